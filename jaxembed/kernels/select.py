"""Which shard-local kernels a plan runs: XLA's (`local`, `sparse`) or their native twins.

The plan decides (`plan.impl`, see `jaxembed.plan.impl`); the bodies ask here which module's
functions to call. `jaxembed.kernels.native` has the same function names and signatures as
`jaxembed.kernels.local` (gather, pool, scatter, the routed exchange's `bucket_ids`) and
`jaxembed.kernels.sparse` (dedup, the row-sparse update), so a body calls
`kernels_for(plan).gather_rows(...)` either way.

A lookup on a quantized table (`jaxembed.QuantizedTable`) passes the table too:
`kernels_for(plan, table)` is then `jaxembed.kernels.quant` (or its native twin
`jaxembed.kernels.quant_native` when `plan.impl` is native), whose `gather_rows`, `pool_sum`
and `pool_max` read packed rows with the same arguments (lookups only: a quantized table is
not trained).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from jaxembed.kernels import local, native, quant, quant_native
from jaxembed.quant import QuantizedTable

__all__ = ["kernels_for", "native_update"]


def kernels_for(plan: Any, table: Any = None) -> ModuleType:
    """The module whose `gather_rows`, `pool_sum`, `pool_max`, `scatter_add` and `bucket_ids`
    the plan runs: `jaxembed.kernels.local` (XLA), or `jaxembed.kernels.native` (its C++
    twins) when `plan.impl` says so; for a quantized `table`, `jaxembed.kernels.quant`."""
    impl = getattr(plan, "impl", "xla")
    if isinstance(table, QuantizedTable):
        return quant_native if impl == "native" else quant
    return native if impl == "native" else local


def native_update(plan: Any) -> bool:
    """Whether the row-sparse update runs natively (the hidden axis must not be split)."""
    return getattr(plan, "impl", "xla") == "native" and not plan.hidden_axes
