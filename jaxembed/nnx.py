"""`jaxembed.nnx`: the Flax NNX modules and their row-sparse training (a face: names only).

* `Embed`, `Table`: Flax NNX's `Embed` with the lookup and the tied head sharded
  (`jaxembed.nn.nnx_embed`);
* `deferred_logits`, `DeferredLogits`, `cross_entropy`: a model whose `__call__` ends in
  `Embed.attend` trains with the vocab-parallel loss (`jaxembed.nn.common`);
* `DynamicEmbed`, `RemapState`: a dynamic table for raw 64-bit ids, with admission and
  eviction (`jaxembed.nn.nnx_dynamic`);
* `EmbeddingBagCollection`: tables and the sparse features that read them
  (`jaxembed.nn.nnx_collection`); `embed_tables`: an `nnx.Embed` / `nn.Embed` checkpoint's
  weights as the collection's tables (`load_tables`);
* `value_and_grad`, `SparseOptimizer`, `Grads`, `DENSE`: a training step where the tables take
  a row-sparse optimizer and the rest optax (`jaxembed.training.nnx`).

See `jaxembed.flax` for the Linen modules.
"""

from jaxembed.nn.deferred import DeferredLogits as DeferredLogits
from jaxembed.nn.deferred import cross_entropy as cross_entropy
from jaxembed.nn.deferred import deferred_logits as deferred_logits
from jaxembed.nn.linen_collection import embed_tables as embed_tables
from jaxembed.nn.nnx_collection import EmbeddingBagCollection as EmbeddingBagCollection
from jaxembed.nn.nnx_dynamic import DynamicEmbed as DynamicEmbed
from jaxembed.nn.nnx_dynamic import RemapState as RemapState
from jaxembed.nn.nnx_embed import Embed as Embed
from jaxembed.nn.nnx_embed import Table as Table
from jaxembed.training.nnx import DENSE as DENSE
from jaxembed.training.nnx import Grads as Grads
from jaxembed.training.nnx import SparseOptimizer as SparseOptimizer
from jaxembed.training.nnx import value_and_grad as value_and_grad

__all__ = [
    "DENSE",
    "DeferredLogits",
    "DynamicEmbed",
    "Embed",
    "EmbeddingBagCollection",
    "Grads",
    "RemapState",
    "SparseOptimizer",
    "Table",
    "cross_entropy",
    "deferred_logits",
    "embed_tables",
    "value_and_grad",
]
