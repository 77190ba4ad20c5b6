"""Native CPU twins of the quantized lookups: XLA FFI custom calls that unpack, dequantize and
pool in one pass over the packed bytes.

XLA's twins (`jaxembed.kernels.quant`) gather each slot's bytes, scale and bias, unpack and
decode them into a float row `[M, H]`, then scatter-add the rows into their bags. These kernels
(`jaxembed/_native/quant_kernels.cc`) read each slot's packed row straight into the
accumulating registers (16 values at a time with AVX-512: int8 widened, int4's nibbles and
int2's pairs of bits shifted out, fp8's bits rebuilt), prefetch the rows 16 slots ahead and
split the bags over `num_threads()` threads; no float row exists but the results. Each function
here has the signature and the semantics of its XLA twin, so a `shard_map` body can call either;
the collectives stay in JAX.

    native                      XLA twin
    gather_rows                 quant.gather_rows
    pool_sum, pool_max          quant.pool_sum, quant.pool_max
    pool_bags                   quant.pool_bags (one device's whole sum / mean / sqrtn lookup)

`pool_bags` takes the bags as the caller holds them, dense ids `[*batch, L]` with negative ids
as empty slots, or flat ids `[*lead, N]` with `lengths [*lead, B]`, and weights if any: the
kernel finds each bag's slots, which ids read a row and each slot's factor itself, so the
compiled program is this one custom call on the caller's arrays (the twin builds the
canonical form, a valid mask, segment ids and factors, `[M]` each, in XLA first).

Results: bitwise the XLA twin's under `jit`. Each value is `q · scale + bias` in float32
rounded once (the f16 scale and bias widened exactly; fp8: its code's value), as XLA:CPU fuses
`jaxembed.quant.decode`, then times the slot's factor and added to its bag in slot order from
zero, the order of XLA's segment_sum. With float16 scale and bias `q · scale` is exact, so the
twin run op by op, unfused, agrees too; with int8's float32 scale and bias it may differ from
that in the last bit.

Availability and threads are `jaxembed.kernels.native`'s: the library (one for all the native
kernels) compiles on first use; without a compiler, or with `JAXEMBED_NATIVE=0`, `available()`
is False and calling these raises RuntimeError; each call runs on `native.num_threads()`
threads, read when the function is traced.

A shard is a `jaxembed.quant.QuantizedTable` of one device's blocks, as a `shard_map` body over
`table.specs(weight_spec)` sees it: `data u8[V/R, B/K]`, `scale`, `bias f16[V/R]` (int8 may
hold float32; None for fp8).

Examples:
  >>> import jax.numpy as jnp
  >>> from jaxembed.kernels import quant, quant_native
  >>> from jaxembed.quant import quantize
  >>> impl = quant_native if quant_native.available() else quant
  >>> q = quantize(jnp.array([[0.0, 15.0], [2.0, 32.0], [8.0, 8.0]]), "int4")
  >>> impl.gather_rows(q, jnp.array([1, 2, 0]), jnp.array([True, True, False])).tolist()
  [[2.0, 32.0], [8.0, 8.0], [0.0, 0.0]]
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxembed.ids import as_ids
from jaxembed.kernels import native
from jaxembed.kernels.quant import POOLED_COMBINERS
from jaxembed.quant import QuantizedTable
from jaxembed.quant.format import check_fp8_format, check_precision

__all__ = ["available", "gather_rows", "pool_bags", "pool_max", "pool_sum"]

available = native.available

_PARAM_DTYPES = ("float16", "float32")


def _table_operands(kernel: str, table: Any) -> tuple[list[Any], dict[str, Any]]:
    """The shard's arrays `[data, scale, bias]` (fp8: empty scale and bias) and the call's
    format attributes, after checking them."""
    if not isinstance(table, QuantizedTable):
        raise TypeError(
            f"quant_native.{kernel} takes a QuantizedTable shard (jaxembed.quant.quantize), got "
            f"{type(table).__name__}: for a float table use jaxembed.kernels.native.{kernel}"
        )
    precision = check_precision(table.precision)
    data = table.data
    if data.ndim != 2 or data.dtype != jnp.uint8:
        raise TypeError(
            f"quant_native.{kernel}: table.data must be uint8[rows, bytes a row], got "
            f"{data.dtype}{list(data.shape)}"
        )
    attrs = {"precision": precision, "exponent_bits": np.int64(0), "exponent_bias": np.int64(0)}
    if precision == "fp8":
        check_fp8_format(table.exponent_bits, table.exponent_bias)
        attrs["exponent_bits"] = np.int64(table.exponent_bits)
        attrs["exponent_bias"] = np.int64(table.exponent_bias)
        empty = jnp.zeros((0,), jnp.float32)
        return [data, empty, empty], attrs
    for name in ("scale", "bias"):
        a = getattr(table, name)
        if a is None or a.shape != data.shape[:1] or np.dtype(a.dtype).name not in _PARAM_DTYPES:
            got = "None" if a is None else f"{a.dtype}{list(a.shape)}"
            raise TypeError(
                f"quant_native.{kernel}: an {precision} table's {name} must be float16 (or "
                f"float32) [rows] = [{data.shape[0]}], got {got}"
            )
    if table.scale.dtype != table.bias.dtype:
        raise TypeError(
            f"quant_native.{kernel}: scale ({table.scale.dtype}) and bias ({table.bias.dtype}) "
            "must have one dtype: cast both, e.g. bias.astype(scale.dtype)"
        )
    return [data, table.scale, table.bias], attrs


def gather_rows(table: QuantizedTable, local: jax.Array, valid: jax.Array) -> jax.Array:
    """f32 `[*ids, H]`: row `local` of the quantized shard where `valid`, zero rows elsewhere.

    `jaxembed.kernels.quant.gather_rows` (same arguments, same results, bitwise): a valid
    slot's row is clipped into `[0, V_local)`, as the twin's `mode="clip"`.

    Args:
      table: a `QuantizedTable` shard, `data u8[V_local, B]`.
      local, valid: int `[*ids]` this shard's row of each id, bool `[*ids]` whether it reads one.

    Returns:
      f32 `[*ids, H]`, H = `table.dim` (the shard's columns).

    Raises:
      TypeError: `table` is not a `QuantizedTable` of uint8 data and float16 / float32 scale
        and bias. ValueError: `valid` does not have `local`'s shape. RuntimeError: the native
        kernels are unavailable.
    """
    threads = native._require("quant_gather_rows")
    operands, attrs = _table_operands("gather_rows", table)
    flat_local, flat_valid = native._slots("quant_native.gather_rows", local, valid)
    hidden = table.dim
    out = jax.ShapeDtypeStruct((flat_local.shape[0], hidden), jnp.float32)
    rows = native._call("jaxembed_quant_gather_rows", out, *operands, flat_local, flat_valid,
                        num_threads=threads, **attrs)  # fmt: skip
    return rows.reshape(*local.shape, hidden)


def pool_sum(
    table: QuantizedTable,
    local: jax.Array,
    valid: jax.Array,
    segments: jax.Array,
    scale: jax.Array,
    num_segments: int,
) -> jax.Array:
    """`out[s] = Σ_{i: segments[i] = s, valid[i]} scale[i] · row(local[i])`, float32.

    `jaxembed.kernels.quant.pool_sum` (same arguments, same results, bitwise): each bag is
    summed by one thread in slot order. Sum, mean and sqrtn bags are this with
    `jaxembed.ragged.bag_scales`' factors.

    Args:
      table: a `QuantizedTable` shard, `data u8[V_local, B]`.
      local, valid: int[M], bool[M] from `local_rows` (flattened).
      segments: int[M] in `[0, num_segments)`, or -1 for a slot that belongs to no bag (any
        segment outside `[0, num_segments)` is ignored).
      scale: f32[M] each slot's factor (weights and the combiner's normalization); not the
        rows' quantization scale, which `table` holds.
      num_segments: the number of bags.

    Returns:
      f32[num_segments, H].

    Raises:
      TypeError, ValueError, RuntimeError: as `gather_rows`, for every per-slot operand.
    """
    threads = native._require("quant_pool_sum")
    operands, attrs = _table_operands("pool_sum", table)
    args = native._slots("quant_native.pool_sum", local, valid, ("segments", segments),
                         ("scale", scale))  # fmt: skip
    args[2], args[3] = args[2].astype(jnp.int32), args[3].astype(jnp.float32)
    out = jax.ShapeDtypeStruct((int(num_segments), table.dim), jnp.float32)
    return native._call("jaxembed_quant_pool_sum", out, *operands, *args, num_threads=threads,
                        **attrs)  # fmt: skip


def pool_max(
    table: QuantizedTable,
    local: jax.Array,
    valid: jax.Array,
    segments: jax.Array,
    num_segments: int,
) -> tuple[jax.Array, jax.Array]:
    """Element-wise maximum of each bag's rows on this shard, and the slot that gave it.

    `jaxembed.kernels.quant.pool_max` (same arguments, same results, bitwise), one thread a
    bag.

    Args:
      table, local, valid, segments, num_segments: as `pool_sum`.

    Returns:
      `(maxima, winners)`: f32[num_segments, H] with `-inf` for a bag with no row here, and
      int32[num_segments, H], the earliest slot reaching the maximum (M where none).

    Raises:
      TypeError, ValueError, RuntimeError: as `pool_sum`.
    """
    threads = native._require("quant_pool_max")
    operands, attrs = _table_operands("pool_max", table)
    args = native._slots("quant_native.pool_max", local, valid, ("segments", segments))
    args[2] = args[2].astype(jnp.int32)
    shape = (int(num_segments), table.dim)
    out = (jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(shape, jnp.int32))
    maxima, winners = native._call("jaxembed_quant_pool_max", out, *operands, *args,
                                   num_threads=threads, **attrs)  # fmt: skip
    return maxima, winners


def pool_bags(
    table: QuantizedTable,
    ids: jax.Array,
    lengths: jax.Array | None = None,
    weights: jax.Array | None = None,
    *,
    combiner: str = "sum",
    vocab_size: int | None = None,
    padding_idx: int | None = None,
) -> jax.Array:
    """Sum, mean or sqrtn bags pooled from a quantized table, the bags read as given.

    `jaxembed.kernels.quant.pool_bags` (same arguments, same results, bitwise) in one custom
    call on the caller's arrays: the kernel walks each bag's slots in place (a row of dense
    ids; the next `lengths[..., b]` flat ids, cut at the capacity), skips the ids outside
    `[0, vocab_size)` and `padding_idx`, and scales each slot as `jaxembed.ragged.bag_scales`
    does (its weight; over Σ weight or √Σ weight² of its bag's slots for mean and sqrtn,
    summed in slot order), one thread a bag.

    Args:
      table: a `QuantizedTable` (or one device's shard of whole rows), `data u8[V, B]`.
      ids: int `[*batch, L]`, a bag a row (no `lengths`), or `[*lead, N]` with `lengths`.
      lengths: int `[*lead, B]`: bag b is the next `lengths[..., b]` ids; or None.
      weights: float, shaped like `ids`, or None.
      combiner: `"sum"`, `"mean"` or `"sqrtn"` (max: `pool_max`).
      vocab_size: the rows ids may read (default: the table's).
      padding_idx: an id in `[0, vocab_size)` that reads nothing and is not counted, or None.

    Returns:
      f32 `[*batch, H]` (dense ids) or `[*lead, B, H]`.

    Raises:
      TypeError: as `gather_rows`'s table; ids or lengths that are not integers, weights that
        are not floats. ValueError: another combiner, shapes that do not match, `vocab_size`
        or `padding_idx` out of range. RuntimeError: the native kernels are unavailable.

    Ids and lengths of any integer width are read as `jaxembed.ids.as_ids` narrows them
    (saturated, never wrapped), as the twin's `jaxembed.ragged.to_bag_batch` does.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxembed.kernels import quant, quant_native
      >>> from jaxembed.quant import quantize
      >>> impl = quant_native if quant_native.available() else quant
      >>> q = quantize(jnp.array([[0.0, 15.0], [2.0, 32.0], [8.0, 8.0]]), "int4")
      >>> impl.pool_bags(q, jnp.array([[1, 2, -1], [-1, -1, -1]])).tolist()
      [[10.0, 40.0], [0.0, 0.0]]
      >>> impl.pool_bags(q, jnp.array([0, 1, 2]), jnp.array([1, 2]), combiner="mean").tolist()
      [[0.0, 15.0], [5.0, 20.0]]
    """
    threads = native._require("quant_pool_bags")
    operands, attrs = _table_operands("pool_bags", table)
    if combiner not in POOLED_COMBINERS:
        raise ValueError(
            f"quant_native.pool_bags pools {', '.join(POOLED_COMBINERS)} bags, got "
            f"combiner={combiner!r}: max bags pool with pool_max"
        )
    vocab = table.rows if vocab_size is None else int(vocab_size)
    if not 0 <= vocab <= table.rows:
        raise ValueError(
            f"quant_native.pool_bags: vocab_size={vocab} is outside [0, {table.rows}] (the "
            "table's rows)"
        )
    if padding_idx is not None and not 0 <= int(padding_idx) < vocab:
        raise ValueError(
            f"quant_native.pool_bags: padding_idx={padding_idx} is outside [0, {vocab})"
        )
    ids, lengths, weights = _bag_operands(ids, lengths, weights)
    lead = ids.shape[:-1]
    flat = ids.reshape(math.prod(lead), ids.shape[-1])  # i32[G, N]: a bitcast
    if lengths is None:
        num_bags, bounds = 1, jnp.zeros((0,), jnp.int32)  # dense: none
        out_shape = (*lead, table.dim)
    else:
        num_bags = lengths.shape[-1]
        bounds = lengths.reshape(flat.shape[0], num_bags)
        out_shape = (*lead, num_bags, table.dim)
    w = jnp.zeros((0,), jnp.float32) if weights is None else weights.reshape(flat.shape)
    out = jax.ShapeDtypeStruct((flat.shape[0] * num_bags, table.dim), jnp.float32)
    pooled = native._call("jaxembed_quant_pool_bags", out, *operands, flat, bounds, w,
                          num_threads=threads, combiner=combiner, vocab_size=np.int64(vocab),
                          padding_idx=np.int64(-1 if padding_idx is None else padding_idx),
                          dense=np.int64(lengths is None), **attrs)  # fmt: skip
    return pooled.reshape(out_shape)


def _bag_operands(ids: Any, lengths: Any, weights: Any) -> tuple[Any, Any, Any]:
    """ids and lengths as int32 (`jaxembed.ids.as_ids`: never wrapped), weights as float32,
    checked to fit each other's shapes."""
    ids = as_ids(ids, check=False)
    if ids.ndim < 1:
        raise ValueError(f"quant_native.pool_bags: ids must be of rank >= 1, got {ids.shape}")
    if lengths is not None:
        lengths = as_ids(lengths, "lengths", check=False)
        if lengths.ndim != ids.ndim or lengths.shape[:-1] != ids.shape[:-1]:
            raise ValueError(
                f"quant_native.pool_bags: lengths {lengths.shape} must be [*lead, B] for ids "
                f"{ids.shape} = [*lead, N]"
            )
        lengths = lengths.astype(jnp.int32)
    if weights is not None:
        weights = jnp.asarray(weights)
        if not jnp.issubdtype(weights.dtype, jnp.floating):
            raise TypeError(f"quant_native.pool_bags: weights must be floats, got {weights.dtype}")
        if weights.shape != ids.shape:
            raise ValueError(
                f"quant_native.pool_bags: weights {weights.shape} must have the shape of ids "
                f"{ids.shape}: one weight per id"
            )
        weights = weights.astype(jnp.float32)
    return ids.astype(jnp.int32), lengths, weights
