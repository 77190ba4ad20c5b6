"""The quantized sweep's cells, a seeded sample of them, and the bytes every runner reads.

A cell is one quantized table and one feature read by bags (`Cell`): `precision` (`"int8"`,
`"int4"`: FBGEMM's row-wise formats with float16 scale and bias), `rows` x `dim`, `batch` bags of
1 to 20 ids (lengths uniform), ids drawn `ids` (`"uniform"`, or `"zipf1.1"` and the like: rank k
with weight k^-s, id = k - 1, the hot ids first; `jaxembed.workloads.zipf_ids`), sum pooling.

Cells of one table (precision, rows, dim) form a group: `write_table` puts the table on disk
once, as jaxembed holds it (`data.npy` uint8 `[V, dim·bits/8]`, `scale.npy` and `bias.npy`
float16 `[V]`); FBGEMM's runner builds its fused rows `[scale, bias, data]` from the same bytes
(`fused_rows`). The values are random codes with scales in [1e-3, 1e-2) and biases in [-1, 0):
a lookup's speed does not depend on them, and a 1e7 x 128 table takes seconds to draw instead
of a quantization of 5 GB of floats. `write_ids` puts a cell's batches (CSR: `values_{k}` int32,
`lengths_{k}` int32 `[batch]`) in one `.npz`. This module needs numpy only (FBGEMM's Python has
no jax).

Examples:
  >>> cells = sample_cells(8, seed=0)
  >>> len(cells), len({c.table for c in cells}), sorted({c.rows for c in cells})
  (48, 8, [10000, 1000000, 10000000])
  >>> Cell("int8", 4096, 1_000_000, 64, "zipf1.1").name
  'int8,batch=4096,rows=1e6,dim=64,ids=zipf1.1'
  >>> Cell.parse("int4,batch=64,rows=1e7,dim=128,ids=uniform").rows
  10000000
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import numpy as np

from jaxembed.workloads import zipf_ids

__all__ = [
    "BATCHES", "DIMS", "IDS", "ISSUE_CELLS", "MAX_IDS", "PRECISIONS", "ROWS", "Cell",
    "fused_rows", "read_ids", "read_table", "sample_cells", "write_ids", "write_table",
]  # fmt: skip

PRECISIONS = ("int8", "int4")
BATCHES = (64, 512, 4096)
ROWS = (10_000, 1_000_000, 10_000_000)
DIMS = (32, 64, 128)
IDS = ("uniform", "zipf1.1")
MAX_IDS = 20
"""Bags hold 1 to `MAX_IDS` ids."""
_BITS = {"int8": 8, "int4": 4}


@dataclasses.dataclass(frozen=True, order=True)
class Cell:
    """One cell of the sweep (see the module's docstring)."""

    precision: str
    batch: int
    rows: int
    dim: int
    ids: str

    @property
    def name(self) -> str:
        return (f"{self.precision},batch={self.batch},rows=1e{round(math.log10(self.rows))},"
                f"dim={self.dim},ids={self.ids}")  # fmt: skip

    @classmethod
    def parse(cls, name: str) -> Cell:
        """The cell `name` names (`Cell.parse(c.name) == c`)."""
        precision, *parts = name.split(",")
        try:
            kv = dict(part.split("=", 1) for part in parts)
            return cls(precision, int(kv["batch"]), int(float(kv["rows"])), int(kv["dim"]),
                       kv["ids"])  # fmt: skip
        except (KeyError, ValueError) as e:
            raise ValueError(
                f"a cell reads like 'int8,batch=4096,rows=1e6,dim=64,ids=zipf1.1', got {name!r}"
            ) from e

    @property
    def table(self) -> tuple[str, int, int]:
        """The group key: cells of one table share its bytes and its runner processes."""
        return (self.precision, self.rows, self.dim)

    @property
    def zipf(self) -> float:
        """The Zipf exponent (0 for uniform ids)."""
        return 0.0 if self.ids == "uniform" else float(self.ids.removeprefix("zipf"))

    @property
    def row_bytes(self) -> int:
        return self.dim * _BITS[self.precision] // 8


ISSUE_CELLS = tuple(Cell(p, 4096, 1_000_000, 64, "zipf1.1") for p in PRECISIONS)
"""The issue's workload (one 1M x 64 table, batch 4096, 1-20 Zipf(1.1) ids a bag)."""


def sample_cells(
    tables: int,
    seed: int = 0,
    *,
    ids: tuple[str, ...] = IDS,
    precisions: tuple[str, ...] = PRECISIONS,
    batches: tuple[int, ...] = BATCHES,
) -> list[Cell]:
    """Every cell (each batch size and id distribution) of `tables` of the grid's tables (all
    of them when 0 or more than the grid holds): the issue's tables first, then a seeded sample
    of the others, each next one the table whose precision, rows and dim have appeared least so
    far (ties drawn at random), so every level appears about equally often. A table's cells
    share its bytes and its runner processes, so a sweep's time grows with its tables.
    """
    grid = [(p, r, d) for p in precisions for r in ROWS for d in DIMS]
    chosen = [c.table for c in ISSUE_CELLS if c.table in grid]
    if tables <= 0 or tables >= len(grid):
        chosen = grid
    else:
        rng = np.random.default_rng(seed)
        rest = [grid[i] for i in rng.permutation(len(grid)) if grid[i] not in chosen]
        seen: dict[tuple[int, Any], int] = {}
        for t in chosen:
            for level in enumerate(t):
                seen[level] = seen.get(level, 0) + 1
        while len(chosen) < tables:
            pick = min(rest, key=lambda t: sum(seen.get(level, 0) for level in enumerate(t)))
            rest.remove(pick)
            chosen.append(pick)
            for level in enumerate(pick):
                seen[level] = seen.get(level, 0) + 1
    return sorted(Cell(p, b, r, d, i) for p, r, d in chosen for b in batches for i in ids)


def write_table(directory: str, precision: str, rows: int, dim: int, seed: int = 0) -> int:
    """Writes a random quantized table (module docstring) into `directory`; its bytes."""
    rng = np.random.default_rng([seed, rows, dim, _BITS[precision]])
    os.makedirs(directory, exist_ok=True)
    width = dim * _BITS[precision] // 8
    data = np.lib.format.open_memmap(os.path.join(directory, "data.npy"), "w+", np.uint8,
                                     (rows, width))  # fmt: skip
    step = max(1, (64 << 20) // max(width, 1))  # 64 MiB at a time
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        data[start:stop] = rng.integers(0, 256, (stop - start, width), dtype=np.uint8)
    data.flush()
    del data
    np.save(os.path.join(directory, "scale.npy"), rng.uniform(1e-3, 1e-2, rows).astype(np.float16))
    np.save(os.path.join(directory, "bias.npy"), rng.uniform(-1, 0, rows).astype(np.float16))
    return rows * (width + 4)


def read_table(directory: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(data, scale, bias)` as `write_table` wrote them (data memory-mapped)."""
    data = np.load(os.path.join(directory, "data.npy"), mmap_mode="r")
    return data, np.load(os.path.join(directory, "scale.npy")), np.load(
        os.path.join(directory, "bias.npy"))  # fmt: skip


def fused_rows(data: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """FBGEMM's IntNBit rows `[scale f16, bias f16, data]` (uint8 `[V, 4 + B]`), the bytes
    `jaxembed.quant.to_fbgemm_rows` writes, without jax."""
    params = np.stack([scale.astype(np.float16), bias.astype(np.float16)], 1).view(np.uint8)
    return np.concatenate([params.reshape(len(data), 4), np.asarray(data)], axis=1)


def write_ids(path: str, cell: Cell, batches: int, seed: int = 0) -> None:
    """Writes the cell's `batches` batches of CSR ids (module docstring) to `path`."""
    out: dict[str, Any] = {"batches": np.array(batches)}
    for k in range(batches):
        rng = np.random.default_rng([seed, k, cell.batch, cell.rows, round(cell.zipf * 100)])
        lengths = rng.integers(1, MAX_IDS + 1, cell.batch, dtype=np.int32)
        total = int(lengths.sum())
        values = (rng.integers(0, cell.rows, total, dtype=np.int32) if cell.zipf == 0
                  else zipf_ids(rng, total, cell.rows, cell.zipf))  # fmt: skip
        out[f"values_{k}"], out[f"lengths_{k}"] = values.astype(np.int32), lengths
    np.savez(path, **out)


def read_ids(path: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """The `(values, lengths)` of each batch `write_ids` wrote."""
    with np.load(path) as f:
        return [(f[f"values_{k}"], f[f"lengths_{k}"]) for k in range(int(f["batches"]))]
