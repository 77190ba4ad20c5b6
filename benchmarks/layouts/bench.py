"""`jaxembed bench` (`python -m benchmarks`): jaxembed against the lookups users would pick.

For every layout, each implementation runs the same training step under `jax.jit` with the
same in/out shardings: the lookup's forward, its backward for a given cotangent, and one SGD
update (elementwise, so it needs no communication). The benchmark

1. compiles each step ahead of time and reads, from the compiled HLO, every collective and
   its wire bytes per device (ring model, `jaxembed.hlo`), and from `memory_analysis()` the
   temp and argument bytes per device, with the compile time;
2. runs each step once and checks its output and updated table against a dense float64
   reference on the host;
3. times the steps interleaved (`benchmarks.common.timing`) and reports medians, p90s and
   ratios to jaxembed; beside them, the time of the SGD update alone (`update_floor`), which
   every implementation pays;
4. sweeps the vocabulary (compile only: bytes and memory), the device count and the batch size
   (where jaxembed's plan switches from the rows to the dense gradient exchange).

Implementations: `benchmarks.layouts.impls`. Layouts: `benchmarks.layouts.cases.LAYOUTS`.

    python -m benchmarks --quick --json /tmp/bench.json
    python -m benchmarks --json benchmarks/results/layouts/results.json \\
        --plot benchmarks/results/layouts/ --markdown /tmp/tables.md
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax

from benchmarks.common import report as common_report
from benchmarks.common.timing import TimingPolicy
from benchmarks.layouts import report
from benchmarks.layouts.cases import LAYOUTS, MAIN_LAYOUTS, Case, sweep_layout
from benchmarks.layouts.impls import IMPLEMENTATIONS, KNOWN
from benchmarks.layouts.run import run_case, slim

__all__ = ["QUICK", "BenchConfig", "main", "run_bench", "targets"]

SCHEMA = "jaxembed.bench/1"


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What `run_bench` measures.

    Attributes:
      vocab: vocabularies of the layout cases (each layout is measured at each).
      hidden: the table's hidden size.
      ids_shape: global ids shape `[B, S]` of the layout cases.
      layouts: names from `LAYOUTS`.
      implementations: names from `benchmarks.layouts.impls.KNOWN`, jaxembed first.
      dense_regime_ids: ids shape of the extra dense-regime case on `rows-on-model`, or None.
      timing: repeats, warm-up and time budget per implementation.
      learning_rate: SGD's.
      seed: of tables, ids and cotangents.
      vocab_sweep: vocabularies of the vocabulary sweep (compile only), on `rows-on-model`.
      device_sweep: device counts of the device sweep (1-D meshes, ids and global batch fixed).
      batch_sweep: batch sizes B (ids `[B, S]`) of the batch sweep, on `rows-on-model`.
      sweeps: which sweeps to run: any of `vocab`, `devices`, `batch`.
      quick: tiny shapes (a label for the record; `QUICK` sets the shapes).
    """

    vocab: tuple[int, ...] = (65536,)
    hidden: int = 128
    ids_shape: tuple[int, int] = (16, 128)
    layouts: tuple[str, ...] = tuple(LAYOUTS)
    implementations: tuple[str, ...] = IMPLEMENTATIONS
    dense_regime_ids: tuple[int, int] | None = (256, 128)
    timing: TimingPolicy = dataclasses.field(default_factory=TimingPolicy)
    learning_rate: float = 0.1
    seed: int = 0
    vocab_sweep: tuple[int, ...] = (16384, 65536, 262144, 1048576)
    device_sweep: tuple[int, ...] = (1, 2, 4, 8)
    batch_sweep: tuple[int, ...] = (4, 16, 64, 128, 256, 512)
    sweeps: tuple[str, ...] = ("vocab", "devices", "batch")
    quick: bool = False


QUICK = BenchConfig(
    vocab=(32768,), hidden=16, ids_shape=(8, 16), dense_regime_ids=(512, 16),
    timing=TimingPolicy(repeats=2, warmup=0, settle=0, min_samples=1, max_seconds=0.5),
    vocab_sweep=(4096, 32768), device_sweep=(1, 8), batch_sweep=(2, 512), quick=True,
)  # fmt: skip
"""Tiny shapes for the test suite: every code path, in seconds; timings mean nothing."""


DEVICE_SWEEP_LAYOUTS = ("data-parallel", "fully-sharded")
BATCH_SWEEP_IMPLS = ("jaxembed", "jaxembed[rows]", "jaxembed[dense]", "xla")
DEVICE_SWEEP_IMPLS = ("jaxembed", "xla")


def _validate(config: BenchConfig) -> None:
    unknown = [n for n in config.layouts if n not in LAYOUTS]
    if unknown:
        raise ValueError(f"unknown layouts {unknown}: choose from {', '.join(LAYOUTS)}")
    unknown = [n for n in config.implementations if n not in KNOWN]
    if unknown:
        raise ValueError(f"unknown implementations {unknown}: choose from {', '.join(KNOWN)}")
    unknown = [s for s in config.sweeps if s not in ("vocab", "devices", "batch")]
    if unknown:
        raise ValueError(f"unknown sweeps {unknown}: choose from vocab, devices, batch")
    need = max(
        [LAYOUTS[n].num_devices for n in config.layouts]
        + [LAYOUTS["rows-on-model"].num_devices]  # the dense-regime case and two sweeps
        + (list(config.device_sweep) if "devices" in config.sweeps else [])
    )
    if len(jax.devices()) < need:
        raise ValueError(
            f"the benchmark needs {need} devices, found {len(jax.devices())}: set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax is imported "
            "(`jaxembed bench` does this itself)"
        )


def _layout_cases(config: BenchConfig) -> list[Case]:
    cases = [
        Case(LAYOUTS[name], vocab, config.hidden, config.ids_shape)
        for vocab in config.vocab
        for name in config.layouts
    ]
    if config.dense_regime_ids is not None:
        cases.append(
            Case(LAYOUTS["rows-on-model"], config.vocab[0], config.hidden,
                 config.dense_regime_ids, tag="dense-regime")
        )  # fmt: skip
    return cases


def run_bench(
    config: BenchConfig | None = None,
    *,
    progress: Callable[[str, int], None] | None = None,
) -> dict[str, Any]:
    """Runs the benchmark and returns its record (JSON-ready).

    Args:
      config: what to measure (default `BenchConfig()`); `QUICK` for tiny shapes.
      progress: called as `progress(description, units_done)` as work completes (the CLI
        draws a progress bar with it); `plan_units(config)` is the total.

    Returns:
      `{"schema", "machine", "config", "cases": [...], "sweeps": {...}, "targets": {...}}`.
      Every byte count is per device; keys carry their units (`wire_bytes`, `time_median_in_ms`,
      `compile_time_in_s`).

    Raises:
      ValueError: unknown layouts, implementations or sweeps, or too few devices.
    """
    config = BenchConfig() if config is None else config
    _validate(config)
    tick = progress or (lambda description, units: None)
    record: dict[str, Any] = {
        "schema": SCHEMA,
        "machine": common_report.machine(),
        "config": _config_record(config),
        "cases": [],
        "sweeps": {},
    }
    timing = config.timing
    common = {"learning_rate": config.learning_rate, "seed": config.seed}
    for case in _layout_cases(config):
        record["cases"].append(run_case(
            case, config.implementations, execute=True, timing=timing,
            on_compiled=lambda _, c=case: tick(_label(c), 1),
            on_phase=lambda p, c=case: tick(f"{_label(c)}: {p}", 0), **common,
        ))  # fmt: skip
    hidden, ids_shape = config.hidden, config.ids_shape
    if "vocab" in config.sweeps:
        points = []
        for vocab in config.vocab_sweep:
            case = Case(LAYOUTS["rows-on-model"], vocab, hidden, ids_shape, tag="vocab-sweep")
            points.append(slim(run_case(
                case, config.implementations, execute=False, timing=None,
                on_compiled=lambda _, v=vocab: tick(f"vocab sweep V={v}", 1), **common,
            )))  # fmt: skip
        record["sweeps"]["vocab"] = points
    if "devices" in config.sweeps:
        points = []
        for n in config.device_sweep:
            for name in DEVICE_SWEEP_LAYOUTS:
                case = Case(sweep_layout(name, n), config.vocab[0], hidden, ids_shape,
                            tag="device-sweep")  # fmt: skip
                points.append(slim(run_case(
                    case, DEVICE_SWEEP_IMPLS, execute=True, timing=timing,
                    on_compiled=lambda _, n=n: tick(f"device sweep n={n}", 1),
                    on_phase=lambda p, n=n: tick(f"device sweep n={n}: {p}", 0), **common,
                )))  # fmt: skip
        record["sweeps"]["devices"] = points
    if "batch" in config.sweeps:
        points = []
        for batch in config.batch_sweep:
            case = Case(LAYOUTS["rows-on-model"], config.vocab[0], hidden,
                        (batch, ids_shape[1]), tag="batch-sweep")  # fmt: skip
            points.append(slim(run_case(
                case, BATCH_SWEEP_IMPLS, execute=True, timing=timing,
                on_compiled=lambda _, b=batch: tick(f"batch sweep B={b}", 1),
                on_phase=lambda p, b=batch: tick(f"batch sweep B={b}: {p}", 0), **common,
            )))  # fmt: skip
        record["sweeps"]["batch"] = points
    record["targets"] = targets(record)
    return record


def _label(case: Case) -> str:
    return f"{case.layout.name} {case.tag}".strip()


def plan_units(config: BenchConfig) -> int:
    """How many units of work `run_bench` reports to `progress` (one per compiled step)."""
    units = len(_layout_cases(config)) * len(config.implementations)
    if "vocab" in config.sweeps:
        units += len(config.vocab_sweep) * len(config.implementations)
    if "devices" in config.sweeps:
        units += len(config.device_sweep) * len(DEVICE_SWEEP_LAYOUTS) * len(DEVICE_SWEEP_IMPLS)
    if "batch" in config.sweeps:
        units += len(config.batch_sweep) * len(BATCH_SWEEP_IMPLS)
    return units


def _config_record(config: BenchConfig) -> dict[str, Any]:
    out = dataclasses.asdict(config)
    out["timing"] = dataclasses.asdict(config.timing)
    return out


def _geomean(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    return round(math.exp(sum(map(math.log, values)) / len(values)), 4) if values else None


def targets(record: dict[str, Any]) -> dict[str, Any]:
    """The layouts' targets (bytes at the minimum and at most XLA's, time against XLA and the
    best alternative), evaluated on a record's layout cases.

    Evaluated on the five (2, 4) layouts (`MAIN_LAYOUTS`) at the first vocabulary; "at most
    XLA's bytes" on every case, sweeps included. `at_target_shapes` says whether the shapes are the
    targets' (V=65536, H=128, ids 16x128); with other shapes the verdicts are only indicative.

    Args:
      record: what `run_bench` returned (its `cases`).

    Returns:
      One entry per target: the measured values, the threshold and `met`.
    """
    cases = [c for c in record["cases"] if not c["tag"]]
    if not cases:
        return {}
    vocab = cases[0]["vocab"]
    main = [c for c in cases if c["layout"] in MAIN_LAYOUTS and c["vocab"] == vocab]
    dense = [c for c in record["cases"] if c["tag"] == "dense-regime"]

    def per_layout(cs: list[dict[str, Any]], key: str) -> dict[str, Any]:
        return {c["layout"]: c["summary"].get(key) for c in cs}

    out: dict[str, Any] = {
        "at_target_shapes": vocab == 65536
        and cases[0]["hidden"] == 128
        and cases[0]["ids_shape"] == [16, 128],
        "vocab": vocab,
    }
    to_min = per_layout(main, "jaxembed_wire_ratio_to_minimum")
    out["wire_within_1.1x_of_minimum"] = {
        "per_layout": to_min, "threshold": 1.1,
        "met": bool(to_min) and all(v is not None and v <= 1.1 for v in to_min.values()),
    }  # fmt: skip
    everywhere = [*record["cases"], *(p for ps in record.get("sweeps", {}).values() for p in ps)]
    to_xla = {c["name"]: c["summary"].get("jaxembed_wire_ratio_to_xla") for c in everywhere}
    to_xla = {k: v for k, v in to_xla.items() if v is not None}
    out["wire_at_most_xla"] = {
        "per_case": to_xla, "threshold": 1.0,
        "met": bool(to_xla) and all(v <= 1.0 for v in to_xla.values()),
    }  # fmt: skip
    best = per_layout(main, "jaxembed_time_ratio_to_best_alternative")
    geo = _geomean(list(best.values()))
    out["time_ratio_to_best_alternative_geomean"] = {
        "per_layout": best, "geomean": geo, "threshold": 0.8,
        "met": geo is not None and geo <= 0.8,
    }  # fmt: skip
    xla = per_layout(main, "jaxembed_time_ratio_to_xla")
    geo = _geomean(list(xla.values()))
    out["time_ratio_to_xla_geomean"] = {
        "per_layout": xla, "geomean": geo, "threshold": 0.6, "met": geo is not None and geo <= 0.6,
    }  # fmt: skip
    if dense:
        ratio = dense[0]["summary"].get("jaxembed_time_ratio_to_xla")
        out["dense_regime_time_ratio_to_xla"] = {
            "value": ratio, "threshold": 1.05, "met": ratio is not None and ratio <= 1.05,
        }  # fmt: skip
    agree = {
        f"{c['name']} / {name}": r.get("agrees_with_reference")
        for c in record["cases"]
        for name, r in c["implementations"].items()
        if r.get("status") == "ok"
    }
    out["all_agree_with_reference"] = all(agree.values()) if agree else None
    return out


# --- command line ---------------------------------------------------------------------------


def _count(text: str) -> int:
    """`65536`, `64k` (= 65536) or `1M` (= 1048576)."""
    scale = {"k": 2**10, "m": 2**20}.get(text[-1:].lower(), 1)
    digits = text[:-1] if scale > 1 else text
    try:
        value = int(digits) * scale
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a count like 65536, 64k or 1M; got {text!r}")
    return value


def _ids(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"ids shape is BxS, like 16x128; got {text!r}")
    return int(parts[0]), int(parts[1])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxembed bench",
        usage="jaxembed bench [{layouts,sparse,bags,routed,recsys,planner} ...] [-h] [--quick] "
        "[--json PATH] ...",
        description="Benchmark jaxembed.embedding against XLA's jnp.take, Flax's Embed and a "
        "one-hot matmul: wire bytes, memory, compile time and step time per layout, with "
        "vocabulary, device and batch sweeps. Runs on 8 CPU devices unless jax is already up. "
        "Subcommands (each with its own -h): `sparse` (row-sparse training steps), `bags` "
        "(pooled lookups), `routed` (the routed exchange), `recsys` (against TorchRec and "
        "keras-rs), `planner` (planned vs uniform placements); `--calibrate` measures the cost "
        "model's constants instead.",
    )
    p.add_argument("--quick", action="store_true", help="tiny shapes, few repeats (for tests)")
    p.add_argument("--json", metavar="PATH", help="write the record as JSON")
    p.add_argument("--plot", metavar="PATH",
                   help="write PNG plots: a directory, or a NAME.png prefix")  # fmt: skip
    p.add_argument("--markdown", metavar="PATH", help="write the tables as Markdown")
    p.add_argument("--layouts", nargs="+", metavar="NAME", choices=list(LAYOUTS),
                   help=f"layouts to measure (default: all): {', '.join(LAYOUTS)}")  # fmt: skip
    p.add_argument("--vocab", nargs="+", type=_count, metavar="N",
                   help="layout cases' vocabularies (default 65536); 64k, 1M work")  # fmt: skip
    p.add_argument("--hidden", type=int, metavar="N", help="hidden size (default 128)")
    p.add_argument("--ids", type=_ids, metavar="BxS", help="ids shape (default 16x128)")
    p.add_argument("--impls", nargs="+", metavar="NAME", choices=list(KNOWN),
                   help=f"implementations (default: {', '.join(IMPLEMENTATIONS)})")  # fmt: skip
    p.add_argument("--repeats", type=int, metavar="N", help="interleaved timing rounds")
    p.add_argument("--max-seconds", type=float, metavar="S",
                   help="time budget per implementation and case (default 10)")  # fmt: skip
    p.add_argument("--sweeps", nargs="*", choices=("vocab", "devices", "batch"),
                   help="sweeps to run (default: all; none with no names)")  # fmt: skip
    p.add_argument("--vocab-sweep", nargs="+", type=_count, metavar="N",
                   help="vocabularies of the vocabulary sweep")  # fmt: skip
    p.add_argument("--no-dense-regime", action="store_true",
                   help="skip the dense-regime case (ids 256x128 on rows-on-model)")  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--calibrate", action="store_true",
                   help="measure the cost model's CPU constants on this machine and save them "
                   "(jaxembed.calibrate; $JAXEMBED_COST_FILE names the file); "
                   "--repeats sets its timed calls per point")  # fmt: skip
    p.add_argument("--no-save", action="store_true",
                   help="with --calibrate: print the constants, save nothing")  # fmt: skip
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The `BenchConfig` of parsed `jaxembed bench` flags."""
    config = QUICK if args.quick else BenchConfig()
    changes: dict[str, Any] = {}
    if args.layouts:
        changes["layouts"] = tuple(dict.fromkeys(args.layouts))
    if args.vocab:
        changes["vocab"] = tuple(args.vocab)
    if args.hidden:
        changes["hidden"] = args.hidden
    if args.ids:
        changes["ids_shape"] = args.ids
    if args.impls:
        impls = tuple(dict.fromkeys(args.impls))
        changes["implementations"] = impls
    if args.sweeps is not None:
        changes["sweeps"] = tuple(args.sweeps)
    if args.vocab_sweep:
        changes["vocab_sweep"] = tuple(args.vocab_sweep)
    if args.no_dense_regime:
        changes["dense_regime_ids"] = None
    timing = {}
    if args.repeats:
        timing["repeats"] = args.repeats
    if args.max_seconds is not None:
        timing["max_seconds"] = args.max_seconds
    if timing:
        changes["timing"] = dataclasses.replace(config.timing, **timing)
    return dataclasses.replace(config, **changes)


def main(argv: list[str]) -> int:
    """`python -m benchmarks [layouts] [--quick] [--json PATH] [--plot PATH] [--layouts ...]`.

    `--calibrate [--no-save] [--repeats N]` runs `jaxembed.calibrate.calibrate` instead and
    prints the constants and where they went.

    Args:
      argv: the flags after `bench`.

    Returns:
      The exit status: 0, or 2 for bad flags or too few devices.
    """
    args = _parser().parse_args(list(argv))
    if args.calibrate:
        from jaxembed import calibrate

        return calibrate.run(save=not args.no_save, repeats=args.repeats)
    if args.no_save:
        print("jaxembed bench: error: --no-save goes with --calibrate", file=sys.stderr)
        return 2
    config = config_from_args(args)
    try:
        with common_report.progress_bar(plan_units(config), enabled=not args.no_progress) as tick:
            record = run_bench(config, progress=tick)
    except ValueError as err:
        print(f"jaxembed bench: error: {err}", file=sys.stderr)
        return 2
    report.print_tables(record)
    common_report.write_outputs(
        record, json_path=args.json, markdown_path=args.markdown,
        markdown=lambda: report.markdown(record), plot_path=args.plot, plot=report.plot_all,
    )  # fmt: skip
    return 0
