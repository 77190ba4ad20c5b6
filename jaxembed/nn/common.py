"""What both Flax `Embed` modules and both collections share: layouts from Flax metadata.

Helpers of `jaxembed.nn.nnx_embed`, `jaxembed.nn.linen_embed` and the collections (internal):

* the mesh and the table's `PartitionSpec` as a Flax program states them (`current_mesh`,
  `as_spec`, `check_mesh_names`, `names_mesh_axes`, `batch_hint`);
* the padded row count of a table and its zero padding rows (`padded_rows`, `pad_rows`);
* the tied head's logits (`tied_logits`; their deferred form is `jaxembed.nn.deferred`);
* a table set from host values, placed as its metadata says (`place_host_table`), and the
  check that a table is laid out as its metadata says (`check_table_placed`);
* the exchange option and its deprecated old name, resolved here once (`resolve_exchange`).
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta as linen_meta
from flax.core import spmd as core_spmd
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxembed.kernels.arrays import is_explicit, normalize_spec, stated_spec
from jaxembed.kernels.lookup import lookup

__all__ = [
    "IDS_ADVICE",
    "RowInitializer",
    "as_spec",
    "batch_hint",
    "check_mesh_names",
    "check_table_placed",
    "current_mesh",
    "dynamic_rows_lookup",
    "host_value",
    "names_mesh_axes",
    "out_spec_like_batch",
    "pad_rows",
    "padded_rows",
    "place_host_table",
    "replicated_on",
    "resolve_exchange",
    "tied_logits",
]

IDS_ADVICE = (
    "pass inputs_sharding=PartitionSpec(...) when calling the module, or run it inside "
    "flax.linen.logical_axis_rules with a 'batch' axis"
)


def current_mesh(mesh: Any = None) -> Any:
    """`mesh` (metadata), else `jax.set_mesh`'s abstract mesh, else None."""
    if mesh is not None:
        return mesh
    ctx = jax.sharding.get_abstract_mesh()
    return None if ctx.empty else ctx


def as_spec(sharding: Any) -> P | None:
    """A `PartitionSpec` from a spec, a `NamedSharding`, a tuple of names, or None."""
    if sharding is None or isinstance(sharding, P):
        return sharding
    if isinstance(sharding, NamedSharding):
        return sharding.spec
    if isinstance(sharding, tuple | list):
        return P(*sharding)
    raise TypeError(
        f"expected a PartitionSpec, a NamedSharding or a tuple of mesh axis names, got {sharding!r}"
    )


def check_mesh_names(spec: P | None, mesh: Any, what: str) -> None:
    """Raises when `spec` names an axis the mesh lacks (an unresolved logical name)."""
    if spec is None or mesh is None:
        return
    for entry in spec:
        for name in (entry,) if isinstance(entry, str) else entry or ():
            if name not in mesh.axis_names:
                raise ValueError(
                    f"{what} {spec} names {name!r}, which is not an axis of the mesh "
                    f"{tuple(mesh.axis_names)}: if {name!r} is a logical axis name, call the "
                    f"module inside flax.linen.logical_axis_rules([({name!r}, <mesh axis or "
                    "None>), ...]), as at initialization"
                )


def names_mesh_axes(spec: P | None, mesh: Any) -> bool:
    """Whether every name in `spec` is an axis of `mesh` (False for an unresolved logical
    name, True when there is no mesh to check against)."""
    if spec is None or mesh is None:
        return True
    for entry in spec:
        for name in (entry,) if isinstance(entry, str) else entry or ():
            if name not in mesh.axis_names:
                return False
    return True


def batch_hint(inputs_sharding: Any, mesh: Any) -> P | None:
    """The ids' layout a Flax program states: `inputs_sharding`, else the active logical axis
    rules' mapping of `"batch"` (Flax's and MaxText's name for the batch axis)."""
    if inputs_sharding is not None:
        return as_spec(inputs_sharding)
    rules = core_spmd.get_logical_axis_rules()
    for name, axes in rules or ():
        if name == "batch" and axes is not None and mesh is not None:
            spec = P(axes)
            return spec if names_mesh_axes(spec, mesh) else None
    return None


def padded_rows(num_embeddings: int, spec: P | None, mesh: Any, multiple: int | None) -> int:
    """Rows of the parameter: `num_embeddings` rounded up to the row shards (and `multiple`)."""
    if multiple is not None and (isinstance(multiple, bool) or not int(multiple) >= 1):
        raise ValueError(f"pad_to_multiple_of must be a positive int or None, got {multiple!r}")
    step = int(multiple or 1)
    if spec is not None and mesh is not None and len(spec) > 0 and spec[0] is not None:
        row_axes = (spec[0],) if isinstance(spec[0], str) else tuple(spec[0])
        sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
        if all(a in sizes for a in row_axes):
            step = math.lcm(step, math.prod(sizes[a] for a in row_axes))
    return -(-num_embeddings // step) * step


def pad_rows(table: jax.Array, rows: int) -> jax.Array:
    """Appends zero rows up to `rows` (the padding rows, never read nor updated)."""
    extra = rows - table.shape[0]
    if extra <= 0:
        return table
    return jnp.concatenate([table, jnp.zeros((extra, table.shape[1]), table.dtype)])


def out_spec_like_batch(query: jax.Array, mesh: Any) -> P | None:
    """In an Explicit mesh: the query's batch axes and a whole last axis (for `attend`)."""
    if not is_explicit(mesh):
        return None
    spec = jax.typeof(query).sharding.spec
    parts = tuple(spec) + (None,) * (query.ndim - len(spec))
    return P(*parts[:-1], None)


def tied_logits(
    query: jax.Array, table: jax.Array, num_embeddings: int, mesh: Any, out_sharding: Any
) -> jax.Array:
    """`query @ table.T` over the real rows: the body of both modules' `attend`.

    Internal. The logits take `out_sharding`, by default the query's batch axes with the
    vocab axis whole (an Explicit mesh needs it said); padding rows are cut off.
    """
    if out_sharding is None:
        out_sharding = out_spec_like_batch(query, mesh)
    logits = jnp.dot(query, table.T, out_sharding=out_sharding)
    if table.shape[0] != num_embeddings:
        logits = logits[..., :num_embeddings]
    return logits


# --- tables set from host values ------------------------------------------------------------


def host_value(value: Any) -> bool:
    """Whether a concrete table value is not laid out on a mesh: numpy (what checkpoint loaders
    return), an array on one device (`jnp.asarray`, a restore without target shardings), or
    one whole on every device of a mesh (`jnp.asarray` under `jax.set_mesh`)."""
    if isinstance(value, jax.core.Tracer):
        return False
    if isinstance(value, jax.Array):
        sharding = value.sharding
        return not isinstance(sharding, NamedSharding) or sharding.is_fully_replicated
    return isinstance(value, np.ndarray | np.generic)


def _concrete_mesh(value: Any, mesh: Any) -> Any:
    """The concrete mesh to put `value` on: `mesh` if concrete, else `jax.set_mesh`'s, else the
    one `value` is on, if it has `mesh`'s axis names; None when there is none."""
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh
    candidates = []
    try:
        candidates.append(jax.sharding.get_mesh())
    except ValueError:  # inside a trace: a host value there is the program's to lay out
        return None
    sharding = getattr(value, "sharding", None)
    if isinstance(sharding, NamedSharding):
        candidates.append(sharding.mesh)
    for concrete in candidates:
        if not isinstance(concrete, jax.sharding.Mesh) or concrete.empty:
            continue
        if mesh is None or tuple(concrete.axis_names) == tuple(mesh.axis_names):
            return concrete
    return None


def place_host_table(value: Any, mesh: Any, spec: P | None) -> Any:
    """A host value (`host_value`) put in `spec` on `mesh`, as Flax places a parameter from its
    metadata when it creates it; `value` itself when it is placed already, or when no layout
    or no concrete mesh (the metadata's, `jax.set_mesh`'s, the value's own) says where."""
    if spec is None or not any(normalize_spec(spec, 2)) or not host_value(value):
        return value
    concrete = _concrete_mesh(value, mesh)
    if concrete is None or concrete.size == 1 or not names_mesh_axes(spec, concrete):
        return value
    return jax.device_put(value, NamedSharding(concrete, spec))


def check_table_placed(table: Any, mesh: Any, spec: P | None, where: str, fix: str) -> None:
    """Raises when the table is laid out otherwise than its metadata says (`spec`).

    The kernels never move a table, and would name their own `weight_spec` argument, which a
    module's user never passed; this names the parameter and the placement that fixes it.
    Nothing to check where the layout cannot be seen (a traced table in an Auto mesh).
    """
    if spec is None or mesh is None or mesh.size == 1:
        return
    given = stated_spec(table, mesh)
    if given is None or normalize_spec(given, 2) == normalize_spec(spec, 2):
        return
    if any(normalize_spec(given, 2)):
        why = "It was placed or resharded otherwise after it was created"
    else:
        given = f"{given} (whole on every device)"
        why = (
            "A table set from host values (numpy, as checkpoint loaders return) has no layout "
            "of its own, and jit lays it out whole on every device; Flax places a parameter "
            "from its metadata only when it creates it"
        )
    raise ValueError(
        f"{where}: the parameter `embedding` is laid out as {given}, but its sharding metadata "
        f"says {spec} (mesh axes {dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))}). "
        f"{why}, and jaxembed never moves a table. Place it once, before the jitted step: {fix}"
    )


# --- deferred logits: the tied head's loss for a model whose __call__ ends in attend --------


def resolve_exchange(exchange: str, gradient_exchange: str | None, where: str) -> str:
    """The lookup's exchange from `exchange` and its deprecated old name `gradient_exchange`.

    The one place the old name is read: it warns (a `DeprecationWarning` naming `exchange`)
    and stands for `exchange`.

    Args:
      exchange: the exchange (`"auto"`, `"dense"`, `"rows"`, `"routed"`).
      gradient_exchange: the old name's value, or None (not given).
      where: the module, e.g. `"jaxembed.nnx.Embed"`, for the messages.

    Returns:
      The exchange to run.

    Raises:
      ValueError: both names given, with different values.
    """
    if gradient_exchange is None:
        return exchange
    if exchange != "auto" and exchange != gradient_exchange:
        raise ValueError(
            f"{where}(exchange={exchange!r}, gradient_exchange={gradient_exchange!r}): the two "
            f"disagree; gradient_exchange is exchange's old name: pass "
            f"{where}(..., exchange={exchange!r}) only"
        )
    warnings.warn(
        f"{where}: gradient_exchange is deprecated, use exchange: "
        f"{where}(..., exchange={gradient_exchange!r})",
        DeprecationWarning,
        stacklevel=_caller_level(),
    )
    return gradient_exchange


# Frames of the modules' construction, which a deprecation warning skips to name the user's line.
_INTERNAL = ("jaxembed.nn.", "flax.", "dataclasses")


def _caller_level() -> int:
    """The `stacklevel` of the first frame outside these modules and Flax's (the user's line
    that builds the module), so that the warning names it."""
    # As `warnings.warn` counts from `resolve_exchange`: 1 is it, 2 its caller.
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level


def dynamic_rows_lookup(
    rows: jax.Array, table: jax.Array, capacity: int, mesh: Any, spec: Any, exchange: str,
    inputs_sharding: Any, *, recording: bool, function: str,
) -> tuple[jax.Array, dict[str, Any]]:  # fmt: skip
    """A dynamic table's lookup of its remapped rows (`capacity`: no row, reads zeros, eagerly
    too), the table held constant while a training helper records; and the lookup's static
    arguments, which the row-sparse update takes again."""
    static = dict(
        vocab_size=capacity, mesh=mesh, weight_spec=spec, exchange=exchange,
        x_hint=batch_hint(inputs_sharding, current_mesh(mesh)),
    )  # fmt: skip
    out = lookup(rows, jax.lax.stop_gradient(table) if recording else table, **static,
                 function=function, check_ids=False)  # fmt: skip
    return out, static


class RowInitializer:
    """A dynamic table's initializer as its reset rows call it: `init` without the
    partitioning box it may return (NNX's `VariableMetadata`, Linen's `nn.Partitioned`,
    unboxed with no sharding constraint), equal for equal initializers, so that they give one
    compiled step."""

    def __init__(self, init: Any):
        self.init = init

    def __call__(self, key, shape, dtype=jnp.float32):
        value = self.init(key, shape, dtype)
        if hasattr(value, "raw_value"):  # nnx.with_partitioning's VariableMetadata
            return value.raw_value
        if isinstance(value, linen_meta.Partitioned):  # nn.with_partitioning's box
            return value.value
        return value

    def __eq__(self, other):
        return isinstance(other, RowInitializer) and other.init == self.init

    def __hash__(self):
        return hash(self.init)


def replicated_on(mesh: Any) -> Any:
    """`x -> x` placed whole on every device of `mesh` (a concrete one, or `jax.set_mesh`'s),
    so that a checkpoint restores it where the step runs; `x -> x` without a mesh, or traced."""
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
        try:
            mesh = jax.sharding.get_mesh()
        except ValueError:  # traced (under `jit`): the program lays its values out
            return lambda x: x
        mesh = None if mesh.empty else mesh
    if mesh is None or mesh.size == 1:
        return lambda x: x
    # `P(None, ...)`, one entry a dim, as a jitted step returns it (`P()` is the same layout,
    # but the step's second call would miss its first `jit` cache entry)
    return lambda x: jax.device_put(x, NamedSharding(mesh, normalize_spec(P(), jnp.ndim(x))))
