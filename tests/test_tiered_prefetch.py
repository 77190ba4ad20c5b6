"""Tiered tables with prefetch (`prepare(ids, next_ids=...)`, `pipeline`): still exact.

The next batch's remap runs before the current step and its misses are read from the store
while the step runs, on a worker thread that also writes the evicted rows back. Every stream
here runs against an in-memory table on the same batches and cotangents, and must stay equal
bitwise: step outputs, then the store's rows, optimizer state and step count after `flush`.
The streams are built so that the orderings that could go stale happen: a row evicted
(written back) by step t and read ahead for step t + 1, and a row step t served from a spill
row (trained there, written back only at t + 1) wanted again at t + 1.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_tiered import _bags

import jaxembed
from jaxembed.dynamic.keys import bucket_of, is_reserved, keys_to_host, to_uint64
from jaxembed.tiered import TableStore, TieredTable, create_store

H = 8


def _step(opt, combiner="sum"):
    def step(table, state, ids, g):
        out = jaxembed.embedding_bag(ids, table, combiner=combiner)
        table, state = opt.update(table, state, ids, g, combiner=combiner, after=out)
        return out, table, state

    return jax.jit(step, donate_argnums=(0, 1))


def _setup(tmp_path, rows, opt, cache_rows, seed, **kw):
    init = np.random.default_rng(seed).normal(size=(rows, H)).astype(np.float32)
    store = create_store(tmp_path / "store", rows=rows, dim=H, optimizer=opt, table=init)
    ref = jnp.asarray(init)
    return store, TieredTable(store, cache_rows, optimizer=opt, **kw), ref, opt.init(ref)


def _assert_store_equals(store, ref, ref_state):
    np.testing.assert_array_equal(np.asarray(store.table), np.asarray(ref))
    for name, arr in ref_state.slots.items():
        np.testing.assert_array_equal(np.asarray(store.slot_arrays[name]), np.asarray(arr))
    assert store.count == int(ref_state.count)


def _device_cached_ids(tiered):
    keys = np.asarray(tiered.state.keys)
    return np.where(is_reserved(keys), -1, to_uint64(keys).astype(np.int64))


def _pipeline_run(tiered, ref, ref_state, batches, grads, step):
    """Both tables through the stream, the tiered one by `pipeline`; every output bitwise.

    Returns the in-memory table and state, the stats, and per step the ids cached after it
    and the ids it spilled."""
    stats, cached, spilled = [], [], []
    it = tiered.pipeline(zip(batches, grads, strict=True), ids=lambda b: b[0])
    for (ids, g), slots, s in it:
        out_t, tiered.table, tiered.opt_state = step(tiered.table, tiered.opt_state, slots, g)
        out_r, ref, ref_state = step(ref, ref_state, jnp.asarray(ids), g)
        np.testing.assert_array_equal(np.asarray(out_t), np.asarray(out_r))
        assert s.hits + s.misses == np.unique(ids[ids >= 0]).size
        stats.append(s)
        cached.append(set(tiered.cached_ids()[tiered.cached_ids() >= 0].tolist()))
        spilled.append(set(tiered._spilled[0].tolist()))
    return ref, ref_state, stats, cached, spilled


def _hazards(batches, cached, spilled):
    """How often a row left the cache at step t (evicted, written back) or was spilled at
    t, and was a miss of step t + 1: the reads a prefetch must not take stale."""
    evicted_then_missed = spilled_then_missed = 0
    for t in range(1, len(batches) - 1):
        nxt = set(batches[t + 1][batches[t + 1] >= 0].tolist())
        evicted_then_missed += len((cached[t - 1] - cached[t]) & nxt - cached[t])
        spilled_then_missed += len(spilled[t] & nxt)
    return evicted_then_missed, spilled_then_missed


@pytest.mark.parametrize(("policy", "impl"), [("lru", "auto"), ("lfu", "xla")])
def test_pipeline_evicting_stream_bitwise(tmp_path, policy, impl):
    """A cache of 1% of the rows, buckets of 4: every step evicts and spills, rows evicted
    at t come back at t + 1, spilled rows come back; bitwise the in-memory table."""
    rng = np.random.default_rng(20)
    rows = 3200
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    store, tiered, ref, ref_state = _setup(tmp_path, rows, opt, 32, 0, bucket_size=4,
                                           policy=policy, spill_rows=16, impl=impl)  # fmt: skip
    # Ids from two pools in turn (what one step evicts, the next wants again), from
    # anywhere, and the last batch's (what one step spills, the next wants again).
    pools = rng.choice(rows, (2, 30), replace=False)
    batches = []
    for t in range(14):
        b = rng.integers(0, rows, (4, 6))
        b[:, 2:4] = rng.choice(pools[t % 2], (4, 2))
        if t:
            b[:, :2] = batches[-1][:, 4:]
        batches.append(b)
    for b in batches:
        b[rng.random(b.shape) < 0.15] = -1
    grads = [jnp.asarray(rng.normal(size=(4, H)).astype(np.float32)) for _ in batches]
    ref, ref_state, stats, cached, spilled = _pipeline_run(tiered, ref, ref_state, batches,
                                                           grads, _step(opt))  # fmt: skip
    evicted_back, spilled_back = _hazards(batches, cached, spilled)
    assert evicted_back > 0 and spilled_back > 0, (evicted_back, spilled_back)
    assert sum(s.evicted for s in stats) > 50 and sum(s.spilled for s in stats) > 0
    assert stats[0].prefetched == 0  # the first batch is read when it comes
    assert all(s.prefetched > 0 for s in stats[1:])
    # Prefetched: every miss read from the store (the rest moved from last step's spills).
    assert all(s.bytes_read == s.prefetched * store.row_bytes for s in stats[1:])
    assert sum(s.misses - s.prefetched for s in stats[1:]) >= spilled_back > 0
    assert all(s.written_back + s.clean == s.evicted + prev.spilled
               for prev, s in itertools.pairwise(stats))  # fmt: skip
    tiered.flush()
    _assert_store_equals(store, ref, ref_state)


def test_pipeline_zipf_stream_hits(tmp_path):
    """Zipf ids over a cache of 13% of the rows: most hit, the misses prefetched; bitwise."""
    rng = np.random.default_rng(21)
    rows = 2000
    opt = jaxembed.optim.adam(0.01)
    store, tiered, ref, ref_state = _setup(tmp_path, rows, opt, 256, 1)
    batches = _bags(rng, 14, 16, 8, rows, zipf=1.2)
    grads = [jnp.asarray(rng.normal(size=(16, H)).astype(np.float32)) for _ in batches]
    ref, ref_state, stats, *_ = _pipeline_run(tiered, ref, ref_state, batches, grads,
                                              _step(opt, "mean"))  # fmt: skip
    late = stats[4:]
    assert sum(s.hits for s in late) > 0.3 * sum(s.hits + s.misses for s in late)
    assert all(s.prefetched == s.misses for s in stats[1:] if not s.spilled)
    tiered.flush()
    _assert_store_equals(store, ref, ref_state)


def test_prefetch_decides_as_prepare_does(tmp_path):
    """The same stream prepared one batch at a time and pipelined: the same cache at every
    step (the host's map equal to the device's), the same stats but `prefetched`."""
    rng = np.random.default_rng(22)
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    batches = _bags(rng, 10, 4, 5, 1600)
    grads = [jnp.asarray(rng.normal(size=(4, H)).astype(np.float32)) for _ in batches]
    step = _step(opt)
    runs = []
    for name in ("sync", "pipe"):
        (tmp_path / name).mkdir()
        store, tiered, *_ = _setup(tmp_path / name, 1600, opt, 32, 2, bucket_size=4,
                                   spill_rows=16)  # fmt: skip
        seen = []
        if name == "sync":
            pairs = ((b, tiered.prepare(b)) for b in batches)
        else:
            pairs = ((b, (s, st)) for b, s, st in tiered.pipeline(batches))
        for (_, (slots, s)), g in zip(pairs, grads, strict=True):
            _, tiered.table, tiered.opt_state = step(tiered.table, tiered.opt_state, slots, g)
            seen.append((tiered.cached_ids(), s._replace(prefetched=0, bytes_read=0)))
            if name == "sync":  # nothing planned ahead: the host's map is the device's
                np.testing.assert_array_equal(tiered.cached_ids(), _device_cached_ids(tiered))
        tiered.flush()
        runs.append((seen, np.asarray(store.table).copy()))
    for (a, sa), (b, sb) in zip(runs[0][0], runs[1][0], strict=True):
        np.testing.assert_array_equal(a, b)
        assert sa == sb
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


def test_spilled_count_known_before_the_remap(tmp_path):
    """The refusals `prepare` checks before the remap runs (max(0, n - S) of a bucket's n
    distinct ids) are the ones the remap makes."""
    rng = np.random.default_rng(23)
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    _, tiered, *_ = _setup(tmp_path, 4000, opt, 64, 3, bucket_size=4, spill_rows=64)
    cfg = tiered.config
    for _ in range(6):
        ids = rng.integers(0, 4000, (50,))
        distinct = np.unique(ids)
        n = np.bincount(bucket_of(keys_to_host(distinct), cfg.num_buckets, cfg.seed),
                        minlength=cfg.num_buckets)  # fmt: skip
        _, s = tiered.prepare(ids)
        assert s.spilled == np.maximum(n - cfg.bucket_size, 0).sum()


def test_next_ids_not_taken_then_flush_and_save(tmp_path):
    """A batch planned with next_ids but not prepared next is taken as a lookup (cached,
    not trained); a flush or a save with a batch planned leaves it planned; all exact."""
    rng = np.random.default_rng(24)
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    store, tiered, ref, ref_state = _setup(tmp_path, 800, opt, 32, 4, bucket_size=4,
                                           spill_rows=16)  # fmt: skip
    step = _step(opt)
    batches = _bags(rng, 8, 4, 5, 800)
    grads = [jnp.asarray(rng.normal(size=(4, H)).astype(np.float32)) for _ in batches]
    other = rng.integers(0, 800, (4, 5))
    plan = {0: batches[1], 1: other, 2: batches[3], 3: batches[4], 5: batches[6]}
    for t, (ids, g) in enumerate(zip(batches, grads, strict=True)):
        slots, s = tiered.prepare(ids, next_ids=plan.get(t))
        if t == 2:
            assert s.prefetched == 0  # `other` was planned: taken as a lookup first
        out_t, tiered.table, tiered.opt_state = step(tiered.table, tiered.opt_state, slots, g)
        out_r, ref, ref_state = step(ref, ref_state, jnp.asarray(ids), g)
        np.testing.assert_array_equal(np.asarray(out_t), np.asarray(out_r))
        if t == 3:  # batch 4 is planned: flush, save, go on
            tiered.save(str(tmp_path / "ckpt"))
            _assert_store_equals(store, ref, ref_state)
            _assert_store_equals(TableStore.open(str(tmp_path / "ckpt")), ref, ref_state)
    tiered.flush()
    _assert_store_equals(store, ref, ref_state)


def test_next_ids_refused_before_anything_changes(tmp_path):
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    _, tiered, *_ = _setup(tmp_path, 400, opt, 16, 5, bucket_size=8)
    tiered.prepare(np.array([1, 2]), next_ids=np.array([3]))
    before = (tiered.step, tiered.cached_ids())
    with pytest.raises(ValueError, match=r"next_ids: the batch has 20 distinct ids, .* >= 20"):
        tiered.prepare(np.array([3]), next_ids=np.arange(20))
    with pytest.raises(ValueError, match=r"next_ids: id 400 is outside the store's rows"):
        tiered.prepare(np.array([3]), next_ids=np.array([400]))
    with pytest.raises(TypeError, match="next_ids: ids must be integer row ids"):
        tiered.prepare(np.array([3]), next_ids=np.array([1.5]))
    assert tiered.step == before[0]
    np.testing.assert_array_equal(tiered.cached_ids(), before[1])
    _, s = tiered.prepare(np.array([3]))  # the planned batch, still planned
    assert (s.misses, s.prefetched) == (1, 1)


def test_write_back_error_is_raised(tmp_path, monkeypatch):
    """A store write that fails on the worker thread is raised by a later call."""
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    store, tiered, *_ = _setup(tmp_path, 400, opt, 8, 6, bucket_size=8)
    step = _step(opt)
    g = jnp.ones((1, H))
    slots, _ = tiered.prepare(np.arange(8)[None])
    _, tiered.table, tiered.opt_state = step(tiered.table, tiered.opt_state, slots, g)

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(store, "write", broken)
    slots, _ = tiered.prepare(np.arange(8, 16)[None])  # evicts the 8 trained rows
    _, tiered.table, tiered.opt_state = step(tiered.table, tiered.opt_state, slots, g)
    with pytest.raises(OSError, match="disk full"):
        tiered.flush()
