"""Where the routed bag exchange pools: at the source, at the owner, or the gather exchange.

A bag workload on one mesh, timed as the forward alone, the forward + dense table gradient
(`step`) and the row-sparse SGD update (`update`: the backward fused with the optimizer),
three ways, side by side: `exchange="rows"` (the gather exchange), `exchange="routed",
routed_pool="source"` (each distinct id's row back, pooled at the source) and
`routed_pool="owner"` (each slot to its owner, which pools; partial sums reduce-scattered
back), the owner variant also at a capacity that fits the batch's busiest bucket (it counts
slots, not distinct ids, so skewed ids overflow the default C sooner). Reported per variant:
the median and p90 step time, the plan's wire bytes and modelled time, and whether the batch
fell back.

    python -m benchmarks.routed.bag_pool --bags 4096 --slots 20 --vocab 1000000 --hidden 64
"""

from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed
from benchmarks.common.timing import TimingPolicy, time_interleaved, time_record
from jaxembed.workloads import zipf_ids

__all__ = ["main", "run_bag_pool"]


def _step(kw):
    def step(t, x, ct):
        out, vjp = jax.vjp(lambda t: jaxembed.embedding_bag(x, t, return_stats=True, **kw), t)
        zero = jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), out[1])
        return out[1].routed_fallback, vjp((ct, zero))[0]

    return step


def run_bag_pool(bags: int, slots: int, vocab: int, hidden: int, zipf: float, seed: int,
                 policy: TimingPolicy) -> list[dict]:  # fmt: skip
    """Times the variants on `(len(devices),)`, ids and rows split over one axis, mod rows."""
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("x",))
    rng = np.random.default_rng(seed)
    ids = zipf_ids(rng, bags * slots, vocab, zipf).reshape(bags, slots)
    ids = rng.permutation(vocab).astype(np.int32)[ids]  # hot ids spread over the vocabulary
    table = jax.device_put(
        jnp.asarray(rng.normal(size=(vocab, hidden)), jnp.float32), NamedSharding(mesh, P("x"))
    )
    x = jax.device_put(ids, NamedSharding(mesh, P("x")))
    ct = jax.device_put(
        jnp.asarray(rng.normal(size=(bags, hidden)), jnp.float32), NamedSharding(mesh, P("x"))
    )
    # The busiest (source, owner) bucket of the batch, in slots (mod rows: owner = id mod n).
    owners = ids.reshape(n, -1) % n
    busiest = max(int(np.bincount(o, minlength=n).max()) for o in owners)
    fit = math.ceil(busiest * 1.05)
    base = dict(combiner="mean", row_sharding="mod")
    variants = {
        "gather": dict(exchange="rows"),
        "routed-source": dict(exchange="routed", routed_pool="source"),
        "routed-owner": dict(exchange="routed", routed_pool="owner"),
        f"routed-owner-C{fit}": dict(exchange="routed", routed_pool="owner", capacity=fit),
    }
    opt = jaxembed.optim.sgd(0.1)  # the row-sparse update: backward fused with SGD
    state = opt.init(table)
    runners, records = {}, []
    for name, kw in variants.items():
        kw = {**base, **kw}
        plan = jaxembed.plan_embedding_bag(
            mesh, ids.shape, (vocab, hidden), x_spec=P("x"), weight_spec=P("x", None), **kw
        )
        compiled = jax.jit(_step(kw)).lower(table, x, ct).compile()
        fallback = int(compiled(table, x, ct)[0])
        fwd = jax.jit(lambda t, x, kw=kw: jaxembed.embedding_bag(x, t, **kw))
        fwd = fwd.lower(table, x).compile()
        upd = jax.jit(lambda t, s, x, g, kw=kw: opt.update(t, s, x, g, **kw))
        upd = upd.lower(table, state, x, ct).compile()
        runners[name] = {
            "forward": lambda c=fwd: jax.block_until_ready(c(table, x)),
            "update": lambda c=upd: jax.block_until_ready(c(table, state, x, ct)),
            "step": lambda c=compiled: jax.block_until_ready(c(table, x, ct)),
        }
        records.append(dict(
            name=name, capacity=plan.routed.capacity if plan.routed else None,
            fell_back=bool(fallback),
            wire_bytes=plan.forward_wire_bytes + plan.backward_wire_bytes,
            modelled_ms=next(c.modelled_ms for c in plan.candidates if c.name == plan.exchange),
        ))  # fmt: skip
    times = time_interleaved(runners, policy)
    for r in records:
        for part, (wall, _) in times[r["name"]].items():
            record = time_record(wall)
            r[f"{part}_median_in_ms"] = record["time_median_in_ms"]
            r[f"{part}_p90_in_ms"] = record["time_p90_in_ms"]
    for r in records:
        for part in ("forward", "update", "step"):
            key = f"{part}_median_in_ms"
            r[f"{part}_ratio_to_gather"] = round(r[key] / records[0][key], 3)
    return records


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.routed.bag_pool")
    p.add_argument("--bags", type=int, default=4096)
    p.add_argument("--slots", type=int, default=20)
    p.add_argument("--vocab", type=int, default=1_000_000)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    policy = TimingPolicy(repeats=args.repeats, warmup=2, settle=1, min_samples=5)
    records = run_bag_pool(args.bags, args.slots, args.vocab, args.hidden, args.zipf,
                           args.seed, policy)  # fmt: skip
    for r in records:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
