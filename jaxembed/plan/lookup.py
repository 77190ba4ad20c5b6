"""The execution plan of a sharded lookup or bag lookup: layouts, collectives, bytes, memory.

`plan_embedding` and `plan_embedding_bag` ask the rules (`jaxembed.rules`) how the lookup
must be laid out, resolve what they call a conflict by moving the ids or the output gradient
(never the table), and write down every collective of the forward and the backward with its
mesh axes and its bytes. The kernels (`jaxembed.kernels`) execute a plan; they decide
nothing themselves.

Derivation, with R the mesh axes that split the table's rows and K those that split its
hidden axis, in phases (one function each below):

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
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from jaxembed import layout
from jaxembed.plan import cost
from jaxembed.plan.exchange import Geometry, choose_exchange, operand_has_dim
from jaxembed.plan.impl import resolve_impl
from jaxembed.plan.moves import local_shape, plan_moves
from jaxembed.plan.phases import (
    GRAD_ACCUM_BYTES,
    as_spec,
    ask_rules,
    backend_of,
    body_layout,
    check_divides,
    collective,
    entries_spec,
    is_explicit_mesh,
    itemsize,
    make_operand,
    mesh_sizes,
    move_collectives,
    named,
    output_layout,
    prod,
    spec_entries,
    table_layout,
    validate_scalars,
)
from jaxembed.plan.routed import plan_routed
from jaxembed.plan.types import (
    COMBINERS,
    BagGeometry,
    Collective,
    EmbeddingPlan,
    ExchangeCandidate,
    MemoryEstimate,
)

__all__ = ["Exchange", "plan_embedding", "plan_embedding_bag"]

Exchange = Literal["auto", "dense", "rows", "routed"]
_EXCHANGES = ("auto", "dense", "rows", "routed")


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
      gradient_exchange: the old name of `exchange` (round 1), still accepted.
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
        optimizer_slots=optimizer_slots,
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
          optimizer_slots) -> EmbeddingPlan:  # fmt: skip
    names = layout.axis_names_of(mesh)
    sizes = dict(zip(names, mesh_sizes(mesh), strict=True))
    return _plan_cached(
        tuple(sizes.items()),
        is_explicit_mesh(mesh),
        tuple(int(d) for d in x_shape),
        tuple(int(d) for d in weight_shape),
        as_spec(x_spec),
        as_spec(weight_spec),
        None if out_spec is None else as_spec(out_spec),
        padding_idx,
        vocab_size,
        np.dtype(dtype).name,
        np.dtype(ids_dtype).name,
        exchange,
        row_sharding,
        backend or backend_of(mesh),
        bag,
        as_spec(lengths_spec),
        as_spec(weights_spec),
        bool(update),
        capacity,
        capacity_factor,
        resolve_impl(impl, backend or backend_of(mesh), dtype),
        tuple(bool(x) for x in optimizer_slots),
    )


@functools.lru_cache(maxsize=512)
def _plan_cached(
    mesh_axes, explicit, x_shape, weight_shape, x_spec, weight_spec, out_spec, padding_idx,
    vocab_size, dtype, ids_dtype, exchange, row_sharding, backend, bag, lengths_spec,
    weights_spec, update, capacity, capacity_factor, impl, optimizer_slots,
) -> EmbeddingPlan:  # fmt: skip
    names = tuple(n for n, _ in mesh_axes)
    sizes = dict(mesh_axes)
    if exchange not in _EXCHANGES:
        raise ValueError(f"exchange must be one of {_EXCHANGES}, got {exchange!r}")
    if row_sharding not in ("block", "mod"):
        raise ValueError(f"row_sharding must be 'block' or 'mod', got {row_sharding!r}")

    # Phase 1: the table (R, K) and the scalars.
    row_axes, hidden_axes = table_layout(weight_shape, weight_spec, names, sizes)
    num_rows, hidden = weight_shape
    vocab_size = validate_scalars(num_rows, vocab_size, padding_idx)
    w_entries = (row_axes, hidden_axes)

    # The ids' geometry: which ids axes are output batch axes, which are pooled away.
    x_dm = named(layout.to_dims_mapping(x_spec, names, len(x_shape)), names)
    if layout.to_partial_dims(x_spec, names):
        raise ValueError("the ids cannot be unreduced (partial sums)")
    flat = bag is not None and bag.form == "flat"
    if bag is None:
        out_batch, given_batch = x_shape, list(x_dm)
    elif bag.form == "dense":
        out_batch, given_batch = x_shape[:-1], list(x_dm[:-1])
    else:
        out_batch, given_batch = (*x_shape[:-1], bag.num_bags), [*x_dm[:-1], ()]
    x_spec = entries_spec(x_dm)  # normalized: one entry per ids axis
    for dim, (d, e) in enumerate(zip(x_shape, x_dm, strict=True)):
        check_divides(
            f"ids axis {dim} of size", d, tuple(e), sizes,
            f"lay the ids out so that axis {dim} divides (e.g. x_spec without {e}), "
            "or pad the batch to {padded}.",
        )  # fmt: skip

    # Phase 2: the output's layout.
    out_entries, unreduced, out_spec = output_layout(
        out_spec, out_batch, given_batch, hidden, row_axes, hidden_axes, names, sizes, explicit
    )

    # Phase 3: the body's layout: kept prefix per output batch axis, scatters, the ids.
    is_max = bag is not None and bag.combiner == "max"
    if is_max and unreduced:
        raise ValueError(
            f"out_spec {out_spec} keeps partial results unreduced, but a max-pooled bag has no "
            "partial sums: request a reduced output"
        )
    kept, scatters, body_entries = body_layout(
        out_entries, row_axes, hidden_axes, unreduced, names, scatter=not is_max
    )
    if bag is None:
        ids_entries = list(kept)
        bag_split: tuple[str, ...] = ()
    elif bag.form == "dense":
        ids_entries = [*kept, ()]
        bag_split = ()
    else:
        ids_entries = [*kept[:-1], ()]
        bag_split = kept[-1]
    for dim, (d, e) in enumerate(zip(x_shape, ids_entries, strict=True)):
        check_divides(f"ids axis {dim} of size", d, e, sizes, "choose another layout.")

    # Phase 4: the rules: partial over R in the forward, over B in the backward.
    forward_rule, grad_rule, partial, batch_axes = ask_rules(
        x_shape, ids_entries, weight_shape, w_entries, names, bag, kept
    )
    scattered = {a for _, axes in scatters for a in axes}
    psum_axes = tuple(a for a in partial if a not in scattered and a not in unreduced)
    body_out_spec = entries_spec(body_entries, unreduced)

    # The batch operands and their moves into the body.
    operands = [make_operand("ids", x_shape, ids_dtype, x_dm, ids_entries)]
    if flat:
        lengths_shape = (*x_shape[:-1], bag.num_bags)
        l_dm = named(layout.to_dims_mapping(lengths_spec, names, len(lengths_shape)), names)
        operands.append(make_operand("lengths", lengths_shape, "int32", l_dm, ids_entries))
    if bag is not None and bag.weighted:
        w_dm = named(layout.to_dims_mapping(weights_spec, names, len(x_shape)), names)
        operands.append(make_operand("weights", x_shape, "float32", w_dm, ids_entries))
    out_moves = plan_moves(body_entries, out_entries)

    # Phase 5: the forward's collectives.
    e, e_ids = itemsize(dtype), itemsize(ids_dtype)
    ids_local = local_shape(x_shape, ids_entries, sizes)
    out_kept_local = (*local_shape(out_batch, kept, sizes), hidden // prod(hidden_axes, sizes))
    forward: list[Collective] = []
    for op in operands:
        forward += move_collectives(
            "forward", op.name, local_shape(op.shape, spec_entries(op.given), sizes), op.moves,
            sizes, op.dtype, f"{op.name} {op.given} -> {op.spec}: the ids move, the table stays",
        )  # fmt: skip
    shape = list(out_kept_local)
    backward_transposes: list[Collective] = []
    for dim, axes in scatters:
        k = prod(axes, sizes)
        before = tuple(shape)
        shape[dim] //= k
        wire = cost.ring_wire_bytes("reduce-scatter", k, math.prod(shape) * e)
        why = f"sum the row shards; out_spec splits axis {dim}"
        forward.append(collective("forward", "psum_scatter", axes, "out", shape, dtype, wire, why))
        wire = cost.ring_wire_bytes("all-gather", k, math.prod(before) * e)
        why = f"transpose of the forward psum_scatter on axis {dim}"
        backward_transposes.insert(
            0, collective("backward", "all_gather", axes, "out_grad", before, dtype, wire, why)
        )
    if psum_axes:
        k = prod(psum_axes, sizes)
        wire = cost.ring_wire_bytes("all-reduce", k, math.prod(shape) * e)
        why = "sum the row shards (each holds its rows, zeros elsewhere)"
        op = "pmax" if is_max else "psum"
        forward.append(collective("forward", op, psum_axes, "out", shape, dtype, wire, why))
        if is_max:  # which slot won each (bag, column): the earliest among the shards' maxima
            wire = cost.ring_wire_bytes("all-reduce", k, math.prod(shape) * 4)
            why = "the winning slot of each maximum, for the backward"
            forward.append(
                collective("forward", "pmin", psum_axes, "winners", shape, "int32", wire, why)
            )
    body_local = tuple(shape)
    forward += move_collectives(
        "forward", "out", body_local, out_moves, sizes, dtype,
        f"out {body_out_spec} -> {out_spec}",
    )  # fmt: skip
    # The backward starts with the transpose of the output's moves: slices become gathers.
    grad_moves = plan_moves(out_entries, body_entries)
    out_local = local_shape((*out_batch, hidden), out_entries, sizes)
    grad_collectives = move_collectives(
        "backward", "out_grad", out_local, grad_moves, sizes, dtype,
        f"out_grad {out_spec} -> {body_out_spec}",
    )  # fmt: skip
    backward_transposes = grad_collectives + backward_transposes

    # Phase 6: the exchange over B, weighed by the cost model.
    gathers = tuple(
        (d, b)
        for d, b in ((d, tuple(a for a in k if a in batch_axes)) for d, k in enumerate(kept))
        if b
    )
    geometry = Geometry(
        sizes=sizes, e=e, e_ids=e_ids, dtype=dtype, ids_dtype=ids_dtype, operands=operands,
        ids_entries=ids_entries, kept=kept, bag_split=bag_split, batch_axes=batch_axes,
        out_kept_local=out_kept_local, ids_local=ids_local, num_rows=num_rows,
        row_axes=row_axes, hidden_local=out_kept_local[-1], is_bag=bag is not None,
        is_max=is_max, gathers=gathers,
    )  # fmt: skip
    # What runs: a native update needs the hidden axis whole; over a split one only its
    # dedup is native (`jaxembed.kernels.update`).
    price_impl = "native-dedup" if impl == "native" and update and hidden_axes else impl
    routed, routed_option, routed_operands = _routed_option(
        scatters=scatters, batch_axes=batch_axes, row_axes=row_axes, operands=operands,
        ids_entries=ids_entries, sizes=sizes, dtype=dtype, out_kept_local=out_kept_local,
        names=names, bag=bag, capacity=capacity, capacity_factor=capacity_factor, update=update,
        impl=price_impl, out_moves_collectives=[c for c in forward if c.operand == "out" and
                               c.op == "all_gather"], grad_collectives=grad_collectives,
        backend=backend, unreduced=unreduced,
    )  # fmt: skip
    exchange, reason, candidates, exchange_collectives, exchange_buffers = choose_exchange(
        exchange, geometry, forward, backward_transposes, backend, update=update,
        extra={"routed": routed_option}, impl=price_impl,
    )  # fmt: skip
    backward = backward_transposes + exchange_collectives
    if exchange == "routed":
        operands = routed_operands
        ids_entries = list(spec_entries(operands[0].spec))
        ids_local = local_shape(x_shape, ids_entries, sizes)
        forward = [
            *(c for op in operands for c in move_collectives(
                "forward", op.name, local_shape(op.shape, spec_entries(op.given), sizes),
                op.moves, sizes, op.dtype, f"{op.name} {op.given} -> {op.spec}",
            )),
            *routed.forward,
            *(c for c in forward if c.operand == "out" and c.op == "all_gather"),
        ]  # fmt: skip
        backward = [*grad_collectives, *routed.backward]
    else:
        routed = None
    if update:  # the update starts from the ids as given, and may sum rows over K
        backward = _update_collectives(
            operands, sizes, backward, optimizer_slots, hidden_axes, is_max, forward,
            next(c.rows_scattered for c in candidates if c.name == exchange),
        )  # fmt: skip

    grad_shard_shape = (num_rows // prod(row_axes, sizes), out_kept_local[-1])
    grad_shard = math.prod(grad_shard_shape) * GRAD_ACCUM_BYTES
    touched = next(c.rows_scattered for c in candidates if c.name == exchange)
    h_local = out_kept_local[-1]
    per_element = sum(1 for per_row in optimizer_slots if not per_row)
    per_row = len(optimizer_slots) - per_element
    memory = MemoryEstimate(
        table_shard=grad_shard // GRAD_ACCUM_BYTES * e,
        ids=math.prod(ids_local) * e_ids,
        out=math.prod(out_kept_local) * e,
        weight_grad_f32=0 if update else grad_shard,
        exchange_buffers=exchange_buffers,
        touched_rows=touched,
        update_buffers=_update_buffers(
            update, impl, hidden_axes, touched, h_local, per_element, per_row
        ),
        state_bytes=grad_shard_shape[0] * (h_local * per_element + per_row) * 4,
    )
    return EmbeddingPlan(
        mesh_axes=tuple(mesh_axes),
        x_shape=x_shape,
        weight_shape=(num_rows, hidden),
        vocab_size=vocab_size,
        padding_idx=None if padding_idx is None else int(padding_idx),
        dtype=dtype,
        ids_dtype=ids_dtype,
        x_spec=x_spec,
        ids_spec=entries_spec(ids_entries),
        weight_spec=entries_spec(w_entries),
        body_out_spec=body_out_spec,
        out_spec=out_spec,
        row_axes=row_axes,
        hidden_axes=hidden_axes,
        batch_axes=batch_axes,
        scatters=tuple(scatters),
        psum_axes=psum_axes,
        unreduced_axes=unreduced,
        bag_split_axes=bag_split,
        batch_gathers=gathers,
        exchange=exchange,
        exchange_reason=reason,
        candidates=candidates,
        operands=tuple(operands),
        out_moves=out_moves,
        grad_moves=grad_moves,
        forward=tuple(forward),
        backward=tuple(backward),
        memory=memory,
        forward_rule=forward_rule,
        grad_rule=grad_rule,
        bag=bag,
        row_sharding=row_sharding,
        backend=backend,
        for_update=update,
        routed=routed,
        impl=impl,
    )


def _update_buffers(update, impl, hidden_axes, touched, h_local, per_element, per_row) -> int:
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


def _update_collectives(operands, sizes, backward, optimizer_slots, hidden_axes, is_max,
                        forward, touched) -> list[Collective]:  # fmt: skip
    """A row-sparse update's collectives: the ids' moves into its body, a max bag's winners
    (recomputed: the forward's pmax and pmin), the backward's, and the `psum` over the
    hidden axes of each touched row's sum of g² for a one-per-row state."""
    moves = [
        c for op in operands for c in move_collectives(
            "backward", op.name, local_shape(op.shape, spec_entries(op.given), sizes),
            op.moves, sizes, op.dtype, f"the update moves {op.name} into its body",
        )
    ]  # fmt: skip
    winners = [dataclasses.replace(c, phase="backward") for c in forward
               if is_max and c.op in ("pmax", "pmin")]  # fmt: skip
    rows = []
    if hidden_axes and any(optimizer_slots):
        k = prod(hidden_axes, sizes)
        wire = cost.ring_wire_bytes("all-reduce", k, touched * GRAD_ACCUM_BYTES)
        why = "each touched row's sum of g² over the split hidden axis (one-per-row state)"
        rows.append(collective("backward", "psum", hidden_axes, "row_sum", (touched,),
                               "float32", wire, why))  # fmt: skip
    return [*moves, *winners, *backward, *rows]


def _routed_option(*, scatters, batch_axes, row_axes, operands, ids_entries, sizes, dtype,
                   out_kept_local, names, bag, capacity, capacity_factor, update, impl,
                   out_moves_collectives, grad_collectives, backend, unreduced):  # fmt: skip
    """The routed exchange as a candidate: `(RoutedPlan, (candidate, [], buffers), operands)`,
    or `(None, reason, None)` where it does not apply."""
    if unreduced:
        return None, "the output is kept unreduced", None
    op_dims = [operand_has_dim(len(op.shape), scatters[0][0], bag is not None)
               if scatters else False for op in operands]  # fmt: skip
    routed, reason, entries = plan_routed(
        scatters=scatters, batch_axes=batch_axes, row_axes=row_axes,
        operands=[(op.name, op.shape, op.dtype, spec_entries(op.given)) for op in operands],
        ids_entries=ids_entries, op_dims=op_dims, sizes=sizes, dtype=dtype,
        hidden_local=out_kept_local[-1], out_kept_local=out_kept_local, mesh_names=names,
        capacity=capacity, capacity_factor=capacity_factor, update=update,
    )  # fmt: skip
    if routed is None:
        return None, reason, None
    routed_operands = [
        make_operand(op.name, op.shape, op.dtype, spec_entries(op.given), e)
        for op, e in zip(operands, entries, strict=True)
    ]
    moves = [
        c for op in routed_operands for c in move_collectives(
            "forward", op.name, local_shape(op.shape, spec_entries(op.given), sizes),
            op.moves, sizes, op.dtype, "",
        )
    ]  # fmt: skip
    collectives = [*moves, *routed.forward, *out_moves_collectives, *grad_collectives,
                   *routed.backward]  # fmt: skip
    wire = sum(c.wire_bytes for c in collectives)
    looked_up = routed.rows_looked_up
    constants = cost.load_constants(backend, impl)
    row_bytes = out_kept_local[-1] * itemsize(dtype)
    # The owners gather and scatter n·C rows (and sum them over the other row axes); each
    # source fetches its slots' rows back. Bucketing sorts the slots with XLA's sort in the
    # forward and again in the backward; an update also deduplicates at the owner.
    rest = prod(routed.rest_axes, sizes)
    seconds = cost.modelled_seconds(
        constants, wire_bytes=wire, rows=2 * looked_up * rest + routed.slots,
        row_bytes=row_bytes, collectives=len(collectives),
        sorted_ids=looked_up if update else 0,
    ) + 2 * routed.slots / cost.load_constants(backend).sort_ids_per_s  # fmt: skip
    candidate = ExchangeCandidate(
        "routed", wire, looked_up + routed.slots, looked_up, seconds * 1e3,
        f"send each distinct id to its owner over {routed.axes}, capacity {routed.capacity}",
    )  # fmt: skip
    buffers = routed.num_buckets * routed.capacity * (4 + out_kept_local[-1] * 4)
    return routed, (candidate, [], buffers), routed_operands
