"""`embedding`: the sharded lookup and its gradient as `jax.shard_map` bodies.

The bodies execute an `EmbeddingPlan` (`jaxembed.plan`) and decide nothing themselves:

    forward   ids as given -> the plan's moves (all_gather / slice) -> local rows -> masked
              gather -> psum_scatter / psum over the row axes -> the output's moves
    backward  out_grad's moves -> all_gather of out_grad (transpose of psum_scatter) ->
              [rows: all_gather ids and out_grad over the batch axes] -> masked scatter-add
              into a zero shard of the table's own layout -> [dense: psum over the batch axes]

so the weight gradient is born in the table's layout and every collective of the compiled
program is one the plan lists. With the weight gather (`plan.table_move == "gather"`, FSDP's)
the forward first all-gathers the table's shard over G, and the backward ends with the
gradient's reduce-scatter over G back into the table's layout.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxembed.ids import as_ids
from jaxembed.kernels import local as local_ops
from jaxembed.kernels import routed as routed_ops
from jaxembed.kernels.arrays import (
    batch_typed_like,
    conform,
    eager,
    move,
    resolve_mesh,
    retype,
    whole_on_one_device,
    zeros_like_output,
)
from jaxembed.kernels.common import LookupStats as LookupStats
from jaxembed.kernels.common import (
    cotangent_spec,
    counts_spec,
    finish_gradient,
    out_grad_to_body,
    reduce_over_rows,
    runs_on_one_device,
    shard_map,
    stats_of,
    validate_scalars,
    with_stats,
    work_counts,
)
from jaxembed.kernels.common import resolve_layouts as resolve_layouts
from jaxembed.kernels.cross_entropy import gather_table
from jaxembed.kernels.options import LookupOptions
from jaxembed.kernels.reshard import apply_moves, gather
from jaxembed.kernels.select import kernels_for
from jaxembed.kernels.tables import (
    check_lookup_table,
    conform_table,
    frozen,
    is_quantized,
    layout_array,
    table_specs,
    whole_table,
)
from jaxembed.plan import EmbeddingPlan, Exchange, plan_embedding
from jaxembed.plan.lookup import check_choices

# `LookupStats` and `resolve_layouts` live in `jaxembed.kernels.common`; re-exported here, where
# `jaxembed.LookupStats` and the collections' lookup have always found them.
__all__ = ["LookupStats", "check_ids", "embedding", "lookup", "resolve_layouts", "run_lookup"]


# --- the lookup's bodies -----------------------------------------------------------------------


def _gathered_lookup(plan: EmbeddingPlan, ids: jax.Array, table: jax.Array):
    """`(out, counts)`: the gather exchange's lookup of `ids`, reduced over R."""
    local, valid = local_ops.local_rows(plan, ids)
    gathered = kernels_for(plan, table).gather_rows(table, local.reshape(-1), valid.reshape(-1))
    out = gathered.reshape(*ids.shape, table.shape[1])  # f[*batch / ids_spec, H/K], partial / R
    counts = work_counts(plan, ids.size, jnp.sum(valid))
    return reduce_over_rows(plan, out), counts  # f[*batch / body_out_spec, H/K]


def _forward_body(plan: EmbeddingPlan, x: jax.Array, table: jax.Array):
    # x: i32[*batch / x_spec]   table: f[V/R, H/K]
    table = gather_table(plan, table)  # f[V/R, H/K'] (K' = K less G; the weight gather's)
    ids = apply_moves(x, plan.ids_operand.moves)  # i32[*batch / ids_spec]
    overflow = jnp.zeros((), jnp.int32)
    if plan.exchange == "routed":  # ids split over the routed axes S as well
        flat = ids.reshape(-1)
        buckets = routed_ops.bucketize(plan, flat, local_ops.reads_a_row(
            flat, plan.vocab_size, plan.padding_idx))  # fmt: skip
        overflow = routed_ops.overflowed(buckets, plan.mesh_names)

        def routed(_):
            rows, reads = routed_ops.route_rows(plan, table, buckets, count=True)  # f[M, H/K]
            counts = work_counts(plan, flat.size, reads)  # my own slots
            return rows.reshape(*ids.shape, rows.shape[-1]), counts

        def fallback(_):  # the gather exchange: gather ids over S, psum_scatter back
            whole = gather(ids, plan.routed.axes, plan.routed.dim)
            return _gathered_lookup(plan, whole, table)

        out, counts = jax.lax.cond(overflow, fallback, routed, None)
        overflow = overflow.astype(jnp.int32)
    else:
        out, counts = _gathered_lookup(plan, ids, table)
    # out: f[*batch / out_spec, H'] after the moves; counts: i32[1, 2], this device's
    return apply_moves(out, plan.out_moves), ids, overflow, counts


def _scatter_gradient(plan, ids, out_grad):
    # out_grad: f[*ids, H/K], or the routed exchange's pieces n_S × f32[C, H/K] (read in place)
    if plan.gathered_axes:  # the gathered table's gradient: f32[V/R, H/K']
        local, valid = local_ops.local_rows(plan, ids)
        rows = out_grad.reshape(-1, out_grad.shape[-1])
        return kernels_for(plan).scatter_add(
            plan.body_table_shard_shape, local.reshape(-1), valid.reshape(-1), rows
        )
    return routed_ops.scatter_grads(plan, *local_ops.local_rows(plan, ids), out_grad)


def _scatter_back(plan: EmbeddingPlan, weight_grad: jax.Array) -> jax.Array:
    """The weight gather's transpose: f32[V/R, H/K'] summed over G and split back over it
    into the table's own shard f32[V/R, H/K] (after the dense exchange's psum, if any)."""
    if plan.exchange == "dense":
        weight_grad = jax.lax.psum(weight_grad, plan.batch_axes)
    weight_grad = jax.lax.psum_scatter(
        weight_grad, plan.gathered_axes, scatter_dimension=1, tiled=True
    )
    return weight_grad.astype(plan.dtype)


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
    if plan.gathered_axes:
        return _scatter_back(plan, weight_grad)  # f[V/R, H/K]
    return finish_gradient(plan, weight_grad)  # f[V/R, H/K]


def _forward(plan: EmbeddingPlan, mesh: Any, x: jax.Array, table: jax.Array):
    out_specs = (plan.out_spec, plan.ids_spec, P(), counts_spec(plan))
    in_specs = (plan.x_spec, table_specs(table, plan.weight_spec))
    body = shard_map(_forward_body, plan, mesh, in_specs, out_specs)
    return body(x, table)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _lookup(plan: EmbeddingPlan, mesh: Any, x: jax.Array, table: jax.Array):
    out, _, overflow, counts = _forward(plan, mesh, x, table)
    return out, overflow, counts


def _lookup_fwd(plan, mesh, x, table):
    out, ids, overflow, counts = _forward(plan, mesh, x, table)
    return (out, overflow, counts), (ids, overflow)


def _lookup_bwd(plan, mesh, residuals, cotangents):
    (ids, overflow), (out_grad, _, _) = residuals, cotangents
    ct_spec = cotangent_spec(plan)
    out_grad = move(out_grad, mesh, ct_spec)  # a no-op: it arrives in the output's layout
    in_specs = (plan.ids_spec, P(), ct_spec)
    bwd = shard_map(_backward_body, plan, mesh, in_specs, plan.weight_spec)
    return None, bwd(ids, overflow, out_grad)


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def _run(plan: EmbeddingPlan, mesh: Any, x: jax.Array, table: jax.Array):
    """`_lookup` with its operands typed as the plan's specs and its output as the caller's
    (`conform`, `retype`: free, they differ only by axes of size 1; the table's gradient
    comes back in its own type through the `reshard`'s transpose)."""
    x, table = conform(x, mesh, plan.x_spec), conform_table(table, mesh, plan.weight_spec)
    if is_quantized(table):  # inference only: the forward, no gradient
        out, _, overflow, counts = _forward(plan, mesh, x, frozen(table))
    else:
        out, overflow, counts = _lookup(plan, mesh, x, table)
    return retype(out, plan.out_type_spec), overflow, counts


_run_jit = jax.jit(_run, static_argnums=(0, 1))  # an eager call: one compiled program


# --- the public entry point ----------------------------------------------------------------


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
    return kernels_for(None, weight).gather_rows(frozen(weight), jnp.where(valid, x, 0), valid)


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
    table_move: str = "auto",
) -> Any:
    """Looks up `weight[x]` on any layout of table and ids; the gradient stays in the table's.

    Layout conflicts are resolved by moving the ids (and, in the backward, the output
    gradient) with the plan's own collectives, or, where the table's hidden axis is split
    over mesh axes that split the output's batch too (FSDP), by FSDP's weight gather when it
    sends fewer bytes. `jaxembed.plan_embedding` with the same arguments returns the plan
    that runs, with every collective and its bytes.

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
      return_stats: also return a `LookupStats` (whether the routed exchange fell back, and
        each device's slots walked and rows read).
      impl: the shard-local kernels: `"auto"` (jaxembed's native CPU kernels on CPU when they
        can be built, else XLA), `"xla"` or `"native"`; the collectives are the same.
      table_move: with the table's hidden axis split over mesh axes G that `out_spec`'s
        batch is split over too (table `P("tensor", "fsdp")`, output `P("fsdp", None,
        None)`), `"gather"` all-gathers the table's shard over G for the step and
        reduce-scatters its gradient back into the table's layout (FSDP's weight gather);
        `"none"` keeps the table where it is and moves ids and output; `"auto"` (default)
        takes the one that sends fewer bytes (`jaxembed.plan_embedding` prints both).

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
    options = LookupOptions(
        padding_idx=padding_idx, vocab_size=vocab_size, mesh=mesh, x_spec=x_spec,
        weight_spec=weight_spec, out_spec=out_spec,
        exchange=exchange if gradient_exchange is None else gradient_exchange,
        row_sharding=row_sharding, capacity=capacity, capacity_factor=capacity_factor,
        return_stats=return_stats, impl=impl,
    )  # fmt: skip
    return run_lookup(x, weight, options, table_move=table_move)


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
    check_ids: bool = True,
) -> Any:
    """`embedding` with the hooks the Flax modules use (internal).

    `x_hint` is a layout for the ids that is used where it divides (a module's
    `inputs_sharding`, also applied to a `[1, 1]` decoding batch); `function` and
    `table_advice` word the warnings for the caller's own API; `check_ids=False` lets
    concrete ids out of range read zeros, as traced ones do (a dynamic table's rows).
    """
    options = LookupOptions(
        padding_idx=padding_idx, vocab_size=vocab_size, mesh=mesh, x_spec=x_spec,
        weight_spec=weight_spec, out_spec=out_spec, exchange=exchange,
        row_sharding=row_sharding, capacity=capacity, capacity_factor=capacity_factor,
        return_stats=return_stats, impl=impl, x_hint=x_hint, function=function,
        table_advice=table_advice, ids_advice=ids_advice, check_ids=check_ids,
    )  # fmt: skip
    return run_lookup(x, weight, options)


def run_lookup(
    x: jax.Array, weight: jax.Array, options: LookupOptions, *, table_move: str = "auto"
) -> Any:
    """`embedding` of `x` in `weight` with its keywords as one `LookupOptions` (and the
    plan's `table_move`; a quantized table is never gathered).

    Raises:
      As `embedding`.
    """
    x = as_ids(x)
    check_lookup_table(weight)
    mesh = resolve_mesh(options.mesh, layout_array(weight), x)
    plan_vocab = options.vocab_of(weight.shape[0])
    if runs_on_one_device(mesh, options.x_spec, options.weight_spec, options.out_spec):
        check_choices(options.exchange, options.routed_pool, pools=False, is_max=False)
        validate_scalars(plan_vocab, options.padding_idx, weight.shape[0])
        if options.check_ids:
            check_ids_eagerly(x, plan_vocab)
        given = x
        x, weight = whole_on_one_device(x), whole_table(weight)
        out = dense_lookup(x, weight, plan_vocab, options.padding_idx)
        out = batch_typed_like(out, given, given.ndim)
        valid = local_ops.reads_a_row(x, plan_vocab, options.padding_idx)
        return with_stats(out, options.return_stats, x, valid)
    weight_spec, x_spec = resolve_layouts(x, layout_array(weight), mesh, **options.layout_kwargs())
    if weight_spec is None:  # the table's layout is unknown: XLA's lookup, never a gather
        validate_scalars(plan_vocab, options.padding_idx, weight.shape[0])
        out = dense_lookup(x, weight, plan_vocab, options.padding_idx)
        valid = local_ops.reads_a_row(x, plan_vocab, options.padding_idx)
        return with_stats(out, options.return_stats, x, valid)
    plan = plan_embedding(
        mesh, x.shape, weight.shape, x_spec=x_spec, weight_spec=weight_spec,
        out_spec=options.out_spec, dtype=weight.dtype, ids_dtype=x.dtype,
        exchange=options.exchange, table_move="none" if is_quantized(weight) else table_move,
        **options.plan_kwargs(),
    )  # fmt: skip
    if options.check_ids:
        check_ids_eagerly(x, plan.vocab_size)
    if x.size == 0:  # no id: nothing to look up, and no collective lowers over zero slots
        out = zeros_like_output(
            plan.out_shape, weight.dtype, mesh, plan.out_spec, layout_array(weight),
            layout_array(table_specs(weight, plan.weight_spec)),
        )  # fmt: skip
        return with_stats(retype(out, plan.out_type_spec), options.return_stats, devices=mesh.size)
    if not isinstance(x, jax.core.Tracer):
        x = move(x, mesh, plan.x_spec)  # a concrete array is put where x_spec says
    run = _run_jit if eager(x, weight) else _run
    out, overflow, counts = run(plan, mesh, x, weight)
    return (out, stats_of(overflow, counts)) if options.return_stats else out
