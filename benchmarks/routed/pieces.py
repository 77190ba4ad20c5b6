"""The routed exchange in pieces against the copies XLA:CPU would make, one process, 8 devices.

`python -m benchmarks routed-pieces [--workloads a,dlrm] [--repeats 12] [--json PATH]
[--markdown PATH]` (through `python -m benchmarks`: 8 CPU devices, glibc's malloc tuned)

XLA:CPU runs an `all_to_all` on one buffer per peer: it slices the `[n, C, H]` operand into
n blocks and concatenates the n results. With the native kernels the routed exchange keeps
its rows in those blocks (`jaxembed.kernels.routed.fetch_pieces`, `pool_sum_pieces`,
`bag_scatter_add_pieces`, `apply_rows_pieces`, `scatter_add_pieces`). Here the `bench
recsys` step of every table by mod rows with the planner's sized route
(`jaxembed[mod-planned]`) is compiled twice on the same 8 devices, and timed interleaved
with the 1-device step:

* `pieces`: as the library runs it;
* `copies`: the same program with the pieces undone, each pieces kernel replaced by its
  whole-buffer twin (`pool_sum` of the concatenated pieces, `bag_scatter_add` sliced into
  pieces, `apply_rows` and `scatter_add` of the concatenation, one gather of every source's
  rows), so that XLA's slices and concatenations come back.

The swap happens only while the `copies` program is traced; both programs are checked to
give the same pooled output on a batch. Every step's table and state are donated.

`--workloads tokens:B` times a lookup without bags the same way: B sequences of 512 tokens
over a 262,144 × 64 table (Zipf ids, hashed so the hot ones spread over the shards), the
lookup and a `rowwise_adagrad` update on the routed exchange at the plan's default capacity.
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
        (native, "scatter_add_pieces"): lambda shape, loc, v, pieces: native.scatter_add(
            shape, loc.reshape(-1), v.reshape(-1), jnp.concatenate(list(pieces))),
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
    """`{"median_ms", "median_cpu_ms": {name: ms}, "exchange", "samples", "concatenates"}` of
    the 8-device step with and without the pieces and of the 1-device step (module
    docstring); `quick`: the bench's tiny tables."""
    import jax
    import numpy as np

    from benchmarks.recsys import impls
    from benchmarks.recsys.workload import make_workload
    from jaxembed import workloads as W

    if workload_name.startswith("tokens"):
        batch = int(workload_name.partition(":")[2] or 64)
        small = dict(batch=max(batch // 16, 8), vocab=4096) if quick else dict(batch=batch)
        runners, outputs, joins, exchange = _token_runners(**small)
        return _timed(workload_name, exchange, runners, outputs, joins, repeats, max_seconds)
    workload = make_workload(workload_name, quick=quick)
    host = W.make_tables(workload, seed=0)
    cot_host = W.make_cotangent(workload, seed=0)
    runners, outputs, joins, exchange = {}, {}, {}, None
    for name, n, swap in _RUNS:
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
    return _timed(workload_name, exchange, runners, outputs, joins, repeats, max_seconds)


_RUNS = (("8 devices, pieces", 8, False), ("8 devices, copies", 8, True), ("1 device", 1, False))


def _token_runners(batch: int, seq: int = 512, vocab: int = 262_144, hidden: int = 64):
    """The `tokens:B` runs (module docstring): `(runners, outputs, joins, exchange)`."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxembed

    rng = np.random.default_rng(0)
    ids = rng.zipf(1.1, size=(batch, seq)) % vocab
    ids = (ids * 2_654_435_761 % vocab).astype(np.int32)  # the hot ids spread over the shards
    table = rng.normal(size=(vocab, hidden)).astype(np.float32)
    cot = rng.normal(size=(batch, seq, hidden)).astype(np.float32)
    opt = jaxembed.optim.rowwise_adagrad(0.01)
    runners, outputs, joins, exchange = {}, {}, {}, None
    for name, n, swap in _RUNS:
        mesh = jax.make_mesh((n,), ("model",), axis_types=(AxisType.Explicit,),
                             devices=jax.devices()[:n])  # fmt: skip
        kw = dict(exchange="routed" if n > 1 else "auto", x_spec=P("model"),
                  weight_spec=P("model", None))  # fmt: skip
        t, x, g = (jax.device_put(a, NamedSharding(mesh, s)) for a, s in (
            (table, P("model", None)), (ids, P("model")), (cot, P("model"))))  # fmt: skip
        state = opt.init(t)

        def step(t, state, x, g, kw=kw):
            loss = jnp.sum(jaxembed.embedding(x, t, **kw) * g)
            return *opt.update(t, state, x, g, **kw), loss

        def forward(t, x, kw=kw):
            return jaxembed.embedding(x, t, **kw)

        with jax.set_mesh(mesh), _copies() if swap else contextlib.nullcontext():
            compiled = jax.jit(step, donate_argnums=(0, 1)).lower(t, state, x, g).compile()
            outputs[name] = np.asarray(jax.jit(forward)(t, x))
        exchange = "routed (plan's capacity)" if n > 1 else exchange
        joins[name] = compiled.as_text().count("concatenate(")
        box = {"s": (t, state)}

        def run(box=box, compiled=compiled, x=x, g=g):
            *box["s"], loss = compiled(*box["s"], x, g)
            jax.block_until_ready(loss)

        runners[name] = run
    return runners, outputs, joins, exchange


def _timed(workload_name, exchange, runners, outputs, joins, repeats, max_seconds):
    """Checks the two 8-device programs (the copies one joins more, both give one output),
    then times all three interleaved: the result row of `time_pieces`."""
    import numpy as np

    from benchmarks.common.timing import TimingPolicy, time_interleaved

    if joins["8 devices, copies"] <= joins["8 devices, pieces"]:
        raise AssertionError(f"the copies program joins no more than the pieces one: {joins}")
    np.testing.assert_allclose(outputs["8 devices, copies"], outputs["8 devices, pieces"],
                               rtol=1e-6, atol=1e-6)  # fmt: skip
    policy = TimingPolicy(repeats=repeats, warmup=2, min_samples=5, max_seconds=max_seconds)
    times = time_interleaved({k: {"step": r} for k, r in runners.items()}, policy)
    ms = {k: 1e3 * float(np.median(v["step"][0])) for k, v in times.items()}
    cpu_ms = {k: 1e3 * float(np.median(v["step"][1])) for k, v in times.items()}
    return {"workload": workload_name, "exchange": exchange, "median_ms": ms,
            "median_cpu_ms": cpu_ms, "samples": {k: len(v["step"][0]) for k, v in times.items()},
            "concatenates": joins}  # fmt: skip


def _markdown(rows: list[dict[str, Any]], load: Any) -> str:
    out = [f"# The routed exchange in pieces against XLA:CPU's copies (load {load})", "",
           "| workload | exchange | 8 devices, copies ms | 8 devices, pieces ms | pieces / copies "
           "| pieces / copies, CPU time | 1 device ms | pieces / 1 device |",
           "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        ms, cpu = r["median_ms"], r["median_cpu_ms"]
        p, c, one = ms["8 devices, pieces"], ms["8 devices, copies"], ms["1 device"]
        pc = cpu["8 devices, pieces"] / cpu["8 devices, copies"]
        out.append(f"| {r['workload']} | `{r['exchange']}` | {c:.1f} | {p:.1f} | {p / c:.3f} | "
                   f"{pc:.3f} | {one:.1f} | {p / one:.3f} |")  # fmt: skip
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
