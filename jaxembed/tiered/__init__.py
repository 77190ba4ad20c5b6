"""Tiered tables: rows and optimizer state in a backing store, hot rows cached on the device.

A tiered table keeps its full rows and row-wise optimizer state in a store (files on CPU, so a
table may exceed RAM) and a cache of `cache_rows` of them where the step computes. The cache is
a dynamic table keyed by the static row id (`jaxembed.dynamic`): its misses are filled from the
store instead of initialised, and its evictions write the row and its optimizer state back.
Results equal the in-memory table's (docs/tiered.md).

* `jaxembed.tiered.store`: `TableStore`, the memory-mapped files and their JSON header;
* `jaxembed.tiered.table`: `TieredTable`, the cache and its host-driven step (`prepare`,
  `pipeline`, `flush`, `save`, `restore`), and `TieredStats`;
* `jaxembed.tiered.prefetch`: the step's two halves (plan, and the worker thread's store
  reads and writes) that let the next batch's misses be read while a step runs;
* `jaxembed.tiered.checkpoint`: checkpoints of a store, whole or absent (`save_store`,
  `restore_store`).
"""

from jaxembed.tiered.checkpoint import restore_store as restore_store
from jaxembed.tiered.checkpoint import save_store as save_store
from jaxembed.tiered.store import StoreSlot as StoreSlot
from jaxembed.tiered.store import TableStore as TableStore
from jaxembed.tiered.table import TieredStats as TieredStats
from jaxembed.tiered.table import TieredTable as TieredTable
from jaxembed.tiered.table import create_store as create_store
from jaxembed.tiered.table import store_slots as store_slots

__all__ = [
    "StoreSlot",
    "TableStore",
    "TieredStats",
    "TieredTable",
    "create_store",
    "restore_store",
    "save_store",
    "store_slots",
]
