"""What the recommender benchmark's driver and its framework runners exchange through files.

The driver writes one `.npz` of inputs (`save_inputs`: the workload, its tables, batches and
cotangent); each runner (`torchrec_runner`, `kerasrs_runner`, in their own Python) reads it
with `load_inputs` and writes its final tables back (`save_tables` / `load_tables`) for the
float64 check. `runner_arguments` and `runner_main` are the runners' shared command line.
This module needs numpy only (the runners' environments have no jax).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from jaxembed.workloads import EPS, LEARNING_RATE, Batch, FeatureSpec, TableSpec, Workload

__all__ = [
    "BenchInputs", "load_inputs", "load_tables", "runner_arguments", "runner_main",
    "save_inputs", "save_tables",
]  # fmt: skip


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


def runner_arguments(parser, *, steps: int, warmup: int) -> None:
    """The arguments every framework runner takes (each adds its own `--threads`)."""
    parser.add_argument("--inputs", required=True, help="the .npz of save_inputs")
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
