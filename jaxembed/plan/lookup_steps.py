"""The named steps of a lookup's plan run in order, and step 8, FSDP's weight gather.

`plan_request` (cached on the normalized `PlanRequest`) runs `lookup_layout`, then
`assemble_plan` (`lookup_collectives`, `choose_lookup_exchange`, `lookup_memory` and the
`EmbeddingPlan` itself); where the table's hidden axes also split the output's batch
(`weighs_a_gather`), `gather_option` plans the same lookup on the table gathered over them and
the cheaper move in bytes is the plan (`jaxembed.plan.table_moves.choose_move`).
"""

from __future__ import annotations

import dataclasses
import functools

from jax.sharding import PartitionSpec as P

from jaxembed.plan import cost
from jaxembed.plan.layouts import (
    GRAD_ACCUM_BYTES,
    collective,
)
from jaxembed.plan.lookup_costs import (
    choose_lookup_exchange,
    lookup_collectives,
    lookup_memory,
)
from jaxembed.plan.lookup_request import (
    ExchangeChoice,
    LookupCollectives,
    LookupLayout,
    PlanRequest,
    lookup_layout,
)
from jaxembed.plan.specs import (
    entries_spec,
    itemsize,
    prod,
)
from jaxembed.plan.table_moves import choose_move
from jaxembed.plan.types import (
    EmbeddingPlan,
)

__all__ = [
    "assemble_plan",
    "gather_option",
    "plan_request",
    "weighs_a_gather",
]


@functools.lru_cache(maxsize=512)
def plan_request(req: PlanRequest) -> EmbeddingPlan:
    """The plan of a normalized request, in named steps (cached).

    `lookup_layout` (validate, the output's layout, the body's, the rules), then
    `lookup_collectives` (the operands' moves, the forward's collectives and the backward's
    transposes), `choose_lookup_exchange` (the exchange over B and its bytes),
    `lookup_memory`, and the plan itself (`assemble_plan`). Where the table's hidden axes
    split the batch too, the weight gather (`gather_option`) is priced beside it and the
    cheaper taken (`jaxembed.plan.table_moves.choose_move`).
    """
    lay = lookup_layout(req)
    plan = assemble_plan(req, lay)
    if not weighs_a_gather(req, lay):
        if req.table_move == "gather":
            raise ValueError(_no_gather_message(lay, _not_weighed(req, lay)))
        return plan
    plans, refused = {"none": plan}, ""
    gathered = gather_option(req, lay, plan.out_spec)
    if isinstance(gathered, str):
        refused = gathered
    else:
        plans["gather"] = gathered
    if req.table_move == "gather" and "gather" not in plans:
        raise ValueError(_no_gather_message(lay, refused))
    costs = {m: (p.wire_bytes, p.memory.peak_bytes) for m, p in plans.items()}
    move, why, alternatives = choose_move(req.table_move, costs, refused)
    return dataclasses.replace(
        plans[move], table_move=move, move_reason=why, move_alternatives=alternatives
    )


def assemble_plan(
    req: PlanRequest,
    lay: LookupLayout,
    coll: LookupCollectives | None = None,
    choice: ExchangeChoice | None = None,
) -> EmbeddingPlan:
    """The `EmbeddingPlan` of a request's layout, its collectives and its exchange (the
    steps after `lookup_layout` run here when not given)."""
    coll = lookup_collectives(req, lay) if coll is None else coll
    choice = choose_lookup_exchange(req, lay, coll) if choice is None else choice
    return EmbeddingPlan(
        mesh_axes=tuple(req.mesh_axes),
        x_shape=req.x_shape,
        weight_shape=(lay.num_rows, lay.hidden),
        vocab_size=lay.vocab_size,
        padding_idx=None if req.padding_idx is None else int(req.padding_idx),
        dtype=req.dtype,
        ids_dtype=req.ids_dtype,
        x_spec=entries_spec(lay.x_dm),
        ids_spec=entries_spec(choice.ids_entries),
        weight_spec=entries_spec((lay.row_axes, lay.hidden_axes)),
        body_out_spec=lay.body_out_spec,
        out_spec=lay.out_spec,
        row_axes=lay.row_axes,
        hidden_axes=lay.hidden_axes,
        batch_axes=lay.batch_axes,
        scatters=tuple(lay.scatters),
        psum_axes=lay.psum_axes,
        unreduced_axes=lay.unreduced,
        bag_split_axes=lay.bag_split,
        batch_gathers=choice.gathers,
        exchange=choice.exchange,
        exchange_reason=choice.reason,
        candidates=choice.candidates,
        operands=tuple(choice.operands),
        out_moves=coll.out_moves,
        grad_moves=coll.grad_moves,
        forward=tuple(choice.forward),
        backward=tuple(choice.backward),
        memory=lookup_memory(req, lay, coll, choice),
        forward_rule=lay.forward_rule,
        grad_rule=lay.grad_rule,
        bag=req.bag,
        row_sharding=req.row_sharding,
        backend=req.backend,
        for_update=req.update,
        routed=choice.routed,
        impl=req.impl,
    )


# --- the weight gather: the table's shard whole over G for the step ---------------------------


def weighs_a_gather(req: PlanRequest, lay: LookupLayout) -> bool:
    """Whether the plan weighs the weight gather: a plain lookup (no bag, no update) whose
    table's hidden axes split the ids' or the output's batch too (a conflict the `"none"`
    move resolves by moving the ids and the output)."""
    if req.bag is not None or req.update or not lay.hidden_axes:
        return False
    batch = {a for e in (*lay.x_dm, *lay.out_entries[:-1]) for a in e}
    return bool(batch & set(lay.hidden_axes))


def _not_weighed(req: PlanRequest, lay: LookupLayout) -> str:
    if req.bag is not None or req.update:
        return "only a plain lookup's plan gathers its table (not a bag's, not an update's)"
    if not lay.hidden_axes:
        return "the table's hidden axis is not split: there is nothing to gather"
    return f"neither the ids nor the output split their batch over {lay.hidden_axes}"


def _no_gather_message(lay: LookupLayout, why: str) -> str:
    return (
        f"table_move='gather' needs the table's hidden axes split over mesh axes that also "
        f"split the output's batch, but {why}: ids {entries_spec(lay.x_dm)}, table "
        f"{entries_spec((lay.row_axes, lay.hidden_axes))}, output {lay.out_spec}; pass an "
        f"out_spec whose batch is split over {lay.hidden_axes or 'them'}, or "
        "table_move='none' (or 'auto')"
    )


def gather_option(req: PlanRequest, lay: LookupLayout, out_spec: P) -> EmbeddingPlan | str:
    """The plan with the weight gather, reaching the same output `out_spec` as the plan
    without it, or why it does not apply.

    G is the table's hidden axes that the output's batch uses; they must be the minor end of
    K (a tiled all_gather over them leaves the shard contiguous). The body is the lookup of
    a table laid out `(R, K less G)`, planned by the same steps (rules, moves, exchange), with
    the table's all_gather over G first in the forward; the gradient, partial over G (the
    rules say so), is reduce-scattered over G back into the table's own layout, and the
    exchange resolves the rest of the batch axes only.
    """
    sizes, hidden_axes = req.sizes, lay.hidden_axes
    used = {a for e in lay.out_entries[:-1] for a in e}
    gathered = tuple(a for a in hidden_axes if a in used)
    if not gathered:
        return (
            f"the output {out_spec} does not split its batch over the table's hidden axes "
            f"{hidden_axes}: pass an out_spec whose batch is, as FSDP programs lay "
            "activations out"
        )
    kept = hidden_axes[: len(hidden_axes) - len(gathered)]
    if kept + gathered != hidden_axes:
        return (
            f"the output's batch uses {gathered} of the table's hidden axes {hidden_axes}, "
            "not their minor end (a gather over them would not leave a contiguous shard)"
        )
    body = dataclasses.replace(
        req,
        weight_spec=entries_spec((lay.row_axes, kept)),
        out_spec=out_spec,
        table_move="none",
    )
    body_lay = lookup_layout(body)
    missing = [a for a in gathered if a not in body_lay.batch_axes]
    if missing:
        return (
            f"the body's batch is not split over {tuple(missing)} (gathering the table there "
            "would not make each device's share of the work smaller)"
        )
    body_lay = dataclasses.replace(
        body_lay, batch_axes=tuple(a for a in body_lay.batch_axes if a not in gathered)
    )
    coll = lookup_collectives(body, body_lay)
    choice = choose_lookup_exchange(body, body_lay, coll)
    if choice.exchange == "routed":
        return "the routed exchange with a gathered table is not built"
    if not body_lay.batch_axes:
        choice = dataclasses.replace(
            choice, reason=f"the gradient's sum over {gathered} is the weight gather's "
            "reduce-scatter; no other axis splits the batch",
        )  # fmt: skip
    plan = assemble_plan(body, body_lay, coll, choice)
    rows, e, n = plan.rows_per_shard, itemsize(req.dtype), prod(gathered, sizes)
    h_body = lay.hidden // prod(kept, sizes)
    h_own = h_body // n
    wire = cost.ring_wire_bytes("all-gather", n, rows * h_body * e)
    why = f"the weight gather: the table's shard whole over {gathered} for the step"
    table = collective("forward", "all_gather", gathered, "table", (rows, h_body), req.dtype,
                       wire, why)  # fmt: skip
    wire = cost.ring_wire_bytes("reduce-scatter", n, rows * h_own * GRAD_ACCUM_BYTES)
    why = f"the weight gather's transpose: the gradient summed over {gathered}, split back"
    grad = collective("backward", "psum_scatter", gathered, "weight_grad", (rows, h_own),
                      "float32", wire, why)  # fmt: skip
    memory = dataclasses.replace(
        plan.memory, table_shard=rows * h_own * e, gathered_table=rows * h_body * e
    )
    return dataclasses.replace(
        plan, weight_spec=entries_spec((lay.row_axes, hidden_axes)), hidden_axes=hidden_axes,
        gathered_axes=gathered, forward=(table, *plan.forward), backward=(*plan.backward, grad),
        memory=memory,
    )  # fmt: skip


# --- step 1: validate, and the layouts -------------------------------------------------------
