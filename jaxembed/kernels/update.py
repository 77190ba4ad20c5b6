"""The row-sparse update as one `shard_map`: backward and optimizer fused, in the table's layout.

`sparse_update(plan, formula, mesh, table, slots, count, operands, out_grad)` runs, on every
device, what the backward of the lookup (or bag lookup) runs up to the gradient's exchange,
and then, instead of a scatter-add into a zero shard, `jaxembed.kernels.sparse.apply_rows`:
dedup, gather the rows and their state, the formula, scatter back. The plan's exchange is
`rows` (or `none`): the batch's partial sum is resolved by moving ids and output gradients,
never by an all-reduce of a table-shaped buffer.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxembed.kernels import local as local_ops
from jaxembed.kernels import routed as routed_ops
from jaxembed.kernels.bag import exchanged_slot_grads, moved_bags, pool
from jaxembed.kernels.lookup import out_grad_to_body
from jaxembed.kernels.reshard import apply_moves, gather
from jaxembed.kernels.sparse import apply_rows
from jaxembed.plan import EmbeddingPlan

__all__ = ["sparse_update"]


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
    if plan.exchange == "rows":
        for dim, axes in plan.batch_gathers:
            ids = gather(ids, axes, dim)
            out_grad = gather(out_grad, axes, dim)
    return consume(*local_ops.local_rows(plan, ids), out_grad), jnp.zeros((), jnp.int32)


def _update_body(plan: EmbeddingPlan, formula: Any, num_slots: int, *arrays):
    """`((table, slots), overflow)`: the updated shard and state, and whether the routed
    exchange fell back to the gather exchange in this step."""
    # table f[V/R, H/K], slots f32[V/R(, H/K)]..., count i32[], operands as given, out_grad
    table, *rest = arrays
    slots, (count, *given, out_grad) = tuple(rest[:num_slots]), rest[num_slots:]
    hidden_local = table.shape[1]

    native = local_ops.native_update(plan)
    apply = local_ops.kernels_for(plan).apply_rows if native else apply_rows
    if not native and plan.impl == "native":  # a split hidden axis: only the dedup is native
        apply = functools.partial(apply_rows, dedup=local_ops.kernels_for(plan).dedup_rows)

    def consume(local, here, grads):
        return apply(
            formula, table, slots, count, local.reshape(-1), here.reshape(-1),
            grads.reshape(-1, hidden_local), hidden_axes=plan.hidden_axes,
            hidden_size=plan.weight_shape[1],
        )  # fmt: skip

    if plan.bag is None:
        return _plain_update(plan, given, out_grad, consume)
    bags = moved_bags(plan, given)
    winners = pool(plan, bags, table)[1] if plan.bag.combiner == "max" else None
    fused = None
    if native:

        def fused(s, og):  # the bag's backward and the update in one pass, no [M, H] buffer
            return local_ops.kernels_for(plan).bag_apply_rows(
                formula, table, slots, count, s.local, s.here, s.segment, s.scale, og,
                hidden_size=plan.weight_shape[1],
            )  # fmt: skip

    return exchanged_slot_grads(plan, bags, out_grad, winners, consume, fused=fused)


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
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
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

    Returns:
      `((table, slots), overflow)`: the new table and slots in their own layouts, and an
      int32[] that is 1 when the routed exchange fell back this step.
    """
    from jax.sharding import PartitionSpec as P

    slot_specs = tuple(slot_spec(plan, s.per_row) for s in formula.slots)
    in_specs = (
        plan.weight_spec, *slot_specs, P(), *(op.given for op in plan.operands), ct_spec,
    )  # fmt: skip
    body = jax.shard_map(
        functools.partial(_update_body, plan, formula, len(slots)),
        mesh=mesh,
        in_specs=in_specs,
        out_specs=((plan.weight_spec, slot_specs), P()),
        check_vma=True,
    )
    return body(table, *slots, count, *operands, out_grad)
