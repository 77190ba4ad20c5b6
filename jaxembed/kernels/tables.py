"""What a lookup reads as its table: a float array, or a `QuantizedTable` (inference only).

A row-wise quantized table (`jaxembed.quantize`) is a pytree of arrays laid out like the float
table it stands for: `data u8[V, B]` takes the float table's `PartitionSpec` (rows, and
columns over its bytes), `scale` and `bias` `[V]` its row entry (`QuantizedTable.specs`).
The lookups take either; these helpers let them treat both alike:

* `check_lookup_table`: a 2-D float table, or a quantized one;
* `layout_array`: the array whose layout is the table's (`data` for a quantized table);
* `table_specs`, `conform_table`, `whole_table`: `specs`, `conform` and `whole_on_one_device`
  over every array of the table;
* `frozen`: a quantized table's arrays with `stop_gradient` (it gets no gradient: training
  a quantized table is not supported; train the float table, quantize it for serving).

The shard-local kernels dispatch on the table's type (`jaxembed.kernels.select.kernels_for`).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from jaxembed.kernels.arrays import conform, whole_on_one_device
from jaxembed.kernels.common import check_table
from jaxembed.quant import QuantizedTable

__all__ = [
    "check_lookup_table",
    "conform_table",
    "frozen",
    "is_quantized",
    "layout_array",
    "table_specs",
    "whole_table",
]


def is_quantized(table: Any) -> bool:
    """Whether `table` is a `jaxembed.QuantizedTable`."""
    return isinstance(table, QuantizedTable)


def check_lookup_table(weight: Any) -> None:
    """Raises for a table a lookup cannot read: not a 2-D float array nor a `QuantizedTable`
    of arrays."""
    if not is_quantized(weight):
        check_table(weight)
        return
    if not hasattr(weight.data, "shape") or weight.data.ndim != 2:
        raise ValueError(
            f"a quantized table's data must be a 2-D uint8 array [rows, bytes], got "
            f"{type(weight.data).__name__} of shape {getattr(weight.data, 'shape', None)}: build "
            "it with jaxembed.quantize(table, precision)"
        )


def layout_array(table: Any) -> Any:
    """The array whose layout is the table's: the table, or a quantized table's `data`."""
    return table.data if is_quantized(table) else table


def table_specs(table: Any, spec: P) -> Any:
    """`spec` for a float table; a `QuantizedTable` of specs (its `specs(spec)`) for a
    quantized one: a `shard_map` `in_specs` entry either way."""
    return table.specs(spec) if is_quantized(table) else spec


def conform_table(table: Any, mesh: Any, spec: P) -> Any:
    """`jaxembed.kernels.arrays.conform` of every array of the table to its part of `spec`."""
    if not is_quantized(table):
        return conform(table, mesh, spec)
    return jax.tree.map(lambda a, s: conform(a, mesh, s), table, table.specs(spec))


def whole_table(table: Any) -> Any:
    """`jaxembed.kernels.arrays.whole_on_one_device` of every array of the table."""
    return jax.tree.map(whole_on_one_device, table)


def frozen(table: Any) -> Any:
    """The table, its arrays under `stop_gradient` when it is quantized (no gradient)."""
    return jax.tree.map(jax.lax.stop_gradient, table) if is_quantized(table) else table
