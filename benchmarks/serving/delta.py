"""`python -m benchmarks serving-delta`: a served model takes fresh rows while it serves.

One float table (`--rows` x `--dim`, default 1M x 64, 256 MB) and a pooled lookup, exported
and loaded with the standalone loader. The trainer side writes deltas of `--fraction` of the
rows (default 1 %, at random) with `jaxembed.serving.DeltaWriter`; the serving side applies
each with `Model.apply_delta` while `--threads` threads send requests (batch `--batch`, bags
of 1-20 Zipf(1.1) ids). Reported: the delta's size on disk, the time to write it, the time
to apply it (median over `--deltas`), and the requests per second with no delta applying
against during the applies (the requests counted between each apply's start and end).

    python -m benchmarks serving-delta --json benchmarks/results/serving/delta.json
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common.report import write_outputs

__all__ = ["main"]


def run(opts: argparse.Namespace) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxembed
    from jaxembed import serving
    from jaxembed import workloads as W

    rng = np.random.default_rng(0)
    table = rng.standard_normal((opts.rows, opts.dim), dtype=np.float32)

    def fn(params, ids):
        return jaxembed.embedding_bag(ids, params["table"], combiner="sum")

    lengths = rng.integers(1, 21, opts.batch)
    ids = np.full((opts.batch, 20), -1, np.int32)
    ids[np.arange(20)[None] < lengths[:, None]] = W.zipf_ids(rng, int(lengths.sum()), opts.rows,
                                                             1.1)  # fmt: skip
    work = Path(tempfile.mkdtemp())
    t0 = time.perf_counter()
    path = serving.save(serving.export_inference(fn, {"table": table}, ids), work / "model")
    export_s = time.perf_counter() - t0
    model = serving.load(path)
    writer = serving.DeltaWriter(path)
    ids = jnp.asarray(ids)
    jax.block_until_ready(model(ids))

    counts = [0] * opts.threads
    stop = threading.Event()

    def serve(k):
        while not stop.is_set():
            jax.block_until_ready(model(ids))
            counts[k] += 1

    def rate(seconds):
        before, t = sum(counts), time.perf_counter()
        time.sleep(seconds)
        return (sum(counts) - before) / (time.perf_counter() - t)

    threads = [threading.Thread(target=serve, args=(k,)) for k in range(opts.threads)]
    for t in threads:
        t.start()
    quiet = rate(opts.window)
    record: dict[str, Any] = {"deltas": []}
    changed = max(1, int(opts.fraction * opts.rows))
    for k in range(opts.deltas):
        rows = rng.choice(opts.rows, changed, replace=False)
        table[rows] += 0.01
        t = time.perf_counter()
        delta = writer.write({"table": table}, work / f"delta{k}")
        write_s = time.perf_counter() - t
        size = sum(f.stat().st_size for f in delta.iterdir())
        before, t = sum(counts), time.perf_counter()
        model.apply_delta(delta)
        apply_s = time.perf_counter() - t
        during = (sum(counts) - before) / apply_s
        record["deltas"].append({"rows": changed, "bytes": size, "write_s": write_s,
                                 "apply_s": apply_s, "requests_per_s_during": during})  # fmt: skip
    after = rate(opts.window)
    stop.set()
    for t in threads:
        t.join()
    got = np.asarray(model(ids))
    want = np.asarray(jax.jit(fn)({"table": jnp.asarray(table)}, ids))
    record.update(
        rows=opts.rows, dim=opts.dim, batch=opts.batch, threads=opts.threads,
        fraction=opts.fraction, export_s=export_s, requests_per_s_quiet=quiet,
        requests_per_s_after=after, max_abs_error=float(np.abs(got - want).max()),
        apply_median_s=float(np.median([d["apply_s"] for d in record["deltas"]])),
        write_median_s=float(np.median([d["write_s"] for d in record["deltas"]])),
        requests_per_s_during_median=float(
            np.median([d["requests_per_s_during"] for d in record["deltas"]])),
    )  # fmt: skip
    return record


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks serving-delta",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--fraction", type=float, default=0.01)
    p.add_argument("--deltas", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--window", type=float, default=3.0, help="seconds of quiet serving timed")
    p.add_argument("--json")
    opts = p.parse_args(argv)
    record = run(opts)
    summary = {k: v for k, v in record.items() if k != "deltas"}
    for k, v in summary.items():
        print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")
    write_outputs(record, json_path=opts.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
