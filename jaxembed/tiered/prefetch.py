"""A tiered table's step in two halves, so that the next batch's store reads overlap the step.

`TieredTable.prepare` is a **plan** and a **commit**:

* the plan checks the batch on the host, dispatches the cache's remap step for it (the
  device runs work in the order it was dispatched, so the remap of batch t+1, dispatched
  before the user's step t, is ready while step t runs), and hands the rest to a worker
  thread (`fetch`): wait for the remap's answer, find the misses (the ids given a slot, the
  ids refused by a full bucket), and read their rows and optimizer state from the store;
* the commit (`TieredTable._commit`) takes what the worker found, gathers the rows that
  leave the device (one gather, written back to the store by the worker), fills the misses
  into their slots (one scatter), and returns the batch's slots.

`prepare(ids, next_ids=...)` commits batch t and plans batch t+1, so that the worker reads
t+1's misses while the device runs step t (a **prefetch**).

**Ordering.** Every store read and write runs on one worker thread, in the order it was
submitted: a read submitted after a write-back sees it. A row that is not cached has its
current value in the store once the write-backs submitted before it have run, with one
exception: the rows the last step served from spill rows, trained there and written back by
the *next* commit. The plan reads none of them; the commit moves such a row from its spill
row to its new place on the device (`TieredStats.misses` counts it, `bytes_read` does not).
A batch planned ahead is committed by the next `prepare`: rows evicted by the commit of t
are written back before t+1's reads (the same thread, submitted first); rows evicted by t+1
itself are cached at t, so never among its misses.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxembed.dynamic.config import DynamicTableConfig
from jaxembed.dynamic.keys import bucket_of, keys_to_host

__all__ = ["Batch", "Planned", "Worker", "check_batch", "fetch", "padded", "write_back"]


class Batch(NamedTuple):
    """A batch checked on the host."""

    ids: np.ndarray  # the ids as given (a copy: a plan compares the next batch with it)
    flat: np.ndarray  # int64[M]
    pad: np.ndarray  # bool[M]: negative ids, padding
    live: np.ndarray  # int64[L]: the ids that are not padding, in order


class Planned(NamedTuple):
    """What the worker found for a planned batch (host arrays)."""

    rows: np.ndarray  # int32[L] each live id's cache slot after the remap (where found)
    found: np.ndarray  # bool[L]
    hits: int  # distinct ids whose rows were cached
    new: np.ndarray  # int32[K] cache slots given to an id this step
    new_ids: np.ndarray  # int64[K] the id each took
    refused: np.ndarray  # int64[R] ascending: ids refused by a full bucket (spill rows)
    read: int  # the misses read from the store: the first `read` entries of the fill
    moves: tuple[np.ndarray, np.ndarray]  # int32 (from, to): last step's spill rows, moved
    fill_at: np.ndarray  # int32[P] the rows the fill sets (past the cache's end: dropped)
    fill_rows: np.ndarray  # [P, dim] their values (the moved ones' set by the commit)
    fill_slots: dict[str, np.ndarray]  # [P, ...] their optimizer state


def check_batch(
    ids: Any, *, rows: int, config: DynamicTableConfig, spill_rows: int, what: str
) -> Batch:
    """`ids` checked before anything changes: integers, in the store's rows, no more distinct
    ids than the cache holds, and no more ids refused by full buckets than `spill_rows`.

    The refusals are known before the remap runs: a bucket of S slots keeps every id the
    batch looks up in it, so n of the batch's distinct ids hashed to it leave max(0, n - S)
    without a slot, whatever the bucket held (`remap._pick`: a slot looked up in the step is
    never taken, every other slot may be).
    """
    ids = np.array(ids, copy=True)
    name = "" if what == "ids" else f"{what}: "
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"{name}ids must be integer row ids, got {ids.dtype} of shape {ids.shape}")
    raw = ids.reshape(-1)
    if raw.size and (raw >= rows).any():  # before the cast: a uint64 past 2**63 is no padding
        raise ValueError(
            f"{name}id {int(raw[np.argmax(raw >= rows)])} is outside the store's rows [0, {rows})"
        )
    flat = raw.astype(np.int64)
    pad = flat < 0
    ordered = np.sort(flat[~pad])
    distinct = ordered[np.concatenate([[True], ordered[1:] != ordered[:-1]])] if ordered.size \
        else ordered  # fmt: skip
    cache, s = config.capacity, config.bucket_size
    if distinct.size > cache:
        up = -(-distinct.size // s) * s
        raise ValueError(
            f"{name}the batch has {distinct.size} distinct ids, but the cache holds cache_rows="
            f"{cache}: every id of a step is cached while it runs; use cache_rows >= "
            f"{distinct.size} (e.g. {up}: a multiple of bucket_size={s}), or smaller batches"
        )
    per_bucket = np.bincount(bucket_of(keys_to_host(distinct, check=False), config.num_buckets,
                                       config.seed), minlength=config.num_buckets)  # fmt: skip
    refused = int(np.maximum(per_bucket - s, 0).sum())
    if refused > spill_rows:
        raise ValueError(
            f"{name}{refused} of the batch's {distinct.size} distinct ids found their cache "
            f"bucket full of the batch's own ids, more than spill_rows={spill_rows}: pass "
            f"spill_rows >= {refused}, or a larger cache_rows (the batch fills "
            f"{100 * distinct.size / cache:.0f}% of {cache}) or bucket_size"
        )
    return Batch(ids, flat, pad, flat[~pad])


def fetch(store: Any, result: Any, batch: Batch, cache_rows: int, end: int,
          spilled: tuple[np.ndarray, np.ndarray], scratch: np.ndarray) -> Planned:  # fmt: skip
    """The worker's half of a plan: the remap's answer, the misses, their store rows.

    Args:
      store: the `TableStore`.
      result: the remap's `StepResult` (device arrays; waited for here).
      batch: the batch.
      cache_rows: the cache's slots (spill rows follow them).
      end: the cache's rows with spill rows (a fill index there is dropped: padding).
      spilled: the last step's spill rows, `(ids ascending, rows)`: not read (the commit
        moves them on the device).
      scratch: int64[cache_rows], the worker's own: slot -> id of this batch.

    Returns:
      The `Planned` batch, its fill padded to a power of two (few compiled programs).
    """
    rows, found, reset, hits = jax.device_get(
        (result.rows, result.found, result.reset_rows, result.stats.hits)
    )
    live = batch.live
    rows, found = rows[~batch.pad], found[~batch.pad]
    new = reset[reset < cache_rows].astype(np.int32)
    scratch[rows[found]] = live[found]
    new_ids = scratch[new]
    refused = np.unique(live[~found])
    ids = np.concatenate([new_ids, refused])
    at = np.concatenate([new, cache_rows + np.arange(refused.size, dtype=np.int32)])
    moved = np.isin(ids, spilled[0]) if spilled[0].size else np.zeros(ids.shape, bool)
    mv_to, mv_from = at[moved], spilled[1][np.searchsorted(spilled[0], ids[moved])]
    ids, at = ids[~moved], at[~moved]
    order = np.argsort(ids)
    ids, at = ids[order], at[order]
    k, n = ids.size, padded(ids.size + mv_to.size)
    fill_at = np.full(n, end, np.int32)
    fill_at[:k], fill_at[k : k + mv_to.size] = at, mv_to
    fill_rows = np.zeros((n, store.dim), store.dtype)
    fill_slots = {s.name: np.zeros((n, *s.shape), np.float32) for s in store.slots}
    store.read_into(ids, fill_rows, fill_slots)
    return Planned(rows, found, int(hits), new, new_ids, refused, k,
                   (mv_from.astype(np.int32), mv_to), fill_at, fill_rows, fill_slots)  # fmt: skip


def padded(n: int) -> int:
    """A static length for n entries (few compiled programs, little padding moved): a power
    of two up to 256, then a multiple of an eighth to a sixteenth of n (16 lengths an octave).

    Examples:
      >>> [padded(n) for n in (0, 9, 256, 257, 10_700)]
      [8, 16, 256, 288, 11264]
    """
    if n <= 256:
        return max(8, 1 << max(0, n - 1).bit_length())
    step = 1 << ((n - 1).bit_length() - 4)
    return -(-n // step) * step


def write_back(store: Any, ids: np.ndarray, gathered: Any) -> None:
    """The worker's write-back: rows `ids` (ascending) from the device arrays `gathered`
    (`(rows, {slot: values})`, padded past `ids.size`) to the store."""
    rows, slots = jax.device_get(gathered)
    k = ids.size
    store.write(ids, rows[:k], {n: a[:k] for n, a in slots.items()})


class Worker:
    """One thread that runs a table's store reads and writes in the order submitted.

    A write-back's error is raised by the next `submit` or `drain` after it.
    """

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._writes: list[concurrent.futures.Future] = []

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        self._raise_failed(wait=False)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="jaxembed-tiered-store"
            )
        return self._pool.submit(fn, *args)

    def write(self, fn: Callable[..., Any], *args: Any) -> None:
        """`fn(*args)` submitted, its result never waited for but its error raised later."""
        self._writes.append(self.submit(fn, *args))

    def _raise_failed(self, *, wait: bool) -> None:
        done = self._writes if wait else [f for f in self._writes if f.done()]
        self._writes = [f for f in self._writes if f not in done]
        for f in done:
            f.result()

    def drain(self) -> None:
        """Waits for everything submitted; raises the first write-back error."""
        if self._pool is not None:
            self._pool.submit(lambda: None).result()
        self._raise_failed(wait=True)

    def close(self) -> None:
        self.drain()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
