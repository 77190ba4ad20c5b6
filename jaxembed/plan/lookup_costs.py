"""What a lookup sends and holds: steps 5-7 of `jaxembed.plan.lookup`'s derivation.

`lookup_collectives` writes down the operands' moves, the forward's collectives and the
backward's transposes; `choose_lookup_exchange` prices the exchanges that resolve the table
gradient's partial sum over the batch axes B (`dense`, `rows`, `routed`) with the cost model
(`jaxembed.plan.cost`) and takes the cheapest (or the one forced); `lookup_memory` sums the
per-device buffers of what runs, the update's included (`update_buffers`,
`update_collectives`).
"""

from __future__ import annotations

import dataclasses
import math

from jaxembed import layout
from jaxembed.plan import cost
from jaxembed.plan.exchange import Geometry, choose_exchange
from jaxembed.plan.layouts import (
    GRAD_ACCUM_BYTES,
    collective,
    make_operand,
    move_collectives,
)
from jaxembed.plan.lookup_request import (
    ExchangeChoice,
    LookupCollectives,
    LookupLayout,
    PlanRequest,
)
from jaxembed.plan.moves import local_shape, plan_moves
from jaxembed.plan.routed import routed_option
from jaxembed.plan.specs import (
    itemsize,
    named,
    prod,
    spec_entries,
)
from jaxembed.plan.types import (
    Collective,
    MemoryEstimate,
)

__all__ = [
    "choose_lookup_exchange",
    "lookup_collectives",
    "lookup_memory",
    "lookup_operands",
    "operand_moves",
    "price_impl",
    "update_buffers",
    "update_collectives",
]


def lookup_operands(req: PlanRequest, lay: LookupLayout) -> list:
    """The batch operands (ids; a flat bag's lengths; a weighted bag's weights) with their
    moves into the body."""
    names, bag, x_shape = req.names, req.bag, req.x_shape
    operands = [make_operand("ids", x_shape, req.ids_dtype, lay.x_dm, lay.ids_entries)]
    if bag is not None and bag.form == "flat":
        lengths_shape = (*x_shape[:-1], bag.num_bags)
        l_dm = named(layout.to_dims_mapping(req.lengths_spec, names, len(lengths_shape)), names)
        operands.append(make_operand("lengths", lengths_shape, "int32", l_dm, lay.ids_entries))
    if bag is not None and bag.weighted:
        w_dm = named(layout.to_dims_mapping(req.weights_spec, names, len(x_shape)), names)
        operands.append(make_operand("weights", x_shape, "float32", w_dm, lay.ids_entries))
    return operands


def operand_moves(phase: str, operands, sizes, why) -> list[Collective]:
    """The collectives of the operands' moves into the body (`why(op)`: each one's reason)."""
    return [
        c for op in operands for c in move_collectives(
            phase, op.name, local_shape(op.shape, spec_entries(op.given), sizes), op.moves,
            sizes, op.dtype, why(op),
        )
    ]  # fmt: skip


def lookup_collectives(req: PlanRequest, lay: LookupLayout) -> LookupCollectives:
    """The forward's collectives (the ids' moves, `psum_scatter` / `psum` over R, the
    output's moves) and the backward's transposes of them."""
    sizes, dtype, hidden = req.sizes, req.dtype, lay.hidden
    e = itemsize(dtype)
    operands = lookup_operands(req, lay)
    out_moves = plan_moves(lay.body_entries, lay.out_entries)
    ids_local = local_shape(req.x_shape, lay.ids_entries, sizes)
    out_kept_local = (
        *local_shape(lay.out_batch, lay.kept, sizes), hidden // prod(lay.hidden_axes, sizes)
    )  # fmt: skip
    forward = operand_moves(
        "forward", operands, sizes,
        lambda op: f"{op.name} {op.given} -> {op.spec}: the ids move, the table stays",
    )  # fmt: skip
    shape = list(out_kept_local)
    transposes: list[Collective] = []
    for dim, axes in lay.scatters:
        k = prod(axes, sizes)
        before = tuple(shape)
        shape[dim] //= k
        wire = cost.ring_wire_bytes("reduce-scatter", k, math.prod(shape) * e)
        why = f"sum the row shards; out_spec splits axis {dim}"
        forward.append(collective("forward", "psum_scatter", axes, "out", shape, dtype, wire, why))
        wire = cost.ring_wire_bytes("all-gather", k, math.prod(before) * e)
        why = f"transpose of the forward psum_scatter on axis {dim}"
        transposes.insert(
            0,
            collective("backward", "all_gather", axes, "out_grad", before, dtype, wire, why),
        )
    if lay.psum_axes:
        k = prod(lay.psum_axes, sizes)
        wire = cost.ring_wire_bytes("all-reduce", k, math.prod(shape) * e)
        why = "sum the row shards (each holds its rows, zeros elsewhere)"
        op = "pmax" if req.is_max else "psum"
        forward.append(collective("forward", op, lay.psum_axes, "out", shape, dtype, wire, why))
        if req.is_max:  # which slot won each (bag, column): the earliest among the shards' maxima
            wire = cost.ring_wire_bytes("all-reduce", k, math.prod(shape) * 4)
            why = "the winning slot of each maximum, for the backward"
            forward.append(
                collective(
                    "forward",
                    "pmin",
                    lay.psum_axes,
                    "winners",
                    shape,
                    "int32",
                    wire,
                    why,
                )
            )
    forward += move_collectives(
        "forward", "out", tuple(shape), out_moves, sizes, dtype,
        f"out {lay.body_out_spec} -> {lay.out_spec}",
    )  # fmt: skip
    # The backward starts with the transpose of the output's moves: slices become gathers.
    grad_moves = plan_moves(lay.out_entries, lay.body_entries)
    out_local = local_shape((*lay.out_batch, hidden), lay.out_entries, sizes)
    grad_collectives = move_collectives(
        "backward", "out_grad", out_local, grad_moves, sizes, dtype,
        f"out_grad {lay.out_spec} -> {lay.body_out_spec}",
    )  # fmt: skip
    return LookupCollectives(
        operands=operands, out_moves=out_moves, grad_moves=grad_moves, forward=forward,
        transposes=grad_collectives + transposes, grad_collectives=grad_collectives,
        out_kept_local=out_kept_local, ids_local=ids_local,
    )  # fmt: skip


# --- step 3: the exchange over B, weighed by the cost model ------------------------------------


def price_impl(req: PlanRequest, lay: LookupLayout) -> str:
    """The kernels the cost model prices: a native update needs the hidden axis whole; over
    a split one only its dedup is native (`jaxembed.kernels.update`)."""
    if req.impl == "native" and req.update and lay.hidden_axes:
        return "native-dedup"
    return req.impl


def choose_lookup_exchange(
    req: PlanRequest, lay: LookupLayout, coll: LookupCollectives
) -> ExchangeChoice:
    """Weighs `dense`, `rows` and `routed` and takes the requested one or the cheapest; the
    routed exchange replaces the forward's ids moves and scatters with its own."""
    sizes, x_shape = req.sizes, req.x_shape
    batch_of_kept = (
        (d, tuple(a for a in k if a in lay.batch_axes)) for d, k in enumerate(lay.kept)
    )
    gathers = tuple((d, b) for d, b in batch_of_kept if b)
    geometry = Geometry(
        sizes=sizes, e=itemsize(req.dtype), e_ids=itemsize(req.ids_dtype), dtype=req.dtype,
        ids_dtype=req.ids_dtype, operands=coll.operands, ids_entries=lay.ids_entries,
        kept=lay.kept, bag_split=lay.bag_split, batch_axes=lay.batch_axes,
        out_kept_local=coll.out_kept_local, ids_local=coll.ids_local, num_rows=lay.num_rows,
        row_axes=lay.row_axes, hidden_local=coll.out_kept_local[-1], is_bag=req.bag is not None,
        is_max=req.is_max, gathers=gathers,
    )  # fmt: skip
    impl = price_impl(req, lay)
    out_gathers = [c for c in coll.forward if c.operand == "out" and c.op == "all_gather"]
    routed, routed_candidate, routed_operands = routed_option(
        scatters=lay.scatters, batch_axes=lay.batch_axes, row_axes=lay.row_axes,
        operands=coll.operands, ids_entries=lay.ids_entries, sizes=sizes, dtype=req.dtype,
        out_kept_local=coll.out_kept_local, names=req.names, is_bag=req.bag is not None,
        capacity=req.capacity, capacity_factor=req.capacity_factor, update=req.update,
        impl=impl, out_moves_collectives=out_gathers, grad_collectives=coll.grad_collectives,
        backend=req.backend, unreduced=lay.unreduced,
        pooled=req.bag is not None and not req.is_max, routed_pool=req.routed_pool,
    )  # fmt: skip
    exchange, reason, candidates, exchange_collectives, buffers = choose_exchange(
        req.exchange, geometry, coll.forward, coll.transposes, req.backend, update=req.update,
        extra={"routed": routed_candidate}, impl=impl,
    )  # fmt: skip
    operands, ids_entries, ids_local = coll.operands, lay.ids_entries, coll.ids_local
    forward, backward = coll.forward, coll.transposes + exchange_collectives
    if exchange == "routed":
        operands = routed_operands
        ids_entries = list(spec_entries(operands[0].spec))
        ids_local = local_shape(x_shape, ids_entries, sizes)
        forward = [
            *operand_moves("forward", operands, sizes, lambda op: f"{op.name} {op.given} -> "
                           f"{op.spec}"),
            *routed.forward,
            *out_gathers,
        ]  # fmt: skip
        backward = [*coll.grad_collectives, *routed.backward]
    else:
        routed = None
    choice = ExchangeChoice(
        exchange=exchange, reason=reason, candidates=candidates, operands=operands,
        ids_entries=ids_entries, ids_local=ids_local, forward=forward, backward=backward,
        buffers=buffers, routed=routed, gathers=gathers,
    )  # fmt: skip
    if req.update:  # the update starts from the ids as given, and may sum rows over K
        backward = update_collectives(req, lay, choice)
        choice = dataclasses.replace(choice, backward=backward)
    return choice


# --- step 4: the memory ----------------------------------------------------------------------


def lookup_memory(
    req: PlanRequest, lay: LookupLayout, coll: LookupCollectives, choice: ExchangeChoice
) -> MemoryEstimate:
    """Per-device bytes of the table shard, the ids, the output, the gradient shard (or the
    update's buffers and state) and the exchange's buffers."""
    sizes, slots = req.sizes, req.optimizer_slots
    e = itemsize(req.dtype)
    h_local = coll.out_kept_local[-1]
    grad_shard_shape = (lay.num_rows // prod(lay.row_axes, sizes), h_local)
    grad_shard = math.prod(grad_shard_shape) * GRAD_ACCUM_BYTES
    touched = choice.touched
    per_element = sum(1 for per_row in slots if not per_row)
    per_row = len(slots) - per_element
    return MemoryEstimate(
        table_shard=grad_shard // GRAD_ACCUM_BYTES * e,
        ids=math.prod(choice.ids_local) * itemsize(req.ids_dtype),
        out=math.prod(coll.out_kept_local) * e,
        weight_grad_f32=0 if req.update else grad_shard,
        exchange_buffers=choice.buffers,
        touched_rows=touched,
        update_buffers=update_buffers(
            req.update,
            req.impl,
            lay.hidden_axes,
            touched,
            h_local,
            per_element,
            per_row,
        ),
        state_bytes=grad_shard_shape[0] * (h_local * per_element + per_row) * 4,
    )


def update_buffers(update, impl, hidden_axes, touched, h_local, per_element, per_row) -> int:
    """A row-sparse update's transient bytes per device, float32 and int32, over the M slots
    it touches. The native update (hidden axis whole) fuses the bag's backward into the
    update: only each slot's local row, flag, bag and factor are materialized. XLA's holds
    the slots' gradients, their per-row sums, the rows and state it gathers and the new
    ones (`[M, H/K]` each), and its dedup's sort keys, order and positions (`[M]` each)."""
    if not update:
        return 0
    if impl == "native" and not hidden_axes:
        return touched * 4 * 4
    return touched * (h_local * (4 + per_element) + per_row + 6) * 4


def update_collectives(
    req: PlanRequest, lay: LookupLayout, choice: ExchangeChoice
) -> list[Collective]:
    """A row-sparse update's collectives: the ids' moves into its body, a max bag's winners
    (recomputed: the forward's pmax and pmin), the backward's, and the `psum` over the
    hidden axes of each touched row's sum of g² for a one-per-row state."""
    sizes = req.sizes
    moves = operand_moves(
        "backward",
        choice.operands,
        sizes,
        lambda op: f"the update moves {op.name} into its body",
    )
    winners = [dataclasses.replace(c, phase="backward") for c in choice.forward
               if req.is_max and c.op in ("pmax", "pmin")]  # fmt: skip
    rows = []
    if lay.hidden_axes and any(req.optimizer_slots):
        k = prod(lay.hidden_axes, sizes)
        wire = cost.ring_wire_bytes("all-reduce", k, choice.touched * GRAD_ACCUM_BYTES)
        why = "each touched row's sum of g² over the split hidden axis (one-per-row state)"
        rows.append(collective("backward", "psum", lay.hidden_axes, "row_sum", (choice.touched,),
                               "float32", wire, why))  # fmt: skip
    return [*moves, *winners, *choice.backward, *rows]
