"""A tiered table's backing store on CPU: its rows and row-wise optimizer state in files.

A store is a directory of raw memory-mapped files and one small JSON header:

    header.json         {"format", "version", "rows", "dim", "dtype", "slots", "count"}
    table.bin           dtype[rows, dim]            the table's rows
    slot.<name>.bin     float32[rows, *shape]       one per optimizer slot (`accumulator`, ...)

The files are `numpy.memmap`s, so a store may be larger than RAM: reading a batch's rows
(`read`) touches their pages alone, and writing them back (`write`) dirties those pages,
which the OS writes out (`flush` forces it). The header is written last, atomically
(`os.replace`), so a directory without one is no store. Raw files rather than `.npy` keep
every dtype jax has (bfloat16 included); the header says what they hold, and `open` checks
the files' sizes against it.

Examples:
  >>> import tempfile, numpy as np
  >>> d = tempfile.mkdtemp()
  >>> s = TableStore.create(f"{d}/t", rows=6, dim=2, slots=[("accumulator", (), 0.0)],
  ...                       table=np.arange(12.0).reshape(6, 2))
  >>> rows, slots = s.read(np.array([4, 1]))
  >>> rows.tolist(), slots["accumulator"].tolist()
  ([[8.0, 9.0], [2.0, 3.0]], [0.0, 0.0])
  >>> s.write(np.array([1]), np.array([[7.0, 7.0]]), {"accumulator": np.array([0.5])})
  >>> s.flush()
  >>> TableStore.open(f"{d}/t").table[1].tolist()
  [7.0, 7.0]
  >>> TableStore.open(f"{d}/t", rows=6, dim=4)
  Traceback (most recent call last):
  ...
  ValueError: the store at ... holds float32[6, 2] with slots ['accumulator'], but float32[6, 4] ...
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

__all__ = ["FORMAT", "StoreSlot", "TableStore"]

FORMAT = "jaxembed.tiered.TableStore"
_VERSION = 1
_HEADER = "header.json"
_CHUNK = 1 << 16  # rows copied or filled a pass


class StoreSlot(NamedTuple):
    """One row-wise optimizer array of a store: `float32[rows, *shape]`, starting at `init`.

    `shape` is `()` for one float a row (row-wise Adagrad's accumulator) or `(dim,)` for one
    a column (Adam's moments).
    """

    name: str
    shape: tuple[int, ...]
    init: float


def _dtype_name(dtype: Any) -> str:
    return np.dtype(jnp.dtype(dtype)).name


def _describe(dtype: str, rows: int, dim: int, slots: Sequence[str]) -> str:
    return f"{dtype}[{rows}, {dim}] with slots {sorted(slots)}"


class TableStore:
    """A table's rows and row-wise optimizer state in memory-mapped files.

    Make one with `TableStore.create` or `TableStore.open`, not the constructor.

    Attributes:
      path: the store's directory.
      rows, dim: the table's shape.
      dtype: the table's dtype (the slots are float32).
      slots: the optimizer slots, `StoreSlot`s, in the header's order.
      table: the rows, a writable `numpy.memmap` `[rows, dim]`.
      slot_arrays: each slot's `numpy.memmap` `[rows, *shape]`, by name.
      count: the optimizer's step count as last flushed (lazy Adam's bias correction and
        schedules continue from it).
    """

    def __init__(self, path: str, header: dict[str, Any], mode: str) -> None:
        self.path = os.fspath(path)
        self.rows, self.dim = int(header["rows"]), int(header["dim"])
        self.dtype = np.dtype(jnp.dtype(header["dtype"]))
        self.slots = tuple(StoreSlot(s["name"], tuple(s["shape"]), float(s["init"]))
                           for s in header["slots"])  # fmt: skip
        self.count = int(header.get("count", 0))
        self.table = self._map("table.bin", self.dtype, (self.rows, self.dim), mode)
        self.slot_arrays = {
            s.name: self._map(f"slot.{s.name}.bin", np.float32, (self.rows, *s.shape), mode)
            for s in self.slots
        }

    def _map(self, name: str, dtype: Any, shape: tuple[int, ...], mode: str) -> np.memmap:
        file = os.path.join(self.path, name)
        want = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if mode != "w+":
            got = os.path.getsize(file) if os.path.exists(file) else None
            if got != want:
                raise ValueError(
                    f"the store at {self.path!r}: {name} has {got} bytes, but its header says "
                    f"{np.dtype(dtype).name}{list(shape)} ({want} bytes): the store is damaged "
                    "or was written by something else; restore it from a checkpoint"
                )
        return np.memmap(file, dtype=dtype, mode=mode, shape=shape)

    # --- construction ----------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        path: str,
        *,
        rows: int,
        dim: int,
        dtype: Any = np.float32,
        slots: Sequence[StoreSlot | tuple[str, tuple[int, ...], float]] = (),
        table: Any = None,
        overwrite: bool = False,
    ) -> TableStore:
        """A new store of `rows` x `dim`, its rows from `table` (zeros without), its slots
        at their initial values.

        Args:
          path: a directory (made if missing; it must not hold a store unless `overwrite`).
          rows, dim: the table's shape.
          dtype: the table's dtype (float32, bfloat16, ...).
          slots: the optimizer's row-wise arrays, `StoreSlot(name, shape, init)` or tuples.
          table: the initial rows, any array-like `[rows, dim]` that slices (a numpy array or
            memmap: copied `65536` rows a pass, so it may itself be larger than RAM), or None
            (zeros). The memmap `store.table` may also be written after `create`.
          overwrite: replace a store already at `path`.

        Returns:
          The store, open for reading and writing.

        Raises:
          ValueError: a shape that is not positive, a table of another shape, a store
            already at `path` without `overwrite`.
        """
        path = os.fspath(path)
        for name, v in (("rows", rows), ("dim", dim)):
            if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive int")
        if os.path.exists(os.path.join(path, _HEADER)) and not overwrite:
            raise ValueError(
                f"a store already exists at {path!r}: open it (TableStore.open(path)), pass "
                "overwrite=True to replace it, or choose another path"
            )
        if table is not None and tuple(np.shape(table)) != (rows, dim):
            raise ValueError(
                f"table has shape {tuple(np.shape(table))}, but the store is [{rows}, {dim}]"
            )
        slots = tuple(StoreSlot(str(n), tuple(int(d) for d in s), float(i)) for n, s, i in slots)
        os.makedirs(path, exist_ok=True)
        if os.path.exists(os.path.join(path, _HEADER)):
            os.remove(os.path.join(path, _HEADER))  # a half-written store is no store
        header = dict(
            format=FORMAT, version=_VERSION, rows=int(rows), dim=int(dim),
            dtype=_dtype_name(dtype), count=0,
            slots=[dict(name=s.name, shape=list(s.shape), init=s.init) for s in slots],
        )  # fmt: skip
        store = cls(path, header, "w+")
        for lo in range(0, rows, _CHUNK):
            hi = min(rows, lo + _CHUNK)
            if table is not None:
                store.table[lo:hi] = np.asarray(table[lo:hi]).astype(store.dtype)
            for s in slots:  # w+ files start at zero; other values are written
                if s.init != 0.0:
                    store.slot_arrays[s.name][lo:hi] = s.init
        store.flush()
        return store

    @classmethod
    def open(
        cls,
        path: str,
        *,
        rows: int | None = None,
        dim: int | None = None,
        dtype: Any = None,
        slots: Sequence[str] | None = None,
        readonly: bool = False,
    ) -> TableStore:
        """The store at `path`, checked against what the caller expects of it.

        Args:
          path: the store's directory.
          rows, dim, dtype: the table's shape and dtype the caller expects (None: any).
          slots: the optimizer slot names the caller expects (None: any).
          readonly: map the files read-only (a checkpoint), not for reading and writing.

        Returns:
          The store, open for reading (and writing unless `readonly`).

        Raises:
          FileNotFoundError: no store at `path` (no header).
          ValueError: a header of another format, or a store of another shape, dtype or
            slots than expected, naming both and the fix.
        """
        path = os.fspath(path)
        file = os.path.join(path, _HEADER)
        if not os.path.exists(file):
            raise FileNotFoundError(
                f"no store at {path!r} (no {_HEADER}): make one with TableStore.create(path, "
                "rows=..., dim=...)"
            )
        with open(file) as f:
            header = json.load(f)
        if header.get("format") != FORMAT or header.get("version") != _VERSION:
            raise ValueError(
                f"{file} is not a {FORMAT} header of version {_VERSION}: got format "
                f"{header.get('format')!r}, version {header.get('version')!r}"
            )
        held = (header["dtype"], int(header["rows"]), int(header["dim"]),
                [s["name"] for s in header["slots"]])  # fmt: skip
        want = (
            held[0] if dtype is None else _dtype_name(dtype),
            held[1] if rows is None else int(rows),
            held[2] if dim is None else int(dim),
            held[3] if slots is None else list(slots),
        )
        if (want[0], want[1], want[2], sorted(want[3])) != (*held[:3], sorted(held[3])):
            raise ValueError(
                f"the store at {path!r} holds {_describe(*held)}, but {_describe(*want)} was "
                "asked for: open it with the shape, dtype and optimizer it was made with, or "
                "create a new store of the new shape (TableStore.create) and copy the rows "
                "into it"
            )
        return cls(path, header, "r" if readonly else "r+")

    # --- rows ------------------------------------------------------------------------------

    def check_ids(self, ids: np.ndarray) -> np.ndarray:
        """`ids` as int64, or raises ValueError naming the first outside `[0, rows)`."""
        ids = np.asarray(ids).astype(np.int64).reshape(-1)
        bad = (ids < 0) | (ids >= self.rows)
        if bad.any():
            first = int(ids[np.argmax(bad)])
            raise ValueError(f"id {first} is outside the store's rows [0, {self.rows})")
        return ids

    def read(self, ids: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The rows `ids` (int `[K]`) and their slots: `(dtype[K, dim], {name: f32[K, ...]})`,
        copies read in ascending id order (the pages in file order).

        Ids already ascending (what `TieredTable` passes) are read as they are, with one
        vectorized `numpy.take` a file (no sort, no reordering)."""
        ids = self.check_ids(ids)
        if _ascending(ids):
            return self._take(ids)
        order = np.argsort(ids, kind="stable")
        rows, slots = self._take(ids[order])
        back = np.empty_like(order)
        back[order] = np.arange(order.size)
        return rows[back], {n: a[back] for n, a in slots.items()}

    def read_into(self, ids: np.ndarray, rows: np.ndarray, slots: dict[str, np.ndarray]) -> None:
        """The rows `ids` (int64 `[K]`, ascending, in range: not checked) and their slots
        read into the first K rows of `rows` and of each of `slots` (preallocated buffers)."""
        k = ids.size
        table, views = self._views
        np.take(table, ids, axis=0, out=rows[:k])
        for n, v in views.items():
            np.take(v, ids, axis=0, out=slots[n][:k])

    def _take(self, at: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        # `take` on plain ndarray views of the maps: a memmap's own fancy indexing wraps
        # every result in a memmap, several times slower for a batch's rows.
        rows = np.take(self._views[0], at, axis=0)
        return rows, {n: np.take(v, at, axis=0) for n, v in self._views[1].items()}

    def write(self, ids: np.ndarray, rows: np.ndarray, slots: dict[str, np.ndarray]) -> None:
        """Rows `ids` (distinct ints `[K]`) and their slots set to `rows` and `slots`, in
        ascending id order (ids already ascending are written as they are)."""
        ids = self.check_ids(ids)
        if not ids.size:
            return
        rows = np.asarray(rows)
        slots = {name: np.asarray(slots[name]) for name in self.slot_arrays}
        if not _ascending(ids):
            order = np.argsort(ids, kind="stable")
            ids, rows = ids[order], rows[order]
            slots = {n: a[order] for n, a in slots.items()}
        table, views = self._views
        table[ids] = rows.astype(self.dtype, copy=False)
        for name, v in views.items():
            v[ids] = slots[name]

    @property
    def _views(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The maps as plain ndarrays (the same memory)."""
        return self.table.view(np.ndarray), {
            n: a.view(np.ndarray) for n, a in self.slot_arrays.items()
        }

    @property
    def row_bytes(self) -> int:
        """The bytes of one row with its slots."""
        slot = sum(4 * int(np.prod(s.shape)) for s in self.slots)
        return self.dim * self.dtype.itemsize + slot

    def flush(self) -> None:
        """Every written page out to the files, and the header (with `count`) replaced
        atomically."""
        self.table.flush()
        for a in self.slot_arrays.values():
            a.flush()
        write_header(self.path, self.header())

    def header(self) -> dict[str, Any]:
        """The store's header: what `header.json` holds (with the current `count`)."""
        return dict(
            format=FORMAT, version=_VERSION, rows=self.rows, dim=self.dim,
            dtype=self.dtype.name, count=int(self.count),
            slots=[dict(name=s.name, shape=list(s.shape), init=s.init) for s in self.slots],
        )  # fmt: skip

    def files(self) -> list[str]:
        """The names of the store's data files (the header aside)."""
        return ["table.bin", *(f"slot.{s.name}.bin" for s in self.slots)]

    def __repr__(self) -> str:
        names = [s.name for s in self.slots]
        return (
            f"TableStore({self.path!r}, {_describe(self.dtype.name, self.rows, self.dim, names)})"
        )


def _ascending(ids: np.ndarray) -> bool:
    return bool(ids.size < 2 or (ids[1:] > ids[:-1]).all())


def write_header(path: str, header: dict[str, Any]) -> None:
    """`header.json` in directory `path` replaced atomically: written to a temporary file,
    fsynced, renamed over the old one, and the directory fsynced."""
    tmp = os.path.join(path, _HEADER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(header, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, _HEADER))
    fsync_dir(path)


def fsync_dir(path: str) -> None:
    """A directory's entries (files made, renamed or removed in it) to the disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
