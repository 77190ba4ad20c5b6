"""A collection's lookup and row-sparse update: one bag lookup per stack and input shape.

`collection_lookup` and `collection_update` execute a `jaxembed.collection.layout`
(`CollectionLayout`) with the bag kernels; the Flax modules
(`jaxembed.nnx.EmbeddingBagCollection`, `jaxembed.flax.EmbeddingBagCollection`) call them.

Per stack, the features whose inputs have the same form are one call of
`jaxembed.embedding_bag`:

* dense inputs `ids [B, L_f]` (negative ids: empty slots), all pooled, of similar widths:
  stacked as `[B, F, L]` (each padded with empty slots to the widest), the dense form, bag
  `(b, f)` is row `(b, f)` (`stacked_width`): no segments to make from lengths, the cheapest
  call;
* other dense inputs, pooled or unpooled: in the flat form, the ids of all of them side by
  side, `[B, ΣL_f]` with `lengths [B, F]` — a pooled feature is one bag of L_f slots per
  example, an unpooled one L_f bags of one slot;
* `Ragged` inputs with the same lead shape: their values side by side, each followed by a
  "gap" bag over its unused slots (ids -1), so that each feature's bags read its own block.

Where some feature of a call is mean- or sqrtn-pooled or carries per-id weights, each slot
carries its feature's combiner as a per-id factor (`jaxembed.ragged.bag_scales`: w, w/Σw or
w/√Σw²), so sum, mean and sqrtn features pool together as one weighted sum. A call of only
unweighted sum (and unpooled) features passes no factors (`needs_factors`): they would be 1
on every slot that reads a row and 0 on the empty ones, which already read nothing (id -1),
and on a sharded batch their `[B, ΣL]` array would be gathered beside the ids.
Max-pooled features make their own call. Ids are first mapped to their stack rows
(`TablePlacement.stack_ids`); ids outside a table's vocabulary read nothing.

**Table-wise.** Under `exchange="auto"` (or `"table"`), the features of a stacked summed call
whose tables are each whole on one shard make a call of their own, run by
`jaxembed.kernels.tablewise`: with the batch split over the stack's row axes, each feature's
ids go to the one device that holds its table, which pools them (and, in the update, updates
them), and the pooled rows come back: `all_to_all`s of `[B, F_o, L]` ids and `[B, F_o, H]`
rows, F_o the most features one device owns, where the gather exchange would send all the
ids to every device and reduce-scatter `[B, F, H]`.

**The ids' layout.** Read from the inputs where they carry it (concrete arrays, an Explicit
mesh), else the collection's `x_sharding`. In an Auto mesh under `jit` a traced input carries
no layout, and the collection's default is the data-parallel one: the batch split over all the
mesh's axes (of size > 1), as far as that divides. That is how `jax.jit(step,
in_shardings=P("x"))` and `examples/train_dlrm.py` lay out a recommender's batch (its dense
part is purely data parallel), whatever axes the tables use; a batch it does not divide warns
once, naming `x_sharding`. On a DLRM-style step (26 tables row-split over `x`, 8 devices, the
batch stated over `x` in `jit`), assuming the batch replicated instead (the rule of a single
`embedding_bag`: the axes the table does not use) moves 1.61x the collective bytes (7.83 MB
against 4.85 MB a step): XLA gathers the ids and factors twice and all-reduces the pooled
output instead of reduce-scattering it. Either wrong guess costs about as much (a batch the
program states replicated, run split: 4.85 MB against 2.98 MB), so the default follows what
such programs state.
On a one-device mesh nothing is assumed: the lookups run unsharded, with no collective.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxembed import ragged
from jaxembed.collection.layout import CollectionLayout, Stack, stacked_width
from jaxembed.ids import as_ids
from jaxembed.kernels import tablewise
from jaxembed.kernels.arrays import (
    assumed_ids_spec,
    layout_known,
    move,
    resolve_mesh,
    spec_of,
    warn_once,
)
from jaxembed.kernels.bag import prepare_bags, run_embedding_bag
from jaxembed.kernels.common import LookupStats, UpdateStats, stats_of
from jaxembed.kernels.options import LookupOptions
from jaxembed.kernels.tables import layout_array

__all__ = [
    "IDS_ADVICE",
    "Group",
    "checked_batch",
    "collection_lookup",
    "collection_update",
    "default_ids_spec",
    "groups_of",
    "needs_factors",
    "stack_exchange",
]


@dataclasses.dataclass(frozen=True)
class Group:
    """One call: features of one stack whose inputs share a form (static description)."""

    stack: int
    kind: str  # "stacked" (ids [B, F, L]), "dense" (ids [B, ΣL_f], lengths [B, F]) or
    # "ragged" (values [*lead, N], lengths [*lead, B])
    combiner: str  # "sum" (sum, mean, sqrtn, unpooled: a sum, weighted where
    # `needs_factors`) or "max"
    features: tuple[str, ...]


def _as_input(feature: str, value: Any, where: str = "") -> tuple[str, Any, Any, Any]:
    """(kind, ids or values, lengths or None, weights or None) of one feature's input, ids
    checked and narrowed as `embedding_bag` reads them (`jaxembed.ids.as_ids`); messages
    start with `where` (default: the feature's name)."""
    where = where or f"feature {feature!r}: "
    if isinstance(value, ragged.Ragged):
        return "ragged", as_ids(value.values, "values", where=where), value.lengths, value.weights
    weights = None
    if isinstance(value, tuple) and len(value) == 2:
        value, weights = value
        weights = weights if isinstance(weights, jax.Array | jax.core.Tracer) else (
            jnp.asarray(weights)
        )  # fmt: skip
        if not jnp.issubdtype(weights.dtype, jnp.floating):
            raise TypeError(
                f"{where}per-id weights must be floats, got {weights.dtype} of "
                f"shape {weights.shape}: cast them with weights.astype(jnp.float32)"
            )
        weights = weights.astype(jnp.float32)
    ids = as_ids(value, where=where)
    if ids.ndim == 1:
        ids = ids[:, None]  # one id per example
        weights = None if weights is None or weights.ndim != 1 else weights[:, None]
    if ids.ndim != 2:
        raise ValueError(
            f"{where}dense ids must be [B] or [B, L], got shape {ids.shape}; "
            "pass a jaxembed.Ragged for bags of varying length"
        )
    if weights is not None and weights.shape != ids.shape:
        raise ValueError(
            f"{where}per-id weights {weights.shape} must have the shape of its "
            f"ids {ids.shape}: one weight per id, as (ids, weights)"
        )
    return "dense", ids, None, weights


def _examples(kind: str, values: Any, lengths: Any) -> int:
    """The examples of one feature's input: B of dense `[B, L]`, `prod(lead)·B` bags of a
    `Ragged` (its output's rows)."""
    if kind == "dense":
        return values.shape[0]
    return math.prod(lengths.shape)


def _check_ids(layout: CollectionLayout, feature: str, value: Any) -> None:
    """Concrete ids outside their table's vocabulary raise (negative dense ids are empty
    slots); under `jit` such ids read nothing and get no gradient."""
    kind, values, lengths, _ = _as_input(feature, value)
    if isinstance(values, jax.core.Tracer) or isinstance(lengths, jax.core.Tracer):
        return
    if isinstance(values, jax.Array) and not values.is_fully_addressable:
        return
    f = {f.name: f for f in layout.features}[feature]
    vocab = layout.table(f.table).vocab_size
    ids = np.asarray(values)
    if kind == "dense":
        bad = ids >= vocab
    else:
        n = ids.shape[-1]
        total = np.minimum(np.maximum(np.asarray(lengths), 0).sum(-1, keepdims=True), n)
        bad = ((ids < 0) | (ids >= vocab)) & (np.arange(n) < total)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"feature {feature!r}: id {int(ids[where])} at {where} is out of range for table "
            f"{f.table!r} of {vocab} rows (valid ids: 0 to {vocab - 1}); under jax.jit such "
            "ids read nothing and get no gradient"
        )


def checked_batch(layout: CollectionLayout, batch: Mapping[str, Any]) -> dict[str, Any]:
    """The collection's inputs, each checked by the rules `embedding_bag` applies (integer
    ids that fit int32, float weights shaped like the ids, no weights on a max-pooled
    feature) with messages naming the feature and its table, and all of one batch size.

    Returns `{feature: input}` with dense ids as int32 jax arrays (other keys are dropped).

    Raises:
      TypeError: float ids, integer weights.
      ValueError: a missing feature, wide or malformed ids, weights with max, features whose
        batch sizes differ.
    """
    missing = [f.name for f in layout.features if f.name not in batch]
    if missing:
        raise ValueError(f"the batch has no input for features {missing} (it has {sorted(batch)})")
    out, sizes = {}, {}
    for f in layout.features:
        where = f"feature {f.name!r} (table {f.table!r}): "
        kind, values, lengths, weights = _as_input(f.name, batch[f.name], where)
        ragged.check_weights_allowed(f.combiner, weights is not None, where)
        if kind == "ragged":
            value = batch[f.name]
            out[f.name] = value if value.values is values else ragged.Ragged(
                values, value.lengths, value.weights
            )  # fmt: skip
        else:
            out[f.name] = values if weights is None else (values, weights)
        sizes[f.name] = _examples(kind, values, lengths)
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{name!r}: {n}" for name, n in sizes.items())
        raise ValueError(
            f"the collection's features have different batch sizes ({listed}): every feature "
            "needs one input per example of the batch (a Ragged: one bag per example, "
            "lead dims included); pad or slice them to one batch size"
        )
    return out


def groups_of(layout: CollectionLayout, batch: Mapping[str, Any]) -> list[Group]:
    """The calls a batch makes, in a fixed order (stack, form, combiner, features)."""
    missing = [f.name for f in layout.features if f.name not in batch]
    if missing:
        raise ValueError(f"the batch has no input for features {missing} (it has {sorted(batch)})")
    keys: dict[tuple, list[str]] = {}
    for f in layout.features:
        kind, values, _, _ = _as_input(f.name, batch[f.name])
        if kind == "ragged" and not f.pooled:
            raise ValueError(
                f"feature {f.name!r} is unpooled (combiner=None) but its input is a Ragged: "
                "give it dense ids [B, L]"
            )
        lead = tuple(values.shape[:-1])
        combiner = "max" if f.combiner == "max" else "sum"
        key = (layout.placement(f.table).stack, kind, lead, combiner)
        keys.setdefault(key, []).append(f.name)
    groups = []
    for (stack, kind, _, combiner), names in keys.items():
        if kind == "dense" and _stackable(layout, batch, names):
            kind = "stacked"
        groups.append(Group(stack, kind, combiner, tuple(names)))
    return groups


def _stackable(layout: CollectionLayout, batch: Mapping[str, Any], names) -> bool:
    """Whether dense pooled features' ids stack as `[B, F, L]` (`stacked_width`)."""
    features = {f.name: f for f in layout.features}
    if not all(features[n].pooled for n in names):
        return False
    return stacked_width([_as_input(n, batch[n])[1].shape[-1] for n in names]) is not None


def needs_factors(layout: CollectionLayout, group: Group, batch: Mapping[str, Any]) -> bool:
    """Whether a call passes per-slot factors: a summed call with a mean or sqrtn feature, or
    a feature whose input carries per-id weights. Without them (only unweighted sum and
    unpooled features, or max) it passes none: an unweighted sum's factor is 1 on the slots
    that read a row and 0 on the others, whose ids (-1) already read nothing."""
    if group.combiner != "sum":
        return False
    features = {f.name: f for f in layout.features}
    return any(
        features[n].combiner in ("mean", "sqrtn") or _as_input(n, batch[n])[3] is not None
        for n in group.features
    )


def _operands(layout: CollectionLayout, group: Group, batch: Mapping[str, Any]):
    """The flat-form operands of one call: ids, lengths, per-slot factors (None where the
    call `needs_factors` none), and how to split its output `[*lead, B_total, dim]` back
    into features."""
    stack = layout.stacks[group.stack]
    features = {f.name: f for f in layout.features}
    if group.kind == "stacked":
        return _stacked_operands(layout, group, batch)
    scaled = needs_factors(layout, group, batch)
    ids, lengths, weights, pieces = [], [], [], []
    bag = 0
    for name in group.features:
        f = features[name]
        _, values, lens, w = _as_input(name, batch[name])
        gid = layout.placement(f.table).stack_ids(values, stack.local_rows)
        valid = gid >= 0
        if group.kind == "dense":  # pooled: one bag of n slots; unpooled: n bags of one
            n = values.shape[-1]
            nbags = 1 if f.pooled else n
            lens = jnp.full((*values.shape[:-1], nbags), n if f.pooled else 1, jnp.int32)
            slot = _positions(values) if not f.pooled else jnp.zeros_like(values, jnp.int32)
            segments = jnp.where(valid, slot, -1)
        else:
            n = values.shape[-1]
            clamped = jnp.diff(
                jnp.minimum(jnp.cumsum(jnp.maximum(lens, 0), axis=-1), n), axis=-1,
                prepend=jnp.zeros_like(lens[..., :1]),
            ).astype(jnp.int32)  # fmt: skip
            total = jnp.sum(clamped, axis=-1, keepdims=True)
            used = _positions(values) < total
            gid = jnp.where(used, gid, -1)
            valid = gid >= 0
            segments = ragged.segments_from_lengths(clamped, n)
            lens = jnp.concatenate([clamped, n - total], axis=-1)  # the gap bag last
            nbags = clamped.shape[-1] + 1
        if scaled:
            scale = ragged.bag_scales(
                valid, jnp.where(valid, segments, -1), w, nbags, f.combiner or "sum"
            )
            weights.append(scale)
        ids.append(gid)
        lengths.append(lens)
        real = nbags - (1 if group.kind == "ragged" else 0)
        pieces.append((name, bag, real, f.pooled))
        bag += nbags
    ids = jnp.concatenate(ids, axis=-1)
    lengths = jnp.concatenate(lengths, axis=-1)
    weights = jnp.concatenate(weights, axis=-1) if weights else None
    # Dense inputs' lengths are constants: tied to the ids, XLA does not constant-fold the
    # bag offsets and segments made from them (a [B, N] cumsum it would evaluate for seconds
    # at compile time).
    ids, lengths = jax.lax.optimization_barrier((ids, lengths))
    return ids, lengths, weights, pieces


def _stacked_operands(layout: CollectionLayout, group: Group, batch: Mapping[str, Any]):
    """The dense-form operands of pooled dense features: ids `[B, F, L]` (each feature's
    `[B, L_f]` padded with empty slots to L = max L_f), its factors (None where the call
    `needs_factors` none), no lengths: bag `(b, f)` is row `(b, f)`, so the call needs no
    segments made from lengths."""
    stack = layout.stacks[group.stack]
    features = {f.name: f for f in layout.features}
    scaled = needs_factors(layout, group, batch)
    width = max(_as_input(n, batch[n])[1].shape[-1] for n in group.features)
    ids, weights, pieces = [], [], []
    for index, name in enumerate(group.features):
        f = features[name]
        _, values, _, w = _as_input(name, batch[name])
        gid = layout.placement(f.table).stack_ids(values, stack.local_rows)
        pad = [(0, 0)] * (gid.ndim - 1) + [(0, width - gid.shape[-1])]
        if scaled:
            valid = gid >= 0
            scale = ragged.bag_scales(valid, jnp.where(valid, 0, -1), w, 1, f.combiner or "sum")
            weights.append(jnp.pad(scale, pad))
        ids.append(jnp.pad(gid, pad, constant_values=-1))
        pieces.append((name, index, 1, True))
    weights = jnp.stack(weights, axis=-2) if weights else None
    return jnp.stack(ids, axis=-2), None, weights, pieces


def _positions(values: jax.Array) -> jax.Array:
    """Each slot's index along the last axis, laid out as `values` (a constant `arange`
    would be replicated, which an Explicit mesh does not mix with a split array)."""
    _, ones = jax.lax.optimization_barrier((values, jnp.ones_like(values, jnp.int32)))
    # not a constant: XLA does not fold it at compile time
    return ragged.running_sum(ones, axis=-1) - 1


def _split(out: jax.Array, pieces, kind: str) -> dict[str, jax.Array]:
    result = {}
    for name, start, count, pooled in pieces:
        block = out[..., start : start + count, :]  # [*lead, count, dim]
        if kind in ("dense", "stacked") and pooled:
            block = block[..., 0, :]  # [B, dim]
        elif kind == "ragged":
            block = block.reshape(-1, block.shape[-1])  # [*lead * B_f, dim]: the blocks in order
        result[name] = block
    return result


def collection_lookup(
    layout: CollectionLayout,
    stacks: Mapping[int, jax.Array],
    batch: Mapping[str, Any],
    *,
    mesh: Any = None,
    x_spec: P | None = None,
    exchange: str = "auto",
    capacity_factor: float | None = None,
    impl: str = "auto",
    return_stats: bool = False,
    routed_pool: str = "auto",
) -> Any:
    """Every feature's output: pooled `[B, dim]` (a `Ragged` input: `[*lead·B, dim]`) or
    unpooled `[B, L, dim]`; with `return_stats`, also each stack's `LookupStats` (its calls'
    counters summed), `(outputs, {stack name: stats})`.

    Args:
      layout: the collection's layout.
      stacks: each stack's physical table, by stack index.
      batch: `{feature: ids [B] | ids [B, L] | (ids, weights) | Ragged}` (other keys, e.g.
        dense features or labels, are left alone).
      mesh: the mesh (default the stacks' own or `jax.set_mesh`'s).
      x_spec: the dense ids' layout where it cannot be read (e.g. `P("data")`).
      exchange, capacity_factor, impl: as in `jaxembed.embedding_bag`, for every call
        (`exchange` may be a mapping from stack index to exchange, e.g. a
        `CollectionPlan.exchanges`, whose routed stacks may say their pooling and capacity
        factor, `"routed:source:0.0794"`: those win over `routed_pool` and
        `capacity_factor` for that stack).
      return_stats: also return each stack's `LookupStats`: the routed exchange's fallback
        and every device's slots walked and rows read, summed over the stack's calls.
      routed_pool: where the routed exchange pools the sum-like calls (`"auto"`, `"source"`,
        `"owner"`; see `jaxembed.plan_embedding_bag`); max-pooled calls pool at the source.
    """
    outputs: dict[str, jax.Array] = {}
    stats: dict[str, LookupStats] = {}
    batch = checked_batch(layout, batch)  # other keys: not ours
    groups = groups_of(layout, batch)
    for name, value in batch.items():
        _check_ids(layout, name, value)
    calls = [
        c for g in groups for c in _calls(layout, g, batch, exchange, mesh, x_spec, stacks[g.stack])
    ]
    for group, owners in calls:
        stack = layout.stacks[group.stack]
        ids, lengths, weights, pieces = _operands(layout, group, batch)
        table = stacks[group.stack]
        where = _where(mesh, table, ids)
        if owners is not None:  # table-wise: each feature pooled by its table's device
            out = tablewise.lookup(table, ids, weights, owners, where, impl=impl,
                                   return_counts=return_stats)  # fmt: skip
            if return_stats:
                out, counts = out
                call_stats = stats_of(jnp.zeros((), jnp.int32), counts)
                stats[stack.name] = _add_stats(stats.get(stack.name), call_stats)
            outputs.update(_split(out, pieces, group.kind))
            continue
        ids_spec = _ids_spec(ids, stack, where, x_spec, warn=True)
        options = LookupOptions(
            vocab_size=stack.shape[0], mesh=mesh, x_spec=ids_spec,
            weight_spec=_weight_spec(stack, where),
            exchange=stack_exchange(exchange, layout, group.stack),
            capacity_factor=_capacity_factor(capacity_factor, exchange, group.stack), impl=impl,
            combiner=group.combiner, check_ids=False,
            function="EmbeddingBagCollection", ids_advice=IDS_ADVICE,
            routed_pool=_routed_pool(routed_pool, group.combiner, exchange, group.stack),
        )  # fmt: skip
        if return_stats:
            options = dataclasses.replace(options, return_stats=True)
        bags = prepare_bags(ids, lengths, None, weights, False, check=False)
        out = run_embedding_bag(bags, table, options)
        if return_stats:
            out, call_stats = out
            stats[stack.name] = _add_stats(stats.get(stack.name), call_stats)
        out = _to_batch_layout(out, stack, where, ids, ids_spec)
        outputs.update(_split(out, pieces, group.kind))
    outputs = {f.name: outputs[f.name] for f in layout.features}
    return (outputs, stats) if return_stats else outputs


def _add_stats(total: LookupStats | None, call: LookupStats) -> LookupStats:
    """A stack's `LookupStats` over its calls: the counters add, a fallback of any counts."""
    if total is None:
        return call
    if total.slots.shape != call.slots.shape:  # one call ran on one device, one did not
        return total._replace(routed_fallback=total.routed_fallback | call.routed_fallback)
    return LookupStats(
        total.routed_fallback | call.routed_fallback,
        total.slots + call.slots, total.rows + call.rows,
    )  # fmt: skip


IDS_ADVICE = "pass x_sharding=PartitionSpec(...) to the EmbeddingBagCollection"
"""How the collection's warnings tell the caller to state the ids' layout."""


def _where(mesh: Any, table: jax.Array, ids: jax.Array) -> Any:
    """The mesh a call runs on; None when there is none or it has one device (then the
    call runs unsharded: nothing to lay out, no collective to emit). A batch of no slot
    keeps its mesh: the kernels answer it with zeros in the output's layout."""
    mesh = resolve_mesh(mesh, layout_array(table), ids)
    if mesh is None or (mesh.size == 1 and ids.size > 0):
        return None
    return mesh


def _weight_spec(stack: Stack, mesh: Any) -> P | None:
    """The stack's layout for the kernels; None on no mesh or one device (`_where`)."""
    return None if mesh is None else stack.spec


def default_ids_spec(shape: tuple[int, ...], mesh: Any) -> P:
    """The collection's default layout for ids whose own it cannot see: the batch (the first
    axis; a flat `Ragged`'s `[N]` values have none) split over all the mesh's axes of size
    > 1, data parallel, as `jax.jit(in_shardings=P(axes))` programs lay it out.

    Examples:
      >>> import jax
      >>> mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
      >>> default_ids_spec((64, 20), mesh)
      P(('data', 'model'), None)
      >>> default_ids_spec((64,), mesh)
      P(None,)
    """
    axes = tuple(a for a, n in zip(mesh.axis_names, mesh.axis_sizes, strict=True) if n > 1)
    if len(shape) < 2 or not axes:
        return P(*(None,) * len(shape))
    return P(axes[0] if len(axes) == 1 else axes, *(None,) * (len(shape) - 1))


def _ids_spec(ids: jax.Array, stack: Stack, mesh: Any, x_spec: P | None, *, warn: bool):
    """The ids' layout to run with: `x_spec` (the collection's `x_sharding`) as given; None
    where the kernels can read it (concrete ids, an Explicit mesh) or there is no mesh to
    lay out on; else the collection's default (`default_ids_spec`), reduced to what divides
    the batch, which warns (with `warn`: the lookup's call, not the update's again)."""
    if mesh is None:
        return None
    if x_spec is not None:
        return _spec(x_spec, ids)
    if layout_known(ids, mesh):
        return None
    wanted = default_ids_spec(tuple(ids.shape), mesh)
    spec = assumed_ids_spec(tuple(ids.shape), mesh, stack.spec, hint=wanted)
    if warn and spec != wanted:
        warn_once(
            "collection-ids-assumed",
            f"EmbeddingBagCollection: the batch of {ids.shape[0]} examples is traced in an Auto "
            f"mesh, where its layout cannot be seen; the collection's default, the batch split "
            f"over all the mesh's axes ({wanted}), does not divide it, so it runs as {spec}. "
            f"To state it: {IDS_ADVICE} (e.g. x_sharding=PartitionSpec('data')), or use an "
            "Explicit mesh.",
        )
    return spec


def _to_batch_layout(out: jax.Array, stack: Stack, mesh: Any, ids, ids_spec: P | None):
    """A columns stack's output `[*lead, bags, dim]` moved to the batch's layout, its dim
    whole, as the other stacks' are, so that a dense model can put them side by side
    (`concat`). XLA reshards it (an all_to_all over the hidden axes, and its transpose for
    the gradient), as `jaxembed.plan_collection` models it."""
    if not stack.hidden_axes or mesh is None:
        return out
    if ids_spec is None:  # read from the ids, as the kernel did
        ids_spec = spec_of(ids, mesh)
    lead = tuple(ids_spec)[: ids.ndim - 1]
    lead = lead + (None,) * (ids.ndim - 1 - len(lead))
    # First the hidden axes the batch uses trade places with it (an all_to_all XLA sees as
    # such), then the others are gathered: one reshard would replicate the whole output first.
    batch_axes = {a for e in lead if e is not None for a in ((e,) if isinstance(e, str) else e)}
    rest = tuple(a for a in stack.hidden_axes if a not in batch_axes)
    middle = (*lead, *(None,) * (out.ndim - 1 - len(lead)), rest or None)
    out = move(out, mesh, P(*middle))
    return move(out, mesh, P(*lead, *(None,) * (out.ndim - len(lead))))


class _Asked(NamedTuple):
    """A stack's exchange as asked, `exchange[:pool[:factor]]` (a `CollectionPlan`'s routed
    stacks may say their pooling and capacity factor, `"routed:source:0.0794"`)."""

    exchange: str
    pool: str | None
    factor: float | None


def _requested(exchange: Any, stack: int) -> _Asked:
    """A stack's exchange as asked: one for all, or per stack index (a `CollectionPlan`'s)."""
    text = exchange.get(stack, "auto") if isinstance(exchange, Mapping) else exchange
    name, *rest = text.split(":")
    how = "a plan's exchange is 'routed:<pool>:<factor>', e.g. 'routed:source:0.08'"
    if len(rest) > 2:
        raise ValueError(f"stack {stack}: exchange {text!r} has {len(rest) + 1} parts: {how}")
    factor = None
    if len(rest) == 2:
        try:
            factor = float(rest[1])
        except ValueError:
            raise ValueError(f"stack {stack}: exchange {text!r} ends in {rest[1]!r}, not a "
                             f"capacity factor: {how}") from None  # fmt: skip
    return _Asked(name, rest[0] if rest else None, factor)


def stack_exchange(exchange: Any, layout: CollectionLayout, stack: int) -> str:
    """The exchange a stack's bag calls run: `"table"` (the table-wise exchange, for the calls
    `_calls` gives to `jaxembed.kernels.tablewise`) runs its other calls as `"auto"`, and
    `"table+X"` (a `CollectionPlan`'s, for a stack it plans both ways) as X.

    `"auto"` on a stack holding a table split by block rows runs the gather exchange
    (`"rows"`): recommender vocabularies are often ranked by frequency, and then block rows
    put every hot id on the first shard, whose routed bucket would overflow its capacity
    every step (the exact fallback is the gather exchange plus the bucketing). Mod rows (the
    hot ids spread over the shards) and a `CollectionPlan`'s exchanges, priced with the ids'
    measured skew (`id_stats`), route where that is faster."""
    chosen = _requested(exchange, stack).exchange  # a plan's pooling: `_routed_pool`
    if chosen.startswith("table+"):  # a plan's: table-wise calls, the rest by this exchange
        return chosen.removeprefix("table+")
    if chosen == "auto" and any(
        p.placement in ("rows", "table_rows") and p.row_sharding == "block" and len(p.shards) > 1
        for _, p in layout.placements if p.stack == stack
    ):  # fmt: skip
        return "rows"
    return "auto" if chosen == "table" else chosen


def _calls(layout: CollectionLayout, group: Group, batch, exchange: Any, mesh: Any, x_spec,
           table: jax.Array):  # fmt: skip
    """A group's calls, `[(group, tablewise.OwnerMap or None)]`: under `exchange="auto"` (or
    `"table"`), the features of a dense `[B, F, L]` summed group whose tables are each whole on
    one shard run table-wise (`jaxembed.kernels.tablewise`: their ids go to that device only),
    where the batch is split over the stack's row axes alone and the hidden axis is whole; the
    group's other features make a call of their own, as before."""
    stack = layout.stacks[group.stack]
    requested = _requested(exchange, group.stack).exchange
    tablewise_asked = requested in ("auto", "table") or requested.startswith("table+")
    if (not tablewise_asked or group.kind != "stacked"
            or group.combiner != "sum" or stack.hidden_axes or stack.num_shards < 2):  # fmt: skip
        return [(group, None)]
    features = {f.name: f for f in layout.features}
    places = {n: layout.placement(features[n].table) for n in group.features}
    single = tuple(n for n in group.features if len(places[n].shards) == 1)
    if not single:
        return [(group, None)]
    ids = _as_input(single[0], batch[single[0]])[1]  # [B, L]: the group's batch layout
    where = _where(mesh, table, ids)
    if where is None or ids.shape[0] % stack.num_shards:
        return [(group, None)]
    spec = tuple(_ids_spec(ids, stack, where, x_spec, warn=False) or spec_of(ids, where) or ())
    rows = next(iter(stack.spec), None)
    if not spec or rows is None or spec[0] != rows or any(e is not None for e in spec[1:]):
        return [(group, None)]
    axes = (rows,) if isinstance(rows, str) else tuple(rows)
    owners = tablewise.owner_map(tuple(places[n].shards[0] for n in single), axes,
                                 stack.num_shards, stack.local_rows)  # fmt: skip
    rest = tuple(n for n in group.features if n not in single)
    calls = [(dataclasses.replace(group, features=single), owners)]
    return calls + ([(dataclasses.replace(group, features=rest), None)] if rest else [])


def _spec(x_spec: P | None, ids: jax.Array) -> P | None:
    if x_spec is None:
        return None
    parts = tuple(x_spec)[: ids.ndim - 1]
    return P(*parts, *(None,) * (ids.ndim - len(parts)))


def collection_update(
    layout: CollectionLayout,
    optimizer: Any,
    stacks: Mapping[int, jax.Array],
    states: Mapping[int, Any],
    batch: Mapping[str, Any],
    out_grads: Mapping[str, jax.Array],
    *,
    mesh: Any = None,
    x_spec: P | None = None,
    exchange: str = "auto",
    capacity_factor: float | None = None,
    impl: str = "auto",
    routed_pool: str = "auto",
    return_stats: bool = False,
) -> Any:
    """Row-sparse update of every stack from the outputs' gradients (`jaxembed.optim`).

    Each stack's rows get one update per call that reads them (one per stack and input form;
    usually one); a row that two calls of the same stack read in one step (a max-pooled
    feature sharing a table with a summed one, or a dense and a `Ragged` input of one table)
    gets one update per call, and a warning says so.

    Args:
      layout, batch, mesh, x_spec, exchange, capacity_factor, impl, routed_pool: as
        `collection_lookup`.
      optimizer: a `jaxembed.optim.RowSparseOptimizer`.
      stacks, states: each stack's table and optimizer state, by stack index.
      out_grads: d loss / d output, per feature, shaped as `collection_lookup`'s outputs.
      return_stats: also return each stack's `UpdateStats` (its calls' distinct rows
        updated per device, summed; the routed exchange's fallback).

    Returns:
      The new stacks and states, by stack index; with `return_stats`, also
      `{stack name: UpdateStats}`.
    """
    stacks, states = dict(stacks), dict(states)
    stats: dict[str, UpdateStats] = {}
    batch = checked_batch(layout, batch)
    groups = groups_of(layout, batch)
    per_stack: dict[int, int] = {}
    for g in groups:
        per_stack[g.stack] = per_stack.get(g.stack, 0) + 1
    for index, n in per_stack.items():
        if n > 1:
            warn_once(
                "collection-groups",
                f"the collection's stack {layout.stacks[index].name} is read by {n} calls in one "
                "step (inputs of different forms, or max-pooled features beside summed ones): "
                "a row that more than one of them reads gets one update per call",
            )
    calls = [
        c for g in groups for c in _calls(layout, g, batch, exchange, mesh, x_spec, stacks[g.stack])
    ]
    for group, owners in calls:
        stack = layout.stacks[group.stack]
        ids, lengths, weights, pieces = _operands(layout, group, batch)
        out_grad = _join(group, pieces, out_grads, ids, stack)
        where = _where(mesh, stacks[group.stack], ids)
        ids_spec = _ids_spec(ids, stack, where, x_spec, warn=False)
        if owners is not None:  # table-wise: each table updated by the device that holds it
            done = tablewise.update(
                optimizer, stacks[group.stack], states[group.stack], ids, weights, out_grad,
                owners, where, impl=impl, return_stats=return_stats,
            )  # fmt: skip
        else:
            done = optimizer.update(
                stacks[group.stack], states[group.stack], ids, out_grad, lengths=lengths,
                per_id_weights=weights, combiner=group.combiner, vocab_size=stack.shape[0],
                mesh=mesh, x_spec=ids_spec, weight_spec=_weight_spec(stack, where),
                exchange=stack_exchange(exchange, layout, group.stack),
                capacity_factor=_capacity_factor(capacity_factor, exchange, group.stack), impl=impl,
                routed_pool=_routed_pool(routed_pool, group.combiner, exchange, group.stack),
                return_stats=return_stats,
            )  # fmt: skip
        stacks[group.stack], states[group.stack] = done[:2]
        if return_stats:
            stats[stack.name] = _add_update_stats(stats.get(stack.name), done[2])
    return (stacks, states, stats) if return_stats else (stacks, states)


def _add_update_stats(total: UpdateStats | None, call: UpdateStats) -> UpdateStats:
    """A stack's `UpdateStats` over its calls: rows updated add (calls of one mesh), a
    fallback of any counts."""
    if total is None:
        return call
    fallback = total.routed_fallback | call.routed_fallback
    if total.rows.shape != call.rows.shape:  # one call ran on one device, one did not
        return total._replace(routed_fallback=fallback)
    return UpdateStats(fallback, total.rows + call.rows)


def _capacity_factor(capacity_factor: float | None, exchange: Any, stack: int) -> float | None:
    """A call's routed `capacity_factor`: the plan's for its stack (a `CollectionPlan`'s
    exchange `"routed:source:0.0789"`, sized from the sampled ids), else the one asked for."""
    factor = _requested(exchange, stack).factor
    return capacity_factor if factor is None else factor


def _routed_pool(routed_pool: str, combiner: str, exchange: Any, stack: int) -> str:
    """A call's `routed_pool`: the plan's for its stack (a `CollectionPlan`'s exchange
    `"routed:source"` or `"table+routed:source"`, where pooling at the owner would overflow
    or costs more), else the one asked for; a max-pooled call has no partial sums to pool
    at the owner."""
    routed_pool = _requested(exchange, stack).pool or routed_pool
    return "auto" if combiner == "max" and routed_pool == "owner" else routed_pool


def _join(group: Group, pieces, out_grads, ids, stack: Stack) -> jax.Array:
    """The call's output gradient `[*lead, B_total, dim]` from the features' gradients."""
    lead = ids.shape[:-1]
    blocks = []
    for name, _, count, pooled in pieces:
        g = jnp.asarray(out_grads[name])
        if group.kind in ("dense", "stacked"):
            g = g[..., None, :] if pooled else g
        else:
            g = g.reshape(*lead, count, stack.dim)
            g = jnp.pad(g, [(0, 0)] * (g.ndim - 2) + [(0, 1), (0, 0)])  # the gap bag's zero
        blocks.append(g)
    return jnp.concatenate(blocks, axis=-2)
