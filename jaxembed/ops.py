"""`embedding`: the sharded lookup and its gradient as `jax.shard_map` bodies.

The bodies execute an `EmbeddingPlan` (`jaxembed.plan`) and decide nothing themselves:

    forward   ids -> local rows -> masked gather -> psum_scatter / psum over the row axes
    backward  all_gather of out_grad (transpose of psum_scatter) -> [rows: all_gather ids and
              out_grad over the batch axes] -> masked scatter-add into a zero shard of the
              table's own layout -> [dense: psum over the batch axes]

so the weight gradient is born in the table's layout and no plan gathers the table.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxembed.plan import EmbeddingPlan, GradientExchange, plan_embedding

__all__ = ["check_ids", "embedding", "resolve_mesh", "spec_of"]


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


def is_explicit(mesh: Any) -> bool:
    """Internal: whether every axis of `mesh` is `AxisType.Explicit` (False for no mesh)."""
    return mesh is not None and all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def normalize_spec(spec: P, ndim: int) -> P:
    """Internal: `spec` with one entry per axis and one-name tuples unwrapped, for comparisons."""
    parts = tuple(spec.partitions) + (None,) * (ndim - len(spec.partitions))
    parts = tuple(p[0] if isinstance(p, tuple) and len(p) == 1 else p for p in parts)
    return P(*parts, unreduced=spec.unreduced) if spec.unreduced else P(*parts)


def move(a: jax.Array, mesh: Any, spec: P) -> jax.Array:
    """Internal: reshards a small operand (ids, an output, hidden states) to `spec`.

    A no-op when `a` is already laid out so; otherwise XLA picks the collectives
    (`device_put` for a concrete array, `reshard` in an Explicit mesh,
    `with_sharding_constraint` in an Auto one). Never used on a table.
    """
    if mesh is None or normalize_spec(spec_of(a, mesh), a.ndim) == normalize_spec(spec, a.ndim):
        return a
    if not isinstance(a, jax.core.Tracer) and isinstance(mesh, jax.sharding.Mesh):
        return jax.device_put(a, NamedSharding(mesh, spec))
    if is_explicit(mesh):
        return jax.sharding.reshard(a, NamedSharding(mesh, spec))
    return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec))


def warn_if_layout_unknown(a: Any, mesh: Any, *, function: str, arg: str, what: str) -> None:
    """Internal: warns when `a` is traced in an Auto mesh, where its layout is invisible."""
    if isinstance(a, jax.core.Tracer) and not is_explicit(mesh) and mesh.size > 1:
        warnings.warn(
            f"{function}() is traced in an Auto mesh without {arg}: a traced {what} does not "
            "carry its layout there, so it is taken as replicated and XLA may gather it. Pass "
            f"{arg}=PartitionSpec(...) (the Flax modules do), or use an Explicit mesh.",
            stacklevel=3,
        )


# --- the shard_map bodies -----------------------------------------------------------------


def _reads_a_row(ids: jax.Array, vocab_size: int, padding_idx: int | None) -> jax.Array:
    """Whether each id reads a table row: in `[0, vocab_size)` and not `padding_idx`."""
    valid = (ids >= 0) & (ids < vocab_size)
    if padding_idx is not None:
        valid &= ids != padding_idx
    return valid


def _local_rows(plan: EmbeddingPlan, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """This shard's row index of each id, and whether the id reads a row of this shard."""
    rows = plan.rows_per_shard
    start = jax.lax.axis_index(plan.row_axes) * rows if plan.row_axes else 0
    local = ids - start
    valid = _reads_a_row(ids, plan.vocab_size, plan.padding_idx) & (local >= 0) & (local < rows)
    return local, valid


def _forward_body(plan: EmbeddingPlan, ids: jax.Array, table: jax.Array) -> jax.Array:
    # ids: i32[*batch / ids_spec]   table: f[V/R, H/K]
    local, valid = _local_rows(plan, ids)
    rows = jnp.take(table, jnp.where(valid, local, 0), axis=0, mode="clip")
    out = jnp.where(valid[..., None], rows, jnp.zeros((), table.dtype))
    # out: f[*batch / ids_spec, H/K], partial over R
    for dim, axes in plan.scatters:
        out = jax.lax.psum_scatter(out, axes, scatter_dimension=dim, tiled=True)
    if plan.psum_axes:
        out = jax.lax.psum(out, plan.psum_axes)
    return out  # f[*batch / body_out_spec, H/K]


def _backward_body(plan: EmbeddingPlan, ids: jax.Array, out_grad: jax.Array) -> jax.Array:
    # ids: i32[*batch / ids_spec]   out_grad: f[*batch / body_out_spec, H/K]
    for dim, axes in reversed(plan.scatters):
        out_grad = jax.lax.all_gather(out_grad, axes, axis=dim, tiled=True, to="invarying")
    # out_grad: f[*batch / ids_spec, H/K], replicated over R
    if plan.gradient_exchange == "rows":
        for dim, axes in plan.batch_gathers:
            ids = jax.lax.all_gather(ids, axes, axis=dim, tiled=True, to="invarying")
            out_grad = jax.lax.all_gather(out_grad, axes, axis=dim, tiled=True, to="invarying")
        # ids: i32[*batch]   out_grad: f[*batch, H/K]
    local, valid = _local_rows(plan, ids)
    rows, cols = plan.table_shard_shape
    weight_grad = jnp.zeros((rows, cols), jnp.float32)
    weight_grad = weight_grad.at[jnp.where(valid, local, rows)].add(
        out_grad.astype(jnp.float32), mode="drop"
    )  # f32[V/R, H/K]
    if plan.gradient_exchange == "dense":
        weight_grad = jax.lax.psum(weight_grad, plan.batch_axes)
    return weight_grad.astype(plan.dtype)


# --- custom_vjp over the two shard_maps ----------------------------------------------------


def _shard_map(body, plan: EmbeddingPlan, mesh: Any, in_specs, out_specs):
    return jax.shard_map(
        functools.partial(body, plan),
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        check_vma=True,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _lookup(plan: EmbeddingPlan, mesh: Any, ids: jax.Array, table: jax.Array) -> jax.Array:
    fwd = _shard_map(
        _forward_body, plan, mesh, (plan.ids_spec, plan.weight_spec), plan.body_out_spec
    )
    return fwd(ids, table)


def _lookup_fwd(plan, mesh, ids, table):
    return _lookup(plan, mesh, ids, table), ids


def _lookup_bwd(plan, mesh, ids, out_grad):
    grad_spec = plan.body_out_spec
    if plan.unreduced_axes:  # the cotangent of an unreduced output is reduced over them
        grad_spec = grad_spec.to_ct_spec()
    out_grad = move(out_grad, mesh, grad_spec)  # a no-op when it arrives in the out layout
    bwd = _shard_map(_backward_body, plan, mesh, (plan.ids_spec, grad_spec), plan.weight_spec)
    return None, bwd(ids, out_grad)


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


# --- the public entry point ----------------------------------------------------------------


def _check_ids_eagerly(x: Any, vocab_size: int) -> None:
    """Raises on out-of-range ids when they are concrete (called outside `jit`)."""
    if isinstance(x, jax.core.Tracer):
        return
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return  # another process holds part of them; under jit they read as zero rows
    ids = np.asarray(x)
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"id {int(ids[where])} at index {where} is out of range for a vocabulary of "
            f"{vocab_size} rows (valid ids: 0 to {vocab_size - 1}). Under jax.jit such ids "
            "read as zero rows and get no gradient; to catch them under jit, call "
            "jaxembed.check_ids inside a function transformed by jax.experimental.checkify."
        )


def check_ids(x: jax.Array, vocab_size: int) -> None:
    """Adds a `checkify` check that every id is in `[0, vocab_size)`.

    Use it inside a function transformed by `jax.experimental.checkify.checkify`:

        >>> import jax, jax.numpy as jnp
        >>> from jax.experimental import checkify
        >>> def f(ids):
        ...     check_ids(ids, vocab_size=10)
        ...     return ids
        >>> err, _ = checkify.checkify(jax.jit(f))(jnp.array([3, 12]))
        >>> print(err.get())  # doctest: +ELLIPSIS
        ids must be in [0, 10): found ids from 3 to 12 ...
    """
    from jax.experimental import checkify

    # Reductions only (no indexing by position): they type-check in Explicit meshes too.
    checkify.check(
        jnp.all((x >= 0) & (x < vocab_size)),
        "ids must be in [0, {vocab}): found ids from {lo} to {hi}",
        vocab=jnp.asarray(vocab_size), lo=jnp.min(x), hi=jnp.max(x),
    )  # fmt: skip


def _dense_lookup(x, weight, vocab_size, padding_idx):
    """No mesh: the same masked lookup on one device (out-of-range and padding read zero)."""
    valid = _reads_a_row(x, vocab_size, padding_idx)
    rows = jnp.take(weight, jnp.where(valid, x, 0), axis=0, mode="clip")
    return jnp.where(valid[..., None], rows, jnp.zeros((), weight.dtype))


def embedding(
    x: jax.Array,
    weight: jax.Array,
    *,
    padding_idx: int | None = None,
    vocab_size: int | None = None,
    mesh: Any = None,
    x_spec: P | None = None,
    weight_spec: P | None = None,
    out_spec: P | None = None,
    gradient_exchange: GradientExchange = "auto",
) -> jax.Array:
    """Looks up `weight[x]` on any layout of table and ids; the gradient stays in the table's.

    The table never moves: layout conflicts are resolved by moving the ids (and, in the
    backward, the output gradient). `jaxembed.plan_embedding` with the same arguments
    returns the plan that runs, with every collective and its bytes.

    Args:
      x: integer ids of any rank `[*batch]`.
      weight: the table `[V, H]` (`V` may be padded past `vocab_size`), float32 or bfloat16.
      padding_idx: an id whose row reads as zero and gets a zero gradient (Paddle's).
      vocab_size: the real rows when the table is padded to a multiple of its shards.
      mesh: the mesh; default `jax.set_mesh`'s, else the arrays' own.
      x_spec, weight_spec: layouts; default read from the arrays (a concrete array's
        `NamedSharding`, or its type in an Explicit mesh), else replicated. Under `jit` in an
        Auto mesh, pass `weight_spec`: there the traced table does not carry its layout.
      out_spec: the output's layout; default the ids' layout plus the table's hidden split.
        Splitting a batch axis over a row axis gives a sequence-parallel output
        (`psum_scatter`); `unreduced={...}` returns partial sums (Explicit meshes).
      gradient_exchange: `"auto"` (fewest bytes, per the plan), `"dense"` (`psum` of the
        gradient shard) or `"rows"` (gather ids and out_grad, then scatter-add).

    Returns:
      `out[*batch, H]` laid out as `out_spec`. Ids outside `[0, vocab_size)` read as zero
      rows and get no gradient under `jit`; called with concrete ids, they raise.

    Raises:
      TypeError: float ids or a non-float table.
      ValueError: a table not 2-D, unknown mesh axes, specs longer than ranks, splits that
        do not divide, `padding_idx`/`vocab_size` out of range, out-of-range concrete ids.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
      >>> table = jax.device_put(jnp.ones((64, 8)), NamedSharding(mesh, P("model", None)))
      >>> ids = jax.device_put(jnp.zeros((4, 16), jnp.int32), NamedSharding(mesh, P("data")))
      >>> out = embedding(ids, table)
      >>> out.shape, out.sharding.spec == P("data", None, None)
      ((4, 16, 8), True)
    """
    x = x if isinstance(x, jax.Array | jax.core.Tracer) else jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(
            f"ids must be integers, got {x.dtype} ids of shape {x.shape}: cast them with "
            "x.astype(jnp.int32) if they hold whole numbers"
        )
    if jnp.ndim(weight) != 2:
        raise ValueError(
            f"weight must be a 2-D table [vocab, hidden], got shape {jnp.shape(weight)}"
        )
    if not jnp.issubdtype(weight.dtype, jnp.floating):
        raise TypeError(f"weight must be a float table, got {weight.dtype}")
    mesh = resolve_mesh(mesh, weight, x)
    if mesh is None or (mesh.size == 1 and all(s is None for s in (x_spec, weight_spec, out_spec))):
        plan_vocab = weight.shape[0] if vocab_size is None else vocab_size
        _validate_scalars(plan_vocab, padding_idx, weight.shape[0])
        _check_ids_eagerly(x, plan_vocab)
        return _dense_lookup(x, weight, plan_vocab, padding_idx)
    given_weight_spec = spec_of(weight, mesh)
    if weight_spec is None:
        warn_if_layout_unknown(weight, mesh, function="embedding", arg="weight_spec", what="table")
        weight_spec = given_weight_spec
    elif is_explicit(mesh) and normalize_spec(given_weight_spec, 2) != normalize_spec(
        weight_spec, 2
    ):
        raise ValueError(
            f"weight is laid out as {given_weight_spec} but weight_spec={weight_spec}: jaxembed "
            "never moves the table; drop weight_spec, or reshard the table once with "
            "jax.sharding.reshard(weight, weight_spec)"
        )
    # Traced ids in an Auto mesh read as replicated (a valid layout, so no warning): every
    # device then looks up the whole batch. Pass x_spec there to split the work.
    x_spec = spec_of(x, mesh) if x_spec is None else x_spec
    plan = plan_embedding(
        mesh, x.shape, weight.shape, x_spec=x_spec, weight_spec=weight_spec,
        out_spec=out_spec, padding_idx=padding_idx, vocab_size=vocab_size,
        dtype=weight.dtype, ids_dtype=x.dtype, gradient_exchange=gradient_exchange,
    )  # fmt: skip
    _check_ids_eagerly(x, plan.vocab_size)
    ids = move(x, mesh, plan.ids_spec)
    out = _lookup(plan, mesh, ids, weight)
    if plan.needs_out_reshard:
        out = move(out, mesh, plan.out_spec)
    return out


def _validate_scalars(vocab_size: int, padding_idx: int | None, num_rows: int) -> None:
    if not 1 <= vocab_size <= num_rows:
        raise ValueError(
            f"vocab_size must be in [1, {num_rows}] (the table's rows), got {vocab_size}"
        )
    if padding_idx is not None and not 0 <= padding_idx < vocab_size:
        raise ValueError(
            f"padding_idx must be in [0, {vocab_size}) (the vocabulary), got {padding_idx}"
        )
