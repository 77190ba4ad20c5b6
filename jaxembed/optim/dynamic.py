"""Dynamic tables for training: raw 64-bit ids become rows of an ordinary table, reset on admission.

A dynamic table (`jaxembed.dynamic`) is a static table of `capacity` rows plus a remap from
raw 64-bit ids to those rows (`jaxembed.kernels.remap`). `prepare` runs one step of the remap
and turns the batch's ids into row ids, so every downstream path is the static one, unchanged:
`jaxembed.embedding`, `jaxembed.embedding_bag`, the row-sparse optimizers' `update`. An id
without a row gets row `capacity`, outside the table: it reads zeros and gets no gradient.

    rows, dyn, opt_state, stats = prepare(config, dyn, opt_state, ids, t,
                                          initializer=init, key=key, optimizer=opt)
    pooled = jaxembed.embedding_bag(rows, dyn.table)          # f[B, H]: the static lookup
    ...                                                        # loss, d loss / d pooled
    table, opt_state = opt.update(dyn.table, opt_state, rows, g, combiner="sum", after=pooled)

**Resets.** A row the step (re)assigns (an id admitted to a free row, or taking an evicted
id's row) is re-initialised in the same step, before any id reads it: the table's row to
`initializer(k, (1, H), dtype)[0]` with `k = fold_in(fold_in(key, t), row)`, and every
per-row leaf of the optimizer state to its `optimizer.init` value. So a row's values depend
only on the key, the step and the row: one device or eight, XLA or native remap, give the same
table. The initializer sees one row, `(1, H)`: fan-based initializers that count rows (glorot,
`variance_scaling` with `fan_out` over the rows) see one; `normal`, `uniform`,
`truncated_normal` and Flax's `Embed` default (`variance_scaling(1.0, "fan_in", "normal",
out_axis=0)`) give what they give for the whole table.

**Optimizer state.** `optimizer.init(table)` lays out one array per slot, `[V, H]` or `[V]`;
the leaves of `optimizer.init` of a one-row table whose leading dim is 1 are the per-row
ones, and their values are what a reset row gets (`count`, the global step, is not reset:
lazy Adam's bias correction stays the global step's, as for a row touched for the first time).

**Sharding.** The table and its per-row optimizer state may be split over the mesh ("rows"
placement, `P("model", None)`; a hidden split works too). The remap's state splits with the
rows (`state_specs`): row shard s of n holds buckets `[s·nb/n, (s+1)·nb/n)`, their keys,
last_seen and count, and their columns of the bucket-local sketch, so an id's owner is the
shard holding its bucket (`keys.owner_of`). Inside one `shard_map` each shard probes and
decides only its own ids. Where the batch is split over the rows' axes each device sends its
slots to their owners and gets their rows back (`jaxembed.kernels.remap_routed`; a step that
overflows the places gathers instead); elsewhere every shard hashes the whole batch and each
id's row is a `pmin` of int32[B]. The table's answer is assembled from id-sized collectives:
the reset rows in the one-device order, the counts summed, the sketch halved on the summed
total. The result is the one device's, bit for bit; state memory and probing are ÷ n, and
routed, hashing and the ids' bytes too. An id's
bucket and row do not depend on n, so a checkpoint restores onto any shard count that splits
the buckets whole. Only block row sharding (`row_sharding="block"`, the default) is
supported.

Examples:
  >>> import jax, jax.numpy as jnp, numpy as np
  >>> import jaxembed
  >>> from jaxembed.dynamic import DynamicTableConfig, as_keys
  >>> cfg = DynamicTableConfig(capacity=16, bucket_size=4)
  >>> dyn = init_table(cfg, 2)
  >>> opt = jaxembed.optim.adagrad(0.1)
  >>> opt_state = opt.init(dyn.table)
  >>> ids = as_keys(np.array([[7, 2**40], [7, -1]], np.int64), check=False)  # -1: padding
  >>> rows, dyn, opt_state, stats = prepare(cfg, dyn, opt_state, ids, 0, check_ids=False,
  ...     initializer=jax.nn.initializers.constant(0.5), key=jax.random.key(0), optimizer=opt)
  >>> int(stats.admitted), bool(rows[0, 0] == rows[1, 0]), int(rows[1, 1])  # 16: no row
  (2, True, 16)
  >>> jaxembed.embedding_bag(rows, dyn.table, check_ids=False).tolist()
  [[1.0, 1.0], [0.5, 0.5]]
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxembed.dynamic.config import DynamicState, DynamicTableConfig, StepStats
from jaxembed.dynamic.keys import as_keys, is_reserved
from jaxembed.kernels import remap, remap_native, remap_routed
from jaxembed.kernels.arrays import (
    eager,
    move,
    normalize_spec,
    resolve_mesh,
    stated_spec,
    typed_like,
    whole_on_one_device,
)
from jaxembed.kernels.common import check_table
from jaxembed.optim.row_reset import (
    axes_of,
    check_initializer,
    check_key,
    initial_rows,
    reset_rows,
    row_leaves,
)
from jaxembed.optim.sparse import RowSparseOptimizer
from jaxembed.plan.impl import auto_means

__all__ = [
    "IMPLS",
    "DynamicTable",
    "check_dynamic_table",
    "init_table",
    "prepare",
    "remap_engine",
    "remap_table",
    "reset_optimizer_rows",
    "reset_table_rows",
    "rows_for",
    "state_specs",
]

IMPLS = ("auto", "xla", "native")


class DynamicTable(NamedTuple):
    """A trainable dynamic table: the rows and the remap that owns them (a pytree).

    Attributes:
      table: f32 / bf16 `[capacity, H]`, an ordinary table (row-split like any other).
      state: the remap's `DynamicState` (which id holds each row), split with the table's
        rows (`state_specs`).
    """

    table: jax.Array
    state: DynamicState


# --- checks ----------------------------------------------------------------------------------


def _spec2(spec: P) -> P:
    parts = tuple(spec) + (None,) * (2 - len(tuple(spec)))
    if len(parts) != 2:
        raise ValueError(f"weight_spec={spec} has {len(parts)} entries: a table's has 2 (rows, H)")
    return P(*parts)


def _check_split(config: DynamicTableConfig, hidden: int, mesh: Any, spec: P) -> None:
    """Raises unless the spec's axes divide the table's rows and hidden evenly."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    for dim, (entry, n, what) in enumerate(
        zip(spec, (config.capacity, hidden), ("capacity", "hidden"), strict=True)
    ):
        axes = axes_of(entry)
        unknown = [a for a in axes if a not in sizes]
        if unknown:
            raise ValueError(
                f"weight_spec={spec} names mesh axis {unknown[0]!r}, which the mesh "
                f"{dict(sizes)} does not have"
            )
        shards = math.prod(sizes[a] for a in axes)
        whole = config.num_buckets if dim == 0 else n  # rows split in whole buckets
        if whole % shards:
            step = config.bucket_size * shards if dim == 0 else shards
            up = -(-n // step) * step
            each = f" of whole buckets of {config.bucket_size}" if dim == 0 else ""
            raise ValueError(
                f"{what} {n} does not divide over mesh axes {axes} (size {shards}) of mesh "
                f"{dict(sizes)} into shards{each}: use {what}={up} (a multiple of {step}), "
                "or split the table's dim over fewer devices"
            )


def check_dynamic_table(config: DynamicTableConfig, dyn: Any, rows_at: int | None = None) -> None:
    """Raises unless `dyn` is a `DynamicTable` whose state and table fit `config` (with
    `rows_at`: its table holds `capacity` rows from row `rows_at` on)."""
    if not isinstance(dyn, DynamicTable):
        raise TypeError(
            f"dyn_table must be a DynamicTable (table, state), got {type(dyn).__name__}: "
            "make it with jaxembed.optim.dynamic.init_table(config, hidden), or pass the table "
            "prepare (or jaxembed.optim.dynamic_io.restore_rows) returned"
        )
    remap.check_state(config, dyn.state)
    check_table(dyn.table)
    if rows_at is not None:
        _check_rows_at(config, dyn.table, rows_at)
    elif dyn.table.shape[0] != config.capacity:
        h = dyn.table.shape[1]
        raise ValueError(
            f"dyn_table.table has {dyn.table.shape[0]} rows, but config.capacity="
            f"{config.capacity}: a dynamic table has one row per slot; pass the config the table "
            f"was made with, or make it with init_table(config, {h})"
        )


def _check_rows_at(config: DynamicTableConfig, table: Any, rows_at: Any) -> int:
    """`rows_at` as an int, or raises unless the table holds `capacity` rows from it on."""
    if isinstance(rows_at, bool) or not isinstance(rows_at, int | np.integer):
        raise TypeError(
            f"rows_at={rows_at!r} must be an int: the table's first row in the stack that "
            "holds it (None: the table is its own)"
        )
    if rows_at < 0:
        raise ValueError(f"rows_at={rows_at} must be >= 0: the table's first row in its stack")
    if int(rows_at) + config.capacity > table.shape[0]:
        raise ValueError(
            f"rows_at={rows_at} + capacity={config.capacity} is past the {table.shape[0]} "
            f"rows of the table given: a table placed at rows_at needs rows [rows_at, "
            f"rows_at + capacity) of it"
        )
    return int(rows_at)


def remap_engine(impl: Any) -> Any:
    """The remap module `impl` names: `remap_native` where "native" (or "auto" and built)."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} must be one of {IMPLS}")
    if impl == "auto":
        impl = {"native": "auto"}.get(auto_means(), auto_means())  # `default_impl`'s
    if impl == "native" and not remap_native.available():
        raise RuntimeError(
            "impl='native': the native kernels are unavailable (no C++ compiler, or "
            "JAXEMBED_NATIVE=0); pass impl='xla' or impl='auto'"
        )
    return remap_native if impl != "xla" and remap_native.available() else remap


# --- layouts ---------------------------------------------------------------------------------


class _Layout(NamedTuple):
    """Where a step runs: the mesh (None: one device), the table's spec, each row leaf's, and
    the mesh axes the rows (and the remap's state) are split over, with their size."""

    mesh: Any
    table_spec: P | None
    leaf_specs: tuple[P | None, ...]
    row_axes: tuple[str, ...] = ()
    shards: int = 1
    base: int | None = None  # `rows_at`: the table's rows are [base, base + capacity) of it


def state_specs(config: DynamicTableConfig, row_axes: Any) -> DynamicState:
    """The remap state's layout for a table whose rows split over `row_axes` (a
    `PartitionSpec` entry: None, an axis or a tuple of axes): each shard holds its rows'
    keys, last_seen and count and its buckets' sketch counters; the total (and an unused
    sketch's placeholder) is replicated.

    Examples:
      >>> cfg = DynamicTableConfig(capacity=64, admit_after=2)
      >>> state_specs(cfg, "model").sketch, state_specs(cfg, None).keys
      (P(None, 'model'), P())
    """
    axes = axes_of(row_axes)
    if not axes:
        return DynamicState(*([P()] * len(DynamicState._fields)))
    r = axes[0] if len(axes) == 1 else axes
    sketch = P(None, r) if config.uses_sketch else P()
    return DynamicState(keys=P(r, None), last_seen=P(r), count=P(r), sketch=sketch,
                        sketch_total=P())  # fmt: skip


def _layout(config, table, leaves, mesh, weight_spec, rows_at=None) -> _Layout:
    mesh = resolve_mesh(mesh, table)
    if mesh is None or mesh.size == 1:
        return _Layout(None, None, (None,) * len(leaves), base=rows_at)
    spec = weight_spec if weight_spec is not None else stated_spec(table, mesh)
    if spec is None:
        raise ValueError(
            "prepare: the table is traced in an Auto mesh, where its layout cannot be read, "
            "and its rows are reset in its own layout: pass weight_spec=PartitionSpec(...) "
            "(e.g. P('model', None) for rows split over 'model'), or use an Explicit mesh"
        )
    spec = _spec2(spec)
    if rows_at is None:  # else the rows are a stack's, which its collection split
        _check_split(config, table.shape[1], mesh, spec)
    specs = []
    for leaf in leaves:  # a leaf's own layout, else the one opt.init gives it
        own = stated_spec(leaf, mesh)
        specs.append(own if own is not None else P(spec[0], *tuple(spec)[1 : leaf.ndim]))
    if rows_at is not None:  # the table whole on one shard of a stack: the state whole too
        return _Layout(mesh, spec, tuple(specs), base=rows_at)
    axes = axes_of(spec[0])
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    return _Layout(mesh, spec, tuple(specs), axes, math.prod(sizes[a] for a in axes))


def _keys_spec(keys: jax.Array, mesh: Any) -> P:
    """The keys' batch layout where it is known (the pair axis whole), else replicated."""
    spec = stated_spec(keys, mesh)
    if spec is None:
        return P()
    parts = (tuple(spec) + (None,) * keys.ndim)[: keys.ndim - 1]
    return P(*parts, None)


# --- the step --------------------------------------------------------------------------------


class _Static(NamedTuple):
    """What a step's program depends on besides its arrays (hashable: a jit static arg)."""

    config: DynamicTableConfig
    engine: Any  # remap or remap_native
    initializer: Any
    hidden: int  # H, the table's global width
    layout: _Layout
    routed: bool = False  # the batch split over the row axes: each id sent to its owner


def _body(s: _Static, state, keys, t, key, table, leaves, fresh):
    """One device's step: the remap of its shard's ids, then the reset of its rows.

    With n row shards and m hidden shards (1 and 1 on one device):
    # keys u32[*B, 2], t, key, fresh (one row per per-row leaf): replicated
    # state: the shard's (keys u32[V/n, 2], last_seen / count i32[V/n], sketch i32[D, W/n])
    # table: f[V/n, H/m]   leaves: the optimizer state's per-row leaves, [V/n, ...] each
    """
    if s.layout.shards == 1:
        res = s.engine.step(s.config, state, keys, t, check=False)  # rows i32[*B], reset i32[M]
        new_state, rows, stats, reset, own_reset = res.state, res.rows, res.stats, *(
            res.reset_rows,) * 2  # fmt: skip
    elif s.routed:
        new_state, rows, stats, reset, own_reset = _routed_step(s, state, keys, t)
    else:
        new_state, rows, stats, reset, own_reset = _shard_step(s, state, keys, t)
    table, new_leaves = _reset(s, own_reset, key, t, table, tuple(leaves), fresh)
    return new_state, rows, stats, table, new_leaves, reset


def _shard_step(s: _Static, state, keys, t):
    """One row shard's remap: its own buckets' ids decided on its own state, then the
    table's answer on every shard (each id's row from its owner, the reset rows in the
    reference's order, the counts summed) and the sketch's halving on the total of all.

    # keys u32[*B, 2] (every shard sees every id), M = its slots
    # -> rows i32[*B], reset i32[M] (the table's, in order), own i32[M] (the shard's first)
    """
    new_state, rows, stats, own = _decide(s, state, keys, t)
    rows = jax.lax.pmin(rows, s.layout.row_axes)  # one owner an id
    reset = _reset_order(s, own, stats.admitted, own.shape[0])
    return new_state, rows, _summed(s, stats), reset, own  # every shard saw each reserved id


def _decide(s: _Static, state, keys, t):
    """The shard's step on the ids it is given, deciding those of its own buckets, and the
    sketch's halving on every shard's counts. Rows and own reset rows are the table's
    (`capacity`: none, or another shard's id).

    # keys u32[*K, 2] -> rows i32[*K], own i32[K] (the rows it assigned first)
    """
    axes, n, cap = s.layout.row_axes, s.layout.shards, s.config.capacity
    cfg = s.config.shard(n)
    first = jax.lax.axis_index(axes) * cfg.num_buckets
    res = s.engine.step(cfg, state, keys, t, check=False,
                        shard=remap.Shard(first, s.config.num_buckets))  # fmt: skip
    offset = first * cfg.bucket_size  # the shard's first row in the table
    rows = jnp.where(res.found, res.rows + offset, cap)
    own = jnp.where(res.reset_rows < cfg.capacity, res.reset_rows + offset, cap)
    new_state = res.state
    if cfg.uses_sketch:  # every shard's counts, then the halving the whole table's step does
        total = state.sketch_total + jax.lax.psum(res.state.sketch_total - state.sketch_total,
                                                  axes)  # fmt: skip
        sketch, total = jax.lax.cond(
            total[0] >= cfg.sketch_window,
            lambda sk, tot: (sk >> 1, tot >> 1),
            lambda sk, tot: (sk, tot),
            res.state.sketch,
            total,
        )
        new_state = new_state._replace(sketch=sketch, sketch_total=total)
    return new_state, rows, res.stats, own


def _summed(s: _Static, stats: StepStats) -> StepStats:
    """The table's counts: every shard's decisions summed (`reserved` as given)."""
    axes = s.layout.row_axes
    return StepStats(*(jax.lax.psum(x, axes) for x in stats[:-1]), stats.reserved)


def _reset_order(s: _Static, own: jax.Array, placed: jax.Array, m: int) -> jax.Array:
    """The table's reset rows in the one-device order (shards in order: buckets ascending),
    `capacity` after them, on every shard: i32[m] from the `placed` (the shard's admitted
    ids) first rows of each shard's `own`."""
    axes, n, cap = s.layout.row_axes, s.layout.shards, s.config.capacity
    me = jax.lax.axis_index(axes)
    before = jnp.sum(jnp.where(jnp.arange(n) < me, jax.lax.all_gather(placed, axes), 0))
    at = jnp.arange(own.shape[0], dtype=jnp.int32)
    at = jnp.where(at < placed, before + at, m)
    return jax.lax.pmin(jnp.full((m,), cap, jnp.int32).at[at].set(own, mode="drop"), axes)


def _routed_step(s: _Static, state, keys, t):
    """One row shard's remap with the batch split over the row axes: each device's slots
    sent to their owners (`jaxembed.kernels.remap_routed`), each owner deciding what it
    received, the rows sent back; a step in which some device's slots for one owner
    overflowed their places runs `_shard_step` on the gathered batch instead.

    # keys u32[*b, 2]: this device's m slots (the batch's n·m split over the row axes)
    # -> rows i32[*b], reset i32[n·m] (the table's, in order), own i32[n·m]
    """
    axes, n, cap = s.layout.row_axes, s.layout.shards, s.config.capacity
    flat = keys.reshape(-1, 2)  # u32[m, 2]
    m = flat.shape[0]
    c = remap_routed.capacity(m, n)
    routes = remap_routed.route(flat, s.config.num_buckets, n, s.config.seed, c)
    reserved = jax.lax.psum(jnp.sum(is_reserved(flat), dtype=jnp.int32), axes)

    def routed(state):
        recv = remap_routed.send_keys(routes.send, axes).reshape(n * c, 2)  # u32[n·C, 2]
        new_state, rows, stats, own = _decide(s, state, recv, t)  # rows i32[n·C]
        rows = remap_routed.rows_back(routes, rows.reshape(n, c), axes, cap)  # i32[m]
        own = jnp.pad(own, (0, n * m - n * c), constant_values=cap)  # i32[n·m]
        reset = _reset_order(s, own, stats.admitted, n * m)
        return new_state, rows, _summed(s, stats._replace(reserved=reserved)), reset, own

    def gathered(state):
        everyone = jax.lax.all_gather(flat, axes, tiled=True)  # u32[n·m, 2]
        new_state, rows, stats, reset, own = _shard_step(s, state, everyone, t)
        mine = jax.lax.dynamic_slice(rows, (jax.lax.axis_index(axes) * m,), (m,))
        return new_state, mine, stats, reset, own

    over = jax.lax.psum(routes.overflow.astype(jnp.int32), axes) > 0
    new_state, rows, stats, reset, own = jax.lax.cond(over, gathered, routed, state)
    return new_state, rows.reshape(keys.shape[:-1]), stats, reset, own


def _reset_chunk(m: int) -> int:
    """Rows reset per pass: a 32nd of the step's id slots (at least 64, at most all)."""
    return min(m, max(64, -(-m // 32)))


def _reset(s: _Static, reset: jax.Array, key, t, table, leaves, fresh):
    """The table's and the state's rows in `reset` (int32[M], the step's reset rows first,
    then `capacity`) set to their initial values, `_reset_chunk(M)` rows a pass: a step
    resets far fewer rows than it has id slots once the table is warm, so it draws the
    initializer for those alone (a row's value depends on the key, the step and the row
    only, so the passes give what one pass over all M would). `table=None`: the optimizer
    state's leaves alone (`reset_optimizer_rows`)."""
    m = reset.shape[0]
    if m == 0:  # an empty batch resets nothing
        return table, leaves
    k = _reset_chunk(m)
    count = jnp.sum(reset < s.config.capacity, dtype=jnp.int32)
    padded = jnp.pad(reset, (0, -m % k), constant_values=s.config.capacity)

    def one_pass(i, carry):
        table, leaves = carry
        rows = jax.lax.dynamic_slice(padded, (i * k,), (k,))  # i32[k], the table's rows
        at = _stored(s, rows)  # i32[k], where they are stored
        if table is not None:
            values = initial_rows(s.initializer, key, t, rows, s.hidden, table.dtype)  # f[k, H]
            table = reset_rows(table, s.layout.table_spec, at, values)
        leaves = tuple(
            reset_rows(leaf, spec, at, jnp.broadcast_to(f, (k, *f.shape[1:])))
            for leaf, spec, f in zip(leaves, s.layout.leaf_specs, fresh, strict=True)
        )
        return table, leaves

    return jax.lax.fori_loop(0, (count + k - 1) // k, one_pass, (table, leaves))


def _stored(s: _Static, rows: jax.Array) -> jax.Array:
    """The table's rows (`capacity`: none) where they are stored: the same, or, in a stack
    (`rows_at`), shifted to its rows there, none past every row (the reset drops them)."""
    if s.layout.base is None:
        return rows
    none = jnp.iinfo(jnp.int32).max
    return jnp.where(rows < s.config.capacity, rows + s.layout.base, none)


def _run(s: _Static, state, keys, t, key, table, leaves, fresh):
    """The step on one device, or as one `shard_map` over the layout's mesh."""
    lay = s.layout
    if lay.mesh is None:
        one = [whole_on_one_device(a) for a in (table, *leaves)]
        state = jax.tree.map(whole_on_one_device, state)
        out = _body(s, state, whole_on_one_device(keys), t, key, one[0], tuple(one[1:]), fresh)
        new_state, rows, stats, new_table, new_leaves, reset = out
        new_table = typed_like(new_table, table)
        new_leaves = tuple(typed_like(n, o) for n, o in zip(new_leaves, leaves, strict=True))
        return new_state, rows, stats, new_table, new_leaves, reset
    mesh, rep = lay.mesh, P()
    specs = state_specs(s.config, lay.row_axes)
    state = jax.tree.map(lambda a, sp: move(a, mesh, sp), state, specs)
    ids_spec = _keys_spec(keys, mesh)
    if s.routed:  # each device keeps its slots and sends them to their owners
        keys_spec = P(_spec2(lay.table_spec)[0], *([None] * (keys.ndim - 1)))
        rows_spec = P(*tuple(keys_spec)[:-1])
    else:  # every device sees every id, and decides its shard's
        keys_spec = rows_spec = rep
    keys = move(keys, mesh, keys_spec)
    fresh = tuple(move(f, mesh, rep) for f in fresh)
    stats_specs = StepStats(*([rep] * len(StepStats._fields)))
    fresh_specs = (rep,) * len(fresh)
    step = jax.shard_map(
        lambda *a: _body(s, *a),
        mesh=mesh,
        in_specs=(specs, keys_spec, rep, rep, lay.table_spec, lay.leaf_specs, fresh_specs),
        out_specs=(specs, rows_spec, stats_specs, lay.table_spec, lay.leaf_specs, rep),
        check_vma=False,  # the native remap is a custom call, typed by no VMA rule
    )
    new_state, rows, stats, new_table, new_leaves, reset = step(
        state, keys, t, key, table, tuple(leaves), fresh
    )
    rows = move(rows, mesh, P(*tuple(ids_spec)[:-1])) if tuple(ids_spec) else rows
    return new_state, rows, stats, new_table, new_leaves, reset


def _routes(keys: jax.Array, layout: _Layout) -> bool:
    """Whether a step routes each id to its owner: the rows split over more than one shard,
    and the keys' batch (their first axis, the others whole; not empty) split over the rows'
    axes."""
    if layout.shards == 1 or keys.ndim < 2 or keys.size == 0:
        return False
    spec = stated_spec(keys, layout.mesh)
    if spec is None:
        return False
    parts = (*tuple(spec), *([None] * keys.ndim))[: keys.ndim]
    return axes_of(parts[0]) == layout.row_axes and all(p is None for p in parts[1:])


_run_jit = jax.jit(_run, static_argnums=0)


def _run_reset(s: _Static, reset, key, t, table, leaves, fresh):
    """The rows in `reset` set afresh (the table's too, with `table` given), on one device or
    as a `shard_map`. Returns `(table, leaves)`.

    # reset i32[M], key, t, fresh: replicated
    # table: f[V/n, H/m] or None   leaves: the per-row leaves, [V/n, ...] each
    """
    lay = s.layout
    if lay.mesh is None:
        one = tuple(whole_on_one_device(a) for a in leaves)
        whole = None if table is None else whole_on_one_device(table)
        new_table, new = _reset(s, whole_on_one_device(reset), key, t, whole, one, fresh)
        new = tuple(typed_like(n, o) for n, o in zip(new, leaves, strict=True))
        return (None if table is None else typed_like(new_table, table)), new
    mesh, rep = lay.mesh, P()
    reset, fresh = move(reset, mesh, rep), tuple(move(f, mesh, rep) for f in fresh)
    run = jax.shard_map(  # a None table, key or step is an empty pytree: its spec spans none
        lambda r, k, tt, tb, ls, fs: _reset(s, r, k, tt, tb, tuple(ls), fs),
        mesh=mesh,
        in_specs=(rep, rep, rep, lay.table_spec, lay.leaf_specs, (rep,) * len(fresh)),
        out_specs=(lay.table_spec, lay.leaf_specs), check_vma=False,
    )  # fmt: skip
    return run(reset, key, t, table, tuple(leaves), fresh)


_run_reset_jit = jax.jit(_run_reset, static_argnums=0)


def _same_sharding(new: Any, old: Any) -> Any:
    """`new` with `old`'s sharding where they are the same layout spelled otherwise (a jitted
    program gives `P('model',)` for `P('model', None)`), so the next step's cache key holds."""
    if getattr(new, "sharding", None) == getattr(old, "sharding", None):
        return new
    if not isinstance(getattr(old, "sharding", None), NamedSharding):
        return new
    if new.sharding.is_equivalent_to(old.sharding, new.ndim):
        return jax.device_put(new, old.sharding)
    return new


def prepare(
    config: DynamicTableConfig,
    dyn_table: DynamicTable,
    opt_state: Any,
    ids: Any,
    step_index: Any,
    *,
    initializer: Any,
    key: Any,
    optimizer: RowSparseOptimizer | None,
    impl: str = "auto",
    mesh: Any = None,
    weight_spec: P | None = None,
    check_ids: bool = True,
    rows_at: int | None = None,
) -> tuple[jax.Array, DynamicTable, Any, StepStats]:
    """One training step's remap: raw ids to rows, with the rows it (re)assigns reset.

    Runs the remap step (count, admit, evict, touch: `jaxembed.kernels.remap.step`), then, in
    the same step and before anything reads them, re-initialises every row in its
    `reset_rows`: the table's row from `initializer` (deterministic from `key`, the step and
    the row), the optimizer state's per-row leaves to `optimizer.init`'s values. Jit the
    training step with `dyn_table` and `opt_state` donated: the resets write in place.

    Args:
      config: the table's `DynamicTableConfig` (static).
      dyn_table: its `DynamicTable` (`init_table`).
      opt_state: `optimizer.init(dyn_table.table)`, or None with `optimizer=None`.
      ids: the batch's raw ids, any shape, in a form `jaxembed.dynamic.as_keys` takes: keys
        `uint32[*B, 2]` under `jit` without x64 (convert int64 ids with `as_keys` outside the
        jitted step). The reserved id `EMPTY_ID` (int64 -1) is padding: it gets no row.
      step_index: t, an integer scalar counting the steps, read modulo 2**32 (an int32
        counter that wraps past 2**31 - 1 keeps counting: the policy compares ages).
      initializer: `(key, shape, dtype) -> array`, as `jax.nn.initializers` makes; called
        with shape `(1, H)` for each reset row.
      key: a PRNG key (`jax.random.key(0)`); row r reset at step t reads
        `initializer(fold_in(fold_in(key, t), r), (1, H), dtype)[0]`.
      optimizer: the `RowSparseOptimizer` of `opt_state`, or None (no optimizer state).
      impl: the remap's engine: `"xla"`, `"native"` (C++), or `"auto"` (native where built).
      mesh: the mesh; default `jax.set_mesh`'s, else the table's.
      weight_spec: the table's layout where it cannot be read (traced in an Auto mesh).
      check_ids: raise for concrete ids equal to `EMPTY_ID` (True), or take them as padding
        (False), as traced ids always are.
      rows_at: None, or the table's first row in `dyn_table.table` when that is a stack of
        several tables (a collection's table-wise stack): the table's rows are rows
        `[rows_at, rows_at + capacity)` of it, reset where they are stored, and the remap
        state is whole on every device (not split with the stack's rows). The rows returned
        are the table's own, `[0, capacity)`.

    Returns:
      `(rows, dyn_table, opt_state, stats)`: rows int32 `[*B]` (each id's row; `capacity`,
      outside the table, for an id without one: it reads zeros and gets no gradient), laid
      out like the ids where their layout is known; the new table and optimizer state in
      their layouts; the step's `StepStats` (hits, admitted, evicted, refused, pending,
      reserved).

    Raises:
      TypeError: ids in no accepted form (floats; int32 in any shape, as `jit` narrows
        numpy int64 ids with x64 off), a `dyn_table` that is no `DynamicTable`, a key that
        is no PRNG key, an initializer that is no function, an optimizer not row-sparse.
      ValueError: a table or state that does not fit `config`, an initializer giving another
        shape, an optimizer state of another optimizer or table, a split that does not
        divide, a traced table in an Auto mesh without `weight_spec`.
      RuntimeError: `impl="native"` without the native kernels.

    Examples:
      >>> import jax, numpy as np
      >>> from jaxembed.dynamic import DynamicTableConfig, as_keys
      >>> cfg = DynamicTableConfig(capacity=8, bucket_size=4, admit_after=2)
      >>> dyn = init_table(cfg, 4)
      >>> ids = as_keys(np.array([3, 3, 5], np.int64))
      >>> rows, dyn, _, stats = prepare(cfg, dyn, None, ids, 0, optimizer=None,
      ...     initializer=jax.nn.initializers.normal(0.1), key=jax.random.key(0))
      >>> rows.tolist(), int(stats.admitted), int(stats.pending)   # 3 seen twice: admitted
      ([0, 0, 8], 1, 1)
    """
    return _prepare(
        config, dyn_table, opt_state, ids, step_index, initializer=initializer, key=key,
        optimizer=optimizer, impl=impl, mesh=mesh, weight_spec=weight_spec, check_ids=check_ids,
        rows_at=rows_at,
    )[:4]  # fmt: skip


def _prepare(
    config, dyn_table, opt_state, ids, step_index, *, initializer, key, optimizer, impl, mesh,
    weight_spec, check_ids, rows_at,
):  # fmt: skip
    """`prepare`, also returning the step's reset rows (`remap_table`)."""
    engine = remap_engine(impl)
    check_dynamic_table(config, dyn_table, rows_at)
    rows_at = None if rows_at is None else int(rows_at)
    table = dyn_table.table
    hidden = table.shape[1]
    keys = as_keys(ids, check=check_ids)
    t = remap.check_step_index(step_index)
    check_key(key)
    check_initializer(initializer, key, hidden, table.dtype)
    split = row_leaves(optimizer, opt_state, table.shape[0], hidden, table.dtype)
    leaves = split.rows
    layout = _layout(config, table, leaves, mesh, weight_spec, rows_at)
    static = _Static(config, engine, initializer, hidden, layout, _routes(keys, layout))
    args = (dyn_table.state, keys, t, key, table, leaves, split.fresh)
    if eager(dyn_table, leaves, keys, key):  # one program, not a shard_map op by op
        new_state, rows, stats, new_table, new_leaves, reset = _run_jit(static, *args)
        new_state = jax.tree.map(_same_sharding, new_state, dyn_table.state)
        new_table = _same_sharding(new_table, table)
        new_leaves = tuple(map(_same_sharding, new_leaves, leaves))
    else:
        new_state, rows, stats, new_table, new_leaves, reset = _run(static, *args)
    opt_state = split.rebuild(new_leaves)  # None without an optimizer
    return rows, DynamicTable(new_table, new_state), opt_state, stats, reset


def remap_table(
    config: DynamicTableConfig,
    dyn_table: DynamicTable,
    ids: Any,
    step_index: Any,
    *,
    initializer: Any,
    key: Any,
    impl: str = "auto",
    mesh: Any = None,
    weight_spec: P | None = None,
    check_ids: bool = True,
    rows_at: int | None = None,
) -> tuple[jax.Array, DynamicTable, jax.Array, StepStats]:
    """`prepare` without the optimizer state: the rows it resets come back to reset it later.

    For a training loop where the optimizer state is not at hand when the ids are remapped
    (the Flax modules: the table's forward remaps, the optimizer's update resets its state).
    `remap_table` then `reset_optimizer_rows` on its `reset_rows` give what `prepare` gives.

    Args:
      config, dyn_table, ids, step_index, initializer, key, impl, mesh, weight_spec,
        check_ids, rows_at: as `prepare`'s.

    Returns:
      `(rows, dyn_table, reset_rows, stats)`: as `prepare`'s, with `reset_rows` int32 `[M]`
      (M: the batch's id slots), replicated: the rows the step (re)assigned, then `capacity`.

    Examples:
      >>> import jax, numpy as np
      >>> import jaxembed
      >>> from jaxembed.dynamic import DynamicTableConfig, as_keys
      >>> cfg = DynamicTableConfig(capacity=8, bucket_size=4)
      >>> opt = jaxembed.optim.adagrad(0.1, initial_accumulator_value=0.5)
      >>> dyn = init_table(cfg, 2)
      >>> acc = opt.init(dyn.table)
      >>> rows, dyn, reset, _ = remap_table(cfg, dyn, as_keys(np.array([9, 4], np.int64)), 0,
      ...     initializer=jax.nn.initializers.ones, key=jax.random.key(0))
      >>> sorted(reset.tolist()) == sorted(rows.tolist())  # both ids got a row this step
      True
      >>> acc = reset_optimizer_rows(cfg, dyn.table, opt, acc, reset)
    """
    rows, dyn_table, _, stats, reset = _prepare(
        config, dyn_table, None, ids, step_index, initializer=initializer, key=key,
        optimizer=None, impl=impl, mesh=mesh, weight_spec=weight_spec, check_ids=check_ids,
        rows_at=rows_at,
    )  # fmt: skip
    return rows, dyn_table, reset, stats


def _check_reset_rows(reset_rows: Any) -> jax.Array:
    dtype = getattr(reset_rows, "dtype", None)
    if dtype is None or np.dtype(dtype) != np.int32:  # row numbers: never narrowed here
        raise TypeError(
            f"reset_rows must be the int32 reset rows remap_table returned, got "
            f"{type(reset_rows).__name__} of dtype {dtype}"
        )
    if reset_rows.ndim != 1:
        raise ValueError(
            f"reset_rows must be 1-D (int32[M], as remap_table returns it), got shape "
            f"{tuple(reset_rows.shape)}"
        )
    return reset_rows


def _reset_after(config, table, optimizer, opt_state, reset_rows, step_index, key, initializer,
                 mesh, weight_spec, with_table, rows_at):  # fmt: skip
    check_table(table)
    if rows_at is not None:
        rows_at = _check_rows_at(config, table, rows_at)
    hidden = table.shape[1]
    reset_rows = _check_reset_rows(reset_rows)
    t = None
    if with_table:
        t = remap.check_step_index(step_index)
        check_key(key)
        check_initializer(initializer, key, hidden, table.dtype)
    split = row_leaves(optimizer, opt_state, table.shape[0], hidden, table.dtype)
    if not split.rows and not with_table:
        return table, opt_state
    layout = _layout(config, table, split.rows, mesh, weight_spec, rows_at)
    static = _Static(config, None, initializer if with_table else None, hidden, layout)
    args = (reset_rows, key, t, table if with_table else None, split.rows, split.fresh)
    if eager(table, split.rows, reset_rows):
        new_table, new = _run_reset_jit(static, *args)
        new = tuple(map(_same_sharding, new, split.rows))
        new_table = None if new_table is None else _same_sharding(new_table, table)
    else:
        new_table, new = _run_reset(static, *args)
    return (new_table if with_table else table), split.rebuild(new)


def reset_optimizer_rows(
    config: DynamicTableConfig,
    table: jax.Array,
    optimizer: RowSparseOptimizer,
    opt_state: Any,
    reset_rows: jax.Array,
    *,
    mesh: Any = None,
    weight_spec: P | None = None,
    rows_at: int | None = None,
) -> Any:
    """The optimizer state with the rows of `reset_rows` back at `optimizer.init`'s values.

    Args:
      config: the table's `DynamicTableConfig`.
      table: the dynamic table's rows `[capacity, H]` (its width, dtype and layout).
      optimizer: the `RowSparseOptimizer` of `opt_state`.
      opt_state: `optimizer.init(table)`, laid out like the table.
      reset_rows: int32 `[M]` as `remap_table` returns it: the reset rows first, then
        `capacity` (padding, dropped).
      mesh, weight_spec, rows_at: as `prepare`'s.

    Returns:
      The state, every row not in `reset_rows` bitwise as it was (and `count` too).

    Raises:
      TypeError: an optimizer that is not row-sparse, reset rows that are not integers.
      ValueError: a state of another optimizer or table, reset rows that are not 1-D.
    """
    if optimizer is None:
        raise TypeError(
            "reset_optimizer_rows: optimizer must be the RowSparseOptimizer of opt_state"
        )
    return _reset_after(config, table, optimizer, opt_state, reset_rows, None, None, None,
                        mesh, weight_spec, with_table=False, rows_at=rows_at)[1]  # fmt: skip


def reset_table_rows(
    config: DynamicTableConfig,
    table: jax.Array,
    optimizer: RowSparseOptimizer | None,
    opt_state: Any,
    reset_rows: jax.Array,
    step_index: Any,
    *,
    initializer: Any,
    key: Any,
    mesh: Any = None,
    weight_spec: P | None = None,
    rows_at: int | None = None,
) -> tuple[jax.Array, Any]:
    """The table's and the optimizer state's rows of `reset_rows` set afresh, as the step
    `step_index` of `remap_table` (or `prepare`) set them: the same bits.

    For a training loop where the remap's reset of the table cannot be kept (Linen's `apply`
    does not write its `params`): `jaxembed.flax.sparse_update` resets the stored table's rows
    with the step's reset rows, key and step before the row-sparse update.

    Args:
      config, table, optimizer, opt_state, reset_rows, mesh, weight_spec, rows_at: as
        `reset_optimizer_rows`'s (`optimizer` and `opt_state` may be None).
      step_index, initializer, key: the step's, as given to `remap_table`.

    Returns:
      `(table, opt_state)`.
    """
    return _reset_after(config, table, optimizer, opt_state, reset_rows, step_index, key,
                        initializer, mesh, weight_spec, with_table=True,
                        rows_at=rows_at)  # fmt: skip


# --- construction and serving ----------------------------------------------------------------


def init_table(
    config: DynamicTableConfig,
    hidden: int,
    *,
    dtype: Any = jnp.float32,
    mesh: Any = None,
    weight_spec: P | None = None,
) -> DynamicTable:
    """An empty dynamic table: zero rows (each is initialised when an id is admitted to it)
    and an empty remap, laid out on `mesh` (the table as `weight_spec`, the state split with
    its rows: `state_specs`).

    Args:
      config: the table.
      hidden: H, the row width.
      dtype: the table's dtype (float32 or bfloat16).
      mesh: a `Mesh` to place the arrays on; default `jax.set_mesh`'s (if any).
      weight_spec: the table's layout, e.g. `P("model", None)` (rows split over `"model"`);
        default replicated.

    Returns:
      A `DynamicTable`.

    Raises:
      ValueError: a hidden that is not a positive int, a split that does not divide.

    Examples:
      >>> import jax
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxembed.dynamic import DynamicTableConfig
      >>> mesh = jax.make_mesh((8,), ("model",))
      >>> dyn = init_table(DynamicTableConfig(capacity=64, bucket_size=8), 4, mesh=mesh,
      ...                  weight_spec=P("model", None))
      >>> state = dyn.state  # split with the rows, but for the sketch's total
      >>> dyn.table.sharding.spec, state.keys.sharding.spec, state.sketch_total.sharding.spec
      (P('model', None), P('model', None), P(None,))
    """
    remap.init_state(config)  # checks the config
    if isinstance(hidden, bool) or not isinstance(hidden, int | np.integer) or hidden < 1:
        raise ValueError(f"hidden={hidden!r} must be a positive int, the width of a row")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"dtype={np.dtype(dtype).name} must be a float dtype (e.g. float32)")
    table = jnp.zeros((config.capacity, int(hidden)), dtype)
    state = remap.init_state(config)
    mesh = resolve_mesh(mesh)
    if mesh is None:
        if weight_spec is not None:
            raise ValueError(
                f"init_table: weight_spec={weight_spec} needs a mesh: pass mesh=jax.make_mesh"
                "(...) or call it under jax.set_mesh(mesh)"
            )
        return DynamicTable(table, state)
    spec = _spec2(weight_spec if weight_spec is not None else P())
    _check_split(config, int(hidden), mesh, spec)
    if not isinstance(mesh, jax.sharding.Mesh):  # an AbstractMesh, from jax.set_mesh
        mesh = jax.sharding.get_mesh()
        if mesh.empty:
            raise ValueError("init_table: pass a concrete jax.sharding.Mesh to place the table on")
    # Each spec spelled out to the array's rank, as a jitted step returns it (`P()` and
    # `P(None,)` are one layout, but a second `jit` cache entry for the step).
    place = lambda a, s: jax.device_put(a, NamedSharding(mesh, normalize_spec(s, a.ndim)))
    specs = state_specs(config, spec[0])
    return DynamicTable(place(table, spec), jax.tree.map(place, state, specs))


def rows_for(
    config: DynamicTableConfig, state: DynamicState | DynamicTable, ids: Any, *,
    impl: str = "auto", mesh: Any = None, weight_spec: P | None = None, check_ids: bool = True,
) -> jax.Array:  # fmt: skip
    """Each id's row for serving and evaluation: read-only, no admission, no counting.

    Args:
      config: the table.
      state: its `DynamicState` (or the `DynamicTable`).
      ids: raw ids in a form `jaxembed.dynamic.as_keys` takes (keys under `jit`).
      impl: `"xla"` (plain StableHLO: an exported serving function needs no jaxembed),
        `"native"`, or `"auto"` (native where built).
      mesh: the mesh; default `jax.set_mesh`'s, else the state's. With the state split by
        rows, each shard looks its buckets' ids up and the owner's answer reaches every
        device; otherwise each device looks up the ids it holds.
      weight_spec: the table's layout where the state's cannot be read (traced in an Auto
        mesh, where the state is otherwise read whole): its row entry is the state's split.
      check_ids: raise for concrete ids equal to `EMPTY_ID` (True), or take them as padding
        (False), as traced ids always are.

    Returns:
      int32 `[*B]`: each id's row, `capacity` for an id without one (it reads zeros).

    Examples:
      >>> import numpy as np
      >>> from jaxembed.dynamic import DynamicTableConfig
      >>> cfg = DynamicTableConfig(capacity=8, bucket_size=4)
      >>> dyn = init_table(cfg, 2)
      >>> rows_for(cfg, dyn, np.array([5, 6], np.int64)).tolist()    # nothing admitted yet
      [8, 8]
    """
    engine = remap_engine(impl)
    if isinstance(state, DynamicTable):
        state = state.state
    remap.check_state(config, state)
    keys = as_keys(ids, check=check_ids)
    mesh = resolve_mesh(mesh, state.keys, keys)
    if mesh is None or mesh.size == 1:
        state, keys = jax.tree.map(whole_on_one_device, state), whole_on_one_device(keys)
        return _lookup_run(_Lookup(config, engine), state, keys)
    spec = _keys_spec(keys, mesh)
    row_axes = _state_row_axes(state, mesh, weight_spec)
    _check_split(config, 1, mesh, P(row_axes or None, None))
    if row_axes:  # every shard sees the ids: the batch stays split over the other axes only
        spec = P(*(_without(e, row_axes) for e in spec))
    specs = state_specs(config, row_axes)
    state = jax.tree.map(lambda a, sp: move(a, mesh, sp), state, specs)
    keys = move(keys, mesh, spec)
    return _lookup_run(_Lookup(config, engine, mesh, row_axes, specs, spec), state, keys)


class _Lookup(NamedTuple):
    """What `rows_for`'s program depends on besides its arrays (hashable: a jit static arg,
    so that eager calls with the same table and layout share one compiled program)."""

    config: DynamicTableConfig
    engine: Any  # remap or remap_native
    mesh: Any = None  # None: the state and the ids whole on one device
    row_axes: tuple[str, ...] = ()  # the mesh axes splitting the state's rows
    specs: DynamicState | None = None  # the state's layout
    spec: P | None = None  # the keys' layout


def _lookup(s: _Lookup, state: DynamicState, keys: jax.Array) -> jax.Array:
    """`rows_for`'s program: each key's row, `capacity` where it has none."""
    config, engine, mesh, row_axes = s.config, s.engine, s.mesh, s.row_axes
    if mesh is None:
        return engine.lookup(config, state, keys, check=False)[0]
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    n = math.prod(sizes[a] for a in row_axes)

    def one(st, k):  # st: the shard's state; k u32[*b, 2] -> i32[*b]
        if n == 1:
            return engine.lookup(config, st, k, check=False)[0]
        cfg = config.shard(n)
        first = jax.lax.axis_index(row_axes) * cfg.num_buckets
        rows, found = engine.lookup(cfg, st, k, check=False,
                                    shard=remap.Shard(first, config.num_buckets))  # fmt: skip
        rows = jnp.where(found, rows + first * cfg.bucket_size, config.capacity)
        return jax.lax.pmin(rows, row_axes)

    look = jax.shard_map(one, mesh=mesh, in_specs=(s.specs, s.spec),
                         out_specs=P(*tuple(s.spec)[:-1]), check_vma=False)  # fmt: skip
    return look(state, keys)


_lookup_jit = jax.jit(_lookup, static_argnums=0)


def _lookup_run(s: _Lookup, state: DynamicState, keys: jax.Array) -> jax.Array:
    """`_lookup`, compiled once per `_Lookup` (and shapes) when called eagerly."""
    return (_lookup_jit if eager(state, keys) else _lookup)(s, state, keys)


def _without(entry: Any, axes: tuple[str, ...]) -> Any:
    """A `PartitionSpec` entry without `axes`."""
    kept = tuple(a for a in axes_of(entry) if a not in axes)
    return None if not kept else kept[0] if len(kept) == 1 else kept


def _state_row_axes(state: DynamicState, mesh: Any, weight_spec: P | None) -> tuple[str, ...]:
    """The mesh axes the state's rows are split over: the table's row entry where given,
    else read from its keys' layout."""
    if weight_spec is not None:
        return axes_of(_spec2(weight_spec)[0])
    spec = stated_spec(state.keys, mesh)  # None: traced in an Auto mesh (read it whole)
    return axes_of(next(iter(spec))) if spec is not None and tuple(spec) else ()
