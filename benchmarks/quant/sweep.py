"""`python -m benchmarks quant-sweep`: the quantized pooled lookup a user writes, against FBGEMM.

jaxembed's public path, `jax.jit(embedding_bag)` on a `jaxembed.QuantizedTable` at the defaults,
against FBGEMM's `IntNBitTableBatchedEmbeddingBagsCodegen` on the same bytes and the same ids,
over the sweep (`cells`: int8 / int4, batch 64 / 512 / 4096, tables of 1e4 / 1e6 / 1e7 rows,
dim 32 / 64 / 128, ids uniform or Zipf 1.1; bags of 1-20 ids; sum): by default every cell of 8 of
its 18 tables (`cells.sample_cells`, seeded: each level of precision, rows and dim about equally
often), the issue's two (1M x 64, int8 and int4; its cell is batch 4096, Zipf 1.1) always in;
`--tables 0` runs the whole grid (108 cells).

For each table of the sample the driver writes its bytes once (`cells.write_table`) and each of
its cells' 8 batches of ids (`cells.write_ids`), then runs, one after the other on the same
cores, each a fresh process:

1. `sweep_jaxembed` (this Python): at 1 and 2 threads (`JAXEMBED_NUM_THREADS`), ragged ids (the
   CSR bytes) and dense ids (`[B, 20]`, -1 padding);
2. `fbgemm_runner` (`--torch-python`: torch and fbgemm-gpu-cpu, no jax) with libgomp's default
   `OMP_WAIT_POLICY` (it spins), then with `PASSIVE`: at 1 and 2 threads
   (`torch.set_num_threads`) each.

Each times 200 calls after 20 of warm-up, each call on the next of the 8 batches (a batch's rows
would otherwise stay in the cache from the call before): median and lower quartile. A cell's
ratio at n threads is jaxembed's ragged median over FBGEMM's best median at n threads (of its two
wait policies), the same of the lower quartiles beside it (FBGEMM's 2-thread median can stall on
a shared machine); `best` compares each side's best setting. The summary gives each ratio's
geometric mean over the cells and the worst cell. Checks: FBGEMM's weights read back are the
table's bytes; jaxembed's first output is the same in both forms and a float64 sum of the
dequantized rows within float32 rounding. Whether it equals FBGEMM's bitwise is reported, not
required (FBGEMM's int8 sums differed from jaxembed's by an ulp at dims 64 and 128 here, both
within rounding of the float64 sums).

    python -m benchmarks quant-sweep --torch-python /path/to/venv/bin/python \\
        --json benchmarks/results/quant/sweep.json --markdown benchmarks/results/quant/sweep.md
    python -m benchmarks quant-sweep --quick --torch-python ...   # two tiny cells
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.common.report import write_outputs
from benchmarks.quant import cells as C
from jaxembed import host

__all__ = ["main", "run_sweep", "summarize"]

SCHEMA = "jaxembed.bench.quant_sweep/1"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WAITS = ("default", "passive")
QUICK_CELLS = (C.Cell("int8", 64, 10_000, 32, "zipf1.1"), C.Cell("int4", 64, 10_000, 32, "uniform"))
RATIOS = ("ratio_best", "ratio_best_q25", "ratio_1", "ratio_1_q25", "ratio_2", "ratio_2_q25",
          "ratio_dense_best")  # fmt: skip


def _child(python: str, module: str, args: Sequence[str], out: str, timeout: float):
    """Runs a runner in its own process (tuned malloc, one jax device, the checkout on its
    path): its record."""
    env = host.host_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env.pop("XLA_FLAGS", None)
    env.pop("JAXEMBED_NUM_THREADS", None)
    cmd = [python, "-m", f"benchmarks.quant.{module}", *args, "--out", out]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if not os.path.exists(out):
        return {"error": f"exit {done.returncode}: {done.stderr[-1500:]}"}
    with open(out) as f:
        return json.load(f)


def _reference(directory: str, precision: str, values: np.ndarray, lengths: np.ndarray):
    """float64 `[B, D]`: each bag the sum of its dequantized rows (`q · scale + bias`)."""
    data, scale, bias = C.read_table(directory)
    rows = np.asarray(data[values])  # only the rows read
    if precision == "int4":
        rows = np.stack([rows & 15, rows >> 4], axis=-1).reshape(len(values), -1)
    deq = rows * scale[values, None].astype(np.float64) + bias[values, None].astype(np.float64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return np.add.reduceat(deq, starts, axis=0)  # every bag holds at least one id


def _checks(directory: str, k: int, cell: C.Cell, ids_path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    load = lambda name: np.load(os.path.join(directory, f"{name}-{k}.npy"))
    try:
        ragged, dense = load("jaxembed-ragged"), load("jaxembed-dense")
    except OSError:
        return {"checked": False}
    values, lengths = C.read_ids(ids_path)[0]
    want = _reference(directory, cell.precision, values, lengths)
    error = float(np.abs(ragged - want).max())
    out.update(forms_equal=bool(np.array_equal(ragged, dense)), max_abs_error_to_float64=error,
               agrees_with_float64=error <= 1e-5 * max(1.0, float(np.abs(want).max())))  # fmt: skip
    for wait in WAITS:
        try:
            fb = load(f"fbgemm-{wait}")
        except OSError:
            continue
        equal = bool(np.array_equal(ragged, fb)) and out.get("bitwise_equal_to_fbgemm", True)
        diff = max(float(np.abs(ragged - fb).max()), out.get("max_abs_diff_to_fbgemm", 0.0))
        out.update(bitwise_equal_to_fbgemm=equal, max_abs_diff_to_fbgemm=diff)
    out["checked"] = out["forms_equal"] and out["agrees_with_float64"]
    return out


def _ratios(cell: dict[str, Any], threads: Sequence[int]) -> None:
    """Adds each ratio (module docstring) to a cell's record."""
    jx, fb = cell["jaxembed"], cell["fbgemm"]

    def at(record, n, key, form=None):
        r = record.get(str(n), {})
        r = r.get(form, {}) if form else r
        return r.get(key)

    best: dict[str, float] = {}
    for n in threads:
        peer = [at(fb[w], n, "step_median_in_ms") for w in fb if at(fb[w], n, "step_median_in_ms")]
        peer_q = [at(fb[w], n, "step_q25_in_ms") for w in fb if at(fb[w], n, "step_q25_in_ms")]
        mine = at(jx, n, "step_median_in_ms", "ragged")
        mine_q = at(jx, n, "step_q25_in_ms", "ragged")
        dense = at(jx, n, "step_median_in_ms", "dense")
        for key, value in (
            ("jx", mine),
            ("jx_q25", mine_q),
            ("jx_dense", dense),
            ("fb", min(peer, default=None)),
            ("fb_q25", min(peer_q, default=None)),
        ):
            if value is not None:
                best[key] = min(best.get(key, math.inf), value)
        if mine and peer:
            cell[f"ratio_{n}"] = mine / min(peer)
        if mine_q and peer_q:
            cell[f"ratio_{n}_q25"] = mine_q / min(peer_q)
    if "jx" in best:
        cell["jaxembed_best_in_ms"] = best["jx"]
    if "fb" in best:
        cell["fbgemm_best_in_ms"] = best["fb"]
    if "jx" in best and "fb" in best:
        cell["ratio_best"] = best["jx"] / best["fb"]
    if "jx_q25" in best and "fb_q25" in best:
        cell["ratio_best_q25"] = best["jx_q25"] / best["fb_q25"]
    if "jx_dense" in best and "fb" in best:
        cell["ratio_dense_best"] = best["jx_dense"] / best["fb"]


def run_table(key: tuple[str, int, int], cells: list[C.Cell], opts: argparse.Namespace,
              directory: str) -> list[dict[str, Any]]:  # fmt: skip
    """One table's cells: its bytes and ids on disk, then every runner on them in turn."""
    precision, rows, dim = key
    C.write_table(directory, precision, rows, dim, seed=opts.seed)
    listed = []
    for k, cell in enumerate(cells):
        path = os.path.join(directory, f"ids-{k}.npz")
        C.write_ids(path, cell, opts.batches, seed=opts.seed)
        listed.append({"name": cell.name, "ids": path})
    with open(os.path.join(directory, "cells.json"), "w") as f:
        json.dump({"precision": precision, "rows": rows, "dim": dim, "cells": listed}, f)
    timing = ["--steps", str(opts.steps), "--warmup", str(opts.warmup),
              "--threads", *map(str, opts.threads)]  # fmt: skip
    out = lambda tag: os.path.join(directory, f"{tag}.json")
    runs = {"jaxembed": _child(sys.executable, "sweep_jaxembed", ["--group", directory, *timing],
                               out("jaxembed"), opts.timeout)}  # fmt: skip
    for wait in WAITS if opts.torch_python else ():
        runs[f"fbgemm-{wait}"] = _child(
            opts.torch_python, "fbgemm_runner",
            ["--group", directory, *timing, "--omp-wait-policy", wait], out(f"fbgemm-{wait}"),
            opts.timeout,
        )  # fmt: skip
    errors = [f"{name}: {r['error']}" for name, r in runs.items() if "error" in r]
    records = []
    for k, cell in enumerate(cells):
        record: dict[str, Any] = {
            "name": cell.name, "precision": precision, "batch": cell.batch, "rows": rows,
            "dim": dim, "ids": cell.ids, "errors": errors,
            "jaxembed": runs["jaxembed"].get("cells", {}).get(cell.name, {}),
            "fbgemm": {w: runs[f"fbgemm-{w}"].get("cells", {}).get(cell.name, {})
                       for w in WAITS if f"fbgemm-{w}" in runs},
            "same_bytes": all(r.get("same_bytes", True) for n, r in runs.items()
                              if n.startswith("fbgemm")),
            "loadavg": {n: r.get("loadavg") for n, r in runs.items()},
            **_checks(directory, k, cell, listed[k]["ids"]),
        }  # fmt: skip
        _ratios(record, opts.threads)
        records.append(record)
    for name in os.listdir(directory):  # the next table's bytes take their place
        os.remove(os.path.join(directory, name))
    return records


def summarize(cells: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each ratio's geometric mean over the cells that have it, and its worst cell.

    Examples:
      >>> s = summarize([{"name": "x", "ratio_best": 0.5}, {"name": "y", "ratio_best": 2.0}])
      >>> s["ratio_best"]["geomean"], s["ratio_best"]["worst"], s["ratio_best"]["worst_cell"]
      (1.0, 2.0, 'y')
    """
    out: dict[str, Any] = {}
    for key in RATIOS:
        have = [c for c in cells if c.get(key)]
        if have:
            worst = max(have, key=lambda c: c[key])
            geomean = math.exp(float(np.mean([math.log(c[key]) for c in have])))
            out[key] = {"geomean": geomean, "worst": worst[key], "worst_cell": worst["name"],
                        "cells": len(have)}  # fmt: skip
    return out


def run_sweep(opts: argparse.Namespace) -> dict[str, Any]:
    """Every table of the sample in turn (`run_table`); the record with its summary."""
    if opts.quick:
        sample = sorted(QUICK_CELLS)
    elif opts.cell:
        sample = sorted({C.Cell.parse(name) for name in opts.cell})
    else:
        ids = tuple(opts.ids)
        sample = C.sample_cells(opts.tables, opts.seed, ids=ids,
                                precisions=tuple(opts.precisions))  # fmt: skip
    tables = [(key, list(group)) for key, group in itertools.groupby(sample, lambda c: c.table)]
    record: dict[str, Any] = {
        "schema": SCHEMA, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpu": _cpu_model(), "cpu_count": os.cpu_count(),
                    "python": platform.python_version(), "loadavg": list(os.getloadavg())},
        "options": {k: v for k, v in vars(opts).items() if k not in ("json", "markdown")},
        "cells": [],
    }  # fmt: skip
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="jaxembed-quant-sweep-", dir=opts.workdir) as work:
        for i, (key, group) in enumerate(tables):
            print(f"[{time.perf_counter() - start:6.0f}s] table {i + 1}/{len(tables)} "
                  f"{key[0]} {key[1]}x{key[2]}: {len(group)} cells", file=sys.stderr,
                  flush=True)  # fmt: skip
            record["cells"] += run_table(key, group, opts, work)
    record["summary"] = summarize(record["cells"])
    record["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    record["seconds"] = round(time.perf_counter() - start, 1)
    return record


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                        "")  # fmt: skip
    except OSError:
        return platform.processor()


def markdown(record: dict[str, Any]) -> str:
    """The cells' table (medians and lower quartiles in ms, ratios), then the summary."""
    threads = record["options"]["threads"]
    head = "| cell | jaxembed ms (best) | FBGEMM ms (best) | best | best q25 | dense best |"
    head += "".join(f" {n} thr | {n} thr q25 |" for n in threads) + " checks |"
    lines = [head, "|" + "---|" * (6 + 2 * len(threads) + 1)]

    def f(c, k):
        return f"{c[k]:.3f}" if c.get(k) is not None else "-"

    for c in record["cells"]:
        checks = ("ok" if c.get("checked") else "NOT CHECKED") + (
            "" if c.get("bitwise_equal_to_fbgemm", True) else ", != fbgemm bitwise") + (
            "" if c["same_bytes"] else ", bytes differ") + (
            f", errors: {'; '.join(c['errors'])}" if c["errors"] else "")  # fmt: skip
        row = (
            f"| {c['name']} | {f(c, 'jaxembed_best_in_ms')} | {f(c, 'fbgemm_best_in_ms')} "
            f"| {f(c, 'ratio_best')} | {f(c, 'ratio_best_q25')} | {f(c, 'ratio_dense_best')} |"
        )
        row += "".join(f" {f(c, f'ratio_{n}')} | {f(c, f'ratio_{n}_q25')} |" for n in threads)
        lines.append(row + f" {checks} |")  # fmt: skip
    lines.append("")
    for key, s in record["summary"].items():
        lines.append(f"- {key}: geomean {s['geomean']:.3f} over {s['cells']} cells, worst "
                     f"{s['worst']:.3f} ({s['worst_cell']})")  # fmt: skip
    lines.append(f"\n{record['machine']['cpu']}, {record['machine']['cpu_count']} cores; "
                 f"{record['seconds']:.0f} s")  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m benchmarks quant-sweep [--quick] [--tables N] [--torch-python PY] ...`."""
    p = argparse.ArgumentParser(prog="python -m benchmarks quant-sweep",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--tables", type=int, default=8,
                   help="tables sampled from the grid's 18, each with its 6 cells (batch x ids); "
                   "0: all of them, the whole 108-cell grid")  # fmt: skip
    p.add_argument(
        "--cell",
        action="append",
        metavar="NAME",
        help="run this cell (e.g. int8,batch=4096,rows=1e6,dim=64,ids=zipf1.1) "
        "instead of a sample; repeatable",
    )
    p.add_argument("--precisions", nargs="+", default=list(C.PRECISIONS), choices=C.PRECISIONS)
    p.add_argument(
        "--ids",
        nargs="+",
        default=list(C.IDS),
        help="id distributions: uniform, zipf1.1, zipf0.8, ...",
    )
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batches", type=int, default=8, help="distinct batches a cell cycles")
    p.add_argument("--steps", type=int, default=200, help="timed calls")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument(
        "--torch-python",
        default=os.environ.get("JAXEMBED_TORCHREC_PYTHON"),
        help="a Python with torch and fbgemm-gpu-cpu (default "
        "$JAXEMBED_TORCHREC_PYTHON; none: jaxembed alone)",
    )
    p.add_argument("--workdir", help="where the tables go (default: the system's temp dir)")
    p.add_argument("--timeout", type=float, default=900, help="seconds a child may take")
    p.add_argument("--quick", action="store_true", help="two tiny cells, a few calls")
    p.add_argument("--json")
    p.add_argument("--markdown")  # fmt: skip
    opts = p.parse_args(argv)
    if opts.quick:
        opts.steps, opts.warmup, opts.batches = 5, 2, 2
    record = run_sweep(opts)
    print(markdown(record))
    write_outputs(record, json_path=opts.json, markdown_path=opts.markdown,
                  markdown=lambda: markdown(record))  # fmt: skip
    ok = all(not c["errors"] and c.get("checked") and c["same_bytes"] for c in record["cells"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
