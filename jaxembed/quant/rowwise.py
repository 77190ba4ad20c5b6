"""`quantize` and `dequantize`: FBGEMM's row-wise formulas in `jnp`, bitwise where f32 allows.

What each precision follows (FBGEMM's sources; their arithmetic is float32 unless said):

* **int4, int2** (`FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf`, src/QuantUtils.cc): per
  row, `bias = fp16(min)`; `range = max - f32(bias)`; `scale = fp16(range / (2^bits - 1))`
  (1 when the range is 0, or when that rounds to 0 in fp16); `q = clamp(lrintf((x - f32(bias))
  · (1 / scale)), 0, 2^bits - 1)`, `lrintf` rounding half to even. Scale and bias are stored
  as fp16 (round to nearest even).
* **int8** (IntNBit TBE's rows, `fbgemm_gpu.tbe.utils.quantize.quantize_embs`): the bytes of
  `FloatOrHalfToFused8BitRowwiseQuantizedSBFloat`, `q = lrintf((x - min) · (255 / (range +
  1e-8)))` with the float32 `min` and `range`, then its float32 `scale = range / 255` and
  `bias = min` converted to fp16 for the TBE row. With `scale_dtype=jnp.float32` they stay
  float32: the rows of `FloatToFused8BitRowwiseQuantized` itself.
* **fp8** (`float_to_hfp8`, include/fbgemm_gpu/quantize_ops_utils.h): the magnitude is
  clamped to `fp8_max` (NaN and inf included, as `fminf`); normal values keep `7 - bits`
  mantissa bits, rounded half to even; below the smallest normal `2^(1 - bias)` the code is the
  multiple of `2^(1 - bias - mantissa bits)`, rounded half to even; the sign is its own bit.
  Decoded as `hfp8_to_float`.
* **search="greedy"** (int4 and int2): the range search of Guan et al. 2019, "Post-Training
  4-bit Quantization on Embedding Tables", as PyTorch's `choose_qparams_optimized` and
  Caffe2's `param_search_greedy` run it (FBGEMM takes its result as the row's min and max):
  from `[min, max]`, step `(max - min) / greedy_bins` (200); while the range is wider than
  `int(greedy_bins · (1 - greedy_ratio))` steps (168), try
  the range one step narrower at either end, move to the one with the lower L2 error (the
  right end on a tie), and keep the best strict local minimum. A range's error quantizes and
  dequantizes the row with the int4/int2 formulas and sums the squared errors in column
  order, so the chosen range is bitwise the reference's too. The row is then quantized with
  the chosen range as its min and max (values outside clamp).

Dequantized values are `q · scale + bias`, computed in float32: FBGEMM computes them in double
and rounds once, which with fp16 scale and bias is the same number (`q · scale` is exact in
float32 and the sum spans fewer than 53 bits), so int4 / int2 / int8 / fp8 read back bitwise.
With int8's float32 scale, float32 rounds `q · scale` first: within half an ulp of it.

Where float32 arithmetic under XLA is not FBGEMM's, this module works around it:

* XLA rewrites `x / c` for a constant (or broadcast) `c` into `x · (1 / c)`, which rounds
  differently; the divisions by `2^bits - 1`, 255 and the bin count here divide by an array
  XLA cannot see through (`_divide`), so they round as FBGEMM's `range / 15` does.
* XLA on CPU flushes float32 subnormals to zero; FBGEMM keeps them. Stored bytes differ only
  for rows whose values or range are below 2^-126 (and int8's float32 scale of a row whose
  range is below 2^-118); fp8 encodes and decodes without subnormal intermediates.
* On GPU XLA may fuse a multiply and an add into one FMA: values read with fp16 scales are
  unchanged (the product is exact), int8's float32 ones and the greedy search's error sums
  can differ in the last bit. The bitwise claims are checked on XLA:CPU (tests/test_quant.py);
  on GPU and TPU they also rest on IEEE float32 division and fp16 conversion, not checked
  there yet. The lookups only unpack, multiply and add, so they read the same rows anywhere.

FBGEMM's fp16 scale and bias overflow for values past 65504 (a row's min) or ranges past
65504 · (2^bits - 1); `quantize` raises for such rows when the table is concrete (under `jit`
they read NaN, as FBGEMM's would). A row holding NaN or ±inf has no scale and bias: called
eagerly, `quantize` raises `RowError` (a ValueError) naming its row, column and value; under
`jit` the row gets NaN scale and bias, so it reads NaN in every column whatever the table's
layout (a min or max over column shards would drop a NaN). fp8 takes them: it saturates, as
FBGEMM's `fminf`. The check reduces the table to a flag and one row's values, so it runs on
any layout, Explicit or Auto, and brings only scalars to the host. A row that stalls the greedy
search (a step below its values' float spacing, which loops forever in the reference) stops
after `greedy_bins` steps.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxembed.quant.format import (
    FP8_EXPONENT_BIAS,
    FP8_EXPONENT_BITS,
    PRECISIONS,
    QuantizedTable,
    check_dim,
    check_fp8_format,
    check_precision,
    check_scale_dtype,
    fp8_max,
    pack,
    packed_bytes,
    unpack,
    values_per_byte,
)

__all__ = ["SEARCHES", "RowError", "decode", "dequantize", "quantize"]

SEARCHES = ("minmax", "greedy")


def _divide(x: jax.Array, d: float) -> jax.Array:
    """`x / d` rounded as IEEE division, not as XLA's `x · (1/d)` (see the module doc)."""
    return x / jax.lax.optimization_barrier(jnp.full(x.shape, d, x.dtype))


def _f16(x: jax.Array) -> jax.Array:
    """Through fp16 and back: round to nearest even, as `cpu_float2half_rn`."""
    return x.astype(jnp.float16).astype(jnp.float32)


# --- int4 / int2 -------------------------------------------------------------------------------


def _nbit_params(lo: jax.Array, hi: jax.Array, bits: int):
    """FBGEMM's scale, bias (float32 values of fp16) and 1/scale from a row's min and max."""
    bias = _f16(lo)
    span = hi - bias
    scale = _f16(jnp.where(span == 0, 1.0, _divide(span, 2**bits - 1)))
    scale = jnp.where(scale == 0, 1.0, scale)
    inverse = 1.0 / scale
    bad = jnp.isinf(inverse)
    return jnp.where(bad, 1.0, scale), bias, jnp.where(bad, 1.0, inverse)


def _nbit(x: jax.Array, lo: jax.Array, hi: jax.Array, bits: int):
    # x: f32[V, H]   lo, hi: f32[V]
    scale, bias, inverse = _nbit_params(lo, hi, bits)
    q = jnp.round((x - bias[:, None]) * inverse[:, None])  # half to even, as lrintf
    q = jnp.clip(q, 0, 2**bits - 1).astype(jnp.uint8)
    return pack(q, bits), scale.astype(jnp.float16), bias.astype(jnp.float16)


def _range_error(x: jax.Array, lo: jax.Array, hi: jax.Array, bits: int) -> jax.Array:
    """f32[V]: the L2 error of quantizing each row with range `[lo, hi]` (PyTorch's
    `calculate_quant_loss`), the squares summed in column order."""
    qmax = 2**bits - 1
    bias = _f16(lo)
    span = hi - bias
    scale = jnp.where(span == 0, 1.0, _f16(_divide(span, qmax)))
    inverse = jnp.where(scale == 0, 1.0, 1.0 / scale)
    q = jnp.clip(jnp.round((x - bias[:, None]) * inverse[:, None]), 0, qmax)
    err = x - (q * scale[:, None] + bias[:, None])
    total, _ = jax.lax.scan(lambda acc, e: (acc + e, None), jnp.zeros_like(lo), (err * err).T)
    return jnp.sqrt(total)


def _greedy_range(x: jax.Array, bits: int, n_bins: int, ratio: float):
    """Each row's `(lo, hi)` by the greedy search (see the module doc). x: f32[V, H]."""
    lo, hi = jnp.min(x, axis=1), jnp.max(x, axis=1)
    step = _divide(hi - lo, n_bins)
    thr = jnp.float32(int(n_bins * (1.0 - float(np.float32(ratio))))) * step
    loss = _range_error(x, lo, hi, bits)

    def cond(state):
        i, cur_lo, cur_hi, *_ = state
        return (i < n_bins) & jnp.any(cur_lo + thr < cur_hi)

    def body(state):
        i, cur_lo, cur_hi, cur_loss, best_lo, best_hi, best_loss = state
        live = cur_lo + thr < cur_hi
        loss1 = _range_error(x, cur_lo + step, cur_hi, bits)  # move the left end in
        loss2 = _range_error(x, cur_lo, cur_hi - step, bits)  # move the right end in
        better = live & (cur_loss < loss1) & (cur_loss < loss2) & (cur_loss < best_loss)
        best_lo, best_hi = jnp.where(better, cur_lo, best_lo), jnp.where(better, cur_hi, best_hi)
        best_loss = jnp.where(better, cur_loss, best_loss)
        left = live & (loss1 < loss2)
        right = live & ~(loss1 < loss2)
        cur_lo = jnp.where(left, cur_lo + step, cur_lo)
        cur_hi = jnp.where(right, cur_hi - step, cur_hi)
        cur_loss = jnp.where(left, loss1, jnp.where(right, loss2, cur_loss))
        return i + 1, cur_lo, cur_hi, cur_loss, best_lo, best_hi, best_loss

    state = (jnp.int32(0), lo, hi, loss, lo, hi, loss)
    _, _, _, _, best_lo, best_hi, _ = jax.lax.while_loop(cond, body, state)
    return best_lo, best_hi


# --- int8 --------------------------------------------------------------------------------------


def _int8(x: jax.Array, scale_dtype: Any):
    # x: f32[V, H]
    lo, hi = jnp.min(x, axis=1), jnp.max(x, axis=1)
    span = hi - lo
    scale = _divide(span, 255)
    inverse = 255.0 / (span + jnp.float32(1e-8))
    q = jnp.clip(jnp.round((x - lo[:, None]) * inverse[:, None]), 0, 255).astype(jnp.uint8)
    return q, scale.astype(scale_dtype), lo.astype(scale_dtype)


# --- fp8 (FBGEMM's hfp8) -----------------------------------------------------------------------


def _fp8_encode(x: jax.Array, ebits: int, ebias: int) -> jax.Array:
    """f32 -> uint8 hfp8 codes, `float_to_hfp8` by integer arithmetic on the bits."""
    mbits = 7 - ebits
    u32 = jnp.uint32
    bits = jax.lax.bitcast_convert_type(x, u32)
    sign = bits & u32(0x80000000)
    mag = jax.lax.bitcast_convert_type(bits & u32(0x7FFFFFFF), jnp.float32)
    top = jnp.float32(fp8_max(ebits, ebias))
    mag = jnp.where(jnp.isnan(mag), top, jnp.minimum(mag, top))  # fminf: NaN -> max
    # normal: keep mbits mantissa bits, half to even (FBGEMM adds and subtracts a bouncer)
    m = jax.lax.bitcast_convert_type(mag, u32)
    cut = 23 - mbits
    keep = (m + u32((1 << (cut - 1)) - 1) + ((m >> cut) & u32(1))) & ~u32((1 << cut) - 1)
    normal = ((keep - u32((127 - ebias) << 23)) << (8 - ebits)) >> 24
    # subnormal: the multiple of 2^(1 - bias - mbits), half to even
    tiny = jnp.round(mag * jnp.float32(2.0 ** (ebias + mbits - 1))).astype(u32)
    code = jnp.where(mag >= jnp.float32(2.0 ** (1 - ebias)), normal, tiny) | (sign >> 24)
    return code.astype(jnp.uint8)


def _fp8_decode(codes: jax.Array, ebits: int, ebias: int) -> jax.Array:
    """uint8 hfp8 codes -> f32, `hfp8_to_float`, without subnormal intermediates."""
    mbits = 7 - ebits
    u32 = jnp.uint32
    c = codes.astype(u32)
    exponent = (c >> mbits) & u32(2**ebits - 1)
    mantissa = c & u32(2**mbits - 1)
    normal = ((exponent + u32(127 - ebias)) << 23) | (mantissa << (23 - mbits))
    tiny = mantissa.astype(jnp.float32) * jnp.float32(2.0 ** (1 - ebias - mbits))
    mag = jnp.where(exponent == 0, jax.lax.bitcast_convert_type(tiny, u32), normal)
    return jax.lax.bitcast_convert_type(mag | ((c & u32(0x80)) << 24), jnp.float32)


# --- quantize / dequantize ---------------------------------------------------------------------


class RowError(ValueError):
    """`quantize`'s error for a row it cannot give a finite scale and bias: one holding NaN or
    ±inf, or values past what fp16 scale and bias hold.

    Attributes:
      row: the row's index in the table given (the collections name the table and its own
        row from it).
      detail: the message after "row r of the table": the value and the fix.
    """

    def __init__(self, row: int, detail: str) -> None:
        super().__init__(f"row {row} of the table {detail}")
        self.row = row
        self.detail = detail


def _nan_rows(x: jax.Array, q: QuantizedTable) -> QuantizedTable:
    """`q` with NaN scale and bias on the rows of `x` holding NaN or ±inf, so that they read NaN
    in every layout: a min or max over column shards drops a NaN (an all-reduce's `min` is
    not `jnp.min`'s), which would leave the row a finite scale and codes of nothing."""
    finite = jnp.all(jnp.isfinite(x), axis=1)  # [V]
    nan = jnp.asarray(jnp.nan, q.scale.dtype)
    scale, bias = jnp.where(finite, q.scale, nan), jnp.where(finite, q.bias, nan)
    return dataclasses.replace(q, scale=scale, bias=bias)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6, 7))
def _quantize(x, precision, search, scale_dtype, ebits, ebias, n_bins, ratio):
    x = x.astype(jnp.float32)  # f32[V, H], exact from f16 / bf16
    if precision == "fp8":
        return QuantizedTable(_fp8_encode(x, ebits, ebias), None, None, "fp8", ebits, ebias)
    if precision == "int8":
        return _nan_rows(x, QuantizedTable(*_int8(x, scale_dtype), "int8"))
    bits = PRECISIONS[precision]
    if search == "greedy":
        lo, hi = _greedy_range(x, bits, n_bins, ratio)
    else:
        lo, hi = jnp.min(x, axis=1), jnp.max(x, axis=1)
    return _nan_rows(x, QuantizedTable(*_nbit(x, lo, hi, bits), precision))


def quantize(
    table: Any,
    precision: str,
    *,
    search: str = "minmax",
    scale_dtype: Any = jnp.float16,
    fp8_exponent_bits: int = FP8_EXPONENT_BITS,
    fp8_exponent_bias: int = FP8_EXPONENT_BIAS,
    greedy_bins: int = 200,
    greedy_ratio: float = 0.16,
) -> QuantizedTable:
    """Quantizes each row of a float table with its own scale and bias, as FBGEMM does.

    The formulas, what they follow in FBGEMM and where XLA's float32 is not FBGEMM's are in
    this module's doc (`jaxembed.quant.rowwise`). Jittable; a sharded table quantizes in
    place (the work is row-wise; the result keeps the rows' layout).

    Args:
      table: float `[V, H]` (float32, float16 or bfloat16; numpy float64 is rounded to
        float32 first), a jax array, a tracer or host numpy.
      precision: `"int8"`, `"int4"`, `"int2"` or `"fp8"`.
      search: how a row's range is chosen: `"minmax"` (its min and max), or `"greedy"`
        (int4 and int2: the L2-error search of Guan et al. 2019, slower, more accurate).
      scale_dtype: int8's scale and bias: float16 (IntNBit TBE's rows) or float32
        (`FloatToFused8BitRowwiseQuantized`'s). The other precisions hold float16 / none.
      fp8_exponent_bits, fp8_exponent_bias: fp8's format (FBGEMM's TBE default: 4, 7).
      greedy_bins, greedy_ratio: the greedy search's steps and the share of the range it may
        cut (FBGEMM's 200 and 0.16).

    Returns:
      A `QuantizedTable`.

    Raises:
      TypeError: a table that is not floating point.
      ValueError: an unknown precision or search, a table that is not 2-D, a dim the
        precision cannot pack, a scale dtype, fp8 format or search option the precision does
        not take, a table whose columns are split (Explicit mesh axes) into shards the packed
        bytes do not divide; and, called eagerly, a `RowError` (a ValueError) for the first
        int8 / int4 / int2 row holding NaN or ±inf (its column and value named), or whose
        scale or bias fp16 cannot hold. Under `jit` the values are not known: such rows get
        NaN scale and bias (they read NaN), and fp8 saturates NaN and ±inf in both cases.

    Examples:
      >>> import jax.numpy as jnp
      >>> q = quantize(jnp.array([[-1.0, 0.0, 0.5, 2.0]]), "int2")
      >>> q.data.tolist(), q.scale.tolist(), q.bias.tolist()
      ([[228]], [1.0], [-1.0])
      >>> dequantize(q).tolist()
      [[-1.0, 0.0, 1.0, 2.0]]
    """
    precision = check_precision(precision)
    if search not in SEARCHES:
        raise ValueError(f"search must be one of {SEARCHES}, got {search!r}")
    if search == "greedy" and not (int(greedy_bins) >= 1 and 0 <= greedy_ratio < 1):
        raise ValueError(
            f"the greedy search takes greedy_bins >= 1 and 0 <= greedy_ratio < 1, got "
            f"greedy_bins={greedy_bins!r}, greedy_ratio={greedy_ratio!r} (FBGEMM's: 200, 0.16)"
        )
    if search == "greedy" and precision not in ("int4", "int2"):
        raise ValueError(
            f"search='greedy' chooses the ranges of int4 and int2 rows; {precision} rows take "
            "their min and max: drop search='greedy', or quantize to 'int4' or 'int2'"
        )
    if not isinstance(table, jax.Array | jax.core.Tracer):
        table = np.asarray(table)
        if table.dtype == np.float64:
            table = table.astype(np.float32)
    dtype, shape = np.dtype(table.dtype), tuple(table.shape)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"quantize takes a float table, got {dtype.name} of shape {shape}: cast it with "
            "table.astype(jnp.float32) if it holds the float values"
        )
    if len(shape) != 2:
        raise ValueError(
            f"quantize takes a table [rows, dim], got shape {shape}: reshape it to "
            f"(-1, {shape[-1] if shape else 1}) if each row is one embedding"
        )
    check_dim(shape[1], precision)
    _check_column_split(table, shape, precision)
    dtype16 = jnp.float16
    if precision in ("int8", "int4", "int2"):
        dtype16 = check_scale_dtype(scale_dtype, precision)
    if precision == "fp8":
        check_fp8_format(fp8_exponent_bits, fp8_exponent_bias)
        ebits, ebias = fp8_exponent_bits, fp8_exponent_bias
    else:
        ebits = ebias = None
    out = _quantize(table, precision, search, np.dtype(dtype16).name, ebits, ebias,
                    int(greedy_bins), float(greedy_ratio))  # fmt: skip
    if out.scale is not None and not isinstance(table, jax.core.Tracer):
        _check_params(table, out)
    return out


def _check_column_split(table: Any, shape: tuple[int, int], precision: str) -> None:
    """Raises where Explicit mesh axes split the columns into shards whose values do not pack
    into whole bytes of their own (packing reshapes each shard's columns)."""
    if not isinstance(table, jax.Array | jax.core.Tracer) or values_per_byte(precision) == 1:
        return
    sharding = getattr(jax.typeof(table), "sharding", None)
    spec = (*getattr(sharding, "spec", ()), None, None)
    if spec[1] is None:
        return
    names = (spec[1],) if isinstance(spec[1], str) else tuple(spec[1])
    n = math.prod(sharding.mesh.shape[a] for a in names)
    nbytes = packed_bytes(shape[1], precision)
    if nbytes % n:
        raise ValueError(
            f"an {precision} table of shape {shape} packs {nbytes} bytes a row, which the {n} "
            f"column shards of mesh axes {names} (mesh {dict(sharding.mesh.shape)}) cannot "
            f"split evenly: reshard its columns over fewer devices first (jax.sharding.reshard("
            f"table, NamedSharding(mesh, P({spec[0]!r}, None)))), use a dim that is a multiple "
            f"of {n * values_per_byte(precision)}, or 'int8' or 'fp8', which pack any split"
        )


def _iota(like: jax.Array, dim: int) -> jax.Array:
    """int32 indices along `dim`, shaped and laid out as `like` (Explicit meshes included)."""
    sharding = jax.typeof(like).sharding
    return jax.lax.broadcasted_iota(jnp.int32, like.shape, dim, out_sharding=sharding)


@jax.jit
def _first_refused_row(x: jax.Array, scale: jax.Array, bias: jax.Array):
    """Where the first row without a finite scale or bias is, and why, as scalars read by
    reductions and masks alone (no indexing of a sharded axis, so any layout, Explicit or
    Auto, works, and only scalars reach the host).

    Returns:
      `(found, row, holds_nonfinite, column, value, row_min, row_max, scale, bias)`: the
      row's first column holding NaN or ±inf and its value (when it holds one).
    """
    x = x.astype(jnp.float32)  # x: f32[V, H]   scale, bias: [V]
    nonfinite = ~jnp.isfinite(x)
    off = jnp.any(nonfinite, axis=1) | ~(jnp.isfinite(scale) & jnp.isfinite(bias))
    row = jnp.argmax(off)
    in_row = _iota(x, 0) == row  # [V, H]
    bad_columns = jnp.any(nonfinite & in_row, axis=0)  # [H]
    column = jnp.argmax(bad_columns)
    at = in_row & (_iota(x, 1) == column)

    def pick(a, mask):  # the one entry of `a` where mask holds
        return jnp.sum(jnp.where(mask, a.astype(jnp.float32), 0.0))

    at_row = _iota(scale, 0) == row
    return (
        jnp.any(off), row, jnp.any(bad_columns), column, pick(x, at),
        jnp.min(jnp.where(in_row, x, jnp.inf)), jnp.max(jnp.where(in_row, x, -jnp.inf)),
        pick(scale, at_row), pick(bias, at_row),
    )  # fmt: skip


def _check_params(table: Any, q: QuantizedTable) -> None:
    """Raises `RowError` for the first row whose scale or bias is not finite: a row holding NaN
    or ±inf, or values past what its scale and bias dtype holds."""
    found, row, nonfinite, column, value, lo, hi, scale, bias = jax.device_get(
        _first_refused_row(table, q.scale, q.bias)
    )
    if not found:
        return
    row, column = int(row), int(column)
    if nonfinite:
        raise RowError(
            row,
            f"holds {float(value)} (column {column}): {q.precision} rows need finite values for "
            "their scale and bias; replace them (jnp.nan_to_num), or use 'fp8', which saturates "
            "them as FBGEMM's does",
        )
    dtype = np.dtype(q.scale.dtype)
    if dtype == np.float16:
        fix = (
            "float16 scale and bias hold rows whose min is within +-65504 and whose range over "
            "2^bits - 1 is too (FBGEMM's format). Scale the table down first, or use "
            "scale_dtype=jnp.float32 with 'int8', or 'fp8' (which saturates)"
        )
    else:
        fix = (
            "its range overflows float32. Scale the table down first, or use 'fp8' (which "
            "saturates)"
        )
    raise RowError(
        row,
        f"(min {np.float32(lo)}, max {np.float32(hi)}) gets an {q.precision} scale "
        f"{np.float32(scale)} and bias {np.float32(bias)}: {fix}",
    )


def decode(table: QuantizedTable) -> jax.Array:
    """f32 `[..., H]`: the values of rows of any leading shape (`data [..., B]`, `scale` and
    `bias` `[...]`), unpacked by shifts and masks and read as `q · scale + bias`. The
    lookups of `jaxembed.kernels.quant` apply it to the rows they gather."""
    codes = unpack(table.data, table.bits)  # u8[..., H]
    if table.precision == "fp8":
        return _fp8_decode(codes, table.exponent_bits, table.exponent_bias)
    scale = table.scale.astype(jnp.float32)[..., None]
    bias = table.bias.astype(jnp.float32)[..., None]
    return codes.astype(jnp.float32) * scale + bias


def _to_bfloat16(x: jax.Array) -> jax.Array:
    """f32 -> bf16 as FBGEMM's `cpu_float2bfloat16`: add half an ulp, truncate (ties away from
    zero, where XLA's cast rounds them to even)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(((bits + 0x8000) >> 16).astype(jnp.uint16), jnp.bfloat16)


@functools.partial(jax.jit, static_argnums=(1,))
def _dequantize(table: QuantizedTable, dtype: str) -> jax.Array:
    values = decode(table)
    return _to_bfloat16(values) if dtype == "bfloat16" else values.astype(dtype)


def dequantize(table: QuantizedTable, dtype: Any = jnp.float32) -> jax.Array:
    """The float table a `QuantizedTable` reads as: `q · scale + bias` (fp8: its code's value).

    Bitwise FBGEMM's dequantize ops (`FusedNBitRowwiseQuantizedSBHalfToFloatOrHalf`,
    `Fused8BitRowwiseQuantizedSBFloatToFloatOrHalf`, `HFP8QuantizedToFloat`), float16 and
    bfloat16 outputs rounded as theirs, except int8 with float32 scale and bias (within half
    an ulp of `q · scale`; see the module doc).

    Args:
      table: a `QuantizedTable`.
      dtype: the result's dtype: float32, float16 or bfloat16.

    Returns:
      `dtype[V, H]`.

    Raises:
      TypeError: `table` is not a `QuantizedTable`, or `dtype` is not a float dtype above.

    Examples:
      >>> import jax.numpy as jnp
      >>> dequantize(quantize(jnp.array([[0.1, -3.0, 250.0, 7.0]]), "fp8")).tolist()
      [[0.1015625, -3.0, 240.0, 7.0]]
    """
    if not isinstance(table, QuantizedTable):
        raise TypeError(
            f"dequantize takes a QuantizedTable (from jaxembed.quant.quantize), got "
            f"{type(table).__name__}"
        )
    name = np.dtype(dtype).name
    if name not in ("float32", "float16", "bfloat16"):
        raise TypeError(f"dequantize reads float32, float16 or bfloat16, got dtype={name}")
    return _dequantize(table, name)
