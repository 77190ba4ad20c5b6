"""The grid's cells, a sample of them that covers every level, and each cell's ids on disk.

A cell is one table and one feature read by bags: `batch` bags of `bags` ids (`"1"`: one id a
bag; `"1-20"`, `"1-100"`: lengths uniform in the range), ids drawn `ids` (`"uniform"`, or
`"zipf0.8"` / `"zipf1.1"` / `"zipf1.3"`: rank k with weight k^-s, id = k - 1, the hot ids
first), over a table of `rows` x `dim` float32. The step every implementation runs on it:
sum-pool the bags, `loss = sum(pooled * cotangent)` with a fixed cotangent, row-wise Adagrad
on the rows read (FBGEMM's `EXACT_ROWWISE_ADAGRAD`).

`write_cell` puts a cell's steps on disk as CSR ids (`values_{s}` int32 `[N_s]`, `lengths_{s}`
int32 `[batch]`) and the cotangent: the very same bytes every runner reads (`read_cell`). The
table is not stored: every runner sets every entry to `TABLE_VALUE` (a table of 1e7 x 128 is
5 GB), which the step's speed does not depend on. This module needs numpy only.

Examples:
  >>> cells = sample_cells(12, seed=0)
  >>> len(cells), sorted({c.bags for c in cells})
  (12, ['1', '1-100', '1-20'])
  >>> Cell(4096, 64, "1-20", "zipf1.1", 1_000_000).name
  'batch=4096,dim=64,bags=1-20,ids=zipf1.1,rows=1e6'
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxembed.workloads import zipf_ids

__all__ = [
    "BAGS", "BATCHES", "DIMS", "IDS", "ROWS", "TABLE_VALUE", "Cell", "read_cell",
    "sample_cells", "workload_a_cell", "write_cell",
]  # fmt: skip

BATCHES = (512, 4096, 16384)
DIMS = (16, 64, 128)
BAGS = ("1", "1-20", "1-100")
IDS = ("uniform", "zipf0.8", "zipf1.1", "zipf1.3")
ROWS = (1_000, 10_000, 100_000, 1_000_000, 10_000_000)
TABLE_VALUE = 0.01
"""Every entry of a grid table before the first step (the same on every runner)."""
LEARNING_RATE, EPS = 0.05, 1e-8


@dataclasses.dataclass(frozen=True)
class Cell:
    """One cell of the grid (see the module's docstring)."""

    batch: int
    dim: int
    bags: str
    ids: str
    rows: int

    @property
    def name(self) -> str:
        return (f"batch={self.batch},dim={self.dim},bags={self.bags},ids={self.ids},"
                f"rows=1e{round(math.log10(self.rows))}")  # fmt: skip

    @property
    def lengths_range(self) -> tuple[int, int]:
        lo, _, hi = self.bags.partition("-")
        return int(lo), int(hi or lo)

    @property
    def zipf(self) -> float:
        """The Zipf exponent (0 for uniform ids)."""
        return 0.0 if self.ids == "uniform" else float(self.ids.removeprefix("zipf"))

    @property
    def table_bytes(self) -> int:
        return self.rows * self.dim * 4


def sample_cells(n: int, seed: int = 0, *, max_table_bytes: int = 3 * 2**30) -> list[Cell]:
    """`n` cells in which every level of every factor appears, each about equally often.

    Each factor's levels are repeated to `n` and shuffled on their own (a Latin-hypercube-like
    sample of the 540-cell grid), with two cells always in: the largest (16384 bags of 1-100
    ids) and the smallest (512 bags of one id). Tables over `max_table_bytes` lose rows (a
    10x step down) until they fit: each runner holds its table, FBGEMM's and jaxembed's
    steps one at a time, on this machine's memory.
    """
    rng = np.random.default_rng(seed)
    columns = []
    for levels in (BATCHES, DIMS, BAGS, IDS, ROWS):
        column = list(itertools.islice(itertools.cycle(levels), n))
        rng.shuffle(column)
        columns.append(column)
    cells = [Cell(*row) for row in zip(*columns, strict=True)]
    if n >= 2:
        cells[0] = dataclasses.replace(cells[0], batch=BATCHES[-1], bags=BAGS[-1])
        cells[1] = dataclasses.replace(cells[1], batch=BATCHES[0], bags=BAGS[0])
    out = []
    for c in cells:
        while c.table_bytes > max_table_bytes and c.rows > ROWS[0]:
            c = dataclasses.replace(c, rows=c.rows // 10)
        out.append(c)
    return out


def workload_a_cell(batch: int = 4096) -> list[Cell]:
    """The issue's workload (a) as cells: 8 tables of 1e6 .. 100 rows x 64, 1-20 Zipf(1.1)."""
    return [
        Cell(batch, 64, "1-20", "zipf1.1", r)
        for r in (1_000_000, 500_000, 100_000, 100_000, 50_000, 10_000, 1_000, 100)
    ]


def write_cell(path: str, cells: Sequence[Cell], *, steps: int = 4, seed: int = 0) -> None:
    """Writes the cells' `steps` batches of ids (CSR) and cotangents to one `.npz`.

    Several cells in one file are one step over several tables (workload (a)): feature i reads
    table i, `values_{s}_{i}`, `lengths_{s}_{i}`, cotangent `[batch, F, dim]`.
    """
    batch, dim = cells[0].batch, cells[0].dim
    if any((c.batch, c.dim) != (batch, dim) for c in cells):
        raise ValueError("the cells of one file share their batch and dim")
    out: dict[str, Any] = {
        "cells": np.array([[c.batch, c.dim, *c.lengths_range, c.rows] for c in cells]),
        "zipf": np.array([c.zipf for c in cells]),
        "names": np.array([c.name for c in cells]),
    }
    for s in range(steps):
        for i, c in enumerate(cells):
            rng = np.random.default_rng([seed, s, i])
            lo, hi = c.lengths_range
            lengths = rng.integers(lo, hi + 1, size=batch, dtype=np.int32)
            total = int(lengths.sum())
            ids = (rng.integers(0, c.rows, total, dtype=np.int32) if c.zipf == 0
                   else zipf_ids(rng, total, c.rows, c.zipf))  # fmt: skip
            out[f"values_{s}_{i}"], out[f"lengths_{s}_{i}"] = ids, lengths
    out["cotangent"] = np.random.default_rng([seed, 1 << 20]).standard_normal(
        (batch, len(cells), dim), dtype=np.float32)  # fmt: skip
    out["steps"] = np.array(steps)
    np.savez(path, **out)


def read_cell(path: str) -> dict[str, Any]:
    """What `write_cell` wrote: `rows` (per table), `batch`, `dim`, `steps` of
    `[(values, lengths), ...]` per table, `cotangent`, `names`."""
    with np.load(path) as f:
        cells = f["cells"]
        steps = int(f["steps"])
        n = len(cells)
        return {
            "rows": [int(r) for r in cells[:, 4]], "batch": int(cells[0, 0]),
            "dim": int(cells[0, 1]), "max_ids": [int(h) for h in cells[:, 3]],
            "names": [str(x) for x in f["names"]], "cotangent": f["cotangent"],
            "steps": [[(f[f"values_{s}_{i}"], f[f"lengths_{s}_{i}"]) for i in range(n)]
                      for s in range(steps)],
        }  # fmt: skip
