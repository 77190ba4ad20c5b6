"""Row-wise quantized tables as plain data: their format, and quantize / dequantize.

FBGEMM's row-wise formats (int8, int4, int2 with a per-row scale and bias; fp8): each row is
stored as packed integers and read back as `q · scale + bias` (DESIGN.md, "Dynamic tables,
serving, and work that divides by the devices").

* `jaxembed.quant.format`: `QuantizedTable` (a pytree that shards and checkpoints like a float
  table), the precisions and what dims they pack, FBGEMM's fused byte rows;
* `jaxembed.quant.rowwise`: `quantize` (min/max or the greedy range search) and `dequantize`,
  FBGEMM's formulas in `jnp`, and where XLA's float32 is not FBGEMM's; `RowError`, the
  ValueError for a row `quantize` cannot scale (NaN, ±inf, past fp16).

The lookups on a quantized shard (gather, pooled sums) are `jaxembed.kernels.quant`.
"""

from jaxembed.quant.format import FP8_EXPONENT_BIAS as FP8_EXPONENT_BIAS
from jaxembed.quant.format import FP8_EXPONENT_BITS as FP8_EXPONENT_BITS
from jaxembed.quant.format import PRECISIONS as PRECISIONS
from jaxembed.quant.format import QuantizedTable as QuantizedTable
from jaxembed.quant.format import check_dim as check_dim
from jaxembed.quant.format import fp8_max as fp8_max
from jaxembed.quant.format import from_fbgemm_rows as from_fbgemm_rows
from jaxembed.quant.format import packed_bytes as packed_bytes
from jaxembed.quant.format import to_fbgemm_rows as to_fbgemm_rows
from jaxembed.quant.rowwise import SEARCHES as SEARCHES
from jaxembed.quant.rowwise import RowError as RowError
from jaxembed.quant.rowwise import decode as decode
from jaxembed.quant.rowwise import dequantize as dequantize
from jaxembed.quant.rowwise import quantize as quantize

__all__ = [
    "FP8_EXPONENT_BIAS",
    "FP8_EXPONENT_BITS",
    "PRECISIONS",
    "SEARCHES",
    "QuantizedTable",
    "RowError",
    "check_dim",
    "decode",
    "dequantize",
    "fp8_max",
    "from_fbgemm_rows",
    "packed_bytes",
    "quantize",
    "to_fbgemm_rows",
]
