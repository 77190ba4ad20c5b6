"""Tiered tables (`jaxembed.tiered`): the step against the in-memory table's, and larger than RAM.

    python -m benchmarks tiered --json benchmarks/results/tiered/tiered.json \\
        --markdown benchmarks/results/tiered/tiered.md
    python -m benchmarks tiered --rows 200_000_000 --path /mnt/disk/tiered   # 51 GB on disk
    python -m benchmarks tiered --quick                   # a tiny table, a few steps (tests)

One CPU device (set here before jax starts), rowwise Adagrad, `embedding_bag(combiner="sum")`.

**The stream**: batches of `batch` (4096) bags of 1 to 20 ids (the rest of a row padding,
-1); each id a Zipf(1.1) rank scattered over the rows by a multiplication modulo the rows (so
hot rows are not neighbours in the file), the same batches for every variant.

**(a) A table that fits** (`rows` 2M x `dim` 64 float32), a cache of 5 % and of 20 % of the
rows: the tiered pipeline (`prepare(ids, next_ids=the next batch)`, then the jitted step on
the cache's slots: the next batch's remap and store reads overlap the step) against the
in-memory table's jitted step on the very same ids, in one run, after `warmup` (50) untimed
steps that fill the cache (the 20 % one takes about 40), so that every timed step evicts as
many rows as it reads (and the store's pages have been written once: the first write to a
clean page of a shared file mapping faults, about 10k faults a step on a fresh store).
A pipeline is timed over a block of `block` (5) steps, not a step alone (a step's host
work overlaps the one before it): the variants alternate block by block (each
block's two in alternating order), each block `perf_counter` from its first call to
`block_until_ready` of its last step and, for the tiered table, `wait()` for the store I/O in
flight (the next block's first batch's reads included). A sample is a block's time over its
steps. Both steps are compiled ahead of time with the table and optimizer state donated.
Reported: median and p90 step time, the ratio to the in-memory step, the ratio of process
CPU time (all threads: robust to other processes on a shared machine), the median host time
in `prepare`, the hit rate (distinct ids), the misses prefetched, and whether the store after
`flush` equals the in-memory table bit for bit (`equal_bitwise`). `--no-prefetch` times
`prepare(ids)` alone (the misses read after the step before has finished).

**(b) A table larger than RAM** (`--rows`, off by default: it writes `rows x (4 dim + 4)`
bytes under `--path`, reused by later runs): `steps` tiered steps (`pipeline`, prefetching)
with a cache of `large_cache_rows`: steps/s, the hit rate, the store's bytes a step (rows and
optimizer state, read and written), and the disk's random-read bandwidth measured on the same file
(`os.pread` of `read_samples` rows of `4 dim` bytes at random offsets) with the steps/s that
bandwidth alone would allow. `--quick` runs (b) too, on a small file in a temporary directory
(its bandwidth is the page cache's).
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
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

SCHEMA = "jaxembed.benchmarks.tiered/1"
_SCATTER = 2_654_435_761  # Knuth's multiplicative hash: rank -> row


@dataclasses.dataclass(frozen=True)
class TieredConfig:
    """What the benchmark runs (the defaults: issue 46's cases)."""

    rows: int = 2_000_000
    dim: int = 64
    cache_fractions: tuple[float, ...] = (0.05, 0.20)
    batch: int = 4096
    max_bag: int = 20
    zipf: float = 1.1
    lr: float = 0.05
    warmup: int = 50  # fills the 20 % cache (about 10k misses a step), so every step evicts
    steps: int = 40
    block: int = 5  # steps a timed block: the variants alternate block by block
    prefetch: bool = True  # the pipeline (prepare with next_ids); False: prepare alone
    large_rows: int | None = None  # (b) off
    large_path: str | None = None
    large_steps: int = 1000
    large_cache_rows: int = 1 << 20
    read_samples: int = 20_000
    seed: int = 0


QUICK = TieredConfig(rows=20_000, dim=16, batch=64, warmup=2, steps=4, block=2,
                     large_rows=50_000, large_steps=4, large_cache_rows=2048,
                     read_samples=500)  # fmt: skip


def zipf_bags(rng: np.random.Generator, batch: int, rows: int, max_bag: int, a: float):
    """int64 `[batch, max_bag]`: bags of 1 to `max_bag` Zipf(a) ids, padded with -1."""
    ranks = rng.zipf(a, (batch, max_bag)).astype(np.uint64) - np.uint64(1)
    ids = ((ranks % np.uint64(rows)) * np.uint64(_SCATTER) % np.uint64(rows)).astype(np.int64)
    length = rng.integers(1, max_bag + 1, (batch, 1))
    return np.where(np.arange(max_bag) < length, ids, -1)


def _programs(opt: Any, table: Any, batch: int, max_bag: int) -> Callable:
    """The training step compiled ahead of time for `table`'s shape, state donated."""
    import jax
    import jax.numpy as jnp

    import jaxembed

    def step(table, state, ids, g):
        out = jaxembed.embedding_bag(ids, table, combiner="sum")  # f32[B, dim]
        return opt.update(table, state, ids, g, combiner="sum", after=out)

    ids = jax.ShapeDtypeStruct((batch, max_bag), jnp.int32)
    g = jax.ShapeDtypeStruct((batch, table.shape[1]), jnp.float32)
    state = jax.eval_shape(opt.init, table)
    return jax.jit(step, donate_argnums=(0, 1)).lower(table, state, ids, g).compile()


class _RandomRows:
    """A `[rows, dim]` float32 source of normal rows generated a slice at a time, for
    `TableStore.create` (so a table larger than RAM never is in memory)."""

    def __init__(self, rows: int, dim: int, seed: int) -> None:
        self.shape, self.seed = (rows, dim), seed

    def __getitem__(self, s: slice) -> np.ndarray:
        rng = np.random.default_rng((self.seed, s.start))
        return rng.normal(size=(s.stop - s.start, self.shape[1])).astype(np.float32)


def _stats(stats: list[Any], row_bytes: int) -> dict[str, Any]:
    hits = sum(s.hits for s in stats)
    looked = hits + sum(s.misses for s in stats)
    moved = sum(s.bytes_read + s.bytes_written for s in stats)
    return {
        "hit_rate": round(hits / max(looked, 1), 4),
        "distinct_ids_per_step": round(looked / max(len(stats), 1), 1),
        "written_back_per_step": round(sum(s.written_back for s in stats) / max(len(stats), 1), 1),
        "store_bytes_per_step": round(moved / max(len(stats), 1)),
        "row_bytes": row_bytes,
    }


def run_fits(config: TieredConfig, workdir: str, say: Callable[[str], None]) -> list[dict]:
    """(a): per cache fraction, the tiered pipeline against the in-memory step, interleaved
    by blocks of `block` steps on the same batches."""
    import jax
    import jax.numpy as jnp

    import jaxembed
    from benchmarks.common.timing import time_record
    from jaxembed.tiered import TieredTable, create_store

    c = config
    opt = jaxembed.optim.rowwise_adagrad(c.lr)
    init = np.asarray(_RandomRows(c.rows, c.dim, c.seed)[0 : c.rows])
    rng = np.random.default_rng(c.seed)
    n = c.warmup + c.steps
    batches = [zipf_bags(rng, c.batch, c.rows, c.max_bag, c.zipf) for _ in range(n)]
    grads = [jnp.asarray(rng.normal(size=(c.batch, c.dim)).astype(np.float32) * 0.1)
             for _ in range(n)]  # fmt: skip
    mem_step = _programs(opt, jnp.asarray(init), c.batch, c.max_bag)
    cases = []
    for frac in c.cache_fractions:
        cache = max(32, int(c.rows * frac) // 32 * 32)
        name = f"rows={c.rows},dim={c.dim},cache={frac:.0%},batch={c.batch}"
        say(name)
        path = os.path.join(workdir, f"fits-{frac}")
        store = create_store(path, rows=c.rows, dim=c.dim, optimizer=opt, table=init,
                             overwrite=True)  # fmt: skip
        tiered = TieredTable(store, cache, optimizer=opt)
        tiered_step = _programs(opt, tiered.table, c.batch, c.max_bag)
        table = jnp.asarray(init)
        state = opt.init(table)

        def run_tiered(lo: int, hi: int, prepare_s: list[float], stats: list[Any],
                       tiered: Any = tiered, tiered_step: Any = tiered_step) -> None:  # fmt: skip
            for i in range(lo, hi):
                nxt = batches[i + 1] if c.prefetch and i + 1 < n else None
                t0 = time.perf_counter()
                slots, st = tiered.prepare(batches[i], next_ids=nxt)
                prepare_s.append(time.perf_counter() - t0)
                stats.append(st)
                tiered.table, tiered.opt_state = tiered_step(
                    tiered.table, tiered.opt_state, slots, grads[i]
                )
            jax.block_until_ready(tiered.table)
            tiered.wait()  # the store reads and writes in flight (the next batch's too)

        def run_memory(lo: int, hi: int) -> None:
            nonlocal table, state
            for i in range(lo, hi):
                table, state = mem_step(table, state, jnp.asarray(batches[i], jnp.int32),
                                        grads[i])  # fmt: skip
            jax.block_until_ready(table)

        run_tiered(0, c.warmup, [], [])
        run_memory(0, c.warmup)
        wall: dict[str, list[float]] = {"tiered": [], "memory": []}
        cpu: dict[str, list[float]] = {"tiered": [], "memory": []}
        prepare_s: list[float] = []
        stats: list[Any] = []
        for k, lo in enumerate(range(c.warmup, n, c.block)):
            hi = min(n, lo + c.block)
            for variant in ("tiered", "memory") if k % 2 else ("memory", "tiered"):
                t0, p0 = time.perf_counter(), time.process_time()
                if variant == "tiered":
                    run_tiered(lo, hi, prepare_s, stats)
                else:
                    run_memory(lo, hi)
                wall[variant].append((time.perf_counter() - t0) / (hi - lo))
                cpu[variant].append((time.process_time() - p0) / (hi - lo))
        tiered.flush()
        acc = np.asarray(state.slots["accumulator"])
        equal = bool(
            np.array_equal(np.asarray(store.table), np.asarray(table))
            and np.array_equal(np.asarray(store.slot_arrays["accumulator"]), acc)
        )
        tiered.close()
        t, m = time_record(wall["tiered"]), time_record(wall["memory"])
        cpu_ratio = float(np.median(cpu["tiered"]) / np.median(cpu["memory"]))
        misses = sum(s.misses for s in stats)
        cases.append({
            "name": name, "cache_rows": cache, "cache_fraction": frac,
            "prefetch": c.prefetch, "block_steps": c.block,
            "tiered": t, "memory": m,
            "prepare_median_in_ms": time_record(prepare_s)["time_median_in_ms"],
            "ratio_to_memory": round(t["time_median_in_ms"] / m["time_median_in_ms"], 3),
            "cpu_ratio_to_memory": round(cpu_ratio, 3),
            "prefetched_fraction": round(sum(s.prefetched for s in stats) / max(misses, 1), 4),
            "equal_bitwise": equal, **_stats(stats, store.row_bytes),
        })  # fmt: skip
    return cases


def disk_read_bandwidth(file: str, row_bytes: int, samples: int, seed: int = 1) -> dict:
    """Random reads of `row_bytes` at row-aligned offsets of `file` with `os.pread`."""
    rows = os.path.getsize(file) // row_bytes
    at = np.random.default_rng(seed).integers(0, rows, samples) * row_bytes
    fd = os.open(file, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        for off in at.tolist():
            os.pread(fd, row_bytes, off)
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
    return {
        "read_bytes": row_bytes, "reads": samples,
        "reads_per_s": round(samples / seconds),
        "bytes_per_s": round(samples * row_bytes / seconds),
    }  # fmt: skip


def run_large(config: TieredConfig, path: str, say: Callable[[str], None]) -> dict:
    """(b): `large_steps` tiered steps on a store of `large_rows` at `path` (made once)."""
    import jax
    import jax.numpy as jnp

    import jaxembed
    from jaxembed.tiered import TableStore, TieredTable, create_store

    c = config
    rows = int(c.large_rows)
    opt = jaxembed.optim.rowwise_adagrad(c.lr)
    try:
        store = TableStore.open(path, rows=rows, dim=c.dim, slots=["accumulator"])
        say(f"reusing the store at {path}")
    except FileNotFoundError:
        gb = rows * (4 * c.dim + 4) / 1e9
        say(f"writing a store of {rows} x {c.dim} at {path} ({gb:.1f} GB)")
        store = create_store(path, rows=rows, dim=c.dim, optimizer=opt,
                             table=_RandomRows(rows, c.dim, c.seed))  # fmt: skip
    tiered = TieredTable(store, c.large_cache_rows, optimizer=opt)
    step = _programs(opt, tiered.table, c.batch, c.max_bag)
    rng = np.random.default_rng(c.seed + 1)
    g = jnp.asarray(rng.normal(size=(c.batch, c.dim)).astype(np.float32) * 0.1)
    stats, t0 = [], time.perf_counter()
    loader = (zipf_bags(rng, c.batch, rows, c.max_bag, c.zipf) for _ in range(c.large_steps))
    for i, (_, slots, st) in enumerate(tiered.pipeline(loader)):
        tiered.table, tiered.opt_state = step(tiered.table, tiered.opt_state, slots, g)
        stats.append(st)
        if i % 100 == 99:
            say(f"step {i + 1}: {(i + 1) / (time.perf_counter() - t0):.2f} steps/s")
    jax.block_until_ready(tiered.table)
    tiered.wait()
    seconds = time.perf_counter() - t0
    disk = disk_read_bandwidth(os.path.join(path, "table.bin"), 4 * c.dim, c.read_samples)
    out = {"name": f"rows={rows},dim={c.dim},cache_rows={c.large_cache_rows},batch={c.batch}",
           "rows": rows, "table_bytes": rows * 4 * c.dim, "steps": c.large_steps,
           "steps_per_s": round(c.large_steps / seconds, 3), **_stats(stats, store.row_bytes),
           "disk_random_read": disk}  # fmt: skip
    rows_read = sum(s.misses for s in stats) / len(stats)
    out["disk_bound_steps_per_s"] = round(disk["reads_per_s"] / max(rows_read, 1), 3)
    return out


def markdown(record: dict[str, Any]) -> str:
    lines = [f"# Tiered tables ({record['schema']})", "",
             "| case | tiered ms (median / p90) | in-memory ms | ratio | CPU ratio | prepare ms "
             "| hit rate | prefetched | store bytes/step | bitwise |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for x in record["fits"]:
        t, m = x["tiered"], x["memory"]
        lines.append(
            f"| {x['name']} | {t['time_median_in_ms']:.2f} / {t['time_p90_in_ms']:.2f} "
            f"| {m['time_median_in_ms']:.2f} | {x['ratio_to_memory']:.2f}x "
            f"| {x['cpu_ratio_to_memory']:.2f}x | {x['prepare_median_in_ms']:.2f} "
            f"| {x['hit_rate']:.3f} | {x['prefetched_fraction']:.3f} "
            f"| {x['store_bytes_per_step']} | {x['equal_bitwise']} |"
        )
    if record.get("large"):
        x = record["large"]
        d = x["disk_random_read"]
        lines += ["", "| larger than RAM | steps/s | hit rate | store bytes/step | disk random "
                  "reads/s | disk MB/s | disk-bound steps/s |", "|---|---|---|---|---|---|---|",
                  f"| {x['name']} | {x['steps_per_s']} | {x['hit_rate']:.3f} "
                  f"| {x['store_bytes_per_step']} | {d['reads_per_s']} "
                  f"| {d['bytes_per_s'] / 1e6:.1f} | {x['disk_bound_steps_per_s']} |"]  # fmt: skip
    return "\n".join(lines) + "\n"


def run(config: TieredConfig, *, workdir: str, say: Callable[[str], None] = print) -> dict:
    """The record: `fits` (a) and `large` (b, where `config.large_rows`)."""
    from benchmarks.common import report

    record: dict[str, Any] = {"schema": SCHEMA, "config": dataclasses.asdict(config),
                              "machine": report.machine()}  # fmt: skip
    record["fits"] = run_fits(config, workdir, say)
    record["large"] = None
    if config.large_rows:
        path = config.large_path or os.path.join(workdir, "large")
        record["large"] = run_large(config, path, say)
    return record


def main(argv: Sequence[str]) -> int:
    """`python -m benchmarks tiered [--quick] [--rows N --path DIR] [--json P] [--markdown P]`."""
    doc = (__doc__ or "").split("\n")[0]
    p = argparse.ArgumentParser(prog="python -m benchmarks tiered", description=doc)
    p.add_argument("--quick", action="store_true", help="a tiny table, a few steps (for tests)")
    p.add_argument("--json", metavar="PATH", help="write the record as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the tables as Markdown")
    p.add_argument("--steps", type=int, help="timed steps of (a)")
    p.add_argument("--block", type=int, help="(a): steps a timed block (default 5)")
    p.add_argument(
        "--no-prefetch",
        action="store_true",
        help="(a): time prepare(ids) alone, without the next batch's prefetch",
    )
    p.add_argument("--rows", type=lambda s: int(s.replace("_", "")),
                   help="(b): a store of these rows on disk (200_000_000: 51 GB)")  # fmt: skip
    p.add_argument("--path", help="(b): the store's directory (default: a temporary one)")
    p.add_argument("--large-steps", type=int, help="(b): steps (default 1000)")
    p.add_argument("--large-cache-rows", type=int, help="(b): the cache's rows (default 2^20)")
    args = p.parse_args(list(argv))
    config = QUICK if args.quick else TieredConfig()
    changes = {k: v for k, v in (("steps", args.steps), ("block", args.block),
               ("prefetch", False if args.no_prefetch else None), ("large_rows", args.rows),
               ("large_path", args.path), ("large_steps", args.large_steps),
               ("large_cache_rows", args.large_cache_rows)) if v is not None}  # fmt: skip
    config = dataclasses.replace(config, **changes)
    from benchmarks.common import report

    with tempfile.TemporaryDirectory(prefix="jaxembed-tiered-") as workdir:
        record = run(config, workdir=workdir, say=lambda s: print(f"[tiered] {s}", file=sys.stderr))
    print(markdown(record))
    report.write_outputs(record, json_path=args.json, markdown_path=args.markdown,
                         markdown=lambda: markdown(record))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
