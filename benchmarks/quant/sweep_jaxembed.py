"""jaxembed's side of the quantized sweep: the pooled lookup as a user writes it (a child).

For each cell of one table group (`--group`: `cells.write_table`'s files and `cells.json`):
`jax.jit(lambda x, n, q: jaxembed.embedding_bag(x, q, lengths=n, combiner="sum"))` on the
group's `jaxembed.QuantizedTable`, one device, every option at its default; the thread count is
`JAXEMBED_NUM_THREADS` (read when the lookup is traced, so each count compiles its own program).
The ids in two forms:

* `ragged`: the cell's CSR bytes as they are, `values` padded with -1 to a static capacity (the
  batches' largest total, rounded up to 1024) and `lengths [B]`;
* `dense`: `[B, 20]` with -1 in the empty slots (what a fixed-shape input pipeline gives).

The table is an argument of the jitted function: closed over, jax 0.10 embeds it in the
executable as a constant (a second copy of the table, and a compile that grows with it; the
call's speed is the same). Each form's first output is saved for the driver's checks (both forms
must agree bitwise).

    python -m benchmarks.quant.sweep_jaxembed --group DIR --out jx.json --threads 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.quant import cells as C

__all__ = ["main", "run_group"]


def _forms(batches: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, list[tuple[Any, ...]]]:
    """Each batch in both forms, on the device."""
    import jax.numpy as jnp

    cap = -(-max(len(v) for v, _ in batches) // 1024) * 1024
    out: dict[str, list[tuple[Any, ...]]] = {"ragged": [], "dense": []}
    for values, lengths in batches:
        flat = np.full((cap,), -1, np.int32)
        flat[: len(values)] = values
        out["ragged"].append((jnp.asarray(flat), jnp.asarray(lengths)))
        dense = np.full((len(lengths), C.MAX_IDS), -1, np.int32)
        dense[np.arange(C.MAX_IDS)[None, :] < lengths[:, None]] = values
        out["dense"].append((jnp.asarray(dense),))
    return out


def run_group(args: argparse.Namespace) -> dict[str, Any]:
    import jax

    import jaxembed
    from benchmarks.grid.runner import timed
    from jaxembed.quant import QuantizedTable

    with open(os.path.join(args.group, "cells.json")) as f:
        group = json.load(f)
    data, scale, bias = (jax.device_put(np.asarray(a)) for a in C.read_table(args.group))
    table = QuantizedTable(data, scale, bias, group["precision"])
    record: dict[str, Any] = {"jax": jax.__version__, "cells": {}}
    for k, cell in enumerate(group["cells"]):
        forms = _forms(C.read_ids(cell["ids"]))
        by_threads: dict[str, Any] = {}
        for threads in args.threads:
            os.environ["JAXEMBED_NUM_THREADS"] = str(threads)
            timings = {}
            for form, batches in forms.items():
                if form == "ragged":  # a new function each time: the thread count is traced

                    def lookup(x, n, q):
                        return jaxembed.embedding_bag(x, q, lengths=n, combiner="sum")
                else:

                    def lookup(x, q):
                        return jaxembed.embedding_bag(x, q, combiner="sum")

                run = jax.jit(lookup).lower(*batches[0], table).compile()
                if threads == args.threads[0]:
                    out = np.asarray(run(*batches[0], table))
                    np.save(os.path.join(args.group, f"jaxembed-{form}-{k}.npy"), out)

                def step(i, run=run, batches=batches):
                    run(*batches[i % len(batches)], table).block_until_ready()

                timings[form] = timed(step, args.steps, args.warmup)
            by_threads[str(threads)] = timings
        record["cells"][cell["name"]] = by_threads
    return record


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m benchmarks.quant.sweep_jaxembed --group DIR --out PATH [...]`."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.quant.sweep_jaxembed",
        description="jaxembed's side of the quantized sweep (a child).",
    )
    p.add_argument("--group", required=True, help="a table group's directory")
    p.add_argument("--out", required=True, help="the JSON record to write")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)  # fmt: skip
    args = p.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    try:
        record, status = run_group(args), 0
    except Exception as e:  # the driver records it and goes on
        record, status = {"error": f"{type(e).__name__}: {e}"}, 1
    record["loadavg"] = list(os.getloadavg())
    with open(args.out, "w") as f:
        json.dump(record, f)
    return status


if __name__ == "__main__":
    sys.exit(main())
