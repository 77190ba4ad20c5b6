"""The one-device pooled lookup on a quantized table in one call (`pool_bags`): the native kernel
(`jaxembed.kernels.quant_native`) against its XLA twin (`jaxembed.kernels.quant`), bitwise, and
both against float64 bags of the dequantized rows (`tests/bag_reference.py`); and the public path,
`jax.jit(embedding_bag)` on a `QuantizedTable`, compiled to that one custom call on the caller's
arrays, with the twin's results.

Every precision, at dims of whole 16-value vectors and a tail; dense ids `[*batch, L]` with -1
padding, ids past the vocabulary and empty bags, and flat ids with lengths (zero, negative, past
the capacity) under a lead axis; sum, mean and sqrtn, weighted (exact 1s and a bag of zero
weights included) and not; `padding_idx` and a `vocab_size` below the table's rows.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bag_reference import embedding_bag_reference

import jaxembed
from jaxembed.kernels import native, quant, quant_native
from jaxembed.quant import dequantize, quantize

pytestmark = pytest.mark.skipif(
    not native.available(), reason=f"native kernels unavailable: {native.why_unavailable()}"
)

V = 40  # rows
CASES = [  # (precision, dim, quantize options)
    ("int8", 37, {}),
    ("int8", 16, {"scale_dtype": jnp.float32}),
    ("int4", 36, {}),
    ("int2", 20, {}),
    ("fp8", 19, {}),
]
IDS = [f"{p}-{d}" + ("-f32" if kw else "") for p, d, kw in CASES]
RUNS = [(c, w) for c in ("sum", "mean", "sqrtn") for w in (False, True)]


@functools.cache
def _table(case: int):
    precision, dim, options = CASES[case]
    rng = np.random.default_rng(case)
    x = rng.standard_normal((V, dim)).astype(np.float32) * np.linspace(0.05, 6, V)[:, None]
    q = quantize(x, precision, **options)
    return q, np.asarray(dequantize(q), np.float64)


def _bags(rng, form: str):
    """`(ids, lengths, weights)`: dense `[3, 4, 6]` with -1 padding (bag [0, 1] empty), or flat
    `[2, 30]` with lengths `[2, 7]` (a zero, a negative, a total past the capacity)."""
    if form == "dense":
        ids = rng.integers(-3, V + 3, (3, 4, 6))
        ids[rng.random(ids.shape) < 0.3] = -1
        ids[0, 1] = -1
        lengths = None
    else:
        ids = rng.integers(-2, V + 2, (2, 30))
        lengths = rng.integers(0, 8, (2, 7))
        lengths[0, 2], lengths[0, 5], lengths[1, 6] = 0, -1, 30
    weights = rng.uniform(0.1, 2.0, ids.shape).astype(np.float32)
    weights[rng.random(ids.shape) < 0.2] = 1.0  # exactly 1: the kernel skips the multiply
    weights[-1, :] = 0.0  # the last block's bags sum to zero weight: mean and sqrtn give 0
    return ids, lengths, weights


@functools.cache
def _both(form: str, padding_idx, vocab_size):
    """Every (combiner, weighted) run, native then XLA, in one compiled program."""

    def run(table, ids, lengths, weights):
        out = []
        for impl in (quant_native, quant):
            for combiner, weighted in RUNS:
                out.append(impl.pool_bags(table, ids, lengths, weights if weighted else None,
                                          combiner=combiner, vocab_size=vocab_size,
                                          padding_idx=padding_idx))  # fmt: skip
        return out

    return jax.jit(run)


def _assert_bitwise(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), strict=True)


@pytest.mark.parametrize("form", ["dense", "flat"])
@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_pool_bags_equals_the_xla_twin_and_float64(case, form):
    q, rows = _table(case)
    rng = np.random.default_rng([case, form == "flat"])
    ids, lengths, weights = _bags(rng, form)
    # no padding id, or one and a vocabulary below the rows: each case and form sees both
    padding_idx, vocab_size = ((None, None), (7, V - 5))[(case + (form == "flat")) % 2]
    args = (jnp.asarray(ids), None if lengths is None else jnp.asarray(lengths),
            jnp.asarray(weights))  # fmt: skip
    out = _both(form, padding_idx, vocab_size)(q, *args)
    native_out, xla_out = out[: len(RUNS)], out[len(RUNS) :]
    for (combiner, weighted), got, twin in zip(RUNS, native_out, xla_out, strict=True):
        _assert_bitwise(got, twin)
        want = embedding_bag_reference(
            rows, ids, lengths=lengths, per_id_weights=weights if weighted else None,
            combiner=combiner, padding_idx=padding_idx, vocab_size=vocab_size,
        )  # fmt: skip
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5,
                                   atol=1e-5 * scale, err_msg=f"{combiner} {weighted}")  # fmt: skip
    if form == "dense":
        assert not np.asarray(native_out[0])[0, 1].any()  # the empty bag
    else:
        assert not np.asarray(native_out[0])[0, 2].any()  # lengths 0
        assert not np.asarray(native_out[0])[0, 5].any()  # lengths -1


@pytest.mark.parametrize("form", ["dense", "flat"])
def test_the_public_path_is_one_custom_call_with_the_twins_results(form):
    """`jax.jit(embedding_bag)` on a QuantizedTable, as a user writes it (the table closed over):
    no XLA op but the custom call on the caller's arrays (bitcasts and empty operands aside),
    and the XLA twin's results, bitwise; int16 ids (widened by one convert) and an eager call
    give the same."""
    q, _ = _table(2)  # int4, dim 36
    ids, lengths, weights = _bags(np.random.default_rng(3), form)
    if lengths is not None:
        lengths = np.minimum(np.maximum(lengths, 0), 30 // lengths.shape[1])  # eager checks
    x, n = jnp.asarray(ids), None if lengths is None else jnp.asarray(lengths)
    for combiner, weighted in RUNS:
        w = jnp.asarray(weights) if weighted else None

        def lookup(x, n, w, combiner=combiner):
            return jaxembed.embedding_bag(x, q, lengths=n, per_id_weights=w, combiner=combiner,
                                          check_ids=False)  # fmt: skip

        text = jax.jit(lookup).lower(x, n, w).compile().as_text()
        entry = text[text.index("ENTRY") :]
        ops = set(re.findall(r"= \S+ ([\w-]+)\(", entry))
        assert 'custom_call_target="jaxembed_quant_pool_bags"' in entry
        assert ops <= {"parameter", "constant", "bitcast", "custom-call"}, ops
        got = jax.jit(lookup)(x, n, w)
        _assert_bitwise(got, quant.pool_bags(q, x, n, w, combiner=combiner))
        _assert_bitwise(jax.jit(lookup)(x.astype(jnp.int16), n, w), got)  # widened in XLA
        _assert_bitwise(lookup(np.asarray(ids), lengths, w), got)


def test_two_threads_give_the_one_thread_results(monkeypatch):
    """Enough slots for 2 threads (2^18 each), bags handed out in runs by a counter."""
    q, _ = _table(0)  # int8, dim 37
    rng = np.random.default_rng(5)
    ids = jnp.asarray(rng.integers(-2, V + 2, (24_000, 12)))  # 288k slots
    weights = jnp.asarray(rng.uniform(0.1, 2.0, ids.shape).astype(np.float32))
    flat, lengths = ids.reshape(-1), jnp.asarray(rng.integers(0, 24, 24_000))  # ~276k ids
    results = {}
    for threads in ("1", "2"):
        monkeypatch.setenv("JAXEMBED_NUM_THREADS", threads)  # read when traced
        results[threads] = [
            quant_native.pool_bags(q, ids, None, weights, combiner="sqrtn"),
            quant_native.pool_bags(q, flat, lengths, None, combiner="mean"),
        ]
    twins = [quant.pool_bags(q, ids, None, weights, combiner="sqrtn"),
             quant.pool_bags(q, flat, lengths, None, combiner="mean")]  # fmt: skip
    for one, two, twin in zip(results["1"], results["2"], twins, strict=True):
        _assert_bitwise(two, one)
        _assert_bitwise(one, twin)


def test_no_slots_no_bags_and_no_rows_give_zeros():
    q, _ = _table(2)
    h = q.dim
    cases = [
        (jnp.zeros((3, 0), jnp.int32), None, (3, h)),  # dense bags of no slot
        (jnp.full((3, 4), -1), None, (3, h)),  # every slot empty
        (jnp.zeros((0,), jnp.int32), jnp.zeros((4,), jnp.int32), (4, h)),  # flat, N = 0
        (jnp.arange(5), jnp.zeros((0,), jnp.int32), (0, h)),  # no bag
    ]
    for ids, lengths, shape in cases:
        got = quant_native.pool_bags(q, ids, lengths, combiner="mean")
        _assert_bitwise(got, jnp.zeros(shape))
        _assert_bitwise(quant.pool_bags(q, ids, lengths, combiner="mean"), got)
    empty = jax.tree.map(lambda a: a[:0], q)  # a shard that holds no row
    got = quant_native.pool_bags(empty, jnp.array([[0, 2], [1, -1]]), vocab_size=0)
    _assert_bitwise(got, jnp.zeros((2, h)))


def test_errors_name_the_value_and_the_fix():
    q, _ = _table(2)
    ids = jnp.array([[0, 1], [2, -1]])
    with pytest.raises(ValueError, match=r"pools sum, mean, sqrtn bags, got combiner='max'"):
        quant_native.pool_bags(q, ids, combiner="max")
    with pytest.raises(ValueError, match=r"pools sum, mean, sqrtn bags, got combiner='max'"):
        quant.pool_bags(q, ids, combiner="max")
    with pytest.raises(ValueError, match=r"weights \(3,\) must have the shape of ids \(2, 2\)"):
        quant_native.pool_bags(q, ids, weights=jnp.ones(3))
    with pytest.raises(TypeError, match=r"weights must be floats, got int32"):
        quant_native.pool_bags(q, ids, weights=jnp.ones((2, 2), jnp.int32))
    with pytest.raises(ValueError, match=r"lengths \(3, 1\) must be \[\*lead, B\] for ids"):
        quant_native.pool_bags(q, ids, jnp.ones((3, 1), jnp.int32))
    with pytest.raises(ValueError, match=r"padding_idx=40 is outside \[0, 40\)"):
        quant_native.pool_bags(q, ids, padding_idx=40)
    with pytest.raises(ValueError, match=r"vocab_size=41 is outside \[0, 40\]"):
        quant_native.pool_bags(q, ids, vocab_size=41)
    with pytest.raises(TypeError, match=r"takes a QuantizedTable"):
        quant_native.pool_bags(jnp.zeros((4, 8)), ids)
