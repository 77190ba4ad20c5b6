"""Training steps where embedding tables take row-sparse optimizers and the rest optax.

* `jaxembed.training.nnx`: `jaxembed.nnx.value_and_grad`, `jaxembed.nnx.SparseOptimizer`;
* `jaxembed.training.linen`: `jaxembed.flax.value_and_grad`, `jaxembed.flax.sparse_update`;
* `jaxembed.training.common`: `Grads`, what both `value_and_grad`s return.

Both rest on `jaxembed.tape`: the lookups' outputs are differentiated instead of the tables.
"""
