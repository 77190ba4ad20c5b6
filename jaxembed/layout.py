"""The layout bridge: Paddle-style dims mappings and partial dims <-> `PartitionSpec`.

A *dims mapping* has one entry per tensor axis: `-1` when the axis is replicated, the index
of the mesh axis that splits it, or a tuple of mesh-axis indices (major first) when several
mesh axes split it together. *Partial dims* are the mesh axes along which every shard holds
a partial sum; JAX spells them `PartitionSpec(..., unreduced={...})`.

Examples:
  >>> from jax.sharding import PartitionSpec as P
  >>> from jaxembed.layout import to_partition_spec, to_dims_mapping
  >>> to_partition_spec((1, -1), ("data", "model"))
  P('model', None)
  >>> to_partition_spec(((0, 1), -1), ("data", "model"))
  P(('data', 'model'), None)
  >>> to_partition_spec((1, -1), ("data", "model"), partial_dims={0})
  P('model', None, unreduced={'data'})
  >>> to_dims_mapping(P(None, "data"), ("data", "model"), ndim=2)
  (-1, 0)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # jax is imported lazily so that `jaxembed.rules` stays importable without it
    from jax.sharding import PartitionSpec

__all__ = [
    "DimsEntry",
    "DimsMapping",
    "axis_names_of",
    "entry_mesh_axes",
    "normalize_entry",
    "to_dims_mapping",
    "to_partial_dims",
    "to_partition_spec",
]

DimsEntry = int | tuple[int, ...]
"""One tensor axis: `-1`, a mesh-axis index, or a tuple of mesh-axis indices (major first)."""
DimsMapping = tuple[DimsEntry, ...]


def axis_names_of(mesh_or_axis_names: Any) -> tuple[str, ...]:
    """The mesh's axis names, from a `Mesh`, an `AbstractMesh` or a sequence of names.

    Every function of the bridge takes either a mesh or its axis names; this reads the
    names, in mesh order, so that index `i` of a dims mapping means `names[i]`.

    Args:
      mesh_or_axis_names: a `jax.sharding.Mesh`, an `AbstractMesh`, or a sequence of axis
        names such as `("data", "model")`.

    Returns:
      The axis names as a tuple of strings, in mesh order.

    Raises:
      TypeError: a single string, a non-iterable, or names that are not strings.

    Examples:
      >>> import jax
      >>> axis_names_of(jax.make_mesh((2, 4), ("data", "model")))
      ('data', 'model')
      >>> axis_names_of(["data", "model"])
      ('data', 'model')
    """
    names = getattr(mesh_or_axis_names, "axis_names", mesh_or_axis_names)
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise TypeError(
            f"expected a jax.sharding.Mesh or a sequence of mesh axis names, got {names!r}"
        )
    names = tuple(names)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"mesh axis names must be strings, got {names!r}")
    return names


def normalize_entry(entry: Any) -> DimsEntry:
    """Puts one dims-mapping entry in canonical form.

    An entry says which mesh axes split one tensor axis: `-1` (replicated), a mesh-axis
    index, or a tuple of mesh-axis indices, major first. The canonical form has one
    spelling per layout, so that entries compare with `==`: a one-element tuple becomes
    its int, an empty tuple becomes `-1`, and lists become tuples.

    Args:
      entry: `-1`, a mesh-axis index `>= 0`, or a sequence of mesh-axis indices `>= 0`.

    Returns:
      `-1`, an int `>= 0`, or a tuple of at least two ints `>= 0`.

    Raises:
      TypeError: a bool, a string, or anything else that is not an int or a sequence.
      ValueError: an int below `-1`, or a `-1` (or a nested tuple) inside a tuple.

    Examples:
      >>> normalize_entry((1,)), normalize_entry(()), normalize_entry([0, 1])
      (1, -1, (0, 1))
      >>> normalize_entry(-2)
      Traceback (most recent call last):
        ...
      ValueError: a dims mapping entry must be -1 or a mesh axis index, got -2
    """
    if isinstance(entry, bool):
        raise TypeError(f"a dims mapping entry must be an int or a tuple of ints, got {entry!r}")
    if isinstance(entry, int):
        if entry < -1:
            raise ValueError(f"a dims mapping entry must be -1 or a mesh axis index, got {entry}")
        return entry
    if isinstance(entry, Sequence) and not isinstance(entry, str):
        axes = tuple(normalize_entry(e) for e in entry)
        if any(not isinstance(a, int) or a < 0 for a in axes):
            raise ValueError(
                f"a tuple entry of a dims mapping lists mesh axis indices >= 0, got {entry!r}"
            )
        if len(axes) == 0:
            return -1
        return axes[0] if len(axes) == 1 else axes
    raise TypeError(f"a dims mapping entry must be an int or a tuple of ints, got {entry!r}")


def entry_mesh_axes(entry: DimsEntry) -> tuple[int, ...]:
    """The mesh axes a dims-mapping entry uses, major first.

    Args:
      entry: a canonical entry (see `normalize_entry`): `-1`, an index, or a tuple.

    Returns:
      A tuple of mesh-axis indices: `()` for a replicated axis.

    Examples:
      >>> entry_mesh_axes(-1), entry_mesh_axes(1), entry_mesh_axes((0, 1))
      ((), (1,), (0, 1))
    """
    if isinstance(entry, tuple):
        return entry
    return () if entry == -1 else (entry,)


def _check_no_repeats(axes: list[int], names: tuple[str, ...], what: Any) -> None:
    seen = set()
    for a in axes:
        if a in seen:
            raise ValueError(
                f"mesh axis {names[a]!r} is used twice in {what!r}: a mesh axis can split at "
                "most one axis of a tensor"
            )
        seen.add(a)


def to_partition_spec(
    dims_mapping: Sequence[Any],
    mesh_or_axis_names: Any,
    partial_dims: Iterable[int] = (),
) -> PartitionSpec:
    """Translates a dims mapping (and partial dims) into a `PartitionSpec`.

    Args:
      dims_mapping: one entry per tensor axis: `-1`, a mesh-axis index, or a tuple of them.
      mesh_or_axis_names: a `Mesh` or the mesh's axis names, in order.
      partial_dims: mesh-axis indices holding partial sums (`unreduced` in the spec).

    Returns:
      A `PartitionSpec` with one entry per tensor axis: `None` for `-1`, a mesh axis name
      for an index, a tuple of names for a tuple; `unreduced={...}` names the partial dims.

    Raises:
      ValueError: a mesh index out of range, a mesh axis used twice, or a mesh axis that
        both splits a tensor axis and holds partial sums.

    Examples:
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh_axes = ("data", "model")
      >>> to_partition_spec(((0, 1), -1), mesh_axes) == P(("data", "model"), None)
      True
      >>> spec = to_partition_spec((1, -1), mesh_axes, partial_dims={0})
      >>> spec == P("model", None, unreduced={"data"})
      True
    """
    names = axis_names_of(mesh_or_axis_names)
    entries = [normalize_entry(e) for e in dims_mapping]
    used: list[int] = []
    parts: list[Any] = []
    for entry in entries:
        axes = entry_mesh_axes(entry)
        for a in axes:
            if a >= len(names):
                raise ValueError(
                    f"dims mapping {tuple(dims_mapping)!r} names mesh axis {a}, but the mesh has "
                    f"{len(names)} axes {names!r}"
                )
        used.extend(axes)
        if not axes:
            parts.append(None)
        elif len(axes) == 1:
            parts.append(names[axes[0]])
        else:
            parts.append(tuple(names[a] for a in axes))
    _check_no_repeats(used, names, tuple(dims_mapping))
    partial = sorted(set(partial_dims))
    for a in partial:
        if not 0 <= a < len(names):
            raise ValueError(
                f"partial dim {a} is not a mesh axis index of a mesh with axes {names!r}"
            )
        if a in used:
            raise ValueError(
                f"mesh axis {names[a]!r} both splits a tensor axis and holds partial sums in "
                f"dims mapping {tuple(dims_mapping)!r}, partial dims {partial}"
            )
    from jax.sharding import PartitionSpec as P

    if partial:
        return P(*parts, unreduced={names[a] for a in partial})
    return P(*parts)


def _spec_partitions(spec: Any) -> tuple[Any, ...]:
    from jax.sharding import PartitionSpec as P

    if isinstance(spec, P):
        return tuple(spec.partitions) if hasattr(spec, "partitions") else tuple(spec)
    if spec is None:
        return ()
    if isinstance(spec, tuple | list):
        return tuple(spec)
    raise TypeError(f"expected a PartitionSpec, got {spec!r}")


def to_dims_mapping(spec: Any, mesh_or_axis_names: Any, ndim: int) -> DimsMapping:
    """Translates a `PartitionSpec` into a dims mapping of length `ndim`.

    A spec shorter than the tensor's rank leaves the remaining axes replicated.

    Args:
      spec: a `PartitionSpec` (or `None` for fully replicated).
      mesh_or_axis_names: a `Mesh` or the mesh's axis names, in order.
      ndim: the tensor's rank.

    Returns:
      A tuple of `ndim` entries.

    Raises:
      ValueError: an unknown mesh axis name, a mesh axis used twice, a spec longer than `ndim`,
        an UNCONSTRAINED entry.
      TypeError: an entry that is not None, a mesh axis name or a tuple of names.

    Examples:
      >>> import jax
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
      >>> to_dims_mapping(P("model"), mesh, ndim=2)           # a table split by rows
      (1, -1)
      >>> to_dims_mapping(P(("data", "model"), None), mesh, ndim=2)
      ((0, 1), -1)
    """
    names = axis_names_of(mesh_or_axis_names)
    parts = _spec_partitions(spec)
    if len(parts) > ndim:
        raise ValueError(
            f"PartitionSpec {spec!r} has {len(parts)} entries but the tensor has rank {ndim}: "
            "a spec can name at most one entry per tensor axis"
        )
    used: list[int] = []
    mapping: list[DimsEntry] = []
    for part in parts:
        if part is None:
            mapping.append(-1)
            continue
        if not isinstance(part, str | tuple | list):
            from jax.sharding import PartitionSpec as P

            if part is P.UNCONSTRAINED:
                raise ValueError(
                    f"PartitionSpec {spec!r} has an UNCONSTRAINED entry; jaxembed needs a "
                    "concrete layout (use None for a replicated axis)"
                )
            raise TypeError(
                f"PartitionSpec {spec!r} has entry {part!r}: an entry must be None, a mesh axis "
                "name or a tuple of mesh axis names"
            )
        group = (part,) if isinstance(part, str) else tuple(part)
        axes = []
        for name in group:
            if name not in names:
                raise ValueError(
                    f"PartitionSpec {spec!r} names mesh axis {name!r}, which is not one of the "
                    f"mesh's axes {names!r}"
                )
            axes.append(names.index(name))
        used.extend(axes)
        mapping.append(normalize_entry(tuple(axes)))
    _check_no_repeats(used, names, spec)
    return tuple(mapping) + (-1,) * (ndim - len(parts))


def to_partial_dims(spec: Any, mesh_or_axis_names: Any) -> frozenset[int]:
    """Translates a `PartitionSpec`'s `unreduced` set into partial dims.

    A tensor whose spec is `P(..., unreduced={"data"})` holds, on each shard, a partial
    sum over the `data` axis; its partial dims are `{index of "data"}`.

    Args:
      spec: a `PartitionSpec` (or None, or any object without `unreduced`: no partial dims).
      mesh_or_axis_names: a `Mesh` or the mesh's axis names, in order.

    Returns:
      The mesh-axis indices named in `spec.unreduced` (empty when there are none).

    Raises:
      ValueError: an unreduced name that is not an axis of the mesh.

    Examples:
      >>> from jax.sharding import PartitionSpec as P
      >>> to_partial_dims(P("model", None, unreduced={"data"}), ("data", "model"))
      frozenset({0})
      >>> to_partial_dims(P("model", None), ("data", "model"))
      frozenset()
    """
    names = axis_names_of(mesh_or_axis_names)
    unreduced = getattr(spec, "unreduced", frozenset()) or frozenset()
    out = set()
    for name in unreduced:
        if name not in names:
            raise ValueError(
                f"PartitionSpec {spec!r} names unreduced mesh axis {name!r}, which is not one of "
                f"the mesh's axes {names!r}"
            )
        out.add(names.index(name))
    return frozenset(out)
