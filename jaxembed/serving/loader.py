"""Load an artifact of `jaxembed.serving.export_inference` and run it, with jax alone.

This file stands alone: it imports the standard library, numpy and jax, never jaxembed, so a
serving process copies it next to the artifact (`jaxembed.serving.save` writes a copy there)
and runs the model without installing jaxembed:

    import loader                              # this file, copied beside the artifact
    model = loader.load("artifacts/ranker")    # deserialize, read the params, compile
    scores = model(ids, dense)                 # the exported function's arguments, no params

An artifact is a directory of

* `manifest.json`: the format, the jax that exported it, the platforms, the native FFI
  targets it calls (if any), and each parameter leaf by name (its `jax.tree_util.keystr`
  path, e.g. `['tables'][0].data`) with its dtype and shape, in the order the exported
  function takes them; then the arguments' shapes and dtypes;
* `params.npz`: the leaves, one array per name (dtypes numpy lacks, e.g. bfloat16, are stored
  as unsigned integers of their width and viewed back);
* `exported.bin`: the serialized `jax.export.Exported`, whose first argument is the tuple of
  leaves and whose other arguments are those of the user's function.

An artifact that calls jaxembed's native kernels (`native_targets` in its manifest) needs
them registered as XLA FFI targets before it compiles: `load(path,
register=jaxembed.serving.register)`, in a process that has jaxembed.

`Model.__call__` checks integer inputs on the host before jax sees them (with x64 off, jax
narrows an int64 argument to int32 silently: id `2**32 + 7` would read row 7): a value that
does not fit the exported dtype is refused, naming the argument, the first such value and
its index; a float or bool array given for integers is refused, never rounded; integers of
another dtype whose values all fit are cast to the exported one (numpy int64 ids for an int32
model). A 64-bit array given for a `uint32` input (a dynamic table's keys `uint32[..., 2]`) is
refused whatever its values, since its ids and keys' halves look alike.

A damaged file (truncated, empty, another format) raises `ValueError` naming it and the fix.

It is tested in a process where `import jaxembed` fails (tests/test_serving_export.py).
"""

from __future__ import annotations

import json
import re
import threading
import zipfile
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "DELTA_ARRAYS",
    "DELTA_FORMAT",
    "DELTA_MANIFEST",
    "EXPORTED",
    "FORMAT",
    "MANIFEST",
    "PARAMS",
    "Model",
    "custom_call_targets",
    "load",
    "read_delta",
    "read_manifest",
    "stored_dtype",
]

FORMAT = "jaxembed.serving/1"
"""The artifact format this loader reads (the manifest's `format`)."""

MANIFEST, PARAMS, EXPORTED = "manifest.json", "params.npz", "exported.bin"
"""The artifact's file names."""

DELTA_FORMAT = "jaxembed.serving.delta/1"
"""The format of a delta (`jaxembed.serving.DeltaWriter`) this loader applies."""

DELTA_MANIFEST, DELTA_ARRAYS = "delta.json", "delta.npz"
"""A delta's file names: which rows of which leaves, and their new values."""

_REQUIRED = ("format", "function", "platforms", "native_targets", "params", "args")
"""The manifest's keys the loader reads (`params_file` may be absent: no `params.npz`)."""

_TARGET = re.compile(r'custom_call\s*@([\w.$-]+)|call_target_name\s*=\s*"([^"]+)"')


def custom_call_targets(mlir_text: str) -> tuple[str, ...]:
    """The custom-call targets a StableHLO module's text calls, sorted, each once.

    Args:
      mlir_text: `exported.mlir_module()`, in its pretty or generic form.

    Returns:
      The target names, e.g. `("jaxembed_pool_sum",)`; `()` for a module of plain ops.

    Examples:
      >>> custom_call_targets('%0 = stablehlo.custom_call @jaxembed_pool_sum(%a) : ...')
      ('jaxembed_pool_sum',)
    """
    return tuple(sorted({a or b for a, b in _TARGET.findall(mlir_text)}))


def stored_dtype(dtype: Any) -> np.dtype:
    """The numpy dtype a leaf of `dtype` is stored as in `params.npz`: itself where numpy's
    format holds it, else the unsigned integer of its width (bfloat16 -> uint16, the float8
    types -> uint8), whose bits are the value's."""
    dtype = jnp.dtype(dtype)
    return dtype if dtype.kind != "V" else np.dtype(f"u{dtype.itemsize}")


def _damaged(file: Path, what: str, *, also: str = "") -> ValueError:
    return ValueError(
        f"{file} {what}: it is truncated or not a jaxembed.serving artifact{also}. Save the "
        "artifact again with jaxembed.serving.save(artifact, path), or copy it again from where "
        "it was saved"
    )


def _read_json(file: Path, what: str, where: str) -> Any:
    """The JSON in `file`: FileNotFoundError where it is missing (`where` says what to pass),
    a ValueError naming it where it does not parse."""
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist: {where}")
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _damaged(file, f"is not a JSON {what} ({type(e).__name__}: {e})") from e


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The artifact's manifest, checked for the format this loader reads and its keys.

    Raises:
      FileNotFoundError: `path` holds no `manifest.json`.
      ValueError: a manifest of another format; one that is not JSON (truncated, empty) or
        lacks keys the loader reads (each names the file and the fix).
    """
    file = Path(path) / MANIFEST
    manifest = _read_json(file, "manifest", "load() takes the directory "
                          "jaxembed.serving.save(artifact, path) wrote (manifest.json, "
                          "params.npz, exported.bin)")  # fmt: skip
    if not isinstance(manifest, dict):
        raise _damaged(file, f"holds a JSON {type(manifest).__name__}, not an object")
    if "format" in manifest and manifest["format"] != FORMAT:
        raise ValueError(
            f"{file} is of format {manifest['format']!r}, and this loader reads {FORMAT!r}: "
            "load it with the loader.py saved beside it, or export the model again"
        )
    missing = [k for k in _REQUIRED if k not in manifest]
    for key, needs in (("params", {"name", "dtype", "shape"}), ("args", {"dtype", "shape"})):
        for i, entry in enumerate(manifest.get(key) or ()):
            lacks = sorted(needs - set(entry)) if isinstance(entry, dict) else sorted(needs)
            missing += [f"{key}[{i}].{k}" for k in lacks]
    if missing:
        raise _damaged(file, f"lacks the keys {missing}, which a {FORMAT} manifest has")
    return manifest


def _describe(dtype: Any, shape: Any) -> str:
    return f"{jnp.dtype(dtype).name}[{', '.join(str(d) for d in shape)}]"


def _check_leaf(name: str, array: Any, entry: Mapping[str, Any], source: str) -> None:
    want, got = (entry["dtype"], tuple(entry["shape"])), (jnp.dtype(array.dtype).name, array.shape)
    if want != got:
        raise ValueError(
            f"parameter leaf {name} from {source} is {_describe(*got)}, but the model was "
            f"exported for {_describe(*want)}: pass an array of that dtype and shape (cast with "
            f"x.astype('{want[0]}')), or export the model again for the new one"
        )


def _read_leaves(
    path: Path, manifest: Mapping[str, Any], params: Mapping[str, Any] | None
) -> list[Any]:
    """The leaves in the exported order: `params[name]` where given, else from the npz."""
    entries = manifest["params"]
    given = dict(params or {})
    unknown = sorted(set(given) - {e["name"] for e in entries})
    if unknown:
        raise ValueError(
            f"params names leaves the model does not have: {unknown}; its leaves are "
            f"{[e['name'] for e in entries]}"
        )
    missing = [e["name"] for e in entries if e["name"] not in given]
    stored = None
    if missing:
        file = path / PARAMS
        if manifest.get("params_file") is None or not file.is_file():
            raise ValueError(
                f"{path} was saved without its parameters (save(..., params=False)), and "
                f"params= lacks the leaves {missing}: pass them, e.g. load(path, "
                "params=other.params) with the model of the same weights loaded first"
            )
        stored = _read_npz(file, missing)
    leaves = []
    for entry in entries:
        name = entry["name"]
        if name in given:
            array, source = given[name], "params="
        else:
            array, source = stored[name], str(path / PARAMS)
            dtype = jnp.dtype(entry["dtype"])
            if stored_dtype(dtype) != dtype and array.dtype == stored_dtype(dtype):
                array = array.view(dtype)  # e.g. bfloat16's bits, stored as uint16
        _check_leaf(name, array, entry, source)
        leaves.append(array)
    return leaves


def _read_npz(file: Path, names: list[str]) -> dict[str, np.ndarray]:
    """The arrays `names` of the npz `file`, read whole (the file is closed after)."""
    try:
        stored = np.load(file, allow_pickle=False)
        if isinstance(stored, np.lib.npyio.NpzFile):
            with stored:
                arrays = {name: stored[name] for name in names if name in stored.files}
    except (zipfile.BadZipFile, zlib.error, EOFError, ValueError) as e:
        why = "is empty" if file.stat().st_size == 0 else "is not a whole npz archive"
        raise _damaged(file, f"{why} ({type(e).__name__}: {e})") from e
    if not isinstance(stored, np.lib.npyio.NpzFile):
        raise _damaged(file, f"holds one {_describe(stored.dtype, stored.shape)} array, not an npz")
    absent = [name for name in names if name not in arrays]
    if absent:
        raise _damaged(file, f"has no arrays {absent}, which {MANIFEST} names")
    return arrays


def _deserialize(file: Path, manifest: Mapping[str, Any]) -> Any:
    """The `jax.export.Exported` in `file`; a ValueError naming it where it does not read."""
    data = file.read_bytes()
    try:
        return jax.export.deserialize(bytearray(data))
    except Exception as e:  # whatever the flatbuffer reader raises: struct.error, IndexError
        exporter = manifest.get("jax_version")
        also = (
            f", or one of a jax this one cannot read (jax {exporter} exported it, this is "
            f"jax {jax.__version__})"
            if data and exporter != jax.__version__
            else ""
        )
        why = "is empty" if not data else f"does not deserialize ({type(e).__name__}: {e})"
        raise _damaged(file, why, also=also) from e


class Model:
    """A loaded artifact: call it with the exported function's arguments (without params).

    Attributes:
      exported: the deserialized `jax.export.Exported`.
      manifest: the artifact's manifest.
      leaf_names: the parameter leaves' names, in the order the function takes them.
      params: `{name: array}`, the leaves on the device (pass them to `load(..., params=)` of
        another artifact of the same model, e.g. another batch size).
    """

    def __init__(self, exported: Any, manifest: dict[str, Any], leaves: list[Any], device: Any):
        self.exported = exported
        self.manifest = manifest
        self.leaf_names = tuple(e["name"] for e in manifest["params"])
        self._leaves = tuple(jax.device_put(leaf, device) for leaf in leaves)
        self.params = dict(zip(self.leaf_names, self._leaves, strict=True))
        self.version = manifest.get("version")
        self._updating = threading.Lock()
        self._jitted = jax.jit(exported.call)
        self._compiled = None
        self._arg_trees = tuple(exported.in_tree.children()[0].children()[1:])  # ((p, *a), {})
        self._arg_avals = tuple(exported.in_avals[len(self._leaves) :])
        names = [a.get("name") for a in manifest["args"]]
        self._arg_names = names if len(names) == len(self._arg_avals) else []

    def compile(self) -> None:
        """Compiles the function for the exported arguments' shapes (when none is symbolic),
        so that the first call does not; `load` calls it."""
        avals = self.exported.in_avals[len(self._leaves) :]
        if not all(isinstance(d, int) for a in avals for d in a.shape):
            return
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
        (_, *args), _ = jax.tree.unflatten(self.exported.in_tree, [*self._leaves, *specs])
        self._compiled = self._jitted.lower(self._leaves, *args).compile()

    def __call__(self, *args: Any) -> Any:
        """The exported function of `args` (arrays shaped as exported; see `manifest["args"]`).

        Integer inputs are checked on the host first (one min and max of each whose dtype is
        not the exported one; concrete jax arrays too, traced ones not): integers of another
        dtype whose values all fit the exported one are cast to it (numpy int64 ids for an
        int32 model), never narrowed by jax. Ids that fit but lie outside a table's rows are
        not refused: they read nothing, as the lookup under `jax.jit` (docs/serving.md).

        Args:
          *args: the exported function's arguments after the parameters.

        Returns:
          Its outputs, jax arrays in the exported pytree.

        Raises:
          ValueError: an integer input holding a value its exported dtype does not hold (the
            argument, the first such value and its index, the fix); a 64-bit array for a
            `uint32` input (keys); shapes or dtypes other than exported (what it takes).
          TypeError: a float or bool array (or scalar) where integers were exported.
        """
        args = self._checked(args)
        leaves = self._leaves  # read once: a delta applied meanwhile is seen whole or not at all
        if self._compiled is not None:
            try:
                return self._compiled(leaves, *args)
            except TypeError:  # other shapes or dtypes than compiled for: jit checks them
                pass
        try:
            return self._jitted(leaves, *args)
        except ValueError as e:
            if "mismatch for args[" not in str(e):
                raise
            takes = ", ".join(_describe(a["dtype"], a["shape"]) for a in self.manifest["args"])
            raise ValueError(
                f"{e} (args[0] there is the parameters, args[1] the model's first input): the "
                f"model was exported for inputs ({takes}); export it again for other shapes"
            ) from e

    def apply_delta(self, path: str | Path) -> str:
        """Applies a delta (`jaxembed.serving.DeltaWriter.write`): the rows it names take its
        values, in every leaf it names; the model is then at the delta's version.

        The new leaves are built beside the old ones and swapped in at once: a call running
        meanwhile (from another thread) reads the old parameters or the new ones, whole,
        never a mix. Deltas apply in the order they were written, each to the version it
        was written from.

        Args:
          path: the delta's directory (`delta.json`, `delta.npz`).

        Returns:
          The model's new version.

        Raises:
          FileNotFoundError: no delta at `path`.
          ValueError: a delta of another format or another model, one written from another
            version than this model's (the versions named: apply the deltas in order, or
            load the artifact again), a leaf it names that the model lacks, rows out of a
            leaf's range, values of another shape or dtype, a damaged file (named).
        """
        path = Path(path)
        delta = read_delta(path)
        where = path / DELTA_MANIFEST
        if delta["model"] != self.manifest.get("model"):
            raise ValueError(
                f"{where} is a delta of model {delta['model']!r}, and this model is "
                f"{self.manifest.get('model')!r} ({self.manifest['function']}): apply deltas "
                "written from this model's artifact (DeltaWriter(artifact_path))"
            )
        index = {name: i for i, name in enumerate(self.leaf_names)}
        unknown = [e["name"] for e in delta["leaves"] if e["name"] not in index]
        if unknown:
            raise ValueError(
                f"{where} names leaves {unknown} this model does not have (it has "
                f"{list(self.leaf_names)}): the delta is of another export of the model"
            )
        arrays = _read_npz(path / DELTA_ARRAYS, [k for e in delta["leaves"]
                                                 for k in (f"rows/{e['name']}",
                                                           f"values/{e['name']}")])  # fmt: skip
        with self._updating:  # one delta at a time; calls go on meanwhile
            if delta["base_version"] != self.version:
                raise ValueError(
                    f"{where} was written from version {delta['base_version']!r} and this "
                    f"model is at version {self.version!r}: apply the deltas in the order they "
                    "were written (each names the version it follows), or load the artifact "
                    "again and apply those written since its version"
                )
            leaves = list(self._leaves)
            for entry in delta["leaves"]:
                name = entry["name"]
                i = index[name]
                rows, values = arrays[f"rows/{name}"], arrays[f"values/{name}"]
                leaves[i] = _patched(leaves[i], rows, values, self.manifest["params"][i], where)
            self._leaves = tuple(leaves)  # the swap: one assignment
            self.params = dict(zip(self.leaf_names, self._leaves, strict=True))
            self.version = delta["version"]
        return self.version

    def _checked(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """`args` with each integer input checked against the exported dtype and cast to it;
        unchanged where their structure is not the exported one (jax then says so)."""
        if len(args) != len(self._arg_trees):
            return args
        out, flat_index = [], 0
        for position, (arg, tree) in enumerate(zip(args, self._arg_trees, strict=True)):
            leaves, structure = jax.tree.flatten(arg)
            if structure != tree:
                return args
            checked = []
            for leaf in leaves:
                name = self._arg_names[flat_index] if flat_index < len(self._arg_names) else None
                label = f"argument {position}" + (f" ({name})" if name else "")
                checked.append(_checked_input(leaf, self._arg_avals[flat_index], label))
                flat_index += 1
            out.append(jax.tree.unflatten(structure, checked))
        return tuple(out)

    def __repr__(self) -> str:
        args = ", ".join(_describe(a["dtype"], a["shape"]) for a in self.manifest["args"])
        native = self.manifest["native_targets"]
        return (
            f"Model({self.manifest['function']}({args}), {len(self.leaf_names)} parameter "
            f"leaves, platforms={tuple(self.manifest['platforms'])}"
            f"{f', native={tuple(native)}' if native else ''})"
        )


def _checked_input(x: Any, aval: Any, label: str) -> Any:
    """`x` for an input exported as `aval`: cast to its integer dtype where every value fits.

    Non-integer inputs, traced ones and non-arrays pass unchanged (jax checks them).
    """
    want = np.dtype(aval.dtype)
    if want.kind not in "iu" or isinstance(x, jax.core.Tracer):
        return x
    if isinstance(x, bool | int | float | np.generic):
        x = np.asarray(x)
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        return x
    got = np.dtype(x.dtype)
    if got == want:
        return x
    exported = _describe(want, aval.shape)
    if got.kind not in "iu":
        raise TypeError(
            f"{label} is {_describe(got, x.shape)}, and the model was exported for {exported}: "
            f"the loader never rounds or converts {got.name} to integers; pass an integer array "
            f"(x.astype(np.{want.name}) where x holds whole ids, e.g. ids read as floats)"
        )
    if want == np.uint32 and got.itemsize == 8:
        raise ValueError(
            f"{label} is {_describe(got, x.shape)}, and the model was exported for {exported}, "
            "a dynamic table's keys (each 64-bit id as its low and high 32 bits) or other "
            "32-bit values: a 64-bit array is refused there whatever its values, since jax would "
            "narrow it and 64-bit ids look like keys' halves. Convert 64-bit ids to keys on the "
            "host: keys = ids.astype(np.uint64).view(np.uint32).reshape(*ids.shape, 2) on a "
            "little-endian host ([..., 0] the low 32 bits, [..., 1] the high; "
            "jaxembed.dynamic.as_keys(ids) where jaxembed is installed); cast keys' halves held "
            "in a 64-bit array with x.astype(np.uint32)"
        )
    if not np.can_cast(got, want) and x.size:
        info, wide = np.iinfo(want), np.iinfo(got)
        if int(x.min()) < info.min or int(x.max()) > info.max:
            host = np.asarray(x)
            low, high = max(info.min, wide.min), min(info.max, wide.max)
            index = np.unravel_index(np.argmax((host < low) | (host > high)), host.shape)
            index = tuple(int(i) for i in index)
            raise ValueError(
                f"{label} is {_describe(got, x.shape)}, and its value {host[index]} at index "
                f"{index} does not fit {want.name}, the dtype the model was exported for "
                f"({exported}; {want.name} holds {info.min} to {info.max}). Such values are "
                "refused, never narrowed (with x64 off, jax reads int64 id 2**32 + 7 as row 7): "
                f"map such ids into the {want.name} range before serving (e.g. hash them into "
                "the table's rows), or export and serve the model with jax_enable_x64 on for "
                "int64 ids"
            )
    return x.astype(want)


def read_delta(path: str | Path) -> dict[str, Any]:
    """A delta's `delta.json`, checked for the format and the keys `apply_delta` reads.

    Raises:
      FileNotFoundError: `path` holds no `delta.json`.
      ValueError: another format, a file that is not a JSON object or lacks keys (named).
    """
    file = Path(path) / DELTA_MANIFEST
    delta = _read_json(file, "delta", "apply_delta takes the directory DeltaWriter.write "
                       "wrote (delta.json, delta.npz)")  # fmt: skip
    if not isinstance(delta, dict) or delta.get("format") != DELTA_FORMAT:
        got = delta.get("format") if isinstance(delta, dict) else type(delta).__name__
        raise ValueError(
            f"{file} is of format {got!r}, and this loader applies {DELTA_FORMAT!r}: write it "
            "again with jaxembed.serving.DeltaWriter of this jaxembed"
        )
    missing = [k for k in ("model", "base_version", "version", "leaves") if k not in delta]
    if missing:
        raise _damaged(file, f"lacks the keys {missing}")
    return delta


def _patched(leaf: Any, rows: np.ndarray, values: np.ndarray, entry: Mapping[str, Any],
             where: Path) -> Any:  # fmt: skip
    """`leaf` with `leaf[rows] = values`, a new array (the old one may be in use)."""
    name, shape = entry["name"], tuple(entry["shape"])
    dtype = jnp.dtype(entry["dtype"])
    if stored_dtype(dtype) != dtype and values.dtype == stored_dtype(dtype):
        values = values.view(dtype)  # bfloat16's bits, stored as uint16
    if not shape:  # a scalar leaf: replaced whole
        want = ()
    else:
        want = (len(rows), *shape[1:])
        if rows.ndim != 1 or not np.issubdtype(rows.dtype, np.integer):
            raise ValueError(f"{where}: the rows of leaf {name} are not a 1-D integer array")
        if len(rows) and (rows.min() < 0 or rows.max() >= shape[0]):
            raise ValueError(
                f"{where}: leaf {name} has {shape[0]} rows, and the delta writes row "
                f"{int(rows.max() if rows.max() >= shape[0] else rows.min())}: the delta is of "
                "another export of the model"
            )
    if values.shape != want or jnp.dtype(values.dtype) != dtype:
        raise ValueError(
            f"{where}: leaf {name} takes {_describe(dtype, want)} values, the delta holds "
            f"{_describe(values.dtype, values.shape)}: the delta is of another export"
        )
    if not shape:
        return jax.device_put(values, leaf.sharding)
    return leaf.at[rows].set(jax.device_put(values, leaf.sharding))


def load(
    path: str | Path,
    *,
    register: Callable[[], Any] | None = None,
    params: Mapping[str, Any] | None = None,
    device: Any = None,
    compile: bool = True,
) -> Model:
    """Loads an artifact saved by `jaxembed.serving.save`, ready to call.

    Args:
      path: the artifact's directory.
      register: called first, to register the FFI targets of an artifact that calls native
        kernels (`jaxembed.serving.register`); required for one, ignored otherwise.
      params: `{leaf name: array}` replacing leaves of `params.npz` (e.g. retrained weights
        of the same shapes, or `Model.params` of another artifact of the model saved with
        `params=False`); each is checked against the exported dtype and shape.
      device: where the parameters live and the function runs; default `jax.devices()[0]`.
      compile: compile for the exported shapes now, not on the first call.

    Returns:
      A `Model`: `model(*args)` runs the exported function on the loaded parameters.

    Raises:
      FileNotFoundError: no artifact at `path`.
      ValueError: another format; a file that does not read (`manifest.json`, `params.npz`
        or `exported.bin` truncated, empty or of something else: named, with the fix); a
        leaf missing or of another dtype or shape (named); a function exported for more
        devices than one or a platform this process lacks.
      RuntimeError: a native artifact without `register`, or whose targets are not
        registered after it.
    """
    path = Path(path)
    manifest = read_manifest(path)
    native = manifest["native_targets"]
    if native and register is None:
        raise RuntimeError(
            f"{path} calls jaxembed's native kernels (FFI targets {', '.join(native)}), which "
            "must be registered before it runs: load(path, register=jaxembed.serving.register) "
            "in a process with jaxembed, or export the model again with impl='xla' in every "
            "lookup and native=False, which needs no jaxembed"
        )
    if register is not None:
        register()
    exported = _deserialize(path / EXPORTED, manifest)
    device = jax.devices()[0] if device is None else device
    if exported.nr_devices != 1:
        raise ValueError(
            f"{path} was exported for {exported.nr_devices} devices, and this loader runs "
            "one-device functions: export the lookups without a mesh (or on a 1-device mesh)"
        )
    if device.platform not in exported.platforms:
        raise ValueError(
            f"{path} was exported for platforms {exported.platforms}, not {device.platform!r}: "
            f"export it with platforms=('{device.platform}', ...)"
        )
    leaves = _read_leaves(path, manifest, params)
    taken = exported.in_tree.children()[0].children()[0]  # ((leaves, *args), {}) -> leaves
    if taken.num_leaves != len(leaves):
        raise ValueError(
            f"{path / MANIFEST} names {len(leaves)} parameter leaves, but {EXPORTED} takes "
            f"{taken.num_leaves}: the files are of different exports; save the artifact again"
        )
    for leaf, aval, entry in zip(leaves, exported.in_avals, manifest["params"], strict=False):
        _check_leaf(entry["name"], leaf, {"dtype": aval.dtype.name, "shape": aval.shape}, EXPORTED)
    model = Model(exported, manifest, leaves, device)
    if compile:
        try:
            model.compile()
        except jax.errors.JaxRuntimeError as e:
            if "FFI handler" not in str(e):
                raise
            raise RuntimeError(
                f"{path} calls FFI targets {', '.join(native)} that this process has not "
                f"registered ({e}): pass register=jaxembed.serving.register"
            ) from e
    return model
