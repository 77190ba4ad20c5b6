"""`jaxembed bench recsys`: the recommender embedding step against XLA, Flax, keras-rs, TorchRec.

Every implementation runs the step of `jaxembed.workloads` — sum-pooled lookups of every
feature, `loss = sum(pooled * cotangent)`, a row-wise Adagrad update (lr 0.05, eps 1e-8;
dense element-wise Adagrad where the framework has no row-wise one) — and is checked against
the float64 reference before it is timed:

| implementation | where | what |
|---|---|---|
| `jaxembed` | worker | collection lookup + row-sparse update, native CPU kernels |
| `jaxembed[xla]` | worker | the same with `impl="xla"` |
| `jaxembed[rows]` | worker | the same with `exchange="rows"` (more than one device) |
| `xla`, `flax` | worker | `jnp.take` + sum / `nnx.Embed`, optax dense Adagrad, by XLA |
| `torchrec` | `torchrec_runner` | `FusedEmbeddingBagCollection`, FBGEMM EXACT_ROWWISE_ADAGRAD |
| `fbgemm` | `torchrec_runner` | FBGEMM's TBE alone (`--impl tbe`) |
| `keras-rs` | `kerasrs_runner` | `DistributedEmbedding` on the JAX backend, dense Adagrad |

Each JAX configuration (workload x device count) runs in its own process (`--worker`, with
`XLA_FLAGS=--xla_force_host_platform_device_count=N`: `recsys_worker`), the frameworks in
their own Pythons (`--torchrec-python`, `--kerasrs-python`, or `$JAXEMBED_TORCHREC_PYTHON`,
`$JAXEMBED_KERASRS_PYTHON`; skipped with the reason where they are not installed), one after
the other, so one run measures everything side by side. Then a sweep of the largest table of
workload (a), jaxembed against XLA. `targets` states the goals met or missed.

    jaxembed bench recsys --quick --json /tmp/recsys.json
    jaxembed bench recsys --json benchmarks/results/recsys/recsys.json \\
        --plot benchmarks/results/recsys --markdown benchmarks/results/recsys/recsys.md \\
        --torchrec-python /venvs/torchrec/bin/python

This module does not import jax: the driver only starts processes and reads their JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.common.report import write, write_outputs
from benchmarks.recsys.files import save_inputs
from benchmarks.recsys.targets import targets
from benchmarks.recsys.worker import split_name
from benchmarks.recsys.workload import make_workload
from jaxembed import host
from jaxembed import workloads as W

__all__ = ["QUICK", "RecsysConfig", "main", "make_workload", "run_recsys", "targets"]

SCHEMA = "jaxembed.bench.recsys/1"
FRAMEWORKS = ("torchrec", "fbgemm", "keras-rs")
"""The subprocess runners: TorchRec's FusedEmbeddingBagCollection, FBGEMM's TBE, keras-rs."""


@dataclasses.dataclass(frozen=True)
class RecsysConfig:
    """What `run_recsys` measures.

    Attributes:
      workloads: `"a"` and/or `"dlrm"`.
      devices: device counts of the JAX configurations (each its own process).
      variants: JAX implementations (`recsys_impls.VARIANTS`); `jaxembed[rows]` runs on more
        than one device only.
      frameworks: subprocess runners (`FRAMEWORKS`).
      dlrm_variants, dlrm_frameworks: the same for the DLRM workload (None: as for (a)). By
        default the DLRM run leaves out `jaxembed[xla]`, `flax` and `fbgemm`, to keep a full
        run near 20 minutes on 2 cores: their DLRM steps are the slowest (seconds each) and
        add nothing that (a) does not show (`flax` is XLA's dense step, `jaxembed[xla]` the
        native kernels' gain, `fbgemm` TorchRec's kernels without its input handling).
      dlrm_batch_size: the DLRM workload's batch.
      sweep_rows: largest-table sizes of workload (a) for the sweep (empty: no sweep).
      sweep_devices: the sweep's device count.
      sweep_variants: the sweep's implementations.
      threads: torch threads and keras-rs cores (default: all the CPUs).
      torchrec_python, kerasrs_python: the Pythons of the framework venvs.
      repeats, max_seconds, profile_calls: the workers' timing and tracing.
      runner_steps: timed steps of each runner.
      one_beside: a worker of n > 1 devices also times `jaxembed` on one of its devices
        (`jaxembed@1`, interleaved with the others): the scale-out targets' 1-device step,
        timed in the same rounds (`benchmarks.recsys.worker`).
      malloc: `"tuned"`: every subprocess (workers and runners alike) starts with glibc's
        malloc set to keep XLA's per-step buffers (`jaxembed.host`); `"default"`: glibc's
        defaults, each step faulting its big buffers in again.
      memory_budget_gb: a worker's budget for its implementations' buffers (None: 70% of
        the memory available when it starts).
      timeout_s: of each subprocess.
      quick: tiny shapes (every path in seconds; timings mean nothing).
    """

    workloads: tuple[str, ...] = ("a", "dlrm")
    devices: tuple[int, ...] = (8, 1)
    variants: tuple[str, ...] = ("jaxembed", "jaxembed[xla]", "jaxembed[rows]", "xla", "flax")
    frameworks: tuple[str, ...] = FRAMEWORKS
    dlrm_variants: tuple[str, ...] | None = ("jaxembed", "jaxembed[rows]", "xla")
    dlrm_frameworks: tuple[str, ...] | None = ("torchrec", "keras-rs")
    dlrm_batch_size: int = 4096
    sweep_rows: tuple[int, ...] = (100_000, 1_000_000, 3_000_000, 10_000_000)
    sweep_devices: int = 1
    sweep_variants: tuple[str, ...] = ("jaxembed", "xla")
    threads: int | None = None
    torchrec_python: str | None = None
    kerasrs_python: str | None = None
    repeats: int = 5
    max_seconds: float = 3.0
    profile_calls: int = 2
    runner_steps: int = 20
    memory_budget_gb: float | None = None
    one_beside: bool = True
    malloc: str = "tuned"
    timeout_s: float = 1800.0
    quick: bool = False


QUICK = RecsysConfig(
    dlrm_variants=None, dlrm_frameworks=None, sweep_rows=(1000, 4000), repeats=2,
    max_seconds=0.2, profile_calls=1, runner_steps=2, quick=True,
)  # fmt: skip
"""Tiny shapes: every code path in seconds; the times mean nothing."""


# --- processes -------------------------------------------------------------------------------


def _env(devices: int | None = None, malloc: str | None = None) -> dict[str, str]:
    """A subprocess's environment: this checkout first on its path, `devices` CPU devices,
    and glibc's malloc tuned (`jaxembed.host.host_env`) unless `malloc` (or the environment's
    `JAXEMBED_MALLOC`) is `"default"`."""
    env = dict(os.environ)
    if malloc is not None:
        env[host.ENV_MALLOC] = malloc
    env = host.host_env(env)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]  # fmt: skip
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def _run_json(cmd: list[str], env: dict[str, str], out: str, timeout: float) -> dict[str, Any]:
    """Runs `cmd`, which writes JSON to `out`; failures become records, not exceptions."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "error", "error": f"timed out after {timeout:.0f} s: {' '.join(cmd)}"}
    except OSError as err:
        return {"status": "skipped", "reason": f"cannot start {cmd[0]}: {err}"}
    wall = round(time.perf_counter() - start, 2)
    lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
    if proc.returncode == 3:  # the runners' "framework not installed"
        return {"status": "skipped", "reason": lines[-1] if lines else "not installed"}
    if proc.returncode != 0 or not os.path.exists(out):
        tail = " | ".join(lines[-6:])[-1500:]
        return {"status": "error", "error": f"exit {proc.returncode}: {tail}"}
    with open(out) as f:
        record = json.load(f)
    record["process_wall_time_in_s"] = wall
    return record


def _worker(config: RecsysConfig, tmp: str, workload: str, devices: int,
            variants: Sequence[str], **kw: Any) -> dict[str, Any]:  # fmt: skip
    out = os.path.join(tmp, f"worker-{workload}-{devices}-{kw.get('largest_rows')}.json")
    cmd = [sys.executable, "-m", "benchmarks.recsys.bench", "--worker", "--workload", workload,
           "--devices", str(devices), "--variants", ",".join(variants), "--out", out,
           "--repeats", str(config.repeats), "--max-seconds", str(config.max_seconds),
           "--profile", str(config.profile_calls)]  # fmt: skip
    for key, value in kw.items():
        if value is not None:
            cmd += [f"--{key.replace('_', '-')}", str(value)]
    if config.quick:
        cmd.append("--quick")
    if config.memory_budget_gb:
        cmd += ["--memory-budget-gb", str(config.memory_budget_gb)]
    return _run_json(cmd, _env(devices, config.malloc), out, config.timeout_s)


def _python(configured: str | None, variable: str) -> str:
    return configured or os.environ.get(variable) or sys.executable


def _runner(config: RecsysConfig, tmp: str, framework: str, inputs: str) -> dict[str, Any]:
    out = os.path.join(tmp, f"{framework}.json")
    threads = str(config.threads or os.cpu_count() or 1)
    common = ["--inputs", inputs, "--out", out, "--threads", threads, "--check-steps", "2",
              "--verify"]  # fmt: skip
    if framework == "keras-rs":  # ~10x slower a step: a quarter of the steps
        python = _python(config.kerasrs_python, "JAXEMBED_KERASRS_PYTHON")
        cmd = [python, "-m", "benchmarks.recsys.kerasrs_runner", *common,
               "--steps", str(max(2, config.runner_steps // 4))]  # fmt: skip
    else:
        python = _python(config.torchrec_python, "JAXEMBED_TORCHREC_PYTHON")
        impl = "fused-ebc" if framework == "torchrec" else "tbe"
        cmd = [python, "-m", "benchmarks.recsys.torchrec_runner", *common, "--impl", impl,
               "--steps", str(config.runner_steps),
               "--profile", str(max(1, config.profile_calls))]  # fmt: skip
    record = _run_json(cmd, _env(1, config.malloc), out, config.timeout_s)
    if "devices" in record:  # keras-rs lists its jax devices
        record["jax_devices"] = record.pop("devices")
    record.update(python=python, devices=None)
    if record.get("status") not in ("skipped", "error"):
        agrees = bool(record.get("check", {}).get("agrees_with_reference"))
        record.update(status="ok", agrees_with_reference=agrees)
    return record


# --- the run ---------------------------------------------------------------------------------


def _variants_for(config: RecsysConfig, kind: str, devices: int) -> list[str]:
    names = config.dlrm_variants if kind == "dlrm" and config.dlrm_variants else config.variants
    out = [v for v in names if devices > 1 or v != "jaxembed[rows]"]
    if config.one_beside and devices > 1 and any(v.startswith("jaxembed") for v in out):
        out.append("jaxembed@1")  # the scale-out ratios' denominator, timed in the same rounds
    return out


def _frameworks_for(config: RecsysConfig, kind: str) -> tuple[str, ...]:
    if kind == "dlrm" and config.dlrm_frameworks is not None:
        return config.dlrm_frameworks
    return config.frameworks


def run_recsys(config: RecsysConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs every configuration of `config`, one process at a time.

    Returns:
      The record: `workloads` (per workload, `implementations`: a list of records with
      `implementation`, `devices`, status, check, times), `sweep`, `targets`, machine facts.
    """
    record: dict[str, Any] = {
        "schema": SCHEMA, "config": dataclasses.asdict(config),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "loadavg_start": list(os.getloadavg())},
        "workloads": {}, "sweep": [],
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="jaxembed-recsys-") as tmp:
        for kind in config.workloads:
            batch = config.dlrm_batch_size if kind == "dlrm" and not config.quick else None
            w = make_workload(kind, batch_size=batch, quick=config.quick)
            entry: dict[str, Any] = {"workload": _describe(w), "implementations": []}
            record["workloads"][kind] = entry
            for n in config.devices:
                log(f"[recsys] {w.name}: JAX implementations on {n} device(s)")
                variants = _variants_for(config, kind, n)
                res = _worker(config, tmp, kind, n, variants, batch_size=batch)
                entry["implementations"] += _rows(res, n)
                entry.setdefault("workers", {})[str(n)] = _worker_facts(res)
            if _frameworks_for(config, kind):
                inputs = os.path.join(tmp, f"inputs-{kind}.npz")
                save_inputs(
                    inputs,
                    w,
                    W.make_tables(w, 0),
                    [W.make_batch(w, 0, s) for s in range(4)],
                    W.make_cotangent(w, 0),
                )
                for framework in _frameworks_for(config, kind):
                    log(f"[recsys] {w.name}: {framework}")
                    res = _runner(config, tmp, framework, inputs)
                    entry["implementations"].append({"implementation": framework, **res})
                os.remove(inputs)
        for rows in config.sweep_rows:
            reused = _reuse(record, config, rows)
            if reused:
                record["sweep"] += reused
                continue
            log(f"[recsys] sweep: largest table {rows} rows, {config.sweep_devices} device(s)")
            res = _worker(config, tmp, "a", config.sweep_devices, config.sweep_variants,
                          largest_rows=rows)  # fmt: skip
            for r in _rows(res, config.sweep_devices):
                record["sweep"].append({"largest_table_rows": rows, **r})
    record["machine"]["loadavg_end"] = list(os.getloadavg())
    record["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    record["targets"] = targets(record)
    return record


def _reuse(record: dict[str, Any], config: RecsysConfig, rows: int) -> list[dict[str, Any]]:
    """The sweep's point of workload (a)'s own largest table, from the run of (a) when it
    ran the same implementations on the same device count (same seed: the same numbers)."""
    entry = record["workloads"].get("a")
    if entry is None or entry["workload"]["largest_table_rows"] != rows:
        return []
    found = [r for r in entry["implementations"] if r.get("devices") == config.sweep_devices
             and r["implementation"] in config.sweep_variants]  # fmt: skip
    if len(found) != len(config.sweep_variants):
        return []
    return [{"largest_table_rows": rows, "reused_from": "workload a", **r} for r in found]


def _describe(w: W.Workload) -> dict[str, Any]:
    return {"name": w.name, "batch_size": w.batch_size, "dim": w.dim,
            "num_tables": len(w.tables), "num_features": len(w.features),
            "total_rows": w.total_rows, "largest_table_rows": max(t.rows for t in w.tables),
            "ids_per_step_expected": w.num_ids_expected}  # fmt: skip


def _worker_facts(res: dict[str, Any]) -> dict[str, Any]:
    keys = ("status", "error", "native", "malloc", "ids_per_step", "loadavg_before",
            "loadavg_after", "memory_budget_bytes", "process_wall_time_in_s",
            "timing_error")  # fmt: skip
    return {k: res[k] for k in keys if k in res}


def _rows(res: dict[str, Any], devices: int) -> list[dict[str, Any]]:
    """A worker's result as one row per implementation (an error: one row saying so)."""
    if "implementations" not in res:
        return [{"implementation": "worker", "devices": devices, **res}]
    load = [res.get("loadavg_before"), res.get("loadavg_after")]
    out = []
    for name, rec in res["implementations"].items():
        base, num = split_name(name, devices)
        beside = {"beside": devices} if num != devices else {}  # timed in the n-device worker
        out.append({"implementation": base, "devices": num, **beside, "worker_loadavg": load,
                    **rec})  # fmt: skip
    return out


# --- the command -------------------------------------------------------------------------------


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(float(x)) for x in text.split(",") if x)


def _names(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.split(",") if x)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxembed bench recsys", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes (for the tests)")
    p.add_argument("--json", help="write the record here")
    p.add_argument("--markdown", help="write the tables here")
    p.add_argument("--plot", help="write PNG plots into this folder")
    p.add_argument("--workloads", type=_names, help="a,dlrm (default both)")
    p.add_argument("--devices", type=_ints, help="device counts, default 8,1")
    p.add_argument("--variants", type=_names, help="JAX implementations (recsys_impls.VARIANTS)")
    p.add_argument("--frameworks", type=_names,
                   help=f"subset of {','.join(FRAMEWORKS)}; '' for none")  # fmt: skip
    p.add_argument("--dlrm-variants", type=_names, help="JAX implementations on DLRM")
    p.add_argument("--dlrm-frameworks", type=_names, help="runners on DLRM")
    p.add_argument("--sweep-rows", type=_ints, help="largest-table rows, e.g. 1e5,1e6,1e7")
    p.add_argument("--sweep-devices", type=int)
    p.add_argument("--dlrm-batch-size", type=int)
    p.add_argument("--threads", type=int, help="torch threads / keras cores (default: all)")
    p.add_argument("--torchrec-python", help="the torchrec venv's python "
                   "(default $JAXEMBED_TORCHREC_PYTHON, else this one)")  # fmt: skip
    p.add_argument("--kerasrs-python", help="the keras-rs venv's python "
                   "(default $JAXEMBED_KERASRS_PYTHON, else this one)")  # fmt: skip
    p.add_argument("--repeats", type=int, help="interleaved timing rounds per worker")
    p.add_argument("--max-seconds", type=float, help="timed seconds per implementation")
    p.add_argument("--profile", type=int, dest="profile_calls", help="steps to trace")
    p.add_argument("--memory-budget-gb", type=float)
    p.add_argument(
        "--malloc",
        choices=("tuned", "default"),
        help="glibc's malloc in every subprocess (jaxembed.host; default tuned)",
    )
    p.add_argument(
        "--no-one-beside",
        dest="one_beside",
        action="store_false",
        default=None,
        help="do not time jaxembed on 1 device inside the n-device workers",
    )
    # The worker (one JAX configuration in this process).
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workload", default="a", help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--largest-rows", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p


def _worker_main(args: argparse.Namespace) -> int:
    from benchmarks.recsys.worker import WorkerConfig, run_worker

    fields = {"workload": args.workload, "devices": (args.devices or (1,))[0],
              "batch_size": args.batch_size, "largest_rows": args.largest_rows,
              "quick": args.quick}  # fmt: skip
    for key, value in (("variants", args.variants), ("repeats", args.repeats),
                       ("max_seconds", args.max_seconds), ("profile_calls", args.profile_calls),
                       ("memory_budget_bytes", args.memory_budget_gb and
                        int(args.memory_budget_gb * 2**30))):  # fmt: skip
        if value is not None:
            fields[key] = value
    if args.quick:
        fields.setdefault("repeats", 2)
        fields.update(batches=2, warmup=0, min_samples=1)
    text = json.dumps(run_worker(WorkerConfig(**fields)), indent=1, default=str)
    if args.out:
        write(args.out, text)
    else:
        print(text)
    return 0


def config_from_args(args: argparse.Namespace) -> RecsysConfig:
    """The `RecsysConfig` of parsed flags (`--quick` starts from `QUICK`)."""
    base = QUICK if args.quick else RecsysConfig()
    fields = {k: getattr(args, k) for k in (
        "workloads", "devices", "variants", "frameworks", "dlrm_variants", "dlrm_frameworks",
        "sweep_rows", "sweep_devices",
        "dlrm_batch_size", "threads", "torchrec_python", "kerasrs_python", "repeats",
        "max_seconds", "profile_calls", "memory_budget_gb", "one_beside", "malloc",
    ) if getattr(args, k) is not None}  # fmt: skip
    return dataclasses.replace(base, **fields)


def main(argv: Sequence[str] | None = None) -> int:
    """`jaxembed bench recsys [--quick] [--json PATH] [--markdown PATH] [--plot DIR] ...`.

    Returns:
      The exit status: 0, or 2 for bad flags.
    """
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.worker:
        return _worker_main(args)
    try:
        config = config_from_args(args)
        for kind in config.workloads:
            make_workload(kind, quick=True)
    except ValueError as err:
        print(f"jaxembed bench recsys: error: {err}", file=sys.stderr)
        return 2
    record = run_recsys(config, log=lambda m: print(m, flush=True))
    from benchmarks.recsys import report

    print(report.markdown(record))
    write_outputs(
        record, json_path=args.json, markdown_path=args.markdown,
        markdown=lambda: report.markdown(record), plot_path=args.plot, plot=report.plot_all,
        allow_nan=True,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
