"""`python -m benchmarks defaults`: the steps of issue 43 as users write them, at the defaults.

Two measurements, each step in a fresh process (what `import jaxembed` sets up counts), the
processes one after the other on the same cores, every one timed the same way (median of
`--steps` steps after `--warmup`):

* **planner**: an NNX model (a collection over workload (a)'s 8 tables, bags of 1-20 Zipf(1.1)
  ids for the four largest and one id for the rest, a dense head; `rowwise_adagrad` for the
  tables, optax Adam for the rest) on 8 devices, batch 4096 over the mesh, trained with
  `nnx.jit` as written (no donation). `placements="auto"` with `planner={"batch_size": 4096,
  "memory_per_device": 384 MiB}` and no `id_stats`, against every uniform placement (`rows`,
  `columns`, `table`, `replicated`) that fits the budget by the planner's model.
* **scale-out**: workload (a)'s functional step (`embedding_bag` + `opt.update` per table, one
  `jax.jit` with the tables donated) on 1 device, and on 8 with the layout a user states: the
  four large tables' rows over `x` (`P("x", None)`, block rows), the small ones replicated, the
  ids over `x`; defaults otherwise.

    python -m benchmarks defaults --json benchmarks/results/defaults/defaults.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks.common.report import write_outputs

__all__ = ["main"]

ROWS = (1_000_000, 500_000, 100_000, 100_000, 50_000, 10_000, 1_000, 100)
BATCH, DIM = 4096, 64
BUDGET = 384 * 2**20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _batches(mesh: Any, steps: int, *, multi_hot: tuple[bool, ...]) -> list[dict[str, Any]]:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxembed import workloads as W

    out = []
    for s in range(steps):
        rng = np.random.default_rng([0, s])
        batch = {}
        for i, (rows, hot) in enumerate(zip(ROWS, multi_hot, strict=True)):
            width = 20 if hot else 1
            lengths = rng.integers(1, width + 1, BATCH)
            ids = W.zipf_ids(rng, int(lengths.sum()), rows, 1.1)
            dense = np.full((BATCH, width), -1, np.int32)
            dense[np.arange(width)[None, :] < lengths[:, None]] = ids
            batch[f"f{i}"] = dense if hot else dense[:, 0]
        batch["y"] = rng.random(BATCH).astype(np.float32)
        out.append({k: jax.device_put(v, NamedSharding(mesh, P("x"))) for k, v in batch.items()})
    return out


def _time(step, batches, steps, warmup) -> dict[str, Any]:
    import time

    import jax
    import numpy as np

    for i in range(warmup):
        jax.block_until_ready(step(batches[i % len(batches)]))
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(step(batches[i % len(batches)]))
        times.append((time.perf_counter() - t0) * 1e3)
    return {"step_median_in_ms": float(np.median(times)),
            "step_q25_in_ms": float(np.percentile(times, 25)),
            "step_samples_in_ms": [round(t, 3) for t in times]}  # fmt: skip


def planner_worker(placement: str, steps: int, warmup: int) -> dict[str, Any]:
    """One NNX training step of the planner case (in a process of 8 devices)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jaxembed
    import jaxembed.nnx

    mesh = jax.make_mesh((8,), ("x",))
    hot = tuple(i < 4 for i in range(len(ROWS)))
    tables = [jaxembed.TableConfig(f"t{i}", r, DIM, placement=placement)
              for i, r in enumerate(ROWS)]  # fmt: skip
    features = [jaxembed.FeatureConfig(f"f{i}", f"t{i}", max_ids=20 if h else 1)
                for i, h in enumerate(hot)]  # fmt: skip
    auto = placement == "auto"
    planner = {"batch_size": BATCH, "memory_per_device": BUDGET} if auto else None

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.coll = jaxembed.nnx.EmbeddingBagCollection(
                tables, features, rngs=rngs, placements="auto" if auto else None,
                planner=planner)  # fmt: skip
            self.head = nnx.Linear(len(ROWS) * DIM, 1, rngs=rngs)

        def __call__(self, batch):
            return self.head(self.coll.concat(self.coll(batch)))[:, 0]

    with jax.set_mesh(mesh):
        model = Model(nnx.Rngs(0))
        dense = nnx.Optimizer(model, optax.adam(1e-3), wrt=jaxembed.nnx.DENSE)
        sparse = jaxembed.nnx.SparseOptimizer(model, jaxembed.optim.rowwise_adagrad(0.05))

        @nnx.jit
        def step(model, dense, sparse, batch):
            loss_fn = lambda m: jnp.mean((m(batch) - batch["y"]) ** 2)
            loss, grads = jaxembed.nnx.value_and_grad(loss_fn)(model)
            dense.update(model, grads.dense)
            sparse.update(model, grads)
            return loss

        batches = _batches(mesh, 3, multi_hot=hot)
        record = _time(lambda b: step(model, dense, sparse, b), batches, steps, warmup)
        record["placements"] = {t.name: t.placement for t in model.coll.layout.tables}
        record["row_sharding"] = {t.name: t.row_sharding for t in model.coll.layout.tables}
    return record


def scaleout_worker(devices: int, steps: int, warmup: int) -> dict[str, Any]:
    """Workload (a)'s functional step on `devices` devices (the stated layout on 8)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxembed

    mesh = jax.make_mesh((devices,), ("x",))
    hot = (True,) * len(ROWS)
    opt = jaxembed.optim.rowwise_adagrad(0.05)
    with jax.set_mesh(mesh):
        rng = np.random.default_rng(1)
        tables = [jax.device_put(np.full((r, DIM), 0.01, np.float32), NamedSharding(
            mesh, P("x", None) if i < 4 else P())) for i, r in enumerate(ROWS)]  # fmt: skip
        states = [opt.init(t) for t in tables]
        cot = jax.device_put(rng.standard_normal((BATCH, len(ROWS), DIM), np.float32),
                             NamedSharding(mesh, P("x")))  # fmt: skip

        def step(tables, states, batch, cot):
            new_t, new_s = [], []
            for i in range(len(ROWS)):
                ids = batch[f"f{i}"]
                pooled = jaxembed.embedding_bag(ids, tables[i], combiner="sum")
                t, s = opt.update(tables[i], states[i], ids, cot[:, i], combiner="sum",
                                  after=pooled)  # fmt: skip
                new_t.append(t)
                new_s.append(s)
            return new_t, new_s

        jitted = jax.jit(step, donate_argnums=(0, 1))
        batches = _batches(mesh, 4, multi_hot=hot)
        box = [tables, states]

        def one(batch):
            box[0], box[1] = jitted(box[0], box[1], batch, cot)
            return box[0]

        record = _time(one, batches, steps, warmup)
        record["routed_fallbacks"] = [int(s.routed_fallbacks) for s in box[1]]
    return record


def _run(kind: str, arg: str, opts: argparse.Namespace, devices: int) -> dict[str, Any]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env.pop("GLIBC_TUNABLES", None)  # what a user's process gets: `import jaxembed` tunes it
    code = (f"import json, sys; from benchmarks import defaults as d; "
            f"print(json.dumps(d.{kind}_worker({arg!r} if {kind!r} == 'planner' else int({arg!r}), "
            f"{opts.steps}, {opts.warmup})))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=opts.timeout)  # fmt: skip
    if done.returncode:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _fits(placement: str) -> bool:
    """Whether every table placed so fits the budget by the planner's model."""
    import jax

    import jaxembed

    tables = [jaxembed.TableConfig(f"t{i}", r, DIM, placement=placement)
              for i, r in enumerate(ROWS)]  # fmt: skip
    features = [jaxembed.FeatureConfig(f"f{i}", f"t{i}", max_ids=20 if i < 4 else 1)
                for i in range(len(ROWS))]  # fmt: skip
    mesh = jax.sharding.AbstractMesh((8,), ("x",))
    plan = jaxembed.plan_collection(tables, features, mesh, batch_size=BATCH,
                                    memory_per_device="1TiB", backend="cpu",
                                    optimizer=jaxembed.optim.rowwise_adagrad(0.05))  # fmt: skip
    return plan.peak_bytes <= BUDGET


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks defaults",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="each process this many times, in turn")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json")
    opts = p.parse_args(argv)
    uniform = [u for u in ("rows", "columns", "table", "replicated") if _fits(u)]
    record: dict[str, Any] = {"uniform_that_fit": uniform, "planner": {}, "scaleout": {}}
    for r in range(opts.rounds):
        for placement in ("auto", *uniform):
            print(f"round {r}: planner {placement}", file=sys.stderr, flush=True)
            record["planner"].setdefault(placement, []).append(_run("planner", placement, opts, 8))
        for devices in (1, 8):
            print(f"round {r}: scale-out {devices}", file=sys.stderr, flush=True)
            record["scaleout"].setdefault(str(devices), []).append(
                _run("scaleout", str(devices), opts, devices)
            )
    med = lambda runs: min(x["step_median_in_ms"] for x in runs if "step_median_in_ms" in x)
    best = min(uniform, key=lambda u: med(record["planner"][u])) if uniform else None
    summary = {"planner_ms": med(record["planner"]["auto"])}
    if best:
        summary.update(
            best_uniform=best,
            best_uniform_ms=med(record["planner"][best]),
            planner_ratio=summary["planner_ms"] / med(record["planner"][best]),
        )
    one, eight = med(record["scaleout"]["1"]), med(record["scaleout"]["8"])
    summary.update(one_device_ms=one, eight_devices_ms=eight, scaleout_ratio=eight / one)
    record["summary"] = summary
    print(json.dumps(summary, indent=1))
    write_outputs(record, json_path=opts.json)
    return 0
