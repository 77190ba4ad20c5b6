"""The quantized table as plain data: `QuantizedTable`, its precisions, packing and FBGEMM rows.

A quantized table holds, for each of its V rows, the row's values as small integers (or fp8
codes) and, for the integer formats, the row's own scale and bias, which read it back as
`q · scale + bias`. The formats are those of FBGEMM's IntNBit table-batched embeddings
(`fbgemm_gpu.split_embedding_configs.SparseType`):

| precision | a value | values a byte | scale, bias a row | TBE row (`to_fbgemm_rows`) |
|---|---|---|---|---|
| `int8` | uint8 | 1 | float16 (or float32) | `[scale f16, bias f16, H bytes]` |
| `int4` | 4-bit uint | 2 | float16 | `[scale f16, bias f16, H/2 bytes]` |
| `int2` | 2-bit uint | 4 | float16 | `[scale f16, bias f16, H/4 bytes]` |
| `fp8` | FBGEMM's hfp8 code | 1 | none | `[H bytes]` |

Packing (FBGEMM's `FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf`): value `c` of a row sits in
byte `c // n` at bit `(c % n) · bits` (n values a byte), the first value in the low bits. A
precision packs a dim only when n divides it (int4: even dims, int2: multiples of 4), as
FBGEMM's quantize op requires; fbgemm_gpu's own op also wants an even number of bytes (int4
dims a multiple of 4, int2 of 8), and its TBE converter dims a multiple of `align_size`
(int8 and fp8: 4, int4: 8, int2: 16). jaxembed keeps scale and bias in arrays of their own,
so neither alignment matters here; `to_fbgemm_rows` writes FBGEMM's fused rows when needed.

`fp8` is FBGEMM's `SparseType.FP8`: the "hfp8" code of `FloatToHFP8Quantized` (a sign bit,
`exponent_bits` exponent bits with `exponent_bias`, the rest mantissa; no infinities, no
NaN; TBE's default 4 and 7, whose largest value is 240), with no per-row scale or bias.

A `QuantizedTable` is a pytree of its arrays (`data`, `scale`, `bias`; None for fp8), its
precision and fp8 format static, so it passes through `jit`, `shard_map` and checkpoints
like a float table. It shards like one: rows split `data`, `scale` and `bias` alike; columns
split `data`'s bytes, each row's scale and bias replicated with them (`shardings`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "FP8_EXPONENT_BIAS",
    "FP8_EXPONENT_BITS",
    "PRECISIONS",
    "QuantizedTable",
    "check_dim",
    "check_fp8_format",
    "check_precision",
    "check_scale_dtype",
    "fp8_max",
    "from_fbgemm_rows",
    "pack",
    "packed_bytes",
    "table_precisions",
    "to_fbgemm_rows",
    "unpack",
    "values_per_byte",
]

PRECISIONS: dict[str, int] = {"int8": 8, "int4": 4, "int2": 2, "fp8": 8}
"""Each precision's bits a value."""

FP8_EXPONENT_BITS = 4  # FBGEMM's FP8QuantizationConfig(4, 7), SparseType.FP8's default
FP8_EXPONENT_BIAS = 7


def table_precisions(precision: Any, tables: Any) -> dict[str, str | None]:
    """Each of `tables`' precision (None: kept float) from one precision for all, or
    `{table: precision}` (a table left out, or mapped to None, stays float).

    Raises:
      ValueError: an unknown precision, or a table that is not one of `tables` (named).
      TypeError: `precision` neither a string nor a mapping.

    Examples:
      >>> table_precisions({"item": "int4"}, ["item", "os"])
      {'item': 'int4', 'os': None}
      >>> table_precisions({"itme": "int4"}, ["item", "os"])
      Traceback (most recent call last):
      ...
      ValueError: no table named ['itme'] in this collection (its tables: ['item', 'os'])
    """
    names = list(tables)
    if isinstance(precision, str):
        return dict.fromkeys(names, check_precision(precision))
    if not hasattr(precision, "keys"):
        raise TypeError(
            f"precision must be a precision like 'int4' or {{table: precision}}, got {precision!r}"
        )
    unknown = sorted(set(precision) - set(names))
    if unknown:
        raise ValueError(
            f"no table named {unknown} in this collection (its tables: {sorted(names)})"
        )
    return {t: None if precision.get(t) is None else check_precision(precision[t])
            for t in names}  # fmt: skip


def check_precision(precision: Any) -> str:
    """`precision` if it names a format, else a ValueError that lists the known ones."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(
            f"unknown precision {precision!r}: use one of {', '.join(map(repr, PRECISIONS))} "
            "(e.g. jaxembed.quant.quantize(table, 'int4'))"
        )
    return precision


def values_per_byte(precision: str) -> int:
    """How many values one byte of `data` holds: 8 // bits."""
    return 8 // PRECISIONS[check_precision(precision)]


def check_dim(dim: int, precision: str) -> None:
    """Raises unless `precision` packs rows of `dim` values into whole bytes.

    Examples:
      >>> check_dim(6, "int2")
      Traceback (most recent call last):
      ...
      ValueError: int2 packs 4 values a byte, so it cannot pack rows of dim 6: ...
    """
    n = values_per_byte(precision)
    if dim <= 0:
        raise ValueError(f"a quantized table needs rows of at least one value, got dim {dim}")
    if dim % n:
        up = -(-dim // n) * n
        raise ValueError(
            f"{precision} packs {n} values a byte, so it cannot pack rows of dim {dim}: pad the "
            f"columns to {up} by repeating the last one, which keeps every row's min and max "
            f"(jnp.pad(table, ((0, 0), (0, {up - dim})), mode='edge')) and read [:, :{dim}], "
            "or use 'int8' or 'fp8', which pack any dim"
        )


def packed_bytes(dim: int, precision: str) -> int:
    """The bytes of `data` a row of `dim` values takes (`check_dim` first)."""
    check_dim(dim, precision)
    return dim // values_per_byte(precision)


def check_fp8_format(exponent_bits: int, exponent_bias: int) -> None:
    """Raises unless `(exponent_bits, exponent_bias)` is an hfp8 format FBGEMM's code holds:
    1 to 7 exponent bits and a bias that leaves the largest exponent `2^bits - 2` >= 0."""
    ok = isinstance(exponent_bits, int) and isinstance(exponent_bias, int)
    if not ok or not 1 <= exponent_bits <= 7 or not 0 <= exponent_bias <= 2**exponent_bits - 2:
        raise ValueError(
            f"fp8 takes 1 to 7 exponent bits and a bias in [0, 2^bits - 2], got "
            f"fp8_exponent_bits={exponent_bits!r}, fp8_exponent_bias={exponent_bias!r}: "
            f"FBGEMM's TBE uses {FP8_EXPONENT_BITS} and {FP8_EXPONENT_BIAS}"
        )


def fp8_max(
    exponent_bits: int = FP8_EXPONENT_BITS, exponent_bias: int = FP8_EXPONENT_BIAS
) -> float:
    """The largest fp8 magnitude, FBGEMM's `max_position` (`FP8QuantizationConfig`): the top
    exponent `2^bits - 2` with every mantissa bit set; larger values saturate to it.

    Examples:
      >>> fp8_max()
      240.0
    """
    check_fp8_format(exponent_bits, exponent_bias)
    mantissa_bits = 7 - exponent_bits
    return float(2.0 ** (2**exponent_bits - 2 - exponent_bias) * (2 - 2.0**-mantissa_bits))


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class QuantizedTable:
    """A row-wise quantized embedding table: a pytree of its arrays.

    Attributes:
      data: uint8 `[V, B]`, each row's values packed (`B = dim / values_per_byte`).
      scale: float16 `[V]` (float32 for int8 quantized with `scale_dtype=jnp.float32`), the
        row's step; None for fp8.
      bias: `[V]` like `scale`, the row's value of code 0 (its min, or the low end the greedy
        search chose); None for fp8.
      precision: `"int8"`, `"int4"`, `"int2"` or `"fp8"` (static).
      exponent_bits, exponent_bias: fp8's format (static; None for the integer formats).

    `dim` and `shape` are read from `data`, so inside a `shard_map` body, where the arrays
    are one device's block, they are the block's (`[V/R, H/K]`).

    Build one with `jaxembed.quant.quantize`, read it with `jaxembed.quant.dequantize` or the
    lookups of `jaxembed.kernels.quant`.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxembed.quant import quantize
      >>> q = quantize(jnp.arange(8.0).reshape(2, 4), "int4")
      >>> q
      QuantizedTable(int4, rows=2, dim=4, data uint8[2, 2], scale float16[2], bias float16[2])
      >>> q.shape, q.nbytes
      ((2, 4), 12)
    """

    data: Any
    scale: Any
    bias: Any
    precision: str = dataclasses.field(metadata={"static": True})
    exponent_bits: int | None = dataclasses.field(default=None, metadata={"static": True})
    exponent_bias: int | None = dataclasses.field(default=None, metadata={"static": True})

    @property
    def bits(self) -> int:
        """Bits a value: 8, 4 or 2."""
        return PRECISIONS[self.precision]

    @property
    def values_per_byte(self) -> int:
        return values_per_byte(self.precision)

    @property
    def rows(self) -> int:
        """V, the table's rows."""
        return int(self.data.shape[0])

    @property
    def dim(self) -> int:
        """H, the values a row holds."""
        return int(self.data.shape[-1]) * self.values_per_byte

    @property
    def shape(self) -> tuple[int, int]:
        """`(V, H)`, the shape of the float table it reads as."""
        return (self.rows, self.dim)

    @property
    def dtype(self) -> np.dtype:
        """float32: the type a lookup reads the rows as (`q · scale + bias` in float32)."""
        return np.dtype(np.float32)

    @property
    def nbytes(self) -> int:
        """Bytes held: packed values plus the rows' scales and biases."""
        return sum(int(a.nbytes) for a in (self.data, self.scale, self.bias) if a is not None)

    def __repr__(self) -> str:
        def arr(name, a):
            shape = ", ".join(map(str, getattr(a, "shape", ())))
            return f"{name} {getattr(a, 'dtype', type(a).__name__)}[{shape}]"

        try:
            head = f"{self.precision}, rows={self.rows}, dim={self.dim}"
        except (AttributeError, IndexError, TypeError):  # leaves that are not arrays
            head = self.precision
        if self.precision == "fp8":
            head += f", e{self.exponent_bits} bias {self.exponent_bias}"
        parts = [arr("data", self.data)]
        parts += [
            arr(n, a) for n, a in (("scale", self.scale), ("bias", self.bias)) if a is not None
        ]
        return f"QuantizedTable({head}, {', '.join(parts)})"

    def specs(self, spec: P) -> QuantizedTable:
        """This table's `PartitionSpec`s for a float table laid out as `spec`: `data` takes
        `spec` (rows, and columns over its bytes), `scale` and `bias` its row entry.

        Args:
          spec: the float table's layout, `P(rows, columns)` (shorter specs replicate the
            rest).

        Returns:
          A `QuantizedTable` of `PartitionSpec`s (None where the table has no array), the
          `in_specs` / `out_specs` entry of a `shard_map` over it.
        """
        entries = tuple(spec) + (None,) * (2 - len(tuple(spec)))
        row = P(entries[0])
        return dataclasses.replace(
            self,
            data=P(*entries[:2]),
            scale=None if self.scale is None else row,
            bias=None if self.bias is None else row,
        )

    def shardings(self, mesh: jax.sharding.Mesh, spec: P) -> QuantizedTable:
        """`NamedSharding`s laying this table out over `mesh` as a float table of `spec`.

        `jax.device_put(q, q.shardings(mesh, P("model", None)))` splits its rows over
        `model`. A column split divides `data`'s bytes, so the shards must divide them.

        Args:
          mesh: the mesh.
          spec: the float table's layout, `P(rows, columns)`, as `specs`.

        Returns:
          A `QuantizedTable` of `NamedSharding`s, for `jax.device_put` or `jit`'s shardings.

        Raises:
          ValueError: the row or byte axis does not divide over the mesh axes that split it.
        """
        entries = tuple(spec) + (None,) * (2 - len(tuple(spec)))
        for axis, (entry, size, what) in enumerate(zip(
            entries[:2], (self.rows, int(self.data.shape[-1])), ("rows", "bytes a row"),
            strict=True,
        )):  # fmt: skip
            names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            n = math.prod(mesh.shape[a] for a in names)
            if size % n:
                fix = (
                    f"pad the rows to {-(-size // n) * n} before quantizing"
                    if axis == 0
                    else f"pick a dim that packs into a multiple of {n} bytes, or split the "
                    "columns over fewer devices"
                )
                raise ValueError(
                    f"an {self.precision} table of shape {self.shape} holds {size} {what}, which "
                    f"{n} shards of mesh axes {names} (mesh {dict(mesh.shape)}) cannot split "
                    f"evenly: {fix}"
                )
        return jax.tree.map(lambda s: NamedSharding(mesh, s), self.specs(spec))


jax.tree_util.register_dataclass(
    QuantizedTable,
    data_fields=["data", "scale", "bias"],
    meta_fields=["precision", "exponent_bits", "exponent_bias"],
)


# --- packing ------------------------------------------------------------------------------------


def pack(codes: jax.Array, bits: int) -> jax.Array:
    """uint8 `[..., H]` codes below `2^bits` -> uint8 `[..., H·bits/8]`, FBGEMM's order: value c
    in byte `c // n` at bit `(c % n) · bits`."""
    n = 8 // bits
    if n == 1:
        return codes.astype(jnp.uint8)
    grouped = codes.astype(jnp.uint32).reshape(*codes.shape[:-1], codes.shape[-1] // n, n)
    shifts = (jnp.arange(n, dtype=jnp.uint32) * bits).reshape((1,) * codes.ndim + (n,))
    return jnp.sum(grouped << shifts, axis=-1, dtype=jnp.uint32).astype(jnp.uint8)


def unpack(data: jax.Array, bits: int) -> jax.Array:
    """uint8 `[..., B]` packed bytes -> uint8 `[..., B·8/bits]` codes, by shifts and masks."""
    n = 8 // bits
    if n == 1:
        return data
    shifts = (jnp.arange(n, dtype=jnp.uint8) * bits).reshape((1,) * data.ndim + (n,))
    codes = (data[..., None] >> shifts) & jnp.uint8(2**bits - 1)  # [..., B, n]
    return codes.reshape(*data.shape[:-1], data.shape[-1] * n)


# --- FBGEMM's fused rows ------------------------------------------------------------------------


def _param_bytes(a: jax.Array) -> jax.Array:
    """`[V]` float16 / float32 -> uint8 `[V, 2 | 4]`, little-endian (FBGEMM's memory order)."""
    width = np.dtype(a.dtype).itemsize
    word = jax.lax.bitcast_convert_type(a, jnp.uint16 if width == 2 else jnp.uint32)
    shifts = jnp.arange(width, dtype=word.dtype)[None, :] * 8
    return ((word[:, None] >> shifts) & 0xFF).astype(jnp.uint8)


def _param_from_bytes(b: jax.Array, dtype: Any) -> jax.Array:
    width = np.dtype(dtype).itemsize
    word_type = jnp.uint16 if width == 2 else jnp.uint32
    shifts = jnp.arange(width, dtype=word_type)[None, :] * 8
    word = jnp.sum(b.astype(word_type) << shifts, axis=-1, dtype=word_type)
    return jax.lax.bitcast_convert_type(word, dtype)


def to_fbgemm_rows(
    table: QuantizedTable, *, scale_bias_last: bool = False, row_alignment: int = 1
) -> jax.Array:
    """The table as FBGEMM's fused byte rows, uint8 `[V, row_bytes]`.

    Integer formats: `[scale, bias, data]`, the IntNBit TBE's row (`scale_bias_last=False`),
    or `[data, scale, bias]` (`scale_bias_last=True`): the rows of FBGEMM's quantize ops
    (`FloatToFusedNBitRowwiseQuantizedSBHalf` for int4 / int2, and for int8 with float32
    scale and bias `FloatToFused8BitRowwiseQuantized`, as its CPU op writes them: the CUDA
    op pads the data to a multiple of 4 bytes first) and of TBE's `reverse_qparam`. fp8:
    `[data]`. Each row is zero-padded to a multiple of `row_alignment` bytes (TBE: 16 on
    GPU, 1 on CPU). The rows keep the table's row layout; a column split of the integer
    formats is undone (a row is one run of bytes).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxembed.quant import quantize
      >>> to_fbgemm_rows(quantize(jnp.array([[0.0, 1.0, 2.0, 3.0]]), "int4")).tolist()
      [[102, 50, 0, 0, 80, 250]]
    """
    data = table.data
    typed = getattr(jax.typeof(data), "sharding", None)
    spec = (*getattr(typed, "spec", ()), None, None)
    if spec[1] is not None and table.scale is not None:
        # Explicit axes split the columns: a fused row is whole, beside its scale and bias.
        mesh = data.sharding.mesh if isinstance(data, jax.Array) else typed.mesh
        data = jax.sharding.reshard(data, NamedSharding(mesh, P(spec[0], None)))
    parts = [data]
    if table.scale is not None:
        params = [_param_bytes(table.scale), _param_bytes(table.bias)]
        parts = [data, *params] if scale_bias_last else [*params, data]
    rows = jnp.concatenate(parts, axis=1)
    pad = -rows.shape[1] % int(row_alignment)
    return jnp.pad(rows, ((0, 0), (0, pad))) if pad else rows


def from_fbgemm_rows(
    rows: Any,
    precision: str,
    dim: int,
    *,
    scale_bias_last: bool = False,
    scale_dtype: Any = jnp.float16,
    fp8_exponent_bits: int = FP8_EXPONENT_BITS,
    fp8_exponent_bias: int = FP8_EXPONENT_BIAS,
) -> QuantizedTable:
    """A `QuantizedTable` from FBGEMM's fused rows (`to_fbgemm_rows`'s inverse).

    Args:
      rows: uint8 `[V, row_bytes]`, e.g. an IntNBit TBE's `split_embedding_weights()` entry
        or a quantize op's output; bytes past a row's payload (alignment padding) are ignored.
      precision: the rows' format.
      dim: H, the values a row holds.
      scale_bias_last: where the rows keep scale and bias (see `to_fbgemm_rows`).
      scale_dtype: their dtype: float16, or float32 (int8 only: the rows of
        `FloatToFused8BitRowwiseQuantized`).
      fp8_exponent_bits, fp8_exponent_bias: the fp8 format.

    Raises:
      ValueError: rows that are not 2-D uint8 or are too short for `dim`, a dim the precision
        cannot pack, a scale dtype the precision does not hold.
    """
    precision = check_precision(precision)
    b = packed_bytes(dim, precision)
    rows = jnp.asarray(rows)
    width = 0 if precision == "fp8" else 2 * check_scale_dtype(scale_dtype, precision).itemsize
    if rows.ndim != 2 or rows.dtype != jnp.uint8 or rows.shape[1] < b + width:
        raise ValueError(
            f"{precision} rows of dim {dim} need uint8 [V, >= {b + width}] ({b} bytes of values"
            f"{f' and {width} of scale and bias' if width else ''}), got {rows.dtype} "
            f"{tuple(rows.shape)}"
        )
    if precision == "fp8":
        check_fp8_format(fp8_exponent_bits, fp8_exponent_bias)
        return QuantizedTable(rows[:, :b], None, None, "fp8", fp8_exponent_bits, fp8_exponent_bias)
    start = b if scale_bias_last else 0
    half = width // 2
    scale = _param_from_bytes(rows[:, start : start + half], scale_dtype)
    bias = _param_from_bytes(rows[:, start + half : start + width], scale_dtype)
    data = rows[:, :b] if scale_bias_last else rows[:, width : width + b]
    return QuantizedTable(data, scale, bias, precision)


def check_scale_dtype(scale_dtype: Any, precision: str) -> np.dtype:
    """`scale_dtype` as a numpy dtype if `precision` holds its scale and bias in it: float16,
    or float32 for int8; else a ValueError."""
    dtype = np.dtype(scale_dtype)
    if dtype == np.float16 or (dtype == np.float32 and precision == "int8"):
        return dtype
    allowed = "float16 or float32" if precision == "int8" else "float16"
    raise ValueError(
        f"{precision} keeps its rows' scale and bias as {allowed} (FBGEMM's formats), got "
        f"scale_dtype={dtype.name}"
    )
