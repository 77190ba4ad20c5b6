"""The row-sparse update as one `shard_map`: backward and optimizer fused, in the table's layout.

`sparse_update(plan, formula, mesh, table, slots, count, operands, out_grad)` runs, on every
device, what the backward of the lookup (or bag lookup) runs up to the gradient's exchange,
and then, instead of a scatter-add into a zero shard, `jaxembed.kernels.sparse.apply_rows`:
dedup, gather the rows and their state, the formula, scatter back. The plan's exchange is
`rows` (or `none`): the batch's partial sum is resolved by moving ids and output gradients,
or, where the table is small beside the batch (the cost model's choice, or
`exchange="dense"`), by a `psum` over the batch axes of each device's gradient shard and of
each row's count of slots, after which every device updates the rows any device's batch
read: a replicated table's update then walks each device's own slots, not the whole batch's.

`after(x, *reads)` orders the update after the step's reads of the table (see its docstring).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxembed.kernels import local as local_ops
from jaxembed.kernels import routed as routed_ops
from jaxembed.kernels.arrays import conform, retype
from jaxembed.kernels.bag import bag_slots, exchanged_slot_grads, moved_bags, pool
from jaxembed.kernels.common import counts_spec, device_count, out_grad_to_body
from jaxembed.kernels.reshard import apply_moves, gather
from jaxembed.kernels.select import kernels_for, native_update
from jaxembed.kernels.sparse import apply_rows
from jaxembed.plan import EmbeddingPlan

__all__ = ["after", "distinct_rows", "sparse_update", "update_body"]


def _plain_update(plan: EmbeddingPlan, given, out_grad, consume):
    ids = apply_moves(given[0], plan.ids_operand.moves)  # i32[*batch / ids_spec]
    if plan.exchange == "routed":
        out_grad = apply_moves(out_grad, plan.grad_moves)  # f[*batch / ids_spec, H/K]
        flat = ids.reshape(-1)
        buckets = routed_ops.bucketize(plan, flat, local_ops.reads_a_row(
            flat, plan.vocab_size, plan.padding_idx))  # fmt: skip

        def routed(_):
            owner_ids, grads = routed_ops.route_grads(
                plan, buckets, out_grad.reshape(flat.shape[0], -1)
            )
            local, here = local_ops.local_rows(plan, owner_ids)
            return consume(local, here & (owner_ids >= 0), grads)

        def fallback(_):
            axes, dim = plan.routed.axes, plan.routed.dim
            whole = gather(ids, axes, dim)
            return consume(*local_ops.local_rows(plan, whole), gather(out_grad, axes, dim))

        overflow = routed_ops.overflowed(buckets, plan.mesh_names)
        return jax.lax.cond(overflow, fallback, routed, None), overflow.astype(jnp.int32)
    out_grad = out_grad_to_body(plan, out_grad)  # f[*batch / ids_spec, H/K]
    if plan.exchange == "dense":  # this device's slots into a gradient shard, summed over B
        local, here = local_ops.local_rows(plan, ids)
        grad = routed_ops.scatter_grads(plan, local, here, out_grad)  # f32[V/R, H/K]
        return consume(*_dense_exchange(plan, local, here, grad)), jnp.zeros((), jnp.int32)
    if plan.exchange == "rows":
        for dim, axes in plan.batch_gathers:
            ids = gather(ids, axes, dim)
            out_grad = gather(out_grad, axes, dim)
    return consume(*local_ops.local_rows(plan, ids), out_grad), jnp.zeros((), jnp.int32)


def _dense_exchange(plan: EmbeddingPlan, local: jax.Array, here: jax.Array, grad: jax.Array):
    """The dense exchange of an update: this device's gradient shard `grad` f32[V/R, H/K]
    (its own slots, `local` where `here`) and each row's count of slots summed over the
    batch axes B. Returns `(rows, touched, grad)`: every row of the shard i32[V/R], whether
    any device's batch read it, and the whole batch's gradient, what `consume` updates."""
    num_rows = grad.shape[0]
    at = jnp.where(here, local, num_rows).reshape(-1)  # i32[M], V/R: read nothing here
    count = jnp.zeros((num_rows,), jnp.int32).at[at].add(1, mode="drop")  # i32[V/R]
    count = jax.lax.psum(count, plan.batch_axes)  # every device's slots of each row
    grad = jax.lax.psum(grad, plan.batch_axes)  # f32[V/R, H/K], the batch's gradient
    return jnp.arange(num_rows, dtype=jnp.int32), count > 0, grad


def distinct_rows(local: jax.Array, here: jax.Array, num_rows: int) -> jax.Array:
    """int32[]: how many distinct rows of a `num_rows`-row shard the slots `local` (where
    `here`) name: the rows an update writes. One scatter into `[num_rows]` flags."""
    hit = jnp.zeros((num_rows + 1,), jnp.bool_)
    hit = hit.at[jnp.where(here, local, num_rows).reshape(-1)].set(True, mode="drop")
    return jnp.sum(hit[:num_rows], dtype=jnp.int32)


def update_body(plan: EmbeddingPlan, formula: Any, num_slots: int, *arrays,
                count_rows: bool = False):  # fmt: skip
    """`((table, slots), overflow, rows)`: the updated shard and state, whether the routed
    exchange fell back to the gather exchange in this step, and (`count_rows`) the distinct
    rows this device updated, int32[1] (zero when not counted).

    The body of `sparse_update`, on one device's blocks; a one-device update (no mesh) calls
    it as it is, without a `shard_map`.
    """
    # table f[V/R, H/K], slots f32[V/R(, H/K)]..., count i32[], operands as given, out_grad
    table, *rest = arrays
    slots, (count, *given, out_grad) = tuple(rest[:num_slots]), rest[num_slots:]
    hidden_local = table.shape[1]

    native = native_update(plan)
    apply = kernels_for(plan).apply_rows if native else apply_rows
    if not native and plan.impl == "native":  # a split hidden axis: only the dedup is native
        apply = functools.partial(apply_rows, dedup=kernels_for(plan).dedup_rows)

    def rows(local, here):  # the distinct rows written here, when counted
        if not count_rows:
            return jnp.zeros((), jnp.int32)
        return distinct_rows(local, here, table.shape[0])

    def consume(local, here, grads):  # grads: f[..., H/K], or the routed exchange's pieces
        if native and isinstance(grads, list | tuple):  # read where the all_to_all left them
            new = kernels_for(plan).apply_rows_pieces(
                formula, table, slots, count, local.reshape(-1), here.reshape(-1), grads,
                hidden_size=plan.weight_shape[1],
            )  # fmt: skip
            return new, rows(local, here)
        new = apply(
            formula, table, slots, count, local.reshape(-1), here.reshape(-1),
            routed_ops.joined(grads).reshape(-1, hidden_local), hidden_axes=plan.hidden_axes,
            hidden_size=plan.weight_shape[1],
        )  # fmt: skip
        return new, rows(local, here)

    if plan.bag is None:
        (new, written), overflow = _plain_update(plan, given, out_grad, consume)
        return new, overflow, device_count(plan, written)
    bags = moved_bags(plan, given)
    winners = pool(plan, bags, table)[1] if plan.bag.combiner == "max" else None
    if plan.exchange == "dense":  # this device's bags into a gradient shard, summed over B
        s = bag_slots(plan, bags)
        scatter = functools.partial(routed_ops.scatter_grads, plan)
        fused_scatter = None
        if plan.impl == "native":  # the bag's backward into the shard, no [M, H] buffer

            def fused_scatter(s, og):
                return kernels_for(plan).bag_scatter_add(
                    plan.table_shard_shape, s.local, s.here, s.segment, s.scale, og
                )

        grad, _ = exchanged_slot_grads(
            plan, bags, out_grad, winners, scatter, fused=fused_scatter
        )  # f32[V/R, H/K]
        new, written = consume(*_dense_exchange(plan, s.local, s.here, grad))
        return new, jnp.zeros((), jnp.int32), device_count(plan, written)
    fused = None
    if native:

        def fused(s, og):  # the bag's backward and the update in one pass, no [M, H] buffer
            new = kernels_for(plan).bag_apply_rows(
                formula, table, slots, count, s.local, s.here, s.segment, s.scale, og,
                hidden_size=plan.weight_shape[1],
            )  # fmt: skip
            return new, rows(s.local, s.here)

    (new, written), overflow = exchanged_slot_grads(
        plan, bags, out_grad, winners, consume, fused=fused
    )
    return new, overflow, device_count(plan, written)


def slot_spec(plan: EmbeddingPlan, per_row: bool):
    """The layout of an optimizer state slot: the table's, or its rows' alone."""
    from jax.sharding import PartitionSpec as P

    return P(plan.weight_spec[0]) if per_row else plan.weight_spec


def sparse_update(
    plan: EmbeddingPlan,
    formula: Any,
    mesh: Any,
    table: jax.Array,
    slots: tuple[jax.Array, ...],
    count: jax.Array,
    operands: tuple[jax.Array, ...],
    out_grad: jax.Array,
    ct_spec: Any,
    count_rows: bool = False,
) -> tuple[tuple[jax.Array, tuple[jax.Array, ...]], jax.Array, jax.Array]:
    """Runs the fused backward + update of `plan` with `formula` on `mesh`.

    Args:
      plan: the lookup's plan, made for an update (its exchange is `rows` or `none`).
      formula: a `jaxembed.optim.formulas.RowFormula`.
      mesh: the mesh.
      table: the table, in `plan.weight_spec`.
      slots: the optimizer state, one array per formula slot, in the table's layout (per-row
        slots: its rows' layout).
      count: int32[], updates applied before this one.
      operands: the batch operands as given (ids; for bags lengths and weights).
      out_grad: d loss / d output, in `ct_spec` (the lookup's output layout).
      ct_spec: out_grad's layout.
      count_rows: count each device's distinct rows updated (else zeros).

    Returns:
      `((table, slots), overflow, rows)`: the new table and slots in their own layouts, an
      int32[] that is 1 when the routed exchange fell back this step, and int32[devices],
      the distinct rows each device updated, in the mesh's device order.
    """
    from jax.sharding import PartitionSpec as P

    slot_specs = tuple(slot_spec(plan, s.per_row) for s in formula.slots)
    in_specs = (
        plan.weight_spec, *slot_specs, P(), *(op.given for op in plan.operands), ct_spec,
    )  # fmt: skip
    body = jax.shard_map(
        functools.partial(update_body, plan, formula, len(slots), count_rows=count_rows),
        mesh=mesh,
        in_specs=in_specs,
        out_specs=((plan.weight_spec, slot_specs), P(), P(counts_spec(plan)[0])),
        check_vma=True,
    )
    # The plan names no axis of size 1; the arrays' Explicit types may (free either way).
    given = (table, *slots, count, *operands, out_grad)
    (new_table, new_slots), overflow, rows = body(
        *(conform(a, mesh, spec) for a, spec in zip(given, in_specs, strict=True))
    )
    new_table = retype(new_table, _type_spec(table))
    new_slots = tuple(retype(n, _type_spec(o)) for n, o in zip(new_slots, slots, strict=True))
    return (new_table, new_slots), overflow, rows


def _type_spec(a: jax.Array) -> Any:
    """`a`'s Explicit type's spec, or None where its type names no layout."""
    typed = jax.typeof(a).sharding
    mesh = getattr(typed, "mesh", None)
    if mesh is None or mesh.empty:
        return None
    return typed.spec


def after(x: Any, *reads: Any) -> Any:
    """`x` unchanged, but computed only once every array of `reads` is: an ordering in a step.

    A donated table is updated in place only if XLA can order every read of its old value
    before the update's write. When the update does not depend on the forward (a linear loss,
    a fixed cotangent), nothing orders the forward's gather first and XLA copies the whole
    table, every step. `opt.update(..., after=out)` and the training helpers pass the update's
    gradient through `after`, which makes it depend on the reads by data, exactly: a select of
    `x` on a predicate that is true for every value (NaN and inf included), computed from the
    reads' bits. `jax.lax.optimization_barrier` is no such ordering: XLA's CPU pipeline
    removes it before it inserts the copies.

    A read with `x`'s structure, shapes and layouts (the lookup's outputs, for their
    gradients) orders each leaf of `x` after its own counterpart, elementwise: no collective.
    Any other read orders every leaf through one scalar: free for a scalar (the loss), else a
    pass over the read and, when it is sharded, an all-reduce of one flag.

    Args:
      x: an array or a pytree of arrays (the update's `out_grad`, or several).
      *reads: arrays or pytrees of arrays the step computes from the old table (the lookup's
        outputs, the loss).

    Returns:
      `x`, bitwise, with the dependence.

    Examples:
      >>> import jax.numpy as jnp
      >>> g = after(jnp.ones(3), jnp.array([jnp.nan, jnp.inf, -0.0]))
      >>> g.tolist()
      [1.0, 1.0, 1.0]
    """
    if not reads:
        return x
    leaves, treedef = jax.tree.flatten(x)
    leaves = [jnp.asarray(a) for a in leaves]
    paired: list[list[jax.Array]] = [[] for _ in leaves]
    shared = None
    for read in reads:
        read_leaves, read_def = jax.tree.flatten(read)
        read_leaves = [jnp.asarray(r) for r in read_leaves if hasattr(r, "shape")]
        if _same_layout(read_def, read_leaves, treedef, leaves):
            for flags, r in zip(paired, read_leaves, strict=True):
                flags.append(_always_true(r))
            continue
        for r in read_leaves:
            if r.size:
                flag = jnp.all(_always_true(r)) if r.ndim else _always_true(r)
                shared = flag if shared is None else shared & flag
    out = []
    for a, flags in zip(leaves, paired, strict=True):
        flags = flags if shared is None else [*flags, shared]
        if flags:
            a = jnp.where(functools.reduce(jnp.logical_and, flags), a, jnp.zeros_like(a))
        out.append(a)
    return jax.tree.unflatten(treedef, out)


def _always_true(read: Any) -> jax.Array:
    """True at every element, but computed from `read`'s bits (XLA cannot fold it away)."""
    read = jnp.asarray(read)
    if jnp.issubdtype(read.dtype, jnp.inexact):
        bits = jax.lax.bitcast_convert_type(jnp.real(read).astype(jnp.float32), jnp.uint32)
    else:
        bits = read.astype(jnp.uint32)
    return (bits | jnp.uint32(0x7FFFFFFF)) != 0


def _same_layout(read_def, read_leaves, treedef, leaves) -> bool:
    """Whether a read pairs leaf by leaf with `x` (same structure, shapes and layouts)."""
    return (read_def == treedef and len(read_leaves) == len(leaves) and all(
        r.shape == a.shape and _spec(r) == _spec(a)
        for r, a in zip(read_leaves, leaves, strict=True)))  # fmt: skip


def _spec(a: jax.Array) -> Any:
    return getattr(jax.typeof(a).sharding, "spec", None)
