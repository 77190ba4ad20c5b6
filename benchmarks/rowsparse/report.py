"""`jaxembed bench sparse`'s tables and plot (`sparse_vocab.png`)."""

from __future__ import annotations

import os
from typing import Any

from benchmarks.common.plots import figure, folder, group_series, subtitle
from benchmarks.common.report import Table, group_cells, group_targets_table
from benchmarks.common.report import fmt_num as _num

__all__ = ["plot_sparse", "sparse_tables"]


def sparse_tables(record: dict[str, Any]) -> list[Table]:
    """`bench sparse`: the vocabulary sweep, the layouts, the targets."""
    headers = ["V", "optimizer", "implementation", "status", "wire bytes", "temp", "median ms",
               "p90 ms", "compile s", "x dense"]  # fmt: skip
    rows = []
    for p in record["vocab_sweep"]:
        dense = p["implementations"].get("dense", {}).get("time_median_in_ms")
        for name, r in p["implementations"].items():
            t = r.get("time_median_in_ms")
            rows.append([str(p["vocab"]), p["optimizer"], name, *group_cells(r),
                         _num(r.get("compile_time_in_s")),
                         _num(t / dense if t and dense else None, "{:.3g}")])  # fmt: skip
    sweep = ("vocabulary sweep, rows-on-model (data=2, model=4): step = fwd + bwd + update",
             headers, rows)  # fmt: skip
    headers = ["layout", "plan exchange", "implementation", "status", "wire bytes", "temp",
               "median ms", "p90 ms", "x xla"]  # fmt: skip
    rows = []
    for p in record["layouts"]:
        xla = p["implementations"].get("xla", {}).get("time_median_in_ms")
        first = True
        for name, r in p["implementations"].items():
            t = r.get("time_median_in_ms")
            rows.append([p["layout"] if first else "", p["plan"]["exchange"] if first else "",
                         name, *group_cells(r),
                         _num(t / xla if t and xla else None, "{:.3g}")])  # fmt: skip
            first = False
    vocab = record["layouts"][0]["vocab"] if record["layouts"] else "-"
    layouts = (f"layouts at V={vocab}, SGD", headers, rows)
    return [sweep, layouts, group_targets_table(record["targets"], "bench sparse targets")]


def plot_sparse(record: dict[str, Any], path: str) -> list[str]:
    """`bench sparse`: step time and temp memory against V, sparse vs dense, per optimizer.

    Returns:
      The files written (`sparse_vocab.png` in the directory `path`).
    """
    points = record["vocab_sweep"]
    optimizers = list(dict.fromkeys(p["optimizer"] for p in points))
    xs = sorted({p["vocab"] for p in points})
    time_s: dict[str, list[float | None]] = {}
    temp_s: dict[str, list[float | None]] = {}
    for p in points:
        for name, r in p["implementations"].items():
            optimizer = p["optimizer"]
            if name != "sparse" and optimizer != "sgd":
                optimizer = "optax.adagrad"  # the dense step's element-wise formula
            key = f"{name} {optimizer}"
            i = xs.index(p["vocab"])
            time_s.setdefault(key, [None] * len(xs))[i] = r.get("time_median_in_ms")
            temp_s.setdefault(key, [None] * len(xs))[i] = r.get("temp_bytes")
    ids = "x".join(map(str, points[0]["ids_shape"])) if points else "-"
    title = (f"row-sparse vs dense step, rows-on-model (2x4), ids {ids}, optimizers "
             f"{', '.join(optimizers)}: " + subtitle(record))  # fmt: skip
    fig, (a, b) = figure(2, title)
    group_series(a, xs, time_s, ylabel="median step time, ms (fwd + bwd + update)",
               xlabel="vocabulary V (rows)")  # fmt: skip
    group_series(b, xs, temp_s, ylabel="temp bytes per device (memory_analysis)",
               xlabel="vocabulary V (rows)")  # fmt: skip
    skipped = sorted({f"{n} V={p['vocab']}" for p in points
                      for n, r in p["implementations"].items() if "not_run" in r})  # fmt: skip
    if skipped:
        fig.text(0.01, 0.005, "not run (memory): " + ", ".join(skipped), fontsize=7)
    out = os.path.join(folder(path), "sparse_vocab.png")
    fig.savefig(out)
    return [out]
