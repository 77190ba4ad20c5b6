"""The dynamic table's remap in XLA: raw 64-bit id -> row, with admission and eviction.

A dynamic table of `capacity` rows in buckets of `bucket_size` slots (bucket b holds rows
`[b·S, (b+1)·S)`) maps each id to a row of its own bucket (`keys.bucket_of`) or to none. Its
identity and metadata are a `DynamicState` (`jaxembed.dynamic.config`); the policy is stated,
one id at a time, in `jaxembed.dynamic.reference`, and these functions make the same decisions,
bit for bit, vectorised over the batch with static shapes and without x64:

* `lookup` reads: each id's row, or none (read-only; serving).
* `step` decides: it counts, admits, evicts and touches, and says which rows it (re)assigned,
  so the caller re-initialises those rows and their optimizer state before the ids read them.

How a step vectorises its decisions (M id slots, U <= M distinct ids, S slots a bucket):

1. one sort of the slots by (bucket, id) groups equal ids: the distinct ids, their
   multiplicities, and each slot's distinct id;
2. each distinct id compares its bucket's S keys (hit or miss); hits are touched;
3. misses add their multiplicity to the count-min sketch (one scatter-add: order-free, so
   deterministic), then read their estimate;
4. a second sort ranks the candidates by (bucket, estimate descending, id): candidate r of a
   bucket is its r-th; each candidate orders its bucket's S slots by availability (free first,
   then victims in policy order, then the unavailable; by S² comparisons up to 32 slots, a
   sort beyond) and takes the slot at place r when r is below the available count.
   Candidates of one bucket see one order and take distinct places, so no two take one
   slot, and buckets are disjoint: every scatter is free of conflicts.

Work is O(M log M + M·S²) a step (M·S log S beyond 32 slots): nothing scans the table (the
sketch's halving, once per `sketch_window` counts, is the one pass over the sketch).

Rows are int32; an id without a row has row `capacity` (outside every row, so a `mode="drop"`
scatter ignores it) and `found` False: it reads zeros and gets no gradient when its lookup is
masked by `found` (as `jaxembed.kernels.local.gather_rows` does).

Examples:
  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from jaxembed.dynamic.config import DynamicTableConfig
  >>> from jaxembed.dynamic.keys import as_keys
  >>> cfg = DynamicTableConfig(capacity=64, bucket_size=8)
  >>> run = jax.jit(step, static_argnums=0, donate_argnums=1)
  >>> out = run(cfg, init_state(cfg), as_keys(np.array([7, 2**40, 7], np.int64)), 0)
  >>> out.found.tolist(), int(out.stats.admitted), int(out.stats.hits)
  ([True, True, True], 2, 0)
  >>> bool(out.rows[0] == out.rows[2]), out.reset_rows.tolist()   # padded with capacity
  (True, [..., ..., 64])
  >>> rows, found = lookup(cfg, out.state, as_keys(np.array([2**40, 8], np.int64)))
  >>> found.tolist(), bool(rows[0] == out.rows[1])
  ([True, False], True)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxembed.dynamic.config import INT32_MAX, DynamicState, DynamicTableConfig, StepStats
from jaxembed.dynamic.keys import (
    EMPTY_HALF,
    as_keys,
    bucket_of,
    is_reserved,
    sketch_index,
)
from jaxembed.ragged import running_sum

__all__ = [
    "DynamicState",
    "Shard",
    "StepResult",
    "StepStats",
    "check_state",
    "check_step_index",
    "init_state",
    "lookup",
    "step",
]


class Shard(NamedTuple):
    """One of a table's equal row shards, for `lookup` and `step` run on its state alone.

    The config passed with it is the shard's (`DynamicTableConfig.shard(n)`): its rows,
    buckets and sketch counters; the ids are hashed into the whole table's `num_buckets`, and
    the ids of other shards' buckets are no part of this shard's step (no row, not counted).
    Rows and reset rows come back as the shard's own (`[0, config.capacity)`, capacity: none):
    the caller adds `first_bucket * bucket_size` for the table's. A sharded step does not halve
    the sketch: the halving waits on every shard's counts (`jaxembed.optim.dynamic`).
    """

    first_bucket: Any  # int32[] the shard's first bucket (traced: shard index x its buckets)
    num_buckets: int  # the whole table's buckets (static)


class StepResult(NamedTuple):
    """One step's results (`*B` the ids' batch shape, M = the number of id slots)."""

    state: DynamicState  # the new state (donate the old one)
    rows: jax.Array  # int32[*B] each id's row after the step; capacity: none
    found: jax.Array  # bool[*B] whether it has one (hit or admitted this step)
    stats: StepStats  # int32[] counts
    reset_rows: jax.Array  # int32[M] rows (re)assigned this step, in order; then capacity
    evicted_keys: jax.Array  # uint32[M, 2] the id each reset row held (EMPTY_HALF pairs: free)


def init_state(config: DynamicTableConfig) -> DynamicState:
    """An empty table: every key `EMPTY_ID`, `last_seen` -1, counts and sketch zero.

    Examples:
      >>> from jaxembed.dynamic.config import DynamicTableConfig
      >>> s = init_state(DynamicTableConfig(capacity=64, admit_after=2))
      >>> [(f, x.dtype.name, x.shape) for f, x in zip(s._fields, s)][:2]
      [('keys', 'uint32', (64, 2)), ('last_seen', 'int32', (64,))]
    """
    _check_config(config)
    c = config.capacity
    return DynamicState(
        keys=jnp.full((c, 2), EMPTY_HALF, jnp.uint32),
        last_seen=jnp.full((c,), -1, jnp.int32),
        count=jnp.zeros((c,), jnp.int32),
        sketch=jnp.zeros(config.sketch_shape, jnp.int32),
        sketch_total=jnp.zeros((1,), jnp.int32),
    )


def _check_config(config: Any) -> None:
    if not isinstance(config, DynamicTableConfig):
        raise TypeError(
            f"config must be a jaxembed.dynamic.config.DynamicTableConfig, got "
            f"{type(config).__name__} {config!r:.80}: build one, e.g. "
            "DynamicTableConfig(capacity=1 << 20)"
        )


def check_state(config: DynamicTableConfig, state: Any) -> None:
    """Raises unless `state` has the fields, dtypes and shapes `config` makes.

    Raises:
      TypeError: a config of another type, or a state that is no `DynamicState`.
      ValueError: a field of another dtype or shape, naming it and what it must be.
    """
    _check_config(config)
    if not isinstance(state, DynamicState):
        raise TypeError(
            f"state must be a DynamicState, got {type(state).__name__}: make it with "
            "remap.init_state(config)"
        )
    c = config.capacity
    want = dict(
        keys=("uint32", (c, 2)),
        last_seen=("int32", (c,)),
        count=("int32", (c,)),
        sketch=("int32", config.sketch_shape),
        sketch_total=("int32", (1,)),
    )
    for name, (dtype, shape) in want.items():
        a = getattr(state, name)
        got = (np.dtype(a.dtype).name, tuple(a.shape))
        if got != (dtype, shape):
            raise ValueError(
                f"state.{name} is {got[0]}{list(got[1])}, but {config} needs "
                f"{dtype}{list(shape)}: was the state made for another config? Make it with "
                "remap.init_state(config)"
            )


def check_step_index(step_index: Any) -> jax.Array:
    """`step_index` as the int32 bits of `t mod 2**32`, checked to be an integer scalar.

    The step is a 32-bit counter read modulo 2**32: an int32 counter that wrapped past
    `2**31 - 1` (as `step + 1` does under `jit`) keeps counting, and the policy compares
    ages `(t - last_seen) mod 2**32`, never the steps themselves (`_age`). Python ints and
    int64 / uint32 / uint64 steps of any value are taken modulo 2**32 too.

    Raises:
      TypeError: not an integer; ValueError: not a scalar.
    """
    if isinstance(step_index, bool) or not jnp.issubdtype(jnp.result_type(step_index), jnp.integer):
        raise TypeError(f"step_index must be an integer (the training step), got {step_index!r}")
    if np.shape(step_index) != ():
        raise ValueError(f"step_index must be a scalar, got shape {np.shape(step_index)}")
    if not isinstance(step_index, jax.Array):  # a Python or numpy int of any width, on the host
        return jnp.asarray(np.array(int(step_index) % 2**32, np.uint32).view(np.int32))
    if step_index.dtype.itemsize > 4:  # int64 / uint64 (x64 on): the low 32 bits
        step_index = step_index.astype(jnp.uint32)
    if step_index.dtype.itemsize == 4:
        return jax.lax.bitcast_convert_type(step_index, jnp.int32)
    return step_index.astype(jnp.int32)  # narrower integers, sign-extended


def _age(t: jax.Array, last: jax.Array) -> jax.Array:
    """Steps since `last` (a slot's `last_seen`) at step t: `(t - last) mod 2**32`, uint32.
    Exact while no live id goes unseen for 2**32 steps, whatever the counter's wraps."""
    return jax.lax.bitcast_convert_type(t - last, jnp.uint32)  # int32 subtraction wraps


def _bucket_view(config: DynamicTableConfig, state: DynamicState, bucket: jax.Array):
    """The S slots of each bucket in `bucket` (int32[N], in range): keys [N, S, 2],
    last_seen [N, S], count [N, S]."""
    nb, s = config.num_buckets, config.bucket_size
    return (
        state.keys.reshape(nb, s, 2)[bucket],
        state.last_seen.reshape(nb, s)[bucket],
        state.count.reshape(nb, s)[bucket],
    )


def _find(config: DynamicTableConfig, state: DynamicState, flat: jax.Array, bucket: jax.Array,
          live: jax.Array) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """Each key's row in its bucket (capacity where none) and whether it holds one."""
    s = config.bucket_size
    b = jnp.minimum(bucket, config.num_buckets - 1)
    held = state.keys.reshape(config.num_buckets, s, 2)[b]  # uint32[N, S, 2]
    match = (held[..., 0] == flat[:, None, 0]) & (held[..., 1] == flat[:, None, 1])
    match = match & live[:, None]  # a free slot's EMPTY key matches no live id
    found = jnp.any(match, axis=1)
    row = b * s + jnp.argmax(match, axis=1).astype(jnp.int32)
    return jnp.where(found, row, config.capacity), found


def lookup(
    config: DynamicTableConfig, state: DynamicState, ids: Any, *, check: bool = True,
    shard: Shard | None = None,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """Each id's row, and whether it has one; reads the state, changes nothing.

    Args:
      config: the table (static).
      state: its `DynamicState`.
      ids: the ids, any batch shape, in a form `keys.as_keys` takes (keys `uint32[*B, 2]`
        under `jit` with x64 off).
      check: raise for concrete ids equal to `EMPTY_ID` (True), or read them as padding.
      shard: the `Shard` `state` is (None: the whole table); other shards' ids find none.

    Returns:
      `(rows, found)`: int32[*B] (capacity where an id has no row) and bool[*B]. The reserved
      id `EMPTY_ID` has none.

    Raises:
      TypeError, ValueError: ids in no accepted form (`keys.as_keys`), a state that does
        not fit the config (`check_state`).
    """
    check_state(config, state)
    keys = as_keys(ids, check=check)  # check=False: the caller checked the ids
    batch = keys.shape[:-1]
    flat = keys.reshape(-1, 2)  # uint32[M, 2]
    if flat.shape[0] == 0:
        return jnp.zeros(batch, jnp.int32), jnp.zeros(batch, bool)
    bucket, mine = _buckets(config, flat, shard)
    rows, found = _find(config, state, flat, bucket, mine & ~is_reserved(flat))
    return rows.reshape(batch), found.reshape(batch)


def _buckets(config: DynamicTableConfig, flat: jax.Array, shard: Shard | None):
    """Each key's bucket among the (shard's) buckets, and whether the shard holds it."""
    if shard is None:
        return bucket_of(flat, config.num_buckets, config.seed), jnp.ones(flat.shape[:1], bool)
    local = bucket_of(flat, shard.num_buckets, config.seed) - shard.first_bucket
    mine = (local >= 0) & (local < config.num_buckets)
    return jnp.where(mine, local, config.num_buckets), mine


def _saturating_add(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.where(a > INT32_MAX - b, INT32_MAX, a + b)


def _distinct(config: DynamicTableConfig, flat: jax.Array, bucket: jax.Array):
    """Sort 1: the distinct ids (padded to M), their buckets and multiplicities, and each
    slot's distinct id (`bucket` nb for the ids that take no part: they sort last)."""
    m, nb = flat.shape[0], config.num_buckets
    iota = jnp.arange(m, dtype=jnp.int32)
    sb, shi, slo, order = jax.lax.sort((bucket, flat[:, 1], flat[:, 0], iota), num_keys=3)
    same = (sb[1:] == sb[:-1]) & (shi[1:] == shi[:-1]) & (slo[1:] == slo[:-1])
    new = jnp.concatenate([jnp.ones((1,), bool), ~same])
    uid = running_sum(new, dtype=jnp.int32) - 1  # int32[M] distinct number, in sorted order
    at = jnp.where(new, uid, m)
    u_bucket = jnp.full((m,), nb, jnp.int32).at[at].set(sb, mode="drop", unique_indices=True)
    u_keys = (
        jnp.full((m, 2), EMPTY_HALF, jnp.uint32)
        .at[at]
        .set(jnp.stack([slo, shi], axis=-1), mode="drop", unique_indices=True)
    )
    u_mult = jnp.zeros((m,), jnp.int32).at[uid].add(1)
    slot_uid = jnp.zeros((m,), jnp.int32).at[order].set(uid, unique_indices=True)
    return u_bucket, u_keys, u_mult, slot_uid


def _admission(config: DynamicTableConfig, state: DynamicState, u_keys, u_bucket, u_mult, miss):
    """Counting: the sketch after this step's misses, their estimates, the new total."""
    if not config.uses_sketch:
        return state.sketch, state.sketch_total, u_mult
    d, w = config.sketch_shape
    b = jnp.minimum(u_bucket, config.num_buckets - 1)  # padding: any bucket (adds 0)
    where = sketch_index(u_keys, b, d, config.sketch_per_bucket, config.seed)  # int32[D, M]
    flat_where = (where + (jnp.arange(d, dtype=jnp.int32) * w)[:, None]).reshape(-1)
    add = jnp.where(miss, u_mult, 0)
    sketch = state.sketch.reshape(-1).at[flat_where].add(jnp.tile(add, d))  # order-free
    est = jnp.min(sketch[flat_where].reshape(d, -1), axis=0)
    total = state.sketch_total + jnp.sum(add, dtype=jnp.int32)
    return sketch.reshape(d, w), total, est


def _lex_less(a: tuple[jax.Array, ...], b: tuple[jax.Array, ...]) -> jax.Array:
    """Whether tuple a sorts before tuple b, element-wise (the last key decides ties)."""
    less = a[-1] < b[-1]
    for x, y in zip(a[-2::-1], b[-2::-1], strict=True):
        less = (x < y) | ((x == y) & less)
    return less


_COMPARE_UP_TO = 32  # bucket sizes ordered by S² comparisons; larger ones by a sort


def _pick(config: DynamicTableConfig, held, last, count, t, rank):
    """The slot a candidate of rank r takes in its bucket, how many it could take, and which
    slots are occupied.

    A bucket's slots are taken in the order (class, then the policy's keys, then the slot):
    class 0 free, 1 a victim, 2 unavailable (occupied and looked up this step, or under ttl
    not expired). Up to `_COMPARE_UP_TO` slots the place of each slot is the number of slots
    that sort before it (S² comparisons a bucket, fused: XLA:CPU sorts many short rows of
    several operands slowly); larger buckets sort their slots.

    held uint32[N, S, 2], last / count int32[N, S], rank int32[N] -> (slot int32[N],
    available count int32[N], occupied bool[N, S]).
    """
    occupied = ~is_reserved(held)  # a free slot holds the reserved key
    age = _age(t, last)  # uint32[N, S]; 0: looked up this step
    victim = occupied & (age != 0)  # a slot looked up this step is never taken
    if config.policy == "ttl":
        victim &= age > jnp.uint32(config.ttl_steps)
    cls = jnp.where(occupied, jnp.where(victim, 1, 2), 0)
    older_first = jnp.where(victim, ~age, jnp.uint32(0))  # the oldest (largest age) sorts first
    if config.policy == "lfu":
        keys = (cls, jnp.where(victim, count, 0), older_first)
    else:
        keys = (cls, older_first)
    slot = jnp.broadcast_to(jnp.arange(config.bucket_size, dtype=jnp.int32), last.shape)
    n_avail = jnp.sum(cls < 2, axis=1, dtype=jnp.int32)
    r = jnp.minimum(rank, config.bucket_size - 1)
    if config.bucket_size <= _COMPARE_UP_TO:
        keys = (*keys, slot)
        before = _lex_less(tuple(k[:, None, :] for k in keys), tuple(k[:, :, None] for k in keys))
        place = jnp.sum(before, axis=2, dtype=jnp.int32)  # [N, S]: slots sorting before slot i
        pick = jnp.argmax(place == r[:, None], axis=1).astype(jnp.int32)
    else:
        *_, order = jax.lax.sort((*keys, slot), dimension=1, num_keys=len(keys) + 1)
        pick = jnp.take_along_axis(order, r[:, None], axis=1)[:, 0]
    return pick, n_avail, occupied


def step(
    config: DynamicTableConfig,
    state: DynamicState,
    ids: Any,
    step_index: Any,
    *,
    check: bool = True,
    shard: Shard | None = None,
) -> StepResult:
    """One training step's remap: count, admit, evict and touch (`reference` states it).

    Jit it with the config static and the state donated:
    `jax.jit(step, static_argnums=0, donate_argnums=1)`. Every field of the new state is
    written in place of the old; the work is proportional to the batch, not the table.

    Args:
      config: the table (static).
      state: its `DynamicState`.
      ids: the batch, any shape, in a form `keys.as_keys` takes (keys `uint32[*B, 2]` under
        `jit` with x64 off). The reserved id `EMPTY_ID` is counted in `stats.reserved` only.
      step_index: t, an integer scalar: the training step, counting up by one (or more) from
        call to call, read modulo 2**32 (`check_step_index`: an int32 counter may wrap).
        Several calls with one t (features sharing a table) never take each other's rows.
      check: raise for concrete ids equal to `EMPTY_ID` (True), or take them as padding.
      shard: the `Shard` `state` is (None: the whole table): the step decides its buckets
        alone, and leaves the sketch's halving to the caller.

    Returns:
      A `StepResult`: the new state, each id's row and `found` after the step, the stats, and
      the rows (re)assigned in this step (`reset_rows`, in the reference's order: bucket, then
      rank; padded with capacity) with the id each held before (`evicted_keys`).

    Raises:
      TypeError, ValueError: ids in no accepted form, a state that does not fit the config,
        a step_index that is not an integer scalar.
    """
    check_state(config, state)
    t = check_step_index(step_index)
    keys = as_keys(ids, check=check)  # check=False: the caller checked the ids
    batch = keys.shape[:-1]
    flat = keys.reshape(-1, 2)  # uint32[M, 2]
    m, cap, s, nb = flat.shape[0], config.capacity, config.bucket_size, config.num_buckets
    if m == 0:
        zero = jnp.zeros((), jnp.int32)
        empty = (jnp.zeros((0,), jnp.int32), jnp.zeros((0, 2), jnp.uint32))
        return StepResult(state, jnp.zeros(batch, jnp.int32), jnp.zeros(batch, bool),
                          StepStats(*([zero] * 6)), *empty)  # fmt: skip
    reserved = is_reserved(flat)
    bucket, _ = _buckets(config, flat, shard)  # nb: another shard's id

    # 1. distinct ids: u_* are [M], padded past the U distinct ones with bucket nb.
    u_bucket, u_keys, u_mult, slot_uid = _distinct(config, flat, jnp.where(reserved, nb, bucket))
    live = u_bucket < nb

    # 2. hits: touch last_seen and count (distinct ids hold distinct rows: no conflicts).
    hit_row, hit = _find(config, state, u_keys, u_bucket, live)
    count = state.count.at[hit_row].set(
        _saturating_add(state.count[jnp.minimum(hit_row, cap - 1)], u_mult), mode="drop"
    )
    last = state.last_seen.at[hit_row].set(t, mode="drop")
    touched = state._replace(last_seen=last, count=count)

    # 3. counting: misses are candidates once their estimate reaches admit_after.
    miss = live & ~hit
    sketch, total, est = _admission(config, state, u_keys, u_bucket, u_mult, miss)
    cand = miss & (est >= config.admit_after)

    # 4. sort 2: candidates by (bucket, estimate descending, id); the rest sort last.
    iota = jnp.arange(m, dtype=jnp.int32)
    cb, _, _, _, cu = jax.lax.sort(
        (jnp.where(cand, u_bucket, nb), jnp.where(cand, -est, 0), u_keys[:, 1], u_keys[:, 0],
         iota), num_keys=4)  # fmt: skip
    is_cand = cb < nb
    starts = jnp.concatenate([jnp.ones((1,), bool), cb[1:] != cb[:-1]])
    rank = iota - jax.lax.cummax(jnp.where(starts, iota, 0))  # int32[M] rank in its bucket
    bb = jnp.minimum(cb, nb - 1)
    held, held_last, held_count = _bucket_view(config, touched, bb)  # [M, S, ...]
    pick, n_avail, occupied = _pick(config, held, held_last, held_count, t, rank)
    assign = is_cand & (rank < n_avail)
    new_row = jnp.where(assign, bb * s + pick, cap)  # int32[M]
    evicted = assign & jnp.take_along_axis(occupied, pick[:, None], axis=1)[:, 0]
    old_key = jnp.take_along_axis(held, pick[:, None, None], axis=1)[:, 0]
    old_key = jnp.where(evicted[:, None], old_key, jnp.uint32(EMPTY_HALF))

    new_state = DynamicState(
        keys=state.keys.at[new_row].set(u_keys[cu], mode="drop"),
        last_seen=last.at[new_row].set(t, mode="drop"),
        count=count.at[new_row].set(est[cu], mode="drop"),
        sketch=sketch,
        sketch_total=total,
    )
    if config.uses_sketch and shard is None:  # 5. halving, once per sketch_window counts
        halved = jax.lax.cond(
            total[0] >= config.sketch_window,
            lambda sk, tot: (sk >> 1, tot >> 1),
            lambda sk, tot: (sk, tot),
            sketch,
            total,
        )
        new_state = new_state._replace(sketch=halved[0], sketch_total=halved[1])

    # Rows: each distinct id's (hit or new), then each slot's.
    admitted_row = jnp.full((m,), cap, jnp.int32).at[cu].set(new_row, unique_indices=True)
    u_row = jnp.where(hit, hit_row, admitted_row)
    rows = u_row[slot_uid]
    out_at = jnp.where(assign, running_sum(assign, dtype=jnp.int32) - 1, m)  # in sort-2 order
    reset_rows = jnp.full((m,), cap, jnp.int32).at[out_at].set(new_row, mode="drop")
    evicted_keys = jnp.full((m, 2), EMPTY_HALF, jnp.uint32).at[out_at].set(old_key, mode="drop")
    stats = StepStats(
        hits=jnp.sum(hit, dtype=jnp.int32),
        admitted=jnp.sum(assign, dtype=jnp.int32),
        evicted=jnp.sum(evicted, dtype=jnp.int32),
        refused=jnp.sum(is_cand & ~assign, dtype=jnp.int32),
        pending=jnp.sum(miss & ~cand, dtype=jnp.int32),
        reserved=jnp.sum(reserved, dtype=jnp.int32),  # every shard counts them all
    )
    return StepResult(
        new_state, rows.reshape(batch), (rows < cap).reshape(batch), stats, reset_rows,
        evicted_keys,
    )  # fmt: skip
