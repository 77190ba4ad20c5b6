"""`python -m benchmarks grid`: jaxembed's 1-device step against FBGEMM's TBE, cell by cell.

For each cell of a sample of the grid (`cells.sample_cells`: batch 512 / 4096 / 16384, dim 16
/ 64 / 128, bags of 1 / 1-20 / 1-100 ids, ids uniform or Zipf 0.8 / 1.1 / 1.3, tables of 1e3
to 1e7 rows), and for workload (a) (8 tables in one step), the driver writes the cell's ids
once (`cells.write_cell`: the very same bytes for every runner) and runs, one after the other
on the same cores, each a fresh process:

1. `jaxembed_runner` (ragged ids: the cell's CSR bytes), the step a user writes at the
   defaults (`embedding_bag` + `opt.update`, one device, no flags);
2. `fbgemm_runner` at every setting asked (`--peer`, default threads 1 and 2, libgomp's
   default spinning wait and PASSIVE): the peer's best setting is the one compared;
3. `jaxembed_runner` with dense ids (`[B, max_ids]`, -1 padding), then ragged again.

The ratio of a cell is jaxembed's median step (both ragged runs' samples) over the best
peer's median; the same of the lower quartiles is reported beside it (a peer's 2-thread
median can stall on a shared machine). The summary gives each ratio's geometric mean over the
cells and the worst cell. The first runs of a cell check two steps from the initial tables
against the float64 reference where the cell is small enough (`--check-ids`).

    python -m benchmarks grid --cells 24 --json benchmarks/results/grid/grid.json \\
        --markdown benchmarks/results/grid/grid.md --torch-python /path/to/venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.common.report import write_outputs
from benchmarks.grid import cells as C
from jaxembed import host

__all__ = ["main", "run_grid", "summarize"]

SCHEMA = "jaxembed.bench.grid/1"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _child(python: str, module: str, cell: str, out: str, args: Sequence[str],
           timeout: float) -> dict[str, Any]:  # fmt: skip
    """Runs a runner in its own process (tuned malloc, the checkout on its path): its record."""
    env = host.host_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env.pop("XLA_FLAGS", None)  # one device, as a user's process has
    cmd = [python, "-m", f"benchmarks.grid.{module}", "--cell", cell, "--out", out, *args]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if not os.path.exists(out):
        return {"error": f"exit {done.returncode}: {done.stderr[-1500:]}"}
    with open(out) as f:
        return json.load(f)


def _peers(spec: str) -> list[tuple[int, str]]:
    out = []
    for item in filter(None, spec.split(",")):
        threads, _, wait = item.partition(":")
        out.append((int(threads), wait or "default"))
    return out


def run_group(name: str, group: list[C.Cell], opts: argparse.Namespace,
              workdir: str) -> dict[str, Any]:  # fmt: skip
    """One cell (or workload (a)'s tables): every runner on its ids, in turn."""
    path = os.path.join(workdir, "cell.npz")
    C.write_cell(path, group, steps=opts.batches, seed=opts.seed)
    ids = sum(c.batch * sum(c.lengths_range) / 2 for c in group)
    small = ids <= opts.check_ids and sum(c.table_bytes for c in group) <= 512 * 2**20
    timing = ["--steps", str(opts.steps), "--warmup", str(opts.warmup)]
    check = ["--check", "2"] if small else []
    record: dict[str, Any] = {"name": name, "cells": [c.name for c in group],
                              "ids_per_step": ids, "jaxembed": {}, "fbgemm": {}}  # fmt: skip
    out = lambda tag: os.path.join(workdir, f"{tag}.json")
    record["jaxembed"]["ragged"] = _child(sys.executable, "jaxembed_runner", path, out("j1"),
                                          [*timing, *check], opts.timeout)  # fmt: skip
    for k, (threads, wait) in enumerate(_peers(opts.peer) if opts.torch_python else []):
        args = [*timing, "--threads", str(threads), "--omp-wait-policy", wait]
        record["fbgemm"][f"threads={threads},wait={wait}"] = _child(
            opts.torch_python, "fbgemm_runner", path, out(f"p{k}"),
            [*args, *(check if k == 0 else [])], opts.timeout)  # fmt: skip
    if "dense" in opts.forms:
        dense = [*timing, "--form", "dense"]
        record["jaxembed"]["dense"] = _child(sys.executable, "jaxembed_runner", path, out("j2"),
                                             dense, opts.timeout)  # fmt: skip
    second = _child(sys.executable, "jaxembed_runner", path, out("j3"), timing, opts.timeout)
    record["jaxembed"]["ragged_again"] = second
    return _ratios(record)


def _ratios(record: dict[str, Any]) -> dict[str, Any]:
    """Adds the medians compared: jaxembed's (both ragged runs), the peer's best setting."""
    jx = record["jaxembed"]
    runs = (jx["ragged"], jx["ragged_again"])
    samples = [x for r in runs for x in r.get("step_samples_in_ms", [])]
    peers = {k: v for k, v in record["fbgemm"].items() if "step_median_in_ms" in v}
    if samples:
        record["jaxembed_median_in_ms"] = float(np.median(samples))
        record["jaxembed_q25_in_ms"] = float(np.percentile(samples, 25))
    if "step_median_in_ms" in jx.get("dense", {}):
        record["jaxembed_dense_median_in_ms"] = jx["dense"]["step_median_in_ms"]
    if peers and samples:
        best = min(peers, key=lambda k: peers[k]["step_median_in_ms"])
        record["peer_best"] = best
        record["peer_median_in_ms"] = peers[best]["step_median_in_ms"]
        record["peer_q25_in_ms"] = min(v["step_q25_in_ms"] for v in peers.values())
        record["ratio"] = record["jaxembed_median_in_ms"] / record["peer_median_in_ms"]
        record["ratio_q25"] = record["jaxembed_q25_in_ms"] / record["peer_q25_in_ms"]
        if "jaxembed_dense_median_in_ms" in record:
            record["ratio_dense"] = record["jaxembed_dense_median_in_ms"] / record[
                "peer_median_in_ms"]  # fmt: skip
    checks = [r["check"] for r in (jx["ragged"], *record["fbgemm"].values()) if "check" in r]
    record["checked"] = bool(checks) and all(c["agrees"] for c in checks)
    record["errors"] = [f"{k}: {v['error']}" for k, v in (*jx.items(), *record["fbgemm"].items())
                        if "error" in v]  # fmt: skip
    return record


def summarize(groups: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Geometric means of the ratios over the grid's cells (workload (a) apart), and the worst.

    Examples:
      >>> s = summarize([{"name": "x", "ratio": 0.5, "ratio_q25": 1.0},
      ...                {"name": "y", "ratio": 2.0, "ratio_q25": 1.0}])
      >>> s["ratio"]["geomean"], s["ratio"]["worst"], s["ratio"]["worst_cell"]
      (1.0, 2.0, 'y')
    """
    out: dict[str, Any] = {}
    cells = [g for g in groups if g["name"] != "workload (a)"]
    for key in ("ratio", "ratio_q25", "ratio_dense"):
        have = [g for g in cells if key in g]
        if have:
            worst = max(have, key=lambda g: g[key])
            geomean = math.exp(np.mean([math.log(g[key]) for g in have]))
            out[key] = {"geomean": geomean, "worst": worst[key], "worst_cell": worst["name"],
                        "cells": len(have)}  # fmt: skip
    return out


def run_grid(opts: argparse.Namespace) -> dict[str, Any]:
    sample = C.sample_cells(opts.cells, opts.seed, max_table_bytes=opts.max_table_bytes)
    if opts.quick:
        sample = [C.Cell(64, 8, "1-20", "zipf1.1", 1000), C.Cell(32, 16, "1", "uniform", 100)]
    groups = [(c.name, [c]) for c in sample]
    if opts.workload_a and not opts.quick:
        groups.append(("workload (a)", C.workload_a_cell()))
    record: dict[str, Any] = {"schema": SCHEMA, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "options": {k: v for k, v in vars(opts).items() if k not in (
                                  "json", "markdown")}, "groups": []}  # fmt: skip
    with tempfile.TemporaryDirectory() as workdir:
        for i, (name, group) in enumerate(groups):
            print(f"[{i + 1}/{len(groups)}] {name}", file=sys.stderr, flush=True)
            record["groups"].append(run_group(name, group, opts, workdir))
    record["summary"] = summarize(record["groups"])
    record["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return record


def markdown(record: dict[str, Any]) -> str:
    lines = [
        "| cell | ids a step | jaxembed ms (ragged) | dense | FBGEMM best ms | its setting "
        "| ratio | ratio of q25 | checked |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for g in record["groups"]:

        def f(k, g=g):
            return f"{g[k]:.2f}" if k in g else "-"

        lines.append(f"| {g['name']} | {g['ids_per_step']:,.0f} | {f('jaxembed_median_in_ms')} "
                     f"| {f('jaxembed_dense_median_in_ms')} | {f('peer_median_in_ms')} "
                     f"| {g.get('peer_best', '-')} | {f('ratio')} | {f('ratio_q25')} "
                     f"| {'yes' if g['checked'] else '-'} |")  # fmt: skip
    for key, s in record["summary"].items():
        lines.append(f"\n{key}: geomean {s['geomean']:.3f} over {s['cells']} cells, worst "
                     f"{s['worst']:.3f} ({s['worst_cell']})")  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks grid", description=__doc__.split(
        "\n\n")[0])  # fmt: skip
    p.add_argument("--cells", type=int, default=24, help="how many cells of the grid")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batches", type=int, default=4, help="distinct batches a cell cycles")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--forms", default="ragged,dense")
    p.add_argument("--peer", default="1:default,2:default,1:passive,2:passive",
                   help="FBGEMM's settings, threads:wait each")  # fmt: skip
    p.add_argument("--torch-python", default=os.environ.get("JAXEMBED_TORCHREC_PYTHON"),
                   help="a Python with torch and fbgemm-gpu-cpu (default "
                   "$JAXEMBED_TORCHREC_PYTHON; none: jaxembed alone)")  # fmt: skip
    p.add_argument("--no-workload-a", dest="workload_a", action="store_false")
    p.add_argument("--check-ids", type=float, default=4e5,
                   help="check cells of at most this many ids a step")  # fmt: skip
    p.add_argument("--max-table-bytes", type=int, default=3 * 2**30)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--quick", action="store_true", help="two tiny cells (for the tests)")
    p.add_argument("--json")
    p.add_argument("--markdown")
    opts = p.parse_args(argv)
    if opts.quick:
        opts.steps, opts.warmup, opts.batches = 2, 1, 2
    record = run_grid(opts)
    print(markdown(record))
    write_outputs(record, json_path=opts.json, markdown_path=opts.markdown,
                  markdown=lambda: markdown(record))  # fmt: skip
    return 0 if all(not g["errors"] for g in record["groups"]) else 1
