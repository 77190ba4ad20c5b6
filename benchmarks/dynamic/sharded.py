"""A dynamic table's remap step on 1 device and split over 8: does its work divide?

    python -m benchmarks.dynamic.sharded \\
        --json benchmarks/results/dynamic/sharded.json \\
        --markdown benchmarks/results/dynamic/sharded.md
    python -m benchmarks.dynamic.sharded --quick      # small, a few rounds (tests)

Eight CPU devices on the process's cores (`XLA_FLAGS=--xla_force_host_platform_device_count=8`,
set here before jax starts). One table (`capacity` slots in buckets of 32, `lfu`, admission
after 2 sightings), its adagrad state, and one jitted `jaxembed.optim.dynamic.prepare` (the
remap, then the reset of the rows it (re)assigns) with the table and state donated, in three
layouts over the same global batch of `batch` ids (Zipf 1.05 over 4 x capacity ranks, 20% of
the ranks new each `steps_per_day` steps, the throughput benchmark's stream):

* `1 device`: a mesh of one device, the whole state on it.
* `rows over 8`: the table's rows over 8 devices, `P("model", None)`; the remap state splits
  with them (`state_specs`): each device owns an eighth of the buckets and probes only their
  ids, and the answer is put together from id-sized collectives.
* `rows over 8, routed`: the same, with the batch split over the same axis (`P("model")`):
  each device sends its ids to their owners and gets their rows back (`all_to_all`,
  `jaxembed.kernels.remap_routed`), instead of every device seeing every id.
* `replicated on 8`: table and state whole on every device; each device remaps the batch.

Each case is warmed (`warmup_steps`, untimed), then the cases step in interleaved rounds, each
round one step of every case, so that the machine's noise falls on all alike; the ratio is of
medians. The three must give the same rows for every id, bit for bit (`rows_equal`), and the
per-device state bytes are read from the arrays' shards.
"""

from __future__ import annotations

import os
import sys

if "jax" not in sys.modules:
    _flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
              if not f.startswith("--xla_force_host_platform_device_count")]  # fmt: skip
    os.environ["XLA_FLAGS"] = " ".join([*_flags, "--xla_force_host_platform_device_count=8"])

import argparse
import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

CASES = ("1 device", "rows over 8", "rows over 8, routed", "replicated on 8")


@dataclasses.dataclass(frozen=True)
class ShardedConfig:
    capacity: int = 1 << 22
    batch: int = 32768
    hidden: int = 16
    rounds: int = 20
    warmup_steps: int = 8
    steps_per_day: int = 16
    seed: int = 0

    @classmethod
    def quick(cls) -> ShardedConfig:
        return cls(capacity=1 << 14, batch=2048, rounds=2, warmup_steps=2, steps_per_day=4)


def _stream(config: ShardedConfig, steps: int) -> list[np.ndarray]:
    from benchmarks.dynamic.throughput import day_ids, zipf_ranks
    from jaxembed.dynamic.keys import keys_to_host

    rng = np.random.default_rng([config.seed, 34])
    out = []
    for t in range(steps):
        ranks = zipf_ranks(rng, config.batch, 1.05, 4 * config.capacity)
        out.append(keys_to_host(day_ids(ranks, t // config.steps_per_day, 0.2), check=False))
    return out


def run_sharded(config: ShardedConfig, say=lambda s: None) -> dict[str, Any]:
    import jax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxembed
    from jaxembed.dynamic.config import DynamicTableConfig
    from jaxembed.optim import dynamic as D

    cfg = DynamicTableConfig(capacity=config.capacity, bucket_size=32, policy="lfu",
                             admit_after=2, seed=config.seed)  # fmt: skip
    opt = jaxembed.optim.adagrad(0.05)
    init = jax.nn.initializers.normal(0.1)
    devices = jax.devices()
    if len(devices) < 8:
        raise RuntimeError(f"needs 8 devices, got {len(devices)}: start a fresh process")
    layouts = {  # the devices, the table's layout, the batch's
        "1 device": (devices[:1], P(), P()),
        "rows over 8": (devices[:8], P("model", None), P()),
        "rows over 8, routed": (devices[:8], P("model", None), P("model")),
        "replicated on 8": (devices[:8], P(), P()),
    }

    def step(dyn, opt_state, keys, t):
        rows, dyn, opt_state, stats = D.prepare(cfg, dyn, opt_state, keys, t, initializer=init,
                                                key=jax.random.key(1), optimizer=opt)  # fmt: skip
        return rows, dyn, opt_state, stats

    batches = _stream(config, config.warmup_steps + config.rounds)
    state: dict[str, Any] = {}
    for name, (devs, spec, ids_spec) in layouts.items():
        mesh = jax.make_mesh((len(devs),), ("model",), axis_types=(AxisType.Explicit,),
                             devices=devs)  # fmt: skip
        with jax.set_mesh(mesh):
            dyn = D.init_table(cfg, config.hidden, mesh=mesh, weight_spec=spec)
            opt_state = opt.init(dyn.table)
        rep, ids = NamedSharding(mesh, P()), NamedSharding(mesh, ids_spec)
        args = (dyn, opt_state, jax.device_put(batches[0], ids), jax.device_put(np.int32(0), rep))
        with jax.set_mesh(mesh):
            compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile()
        per_device = sum(leaf.addressable_shards[0].data.nbytes for leaf in dyn.state)
        state[name] = {"mesh": mesh, "rep": rep, "ids": ids, "fn": compiled, "dyn": dyn,
                       "opt": opt_state, "times": [], "rows": [],
                       "state_bytes_per_device": per_device}  # fmt: skip
        say(f"[sharded] {name}: compiled; state {per_device / 2**20:.2f} MiB a device")

    def one(name, t, timed):
        s = state[name]
        keys = jax.device_put(batches[t], s["ids"])
        t_arr = jax.device_put(np.int32(t), s["rep"])
        start = time.perf_counter()
        with jax.set_mesh(s["mesh"]):
            rows, s["dyn"], s["opt"], _ = s["fn"](s["dyn"], s["opt"], keys, t_arr)
        rows.block_until_ready()
        if timed:
            s["times"].append(time.perf_counter() - start)
        s["rows"].append(np.asarray(rows))

    for t in range(config.warmup_steps + config.rounds):
        for name in CASES:
            one(name, t, timed=t >= config.warmup_steps)
    base = float(np.median(state["1 device"]["times"]))
    cases = []
    for name in CASES:
        s = state[name]
        med = float(np.median(s["times"]))
        equal = all(np.array_equal(a, b)
                    for a, b in zip(s["rows"], state["1 device"]["rows"], strict=True))  # fmt: skip
        cases.append({"case": name, "median_ms": 1e3 * med, "ratio_to_1_device": med / base,
                      "state_bytes_per_device": s["state_bytes_per_device"],
                      "rows_equal": equal})  # fmt: skip
        say(f"[sharded] {name}: median {1e3 * med:.2f} ms ({med / base:.2f}x 1 device)")
    return {
        "schema": "jaxembed.bench.dynamic.sharded/1",
        "machine": {
            "cpu_cores": os.cpu_count(),
            "jax": jax.__version__,
            "load_avg": os.getloadavg()[0],
        },
        "config": dataclasses.asdict(config),
        "cases": cases,
    }


def markdown(record: dict[str, Any]) -> str:
    c = record["config"]
    lines = [
        f"capacity {c['capacity']} (buckets of 32, lfu, admit after 2), batch {c['batch']}, "
        f"H {c['hidden']}, {c['rounds']} interleaved rounds; {record['machine']['cpu_cores']} "
        f"cores, jax {record['machine']['jax']}",
        "",
        "| case | median ms | x 1 device | state a device | rows equal |",
        "|---|---|---|---|---|",
    ]
    for r in record["cases"]:
        lines.append(f"| {r['case']} | {r['median_ms']:.2f} | {r['ratio_to_1_device']:.2f} | "
                     f"{r['state_bytes_per_device'] / 2**20:.2f} MiB | "
                     f"{'yes' if r['rows_equal'] else 'NO'} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dynamic.sharded", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--quick", action="store_true", help="small shapes, two rounds (for tests)")
    p.add_argument("--json", metavar="PATH", help="write the record as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the table as Markdown")
    p.add_argument("--capacity", type=int, help="slots of the table (default 2^22)")
    p.add_argument("--batch", type=int, help="ids a step (default 32768)")
    p.add_argument("--rounds", type=int, help="interleaved timed rounds (default 20)")
    a = p.parse_args(argv)
    config = ShardedConfig.quick() if a.quick else ShardedConfig()
    over = {k: v for k, v in (("capacity", a.capacity), ("batch", a.batch),
                              ("rounds", a.rounds)) if v is not None}  # fmt: skip
    config = dataclasses.replace(config, **over)
    record = run_sharded(config, say=lambda s: print(s, file=sys.stderr, flush=True))
    print(markdown(record))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(record, f, indent=2)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(markdown(record))
    return 0 if all(r["rows_equal"] for r in record["cases"]) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
