"""The bucketing of `jaxembed bench routed`: the routed exchange's sort + dedup, native vs XLA.

Before its first `all_to_all` every device buckets its M slots by owner and dedups each bucket
(`bucket_ids` of `kernels_for(plan)`): `jaxembed.kernels.local`'s is one XLA comparison sort
of the slots by (owner, id), `jaxembed.kernels.native`'s a counting sort by owner and a hash
dedup per bucket. Both run on the same slots at the plan's shapes: M slots per device (a
`[8·M/128, 128]` batch over `(8,)`, V = 2^20), n = 8 owners, the plan's capacity C; ids uniform
or Zipf (hot ids low), owners by block or mod rows, 5% of the slots reading no row. Each case
is checked bitwise (native against XLA) and timed interleaved, compiled ahead of time:

* `devices=1`: one device's call alone;
* `devices=8`: the 8 devices' calls in one `shard_map`, concurrently (as in a step; each
  native call gets `native.num_threads()` threads).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed
from benchmarks.common import variants as harness
from benchmarks.common.report import fmt_num as _num
from benchmarks.common.timing import TimingPolicy, time_interleaved, time_record
from jaxembed.kernels import local, native
from jaxembed.workloads import zipf_ids

__all__ = ["BUCKETING_IMPLS", "bucketing_sweep", "bucketing_table"]

BUCKETING_IMPLS = ("xla", "native")
"""The baseline first."""

_DEVICES = 8


def _plan(slots: int, vocab: int):
    mesh = jax.sharding.AbstractMesh((_DEVICES,), ("data",))
    ids = (_DEVICES * slots // 128, 128)
    plan = jaxembed.plan_embedding(mesh, ids, (vocab, 128), x_spec=P("data", None),
                                   weight_spec=P("data", None), exchange="routed")  # fmt: skip
    assert plan.routed.slots == slots, (plan.routed.slots, slots)
    return plan.routed


def _slots(rng, count: int, vocab: int, zipf: float, rows: str, n: int):
    """dest, key as `routed.bucketize` makes them for `count` slots."""
    if zipf == 0:
        ids = rng.integers(0, vocab, count)
    else:
        ids = zipf_ids(rng, count, vocab, zipf).reshape(-1)
    valid = rng.random(count) >= 0.05
    owner = ids % n if rows == "mod" else ids // (vocab // n)
    dest = np.where(valid, owner, n).astype(np.int32)
    key = np.where(valid, ids, 0).astype(np.int32)
    return dest, key


def _programs(impl, devices: int, n: int, c: int, dest, key):
    """The compiled call and its arguments: one device's, or 8 devices' in a `shard_map`."""
    if devices == 1:
        f = jax.jit(lambda d, k: impl.bucket_ids(d, k, n, c))
        m = dest.size // _DEVICES
        args = (jax.device_put(dest[:m]), jax.device_put(key[:m]))
        return f.lower(*args).compile(), args
    mesh = jax.make_mesh((_DEVICES,), ("data",))
    body = lambda d, k: tuple(r[None] for r in impl.bucket_ids(d, k, n, c))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")),
                              out_specs=(P("data"),) * 3))  # fmt: skip
    args = tuple(jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (dest, key))
    return f.lower(*args).compile(), args


def bucketing_sweep(
    slot_counts: Sequence[int],
    *,
    vocab: int = 2**20,
    zipfs: Sequence[float] = (0.0, 1.1),
    row_shardings: Sequence[str] = ("block", "mod"),
    timing: TimingPolicy,
    seed: int = 0,
    say: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """One point per (slots M, ids, row sharding, devices): native vs XLA bucketing.

    Returns:
      Points `{"name", "slots", "num_buckets", "capacity", "zipf", "row_sharding",
      "devices", "num_threads", "max_bucket_distinct_ids", "overflow", "bitwise_equal",
      "implementations": {"xla": times, "native": times}, "summary": {"xla_time_over_native"}}`.
    """
    say = say or (lambda message: None)
    if len(jax.devices()) < _DEVICES:
        raise ValueError(f"the bucketing sweep needs {_DEVICES} devices")
    if not native.available():
        say(f"bucketing: skipped, the native kernels are unavailable ({native.why_unavailable()})")
        return []
    points = []
    for m in slot_counts:
        routed = _plan(m, vocab)
        for zipf in zipfs:
            for rows in row_shardings:
                rng = np.random.default_rng([seed, m, round(zipf * 1000), rows == "mod"])
                dest, key = _slots(rng, _DEVICES * m, vocab, zipf, rows, routed.num_buckets)
                for devices in (1, _DEVICES):
                    case = {"slots": m, "num_buckets": routed.num_buckets,
                            "capacity": routed.capacity, "zipf": zipf, "row_sharding": rows,
                            "devices": devices}  # fmt: skip
                    say(f"bucketing {_name(case)}")
                    points.append(_point(case, dest, key, timing))
    return points


def _name(case: dict[str, Any]) -> str:
    keys = ("slots", "num_buckets", "capacity", "zipf", "row_sharding", "devices")
    labels = ("slots", "buckets", "capacity", "zipf", "rows", "devices")
    return ",".join(f"{label}={case[k]}" for label, k in zip(labels, keys, strict=True))


def _point(case: dict[str, Any], dest, key, timing: TimingPolicy) -> dict[str, Any]:
    """One case: both programs checked bitwise against each other, then timed interleaved."""
    m, n, c = case["slots"], case["num_buckets"], case["capacity"]
    progs = {impl: _programs(module, case["devices"], n, c, dest, key)
             for impl, module in zip(BUCKETING_IMPLS, (local, native), strict=True)}  # fmt: skip
    outs = {impl: [np.asarray(r) for r in f(*a)] for impl, (f, a) in progs.items()}
    same = all(a.dtype == b.dtype and np.array_equal(a, b)
               for a, b in zip(outs["xla"], outs["native"], strict=True))  # fmt: skip
    d0, k0 = dest[:m], key[:m]  # device 0's slots
    busiest = max(np.unique(k0[d0 == b]).size for b in range(n))
    runners = {impl: (lambda f=f, a=a: jax.block_until_ready(f(*a)))
               for impl, (f, a) in progs.items()}  # fmt: skip
    times = time_interleaved(runners, timing)
    impls = {impl: time_record(times[impl]) for impl in BUCKETING_IMPLS}
    ratio = harness.ratio(impls["xla"]["time_median_in_ms"], impls["native"]["time_median_in_ms"])
    return {
        "name": _name(case), **case, "num_threads": native.num_threads(),
        "max_bucket_distinct_ids": int(busiest), "overflow": bool(np.any(outs["xla"][2])),
        "bitwise_equal": bool(same), "implementations": impls,
        "summary": {"xla_time_over_native": ratio},
    }  # fmt: skip


def bucketing_table(points: list[dict[str, Any]]):
    """The sweep as a report table: `(title, headers, rows)`."""
    headers = ["slots M", "n", "C", "zipf", "rows", "devices", "busiest bucket", "overflow",
               "bitwise", "xla median ms", "native median ms", "xla p90", "native p90",
               "xla / native"]  # fmt: skip
    rows = []
    for p in points:
        x, nv = p["implementations"]["xla"], p["implementations"]["native"]
        rows.append([str(p["slots"]), str(p["num_buckets"]), str(p["capacity"]), f"{p['zipf']:g}",
                     p["row_sharding"], str(p["devices"]), str(p["max_bucket_distinct_ids"]),
                     str(p["overflow"]), str(p["bitwise_equal"]),
                     f"{x['time_median_in_ms']:.3f}", f"{nv['time_median_in_ms']:.3f}",
                     f"{x['time_p90_in_ms']:.3f}", f"{nv['time_p90_in_ms']:.3f}",
                     _num(p["summary"]["xla_time_over_native"])])  # fmt: skip
    title = ("the routed exchange's bucketing (sort + dedup by owner), XLA sort vs native "
             "counting sort + hash, per call")  # fmt: skip
    return title, headers, rows
