"""jaxembed: sharded embedding lookups for JAX.

The floors, each importing only those above it in this list (checked by `lint-imports`
against `pyproject.toml`'s contracts):

* base — `jaxembed.layout`, `ids`, `ragged`, `rowsharding`, `tape`, `collection` (configs and
  stack layouts), `dynamic` (raw 64-bit ids and dynamic tables' configs), `quant` (row-wise
  quantized tables), `_native` (the C++ sources and their build), `workloads`;
* `jaxembed.rules` — the sharding rules (pure Python, no jax needed);
* `jaxembed.plan` — what runs where, with every collective and its bytes;
* `jaxembed.kernels` — the `shard_map` bodies that execute a plan;
* `jaxembed.optim` — row-sparse optimizers;
* `jaxembed.nn` and `jaxembed.training` — Flax NNX and Linen modules, training helpers;
* faces — `jaxembed.nnx`, `jaxembed.flax`, `jaxembed.losses`: re-exports only;
* tools — `jaxembed.cli`, `demo`, `launch`, `calibrate`, `hlo`.

`import jaxembed.rules` never imports jax; the jax-facing names below are loaded on first use.

Importing jaxembed before JAX's backend starts tunes glibc's malloc for XLA:CPU's step buffers
(`jaxembed.host.tune_malloc`: the blocks a step allocates are reused instead of faulted in
anew each step; 2.5x on an 8-device NNX training step here). Set `JAXEMBED_MALLOC=default`
to keep glibc's defaults; imported after the backend started, it changes nothing.
"""

import importlib

from jaxembed import host as _host

__version__ = "0.1.0"

_host.tune_malloc(warn=False)  # the default is the fast path (see the docstring)

_LAZY = {
    "check_ids": "jaxembed.kernels.lookup",
    "check_ids_fit": "jaxembed.ids",
    "embedding": "jaxembed.kernels.lookup",
    "embedding_bag": "jaxembed.kernels.bag",
    "plan_embedding_bag": "jaxembed.plan",
    "optim": "jaxembed.optim",
    "TableConfig": "jaxembed.collection",
    "plan_collection": "jaxembed.plan.collection",
    "CollectionPlan": "jaxembed.plan.collection",
    "id_stats": "jaxembed.plan.idstats",
    "IdStats": "jaxembed.plan.idstats",
    "FeatureConfig": "jaxembed.collection",
    "LookupStats": "jaxembed.kernels.lookup",
    "UpdateStats": "jaxembed.kernels.common",
    "to_mod_order": "jaxembed.rowsharding",
    "from_mod_order": "jaxembed.rowsharding",
    "Ragged": "jaxembed.ragged",
    "plan_embedding": "jaxembed.plan",
    "EmbeddingPlan": "jaxembed.plan",
    "vocab_parallel_cross_entropy": "jaxembed.losses",
    "plan_cross_entropy": "jaxembed.losses",
    "quantize": "jaxembed.quant",
    "dequantize": "jaxembed.quant",
    "QuantizedTable": "jaxembed.quant",
    "default_impl": "jaxembed.plan.impl",
}

__all__ = [
    "CollectionPlan",
    "EmbeddingPlan",
    "FeatureConfig",
    "IdStats",
    "LookupStats",
    "QuantizedTable",
    "Ragged",
    "TableConfig",
    "UpdateStats",
    "__version__",
    "check_ids",
    "check_ids_fit",
    "default_impl",
    "dequantize",
    "embedding",
    "embedding_bag",
    "from_mod_order",
    "id_stats",
    "optim",
    "plan_collection",
    "plan_cross_entropy",
    "plan_embedding",
    "plan_embedding_bag",
    "quantize",
    "to_mod_order",
    "vocab_parallel_cross_entropy",
]


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        return module if _LAZY[name] == f"jaxembed.{name}" else getattr(module, name)
    raise AttributeError(f"module 'jaxembed' has no attribute {name!r}")
