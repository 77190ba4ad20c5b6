"""What every grid runner shares: its command line, its timing and the float64 check.

A runner is a child process (`python -m benchmarks.grid.<name> --cell in.npz --out out.json
...`) that reads a cell's ids (`cells.read_cell`), builds its tables at `cells.TABLE_VALUE`,
runs `--check` steps against the float64 reference of the touched rows, then times `--steps`
steps (each a forward, the fixed cotangent's backward and the fused row-wise Adagrad update)
after `--warmup`, and writes one JSON record. This module needs numpy only (the peers' Python
has no jax).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from benchmarks.grid import cells as C

__all__ = ["check_tables", "parser", "reference", "run_main", "timed"]


def parser(prog: str, doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    p.add_argument("--cell", required=True, help="the cell's ids (cells.write_cell)")
    p.add_argument("--out", required=True, help="the JSON record to write")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--check", type=int, default=0, metavar="K",
                   help="first run K steps from the initial tables against float64")  # fmt: skip
    return p


def timed(step: Callable[[int], Any], steps: int, warmup: int) -> dict[str, Any]:
    """`step(i)` (blocking) `warmup` times, then `steps` timed calls: wall and process CPU ms."""
    for i in range(warmup):
        step(i)
    wall, cpu = [], []
    for i in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        step(warmup + i)
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    return {
        "step_samples_in_ms": [round(x, 4) for x in wall],
        "step_median_in_ms": round(float(np.median(wall)), 4),
        "step_q25_in_ms": round(float(np.percentile(wall, 25)), 4),
        "step_cpu_median_in_ms": round(float(np.median(cpu)), 4),
    }


def reference(cell: dict[str, Any], steps: int) -> tuple[list[dict], list[dict]]:
    """The float64 tables and row-wise accumulators after `steps` steps, touched rows only:
    per table `{row: vector}` and `{row: accumulator}` (FBGEMM's EXACT_ROWWISE_ADAGRAD: each
    touched row's gradient summed over the batch, `s += mean(g^2)`, `w -= lr g / (sqrt(s) +
    eps)`)."""
    n = len(cell["rows"])
    rows: list[dict] = [{} for _ in range(n)]
    accs: list[dict] = [{} for _ in range(n)]
    cot = cell["cotangent"].astype(np.float64)  # [B, F, H]
    for batch in cell["steps"][:steps]:
        for i, (values, lengths) in enumerate(batch):
            bag = np.repeat(np.arange(len(lengths)), lengths)  # i[N]: each id's bag
            touched, inverse = np.unique(values, return_inverse=True)
            grads = np.zeros((len(touched), cell["dim"]))
            np.add.at(grads, inverse, cot[bag, i])  # each touched row's summed gradient
            for r, g in zip(touched.tolist(), grads, strict=True):
                w = rows[i].get(r, np.full(cell["dim"], C.TABLE_VALUE, np.float64))
                s = accs[i].get(r, 0.0) + float(np.mean(g * g))
                rows[i][r] = w - C.LEARNING_RATE * g / (np.sqrt(s) + C.EPS)
                accs[i][r] = s
    return rows, accs


def check_tables(
    cell: dict[str, Any], steps: int, read: Callable[[int, np.ndarray], tuple[Any, Any]]
) -> dict[str, Any]:
    """Compares a runner's tables after `steps` steps with `reference`: `read(table, rows)`
    gives those rows and their accumulators. The largest error relative to the array's largest
    entry, and whether it is within 1e-5 (float32 sums in another order)."""
    want_rows, want_accs = reference(cell, steps)
    worst = 0.0
    for i, (w, a) in enumerate(zip(want_rows, want_accs, strict=True)):
        rows = np.array(sorted(w), np.int64)
        if not len(rows):
            continue
        got_w, got_a = (np.asarray(x, np.float64) for x in read(i, rows))
        ref_w = np.stack([w[r] for r in rows.tolist()])
        ref_a = np.array([a[r] for r in rows.tolist()])
        for got, ref in ((got_w, ref_w), (got_a, ref_a)):
            worst = max(worst, float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))))
    return {"steps": steps, "max_rel_error": worst, "agrees": worst <= 1e-5}


def run_main(name: str, argv: Sequence[str] | None, doc: str,
             run: Callable[[argparse.Namespace], dict[str, Any]],
             extra: Callable[[argparse.ArgumentParser], None] | None = None) -> int:  # fmt: skip
    """Parses the flags, runs, writes the record (or `{"error": ...}`) to `--out`."""
    p = parser(f"python -m benchmarks.grid.{name}", doc)
    if extra is not None:
        extra(p)
    args = p.parse_args(argv)
    try:
        record = run(args)
        status = 0
    except Exception as e:  # a runner's failure is the record's, the driver goes on
        record, status = {"error": f"{type(e).__name__}: {e}"}, 1
    record.update(runner=name, loadavg=list(os.getloadavg()))
    with open(args.out, "w") as f:
        json.dump(record, f)
    if status:
        print(f"{name}: {record['error']}", file=sys.stderr)
    return status
