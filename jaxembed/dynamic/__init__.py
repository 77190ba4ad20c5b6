"""Dynamic tables as plain data: raw 64-bit ids, their configs, and the policy's reference.

A dynamic table holds `capacity` rows and maps raw 64-bit ids (any value) to the rows it owns,
admitting ids after they have been seen `admit_after` times and evicting by policy when a
bucket is full (DESIGN.md, "Dynamic tables, serving, and work that divides by the devices").

* `jaxembed.dynamic.keys`: ids as `uint32[..., 2]` (low, high halves) without x64, checked
  (`as_keys`), the reserved empty id, and the hash that picks an id's bucket and owner;
* `jaxembed.dynamic.config`: `DynamicTableConfig` (capacity, buckets, admission, eviction
  policy), the table's `DynamicState` and a step's `StepStats`;
* `jaxembed.dynamic.ragged`: `RaggedKeys`, bags of raw ids of varying length (a
  `jaxembed.Ragged` whose values are keys);
* `jaxembed.dynamic.reference`: the policy one id at a time in Python, the specification the
  kernels are checked against.

The remap itself (`lookup`, `step`) is `jaxembed.kernels.remap` (XLA) and
`jaxembed.kernels.remap_native` (its C++ twin); training a dynamic table (remap, then reset
the rows it (re)assigned, table and optimizer state) is `jaxembed.optim.dynamic`.
"""

from jaxembed.dynamic.config import POLICIES as POLICIES
from jaxembed.dynamic.config import DynamicState as DynamicState
from jaxembed.dynamic.config import DynamicTableConfig as DynamicTableConfig
from jaxembed.dynamic.config import StepStats as StepStats
from jaxembed.dynamic.config import overflow_fraction as overflow_fraction
from jaxembed.dynamic.keys import EMPTY_ID as EMPTY_ID
from jaxembed.dynamic.keys import as_keys as as_keys
from jaxembed.dynamic.keys import bucket_of as bucket_of
from jaxembed.dynamic.keys import owner_of as owner_of
from jaxembed.dynamic.ragged import RaggedKeys as RaggedKeys

__all__ = [
    "EMPTY_ID",
    "POLICIES",
    "DynamicState",
    "DynamicTableConfig",
    "RaggedKeys",
    "StepStats",
    "as_keys",
    "bucket_of",
    "overflow_fraction",
    "owner_of",
]
