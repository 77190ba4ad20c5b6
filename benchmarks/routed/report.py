"""`jaxembed bench routed`'s tables and plots (`routed_zipf.png`, `routed_batch.png`)."""

from __future__ import annotations

import os
from typing import Any

from benchmarks.common.plots import figure, folder, group_series, subtitle
from benchmarks.common.report import Table, group_status, group_targets_table
from benchmarks.common.report import fmt_bytes as _bytes
from benchmarks.common.report import fmt_num as _num
from benchmarks.layouts.report import batch_table, plot_batch
from benchmarks.routed.bucketing import bucketing_table

__all__ = ["plot_routed", "routed_tables"]


def routed_tables(record: dict[str, Any]) -> list[Table]:
    """`bench routed`: exchanges per point, the routing's numbers, the batch sweep, the
    bucketing (native vs XLA), targets."""
    headers = ["layout", "rows", "zipf", "exchange", "plan", "status", "wire bytes", "x rows",
               "fallback rate", "median ms", "p90 ms", "x rows time"]  # fmt: skip
    rows = []
    for p in record["points"]:
        s = p["summary"]
        first = True
        for name, r in p["implementations"].items():
            wire_x = s.get(f"{name}_wire_ratio_to_rows") if name != "rows" else 1.0
            time_x = s.get(f"{name}_time_ratio_to_rows") if name != "rows" else 1.0
            head = [p["layout"], p["row_sharding"], f"{p['zipf']:g}"] if first else ["", "", ""]
            rows.append([*head, name, r.get("exchange", "-"), group_status(r),
                         _bytes(r.get("effective_wire_bytes")), _num(wire_x),
                         _num(r.get("fallback_rate")), _num(r.get("time_median_in_ms")),
                         _num(r.get("time_p90_in_ms")), _num(time_x)])  # fmt: skip
            first = False
    cfg = record["config"]
    ids = "x".join(map(str, cfg["ids_shape"]))
    main = (f"routed vs gather path: V={cfg['vocab']}, H={cfg['hidden']}, ids {ids}; step = "
            "lookup + row-sparse SGD; bytes of the path the batch took", headers, rows)  # fmt: skip
    headers = ["layout", "rows", "zipf", "distinct ids", "busiest bucket", "capacity C",
               "overflows", "rows looked up n_S·C", "G/n_S", "ratio"]  # fmt: skip
    rows = []
    for p in record["points"]:
        r = p.get("routing")
        if not r:
            continue
        rows.append([p["layout"], p["row_sharding"], f"{p['zipf']:g}", str(p["distinct_ids"]),
                     str(r["max_bucket_distinct_ids"]), str(r["capacity"]), str(r["overflows"]),
                     str(r["rows_looked_up"]), f"{r['ids_per_owner']:.0f}",
                     _num(r["rows_looked_up_ratio"])])  # fmt: skip
    routing = ("the routed exchange's buckets (per device and owner, this batch)", headers, rows)
    out = [main, routing] if record["points"] else []
    if record.get("batch_sweep"):
        title, headers, rows = batch_table(record["batch_sweep"])
        out.append(("batch sweep (rows-on-model, fwd + bwd + optax SGD): " + title.split(": ")[-1],
                    headers, rows))  # fmt: skip
    if record.get("bucketing"):
        out.append(bucketing_table(record["bucketing"]))
    out.append(group_targets_table(record["targets"], "bench routed targets"))
    return out


def plot_routed(record: dict[str, Any], path: str) -> list[str]:
    """`bench routed`: bytes and time against the Zipf exponent per exchange and row sharding
    (the first layout), and the batch sweep.

    Returns:
      The files written (`routed_zipf.png`, `routed_batch.png` in the directory `path`).
    """
    written = []
    points = record["points"]
    layout = points[0]["layout"] if points else None
    mine = [p for p in points if p["layout"] == layout]
    xs = sorted({p["zipf"] for p in mine})
    wire: dict[str, list[float | None]] = {}
    times: dict[str, list[float | None]] = {}
    for p in mine:
        for name, r in p["implementations"].items():
            key = f"{name} {p['row_sharding']}"
            i = xs.index(p["zipf"])
            wire.setdefault(key, [None] * len(xs))[i] = r.get("effective_wire_bytes")
            times.setdefault(key, [None] * len(xs))[i] = r.get("time_median_in_ms")
    if mine:
        cfg = record["config"]
        ids = "x".join(map(str, cfg["ids_shape"]))
        title = (f"routed vs gather path on {layout}, V={cfg['vocab']}, H={cfg['hidden']}, ids "
                 f"{ids} (dashed: mod rows): " + subtitle(record))  # fmt: skip
        fig, (a, b) = figure(2, title)
        group_series(a, xs, wire, ylabel="wire bytes per device (path taken)",
                   xlabel="Zipf exponent of the ids (0: uniform)", log_x=False)  # fmt: skip
        group_series(b, xs, times, ylabel="median step time, ms (lookup + sparse SGD)",
                   xlabel="Zipf exponent of the ids (0: uniform)", log_x=False)  # fmt: skip
        out = os.path.join(folder(path), "routed_zipf.png")
        fig.savefig(out)
        written.append(out)
    if record.get("batch_sweep"):
        out = os.path.join(folder(path), "routed_batch.png")
        plot_batch({"machine": record["machine"], "sweeps": {"batch": record["batch_sweep"]}}, out)
        written.append(out)
    return written
