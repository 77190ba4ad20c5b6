"""`jaxembed.flax`: the Flax Linen modules and their row-sparse training (a face: names only).

* `Embed`: Linen's `Embed` with the lookup and the tied head sharded
  (`jaxembed.nn.linen_embed`);
* `deferred_logits`, `DeferredLogits`, `cross_entropy`: a model whose `__call__` ends in
  `Embed.attend` trains with the vocab-parallel loss (`jaxembed.nn.common`; the same objects
  as `jaxembed.nnx`'s);
* `DynamicEmbed`: a dynamic table for raw 64-bit ids, with admission and eviction
  (`jaxembed.nn.linen_dynamic`);
* `EmbeddingBagCollection`: tables and the sparse features that read them
  (`jaxembed.nn.linen_collection`); `embed_tables`: an `nn.Embed` / `nnx.Embed` checkpoint's
  weights as the collection's tables (`load_tables`);
* `value_and_grad`, `init_sparse`, `dense_mask`, `sparse_update`, `Grads`: a training step
  where the tables take a row-sparse optimizer and the rest optax (`jaxembed.training.linen`).

See `jaxembed.nnx` for the NNX modules.
"""

from jaxembed.nn.deferred import DeferredLogits as DeferredLogits
from jaxembed.nn.deferred import cross_entropy as cross_entropy
from jaxembed.nn.deferred import deferred_logits as deferred_logits
from jaxembed.nn.linen_collection import EmbeddingBagCollection as EmbeddingBagCollection
from jaxembed.nn.linen_collection import embed_tables as embed_tables
from jaxembed.nn.linen_dynamic import DynamicEmbed as DynamicEmbed
from jaxembed.nn.linen_embed import Embed as Embed
from jaxembed.training.linen import Grads as Grads
from jaxembed.training.linen import dense_mask as dense_mask
from jaxembed.training.linen import init_sparse as init_sparse
from jaxembed.training.linen import sparse_update as sparse_update
from jaxembed.training.linen import value_and_grad as value_and_grad

__all__ = [
    "DeferredLogits",
    "DynamicEmbed",
    "Embed",
    "EmbeddingBagCollection",
    "Grads",
    "cross_entropy",
    "deferred_logits",
    "dense_mask",
    "embed_tables",
    "init_sparse",
    "sparse_update",
    "value_and_grad",
]
