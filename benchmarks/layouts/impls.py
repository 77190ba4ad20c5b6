"""The lookups `jaxembed bench` compares, each built into one jitted training step.

Every implementation is a `Program`: a parameter pytree holding the table, the shardings
Flax or the user would give it, and `apply(params, ids) -> out`. `make_step` turns any of them
into the same step, jitted with the same in/out shardings:

    out, vjp = jax.vjp(lambda p: apply(p, ids), params)   # forward
    grads = vjp(ct)                                      # backward, cotangent given
    params = optax.apply_updates(params, sgd.update(grads))  # elementwise: no communication

The cotangent is an input, so XLA can fold nothing away, and `out` is returned, so the
forward's collectives stay in the program.

Implementations:
  jaxembed: `jaxembed.embedding` (Explicit mesh, as `jax.make_mesh` makes it); `jaxembed[rows]`
    and `jaxembed[dense]` force the gradient exchange.
  xla: `jnp.take(table, ids, axis=0, mode='clip')`, partitioned by XLA (Auto mesh).
  flax-nnx, flax-linen: `nnx.Embed` / `linen.Embed` with `with_partitioning` on the table, as
    Flax's multi-device guide writes them (Auto mesh).
  flax-nnx-explicit, flax-linen-explicit: the same code in an Explicit mesh (`jax.make_mesh`'s
    default), where Flax raises on sharded tables; the error is the result.
  onehot: `one_hot(ids, V) @ table`, the TPU-style lookup, partitioned by XLA (Auto mesh).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding

import jaxembed
from benchmarks.layouts.cases import Case, Layout

__all__ = ["IMPLEMENTATIONS", "KNOWN", "Program", "build", "make_mesh", "make_step", "update_floor"]

IMPLEMENTATIONS = (
    "jaxembed",
    "xla",
    "flax-nnx",
    "flax-linen",
    "flax-nnx-explicit",
    "flax-linen-explicit",
    "onehot",
)
"""The implementations of a default run, jaxembed (the baseline of every ratio) first."""

KNOWN = (*IMPLEMENTATIONS, "jaxembed[rows]", "jaxembed[dense]")
"""Every name `build` accepts."""


@dataclasses.dataclass(frozen=True)
class Program:
    """One implementation of the lookup, ready to become a step.

    Attributes:
      name: the implementation's name.
      mesh: the concrete mesh it runs on (Auto or Explicit axes).
      params: the parameter pytree (one leaf: the table), arrays or `ShapeDtypeStruct`s.
      param_shardings: a pytree of `NamedSharding`s like `params`.
      apply: `apply(params, ids) -> out`.
    """

    name: str
    mesh: Any
    params: Any
    param_shardings: Any
    apply: Callable[[Any, jax.Array], jax.Array]

    def table_of(self, params: Any) -> jax.Array:
        """The table inside a parameter pytree of this program."""
        (table,) = jax.tree.leaves(params)
        return table


def make_mesh(layout: Layout, axis_type: AxisType) -> jax.sharding.Mesh:
    """The layout's mesh on the first devices, all axes of `axis_type`.

    Raises:
      ValueError: fewer devices than the mesh needs.
    """
    devices = jax.devices()
    if len(devices) < layout.num_devices:
        raise ValueError(
            f"layout {layout.name!r} needs {layout.num_devices} devices, found {len(devices)}: "
            "set XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax is imported "
            "(`jaxembed bench` does this itself)"
        )
    return jax.make_mesh(
        layout.mesh_shape,
        layout.mesh_axes,
        axis_types=(axis_type,) * len(layout.mesh_shape),
        devices=devices[: layout.num_devices],
    )


def _table_spec_tuple(layout: Layout) -> tuple[Any, Any]:
    parts = tuple(layout.table_spec) + (None,) * (2 - len(tuple(layout.table_spec)))
    return parts[0], parts[1]


def _placed(table: np.ndarray | None, case: Case, sharding: NamedSharding) -> Any:
    """The table on devices, or its abstract stand-in when `table` is None (compile only)."""
    if table is None:
        return jax.ShapeDtypeStruct(case.table_shape, jnp.dtype(case.dtype), sharding=sharding)
    return jax.device_put(table, sharding)


def _jaxembed(case: Case, table: np.ndarray | None, exchange: str, name: str) -> Program:
    layout = case.layout
    mesh = make_mesh(layout, AxisType.Explicit)
    sharding = NamedSharding(mesh, layout.table_spec)

    def apply(weight, ids):
        return jaxembed.embedding(
            ids, weight, mesh=mesh, x_spec=layout.ids_spec, weight_spec=layout.table_spec,
            out_spec=layout.out_spec, gradient_exchange=exchange,
        )  # fmt: skip

    return Program(name, mesh, _placed(table, case, sharding), sharding, apply)


def _xla(case: Case, table: np.ndarray | None) -> Program:
    mesh = make_mesh(case.layout, AxisType.Auto)
    sharding = NamedSharding(mesh, case.layout.table_spec)

    def apply(weight, ids):
        return jnp.take(weight, ids, axis=0, mode="clip")

    return Program("xla", mesh, _placed(table, case, sharding), sharding, apply)


def _onehot(case: Case, table: np.ndarray | None) -> Program:
    mesh = make_mesh(case.layout, AxisType.Auto)
    sharding = NamedSharding(mesh, case.layout.table_spec)

    def apply(weight, ids):
        return jax.nn.one_hot(ids, weight.shape[0], dtype=weight.dtype) @ weight

    return Program("onehot", mesh, _placed(table, case, sharding), sharding, apply)


def _flax_nnx(case: Case, table: np.ndarray | None, axis_type: AxisType, name: str) -> Program:
    """`nnx.Embed` with `nnx.with_partitioning`, created under `jax.set_mesh` (Flax's guide)."""
    from flax import nnx

    mesh = make_mesh(case.layout, axis_type)
    init = nnx.with_partitioning(nnx.initializers.normal(), _table_spec_tuple(case.layout))
    with jax.set_mesh(mesh):
        model = nnx.eval_shape(
            lambda: nnx.Embed(case.vocab, case.hidden, embedding_init=init, rngs=nnx.Rngs(0))
        )
    graphdef, state = nnx.split(model)
    shardings = nnx.get_named_sharding(state, mesh)  # from the Param's own metadata
    _check_flax_layout(name, shardings, case.layout)
    (sharding,) = jax.tree.leaves(shardings)
    placed = _placed(table, case, sharding)
    params = jax.tree.map(lambda _: placed, state)

    def apply(state, ids):
        return nnx.merge(graphdef, state)(ids)

    return Program(name, mesh, params, shardings, apply)


def _flax_linen(case: Case, table: np.ndarray | None, axis_type: AxisType, name: str) -> Program:
    """`linen.Embed` with `nn.with_partitioning`; shardings from `nn.get_sharding`."""
    import flax.linen as nn

    mesh = make_mesh(case.layout, axis_type)
    init = nn.with_partitioning(nn.initializers.normal(), _table_spec_tuple(case.layout))
    module = nn.Embed(case.vocab, case.hidden, embedding_init=init)
    ids = jax.ShapeDtypeStruct(case.ids_shape, jnp.int32)
    with jax.set_mesh(mesh):
        boxed = jax.eval_shape(module.init, jax.random.key(0), ids)
    shardings = nn.get_sharding(boxed, mesh)
    _check_flax_layout(name, shardings, case.layout)
    (sharding,) = jax.tree.leaves(shardings)
    placed = _placed(table, case, sharding)
    params = jax.tree.map(lambda _: placed, nn.unbox(boxed))

    def apply(params, ids):
        return module.apply(params, ids)

    return Program(name, mesh, params, shardings, apply)


def _check_flax_layout(name: str, shardings: Any, layout: Layout) -> None:
    (sharding,) = jax.tree.leaves(shardings)
    want = NamedSharding(sharding.mesh, layout.table_spec)
    if not sharding.is_equivalent_to(want, 2):
        raise AssertionError(
            f"{name}: Flax's metadata gives {sharding.spec}, the layout {layout.table_spec}"
        )


def build(name: str, case: Case, table: np.ndarray | None) -> Program:
    """Builds implementation `name` for `case` with `table` (None: abstract, compile only).

    Args:
      name: one of `KNOWN`.
      case: the case.
      table: the table's values on the host, or None for `ShapeDtypeStruct` stand-ins.

    Returns:
      The `Program`.

    Raises:
      ValueError: an unknown name. Whatever Flax raises while building its module (that is
        a result, and the caller records it).
    """
    if name == "jaxembed":
        return _jaxembed(case, table, "auto", name)
    if name in ("jaxembed[rows]", "jaxembed[dense]"):
        return _jaxembed(case, table, name[len("jaxembed[") : -1], name)
    if name == "xla":
        return _xla(case, table)
    if name == "onehot":
        return _onehot(case, table)
    if name in ("flax-nnx", "flax-nnx-explicit"):
        axis_type = AxisType.Explicit if name.endswith("explicit") else AxisType.Auto
        return _flax_nnx(case, table, axis_type, name)
    if name in ("flax-linen", "flax-linen-explicit"):
        axis_type = AxisType.Explicit if name.endswith("explicit") else AxisType.Auto
        return _flax_linen(case, table, axis_type, name)
    raise ValueError(f"unknown implementation {name!r}: choose from {', '.join(KNOWN)}")


def make_step(
    program: Program, optimizer: optax.GradientTransformation, layout: Layout
) -> tuple[Any, Any, Any]:
    """The jitted training step of a program and its shardings.

    Args:
      program: the implementation.
      optimizer: an elementwise optax transformation (its state shaped like the params).
      layout: gives the ids' and the output's (and the cotangent's) layouts.

    Returns:
      `(step, ids_sharding, out_sharding)`, where `step(params, opt_state, ids, ct)` returns
      `(params, opt_state, out)` and donates `params` and `opt_state`.
    """
    mesh = program.mesh
    ids_sharding = NamedSharding(mesh, layout.ids_spec)
    out_sharding = NamedSharding(mesh, layout.out_spec)
    opt_shardings = _like_params(optimizer.init(program.params), program)

    def step(params, opt_state, ids, ct):
        out, vjp = jax.vjp(lambda p: program.apply(p, ids), params)
        (grads,) = vjp(ct)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, out

    jitted = jax.jit(
        step,
        in_shardings=(program.param_shardings, opt_shardings, ids_sharding, out_sharding),
        out_shardings=(program.param_shardings, opt_shardings, out_sharding),
        donate_argnums=(0, 1),
    )
    return jitted, ids_sharding, out_sharding


def _like_params(opt_state: Any, program: Program) -> Any:
    """Shardings for an optimizer state whose leaves are shaped like the table."""
    (sharding,) = jax.tree.leaves(program.param_shardings)
    return jax.tree.map(lambda _: sharding, opt_state)


def update_floor(sharding: NamedSharding, optimizer: optax.GradientTransformation) -> Any:
    """A jitted `table -= update(grads)` alone: the part of every step that is not the lookup.

    Returns:
      `floor(table, opt_state, grads) -> (table, opt_state)`, donating table and state, with
      table and grads laid out by `sharding`.
    """

    def floor(table, opt_state, grads):
        updates, opt_state = optimizer.update(grads, opt_state, table)
        return optax.apply_updates(table, updates), opt_state

    return jax.jit(
        floor,
        in_shardings=(sharding, None, sharding),
        out_shardings=(sharding, None),
        donate_argnums=(0, 1),
    )
