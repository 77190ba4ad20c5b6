"""What XLA:CPU's collectives cost on the routed exchange's buffers, 8 simulated devices.

`python -m benchmarks.routed.collectives [--capacities 2643,12747] [--hidden 64]
[--json PATH] [--markdown PATH]`

The routed exchange sends each owner a `[C, H]` block of rows (`all_to_all` of an `[n, C, H]`
buffer a device, forward and backward); its cost model prices those bytes at the link rate
(`jaxembed.plan.cost`). Here, per capacity C, one `shard_map` over 8 CPU devices times, on the
same per-device buffer of `n·C·H` floats:

* `copy`: the buffer times 1.0 (a memory pass, the floor of any exchange);
* `all_to_all`: `lax.all_to_all(x, split 0, concat 0, tiled)`, what the routed exchange runs;
* `ppermute x7`: the same exchange as 7 `ppermute`s of one `[C, H]` block each (checked equal);
* `all_gather`: of one `[C, H]` block to `[n·C, H]` (the same result bytes);
* `reduce_scatter`: of the buffer as `[n·C, H]` to `[C, H]`.

Medians of interleaved rounds (`benchmarks.common.timing`), wall ms of the 8 devices' call.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

__all__ = ["time_collectives"]

_N = 8


def _exchanges(mesh, c: int, h: int):
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    def by_ppermute(v):  # v: [n, C, H], block j for device j
        i = jax.lax.axis_index("x")
        out = jax.lax.dynamic_update_index_in_dim(
            jnp.zeros_like(v), jax.lax.dynamic_index_in_dim(v, i, 0, keepdims=True), i, 0
        )
        for k in range(1, _N):
            block = jax.lax.dynamic_index_in_dim(v, (i + k) % _N, 0, keepdims=True)
            got = jax.lax.ppermute(block, "x", perm=[(j, (j + k) % _N) for j in range(_N)])
            out = jax.lax.dynamic_update_index_in_dim(out, got, (i - k) % _N, 0)
        return out

    bodies = {
        "copy": lambda v: v * 1.0,
        "all_to_all": lambda v: jax.lax.all_to_all(v, "x", 0, 0, tiled=True) * 1.0,
        "ppermute x7": lambda v: by_ppermute(v) * 1.0,
        "all_gather": lambda v: jax.lax.all_gather(v[0], "x", axis=0, tiled=True) * 1.0,
        "reduce_scatter": lambda v: jax.lax.psum_scatter(
            v.reshape(_N * c, h), "x", scatter_dimension=0, tiled=True
        ) * 1.0,
    }  # fmt: skip
    return {
        k: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        for k, f in bodies.items()
    }


def time_collectives(capacities, hidden: int = 64, repeats: int = 5, max_seconds: float = 2.0):
    """Per capacity, each exchange's median wall ms on the 8 devices (module docstring)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from benchmarks.common.timing import TimingPolicy, time_interleaved

    if jax.device_count() < _N:
        raise RuntimeError(f"needs {_N} devices: set XLA_FLAGS="
                           "--xla_force_host_platform_device_count=8")  # fmt: skip
    mesh = jax.make_mesh((_N,), ("x",), devices=jax.devices()[:_N])
    rows = []
    for c in capacities:
        shape = (_N * _N, c, hidden)  # [n, C, H] a device
        x = jax.device_put(jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) % 997,
                           NamedSharding(mesh, P("x")))  # fmt: skip
        fns = _exchanges(mesh, c, hidden)
        a, b = fns["all_to_all"](x), fns["ppermute x7"](x)
        if not bool(jnp.array_equal(a, b)):
            raise AssertionError(f"C={c}: ppermute exchange differs from all_to_all")
        policy = TimingPolicy(repeats=repeats, warmup=1, min_samples=3, max_seconds=max_seconds)
        times = time_interleaved({k: (lambda f=f, x=x: f(x).block_until_ready()) for k, f in
                                  fns.items()}, policy)  # fmt: skip
        buffer = _N * c * hidden * 4
        median = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
        rows.append({"capacity": c, "hidden": hidden, "buffer_bytes_per_device": buffer,
                     "median_ms": median})  # fmt: skip
    return rows


def _markdown(rows) -> str:
    names = list(rows[0]["median_ms"])
    out = ["| C | buffer a device | " + " | ".join(f"{n} ms" for n in names) + " |",
           "|---" * (len(names) + 2) + "|"]  # fmt: skip
    for r in rows:
        ms = " | ".join(f"{r['median_ms'][n]:.2f}" for n in names)
        out.append(f"| {r['capacity']} | {r['buffer_bytes_per_device'] / 2**20:.1f} MiB | {ms} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--capacities", default="2643,12747")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json")
    p.add_argument("--markdown")
    a = p.parse_args(argv)
    rows = time_collectives([int(c) for c in a.capacities.split(",")], a.hidden, a.repeats)
    record: dict[str, Any] = {"devices": _N, "loadavg": list(os.getloadavg()), "rows": rows}
    text = _markdown(rows)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(record, f, indent=1)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(f"# XLA:CPU collectives on 8 simulated devices (load {record['loadavg']})\n\n")
            f.write(text)
    return 0


if __name__ == "__main__":
    if "jax" not in sys.modules:
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    sys.exit(main())
