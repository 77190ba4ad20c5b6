"""A dynamic table's remap step in ids per second: lookup, admission, insertion and eviction.

    python -m benchmarks.dynamic.throughput \\
        --json benchmarks/results/dynamic/throughput.json \\
        --markdown benchmarks/results/dynamic/throughput.md
    python -m benchmarks.dynamic.throughput --quick      # 2^20 slots, a few steps (tests)

One CPU device (`XLA_FLAGS=--xla_force_host_platform_device_count=1`, set here before jax
starts), so a native call runs on all the process's cores (`native.num_threads()`).

**The table**: `capacity` slots (2^26) in buckets of 32, warmed to `load_factor` (0.9) live ids
before anything is timed: the vocabulary's ids in rank order (most popular first) are stepped
in batches of `warm_batch` under a `ttl` policy that never expires, so a full bucket refuses
the less popular ids, until the live ids reach 0.9 x capacity. One warm state serves every
case (each gets its own copy, donated through its steps).

**The stream**: batches of `batch` (65536) ids, `steps_per_day` steps a day. Each id is a
rank drawn from a Zipf law of exponent `zipf` (1.05) over `vocabulary` ranks (4 x capacity;
inverse-CDF sampling of the continuous law, floored), mapped to its 64-bit id of the day:
on every day d >= 1 each rank independently gets a new id with probability `new_per_day`
(0.2), so a day starts with 20% of the vocabulary (and of the traffic) new to the table.
Ids are splitmix64 of (rank, generation): distinct ranks and generations give distinct ids.
`warmup_steps` steps of day 0 run first, untimed (the compile, the caches, the policy's
metadata of the head); the timed steps are days 1 to `days`. Every case steps the same
batches from the same state and step index, so native and XLA must decide alike: their
results on the steps both run are compared bit for bit (`matches_native`).

**The cases**: each policy (`lru`, `lfu`; `ttl` with `ttl_steps` = two days) on the native
kernel (`jaxembed.kernels.remap_native.step`) and on XLA (`jaxembed.kernels.remap.step`),
both jitted with the state donated, compiled ahead of time. XLA is much slower and times only
the first `xla_steps` steps of day 1 (the native case's median over those same steps is its
`ratio_to_native`'s base). A step's time is `perf_counter` around the call and
`block_until_ready` (and process CPU time: both cores); ids/s is `batch / median step time`
over the timed steps (`overall`: all timed ids over all timed seconds). Per case, the steps'
admitted, evicted, refused, hits and pending (distinct ids) are summed, and the load
average of the machine (2 shared cores) is recorded at its start and end.

Running as `python -m benchmarks dynamic-throughput` needs one line in
`benchmarks/__init__.py`'s `SUBCOMMANDS`: `"dynamic-throughput": "benchmarks.dynamic.throughput",`.
"""

from __future__ import annotations

import os
import sys

if "jax" not in sys.modules:  # one CPU device, before jax starts (`python -m benchmarks` asks 8)
    _flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
              if not f.startswith("--xla_force_host_platform_device_count")]  # fmt: skip
    os.environ["XLA_FLAGS"] = " ".join([*_flags, "--xla_force_host_platform_device_count=1"])

import argparse
import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "QUICK", "SCHEMA", "ThroughputConfig", "compare", "day_ids", "main", "markdown", "mix64",
    "run_throughput", "tables", "zipf_ranks",
]  # fmt: skip

SCHEMA = "jaxembed.bench.dynamic.throughput/1"
GOAL_IDS_PER_S = 30e6  # issue 24's goal for the native step
STATS = ("hits", "admitted", "evicted", "refused", "pending", "reserved")


@dataclasses.dataclass(frozen=True)
class ThroughputConfig:
    """The table, the stream and the timing (the module's docstring).

    Attributes:
      capacity, bucket_size, load_factor: the table, and the live ids it is warmed to.
      batch: ids a step (duplicates included).
      zipf, vocabulary: the Zipf law's exponent and ranks (None: 4 x capacity).
      new_per_day, steps_per_day, days: the vocabulary's daily turnover, the steps of a day,
        and the days timed (after the warm-up day 0).
      warmup_steps: untimed steps of day 0 before the timed ones.
      xla_steps: timed steps of XLA's cases (the first of day 1).
      policies, impls: the cases.
      ttl_steps: the ttl policy's (None: two days).
      warm_batch: ids a step while warming the table.
      seed: of the stream and of the table's hash.
    """

    capacity: int = 2**26
    bucket_size: int = 32
    load_factor: float = 0.9
    batch: int = 65536
    zipf: float = 1.05
    vocabulary: int | None = None
    new_per_day: float = 0.2
    steps_per_day: int = 32
    days: int = 3
    warmup_steps: int = 8
    xla_steps: int = 6
    policies: tuple[str, ...] = ("lru", "lfu", "ttl")
    impls: tuple[str, ...] = ("native", "xla")
    ttl_steps: int | None = None
    warm_batch: int = 2**20
    seed: int = 0
    quick: bool = False

    @property
    def ranks(self) -> int:
        return 4 * self.capacity if self.vocabulary is None else self.vocabulary

    @property
    def timed_steps(self) -> int:
        return self.days * self.steps_per_day


QUICK = ThroughputConfig(
    capacity=2**20, batch=8192, steps_per_day=4, days=2, warmup_steps=2, xla_steps=2,
    warm_batch=2**16, quick=True,
)  # fmt: skip
"""`--quick`: 2^20 slots and a few steps, to exercise the code; the times mean little."""


def case_name(config: ThroughputConfig, policy: str, impl: str) -> str:
    return (f"policy={policy},impl={impl},capacity={config.capacity},"
            f"bucket={config.bucket_size},batch={config.batch}")  # fmt: skip


# --- the stream -------------------------------------------------------------------------------

_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix64(x: Any) -> np.ndarray:
    """splitmix64's finalizer on uint64: a bijection (distinct inputs give distinct outputs).

    Examples:
      >>> mix64(np.arange(3, dtype=np.uint64)).tolist()[0]
      0
      >>> len(set(mix64(np.arange(1000, dtype=np.uint64)).tolist()))
      1000
    """
    z = np.asarray(x, np.uint64)
    with np.errstate(over="ignore"):  # wrapping multiplies (numpy warns on scalars)
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def zipf_ranks(rng: np.random.Generator, n: int, exponent: float, ranks: int) -> np.ndarray:
    """n ranks in `[0, ranks)` (int64) from the continuous Zipf law of `exponent` (> 1 or < 1),
    by its inverse CDF: `x = (1 + u·((ranks + 1)^(1-s) - 1))^(1/(1-s))`, rank `floor(x) - 1`.

    Examples:
      >>> r = zipf_ranks(np.random.default_rng(0), 100_000, 1.05, 1000)
      >>> int(r.min()), int(r.max()) <= 999, bool((r == 0).mean() > (r == 1).mean())
      (0, True, True)
    """
    a = 1.0 - exponent
    x = (1.0 + rng.random(n) * ((ranks + 1.0) ** a - 1.0)) ** (1.0 / a)
    return np.minimum(np.floor(x).astype(np.int64) - 1, ranks - 1)


def day_ids(ranks: np.ndarray, day: int, new_per_day: float, seed: int = 0) -> np.ndarray:
    """The int64 ids of `ranks` on `day`: on each day d in [1, day] every rank independently
    gets a new id with probability `new_per_day`; the id is splitmix64 of (generation, rank).

    Examples:
      >>> r = np.arange(100_000)
      >>> same = day_ids(r, 1, 0.2) == day_ids(r, 0, 0.2)
      >>> kept = day_ids(r, 2, 0.2)[same] == day_ids(r, 1, 0.2)[same]
      >>> round(1 - float(same.mean()), 2), round(float(kept.mean()), 2)
      (0.2, 0.8)
    """
    r = np.asarray(ranks, np.uint64)
    generation = np.zeros(r.shape, np.uint64)
    cut = np.uint64(int(new_per_day * 2**32))
    for d in range(1, day + 1):
        salt = mix64(np.uint64((seed << 32) + d))
        generation += (mix64(r ^ salt) >> np.uint64(32)) < cut
    return mix64((generation << np.uint64(40)) | r).view(np.int64)


def stream(config: ThroughputConfig) -> list[tuple[int, np.ndarray]]:
    """Every step's (day, keys uint32[batch, 2]): `warmup_steps` of day 0, then the days."""
    from jaxembed.dynamic.keys import keys_to_host

    rng = np.random.default_rng([config.seed, 24])
    days = [0] * config.warmup_steps
    days += [d for d in range(1, config.days + 1) for _ in range(config.steps_per_day)]
    out = []
    for day in days:
        ranks = zipf_ranks(rng, config.batch, config.zipf, config.ranks)
        ids = day_ids(ranks, day, config.new_per_day, config.seed)
        out.append((day, keys_to_host(ids, check=False)))
    return out


# --- the table --------------------------------------------------------------------------------


def table_config(config: ThroughputConfig, policy: str):
    from jaxembed.dynamic.config import DynamicTableConfig

    ttl = (config.ttl_steps or 2 * config.steps_per_day) if policy == "ttl" else None
    return DynamicTableConfig(capacity=config.capacity, bucket_size=config.bucket_size,
                              policy=policy, ttl_steps=ttl, seed=config.seed)  # fmt: skip


def warm_table(config: ThroughputConfig, say: Callable[[str], None]) -> dict[str, Any]:
    """Steps the vocabulary's day-0 ids in rank order until `load_factor` of the slots are
    live (a never-expiring ttl: full buckets refuse); the state and how it was made."""
    import jax

    from jaxembed.dynamic.config import INT32_MAX, DynamicTableConfig
    from jaxembed.dynamic.keys import keys_to_host
    from jaxembed.kernels import remap, remap_native

    cfg = DynamicTableConfig(capacity=config.capacity, bucket_size=config.bucket_size,
                             policy="ttl", ttl_steps=INT32_MAX - 1, seed=config.seed)  # fmt: skip
    impl = remap_native if remap_native.available() else remap
    run = jax.jit(impl.step, static_argnums=0, donate_argnums=1)
    state = remap.init_state(cfg)
    target = math.ceil(config.load_factor * config.capacity)
    live = rank = t = refused = 0
    start = time.perf_counter()
    while live < target:
        n = min(config.warm_batch, max(target - live, 1024))
        ids = np.full((config.warm_batch,), -1, np.int64)  # the reserved id pads
        ids[:n] = day_ids(np.arange(rank, rank + n), 0, config.new_per_day, config.seed)
        out = run(cfg, state, keys_to_host(ids, check=False), np.int32(t))
        state = out.state
        live += int(out.stats.admitted) - int(out.stats.evicted)
        refused += int(out.stats.refused)
        rank, t = rank + n, t + 1
        if t % 16 == 0:
            say(f"warm: {live / config.capacity:.3f} of the slots live after {t} steps")
    return {
        "state": state,
        "steps": t,
        "ranks_stepped": rank,
        "live": live,
        "refused": refused,
        "impl": impl.__name__.rsplit(".", 1)[-1],
        "time_in_s": round(time.perf_counter() - start, 2),
    }


def memory_pages() -> dict[str, Any]:
    """Whether the state can sit on huge pages: the kernel's transparent-huge-page mode, glibc's
    tunables (`glibc.malloc.hugetlb=1` makes malloc ask for them), and this process's anonymous
    memory on huge pages (from /proc; None where it cannot be read)."""

    def read(path: str) -> str | None:
        try:
            with open(path) as f:
                return f.read()
        except OSError:
            return None

    mode = read("/sys/kernel/mm/transparent_hugepage/enabled")
    rollup = read("/proc/self/smaps_rollup") or ""
    huge = [line.split()[1] for line in rollup.splitlines() if line.startswith("AnonHugePages:")]
    return {
        "transparent_hugepage": mode.strip() if mode else None,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
        "anon_huge_pages_bytes": int(huge[0]) * 1024 if huge else None,
    }


def _live(state) -> int:
    import jax
    import jax.numpy as jnp

    from jaxembed.dynamic.keys import is_reserved

    return int(jax.jit(lambda k: jnp.sum(~is_reserved(k), dtype=jnp.int32))(state.keys))


def _digest(out) -> str:
    """A step's results (not its state) as one hash, to compare two engines' steps."""
    h = hashlib.sha256()
    for leaf in (out.rows, out.found, *out.stats, out.reset_rows, out.evicted_keys):
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()[:16]


def run_case(config: ThroughputConfig, policy: str, impl: str, warm: dict[str, Any],
             batches: list[Any], steps: int) -> dict[str, Any]:  # fmt: skip
    """Steps the first `warmup_steps + steps` batches from a copy of the warm state; the
    per-step times, the summed stats and the digests of the steps' results."""
    import jax
    import jax.numpy as jnp

    from jaxembed.kernels import native, remap, remap_native

    fn = remap_native.step if impl == "native" else remap.step
    cfg = table_config(config, policy)
    state = jax.jit(lambda s: jax.tree.map(jnp.copy, s))(warm["state"])  # its own buffers
    t0 = warm["steps"]
    start = time.perf_counter()
    step = jax.jit(fn, static_argnums=0, donate_argnums=1)
    step = step.lower(cfg, state, batches[0], np.int32(t0)).compile()
    compile_s = time.perf_counter() - start
    wall, cpu, stats, digests = [], [], [], []
    load_start = os.getloadavg()
    for i, keys in enumerate(batches[: config.warmup_steps + steps]):
        t = np.int32(t0 + i)
        start, start_cpu = time.perf_counter(), time.process_time()
        out = step(state, keys, t)
        jax.block_until_ready(out)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        state = out.state
        if i >= config.warmup_steps:
            stats.append([int(x) for x in out.stats])
        if i < config.warmup_steps + config.xla_steps:
            digests.append(_digest(out))
        del out
    load_end = os.getloadavg()
    live_end = _live(state)
    del state
    w = np.asarray(wall[config.warmup_steps :])
    c = np.asarray(cpu[config.warmup_steps :])
    totals = np.sum(stats, axis=0)
    median = float(np.median(w))
    return {
        "name": case_name(config, policy, impl),
        "policy": policy,
        "impl": impl,
        "ttl_steps": cfg.ttl_steps,
        "num_threads": int(native.num_threads()) if impl == "native" else None,
        "steps_timed": len(w),
        "compile_time_in_s": round(compile_s, 3),
        "step_time_median_in_ms": round(median * 1e3, 4),
        "step_time_p90_in_ms": round(float(np.percentile(w, 90)) * 1e3, 4),
        "step_time_min_in_ms": round(float(np.min(w)) * 1e3, 4),
        "step_cpu_median_in_ms": round(float(np.median(c)) * 1e3, 4),
        "step_time_samples_in_ms": [round(x * 1e3, 3) for x in w.tolist()],
        "ids_per_s_median": round(config.batch / median),
        "ids_per_cpu_s_median": round(config.batch / float(np.median(c))),
        "ids_per_s_overall": round(config.batch * len(w) / float(np.sum(w))),
        "first_steps_median_in_ms": round(float(np.median(w[: config.xla_steps])) * 1e3, 4),
        **{k: int(v) for k, v in zip(STATS, totals, strict=True)},
        "load_factor_start": round(warm["live"] / config.capacity, 5),
        "load_factor_end": round(live_end / config.capacity, 5),
        "load_average_start": [round(x, 2) for x in load_start],
        "load_average_end": [round(x, 2) for x in load_end],
        "digests": digests,
    }


def run_throughput(config: ThroughputConfig, say: Callable[[str], None] = lambda s: None):
    """Warms the table, makes the stream, runs every case; the record."""
    import jax

    from benchmarks.common import report
    from jaxembed.kernels import remap_native

    load_start = os.getloadavg()
    if jax.local_device_count() != 1:  # jax started before this module set the flag
        say(
            f"{jax.local_device_count()} devices, not 1: a native call gets cores / devices "
            "threads; run `python -m benchmarks.dynamic.throughput` in a new process"
        )
    impls = [i for i in config.impls if i != "native" or remap_native.available()]
    say(f"warm a table of {config.capacity} slots to load factor {config.load_factor}")
    warm = warm_table(config, say)
    say(f"warm: {warm['live']} live ids after {warm['steps']} steps ({warm['time_in_s']} s)")
    warm["memory_pages"] = memory_pages()  # with the warm state in memory
    batches = [jax.device_put(keys) for _, keys in stream(config)]
    cases = []
    for policy in config.policies:
        for impl in impls:
            steps = config.timed_steps if impl == "native" else config.xla_steps
            say(f"{policy} {impl}: {config.warmup_steps} + {steps} steps")
            cases.append(run_case(config, policy, impl, warm, batches, steps))
            x = cases[-1]
            say(f"{policy} {impl}: {x['ids_per_s_median'] / 1e6:.2f} M ids/s "
                f"(median {x['step_time_median_in_ms']:.2f} ms a step)")  # fmt: skip
    for x in cases:
        base = next((n for n in cases if n["policy"] == x["policy"] and n["impl"] == "native"),
                    None)  # fmt: skip
        x["ratio_to_native"] = None if base is None else round(
            x["first_steps_median_in_ms"] / base["first_steps_median_in_ms"], 2)  # fmt: skip
        n = min(len(x["digests"]), len(base["digests"])) if base else 0
        x["matches_native"] = None if base is None else x["digests"][:n] == base["digests"][:n]
    del warm["state"]
    machine = report.machine()
    machine["load_average_start"] = [round(v, 2) for v in load_start]
    machine["load_average_end"] = [round(v, 2) for v in os.getloadavg()]
    return {
        "schema": SCHEMA,
        "machine": machine,
        "config": dataclasses.asdict(config) | {"vocabulary": config.ranks},
        "warm": {k: v for k, v in warm.items() if k != "state"},
        "goal_ids_per_s": GOAL_IDS_PER_S,
        "cases": cases,
    }


# --- the report -------------------------------------------------------------------------------


def compare(record: dict[str, Any], baseline: dict[str, Any], path: str) -> None:
    """Adds to each case of `record` the same case's ids/s in `baseline` (an earlier record of
    this benchmark, e.g. before a change of the kernel) and the ratio of the medians."""
    before = {x["name"]: x for x in baseline.get("cases", [])}
    record["baseline"] = {"path": path, "date": baseline.get("machine", {}).get("date"),
                          "load_average_start": baseline.get("machine", {}).get(
                              "load_average_start")}  # fmt: skip
    for x in record["cases"]:
        b = before.get(x["name"])
        x["baseline_ids_per_s_median"] = None if b is None else b["ids_per_s_median"]
        x["baseline_ids_per_cpu_s_median"] = None if b is None else b.get("ids_per_cpu_s_median")
        x["speedup_vs_baseline"] = None if b is None else round(
            x["ids_per_s_median"] / b["ids_per_s_median"], 2)  # fmt: skip


def tables(record: dict[str, Any]) -> list[Any]:
    """One table: every case's step time, ids/s and decisions (and the baseline's ids/s)."""
    c = record["config"]
    rows = []
    for x in record["cases"]:
        per = lambda k: f"{x[k] / x['steps_timed']:.0f}"  # noqa: B023 - used at once
        lf = f"{x['load_factor_start']:.3f} -> {x['load_factor_end']:.3f}"
        match = {None: "-", True: "yes", False: "NO"}[x["matches_native"]]
        ratio = "-" if x["impl"] == "native" else f"{x['ratio_to_native']:.1f}"
        load = f"{x['load_average_start'][0]:.1f} / {x['load_average_end'][0]:.1f}"
        rows.append([x["policy"], x["impl"], str(x["steps_timed"]),
                     f"{x['step_time_median_in_ms']:.2f}", f"{x['step_time_p90_in_ms']:.2f}",
                     f"{x['step_cpu_median_in_ms']:.2f}", f"{x['ids_per_s_median'] / 1e6:.2f}",
                     f"{x['ids_per_s_overall'] / 1e6:.2f}",
                     f"{x['ids_per_cpu_s_median'] / 1e6:.2f}", ratio, match, per("hits"),
                     per("admitted"), per("evicted"), per("refused"), lf, load])  # fmt: skip
        if "baseline" in record:
            b = x["baseline_ids_per_s_median"]
            rows[-1] += ["-" if b is None else f"{b / 1e6:.2f}",
                         "-" if b is None else f"{x['speedup_vs_baseline']:.2f}"]  # fmt: skip
    headers = ["policy", "impl", "steps", "median ms", "p90 ms", "cpu ms", "M ids/s",
               "M ids/s overall", "M ids/cpu-s", "x native", "= native", "hits/step",
               "admitted/step",
               "evicted/step", "refused/step", "load factor", "load avg"]  # fmt: skip
    if "baseline" in record:
        headers += ["baseline M ids/s", "x baseline"]
    title = (f"capacity={c['capacity']} (buckets of {c['bucket_size']}), batch={c['batch']}, "
             f"Zipf {c['zipf']} over {c['vocabulary']} ranks, {c['new_per_day']:.0%} new a "
             f"day of {c['steps_per_day']} steps")  # fmt: skip
    return [(title, headers, rows)]


def markdown(record: dict[str, Any]) -> str:
    """The record's table as Markdown, under the command, the machine and the goal."""
    from benchmarks.common.report import markdown_tables

    m, w, c = record["machine"], record["warm"], record["config"]
    native = [x for x in record["cases"] if x["impl"] == "native"]
    goal = record["goal_ids_per_s"]
    verdict = ", ".join(
        f"{x['policy']} {x['ids_per_s_median'] / 1e6:.1f}M "
        f"({'met' if x['ids_per_s_median'] >= goal else 'not met'})"
        for x in native
    )
    command = "python -m benchmarks.dynamic.throughput" + (" --quick" if c["quick"] else "")
    base = record.get("baseline")
    if base:
        command += f" --baseline {base['path']}"
    head = (
        f"Made by `{command} --json benchmarks/results/dynamic/throughput.json --markdown "
        f"benchmarks/results/dynamic/throughput.md` ({m['date']}, {m['cpu_count']} shared CPU "
        f"cores, {m['processor']}, 1 CPU device, jax {m['jax']}; load average (1, 5, 15 min) "
        f"{m['load_average_start']} at the start, {m['load_average_end']} at the end: other "
        "engineers' jobs share the cores; native steps on "
        f"{next((x['num_threads'] for x in native), '-')} threads; huge pages: "
        f"{w['memory_pages']['anon_huge_pages_bytes']} bytes, THP "
        f"{w['memory_pages']['transparent_hugepage']}).\n\n"
        f"The table was warmed to {w['live'] / c['capacity']:.3f} of its slots live "
        f"({w['live']} ids, {w['steps']} steps of {c['warm_batch']} ids by the {w['impl']} "
        f"step, {w['time_in_s']} s; {w['refused']} refused by full buckets). Then "
        f"{c['warmup_steps']} untimed steps of day 0 and {c['days']} days of "
        f"{c['steps_per_day']} steps (XLA: the first {c['xla_steps']}), the same batches from "
        "the same state for every case. `M ids/s` is batch / the median step time (ids with "
        "their duplicates); `cpu ms` the process's CPU time a step (all its threads) and "
        "`M ids/cpu-s` batch / that median: what a step costs whatever the load; `x native` "
        "XLA's median over its steps against the native median over the same steps; "
        "`= native`: the steps' results (rows, found, stats, reset rows, evicted keys) equal "
        "the native case's, bit for bit; decisions are distinct ids a step. "
        "On this stream the policies admit and evict about alike: their victims are the "
        "warm ids seen once, the least recently and the least often seen, most of them "
        "stepped more than `ttl_steps` ago (expired), so ttl refuses only a handful. "
        f"Goal: >= {goal / 1e6:.0f}M ids/s for the native step: {verdict}.\n"
    )
    if base:
        head += (
            f"\n`baseline`: the same benchmark on the kernel before this change ({base['path']}, "
            f"{base['date']}, load average {base['load_average_start']} at its start); its "
            "XLA rows, whose code did not change, show how much the machine's load moves a "
            "median from one run to the next.\n"
        )
    return head + "\n" + markdown_tables(tables(record))


def _names(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.split(",") if x)


def main(argv: Sequence[str]) -> int:
    """`python -m benchmarks.dynamic.throughput [--quick] [--json PATH] [--markdown PATH] ...`."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.dynamic.throughput",
        description="A dynamic table's remap step (lookup, admit, evict) in ids/s on 1 device.",
    )
    p.add_argument("--quick", action="store_true", help="2^20 slots, a few steps (for tests)")
    p.add_argument("--json", metavar="PATH", help="write the record as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the table as Markdown")
    p.add_argument("--capacity", type=int, help="slots of the table (default 2^26)")
    p.add_argument("--batch", type=int, help="ids a step (default 65536)")
    p.add_argument("--policies", type=_names, metavar="P,P", help="e.g. lru,lfu,ttl")
    p.add_argument("--impls", type=_names, metavar="I,I", help="native,xla")
    p.add_argument("--days", type=int, help="days timed")
    p.add_argument("--steps-per-day", type=int, help="steps a day")
    p.add_argument("--xla-steps", type=int, help="timed steps of the XLA cases")
    p.add_argument("--baseline", metavar="PATH", help="an earlier record: its ids/s beside ours")
    args = p.parse_args(list(argv))
    config = QUICK if args.quick else ThroughputConfig()
    changes = {k: v for k, v in (("capacity", args.capacity), ("batch", args.batch),
               ("policies", args.policies), ("impls", args.impls), ("days", args.days),
               ("steps_per_day", args.steps_per_day), ("xla_steps", args.xla_steps))
               if v is not None}  # fmt: skip
    config = dataclasses.replace(config, **changes)
    from benchmarks.common import report

    record = run_throughput(config, say=lambda s: print(f"[dynamic] {s}", file=sys.stderr))
    if args.baseline:
        with open(args.baseline) as f:
            compare(record, json.load(f), args.baseline)
    m = record["machine"]
    report.print_table_list(
        f"{SCHEMA} on {m['cpu_count']} CPU cores, 1 {m['platform']} device; jax {m['jax']}",
        tables(record),
    )
    report.write_outputs(record, json_path=args.json, markdown_path=args.markdown,
                         markdown=lambda: markdown(record))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
