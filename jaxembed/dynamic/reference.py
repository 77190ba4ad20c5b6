"""The dynamic table's policy in plain Python, one id and one bucket at a time.

The reference that `jaxembed.kernels.remap` (XLA) and its native twin are checked against,
decision for decision: it holds the same `DynamicState` (as numpy arrays) but decides with a
dict from id to row and loops over the batch's distinct ids and the buckets they want. It
shares only the hash (`jaxembed.dynamic.keys`) with the engines.

One step, given the table's state, a batch of ids and the step's index t:

1. The batch is a multiset: each distinct id d with multiplicity m(d). Ids equal to
   `EMPTY_ID` are counted in `reserved` and take no further part.
2. **Hits.** An id holding a row is touched: `last_seen = t`, `count += m` (saturating).
3. **Counting.** With `admit_after > 1`, every id without a row adds m to its d sketch
   counters (in its bucket's share of each row: `keys.sketch_index`); its estimate e(d) is
   then the minimum of them. With `admit_after = 1`,
   e(d) = m(d). An id with `e >= admit_after` is a **candidate**; the others are `pending`.
4. **Assignment, bucket by bucket** (ascending). The bucket's candidates are ranked by
   (e descending, id ascending). Its available slots are its free slots (ascending), then its
   victims in policy order, by their **age** `(t - last_seen) mod 2**32` (the step is a 32-bit
   counter that may wrap: ages, not steps, are compared); a slot of age 0 (looked up this
   step) is never one:
   * `lru`: occupied slots by (age descending, slot); `lfu`: by (count, age descending, slot);
   * `ttl`: only expired slots (age > `ttl_steps`), by (age descending, slot).
   Candidate r takes available slot r (`keys = id, last_seen = t, count = e`); if the slot
   held an id, that id is evicted. Candidates beyond the available slots are refused.
5. **Halving.** With the sketch, `sketch_total += Σ m` over the ids without a row; if it
   reaches `sketch_window`, every counter and the total are halved (integer shift).

The step's `reset_rows` lists the rows assigned in step 4 in that order (bucket, then rank):
the caller re-initialises those rows and their optimizer state before anything reads them.

Examples:
  >>> import numpy as np
  >>> from jaxembed.dynamic.config import DynamicTableConfig
  >>> cfg = DynamicTableConfig(capacity=8, bucket_size=4)
  >>> s = init_state(cfg)
  >>> out = step(cfg, s, np.array([10, 11, 10], np.int64), 0)
  >>> out.found.tolist(), out.stats.admitted, sorted(out.admitted)
  ([True, True, True], 2, [10, 11])
  >>> rows, found = lookup(cfg, out.state, np.array([11, 12], np.int64))
  >>> found.tolist(), bool(rows[0] == out.rows[1])
  ([True, False], True)
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, NamedTuple

import numpy as np

from jaxembed.dynamic.config import INT32_MAX, DynamicState, DynamicTableConfig, StepStats
from jaxembed.dynamic.keys import EMPTY_HALF, EMPTY_ID, bucket_of, keys_to_host, sketch_index

__all__ = ["ReferenceStep", "init_state", "lookup", "step"]


class ReferenceStep(NamedTuple):
    """One reference step's results (rows and found have the batch's shape)."""

    state: DynamicState  # the new state (numpy)
    rows: np.ndarray  # int32[*batch] each id's row after the step; capacity: none
    found: np.ndarray  # bool[*batch] whether it has one
    stats: StepStats  # Python ints
    reset_rows: list[int]  # rows assigned this step, in order (bucket, then rank)
    admitted: list[int]  # the id given each of them (uint64 values)
    evicted: list[int | None]  # the id each of them held before (None: it was free)
    refused: list[int]  # candidates that found no slot, in rank order


def init_state(config: DynamicTableConfig) -> DynamicState:
    """An empty table's state as numpy arrays (the same values as `remap.init_state`)."""
    c = config.capacity
    return DynamicState(
        keys=np.full((c, 2), EMPTY_HALF, np.uint32),
        last_seen=np.full((c,), -1, np.int32),
        count=np.zeros((c,), np.int32),
        sketch=np.zeros(config.sketch_shape, np.int32),
        sketch_total=np.zeros((1,), np.int32),
    )


def _ids(keys: np.ndarray) -> list[int]:
    """Keys uint32[N, 2] as Python ints (the ids' uint64 values)."""
    return [int(lo) | (int(hi) << 32) for lo, hi in keys.reshape(-1, 2).tolist()]


def _key(i: int) -> list[int]:
    return [i & 0xFFFFFFFF, i >> 32]


def lookup(
    config: DynamicTableConfig, state: DynamicState, ids: Any
) -> tuple[np.ndarray, np.ndarray]:
    """Each id's row (capacity where it has none) and whether it has one; reads nothing else."""
    keys = keys_to_host(ids, check=False)
    table = {i: r for r, i in enumerate(_ids(np.asarray(state.keys))) if i != EMPTY_ID}
    rows = [table.get(i, config.capacity) if i != EMPTY_ID else config.capacity for i in _ids(keys)]
    rows = np.array(rows, np.int32).reshape(keys.shape[:-1])
    return rows, rows < config.capacity


def _victim_order(config, last, count, slots, t):
    """The bucket's available slots: free ones ascending, then victims in policy order."""
    free = [s for s in slots if last[s] is None]
    age = {s: (t - last[s]) % 2**32 for s in slots if last[s] is not None}
    held = [s for s in age if age[s] != 0]
    if config.policy == "ttl":
        held = [s for s in held if age[s] > config.ttl_steps]
    if config.policy == "lfu":
        held.sort(key=lambda s: (count[s], -age[s], s))
    else:
        held.sort(key=lambda s: (-age[s], s))
    return free + held


def step(
    config: DynamicTableConfig, state: DynamicState, ids: Any, step_index: int
) -> ReferenceStep:
    """One step of the policy (the module's docstring): count, admit, evict, touch.

    Args:
      config: the table.
      state: its state (numpy or jax arrays; not modified).
      ids: the batch, in any form `keys.keys_to_host` takes (the reserved id allowed).
      step_index: t, an int counting up from step to step, read modulo 2**32 (an int32
        counter that wrapped, or any int: only `t mod 2**32` is kept).

    Returns:
      A `ReferenceStep`.
    """
    keys = keys_to_host(ids, check=False)
    t, cap, size = int(step_index) % 2**32, config.capacity, config.bucket_size
    held = _ids(np.asarray(state.keys))
    row_of = {i: r for r, i in enumerate(held) if i != EMPTY_ID}
    last = [
        None if i == EMPTY_ID else int(v)
        for i, v in zip(held, np.asarray(state.last_seen), strict=True)
    ]
    count = [int(v) for v in np.asarray(state.count)]
    sketch = np.asarray(state.sketch).astype(np.int64)
    total = int(np.asarray(state.sketch_total)[0])

    batch = _ids(keys)
    reserved = sum(i == EMPTY_ID for i in batch)
    mult: dict[int, int] = {}
    for i in batch:
        if i != EMPTY_ID:
            mult[i] = mult.get(i, 0) + 1

    misses = []
    for i, m in mult.items():  # 2. hits
        if i in row_of:
            r = row_of[i]
            last[r], count[r] = t, min(count[r] + m, INT32_MAX)
        else:
            misses.append(i)

    est = {}
    if config.uses_sketch:  # 3. counting
        miss_keys = np.array([_key(i) for i in misses], np.uint32).reshape(-1, 2)
        buckets = bucket_of(miss_keys, config.num_buckets, config.seed)
        where = sketch_index(miss_keys, buckets, config.sketch_depth,
                             config.sketch_per_bucket, config.seed)  # fmt: skip
        for n, i in enumerate(misses):
            for j in range(config.sketch_depth):
                sketch[j, where[j, n]] += mult[i]
            total += mult[i]
        for n, i in enumerate(misses):
            est[i] = min(int(sketch[j, where[j, n]]) for j in range(config.sketch_depth))
    else:
        est = {i: mult[i] for i in misses}
    candidates = [i for i in misses if est[i] >= config.admit_after]

    by_bucket = defaultdict(list)
    if candidates:
        their = bucket_of(np.array([_key(i) for i in candidates], np.uint32), config.num_buckets,
                          config.seed)  # fmt: skip
        for i, b in zip(candidates, their.tolist(), strict=True):
            by_bucket[b].append(i)
    reset_rows, admitted, evicted, refused = [], [], [], []
    for b in sorted(by_bucket):  # 4. assignment
        ranked = sorted(by_bucket[b], key=lambda i: (-est[i], i))
        avail = _victim_order(config, last, count, range(b * size, (b + 1) * size), t)
        for r, i in enumerate(ranked):
            if r >= len(avail):
                refused.append(i)
                continue
            s = avail[r]
            old = held[s] if last[s] is not None else None
            if old is not None:
                del row_of[old]
            held[s], last[s], count[s], row_of[i] = i, t, est[i], s
            reset_rows.append(s)
            admitted.append(i)
            evicted.append(old)

    if config.uses_sketch and total >= config.sketch_window:  # 5. halving
        sketch >>= 1
        total >>= 1

    new = DynamicState(
        keys=np.array([_key(i) for i in held], np.uint32).reshape(cap, 2),
        last_seen=np.array([-1 if v is None else v for v in last], np.int64).astype(np.int32),
        count=np.array([0 if last[r] is None else c for r, c in enumerate(count)], np.int32),
        sketch=sketch.astype(np.int32),
        sketch_total=np.array([total], np.int32),
    )
    rows = np.array([row_of.get(i, cap) for i in batch], np.int32).reshape(keys.shape[:-1])
    stats = StepStats(
        hits=len(mult) - len(misses),
        admitted=len(admitted),
        evicted=sum(e is not None for e in evicted),
        refused=len(refused),
        pending=len(misses) - len(candidates),
        reserved=reserved,
    )
    return ReferenceStep(new, rows, rows < cap, stats, reset_rows, admitted, evicted, refused)
