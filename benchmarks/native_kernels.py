"""The native CPU kernels against their XLA twins on workload-a sized inputs, side by side.

Workload a (`jaxembed.workloads.workload_a`): 8 tables of 1e6 .. 100 rows x 64 float32,
stacked into one table of 1.76M rows (451 MB), batch 4096, one feature per table, bags of 1-20
Zipf(1.1) ids (hot ids are the low ids): ~345k ids a step over 4096 x 8 = 32768 bags, sum
pooling, row-wise Adagrad. The ids are generated here with numpy, slots in feature-major,
bag-major order (each bag's slots consecutive, as the flat form gives them).

Cases (each kernel native vs XLA, compiled ahead of time, warmed up, interleaved repeats;
median and p90 in ms, and the XLA / native ratio):

* `gather_rows`     the 345k rows, [M, 64]
* `pool_sum`        the forward: [32768, 64] pooled sums
* `dedup_rows`      the dedup alone (radix sort vs XLA's sort + cumsum + scatters)
* `bag_scatter_add` the dense gradient [1.76M, 64] of the pooled output (no update)
* `bag_apply_rows`  the backward + update: rowwise_adagrad, table and state donated

Each case also times the native kernel alone, back to back (`native_back_to_back`): the
interleaved XLA run in between evicts the table rows from the caches, which a training loop
(forward, then the update of the same rows) does not. Times are wall clock; `cpu` is the
process's CPU time over the call (on a shared machine the wall time includes waiting for a
core).

With `--devices 8` the process gets 8 simulated CPU devices and each kernel runs in a
`shard_map` over a (8,) mesh: the table split by rows (220k rows each), the slots split in 8
contiguous blocks, each block's ids folded into its shard's rows (id mod 220k): the kernels of
8 devices run concurrently on the machine's cores, one thread each.

    python -m benchmarks.native_kernels [--devices 8] [--repeats 7] [--batch 4096] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--cases", nargs="*", default=None, help="subset of the cases")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args()


ARGS = _args() if __name__ == "__main__" else None
if ARGS is not None and "jax" not in sys.modules:
    flag = f"--xla_force_host_platform_device_count={ARGS.devices}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks.common.timing import TimingPolicy, time_interleaved  # noqa: E402
from jaxembed.kernels import local as local_ops  # noqa: E402
from jaxembed.kernels import native, sparse  # noqa: E402
from jaxembed.optim import formulas  # noqa: E402

ROWS = (1_000_000, 500_000, 100_000, 100_000, 50_000, 10_000, 1_000, 100)
HIDDEN = 64
FORMULA = formulas.rowwise_adagrad(0.05, eps=1e-8)


def workload(batch: int, seed: int = 0):
    """(ids i32[M], segments i32[M], num_bags): feature-major, each bag's slots consecutive."""
    rng = np.random.default_rng(seed)
    ids, segs = [], []
    offset = 0
    for f, rows in enumerate(ROWS):
        lengths = rng.integers(1, 21, batch)
        cdf = np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -1.1)
        u = rng.random(int(lengths.sum())) * cdf[-1]
        ids.append(offset + np.searchsorted(cdf, u).astype(np.int32))
        segs.append(np.repeat(np.arange(batch, dtype=np.int32) + f * batch, lengths))
        offset += rows
    return np.concatenate(ids), np.concatenate(segs), len(ROWS) * batch


def timed(fns: dict, repeats: int, warmup: int = 2) -> dict:
    """Interleaved (`benchmarks.common.timing`): each round calls every variant once, in a
    rotated order. fn() returns something to block on."""
    policy = TimingPolicy(repeats=repeats, warmup=warmup, settle=0, min_samples=repeats,
                          max_seconds=float("inf"))  # fmt: skip
    runners = {k: {"call": lambda fn=fn: jax.block_until_ready(fn())} for k, fn in fns.items()}
    out = {}
    for k, samples in time_interleaved(runners, policy).items():
        wall, cpu = samples["call"]
        out[k] = {
            "median_ms": 1e3 * float(np.median(wall)),
            "p90_ms": 1e3 * float(np.percentile(wall, 90)),
            "median_cpu_ms": 1e3 * float(np.median(cpu)),
        }
    return out


def main(args) -> dict:
    if not native.available():
        raise SystemExit(f"native kernels unavailable: {native.why_unavailable()}")
    n = jax.device_count()
    ids, segs, num_bags = workload(args.batch)
    m, rows = len(ids), sum(ROWS)
    print(f"{n} device(s) on {os.cpu_count()} cores, {native.num_threads()} thread(s) per "
          f"kernel; table {rows} x {HIDDEN} f32, {m} ids, {num_bags} bags", flush=True)  # fmt: skip
    rng = np.random.default_rng(1)
    table = rng.standard_normal((rows, HIDDEN), dtype=np.float32)
    cotangent = rng.standard_normal((num_bags, HIDDEN), dtype=np.float32)
    scale = np.ones(m, np.float32)
    valid = np.ones(m, bool)

    mesh = jax.make_mesh((n,), ("d",)) if n > 1 else None
    if n == 1:
        local, shard_rows, bags = ids, rows, num_bags
    else:  # each device: a contiguous block of slots, its ids folded into its row shard
        shard_rows = -(-rows // n)
        table = np.concatenate([table, np.zeros((shard_rows * n - rows, HIDDEN), np.float32)])
        per = -(-m // n)
        pad = per * n - m
        local = np.concatenate([ids % shard_rows, np.zeros(pad, np.int32)]).astype(np.int32)
        valid = np.concatenate([valid, np.zeros(pad, bool)])
        scale = np.concatenate([scale, np.zeros(pad, np.float32)])
        # each block's slots pool into its own bags: the block's segments minus its first
        seg_all = np.concatenate([segs, np.full(pad, segs[-1], np.int32)]).reshape(n, per)
        seg_blocks = seg_all - seg_all[:, :1]
        bags = int(seg_blocks.max()) + 1
        segs = seg_blocks.reshape(-1).astype(np.int32)
        cotangent = rng.standard_normal((n * bags, HIDDEN), dtype=np.float32)

    def place(a):
        if mesh is None:
            return jnp.asarray(a)
        return jax.device_put(a, NamedSharding(mesh, P("d")))

    def wrap(body, specs, out):
        if mesh is None:
            return body
        return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out)

    d = P("d")
    t_, l_, v_, s_, c_, g_ = (place(a) for a in (table, local, valid, segs, scale, cotangent))
    results = {}
    want = set(args.cases or ["gather_rows", "pool_sum", "dedup_rows", "bag_scatter_add",
                              "bag_apply_rows"])  # fmt: skip

    def run_case(name, make, operands, donate=()):
        compiled = {}
        for impl in ("native", "xla"):
            body, specs, out = make(impl)
            fn = jax.jit(wrap(body, specs, out), donate_argnums=donate)
            compiled[impl] = fn.lower(*operands[impl]).compile()
        state = {k: list(v) for k, v in operands.items()}

        def caller(impl):
            def call():
                outs = compiled[impl](*state[impl])
                if donate:  # thread the donated buffers through
                    for i, o in zip(donate, outs if isinstance(outs, tuple) else (outs,),
                                    strict=False):  # fmt: skip
                        state[impl][i] = o
                return outs

            return call

        r = timed({impl: caller(impl) for impl in compiled}, args.repeats)
        r["xla_over_native"] = r["xla"]["median_ms"] / r["native"]["median_ms"]
        # native back to back: the table rows it read last time are still in cache, as in a
        # training loop where the forward and the update read the same rows
        r["native_back_to_back"] = timed({"native": caller("native")}, args.repeats)["native"]
        results[name] = r
        nat, xla = r["native"], r["xla"]
        print(f"{name:<16} native {nat['median_ms']:8.2f} ms (p90 {nat['p90_ms']:8.2f}, cpu "
              f"{nat['median_cpu_ms']:8.2f})   xla {xla['median_ms']:8.2f} ms (p90 "
              f"{xla['p90_ms']:8.2f}, cpu {xla['median_cpu_ms']:8.2f})   xla/native "
              f"{r['xla_over_native']:5.1f}x", flush=True)  # fmt: skip
        alone = r["native_back_to_back"]
        print(f"{'':<16} native back to back {alone['median_ms']:8.2f} ms (cpu "
              f"{alone['median_cpu_ms']:8.2f})", flush=True)  # fmt: skip

    def same(*a):
        return {"native": a, "xla": a}

    if "gather_rows" in want:
        run_case("gather_rows", lambda impl: (
            native.gather_rows if impl == "native" else local_ops.gather_rows, (d, d, d), d),
            same(t_, l_, v_))  # fmt: skip
    if "pool_sum" in want:

        def pool(impl):
            f = native.pool_sum if impl == "native" else local_ops.pool_sum
            return (lambda t, lo, v, s, c: f(t, lo, v, s, c, bags)), (d,) * 5, d

        run_case("pool_sum", pool, same(t_, l_, v_, s_, c_))
    if "dedup_rows" in want:

        def dedup(impl):
            f = native.dedup_rows if impl == "native" else sparse.dedup_rows
            return (lambda lo, v: f(lo, v, shard_rows)), (d, d), (d, d)

        run_case("dedup_rows", dedup, same(l_, v_))
    if "bag_scatter_add" in want:

        def scatter(impl):
            f = native.bag_scatter_add if impl == "native" else local_ops.bag_scatter_add
            shape = (shard_rows, HIDDEN)
            return (lambda lo, v, s, c, g: f(shape, lo, v, s, c, g)), (d,) * 5, d

        run_case("bag_scatter_add", scatter, same(l_, v_, s_, c_, g_))
    if "bag_apply_rows" in want:

        def update(impl):
            f = native.bag_apply_rows if impl == "native" else sparse.bag_apply_rows

            def body(t, a, lo, v, s, c, g):
                new, (new_a,) = f(FORMULA, t, (a,), 0, lo, v, s, c, g, hidden_size=HIDDEN)
                return new, new_a

            return body, (d,) * 7, (d, d)

        ops = {impl: (place(table), place(np.zeros(table.shape[0], np.float32)), l_, v_, s_,
                      c_, g_) for impl in ("native", "xla")}  # fmt: skip
        run_case("bag_apply_rows", update, ops, donate=(0, 1))
    return {
        "devices": n,
        "cpu_count": os.cpu_count(),
        "threads_per_kernel": native.num_threads(),
        "ids": int(m),
        "bags": int(num_bags),
        "table_rows": int(rows),
        "hidden": HIDDEN,
        "repeats": args.repeats,
        "cases": results,
    }


if __name__ == "__main__":
    record = main(ARGS)
    if ARGS.json:
        with open(ARGS.json, "w") as f:
            json.dump(record, f, indent=2)
