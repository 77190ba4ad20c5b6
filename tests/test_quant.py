"""`jaxembed.quant`: quantize / dequantize against FBGEMM's formulas, reimplemented here.

FBGEMM itself stays out of the test environment: the references below restate its C++ in
numpy float32, one operation at a time as the C++ rounds them (numpy, unlike XLA on CPU,
keeps subnormals and never turns `x / 15` into `x · (1/15)`):

* `nbit_rows`: `FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf` (src/QuantUtils.cc), rows
  `[packed | scale f16 | bias f16]`, optionally with a given min / max (its `rowwise_min_max`);
* `fused8_rows`: `FloatOrHalfToFused8BitRowwiseQuantizedSBFloat`, rows `[q | scale f32 |
  bias f32]`; `tbe_int8_rows`: fbgemm_gpu's `quantize_embs` for `SparseType.INT8`, its scale
  and bias turned to fp16 and put first;
* `hfp8_encode` / `hfp8_decode`: `float_to_hfp8` / `hfp8_to_float` (quantize_ops_utils.h),
  the bouncer additions included;
* `greedy_range`: PyTorch's `choose_qparams_optimized` with `calculate_quant_loss`;
* dequantization: `float(double(scale) · q + double(bias))`, and bf16 output as
  `cpu_float2bfloat16`.

Stored rows, scales and biases are compared bitwise.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxembed.quant import (
    PRECISIONS,
    QuantizedTable,
    dequantize,
    fp8_max,
    from_fbgemm_rows,
    quantize,
    to_fbgemm_rows,
)

F32 = np.float32


def _u8(a, dtype):
    return np.asarray([a], dtype).view(np.uint8)


# --- FBGEMM's formulas in numpy -----------------------------------------------------------------


def nbit_rows(x, bits, lo=None, hi=None):
    n, qmax = 8 // bits, 2**bits - 1
    rows = []
    for r, row in enumerate(np.asarray(x, F32)):
        mn = F32(row.min() if lo is None else lo[r])
        mx = F32(row.max() if hi is None else hi[r])
        bias16 = np.float16(mn)
        mn = F32(bias16)
        span = F32(mx - mn)
        scale = F32(1) if span == 0 else F32(span / F32(qmax))
        scale = F32(np.float16(scale))
        if scale == 0:
            scale = F32(1)
        inverse = F32(1) / scale
        if np.isinf(inverse):
            scale = inverse = F32(1)
        q = np.clip(np.rint((row - mn) * inverse), 0, qmax).astype(np.uint8)  # lrintf
        packed = np.zeros(len(row) // n, np.uint8)
        for c, v in enumerate(q):
            packed[c // n] |= np.uint8(v << ((c % n) * bits))
        rows.append(np.concatenate([packed, _u8(scale, np.float16), _u8(bias16, np.float16)]))
    return np.stack(rows)


def fused8_rows(x):
    rows = []
    for row in np.asarray(x, F32):
        mn, mx = F32(row.min()), F32(row.max())
        span = F32(mx - mn)
        inverse = F32(255) / F32(span + F32(1e-8))
        q = np.rint((row - mn) * inverse)
        assert q.min() >= 0 and q.max() <= 255
        scale = F32(span / F32(255))
        rows.append(np.concatenate([q.astype(np.uint8), _u8(scale, F32), _u8(mn, F32)]))
    return np.stack(rows)


def tbe_int8_rows(x):
    fused = fused8_rows(x)
    params = fused[:, -8:].copy().view(F32).astype(np.float16).view(np.uint8)
    return np.concatenate([params, fused[:, :-8]], axis=1)


def hfp8_encode(x, ebits, ebias):
    mbits = 7 - ebits
    max_pos = F32((1 << ((1 << ebits) - 2 - ebias)) * (2 - 2.0 ** (ebits - 7)))
    smallest_normal = np.uint32((127 - ebias + 1) << 23).view(F32)
    out = []
    for v in np.asarray(x, F32).ravel():
        bits = int(np.asarray(v).view(np.uint32))
        sign = bits & 0x80000000
        mag = np.fmin(np.uint32(bits & 0x7FFFFFFF).view(F32), max_pos)  # fminf
        if mag >= smallest_normal:
            bouncer = np.uint32((int(mag.view(np.uint32)) & 0xFF800000) + ((23 - mbits) << 23))
            bouncer = bouncer.view(F32)
            mag = F32(F32(bouncer + mag) - bouncer)
            shifted = (int(mag.view(np.uint32)) - ((127 - ebias) << 23)) << (8 - ebits)
            code = ((shifted & 0xFFFFFFFF) | sign) >> 24
        else:
            bouncer = np.uint32((127 + (23 + (1 - ebias - mbits))) << 23).view(F32)
            code = int(F32(bouncer + mag).view(np.uint32)) | (sign >> 24)
        out.append(code & 0xFF)
    return np.asarray(out, np.uint8).reshape(np.shape(x))


def hfp8_decode(codes, ebits, ebias):
    c = np.asarray(codes, np.uint32)
    sign = (c & 0x80) << 24
    value = ((c & 0x7F) << (24 - (8 - ebits))).view(F32)
    value = value * np.uint32((127 + (127 - ebias)) << 23).view(F32)
    return (value.view(np.uint32) | sign).view(F32)


def quant_loss(row, xmin, xmax, bits):
    xmin = F32(np.float16(xmin))
    span, qmax = F32(xmax - xmin), F32(2**bits - 1)
    scale = F32(1) if span == 0 else F32(np.float16(F32(span / qmax)))
    inverse = F32(1) if scale == 0 else F32(F32(1) / scale)
    q = np.clip(np.rint((row - xmin) * inverse), 0, qmax)
    err = row - (q * scale + xmin)
    return F32(np.sqrt(np.add.accumulate(err * err)[-1]))  # summed in column order


def greedy_range(x, bits, n_bins=200, ratio=0.16):
    lo, hi = [], []
    for row in np.asarray(x, F32):
        xmin, xmax = F32(row.min()), F32(row.max())
        step = F32((xmax - xmin) / F32(n_bins))
        thr = F32(F32(int(n_bins * (1.0 - float(F32(ratio))))) * step)
        cur_min, cur_max = xmin, xmax
        cur = best = quant_loss(row, xmin, xmax, bits)
        while F32(cur_min + thr) < cur_max:
            loss1 = quant_loss(row, F32(cur_min + step), cur_max, bits)
            loss2 = quant_loss(row, cur_min, F32(cur_max - step), bits)
            if cur < loss1 and cur < loss2 and cur < best:
                best, xmin, xmax = cur, cur_min, cur_max
            if loss1 < loss2:
                cur_min, cur = F32(cur_min + step), loss1
            else:
                cur_max, cur = F32(cur_max - step), loss2
        lo.append(xmin)
        hi.append(xmax)
    return np.asarray(lo, F32), np.asarray(hi, F32)


def dequantized(rows, precision, dim, scale_dtype=np.float16):
    """FBGEMM's dequantize of TBE rows ([scale, bias, data]; fp8: [data]) in float64."""
    if precision == "fp8":
        return hfp8_decode(rows[:, :dim], 4, 7)
    bits, w = PRECISIONS[precision], 2 * np.dtype(scale_dtype).itemsize
    params = rows[:, :w].copy().view(scale_dtype).astype(np.float64)
    data = rows[:, w:]
    codes = (data[:, :, None] >> (np.arange(8 // bits) * bits)) & (2**bits - 1)
    codes = codes.reshape(len(rows), dim).astype(np.float64)
    return (params[:, :1] * codes + params[:, 1:]).astype(F32)


def bf16_like_fbgemm(x):
    return ((np.asarray(x, F32).view(np.uint32) + 0x8000) >> 16).astype(np.uint16)


# --- tables ------------------------------------------------------------------------------------


def table(rng, dim, qmax, big=3e4, rows=16):
    """Random rows and the hard ones: constant, zeros, one-signed, large, ties, a range fp16
    cannot hold as a scale (it falls back to 1), an fp16-rounded min."""
    t = rng.standard_normal((rows, dim)).astype(F32) * np.logspace(-3, 3, rows, dtype=F32)[:, None]
    t[0] = 0.37
    t[1] = 0.0
    t[2] = -5.0 - np.abs(t[2])
    t[3] = 7.0 + np.abs(t[3])
    t[4] = rng.uniform(-big, big, dim)
    t[5, :2] = 0.0, qmax  # scale exactly 1: every other value a tie
    t[5, 2:] = np.arange(dim - 2) % qmax + 0.5
    t[6] = rng.standard_normal(dim) * 1e-9
    t[7] = 0.1 + rng.uniform(0, 1, dim)
    return t


@pytest.mark.parametrize(
    "precision, dim, scale_dtype",
    [("int8", 12, np.float16), ("int8", 12, np.float32), ("int4", 20, np.float16),
     ("int2", 24, np.float16)],
    ids=["int8", "int8-f32", "int4", "int2"],
)  # fmt: skip
def test_stored_rows_and_dequantize_are_fbgemms(rng, precision, dim, scale_dtype):
    bits = PRECISIONS[precision]
    x = table(rng, dim, 2**bits - 1, big=1e30 if scale_dtype == np.float32 else 3e4)
    q = quantize(x, precision, scale_dtype=scale_dtype)
    assert q.shape == (16, dim) and q.data.dtype == jnp.uint8 and q.scale.dtype == scale_dtype
    assert q.nbytes == 16 * (dim * bits // 8 + 2 * np.dtype(scale_dtype).itemsize)

    if precision != "int8":
        expected = nbit_rows(x, bits)
    else:
        expected = fused8_rows(x) if scale_dtype == np.float32 else tbe_int8_rows(x)
    last = precision != "int8" or scale_dtype == np.float32  # the op's own layout
    np.testing.assert_array_equal(np.asarray(to_fbgemm_rows(q, scale_bias_last=last)), expected)

    tbe = np.asarray(to_fbgemm_rows(q))  # TBE's row: [scale, bias, data]
    ref = dequantized(tbe, precision, dim, scale_dtype)
    got = np.asarray(dequantize(q))
    if scale_dtype == np.float16:
        np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
        np.testing.assert_array_equal(
            np.asarray(dequantize(q, jnp.bfloat16)).view(np.uint16), bf16_like_fbgemm(ref)
        )
        np.testing.assert_array_equal(
            np.asarray(dequantize(q, jnp.float16)), ref.astype(np.float16)
        )
    else:  # f32 rounds q·scale before adding the bias: within half an ulp of q·scale
        qs = np.abs(np.asarray(q.scale, np.float64))[:, None] * 255
        assert np.all(np.abs(got.astype(np.float64) - ref) <= np.spacing(F32(qs)))
        assert np.mean(got == ref) > 0.9  # mostly the same number
    # FBGEMM's rows back, from any alignment and either layout
    for last, align in ((False, 16), (True, 1)):
        rows = to_fbgemm_rows(q, scale_bias_last=last, row_alignment=align)
        assert rows.shape[1] % align == 0
        back = from_fbgemm_rows(rows, precision, dim, scale_bias_last=last, scale_dtype=scale_dtype)
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(q), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_constant_zero_and_tiny_rows(rng):
    x = table(rng, 8, 15)
    for precision in ("int8", "int4", "int2"):
        q = quantize(x[:2], precision)  # a constant row (0.37), and zeros
        # range 0: int4 / int2 take scale 1, int8 (the fused 8-bit op's range / 255) 0; int4's
        # 0.37 - fp16(0.37) < 0 gives a negative scale, as FBGEMM's does
        assert float(q.scale[1]) == float(precision != "int8") and float(q.bias[1]) == 0.0
        assert np.asarray(dequantize(q))[1].tolist() == [0.0] * 8
        np.testing.assert_allclose(np.asarray(dequantize(q))[0], 0.37, rtol=1e-3)
    q = quantize(x[6:7], "int4")  # a range of 1e-9: fp16 scale 0, so FBGEMM's 1
    assert float(q.scale[0]) == 1.0


def test_scales_round_as_ieee_division(rng):
    """XLA turns `x / 15` into `x · (1/15)`; rows where that changes the fp16 scale."""
    span = rng.uniform(0.01, 1000, 400_000).astype(F32)
    for precision, qmax in (("int4", 15), ("int2", 3)):
        differs = np.float16(span / F32(qmax)) != np.float16(span * (F32(1) / F32(qmax)))
        rows = np.zeros((4, 4), F32)
        rows[:, 1] = span[differs][:4]  # min 0, max span
        q = quantize(rows, precision)
        np.testing.assert_array_equal(np.asarray(q.scale), np.float16(rows[:, 1] / F32(qmax)))


@pytest.mark.parametrize("ebits, ebias", [(4, 7), (5, 15)])
def test_fp8_is_fbgemms_hfp8(rng, ebits, ebias):
    top = fp8_max(ebits, ebias)
    lsb = 2.0 ** (1 - ebias - (7 - ebits))
    special = [0.0, -0.0, lsb, 1.5 * lsb, 2.5 * lsb, 0.49 * lsb, 0.5 * lsb, 2.0 ** (1 - ebias),
               0.99 * 2.0 ** (1 - ebias), 1 + 2.0 ** -(8 - ebits), 1 + 3 * 2.0 ** -(8 - ebits),
               top, 0.999 * top, 1.01 * top, 1e30, np.inf, -np.inf, np.nan, 1e-40, -1e-40,
               -3.7, 1 / 3]  # fmt: skip
    values = np.concatenate([special, rng.standard_normal(90) * 10.0 ** rng.uniform(-4, 3, 90)])
    values = np.concatenate([values, -values]).astype(F32).reshape(4, -1)  # [4, 56]
    q = quantize(values, "fp8", fp8_exponent_bits=ebits, fp8_exponent_bias=ebias)
    assert q.scale is None and q.shape == values.shape and q.nbytes == values.size
    np.testing.assert_array_equal(np.asarray(q.data), hfp8_encode(values, ebits, ebias))
    np.testing.assert_array_equal(np.asarray(to_fbgemm_rows(q, row_alignment=4))[:, :56], q.data)
    # every code decodes as hfp8_to_float, subnormal codes and -0 included
    codes = np.arange(256, dtype=np.uint8).reshape(8, 32)
    every = QuantizedTable(jnp.asarray(codes), None, None, "fp8", ebits, ebias)
    ref = hfp8_decode(codes, ebits, ebias)
    np.testing.assert_array_equal(
        np.asarray(dequantize(every)).view(np.uint32), ref.view(np.uint32)
    )


@pytest.mark.parametrize("precision, dim", [("int4", 24), ("int2", 16)])
def test_greedy_search_is_the_references(rng, precision, dim):
    bits = PRECISIONS[precision]
    x = table(rng, dim, 2**bits - 1, rows=12)
    x[8:, :3] *= 6.0  # outliers: the search has something to cut
    q = quantize(x, precision, search="greedy")
    lo, hi = greedy_range(x, bits)
    assert (lo > x.min(1)).sum() + (hi < x.max(1)).sum() >= 4  # the search moved some rows
    expected = nbit_rows(x, bits, lo, hi)
    np.testing.assert_array_equal(np.asarray(to_fbgemm_rows(q, scale_bias_last=True)), expected)
    # ... and it never reads back worse than min / max (its loss counts in f32: a margin)
    err = lambda t: np.sqrt(((np.asarray(dequantize(t), np.float64) - x) ** 2).sum(1))
    assert np.all(err(q) <= err(quantize(x, precision)) * (1 + 1e-5) + 1e-30)


def test_inputs_host_jit_and_half_precision(rng):
    x = rng.standard_normal((8, 16))  # float64 on the host: rounded to float32 first
    q = quantize(x, "int4")
    jitted = jax.jit(lambda t: quantize(t, "int4"))(jnp.asarray(x, jnp.float32))
    assert isinstance(jitted, QuantizedTable) and jitted.precision == "int4"
    for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    half = jnp.asarray(x, jnp.bfloat16)  # exact in float32, quantized as float32
    expected = nbit_rows(np.asarray(half, F32), 4)
    np.testing.assert_array_equal(
        np.asarray(to_fbgemm_rows(quantize(half, "int4"), scale_bias_last=True)), expected
    )


def test_a_sharded_table_quantizes_in_its_layout_and_shards_like_one(rng):
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    x = jax.device_put(rng.standard_normal((16, 24)).astype(F32), NamedSharding(mesh, P("model")))
    q = quantize(x, "int2")  # 6 bytes a row
    for a in jax.tree.leaves(q):
        assert a.sharding.is_equivalent_to(NamedSharding(mesh, P("model")), a.ndim)
    placed = jax.device_put(q, q.shardings(mesh, P("model", "data")))
    assert placed.data.sharding.spec == P("model", "data")
    assert placed.bias.sharding.spec == P("model")
    assert {s.data.shape for s in placed.data.addressable_shards} == {(4, 3)}
    np.testing.assert_array_equal(np.asarray(dequantize(placed)), np.asarray(dequantize(q)))
    with pytest.raises(
        ValueError,
        match=r"an int2 table of shape \(16, 24\) holds 6 bytes a row, which 4 shards of mesh axes \('model',\) .* cannot split evenly: pick a dim",
    ):
        q.shardings(mesh, P(None, "model"))


# --- hostile input ------------------------------------------------------------------------------


def test_unknown_precision_lists_the_known_ones():
    with pytest.raises(
        ValueError, match=r"unknown precision 'int3': use one of 'int8', 'int4', 'int2', 'fp8'"
    ):
        quantize(np.zeros((2, 4), F32), "int3")
    with pytest.raises(ValueError, match=r"unknown precision 8"):
        quantize(np.zeros((2, 4), F32), 8)


@pytest.mark.parametrize(
    "precision, dim, match",
    [("int4", 7, r"int4 packs 2 values a byte, so it cannot pack rows of dim 7: pad the columns to 8 .*mode='edge'"),
     ("int2", 6, r"int2 packs 4 values a byte, so it cannot pack rows of dim 6: pad the columns to 8"),
     ("int8", 0, r"at least one value, got dim 0")],
)  # fmt: skip
def test_dims_a_precision_cannot_pack(precision, dim, match):
    with pytest.raises(ValueError, match=match):
        quantize(np.zeros((3, dim), F32), precision)


def test_tables_that_are_not_2d_float():
    with pytest.raises(
        ValueError, match=r"takes a table \[rows, dim\], got shape \(8,\): reshape it to \(-1, 8\)"
    ):
        quantize(np.zeros(8, F32), "int8")
    with pytest.raises(ValueError, match=r"got shape \(2, 3, 4\)"):
        quantize(jnp.zeros((2, 3, 4)), "fp8")
    with pytest.raises(
        TypeError,
        match=r"takes a float table, got int32 of shape \(4, 4\): cast it with table.astype\(jnp.float32\)",
    ):
        quantize(jnp.zeros((4, 4), jnp.int32), "int4")
    with pytest.raises(TypeError, match=r"got bool"):
        quantize(np.zeros((4, 4), bool), "int8")


def test_options_a_precision_does_not_take():
    x = np.zeros((2, 8), F32)
    with pytest.raises(
        ValueError, match=r"search='greedy' chooses the ranges of int4 and int2 rows; int8"
    ):
        quantize(x, "int8", search="greedy")
    with pytest.raises(
        ValueError, match=r"search must be one of \('minmax', 'greedy'\), got 'best'"
    ):
        quantize(x, "int4", search="best")
    with pytest.raises(
        ValueError,
        match=r"int4 keeps its rows' scale and bias as float16 .* got scale_dtype=float32",
    ):
        quantize(x, "int4", scale_dtype=jnp.float32)
    with pytest.raises(
        ValueError, match=r"fp8 takes 1 to 7 exponent bits .* got fp8_exponent_bits=8"
    ):
        quantize(x, "fp8", fp8_exponent_bits=8)
    with pytest.raises(
        ValueError, match=r"greedy_bins=0, greedy_ratio=0.16 \(FBGEMM's: 200, 0.16\)"
    ):
        quantize(x, "int4", search="greedy", greedy_bins=0)
    with pytest.raises(ValueError, match=r"fp8_exponent_bias=15: FBGEMM's TBE uses 4 and 7"):
        quantize(x, "fp8", fp8_exponent_bias=15)


def test_rows_fp16_cannot_scale_name_the_row():
    x = np.ones((3, 4), F32)
    x[1, 0] = -7e4  # its min, the bias, is past fp16
    with pytest.raises(
        ValueError,
        match=r"row 1 of the table \(min -70000.0, max 1.0\) gets an int4 scale .* scale_dtype=jnp.float32 with 'int8'",
    ):
        quantize(x, "int4")
    assert np.isfinite(np.asarray(quantize(x, "int8", scale_dtype=jnp.float32).scale)).all()
    x[1, 2] = np.nan
    with pytest.raises(
        ValueError,
        match=r"row 1 of the table holds nan \(column 2\): int8 rows need finite values .*jnp.nan_to_num",
    ):
        quantize(x, "int8", scale_dtype=jnp.float32)
    assert quantize(x, "fp8").data[1, 2] == 0x77  # fp8 saturates NaN, as FBGEMM's fminf


def test_bad_rows_and_dequantize_arguments():
    with pytest.raises(
        ValueError,
        match=r"int4 rows of dim 8 need uint8 \[V, >= 8\] \(4 bytes of values and 4 of scale and bias\), got uint8 \(2, 6\)",
    ):
        from_fbgemm_rows(np.zeros((2, 6), np.uint8), "int4", 8)
    with pytest.raises(TypeError, match=r"dequantize takes a QuantizedTable .* got ndarray"):
        dequantize(np.zeros((2, 4), F32))
    q = quantize(np.zeros((2, 4), F32), "int8")
    with pytest.raises(TypeError, match=r"float32, float16 or bfloat16, got dtype=int32"):
        dequantize(q, jnp.int32)
