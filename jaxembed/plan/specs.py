"""Mesh and spec helpers every plan shares: entries, specs, sizes, and the scalars' checks.

A layout is one tuple of mesh axis names per array axis (`Entries`); these functions turn
`PartitionSpec`s into entries and back, read a mesh's sizes and axis types, check that a
split divides, and validate `vocab_size` and `padding_idx` (`validate_scalars`, the one check
of them for every plan). This module imports nothing from `jaxembed.plan` but its types.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec as P

from jaxembed import layout
from jaxembed.layout import entry_mesh_axes
from jaxembed.plan.types import Entries

__all__ = [
    "as_spec",
    "backend_of",
    "check_divides",
    "dims_mapping",
    "drop_unit_axes",
    "entries_spec",
    "entry_names",
    "format_bytes",
    "is_explicit_mesh",
    "itemsize",
    "mesh_sizes",
    "named",
    "prod",
    "spec_entries",
    "spec_entry",
    "validate_scalars",
]


def entry_names(entry: Any) -> tuple[str, ...]:
    """The mesh axis names of one `PartitionSpec` entry (None, a name or a tuple)."""
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


def spec_entries(spec: P) -> Entries:
    """The entries of a `PartitionSpec` (one per entry it has)."""
    return tuple(entry_names(e) for e in spec.partitions)


def drop_unit_axes(spec: P, sizes: dict[str, int]) -> P:
    """`spec` without the mesh axes of size 1: a split into one piece moves nothing, so the
    plans never name one (no collective, no copy over a group of one device).

    Examples:
      >>> drop_unit_axes(P(("data", "model"), None), {"data": 1, "model": 4})
      P('model', None)
      >>> drop_unit_axes(P("data", unreduced={"model"}), {"data": 2, "model": 1})
      P('data',)
    """
    parts = tuple(
        spec_entry(a for a in entry_names(e) if sizes.get(a, 2) != 1) for e in spec.partitions
    )
    unreduced = {a for a in spec.unreduced if sizes.get(a, 2) != 1}
    return P(*parts, unreduced=unreduced) if unreduced else P(*parts)


def as_spec(spec: Any) -> P:
    """A `PartitionSpec` from None (replicated), a spec, or a tuple or list of entries."""
    if spec is None:
        return P()
    if isinstance(spec, P):
        return spec
    if isinstance(spec, tuple | list):
        return P(*spec)
    raise TypeError(f"expected a PartitionSpec, got {spec!r}")


def named(dims_mapping, names) -> list[tuple[str, ...]]:
    """Entries in mesh axis names from a dims mapping (mesh axis indices)."""
    return [tuple(names[a] for a in entry_mesh_axes(e)) for e in dims_mapping]


def dims_mapping(entries: Entries, names: Sequence[str]) -> tuple:
    """A dims mapping (mesh axis indices) from entries in mesh axis names."""
    idx = {a: i for i, a in enumerate(names)}
    return tuple(layout.normalize_entry(tuple(idx[a] for a in e)) for e in entries)


def itemsize(dtype: Any) -> int:
    return np.dtype(dtype).itemsize


def prod(axes, sizes) -> int:
    """The devices along `axes`: the product of their sizes."""
    return math.prod(sizes[a] for a in axes)


def format_bytes(n: float) -> str:
    """Bytes for people: `512 B`, `4.0 KiB`, `1.3 MiB`, `2.0 GiB`.

    >>> format_bytes(1536), format_bytes(3 * 2**20)
    ('1.5 KiB', '3.0 MiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def mesh_sizes(mesh: Any) -> tuple[int, ...]:
    sizes = getattr(mesh, "axis_sizes", None)
    if sizes is None:
        raise TypeError(f"expected a jax.sharding.Mesh or AbstractMesh, got {mesh!r}")
    return tuple(int(s) for s in sizes)


def is_explicit_mesh(mesh: Any) -> bool:
    types = getattr(mesh, "axis_types", ())
    return bool(types) and all(str(t).endswith("Explicit") for t in types)


def backend_of(mesh: Any) -> str:
    """The platform of a concrete mesh's devices, else jax's default backend."""
    import jax

    if isinstance(mesh, jax.sharding.Mesh) and mesh.devices.size:
        return str(mesh.devices.flat[0].platform)
    return jax.default_backend()


def check_divides(what: str, dim: int, axes: tuple[str, ...], sizes, fix: str) -> None:
    """Raises a ValueError naming the mesh axes and `fix` when `axes` do not divide `dim`."""
    n = math.prod(sizes[a] for a in axes)
    if dim % n:
        shown = ", ".join(f"{a!r} (size {sizes[a]})" for a in axes)
        padded = -(-dim // n) * n
        raise ValueError(
            f"{what} {dim} does not divide mesh axis {shown} (shards: {n}): "
            + fix.format(padded=padded, dim=dim, n=n)
        )


def validate_scalars(num_rows: int, vocab_size: Any, padding_idx: Any) -> int:
    """`vocab_size` (default `num_rows`) checked against the table, and `padding_idx` in it.

    Raises:
      TypeError: a `vocab_size` or `padding_idx` that is not an int.
      ValueError: `vocab_size` outside `[1, num_rows]`, `padding_idx` outside the vocabulary.
    """
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
