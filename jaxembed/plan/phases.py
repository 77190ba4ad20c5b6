"""The phases of a plan, one function each: table, output, body, rules, moves' collectives.

`jaxembed.plan.lookup` runs them in order for a lookup or a bag lookup; the collection
planner reuses them per table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec as P

from jaxembed import layout, rules
from jaxembed.layout import entry_mesh_axes
from jaxembed.plan import cost
from jaxembed.plan.moves import Entries, Move, move_shapes, plan_moves
from jaxembed.plan.types import Collective, Operand

GRAD_ACCUM_BYTES = 4  # gradients accumulate in float32

# --- small helpers ---------------------------------------------------------------------------


def entry_names(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def spec_entry(axes: Sequence[str]) -> Any:
    """A `PartitionSpec` entry for mesh axes: None, a name, or a tuple of names."""
    axes = tuple(axes)
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def entries_spec(entries: Sequence[Sequence[str]], unreduced: Sequence[str] = ()) -> P:
    """A `PartitionSpec` with one entry per array axis."""
    parts = (spec_entry(e) for e in entries)
    return P(*parts, unreduced=set(unreduced)) if unreduced else P(*parts)


def as_spec(spec: Any) -> P:
    if spec is None:
        return P()
    if isinstance(spec, P):
        return spec
    if isinstance(spec, tuple | list):
        return P(*spec)
    raise TypeError(f"expected a PartitionSpec, got {spec!r}")


def itemsize(dtype: Any) -> int:
    return np.dtype(dtype).itemsize


def check_divides(what: str, dim: int, axes: tuple[str, ...], sizes, fix: str) -> None:
    n = math.prod(sizes[a] for a in axes)
    if dim % n:
        shown = ", ".join(f"{a!r} (size {sizes[a]})" for a in axes)
        padded = -(-dim // n) * n
        raise ValueError(
            f"{what} {dim} does not divide mesh axis {shown} (shards: {n}): "
            + fix.format(padded=padded, dim=dim, n=n)
        )


def named(dims_mapping, names) -> list[tuple[str, ...]]:
    return [tuple(names[a] for a in entry_mesh_axes(e)) for e in dims_mapping]


def dims_mapping(entries: Entries, names: Sequence[str]) -> tuple:
    idx = {a: i for i, a in enumerate(names)}
    return tuple(layout.normalize_entry(tuple(idx[a] for a in e)) for e in entries)


def mesh_sizes(mesh: Any) -> tuple[int, ...]:
    sizes = getattr(mesh, "axis_sizes", None)
    if sizes is None:
        raise TypeError(f"expected a jax.sharding.Mesh or AbstractMesh, got {mesh!r}")
    return tuple(int(s) for s in sizes)


def is_explicit_mesh(mesh: Any) -> bool:
    types = getattr(mesh, "axis_types", ())
    return bool(types) and all(str(t).endswith("Explicit") for t in types)


def backend_of(mesh: Any) -> str:
    import jax

    if isinstance(mesh, jax.sharding.Mesh) and mesh.devices.size:
        return str(mesh.devices.flat[0].platform)
    return jax.default_backend()


def collective(phase, op, axes, operand, shape, dtype, wire, why) -> Collective:
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


# --- phase 1: the scalars and the table ------------------------------------------------------


def validate_scalars(num_rows: int, vocab_size: Any, padding_idx: Any) -> int:
    vocab_size = num_rows if vocab_size is None else vocab_size
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int | np.integer):
        raise TypeError(f"vocab_size must be an int, got {vocab_size!r}")
    if not 1 <= vocab_size <= num_rows:
        raise ValueError(
            f"vocab_size must be in [1, {num_rows}] (the table's rows), got {vocab_size}"
        )
    if padding_idx is not None:
        if isinstance(padding_idx, bool) or not isinstance(padding_idx, int | np.integer):
            raise TypeError(f"padding_idx must be an int or None, got {padding_idx!r}")
        if not 0 <= padding_idx < vocab_size:
            raise ValueError(
                f"padding_idx must be in [0, {vocab_size}) (the vocabulary), got {padding_idx}"
            )
    return int(vocab_size)


def table_layout(weight_shape, weight_spec, names, sizes) -> tuple[tuple[str, ...], ...]:
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


# --- phase 2: the output's layout ------------------------------------------------------------


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


# --- phase 3: the body's layouts ---------------------------------------------------------------


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


# --- phase 4: the rules ----------------------------------------------------------------------


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


def prod(axes, sizes) -> int:
    return math.prod(sizes[a] for a in axes)


def spec_entries(spec: P) -> Entries:
    return tuple(entry_names(e) for e in spec.partitions)


def make_operand(name, shape, dtype, given_entries, body_entries) -> Operand:
    return Operand(
        name=name,
        shape=tuple(shape),
        dtype=np.dtype(dtype).name,
        given=entries_spec(given_entries),
        spec=entries_spec(body_entries),
        moves=plan_moves(given_entries, body_entries),
    )
