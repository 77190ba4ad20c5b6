"""Synthetic recommender workloads for `jaxembed bench recsys`, and the step every framework runs.

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
permutation per table). Bag lengths are uniform in `[min_ids, max_ids]`. `save_inputs` writes
everything a runner needs into one `.npz` (`load_inputs` reads it), and `reference_steps` is the
float64 numpy reference that every runner's final tables are checked against.

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
import json
import time
import zlib
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

__all__ = [
    "CRITEO_KAGGLE_CARDINALITIES", "EPS", "LEARNING_RATE", "BenchInputs", "FeatureSpec",
    "TableSpec", "Workload", "compare_tables", "dlrm_workload", "load_inputs", "load_tables",
    "make_batch", "make_cotangent", "make_tables", "reference_pooled", "reference_steps",
    "save_inputs", "save_tables", "summarize_times", "time_calls", "workload_a", "zipf_ids"
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


class BenchInputs(NamedTuple):
    """What `load_inputs` returns: everything a runner needs."""

    workload: Workload
    tables: dict[str, np.ndarray]
    batches: list[Batch]
    cotangent: np.ndarray
    learning_rate: float
    eps: float


def save_inputs(
    path: str,
    workload: Workload,
    tables: Mapping[str, np.ndarray],
    batches: Sequence[Batch],
    cotangent: np.ndarray,
    *,
    learning_rate: float = LEARNING_RATE,
    eps: float = EPS,
) -> None:
    """Writes one uncompressed `.npz` that the runners read with `load_inputs`.

    Keys: `table_{t}` (table index t), `values_{step}_{f}` / `lengths_{step}_{f}` (feature
    index f), `cotangent`, and `meta`: JSON with the workload (its feature -> table map
    included), the step count and the hyperparameters.
    """
    meta = {"workload": dataclasses.asdict(workload), "num_steps": len(batches),
            "learning_rate": learning_rate, "eps": eps,
            "feature_table": {f.name: f.table for f in workload.features}}  # fmt: skip
    arrays = {f"table_{i}": np.asarray(tables[t.name], np.float32)
              for i, t in enumerate(workload.tables)}  # fmt: skip
    for s, batch in enumerate(batches):
        for i, f in enumerate(workload.features):
            arrays[f"values_{s}_{i}"], arrays[f"lengths_{s}_{i}"] = batch[f.name]
    np.savez(path, meta=np.array(json.dumps(meta)), cotangent=cotangent, **arrays)


def load_inputs(path: str) -> BenchInputs:
    """Reads what `save_inputs` wrote."""
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
        d = meta["workload"]
        w = Workload(d["name"], tuple(TableSpec(**t) for t in d["tables"]),
                     tuple(FeatureSpec(**f) for f in d["features"]), d["batch_size"])  # fmt: skip
        tables = {t.name: z[f"table_{i}"] for i, t in enumerate(w.tables)}
        batches = [{f.name: (z[f"values_{s}_{i}"], z[f"lengths_{s}_{i}"])
                    for i, f in enumerate(w.features)}
                   for s in range(meta["num_steps"])]  # fmt: skip
        lr, eps = meta["learning_rate"], meta["eps"]
        return BenchInputs(w, tables, batches, z["cotangent"], lr, eps)


# --- float64 references ---------------------------------------------------------------------


def _bag_index(lengths: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(lengths.shape[0]), lengths)


def reference_pooled(workload: Workload, tables: Mapping[str, np.ndarray], batch: Batch):
    """The forward: float64 `[B, F, dim]`, each bag the sum of its rows."""
    b = workload.batch_size
    out = np.zeros((b, len(workload.features), workload.dim))
    for i, f in enumerate(workload.features):
        values, lengths = batch[f.name]
        ids = values[: int(lengths.sum())]
        np.add.at(out[:, i], _bag_index(lengths), tables[f.table][ids].astype(np.float64))
    return out


def _row_gradients(workload: Workload, batch: Batch, cotangent: np.ndarray, table: str):
    """(unique rows, float64 summed gradients [U, dim]) of one table for one step."""
    ids, grads = [], []
    for i, f in enumerate(workload.features):
        if f.table == table:
            values, lengths = batch[f.name]
            ids.append(values[: int(lengths.sum())])
            grads.append(cotangent[_bag_index(lengths), i])
    ids = np.concatenate(ids)
    rows, inverse = np.unique(ids, return_inverse=True)
    g = np.zeros((rows.size, workload.dim))
    np.add.at(g, inverse, np.concatenate(grads).astype(np.float64))
    return rows, g


def reference_steps(
    workload: Workload,
    tables: Mapping[str, np.ndarray],
    batches: Sequence[Batch],
    cotangent: np.ndarray,
    lr: float = LEARNING_RATE,
    eps: float = EPS,
    *,
    optimizer: str = "rowwise_adagrad",
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Runs the benchmark's step over `batches` in float64 numpy, from `tables`.

    Args:
      workload, tables, batches, cotangent: as `make_*` return them.
      lr, eps: the optimizer's.
      optimizer: `rowwise_adagrad` (FBGEMM's EXACT_ROWWISE_ADAGRAD: `s_r += mean(g_r²)`,
        `w_r -= lr g_r / (sqrt(s_r) + eps)`, s of shape `[rows]`) or `adagrad` (keras' dense
        Adagrad with initial accumulator 0: `s += g²`, `w -= lr g / sqrt(s + eps)` element-wise,
        s of shape `[rows, dim]`; rows no id touches do not move).

    Returns:
      `(tables, accumulators)`, float64, by table name.
    """
    if optimizer not in ("rowwise_adagrad", "adagrad"):
        raise ValueError(f"optimizer must be 'rowwise_adagrad' or 'adagrad', got {optimizer!r}")
    out = {name: np.asarray(w, np.float64).copy() for name, w in tables.items()}
    state = {t.name: np.zeros((t.rows,) if optimizer == "rowwise_adagrad" else (t.rows, t.dim))
             for t in workload.tables}  # fmt: skip
    for batch in batches:
        for t in workload.tables:
            if not any(f.table == t.name for f in workload.features):
                continue
            rows, g = _row_gradients(workload, batch, cotangent, t.name)
            s = state[t.name]
            if optimizer == "rowwise_adagrad":
                s[rows] += np.mean(g * g, axis=1)
                out[t.name][rows] -= lr * g / (np.sqrt(s[rows]) + eps)[:, None]
            else:
                s[rows] += g * g
                out[t.name][rows] -= lr * g / np.sqrt(s[rows] + eps)
    return out, state


# --- what runners write back ----------------------------------------------------------------


def save_tables(path: str, workload: Workload, tables: Mapping[str, np.ndarray],
                accumulators: Mapping[str, np.ndarray] | None = None) -> None:  # fmt: skip
    """Writes a runner's final tables (and optimizer state) as `.npz`: `table_{t}`,
    `accumulator_{t}` (t the table index) and `meta` (JSON: the workload's table names)."""
    arrays = {}
    for i, t in enumerate(workload.tables):
        arrays[f"table_{i}"] = np.asarray(tables[t.name])
        if accumulators is not None:
            arrays[f"accumulator_{i}"] = np.asarray(accumulators[t.name])
    meta = {"tables": [t.name for t in workload.tables]}
    np.savez(path, meta=np.array(json.dumps(meta)), **arrays)


def load_tables(path: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Reads what `save_tables` wrote: `(tables, accumulators)` by table name."""
    with np.load(path, allow_pickle=False) as z:
        names = json.loads(str(z["meta"]))["tables"]
        tables = {n: z[f"table_{i}"] for i, n in enumerate(names)}
        accs = {n: z[f"accumulator_{i}"] for i, n in enumerate(names) if f"accumulator_{i}" in z}
    return tables, accs


def compare_tables(got: Mapping[str, np.ndarray], ref: Mapping[str, np.ndarray],
                   floor: float = LEARNING_RATE, rtol: float = 1e-4) -> dict:  # fmt: skip
    """Errors of `got` against `ref` over all tables in `ref`.

    The relative error is `|got - ref| / max(|ref|, floor)`. The default floor, the learning
    rate, is the size of one Adagrad update (|lr g / sqrt(s)| <= lr a step): the initial
    tables are +-0.01, so entries near zero are common, and their float32 error scales with
    the update, not the entry (a hot row sums thousands of gradients in float32).
    `num_over_rtol` counts the entries whose relative error passes `rtol`.

    Examples:
      >>> compare_tables({"t": np.array([2.002, 0.001])}, {"t": np.array([2.0, 0.0])})
      {'max_abs_error': 0.002, 'max_rel_error': 0.02, 'num_over_rtol': 2, 'num_entries': 2}
    """
    abs_err = rel_err = 0.0
    over = total = 0
    for name, r in ref.items():
        g = np.asarray(got[name], np.float64)
        if g.shape != r.shape:
            raise ValueError(f"table {name!r}: got shape {g.shape}, reference {r.shape}")
        d = np.abs(g - r)
        rel = d / np.maximum(np.abs(r), floor)
        abs_err = max(abs_err, float(d.max(initial=0)))
        rel_err = max(rel_err, float(rel.max(initial=0)))
        over, total = over + int((rel > rtol).sum()), total + rel.size
    return {"max_abs_error": round(abs_err, 12), "max_rel_error": round(rel_err, 9),
            "num_over_rtol": over, "num_entries": total}  # fmt: skip


def time_calls(fn, count: int) -> tuple[list[float], list[float]]:
    """Calls `fn(i)` for i < count: `(wall seconds, process CPU seconds)` of each call.

    The CPU time (all threads of the process) is the load-robust figure on a shared machine:
    when other processes take the cores, wall time grows and CPU time does not (it does grow
    with threads that spin while they wait).
    """
    wall, cpu = [], []
    for i in range(count):
        t, c = time.perf_counter(), time.process_time()
        fn(i)
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return wall, cpu


def summarize_times(wall_s: Sequence[float], cpu_s: Sequence[float] | None, prefix: str):
    """`{prefix}_median_in_ms`, `_p90_in_ms`, `_samples_in_ms` and `{prefix}_cpu_median_in_ms`.

    Examples:
      >>> summarize_times([0.001, 0.002, 0.003], None, "step_time")["step_time_median_in_ms"]
      2.0
    """
    ms = np.asarray(wall_s, np.float64) * 1e3
    out = {f"{prefix}_median_in_ms": round(float(np.median(ms)), 4),
           f"{prefix}_p90_in_ms": round(float(np.percentile(ms, 90)), 4),
           f"{prefix}_samples_in_ms": [round(float(x), 4) for x in ms]}  # fmt: skip
    if cpu_s is not None:
        out[f"{prefix}_cpu_median_in_ms"] = round(float(np.median(cpu_s)) * 1e3, 4)
    return out


# --- the runners' command line (`torchrec_runner`, `kerasrs_runner`) ----------------------------


def runner_arguments(parser, *, steps: int, warmup: int) -> None:
    """The arguments every framework runner takes (each adds its own `--threads`)."""
    parser.add_argument("--inputs", required=True, help="the .npz of workloads.save_inputs")
    parser.add_argument("--out", help="write the result JSON here (default: stdout)")
    parser.add_argument("--steps", type=int, default=steps, help="timed steps (and forwards)")
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed steps first")
    parser.add_argument(
        "--check-steps",
        type=int,
        default=0,
        help="steps from the initial tables before timing, for the check",
    )
    parser.add_argument("--save-tables", help="write the check's final tables here (.npz)")
    parser.add_argument("--verify", action="store_true",
                        help="compare the check's tables with the float64 reference")  # fmt: skip


def runner_main(prog: str, args, setup, run) -> int:
    """Checks `args`, calls `setup()` then `run(args)`, and writes its record as JSON
    (`--out`, else stdout). Returns the exit status."""
    import json
    import sys

    if (args.save_tables or args.verify) and args.check_steps < 1:
        print(f"{prog}: error: --save-tables and --verify need --check-steps >= 1",
              file=sys.stderr)  # fmt: skip
        return 2
    setup()
    text = json.dumps(run(args), indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0
