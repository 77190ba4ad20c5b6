"""Collections of embedding tables: configs, placements and stacks, lookups and updates.

* `jaxembed.collection.config`: `TableConfig`, `FeatureConfig`;
* `jaxembed.collection.layout`: placements resolved on a mesh, tables packed into stacks;
* `jaxembed.collection.lookup`: a batch's lookups and row-sparse updates, one call per stack.

The Flax modules are `jaxembed.nnx.EmbeddingBagCollection` and
`jaxembed.flax.EmbeddingBagCollection`.
"""

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


def __getattr__(name):
    # The lookups import the kernels: loaded on first use, so that the planner (which reads
    # configs and layouts only) stays below them.
    if name in ("collection_lookup", "collection_update"):
        from jaxembed.collection import lookup

        return getattr(lookup, name)
    raise AttributeError(f"module 'jaxembed.collection' has no attribute {name!r}")
