"""Batches of bags: the `Ragged` input and `BagBatch`, the canonical form the bag kernels read.

A *bag* is the ids of one feature of one example, pooled into one vector by a combiner. Users
hand bags to `jaxembed.embedding_bag` in one of three forms; `to_bag_batch` turns each into
the same canonical `BagBatch` (ids, the bag index of every slot, per-id weights), with pure
`jnp` code and static shapes, so it runs under `jit` and inside a `shard_map` body on each
device's local block alike.

| form | inputs | bag b (of lead element i) | output |
|---|---|---|---|
| dense | `x [*batch, L]` | the row `x[*batch, :]`; negative ids are empty slots | `[*batch, H]` |
| lengths | `x`, `lengths [*lead, B]` | the next `lengths[i, b]` ids | `[*lead, B, H]` |
| offsets | `x`, `offsets [*lead, B]` | `x[i, o[b]:o[b+1]]`, the last bag to N | `[*lead, B, H]` |
| offsets, include last | `x`, `offsets [*lead, B+1]` | `x[i, o[b]:o[b+1]]` | `[*lead, B, H]` |

In the flat forms `x` is `[*lead, N]` and `o = offsets[i]`. N is a static capacity: ids past
the bags' total are ignored. Leading dims are independent blocks (e.g. one per data-parallel
shard): nothing crosses them. With w the per-id weights
(1 when none) over the ids of the bag that read a row (in range, not `padding_idx`):

| combiner | pooled bag | empty bag |
|---|---|---|
| `sum` | Σ wᵢ eᵢ | 0 |
| `mean` | Σ wᵢ eᵢ / Σ wᵢ (unweighted: the mean over the ids that read a row) | 0 |
| `sqrtn` | Σ wᵢ eᵢ / √(Σ wᵢ²) | 0 |
| `max` | element-wise max (no weights); the gradient goes to the earliest max slot | 0 |

`bag_scales` gives the factor of every slot, so sum, mean and sqrtn are one weighted
segment sum. Doctests:

    >>> import jax.numpy as jnp
    >>> batch = to_bag_batch(jnp.array([4, 2, 2, 7, 0]), lengths=jnp.array([2, 0, 2]))
    >>> batch.segments.tolist(), batch.num_bags      # slot 4 is past the bags' total
    ([0, 0, 2, 2, -1], 3)
    >>> bag_scales(batch.ids >= 0, batch.segments, None, 3, "mean").tolist()
    [0.5, 0.5, 0.5, 0.5, 0.0]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxembed.ids import as_ids, check_ids_fit
from jaxembed.ids import concrete as _concrete

__all__ = [
    "COMBINERS",
    "BagBatch",
    "Ragged",
    "bag_counts",
    "bag_scales",
    "check_bag_ids",
    "check_weights_allowed",
    "global_segments",
    "lengths_from_offsets",
    "running_sum",
    "segments_from_lengths",
    "to_bag_batch",
    "valid_slots",
]

COMBINERS = ("sum", "mean", "sqrtn", "max")


def check_weights_allowed(combiner: str | None, weighted: bool, where: str = "") -> None:
    """Raises for per-id weights on a max-pooled bag (a maximum is not weighted); messages
    start with `where` (a collection names the feature and table there)."""
    if combiner == "max" and weighted:
        raise ValueError(
            f"{where}per_id_weights cannot be used with combiner='max' (a maximum is not "
            "weighted): drop the weights, or use 'sum', 'mean' or 'sqrtn'"
        )


def _at(name: str, index: tuple[int, ...]) -> str:
    return f"{name}[{', '.join(str(int(i)) for i in index)}]"


def _check_floats(x: Any, what: str) -> None:
    """Raises for weights that are not floats (ids, lengths and offsets: `jaxembed.ids`)."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{what} must be floats, got {x.dtype} of shape {x.shape}: cast them with "
            f"{what}.astype(jnp.float32)"
        )


def _check_flat(x: Any, sizes: Any, what: str) -> None:
    """Static checks of the flat forms: x [*lead, N] and lengths / offsets [*lead, B]."""
    if x.ndim < 1 or sizes.ndim < 1:
        raise ValueError(
            f"the flat form needs x [*lead, N] and {what} [*lead, B] of rank >= 1: got x "
            f"{x.shape}, {what} {sizes.shape}"
        )
    if sizes.shape[:-1] != x.shape[:-1]:
        raise ValueError(
            f"{what} {sizes.shape} must have x's leading dims {x.shape[:-1]}: x is [*lead, N] "
            f"= {x.shape} and {what} [*lead, B]; reshape {what} to "
            f"{(*x.shape[:-1], sizes.shape[-1])}"
        )


def _check_lengths_values(lengths: np.ndarray, capacity: int) -> None:
    if (lengths < 0).any():
        idx = tuple(np.argwhere(lengths < 0)[0])
        raise ValueError(
            f"lengths must be >= 0, got {_at('lengths', idx)} = {lengths[idx]} (under jit a "
            "negative length counts as 0): pass np.maximum(lengths, 0) for empty bags"
        )
    totals = lengths.astype(np.int64).sum(axis=-1)
    if (totals > capacity).any():
        idx = tuple(int(i) for i in np.argwhere(totals > capacity)[0])
        block = f"the bags of lead element {idx}" if idx else "the bags"
        raise ValueError(
            f"{block} hold {totals[idx]} ids but x's capacity (last axis) is {capacity}: pad "
            f"x to at least {totals[idx]} ids (ids past the total are ignored) or shorten the "
            "bags; under jit, ids past the capacity are dropped"
        )


def _check_offsets_values(offsets: np.ndarray, capacity: int, include_last: bool) -> None:
    if offsets.shape[-1] and (offsets[..., 0] != 0).any():
        idx = (*np.argwhere(offsets[..., 0] != 0)[0], 0)
        raise ValueError(
            f"the first bag must start at 0 (as in PyTorch), got {_at('offsets', idx)} = "
            f"{offsets[idx]}; under jit the first bag starts at 0 whatever it says"
        )
    drops = offsets[..., 1:] < offsets[..., :-1]
    if drops.any():
        idx = tuple(np.argwhere(drops)[0])
        prev, here = (*idx[:-1], idx[-1]), (*idx[:-1], idx[-1] + 1)
        raise ValueError(
            f"offsets must be non-decreasing: {_at('offsets', prev)} = {offsets[prev]} > "
            f"{_at('offsets', here)} = {offsets[here]}; an empty bag repeats the previous offset"
        )
    if (offsets > capacity).any():
        idx = tuple(np.argwhere(offsets > capacity)[0])
        is_end = include_last and idx[-1] == offsets.shape[-1] - 1
        last = " (the end of the last bag)" if is_end else ""
        raise ValueError(
            f"{_at('offsets', idx)} = {offsets[idx]}{last} is past the end of x (capacity "
            f"{capacity}): offsets must lie in [0, {capacity}]"
        )


class RaggedBase:
    """What a batch of bags as flat slots and bag lengths shares: `Ragged` (ids) and
    `jaxembed.dynamic.RaggedKeys` (64-bit ids as uint32 pairs). A pytree of its slots,
    `lengths` and `weights`; the static facts its shapes give.

    A subclass names its slots' field (`_SLOTS`) and how many trailing dims one slot has
    (`_SLOT_DIMS`: 0 for an int id, 1 for a key's pair), and is a frozen dataclass of those
    three fields, registered as a pytree.
    """

    _SLOTS = "values"
    _SLOT_DIMS = 0

    def tree_flatten(self):
        return (getattr(self, self._SLOTS), self.lengths, self.weights), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        del aux
        obj = object.__new__(cls)  # leaves may be tracers or placeholders: no checks
        for name, child in zip((cls._SLOTS, "lengths", "weights"), children, strict=True):
            object.__setattr__(obj, name, child)
        return obj

    @property
    def num_bags(self) -> int:
        """B: the bags per lead element (static)."""
        return self.lengths.shape[-1]

    @property
    def capacity(self) -> int:
        """N: the id slots per lead element (static)."""
        return getattr(self, self._SLOTS).shape[-1 - self._SLOT_DIMS]

    @property
    def lead_shape(self) -> tuple[int, ...]:
        """The leading (independent block) dims."""
        return tuple(getattr(self, self._SLOTS).shape[: -1 - self._SLOT_DIMS])


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Ragged(RaggedBase):
    """A batch of bags as flat ids and bag lengths: one feature of TorchRec's KeyedJaggedTensor.

    Leading dims are independent blocks (e.g. one per data-parallel shard), each with its own
    capacity N of slots; ids past a block's total length are ignored. A jittable pytree: its
    leaves are `values`, `lengths` and `weights`.

    Attributes:
      values: int ids `[*lead, N]`.
      lengths: int bag lengths `[*lead, B]`.
      weights: float per-id weights `[*lead, N]`, or None.

    Raises:
      TypeError: float ids or lengths, integer weights.
      ValueError: shapes that do not match; with concrete arrays, a negative length or
        lengths that sum past the capacity.

    Examples:
      >>> r = Ragged.from_lists([[3, 1], [], [4, 1, 5]])
      >>> r
      Ragged(num_bags=3, capacity=5, lead_shape=(), values=int32)
      >>> r.values.tolist(), r.lengths.tolist()
      ([3, 1, 4, 1, 5], [2, 0, 3])
      >>> jax.jit(lambda r: r)(r).to_lists()           # a pytree: it goes through jit
      [[3, 1], [], [4, 1, 5]]
    """

    values: jax.Array
    lengths: jax.Array
    weights: jax.Array | None = None

    _SLOTS = "values"

    def __post_init__(self):
        values, lengths = as_ids(self.values, "values"), as_ids(self.lengths, "lengths")
        weights = self.weights
        if weights is not None and not isinstance(weights, jax.Array | jax.core.Tracer):
            weights = jnp.asarray(weights)
        _check_flat(values, lengths, "lengths")
        if weights is not None:
            _check_floats(weights, "weights")
            if weights.shape != values.shape:
                raise ValueError(
                    f"weights {weights.shape} must have the shape of values {values.shape}: "
                    "one weight per id slot"
                )
        concrete = _concrete(lengths)
        if concrete is not None:
            _check_lengths_values(concrete, values.shape[-1])
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "weights", weights)

    def __repr__(self) -> str:
        shape = getattr(self.values, "shape", None)
        if shape is None:
            return "Ragged(<placeholder>)"
        weighted = ", weighted" if self.weights is not None else ""
        return (
            f"Ragged(num_bags={self.num_bags}, capacity={self.capacity}, "
            f"lead_shape={self.lead_shape}, values={self.values.dtype}{weighted})"
        )

    @classmethod
    def from_lists(
        cls,
        bags: Sequence[Sequence[int]],
        *,
        capacity: int | None = None,
        weights: Sequence[Sequence[float]] | None = None,
        blocks: int | None = None,
        dtype: Any = np.int32,
    ) -> Ragged:
        """Packs Python lists of ids, one list per bag.

        Args:
          bags: the bags in order; with `blocks`, block i holds the i-th run of
            `len(bags) // blocks` bags.
          capacity: N, the slots per block; default the longest block's total. Unused slots
            hold id 0 (and weight 0): they are past the total, so they are ignored.
          weights: per-id weights, one list per bag, shaped like `bags`.
          blocks: split the bags into this many equal lead blocks (`lead_shape == (blocks,)`),
            each packed from slot 0; None for no lead dim.
          dtype: the integer dtype of values and lengths.

        Returns:
          A concrete `Ragged`.

        Raises:
          ValueError: bags that do not split into `blocks`, a block longer than `capacity`,
            weights not shaped like the bags, non-integer ids.

        Examples:
          >>> r = Ragged.from_lists([[1], [2, 3], [], [4]], blocks=2)
          >>> r.values.tolist(), r.lengths.tolist(), r.lead_shape
          ([[1, 2, 3], [4, 0, 0]], [[1, 2], [0, 1]], (2,))
        """
        bags = [np.asarray(b).reshape(-1) for b in bags]
        for i, b in enumerate(bags):
            if b.size and not np.issubdtype(b.dtype, np.integer):
                raise TypeError(f"bag {i} holds non-integer ids {b.tolist()}: ids are ints")
            if b.size:
                check_ids_fit(b, f"bag {i}")  # before they are packed into `dtype`
        if weights is not None:
            weights = [np.asarray(w, np.float32).reshape(-1) for w in weights]
            if len(weights) != len(bags) or any(
                w.size != b.size for w, b in zip(weights, bags, strict=False)
            ):
                raise ValueError(
                    f"weights must hold one list per bag, as long as the bag: bag lengths "
                    f"{[b.size for b in bags]}, weight lengths {[w.size for w in weights]}"
                )
        k = 1 if blocks is None else int(blocks)
        if k < 1 or len(bags) % k:
            raise ValueError(
                f"{len(bags)} bags do not split into blocks={blocks} equal blocks: pass a "
                f"divisor of {len(bags)}, or pad with empty bags to a multiple of {blocks}"
            )
        per = len(bags) // k
        totals = [sum(b.size for b in bags[i * per : (i + 1) * per]) for i in range(k)]
        cap = max(totals, default=0) if capacity is None else int(capacity)
        if max(totals, default=0) > cap:
            i = int(np.argmax(totals))
            raise ValueError(
                f"block {i} holds {totals[i]} ids, past capacity={cap}: pass capacity >= "
                f"{max(totals)} or leave it None"
            )
        values = np.zeros((k, cap), dtype)
        lengths = np.zeros((k, per), dtype)
        w = np.zeros((k, cap), np.float32) if weights is not None else None
        for i in range(k):
            block = bags[i * per : (i + 1) * per]
            lengths[i] = [b.size for b in block]
            if block:
                values[i, : totals[i]] = np.concatenate(block)
            if w is not None and block:
                w[i, : totals[i]] = np.concatenate(weights[i * per : (i + 1) * per])
        if blocks is None:
            values, lengths, w = values[0], lengths[0], None if w is None else w[0]
        return cls(jnp.asarray(values), jnp.asarray(lengths), None if w is None else jnp.asarray(w))

    @classmethod
    def from_offsets(
        cls,
        values: jax.Array,
        offsets: jax.Array,
        *,
        include_last_offset: bool = False,
        weights: jax.Array | None = None,
    ) -> Ragged:
        """From flat ids and bag starts, as `torch.nn.functional.embedding_bag` takes them.

        Args:
          values: int ids `[*lead, N]`.
          offsets: the bags' starts `[*lead, B]` (the last bag runs to N), or `[*lead, B+1]`
            with `include_last_offset` (the last entry ends the last bag).
          include_last_offset: as PyTorch's.
          weights: per-id weights `[*lead, N]`, or None.

        Returns:
          A `Ragged` with `lengths` from `lengths_from_offsets`.

        Raises:
          ValueError: with concrete offsets, a first offset not 0, decreasing offsets,
            offsets past N; shapes that do not match.

        Examples:
          >>> r = Ragged.from_offsets(jnp.array([5, 6, 7, 8]), jnp.array([0, 1, 1]))
          >>> r.lengths.tolist(), r.to_lists()
          ([1, 0, 3], [[5], [], [6, 7, 8]])
        """
        values, offsets = as_ids(values, "values"), as_ids(offsets, "offsets")
        lengths = _lengths_of_offsets(values, offsets, include_last_offset)
        return cls(values, lengths, weights)

    def to_lists(self, *, with_weights: bool = False) -> Any:
        """The bags as Python lists, in lead-major order (concrete arrays only).

        Args:
          with_weights: also return the weights, one list per bag.

        Returns:
          `bags`, or `(bags, weights)` when `with_weights`.

        Raises:
          ValueError: called on traced arrays (inside `jit`).

        Examples:
          >>> Ragged.from_lists([[1, 2], [3]], weights=[[0.5, 1.0], [2.0]]).to_lists(
          ...     with_weights=True)
          ([[1, 2], [3]], [[0.5, 1.0], [2.0]])
        """
        values, lengths = _concrete(self.values), _concrete(self.lengths)
        if values is None or lengths is None:
            raise ValueError("to_lists() needs concrete arrays: call it outside jax.jit")
        weights = None if self.weights is None else np.asarray(self.weights)
        size, n = math.prod(values.shape[:-1]), values.shape[-1]
        values = values.reshape(size, n)
        lengths = np.maximum(lengths.reshape(size, lengths.shape[-1]), 0)
        if weights is not None:
            weights = weights.reshape(size, n)
        bags, bag_weights = [], []
        for i in range(values.shape[0]):
            ends = np.minimum(np.cumsum(lengths[i]), n)
            starts = np.concatenate([[0], ends[:-1]]).astype(int)
            for s, e in zip(starts, ends, strict=True):
                bags.append(values[i, s:e].tolist())
                if weights is not None:
                    bag_weights.append(weights[i, s:e].tolist())
        if with_weights:
            return bags, (bag_weights if weights is not None else None)
        return bags


# --- the canonical form ---------------------------------------------------------------------


class BagBatch(NamedTuple):
    """A batch of bags in the form the kernels read; every input form becomes one.

    Attributes:
      ids: int32 `[*lead, N]`, the ids of every slot.
      segments: int32 `[*lead, N]`, the bag of every slot in `[0, num_bags)`, or -1 for
        a slot in no bag (past the total, or a negative id of the dense form).
      weights: float32 `[*lead, N]` per-id weights, or None.
      num_bags: B, the bags per lead element (static); 1 for the dense form.
      dense: True for the dense form, whose output is `[*lead, H]` (not `[*lead, 1, H]`).
    """

    ids: jax.Array
    segments: jax.Array
    weights: jax.Array | None
    num_bags: int
    dense: bool


def running_sum(x: jax.Array, axis: int = -1, dtype: Any = None) -> jax.Array:
    """`jnp.cumsum(x, axis, dtype)` as a parallel prefix (`jax.lax.associative_scan`).

    XLA:CPU lowers `cumsum` to a `reduce-window` that took 10-17 ms over the 835k slots of a
    16384-bag batch here; the scan takes 3 ms (2-5x at every size measured, 1e3 to 1e6).
    Integer sums are the same numbers; float sums may round differently (another order).

    Examples:
      >>> running_sum(jnp.array([1, 0, 2, 3])).tolist()
      [1, 1, 3, 6]
    """
    x = jnp.asarray(x)
    if dtype is not None:
        x = x.astype(dtype)
    elif x.dtype == jnp.bool_:
        x = x.astype(jnp.int32)
    n = x.shape[axis]
    if not isinstance(n, int):  # a symbolic dimension (jax.export): the scan needs its size
        return jnp.cumsum(x, axis=axis)
    return x if n <= 1 else jax.lax.associative_scan(jnp.add, x, axis=axis)


def segments_from_lengths(lengths: jax.Array, capacity: int) -> jax.Array:
    """The bag index of every slot of a flat block, from the bags' lengths (jit-safe).

    Negative lengths count as 0; slots past the total (and past the capacity) are -1.
    O(N + B) per lead element: a scatter of the bags' ends, then a cumulative sum.

    Args:
      lengths: int `[*lead, B]`.
      capacity: N, the slots per lead element.

    Returns:
      int32 `[*lead, N]`.

    Examples:
      >>> segments_from_lengths(jnp.array([[1, 2], [0, 9]]), 4).tolist()
      [[0, 1, 1, -1], [1, 1, 1, 1]]
    """
    lengths = jnp.asarray(lengths)
    lead, num_bags = lengths.shape[:-1], lengths.shape[-1]
    clamped = jnp.clip(lengths, 0, capacity).astype(jnp.int32)
    ends = running_sum(clamped, axis=-1).reshape(math.prod(lead), num_bags)  # i32[M, B]

    def bag_of_slots(ends):  # ends: i32[B] -> i32[N]
        # marks[n]: how many bags end at slot n; their running sum is the bag of slot n.
        marks = jnp.zeros((capacity,), jnp.int32).at[ends].add(1, mode="drop")
        return running_sum(marks)

    segments = jax.vmap(bag_of_slots)(ends)  # i32[M, N]
    segments = jnp.where(segments < num_bags, segments, -1)
    return segments.reshape(*lead, capacity)


def lengths_from_offsets(
    offsets: jax.Array, capacity: int, *, include_last_offset: bool = False
) -> jax.Array:
    """Bag lengths from bag starts (jit-safe), as PyTorch's `offsets`.

    Offsets are clamped to `[0, capacity]` and made non-decreasing (a running max); the
    first bag starts at 0. Without `include_last_offset` the last bag runs to `capacity`; with
    it, the last offset ends the last bag and later ids are ignored (PyTorch requires it to be
    N, and its CPU kernel then runs the last bag to N whatever it says: the same when it is).

    Args:
      offsets: int `[*lead, B]`, or `[*lead, B+1]` with `include_last_offset`.
      capacity: N, the slots per lead element.
      include_last_offset: the last offset ends the last bag.

    Returns:
      int32 `[*lead, B]`.

    Examples:
      >>> lengths_from_offsets(jnp.array([0, 2, 2]), 5).tolist()
      [2, 0, 3]
      >>> lengths_from_offsets(jnp.array([0, 2, 2, 4]), 5, include_last_offset=True).tolist()
      [2, 0, 2]
    """
    offsets = jnp.clip(as_ids(offsets, "offsets"), 0, capacity).astype(jnp.int32)
    offsets = offsets.at[..., :1].set(0)
    if offsets.shape[-1]:
        offsets = jax.lax.cummax(offsets, axis=offsets.ndim - 1)
    if include_last_offset:
        return offsets[..., 1:] - offsets[..., :-1]
    ends = jnp.full((*offsets.shape[:-1], 1), capacity, jnp.int32)
    return jnp.concatenate([offsets[..., 1:], ends], axis=-1) - offsets


def _lengths_of_offsets(x: jax.Array, offsets: jax.Array, include_last: bool) -> jax.Array:
    _check_flat(x, offsets, "offsets")
    if include_last and offsets.shape[-1] < 1:
        raise ValueError(
            f"include_last_offset=True needs offsets [*lead, B+1] with at least one entry, "
            f"got offsets {offsets.shape}"
        )
    concrete = _concrete(offsets)
    if concrete is not None:
        _check_offsets_values(concrete, x.shape[-1], include_last)
    return lengths_from_offsets(offsets, x.shape[-1], include_last_offset=include_last)


def to_bag_batch(
    x: jax.Array | Ragged,
    *,
    lengths: jax.Array | None = None,
    offsets: jax.Array | None = None,
    per_id_weights: jax.Array | None = None,
    include_last_offset: bool = False,
) -> BagBatch:
    """The canonical `BagBatch` of any input form (pure jnp; works on a local block).

    Shapes and dtypes are always checked; values only when concrete (outside `jit`).

    Args:
      x: ids: dense `[*batch, L]` (no lengths or offsets), flat `[*lead, N]`, or a `Ragged`.
      lengths: int `[*lead, B]`: bag b is the next `lengths[..., b]` ids.
      offsets: int `[*lead, B]` bag starts, or `[*lead, B+1]` with `include_last_offset`.
      per_id_weights: float, shaped like x.
      include_last_offset: as PyTorch's; only with `offsets`.

    Returns:
      `BagBatch(ids, segments, weights, num_bags, dense)`.

    Raises:
      TypeError: float ids, lengths or offsets; integer weights.
      ValueError: both lengths and offsets; ranks or shapes that do not match; with
        concrete values: a negative length, lengths past the capacity, offsets that
        decrease, pass N or do not start at 0. Each names the first bad value and index.

    Examples:
      >>> b = to_bag_batch(jnp.array([[3, -1, 4], [-1, -1, -1]]))     # dense: 2 bags
      >>> b.segments.tolist(), b.num_bags, b.dense
      ([[0, -1, 0], [-1, -1, -1]], 1, True)
      >>> to_bag_batch(jnp.array([1, 2, 3]), offsets=jnp.array([0, 1, 3]),
      ...              include_last_offset=True).segments.tolist()
      [0, 1, 1]
      >>> to_bag_batch(jnp.array([1, 2]), lengths=jnp.array([3]))
      Traceback (most recent call last):
        ...
      ValueError: the bags hold 3 ids but x's capacity (last axis) is 2: pad x to at least 3
      ids (ids past the total are ignored) or shorten the bags; under jit, ids past the
      capacity are dropped
    """
    if isinstance(x, Ragged):
        if lengths is not None or offsets is not None:
            raise ValueError("a Ragged carries its own lengths: pass no lengths or offsets")
        if per_id_weights is not None and x.weights is not None:
            raise ValueError("the Ragged has weights already: pass per_id_weights=None")
        if x.weights is not None:
            per_id_weights = x.weights
        x, lengths = x.values, x.lengths
    x = as_ids(x)
    if lengths is not None and offsets is not None:
        raise ValueError("pass lengths or offsets, not both: they say the same thing")
    if include_last_offset and offsets is None:
        raise ValueError("include_last_offset=True needs offsets: it says how to read them")
    weights = None
    if per_id_weights is not None:
        weights = jnp.asarray(per_id_weights)
        _check_floats(weights, "per_id_weights")
        if weights.shape != x.shape:
            raise ValueError(
                f"per_id_weights {weights.shape} must have the shape of x {x.shape}: one "
                "weight per id"
            )
        weights = weights.astype(jnp.float32)
    ids = x.astype(jnp.int32)
    if lengths is None and offsets is None:
        if x.ndim < 1:
            raise ValueError(f"dense ids are [*batch, L], rank >= 1: got a scalar {x.shape}")
        segments = jnp.where(ids >= 0, 0, -1).astype(jnp.int32)
        return BagBatch(ids, segments, weights, 1, True)
    if offsets is not None:
        lengths = _lengths_of_offsets(x, as_ids(offsets, "offsets"), include_last_offset)
    else:
        lengths = as_ids(lengths, "lengths")
        _check_flat(x, lengths, "lengths")
        concrete = _concrete(lengths)
        if concrete is not None:
            _check_lengths_values(concrete, x.shape[-1])
    segments = segments_from_lengths(lengths, x.shape[-1])
    return BagBatch(ids, segments, weights, lengths.shape[-1], False)


# --- per-slot factors: what every combiner needs ---------------------------------------------


def valid_slots(batch: BagBatch, vocab_size: int, padding_idx: int | None = None) -> jax.Array:
    """Whether each slot reads a table row: in a bag, in `[0, vocab_size)`, not `padding_idx`.

    In a row-split table pass the whole vocabulary, not the shard's rows: a bag's mean and
    sqrtn count every id that reads a row, wherever the row lives.

    Args:
      batch: the canonical batch.
      vocab_size: the real rows of the table.
      padding_idx: an id that reads nothing and is not counted, or None.

    Returns:
      bool `[*lead, N]`.

    Examples:
      >>> b = to_bag_batch(jnp.array([0, 9, 2, -3, 1]), lengths=jnp.array([4]))
      >>> valid_slots(b, vocab_size=5, padding_idx=2).tolist()
      [True, False, False, False, False]
    """
    valid = (batch.segments >= 0) & (batch.ids >= 0) & (batch.ids < vocab_size)
    if padding_idx is not None:
        valid &= batch.ids != padding_idx
    return valid


def global_segments(segments: jax.Array, num_bags: int) -> jax.Array:
    """Bag indices unique across the lead: `lead_index * num_bags + bag` (for segment ops).

    Slots in no bag (`segments < 0`) get `M * num_bags` (M the lead's size), one past the
    last segment, which `jax.ops.segment_sum` and friends drop.

    Args:
      segments: int `[*lead, N]`, as in `BagBatch`.
      num_bags: B.

    Returns:
      int32 `[*lead, N]` in `[0, M * B]`.

    Examples:
      >>> global_segments(jnp.array([[0, 1, -1], [1, 1, 0]]), 2).tolist()
      [[0, 1, 4], [3, 3, 2]]
    """
    segments = jnp.asarray(segments)
    size = math.prod(segments.shape[:-1])
    flat = segments.reshape(size, segments.shape[-1]).astype(jnp.int32)
    base = jnp.arange(size, dtype=jnp.int32)[:, None] * num_bags
    out = jnp.where(flat >= 0, base + flat, size * num_bags)
    return out.reshape(segments.shape)


def _per_bag_sum(values: jax.Array, in_bag: jax.Array, segments: jax.Array, num_bags: int):
    """Σ values over each bag's slots where in_bag, `[M, B]`; and each slot's bag `[M, N]`.

    One `segment_sum` per lead element (vmapped over the flattened lead M, so that a lead
    split over a mesh stays split, in Explicit meshes too); slots out of a bag get index B,
    which `segment_sum` drops.
    """
    size, n = math.prod(segments.shape[:-1]), segments.shape[-1]
    seg = jnp.where(in_bag, segments, num_bags).reshape(size, n).astype(jnp.int32)
    per_bag = functools.partial(jax.ops.segment_sum, num_segments=num_bags)
    return jax.vmap(per_bag)(values.reshape(size, n), seg), seg


def bag_counts(valid: jax.Array, segments: jax.Array, num_bags: int) -> jax.Array:
    """The number of slots of each bag that read a row.

    Args:
      valid: bool `[*lead, N]`, as `valid_slots` returns.
      segments: int `[*lead, N]`.
      num_bags: B.

    Returns:
      int32 `[*lead, B]`.

    Examples:
      >>> b = to_bag_batch(jnp.array([[1, 2, 3], [4, 5, 0]]), lengths=jnp.array([[2, 1], [0, 2]]))
      >>> bag_counts(valid_slots(b, 10), b.segments, b.num_bags).tolist()
      [[2, 1], [0, 2]]
    """
    in_bag = valid & (segments >= 0)
    if num_bags == 0:
        return jnp.zeros((*segments.shape[:-1], 0), jnp.int32)
    counts, _ = _per_bag_sum(in_bag.astype(jnp.int32), in_bag, segments, num_bags)
    return counts.reshape(*segments.shape[:-1], num_bags)


def bag_scales(
    valid: jax.Array,
    segments: jax.Array,
    weights: jax.Array | None,
    num_bags: int,
    combiner: str,
) -> jax.Array:
    """The factor of every slot: the pooled bag is `Σ scale_i * row_i` (sum, mean, sqrtn).

    With w the per-id weights (1 when None) on the slots that read a row: `sum` -> w,
    `mean` -> w / Σw over the bag, `sqrtn` -> w / √(Σw²); `max` -> 1 on the slots that read
    a row (its pooling is a segment max). Other slots, and bags whose Σw is 0, get 0 (no
    NaN, as TensorFlow's `div_no_nan`). A bag's factors need all of its slots: compute them
    where bags are whole (split the lead, not N).

    Args:
      valid: bool `[*lead, N]`: the slot reads a row (see `valid_slots`).
      segments: int `[*lead, N]`: the bag of each slot, -1 for none.
      weights: float `[*lead, N]`, or None.
      num_bags: B.
      combiner: one of `COMBINERS`.

    Returns:
      float32 `[*lead, N]`.

    Raises:
      ValueError: an unknown combiner, or weights with `max`.

    Examples:
      >>> seg = jnp.array([0, 0, 0, 1])
      >>> ok = jnp.array([True, True, False, True])
      >>> bag_scales(ok, seg, None, 3, "mean").tolist()
      [0.5, 0.5, 0.0, 1.0]
      >>> bag_scales(ok, seg, jnp.array([3.0, 4.0, 9.0, 2.0]), 3, "sqrtn").tolist()
      [0.6000000238418579, 0.800000011920929, 0.0, 1.0]
    """
    if combiner not in COMBINERS:
        raise ValueError(f"combiner must be one of {COMBINERS}, got {combiner!r}")
    if combiner == "max" and weights is not None:
        raise ValueError(
            "per-id weights do not apply to combiner='max': pass per_id_weights=None, or "
            "use 'sum', 'mean' or 'sqrtn'"
        )
    in_bag = valid & (segments >= 0)
    w = jnp.ones(segments.shape, jnp.float32) if weights is None else weights
    w = jnp.where(in_bag, w.astype(jnp.float32), 0.0)
    if combiner in ("sum", "max") or w.size == 0 or num_bags == 0:
        return w
    sums, seg = _per_bag_sum(w if combiner == "mean" else w * w, in_bag, segments, num_bags)
    denom = sums if combiner == "mean" else jnp.sqrt(sums)  # f32[M, B]
    per_bag = functools.partial(jnp.take, mode="fill", fill_value=0)
    per_slot = jax.vmap(per_bag)(denom, seg).reshape(w.shape)  # f32[*lead, N]
    nonzero = per_slot != 0
    return jnp.where(nonzero, w / jnp.where(nonzero, per_slot, 1.0), 0.0)


def check_bag_ids(batch: BagBatch, vocab_size: int) -> None:
    """Raises on the first id of a bag outside `[0, vocab_size)`, when the ids are concrete.

    Slots in no bag (past the total, or negative ids of the dense form) are not checked.
    Under `jit` it does nothing: there such ids read nothing and get no gradient.

    Args:
      batch: the canonical batch.
      vocab_size: the real rows of the table.

    Raises:
      ValueError: naming the id, its index in x, its bag and the vocabulary.

    Examples:
      >>> check_bag_ids(to_bag_batch(jnp.array([[1, -1], [2, 3]])), vocab_size=4)
      >>> check_bag_ids(to_bag_batch(jnp.array([1, 7]), lengths=jnp.array([1, 1])), 4)
      Traceback (most recent call last):
        ...
      ValueError: id 7 at x[1] (bag 1) is out of range for a vocabulary of 4 rows (valid ids:
      0 to 3). Under jax.jit such ids read nothing and get no gradient; drop them from the
      bag (or, in the dense form, mark an empty slot with a negative id)
    """
    ids, segments = _concrete(batch.ids), _concrete(batch.segments)
    if ids is None or segments is None:
        return
    bad = (segments >= 0) & ((ids < 0) | (ids >= vocab_size))
    if bad.any():
        idx = tuple(np.argwhere(bad)[0])
        raise ValueError(
            f"id {ids[idx]} at {_at('x', idx)} (bag {segments[idx]}) is out of range for a "
            f"vocabulary of {vocab_size} rows (valid ids: 0 to {vocab_size - 1}). Under jax.jit "
            "such ids read nothing and get no gradient; drop them from the bag (or, in the "
            "dense form, mark an empty slot with a negative id)"
        )
