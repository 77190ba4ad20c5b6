"""`jaxembed bench planner`: the collection planner's layout against uniform placements.

On the DLRM workload (`workloads.dlrm_workload`: 26 multi-hot Zipf features over Criteo's
tables, scaled to this machine), one worker process on a 1-D mesh of simulated CPU devices
plans five layouts with `jaxembed.plan_collection` — the planner's choice within a memory
budget per device, and every table fixed to one placement: replicated where its replica
fits (rows for the rest), rows, table, columns — then compiles, checks against the float64
reference and times the same training step on each (lookup, backward, row-wise Adagrad
row-sparse update; tables and state donated), interleaved (`planner_worker`). The record sets
the model beside the measurement for each layout:

| per device | modelled (`CollectionPlan`) | measured |
|---|---|---|
| step | `step_ms` | median wall (and process CPU) time, interleaved |
| memory | `peak_bytes` | `memory_analysis()`: argument + output - alias + temp |
| wire bytes | Σ calls' `wire_bytes` (+ routed fallbacks) | `hlo.total_wire_bytes` of the step |

and the targets: the planner's step within 1.10x of the fastest uniform
placement, the planner never over budget; and how well the model ranks the layouts (Spearman
rank correlation of modelled against measured step).

    jaxembed bench planner --quick --json /tmp/planner.json
    jaxembed bench planner --json benchmarks/results/planner/planner.json \\
        --markdown benchmarks/results/planner/planner.md --plot benchmarks/results/planner \\
        --max-load 6

The mesh is 1-D, `("data",)` over all the devices: the simulated devices are threads of one
process and a collective a copy between them, so no axis is slower than another (the model
has one link bandwidth too); a 2-D mesh would only add `table_rows`, which no uniform
placement uses. This module does not import jax (checking `--memory` does): the worker sets
its own device count (`XLA_FLAGS`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.common.report import write, write_outputs
from benchmarks.planner.worker import LAYOUTS, WorkerConfig
from benchmarks.recsys.bench import _env, _run_json

__all__ = ["QUICK", "PlannerConfig", "main", "run_planner_bench", "spearman", "targets"]

SCHEMA = "jaxembed.bench.planner/1"
STEP_GOAL = 1.10
"""The goal of the planner's step against the fastest uniform placement."""


@dataclasses.dataclass(frozen=True)
class PlannerConfig:
    """What `run_planner_bench` measures.

    Attributes:
      worker: the worker's workload, mesh, budget and timing (`planner_worker.WorkerConfig`).
      max_load: wait before starting while the 1-minute load average is above this (None:
        start at once); max_wait_s: for at most this long.
      timeout_s: of the worker process.
      quick: tiny shapes (every path in seconds; the times mean nothing).
    """

    worker: WorkerConfig = dataclasses.field(default_factory=WorkerConfig)
    max_load: float | None = None
    max_wait_s: float = 900.0
    timeout_s: float = 1800.0
    quick: bool = False


QUICK = PlannerConfig(
    worker=WorkerConfig(batch_size=64, scale=1 / 4096, dim=16, memory_per_device="1MiB",
                        batches=2, repeats=2, warmup=0, min_samples=1, max_seconds=0.2,
                        profile_calls=0),
    timeout_s=600.0, quick=True,
)  # fmt: skip
"""Tiny shapes: 26 features over 9 tables of 10-2473 rows, dim 16, batch 64."""


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation (ties share their mean rank); None under 3 pairs or
    when either side is constant.

    Examples:
      >>> spearman([1, 2, 3, 4], [10, 30, 20, 40])
      0.8
      >>> spearman([1, 1, 2], [5, 6, 7]), spearman([1, 2], [2, 1])
      (0.866, None)
    """
    if len(xs) != len(ys) or len(xs) < 3:
        return None

    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return r

    a, b = ranks(list(xs)), ranks(list(ys))
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    cov = sum((p - ma) * (q - mb) for p, q in zip(a, b, strict=True))
    va, vb = sum((p - ma) ** 2 for p in a), sum((q - mb) ** 2 for q in b)
    return round(cov / (va * vb) ** 0.5, 3) if va and vb else None


def _timed(rec: dict[str, Any]) -> bool:
    return (rec.get("status") == "ok" and bool(rec.get("agrees_with_reference"))
            and rec.get("step_time_median_in_ms") is not None)  # fmt: skip


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def targets(record: dict[str, Any]) -> dict[str, Any]:
    """The targets and the model's quality from a record's `layouts`.

    Returns:
      `{"step_goal", "fastest_uniform", "step_ratio", "step_ratio_cpu",
      "planner_step_within_goal", "fastest_uniform_within_budget",
      "step_ratio_within_budget", "planner_within_budget_modelled",
      "planner_within_budget_compiled", "planner_within_budget", "all_checks_pass",
      "same_layout_as", "spearman_wall", "spearman_cpu", "model_picks_fastest"}`; the
      `planner_*`, `all_checks_pass` and `model_picks_fastest` entries are booleans (False
      where a layout did not run).

    Examples:
      >>> def row(ms, cpu, model, peak=1, compiled=1):
      ...     return {"status": "ok", "agrees_with_reference": True,
      ...             "step_time_median_in_ms": ms, "step_time_cpu_median_in_ms": cpu,
      ...             "compiled_peak_bytes": compiled, "modelled": {"modelled_step_in_ms":
      ...             model, "modelled_peak_bytes": peak, "placements": {"t": str(ms)},
      ...             "exchanges": {}}}
      >>> rec = {"memory_per_device_bytes": 10, "layouts": {"planner": row(105, 100, 1, 9, 11),
      ...        "rows": row(100, 100, 2), "table": row(300, 250, 3, 20)}}
      >>> t = targets(rec)
      >>> t["fastest_uniform"], t["step_ratio"], t["planner_step_within_goal"]
      ('rows', 1.05, True)
      >>> t["planner_within_budget_modelled"], t["planner_within_budget_compiled"]
      (True, False)
      >>> t["spearman_wall"], t["model_picks_fastest"]
      (0.5, False)
    """
    layouts = record.get("layouts", {})
    budget = record.get("memory_per_device_bytes")
    planner = layouts.get("planner", {})
    uniform = {n: r for n, r in layouts.items() if n != "planner" and _timed(r)}

    def step(r, key="step_time_median_in_ms"):
        return r.get(key)

    fastest = min(uniform, key=lambda n: step(uniform[n]), default=None)
    fits = {n: r for n, r in uniform.items() if r["modelled"]["modelled_peak_bytes"] <= budget}
    fastest_fit = min(fits, key=lambda n: step(fits[n]), default=None)
    ok = _timed(planner)
    ratio = _ratio(step(planner), step(uniform[fastest])) if ok and fastest else None
    cpu_key = "step_time_cpu_median_in_ms"
    cpu = _ratio(step(planner, cpu_key), step(uniform[fastest], cpu_key)) if ratio else None
    model = planner.get("modelled", {})
    peak_ok = bool(model) and model["modelled_peak_bytes"] <= budget
    compiled_ok = planner.get("compiled_peak_bytes") is not None and (
        planner["compiled_peak_bytes"] <= budget
    )
    keys = ("placements", "row_sharding", "exchanges")
    same = [n for n, r in uniform.items()
            if model and all(r["modelled"].get(k) == model.get(k) for k in keys)]  # fmt: skip
    timed = {n: r for n, r in layouts.items() if _timed(r)}
    modelled = [r["modelled"]["modelled_step_in_ms"] for r in timed.values()]
    by_model = min(timed, key=lambda n: timed[n]["modelled"]["modelled_step_in_ms"], default=None)
    by_wall = min(timed, key=lambda n: step(timed[n]), default=None)
    return {
        "step_goal": STEP_GOAL, "fastest_uniform": fastest, "step_ratio": ratio,
        "step_ratio_cpu": cpu,
        "planner_step_within_goal": bool(ratio is not None and ratio <= STEP_GOAL),
        "fastest_uniform_within_budget": fastest_fit,
        "step_ratio_within_budget": _ratio(step(planner), step(fits[fastest_fit]))
        if ok and fastest_fit else None,
        "planner_within_budget_modelled": bool(peak_ok),
        "planner_within_budget_compiled": bool(compiled_ok),
        "planner_within_budget": bool(peak_ok and compiled_ok),
        "all_checks_pass": bool(layouts) and all(
            r.get("status") == "ok" and r.get("agrees_with_reference") for r in layouts.values()),
        "same_layout_as": same,
        "spearman_wall": spearman(modelled, [step(r) for r in timed.values()]),
        "spearman_cpu": spearman(modelled, [step(r, cpu_key) for r in timed.values()]),
        "model_picks_fastest": bool(by_model is not None and (
            timed[by_model]["modelled"]["modelled_step_in_ms"] ==
            timed[by_wall]["modelled"]["modelled_step_in_ms"])),
    }  # fmt: skip


def _wait_for_load(config: PlannerConfig, log: Callable[[str], None]) -> list[list[float]]:
    """Waits while the 1-minute load is over `config.max_load`; the loads seen, per minute."""
    seen = [list(os.getloadavg())]
    if config.max_load is None:
        return seen
    deadline = time.monotonic() + config.max_wait_s
    while seen[-1][0] > config.max_load and time.monotonic() < deadline:
        log(f"[planner] load {seen[-1][0]:.2f} > {config.max_load}: waiting")
        time.sleep(min(60.0, max(1.0, deadline - time.monotonic())))
        seen.append(list(os.getloadavg()))
    return seen


def run_planner_bench(config: PlannerConfig,
                      log: Callable[[str], None] = print) -> dict[str, Any]:  # fmt: skip
    """Runs the worker (one process, `config.worker.devices` simulated devices) and states
    the targets.

    Returns:
      The record: `config`, `machine` (load averages at the start, waited, at the end),
      the worker's facts (`workload`, `memory_per_device_bytes`, `planner_text`, ...),
      `layouts` (per layout: `modelled`, compiled facts, `check`, times, `profile`) and
      `targets` (see `targets`); on a worker failure, `error` and empty `layouts`.
    """
    loads = _wait_for_load(config, log)
    record: dict[str, Any] = {
        "schema": SCHEMA, "config": dataclasses.asdict(config),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "loadavg_waited": loads,
                    "loadavg_start": list(os.getloadavg())},
    }  # fmt: skip
    w = config.worker
    log(f"[planner] DLRM x{w.scale:g}, batch {w.batch_size}, dim {w.dim}, {w.devices} devices, "
        f"budget {w.memory_per_device} per device: {', '.join(w.layouts)}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="jaxembed-planner-") as tmp:
        out = os.path.join(tmp, "worker.json")
        cmd = [sys.executable, "-m", "benchmarks.planner.bench", "--worker", "--out", out,
               "--worker-config", json.dumps(dataclasses.asdict(w))]  # fmt: skip
        res = _run_json(cmd, _env(w.devices), out, config.timeout_s)
    res.pop("schema", None)
    res.pop("config", None)  # the worker's: record["config"]["worker"]
    if "layouts" not in res:
        res = {"error": res.get("error") or res.get("reason"), "layouts": {}}
    record.update(res)
    record["machine"]["loadavg_end"] = list(os.getloadavg())
    record["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    record["targets"] = targets(record)
    return record


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxembed bench planner", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes (for the tests)")
    p.add_argument("--json", help="write the record here")
    p.add_argument("--markdown", help="write the tables here")
    p.add_argument("--plot", help="write planner.png into this folder")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--scale", type=float, help="on Criteo's cardinalities (default 1/32)")
    p.add_argument("--dim", type=int)
    p.add_argument("--devices", type=int, help="the 1-D mesh (default 8)")
    p.add_argument("--memory", dest="memory_per_device", help="budget per device, e.g. 64MiB")
    p.add_argument("--layouts", type=lambda s: tuple(x for x in s.split(",") if x),
                   help=f"subset of {','.join(LAYOUTS)}")  # fmt: skip
    p.add_argument("--repeats", type=int, help="interleaved timing rounds")
    p.add_argument("--max-seconds", type=float, help="timed seconds per layout")
    p.add_argument("--profile", type=int, dest="profile_calls", help="steps to trace")
    p.add_argument("--max-load", type=float, help="wait while the load average is above this")
    p.add_argument("--max-wait-s", type=float)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-config", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p


def config_from_args(args: argparse.Namespace) -> PlannerConfig:
    """The `PlannerConfig` of parsed flags (`--quick` starts from `QUICK`).

    Raises:
      ValueError: an unknown layout, or a budget that is not a size.
    """
    from jaxembed.plan.collection import parse_bytes

    base = QUICK if args.quick else PlannerConfig()
    fields = {k: getattr(args, k) for k in ("batch_size", "scale", "dim", "devices",
              "memory_per_device", "layouts", "repeats", "max_seconds", "profile_calls")
              if getattr(args, k) is not None}  # fmt: skip
    unknown = [x for x in fields.get("layouts", ()) if x not in LAYOUTS]
    if unknown:
        raise ValueError(f"unknown layouts {unknown}: choose from {','.join(LAYOUTS)}")
    parse_bytes(fields.get("memory_per_device", base.worker.memory_per_device))
    top = {k: getattr(args, k) for k in ("max_load", "max_wait_s") if getattr(args, k) is not None}
    return dataclasses.replace(base, worker=dataclasses.replace(base.worker, **fields), **top)


def main(argv: Sequence[str] | None = None) -> int:
    """`jaxembed bench planner [--quick] [--json PATH] [--markdown PATH] [--plot DIR] ...`.

    Returns:
      The exit status: 0, 1 when the worker failed, or 2 for bad flags.
    """
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.worker:
        from benchmarks.planner.worker import run_worker

        fields = json.loads(args.worker_config or "{}")
        fields["layouts"] = tuple(fields.get("layouts", LAYOUTS))
        text = json.dumps(run_worker(WorkerConfig(**fields)), indent=1, default=str)
        write(args.out, text) if args.out else print(text)
        return 0
    try:
        config = config_from_args(args)
    except ValueError as err:
        print(f"jaxembed bench planner: error: {err}", file=sys.stderr)
        return 2
    record = run_planner_bench(config, log=lambda m: print(m, flush=True))
    from benchmarks.planner import report

    text = report.markdown(record)
    print(text)
    write_outputs(
        record, json_path=args.json, markdown_path=args.markdown, markdown=lambda: text,
        plot_path=args.plot if record["layouts"] else None, plot=report.plot, allow_nan=True,
    )  # fmt: skip
    return 1 if record.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
