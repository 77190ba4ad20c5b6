"""The execution plan of a sharded lookup or bag lookup: layouts, collectives, bytes, memory.

`plan_embedding` and `plan_embedding_bag` ask the rules (`jaxembed.rules`) how the lookup
must be laid out, resolve what they call a conflict by moving the ids or the output gradient
(or, FSDP's weight gather, when it sends fewer bytes, the table's shard for the step), and
write down every collective of the forward and the backward with its mesh axes and its bytes.
The kernels (`jaxembed.kernels`) execute a plan; they decide nothing themselves.

Derivation, with R the mesh axes that split the table's rows and K those that split its
hidden axis, in named steps (`plan_request` runs them on a normalized `PlanRequest`; the
layouts' own functions are in `jaxembed.plan.layouts`):

1. **table**: R and K from the table's spec; the rows must divide over R.
2. **output**: the requested `out_spec`, or the ids' layout with K appended.
3. **body**: the ids run in the layout the output asks for, restricted to the *free* mesh
   axes (outside R, K and the output's unreduced axes): per output batch axis, the longest
   prefix of the output's mesh axes that are free. The ids move there inside the kernel
   (`jaxembed.plan.moves`: all_gathers, free slices). Row axes right after the prefix become
   a `psum_scatter` (sequence parallel). A pooled axis (a bag's ids) is never split.
4. **rules**: the forward rule says the local lookup is partial over R; the gradient rule
   says the table's gradient is partial over B, the mesh axes that split the output's batch
   inside the kernel. The plan takes both from the rules.
5. **forward**: ids moves; `psum_scatter` / `psum` over R; the output's move to `out_spec`.
6. **backward**: the transposes, then the cheapest of the exchanges that resolve the
   gradient's partial sum over B (`dense`, `rows`; `routed` when ids and rows share mesh
   axes), chosen by the cost model (`jaxembed.plan.cost`) or forced.
7. **memory**: the per-device buffers of what runs.

Steps 1-4 are `lookup_layout` (`validate_request` first), 5 and the backward's transposes
`lookup_collectives`, 6 `choose_lookup_exchange` (with `routed_option` of
`jaxembed.plan.routed`), 7 `lookup_memory`.

8. **table move**: where K also splits the output's batch (FSDP: table `P("tensor",
   "fsdp")`, output `P("fsdp", ...)`), `gather_option` plans the same lookup on the table
   gathered over those axes G (`(R, K less G)`, by steps 1-7), with the table's `all_gather`
   first and the gradient's `psum_scatter` over G last; the cheaper of the two moves in bytes
   (`jaxembed.plan.table_moves.choose_move`, shared with the loss's plan) is the plan.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from jax.sharding import PartitionSpec as P

from jaxembed import layout, rules
from jaxembed.plan import cost
from jaxembed.plan.exchange import Geometry, choose_exchange
from jaxembed.plan.impl import resolve_impl
from jaxembed.plan.layouts import (
    GRAD_ACCUM_BYTES,
    ask_rules,
    body_layout,
    collective,
    make_operand,
    move_collectives,
    output_layout,
    table_layout,
)
from jaxembed.plan.moves import local_shape, plan_moves
from jaxembed.plan.routed import routed_option
from jaxembed.plan.specs import (
    as_spec,
    backend_of,
    check_divides,
    drop_unit_axes,
    entries_spec,
    is_explicit_mesh,
    itemsize,
    mesh_sizes,
    named,
    prod,
    spec_entries,
    validate_scalars,
)
from jaxembed.plan.table_moves import check_table_move, choose_move
from jaxembed.plan.types import (
    COMBINERS,
    BagGeometry,
    Collective,
    EmbeddingPlan,
    MemoryEstimate,
)

__all__ = [
    "Exchange",
    "ExchangeChoice",
    "LookupCollectives",
    "LookupLayout",
    "PlanRequest",
    "assemble_plan",
    "check_choices",
    "choose_lookup_exchange",
    "gather_option",
    "lookup_collectives",
    "lookup_layout",
    "lookup_memory",
    "plan_embedding",
    "plan_embedding_bag",
    "plan_request",
    "weighs_a_gather",
]

Exchange = Literal["auto", "dense", "rows", "routed"]
_EXCHANGES = ("auto", "dense", "rows", "routed")
_ROUTED_POOLS = ("auto", "source", "owner")


# --- the plan -----------------------------------------------------------------------------


def plan_embedding(
    mesh: Any,
    x_shape: Sequence[int],
    weight_shape: Sequence[int],
    *,
    x_spec: Any = None,
    weight_spec: Any = None,
    out_spec: Any = None,
    padding_idx: int | None = None,
    vocab_size: int | None = None,
    dtype: Any = np.float32,
    ids_dtype: Any = np.int32,
    exchange: Exchange = "auto",
    gradient_exchange: Exchange | None = None,
    row_sharding: str = "block",
    backend: str | None = None,
    update: bool = False,
    capacity: int | None = None,
    capacity_factor: float | None = None,
    impl: str = "auto",
    optimizer_slots: Sequence[bool] = (),
    table_move: str = "auto",
) -> EmbeddingPlan:
    """Plans a sharded lookup `weight[x]` and its gradient on `mesh`.

    Args:
      mesh: a `jax.sharding.Mesh` or `AbstractMesh`.
      x_shape: global shape of the ids, any rank.
      weight_shape: global shape of the table `[vocab (padded), hidden]`.
      x_spec: the ids' `PartitionSpec` (None: replicated).
      weight_spec: the table's `PartitionSpec` (None: replicated). Never changed.
      out_spec: the output's `PartitionSpec`; `unreduced={...}` keeps partial sums over row
        axes (Explicit meshes only). None: the ids' layout plus the table's hidden split.
      padding_idx: an id in `[0, vocab_size)` whose row reads as zero and gets no gradient.
      vocab_size: the real rows (default `weight_shape[0]`); rows past it are padding.
      dtype: the table's element type; ids_dtype: the ids'.
      exchange: `"auto"` (the cost model's choice), `"dense"`, `"rows"` or `"routed"`.
      gradient_exchange: the old name of `exchange`, still accepted.
      row_sharding: `"block"` (contiguous row blocks per shard) or `"mod"` (id i on shard
        i mod n, at local row i div n).
      backend: the platform whose cost constants decide `"auto"` (default: the mesh's).
      update: plan a row-sparse update (`jaxembed.optim`) instead of a gradient: the
        exchange is never `"dense"` (no table-shaped buffer is ever reduced).
      capacity: the routed exchange's C, the distinct ids one device sends one owner per
        step; default μ + 4√μ + 1 for the uniform expectation μ = M / n.
      capacity_factor: C over μ instead, when `capacity` is None.
      impl: the shard-local kernels: `"xla"`, `"native"` (the C++ kernels of
        `jaxembed.kernels.native`, CPU only, float32 and bfloat16 tables) or `"auto"`
        (native on CPU when they are available and take `dtype`, else XLA).
      optimizer_slots: for an update plan, whether each of the optimizer's state slots is
        one float per row (True) or per element (False), for `memory.state_bytes` and
        `memory.update_buffers` (`RowSparseOptimizer.plan` passes them).
      table_move: where the table's hidden axis is split over mesh axes G that the output's
        batch is split over too (FSDP: table `P("tensor", "fsdp")`, output `P("fsdp", ...)`),
        `"gather"` all-gathers the table's shard over G for the step, looks up each device's
        own ids and reduce-scatters the gradient back over G (FSDP's weight gather);
        `"none"` keeps the table where it is and moves the ids and the output; `"auto"`
        (default) takes the one that sends fewer bytes (ties: less memory). The plan prints
        both (`move_alternatives`). Only plain lookups (not bags, not updates) gather.

    Returns:
      An `EmbeddingPlan`.

    Raises:
      ValueError: a table not 2-D, unknown mesh axes, specs longer than ranks, a split that
        does not divide, `padding_idx` or `vocab_size` out of range, an impossible out_spec,
        an exchange that does not apply to the layout.

    Examples:
      >>> import jax
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
      >>> plan = plan_embedding(mesh, (16, 128), (65536, 128),
      ...                       x_spec=P("data", None), weight_spec=P("model", None))
      >>> [(c.op, c.axes) for c in plan.forward]
      [('psum', ('model',))]
      >>> plan.exchange, [(c.op, c.axes, c.operand) for c in plan.backward]
      ('rows', [('all_gather', ('data',), 'ids'), ('all_gather', ('data',), 'out_grad')])
    """
    return _plan(
        mesh, x_shape, weight_shape, x_spec=x_spec, weight_spec=weight_spec, out_spec=out_spec,
        padding_idx=padding_idx, vocab_size=vocab_size, dtype=dtype, ids_dtype=ids_dtype,
        exchange=_exchange_arg(exchange, gradient_exchange), row_sharding=row_sharding,
        backend=backend, bag=None, lengths_spec=None, weights_spec=None, update=update,
        capacity=capacity, capacity_factor=capacity_factor, impl=impl,
        optimizer_slots=optimizer_slots, routed_pool="auto", table_move=table_move,
    )  # fmt: skip


def plan_embedding_bag(
    mesh: Any,
    x_shape: Sequence[int],
    weight_shape: Sequence[int],
    *,
    num_bags: int | None = None,
    combiner: str = "sum",
    weighted: bool = False,
    x_spec: Any = None,
    lengths_spec: Any = None,
    weights_spec: Any = None,
    weight_spec: Any = None,
    out_spec: Any = None,
    padding_idx: int | None = None,
    vocab_size: int | None = None,
    dtype: Any = np.float32,
    ids_dtype: Any = np.int32,
    exchange: Exchange = "auto",
    row_sharding: str = "block",
    backend: str | None = None,
    update: bool = False,
    capacity: int | None = None,
    capacity_factor: float | None = None,
    impl: str = "auto",
    optimizer_slots: Sequence[bool] = (),
    routed_pool: str = "auto",
) -> EmbeddingPlan:
    """Plans a sharded bag lookup (`jaxembed.embedding_bag`) and its gradient on `mesh`.

    The plan of a lookup whose output is pooled: the ids of a bag are never split (a split
    bag axis is gathered: ids are small), each row shard pools only its own rows, and the
    *pooled* partial sums are reduced, so bytes grow with the number of bags, never with
    their length.

    Args:
      mesh, weight_shape, weight_spec, out_spec, padding_idx, vocab_size, dtype, ids_dtype,
        exchange, row_sharding, backend, update, capacity, capacity_factor, impl,
        optimizer_slots: as in `plan_embedding`.
      x_shape: the ids: `[*batch, L]` (dense form, a bag per row) when `num_bags` is None,
        else `[*lead, N]` (flat form, `num_bags` bags per lead element read in order).
      num_bags: None for the dense form; B of the flat form (lengths are `[*lead, B]`).
      combiner: `"sum"`, `"mean"`, `"sqrtn"` or `"max"`.
      weighted: whether per-id weights (shaped like the ids) scale each row.
      routed_pool: where the routed exchange pools a sum-like bag (sum, mean, sqrtn,
        weighted): `"source"` (each distinct id's row comes back and the source pools),
        `"owner"` (each slot goes to its row's owner, which pools; the partial sums come
        back), or `"auto"` (the faster by the cost model). Ignored by the other exchanges.
      x_spec, lengths_spec, weights_spec: the layouts of the ids, lengths and weights
        (None: replicated).

    Returns:
      An `EmbeddingPlan` with `plan.bag` set.

    Raises:
      ValueError: as `plan_embedding`, and an unknown combiner, weights with `"max"`, ids
        of rank 0.

    Examples:
      >>> import jax
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
      >>> plan = plan_embedding_bag(mesh, (4096, 20), (1_000_000, 64), combiner="mean",
      ...                           x_spec=P("data"), weight_spec=P("model", None))
      >>> [(c.op, c.axes, c.operand, c.shape) for c in plan.forward]  # pooled [B/2, H]
      [('psum', ('model',), 'out', (2048, 64))]
    """
    if combiner not in COMBINERS:
        raise ValueError(f"combiner must be one of {COMBINERS}, got {combiner!r}")
    if weighted and combiner == "max":
        raise ValueError(
            "per_id_weights cannot be used with combiner='max' (a maximum is not weighted): "
            "drop the weights, or use 'sum', 'mean' or 'sqrtn'"
        )
    if len(x_shape) == 0:
        raise ValueError("bag ids need at least one axis: [*batch, L] or [*lead, N]")
    form = "dense" if num_bags is None else "flat"
    bag = BagGeometry(form, 1 if num_bags is None else int(num_bags), combiner, bool(weighted))
    return _plan(
        mesh, x_shape, weight_shape, x_spec=x_spec, weight_spec=weight_spec, out_spec=out_spec,
        padding_idx=padding_idx, vocab_size=vocab_size, dtype=dtype, ids_dtype=ids_dtype,
        exchange=exchange, row_sharding=row_sharding, backend=backend, bag=bag,
        lengths_spec=lengths_spec if form == "flat" else None,
        weights_spec=weights_spec if weighted else None, update=update, capacity=capacity,
        capacity_factor=capacity_factor, impl=impl, optimizer_slots=optimizer_slots,
        routed_pool=routed_pool,
    )  # fmt: skip


def _exchange_arg(exchange: Any, gradient_exchange: Any) -> Any:
    if gradient_exchange is None:
        return exchange
    if exchange != "auto" and exchange != gradient_exchange:
        raise ValueError(
            f"exchange={exchange!r} and gradient_exchange={gradient_exchange!r} disagree: "
            "pass exchange only (gradient_exchange is its old name)"
        )
    return gradient_exchange


def _plan(mesh, x_shape, weight_shape, *, x_spec, weight_spec, out_spec, padding_idx,
          vocab_size, dtype, ids_dtype, exchange, row_sharding, backend, bag, lengths_spec,
          weights_spec, update, capacity, capacity_factor, impl,
          optimizer_slots, routed_pool, table_move="none") -> EmbeddingPlan:  # fmt: skip
    names = layout.axis_names_of(mesh)
    sizes = dict(zip(names, mesh_sizes(mesh), strict=True))
    backend = backend or backend_of(mesh)
    request = PlanRequest(
        mesh_axes=tuple(sizes.items()),
        explicit=is_explicit_mesh(mesh),
        x_shape=tuple(int(d) for d in x_shape),
        weight_shape=tuple(int(d) for d in weight_shape),
        x_spec=as_spec(x_spec),
        weight_spec=as_spec(weight_spec),
        out_spec=None if out_spec is None else as_spec(out_spec),
        padding_idx=padding_idx,
        vocab_size=vocab_size,
        dtype=np.dtype(dtype).name,
        ids_dtype=np.dtype(ids_dtype).name,
        exchange=exchange,
        row_sharding=row_sharding,
        backend=backend,
        bag=bag,
        lengths_spec=as_spec(lengths_spec),
        weights_spec=as_spec(weights_spec),
        update=bool(update),
        capacity=capacity,
        capacity_factor=capacity_factor,
        impl=resolve_impl(impl, backend, dtype),
        optimizer_slots=tuple(bool(x) for x in optimizer_slots),
        routed_pool=routed_pool,
        table_move=check_table_move(table_move),
    )
    unit_free = _without_unit_axes(request)
    plan = plan_request(unit_free)
    if unit_free == request:
        return plan
    return dataclasses.replace(plan, out_type_spec=_out_type_spec(request, plan.out_spec))


def _without_unit_axes(req: PlanRequest) -> PlanRequest:
    """The request with no mesh axis of size 1 in its specs (`drop_unit_axes`): what the
    kernels run, so that no collective or copy spans a group of one device."""
    sizes = req.sizes

    def drop(spec):
        return None if spec is None else drop_unit_axes(spec, sizes)

    return dataclasses.replace(
        req, x_spec=drop(req.x_spec), weight_spec=drop(req.weight_spec),
        out_spec=drop(req.out_spec), lengths_spec=drop(req.lengths_spec),
        weights_spec=drop(req.weights_spec),
    )  # fmt: skip


@functools.lru_cache(maxsize=512)
def _out_type_spec(req: PlanRequest, out_spec: P) -> P | None:
    """The output's type as the caller's layouts name it, size-1 axes included (free: one
    piece), for an Explicit mesh; None where it is the plan's `out_spec`."""
    if not req.explicit:
        return None
    try:
        typed = lookup_layout(req).out_spec
    except ValueError:
        return None
    # Partial sums over one piece are whole: the type keeps the plan's unreduced axes only.
    unreduced = set(out_spec.unreduced)
    typed = P(*typed.partitions, unreduced=unreduced) if unreduced else P(*typed.partitions)
    return None if typed == out_spec else typed


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """A lookup's arguments, normalized: what a plan is derived from (and cached on).

    The fields are `plan_embedding_bag`'s, with the mesh as `mesh_axes` (`((name, size),
    ...)`) and `explicit` (all its axes `AxisType.Explicit`), specs as `PartitionSpec`s,
    dtypes as names, `backend` and `impl` resolved.
    """

    mesh_axes: tuple[tuple[str, int], ...]
    explicit: bool
    x_shape: tuple[int, ...]
    weight_shape: tuple[int, ...]
    x_spec: P
    weight_spec: P
    out_spec: P | None
    padding_idx: Any
    vocab_size: Any
    dtype: str
    ids_dtype: str
    exchange: str
    row_sharding: str
    backend: str
    bag: BagGeometry | None
    lengths_spec: P
    weights_spec: P
    update: bool
    capacity: int | None
    capacity_factor: float | None
    impl: str
    optimizer_slots: tuple[bool, ...]
    routed_pool: str = "auto"
    table_move: str = "none"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.mesh_axes)

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh_axes)

    @property
    def is_max(self) -> bool:
        return self.bag is not None and self.bag.combiner == "max"


@dataclasses.dataclass(frozen=True)
class LookupLayout:
    """The layouts of a lookup, from the table to the body, and the rules' answer on them.

    Attributes:
      row_axes, hidden_axes: R and K; num_rows, hidden: the table's shape; vocab_size: its
        real rows.
      x_dm: the ids' given layout, one entry per ids axis; out_batch: the output's shape
        without its hidden axis.
      out_entries, unreduced, out_spec: the output's layout as returned.
      kept, scatters, body_entries: per output batch axis, the prefix the body runs on; the
        forward's `psum_scatter`s; the layout the body produces.
      ids_entries, bag_split: the layout the ids run in; the axes splitting a flat bag's
        bags.
      forward_rule, grad_rule: the rules' answers; batch_axes: B; psum_axes: the R axes
        the forward sums over; body_out_spec: `body_entries` as a spec.
    """

    row_axes: tuple[str, ...]
    hidden_axes: tuple[str, ...]
    num_rows: int
    hidden: int
    vocab_size: int
    x_dm: list
    out_batch: tuple[int, ...]
    out_entries: list
    unreduced: tuple[str, ...]
    out_spec: P
    kept: list
    scatters: list
    body_entries: list
    ids_entries: list
    bag_split: tuple[str, ...]
    forward_rule: rules.SpmdInfo
    grad_rule: rules.SpmdInfo
    batch_axes: tuple[str, ...]
    psum_axes: tuple[str, ...]
    body_out_spec: P


@dataclasses.dataclass(frozen=True)
class LookupCollectives:
    """The operands' moves and the collectives of the forward and of the backward's first
    steps (the transposes), before any exchange."""

    operands: list
    out_moves: tuple
    grad_moves: tuple
    forward: list
    transposes: list  # the backward's: out_grad's moves, then the scatters' all_gathers
    grad_collectives: list  # out_grad's moves alone
    out_kept_local: tuple[int, ...]
    ids_local: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ExchangeChoice:
    """The exchange over B as chosen, and what it changes of the forward and the backward."""

    exchange: str
    reason: str
    candidates: tuple
    operands: list
    ids_entries: list
    ids_local: tuple[int, ...]
    forward: list
    backward: list
    buffers: int
    routed: Any
    gathers: tuple

    @property
    def touched(self) -> int:
        """The id slots one device scatters or updates with the chosen exchange."""
        return next(c.rows_scattered for c in self.candidates if c.name == self.exchange)


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
        req, weight_spec=entries_spec((lay.row_axes, kept)), out_spec=out_spec, table_move="none"
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


def check_choices(exchange: str, routed_pool: str, *, pools: bool, is_max: bool) -> None:
    """Checks `exchange` and `routed_pool` (also where no plan is made: one device).

    Raises:
      ValueError: an unknown value, or `routed_pool="owner"` for a lookup that pools nothing
        or a max bag.

    Examples:
      >>> check_choices("routed", "owner", pools=True, is_max=False)
      >>> check_choices("route", "auto", pools=True, is_max=False)
      Traceback (most recent call last):
      ...
      ValueError: exchange must be one of ('auto', 'dense', 'rows', 'routed'), got 'route'
    """
    if exchange not in _EXCHANGES:
        raise ValueError(f"exchange must be one of {_EXCHANGES}, got {exchange!r}")
    if routed_pool not in _ROUTED_POOLS:
        raise ValueError(f"routed_pool must be one of {_ROUTED_POOLS}, got {routed_pool!r}")
    if routed_pool == "owner" and (not pools or is_max):
        what = "a max bag" if is_max else "a lookup that pools nothing"
        raise ValueError(
            f"routed_pool='owner' pools partial sums at the rows' owners, which {what} does "
            "not have: pass routed_pool='auto' (or 'source')"
        )


def validate_request(req: PlanRequest) -> tuple[tuple[str, ...], tuple[str, ...], int, list]:
    """Checks the options, the table and the ids: `(R, K, vocab_size, the ids' entries)`."""
    names, sizes = req.names, req.sizes
    check_choices(req.exchange, req.routed_pool, pools=req.bag is not None, is_max=req.is_max)
    if req.row_sharding not in ("block", "mod"):
        raise ValueError(f"row_sharding must be 'block' or 'mod', got {req.row_sharding!r}")
    row_axes, hidden_axes = table_layout(req.weight_shape, req.weight_spec, names, sizes)
    vocab_size = validate_scalars(req.weight_shape[0], req.vocab_size, req.padding_idx)
    x_dm = named(layout.to_dims_mapping(req.x_spec, names, len(req.x_shape)), names)
    if layout.to_partial_dims(req.x_spec, names):
        raise ValueError("the ids cannot be unreduced (partial sums)")
    for dim, (d, e) in enumerate(zip(req.x_shape, x_dm, strict=True)):
        check_divides(
            f"ids axis {dim} of size", d, tuple(e), sizes,
            f"lay the ids out so that axis {dim} divides (e.g. x_spec without {e}), "
            "or pad the batch to {padded}.",
        )  # fmt: skip
    return row_axes, hidden_axes, vocab_size, x_dm


def lookup_layout(req: PlanRequest) -> LookupLayout:
    """Steps 1-4: validate; the output's layout; the body's (kept prefixes, scatters, the
    ids'); the rules' partial axes on it."""
    names, sizes, bag = req.names, req.sizes, req.bag
    row_axes, hidden_axes, vocab_size, x_dm = validate_request(req)
    num_rows, hidden = req.weight_shape
    x_shape = req.x_shape
    # The ids' geometry: which ids axes are output batch axes, which are pooled away.
    if bag is None:
        out_batch, given_batch = x_shape, list(x_dm)
    elif bag.form == "dense":
        out_batch, given_batch = x_shape[:-1], list(x_dm[:-1])
    else:
        out_batch, given_batch = (*x_shape[:-1], bag.num_bags), [*x_dm[:-1], ()]
    out_entries, unreduced, out_spec = output_layout(
        req.out_spec, out_batch, given_batch, hidden, row_axes, hidden_axes, names, sizes,
        req.explicit,
    )  # fmt: skip
    if req.is_max and unreduced:
        raise ValueError(
            f"out_spec {out_spec} keeps partial results unreduced, but a max-pooled bag has no "
            "partial sums: request a reduced output"
        )
    kept, scatters, body_entries = body_layout(
        out_entries, row_axes, hidden_axes, unreduced, names, scatter=not req.is_max
    )
    if bag is None:
        ids_entries, bag_split = list(kept), ()
    elif bag.form == "dense":
        ids_entries, bag_split = [*kept, ()], ()
    else:
        ids_entries, bag_split = [*kept[:-1], ()], kept[-1]
    for dim, (d, e) in enumerate(zip(x_shape, ids_entries, strict=True)):
        check_divides(f"ids axis {dim} of size", d, e, sizes, "choose another layout.")
    # The rules: partial over R in the forward, over B in the backward.
    forward_rule, grad_rule, partial, batch_axes = ask_rules(
        x_shape, ids_entries, req.weight_shape, (row_axes, hidden_axes), names, bag, kept
    )
    scattered = {a for _, axes in scatters for a in axes}
    psum_axes = tuple(a for a in partial if a not in scattered and a not in unreduced)
    return LookupLayout(
        row_axes=row_axes, hidden_axes=hidden_axes, num_rows=num_rows, hidden=hidden,
        vocab_size=vocab_size, x_dm=x_dm, out_batch=tuple(out_batch),
        out_entries=out_entries, unreduced=unreduced, out_spec=out_spec, kept=kept,
        scatters=scatters, body_entries=body_entries, ids_entries=ids_entries,
        bag_split=bag_split, forward_rule=forward_rule, grad_rule=grad_rule,
        batch_axes=batch_axes, psum_axes=psum_axes,
        body_out_spec=entries_spec(body_entries, unreduced),
    )  # fmt: skip


# --- step 2: the operands and the collectives before the exchange ------------------------------


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
            0, collective("backward", "all_gather", axes, "out_grad", before, dtype, wire, why)
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
                collective("forward", "pmin", lay.psum_axes, "winners", shape, "int32", wire, why)
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
            req.update, req.impl, lay.hidden_axes, touched, h_local, per_element, per_row
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
        "backward", choice.operands, sizes, lambda op: f"the update moves {op.name} into its body"
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
