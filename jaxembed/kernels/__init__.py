"""Kernels: the `shard_map` bodies that execute a plan, and their shard-local work.

* `jaxembed.kernels.lookup`: `embedding` (forward and gradient);
* `jaxembed.kernels.bag`: `embedding_bag` (pooled lookups);
* `jaxembed.kernels.update`: the row-sparse update's body (backward and optimizer fused);
* `jaxembed.kernels.routed`: the routed exchange (each id to its owner, at a capacity);
* `jaxembed.kernels.reshard`: the plan's moves of small operands, inside a body;
* `jaxembed.kernels.common`: plumbing every body shares (reductions, layouts, checks, stats);
* `jaxembed.kernels.options`: `LookupOptions`, a lookup's keywords as one object;
* `jaxembed.kernels.local`, `jaxembed.kernels.sparse`: the XLA shard-local work (gather /
  pool / scatter; dedup and the row update), the reference of `jaxembed.kernels.native`,
  their C++ twins (sources and build in `jaxembed._native`); `jaxembed.kernels.select`
  chooses between them (`kernels_for`);
* `jaxembed.kernels.arrays`: where arrays are laid out, and what is assumed when unseen;
* `jaxembed.kernels.collection`: a collection's lookup and update (one bag call per stack);
* `jaxembed.kernels.tablewise`: a collection's table-wise calls (each feature's ids only to
  the device that holds its table; an optimizer reaches it as a value, `local_update`);
* `jaxembed.kernels.cross_entropy`: the vocab-parallel cross-entropy's bodies;
  `jaxembed.kernels.vocab_metrics`: vocab-parallel argmax, top-k and accuracy (no
  full-vocabulary logits); `jaxembed.kernels.vocab_args`: the arguments both check;
* `jaxembed.kernels.remap`, `jaxembed.kernels.remap_native`: a dynamic table's remap (raw
  64-bit id to row, admission, eviction), XLA and its C++ twin; `jaxembed.kernels.remap_routed`:
  each id sent to the row shard that owns it, its row sent back;
* `jaxembed.kernels.quant`, `jaxembed.kernels.quant_native`: gathers and pooled sums on a
  row-wise quantized shard (XLA, and its C++ twin that unpacks, dequantizes and pools in one
  pass); `jaxembed.kernels.tables`: what a lookup takes as its table (float or quantized).

Imports go one way: `select` -> `native`, `local`; `sparse` -> `local`; `native` ->
`jaxembed._native` only. Nothing here imports `jaxembed.optim` (which imports the kernels):
an optimizer's `RowFormula` reaches a kernel as a value, with its own `apply` and
`step_scalars`.
"""
