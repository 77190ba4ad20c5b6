"""The native quantized lookups (`jaxembed.kernels.quant_native`) against their XLA twins
(`jaxembed.kernels.quant`).

Every precision, at a dim that takes both the 16-value vector path and the one-value tail
(int8 also with float32 scale and bias): gathers and pooled sums with sum-, mean- and
sqrtn-like factors, weighted and not, maxima and their winners, on slots with invalid ids,
segments -1 and >= S, empty bags, bags in slot order and shuffled; on one device, on two
threads, and inside a `shard_map` over 8 devices with the table split by rows.

Every comparison with the XLA twin (compiled by jit) is bitwise: the kernels compute each value
as it does (`q · scale + bias` rounded once, as XLA:CPU fuses it, then `· factor`) and add a
bag's rows in slot order, the order of XLA's segment_sum, for the bags in place and the shuffled
ones alike. Only the shards' partial sums added by `psum` are compared with the whole table's
sums within float32 rounding (another order of additions).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxembed import ragged
from jaxembed.kernels import native, quant, quant_native
from jaxembed.quant import QuantizedTable, quantize

pytestmark = pytest.mark.skipif(
    not native.available(), reason=f"native kernels unavailable: {native.why_unavailable()}"
)

V, S, M = 40, 9, 120  # rows, bags, slots
CASES = [  # (precision, dim, quantize options): dims of 16-value vectors and a tail
    ("int8", 37, {}),
    ("int8", 16, {"scale_dtype": jnp.float32}),
    ("int4", 36, {}),
    ("int2", 20, {}),
    ("fp8", 19, {}),
]
IDS = [f"{p}-{d}" + ("-f32" if kw else "") for p, d, kw in CASES]


@functools.cache
def _table(case: int):
    precision, dim, options = CASES[case]
    rng = np.random.default_rng(case)
    x = rng.standard_normal((V, dim)).astype(np.float32) * np.linspace(0.05, 6, V)[:, None]
    return quantize(x, precision, **options)


def _slots(rng, *, shuffle=False):
    """Ids with some out of range (invalid), segments with -1 and S (no bag), bag 3 empty."""
    ids = rng.integers(-3, V + 3, M)
    valid = (ids >= 0) & (ids < V)
    ids[~valid & (rng.random(M) < 0.5)] = 7  # an invalid slot may name a real row
    segments = np.sort(rng.integers(-1, S + 1, M))
    segments[segments == 3] = 4
    if shuffle:
        segments = rng.permutation(segments)
    return ids, valid, segments


def _factors(rng, valid, segments, combiner, weighted):
    live = valid & (segments >= 0) & (segments < S)
    weights = jnp.asarray(rng.uniform(-2, 2, M).astype(np.float32)) if weighted else None
    return ragged.bag_scales(jnp.asarray(live), jnp.asarray(segments), weights, S, combiner)


@functools.cache
def _both():
    """One jitted function per table shape: the native and the XLA results side by side."""

    def run(table, ids, valid, segments, scale):
        out = []
        for impl in (quant_native, quant):
            out += [impl.gather_rows(table, ids.reshape(4, -1), valid.reshape(4, -1)),
                    impl.pool_sum(table, ids, valid, segments, scale, S),
                    *impl.pool_max(table, ids, valid, segments, S)]  # fmt: skip
        return out

    return jax.jit(run)


def _assert_bitwise(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), strict=True)


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_lookups_equal_the_xla_twin_bitwise(case):
    q = _table(case)
    rng = np.random.default_rng(10 + case)
    runs = [
        ("sum", False, False),
        ("mean", True, False),
        ("sqrtn", True, True),
        ("sum", False, True),
    ]
    for combiner, weighted, shuffle in runs:
        ids, valid, segments = _slots(rng, shuffle=shuffle)
        scale = _factors(rng, valid, segments, combiner, weighted)
        out = _both()(q, jnp.asarray(ids), jnp.asarray(valid), jnp.asarray(segments), scale)
        native_out, xla_out = out[:4], out[4:]
        for got, want in zip(native_out, xla_out, strict=True):
            _assert_bitwise(got, want)
        gathered, pooled, maxima, winners = map(np.asarray, native_out)
        assert gathered.shape == (4, M // 4, q.dim) and not gathered.reshape(M, -1)[~valid].any()
        assert not pooled[3].any()  # the empty bag
        assert np.all(maxima[3] == -np.inf) and np.all(winners[3] == M)


def test_no_slots_and_no_rows_give_empty_bags():
    q = _table(2)  # int4
    none = jnp.zeros((0,), jnp.int32)
    pooled = quant_native.pool_sum(q, none, none.astype(bool), none, none.astype(jnp.float32), S)
    maxima, winners = quant_native.pool_max(q, none, none.astype(bool), none, S)
    assert pooled.shape == (S, q.dim) and not np.asarray(pooled).any()
    assert np.all(np.asarray(maxima) == -np.inf) and np.all(np.asarray(winners) == 0)
    empty = jax.tree.map(lambda a: a[:0], q)  # a shard that holds no row
    ids = jnp.array([0, 2, 1])
    valid, segments, ones = jnp.array([True, False, True]), jnp.array([0, 0, 1]), jnp.ones(3)
    _assert_bitwise(quant_native.pool_sum(empty, ids, valid, segments, ones, S),
                    jnp.zeros((S, q.dim)))  # fmt: skip
    _assert_bitwise(quant_native.gather_rows(empty, ids, valid), jnp.zeros((3, q.dim)))


def test_two_threads_give_the_one_thread_results(monkeypatch):
    """Big enough for 2 threads (>= 2^18 slots each) and runs of bags handed out by a
    counter."""
    q = _table(0)  # int8, dim 37
    rng = np.random.default_rng(5)
    m, s = 300_000, 1_500
    ids = jnp.asarray(rng.integers(-2, V + 2, m))
    valid = (ids >= 0) & (ids < V)
    segments = jnp.asarray(np.sort(rng.integers(-1, s, m)))
    scale = jnp.asarray(rng.uniform(-2, 2, m).astype(np.float32))
    results = {}
    for threads in ("1", "2"):
        monkeypatch.setenv("JAXEMBED_NUM_THREADS", threads)  # read when traced
        results[threads] = [quant_native.pool_sum(q, ids, valid, segments, scale, s),
                            *quant_native.pool_max(q, ids, valid, segments, s)]  # fmt: skip
    xla = [jax.jit(quant.pool_sum, static_argnums=5)(q, ids, valid, segments, scale, s),
           *jax.jit(quant.pool_max, static_argnums=4)(q, ids, valid, segments, s)]  # fmt: skip
    for one, two, want in zip(results["1"], results["2"], xla, strict=True):
        _assert_bitwise(two, one)
        _assert_bitwise(one, want)


def test_a_shard_map_over_8_devices_pools_each_shards_rows():
    mesh = jax.make_mesh((8,), ("model",))
    q = _table(3)  # int2, dim 20: 5 rows a shard
    sharded = jax.device_put(q, q.shardings(mesh, P("model", None)))
    rng = np.random.default_rng(7)
    ids, valid, segments = _slots(rng)
    scale = _factors(rng, valid, segments, "mean", True)

    def body(shard, ids, valid, segments, scale):
        # shard: data u8[V/8, 5], scale / bias f16[V/8]   ids, valid, segments, scale: [M] whole
        rows = shard.rows
        local = ids - jax.lax.axis_index("model") * rows
        here = valid & (local >= 0) & (local < rows)
        parts = [impl.pool_sum(shard, local, here, segments, scale, S)[None]
                 for impl in (quant_native, quant)]  # f32[1, S, H] each  # fmt: skip
        maxima = [impl.pool_max(shard, local, here, segments, S)[0][None]
                  for impl in (quant_native, quant)]  # fmt: skip
        return *parts, *maxima, jax.lax.psum(parts[0][0], "model")

    specs = (q.specs(P("model", None)), P(), P(), P(), P())
    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs,
                                out_specs=(P("model"),) * 4 + (P(),)))  # fmt: skip
    args = (jnp.asarray(ids), jnp.asarray(valid), jnp.asarray(segments), scale)
    native_sum, xla_sum, native_max, xla_max, total = run(sharded, *args)
    _assert_bitwise(native_sum, xla_sum)  # each shard's partial sums, f32[8, S, H]
    _assert_bitwise(native_max, xla_max)
    assert native_sum.sharding.spec == P("model", None, None)
    whole = quant.pool_sum(q, jnp.asarray(ids), jnp.asarray(valid), jnp.asarray(segments), scale,
                           S)  # fmt: skip
    np.testing.assert_allclose(np.asarray(total), np.asarray(whole), rtol=1e-6, atol=1e-6)


def test_errors_name_the_value_and_the_fix():
    q = _table(2)
    ids, valid = jnp.array([0, 1]), jnp.array([True, True])
    with pytest.raises(TypeError, match=r"takes a QuantizedTable .*kernels\.native\.gather_rows"):
        quant_native.gather_rows(jnp.zeros((4, 8)), ids, valid)
    with pytest.raises(ValueError, match=r"valid has shape \(3,\) but local has \(2,\)"):
        quant_native.gather_rows(q, ids, jnp.array([True, True, False]))
    with pytest.raises(ValueError, match=r"scale has shape \(1,\) but local has \(2,\)"):
        quant_native.pool_sum(q, ids, valid, ids, jnp.ones(1), S)
    wrong = QuantizedTable(q.data, q.scale, q.bias.astype(jnp.int32), "int4")
    with pytest.raises(TypeError, match=r"int4 table's bias must be float16 .* got int32\[40\]"):
        quant_native.pool_max(wrong, ids, valid, ids, S)
    mixed = QuantizedTable(q.data, q.scale, q.bias.astype(jnp.float32), "int4")
    with pytest.raises(TypeError, match=r"scale \(float16\) and bias \(float32\) must have one"):
        quant_native.gather_rows(mixed, ids, valid)
    with pytest.raises(ValueError, match="unknown precision 'int3'"):
        quant_native.gather_rows(QuantizedTable(q.data, q.scale, q.bias, "int3"), ids, valid)
