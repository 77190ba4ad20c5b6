"""`jaxembed bench --calibrate`: measure the cost model's CPU constants on this machine.

The model (`jaxembed.plan.cost`) times a device's share of a step as

    wire_bytes / link_bytes_per_s + rows · row_bytes / memory_bytes_per_s + collectives · latency

Three microbenchmarks fit its constants, each on every device of the mesh at once (simulated
CPU devices share the cores, and the model is per device):

* **link**: `all_gather` of blocks from 8 KiB to 256 KiB per device in a `shard_map`; a
  least-squares line through (wire bytes, seconds) gives the bandwidth (slope) and the
  latency (intercept);
* **memory**: a gather of random rows and a scatter-add of them back, from 2^10 to 2^14
  rows of 128 floats (a 2^15-row shard per device); the line through (bytes touched,
  seconds) gives the random-row bandwidth.

The constants are saved with `jaxembed.plan.cost.save_constants` and every later plan on this
machine uses them (set `JAXEMBED_COST_FILE` to choose the file; an empty value ignores it).
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxembed.plan import cost

__all__ = ["calibrate"]


def _median_seconds(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples))


def _fit(xs, ys) -> tuple[float, float]:
    """Least-squares `y = a + b·x`; returns `(a, b)` with a >= 0 and b > 0."""
    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return max(float(a), 0.0), max(float(b), 1e-15)


def calibrate(*, repeats: int = 15, save: bool = True, progress=print) -> dict[str, Any]:
    """Measures and (by default) saves the CPU constants of the cost model.

    Args:
      repeats: timed calls per point (the median counts).
      save: write them where `jaxembed.plan.cost.load_constants` finds them.
      progress: where to report each point (print by default).

    Returns:
      `{"constants": {...}, "link": [(wire bytes, s), ...], "memory": [(bytes, s), ...],
      "path": where they were saved or None}`.
    """
    devices = jax.devices()
    n = len(devices)
    mesh = jax.make_mesh((n,), ("x",))
    link = []
    for block in (1 << 13, 1 << 14, 1 << 15, 1 << 16, 1 << 17, 1 << 18):
        x = jax.device_put(jnp.ones((n * block // 4,), jnp.float32), NamedSharding(mesh, P("x")))
        f = jax.jit(
            jax.shard_map(
                lambda a: jax.lax.all_gather(a, "x", tiled=True)[:1],
                mesh=mesh, in_specs=P("x"), out_specs=P("x"),
            )
        )  # fmt: skip
        seconds = _median_seconds(f, x, repeats=repeats)
        wire = cost.ring_wire_bytes("all-gather", n, n * block)
        link.append((wire, seconds))
        progress(f"  all_gather {block >> 10:>6} KiB per device: {seconds * 1e3:8.3f} ms")
    latency, per_byte = _fit(*zip(*link, strict=True))

    memory = []
    hidden = 128
    table_rows = 1 << 15
    for rows in (1 << 10, 1 << 11, 1 << 12, 1 << 13, 1 << 14):
        table = jax.device_put(
            jnp.ones((n * table_rows, hidden), jnp.float32), NamedSharding(mesh, P("x"))
        )
        ids = np.random.default_rng(0).integers(0, table_rows, size=(n * rows,)).astype(np.int32)
        ids = jax.device_put(ids, NamedSharding(mesh, P("x")))

        def body(t, i):
            got = jnp.take(t, i, axis=0, mode="clip")
            return t.at[i].add(got * 0.5, mode="drop")

        f = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x")),
            donate_argnums=(0,),
        )
        jax.block_until_ready(table)
        seconds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            table = f(table, ids)
            jax.block_until_ready(table)
            seconds.append(time.perf_counter() - t0)
        touched = 2 * rows * hidden * 4  # the gather and the scatter
        memory.append((touched, float(np.median(seconds))))
        progress(f"  gather+scatter {rows:>7} rows per device: {memory[-1][1] * 1e3:8.3f} ms")
    _, per_row_byte = _fit(*zip(*memory, strict=True))

    constants = cost.CostConstants(
        backend=jax.default_backend(),
        link_bytes_per_s=1.0 / per_byte,
        memory_bytes_per_s=1.0 / per_row_byte,
        latency_s=latency,
        source=f"jaxembed bench --calibrate on {n} {jax.default_backend()} devices",
    )
    path = cost.save_constants(constants) if save else None
    return {
        "constants": {
            "link_bytes_per_s": constants.link_bytes_per_s,
            "memory_bytes_per_s": constants.memory_bytes_per_s,
            "latency_s": constants.latency_s,
        },
        "link": link,
        "memory": memory,
        "path": None if path is None else str(path),
    }
