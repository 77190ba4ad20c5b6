"""The exchange phase: every way to resolve the gradient's partial sum, weighed.

`dense` (a `psum` of the gradient shard over the batch axes B), `rows` (gather the batch's
ids and output gradients over B, scatter-add locally) and `routed` (send each id to the
shard that owns its row) each get their collectives, their wire bytes and their work (rows
gathered and scattered per device); the cost model (`jaxembed.plan.cost`) times them and
`"auto"` takes the fastest.
"""

from __future__ import annotations

import dataclasses
import math

from jaxembed.plan import cost
from jaxembed.plan.layouts import GRAD_ACCUM_BYTES, collective, operand_has_dim
from jaxembed.plan.moves import local_shape
from jaxembed.plan.specs import format_bytes, itemsize, prod
from jaxembed.plan.types import Collective, ExchangeCandidate

__all__ = ["Geometry", "choose_exchange", "operand_has_dim", "rows_gathers"]


@dataclasses.dataclass(frozen=True)
class Geometry:
    """What the exchange phase needs to know of the lookup (internal)."""

    sizes: dict
    e: int
    e_ids: int
    dtype: str
    ids_dtype: str
    operands: list
    ids_entries: list
    kept: list
    bag_split: tuple
    batch_axes: tuple
    out_kept_local: tuple
    ids_local: tuple
    num_rows: int
    row_axes: tuple
    hidden_local: int
    is_bag: bool
    is_max: bool
    gathers: tuple


def rows_gathers(g: Geometry) -> tuple[list[Collective], int]:
    """The rows exchange: per gathered output batch axis, every operand that has it, then
    out_grad, as the body runs them."""
    collectives: list[Collective] = []
    shapes = {op.name: list(local_shape(op.shape, g.ids_entries, g.sizes)) for op in g.operands}
    grad_shape = list(g.out_kept_local)
    for dim, axes in g.gathers:
        n = prod(axes, g.sizes)
        for op in g.operands:
            if not operand_has_dim(len(op.shape), dim, g.is_bag):
                continue
            shape = shapes[op.name]
            shape[dim] *= n
            wire = cost.ring_wire_bytes("all-gather", n, math.prod(shape) * itemsize(op.dtype))
            why = f"rows exchange: gather the batch's {op.name} before the scatter-add"
            collectives.append(
                collective("backward", "all_gather", axes, op.name, shape, op.dtype, wire, why)
            )
        grad_shape[dim] *= n
        wire = cost.ring_wire_bytes("all-gather", n, math.prod(grad_shape) * g.e)
        why = "rows exchange: gather the batch's output gradients before the scatter-add"
        collectives.append(
            collective("backward", "all_gather", axes, "out_grad", grad_shape, g.dtype, wire, why)
        )
        if g.is_max:
            wire = cost.ring_wire_bytes("all-gather", n, math.prod(grad_shape) * 4)
            why = "rows exchange: gather the slots that won each maximum"
            winners = collective(
                "backward", "all_gather", axes, "winners", grad_shape, "int32", wire, why
            )
            collectives.append(winners)
    buffers = sum(math.prod(shapes[op.name]) * itemsize(op.dtype) for op in g.operands)
    buffers += math.prod(grad_shape) * GRAD_ACCUM_BYTES
    return collectives, buffers


def _dense_update(g: Geometry, constants, base_bytes, base_count, dense, slots, shard_rows,
                  share, row_bytes, nb):  # fmt: skip
    """The dense exchange of a row-sparse update, weighed: `(candidate, collectives, 0)`."""
    wire = cost.ring_wire_bytes("all-reduce", nb, shard_rows * 4)
    counts = collective(
        "backward", "psum", g.batch_axes, "row_counts", (shard_rows,), "int32", wire,
        "dense exchange: count each row's slots over the batch, the rows to update",
    )  # fmt: skip
    collectives = [*dense, counts]
    total = base_bytes + sum(c.wire_bytes for c in collectives)
    seconds = cost.modelled_seconds(
        constants, wire_bytes=total, rows=slots * share + 2 * shard_rows, row_bytes=row_bytes,
        collectives=base_count + len(collectives), sorted_ids=shard_rows,
        slots=slots + shard_rows,
    )  # fmt: skip
    why = ("psum of the gradient shard and of each row's slot count over the batch axes, "
           "then every device updates the rows any batch read")  # fmt: skip
    candidate = ExchangeCandidate("dense", total, slots, slots, seconds * 1e3, why)
    return candidate, collectives, 0


def choose_exchange(
    requested, g: Geometry, forward, transposes, backend, *, update=False, extra=None,
    impl="xla",
):  # fmt: skip
    """Weighs the exchanges that apply and picks one (the requested one, or the cheapest).

    For a row-sparse update (`update=True`) the dense exchange all-reduces the gradient
    shard and each row's count of slots, then every device updates the rows any batch read:
    cheap for a small table read by a large batch (a replicated table's update then walks
    each device's own slots, not the whole batch's), dear for a large one; the model weighs
    it like the others (not for max-pooled bags, whose updates need the winning slots).
    `extra` adds candidates built elsewhere (the routed exchange), as `{name: (candidate,
    collectives, buffers)}` or `{name: reason it does not apply}`.
    """
    if update and requested == "dense" and g.is_max:
        raise ValueError(
            "exchange='dense' in a row-sparse update of max-pooled bags is not built (each "
            "row's update needs the slots that won a maximum, not a gradient shard): use "
            "exchange='rows' (or 'routed', or 'auto')"
        )
    constants = cost.load_constants(backend, impl)
    row_bytes = g.hidden_local * g.e
    slots = math.prod(g.ids_local)
    # A masked gather or scatter pays for the slots whose rows this shard holds (a share 1/R
    # of them): the native kernels skip the others, and XLA clips them onto one cached row
    # (its gather) or drops them (its scatter), which `jaxembed bench bags` measures as free
    # next to a random row.
    share = 1.0 / max(prod(g.row_axes, g.sizes), 1)
    fwd_bytes = sum(c.wire_bytes for c in forward)
    fwd_count = len(forward)
    base_bytes = fwd_bytes + sum(c.wire_bytes for c in transposes)
    base_count = fwd_count + len(transposes)
    nb = prod(g.batch_axes, g.sizes)

    # An update deduplicates what it scatters: XLA's sort takes every slot (the masked ones
    # as a sentinel), the native dedup only the slots this shard owns.
    dedup_share = share if impl in ("native", "native-dedup") else 1.0

    def candidate(name, collectives, gathered, scattered, extra_rows, why):
        wire = base_bytes + sum(c.wire_bytes for c in collectives)
        seconds = cost.modelled_seconds(
            constants, wire_bytes=wire, rows=(gathered + scattered) * share + extra_rows,
            row_bytes=row_bytes, collectives=base_count + len(collectives),
            sorted_ids=scattered * dedup_share if update else 0,
            slots=gathered + scattered,  # every slot is walked, its row read or not
        )  # fmt: skip
        return ExchangeCandidate(name, wire, gathered, scattered, seconds * 1e3, why)

    options: dict[str, tuple[ExchangeCandidate, list[Collective], int]] = {}
    if not g.batch_axes:
        c = candidate(
            "none", [], slots, slots, 0,
            "the batch is not split inside the kernel: the gradient is complete on each device",
        )  # fmt: skip
        options["none"] = (c, [], 0)
    else:
        shard_rows = g.num_rows // prod(g.row_axes, g.sizes)
        grad_shard_bytes = shard_rows * g.hidden_local * GRAD_ACCUM_BYTES
        dense_wire = cost.ring_wire_bytes("all-reduce", nb, grad_shard_bytes)
        dense = [
            collective(
                "backward", "psum", g.batch_axes, "weight_grad",
                (shard_rows, g.hidden_local), "float32", dense_wire,
                "dense exchange: sum the partial gradient shards",
            )
        ]  # fmt: skip
        # Both exchanges zero-fill a gradient shard and scatter into it (the backward's result
        # is the shard; an update, which builds none, has no dense candidate); the dense one
        # adds the psum, whose reads and writes are its wire bytes.
        options["dense"] = (
            candidate(
                "dense",
                dense,
                slots,
                slots,
                0,
                "psum of the gradient shard over the batch axes",
            ),
            dense,
            0,
        )
        if update:  # the shard's gradient and each row's count of slots, summed over B;
            # then every device updates the rows any batch read (its own slots walked once)
            del options["dense"]
            if not g.is_max:
                options["dense"] = _dense_update(
                    g, constants, base_bytes, base_count, dense, slots, shard_rows, share,
                    row_bytes, nb,
                )  # fmt: skip
        rows, buffers = rows_gathers(g)
        options["rows"] = (
            candidate(
                "rows",
                rows,
                slots,
                slots * nb,
                0,
                "gather ids and output gradients over the batch axes, scatter-add locally",
            ),
            rows,
            buffers,
        )
    not_applying = {}
    for name, option in (extra or {}).items():
        if isinstance(option, str):
            not_applying[name] = option
        else:
            options[name] = option
    names = {"none": "none"}
    if requested == "auto":
        best = min(options.values(), key=lambda o: (o[0].modelled_ms, o[0].wire_bytes))
        chosen = best[0].name
        others = [o[0] for o in options.values() if o[0].name != chosen]
        if others:
            reason = (
                f"{chosen} models {best[0].modelled_ms:.3f} ms, "
                + ", ".join(f"{o.name} {o.modelled_ms:.3f} ms" for o in others)
                + f" ({format_bytes(best[0].wire_bytes)} vs "
                + ", ".join(format_bytes(o.wire_bytes) for o in others)
                + ")"
            )
        else:
            reason = best[0].why
    else:
        if requested not in options and not ("none" in options and requested in ("dense", "rows")):
            why = not_applying.get(requested, "")
            raise ValueError(
                f"exchange={requested!r} does not apply to this layout"
                + (f" ({why})" if why else "")
                + f": {', '.join(names.get(k, k) for k in options)} would. "
                + (
                    "The routed exchange needs ids and table rows split over the same mesh "
                    "axes (e.g. both over 'model'), and the batch over no other axis."
                    if requested == "routed"
                    else ""
                )
            )
        chosen = requested if requested in options else "none"
        reason = f"forced by exchange={requested!r}" if chosen != "none" else options["none"][0].why
    candidate_list = tuple(o[0] for o in options.values())
    _, collectives, buffers = options[chosen]
    return chosen, reason, candidate_list, list(collectives), buffers
