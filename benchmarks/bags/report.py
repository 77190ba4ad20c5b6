"""`jaxembed bench bags`'s tables and plot (`bags.png`)."""

from __future__ import annotations

import os
from typing import Any

from benchmarks.common.plots import COLORS, GROUP_COLORS, figure, folder, subtitle
from benchmarks.common.report import Table, group_status, group_targets_table
from benchmarks.common.report import fmt_bytes as _bytes
from benchmarks.common.report import fmt_num as _num

__all__ = ["bags_tables", "plot_bags"]


def bags_tables(record: dict[str, Any]) -> list[Table]:
    """`bench bags`: per layout and implementation, bytes and time against XLA."""
    headers = ["layout", "implementation", "exchange", "status", "wire bytes", "x xla",
               "temp", "median ms", "p90 ms", "x xla time"]  # fmt: skip
    rows = []
    for p in record["layouts"]:
        first = True
        for name, r in p["implementations"].items():
            s = p["summary"].get(name, {})
            title = f"{p['layout']} (L̄ {p['mean_bag_length']:.2f})" if first else ""
            rows.append([title, name, r.get("exchange", "-"), group_status(r),
                         _bytes(r.get("effective_wire_bytes")), _num(s.get("wire_ratio_to_xla")),
                         _bytes(r.get("temp_bytes")), _num(r.get("time_median_in_ms")),
                         _num(r.get("time_p90_in_ms")),
                         _num(s.get("time_ratio_to_xla"))])  # fmt: skip
            first = False
    cfg = record["config"]
    title = (f"bags: B={cfg['num_bags']}, {cfg['min_ids']}-{cfg['max_ids']} Zipf({cfg['zipf']}) "
             f"ids per bag, table {cfg['vocab']}x{cfg['hidden']}; step = fwd + bwd + SGD; "
             "bytes of the path this batch took")  # fmt: skip
    return [(title, headers, rows), group_targets_table(record["targets"], "bench bags targets")]


def _bars(ax, groups: list[str], series: dict[str, list[float | None]], ylabel: str) -> None:
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [j - 0.4 + (i + 0.5) * width for j, v in enumerate(values) if v is not None]
        ys = [v for v in values if v is not None]
        ax.bar(xs, ys, width, label=name, color=GROUP_COLORS.get(name, COLORS.get(name)))
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)


def plot_bags(record: dict[str, Any], path: str) -> list[str]:
    """`bench bags`: wire bytes and step time per layout and implementation (bars, log).

    Returns:
      The files written (`bags.png` in the directory `path`).
    """
    points = record["layouts"]
    groups = [p["layout"] for p in points]
    names = list(dict.fromkeys(n for p in points for n in p["implementations"]))
    wire = {n: [p["implementations"].get(n, {}).get("effective_wire_bytes") for p in points]
            for n in names}  # fmt: skip
    times = {n: [p["implementations"].get(n, {}).get("time_median_in_ms") for p in points]
             for n in names}  # fmt: skip
    cfg = record["config"]
    title = (f"bags: B={cfg['num_bags']}, up to {cfg['max_ids']} Zipf ids, table "
             f"{cfg['vocab']}x{cfg['hidden']}: " + subtitle(record))  # fmt: skip
    fig, (a, b) = figure(2, title)
    _bars(a, groups, wire, "wire bytes per device (compiled HLO, path taken)")
    _bars(b, groups, times, "median step time, ms (fwd + bwd + SGD)")
    out = os.path.join(folder(path), "bags.png")
    fig.savefig(out)
    return [out]
