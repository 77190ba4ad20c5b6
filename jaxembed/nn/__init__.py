"""The Flax modules behind the faces `jaxembed.nnx` and `jaxembed.flax` (import them from there).

* `jaxembed.nn.common`: the layout helpers both `Embed` modules share (Flax metadata to a mesh
  and a `PartitionSpec`, padded rows, the tied head, the exchange option);
* `jaxembed.nn.nnx_embed`, `jaxembed.nn.linen_embed`: the NNX and Linen `Embed`;
* `jaxembed.nn.stacks`: a collection's stacks built from tables and read back;
* `jaxembed.nn.nnx_collection`, `jaxembed.nn.linen_collection`: the NNX and Linen
  `EmbeddingBagCollection`, on `jaxembed.kernels.collection`'s lookup and update.
"""
