"""Synthetic recommender workloads: tables, features, Zipf ids, and the step every framework runs.

A `Workload` is tables, the features that read them (several features may share a table) and
a batch size. Each step of the benchmark, in every framework:

1. looks up every feature's bags and sum-pools them: `pooled [B, F, H]`, features in order;
2. takes `loss = sum(pooled * cotangent)` with a fixed `cotangent [B, F, H]`, so that
   d loss / d pooled is exactly the cotangent everywhere;
3. updates the tables with row-wise Adagrad as FBGEMM's `EXACT_ROWWISE_ADAGRAD` does: for each
   touched row r, with g_r the sum of the gradients of all its ids in the batch,
   `s_r += mean(g_r²)` and `w_r -= lr * g_r / (sqrt(s_r) + eps)`; `s` starts at 0.

Ids are Zipf over each table's rows (rank k drawn with weight k^-s, id = k - 1, so the hot ids
are the low ids: the hard case for block row sharding; `permute=True` scatters them by a fixed
permutation per table). Bag lengths are uniform in `[min_ids, max_ids]`. The examples train on
these (`examples/dlrm_data.py`); the benchmarks (`jaxembed bench recsys`, in the repository's
`benchmarks/`) time every framework on them and check each against a float64 reference.

This module needs numpy only. Examples:

    >>> w = workload_a(batch_size=8)
    >>> [t.rows for t in w.tables][:3], w.num_ids_expected
    ([1000000, 500000, 100000], 672.0)
    >>> values, lengths = make_batch(w, seed=0, step=0)["f0"]
    >>> values.shape, lengths.shape, values.dtype
    ((160,), (8,), dtype('int32'))
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import numpy as np

__all__ = [
    "CRITEO_KAGGLE_CARDINALITIES", "EPS", "LEARNING_RATE", "Batch", "FeatureSpec", "TableSpec",
    "Workload", "dlrm_workload", "make_batch", "make_cotangent", "make_tables", "workload_a",
    "zipf_ids",
]  # fmt: skip

Batch = dict[str, tuple[np.ndarray, np.ndarray]]
"""One step's input: feature -> (values int32 [B * max_ids], lengths int32 [B])."""

LEARNING_RATE = 0.05
EPS = 1e-8


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """An embedding table: `rows` x `dim` float32."""

    name: str
    rows: int
    dim: int


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    """A sparse feature: bags of `min_ids`..`max_ids` Zipf(`zipf`) ids into `table`."""

    name: str
    table: str
    min_ids: int = 1
    max_ids: int = 20
    zipf: float = 1.1


@dataclasses.dataclass(frozen=True)
class Workload:
    """Tables, the features that read them (in the order of the pooled output), the batch size.

    Raises:
      ValueError: duplicate names, a feature of an unknown table, bad bag lengths, a Zipf
        exponent <= 0, or tables of different dims (the pooled output is `[B, F, dim]`).
    """

    name: str
    tables: tuple[TableSpec, ...]
    features: tuple[FeatureSpec, ...]
    batch_size: int

    def __post_init__(self):
        known = [t.name for t in self.tables]
        for kind, names in (("table", known), ("feature", [f.name for f in self.features])):
            if len(set(names)) < len(names):
                dup = sorted({n for n in names if names.count(n) > 1})
                raise ValueError(f"workload {self.name!r}: duplicate {kind} names {dup}")
        for f in self.features:
            bad = (f"reads unknown table {f.table!r}: choose from {known}"
                   if f.table not in known else
                   f"need 0 <= min_ids <= max_ids and max_ids >= 1, got {f.min_ids}..{f.max_ids}"
                   if not 0 <= f.min_ids <= f.max_ids or f.max_ids < 1 else
                   f"zipf exponent must be > 0, got {f.zipf}" if f.zipf <= 0 else None)  # fmt: skip
            if bad:
                raise ValueError(f"feature {f.name!r}: {bad}")
        dims = sorted({t.dim for t in self.tables})
        if len(dims) != 1 or self.batch_size < 1 or not self.features:
            raise ValueError(f"workload {self.name!r}: need one dim for all tables (the pooled "
                             f"output is [B, F, dim]), batch_size >= 1 and a feature; got dims "
                             f"{dims}, batch_size={self.batch_size}")  # fmt: skip

    @property
    def dim(self) -> int:
        return self.tables[0].dim

    @property
    def num_ids_expected(self) -> float:
        """Mean ids per step: B x sum over features of the mean bag length."""
        return self.batch_size * sum((f.min_ids + f.max_ids) / 2 for f in self.features)

    @property
    def total_rows(self) -> int:
        return sum(t.rows for t in self.tables)

    def table(self, name: str) -> TableSpec:
        return next(t for t in self.tables if t.name == name)


def workload_a(batch_size: int = 4096) -> Workload:
    """8 tables of 1e6 .. 100 rows x 64, one feature each, bags of 1-20 Zipf(1.1) ids.

    About 345k ids a step at batch 4096; 1.76M rows (451 MB of float32) in all.
    """
    rows = (1_000_000, 500_000, 100_000, 100_000, 50_000, 10_000, 1_000, 100)
    tables = tuple(TableSpec(f"t{i}", r, 64) for i, r in enumerate(rows))
    features = tuple(FeatureSpec(f"f{i}", f"t{i}") for i in range(len(rows)))
    return Workload("workload_a", tables, features, batch_size)


CRITEO_KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
"""Distinct values of the 26 categorical features C1..C26 of Criteo's Kaggle (DAC) data set, as
DLRM's Kaggle preprocessing counts them: 33,762,577 in all."""


def dlrm_workload(batch_size: int = 4096, scale: float = 1 / 8, dim: int = 64) -> Workload:
    """DLRM on Criteo Kaggle, scaled to this machine: 26 multi-hot features over 20 tables.

    Scaling: feature Cj gets `max(10, round(card_j * scale))` rows; features whose scaled row
    counts are equal share one table. At the default `scale=1/8` the tables run from 10 to
    1,266,403 rows, 4.22M rows in all (1.08 GB of float32 at dim 64): with the table, 8 dense
    per-device gradients of its shape and row-wise state, the worst case of 8 simulated
    devices stays under ~10 GB, and a dense Adagrad (keras) adds one table-sized accumulator.
    The seven features of cardinality 3 to 27 (all those under 85) share one 10-row table,
    so 26 features read 20 tables. Bags: 1-20 Zipf(1.1) ids (Criteo is one-hot; the multi-hot
    bags make the pooling and the duplicate-id summing matter), ~1.12M ids a step at 4096.

    Args:
      batch_size: examples per step.
      scale: the factor on Criteo's cardinalities (1.0 is the real 33.8M rows).
      dim: embedding dim of every table.

    Returns:
      The workload; features `C1`..`C26` in Criteo's order, tables `t00`, `t01`, ... in the
      order of the first feature that reads them.
    """
    if not 0 < scale <= 1:
        raise ValueError(f"scale must be in (0, 1], got {scale}: 1/8 gives ~4.2M rows")
    by_rows: dict[int, str] = {}
    features = []
    for j, card in enumerate(CRITEO_KAGGLE_CARDINALITIES, start=1):
        rows = max(10, round(card * scale))
        table = by_rows.setdefault(rows, f"t{len(by_rows):02d}")
        features.append(FeatureSpec(f"C{j}", table))
    tables = tuple(TableSpec(name, rows, dim) for rows, name in by_rows.items())
    return Workload(f"dlrm_criteo_kaggle_x{scale:g}", tables, tuple(features), batch_size)


# --- inputs ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _zipf_cdf(rows: int, s: float) -> np.ndarray:
    cdf = np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -s)
    return cdf / cdf[-1]


@functools.lru_cache(maxsize=64)
def _permutation(table: str, rows: int) -> np.ndarray:
    rng = np.random.default_rng([zlib.crc32(table.encode()), rows])
    return rng.permutation(rows).astype(np.int32)


def zipf_ids(rng: np.random.Generator, n: int, rows: int, s: float) -> np.ndarray:
    """`n` ids in `[0, rows)` with P(id = k - 1) proportional to k^-s (inverse CDF).

    Examples:
      >>> ids = zipf_ids(np.random.default_rng(0), 100_000, rows=1000, s=1.1)
      >>> int(ids.min()), int(ids.max()) < 1000, round(float((ids == 0).mean()), 2)
      (0, True, 0.18)
    """
    ranks = np.searchsorted(_zipf_cdf(rows, float(s)), rng.random(n), side="right")
    return np.minimum(ranks, rows - 1).astype(np.int32)


def make_batch(workload: Workload, seed: int, step: int, *, permute: bool = False) -> Batch:
    """One step's bags, deterministic from `(seed, step)`.

    Args:
      workload: what to draw.
      seed, step: the draw; each feature has its own stream.
      permute: map Zipf ranks through a fixed random permutation per table (hot ids spread
        over the table) instead of id = rank - 1 (hot ids at the low ids).

    Returns:
      feature -> `(values int32 [B * max_ids], lengths int32 [B])`: bag b is the next
      `lengths[b]` values; the tail past `lengths.sum()` is unused and holds 0.
    """
    out: Batch = {}
    b = workload.batch_size
    for i, f in enumerate(workload.features):
        rng = np.random.default_rng([seed, step, i])
        rows = workload.table(f.table).rows
        lengths = rng.integers(f.min_ids, f.max_ids + 1, size=b, dtype=np.int32)
        n = int(lengths.sum())
        ids = zipf_ids(rng, n, rows, f.zipf)
        if permute:
            ids = _permutation(f.table, rows)[ids]
        values = np.zeros(b * f.max_ids, np.int32)
        values[:n] = ids
        out[f.name] = (values, lengths)
    return out


def make_tables(workload: Workload, seed: int) -> dict[str, np.ndarray]:
    """Initial tables: float32 `[rows, dim]`, uniform in [-0.01, 0.01)."""
    out = {}
    for i, t in enumerate(workload.tables):
        x = np.random.default_rng([seed, 1, i]).random((t.rows, t.dim), dtype=np.float32)
        x *= 0.02
        x -= 0.01
        out[t.name] = x
    return out


def make_cotangent(workload: Workload, seed: int) -> np.ndarray:
    """The fixed d loss / d pooled: float32 `[B, F, dim]` standard normal, features in order."""
    shape = (workload.batch_size, len(workload.features), workload.dim)
    return np.random.default_rng([seed, 2]).standard_normal(shape, dtype=np.float32)
