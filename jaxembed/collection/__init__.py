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
from jaxembed.collection.lookup import collection_lookup as collection_lookup
from jaxembed.collection.lookup import collection_update as collection_update

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
