"""`python -m benchmarks.serving.torchrec_qebc`: the exported ranker against TorchRec's QEBC.

    python -m benchmarks.serving.torchrec_qebc \\
        --json benchmarks/results/serving/torchrec_qebc.json \\
        --markdown benchmarks/results/serving/torchrec_qebc.md

The model is `benchmarks.serving.latency`'s DLRM-like ranker (F features x `rows` x `dim`,
bags of L ids about 1 in 8 empty, an MLP of `hidden`), float, int8 and int4 tables. This
process exports it as that bench does (`latency.export_all`: `jaxembed.serving`,
`impl="xla"`). For each thread count n, a child process in which `import jaxembed` fails loads
the artifacts with their `loader.py` and builds the same model in TorchRec from the float
artifact's parameters (`torchrec_runner`): a float `torchrec.EmbeddingBagCollection` of the
same tables, quantized by TorchRec's inference quantization (`quantize_embeddings`: FP32,
INT8 and INT4 rows in one FBGEMM IntNBit TBE), the same two linear layers. Both take the
same ids: jaxembed's `[B, F, L]` with -1 slots, TorchRec's as a `KeyedJaggedTensor` of the
ids >= 0, each side's inputs built before timing.

Checks, at each batch on the check inputs: the loaded model's scores against this process's
`jit` (as `latency`); TorchRec's scores against the loaded model's; TorchRec's TBE rows
against jaxembed's (int4: the same bytes; int8: TorchRec quantizes with FBGEMM's N-bit
formula at 8 bits, jaxembed with the TBE's `quantize_embs` one, so a few codes and scales
differ by one step); and a TorchRec module holding jaxembed's own rows (`with_rows`),
whose scores must equal the loaded model's within float32 rounding of the MLP.

Timing (`benchmarks.common.timing`): at each batch the six models (two implementations x
three precisions) interleaved in rotated rounds, after warm-up, each call on the next of a few
input sets; median, p90, process CPU time, TorchRec's ratio to jaxembed (of medians and the
median of per-round ratios). Threads: the child of n threads runs on the first n CPUs of its
affinity mask (`os.sched_setaffinity`, before jax and torch start their pools), with
`torch.set_num_threads(n)`, `OMP_NUM_THREADS=n`, and for n = 1 XLA's
`--xla_cpu_multi_thread_eigen=false`; one JAX CPU device. The record keeps them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.serving import latency

__all__ = ["QUICK", "SCHEMA", "TorchrecConfig", "main", "markdown", "run_torchrec", "tables"]

SCHEMA = "jaxembed.bench.serving.torchrec_qebc/1"
IMPLEMENTATIONS = ("jaxembed", "torchrec")
SCORE_ATOL = 1e-6
"""Scores of the same rows in both libraries: float32 rounding of the MLP (and of TorchRec's
and XLA's pooled sums in their orders)."""


@dataclasses.dataclass(frozen=True)
class TorchrecConfig:
    """The model and timing (`latency.LatencyConfig`), and the thread counts, a child each."""

    model: latency.LatencyConfig = dataclasses.field(
        default_factory=lambda: dataclasses.replace(latency.LatencyConfig(), max_seconds=3.0)
    )
    threads: tuple[int, ...] = (1, 2)
    quick: bool = False


QUICK = TorchrecConfig(model=latency.QUICK, threads=(1,), quick=True)
"""`--quick`: latency's tiny model, one thread; the times mean nothing."""


def _leaves(path: Path) -> dict[str, np.ndarray]:
    with np.load(path / "params.npz") as f:
        return dict(f)


# --- the child process: load, build in TorchRec, check and time (never imports jaxembed) -----


def _set_threads(threads: int) -> dict[str, Any]:
    """Pins this process to `threads` CPUs; call before jax and torch start."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    os.sched_setaffinity(0, cpus)
    return {"threads": threads, "cpus": cpus, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "")}  # fmt: skip


def _codes(data: np.ndarray, bits: int) -> np.ndarray:
    """uint8 `[V, B]` packed rows -> int64 `[V, B·8/bits]` codes, the first in the low bits."""
    n = 8 // bits
    shifts = np.arange(n, dtype=np.uint8) * bits
    codes = (data[..., None] >> shifts) & np.uint8(2**bits - 1)
    return codes.reshape(len(data), -1).astype(np.int64)


def _row_check(rows, leaves: dict[str, np.ndarray], precision: str) -> dict[str, Any]:
    """TorchRec's TBE rows against the jaxembed artifact's leaves of the same tables."""
    if precision == "float":
        same = all(np.array_equal(d.view(np.float32), leaves[f"['tables'][{f}]"])
                   for f, (d, _, _) in enumerate(rows))  # fmt: skip
        return {"rows_equal_fraction": 1.0 if same else 0.0}
    bits = {"int8": 8, "int4": 4}[precision]
    count = {"rows": 0, "rows_equal": 0, "codes": 0, "codes_differing": 0,
             "scales_differing": 0, "biases_differing": 0}  # fmt: skip
    worst = 0
    for f, (data, scale, bias) in enumerate(rows):
        mine = [leaves[f"['tables'][{f}].{a}"] for a in ("data", "scale", "bias")]
        diff = np.abs(_codes(mine[0], bits) - _codes(data, bits))
        same_scale = scale.view(np.uint16) == mine[1].view(np.uint16)
        same_bias = bias.view(np.uint16) == mine[2].view(np.uint16)
        count["rows"] += len(data)
        count["rows_equal"] += int(((diff == 0).all(axis=1) & same_scale & same_bias).sum())
        count["codes"] += diff.size
        count["codes_differing"] += int((diff > 0).sum())
        count["scales_differing"] += int((~same_scale).sum())
        count["biases_differing"] += int((~same_bias).sum())
        worst = max(worst, int(diff.max()))
    return {**count, "rows_equal_fraction": round(count["rows_equal"] / count["rows"], 6),
            "max_code_difference": worst}  # fmt: skip


def child(work: Path, threads: int) -> None:
    """Loads the artifacts, builds the TorchRec models, checks and times them; writes
    `work/child-{threads}.json`."""
    settings = _set_threads(threads)
    sys.modules["jaxembed"] = None  # from here on `import jaxembed` raises ImportError
    sys.path.insert(0, str(work))
    from benchmarks.serving import torchrec_runner as tr

    tr.require()
    import jax
    import loader  # the copy beside the artifacts
    import torch

    from benchmarks.common.timing import TimingPolicy, time_interleaved, time_record

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(threads)  # before any parallel work; unused by a forward
    plan = json.loads((work / "plan.json").read_text())
    config = latency.LatencyConfig(**{k: tuple(v) if isinstance(v, list) else v
                                      for k, v in plan["config"].items()})  # fmt: skip
    policy = TimingPolicy(
        repeats=config.repeats, warmup=config.warmup, settle=0,
        min_samples=config.min_samples, max_seconds=config.max_seconds,
    )  # fmt: skip
    first_batch = config.batches[0]
    leaves = {p: _leaves(work / f"{p}-{first_batch}") for p in config.precisions}
    start = time.perf_counter()
    base = tr.float_ranker(leaves["float"], config.features)
    torchrec = {p: tr.quantized(base, p) for p in config.precisions}
    build_s = time.perf_counter() - start
    same_rows = {p: tr.with_rows(base, p, leaves[p]) for p in config.precisions if p != "float"}
    del base
    rows = {p: _row_check(tr.tbe_rows(m), leaves[p], p) for p, m in torchrec.items()}
    del leaves
    first: dict[str, Any] = {}
    results: dict[str, Any] = {}
    for batch in config.batches:
        models = {}
        for p in config.precisions:
            models[p] = loader.load(work / f"{p}-{batch}",
                                    params=first[p].params if p in first else None)  # fmt: skip
            first.setdefault(p, models[p])
        ids, dense = latency.inputs(config, batch, seed=0)
        kjt, dense_t = tr.inputs(ids, dense)
        mine = {p: np.asarray(m(ids, dense)) for p, m in models.items()}
        theirs = {p: tr.scores(m, kjt, dense_t) for p, m in torchrec.items()}
        for p in config.precisions:
            same = None if p not in same_rows else tr.scores(same_rows[p], kjt, dense_t)
            results[f"{p}-{batch}"] = {
                "jaxembed_scores": mine[p].reshape(-1).tolist(),
                "torchrec_max_abs_diff_to_jaxembed": float(np.abs(theirs[p] - mine[p]).max()),
                "torchrec_on_jaxembed_rows_max_abs_diff": None if same is None
                else float(np.abs(same - mine[p]).max()),
                "jaxembed_score_error_vs_float": float(np.abs(mine[p] - mine["float"]).max()),
                "torchrec_score_error_vs_float": float(np.abs(theirs[p] - theirs["float"]).max()),
            }  # fmt: skip
        sets = [latency.inputs(config, batch, seed=1 + k) for k in range(config.input_sets)]
        device_sets = [tuple(jax.device_put(a) for a in s) for s in sets]
        torch_sets = [tr.inputs(*s) for s in sets]

        def jax_runner(model, sets):
            turns = iter(range(2**62))  # each call takes the next input set
            return lambda: jax.block_until_ready(model(*sets[next(turns) % len(sets)]))

        runners = {}
        for p in config.precisions:
            runners[f"jaxembed-{p}"] = {"call": jax_runner(models[p], device_sets)}
            runners[f"torchrec-{p}"] = {"call": tr.runner(torchrec[p], torch_sets)}
        timed = time_interleaved(runners, policy)
        for name, calls in timed.items():
            impl, p = name.split("-")
            wall, cpu = calls["call"]
            results[f"{p}-{batch}"][impl] = {
                **time_record(wall), "cpu_time_median_in_ms": round(float(np.median(cpu)) * 1e3, 4)
            }  # fmt: skip
        del models
    leaked = [m for m, v in sys.modules.items() if m.startswith("jaxembed") and v is not None]
    (work / f"child-{threads}.json").write_text(json.dumps({
        "results": results, "rows": rows, "jaxembed_imported": bool(leaked),
        "devices": len(jax.devices()), "torchrec_build_time_in_s": round(build_s, 2),
        "settings": {**settings, **tr.versions(),
                     "os_threads": len(os.listdir("/proc/self/task"))},
    }))  # fmt: skip


# --- the record ---------------------------------------------------------------------------------


def _paired(mine: Sequence[float], base: Sequence[float]) -> float | None:
    if not mine or len(mine) != len(base):
        return None
    return round(float(np.median(np.asarray(mine) / np.asarray(base))), 3)


def _child_env(threads: int) -> dict[str, str]:
    flags = "--xla_force_host_platform_device_count=1"
    if threads == 1:
        flags += " --xla_cpu_multi_thread_eigen=false"
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags, OMP_NUM_THREADS=str(threads),
                MKL_NUM_THREADS=str(threads))  # fmt: skip


def run_torchrec(config: TorchrecConfig, say: Callable[[str], None] = lambda s: None):
    """Exports the ranker, then per thread count loads, checks and times it against TorchRec
    in a child process; the record.

    Raises:
      RuntimeError: torch, fbgemm_gpu or torchrec is missing, or a child failed.
    """
    from benchmarks.common import report
    from benchmarks.serving import torchrec_runner

    torchrec_runner.require()  # here only to fail early with the install hint
    model = config.model
    children: dict[int, Any] = {}
    with tempfile.TemporaryDirectory(prefix="jaxembed-torchrec-") as tmp:
        work = Path(tmp)
        info = latency.export_all(model, work, say)
        (work / "plan.json").write_text(json.dumps({"config": dataclasses.asdict(model)}))
        with np.load(work / "expected.npz") as e:
            expected = dict(e)
        for threads in config.threads:
            say(f"{threads} thread(s): load, build in TorchRec, check and time (no jaxembed)")
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.serving.torchrec_qebc", "--child", str(work),
                 "--threads", str(threads)],
                cwd=latency.ROOT, env=_child_env(threads), capture_output=True, text=True,
                timeout=3600,
            )  # fmt: skip
            if proc.returncode != 0:
                raise RuntimeError(f"the {threads}-thread process failed:\n{proc.stderr[-4000:]}")
            children[threads] = json.loads((work / f"child-{threads}.json").read_text())
    cases = []
    for threads, measured in children.items():
        for batch in model.batches:
            for p in model.precisions:
                r = measured["results"][f"{p}-{batch}"]
                mine, theirs = r["jaxembed"], r["torchrec"]
                got = np.asarray(r.pop("jaxembed_scores"), np.float32)
                want = expected[f"{p}-{batch}"].reshape(-1)
                own_ok = measured["rows"][p]["rows_equal_fraction"] == 1.0
                cases.append({
                    "name": f"threads={threads},{latency.case_name(model, batch, p)}",
                    "threads": threads, "batch": batch, "precision": p, **r,
                    "time_ratio_torchrec_to_jaxembed": round(
                        theirs["time_median_in_ms"] / mine["time_median_in_ms"], 3),
                    "paired_time_ratio_torchrec_to_jaxembed": _paired(
                        theirs["time_samples_in_ms"], mine["time_samples_in_ms"]),
                    "jaxembed_matches_in_process": bool(np.allclose(got, want, rtol=1e-6,
                                                                    atol=1e-7)),
                    "torchrec_matches": (r["torchrec_max_abs_diff_to_jaxembed"] <= SCORE_ATOL
                                         if own_ok else None),
                    "torchrec_on_jaxembed_rows_matches": None
                    if r["torchrec_on_jaxembed_rows_max_abs_diff"] is None
                    else r["torchrec_on_jaxembed_rows_max_abs_diff"] <= SCORE_ATOL,
                    "params_bytes": info[p]["params_bytes"],
                })  # fmt: skip
    first = children[config.threads[0]]
    return {
        "schema": SCHEMA,
        "machine": {**report.machine(), "load_average": list(os.getloadavg())},
        "config": {**dataclasses.asdict(config), "score_atol": SCORE_ATOL},
        "loading_processes": {t: {"jaxembed_imported": c["jaxembed_imported"],
                                  "device_count": c["devices"], "settings": c["settings"],
                                  "torchrec_build_time_in_s": c["torchrec_build_time_in_s"]}
                              for t, c in children.items()},
        "rows": first["rows"],
        "cases": cases,
    }  # fmt: skip


def tables(record: dict[str, Any]) -> list[Any]:
    """One table a thread count and batch size, then TorchRec's rows against jaxembed's."""
    c = record["config"]["model"]
    out = []
    for threads in record["config"]["threads"]:
        for batch in c["batches"]:
            rows = []
            for x in record["cases"]:
                if x["threads"] != threads or x["batch"] != batch:
                    continue
                j, t = x["jaxembed"], x["torchrec"]
                same = x["torchrec_on_jaxembed_rows_max_abs_diff"]
                rows.append([x["precision"], f"{j['time_median_in_ms']:.3f}",
                             f"{j['time_p90_in_ms']:.3f}", f"{t['time_median_in_ms']:.3f}",
                             f"{t['time_p90_in_ms']:.3f}",
                             f"{x['time_ratio_torchrec_to_jaxembed']:.2f}",
                             _fmt(x["paired_time_ratio_torchrec_to_jaxembed"]),
                             f"{j['cpu_time_median_in_ms']:.3f}",
                             f"{t['cpu_time_median_in_ms']:.3f}",
                             f"{x['torchrec_max_abs_diff_to_jaxembed']:.1e}",
                             "-" if same is None else f"{same:.1e}",
                             f"{x['jaxembed_score_error_vs_float']:.1e}"])  # fmt: skip
            title = (f"threads={threads}, batch={batch}: {c['features']} features x "
                     f"{c['rows']} rows x dim {c['dim']}, bags of {c['bag_length']}, "
                     f"MLP {c['hidden']}")  # fmt: skip
            headers = ["tables", "jaxembed ms", "p90", "torchrec ms", "p90", "x jaxembed",
                       "paired", "jaxembed cpu ms", "torchrec cpu ms", "|score diff|",
                       "on jaxembed's rows", "jaxembed err vs float"]  # fmt: skip
            out.append((title, headers, rows))
    rows = [[p, str(r["rows_equal_fraction"]), str(r.get("codes_differing", "-")),
             str(r.get("max_code_difference", "-")), str(r.get("scales_differing", "-")),
             str(r.get("biases_differing", "-"))] for p, r in record["rows"].items()]  # fmt: skip
    out.append(("TorchRec's quantized rows against jaxembed's (the same float tables)",
                ["tables", "rows equal", "codes differing", "max code diff", "scales differing",
                 "biases differing"], rows))  # fmt: skip
    return out


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(record: dict[str, Any]) -> str:
    """The record's tables as Markdown, under the command, the machine and the settings."""
    from benchmarks.common.report import markdown_tables

    m = record["machine"]
    settings = "; ".join(
        f"{t} thread(s): CPUs {s['settings']['cpus']}, torch threads "
        f"{s['settings']['torch_num_threads']}, XLA_FLAGS `{s['settings']['xla_flags']}`"
        for t, s in record["loading_processes"].items()
    )
    any_settings = next(iter(record["loading_processes"].values()))["settings"]
    head = (
        "Made by `python -m benchmarks.serving.torchrec_qebc --json "
        "benchmarks/results/serving/torchrec_qebc.json --markdown "
        "benchmarks/results/serving/torchrec_qebc.md` "
        f"({m['date']}, {m['cpu_count']} CPU cores, {m['processor']}, jax {m['jax']}, torch "
        f"{any_settings['torch']}, fbgemm_gpu {any_settings['fbgemm_gpu']}, torchrec "
        f"{any_settings['torchrec']}; load average at the end {m['load_average'][0]:.1f}). "
        "jaxembed: the exported model loaded without jaxembed; torchrec: the same weights in "
        "a TorchRec EBC quantized by `torchrec.inference.modules.quantize_embeddings` (float: "
        "its FP32 rows), the same MLP; interleaved in one process per thread count "
        f"({settings}). `x jaxembed`: TorchRec's median over jaxembed's; `paired`: the median "
        "of per-round ratios; `|score diff|`: the largest difference of their scores at the "
        "check batch; `on jaxembed's rows`: the same for a TorchRec module holding jaxembed's "
        f"quantized rows (tolerance {record['config']['score_atol']:g}).\n"
    )
    return head + "\n" + markdown_tables(tables(record))


def main(argv: Sequence[str]) -> int:
    """`python -m benchmarks.serving.torchrec_qebc [--quick] [--json PATH] [--markdown PATH]`."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.serving.torchrec_qebc",
        description="The exported ranker against TorchRec's quantized EmbeddingBagCollection.",
    )
    p.add_argument("--quick", action="store_true", help="tiny shapes, few calls (for tests)")
    p.add_argument("--json", metavar="PATH", help="write the record as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the tables as Markdown")
    p.add_argument("--batches", type=latency._ints, metavar="B,B,...", help="e.g. 1,64,512")
    p.add_argument("--threads", type=latency._ints, metavar="N,N,...", help="e.g. 1,2")
    p.add_argument("--rows", type=int, help="rows of each table")
    p.add_argument("--repeats", type=int, help="interleaved timing rounds")
    p.add_argument("--max-seconds", type=float, help="timed seconds per model and batch")
    p.add_argument("--child", metavar="DIR", help=argparse.SUPPRESS)
    args = p.parse_args(list(argv))
    if args.child:
        child(Path(args.child), args.threads[0] if args.threads else 1)
        return 0
    config = QUICK if args.quick else TorchrecConfig()
    flags = (("batches", args.batches), ("rows", args.rows), ("repeats", args.repeats),
             ("max_seconds", args.max_seconds))  # fmt: skip
    changes = {k: v for k, v in flags if v is not None}
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, **changes))
    if args.threads:
        config = dataclasses.replace(config, threads=args.threads)
    from benchmarks.common import report

    try:
        record = run_torchrec(config, say=lambda s: print(f"[serving-torchrec] {s}",
                                                          file=sys.stderr))  # fmt: skip
    except RuntimeError as err:
        print(f"python -m benchmarks.serving.torchrec_qebc: error: {err}", file=sys.stderr)
        return 3
    report.print_table_list(f"{SCHEMA} on {record['machine']['cpu_count']} CPU cores",
                            tables(record))  # fmt: skip
    report.write_outputs(record, json_path=args.json, markdown_path=args.markdown,
                         markdown=lambda: markdown(record))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
