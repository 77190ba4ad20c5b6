"""Fresh rows for a model being served: the rows that changed since an export, as a delta.

A recommender keeps training while it serves. Re-exporting and reloading the whole model
for every refresh moves every table; a delta moves the rows that changed:

    writer = DeltaWriter("artifacts/ranker")          # the saved artifact: its parameters
    ...train...
    writer.write(params, "deltas/0001")               # the rows changed since the export
    ...train...
    writer.write(params, "deltas/0002")               # ... since delta 0001

    model = loader.load("artifacts/ranker")           # the serving process (no jaxembed)
    model.apply_delta("deltas/0001")                  # requests keep running meanwhile
    model.apply_delta("deltas/0002")

A delta is a directory of `delta.json` (the model it is for, the version it follows, the
version it makes, and each leaf it changes with its count of rows) and `delta.npz` (per
leaf, `rows/<name>` the indices along the first axis and `values/<name>` their new values).
A row is changed where any of its bytes differ (bitwise: a NaN written again is no change).
A scalar leaf that changed is written whole. Versions chain: the export's version is a digest
of its parameters' bytes, and each delta's a digest of the version it follows and its own
rows, so `Model.apply_delta` refuses a delta written for another model, or from a version
the model is not at.

The writer keeps a host copy of the parameters as of the last delta (the size of the
parameters, in host memory), so that each delta holds the rows changed since the one before.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxembed.serving import loader

__all__ = ["DeltaWriter"]


def _changed_rows(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """int64 indices of the rows (along axis 0) where `new` differs from `old`, bitwise."""
    if old.ndim == 0:
        return np.zeros(0 if old.tobytes() == new.tobytes() else 1, np.int64)
    width = old.dtype.itemsize * (old.size // max(old.shape[0], 1))
    a = np.ascontiguousarray(old).view(np.uint8).reshape(old.shape[0], width)
    b = np.ascontiguousarray(new).view(np.uint8).reshape(new.shape[0], width)
    return np.flatnonzero(np.any(a != b, axis=1)).astype(np.int64)


class DeltaWriter:
    """Writes the rows of a model's parameters that changed since its export (then since the
    writer's last delta), for `Model.apply_delta` of the serving process.

    Args:
      artifact: the directory `jaxembed.serving.save` wrote with its parameters
        (`params.npz`); the writer reads them once.

    Attributes:
      model: the model the deltas are for (the manifest's `model`).
      version: the version the next delta follows (the export's, then the last delta's).

    Raises:
      ValueError: an artifact saved without parameters, or before artifacts named their
        model and version (save it again).

    Examples:
      >>> import tempfile
      >>> import jax.numpy as jnp
      >>> import jaxembed
      >>> from jaxembed import serving
      >>> def fn(params, ids):
      ...     return jaxembed.embedding_bag(ids, params["table"], combiner="sum")
      >>> params = {"table": jnp.zeros((100, 4))}
      >>> path = serving.save(serving.export_inference(fn, params, jnp.zeros((2, 3), jnp.int32)),
      ...                     tempfile.mkdtemp())
      >>> model = serving.load(path)
      >>> writer = serving.DeltaWriter(path)
      >>> params = {"table": params["table"].at[7].set(1.0)}        # training changed row 7
      >>> delta = writer.write(params, tempfile.mkdtemp())
      >>> json.loads((delta / "delta.json").read_text())["leaves"]
      [{'name': "['table']", 'rows': 1}]
      >>> _ = model.apply_delta(delta)
      >>> model(jnp.array([[7, 7, -1], [1, -1, -1]])).tolist()
      [[2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 0.0]]
    """

    def __init__(self, artifact: str | Path):
        path = Path(artifact)
        self.manifest = loader.read_manifest(path)
        for key in ("model", "version"):
            if key not in self.manifest:
                raise ValueError(
                    f"{path / loader.MANIFEST} names no {key}: it was saved before artifacts "
                    "took deltas; export and save the model again"
                )
        if not self.manifest.get("params_file"):
            raise ValueError(
                f"{path} was saved without its parameters (save(..., params=False)): give the "
                "writer the artifact that holds them"
            )
        self.model = self.manifest["model"]
        self.version = self.manifest["version"]
        self._leaves = loader._read_leaves(path, self.manifest, None)  # the export's values

    def write(self, params: Any, path: str | Path) -> Path:
        """Writes the rows of `params` that differ from the last written values into the
        directory `path` (made if missing), and moves the writer to the delta's version.

        Args:
          params: the model's parameters now, the pytree `export_inference` took (the same
            structure, leaf shapes and dtypes; 64-bit leaves as exported with x64 off).
          path: the delta's directory.

        Returns:
          `path`, as a `Path`.

        Raises:
          ValueError: a tree with other leaves than exported (the names), a leaf of another
            shape (named).
        """
        with_paths, _ = jax.tree_util.tree_flatten_with_path(params)
        names = [jax.tree_util.keystr(p) for p, _ in with_paths]
        entries = self.manifest["params"]
        if names != [e["name"] for e in entries]:
            raise ValueError(
                f"params has the leaves {names}, and the model was exported with "
                f"{[e['name'] for e in entries]}: pass the tree export_inference took"
            )
        digest = hashlib.sha256(self.version.encode())
        arrays, changed, new_leaves = {}, [], []
        for (_, value), entry, old in zip(with_paths, entries, self._leaves, strict=True):
            given = np.asarray(jax.device_get(value))
            new = given.astype(old.dtype, copy=False)
            if given.dtype != old.dtype and given.dtype.kind in "iub" and not np.array_equal(
                new.astype(given.dtype), given
            ):  # never a silent narrowing: e.g. int64 ids beyond the exported int32
                raise ValueError(
                    f"params{entry['name']} is {given.dtype.name} holding values that "
                    f"{old.dtype.name} (the exported dtype) does not: pass values that fit, "
                    "or export the model again with this dtype (x64 on)"
                )
            if new.shape != old.shape:
                raise ValueError(
                    f"params{entry['name']} is {new.dtype.name}{list(new.shape)}, and the model "
                    f"was exported with {old.dtype.name}{list(old.shape)}"
                )
            rows = _changed_rows(old, new)
            new_leaves.append(new.copy())
            if not len(rows):
                continue
            name = entry["name"]
            values = new if new.ndim == 0 else new[rows]
            stored = values.view(loader.stored_dtype(values.dtype))
            arrays[f"rows/{name}"], arrays[f"values/{name}"] = rows, stored
            changed.append({"name": name, "rows": len(rows)})
            for part in (name.encode(), rows.tobytes(), np.ascontiguousarray(stored).tobytes()):
                digest.update(part)
        version = digest.hexdigest()[:16]
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        with open(path / loader.DELTA_ARRAYS, "wb") as f:
            np.savez(f, **arrays)
        delta = {"format": loader.DELTA_FORMAT, "model": self.model,
                 "base_version": self.version, "version": version, "leaves": changed}  # fmt: skip
        (path / loader.DELTA_MANIFEST).write_text(json.dumps(delta, indent=1) + "\n")
        self._leaves, self.version = new_leaves, version
        return path
