"""Checkpoints of dynamic tables: orbax as is, or the live rows exported and re-inserted.

A `DynamicTable` (the rows and the remap's `DynamicState`) and its `RowSparseState` are plain
pytrees of arrays, so `orbax.checkpoint.StandardCheckpointer` saves and restores them as they
are: restored into the same config on the same mesh they are bitwise what was saved, and a run
that goes on from them is bitwise the run that never stopped (docs/dynamic_checkpoints.md).

To move a table elsewhere (another capacity, bucket size or seed, another mesh or shard
count) this module exports what the table knows about each **live** id and re-inserts it:

* `export_rows(config, dyn_table, opt_state)`: a `RowExport` of numpy arrays, one entry per
  live id in ascending row order: its key `uint32[N, 2]`, its row `f[N, H]`, its optimizer
  state rows (the state with every per-row leaf `[N, ...]`), its `RowMetadata` (the row it
  held, last seen, count) and the admission's count-min sketch (`AdmissionState`). Sharded
  arrays are read one shard at a time: host memory is the N rows and one shard.
* `import_rows(config, ids, rows, ...)` (or `restore_rows(config, export, ...)`): a fresh
  table of the given config, on the given mesh and layout, holding every id that fits, with
  its row, optimizer state row and metadata; ids that do not fit are reported, never dropped
  silently (`overflow="raise"`, the default, refuses; `"report"` returns them).

**Placement** (`placement`: numpy only, the same for every mesh). Each id goes to its bucket
under the new config (`keys.bucket_of`, which depends on the bucket count and the seed).
Bucket by bucket, its ids are ranked by what the eviction policy keeps longest: `lru` and
`ttl` by (last seen descending, count descending, id ascending), `lfu` by (count descending,
last seen descending, id ascending). The first `bucket_size` fit; the rest overflow, in
(bucket, rank) order: the ids the policy would have evicted first. Of those that fit, an id
whose exported row lies in its new bucket keeps that row; the others, in rank order, take the
bucket's remaining rows in ascending order. The result depends on the set of ids and their
metadata, not on the order they are given in. With the same config every id keeps its row (the
remap only gives an id a row of its own bucket), so a restored table is the exported one, bit
for bit, on any mesh: a continued run is the uninterrupted one.

**The sketch** (pending ids' counts) is carried when the new config hashes alike (the same
`seed`, `sketch_depth` and `sketch_width`); otherwise admission starts counting afresh: a
count-min sketch holds no ids, so it cannot be re-hashed (`ImportResult.sketch_carried`).

Examples:
  >>> import jax, numpy as np
  >>> from jaxembed.dynamic import DynamicTableConfig
  >>> from jaxembed.optim import dynamic
  >>> cfg = DynamicTableConfig(capacity=8, bucket_size=4)
  >>> ids = np.array([3, 2**40, 5], np.int64)
  >>> _, dyn, _, _ = dynamic.prepare(cfg, dynamic.init_table(cfg, 2), None, ids, 0,
  ...     initializer=jax.nn.initializers.constant(0.5), key=jax.random.key(0), optimizer=None)
  >>> ex = export_rows(cfg, dyn)
  >>> sorted(ex.ids_uint64().tolist()), ex.rows.shape, ex.metadata.last_seen.tolist()
  ([3, 5, 1099511627776], (3, 2), [0, 0, 0])
  >>> big = DynamicTableConfig(capacity=32, bucket_size=4)
  >>> res = restore_rows(big, ex)
  >>> res.placement.overflow, dynamic.rows_for(big, res.dyn_table, ids).tolist()
  (0, [...])
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxembed.dynamic.config import INT32_MAX, DynamicTableConfig
from jaxembed.dynamic.keys import bucket_of, is_reserved, keys_to_host, to_uint64
from jaxembed.optim.dynamic import DynamicTable, check_dynamic_table, init_table
from jaxembed.optim.row_reset import reset_rows
from jaxembed.optim.sparse import RowSparseOptimizer

__all__ = [
    "OVERFLOW",
    "AdmissionState",
    "ImportResult",
    "Placement",
    "RowExport",
    "RowMetadata",
    "export_rows",
    "import_rows",
    "placement",
    "restore_rows",
]

OVERFLOW = ("raise", "report")


class RowMetadata(NamedTuple):
    """What the remap knows about each id besides its key (numpy, `[N]` each).

    Attributes:
      last_seen: int32[N], the step each id was last seen (`>= 0`).
      count: int32[N], the times it was seen (`>= 0`; `lfu` ranks by it).
      row: int32[N], the row it held in the exported table (distinct), or None: with it, an id
        keeps its row where that row lies in its new bucket.
    """

    last_seen: Any
    count: Any
    row: Any = None


class AdmissionState(NamedTuple):
    """The admission's count-min sketch, with the seed that hashed it (numpy).

    Attributes:
      sketch: int32[depth, width] counters.
      sketch_total: int32[1], counts since the last halving.
      seed: uint32[1], the exported table's `config.seed`.
      num_buckets: int32[1], the exported table's bucket count: each bucket counts in its own
        columns of the sketch, so a sketch carries only into a table of as many buckets. None
        in an export written before the sketch was bucket-local, which is never carried.
    """

    sketch: Any
    sketch_total: Any
    seed: Any
    num_buckets: Any = None


class RowExport(NamedTuple):
    """A dynamic table's live ids and all it holds for them, in ascending row order (numpy).

    A pytree of numpy arrays (and None): orbax saves it as is; restored without a target it
    comes back as nested dicts, which `restore_rows` takes too.

    Attributes:
      ids: uint32[N, 2] keys (low half, high half); `ids_uint64()` gives the ids.
      rows: f[N, H], each id's row of the table (the table's dtype).
      opt_state_rows: the optimizer state with every per-row leaf cut to the N ids' rows
        (`[N, H]`, `[N]`) and the other leaves (the step `count`) as they are; None without one.
      metadata: their `RowMetadata` (`row` the row each held).
      sketch: the `AdmissionState`; None for a table that admits at once (`admit_after=1`).
    """

    ids: Any
    rows: Any
    opt_state_rows: Any
    metadata: RowMetadata
    sketch: AdmissionState

    def ids_uint64(self) -> np.ndarray:
        """The ids as numpy uint64 `[N]`."""
        return to_uint64(self.ids).reshape(-1)


class Placement(NamedTuple):
    """Where `placement` puts each id under a config (numpy).

    Attributes:
      row: int32[N], each id's row (in the order given); `capacity` for one that does not fit.
      kept: how many ids kept the row they held (`RowMetadata.row`).
      overflow_index: int64[K], the ids that do not fit, as indices into the input, in
        (bucket, rank) order.
      overflow_ids: uint32[K, 2], their keys.
    """

    row: np.ndarray
    kept: int
    overflow_index: np.ndarray
    overflow_ids: np.ndarray

    @property
    def placed(self) -> int:
        """How many ids got a row."""
        return int(self.row.shape[0] - self.overflow_index.shape[0])

    @property
    def overflow(self) -> int:
        """How many ids did not fit (their buckets were full)."""
        return int(self.overflow_index.shape[0])


class ImportResult(NamedTuple):
    """What `import_rows` built.

    Attributes:
      dyn_table: the new `DynamicTable`, laid out on the mesh (the table as `weight_spec`).
      opt_state: the optimizer state of its table (None without an optimizer).
      placement: where each id went, and those that did not fit (`Placement`).
      sketch_carried: whether the admission's sketch was carried (see the module's docstring).
    """

    dyn_table: DynamicTable
    opt_state: Any
    placement: Placement
    sketch_carried: bool


# --- export ----------------------------------------------------------------------------------


def _host(a: Any) -> np.ndarray:
    """A whole (small or replicated) array on the host; every process calls it together
    where the array spans processes."""
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(a, tiled=True))
    return np.asarray(a)


def _take_rows(a: Any, rows: np.ndarray) -> np.ndarray:
    """`a[rows]` on the host (rows int64[N] ascending), one shard at a time: host memory is
    the N rows and one shard, not the table."""
    if not isinstance(a, jax.Array) or not a.is_fully_addressable:
        return _host(a)[rows]
    out = np.empty((rows.shape[0], *a.shape[1:]), a.dtype)
    seen = set()
    for shard in a.addressable_shards:
        index = shard.index
        where = tuple(s.indices(n)[:2] for s, n in zip(index, a.shape, strict=True))
        if where in seen:  # a replica of a block already read
            continue
        seen.add(where)
        (lo, hi), *_ = where
        mine = np.flatnonzero((rows >= lo) & (rows < hi))
        if mine.size:
            out[(mine, *index[1:])] = np.asarray(shard.data)[rows[mine] - lo]
    return out


def export_rows(
    config: DynamicTableConfig, dyn_table: DynamicTable, opt_state: Any = None
) -> RowExport:
    """The table's live ids and all it holds for them, on the host, in ascending row order.

    Args:
      config: the table's `DynamicTableConfig`.
      dyn_table: its `DynamicTable`, on any mesh (sharded arrays are read shard by shard; in
        a multi-process run every process calls it and gets the whole export).
      opt_state: its optimizer state (`optimizer.init(dyn_table.table)` trained), or None. A
        leaf of rank >= 1 is per row and must have `capacity` rows; scalars (the step
        `count`) are exported as they are.

    Returns:
      A `RowExport` of numpy arrays: N = the live ids.

    Raises:
      TypeError, ValueError: a `dyn_table` that is no `DynamicTable` or does not fit
        `config`; an optimizer state leaf of another table's rows (naming its path).
    """
    check_dynamic_table(config, dyn_table)
    state = dyn_table.state
    keys = _host(state.keys)
    rows = np.flatnonzero(~is_reserved(keys))  # int64[N] ascending: the export's order
    opt_rows = None
    if opt_state is not None:
        leaves = []
        for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state):
            if np.ndim(leaf) == 0:
                leaves.append(_host(leaf))
                continue
            if np.shape(leaf)[0] != config.capacity:
                raise ValueError(
                    f"opt_state{jax.tree_util.keystr(path)} has shape {list(np.shape(leaf))}, "
                    f"but a per-row leaf of this table has {config.capacity} rows: pass the "
                    "optimizer state of dyn_table.table (optimizer.init(dyn_table.table), "
                    "trained with it)"
                )
            leaves.append(_take_rows(leaf, rows))
        opt_rows = jax.tree.unflatten(jax.tree.structure(opt_state), leaves)
    sketch = None  # orbax saves no zero-size array, and an unused sketch is int32[0, 0]
    if config.uses_sketch:
        sketch = AdmissionState(
            _host(state.sketch),
            _host(state.sketch_total),
            np.array([config.seed], np.uint32),
            np.array([config.num_buckets], np.int32),
        )
    return RowExport(
        ids=np.ascontiguousarray(keys[rows]),
        rows=_take_rows(dyn_table.table, rows),
        opt_state_rows=opt_rows,
        metadata=RowMetadata(
            last_seen=_host(state.last_seen)[rows],
            count=_host(state.count)[rows],
            row=rows.astype(np.int32),
        ),
        sketch=sketch,
    )


# --- checks of an import's inputs ------------------------------------------------------------


def _check_config(config: Any) -> None:
    if not isinstance(config, DynamicTableConfig):
        raise TypeError(
            f"config must be a DynamicTableConfig, got {type(config).__name__} {config!r:.60}: "
            "the table to import into, e.g. DynamicTableConfig(capacity=1 << 20)"
        )


def _check_ids(ids: Any) -> np.ndarray:
    """The ids as keys uint32[N, 2]: one flat list, no reserved id, no id twice."""
    keys = keys_to_host(ids, "ids")
    if keys.ndim != 2:
        raise ValueError(
            f"ids must be one flat list of N ids (int64 / uint64 [N] or keys uint32[N, 2]), "
            f"got ids of shape {list(keys.shape[:-1])}: pass ids.reshape(-1) and rows "
            "reshaped alike"
        )
    u = to_uint64(keys)
    order = np.argsort(u, kind="stable")
    same = np.flatnonzero(u[order][1:] == u[order][:-1])
    if same.size:
        first, again = sorted((int(order[same[0]]), int(order[same[0] + 1])))
        raise ValueError(
            f"ids[{again}] = {int(u[again])} repeats ids[{first}]: an id holds one row, so "
            "each may be imported once; drop the repeats first (e.g. keep the first of each: "
            "_, keep = np.unique(ids, return_index=True), then ids[keep], rows[keep])"
        )
    return keys


def _check_rows(rows: Any, n: int) -> np.ndarray:
    """The rows as numpy floats [N, H] (float64 as float32: JAX without x64)."""
    a = np.asarray(rows)
    if a.ndim != 2 or a.shape[1] < 1:
        raise ValueError(
            f"rows must be f[N, H], one row of the table per id, got shape {list(a.shape)}: "
            f"pass rows[i] = the vector of ids[i] ({n} ids), e.g. export.rows"
        )
    if not jnp.issubdtype(a.dtype, jnp.floating):
        raise TypeError(f"rows must be floats (the table's rows), got {a.dtype.name} rows")
    if a.shape[0] != n:
        raise ValueError(
            f"rows has {a.shape[0]} rows but ids has {n} ids: pass one row per id (rows[i] is "
            "the vector of ids[i]), in the same order"
        )
    return a.astype(jax.dtypes.canonicalize_dtype(a.dtype), copy=False)


def _int_field(name: str, v: Any, n: int, lo: int) -> np.ndarray:
    a = np.asarray(v)
    if a.shape != (n,) or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(
            f"metadata.{name} must be int32[{n}], one per id, got {a.dtype.name}"
            f"{list(a.shape)}: pass export.metadata, or RowMetadata(last_seen, count) "
            "aligned with ids"
        )
    bad = np.flatnonzero((a < lo) | (a > INT32_MAX))
    if bad.size:
        i = int(bad[0])
        why = {"last_seen": "a step (steps count up from 0)", "count": "a count of sightings",
               "row": "a row number"}[name]  # fmt: skip
        raise ValueError(
            f"metadata.{name}[{i}] = {int(a[i])} is outside [{lo}, {INT32_MAX}]: it is {why}; "
            "pass the export's metadata unchanged"
        )
    return a.astype(np.int32)


def _check_metadata(metadata: Any, n: int) -> RowMetadata:
    """The metadata as numpy int32 [N] fields; None: each id seen once, at step 0."""
    if metadata is None:
        return RowMetadata(np.zeros(n, np.int32), np.ones(n, np.int32), None)
    if isinstance(metadata, Mapping):  # as orbax restores a RowMetadata without a target
        metadata = RowMetadata(**metadata)
    if not isinstance(metadata, tuple) or len(metadata) not in (2, 3):
        raise TypeError(
            f"metadata must be a RowMetadata(last_seen, count, row=None), got "
            f"{type(metadata).__name__}: pass export.metadata"
        )
    metadata = RowMetadata(*metadata)
    row = metadata.row
    if row is not None:
        row = _int_field("row", row, n, 0)
        order = np.argsort(row, kind="stable")
        same = np.flatnonzero(row[order][1:] == row[order][:-1])
        if same.size:
            a, b = sorted((int(order[same[0]]), int(order[same[0] + 1])))
            raise ValueError(
                f"metadata.row[{b}] = {int(row[b])} repeats metadata.row[{a}]: two ids never "
                "held one row; pass the export's metadata unchanged, or row=None"
            )
    return RowMetadata(
        _int_field("last_seen", metadata.last_seen, n, 0),
        _int_field("count", metadata.count, n, 0),
        row,
    )


# --- placement -------------------------------------------------------------------------------


def _within(groups: np.ndarray) -> np.ndarray:
    """Each entry's place within its run of equal `groups` (sorted): int64[N]."""
    n = groups.shape[0]
    at = np.arange(n)
    starts = np.ones(n, bool)
    starts[1:] = groups[1:] != groups[:-1]
    return at - np.maximum.accumulate(np.where(starts, at, 0)) if n else at


def placement(config: DynamicTableConfig, ids: Any, *, metadata: Any = None) -> Placement:
    """Where `import_rows` puts each id under `config` (the module's docstring states how).

    Numpy only: use it to size a table before importing (`placement(...).overflow`).

    Args:
      config: the table to place into.
      ids: N distinct ids (int64 / uint64 `[N]`, or keys uint32 `[N, 2]`).
      metadata: their `RowMetadata`, or None (each seen once at step 0: ranked by id).

    Returns:
      A `Placement`.

    Raises:
      ValueError: an id twice or equal to `EMPTY_ID`, metadata of another length or range.

    Examples:
      >>> import numpy as np
      >>> from jaxembed.dynamic import DynamicTableConfig
      >>> p = placement(DynamicTableConfig(capacity=4, bucket_size=4), np.arange(1, 7))
      >>> p.placed, p.overflow, sorted(p.row.tolist())      # one bucket of 4 rows
      (4, 2, [0, 1, 2, 3, 4, 4])
    """
    _check_config(config)
    keys = _check_ids(ids)
    return _place(config, keys, _check_metadata(metadata, keys.shape[0]))


def _place(config: DynamicTableConfig, keys: np.ndarray, meta: RowMetadata) -> Placement:
    """`placement` of checked keys uint32[N, 2] and metadata."""
    n, cap, s = keys.shape[0], config.capacity, config.bucket_size
    bucket = bucket_of(keys, config.num_buckets, config.seed).astype(np.int64)
    last, count = meta.last_seen.astype(np.int64), meta.count.astype(np.int64)
    lo, hi = keys[:, 0].astype(np.int64), keys[:, 1].astype(np.int64)
    if config.policy == "lfu":  # np.lexsort: the last key sorts first
        order = np.lexsort((lo, hi, -last, -count, bucket))
    else:
        order = np.lexsort((lo, hi, -count, -last, bucket))
    sb = bucket[order]
    fits = _within(sb) < s  # sorted order: the first bucket_size of each bucket
    if meta.row is not None:
        old = meta.row.astype(np.int64)[order]
        keep = fits & (old // s == sb)  # an exported row inside its new bucket
    else:
        old, keep = np.full(n, cap, np.int64), np.zeros(n, bool)
    new = np.where(keep, old, cap)
    taken = np.zeros(cap, bool)
    taken[old[keep]] = True
    free = np.flatnonzero(~taken)  # ascending, so grouped by bucket
    fill = fits & ~keep
    fb = sb[fill]
    new[fill] = free[np.searchsorted(free, fb * s) + _within(fb)]
    row = np.empty(n, np.int32)
    row[order] = new
    over = order[~fits].astype(np.int64)
    return Placement(row, int(keep.sum()), over, keys[over])


# --- import ----------------------------------------------------------------------------------


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _conform(tree: Any, like: Any) -> Any:
    """`tree` in the structure of `like` where orbax gave it back as dicts (a NamedTuple's
    fields by name) or lists; anything else as it is, for the caller's structure check."""
    if _is_namedtuple(like):
        if isinstance(tree, Mapping) and set(tree) == set(like._fields):
            tree = [tree[f] for f in like._fields]
        if isinstance(tree, list | tuple) and len(tree) == len(like):
            return type(like)(*(_conform(t, x) for t, x in zip(tree, like, strict=True)))
        return tree
    if isinstance(like, dict) and isinstance(tree, Mapping) and set(tree) == set(like):
        return {k: _conform(tree[k], v) for k, v in like.items()}
    return tree


def _opt_rows(optimizer: Any, opt_state_rows: Any, n: int, hidden: int, dtype: Any):
    """The optimizer's one-row state structure, checked against `opt_state_rows`: (per-row
    flags, the leaves of `opt_state_rows` or None)."""
    if optimizer is None:
        if opt_state_rows is not None:
            raise ValueError(
                "import_rows: got opt_state_rows but optimizer=None: pass the optimizer that "
                "made them (optimizer=opt), so that the new table gets its optimizer state"
            )
        return None, None
    if not isinstance(optimizer, RowSparseOptimizer):
        raise TypeError(
            f"optimizer must be a jaxembed.optim.RowSparseOptimizer (e.g. "
            f"jaxembed.optim.adagrad(0.1)), got {type(optimizer).__name__}"
        )
    one = optimizer.init(jnp.zeros((1, hidden), dtype), weight_spec=P())
    per_row = tuple(np.ndim(f) >= 1 and np.shape(f)[0] == 1 for f in jax.tree.leaves(one))
    if opt_state_rows is None:
        return per_row, None
    tree = _conform(opt_state_rows, one)
    if jax.tree.structure(tree) != jax.tree.structure(one):
        raise ValueError(
            f"opt_state_rows is not a state of optimizer {optimizer.name!r}: its structure "
            f"{jax.tree.structure(tree)} differs from optimizer.init's "
            f"{jax.tree.structure(one)}; pass the optimizer the table was trained with"
        )
    leaves = []
    for (path, f), leaf, is_row in zip(jax.tree_util.tree_leaves_with_path(one),
                                       jax.tree.leaves(tree), per_row, strict=True):  # fmt: skip
        a = np.asarray(leaf)
        want = (n, *np.shape(f)[1:]) if is_row else np.shape(f)
        if a.shape != want:
            raise ValueError(
                f"opt_state_rows{jax.tree_util.keystr(path)} is {a.dtype.name}{list(a.shape)}, "
                f"but {n} ids of rows of {hidden} need {list(want)}: pass the opt_state_rows "
                "exported with these ids and rows"
            )
        leaves.append(a.astype(np.asarray(f).dtype, copy=False))
    return per_row, leaves


def _scatter(layout: tuple, arrays: tuple, rows: jax.Array, values: tuple) -> tuple:
    """Every array `[capacity, ...]` with the global `rows` set to `values` `[N, ...]`, in its
    own layout (one `shard_map` over the mesh; rows past the end are dropped)."""
    mesh, specs = layout
    if mesh is None:
        return tuple(reset_rows(a, None, rows, v) for a, v in zip(arrays, values, strict=True))
    body = lambda arrays, rows, values: tuple(
        reset_rows(a, s, rows, v) for a, s, v in zip(arrays, specs, values, strict=True)
    )
    return jax.shard_map(body, mesh=mesh, in_specs=(specs, P(), (P(),) * len(values)),
                         out_specs=specs, check_vma=False)(arrays, rows, values)  # fmt: skip


_scatter_jit = jax.jit(_scatter, static_argnums=0, donate_argnums=1)


def _fill(arrays: list, rows: np.ndarray, values: list) -> list:
    """`_scatter` of the arrays made for the import, donated (nothing table-sized is added)."""
    shardings = [a.sharding for a in arrays]
    first = shardings[0]
    mesh = first.mesh if isinstance(first, NamedSharding) else None
    specs = tuple(s.spec for s in shardings) if mesh is not None else None
    rows = jnp.asarray(rows, jnp.int32)
    values = [jnp.asarray(v, a.dtype) for v, a in zip(values, arrays, strict=True)]
    if mesh is not None:
        rep = NamedSharding(mesh, P())
        rows, values = jax.device_put(rows, rep), [jax.device_put(v, rep) for v in values]
    out = _scatter_jit((mesh, specs), tuple(arrays), rows, tuple(values))
    return [o if o.sharding == s else jax.device_put(o, s)
            for o, s in zip(out, shardings, strict=True)]  # fmt: skip


def _sketch(config: DynamicTableConfig, sketch: Any) -> AdmissionState | None:
    """The sketch to carry into `config`, or None where it hashes otherwise (or is absent)."""
    if sketch is None:
        return None
    if isinstance(sketch, Mapping):
        sketch = AdmissionState(**sketch)
    sk = AdmissionState(*(np.asarray(a) for a in sketch))
    if sk.sketch_total.shape != (1,) or sk.seed.shape != (1,) or sk.sketch.ndim != 2:
        raise ValueError(
            f"sketch must be an AdmissionState(sketch int32[d, w], sketch_total int32[1], seed "
            f"uint32[1]), got shapes {[list(a.shape) for a in sk]}: pass export.sketch"
        )
    if sk.num_buckets is None or sk.num_buckets.shape != (1,):
        return None  # an export of the former whole-table sketch, hashed otherwise
    same = (
        int(sk.seed[0]) == config.seed
        and int(sk.num_buckets[0]) == config.num_buckets
        and tuple(sk.sketch.shape) == config.sketch_shape
    )
    return sk if same and config.uses_sketch else None


def import_rows(
    config: DynamicTableConfig,
    ids: Any,
    rows: Any,
    *,
    opt_state_rows: Any = None,
    metadata: Any = None,
    sketch: Any = None,
    optimizer: RowSparseOptimizer | None = None,
    mesh: Any = None,
    weight_spec: P | None = None,
    overflow: str = "raise",
) -> ImportResult:
    """A fresh dynamic table of `config` holding the given ids, each with its row and state.

    Every id goes to its bucket under `config` (`placement`: with the exported config, every
    id keeps its row). Rows no id takes stay as `init_table` and `optimizer.init` make them.

    Args:
      config: the new table (any capacity, bucket size, seed or policy).
      ids: N distinct ids: int64 / uint64 `[N]`, or keys uint32 `[N, 2]` (`RowExport.ids`).
      rows: f `[N, H]`, `rows[i]` the vector of `ids[i]`; the table takes their dtype
        (float64 becomes float32, as JAX without x64 has it).
      opt_state_rows: the optimizer state with per-row leaves `[N, ...]` and the others as
        they are (`RowExport.opt_state_rows`, or the dicts orbax restores it as); None: each
        id's optimizer state starts afresh.
      metadata: a `RowMetadata` (last seen, count, row held); None: each id seen once at
        step 0, no row held.
      sketch: the admission's `AdmissionState`, carried where `config` hashes alike.
      optimizer: the `RowSparseOptimizer` to make the optimizer state with, or None.
      mesh, weight_spec: where the new table lives, as `init_table` takes them.
      overflow: `"raise"` (default): refuse when an id does not fit, naming how many and the
        first; `"report"`: import the others and return the rest in `placement`.

    Returns:
      An `ImportResult`: the `DynamicTable`, its optimizer state, the `Placement`, and
      whether the sketch was carried.

    Raises:
      TypeError: a config, optimizer or metadata of another type; ids in no id form.
      ValueError: ids and rows of other lengths, rows that are no `[N, H]`, an id twice,
        metadata or optimizer rows that do not fit, a split that does not divide, and with
        `overflow="raise"` ids that do not fit.
    """
    _check_config(config)
    if overflow not in OVERFLOW:
        raise ValueError(f"overflow={overflow!r} must be one of {OVERFLOW}")
    keys = _check_ids(ids)
    n = keys.shape[0]
    values = _check_rows(rows, n)
    meta = _check_metadata(metadata, n)
    hidden, dtype = values.shape[1], values.dtype
    per_row, opt_leaves = _opt_rows(optimizer, opt_state_rows, n, hidden, dtype)
    carried = _sketch(config, sketch)
    where = _place(config, keys, meta)
    if where.overflow and overflow == "raise":
        i, s = int(where.overflow_index[0]), config.bucket_size
        bigger = max(2 * config.capacity, math.ceil(n / 0.75 / s) * s)
        raise ValueError(
            f"{where.overflow} of {n} ids do not fit {config}: their buckets of {s} rows are "
            f"full (load factor {n / config.capacity:.2f}); the first is ids[{i}] = "
            f"{int(to_uint64(keys[i]))}. Import into a larger capacity (e.g. "
            f"capacity={bigger}), or pass overflow='report' to import the others and get "
            "these in result.placement.overflow_ids"
        )
    dyn = init_table(config, hidden, dtype=dtype, mesh=mesh, weight_spec=weight_spec)
    state = dyn.state
    arrays = [dyn.table, state.keys, state.last_seen, state.count]
    fills = [values, keys, meta.last_seen, meta.count]
    leaves, treedef, rowed = [], None, []
    if optimizer is not None:  # fresh values everywhere; the ids' rows and scalars carried
        leaves, treedef = jax.tree.flatten(optimizer.init(dyn.table))
        if opt_leaves is not None:
            rowed = [i for i, r in enumerate(per_row) if r]
            arrays += [leaves[i] for i in rowed]
            fills += [opt_leaves[i] for i in rowed]
            for i in range(len(leaves)):
                if not per_row[i]:  # the step count and the other scalars
                    leaves[i] = jax.device_put(opt_leaves[i], leaves[i].sharding)
    if n:
        arrays = _fill(arrays, where.row, fills)
    table, skeys, last, count, *new_leaves = arrays
    for i, leaf in zip(rowed, new_leaves, strict=True):
        leaves[i] = leaf
    opt_state = None if treedef is None else jax.tree.unflatten(treedef, leaves)
    state = state._replace(keys=skeys, last_seen=last, count=count)
    if carried is not None:
        state = state._replace(
            sketch=jax.device_put(carried.sketch.astype(np.int32), state.sketch.sharding),
            sketch_total=jax.device_put(
                carried.sketch_total.astype(np.int32), state.sketch_total.sharding
            ),
        )
    return ImportResult(DynamicTable(table, state), opt_state, where, carried is not None)


def restore_rows(
    config: DynamicTableConfig,
    export: RowExport | Mapping[str, Any],
    *,
    optimizer: RowSparseOptimizer | None = None,
    mesh: Any = None,
    weight_spec: P | None = None,
    overflow: str = "raise",
) -> ImportResult:
    """`import_rows` of every field of an export: a `RowExport`, or the nested dicts orbax
    restores one as without a target.

    With `optimizer=None` an export's optimizer rows are not imported (the new table has no
    optimizer state); pass the optimizer to carry them.

    Examples:
      >>> import numpy as np
      >>> from jaxembed.dynamic import DynamicTableConfig
      >>> ex = RowExport(np.array([[1, 0], [2, 0]], np.uint32), np.ones((2, 3), np.float32),
      ...                None, RowMetadata(np.array([4, 5]), np.array([1, 1])), None)
      >>> res = restore_rows(DynamicTableConfig(capacity=8, bucket_size=4), ex)
      >>> res.dyn_table.table.shape, res.placement.placed, res.sketch_carried
      ((8, 3), 2, False)
    """
    if isinstance(export, Mapping):
        missing = [f for f in ("ids", "rows") if f not in export]
        if missing:
            raise ValueError(
                f"export has no {missing[0]!r}: pass a RowExport (export_rows(...)) or the "
                f"dict orbax restores one as; got keys {sorted(export)}"
            )
        export = RowExport(**{f: export.get(f) for f in RowExport._fields})
    if not isinstance(export, RowExport):
        raise TypeError(
            f"export must be a RowExport (export_rows(...)) or the dict orbax restores one "
            f"as, got {type(export).__name__}"
        )
    return import_rows(
        config,
        export.ids,
        export.rows,
        opt_state_rows=export.opt_state_rows if optimizer is not None else None,
        metadata=export.metadata,
        sketch=export.sketch,
        optimizer=optimizer,
        mesh=mesh,
        weight_spec=weight_spec,
        overflow=overflow,
    )
