"""Bags of raw 64-bit ids: `RaggedKeys`, a `jaxembed.Ragged` whose values are keys.

A dynamic table's feature may take bags of varying length, as a static table's takes a
`jaxembed.Ragged`: flat ids `[*lead, N]` and bag lengths `[*lead, B]`. The ids of a dynamic
table are raw 64-bit values, which travel as keys `uint32[..., 2]` (`jaxembed.dynamic.keys`),
so `RaggedKeys` holds `keys [*lead, N, 2]` where a `Ragged` holds `values [*lead, N]`.

Once the remap has turned every key into a row (or into "no row", -1), `to_ragged` gives the
`Ragged` the static path reads: the slots without a row are dropped from their bags (their
bag's length shrinks), which is what a no-row id is everywhere else: it reads nothing, gets
no gradient, and a bag's `mean` and `sqrtn` do not count it. Slots past a block's total are
ignored by both: `in_bag_keys` makes them `EMPTY_ID` before the remap sees them, so they are
never counted for admission.

| step | form |
|---|---|
| the input | `RaggedKeys(keys [*lead, N, 2], lengths [*lead, B], weights [*lead, N]?)` |
| the remap sees (`in_bag_keys`) | the keys, `EMPTY_ID` past each block's total |
| the lookup reads (`to_ragged`) | `Ragged(rows [*lead, N], lengths [*lead, B], weights?)`, |
| | the slots without a row dropped from their bags |

Examples:
  >>> r = RaggedKeys.from_lists([[2**40, 7], [], [7]])
  >>> r
  RaggedKeys(num_bags=3, capacity=3, lead_shape=())
  >>> r.lengths.tolist(), to_uint64(r.keys).tolist()[:2]
  ([2, 0, 1], [1099511627776, 7])
  >>> to_ragged(r, jnp.array([5, -1, 0])).to_lists()     # the second id has no row
  [[5], [], [0]]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxembed.dynamic.keys import EMPTY_HALF, as_keys, keys_to_host, to_uint64
from jaxembed.ids import as_ids
from jaxembed.ragged import Ragged, RaggedBase, segments_from_lengths

__all__ = ["RaggedKeys", "in_bag_keys", "to_ragged"]


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class RaggedKeys(RaggedBase):
    """A batch of bags of raw 64-bit ids as flat keys and bag lengths (a jittable pytree).

    Attributes:
      keys: the ids as keys `uint32[*lead, N, 2]` (any form `jaxembed.dynamic.as_keys` takes:
        numpy int64 / uint64 `[*lead, N]` on the host, uint32 pairs, int64 under x64).
        `EMPTY_ID` in a bag is an empty slot (it reads nothing).
      lengths: int bag lengths `[*lead, B]`.
      weights: float per-id weights `[*lead, N]`, or None.

    Raises:
      TypeError: ids that are not 64-bit ids (as `as_keys`), float lengths, integer weights.
      ValueError: shapes that do not match; with concrete lengths, a negative length or
        lengths that sum past the capacity.
    """

    keys: jax.Array
    lengths: jax.Array
    weights: jax.Array | None = None

    _SLOTS = "keys"
    _SLOT_DIMS = 1  # a key is a uint32 pair

    def __post_init__(self):
        keys = as_keys(self.keys, "values", check=False)  # EMPTY_ID: an empty slot
        lengths = as_ids(self.lengths, "lengths")
        # the checks of a Ragged of the same shapes (values stand in for the keys)
        Ragged(jnp.zeros(keys.shape[:-1], jnp.int32), lengths, self.weights)
        weights = self.weights
        if weights is not None and not isinstance(weights, jax.Array | jax.core.Tracer):
            weights = jnp.asarray(weights)
        object.__setattr__(self, "keys", keys)
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "weights", weights)

    def __repr__(self) -> str:
        if getattr(self.keys, "shape", None) is None:
            return "RaggedKeys(<placeholder>)"
        weighted = ", weighted" if self.weights is not None else ""
        return (
            f"RaggedKeys(num_bags={self.num_bags}, capacity={self.capacity}, "
            f"lead_shape={self.lead_shape}{weighted})"
        )

    @classmethod
    def from_lists(
        cls,
        bags: Sequence[Sequence[int]],
        *,
        capacity: int | None = None,
        weights: Sequence[Sequence[float]] | None = None,
        blocks: int | None = None,
    ) -> RaggedKeys:
        """Packs Python lists of raw ids (any value in `[-2**63, 2**64)`), one list per bag,
        as `jaxembed.Ragged.from_lists` packs int32 ids; unused slots hold `EMPTY_ID`.

        Raises:
          TypeError, ValueError: ids that are not 64-bit integers (naming the bag), and as
            `Ragged.from_lists` for the shapes.
        """
        keys = [keys_to_host(b, f"bag {i}", check=False).reshape(-1, 2) for i, b in
                enumerate(bags)]  # fmt: skip
        # the layout (lengths, which slots, weights) is a Ragged's of slot indices
        index, start = [], 0
        for k in keys:
            index.append(list(range(start, start + k.shape[0])))
            start += k.shape[0]
        slots = Ragged.from_lists(index, capacity=capacity, weights=weights, blocks=blocks)
        flat = np.concatenate([np.zeros((0, 2), np.uint32), *keys])
        packed = np.full((*slots.values.shape, 2), EMPTY_HALF, np.uint32)
        in_bag = np.asarray(segments_from_lengths(slots.lengths, slots.capacity)) >= 0
        packed[in_bag] = flat[np.asarray(slots.values)[in_bag]]
        return cls(jnp.asarray(packed), slots.lengths, slots.weights)

    def to_lists(self) -> list[list[int]]:
        """The bags as lists of uint64 ids (lead blocks one after another)."""
        keys = np.asarray(self.keys).reshape(-1, self.capacity, 2)
        lengths = np.asarray(self.lengths).reshape(-1, self.num_bags)
        out = []
        for block, lens in zip(keys, lengths, strict=True):
            ends = np.cumsum(np.maximum(lens, 0))
            ids = to_uint64(block).tolist()
            out += [ids[e - n : e] for e, n in zip(ends, np.maximum(lens, 0), strict=True)]
        return out


def in_bag_keys(r: RaggedKeys) -> jax.Array:
    """The keys the remap sees: a bag's keys, and `EMPTY_ID` in the slots past the total (so
    they are never counted for admission). uint32 `[*lead, N, 2]`."""
    in_bag = segments_from_lengths(r.lengths, r.capacity) >= 0  # bool[*lead, N]
    return jnp.where(in_bag[..., None], r.keys, jnp.uint32(EMPTY_HALF))


def to_ragged(r: RaggedKeys, rows: jax.Array) -> Ragged:
    """The `Ragged` of rows the static path reads: each bag's slots that got a row (rows
    int32 `[*lead, N]`, -1: none), in order; a slot without a row leaves its bag.

    # rows, keep, order: [*lead, N]   lengths: [*lead, B]
    """
    lead, n, b = r.lead_shape, r.capacity, r.num_bags
    segments = segments_from_lengths(r.lengths, n)  # i32[*lead, N], -1 past the total
    keep = (segments >= 0) & (rows >= 0)
    order = jnp.argsort(~keep, axis=-1, stable=True)  # kept slots first, in bag order
    values = jnp.take_along_axis(jnp.where(keep, rows, 0), order, axis=-1).astype(jnp.int32)
    m = math.prod(lead)

    def count(seg, k):  # i32[N], bool[N] -> i32[B]: each bag's slots with a row
        return jnp.zeros((b,), jnp.int32).at[jnp.where(k, seg, b)].add(1, mode="drop")

    lengths = jax.vmap(count)(segments.reshape(m, n), keep.reshape(m, n)).reshape(*lead, b)
    weights = r.weights
    if weights is not None:
        weights = jnp.take_along_axis(jnp.where(keep, weights, 0), order, axis=-1)
    return Ragged(values, lengths.astype(r.lengths.dtype), weights)
