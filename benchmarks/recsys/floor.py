"""`jaxembed bench recsys-floor`: what n devices on these cores could do at best.

A scale-out step divides the work by the devices and adds collectives. On simulated CPU
devices the devices share the cores, so how close can t(n) / t(1) get to 1 here at all? This
benchmark measures that floor. In one process with n devices it runs, interleaved
(`benchmarks.common.timing`), side by side:

| row | what |
|---|---|
| `1 device` | the whole step on the first device (its native kernels given every core) |
| `split` | n 1-device steps at once, each on 1/n of the batch and of every table's rows |
| `jaxembed...` | the n-device step (`bench recsys`'s variants) |

`split` is work ÷ n with no collective at all (each device's ids drawn from its own smaller
tables): no sharded step can beat it. All are `bench recsys`'s step (`jaxembed` on a
one-device mesh for the first two).

    jaxembed bench recsys-floor --workloads a,dlrm --variants 'jaxembed,jaxembed[routed]' \\
        --json benchmarks/results/recsys/floor.json --markdown benchmarks/results/recsys/floor.md

The split steps compute something else than the whole step (other tables, other ids), so
they are timed, not checked; the others are `bench recsys`'s, which checks them against the
float64 reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from benchmarks.common.report import write_outputs
from benchmarks.common.timing import TimingPolicy, summarize_times, time_interleaved
from jaxembed import workloads as W

__all__ = ["FloorConfig", "main", "run_floor", "split_workload"]

SCHEMA = "jaxembed.bench.recsys.floor/1"


@dataclasses.dataclass(frozen=True)
class FloorConfig:
    """What `run_floor` measures: workloads, the device count, the n-device variants and the
    timing (`repeats` interleaved rounds, at most `max_seconds` of timed calls each)."""

    workloads: tuple[str, ...] = ("a", "dlrm")
    devices: int = 8
    variants: tuple[str, ...] = ("jaxembed", "jaxembed[routed]")
    repeats: int = 5
    max_seconds: float = 3.0
    quick: bool = False


def split_workload(w: W.Workload, n: int) -> W.Workload:
    """One device's share: the batch / n, every table ⌈rows / n⌉ rows, the same features.

    Examples:
      >>> s = split_workload(W.workload_a(batch_size=4096), 8)
      >>> s.batch_size, s.tables[0].rows, s.tables[-1].rows
      (512, 125000, 2)
    """
    if w.batch_size % n:
        raise ValueError(f"batch size {w.batch_size} does not split over {n} devices")
    tables = tuple(W.TableSpec(t.name, -(-t.rows // n), t.dim) for t in w.tables)
    return W.Workload(f"{w.name}/{n}", tables, w.features, w.batch_size // n)


class _Steps:
    """Compiled steps on their meshes, their states and batches; `__call__` runs one step of
    each (dispatched together, so the devices run them at once) and waits for all."""

    def __init__(self, variants: list[Any], workload: W.Workload):
        import jax

        self.ready, self.calls = [], 0
        for v in variants:
            ids, cot = v.abstract_inputs(workload)
            with jax.set_mesh(v.mesh):
                step = jax.jit(v.step, donate_argnums=(0,)).lower(v.abstract_state, ids, cot)
                step = step.compile()
            state = jax.device_put(v.make_state(W.make_tables(workload, 0)),
                                   step.input_shardings[0][0])  # fmt: skip
            batches = [v.prepare(workload, W.make_batch(workload, 0, s)) for s in range(4)]
            cot = jax.device_put(W.make_cotangent(workload, 0), v.cotangent_sharding)
            self.ready.append([step, state, batches, cot])

    def __call__(self) -> None:
        import jax

        out = []
        for r in self.ready:
            r[1], loss = r[0](r[1], r[2][self.calls % len(r[2])], r[3])
            out.append((r[1], loss))
        jax.block_until_ready(out)
        self.calls += 1


def _worker(workload: str, devices: int, variants: Sequence[str], config: FloorConfig):
    import jax

    from benchmarks.recsys import impls
    from benchmarks.recsys.workload import make_workload

    w = make_workload(workload, quick=config.quick)
    runners = {}
    # The whole step on one device, as a 1-device process runs it: its kernels read their
    # thread count when traced (`jaxembed.kernels.native.num_threads`), so every core.
    os.environ["JAXEMBED_NUM_THREADS"] = str(os.cpu_count() or 1)
    try:
        whole = impls.build_variant("jaxembed", w, 1, devices=jax.devices()[:1])
        runners["1 device"] = _Steps([whole], w)
    finally:
        del os.environ["JAXEMBED_NUM_THREADS"]
    share = split_workload(w, devices)
    split = [impls.build_variant("jaxembed", share, 1, devices=[d])
             for d in jax.devices()[:devices]]  # fmt: skip
    runners["split"] = _Steps(split, share)
    for name in variants:
        runners[name] = _Steps([impls.build_variant(name, w, devices)], w)
    policy = TimingPolicy(repeats=config.repeats, warmup=2, settle=1, min_samples=5,
                          max_seconds=config.max_seconds)  # fmt: skip
    times = time_interleaved(runners, policy)
    out = {name: summarize_times(t, None, "step_time") for name, t in times.items()}
    one = out["1 device"]["step_time_median_in_ms"]
    for rec in out.values():
        rec["ratio_to_1_device"] = round(rec["step_time_median_in_ms"] / one, 3)
    return out


def run_floor(config: FloorConfig, log=print) -> dict[str, Any]:
    """Runs each workload's n-device process; the record."""
    from benchmarks.recsys.bench import _env, _run_json

    record: dict[str, Any] = {
        "schema": SCHEMA, "config": dataclasses.asdict(config),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "workloads": {},
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for workload in config.workloads:
            out = os.path.join(tmp, f"{workload}.json")
            cmd = [sys.executable, "-m", "benchmarks.recsys.floor", "--worker",
                   "--workload", workload, "--devices", str(config.devices), "--out", out,
                   "--variants", ",".join(config.variants), "--repeats", str(config.repeats),
                   "--max-seconds", str(config.max_seconds)]  # fmt: skip
            if config.quick:
                cmd.append("--quick")
            log(f"{workload}: {config.devices} devices, load {os.getloadavg()[0]:.1f}")
            got = _run_json(cmd, _env(config.devices), out, 3600)
            got.pop("process_wall_time_in_s", None)
            record["workloads"][workload] = got
    record["loadavg_after"] = list(os.getloadavg())
    return record


def markdown(record: dict[str, Any]) -> str:
    """The record's table: step ms and the ratio to the 1-device step, per workload."""
    n = record["config"]["devices"]
    lines = [f"| step | {' | '.join(f'{w} ms | {w} / 1 device' for w in record['workloads'])} |",
             "|---|" + "---|---|" * len(record["workloads"])]  # fmt: skip
    names = list(dict.fromkeys(k for r in record["workloads"].values() for k in r))
    label = {"split": f"split: {n} independent 1-device steps, 1/{n} each, no collective"}
    for name in names:
        cells = []
        for rows in record["workloads"].values():
            rec = rows.get(name, {})
            ms, ratio = rec.get("step_time_median_in_ms"), rec.get("ratio_to_1_device")
            cells += [f"{ms:.1f}" if ms else "-", f"{ratio:.2f}" if ratio else "-"]
        lines.append(f"| {label.get(name, name)} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxembed bench recsys-floor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--workloads", default="a,dlrm")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--variants", default="jaxembed,jaxembed[routed]")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-seconds", type=float, default=3.0)
    p.add_argument("--quick", action="store_true", help="tiny shapes: the times mean nothing")
    p.add_argument("--json")
    p.add_argument("--markdown")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """`jaxembed bench recsys-floor [--workloads a,dlrm] [--devices 8] [--json PATH] ...`."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    config = FloorConfig(
        workloads=tuple(x for x in args.workloads.split(",") if x), devices=args.devices,
        variants=tuple(x for x in args.variants.split(",") if x), repeats=args.repeats,
        max_seconds=args.max_seconds, quick=args.quick,
    )  # fmt: skip
    if args.worker:
        from benchmarks.common.report import to_json, write

        write(args.out, to_json(_worker(args.workload, args.devices, config.variants, config)))
        return 0
    record = run_floor(config, log=lambda m: print(m, flush=True))
    text = markdown(record)
    print(text)
    write_outputs(record, json_path=args.json, markdown_path=args.markdown,
                  markdown=lambda: text)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
