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

Steps 1-4 are `lookup_layout` (`validate_request` first; `jaxembed.plan.lookup_request`), 5 and
the backward's transposes `lookup_collectives`, 6 `choose_lookup_exchange` (with
`routed_option` of `jaxembed.plan.routed`), 7 `lookup_memory` (`jaxembed.plan.lookup_costs`).

8. **table move**: where K also splits the output's batch (FSDP: table `P("tensor",
   "fsdp")`, output `P("fsdp", ...)`), `gather_option` plans the same lookup on the table
   gathered over those axes G (`(R, K less G)`, by steps 1-7), with the table's `all_gather`
   first and the gradient's `psum_scatter` over G last; the cheaper of the two moves in bytes
   (`jaxembed.plan.table_moves.choose_move`, shared with the loss's plan) is the plan.

`plan_request` runs them in order (`jaxembed.plan.lookup_steps`, with `gather_option`); this
module holds the public entry points and re-exports the steps' names.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec as P

from jaxembed import layout
from jaxembed.plan.impl import resolve_impl
from jaxembed.plan.lookup_costs import (  # re-exported: the steps' names
    choose_lookup_exchange,
    lookup_collectives,
    lookup_memory,
)
from jaxembed.plan.lookup_request import (  # re-exported: the steps' names
    Exchange,
    ExchangeChoice,
    LookupCollectives,
    LookupLayout,
    PlanRequest,
    check_choices,
    lookup_layout,
)
from jaxembed.plan.lookup_steps import (  # re-exported: the steps' names
    assemble_plan,
    gather_option,
    plan_request,
    weighs_a_gather,
)
from jaxembed.plan.specs import (
    as_spec,
    backend_of,
    drop_unit_axes,
    is_explicit_mesh,
    mesh_sizes,
)
from jaxembed.plan.table_moves import check_table_move
from jaxembed.plan.types import (
    COMBINERS,
    BagGeometry,
    EmbeddingPlan,
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
