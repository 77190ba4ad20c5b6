"""`jaxembed bench --calibrate`: measure the cost model's CPU constants on this machine.

    python -m jaxembed.calibrate [--no-save] [--repeats N]   # the same, without a checkout

The model (`jaxembed.plan.cost`) times a device's share of a step as

    wire_bytes / link_bytes_per_s + rows · row_bytes / memory_bytes_per_s
        + ids_sorted / sort_ids_per_s + collectives · latency

Microbenchmarks fit its constants, each on every device of the mesh at once (simulated CPU
devices share the cores, and the model is per device):

* **link**: `all_gather` of blocks from 8 KiB to 256 KiB per device in a `shard_map`; a
  least-squares line through (wire bytes, seconds) gives the bandwidth (slope) and the
  latency (intercept);
* **memory**: a gather of random rows and a scatter-add of them back, from 2^10 to 2^14
  rows of 128 floats (a 2^15-row shard per device); the line through (bytes touched,
  seconds) gives the random-row bandwidth;
* **sort**: sorting 2^12 to 2^16 random ids per device; the line through (ids, seconds)
  gives the sort rate;
* **slots**: a native pool of 2^14 to 2^18 slots per device whose rows the shard does not
  hold (bags of 20): the line through (slots, seconds) gives `slot_s`, what each slot a
  kernel walks costs without its row (XLA's kernels get the same: what they pay beyond it is
  their rows term).

With jaxembed's native kernels built (`jaxembed.kernels.native.available()`), the memory and
sort benchmarks run again through them (`gather_rows` + `apply_rows` in place, less its
sort; `dedup_rows`'s radix sort) and give the `cpu-native` constants (the link is the same).

The command line tunes glibc's malloc first (`jaxembed.host.tune_malloc`), as the `jaxembed`
command and the benchmarks run.

A fit whose time does not grow with the size (a machine too busy to measure) keeps that
constant's default and says so: a negative bandwidth would only mislead every later plan.
The constants are saved with `jaxembed.plan.cost.save_constants` and every later plan on this
machine uses them (set `JAXEMBED_COST_FILE` to choose the file; an empty value ignores it).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxembed import host
from jaxembed.plan import cost

__all__ = ["calibrate", "main", "run"]

_HIDDEN = 128
_SHARD_ROWS = 1 << 15


def _median_seconds(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile, warm
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples))


def _fit(points) -> tuple[float, float] | None:
    """Least-squares `seconds = a + b·size`: `(a, b)` with `a >= 0`, or None when `b <= 0`."""
    xs, ys = zip(*points, strict=True)
    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return (max(float(a), 0.0), float(b)) if b > 0 else None


def _link(mesh, n: int, repeats: int, progress) -> list[tuple[float, float]]:
    points = []
    for block in (1 << 13, 1 << 14, 1 << 15, 1 << 16, 1 << 17, 1 << 18):
        x = jax.device_put(jnp.ones((n * block // 4,), jnp.float32), NamedSharding(mesh, P("x")))
        f = jax.jit(
            jax.shard_map(
                lambda a: jax.lax.all_gather(a, "x", tiled=True)[:1],
                mesh=mesh, in_specs=P("x"), out_specs=P("x"),
            )
        )  # fmt: skip
        seconds = _median_seconds(f, x, repeats=repeats)
        points.append((cost.ring_wire_bytes("all-gather", n, n * block), seconds))
        progress(f"  all_gather {block >> 10:>6} KiB per device: {seconds * 1e3:8.3f} ms")
    return points


def _xla_rows(t, i):
    """The XLA kernels: a gather of rows, a scatter-add of them back."""
    got = jnp.take(t, i, axis=0, mode="clip")
    return t.at[i].add(got * 0.5, mode="drop")


def _native_rows(t, i):
    """The native kernels: `gather_rows`, then `apply_rows` (an SGD step on those rows, in
    place; its radix sort of the ids is taken out with the measured sort rate)."""
    from jaxembed.kernels import native
    from jaxembed.optim import formulas

    valid = jnp.ones(i.shape, bool)
    got = native.gather_rows(t, i, valid)
    new, _ = native.apply_rows(formulas.sgd(0.5), t, (), jnp.zeros((), jnp.int32), i, valid, got,
                               hidden_size=t.shape[1])  # fmt: skip
    return new


def _rows(mesh, n, body: Callable, repeats: int, progress, label: str):
    points = []
    for rows in (1 << 10, 1 << 11, 1 << 12, 1 << 13, 1 << 14):
        table = jax.device_put(
            jnp.ones((n * _SHARD_ROWS, _HIDDEN), jnp.float32), NamedSharding(mesh, P("x"))
        )
        ids = np.random.default_rng(0).integers(0, _SHARD_ROWS, size=(n * rows,)).astype(np.int32)
        ids = jax.device_put(ids, NamedSharding(mesh, P("x")))
        f = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x")),
            donate_argnums=(0,),
        )
        table = jax.block_until_ready(f(table, ids))  # compile, warm (the table is donated)
        seconds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            table = jax.block_until_ready(f(table, ids))
            seconds.append(time.perf_counter() - t0)
        touched = 2 * rows * _HIDDEN * 4  # the gather and the scatter
        points.append((touched, float(np.median(seconds))))
        ms = points[-1][1] * 1e3
        progress(f"  {label} gather+scatter {rows:>6} rows per device: {ms:8.3f} ms")
    return points


_BAG = 20  # slots a bag in the slot benchmark


def _native_slots(t, i):
    """A native pool of `M` slots none of whose rows the shard holds (masked): what the
    gather path's kernels pay for each slot of another shard's rows (`slot_s`)."""
    from jaxembed.kernels import native

    m = i.shape[0]
    segments = jnp.arange(m, dtype=jnp.int32) // _BAG
    return native.pool_sum(t, i, i < 0, segments, jnp.ones((m,), jnp.float32), m // _BAG)


def _slots(mesh, n, body: Callable, repeats: int, progress, label: str):
    points = []
    for m in (1 << 14, 1 << 15, 1 << 16, 1 << 17, 1 << 18):
        table = jax.device_put(jnp.ones((n * 8, _HIDDEN), jnp.float32), NamedSharding(mesh, P("x")))
        ids = np.random.default_rng(2).integers(0, 8, size=(n * m,)).astype(np.int32)
        ids = jax.device_put(ids, NamedSharding(mesh, P("x")))
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x")))
        seconds = _median_seconds(f, table, ids, repeats=repeats)
        points.append((m, seconds))  # with the bags' output rows: a bag is written once
        progress(f"  {label} masked slots {m:>7} per device: {seconds * 1e3:8.3f} ms")
    return points


def _xla_sort(i):
    return jnp.sort(i)


def _native_sort(i):
    from jaxembed.kernels import native

    unique, _ = native.dedup_rows(i, jnp.ones(i.shape, bool), _SHARD_ROWS)
    return unique


def _sort(mesh, n, body: Callable, repeats: int, progress, label: str):
    points = []
    for m in (1 << 12, 1 << 13, 1 << 14, 1 << 15, 1 << 16):
        ids = np.random.default_rng(1).integers(0, _SHARD_ROWS, size=(n * m,)).astype(np.int32)
        ids = jax.device_put(ids, NamedSharding(mesh, P("x")))
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        seconds = _median_seconds(f, ids, repeats=repeats)
        points.append((m, seconds))
        progress(f"  {label} sort {m:>6} ids per device: {seconds * 1e3:8.3f} ms")
    return points


def calibrate(*, repeats: int = 15, save: bool = True, progress=print) -> dict[str, Any]:
    """Measures and (by default) saves the CPU constants of the cost model.

    Args:
      repeats: timed calls per point (the median counts).
      save: write them where `jaxembed.plan.cost.load_constants` finds them.
      progress: where to report each point (print by default).

    Returns:
      `{"constants": {...}, "native": {...} or None, "kept_defaults": [...], "link": [(wire
      bytes, s), ...], "memory": [(bytes, s), ...], "sort": [(ids, s), ...], "path": where
      they were saved or None}`; `kept_defaults` names the fits that failed (time not
      growing with size, or a latency fitted at or below zero) and kept the default constant.
    """
    from jaxembed.kernels import native

    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("x",))
    backend = jax.default_backend()
    source = f"jaxembed bench --calibrate on {n} {backend} devices"
    kept: list[str] = []

    def fitted(default: cost.CostConstants, name: str, points, *, intercept: str | None = None):
        fit = _fit(points)
        if fit is None:
            kept.append(f"{default.backend} {name}")
            return {}
        out = {name: 1.0 / fit[1]}
        if intercept and fit[0] > 0:
            out[intercept] = fit[0]
        elif intercept:  # noise at the small sizes: a collective costs something; keep it
            kept.append(f"{default.backend} {intercept}")
        return out

    link = _link(mesh, n, repeats, progress)
    memory = _rows(mesh, n, _xla_rows, repeats, progress, "xla")
    sort = _sort(mesh, n, _xla_sort, repeats, progress, "xla")
    default = cost.BACKENDS.get(backend, cost.BACKENDS["cpu"])
    shared = fitted(default, "link_bytes_per_s", link, intercept="latency_s")
    constants = dataclasses.replace(
        default, backend=backend, source=source, **shared,
        **fitted(default, "memory_bytes_per_s", memory), **fitted(default, "sort_ids_per_s", sort),
    )  # fmt: skip
    result: dict[str, Any] = {"link": link, "memory": memory, "sort": sort, "native": None}

    native_constants = None
    if backend == "cpu" and native.available():
        native_sort = _sort(mesh, n, _native_sort, repeats, progress, "native")
        native_memory = _rows(mesh, n, _native_rows, repeats, progress, "native")
        native_slots = _slots(mesh, n, _native_slots, repeats, progress, "native")
        default = cost.BACKENDS["cpu-native"]
        sorting = fitted(default, "sort_ids_per_s", native_sort)
        rate = sorting.get("sort_ids_per_s", default.sort_ids_per_s)
        rows_only = [(b, s - b / (2 * _HIDDEN * 4) / rate) for b, s in native_memory]
        walked = _fit(native_slots)  # seconds = a + slot_s · slots
        slot = {"slot_s": walked[1]} if walked else {}
        if not walked:
            kept.append("cpu-native slot_s")
        native_constants = dataclasses.replace(
            default, source=source, **shared, **sorting, **slot,
            **fitted(default, "memory_bytes_per_s", rows_only),
        )  # fmt: skip
        # XLA's kernels walk the same slots; what they pay beyond a native walk is their
        # rows term (a masked gather and segment sum cost about a row read each).
        constants = dataclasses.replace(constants, **slot)
        result.update(native_memory=native_memory, native_sort=native_sort,
                      native_slots=native_slots)  # fmt: skip
        result["native"] = _public(native_constants)

    path = None
    if save:
        path = cost.save_constants(constants)
        if native_constants is not None:
            cost.save_constants(native_constants, path)
    result.update(constants=_public(constants), kept_defaults=kept,
                  path=None if path is None else str(path))  # fmt: skip
    return result


def _public(c: cost.CostConstants) -> dict[str, float]:
    return {
        "link_bytes_per_s": c.link_bytes_per_s,
        "memory_bytes_per_s": c.memory_bytes_per_s,
        "latency_s": c.latency_s,
        "sort_ids_per_s": c.sort_ids_per_s,
        "slot_s": c.slot_s,
    }


def run(*, save: bool = True, repeats: int | None = None) -> int:
    """Measures, prints the constants and (unless `save=False`) saves them; returns 0."""
    result = calibrate(save=save, **({"repeats": repeats} if repeats else {}))
    for name, c in (("", result["constants"]), ("native kernels: ", result["native"])):
        if c is None:
            continue
        if name:
            print(name.rstrip(": ") + ":")
        print(f"link bandwidth   {c['link_bytes_per_s'] / 1e9:10.3f} GB/s per device")
        print(f"memory bandwidth {c['memory_bytes_per_s'] / 1e9:10.3f} GB/s of table rows")
        print(f"sort rate        {c['sort_ids_per_s'] / 1e6:10.2f} M ids/s")
        print(f"latency          {c['latency_s'] * 1e6:10.1f} us per collective")
        print(f"slot walked      {c['slot_s'] * 1e9:10.1f} ns")
    for what in result["kept_defaults"]:
        print(f"warning: {what}: time did not grow with size (a busy machine?); kept the default",
              file=sys.stderr)  # fmt: skip
    if result["path"]:
        print(f"saved to {result['path']} (JAXEMBED_COST_FILE overrides where)")
    else:
        print("not saved (--no-save)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxembed.calibrate [--no-save] [--repeats N]`: `run` from the command line."""
    p = argparse.ArgumentParser(
        prog="python -m jaxembed.calibrate", description=__doc__.split("\n")[0]
    )
    p.add_argument("--no-save", action="store_true", help="print the constants, save nothing")
    p.add_argument("--repeats", type=int, metavar="N", help="timed calls per point (default 15)")
    args = p.parse_args(argv)
    host.tune_malloc(warn=False)  # measured as the jaxembed command and the benchmarks run
    return run(save=not args.no_save, repeats=args.repeats)


if __name__ == "__main__":
    sys.exit(main())
