"""`embedding_bag`: pooled lookups over bags of ids, as `jax.shard_map` bodies.

Each row shard pools only its own rows; the *pooled* partial sums are reduced (`psum`, or
`psum_scatter` onto a batch-split output), so the bytes grow with the number of bags, never
with their length. Mean and sqrtn are weighted sums whose per-slot factors every device
computes from the ids it holds (`jaxembed.ragged.bag_scales`); max reduces with `pmax`, and
a `pmin` of the winning slots routes its gradient to the one shard that owns the row.

    forward   ids, lengths, weights -> the plan's moves -> canonical bags (segments, factors)
              -> rows of this shard -> pool (segment sum / max) -> psum_scatter / psum (pmax)
              -> the output's moves
    backward  out_grad's moves and transposes -> [rows: gather ids, lengths, weights,
              out_grad (and winners) over the batch axes] -> each slot's gradient (its
              bag's out_grad times its factor, or the max's winner) -> scatter-add into a
              zero shard -> [dense: psum over the batch axes]

The routed exchange (`jaxembed.kernels.routed`) either fetches each distinct id's row and pools
at the source, or (`plan.routed.pooled_at_owner`, sum-like bags) sends each slot to its row's
owner, which pools per (source, bag) before a `psum_scatter`; its backward gathers out_grad
over S and forms each received slot's gradient at the owner (`fused` when native).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jaxembed import ragged
from jaxembed.ids import as_ids
from jaxembed.kernels import local as local_ops
from jaxembed.kernels import routed as routed_ops
from jaxembed.kernels.arrays import (
    batch_typed_like,
    conform,
    eager,
    move,
    resolve_mesh,
    retype,
    whole_on_one_device,
    zeros_like_output,
)
from jaxembed.kernels.common import (
    companion_spec,
    cotangent_spec,
    counts_spec,
    finish_gradient,
    out_grad_to_body,
    reduce_over_rows,
    resolve_layouts,
    runs_on_one_device,
    shard_map,
    stats_of,
    validate_scalars,
    with_stats,
    work_counts,
)
from jaxembed.kernels.options import LookupOptions
from jaxembed.kernels.reshard import apply_moves, gather
from jaxembed.kernels.select import kernels_for
from jaxembed.kernels.tables import (
    check_lookup_table,
    conform_table,
    frozen,
    is_quantized,
    layout_array,
    table_specs,
    whole_table,
)
from jaxembed.plan import EmbeddingPlan, Exchange, plan_embedding_bag
from jaxembed.plan.exchange import operand_has_dim
from jaxembed.plan.lookup import check_choices

__all__ = [
    "Bags",
    "bag_slot_grads",
    "embedding_bag",
    "exchanged_slot_grads",
    "local_bag",
    "moved_bags",
    "pool",
    "prepare_bags",
    "run_embedding_bag",
]


class Bags(NamedTuple):
    """A bag lookup's batch operands in one pytree: ids, and lengths and weights if any."""

    ids: jax.Array
    lengths: jax.Array | None
    weights: jax.Array | None

    def operands(self) -> tuple[jax.Array, ...]:
        return tuple(a for a in self if a is not None)

    def batch(self) -> ragged.BagBatch:
        """The canonical form of these bags (`jaxembed.ragged.to_bag_batch`): the one place
        the kernels build it, from the whole batch or from one device's block."""
        return ragged.to_bag_batch(self.ids, lengths=self.lengths, per_id_weights=self.weights)


def _unpack(plan: EmbeddingPlan, arrays) -> Bags:
    it = iter(arrays)
    ids = next(it)
    lengths = next(it) if plan.bag.form == "flat" else None
    weights = next(it) if plan.bag.weighted else None
    return Bags(ids, lengths, weights)


# --- the shard-local pieces ------------------------------------------------------------------


class _Slots(NamedTuple):
    local: jax.Array  # i32[M] this shard's row of each slot
    here: jax.Array  # bool[M] the slot reads a row of this shard
    segment: jax.Array  # i32[M] the slot's bag among the block's G*B bags (G*B: none)
    position: jax.Array  # i32[M] the slot's index within its lead element (0..N-1)
    scale: jax.Array  # f32[M] the slot's factor
    num_segments: int  # G*B


def _slots(
    plan: EmbeddingPlan, bags: Bags, *, my_bags_only: bool, owned_only: bool = True
) -> _Slots:
    """The canonical form of a block of bags, flattened: which slots pool into which bag.

    With `my_bags_only`, a device whose output splits the bag axis keeps only its range of
    bags (the ids are whole on it); after the rows exchange gathered out_grad along that
    axis, every bag is its own. With `owned_only=False`, `here` marks every slot that reads
    a row, wherever it lives (the routed exchange fetches them).
    """
    bag = plan.bag
    batch = bags.batch()  # the dense form has no lengths
    if bags.lengths is not None:  # the native kernels read the lengths in one pass
        capacity = batch.ids.shape[-1]
        batch = batch._replace(
            segments=kernels_for(plan).segments_from_lengths(bags.lengths, capacity)
        )
    segments, num_bags = batch.segments, batch.num_bags
    if my_bags_only and plan.bag_split_axes:
        n = math.prod(jax.lax.axis_size(a) for a in plan.bag_split_axes)
        num_bags //= n
        segments = segments - jax.lax.axis_index(plan.bag_split_axes) * num_bags
        segments = jnp.where((segments >= 0) & (segments < num_bags), segments, -1)
    batch = batch._replace(segments=segments, num_bags=num_bags)
    valid = ragged.valid_slots(batch, plan.vocab_size, plan.padding_idx)
    scale = ragged.bag_scales(valid, segments, batch.weights, num_bags, bag.combiner)
    local, here = local_ops.local_rows(plan, batch.ids)
    capacity = batch.ids.shape[-1]
    position = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), batch.ids.shape)
    segment = ragged.global_segments(jnp.where(valid, segments, -1), num_bags)
    groups = math.prod(batch.ids.shape[:-1])
    return _Slots(
        local.reshape(-1),
        (here & valid if owned_only else valid).reshape(-1),
        segment.reshape(-1),
        position.reshape(-1),
        scale.reshape(-1),
        groups * num_bags,
    )


def _out_shape(plan: EmbeddingPlan, bags: Bags, pooled: jax.Array) -> jax.Array:
    """[G*B, H] -> the block's output: [*lead, B, H], or [*batch, H] for the dense form."""
    lead = bags.ids.shape[:-1]
    if plan.bag.form == "dense":
        return pooled.reshape(*lead, pooled.shape[-1])
    return pooled.reshape(*lead, -1, pooled.shape[-1])


def bag_slot_grads(
    plan: EmbeddingPlan, bags: Bags, out_grad: jax.Array, winners: jax.Array | None, *,
    my_bags_only: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """Each slot's gradient from the pooled output gradient: `(local, here, grads[M, H])`.

    Sum, mean, sqrtn: the slot's bag's out_grad times its factor. Max: the bag's out_grad in
    the columns where this slot won the maximum.
    """
    s = _slots(plan, bags, my_bags_only=my_bags_only)
    return s.local, s.here, _slot_grads(plan, s, out_grad, winners)


def bag_slots(plan: EmbeddingPlan, bags: Bags) -> _Slots:
    """This device's own slots (its bags, no exchange): each one's local row and whether it
    reads one here (`.local`, `.here`)."""
    return _slots(plan, bags, my_bags_only=True)


def _slot_grads(plan: EmbeddingPlan, s: _Slots, out_grad, winners) -> jax.Array:
    hidden = out_grad.shape[-1]
    og = out_grad.reshape(-1, hidden).astype(jnp.float32)  # f32[G*B, H/K]
    rows = jnp.take(og, s.segment, axis=0, mode="fill", fill_value=0)  # f32[M, H/K]
    if plan.bag.combiner == "max":
        won = jnp.take(winners.reshape(-1, hidden), s.segment, axis=0, mode="fill", fill_value=-1)
        return jnp.where(won == s.position[:, None], rows, 0.0)
    return rows * s.scale[:, None]


# --- the bodies ------------------------------------------------------------------------------


def _gather_bags(plan: EmbeddingPlan, bags: Bags, axes, dim) -> Bags:
    """The batch operands gathered over `axes` along output batch axis `dim` (those that
    have it)."""
    return Bags(*(
        gather(a, axes, dim) if a is not None and operand_has_dim(a.ndim, dim, True) else a
        for a in bags
    ))  # fmt: skip


def _routed_buckets(plan: EmbeddingPlan, bags: Bags) -> tuple[_Slots, routed_ops.Buckets]:
    """A device's slots (their rows wherever they live) and their buckets by owner: distinct
    ids, or, when the owners pool, the slots themselves."""
    s = _slots(plan, bags, my_bags_only=True, owned_only=False)
    if plan.routed.pooled_at_owner:
        return s, routed_ops.bucket_slots(plan, bags.ids.reshape(-1), s.here & (s.segment >= 0))
    return s, routed_ops.bucketize(plan, bags.ids.reshape(-1), s.here)


def _owner_slots(plan: EmbeddingPlan, bags: Bags, s: _Slots, buckets) -> _Slots:
    """The slots this device received as their rows' owner (`route_slots`), as `_Slots` of
    every source's bags: bag b of the source at position j along S is segment j·GB + b."""
    ids, seg, scale = routed_ops.route_slots(plan, buckets, bags.ids.reshape(-1), s.segment,
                                             s.scale)  # fmt: skip  # [n_S, C] each
    n, c = ids.shape
    local, here = local_ops.local_rows(plan, ids)
    here = here & (seg >= 0)
    source = jnp.arange(n, dtype=jnp.int32)[:, None]
    segment = jnp.where(here, source * s.num_segments + seg, -1)
    return _Slots(local.reshape(-1), here.reshape(-1), segment.reshape(-1),
                  jnp.zeros((n * c,), jnp.int32), scale.reshape(-1),
                  n * s.num_segments)  # fmt: skip


def _routed_pool(plan: EmbeddingPlan, bags: Bags, table: jax.Array):
    """The routed forward: fetch each slot's row from its owner, pool locally (or, pooled at
    the owner: send each slot to its owner, which pools, and reduce-scatter the partial
    sums); a step whose buckets overflow pools through the gather exchange instead.
    `(out, overflow, counts)`."""
    s, buckets = _routed_buckets(plan, bags)
    overflow = routed_ops.overflowed(buckets, plan.mesh_names)

    ops = kernels_for(plan, table)

    def at_owner(_):
        o = _owner_slots(plan, bags, s, buckets)  # n_S·C slots of every source's GB bags
        partial = ops.pool_sum(table, o.local, o.here, o.segment, o.scale, o.num_segments)
        # partial: f32[n_S·GB, H/K], by (source, bag) -> each source its own f[GB, H/K]
        pooled = jax.lax.psum_scatter(partial.astype(table.dtype), plan.routed.axes,
                                      scatter_dimension=0, tiled=True)  # fmt: skip
        if plan.routed.rest_axes:
            pooled = jax.lax.psum(pooled, plan.routed.rest_axes)  # the other row shards
        out = _out_shape(plan, bags, pooled)
        return out, work_counts(plan, o.here.shape[0], jnp.sum(o.here))  # pooled as owner

    def routed(_):
        back, reads = routed_ops.fetch_pieces(plan, table, buckets)  # n_S × f[C, H/K]
        place, fits = routed_ops.places(buckets)  # each slot's row of `back` (float rows)
        pooled = kernels_for(plan).pool_sum_pieces(
            back, place, s.here & fits, s.segment, s.scale, s.num_segments
        )
        out = _out_shape(plan, bags, pooled.astype(table.dtype))
        return out, work_counts(plan, s.here.shape[0], reads)  # pooled: my own slots

    def fallback(_):
        whole = _gather_bags(plan, bags, plan.routed.axes, plan.routed.dim)
        g = _slots(plan, whole, my_bags_only=True)
        pooled = ops.pool_sum(table, g.local, g.here, g.segment, g.scale, g.num_segments)
        out = reduce_over_rows(plan, _out_shape(plan, whole, pooled.astype(table.dtype)))
        return out, work_counts(plan, g.here.shape[0], jnp.sum(g.here))

    branch = at_owner if plan.routed.pooled_at_owner else routed
    out, counts = jax.lax.cond(overflow, fallback, branch, None)
    return out, overflow.astype(jnp.int32), counts


def pool(plan: EmbeddingPlan, bags: Bags, table: jax.Array):
    """A block's pooled bags, reduced over the row shards: `(out, winners, overflow,
    counts)` in the body's layout (winners: the slot of each max, int32 like out, None
    unless max; overflow: int32[], the routed exchange fell back this step; counts:
    `work_counts`, the slots walked and rows read here)."""
    no_overflow = jnp.zeros((), jnp.int32)
    if plan.exchange == "routed":
        out, overflow, counts = _routed_pool(plan, bags, table)
        return out, None, overflow, counts
    s = _slots(plan, bags, my_bags_only=True)
    counts = work_counts(plan, s.here.shape[0], jnp.sum(s.here))
    ops = kernels_for(plan, table)
    if plan.bag.combiner != "max":
        pooled = ops.pool_sum(table, s.local, s.here, s.segment, s.scale, s.num_segments)
        out = reduce_over_rows(plan, _out_shape(plan, bags, pooled.astype(table.dtype)))
        return out, None, no_overflow, counts
    maxima, winners = ops.pool_max(table, s.local, s.here, s.segment, s.num_segments)
    # maxima: f32[G*B, H/K] (-inf: no row here); winners: slot index in the flat block
    capacity = bags.ids.shape[-1]
    winners = jnp.where(winners < s.local.shape[0], winners % capacity, capacity)
    if plan.psum_axes:
        best = jax.lax.pmax(maxima, plan.psum_axes)
        mine = jnp.where((maxima == best) & jnp.isfinite(best), winners, capacity)
        winners = jax.lax.pmin(mine, plan.psum_axes)
        maxima = best
    pooled = jnp.where(jnp.isfinite(maxima), maxima, 0.0).astype(table.dtype)
    out = _out_shape(plan, bags, pooled)
    return out, _out_shape(plan, bags, winners), no_overflow, counts


def moved_bags(plan: EmbeddingPlan, given) -> Bags:
    """The batch operands as given, moved into the body's layout by the plan's moves."""
    return Bags(*(apply_moves(a, op.moves) if a is not None else None for a, op in
                  zip(_unpack(plan, given), _ops_by_name(plan), strict=True)))  # fmt: skip


def _forward_body(plan: EmbeddingPlan, *arrays):
    # arrays: ids i32[*lead, N | L] (+ lengths i32[*lead, B], weights f32[*lead, N]), each
    # as given; table f[V/R, H/K] last.
    *given, table = arrays
    bags = moved_bags(plan, given)
    out, winners, overflow, counts = pool(plan, bags, table)  # f[*out / body_out_spec, H/K]
    out = apply_moves(out, plan.out_moves)  # f[*out / out_spec, H']
    residuals = (*bags.operands(), *((winners,) if winners is not None else ()))
    return out, residuals, overflow, counts  # counts: i32[1, 2], this device's


def _ops_by_name(plan: EmbeddingPlan):
    by_name = {op.name: op for op in plan.operands}
    return (by_name["ids"], by_name.get("lengths"), by_name.get("weights"))


def _rows_exchange(plan: EmbeddingPlan, bags: Bags, out_grad, winners):
    """Gathers the batch operands, out_grad (and winners) over the batch axes, axis by axis,
    in the plan's order."""
    arrays = dict(bags._asdict())
    for dim, axes in plan.batch_gathers:
        for name in ("ids", "lengths", "weights"):
            a = arrays[name]
            if a is not None and operand_has_dim(a.ndim, dim, True):
                arrays[name] = gather(a, axes, dim)
        out_grad = gather(out_grad, axes, dim)
        if winners is not None:
            winners = gather(winners, axes, dim)
    return Bags(**arrays), out_grad, winners


def exchanged_slot_grads(plan: EmbeddingPlan, bags: Bags, out_grad, winners, consume,
                         overflow=None, fused=None):  # fmt: skip
    """out_grad into the body's layout, the exchange, then each slot's gradient handed to
    `consume(local, here, grads)` (a scatter-add, or an optimizer's update), whose result
    is returned with the routed exchange's overflow flag, `(result, overflow)`. Under the
    routed exchange `consume` runs in both branches of its `cond`, chosen by `overflow` (the
    forward's flag; computed here when None).

    Pooled at the owner, the slots are bucketed and sent again (the update has no forward
    to keep them from, and a lookup's residuals stay its operands), out_grad is gathered
    over S (the transpose of the forward's `psum_scatter`), and each owner forms its
    received slots' gradients, `fused` when given (gradient, dedup and update in one pass)."""
    if plan.exchange == "routed":
        out_grad = apply_moves(out_grad, plan.grad_moves)
        s, buckets = _routed_buckets(plan, bags)

        def at_owner(_):
            o = _owner_slots(plan, bags, s, buckets)
            og = out_grad.reshape(-1, out_grad.shape[-1])  # f[GB, H/K]
            og = jax.lax.all_gather(og, plan.routed.axes, axis=0, tiled=True)  # f[n_S·GB, H/K]
            if fused is not None:
                return fused(o, og)
            return consume(o.local, o.here, _slot_grads(plan, o, og, None))

        def routed(_):  # each distinct id's gradient summed by place, fused (no f[M, H])
            place, fits = routed_ops.places(buckets)
            n, c = buckets.send.shape
            og = out_grad.reshape(-1, out_grad.shape[-1])  # f[GB, H/K]
            summed = kernels_for(plan).bag_scatter_add_pieces(
                n, (c, og.shape[-1]), place, s.here & fits, s.segment, s.scale, og
            )  # n_S × f32[C, H/K], one per owner
            owner_ids, summed = routed_ops.send_grads(plan, buckets, summed)
            local, here = local_ops.local_rows(plan, owner_ids)
            return consume(local, here & (owner_ids >= 0), summed)

        def fallback(_):
            axes, dim = plan.routed.axes, plan.routed.dim
            whole = _gather_bags(plan, bags, axes, dim)
            return _consume(plan, whole, gather(out_grad, axes, dim), None, True, consume, fused)

        if overflow is None:
            overflow = routed_ops.overflowed(buckets, plan.mesh_names).astype(jnp.int32)
        branch = at_owner if plan.routed.pooled_at_owner else routed
        return jax.lax.cond(overflow > 0, fallback, branch, None), overflow
    out_grad = out_grad_to_body(plan, out_grad)
    if plan.exchange == "rows":
        bags, out_grad, winners = _rows_exchange(plan, bags, out_grad, winners)
    mine = plan.exchange != "rows"
    result = _consume(plan, bags, out_grad, winners, mine, consume, fused)
    return result, jnp.zeros((), jnp.int32)


def _consume(plan, bags, out_grad, winners, my_bags_only, consume, fused):
    if fused is not None and plan.bag.combiner != "max":
        s = _slots(plan, bags, my_bags_only=my_bags_only)
        return fused(s, out_grad.reshape(-1, out_grad.shape[-1]))
    return consume(*bag_slot_grads(plan, bags, out_grad, winners, my_bags_only=my_bags_only))


def _backward_body(plan: EmbeddingPlan, *arrays):
    *residuals, overflow, out_grad = arrays
    bags = _unpack(plan, residuals)
    winners = residuals[-1] if plan.bag.combiner == "max" else None

    ops = kernels_for(plan)

    scatter = functools.partial(routed_ops.scatter_grads, plan)  # f[M, H/K] grads, or pieces

    fused = None
    if plan.impl == "native":

        def fused(s, og):
            return ops.bag_scatter_add(plan.table_shard_shape, s.local, s.here, s.segment,
                                       s.scale, og)  # fmt: skip

    weight_grad, _ = exchanged_slot_grads(
        plan, bags, out_grad, winners, scatter, overflow, fused=fused
    )
    return finish_gradient(plan, weight_grad)  # f[V/R, H/K]


def residual_specs(plan: EmbeddingPlan) -> tuple[P, ...]:
    """The layouts of the forward's residuals: operands in the body, winners as the body's
    output."""
    specs = tuple(op.spec for op in plan.operands)
    if plan.bag.combiner == "max":
        specs += (plan.body_out_spec,)
    return specs


def _forward(plan: EmbeddingPlan, mesh: Any, operands, table):
    in_specs = (*(op.given for op in plan.operands), table_specs(table, plan.weight_spec))
    out_specs = (plan.out_spec, residual_specs(plan), P(), counts_spec(plan))
    body = shard_map(_forward_body, plan, mesh, in_specs, out_specs)
    return body(*operands, table)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _bag(plan: EmbeddingPlan, mesh: Any, operands: tuple, table: jax.Array):
    out, _, overflow, counts = _forward(plan, mesh, operands, table)
    return out, overflow, counts


def _bag_fwd(plan, mesh, operands, table):
    out, residuals, overflow, counts = _forward(plan, mesh, operands, table)
    return (out, overflow, counts), (*residuals, overflow)


def _bag_bwd(plan, mesh, residuals, cotangents):
    out_grad, _, _ = cotangents
    ct_spec = cotangent_spec(plan)
    out_grad = move(out_grad, mesh, ct_spec)
    in_specs = (*residual_specs(plan), P(), ct_spec)
    bwd = shard_map(_backward_body, plan, mesh, in_specs, plan.weight_spec)
    zeros = tuple(None for _ in residuals[: len(plan.operands)])
    return zeros, bwd(*residuals, out_grad)


_bag.defvjp(_bag_fwd, _bag_bwd)


def _run(plan: EmbeddingPlan, mesh: Any, operands: tuple, table: jax.Array):
    """`_bag` with its operands typed as the plan's specs and its output as the caller's
    (free: they differ only by axes of size 1; see `jaxembed.kernels.lookup._run`)."""
    operands = tuple(
        conform(a, mesh, op.given) for a, op in zip(operands, plan.operands, strict=True)
    )
    table = conform_table(table, mesh, plan.weight_spec)
    if is_quantized(table):  # inference only: the forward, no gradient
        out, _, overflow, counts = _forward(plan, mesh, operands, frozen(table))
    else:
        out, overflow, counts = _bag(plan, mesh, operands, table)
    return retype(out, plan.out_type_spec), overflow, counts


_run_jit = jax.jit(_run, static_argnums=(0, 1))  # an eager call: one compiled program


# One device: the bodies run as they are (no collective to run, no shard_map needed), so
# that the native kernels serve a program without a mesh too.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _local_bag(plan: EmbeddingPlan, operands: tuple, table: jax.Array):
    return _forward_body(plan, *operands, table)[0]


def _local_bag_fwd(plan, operands, table):
    out, residuals, overflow, _ = _forward_body(plan, *operands, table)
    return out, (*residuals, overflow)


def _local_bag_bwd(plan, residuals, out_grad):
    zeros = tuple(None for _ in residuals[: len(plan.operands)])
    return zeros, _backward_body(plan, *residuals, out_grad)


_local_bag.defvjp(_local_bag_fwd, _local_bag_bwd)
_local_bag_jit = jax.jit(_local_bag, static_argnums=(0,))


def _quantized_bag(plan: EmbeddingPlan, operands: tuple, table: Any):
    """A quantized table's one-device lookup (it has no gradient): sum, mean and sqrtn bags in
    one native call on the operands as given (`quant_native.pool_bags`: no XLA work around
    it), max bags through the forward body."""
    if plan.bag.combiner == "max":
        return _forward_body(plan, *operands, table)[0]
    bags = _unpack(plan, operands)
    return kernels_for(plan, table).pool_bags(
        table, bags.ids, bags.lengths, bags.weights, combiner=plan.bag.combiner,
        vocab_size=plan.vocab_size, padding_idx=plan.padding_idx,
    )  # fmt: skip


_quantized_bag_jit = jax.jit(_quantized_bag, static_argnums=(0,))


def _one_device_bag(bags: Bags, batch: ragged.BagBatch, weight, options: LookupOptions):
    """The one-device lookup: the native kernels where they run, else XLA's ops (on `batch`,
    the bags' canonical form). A symbolic shape (`jax.export.symbolic_shape`: an artifact
    that serves every batch size) runs XLA's ops, which need no plan."""
    if not all(isinstance(d, int) for a in bags.operands() for d in a.shape):
        vocab = options.vocab_of(weight.shape[0])
        return _dense_bag(batch, options.combiner, weight, vocab, options.padding_idx)
    plan = plan_embedding_bag(
        AbstractMesh((1,), ("_",)), bags.ids.shape, weight.shape,
        num_bags=None if bags.lengths is None else bags.lengths.shape[-1],
        combiner=options.combiner, weighted=bags.weights is not None, x_spec=P(),
        lengths_spec=None if bags.lengths is None else P(),
        weights_spec=None if bags.weights is None else P(), weight_spec=P(),
        padding_idx=options.padding_idx, vocab_size=options.vocab_size, dtype=weight.dtype,
        ids_dtype=bags.ids.dtype, impl=options.impl,
    )  # fmt: skip
    if plan.impl != "native":
        return _dense_bag(batch, options.combiner, weight, plan.vocab_size, options.padding_idx)
    if is_quantized(weight):  # the native quantized kernels, forward only (no gradient)
        run = _quantized_bag_jit if eager(bags.operands(), weight) else _quantized_bag
        return run(plan, bags.operands(), frozen(weight))
    run = _local_bag_jit if eager(bags.operands(), weight) else _local_bag
    return run(plan, bags.operands(), weight)


def local_bag(
    ids: jax.Array,
    weight: jax.Array,
    *,
    lengths: jax.Array | None = None,
    per_id_weights: jax.Array | None = None,
    combiner: str = "sum",
    impl: str = "auto",
) -> jax.Array:
    """The bag lookup of one device's arrays as they are, with no mesh and no collective:
    the body of a caller's own `shard_map` (a table-wise collection's owner pooling the table
    it holds whole), or an unsharded lookup. Ids outside `[0, rows)` read nothing.

    Args:
      ids, lengths, per_id_weights, combiner: one device's bags, as `embedding_bag` takes them.
      weight: the table (or shard) `[rows, H]` the ids index.
      impl: `"auto"`, `"native"` or `"xla"`.

    Returns:
      The pooled rows, as `embedding_bag`'s.
    """
    bags = prepare_bags(ids, lengths, None, per_id_weights, False, check=False)
    options = LookupOptions(combiner=combiner, impl=impl, check_ids=False, function="local_bag")
    return _one_device_bag(bags, bags.batch(), weight, options)


# --- the public entry point --------------------------------------------------------------------


_SLOTS_ADDED_IN_ORDER = 64
"""Dense sum bags of at most this many slots pool by `_pool_dense` (one add a slot,
unrolled); longer ones, and every other bag, by `pool_sum`'s segment sum."""


@functools.partial(jax.jit, static_argnums=0)  # eager calls: one program, not 2 L ops
def _pool_dense(ops, weight, ids: jax.Array, valid: jax.Array) -> jax.Array:
    """Dense sum bags `[*lead, L]` without weights, pooled without a scatter: f32 `[*lead, H]`.

    Each slot's row (zero where not `valid`), the L slots added one after the other in slot
    order: the sums `ops.pool_sum`'s segment sum makes, in its order (each bag's slots in
    slot order), on the same rows (its factors are 1 on the valid slots: `row · 1` is the
    row), so the same floats. XLA:CPU runs `pool_sum` as a gather and a scatter-add per
    lookup, and the scatter costs about as much as the gather; these adds fuse with the
    gather (and a quantized table's decode) into one loop (docs/serving.md, "Latency").
    Factors other than 1 (mean, sqrtn, weights) stay with the segment sum: XLA:CPU fuses a
    product into the add after it (an fma) in some shapes and not in others, so the adds
    here would not round as the segment sum does.

    Args:
      ops: XLA's kernels for the table (`jaxembed.kernels.local` or `.quant`).
      weight: the table, float or `QuantizedTable`.
      ids, valid: int `[*lead, L]` rows (0 where not valid), bool `[*lead, L]`.
    """
    rows = ops.gather_rows(weight, ids, valid).astype(jnp.float32)  # f32[*lead, L, H]
    pooled = rows[..., 0, :]  # f32[*lead, H]
    for slot in range(1, rows.shape[-2]):
        pooled = pooled + rows[..., slot, :]
    return pooled


def _dense_bag(batch: ragged.BagBatch, plan_bag, weight, vocab_size, padding_idx):
    """The pooled lookup of `batch` (`Bags.batch`) without a kernel: one device, or XLA's own
    partitioning."""
    valid = ragged.valid_slots(batch, vocab_size, padding_idx)
    scale = ragged.bag_scales(valid, batch.segments, batch.weights, batch.num_bags, plan_bag)
    seg = ragged.global_segments(jnp.where(valid, batch.segments, -1), batch.num_bags)
    groups = math.prod(batch.ids.shape[:-1]) * batch.num_bags
    ids = jnp.where(valid, batch.ids, 0).reshape(-1)
    here = valid.reshape(-1)
    ops = kernels_for(None, weight)  # XLA's, on a float or a quantized table
    weight = frozen(weight)
    slots = batch.ids.shape[-1]
    if plan_bag == "max":
        maxima, _ = ops.pool_max(weight, ids, here, seg.reshape(-1), groups)
        pooled = jnp.where(jnp.isfinite(maxima), maxima, 0.0)
    elif (plan_bag == "sum" and batch.weights is None and batch.dense
          and isinstance(slots, int) and 0 < slots <= _SLOTS_ADDED_IN_ORDER):  # fmt: skip
        pooled = _pool_dense(ops, weight, ids.reshape(batch.ids.shape), valid)
    else:
        pooled = ops.pool_sum(weight, ids, here, seg.reshape(-1), scale.reshape(-1), groups)
    lead = batch.ids.shape[:-1]
    pooled = pooled.astype(weight.dtype)
    return pooled.reshape(*lead, weight.shape[1]) if batch.dense else pooled.reshape(
        *lead, batch.num_bags, weight.shape[1]
    )  # fmt: skip


def prepare_bags(
    x, lengths, offsets, per_id_weights, include_last_offset, *, check: bool = True
) -> Bags:
    """The user's input form as `Bags`: a `Ragged` unpacked, offsets turned into lengths,
    every static check of `jaxembed.ragged.to_bag_batch` applied (and value checks when
    concrete). Ids of any width are checked before they are narrowed (`jaxembed.ids`);
    `check=False` saturates concrete ids int32 cannot hold instead of raising."""
    is_ragged = isinstance(x, ragged.Ragged)
    if not is_ragged:
        x = as_ids(x, check=check)
    ragged.to_bag_batch(  # the checks, once (the kernels build the form, `Bags.batch`)
        x, lengths=lengths, offsets=offsets, per_id_weights=per_id_weights,
        include_last_offset=include_last_offset and not is_ragged,
    )  # fmt: skip
    if is_ragged:
        return Bags(as_ids(x.values, check=check), x.lengths, x.weights)
    if offsets is not None:
        lengths = ragged.lengths_from_offsets(
            offsets, x.shape[-1], include_last_offset=include_last_offset
        )
    weights = None if per_id_weights is None else jnp.asarray(per_id_weights, jnp.float32)
    return Bags(x, None if lengths is None else as_ids(lengths, "lengths"), weights)


def _check_bag_ids(bags: Bags, vocab_size: int, batch: ragged.BagBatch | None = None) -> None:
    """Raises on concrete ids outside the vocabulary (`batch`: `bags.batch()` if built)."""
    if any(isinstance(a, jax.core.Tracer) for a in bags.operands()):
        return
    if isinstance(bags.ids, jax.Array) and not bags.ids.is_fully_addressable:
        return
    ragged.check_bag_ids(bags.batch() if batch is None else batch, vocab_size)


def embedding_bag(
    x: Any,
    weight: jax.Array,
    *,
    lengths: jax.Array | None = None,
    offsets: jax.Array | None = None,
    per_id_weights: jax.Array | None = None,
    combiner: str = "sum",
    include_last_offset: bool = False,
    padding_idx: int | None = None,
    vocab_size: int | None = None,
    mesh: Any = None,
    x_spec: P | None = None,
    weight_spec: P | None = None,
    out_spec: P | None = None,
    exchange: Exchange = "auto",
    row_sharding: str = "block",
    capacity: int | None = None,
    capacity_factor: float | None = None,
    return_stats: bool = False,
    check_ids: bool = True,
    impl: str = "auto",
    routed_pool: str = "auto",
) -> Any:
    """Pools `weight`'s rows over bags of ids, sharded, with PyTorch's `embedding_bag` semantics.

    Input forms (all jittable, static shapes; see `jaxembed.ragged`):

    * `x [*batch, L]`: a bag per row; negative ids are empty slots. Output `[*batch, H]`.
    * `x [*lead, N]` with `lengths [*lead, B]`: bag b is the next `lengths[..., b]` ids;
      ids past the total are ignored. Output `[*lead, B, H]`.
    * `x [*lead, N]` with `offsets` (bag starts, or `[*lead, B+1]` with
      `include_last_offset=True`), as PyTorch. Output `[*lead, B, H]`.
    * a `jaxembed.Ragged`.

    Leading dims of the flat forms are independent blocks (e.g. one per data-parallel
    device), so splitting them needs no communication; a split bag axis is gathered (ids
    are small) and each device pools only its own bags.

    Args:
      x: integer ids in one of the forms above, or a `Ragged`.
      weight: the table `[V, H]`, float32 or bfloat16.
      lengths, offsets, include_last_offset: the flat forms' bag boundaries.
      per_id_weights: float weights shaped like `x`: Σwe for `"sum"`, Σwe/Σw for
        `"mean"`, Σwe/√Σw² for `"sqrtn"`; not with `"max"`.
      combiner: `"sum"`, `"mean"` (over the ids that read a row: padding and empty slots
        are not counted), `"sqrtn"` or `"max"` (element-wise; its gradient goes to the
        earliest slot giving the max). An empty bag gives zeros.
      padding_idx, vocab_size, mesh, weight_spec, out_spec, exchange, row_sharding, capacity,
        capacity_factor, return_stats, impl: as in `jaxembed.embedding`.
      check_ids: raise for concrete ids outside the vocabulary (True); False lets them read
        nothing, as under `jit` (for callers that mark empty slots with -1 on purpose).
      routed_pool: where the routed exchange pools a sum-like bag: `"source"`, `"owner"`
        or `"auto"` (see `jaxembed.plan_embedding_bag`).
      x_spec: the ids' layout (the lengths and weights follow the same lead layout unless
        their arrays state their own); default read from the arrays, or assumed as in
        `embedding`.

    Returns:
      The pooled bags, laid out as `out_spec` (default: the ids' lead layout, the table's
      hidden split).

    Raises:
      TypeError: float ids or lengths, integer weights, a non-float table.
      ValueError: bad combiners, weights with max, malformed lengths or offsets (negative,
        past the capacity, decreasing), shapes that do not match, out-of-range concrete
        ids, and the layout errors of `embedding`.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
      >>> table = jax.device_put(jnp.arange(32.0).reshape(16, 2),
      ...                        NamedSharding(mesh, P("model", None)))
      >>> ids = jax.device_put(jnp.array([[1, 2, -1, -1], [3, -1, -1, -1]] * 2),
      ...                      NamedSharding(mesh, P("data")))
      >>> embedding_bag(ids, table, combiner="mean").tolist()
      [[3.0, 4.0], [6.0, 7.0], [3.0, 4.0], [6.0, 7.0]]
    """
    options = LookupOptions(
        padding_idx=padding_idx, vocab_size=vocab_size, mesh=mesh, x_spec=x_spec,
        weight_spec=weight_spec, out_spec=out_spec, exchange=exchange,
        row_sharding=row_sharding, capacity=capacity, capacity_factor=capacity_factor,
        return_stats=return_stats, impl=impl, combiner=combiner,
        include_last_offset=include_last_offset, check_ids=check_ids, function="embedding_bag",
        routed_pool=routed_pool,
    )  # fmt: skip
    bags = prepare_bags(x, lengths, offsets, per_id_weights, include_last_offset, check=check_ids)
    return run_embedding_bag(bags, weight, options)


def run_embedding_bag(bags: Bags, weight: jax.Array, options: LookupOptions) -> Any:
    """`embedding_bag` of `bags` (`prepare_bags`) with its keywords as one `LookupOptions`.

    Raises:
      As `embedding_bag`.
    """
    check_lookup_table(weight)
    ragged.check_weights_allowed(options.combiner, bags.weights is not None)
    mesh = resolve_mesh(options.mesh, layout_array(weight), bags.ids)
    plan_vocab = options.vocab_of(weight.shape[0])
    if runs_on_one_device(mesh, options.x_spec, options.weight_spec, options.out_spec):
        check_choices(options.exchange, options.routed_pool, pools=True,
                      is_max=options.combiner == "max")  # fmt: skip
        validate_scalars(plan_vocab, options.padding_idx, weight.shape[0])
        given_ids = bags.ids
        bags = Bags(*(None if a is None else whole_on_one_device(a) for a in bags))
        batch = bags.batch()
        if options.check_ids:
            _check_bag_ids(bags, plan_vocab, batch)
        weight = whole_table(weight)
        out = _one_device_bag(bags, batch, weight, options)
        out = batch_typed_like(out, given_ids, given_ids.ndim - 1)
        valid = ragged.valid_slots(batch, plan_vocab, options.padding_idx)
        return with_stats(out, options.return_stats, bags.ids, valid)
    weight_spec, x_spec = resolve_layouts(
        bags.ids, layout_array(weight), mesh, **options.layout_kwargs()
    )
    if weight_spec is None:
        validate_scalars(plan_vocab, options.padding_idx, weight.shape[0])
        batch = bags.batch()
        out = _dense_bag(batch, options.combiner, weight, plan_vocab, options.padding_idx)
        valid = ragged.valid_slots(batch, plan_vocab, options.padding_idx)
        return with_stats(out, options.return_stats, bags.ids, valid)
    plan = plan_embedding_bag(
        mesh, bags.ids.shape, weight.shape,
        num_bags=None if bags.lengths is None else bags.lengths.shape[-1],
        combiner=options.combiner, weighted=bags.weights is not None, x_spec=x_spec,
        lengths_spec=companion_spec(bags.lengths, mesh, x_spec),
        weights_spec=companion_spec(bags.weights, mesh, x_spec),
        weight_spec=weight_spec, out_spec=options.out_spec, dtype=weight.dtype,
        ids_dtype=bags.ids.dtype, exchange=options.exchange, routed_pool=options.routed_pool,
        **options.plan_kwargs(),
    )  # fmt: skip
    if options.check_ids:
        _check_bag_ids(bags, plan.vocab_size)
    if bags.ids.size == 0:  # every bag empty: zeros, and no collective over zero slots
        out = zeros_like_output(
            plan.out_shape, weight.dtype, mesh, plan.out_spec, layout_array(weight),
            layout_array(table_specs(weight, plan.weight_spec)),
        )  # fmt: skip
        return with_stats(retype(out, plan.out_type_spec), options.return_stats, devices=mesh.size)
    operands = tuple(
        move(a, mesh, op.given) if not isinstance(a, jax.core.Tracer) else a
        for a, op in zip(bags.operands(), plan.operands, strict=True)
    )
    run = _run_jit if eager(operands, weight) else _run
    out, overflow, counts = run(plan, mesh, operands, weight)
    return (out, stats_of(overflow, counts)) if options.return_stats else out
