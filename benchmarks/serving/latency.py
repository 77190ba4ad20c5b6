"""An exported ranker's latency in a fresh process without jaxembed: float, int8 and int4 tables.

    python -m benchmarks.serving.latency \\
        --json benchmarks/results/serving/latency.json \\
        --markdown benchmarks/results/serving/latency.md

The model is DLRM-like: F sparse features, each a bag of L ids pooled (sum) from its own table
`[rows, dim]`, concatenated with D dense features into a 2-layer MLP and a sigmoid. This
process builds it (random weights; the tables quantized with `jaxembed.quantize` for int8 and
int4), exports it per batch size with `jaxembed.serving.export_inference` (`impl="xla"`: no
custom call) and saves it, the parameters once per precision (`save(..., params=False)` for
the other batch sizes). A child process, in which `import jaxembed` fails, loads each artifact
with the `loader.py` saved beside it (compiling for its shapes), checks its outputs against
this process's `jit` of the same function, and times calls on device-resident inputs (a few
distinct input sets in turn): the precisions interleaved at each batch size, after warm-up,
median and p90 of many calls (`benchmarks.common.timing`), and each precision's ratio to the
float model's median.

Running as `python -m benchmarks serving` needs one line in `benchmarks/__init__.py`'s
`SUBCOMMANDS`: `"serving": "benchmarks.serving.latency",`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["QUICK", "SCHEMA", "LatencyConfig", "main", "markdown", "run_latency", "tables"]

SCHEMA = "jaxembed.bench.serving.latency/1"
ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class LatencyConfig:
    """The model and the timing.

    Attributes:
      features, rows, dim, bag_length: F sparse features, each a table `[rows, dim]` and a
        bag of `bag_length` ids a row (about 1 in 8 slots empty, -1).
      dense, hidden: the dense features and the MLP's hidden width.
      batches, precisions: the batch sizes served and the tables' formats.
      repeats, warmup, min_samples, max_seconds: interleaved rounds, untimed calls first,
        and the time budget of one precision at one batch size (after `min_samples`).
      input_sets: distinct inputs the timed calls cycle through.
    """

    features: int = 26
    rows: int = 100_000
    dim: int = 64
    bag_length: int = 4
    dense: int = 13
    hidden: int = 256
    batches: tuple[int, ...] = (1, 64, 512)
    precisions: tuple[str, ...] = ("float", "int8", "int4")
    repeats: int = 400
    warmup: int = 20
    min_samples: int = 50
    max_seconds: float = 4.0
    input_sets: int = 8
    quick: bool = False


QUICK = LatencyConfig(
    features=4, rows=1000, dim=16, hidden=32, batches=(1, 8), repeats=3, warmup=1,
    min_samples=1, max_seconds=0.2, input_sets=2, quick=True,
)  # fmt: skip
"""`--quick`: tiny shapes and a few calls, to exercise the code; the times mean nothing."""


def case_name(config: LatencyConfig, batch: int, precision: str) -> str:
    return (f"batch={batch},precision={precision},features={config.features},"
            f"rows={config.rows},dim={config.dim},bag={config.bag_length}")  # fmt: skip


def inputs(config: LatencyConfig, batch: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """ids int32 `[B, F, L]` (-1 marks an empty slot) and dense float32 `[B, D]`."""
    rng = np.random.default_rng([batch, seed])
    ids = rng.integers(0, config.rows, (batch, config.features, config.bag_length))
    ids = np.where(rng.random(ids.shape) < 0.125, -1, ids).astype(np.int32)
    return ids, rng.standard_normal((batch, config.dense)).astype(np.float32)


# --- this process: build, export, save (imports jaxembed) ---------------------------------------


def _ranker(params: dict[str, Any], ids: Any, dense: Any) -> Any:
    """f32[B, 1] click probabilities of ids i32[B, F, L] and dense f32[B, D]."""
    import jax
    import jax.numpy as jnp

    import jaxembed

    pooled = [jaxembed.embedding_bag(ids[:, f], table, combiner="sum", impl="xla")  # f32[B, H]
              for f, table in enumerate(params["tables"])]  # fmt: skip
    x = jnp.concatenate([*pooled, dense], axis=-1)  # f32[B, F·H + D]
    h = jax.nn.relu(x @ params["w1"] + params["b1"][None])  # f32[B, hidden]
    return jax.nn.sigmoid(h @ params["w2"] + params["b2"][None])


def _params(config: LatencyConfig, precision: str) -> dict[str, Any]:
    import jax.numpy as jnp

    from jaxembed.quant import quantize

    rng = np.random.default_rng(0)
    tables = [
        jnp.asarray(rng.standard_normal((config.rows, config.dim), np.float32) * 0.1)
        for _ in range(config.features)
    ]
    if precision != "float":
        tables = [quantize(t, precision) for t in tables]
    width = config.features * config.dim + config.dense
    return {
        "tables": tables,
        "w1": jnp.asarray(rng.standard_normal((width, config.hidden), np.float32) / width**0.5),
        "b1": jnp.zeros(config.hidden, jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((config.hidden, 1), np.float32) / config.hidden**0.5),
        "b2": jnp.zeros(1, jnp.float32),
    }


def export_all(config: LatencyConfig, work: Path, say: Callable[[str], None]) -> dict[str, Any]:
    """Exports and saves every (precision, batch) under `work`; writes the check inputs'
    in-process outputs to `work/expected.npz`. Returns what the record keeps of each."""
    import jax

    from jaxembed import serving

    info: dict[str, Any] = {}
    expected = {}
    for precision in config.precisions:
        params = _params(config, precision)
        info[precision] = {"exported_bytes": {}, "export_time_in_s": {}}
        for i, batch in enumerate(config.batches):
            say(f"export {precision} batch {batch}")
            ids, dense = inputs(config, batch, seed=0)
            start = time.perf_counter()
            artifact = serving.export_inference(_ranker, params, ids, dense)
            info[precision]["export_time_in_s"][batch] = round(time.perf_counter() - start, 3)
            assert artifact.native_targets == ()
            serving.save(artifact, work / f"{precision}-{batch}", params=i == 0)
            info[precision]["exported_bytes"][batch] = len(artifact.serialized)
            info[precision]["params_bytes"] = sum(a.nbytes for a in artifact.leaves)
            expected[f"{precision}-{batch}"] = np.asarray(jax.jit(_ranker)(params, ids, dense))
        del params
    np.savez(work / "expected.npz", **expected)
    first = f"{config.precisions[0]}-{config.batches[0]}"
    shutil.copyfile(work / first / "loader.py", work / "loader.py")  # one for all of them
    return info


# --- the child process: load and time (never imports jaxembed) ---------------------------------


def child(work: Path) -> None:
    """Loads every artifact in `work` with its `loader.py` and times it; writes
    `work/child.json` (times, load times) and `work/outputs.npz` (the check outputs)."""
    sys.modules["jaxembed"] = None  # from here on `import jaxembed` raises ImportError
    sys.path.insert(0, str(work))
    import jax
    import loader  # the copy beside the artifacts

    from benchmarks.common.timing import TimingPolicy, time_interleaved, time_record

    plan = json.loads((work / "plan.json").read_text())
    config = LatencyConfig(**{k: tuple(v) if isinstance(v, list) else v
                              for k, v in plan["config"].items()})  # fmt: skip
    policy = TimingPolicy(
        repeats=config.repeats, warmup=config.warmup, settle=0,
        min_samples=config.min_samples, max_seconds=config.max_seconds,
    )  # fmt: skip
    first: dict[str, Any] = {}
    results: dict[str, Any] = {}
    outputs = {}
    for batch in config.batches:
        models = {}
        for precision in config.precisions:
            start = time.perf_counter()
            models[precision] = loader.load(
                work / f"{precision}-{batch}",
                params=first[precision].params if precision in first else None,
            )
            load_s = time.perf_counter() - start
            first.setdefault(precision, models[precision])
            ids, dense = inputs(config, batch, seed=0)
            outputs[f"{precision}-{batch}"] = np.asarray(models[precision](ids, dense))
            results[f"{precision}-{batch}"] = {"load_time_in_s": round(load_s, 3)}
        sets = [tuple(jax.device_put(a) for a in inputs(config, batch, seed=1 + k))
                for k in range(config.input_sets)]  # fmt: skip

        def runner(model, sets):
            turns = iter(range(2**62))  # each call takes the next input set

            def call():
                jax.block_until_ready(model(*sets[next(turns) % len(sets)]))

            return call

        times = time_interleaved({p: runner(m, sets) for p, m in models.items()}, policy)
        for precision, seconds in times.items():
            results[f"{precision}-{batch}"].update(time_record(seconds))
    leaked = [m for m, v in sys.modules.items() if m.startswith("jaxembed") and v is not None]
    np.savez(work / "outputs.npz", **outputs)
    (work / "child.json").write_text(json.dumps({
        "results": results, "jaxembed_imported": bool(leaked), "devices": len(jax.devices()),
    }))  # fmt: skip


# --- the record -------------------------------------------------------------------------------


def run_latency(config: LatencyConfig, say: Callable[[str], None] = lambda s: None):
    """Exports every case, loads and times them in a child process; the record."""
    from benchmarks.common import report

    with tempfile.TemporaryDirectory(prefix="jaxembed-serving-") as tmp:
        work = Path(tmp)
        info = export_all(config, work, say)
        (work / "plan.json").write_text(json.dumps({"config": dataclasses.asdict(config)}))
        say("load and time in a fresh process without jaxembed")
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.serving.latency", "--child", str(work)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"the loading process failed:\n{proc.stderr[-4000:]}")
        measured = json.loads((work / "child.json").read_text())
        with np.load(work / "expected.npz") as e, np.load(work / "outputs.npz") as o:
            expected, outputs = dict(e), dict(o)
    cases = []
    for batch in config.batches:
        base = measured["results"].get(f"float-{batch}")
        for precision in config.precisions:
            key = f"{precision}-{batch}"
            got, want = outputs[key], expected[key]
            timed = measured["results"][key]
            cases.append({
                "name": case_name(config, batch, precision),
                "batch": batch,
                "precision": precision,
                **timed,
                "ratio_to_float": None if base is None else round(
                    timed["time_median_in_ms"] / base["time_median_in_ms"], 3),
                "params_bytes": info[precision]["params_bytes"],
                "exported_bytes": info[precision]["exported_bytes"][batch],
                "export_time_in_s": info[precision]["export_time_in_s"][batch],
                "max_abs_error_vs_in_process": float(np.max(np.abs(got - want))),
                "matches_in_process": bool(np.allclose(got, want, rtol=1e-6, atol=1e-7)),
                "max_abs_score_error_vs_float": None if f"float-{batch}" not in expected
                else float(np.max(np.abs(got - expected[f"float-{batch}"]))),
            })  # fmt: skip
    return {
        "schema": SCHEMA,
        "machine": report.machine(),
        "config": dataclasses.asdict(config),
        "loading_process": {
            "jaxembed_imported": measured["jaxembed_imported"],
            "device_count": measured["devices"],
        },
        "cases": cases,
    }


def tables(record: dict[str, Any]) -> list[Any]:
    """One table a batch size: each precision's latency, its ratio to float, its bytes."""
    from benchmarks.common.report import fmt_bytes

    c = record["config"]
    out = []
    for batch in c["batches"]:
        rows = [[x["precision"], f"{x['time_median_in_ms']:.3f}", f"{x['time_p90_in_ms']:.3f}",
                 "-" if x["ratio_to_float"] is None else f"{x['ratio_to_float']:.2f}",
                 fmt_bytes(x["params_bytes"]), f"{x['load_time_in_s']:.2f}",
                 "yes" if x["matches_in_process"] else "NO",
                 f"{x['max_abs_score_error_vs_float'] or 0:.1e}"]
                for x in record["cases"] if x["batch"] == batch]  # fmt: skip
        title = (f"batch={batch}: {c['features']} features x {c['rows']} rows x dim "
                 f"{c['dim']}, bags of {c['bag_length']}, MLP {c['hidden']}")  # fmt: skip
        headers = ["tables", "median ms", "p90 ms", "x float", "params", "load s",
                   "= in-process", "score err vs float"]  # fmt: skip
        out.append((title, headers, rows))
    return out


def markdown(record: dict[str, Any]) -> str:
    """The record's tables as Markdown, under the command and the machine that made them."""
    from benchmarks.common.report import markdown_tables

    m = record["machine"]
    head = (
        "Made by `python -m benchmarks.serving.latency --json "
        "benchmarks/results/serving/latency.json --markdown "
        "benchmarks/results/serving/latency.md` "
        f"({m['date']}, {m['cpu_count']} CPU cores, {m['processor']}, jax {m['jax']}). "
        "Each artifact loaded in a fresh process without jaxembed, on 1 CPU device; "
        "times per call on device-resident inputs, the precisions interleaved; `x float` "
        "is the median's ratio to the float tables'. `= in-process`: the loaded model's "
        "outputs equal this process's `jit` of the same function (rtol 1e-6); `score err "
        "vs float`: the largest |score - float model's score| at the check batch; `load s`: "
        "deserialize and compile, plus reading params.npz at the first batch size (the "
        "others share its parameters).\n"
    )
    return head + "\n" + markdown_tables(tables(record))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main(argv: Sequence[str]) -> int:
    """`python -m benchmarks.serving.latency [--quick] [--json PATH] [--markdown PATH] ...`."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.serving.latency",
        description="An exported ranker's latency after loading it without jaxembed.",
    )
    p.add_argument("--quick", action="store_true", help="tiny shapes, few calls (for tests)")
    p.add_argument("--json", metavar="PATH", help="write the record as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the tables as Markdown")
    p.add_argument("--batches", type=_ints, metavar="B,B,...", help="e.g. 1,64,512")
    p.add_argument("--rows", type=int, help="rows of each table")
    p.add_argument("--features", type=int, help="sparse features (one table each)")
    p.add_argument("--repeats", type=int, help="interleaved timing rounds")
    p.add_argument("--max-seconds", type=float, help="timed seconds per precision and batch")
    p.add_argument("--child", metavar="DIR", help=argparse.SUPPRESS)
    args = p.parse_args(list(argv))
    if args.child:
        child(Path(args.child))
        return 0
    config = QUICK if args.quick else LatencyConfig()
    changes = {k: v for k, v in (("batches", args.batches), ("rows", args.rows),
               ("features", args.features), ("repeats", args.repeats),
               ("max_seconds", args.max_seconds)) if v is not None}  # fmt: skip
    config = dataclasses.replace(config, **changes)
    from benchmarks.common import report

    record = run_latency(config, say=lambda s: print(f"[serving] {s}", file=sys.stderr))
    table_list = tables(record)
    m = record["machine"]
    report.print_table_list(
        f"{SCHEMA} on {m['cpu_count']} CPU cores, 1 {m['platform']} device; jax {m['jax']}",
        table_list,
    )
    report.write_outputs(record, json_path=args.json, markdown_path=args.markdown,
                         markdown=lambda: markdown(record))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
