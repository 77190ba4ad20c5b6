"""Lookups on quantized shards (`jaxembed.kernels.quant`) against float64 references computed
from the dequantized table: gather, pooled sums (sum / mean / sqrtn, weighted or not), max,
and a `shard_map` over a table split by rows and columns."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxembed import ragged
from jaxembed.kernels import quant as qops
from jaxembed.quant import dequantize, quantize

V, B, M = 24, 6, 40  # rows, bags, slots
CASES = [("int8", 12), ("int4", 16), ("int2", 16), ("fp8", 10)]


@functools.cache
def _table(precision, dim):
    rng = np.random.default_rng(CASES.index((precision, dim)))
    x = rng.standard_normal((V, dim)).astype(np.float32) * np.linspace(0.1, 4, V)[:, None]
    q = quantize(x, precision)
    return q, np.asarray(dequantize(q), np.float64)


def _slots(rng):
    ids = rng.integers(-2, V + 2, M)  # some out of range: they read nothing
    segments = np.sort(rng.integers(-1, B, M))  # -1: a slot in no bag
    segments[segments == 3] = 2  # bag 3 stays empty
    valid = (ids >= 0) & (ids < V)
    return ids, valid, segments


@pytest.mark.parametrize("precision, dim", CASES)
def test_gather_rows_reads_the_dequantized_rows(rng, precision, dim):
    q, table = _table(precision, dim)
    ids = rng.integers(-3, V + 3, (5, 7))
    valid = (ids >= 0) & (ids < V)
    out = jax.jit(qops.gather_rows)(q, jnp.asarray(ids), jnp.asarray(valid))
    assert out.shape == (5, 7, dim) and out.dtype == jnp.float32
    expected = np.where(valid[..., None], table[np.clip(ids, 0, V - 1)], 0.0)
    np.testing.assert_array_equal(np.asarray(out), expected)  # the same decode: bitwise


def _reference(table, ids, live, segments, weights, combiner):
    out = np.zeros((B, table.shape[1]))
    w = np.ones(M) if weights is None else weights.astype(np.float64)
    for b in range(B):
        k = live & (segments == b)
        pooled = (w[k, None] * table[ids[k]]).sum(0)
        norm = {"sum": 1.0, "mean": w[k].sum(), "sqrtn": np.sqrt((w[k] ** 2).sum())}[combiner]
        out[b] = pooled / norm if norm else 0.0
    return out


@pytest.mark.parametrize("precision, dim", CASES)
def test_pooled_sums_match_float64_bags(rng, precision, dim):
    q, table = _table(precision, dim)
    ids, valid, segments = _slots(rng)
    live = valid & (segments >= 0)
    pool = jax.jit(qops.pool_sum, static_argnums=5)
    weights = rng.uniform(0.1, 2.0, M).astype(np.float32)
    for combiner in ("sum", "mean", "sqrtn"):
        for w in (None, weights):
            scale = ragged.bag_scales(jnp.asarray(live), jnp.asarray(segments),
                                      None if w is None else jnp.asarray(w), B, combiner)  # fmt: skip
            out = pool(q, jnp.asarray(ids), jnp.asarray(valid), jnp.asarray(segments), scale, B)
            expected = _reference(table, ids, live, segments, w, combiner)
            np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-6, atol=2e-5)
            assert not np.asarray(out)[3].any()  # the empty bag


@pytest.mark.parametrize("precision, dim", CASES)
def test_pool_max_and_its_winners(rng, precision, dim):
    q, table = _table(precision, dim)
    ids, valid, segments = _slots(rng)
    ids[5] = ids[4]  # a repeated row: ties go to the earlier slot
    live = valid & (segments >= 0)
    maxima, winners = jax.jit(qops.pool_max, static_argnums=4)(
        q, jnp.asarray(ids), jnp.asarray(valid), jnp.asarray(segments), B
    )
    for b in range(B):
        slots = np.flatnonzero(live & (segments == b))
        if not len(slots):
            assert np.all(np.asarray(maxima)[b] == -np.inf) and np.all(np.asarray(winners)[b] == M)
            continue
        rows = table[ids[slots]]  # [slots, H]
        np.testing.assert_array_equal(np.asarray(maxima)[b], rows.max(0))
        np.testing.assert_array_equal(np.asarray(winners)[b], slots[rows.argmax(0)])


def test_a_shard_map_over_rows_and_columns_pools_the_whole_table(rng):
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    q, table = _table("int4", 16)  # 8 bytes a row: 4 on each "data" shard
    q = jax.device_put(q, q.shardings(mesh, P("model", "data")))
    ids, valid, segments = _slots(rng)
    live = valid & (segments >= 0)
    scale = ragged.bag_scales(jnp.asarray(live), jnp.asarray(segments), None, B, "mean")

    def body(shard, ids, segments, scale):
        # shard: data u8[V/4, 4], scale / bias f16[V/4]   ids, segments, scale: [M] whole
        rows = shard.rows
        local = ids - jax.lax.axis_index("model") * rows
        here = (ids >= 0) & (local >= 0) & (local < rows)
        pooled = qops.pool_sum(shard, local, here, segments, scale, B)  # f32[B, H/2]
        return jax.lax.psum(pooled, "model")

    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(q.specs(P("model", "data")), P(), P(), P()),
                                out_specs=P(None, "data")))  # fmt: skip
    out = run(q, jnp.asarray(ids), jnp.asarray(segments), scale)
    assert out.shape == (B, 16)
    expected = _reference(table, ids, live, segments, None, "mean")
    np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-6, atol=2e-5)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "data")), 2)
    # the input's layout is untouched
    assert NamedSharding(mesh, P("model", "data")).is_equivalent_to(q.data.sharding, 2)
