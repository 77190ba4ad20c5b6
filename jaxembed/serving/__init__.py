"""Serving: a trained model's inference function as an artifact that runs with jax alone.

DESIGN.md, "Dynamic tables, serving, and work that divides by the devices": every lookup has
an XLA path that lowers to plain StableHLO, so an exported inference function, with float or
quantized tables, loads and runs in a process that has only jax (docs/serving.md).

* `export_inference(fn, params, *example_args)`: `jax.export` of `fn(params, *args)` on one
  device, the parameters (any pytree of arrays, `jaxembed.QuantizedTable`s included) as
  named leaves; it refuses, naming them, custom calls to jaxembed's native kernels unless
  `native=True`;
* `save(artifact, path)`: `manifest.json`, `params.npz`, `exported.bin` and a copy of
  `loader.py`;
* `loader.load(path)`: the standalone loader (standard library, numpy and jax only);
  `register`, the FFI registration a native artifact's loader calls first;
* `DeltaWriter(path).write(params, delta_path)`: the rows training changed since the export
  (then since the last delta), which `Model.apply_delta` applies to a model while it serves.

The lookups inside `fn` are jaxembed's own, at their default `impl="auto"` (traced as XLA's
kernels, `jaxembed.default_impl`), on float or `jaxembed.QuantizedTable` tables, dynamic
tables in evaluation mode, collections; a symbolic batch serves every batch size.

Examples:
  >>> import tempfile
  >>> import jax.numpy as jnp
  >>> import jaxembed
  >>> from jaxembed import serving
  >>> from jaxembed.quant import quantize
  >>> def fn(params, ids):
  ...     return jaxembed.embedding_bag(ids, params["table"], impl="xla") @ params["w"]
  >>> params = {"table": quantize(jnp.ones((10, 4)), "int8"), "w": jnp.ones((4, 1))}
  >>> path = serving.save(serving.export_inference(fn, params, jnp.zeros((2, 3), jnp.int32)),
  ...                     tempfile.mkdtemp())
  >>> model = serving.load(path)      # or `import loader` in a process without jaxembed
  >>> model(jnp.array([[1, 2, -1], [3, -1, -1]])).tolist()
  [[8.0], [4.0]]
"""

from jaxembed.serving import loader as loader
from jaxembed.serving.delta import DeltaWriter as DeltaWriter
from jaxembed.serving.export import NATIVE_TARGETS as NATIVE_TARGETS
from jaxembed.serving.export import Artifact as Artifact
from jaxembed.serving.export import export_inference as export_inference
from jaxembed.serving.export import native_targets as native_targets
from jaxembed.serving.export import register as register
from jaxembed.serving.export import save as save
from jaxembed.serving.loader import Model as Model
from jaxembed.serving.loader import load as load

__all__ = [
    "NATIVE_TARGETS",
    "Artifact",
    "DeltaWriter",
    "Model",
    "export_inference",
    "load",
    "loader",
    "native_targets",
    "register",
    "save",
]
