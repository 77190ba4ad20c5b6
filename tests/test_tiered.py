"""Tiered tables (`jaxembed.tiered`) against the in-memory table and a float64 reference.

Every stream runs twice with the same batches and cotangents: through a `TieredTable` (rows in
a file-backed store, a small cache on the device, ids mapped to cache slots by `prepare`) and
through an ordinary in-memory table. Outputs, tables and optimizer state must be equal
bitwise: a cached row is the store's bits, and each row's update sees the same gradient summed
in the same (batch) order wherever the row sits. The float64 numpy model checks both against
the math (rowwise Adagrad) within float32 rounding.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxembed
from jaxembed.tiered import StoreSlot, TableStore, TieredTable, create_store, store_slots

H = 8


def _step(opt, combiner):
    """One training step on (table, opt_state), the same program for both tables."""

    def step(table, state, ids, g):
        if combiner is None:
            out = jaxembed.embedding(ids, table)
            table, state = opt.update(table, state, ids, g, after=out)
        else:
            out = jaxembed.embedding_bag(ids, table, combiner=combiner)
            table, state = opt.update(table, state, ids, g, combiner=combiner, after=out)
        return out, table, state

    return jax.jit(step, donate_argnums=(0, 1))


def _setup(tmp_path, rows, opt, cache_rows, rng, **kw):
    init = rng.normal(size=(rows, H)).astype(np.float32)
    store = create_store(tmp_path / "store", rows=rows, dim=H, optimizer=opt, table=init)
    tiered = TieredTable(store, cache_rows, optimizer=opt, **kw)
    ref = jnp.asarray(init)
    return init, store, tiered, ref, opt.init(ref)


def _run(tiered, ref, ref_state, batches, grads, step):
    """Both tables through the stream; every step's outputs equal bitwise. Returns the
    in-memory table, its state, the stats and the outputs."""
    all_stats, outs = [], []
    for ids, g in zip(batches, grads, strict=True):
        slots, stats = tiered.prepare(ids)
        out_t, tiered.table, tiered.opt_state = step(tiered.table, tiered.opt_state, slots, g)
        out_r, ref, ref_state = step(ref, ref_state, jnp.asarray(ids), g)
        np.testing.assert_array_equal(np.asarray(out_t), np.asarray(out_r))
        distinct = np.unique(ids[ids >= 0]).size
        assert stats.hits + stats.misses == distinct
        all_stats.append(stats)
        outs.append(np.asarray(out_t))
    return ref, ref_state, all_stats, outs


def _assert_store_equals(store, ref, ref_state):
    np.testing.assert_array_equal(np.asarray(store.table), np.asarray(ref))
    for name, arr in ref_state.slots.items():
        np.testing.assert_array_equal(np.asarray(store.slot_arrays[name]), np.asarray(arr))
    assert store.count == int(ref_state.count)


def _rowwise_adagrad_f64(table, batches, grads, combiner, lr, eps=1e-8):
    """Bags of ids (negative: empty slots) trained by rowwise Adagrad, in float64."""
    w = table.astype(np.float64)
    s = np.zeros(w.shape[0])
    outs = []
    for ids, g in zip(batches, grads, strict=True):
        g = np.asarray(g, np.float64)
        valid = ids >= 0
        n = np.maximum(valid.sum(1, keepdims=True), 1)
        scale = 1.0 / n if combiner == "mean" else np.ones_like(n, np.float64)
        rows = np.where(valid, ids, 0)
        outs.append((w[rows] * valid[..., None]).sum(1) * scale)
        grad = np.zeros_like(w)
        np.add.at(grad, rows[valid], np.broadcast_to((g * scale)[:, None], (*ids.shape, H))[valid])
        touched = np.unique(rows[valid])
        s[touched] += (grad[touched] ** 2).mean(1)
        w[touched] -= lr * grad[touched] / (np.sqrt(s[touched]) + eps)[:, None]
    return w, s, outs


def _bags(rng, steps, batch, length, rows, zipf=None):
    out = []
    for _ in range(steps):
        if zipf is None:
            ids = rng.integers(0, rows, (batch, length))
        else:
            ids = (rng.zipf(zipf, (batch, length)) - 1) % rows
        ids[rng.random((batch, length)) < 0.15] = -1  # empty slots
        out.append(ids)
    return out


# --- the store ---------------------------------------------------------------------------------


def test_store_roundtrip_and_refusals(tmp_path):
    slots = [StoreSlot("accumulator", (), 0.0), ("nu", (4,), 0.5)]
    s = TableStore.create(tmp_path / "s", rows=10, dim=4, slots=slots,
                          table=np.arange(40.0).reshape(10, 4))  # fmt: skip
    rows, st = s.read(np.array([7, 2, 7]))
    np.testing.assert_array_equal(rows, np.arange(40.0).reshape(10, 4)[[7, 2, 7]])
    assert st["nu"].shape == (3, 4) and (st["nu"] == 0.5).all()
    s.write(np.array([9, 0]), np.ones((2, 4)), {"accumulator": np.array([1.0, 2.0]),
                                                "nu": np.zeros((2, 4))})  # fmt: skip
    s.count = 3
    s.flush()
    again = TableStore.open(tmp_path / "s", rows=10, dim=4, dtype=np.float32,
                            slots=["nu", "accumulator"])  # fmt: skip
    assert again.count == 3 and again.slot_arrays["accumulator"][[0, 9]].tolist() == [2.0, 1.0]
    np.testing.assert_array_equal(again.table[9], np.ones(4))

    with pytest.raises(ValueError, match=r"holds float32\[10, 4\] .* but float32\[10, 8\]"):
        TableStore.open(tmp_path / "s", dim=8)
    with pytest.raises(ValueError, match=r"holds float32\[10, 4\] .* but bfloat16\[10, 4\]"):
        TableStore.open(tmp_path / "s", dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"holds float32\[12, 4\]|holds float32\[10, 4\].*12"):
        TableStore.open(tmp_path / "s", rows=12)
    with pytest.raises(ValueError, match=r"slots \['accumulator'\] was asked for"):
        TableStore.open(tmp_path / "s", slots=["accumulator"])
    with pytest.raises(ValueError, match="already exists"):
        TableStore.create(tmp_path / "s", rows=10, dim=4)
    with pytest.raises(FileNotFoundError, match="no store"):
        TableStore.open(tmp_path / "none")
    with pytest.raises(ValueError, match=r"id 10 is outside the store's rows \[0, 10\)"):
        s.read(np.array([3, 10]))


def test_store_bfloat16(tmp_path):
    table = np.asarray(jnp.arange(12.0, dtype=jnp.bfloat16).reshape(6, 2))
    TableStore.create(tmp_path / "b", rows=6, dim=2, dtype=jnp.bfloat16, table=table)
    s2 = TableStore.open(tmp_path / "b", dtype=jnp.bfloat16, rows=6, dim=2)
    assert s2.dtype == np.dtype(jnp.bfloat16)
    np.testing.assert_array_equal(s2.table.astype(np.float32), table.astype(np.float32))
    with pytest.raises(ValueError, match=r"bfloat16\[6, 2\].* but float32\[6, 2\]"):
        TableStore.open(tmp_path / "b", dtype=np.float32)


def test_table_refuses_store_of_another_optimizer(tmp_path):
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    store = create_store(tmp_path / "s", rows=64, dim=H, optimizer=jaxembed.optim.adam(0.1))
    with pytest.raises(ValueError, match=r"holds slots .*mu.* needs .*accumulator"):
        TieredTable(store, 32, optimizer=opt)
    with pytest.raises(ValueError, match="cache_rows=40 is not a multiple of bucket_size=32"):
        TieredTable(store, 40, optimizer=jaxembed.optim.adam(0.1))
    assert store_slots(opt, H) == (StoreSlot("accumulator", (), 0.0),)


# --- exactness ---------------------------------------------------------------------------------


def test_lookup_matches_in_memory(tmp_path):
    rng = np.random.default_rng(1)
    opt = jaxembed.optim.sgd(0.0)  # lookups only: sgd at lr 0 keeps the tables equal
    _, _, tiered, ref, _ = _setup(tmp_path, 640, opt, 32, rng, bucket_size=8)
    look = jax.jit(jaxembed.embedding)
    for _ in range(6):
        ids = rng.integers(0, 640, (3, 5))
        slots, _ = tiered.prepare(ids)
        assert slots.shape == ids.shape and slots.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(look(slots, tiered.table)),
                                      np.asarray(look(jnp.asarray(ids), ref)))  # fmt: skip
    assert tiered.step == 6
    for ids in (np.zeros((0,), np.int64), np.full((2, 3), -1)):  # nothing, padding alone
        slots, stats = tiered.prepare(ids)
        assert slots.shape == ids.shape and (np.asarray(slots) == -1).all()
        assert stats.hits == stats.misses == 0


def test_bfloat16_table(tmp_path):
    rng = np.random.default_rng(9)
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    init = np.asarray(jnp.asarray(rng.normal(size=(300, H)), jnp.bfloat16))
    store = create_store(tmp_path / "s", rows=300, dim=H, optimizer=opt, dtype=jnp.bfloat16,
                         table=init)  # fmt: skip
    tiered = TieredTable(store, 16, optimizer=opt, bucket_size=8)
    assert tiered.table.dtype == jnp.bfloat16
    ref = jnp.asarray(init)
    batches = [rng.integers(0, 300, (3, 4)) for _ in range(4)]
    grads = [jnp.asarray(rng.normal(size=(3, H)), jnp.bfloat16) for _ in batches]
    ref, ref_state, *_ = _run(tiered, ref, opt.init(ref), batches, grads, _step(opt, "sum"))
    tiered.flush()
    _assert_store_equals(store, ref, ref_state)


@pytest.mark.parametrize(
    ("combiner", "policy", "impl"), [("sum", "lru", "auto"), ("mean", "lfu", "xla")]
)
def test_bags_rowwise_adagrad_evicting(tmp_path, combiner, policy, impl):
    """A cache of 1% of the rows, every step a new set of ids: evictions and spills every
    step, and the result the in-memory table's, bitwise, and the float64 model's."""
    rng = np.random.default_rng(2)
    rows, lr = 3200, 0.1
    opt = jaxembed.optim.rowwise_adagrad(lr)
    init, store, tiered, ref, ref_state = _setup(tmp_path, rows, opt, 32, rng, bucket_size=4,
                                                 policy=policy, spill_rows=16, impl=impl)  # fmt: skip
    batches = _bags(rng, 10, 4, 5, rows)
    grads = [jnp.asarray(rng.normal(size=(4, H)).astype(np.float32)) for _ in batches]
    ref, ref_state, stats, got = _run(tiered, ref, ref_state, batches, grads, _step(opt, combiner))
    assert sum(s.evicted for s in stats) > 50 and sum(s.spilled for s in stats) > 0
    assert all(s.written_back == s.evicted + prev.spilled
               for prev, s in itertools.pairwise(stats))  # fmt: skip
    assert stats[1].bytes_read == stats[1].misses * (4 * H + 4)
    written = tiered.flush()
    assert written == np.count_nonzero(tiered.cached_ids() >= 0) + stats[-1].spilled
    _assert_store_equals(store, ref, ref_state)

    w, s, outs = _rowwise_adagrad_f64(init, batches, grads, combiner, lr)
    np.testing.assert_allclose(np.stack(got), np.stack(outs), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(store.table), w, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(store.slot_arrays["accumulator"]), s, rtol=2e-5)


def test_zipf_stream_hits(tmp_path):
    """Zipf ids: the hot rows stay cached (a third of a batch's distinct ids, most of its
    slots, hit a cache of 13% of the rows), still exact."""
    rng = np.random.default_rng(3)
    rows = 2000
    opt = jaxembed.optim.rowwise_adagrad(0.05)
    init, store, tiered, ref, ref_state = _setup(tmp_path, rows, opt, 256, rng)
    batches = _bags(rng, 12, 16, 8, rows, zipf=1.2)
    grads = [jnp.asarray(rng.normal(size=(16, H)).astype(np.float32)) for _ in batches]
    ref, ref_state, stats, got = _run(tiered, ref, ref_state, batches, grads, _step(opt, "sum"))
    late = stats[4:]
    assert sum(s.hits for s in late) > 0.3 * sum(s.hits + s.misses for s in late)
    tiered.flush()
    _assert_store_equals(store, ref, ref_state)
    w, _, outs = _rowwise_adagrad_f64(init, batches, grads, "sum", 0.05)
    np.testing.assert_allclose(np.stack(got), np.stack(outs), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(store.table), w, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize(
    "make",
    [
        functools.partial(jaxembed.optim.sgd, 0.1),
        functools.partial(jaxembed.optim.adagrad, 0.1),
        functools.partial(jaxembed.optim.fbgemm_adagrad, 0.1),
        functools.partial(jaxembed.optim.adam, 0.01),
        functools.partial(jaxembed.optim.partial_rowwise_adam, 0.01),
        functools.partial(jaxembed.optim.ftrl, 0.1, l1=0.01),
    ],
    ids=["sgd", "adagrad", "fbgemm_adagrad", "adam", "partial_rowwise_adam", "ftrl"],
)
def test_other_row_sparse_optimizers(tmp_path, make):
    """Every optimizer's state travels with its row: slots of [H] and [] per row, and the
    global count (lazy Adam's bias correction)."""
    rng = np.random.default_rng(4)
    opt = make()
    _, store, tiered, ref, ref_state = _setup(tmp_path, 512, opt, 16, rng, bucket_size=4)
    batches = [rng.integers(0, 512, (6,)) for _ in range(5)]
    grads = [jnp.asarray(rng.normal(size=(6, H)).astype(np.float32)) for _ in batches]
    ref, ref_state, *_ = _run(tiered, ref, ref_state, batches, grads, _step(opt, None))
    tiered.flush()
    _assert_store_equals(store, ref, ref_state)


def test_resume_from_flushed_store(tmp_path):
    """A flushed store reopened under a new cache goes on as the in-memory table does."""
    rng = np.random.default_rng(5)
    opt = jaxembed.optim.adam(0.01)
    _, store, tiered, ref, ref_state = _setup(tmp_path, 800, opt, 32, rng, bucket_size=8)
    step = _step(opt, "mean")
    batches = _bags(rng, 6, 4, 4, 800)
    grads = [jnp.asarray(rng.normal(size=(4, H)).astype(np.float32)) for _ in batches]
    ref, ref_state, *_ = _run(tiered, ref, ref_state, batches[:3], grads[:3], step)
    tiered.flush()
    again = TableStore.open(store.path, rows=800, dim=H, slots=["mu", "nu"])
    resumed = TieredTable(again, 64, optimizer=opt, bucket_size=16)
    assert int(resumed.opt_state.count) == 3
    ref, ref_state, *_ = _run(resumed, ref, ref_state, batches[3:], grads[3:], step)
    resumed.flush()
    _assert_store_equals(again, ref, ref_state)


# --- refusals ----------------------------------------------------------------------------------


def test_batch_larger_than_cache_refused(tmp_path):
    rng = np.random.default_rng(6)
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    _, _, tiered, _, _ = _setup(tmp_path, 400, opt, 16, rng, bucket_size=8)
    ids = np.arange(20).reshape(4, 5)
    with pytest.raises(ValueError, match=r"20 distinct ids, but .*cache_rows=16.* >= 20"):
        tiered.prepare(ids)
    assert tiered.step == 0 and (tiered.cached_ids() == -1).all()
    with pytest.raises(ValueError, match=r"id 400 is outside the store's rows \[0, 400\)"):
        tiered.prepare(np.array([1, 400]))
    with pytest.raises(ValueError, match=r"id 9223372036854775813 is outside"):
        tiered.prepare(np.array([1, 2**63 + 5], np.uint64))  # never read as padding
    with pytest.raises(TypeError, match="integer row ids"):
        tiered.prepare(np.array([1.0]))


def test_spill_overflow_refused_and_nothing_changed(tmp_path):
    """With no spill rows, a batch whose bucket overflows is refused before any change, and
    the table goes on exact after it."""
    rng = np.random.default_rng(7)
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    _, store, tiered, ref, ref_state = _setup(tmp_path, 400, opt, 16, rng, bucket_size=2,
                                              spill_rows=0)  # fmt: skip
    step = _step(opt, None)
    ids = np.arange(12)  # 12 ids in 8 buckets of 2: some bucket overflows
    with pytest.raises(ValueError, match=r"found their cache bucket full.* spill_rows=0"):
        tiered.prepare(ids)
    assert tiered.step == 0 and (tiered.cached_ids() == -1).all()
    batches = [np.array([3]), np.array([3, 200]), np.array([200, 5])]
    grads = [jnp.ones((b.size, H)) for b in batches]
    ref, ref_state, *_ = _run(tiered, ref, ref_state, batches, grads, step)
    tiered.flush()
    _assert_store_equals(store, ref, ref_state)


def test_donated_cache_not_set_back(tmp_path):
    rng = np.random.default_rng(8)
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    _, _, tiered, _, _ = _setup(tmp_path, 100, opt, 16, rng, bucket_size=8)
    slots, _ = tiered.prepare(np.array([1, 2]))
    _step(opt, None)(tiered.table, tiered.opt_state, slots, jnp.ones((2, H)))  # results dropped
    with pytest.raises(RuntimeError, match="donated to a step and not set back"):
        tiered.prepare(np.array([1]))


# --- dirty tracking ----------------------------------------------------------------------------


def test_only_trained_rows_written_back(tmp_path):
    """One bucket of 16 slots, LRU: rows a step only read leave without a write, rows a step
    trained are written once, and a flush leaves every row clean."""
    rng = np.random.default_rng(10)
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    _, store, tiered, ref, ref_state = _setup(tmp_path, 200, opt, 16, rng, bucket_size=16,
                                              spill_rows=0)  # fmt: skip
    step, look = _step(opt, None), jax.jit(jaxembed.embedding)

    def lookup(ids):
        slots, stats = tiered.prepare(ids, train=False)
        np.testing.assert_array_equal(np.asarray(look(slots, tiered.table)),
                                      np.asarray(look(jnp.asarray(ids), ref)))  # fmt: skip
        return stats

    def train(ids):
        nonlocal ref, ref_state
        g = jnp.asarray(rng.normal(size=(ids.size, H)).astype(np.float32))
        ref, ref_state, (stats,), _ = _run(tiered, ref, ref_state, [ids], [g], step)
        return stats

    s = lookup(np.arange(16))
    assert (s.misses, s.evicted, s.written_back, s.clean) == (16, 0, 0, 0)
    s = train(np.arange(16, 24))  # evicts 8 rows only read
    assert (s.evicted, s.written_back, s.clean, s.bytes_written) == (8, 0, 8, 0)
    s = lookup(np.arange(24, 40))  # evicts the 8 trained rows and the 8 others
    assert (s.evicted, s.written_back, s.clean) == (16, 8, 8)
    assert s.bytes_written == 8 * store.row_bytes
    s = train(np.arange(16, 24))
    assert (s.misses, s.written_back, s.clean) == (8, 0, 8)
    assert tiered.flush() == 8  # the trained rows alone
    assert tiered.flush() == 0  # clean after a flush
    _assert_store_equals(store, ref, ref_state)
    s = lookup(np.arange(40, 56))
    assert (s.evicted, s.written_back, s.clean) == (16, 0, 16)
    _assert_store_equals(store, ref, ref_state)


def test_dirty_tracking_exact_over_mixed_stream(tmp_path):
    """Training steps and lookups alone, alternating, over a cache that evicts every step:
    the store ends bitwise the in-memory table, with fewer rows written than evicted."""
    rng = np.random.default_rng(12)
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    _, store, tiered, ref, ref_state = _setup(tmp_path, 2000, opt, 32, rng, bucket_size=4,
                                              spill_rows=16)  # fmt: skip
    step, look = _step(opt, "sum"), jax.jit(jaxembed.embedding_bag)
    batches = _bags(rng, 12, 4, 5, 2000)
    left, written, spilled = 0, 0, 0
    for t, ids in enumerate(batches):
        if t % 2:
            slots, s = tiered.prepare(ids, train=False)
            np.testing.assert_array_equal(np.asarray(look(slots, tiered.table)),
                                          np.asarray(look(jnp.asarray(ids), ref)))  # fmt: skip
        else:
            g = jnp.asarray(rng.normal(size=(4, H)).astype(np.float32))
            ref, ref_state, (s,), _ = _run(tiered, ref, ref_state, [ids], [g], step)
        assert s.written_back + s.clean == s.evicted + spilled  # every row that left
        left, written, spilled = left + s.evicted, written + s.written_back, s.spilled
    assert 0 < written < left
    tiered.flush()
    _assert_store_equals(store, ref, ref_state)
