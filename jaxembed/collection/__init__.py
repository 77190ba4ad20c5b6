"""Collections of embedding tables as plain data: configs, placements and stacks.

* `jaxembed.collection.config`: `TableConfig`, `FeatureConfig`;
* `jaxembed.collection.layout`: placements resolved on a mesh, tables packed into stacks;
* `jaxembed.collection.checks`: what replaces or updates a collection's tables, checked.

Nothing here imports the kernels or Flax, so the planner (`jaxembed.plan`) reads these from
below. A batch's lookups and updates are `jaxembed.kernels.collection`'s
(`collection_lookup`, `collection_update`; also here by name, loaded on first use); the Flax
modules are `jaxembed.nnx.EmbeddingBagCollection` and `jaxembed.flax.EmbeddingBagCollection`.
"""

import importlib

from jaxembed.collection.config import PLACEMENTS as PLACEMENTS
from jaxembed.collection.config import FeatureConfig as FeatureConfig
from jaxembed.collection.config import TableConfig as TableConfig
from jaxembed.collection.layout import CollectionLayout as CollectionLayout
from jaxembed.collection.layout import Stack as Stack
from jaxembed.collection.layout import TablePlacement as TablePlacement
from jaxembed.collection.layout import layout_collection as layout_collection

__all__ = [
    "PLACEMENTS",
    "CollectionLayout",
    "FeatureConfig",
    "Stack",
    "TableConfig",
    "TablePlacement",
    "collection_lookup",
    "collection_update",
    "layout_collection",
]

# Names kept here for `from jaxembed.collection import collection_update`: they live in the
# kernels (above this package), so they are looked up by name when first asked for, never
# imported by this package.
_KERNEL_NAMES = {"collection_lookup", "collection_update"}


def __getattr__(name):
    if name in _KERNEL_NAMES:
        return getattr(importlib.import_module("jaxembed.kernels.collection"), name)
    raise AttributeError(f"module 'jaxembed.collection' has no attribute {name!r}")
