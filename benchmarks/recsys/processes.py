"""`jaxembed bench recsys-processes`: the recsys step on 2 processes × 1 device against 1 × 1.

Issue 22 asks for the scale-out ratio across processes too. This runs `bench recsys`'s step
(`benchmarks.recsys.impls`, a jaxembed variant) three ways on the same cores:

| row | what |
|---|---|
| `1 x 1` | one process, one CPU device: the whole step |
| `2 x 1` | two processes (`jaxembed.launch`, gloo), a CPU device each: a 2-device mesh over both |
| `1 x 2` | one process, two simulated devices: the same mesh within a process |

Each run times `--steps` steps after `--warmup` (the median of `perf_counter` around
`block_until_ready`); the native kernels get `cores / devices in the machine` threads each (1
per device on 2 cores, as the 1 × 2 process gives them by default). The runs are sequential
(one at a time on the cores), so their ratios carry the machine's drift.

    python -m benchmarks recsys-processes --workload a --variant 'jaxembed[auto]' \\
        --json benchmarks/results/recsys/processes.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


def _step_times(workload: str, variant: str, steps: int, warmup: int) -> dict[str, Any]:
    """In this process (after `jaxembed.launch.initialize` where launched): the variant on every
    device of the runtime; step times in ms, from process 0."""
    import jax
    import numpy as np

    from benchmarks.recsys import impls
    from benchmarks.recsys.workload import make_workload
    from jaxembed import workloads as W

    w = make_workload(workload)
    n = jax.device_count()
    v = impls.build_variant(variant if n > 1 else "jaxembed", w, n)
    ids, cot = v.abstract_inputs(w)
    with jax.set_mesh(v.mesh):
        step = jax.jit(v.step, donate_argnums=(0,)).lower(v.abstract_state, ids, cot).compile()

    def put(a, sharding):  # a global array from the same host value on every process
        return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])

    state = jax.device_put(v.make_state(W.make_tables(w, 0)), step.input_shardings[0][0])
    batches = [{k: put(x, v.input_sharding) for k, x in impls.dense_ids(w, W.make_batch(
        w, 0, s)).items()} for s in range(4)]  # fmt: skip
    c = put(W.make_cotangent(w, 0), v.cotangent_sharding)
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        state, loss = step(state, batches[i % 4], c)
        jax.block_until_ready((state, loss))
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return {"devices": n, "processes": jax.process_count(), "variant": v.name,
            "exchange": str(v.info.get("exchange")), "layout": str(v.info.get("layout")),
            "step_time_median_in_ms": round(float(np.median(times)), 3),
            "step_time_samples_in_ms": [round(t, 3) for t in times]}  # fmt: skip


def _run(cmd: list[str], env: dict[str, str], out: str) -> dict[str, Any]:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or not os.path.exists(out):
        return {"status": "error", "error": (proc.stdout + proc.stderr)[-2000:]}
    with open(out) as f:
        return json.load(f)


def main(argv: Sequence[str] | None = None) -> int:
    """`jaxembed bench recsys-processes [--workload a] [--variant V] [--json PATH]`."""
    p = argparse.ArgumentParser(prog="jaxembed bench recsys-processes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--workload", default="a")
    p.add_argument("--variant", default="jaxembed[auto]")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.worker:
        if "JAXEMBED_COORDINATOR" in os.environ:
            from jaxembed.launch import initialize

            initialize()
        import jax

        record = _step_times(args.workload, args.variant, args.steps, args.warmup)
        if jax.process_index() == 0:
            with open(args.out, "w") as f:
                json.dump(record, f)
        return 0
    from benchmarks.recsys.bench import _env

    cores = os.cpu_count() or 1
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, processes, devices in (("1 x 1", 1, 1), ("2 x 1", 2, 1), ("1 x 2", 1, 2)):
            out = os.path.join(tmp, f"{processes}x{devices}.json")
            worker = ["-m", "benchmarks.recsys.processes", "--worker", "--workload",
                      args.workload, "--variant", args.variant, "--steps", str(args.steps),
                      "--warmup", str(args.warmup), "--out", out]  # fmt: skip
            env = _env(devices)
            env["JAXEMBED_NUM_THREADS"] = str(max(1, cores // (processes * devices)))
            if processes > 1:
                cmd = [sys.executable, "-m", "jaxembed.launch", "--processes", str(processes),
                       "--devices-per-process", str(devices), "--",
                       os.path.abspath(__file__), *worker[2:]]  # fmt: skip
            else:
                cmd = [sys.executable, *worker]
            print(f"{name}: load {os.getloadavg()[0]:.1f}", flush=True)
            rows[name] = _run(cmd, env, out)
    one = rows["1 x 1"].get("step_time_median_in_ms")
    for rec in rows.values():
        if one and "step_time_median_in_ms" in rec:
            rec["ratio_to_1x1"] = round(rec["step_time_median_in_ms"] / one, 3)
    record = {"schema": "jaxembed.bench.recsys.processes/1", "workload": args.workload,
              "variant": args.variant, "cores": cores, "runs": rows}  # fmt: skip
    for name, rec in rows.items():
        print(name, rec.get("step_time_median_in_ms"), rec.get("ratio_to_1x1"),
              rec.get("error", "")[-500:])  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
