"""The routed exchange in pieces against the copies XLA:CPU would make, one process, 8 devices.

`python -m benchmarks routed-pieces [--workloads a,dlrm] [--repeats 12] [--json PATH]
[--markdown PATH]` (through `python -m benchmarks`: 8 CPU devices, glibc's malloc tuned)

XLA:CPU runs an `all_to_all` on one buffer per peer: it slices the `[n, C, H]` operand into
n blocks and concatenates the n results. With the native kernels the routed exchange keeps
its rows in those blocks (`jaxembed.kernels.routed.fetch_pieces`, `pool_sum_pieces`,
`bag_scatter_add_pieces`, `apply_rows_pieces`). Here the `bench recsys` step of every table
by mod rows with the planner's sized route (`jaxembed[mod-planned]`) is compiled twice on
the same 8 devices, and timed interleaved with the 1-device step:

* `pieces`: as the library runs it;
* `copies`: the same program with the pieces undone, each pieces kernel replaced by its
  whole-buffer twin (`pool_sum` of the concatenated pieces, `bag_scatter_add` sliced into
  pieces, `apply_rows` of the concatenation, one gather of every source's rows), so that
  XLA's slices and concatenations come back.

The swap happens only while the `copies` program is traced; both programs are checked to
give the same pooled output on a batch. Every step's table and state are donated.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any

__all__ = ["time_pieces"]


@contextlib.contextmanager
def _copies():
    """The routed exchange as it ran before the pieces, for the programs traced inside."""
    import jax.numpy as jnp

    from jaxembed.kernels import native, routed

    swapped = {
        (routed, "_apart"): lambda plan: False,  # one gather of every source's rows, sliced
        (native, "pool_sum_pieces"): lambda pieces, *a: native.pool_sum(
            jnp.concatenate(list(pieces)), *a),
        (native, "bag_scatter_add_pieces"): lambda n, shape, *a: list(native.bag_scatter_add(
            (n * shape[0], shape[1]), *a).reshape(n, *shape)),
        (native, "apply_rows_pieces"): lambda f, t, s, c, loc, v, pieces, **kw: native.apply_rows(
            f, t, s, c, loc, v, jnp.concatenate(list(pieces)), **kw),
    }  # fmt: skip
    saved = {key: getattr(*key) for key in swapped}
    try:
        for (module, name), fn in swapped.items():
            setattr(module, name, fn)
        yield
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)


def time_pieces(workload_name: str, repeats: int = 12, max_seconds: float = 3.0, *,
                quick: bool = False):  # fmt: skip
    """`{"median_ms": {name: ms}, "exchange", "samples", "concatenates"}` of the 8-device step
    with and without the pieces and of the 1-device step (module docstring); `quick`: the
    bench's tiny tables."""
    import jax
    import numpy as np

    from benchmarks.common.timing import TimingPolicy, time_interleaved
    from benchmarks.recsys import impls
    from benchmarks.recsys.bench import make_workload
    from jaxembed import workloads as W

    workload = make_workload(workload_name, quick=quick)
    host = W.make_tables(workload, seed=0)
    cot_host = W.make_cotangent(workload, seed=0)
    runners, outputs, joins, exchange = {}, {}, {}, None
    for name, n, swap in (("8 devices, pieces", 8, False), ("8 devices, copies", 8, True),
                          ("1 device", 1, False)):  # fmt: skip
        variant = impls.build_variant("jaxembed[mod-planned]" if n > 1 else "jaxembed",
                                      workload, n, devices=jax.devices()[:n])  # fmt: skip
        exchange = variant.info["exchange"] if n > 1 else exchange
        batches = [variant.prepare(workload, W.make_batch(workload, seed=0, step=i))
                   for i in range(3)]  # fmt: skip
        cot = jax.device_put(cot_host, variant.cotangent_sharding)
        with jax.set_mesh(variant.mesh), _copies() if swap else contextlib.nullcontext():
            step = (
                jax.jit(variant.step, donate_argnums=0)
                .lower(variant.abstract_state, *variant.abstract_inputs(workload))
                .compile()
            )
            forward = (
                jax.jit(variant.forward)
                .lower(variant.abstract_state, variant.abstract_inputs(workload)[0])
                .compile()
            )
        joins[name] = step.as_text().count("concatenate(")  # XLA's joins of the pieces
        state = variant.make_state(host)
        outputs[name] = np.asarray(forward(state, batches[0]))
        box = {"state": state, "i": 0}

        def run(box=box, step=step, batches=batches, cot=cot):
            box["state"], loss = step(box["state"], batches[box["i"] % 3], cot)
            box["i"] += 1
            jax.block_until_ready(loss)

        runners[name] = run
    if joins["8 devices, copies"] <= joins["8 devices, pieces"]:
        raise AssertionError(f"the copies program joins no more than the pieces one: {joins}")
    np.testing.assert_allclose(outputs["8 devices, copies"], outputs["8 devices, pieces"],
                               rtol=1e-6, atol=1e-6)  # fmt: skip
    policy = TimingPolicy(repeats=repeats, warmup=2, min_samples=5, max_seconds=max_seconds)
    times = time_interleaved(runners, policy)
    ms = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    return {"workload": workload_name, "exchange": exchange, "median_ms": ms,
            "samples": {k: len(v) for k, v in times.items()}, "concatenates": joins}  # fmt: skip


def _markdown(rows: list[dict[str, Any]], load: Any) -> str:
    out = [f"# The routed exchange in pieces against XLA:CPU's copies (load {load})", "",
           "| workload | exchange | 8 devices, copies ms | 8 devices, pieces ms | pieces / copies "
           "| 1 device ms | pieces / 1 device |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        ms = r["median_ms"]
        p, c, one = ms["8 devices, pieces"], ms["8 devices, copies"], ms["1 device"]
        out.append(f"| {r['workload']} | `{r['exchange']}` | {c:.1f} | {p:.1f} | {p / c:.3f} | "
                   f"{one:.1f} | {p / one:.3f} |")  # fmt: skip
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="a,dlrm")
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument("--max-seconds", type=float, default=3.0)
    p.add_argument("--quick", action="store_true", help="tiny tables (for the tests)")
    p.add_argument("--json")
    p.add_argument("--markdown")
    args = p.parse_args(argv)
    load = [round(x, 2) for x in os.getloadavg()]
    rows = [time_pieces(w, args.repeats, args.max_seconds, quick=args.quick)
            for w in args.workloads.split(",")]  # fmt: skip
    text = _markdown(rows, load)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_average": load, "rows": rows}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
