"""Where arrays are laid out, and what jaxembed assumes when a layout cannot be seen.

A concrete array carries its `NamedSharding`; under `jit` an Explicit mesh carries the layout
in the array's type (`jax.typeof(x).sharding.spec`). In an Auto mesh under `jit` a traced
array carries no layout at all. There jaxembed never guesses silently:

* a **table** whose layout is unknown is never fed to a `shard_map` (that would force XLA to
  gather it): the lookup falls back to XLA's own partitioning of a masked `take`, and a
  warning says how to state the layout;
* **ids** whose layout is unknown are assumed to be laid out as data-parallel programs lay
  them out: the batch axis split over the mesh axes the table does not use, as far as that
  divides (`assumed_ids_spec`); a warning names the assumption and the override.

Each assumption warns once per process and layout (`warn_once`).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "assumed_ids_spec",
    "batch_typed_like",
    "conform",
    "is_explicit",
    "layout_known",
    "move",
    "normalize_spec",
    "place_table",
    "resolve_mesh",
    "retype",
    "spec_of",
    "stated_spec",
    "typed_like",
    "warn_if_layout_unknown",
    "warn_once",
    "whole_on_one_device",
    "zeros_like_output",
]

_WARNED: set[tuple[str, str, int]] = set()


def resolve_mesh(mesh: Any = None, *arrays: Any) -> Any:
    """The mesh to run on: `mesh`, else `jax.set_mesh`'s, else one an array is laid out on.

    `embedding` and `vocab_parallel_cross_entropy` call it to find their mesh when none is
    passed. Under `jax.set_mesh` the context's `AbstractMesh` wins over the arrays' own.

    Args:
      mesh: a `Mesh` or `AbstractMesh` to use as is, or None to look for one.
      *arrays: arrays (concrete or traced) whose `NamedSharding`, or sharding type, names
        a mesh; the first one that does wins.

    Returns:
      The mesh, or None when there is none (a single-device lookup).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
      >>> table = jax.device_put(jnp.ones((64, 8)), NamedSharding(mesh, P("model", None)))
      >>> resolve_mesh(None, table) is mesh, resolve_mesh(None, jnp.ones(3))
      (True, None)
    """
    if mesh is not None:
        return mesh
    ctx = jax.sharding.get_abstract_mesh()
    if not ctx.empty:
        return ctx
    for a in arrays:
        sharding = getattr(a, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
        try:
            aval_sharding = jax.typeof(a).sharding
        except Exception:  # not a jax value
            continue
        if isinstance(aval_sharding, NamedSharding) and not aval_sharding.mesh.empty:
            return aval_sharding.mesh
    return None


def is_explicit(mesh: Any) -> bool:
    """Whether every axis of `mesh` is `AxisType.Explicit` (False for no mesh)."""
    return mesh is not None and all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def layout_known(a: Any, mesh: Any) -> bool:
    """Whether `a`'s layout on `mesh` can be read: concrete, or typed in an Explicit mesh."""
    if not isinstance(a, jax.core.Tracer):
        return True
    return is_explicit(mesh)


def stated_spec(a: Any, mesh: Any) -> P | None:
    """The layout `a` itself states on `mesh`: its `NamedSharding` there, or its type in an
    Explicit mesh; None when it states none (a numpy array, a traced array in an Auto mesh)."""
    sharding = getattr(a, "sharding", None)
    if isinstance(sharding, NamedSharding) and tuple(sharding.mesh.axis_names) == tuple(
        mesh.axis_names
    ):
        return sharding.spec
    if isinstance(a, jax.core.Tracer) and is_explicit(mesh):
        return spec_of(a, mesh)
    return None


def spec_of(a: Any, mesh: Any) -> P:
    """The `PartitionSpec` an array is laid out with on `mesh`, or `P()` when unknown.

    Concrete arrays tell their `NamedSharding`; under `jit`, only Explicit mesh axes are
    visible in the type (`jax.typeof(a).sharding.spec`): in an Auto mesh pass the spec.

    Args:
      a: an array, concrete or traced (anything else reads as `P()`).
      mesh: the mesh the layout is wanted on; a concrete array's `NamedSharding` counts
        only when its mesh has the same axis names.

    Returns:
      The array's `PartitionSpec`, or `P()` (replicated) when it is not known.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
      >>> table = jax.device_put(jnp.ones((64, 8)), NamedSharding(mesh, P("model", None)))
      >>> spec_of(table, mesh) == P("model", None), spec_of(jnp.ones(3), mesh) == P()
      (True, True)
    """
    sharding = getattr(a, "sharding", None)
    if isinstance(sharding, NamedSharding) and tuple(sharding.mesh.axis_names) == tuple(
        mesh.axis_names
    ):
        return sharding.spec
    try:
        aval_sharding = jax.typeof(a).sharding
    except Exception:
        return P()
    if isinstance(aval_sharding, NamedSharding) and not aval_sharding.mesh.empty:
        return aval_sharding.spec
    return P()


def normalize_spec(spec: P, ndim: int) -> P:
    """`spec` with one entry per axis and one-name tuples unwrapped, for comparisons."""
    parts = tuple(spec.partitions) + (None,) * (ndim - len(spec.partitions))
    parts = tuple(p[0] if isinstance(p, tuple) and len(p) == 1 else p for p in parts)
    return P(*parts, unreduced=spec.unreduced) if spec.unreduced else P(*parts)


def move(a: jax.Array, mesh: Any, spec: P, *, known: P | None = None) -> jax.Array:
    """Puts a small operand in `spec` before a kernel whose `in_specs` say so.

    A no-op when `a` is already laid out so, which is the case for every operand whose
    layout jaxembed read or assumed (the kernels move ids themselves, with the plan's
    collectives). Otherwise `device_put` for a concrete array, `reshard` in an Explicit
    mesh, `with_sharding_constraint` in an Auto one. Never used on a table. `known`: the
    layout `a` has, where the caller knows it and an Auto mesh's tracer would not say (a
    kernel's output).
    """
    have = spec_of(a, mesh) if known is None and mesh is not None else known
    if mesh is None or normalize_spec(have, a.ndim) == normalize_spec(spec, a.ndim):
        return a
    if not isinstance(a, jax.core.Tracer) and isinstance(mesh, jax.sharding.Mesh):
        return jax.device_put(a, NamedSharding(mesh, spec))
    if is_explicit(mesh):
        return jax.sharding.reshard(a, NamedSharding(mesh, spec))
    return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec))


def conform(a: Any, mesh: Any, spec: P) -> Any:
    """`a` typed as a plan's `spec` where its Explicit type names more: the mesh axes of size
    1 plans drop (`jaxembed.plan.specs.drop_unit_axes`). Free: a split into one piece is the
    same bytes on the same devices, so the `reshard` compiles to nothing. A no-op outside
    an Explicit mesh, where `shard_map` reads no type."""
    if a is None or mesh is None or not is_explicit(mesh):
        return a
    try:
        typed = jax.typeof(a).sharding
    except Exception:
        return a
    if not isinstance(typed, NamedSharding) or typed.mesh.empty:
        return a
    if normalize_spec(typed.spec, a.ndim) == normalize_spec(spec, a.ndim):
        return a
    return jax.sharding.reshard(a, NamedSharding(typed.mesh, spec))


def retype(a: Any, spec: P | None) -> Any:
    """`a` typed as `spec` (a plan's `out_type_spec`: its `out_spec` with the caller's axes of
    size 1, free); `a` itself when `spec` is None or it is typed so already."""
    if spec is None:
        return a
    typed = jax.typeof(a).sharding
    if not isinstance(typed, NamedSharding) or typed.mesh.empty:
        return a
    if normalize_spec(typed.spec, a.ndim) == normalize_spec(spec, a.ndim):
        return a
    return jax.sharding.reshard(a, NamedSharding(typed.mesh, spec))


def place_table(a: Any, mesh: Any, spec: P) -> Any:
    """A table (or a collection's stack) born in its layout on `mesh`.

    For the Flax modules' initializers, eager or under `jit`: a concrete array is put on the
    mesh's devices (`device_put`; an `AbstractMesh`, from `jax.set_mesh`, stands for that
    context's concrete mesh), a traced one is resharded (Explicit mesh) or constrained (Auto
    mesh), so that it is split from the start, not replicated until the first step has run.
    With no mesh it is returned as a jax array, unplaced.
    """
    if mesh is None or getattr(mesh, "empty", False):
        return jnp.asarray(a)
    sharding = NamedSharding(mesh, spec)
    if isinstance(a, jax.core.Tracer):
        if is_explicit(mesh):
            return jax.sharding.reshard(a, sharding)
        return jax.lax.with_sharding_constraint(a, sharding)
    if not isinstance(mesh, jax.sharding.Mesh):
        concrete = jax.sharding.get_mesh()
        if (
            not isinstance(concrete, jax.sharding.Mesh)
            or concrete.empty
            or tuple(concrete.axis_names) != tuple(mesh.axis_names)
        ):
            return jnp.asarray(a)
        sharding = NamedSharding(concrete, spec)
    return jax.device_put(a, sharding)


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def assumed_ids_spec(shape: tuple[int, ...], mesh: Any, table_spec: P, hint: P | None = None) -> P:
    """The layout jaxembed assumes for ids whose own layout it cannot see.

    With a `hint` (a module's `inputs_sharding`, the batch's logical axis), each axis keeps
    the longest prefix of the hint's mesh axes that divides it. Without one, the first axis
    is split over the mesh axes the table does not use, in mesh order, as far as that
    divides: what data-parallel programs do. A batch that nothing divides (a `[1, 1]`
    decoding step) is replicated.

    Args:
      shape: the ids' global shape.
      mesh: the mesh.
      table_spec: the table's layout.
      hint: a layout the program states for the ids, or None.

    Returns:
      A `PartitionSpec` with one entry per ids axis.

    Examples:
      >>> import jax
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
      >>> assumed_ids_spec((8, 128), mesh, P("model", None))
      P('data', None)
      >>> assumed_ids_spec((1, 1), mesh, P("model", None))        # nothing divides 1
      P(None, None)
      >>> assumed_ids_spec((8, 128), mesh, P(), hint=P(None, "model"))
      P(None, 'model')
    """
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    if not shape:
        return P()
    if hint is not None:
        wanted = [_axes(e) for e in tuple(hint) + (None,) * (len(shape) - len(hint))]
    else:
        used = {a for e in table_spec for a in _axes(e)}
        wanted = [tuple(a for a in mesh.axis_names if a not in used and sizes[a] > 1)]
        wanted += [()] * (len(shape) - 1)
    entries = []
    for d, axes in zip(shape, wanted, strict=True):
        k = len(axes)
        while k and d % math.prod(sizes[a] for a in axes[:k]):
            k -= 1
        entries.append(axes[:k])
    return P(*(None if not e else e[0] if len(e) == 1 else e for e in entries))


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    """The folders of jaxembed, jax, flax and optax, imported or not (found, not imported:
    which of them a process imported before this module must not change the answer)."""
    dirs = []
    for name in ("jaxembed", "jax", "flax", "optax"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            dirs.append(os.path.dirname(spec.origin) + os.sep)
    return tuple(dirs)


def _caller() -> tuple[str, int]:
    """The innermost frame outside jaxembed, jax, flax and the standard library's wrappers:
    the user's line that called into the lookup."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if (
            not name.startswith(_library_dirs())
            and "/contextlib.py" not in name
            and ("/functools.py" not in name)
        ):
            return name, frame.f_lineno
        frame = frame.f_back
    return "<unknown>", 0


def warn_once(key: str, message: str, *, stacklevel: int = 3) -> None:
    """Warns `message` once per process for each kind of assumption and call site.

    The warning points at the user's line (the first frame outside jaxembed, jax and flax),
    and counts as raised by jaxembed for warning filters (`-W error::UserWarning:jaxembed`).
    """
    del stacklevel
    filename, lineno = _caller()
    if (key, filename, lineno) in _WARNED:
        return
    _WARNED.add((key, filename, lineno))
    warnings.warn_explicit(message, UserWarning, filename, lineno, module="jaxembed")


def warn_if_layout_unknown(a: Any, mesh: Any, *, function: str, arg: str, what: str) -> None:
    """Warns (once) when `a` is traced in an Auto mesh, where its layout is invisible."""
    if isinstance(a, jax.core.Tracer) and not is_explicit(mesh) and mesh.size > 1:
        warn_once(
            f"{function}-{arg}",
            f"{function}() is traced in an Auto mesh without {arg}: a traced {what} does not "
            "carry its layout there, so it is taken as replicated and XLA may gather it. Pass "
            f"{arg}=PartitionSpec(...) (the Flax modules do), or use an Explicit mesh.",
            stacklevel=3,
        )


def zeros_like_output(
    shape: tuple[int, ...], dtype: Any, mesh: Any, spec: P, table: jax.Array, table_spec: P
) -> jax.Array:
    """The output of a lookup whose batch holds no id (every bag empty, or no example at
    all): zeros of `shape`, laid out as `spec`. Collectives over a zero-sized axis do not
    lower, so empty batches never reach a kernel; the zeros are made per shard from the
    table's own `shard_map`, so they live on its devices under any `jit`."""
    if mesh is None or mesh.size == 1:
        return jnp.zeros(shape, dtype)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    parts = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
    local = tuple(
        n // math.prod(sizes[a] for a in _axes(entry))
        for n, entry in zip(shape, parts, strict=True)
    )
    # `t[:0].sum()` is 0 whatever the table holds; it ties the zeros to the table, so that
    # `jit` keeps the table's devices for them rather than pruning the unused argument.
    body = jax.shard_map(
        lambda t: jnp.zeros(local, dtype) + t[:0].sum().astype(dtype),
        mesh=mesh,
        in_specs=(table_spec,),
        out_specs=spec,
        check_vma=False,
    )
    return body(conform(table, mesh, table_spec))


def whole_on_one_device(a: Any) -> Any:
    """`a` with its type's mesh axes dropped when its mesh has one device (free there).

    Under `jit` in a one-device Explicit mesh, a table typed `f32[V@model, H]`, or ids typed
    `i32[B@data]`, cannot feed a plain gather (JAX asks for an `out_sharding`); on one device
    the split is only a name, so the one-device paths drop it.
    """
    if not isinstance(a, jax.core.Tracer):
        return a
    try:
        sharding = jax.typeof(a).sharding
    except Exception:
        return a
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or mesh.size != 1 or not is_explicit(mesh):
        return a
    if all(p is None for p in sharding.spec):
        return a
    return jax.sharding.reshard(a, NamedSharding(mesh, P()))


def typed_like(a: Any, ref: Any) -> Any:
    """`a` retyped as `ref` where `whole_on_one_device(ref)` dropped `ref`'s mesh axes (free on
    one device): a one-device update gives the table and its state back in their own types."""
    if whole_on_one_device(ref) is ref:
        return a
    return jax.sharding.reshard(a, jax.typeof(ref).sharding)


def batch_typed_like(out: Any, ids: Any, lead: int) -> Any:
    """`out` typed with the first `lead` entries of `ids`' type, where `whole_on_one_device(ids)`
    dropped them (free on one device): a one-device lookup's output keeps the batch's layout
    type, as the sharded paths' outputs do, so outputs of different calls concatenate."""
    if whole_on_one_device(ids) is ids:
        return out
    sharding = jax.typeof(ids).sharding
    parts = tuple(sharding.spec) + (None,) * (ids.ndim - len(tuple(sharding.spec)))
    spec = P(*parts[:lead], *(None,) * (out.ndim - lead))
    return jax.sharding.reshard(out, NamedSharding(sharding.mesh, spec))


def eager(*arrays: Any) -> bool:
    """Whether a call runs op by op (no argument is a tracer): a `shard_map` body would then
    be dispatched one primitive at a time (seconds per call), so the kernels jit it."""
    return not any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(arrays))
