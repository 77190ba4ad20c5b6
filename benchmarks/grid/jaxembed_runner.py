"""jaxembed's side of the grid: the step a user writes on one device, at the defaults.

For each table of the cell: `pooled = jaxembed.embedding_bag(ids, table, combiner="sum")`,
then `opt.update(table, state, ids, d loss / d pooled, combiner="sum", after=pooled)` with
`jaxembed.optim.rowwise_adagrad`, all tables in one `jax.jit` with the tables and states
donated; no mesh, no flag. The ids in one of two forms (`--form`):

* `ragged` (default): the cell's CSR bytes as they are, `values [N]` padded with -1 to a
  static capacity (the steps' largest total, rounded up to 1024) and `lengths [B]`;
* `dense`: `[B, max_ids]` with -1 in the empty slots (what a fixed-shape input pipeline gives).

    python -m benchmarks.grid.jaxembed_runner --cell cell.npz --out jax.json --check 2
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.grid import cells as C
from benchmarks.grid import runner

__all__ = ["main", "run"]


def _inputs(cell: dict[str, Any], form: str) -> list[list[Any]]:
    """Each step's per-table ids in `form`, on the device."""
    import jax.numpy as jnp

    batch = cell["batch"]
    out = []
    caps = [max(len(step[i][0]) for step in cell["steps"]) for i in range(len(cell["rows"]))]
    for step in cell["steps"]:
        row = []
        for i, (values, lengths) in enumerate(step):
            if form == "dense":
                hi = cell["max_ids"][i]
                ids = np.full((batch, hi), -1, np.int32)
                ids[np.arange(hi)[None, :] < lengths[:, None]] = values
                row.append((jnp.asarray(ids), None))
            else:
                cap = -(-caps[i] // 1024) * 1024
                flat = np.full((cap,), -1, np.int32)
                flat[: len(values)] = values
                row.append((jnp.asarray(flat), jnp.asarray(lengths)))
        out.append(row)
    return out


def run(args: Any) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    import jaxembed
    from jaxembed import host

    cell = C.read_cell(args.cell)
    n = len(cell["rows"])
    opt = jaxembed.optim.rowwise_adagrad(C.LEARNING_RATE, eps=C.EPS)
    cot = jnp.asarray(cell["cotangent"])  # f32[B, F, H]
    batches = _inputs(cell, args.form)

    def fresh():
        tables = [jnp.full((r, cell["dim"]), C.TABLE_VALUE, jnp.float32) for r in cell["rows"]]
        return tables, [opt.init(t) for t in tables]

    def step(tables, states, ids, cot):
        new_t, new_s = [], []
        for i in range(n):
            x, lengths = ids[i]
            pooled = jaxembed.embedding_bag(x, tables[i], lengths=lengths, combiner="sum")
            t, s = opt.update(tables[i], states[i], x, cot[:, i], lengths=lengths,
                              combiner="sum", after=pooled)  # fmt: skip
            new_t.append(t)
            new_s.append(s)
        return new_t, new_s

    jitted = jax.jit(step, donate_argnums=(0, 1))
    record: dict[str, Any] = {"form": args.form, "jax": jax.__version__,
                              "malloc": host.malloc_settings()}  # fmt: skip
    if args.check:
        tables, states = fresh()
        for s in range(args.check):
            tables, states = jitted(tables, states, batches[s % len(batches)], cot)

        def read(i, rows):
            return (np.asarray(tables[i])[rows],
                    np.asarray(states[i].slots["accumulator"])[rows])  # fmt: skip

        record["check"] = runner.check_tables(cell, args.check, read)
    tables, states = fresh()
    box = [tables, states]

    def one(i):
        box[0], box[1] = jitted(box[0], box[1], batches[i % len(batches)], cot)
        jax.block_until_ready(box[0])

    record.update(runner.timed(one, args.steps, args.warmup))
    return record


def main(argv: Sequence[str] | None = None) -> int:
    def extra(p):
        p.add_argument("--form", default="ragged", choices=("ragged", "dense"))

    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    return runner.run_main("jaxembed_runner", argv, __doc__, run, extra)


if __name__ == "__main__":
    sys.exit(main())
