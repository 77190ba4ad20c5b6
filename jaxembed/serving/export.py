"""`export_inference` and `save`: a trained model's inference function as a jax-only artifact.

    fn(params, *args)  --export_inference-->  Artifact  --save-->  manifest.json
                                                                   params.npz
                                                                   exported.bin
                                                                   loader.py    --load--> Model

`fn` is exported with `jax.export` on the parameters' and the example arguments' shapes, the
parameters flattened to named leaves (`jax.tree_util.keystr` paths) that the exported function
takes as its first argument, a tuple. So any pytree of arrays is a parameter tree, a
`jaxembed.QuantizedTable` included, and the artifact needs none of its classes: the loader
(`jaxembed.serving.loader`, standard library, numpy and jax only) reads the leaves back in
the exported order and calls the function.

An artifact without native kernels (`native=False`, the default) has no custom call of
jaxembed: every lookup in `fn` must take `impl="xla"`, and `export_inference` says so,
naming the targets, if one does not. With `native=True` the lookups may run jaxembed's C++
kernels (`impl="native"`, CPU only); the export then lists each of their targets as
`jax.export.DisabledSafetyCheck.custom_call(target)` (XLA FFI targets carry no
compatibility guarantee), and the loading process registers them first
(`load(path, register=jaxembed.serving.register)`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

import jaxembed
from jaxembed._native import build
from jaxembed.plan.impl import default_impl
from jaxembed.serving import loader

__all__ = [
    "NATIVE_TARGETS",
    "Artifact",
    "export_inference",
    "native_targets",
    "register",
    "save",
]

NATIVE_TARGETS: tuple[str, ...] = tuple(build.TARGETS)
"""The XLA FFI targets of jaxembed's native kernels (`jaxembed._native.build.TARGETS`)."""


def native_targets(exported: jax.export.Exported) -> tuple[str, ...]:
    """The custom calls to jaxembed's native kernels in `exported`, sorted; `()` for none.

    Args:
      exported: a `jax.export.Exported` (e.g. `Artifact.exported`).

    Returns:
      The FFI target names, e.g. `("jaxembed_pool_sum",)`.
    """
    targets = loader.custom_call_targets(exported.mlir_module())
    return tuple(t for t in targets if t in NATIVE_TARGETS or t.startswith("jaxembed_"))


def register() -> None:
    """Registers jaxembed's native kernels as XLA FFI targets (builds them on first use), so
    that a native artifact compiles: `loader.load(path, register=jaxembed.serving.register)`.

    Raises:
      RuntimeError: the kernels cannot be built or loaded here (the reason, e.g. no C++
        compiler, or `JAXEMBED_NATIVE=0`).
    """
    why = build.ensure()
    if why is not None:
        raise RuntimeError(
            f"jaxembed's native kernels are not available in this process: {why}. Export the "
            "model again with impl='xla' in every lookup and native=False: it then loads "
            "with jax alone"
        )


@dataclasses.dataclass(frozen=True, eq=False)
class Artifact:
    """An exported inference function and its parameters, ready to `save`.

    Attributes:
      exported: the `jax.export.Exported` of `fn(params, *args)`, taking the parameter
        leaves as a tuple first.
      serialized: `exported.serialize()`, the bytes of `exported.bin`.
      leaf_names: each parameter leaf's `keystr` path, in the exported order.
      leaves: the leaves as host numpy arrays, in that order.
      manifest: what `manifest.json` holds (see `jaxembed.serving.loader`).
    """

    exported: jax.export.Exported
    serialized: bytes
    leaf_names: tuple[str, ...]
    leaves: tuple[np.ndarray, ...]
    manifest: dict[str, Any]

    @property
    def native_targets(self) -> tuple[str, ...]:
        """The jaxembed FFI targets the function calls; `()` for a jax-only artifact."""
        return tuple(self.manifest["native_targets"])

    def __call__(self, *args: Any) -> Any:
        """Runs the exported function here on the artifact's parameters (what `load` will
        run), e.g. to compare with `fn(params, *args)` before saving."""
        return self.exported.call(self.leaves, *args)

    def __repr__(self) -> str:
        native = f", native={self.native_targets}" if self.native_targets else ""
        return (
            f"Artifact({self.manifest['function']}, {len(self.leaves)} parameter leaves, "
            f"{sum(a.nbytes for a in self.leaves)} bytes, platforms="
            f"{tuple(self.manifest['platforms'])}{native})"
        )


def _spec(x: Any, what: str) -> jax.ShapeDtypeStruct:
    """`x`'s shape and dtype, without its sharding: the export runs on one device."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(
            f"{what} is a {type(x).__name__}, not an array: export_inference takes params and "
            "example args as pytrees of arrays or jax.ShapeDtypeStructs (wrap a number in "
            "jnp.asarray); keep other values in fn's closure"
        )
    return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)


def _entries(tree: Any, what: str) -> tuple[list[str], list[Any]]:
    with_paths, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [f"{what}{jax.tree_util.keystr(p)}" for p, _ in with_paths], [x for _, x in with_paths]


def params_version(leaves: Sequence[np.ndarray]) -> str:
    """The version of an artifact's parameters: a digest of the leaves' bytes."""
    digest = hashlib.sha256()
    for leaf in leaves:
        digest.update(np.ascontiguousarray(leaf).view(np.uint8).reshape(-1).data)
    return digest.hexdigest()[:16]


def export_inference(
    fn: Callable[..., Any],
    params: Any,
    *example_args: Any,
    platforms: Sequence[str] = ("cpu",),
    native: bool = False,
) -> Artifact:
    """Exports `fn(params, *args)` with `jax.export`, its parameters as named leaves.

    Export a one-device function: run its lookups without a mesh (e.g.
    `jaxembed.embedding_bag(ids, table)` on arrays of one device), not over a mesh of several
    devices. `fn` is traced under `jaxembed.default_impl("xla")` (unless `native`), so
    lookups at their default `impl="auto"` (collections, Flax modules) run XLA's kernels and
    the artifact loads without jaxembed. A symbolic batch dimension in `example_args`
    (`jax.export.symbolic_shape`) serves every batch size from one artifact (dense bags,
    lookups, collections); otherwise export once per batch size served
    (`save(..., params=False)` shares the parameters).

    Args:
      fn: the inference function, `fn(params, *args) -> outputs`; outputs a pytree of
        arrays in dicts, lists and tuples.
      params: any pytree of arrays: float tables, `jaxembed.QuantizedTable`s, dense layers.
      *example_args: `fn`'s other arguments, arrays or `jax.ShapeDtypeStruct`s, shaped as
        served.
      platforms: the platforms the artifact runs on, e.g. `("cpu", "cuda")`.
      native: allow custom calls to jaxembed's native kernels (CPU only); the loading
        process must then register them (`jaxembed.serving.register`).

    Returns:
      An `Artifact`; `save` writes it.

    Raises:
      TypeError: a leaf of `params` or `example_args` that is not an array (named).
      ValueError: custom calls to jaxembed's kernels with `native=False` (the targets and
        the fix), native kernels for a platform other than CPU, a function spanning
        several devices.
      ImportError: `flatbuffers`, which `jax.export` serializes with, is not installed.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxembed
      >>> def fn(params, ids):
      ...     pooled = jaxembed.embedding_bag(ids, params["table"], combiner="sum", impl="xla")
      ...     return pooled @ params["w"]
      >>> params = {"table": jnp.ones((10, 4)), "w": jnp.ones((4, 1))}
      >>> artifact = export_inference(fn, params, jnp.zeros((2, 3), jnp.int32))
      >>> artifact.leaf_names, artifact.native_targets
      (("['table']", "['w']"), ())
      >>> artifact(jnp.array([[1, 2, -1], [3, -1, -1]])).tolist()
      [[8.0], [4.0]]
    """
    platforms = (platforms,) if isinstance(platforms, str) else tuple(platforms)
    if not platforms or not all(isinstance(p, str) for p in platforms):
        raise ValueError(f"platforms must name one or more, e.g. ('cpu',), got {platforms!r}")
    names, values = _entries(params, "")
    for name, value in zip(names, values, strict=True):
        _spec(value, f"params{name}")  # raises for a leaf that is not an array
    leaves = tuple(np.asarray(jax.device_get(v)) for v in values)  # host copies, any sharding
    arg_names, arg_values = _entries(list(example_args), "args")
    arg_specs = [_spec(v, n) for n, v in zip(arg_names, arg_values, strict=True)]
    treedef = jax.tree.structure(params)

    def flat_fn(flat_params, *args):
        return fn(jax.tree.unflatten(treedef, list(flat_params)), *args)

    flat_fn.__name__ = getattr(fn, "__name__", "fn")
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in NATIVE_TARGETS]
    specs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in leaves)
    args = jax.tree.unflatten(jax.tree.structure(list(example_args)), arg_specs)
    # Lookups at their default impl ("auto": collections, Flax modules) trace as XLA's
    # kernels unless native kernels are wanted: the artifact then needs nothing of jaxembed.
    with default_impl("auto" if native else "xla"):
        exported = jax.export.export(
            jax.jit(flat_fn), platforms=platforms, disabled_checks=checks
        )(specs, *args)
    found = native_targets(exported)
    if found and not native:
        raise ValueError(
            f"{flat_fn.__name__} calls jaxembed's native kernels (custom calls "
            f"{', '.join(found)}), which a process without jaxembed cannot run. Lookups at "
            "their default impl='auto' export as XLA's; these ask for impl='native' (or fn is "
            "a jax.jit function traced before, with the native kernels): drop impl='native' "
            "(or pass impl='xla') for an artifact that loads with jax alone, or "
            "export_inference(..., "
            "native=True), which exports them with jax.export.DisabledSafetyCheck.custom_call("
            f"{found[0]!r}) for each target, and load it with "
            "load(path, register=jaxembed.serving.register)"
        )
    if found and platforms != ("cpu",):
        raise ValueError(
            f"jaxembed's native kernels ({', '.join(found)}) run on CPU only, and the export "
            f"is for platforms={platforms}: export with platforms=('cpu',), or pass "
            "impl='xla' to the lookups for other platforms"
        )
    if exported.nr_devices != 1:
        raise ValueError(
            f"{flat_fn.__name__} runs on {exported.nr_devices} devices, and serving exports "
            "one-device functions: call its lookups without mesh= (or on a 1-device mesh, "
            "jax.make_mesh((1,), ('model',))) on unsharded arrays"
        )
    # What the exported function takes (with x64 off, jax canonicalises 64-bit leaves and
    # arguments to 32 bits): the manifest and params.npz record that, never the given dtypes,
    # so that the loader checks inputs against the signature that runs.
    taken = exported.in_avals
    leaves = tuple(a.astype(t.dtype, copy=False) for a, t in zip(leaves, taken, strict=False))
    arg_specs = [jax.ShapeDtypeStruct(s.shape, t.dtype)
                 for s, t in zip(arg_specs, taken[len(leaves):], strict=True)]  # fmt: skip
    try:
        serialized = bytes(exported.serialize())
    except ImportError as e:
        raise ImportError(
            f"jax.export serializes with flatbuffers, which is not installed ({e}): "
            "pip install flatbuffers"
        ) from e
    manifest = {
        "format": loader.FORMAT,
        "function": flat_fn.__name__,
        # What a delta names (`jaxembed.serving.DeltaWriter`): the exported program, and the
        # parameters' version, a digest of their bytes (each delta then names the next).
        "model": hashlib.sha256(serialized).hexdigest()[:16],
        "version": params_version(leaves),
        "jax_version": jax.__version__,
        "jaxembed_version": jaxembed.__version__,
        "platforms": list(platforms),
        "nr_devices": exported.nr_devices,
        "native_targets": list(found),
        "params_file": loader.PARAMS,
        "params": [
            {
                "name": n,
                "dtype": a.dtype.name,
                "shape": list(a.shape),
                "stored_as": loader.stored_dtype(a.dtype).name,
            }
            for n, a in zip(names, leaves, strict=True)
        ],
        "args": [
            {"name": n, "dtype": s.dtype.name,
             "shape": [d if isinstance(d, int) else str(d) for d in s.shape]}  # "b": any size
            for n, s in zip(arg_names, arg_specs, strict=True)
        ],
    }
    return Artifact(exported, serialized, tuple(names), leaves, manifest)


def save(artifact: Artifact, path: str | Path, *, params: bool = True) -> Path:
    """Writes `artifact` to the directory `path` (made if missing; its files replaced).

    Files: `manifest.json`, `params.npz` (unless `params=False`), `exported.bin`, and
    `loader.py`, a copy of `jaxembed.serving.loader`, the one file a serving process needs
    besides numpy and jax.

    Args:
      artifact: from `export_inference`.
      path: the artifact's directory.
      params: write the parameters; False for another export of a model whose parameters
        another artifact holds (another batch size): load it with `load(path,
        params=first.params)`.

    Returns:
      `path`, as a `Path`.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    manifest = dict(artifact.manifest, params_file=loader.PARAMS if params else None)
    (path / loader.EXPORTED).write_bytes(artifact.serialized)
    if params:
        stored = {
            name: leaf.view(loader.stored_dtype(leaf.dtype))
            for name, leaf in zip(artifact.leaf_names, artifact.leaves, strict=True)
        }
        with open(path / loader.PARAMS, "wb") as f:
            np.savez(f, **stored)
    elif (path / loader.PARAMS).exists():
        (path / loader.PARAMS).unlink()
    (path / loader.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    shutil.copyfile(loader.__file__, path / "loader.py")
    return path
