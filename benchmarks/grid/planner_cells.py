"""`python -m benchmarks planner-cells`: the planner without `id_stats` on the grid's cells.

For each cell of the grid's sample (`cells.sample_cells`), one process of 8 simulated CPU
devices trains the NNX model a user writes over the cell's one table: an
`EmbeddingBagCollection` (one table, one feature of up to the cell's longest bag, `-1`
padding), a dense head, `rowwise_adagrad` for the table and optax Adam for the rest, batch
over the mesh, `nnx.jit` with the model and both optimizers donated. The collection is built
once per placement:

* `auto`: `placements="auto"`, `planner={"batch_size": B, "memory_per_device": budget}` and
  **no `id_stats`** (what the planner picks without a sample of the ids);
* every uniform placement (`rows`, `columns`, `table`, `replicated`) that fits the budget by the
  planner's own model (`plan_collection(...).peak_bytes`).

Each placement runs in a process of its own (a process holding three placements of a 1e6 x 128
table was killed for memory on this machine), the placements one
after the other, `--rounds` times in turn; a placement's time is the least of its rounds'
medians, and the cell's ratio is the planner's over the fastest uniform placement's. A cell
where no uniform placement fits is reported and left out of the summary (the issue's target
counts the cells "that have a fitting placement"). The cell's ids are the grid's
(`cells.write_cell`, the same seed).

    python -m benchmarks planner-cells --cells 24 \\
        --json benchmarks/results/grid/planner_cells.json \\
        --markdown benchmarks/results/grid/planner_cells.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from benchmarks.common.report import write_outputs
from benchmarks.grid import cells as C

__all__ = ["cell_worker", "main", "summarize"]

SCHEMA = "jaxembed.bench.planner_cells/1"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UNIFORM = ("rows", "columns", "table", "replicated")
DEVICES = 8


def _configs(cell: dict[str, Any], placement: str) -> tuple[list[Any], list[Any]]:
    import jaxembed

    table = jaxembed.TableConfig("t", cell["rows"][0], cell["dim"], placement=placement)
    feature = jaxembed.FeatureConfig("f", "t", max_ids=cell["max_ids"][0])
    return [table], [feature]


def fitting(cell: dict[str, Any], budget: int) -> list[str]:
    """The uniform placements whose plan fits `budget` bytes a device by the planner's model."""
    import jax

    import jaxembed

    mesh = jax.sharding.AbstractMesh((DEVICES,), ("x",))
    out = []
    for placement in UNIFORM:
        tables, features = _configs(cell, placement)
        try:
            plan = jaxembed.plan_collection(
                tables, features, mesh, batch_size=cell["batch"], memory_per_device="1TiB",
                backend="cpu", optimizer=jaxembed.optim.rowwise_adagrad(C.LEARNING_RATE),
            )  # fmt: skip
        except ValueError:
            continue  # not a layout of this table on this mesh (e.g. columns of a narrow dim)
        if plan.peak_bytes <= budget:
            out.append(placement)
    return out


def cell_worker(path: str, placements: Sequence[str], budget: int, steps: int,
                warmup: int) -> dict[str, Any]:  # fmt: skip
    """Times the cell's NNX step on each placement (in a process of 8 devices), interleaved."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxembed
    import jaxembed.nnx

    cell = C.read_cell(path)
    batch, dim, hi = cell["batch"], cell["dim"], cell["max_ids"][0]
    mesh = jax.make_mesh((DEVICES,), ("x",))
    batches = []
    for s in cell["steps"]:
        values, lengths = s[0]
        ids = np.full((batch, hi), -1, np.int32)
        ids[np.arange(hi)[None, :] < lengths[:, None]] = values
        y = np.random.default_rng(len(batches)).random(batch).astype(np.float32)
        batches.append({"f": jax.device_put(ids if hi > 1 else ids[:, 0],
                                            NamedSharding(mesh, P("x"))),
                        "y": jax.device_put(y, NamedSharding(mesh, P("x")))})  # fmt: skip

    class Model(nnx.Module):
        def __init__(self, placement: str, rngs: nnx.Rngs):
            tables, features = _configs(cell, placement)
            auto = placement == "auto"
            self.coll = jaxembed.nnx.EmbeddingBagCollection(
                tables, features, rngs=rngs, placements="auto" if auto else None,
                planner={"batch_size": batch, "memory_per_device": budget} if auto else None,
            )  # fmt: skip
            self.head = nnx.Linear(dim, 1, rngs=rngs)

        def __call__(self, b):
            return self.head(self.coll.concat(self.coll(b)))[:, 0]

    @nnx.jit(donate_argnums=(0, 1, 2))
    def step(model, dense, sparse, b):
        loss_fn = lambda m: jnp.mean((m(b) - b["y"]) ** 2)
        loss, grads = jaxembed.nnx.value_and_grad(loss_fn)(model)
        dense.update(model, grads.dense)
        sparse.update(model, grads)
        return loss

    record: dict[str, Any] = {"placements": {}}
    runs = {}
    with jax.set_mesh(mesh):
        for placement in placements:
            model = Model(placement, nnx.Rngs(0))
            dense = nnx.Optimizer(model, optax.adam(1e-3), wrt=jaxembed.nnx.DENSE)
            sparse = jaxembed.nnx.SparseOptimizer(
                model, jaxembed.optim.rowwise_adagrad(C.LEARNING_RATE, eps=C.EPS)
            )
            t0 = time.perf_counter()
            loss = float(step(model, dense, sparse, batches[0]))
            first = time.perf_counter() - t0
            t = model.coll.layout.tables[0]
            runs[placement] = (model, dense, sparse)
            record["placements"][placement] = {
                "chosen": t.placement, "row_sharding": t.row_sharding,
                "first_step_in_s": round(first, 2), "first_loss": loss, "samples_in_ms": [],
            }  # fmt: skip
        for i in range(warmup + steps):
            for placement, (model, dense, sparse) in runs.items():
                b = batches[i % len(batches)]
                t0 = time.perf_counter()
                jax.block_until_ready(step(model, dense, sparse, b))
                if i >= warmup:
                    record["placements"][placement]["samples_in_ms"].append(
                        round((time.perf_counter() - t0) * 1e3, 3)
                    )
    for r in record["placements"].values():
        r["median_in_ms"] = float(np.median(r["samples_in_ms"]))
        r["q25_in_ms"] = float(np.percentile(r["samples_in_ms"], 25))
    return record


def _child(path: str, placements: Sequence[str], opts: argparse.Namespace) -> dict[str, Any]:
    from jaxembed import host

    env = host.host_env()
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    code = (f"import json; from benchmarks.grid import planner_cells as p; "
            f"print(json.dumps(p.cell_worker({path!r}, {list(placements)!r}, {opts.budget}, "
            f"{opts.steps}, {opts.warmup})))")  # fmt: skip
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=opts.timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {opts.timeout:.0f} s"}
    if done.returncode:
        return {"error": f"exit {done.returncode}: {done.stderr[-2000:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """The planner's ratio to the fastest fitting uniform placement: geomean and worst cell."""
    ratios = {c["cell"]: c["ratio"] for c in cells if c.get("ratio") is not None}
    if not ratios:
        return {"cells": 0}
    worst = max(ratios, key=ratios.get)
    return {
        "cells": len(ratios),
        "geomean": math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios)),
        "worst": ratios[worst],
        "worst_cell": worst,
        "within_1_1": sum(r <= 1.1 for r in ratios.values()),
        "skipped_no_fit": [c["cell"] for c in cells if c.get("fitting") == []],
    }


def markdown(record: dict[str, Any]) -> str:
    lines = [
        "| cell | uniform that fit | planner chose | planner ms | best uniform | its ms | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in record["cells"]:
        if "error" in c:
            lines.append(f"| {c['cell']} | error: {c['error'][-120:]!r} | | | | | |")
            continue
        p = c.get("placements", {})
        auto = p.get("auto", {})
        chosen = f"{auto.get('chosen', '-')} ({auto.get('row_sharding') or '-'})"
        lines.append(
            f"| {c['cell']} | {', '.join(c['fitting']) or 'none'} | {chosen} | "
            f"{auto.get('median_in_ms', float('nan')):.2f} | {c.get('best') or '-'} | "
            f"{p.get(c.get('best'), {}).get('median_in_ms', float('nan')):.2f} | "
            f"{c['ratio']:.2f} |" if c.get("ratio") is not None else
            f"| {c['cell']} | none | {chosen} | - | - | - | - |"
        )  # fmt: skip
    s = record["summary"]
    if s.get("cells"):
        lines += ["", f"planner / fastest fitting uniform: geomean {s['geomean']:.3f} over "
                  f"{s['cells']} cells, worst {s['worst']:.3f} ({s['worst_cell']}); "
                  f"{s['within_1_1']} of {s['cells']} within 1.1x"]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks planner-cells",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--cells", type=int, default=24, help="the grid's sample size")
    p.add_argument("--only", default="", help="comma-separated indices into the sample")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=int, default=384 * 2**20, help="bytes a device")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="each placement's process, in turn")
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--json")
    p.add_argument("--markdown")
    opts = p.parse_args(argv)
    sample = C.sample_cells(opts.cells, opts.seed)
    if opts.only:
        sample = [sample[int(i)] for i in opts.only.split(",")]
    record: dict[str, Any] = {"schema": SCHEMA, "devices": DEVICES, "budget": opts.budget,
                              "cells": []}  # fmt: skip
    with tempfile.TemporaryDirectory() as workdir:
        path = os.path.join(workdir, "cell.npz")
        for cell in sample:
            C.write_cell(path, [cell], steps=4, seed=opts.seed)
            fit = fitting(C.read_cell(path), opts.budget)
            print(f"{cell.name}: fitting {fit}", file=sys.stderr, flush=True)
            entry: dict[str, Any] = {"cell": cell.name, "fitting": fit}
            if fit:
                runs: dict[str, Any] = {}
                for _ in range(opts.rounds):
                    for placement in ("auto", *fit):
                        got = _child(path, [placement], opts)
                        if "error" in got:
                            entry["error"] = f"{placement}: {got['error']}"
                            break
                        run = got["placements"][placement]
                        if placement not in runs or run["median_in_ms"] < runs[placement][
                                "median_in_ms"]:  # fmt: skip
                            runs[placement] = run
                    if "error" in entry:
                        break
                if "error" in entry:
                    print(f"  error: {entry['error'][-600:]}", file=sys.stderr, flush=True)
                else:
                    entry["placements"] = runs
                    best = min(fit, key=lambda u: runs[u]["median_in_ms"])
                    entry["best"] = best
                    entry["ratio"] = runs["auto"]["median_in_ms"] / runs[best]["median_in_ms"]
                    print(f"  planner {runs['auto']['chosen']} {runs['auto']['median_in_ms']:.1f}"
                          f" ms, best {best} {runs[best]['median_in_ms']:.1f} ms: "
                          f"{entry['ratio']:.2f}", file=sys.stderr, flush=True)  # fmt: skip
            record["cells"].append(entry)
    record["summary"] = summarize(record["cells"])
    print(json.dumps(record["summary"], indent=1))
    write_outputs(record, json_path=opts.json)
    if opts.markdown:
        with open(opts.markdown, "w") as f:
            f.write(markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
