"""`embedding`: the sharded lookup and its gradient as `jax.shard_map` bodies.

The bodies execute an `EmbeddingPlan` (`jaxembed.plan`) and decide nothing themselves:

    forward   ids as given -> the plan's moves (all_gather / slice) -> local rows -> masked
              gather -> psum_scatter / psum over the row axes -> the output's moves
    backward  out_grad's moves -> all_gather of out_grad (transpose of psum_scatter) ->
              [rows: all_gather ids and out_grad over the batch axes] -> masked scatter-add
              into a zero shard of the table's own layout -> [dense: psum over the batch axes]

so the weight gradient is born in the table's layout, no plan gathers the table, and every
collective of the compiled program is one the plan lists.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxembed.ids import as_ids
from jaxembed.kernels import local as local_ops
from jaxembed.kernels import routed as routed_ops
from jaxembed.kernels.arrays import (
    assumed_ids_spec,
    eager,
    layout_known,
    move,
    normalize_spec,
    resolve_mesh,
    spec_of,
    stated_spec,
    warn_once,
    whole_on_one_device,
    zeros_like_output,
)
from jaxembed.kernels.reshard import apply_moves, gather
from jaxembed.plan import EmbeddingPlan, Exchange, plan_embedding

__all__ = ["LookupStats", "check_ids", "embedding", "resolve_layouts"]


# --- pieces shared by every body -------------------------------------------------------------


def reduce_over_rows(plan: EmbeddingPlan, out: jax.Array) -> jax.Array:
    """Sums the row shards' partial outputs: `psum_scatter` where the output splits a batch
    axis over a row axis, `psum` over the rest (unreduced axes are left alone)."""
    for dim, axes in plan.scatters:
        out = jax.lax.psum_scatter(out, axes, scatter_dimension=dim, tiled=True)
    if plan.psum_axes:
        out = jax.lax.psum(out, plan.psum_axes)
    return out


def out_grad_to_body(plan: EmbeddingPlan, out_grad: jax.Array) -> jax.Array:
    """The backward's first step: out_grad from the output's layout to the body's, then the
    transpose of each forward `psum_scatter` (an `all_gather`)."""
    out_grad = apply_moves(out_grad, plan.grad_moves)
    for dim, axes in reversed(plan.scatters):
        out_grad = gather(out_grad, axes, dim)
    return out_grad


def finish_gradient(plan: EmbeddingPlan, weight_grad: jax.Array) -> jax.Array:
    """The dense exchange's `psum` over the batch axes, and the table's dtype."""
    if plan.exchange == "dense":
        weight_grad = jax.lax.psum(weight_grad, plan.batch_axes)
    return weight_grad.astype(plan.dtype)


def shard_map(body, plan: EmbeddingPlan, mesh: Any, in_specs, out_specs):
    """`jax.shard_map` of `body(plan, ...)` with the VMA check on."""
    return jax.shard_map(
        functools.partial(body, plan),
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        check_vma=True,
    )


def cotangent_spec(plan: EmbeddingPlan) -> P:
    """The layout the output's cotangent arrives in (reduced where the output is unreduced)."""
    return plan.out_spec.to_ct_spec() if plan.unreduced_axes else plan.out_spec


# --- the lookup's bodies -----------------------------------------------------------------------


def _gathered_lookup(plan: EmbeddingPlan, ids: jax.Array, table: jax.Array) -> jax.Array:
    local, valid = local_ops.local_rows(plan, ids)
    gathered = local_ops.kernels_for(plan).gather_rows(table, local.reshape(-1), valid.reshape(-1))
    out = gathered.reshape(*ids.shape, table.shape[1])  # f[*batch / ids_spec, H/K], partial / R
    return reduce_over_rows(plan, out)  # f[*batch / body_out_spec, H/K]


def _forward_body(plan: EmbeddingPlan, x: jax.Array, table: jax.Array):
    # x: i32[*batch / x_spec]   table: f[V/R, H/K]
    ids = apply_moves(x, plan.ids_operand.moves)  # i32[*batch / ids_spec]
    overflow = jnp.zeros((), jnp.int32)
    if plan.exchange == "routed":  # ids split over the routed axes S as well
        flat = ids.reshape(-1)
        buckets = routed_ops.bucketize(plan, flat, local_ops.reads_a_row(
            flat, plan.vocab_size, plan.padding_idx))  # fmt: skip
        overflow = routed_ops.overflowed(buckets, plan.mesh_names)

        def routed(_):
            rows = routed_ops.route_rows(plan, table, buckets)  # f[M, H/K], complete
            return rows.reshape(*ids.shape, rows.shape[-1])

        def fallback(_):  # the gather exchange: gather ids over S, psum_scatter back
            whole = gather(ids, plan.routed.axes, plan.routed.dim)
            return _gathered_lookup(plan, whole, table)

        out = jax.lax.cond(overflow, fallback, routed, None)
        overflow = overflow.astype(jnp.int32)
    else:
        out = _gathered_lookup(plan, ids, table)
    return apply_moves(out, plan.out_moves), ids, overflow  # f[*batch / out_spec, H']


def _scatter_gradient(plan, ids, out_grad):
    local, valid = local_ops.local_rows(plan, ids)
    grads = out_grad.reshape(-1, out_grad.shape[-1])
    ops = local_ops.kernels_for(plan)
    return ops.scatter_add(plan.table_shard_shape, local.reshape(-1), valid.reshape(-1), grads)


def _backward_body(plan: EmbeddingPlan, ids, overflow, out_grad: jax.Array) -> jax.Array:
    # ids: i32[*batch / ids_spec]   overflow: i32[], the forward's
    # out_grad: f[*batch / out_spec, H']
    if plan.exchange == "routed":
        out_grad = apply_moves(out_grad, plan.grad_moves)  # f[*batch / ids_spec, H/K]
        flat = ids.reshape(-1)
        buckets = routed_ops.bucketize(plan, flat, local_ops.reads_a_row(
            flat, plan.vocab_size, plan.padding_idx))  # fmt: skip

        def routed(_):
            owner_ids, grads = routed_ops.route_grads(
                plan, buckets, out_grad.reshape(flat.shape[0], -1)
            )
            return _scatter_gradient(plan, owner_ids, grads)

        def fallback(_):
            axes, dim = plan.routed.axes, plan.routed.dim
            return _scatter_gradient(plan, gather(ids, axes, dim), gather(out_grad, axes, dim))

        weight_grad = jax.lax.cond(overflow > 0, fallback, routed, None)
        return finish_gradient(plan, weight_grad)
    out_grad = out_grad_to_body(plan, out_grad)  # f[*batch / ids_spec, H/K], replicated over R
    if plan.exchange == "rows":
        for dim, axes in plan.batch_gathers:
            ids = gather(ids, axes, dim)
            out_grad = gather(out_grad, axes, dim)
        # ids: i32[*batch]   out_grad: f[*batch, H/K]
    weight_grad = _scatter_gradient(plan, ids, out_grad)
    return finish_gradient(plan, weight_grad)  # f[V/R, H/K]


def _forward(plan: EmbeddingPlan, mesh: Any, x: jax.Array, table: jax.Array):
    out_specs = (plan.out_spec, plan.ids_spec, P())
    body = shard_map(_forward_body, plan, mesh, (plan.x_spec, plan.weight_spec), out_specs)
    return body(x, table)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _lookup(plan: EmbeddingPlan, mesh: Any, x: jax.Array, table: jax.Array):
    out, _, overflow = _forward(plan, mesh, x, table)
    return out, overflow


def _lookup_fwd(plan, mesh, x, table):
    out, ids, overflow = _forward(plan, mesh, x, table)
    return (out, overflow), (ids, overflow)


def _lookup_bwd(plan, mesh, residuals, cotangents):
    (ids, overflow), (out_grad, _) = residuals, cotangents
    ct_spec = cotangent_spec(plan)
    out_grad = move(out_grad, mesh, ct_spec)  # a no-op: it arrives in the output's layout
    in_specs = (plan.ids_spec, P(), ct_spec)
    bwd = shard_map(_backward_body, plan, mesh, in_specs, plan.weight_spec)
    return None, bwd(ids, overflow, out_grad)


_lookup.defvjp(_lookup_fwd, _lookup_bwd)
_lookup_jit = jax.jit(_lookup, static_argnums=(0, 1))  # an eager call: one compiled program


# --- layouts: read, checked, or assumed --------------------------------------------------------


def check_table(weight: Any) -> None:
    """Raises for a table that is not a 2-D float array."""
    if jnp.ndim(weight) != 2:
        raise ValueError(
            f"weight must be a 2-D table [vocab, hidden], got shape {jnp.shape(weight)}"
        )
    if not jnp.issubdtype(weight.dtype, jnp.floating):
        raise TypeError(f"weight must be a float table, got {weight.dtype}")


def resolve_layouts(
    x: jax.Array,
    weight: jax.Array,
    mesh: Any,
    *,
    x_spec: P | None,
    weight_spec: P | None,
    x_hint: P | None = None,
    function: str = "embedding",
    table_advice: str | None = None,
    ids_advice: str | None = None,
) -> tuple[P | None, P]:
    """The table's and the ids' layouts, read where visible, checked, or assumed.

    Returns `(weight_spec, x_spec)`; `weight_spec` is None when the table's layout cannot be
    known (a traced table in an Auto mesh and no `weight_spec`): the caller then falls back
    to XLA's lookup rather than run a kernel that would make XLA gather the table.

    Args:
      x, weight: the ids and the table (concrete or traced).
      mesh: the mesh the lookup runs on.
      x_spec, weight_spec: layouts the caller states (None: read them).
      x_hint: a layout the program states for the ids without forcing it (a module's
        `inputs_sharding`): used where it divides, else reduced.
      function: the caller's name, for messages.
      table_advice: what to tell the caller when the table's layout is unknown.
      ids_advice: what to tell the caller when the ids' layout is assumed.

    Raises:
      ValueError: a `weight_spec` or `x_spec` contradicting an Explicit array's type.
    """
    if weight_spec is None:
        if layout_known(weight, mesh):
            weight_spec = spec_of(weight, mesh)
        else:
            advice = table_advice or (
                f"pass weight_spec=PartitionSpec(...) to {function}(), or use an Explicit mesh"
            )
            warn_once(
                "table-unknown",
                f"{function}(): the table is traced in an Auto mesh and its layout is not known "
                f"(a traced array does not carry it there), so jaxembed does not run its "
                f"sharded kernel (XLA would gather the table to feed it) and falls back to "
                f"XLA's own partitioning of the lookup. To run sharded: {advice}.",
            )
            return None, P()
    elif (given := stated_spec(weight, mesh)) is not None:
        if normalize_spec(given, 2) != normalize_spec(weight_spec, 2):
            raise ValueError(
                f"weight is laid out as {given} but weight_spec={weight_spec}: jaxembed never "
                "moves the table; drop weight_spec, or reshard the table once with "
                "jax.sharding.reshard(weight, weight_spec)"
            )
    if x_spec is not None:
        if isinstance(x, jax.core.Tracer) and (given := stated_spec(x, mesh)) is not None:
            if normalize_spec(given, x.ndim) != normalize_spec(x_spec, x.ndim):
                raise ValueError(
                    f"the ids are laid out as {given} but x_spec={x_spec}: drop x_spec "
                    "(jaxembed reads the layout from the ids' type in an Explicit mesh), or "
                    "reshard the ids first"
                )
        return weight_spec, x_spec
    if layout_known(x, mesh):
        return weight_spec, spec_of(x, mesh)
    assumed = assumed_ids_spec(tuple(x.shape), mesh, weight_spec, x_hint)
    if x_hint is not None and normalize_spec(assumed, x.ndim) == normalize_spec(x_hint, x.ndim):
        return weight_spec, assumed  # the program states it: nothing assumed
    advice = ids_advice or f"pass x_spec=PartitionSpec(...) to {function}()"
    if x_hint is not None:
        why = f"the stated layout {x_hint} does not divide them, so they run as {assumed}"
    else:
        why = (
            f"jaxembed assumes {assumed}: the batch split over the mesh axes the table does "
            "not use, as far as that divides"
        )
    warn_once(
        "ids-assumed",
        f"{function}(): the ids of shape {tuple(x.shape)} are traced in an Auto mesh, where "
        f"their layout cannot be seen; {why}. To state it: {advice}.",
    )
    return weight_spec, assumed


# --- the public entry point ----------------------------------------------------------------


class LookupStats(NamedTuple):
    """What a lookup did that its plan cannot know in advance (returned with `return_stats`).

    Attributes:
      routed_fallback: int32[], 1 when some bucket of the routed exchange overflowed its
        capacity in this step and the exact gather exchange ran instead (0 otherwise, and
        always 0 for the other exchanges). Sum it over steps to count the fallbacks.
    """

    routed_fallback: jax.Array


def _with_stats(out: jax.Array, return_stats: bool):
    return (out, LookupStats(jnp.zeros((), jnp.int32))) if return_stats else out


def check_ids_eagerly(x: Any, vocab_size: int) -> None:
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


def dense_lookup(x, weight, vocab_size, padding_idx):
    """The masked lookup without a kernel: one device, or XLA's own partitioning."""
    valid = local_ops.reads_a_row(x, vocab_size, padding_idx)
    return local_ops.gather_rows(weight, jnp.where(valid, x, 0), valid)


def validate_scalars(vocab_size: int, padding_idx: int | None, num_rows: int) -> None:
    """Raises for a vocab_size or padding_idx out of range (the plan checks them too)."""
    if not 1 <= vocab_size <= num_rows:
        raise ValueError(
            f"vocab_size must be in [1, {num_rows}] (the table's rows), got {vocab_size}"
        )
    if padding_idx is not None and not 0 <= padding_idx < vocab_size:
        raise ValueError(
            f"padding_idx must be in [0, {vocab_size}) (the vocabulary), got {padding_idx}"
        )


def runs_on_one_device(mesh: Any, *specs: Any) -> bool:
    """No mesh, or a one-device mesh with no layout asked for: no kernel needed."""
    return mesh is None or (mesh.size == 1 and all(s is None for s in specs))


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
    exchange: Exchange = "auto",
    gradient_exchange: Exchange | None = None,
    row_sharding: str = "block",
    capacity: int | None = None,
    capacity_factor: float | None = None,
    return_stats: bool = False,
    impl: str = "auto",
) -> Any:
    """Looks up `weight[x]` on any layout of table and ids; the gradient stays in the table's.

    The table never moves: layout conflicts are resolved by moving the ids (and, in the
    backward, the output gradient) with the plan's own collectives. `jaxembed.plan_embedding`
    with the same arguments returns the plan that runs, with every collective and its bytes.

    Args:
      x: integer ids of any rank `[*batch]`.
      weight: the table `[V, H]` (`V` may be padded past `vocab_size`), float32 or bfloat16.
      padding_idx: an id whose row reads as zero and gets a zero gradient (Paddle's).
      vocab_size: the real rows when the table is padded to a multiple of its shards.
      mesh: the mesh; default `jax.set_mesh`'s, else the arrays' own.
      x_spec, weight_spec: layouts; default read from the arrays (a concrete array's
        `NamedSharding`, or its type in an Explicit mesh). Under `jit` in an Auto mesh a
        traced array carries no layout: without `weight_spec` the lookup falls back to XLA's
        partitioning (a warning says so), and without `x_spec` the ids are assumed split on
        their first axis over the mesh axes the table does not use, where that divides (a
        warning names the assumption).
      out_spec: the output's layout; default the ids' layout plus the table's hidden split.
        Splitting a batch axis over a row axis gives a sequence-parallel output
        (`psum_scatter`); `unreduced={...}` returns partial sums (Explicit meshes).
      exchange: how ids reach the rows and gradients reach the table: `"auto"` (the cost
        model's choice, per the plan), `"dense"` (`psum` of the gradient shard), `"rows"`
        (gather ids and out_grad, then scatter-add) or `"routed"` (where ids and rows share
        mesh axes: each distinct id goes to its owner at a static capacity; a step whose
        buckets overflow runs the gather exchange instead, exactly).
      gradient_exchange: the old name of `exchange`.
      row_sharding: `"block"` (the table's rows in contiguous blocks per shard) or `"mod"`
        (id i on shard i mod n at local row i div n; see `jaxembed.to_mod_order`).
      capacity, capacity_factor: the routed exchange's C (distinct ids per device and
        owner per step), or its factor over the uniform expectation μ = M / n (default:
        μ + 4√μ + 1, see `jaxembed.plan.routed.capacity_for`).
      return_stats: also return a `LookupStats` (whether the routed exchange fell back).
      impl: the shard-local kernels: `"auto"` (jaxembed's native CPU kernels on CPU when they
        can be built, else XLA), `"xla"` or `"native"`; the collectives are the same.

    Returns:
      `out[*batch, H]` laid out as `out_spec` (and `LookupStats` with `return_stats`). Ids
      outside `[0, vocab_size)` read as zero rows and get no gradient under `jit`; called
      with concrete ids, they raise.

    Raises:
      TypeError: float ids or a non-float table.
      ValueError: a table not 2-D, unknown mesh axes, specs longer than ranks, splits that
        do not divide, `padding_idx`/`vocab_size` out of range, out-of-range concrete ids,
        a `weight_spec` or `x_spec` contradicting an Explicit array's type.

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
    return lookup(
        x, weight, padding_idx=padding_idx, vocab_size=vocab_size, mesh=mesh, x_spec=x_spec,
        weight_spec=weight_spec, out_spec=out_spec,
        exchange=exchange if gradient_exchange is None else gradient_exchange,
        row_sharding=row_sharding, capacity=capacity, capacity_factor=capacity_factor,
        return_stats=return_stats, impl=impl,
    )  # fmt: skip


def lookup(
    x: jax.Array,
    weight: jax.Array,
    *,
    padding_idx: int | None = None,
    vocab_size: int | None = None,
    mesh: Any = None,
    x_spec: P | None = None,
    weight_spec: P | None = None,
    out_spec: P | None = None,
    exchange: Exchange = "auto",
    row_sharding: str = "block",
    capacity: int | None = None,
    capacity_factor: float | None = None,
    return_stats: bool = False,
    impl: str = "auto",
    x_hint: P | None = None,
    function: str = "embedding",
    table_advice: str | None = None,
    ids_advice: str | None = None,
) -> Any:
    """`embedding` with the hooks the Flax modules use (internal).

    `x_hint` is a layout for the ids that is used where it divides (a module's
    `inputs_sharding`, also applied to a `[1, 1]` decoding batch); `function` and
    `table_advice` word the warnings for the caller's own API.
    """
    x = as_ids(x)
    check_table(weight)
    mesh = resolve_mesh(mesh, weight, x)
    if runs_on_one_device(mesh, x_spec, weight_spec, out_spec):
        plan_vocab = weight.shape[0] if vocab_size is None else vocab_size
        validate_scalars(plan_vocab, padding_idx, weight.shape[0])
        check_ids_eagerly(x, plan_vocab)
        out = dense_lookup(x, whole_on_one_device(weight), plan_vocab, padding_idx)
        return _with_stats(out, return_stats)
    weight_spec, x_spec = resolve_layouts(
        x, weight, mesh, x_spec=x_spec, weight_spec=weight_spec, x_hint=x_hint,
        function=function, table_advice=table_advice, ids_advice=ids_advice,
    )  # fmt: skip
    if weight_spec is None:  # the table's layout is unknown: XLA's lookup, never a gather
        plan_vocab = weight.shape[0] if vocab_size is None else vocab_size
        validate_scalars(plan_vocab, padding_idx, weight.shape[0])
        return _with_stats(dense_lookup(x, weight, plan_vocab, padding_idx), return_stats)
    plan = plan_embedding(
        mesh, x.shape, weight.shape, x_spec=x_spec, weight_spec=weight_spec,
        out_spec=out_spec, padding_idx=padding_idx, vocab_size=vocab_size,
        dtype=weight.dtype, ids_dtype=x.dtype, exchange=exchange, row_sharding=row_sharding,
        capacity=capacity, capacity_factor=capacity_factor, impl=impl,
    )  # fmt: skip
    check_ids_eagerly(x, plan.vocab_size)
    if x.size == 0:  # no id: nothing to look up, and no collective lowers over zero slots
        out = zeros_like_output(
            plan.out_shape, weight.dtype, mesh, plan.out_spec, weight, plan.weight_spec
        )
        return _with_stats(out, return_stats)
    if not isinstance(x, jax.core.Tracer):
        x = move(x, mesh, plan.x_spec)  # a concrete array is put where x_spec says
    run = _lookup_jit if eager(x, weight) else _lookup
    out, overflow = run(plan, mesh, x, weight)
    return (out, LookupStats(overflow)) if return_stats else out
