"""The layouts of a plan, one function each: table, output, body, the rules' answer on them.

Also the batch operands with their moves into the body, and the collectives those moves
cost. `jaxembed.plan.lookup` runs them in order for a lookup or a bag lookup; the routed
exchange and the collection planner reuse them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from jaxembed import layout, rules
from jaxembed.plan import cost
from jaxembed.plan.moves import move_shapes, plan_moves
from jaxembed.plan.specs import check_divides, dims_mapping, entries_spec, itemsize, named
from jaxembed.plan.types import Collective, Move, Operand

__all__ = [
    "GRAD_ACCUM_BYTES",
    "ask_rules",
    "body_layout",
    "collective",
    "make_operand",
    "move_collectives",
    "operand_has_dim",
    "output_layout",
    "table_layout",
]

GRAD_ACCUM_BYTES = 4  # gradients accumulate in float32


def collective(phase, op, axes, operand, shape, dtype, wire, why) -> Collective:
    """A `Collective` with its result's bytes from `shape` and `dtype`."""
    nbytes = math.prod(shape) * itemsize(dtype)
    return Collective(phase, op, tuple(axes), operand, tuple(shape), dtype, nbytes, wire, why)


def move_collectives(
    phase: str, operand: str, start: Sequence[int], moves: Sequence[Move], sizes, dtype, why
) -> list[Collective]:
    """The collectives of a list of moves (gathers cost, slices are free)."""
    out = []
    for m, shape in zip(moves, move_shapes(start, moves, sizes), strict=True):
        if m.op == "all_gather":
            n = math.prod(sizes[a] for a in m.axes)
            wire = cost.ring_wire_bytes("all-gather", n, math.prod(shape) * itemsize(dtype))
            out.append(collective(phase, "all_gather", m.axes, operand, shape, dtype, wire, why))
    return out


def operand_has_dim(op_ndim: int, dim: int, is_bag: bool) -> bool:
    """Whether a batch operand of rank `op_ndim` has output batch axis `dim` (bags: not the
    pooled axis, and not the bag axis of the flat form)."""
    return not is_bag or dim < op_ndim - 1


def make_operand(name, shape, dtype, given_entries, body_entries) -> Operand:
    """A batch operand given in one layout and run in another, with the moves between."""
    return Operand(
        name=name,
        shape=tuple(shape),
        dtype=np.dtype(dtype).name,
        given=entries_spec(given_entries),
        spec=entries_spec(body_entries),
        moves=plan_moves(given_entries, body_entries),
    )


# --- the table -------------------------------------------------------------------------------


def table_layout(weight_shape, weight_spec, names, sizes) -> tuple[tuple[str, ...], ...]:
    """R and K, the mesh axes splitting the table's rows and its hidden axis."""
    if len(weight_shape) != 2:
        raise ValueError(f"weight must be a 2-D table [vocab, hidden], got shape {weight_shape}")
    w_dm = named(layout.to_dims_mapping(weight_spec, names, 2), names)
    if layout.to_partial_dims(weight_spec, names):
        raise ValueError("the table cannot be unreduced (partial sums)")
    row_axes, hidden_axes = w_dm
    check_divides(
        "vocab (table rows)", weight_shape[0], row_axes, sizes,
        "pad the table to {padded} rows and pass vocab_size={dim}, "
        "or split rows over a smaller mesh axis.",
    )  # fmt: skip
    check_divides(
        "hidden", weight_shape[1], hidden_axes, sizes,
        "use a hidden size that is a multiple of {n}, or do not split the hidden axis.",
    )  # fmt: skip
    return row_axes, hidden_axes


# --- the output --------------------------------------------------------------------------------


def output_layout(
    out_spec, out_batch, given_batch, hidden, row_axes, hidden_axes, names, sizes, explicit
):
    """The output's entries and unreduced axes: requested, or the batch's with K appended."""
    n = len(out_batch)
    if out_spec is None:
        entries = [tuple(a for a in e if a not in hidden_axes) for e in given_batch]
        entries.append(hidden_axes)
        return entries, (), entries_spec(entries)
    entries = named(layout.to_dims_mapping(out_spec, names, n + 1), names)
    unreduced = tuple(names[a] for a in sorted(layout.to_partial_dims(out_spec, names)))
    stray = [a for a in unreduced if a not in row_axes]
    if stray:
        raise ValueError(
            f"out_spec {out_spec} keeps {stray} unreduced, but the lookup is partial only "
            f"over the table's row axes {row_axes}: drop them from unreduced"
        )
    if unreduced and not explicit:
        raise ValueError(
            f"out_spec {out_spec} has unreduced axes, which need a mesh whose axes are all "
            "AxisType.Explicit: make the mesh with jax.make_mesh(..., axis_types="
            "(AxisType.Explicit, ...)) or request a reduced output"
        )
    for dim, (d, e) in enumerate(zip((*out_batch, hidden), entries, strict=True)):
        check_divides(f"output axis {dim} of size", d, e, sizes, "choose another out_spec.")
    return entries, unreduced, out_spec


# --- the body ----------------------------------------------------------------------------------


def body_layout(out_entries, row_axes, hidden_axes, unreduced, names, *, scatter=True):
    """Per output batch axis: the free prefix the body runs on, then the scattered row axes.

    With `scatter=False` (a max-pooled bag: there is no max-scatter collective) the row axes
    are reduced whole and the output's move slices them.
    """
    free = set(names) - set(row_axes) - set(hidden_axes) - set(unreduced)
    kept, scatters, body = [], [], []
    for dim, wanted in enumerate(out_entries[:-1]):
        k = 0
        while k < len(wanted) and wanted[k] in free:
            k += 1
        scattered = []
        while (
            scatter and k + len(scattered) < len(wanted) and wanted[k + len(scattered)] in row_axes
        ):
            scattered.append(wanted[k + len(scattered)])
        kept.append(tuple(wanted[:k]))
        body.append(tuple(wanted[:k]) + tuple(scattered))
        if scattered:
            scatters.append((dim, tuple(scattered)))
    body.append(tuple(hidden_axes))
    return kept, scatters, body


# --- the rules ---------------------------------------------------------------------------------


def ask_rules(x_shape, ids_entries, weight_shape, w_entries, names, bag, out_kept):
    """The forward rule's partial axes and the gradient rule's, in mesh axis names."""
    x_ds = rules.DistSpec(x_shape, dims_mapping(ids_entries, names))
    w_ds = rules.DistSpec(weight_shape, dims_mapping(w_entries, names))
    if bag is None:
        forward = rules.embedding_forward(x_ds, w_ds)
        out = forward.outputs[0]
        grad = rules.embedding_grad(x_ds, w_ds, rules.DistSpec(out.shape, out.dims_mapping))
    else:
        lengths = None
        if bag.form == "flat":
            lead = dims_mapping(ids_entries[:-1], names)
            lengths = rules.DistSpec((*x_shape[:-1], bag.num_bags), (*lead, -1))
        forward = rules.embedding_bag_forward(x_ds, w_ds, lengths=lengths)
        out = forward.outputs[0]
        # The body pools only its range of bags on the bag-split axes: out_grad carries them.
        og_dm = dims_mapping((*out_kept, w_entries[1]), names)
        grad = rules.embedding_bag_grad(
            x_ds, w_ds, rules.DistSpec(out.shape, og_dm), lengths=lengths
        )
    partial = tuple(names[a] for a in sorted(forward.outputs[0].partial_dims))
    batch = tuple(names[a] for a in sorted(grad.outputs[0].partial_dims))
    return forward, grad, partial, batch
