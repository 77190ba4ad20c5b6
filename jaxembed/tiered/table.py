"""A tiered table: rows and optimizer state in a `TableStore`, hot rows cached on the device.

The cache **is a dynamic table** (`jaxembed.dynamic`, `jaxembed.kernels.remap`) keyed by the
static row id: `cache_rows` slots in buckets, the id -> slot map with LRU / LFU eviction, one
remap step a training step. Where a dynamic table initialises the rows a step (re)assigns,
the tiered table fills them from the store, and where a dynamic table forgets the id a step
evicts, the tiered table first writes its row and optimizer state back. One id -> slot
machine, not two (DESIGN.md, "Round 4").

A step, driven from the host:

    slots, stats = tiered.prepare(ids)          # the batch's rows in the cache, ids -> slots
    tiered.table, tiered.opt_state = step(tiered.table, tiered.opt_state, slots, ...)

`prepare` runs the remap step on the batch's ids (admit at once: `admit_after=1`), writes
back what leaves the device (rows evicted from their slots, and the rows the last step
served from spill rows), reads the misses from the store into their slots, and returns the
ids as cache slots. The user's step is the static path, unchanged: `jaxembed.embedding` /
`jaxembed.embedding_bag` and a row-sparse optimizer's `update` on `tiered.table` and
`tiered.opt_state`. `flush` writes every cached row back.

**Prefetch.** `prepare(ids, next_ids=nxt)` (or `pipeline(loader)`, which reads a loader one
batch ahead) also plans the next batch: its remap is dispatched before the user's step, and
a worker thread reads its misses from the store while the step runs; the store's reads and
write-backs all run on that thread, in order (`jaxembed.tiered.prefetch` says why that is
exact).

**Spill rows.** A set-associative cache can find a bucket full of the batch's own ids (slots
looked up this step are never evicted) though the cache has room elsewhere: the remap then
refuses the id. FBGEMM's UVM cache reads such rows from host memory directly; here they take
one of `spill_rows` extra rows after the cache's, filled from the store for this step and
written back at the next `prepare` (or `flush`). No id is dropped: a batch of more distinct
ids than `cache_rows`, or with more refused ids than `spill_rows`, is refused before
anything changes, naming the numbers and the fix.

**Exact.** A cached row is the store's row, bit for bit, and every id of a step reads and
trains its own row in the cache, so outputs, tables and optimizer state equal the in-memory
table's: a row's gradient sums its occurrences in batch order in both, and the row-wise
formulas do not depend on where a row sits (`tests/test_tiered.py` checks it bitwise).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import jaxembed.tiered.prefetch as prefetch
from jaxembed.dynamic.config import DynamicTableConfig
from jaxembed.dynamic.keys import keys_to_host
from jaxembed.kernels import remap
from jaxembed.optim.dynamic import remap_engine
from jaxembed.optim.sparse import RowSparseOptimizer
from jaxembed.tiered.checkpoint import restore_store, save_store
from jaxembed.tiered.store import StoreSlot, TableStore

__all__ = ["TieredStats", "TieredTable", "create_store", "store_slots"]

_FLUSH_CHUNK = 1 << 15  # rows gathered from the device a pass by `flush`


class TieredStats(NamedTuple):
    """What one `prepare` did, in distinct ids and rows (Python ints).

    `hits + misses` is the batch's distinct ids (negative ids, padding, aside).
    """

    hits: int  # ids whose rows were in the cache already
    misses: int  # ids whose rows were read from the store (into cache slots or spill rows)
    spilled: int  # of the misses, those served from spill rows (their bucket was full)
    evicted: int  # rows evicted from their slots (written back if a step trained them)
    written_back: int  # rows written to the store: the dirty evicted, the last step's spills
    bytes_read: int  # bytes read from the store (rows and their optimizer state)
    bytes_written: int  # bytes written to it
    clean: int = 0  # rows that left the device untrained, so not written back
    prefetched: int = 0  # of the misses, those read while the previous step ran (next_ids)


def store_slots(optimizer: RowSparseOptimizer | None, dim: int) -> tuple[StoreSlot, ...]:
    """The `StoreSlot`s a store needs for `optimizer`'s row-wise state (none for None).

    Examples:
      >>> import jaxembed
      >>> store_slots(jaxembed.optim.rowwise_adagrad(0.1), 8)
      (StoreSlot(name='accumulator', shape=(), init=0.0),)
    """
    if optimizer is None:
        return ()
    _check_optimizer(optimizer)
    return tuple(StoreSlot(s.name, () if s.per_row else (dim,), float(s.init))
                 for s in optimizer.formula.slots)  # fmt: skip


def create_store(
    path: str,
    *,
    rows: int,
    dim: int,
    optimizer: RowSparseOptimizer | None,
    dtype: Any = np.float32,
    table: Any = None,
    overwrite: bool = False,
) -> TableStore:
    """`TableStore.create` with the slots `optimizer` needs, at its initial values.

    Args:
      path, rows, dim, dtype, table, overwrite: as `TableStore.create`'s.
      optimizer: the `RowSparseOptimizer` the table trains with, or None (lookups only).
    """
    return TableStore.create(path, rows=rows, dim=dim, dtype=dtype, table=table,
                             slots=store_slots(optimizer, dim), overwrite=overwrite)  # fmt: skip


def _check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, RowSparseOptimizer):
        raise TypeError(
            f"optimizer must be a jaxembed.optim.RowSparseOptimizer (e.g. "
            f"jaxembed.optim.rowwise_adagrad(0.05)) or None, got {type(optimizer).__name__}: "
            "a tiered table trains the rows it caches with the row-sparse update"
        )


_STEPS: dict[Any, Any] = {}


def _step_program(engine: Any) -> Any:
    """The remap engine's `step`, jitted once per engine (the config static, the state
    donated: a batch is checked before its remap runs, so the old state is never needed)."""
    if engine not in _STEPS:
        _STEPS[engine] = jax.jit(engine.step, static_argnums=0, static_argnames="check",
                                 donate_argnums=1)  # fmt: skip
    return _STEPS[engine]


_END = object()  # `pipeline`: the loader is done


def _same_ids(planned: np.ndarray, ids: Any) -> bool:
    """Whether `ids` is the batch a plan was made for."""
    ids = np.asarray(ids)
    return (
        ids.shape == planned.shape
        and ids.dtype == planned.dtype
        and bool(np.array_equal(ids, planned))
    )


def _pad_to(at: np.ndarray, fill: int) -> np.ndarray:
    """int32 `at`, padded with `fill` to `_padded(at.size)`."""
    out = np.full(_padded(at.size), fill, np.int32)
    out[: at.size] = at
    return out


_padded = prefetch.padded


@jax.jit
def _gather(table: jax.Array, slots: dict[str, jax.Array], at: jax.Array):
    """Rows `at` (int32[K], in range) of the cache and of each slot."""
    return table[at], {n: a[at] for n, a in slots.items()}


@jax.jit
def _scatter(table, slots, at, rows, values):
    """The cache with rows `at` (int32[K]; past the end: dropped) set, and each slot's."""
    table = table.at[at].set(rows.astype(table.dtype), mode="drop")
    return table, {n: a.at[at].set(values[n], mode="drop") for n, a in slots.items()}


_scatter_donated = jax.jit(_scatter.__wrapped__, donate_argnums=(0, 1))


class TieredTable:
    """A table in a `TableStore` with a cache of `cache_rows` rows on the device.

    Args:
      store: the backing `TableStore` (its slots must be the optimizer's: `create_store`).
      cache_rows: slots of the cache, a multiple of `bucket_size`.
      optimizer: the `RowSparseOptimizer` the step trains the cache with, or None (lookups).
      bucket_size: slots a bucket of the cache's id -> slot map (the probe bound).
      policy: which cached row leaves when a bucket is full: `"lru"` or `"lfu"`
        (`jaxembed.dynamic.DynamicTableConfig`).
      spill_rows: rows after the cache's for a step's ids whose bucket is full of the step's
        own ids (default: `max(bucket_size, cache_rows // 8)`).
      impl: the remap's engine: `"auto"`, `"xla"` or `"native"`.
      seed: the cache's hash seed.

    Attributes:
      table: the cache, `[cache_rows + spill_rows, dim]` on the device: the user's step reads
        and trains it at the slots `prepare` returns, and sets it back.
      opt_state: `optimizer.init(table)` filled from the store (None without an optimizer),
        set back by the step like the table.
      config: the cache's `DynamicTableConfig`; `state`: its remap state.
      step: the steps prepared so far.

    Raises:
      ValueError: a cache size that does not fit the buckets, or a store whose slots are
        not the optimizer's.
    """

    def __init__(
        self,
        store: TableStore,
        cache_rows: int,
        *,
        optimizer: RowSparseOptimizer | None = None,
        bucket_size: int = 32,
        policy: str = "lru",
        spill_rows: int | None = None,
        impl: str = "auto",
        seed: int = 0,
    ) -> None:
        if not isinstance(store, TableStore):
            raise TypeError(f"store must be a TableStore, got {type(store).__name__}")
        if optimizer is not None:
            _check_optimizer(optimizer)
        c, s = cache_rows, bucket_size
        if isinstance(c, bool) or not isinstance(c, int | np.integer) or c < 1:
            raise ValueError(f"cache_rows={c!r} must be a positive int")
        if isinstance(s, bool) or not isinstance(s, int | np.integer) or not 1 <= s <= 1024:
            raise ValueError(f"bucket_size={s!r} must be an int in [1, 1024]")
        if c % s:
            up, down = c - c % s + s, c - c % s
            raise ValueError(
                f"cache_rows={c} is not a multiple of bucket_size={s}: the cache is whole "
                f"buckets; use cache_rows={up}" + (f" (or {down})" if down else "")
            )
        if policy not in ("lru", "lfu"):
            raise ValueError(f"policy={policy!r}: a tiered table's cache evicts by 'lru' or 'lfu'")
        want = store_slots(optimizer, store.dim)
        if sorted(want) != sorted(store.slots):
            raise ValueError(
                f"the store at {store.path!r} holds slots {list(store.slots)}, but optimizer "
                f"{getattr(optimizer, 'name', None)!r} needs {list(want)}: create the store for "
                "this optimizer (create_store(path, ..., optimizer=optimizer))"
            )
        self.store, self.optimizer = store, optimizer
        self.config = DynamicTableConfig(capacity=int(c), bucket_size=s, policy=policy, seed=seed)
        self.spill_rows = max(s, c // 8) if spill_rows is None else int(spill_rows)
        if self.spill_rows < 0:
            raise ValueError(f"spill_rows={spill_rows} must be >= 0")
        self._engine = remap_engine(impl)
        self._step_jit = _step_program(self._engine)
        self.state = remap.init_state(self.config)
        self.table = jnp.zeros((c + self.spill_rows, store.dim), store.dtype)
        self.opt_state = None
        if optimizer is not None:
            st = optimizer.init(self.table)
            self.opt_state = st._replace(count=jnp.asarray(store.count, st.count.dtype))
        self.step = 0
        self._spilled = (np.zeros(0, np.int64), np.zeros(0, np.int32))  # ids, their rows
        # Dirty rows: trained (or, spill rows, served to a training step) since they were
        # filled or last written back. A clean row is the store's bits, so leaves unwritten.
        self._dirty = np.zeros(c + self.spill_rows, bool)
        # The host's copy of the map, as of the last commit: the id each slot holds (-1 free).
        self._ids_at = np.full(c, -1, np.int64)
        self._scratch = np.zeros(c, np.int64)  # the worker's: slot -> id of a planned batch
        self._worker = prefetch.Worker()
        self._pending: tuple[prefetch.Batch, Any] | None = None  # a batch planned ahead

    # --- properties ------------------------------------------------------------------------

    @property
    def cache_rows(self) -> int:
        return self.config.capacity

    def cached_ids(self) -> np.ndarray:
        """int64 `[cache_rows]`: the id each cache slot holds, -1 where free (as of the last
        `prepare`: a batch planned ahead with `next_ids` is not in it yet)."""
        return self._ids_at.copy()

    # --- the device side -------------------------------------------------------------------

    def _slots(self) -> dict[str, jax.Array]:
        self._check_live()
        return {} if self.opt_state is None else dict(self.opt_state.slots)

    def _check_live(self) -> None:
        arrays = [self.table] + (
            [] if self.opt_state is None else list(self.opt_state.slots.values())
        )
        if any(getattr(a, "is_deleted", lambda: False)() for a in arrays):
            raise RuntimeError(
                "tiered.table or tiered.opt_state was donated to a step and not set back: "
                "assign the step's results (tiered.table, tiered.opt_state = step(...))"
            )
        want = (self.cache_rows + self.spill_rows, self.store.dim)
        if tuple(self.table.shape) != want:
            raise ValueError(
                f"tiered.table is {list(self.table.shape)}, not the cache's {list(want)}"
            )

    def _pull(self, at: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Cache rows `at` (int32[K]) and their slots, on the host."""
        k = at.size
        rows, slots = jax.device_get(_gather(self.table, self._slots(), _pad_to(at, 0)))
        return rows[:k], {n: a[:k] for n, a in slots.items()}

    def _push(self, at: np.ndarray, rows: np.ndarray, slots: dict[str, np.ndarray]) -> None:
        """Cache rows `at` (int32[K]) and their slots set to `rows` and `slots`."""
        k, n = at.size, _padded(at.size)
        pad = lambda a: np.concatenate([a, np.zeros((n - k, *a.shape[1:]), a.dtype)])
        self._fill(_pad_to(at, self.table.shape[0]), pad(rows),
                   {name: pad(a) for name, a in slots.items()})  # fmt: skip

    def _fill(self, at: np.ndarray, rows: np.ndarray, slots: dict[str, np.ndarray]) -> None:
        """`_push` of padded host arrays (`at` past the end: dropped), one transfer each."""
        table, new = _scatter_donated(self.table, self._slots(), at, rows, slots)
        self.table = table
        if self.opt_state is not None:
            self.opt_state = self.opt_state._replace(slots=new)

    def _write_back(self, ids: np.ndarray, at: np.ndarray) -> int:
        """Cache rows `at` written to the store's rows `ids`; returns the bytes."""
        if not ids.size:
            return 0
        rows, slots = self._pull(at)
        self.store.write(ids, rows, slots)
        return ids.size * self.store.row_bytes

    # --- the step --------------------------------------------------------------------------

    def prepare(
        self, ids: Any, *, train: bool | None = None, next_ids: Any = None
    ) -> tuple[jax.Array, TieredStats]:
        """The batch's rows in the cache: its ids as cache slots, and what it took.

        Runs one step of the cache's remap on the batch's ids, writes back the rows it
        evicts (and the rows the last step spilled), fills the misses from the store into
        their slots (or spill rows), and returns each id's slot. With `next_ids`, it then
        plans the next batch: its remap is dispatched now (before the user's step, so it is
        ready while the step runs) and its misses are read from the store by a worker thread
        while the step runs, for the next `prepare` (a prefetch; `pipeline` drives it).

        Args:
          ids: the batch's row ids, integers of any shape (concrete, on the host); negative
            ids are padding (an empty slot of a bag) and stay negative.
          train: whether the step trains the batch's rows (default: whether the table has an
            optimizer). Their slots are then dirty, and written back when they leave the
            device; pass False for lookups alone (evaluation) so that rows a step only read
            leave without a write.
          next_ids: the next batch's ids (None: not known). The next call should be
            `prepare(next_ids, ...)`; a call with other ids first takes the planned batch
            as a lookup (its rows cached, nothing trained: still exact), then its own.

        Returns:
          `(slots, stats)`: int32 `[*ids.shape]`, each id's row of `table` (-1 for padding),
          to pass to the lookup and the optimizer's update in its place; a `TieredStats`.

        Raises:
          TypeError: ids (or next_ids) that are not integers.
          ValueError: an id past the store's rows; more distinct ids than `cache_rows`, or
            more ids refused by full buckets than `spill_rows`, in ids or next_ids (nothing
            is changed then).
          RuntimeError: the cache was donated to a step and not set back.
        """
        pending, self._pending = self._pending, None
        try:
            same = pending is not None and _same_ids(pending[0].ids, ids)
            batch = pending[0] if same else self._check(ids, "ids")
            after = None if next_ids is None else self._check(next_ids, "next_ids")
            self._check_live()
        except BaseException:
            self._pending = pending
            raise
        if pending is not None and not same:  # planned, not taken: looked up, not trained
            self._commit(*pending, train=False, ahead=True)
        plan = pending if same else (batch, self._plan(batch))
        out = self._commit(*plan, train=train, ahead=same)
        if after is not None:
            self._pending = (after, self._plan(after))
        return out

    def pipeline(
        self,
        batches: Iterable[Any],
        *,
        ids: Callable[[Any], Any] | None = None,
        train: bool | None = None,
    ) -> Iterator[tuple[Any, jax.Array, TieredStats]]:
        """The batches of a data loader, each with its slots, the next one prefetched.

        Reads one batch ahead of the loop: `prepare(batch, next_ids=next batch)`, so the
        next batch's misses are read from the store while the loop body's step runs.

        Args:
          batches: any iterable (a data loader).
          ids: a batch's row ids (default: the batch itself is the ids).
          train: as `prepare`'s.

        Yields:
          `(batch, slots, stats)`: run the step on `slots` in the loop body, and set the
          cache back (`tiered.table, tiered.opt_state = step(...)`).

        Examples:
          >>> import tempfile, numpy as np, jaxembed
          >>> opt = jaxembed.optim.rowwise_adagrad(0.1)
          >>> t = TieredTable(create_store(tempfile.mkdtemp() + "/s", rows=64, dim=4,
          ...                 optimizer=opt), 16, optimizer=opt, bucket_size=8)
          >>> loader = [np.array([1, 2, 3]), np.array([3, 4]), np.array([5])]
          >>> [(int(s.misses), int(s.prefetched)) for _, _, s in t.pipeline(loader)]
          [(3, 0), (1, 1), (1, 1)]
        """
        get = (lambda b: b) if ids is None else ids
        it = iter(batches)
        batch = next(it, _END)
        while batch is not _END:
            after = next(it, _END)
            nxt = None if after is _END else get(after)
            yield (batch, *self.prepare(get(batch), train=train, next_ids=nxt))
            batch = after

    def _check(self, ids: Any, what: str) -> prefetch.Batch:
        return prefetch.check_batch(ids, rows=self.store.rows, config=self.config,
                                    spill_rows=self.spill_rows, what=what)  # fmt: skip

    def _plan(self, batch: prefetch.Batch) -> Any:
        """The remap of `batch` dispatched (the state and step are its from here on), and the
        worker's `fetch` of its misses submitted (a future)."""
        # Padding goes in as the reserved id -1 (counted nowhere): the remap's input keeps the
        # batch's own shape, so one compiled program serves every batch. Dropping the padding
        # gives each batch its own length and a compile of its own (~0.2-0.4 s each; the same
        # 43k ids then remap in 4-8 ms, as with their padding).
        keys = keys_to_host(np.where(batch.pad, -1, batch.flat), check=False)
        t = remap.check_step_index(self.step)
        res = self._step_jit(self.config, self.state, keys, t, check=False)
        self.state, self.step = res.state, self.step + 1
        return self._worker.submit(prefetch.fetch, self.store, res, batch, self.cache_rows,
                                   self.table.shape[0], self._spilled, self._scratch)  # fmt: skip

    def _commit(
        self, batch: prefetch.Batch, future: Any, *, train: bool | None, ahead: bool
    ) -> tuple[jax.Array, TieredStats]:
        """A planned batch into the cache: what leaves written back, the misses filled."""
        p: prefetch.Planned = future.result()
        cap, pad = self.cache_rows, batch.pad
        spilled_ids, spilled_at = self._spilled

        # 1. what leaves the device: the rows evicted from their slots, the last step's
        # spill rows; the dirty ones are gathered (before the fill) and written back by the
        # worker, in id order, ahead of any later read.
        old = self._ids_at[p.new]
        gone = old >= 0
        out_ids = np.concatenate([spilled_ids, old[gone]])
        out_at = np.concatenate([spilled_at, p.new[gone]]).astype(np.int32)
        dirty = self._dirty[out_at]
        w_ids, w_at = out_ids[dirty], out_at[dirty]
        order = np.argsort(w_ids)
        w_ids, w_at = w_ids[order], w_at[order]

        # 2. the misses: the ids given slots, then those refused (spill rows). The worker
        # read them, but for the ids the last step spilled: their values are in their spill
        # rows, not yet in the store, and move on the device.
        spill_at = (cap + np.arange(p.refused.size)).astype(np.int32)
        dest_at = np.concatenate([p.new, spill_at]).astype(np.int32)
        mv_from = p.moves[0]  # and p.moves[1], their places, in the fill already
        if mv_from.size:  # waits for the last step: the moved rows are its results
            mv_rows, mv_slots = self._pull(mv_from)
            end = p.read + mv_from.size
            p.fill_rows[p.read : end] = mv_rows
            for n, a in p.fill_slots.items():
                a[p.read : end] = mv_slots[n]
        if w_ids.size:
            gathered = _gather(self.table, self._slots(), _pad_to(w_at, 0))
            self._worker.write(prefetch.write_back, self.store, w_ids, gathered)
        if dest_at.size:
            self._fill(p.fill_at, p.fill_rows, p.fill_slots)

        # 3. the host's map, dirty bits and the ids' slots.
        self._ids_at[p.new] = p.new_ids
        self._spilled = (p.refused, spill_at)
        self._dirty[dest_at] = False  # filled: the store's bits (once written back)
        if self.optimizer is not None if train is None else train:
            self._dirty[p.rows[p.found]] = True
            self._dirty[spill_at] = True
        live = np.where(p.found, p.rows, -1).astype(np.int32)
        live[~p.found] = spill_at[np.searchsorted(p.refused, batch.live[~p.found])]
        slots_of = np.full(pad.shape, -1, np.int32)
        slots_of[~pad] = live
        rb = self.store.row_bytes
        stat = TieredStats(
            hits=p.hits, misses=int(dest_at.size), spilled=int(p.refused.size),
            evicted=int(gone.sum()), written_back=int(w_ids.size),
            bytes_read=int(p.read * rb), bytes_written=int(w_ids.size * rb),
            clean=int(dirty.size - w_ids.size), prefetched=p.read if ahead else 0,
        )  # fmt: skip
        return jax.device_put(slots_of.reshape(batch.ids.shape)), stat

    def flush(self) -> int:
        """Every dirty cached row (and the last step's dirty spill rows) written back to the
        store, the optimizer's step count into its header, and the files flushed.

        The cache keeps its rows, clean now: training goes on after a flush (a batch planned
        with `next_ids` stays planned). Returns the rows written.
        """
        self._check_live()
        self._worker.drain()  # the write-backs submitted so far, first
        at = np.nonzero(self._ids_at >= 0)[0].astype(np.int32)
        ids = np.concatenate([self._ids_at[at], self._spilled[0]])
        at = np.concatenate([at, self._spilled[1]]).astype(np.int32)
        dirty = self._dirty[at]
        ids, at = ids[dirty], at[dirty]
        for lo in range(0, ids.size, _FLUSH_CHUNK):
            self._write_back(ids[lo : lo + _FLUSH_CHUNK], at[lo : lo + _FLUSH_CHUNK])
        if self.opt_state is not None:
            self.store.count = int(self.opt_state.count)
        self.store.flush()
        self._dirty[at] = False
        return int(ids.size)

    def wait(self) -> None:
        """Waits for the store reads and writes in flight on the worker thread (a write-back,
        the next batch's prefetch), raising a write-back's error. Timing a pipeline ends
        with it; nothing else needs it."""
        self._worker.drain()

    def close(self) -> None:
        """Waits for the store writes in flight and stops the worker thread (`flush` first
        to write the cache back; a later `prepare` starts the thread again)."""
        self._worker.close()

    def save(self, path: str) -> int:
        """A checkpoint at `path`: the cache flushed to the store, then the store copied to
        `path` atomically (`jaxembed.tiered.checkpoint`).

        The checkpoint is whole or absent: a process killed during the save leaves the
        previous checkpoint at `path`, and later write-backs go to the working store, never
        to a checkpoint. Training goes on after a save.

        Args:
          path: the checkpoint (a symlink to a sibling directory); one there is replaced.

        Returns:
          The rows the flush wrote back.

        Raises:
          ValueError: `path` is the working store, or something other than a checkpoint.
        """
        written = self.flush()
        save_store(self.store, path)
        return written

    @classmethod
    def restore(
        cls,
        checkpoint: str,
        path: str,
        cache_rows: int,
        *,
        optimizer: RowSparseOptimizer | None = None,
        rows: int | None = None,
        dim: int | None = None,
        dtype: Any = None,
        **kwargs: Any,
    ) -> TieredTable:
        """A tiered table from a checkpoint: copied to a working store at `path`, with an
        empty cache of `cache_rows` rows (any size: the cache is not saved).

        Args:
          checkpoint: a checkpoint (`save`).
          path: the working store's directory; a store there is replaced.
          cache_rows: the new cache's rows.
          optimizer: the optimizer the table trains with; the checkpoint's slots must be its.
          rows, dim, dtype: the table the caller expects (None: any): a checkpoint of
            another is refused.
          **kwargs: the rest of `TieredTable`'s options (`bucket_size`, `policy`, ...).

        Returns:
          The table, its optimizer's step count the checkpoint's.

        Raises:
          ValueError: a checkpoint of another shape, dtype or optimizer, naming both.

        Examples:
          >>> import tempfile, numpy as np, jaxembed
          >>> d, opt = tempfile.mkdtemp(), jaxembed.optim.rowwise_adagrad(0.1)
          >>> t = TieredTable(create_store(f"{d}/s", rows=64, dim=4, optimizer=opt), 16,
          ...                 optimizer=opt, bucket_size=8)
          >>> t.save(f"{d}/ckpt")
          0
          >>> TieredTable.restore(f"{d}/ckpt", f"{d}/s2", 32, optimizer=opt, dim=4).cache_rows
          32
          >>> TieredTable.restore(f"{d}/ckpt", f"{d}/s2", 32, optimizer=opt, dim=8)
          Traceback (most recent call last):
          ...
          ValueError: cannot restore the checkpoint '...': the store at ... holds float32[64, 4] ...
        """
        saved_dim = dim
        if optimizer is not None and saved_dim is None:
            saved_dim = TableStore.open(checkpoint, readonly=True).dim
        names = [s.name for s in store_slots(optimizer, saved_dim or 1)]
        store = restore_store(checkpoint, path, rows=rows, dim=dim, dtype=dtype, slots=names)
        return cls(store, cache_rows, optimizer=optimizer, **kwargs)

    def __repr__(self) -> str:
        return (
            f"TieredTable({self.store!r}, cache_rows={self.cache_rows}, spill_rows="
            f"{self.spill_rows}, bucket_size={self.config.bucket_size}, policy="
            f"{self.config.policy!r}, step={self.step})"
        )
