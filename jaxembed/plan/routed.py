"""The routed exchange: each id goes only to the shard that owns its row.

It applies where the ids and the table's rows are split over the same mesh axes S (the
`psum_scatter` axes of the gather plan: `(8,)` fully sharded, rows over `(data, model)` with
ids on `data`, table-rows placements) and the batch is split over no other axis. Instead of
gathering every id over S, looking all of them up and reduce-scattering the output, each
device, per step:

    buckets its ids by the owner's position on S, removes duplicates in each bucket
    all_to_all over S: ids         i32[n_S · C]        (C: the static capacity per pair)
    [psum over R − S of the rows, when the table's rows are split over more axes]
    all_to_all over S: rows back   f[n_S · C, H/K]
    backward: all_to_all ids again, and each unique id's summed gradient f32[n_S · C, H/K]

No id is ever dropped: when any bucket of any device holds more than C distinct ids, every
device learns it from one all-reduce of a flag and that step runs the gather exchange instead
(`fallback_forward` / `fallback_backward`), exactly. The compiled program holds both branches.

A sum-like bag lookup can instead pool at the owner (`RoutedPlan.pooled_at_owner`):

    buckets its slots (not its distinct ids) by owner
    all_to_all over S: slots       i32[n_S · C, 3]     (id, bag, factor bits)
    the owner pools them per (source, bag); psum_scatter over S: out f[GB, H/K]
    [psum over R − S of the pooled bags]
    backward: all_gather of out_grad f[n_S · GB, H/K], all_to_all of the slots again

`routed_option` prices both with the same model and keeps the faster (or the one asked for,
`routed_pool`).
"""

from __future__ import annotations

import dataclasses
import math

from jaxembed.plan import cost
from jaxembed.plan.layouts import collective, make_operand, move_collectives, operand_has_dim
from jaxembed.plan.moves import local_shape, plan_moves
from jaxembed.plan.specs import itemsize, prod, spec_entries
from jaxembed.plan.types import ExchangeCandidate, RoutedPlan

__all__ = ["RoutedPlan", "capacity_for", "plan_routed", "routed_option"]


def capacity_for(slots: int, buckets: int, capacity: int | None, factor: float | None) -> int:
    """C, the distinct ids one device may send one owner per step, in `[1, M]`.

    `capacity` if given; else `capacity_factor` times the uniform expectation μ = M / n_S;
    else μ + 4√μ + 1: with uniformly spread ids a bucket's count is about Poisson(μ), which
    passes that bound about once in 30,000 buckets, while the buffers stay within ~1.4μ
    for the batch sizes of real models (μ >= 100). Skewed ids need mod row sharding (or a
    larger capacity), else the steps fall back.
    """
    if capacity is not None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        return min(capacity, max(slots, 1))
    mean = slots / buckets
    if factor is None:
        return max(1, min(slots, math.ceil(mean + 4 * math.sqrt(mean) + 1)))
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not factor > 0:
        raise ValueError(f"capacity_factor must be a number > 0, got {factor!r}")
    return max(1, min(slots, math.ceil(factor * mean)))


def plan_routed(
    *,
    scatters,
    batch_axes,
    row_axes,
    operands,
    ids_entries,
    op_dims,
    sizes,
    dtype,
    hidden_local: int,
    out_kept_local,
    mesh_names,
    capacity: int | None,
    capacity_factor: float | None,
    update: bool = False,
    pooled_at_owner: bool = False,
) -> tuple[RoutedPlan | None, str, list]:
    """The routed variant of a plan, or None with the reason it does not apply.

    Args:
      scatters: the gather plan's `((dim, axes),)`: routed needs exactly one.
      batch_axes: B; routed needs none (the batch split only over row axes).
      row_axes: R.
      operands: the batch operands `(name, shape, dtype, given entries)`.
      ids_entries: the gather plan's ids layout.
      op_dims: per operand, whether it has the scatter dim.
      sizes: mesh axis sizes.
      dtype: the table's dtype.
      hidden_local: H/K.
      out_kept_local: the gather plan's per-device output block before its scatter.
      mesh_names: every mesh axis, for the overflow flag's all-reduce.
      capacity, capacity_factor: C, or its factor over the uniform expectation.
      update: a row-sparse update, which computes its own overflow flag (a lookup's
        backward reuses the forward's).
      pooled_at_owner: the bag variant whose owners pool (sum, mean, sqrtn; the caller
        checks that it applies): slots to the owners, partial sums back.

    Returns:
      `(routed plan or None, reason, routed ids entries per operand)`.
    """
    if batch_axes:
        return None, "the batch is also split over axes that hold no rows", []
    if len(scatters) != 1:
        return None, "ids and rows share no mesh axis", []
    dim, axes = scatters[0]
    if not op_dims[0]:
        return None, "the shared axis splits bags, not ids", []
    n = prod(axes, sizes)
    rest = tuple(a for a in row_axes if a not in axes)
    routed_entries = []
    for (_, shape, _, _), has in zip(operands, op_dims, strict=True):
        entries = [tuple(e) for e in ids_entries[: len(shape)]]
        entries += [()] * (len(shape) - len(entries))
        if has:
            entries[dim] = entries[dim] + tuple(axes)
        routed_entries.append(tuple(entries))
    ids_shape = operands[0][1]
    slots = math.prod(local_shape(ids_shape, routed_entries[0], sizes))
    c = capacity_for(slots, n, capacity, capacity_factor)
    e = itemsize(dtype)
    flag_wire = cost.ring_wire_bytes("all-reduce", prod(mesh_names, sizes), 4)

    def a2a(phase, operand, shape, dt, why):
        wire = cost.ring_wire_bytes("all-to-all", n, math.prod(shape) * itemsize(dt))
        return collective(phase, "all_to_all", axes, operand, shape, dt, wire, why)

    def flag(phase):
        why = "did any bucket overflow its capacity? (then the exact fallback runs)"
        return collective(phase, "psum", mesh_names, "overflow", (), "int32", flag_wire, why)

    # The output block each device keeps: its own bags (GB of them), [*, H/K].
    block = list(out_kept_local)
    before = tuple(block)
    block[dim] //= n
    if pooled_at_owner:
        forward, backward = _owner_collectives(
            axes, rest, sizes, n, c, block, dtype, flag, a2a, update
        )
    else:
        forward, backward = _source_collectives(
            axes, rest, sizes, n, c, hidden_local, dtype, flag, a2a, update
        )

    # The exact fallback: the gather exchange, from the routed ids layout.
    fb_forward, fb_backward = [], []
    for (name, shape, dt, _), entries, has in zip(operands, routed_entries, op_dims, strict=True):
        if not has:
            continue
        gathered = list(entries)
        gathered[dim] = tuple(a for a in entries[dim] if a not in axes)
        moves = plan_moves(entries, gathered)
        start = local_shape(shape, entries, sizes)
        why = "fallback: the gather exchange"
        fb_forward += move_collectives("forward", name, start, moves, sizes, dt, why)
        fb_backward += move_collectives("backward", name, start, moves, sizes, dt, why)
    wire = cost.ring_wire_bytes("reduce-scatter", n, math.prod(block) * e)
    why = "fallback: sum the row shards"
    fb_forward.append(collective("forward", "psum_scatter", axes, "out", block, dtype, wire, why))
    if rest:
        wire = cost.ring_wire_bytes("all-reduce", prod(rest, sizes), math.prod(block) * e)
        fb_forward.append(collective("forward", "psum", rest, "out", block, dtype, wire, why))
    wire = cost.ring_wire_bytes("all-gather", n, math.prod(before) * e)
    fb_backward.insert(
        0, collective("backward", "all_gather", axes, "out_grad", before, dtype, wire,
                      "fallback: the transpose of the psum_scatter")
    )  # fmt: skip
    factor = c * n / slots if slots else 1.0
    plan = RoutedPlan(
        axes=tuple(axes), dim=dim, rest_axes=rest, num_buckets=n, slots=slots, capacity=c,
        capacity_factor=factor, forward=tuple(forward), backward=tuple(backward),
        fallback_forward=tuple(fb_forward), fallback_backward=tuple(fb_backward),
        pooled_at_owner=pooled_at_owner,
    )  # fmt: skip
    return plan, "", routed_entries


def _source_collectives(axes, rest, sizes, n, c, hidden_local, dtype, flag, a2a, update):
    """The routed path whose sources pool: distinct ids out, their rows back."""
    e = itemsize(dtype)
    forward = [
        flag("forward"),
        a2a("forward", "ids", (n * c,), "int32", "send each distinct id to its owner"),
    ]
    if rest:
        wire = cost.ring_wire_bytes("all-reduce", prod(rest, sizes), n * c * hidden_local * e)
        forward.append(
            collective(
                "forward", "psum", rest, "rows", (n * c, hidden_local), dtype, wire,
                "sum the owners' rows over the table's other row axes",
            )
        )  # fmt: skip
    forward.append(a2a("forward", "rows", (n * c, hidden_local), dtype, "rows back to the ids"))
    backward = [
        *([flag("backward")] if update else []),
        a2a("backward", "ids", (n * c,), "int32", "send each distinct id to its owner"),
        a2a(
            "backward", "grads", (n * c, hidden_local), "float32",
            "each distinct id's summed gradient to its owner",
        ),
    ]  # fmt: skip
    return forward, backward


def _owner_collectives(axes, rest, sizes, n, c, block, dtype, flag, a2a, update):
    """The routed path whose owners pool (a sum-like bag): each slot's (id, bag, factor)
    out, packed as int32 [n_S, C, 3]; the owners' partial sums per (source, bag) reduced
    back onto the sources; the backward gathers out_grad (the transpose) and sends the
    slots again (recomputed, as the update, which has no forward, must)."""
    e = itemsize(dtype)
    mine = math.prod(block) * e  # f[GB, H/K]: a source's own bags
    slots_why = "send each slot's (id, bag, factor) to its row's owner"
    forward = [
        flag("forward"),
        a2a("forward", "slots", (n * c, 3), "int32", slots_why),
        collective(
            "forward", "psum_scatter", axes, "out", tuple(block), dtype,
            cost.ring_wire_bytes("reduce-scatter", n, mine),
            "the owners' partial sums per (source, bag) back to each source",
        ),
    ]  # fmt: skip
    if rest:
        wire = cost.ring_wire_bytes("all-reduce", prod(rest, sizes), mine)
        forward.append(
            collective(
                "forward", "psum", rest, "out", tuple(block), dtype, wire,
                "sum the bags over the table's other row axes",
            )
        )  # fmt: skip
    gathered = (n * math.prod(block[:-1]), block[-1])  # f[n_S·GB, H/K]
    backward = [
        *([flag("backward")] if update else []),
        collective(
            "backward", "all_gather", axes, "out_grad", gathered, dtype,
            cost.ring_wire_bytes("all-gather", n, mine * n),
            "every source's out_grad to the owners (the transpose of the psum_scatter)",
        ),
        a2a("backward", "slots", (n * c, 3), "int32", slots_why),
    ]  # fmt: skip
    return forward, backward


def routed_option(*, scatters, batch_axes, row_axes, operands, ids_entries, sizes, dtype,
                  out_kept_local, names, is_bag, capacity, capacity_factor, update, impl,
                  out_moves_collectives, grad_collectives, backend, unreduced,
                  pooled: bool = False, routed_pool: str = "auto"):  # fmt: skip
    """The routed exchange as a candidate of a lookup's exchange (`choose_exchange`'s
    `extra`): `(RoutedPlan, (candidate, [], buffers), operands)` with the batch operands as
    the routed path runs them, or `(None, reason, None)` where it does not apply.

    For a sum-like bag (`pooled`) it weighs both poolings, at the source and at the owner,
    by modelled time, and takes the faster, or the one `routed_pool` names (`"source"`,
    `"owner"`)."""
    if unreduced:
        return None, "the output is kept unreduced", None
    op_dims = [operand_has_dim(len(op.shape), scatters[0][0], is_bag)
               if scatters else False for op in operands]  # fmt: skip
    variants = ["source", "owner"] if pooled else ["source"]
    options = {}
    for variant in variants:
        routed, reason, entries = plan_routed(
            scatters=scatters, batch_axes=batch_axes, row_axes=row_axes,
            operands=[(op.name, op.shape, op.dtype, spec_entries(op.given)) for op in operands],
            ids_entries=ids_entries, op_dims=op_dims, sizes=sizes, dtype=dtype,
            hidden_local=out_kept_local[-1], out_kept_local=out_kept_local, mesh_names=names,
            capacity=capacity, capacity_factor=capacity_factor, update=update,
            pooled_at_owner=variant == "owner",
        )  # fmt: skip
        if routed is None:
            return None, reason, None
        options[variant] = _priced(routed, operands, entries, sizes, dtype, out_kept_local,
                                   update, impl, out_moves_collectives, grad_collectives,
                                   backend)  # fmt: skip
    if routed_pool in options:
        chosen = routed_pool
    else:
        chosen = min(options, key=lambda v: options[v][1][0].modelled_ms)
    routed, option, routed_operands = options[chosen]
    if len(options) > 1:
        costs = tuple((v, o[1][0].wire_bytes, o[1][0].modelled_ms) for v, o in options.items())
        routed = dataclasses.replace(routed, pool_costs=costs)
    return routed, option, routed_operands


def _priced(routed, operands, entries, sizes, dtype, out_kept_local, update, impl,
            out_moves_collectives, grad_collectives, backend):  # fmt: skip
    """One routed variant's `(RoutedPlan, (candidate, [], buffers), operands)`."""
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
    h_local = out_kept_local[-1]
    row_bytes = h_local * itemsize(dtype)
    # Bucketing groups the slots by owner in the forward and again in the backward (the
    # plan's kernels: XLA's sort, or the native counting sort); an update also deduplicates
    # at the owner.
    sorted_ids = (looked_up if update else 0) + 2 * routed.slots
    if routed.pooled_at_owner:
        # The owners walk n·C slots twice (pool; each slot's gradient, scattered or updated);
        # no source materializes its slots' rows. Buffers: the packed slots and the partial
        # sums per (source, bag) (the gathered out_grad in the backward).
        rows = 2 * looked_up
        num_bags = math.prod(out_kept_local[:-1]) // routed.num_buckets
        buffers = looked_up * 3 * 4 + routed.num_buckets * num_bags * h_local * 4
        why = f"send each slot to its owner over {routed.axes}, which pools it, capacity "
    else:
        # The owners gather and scatter n·C rows (and sum them over the other row axes);
        # each source fetches its slots' rows back.
        rows = 2 * looked_up * prod(routed.rest_axes, sizes) + routed.slots
        buffers = looked_up * (4 + h_local * 4)
        why = f"send each distinct id to its owner over {routed.axes}, capacity "
    seconds = cost.modelled_seconds(
        constants, wire_bytes=wire, rows=rows, row_bytes=row_bytes,
        collectives=len(collectives), sorted_ids=sorted_ids, slots=rows,
    )  # fmt: skip
    gathered = looked_up if routed.pooled_at_owner else looked_up + routed.slots
    candidate = ExchangeCandidate(
        "routed", wire, gathered, looked_up, seconds * 1e3, f"{why}{routed.capacity}"
    )
    return routed, (candidate, [], buffers), routed_operands
