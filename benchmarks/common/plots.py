"""What the benchmarks' PNG plots share (matplotlib's Agg canvas: no display, no pyplot state):
the colors of the implementations, a figure with its subtitle, a log-log line series, the
output folder. Each capability's `report.py` draws its own figures with these."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["COLORS", "GROUP_COLORS", "figure", "folder", "group_series", "subtitle"]

COLORS = {
    "jaxembed": "#1f77b4",
    "jaxembed[rows]": "#17becf",
    "jaxembed[dense]": "#9467bd",
    "xla": "#d62728",
    "flax-nnx": "#2ca02c",
    "flax-linen": "#bcbd22",
    "flax-nnx-explicit": "#8c564b",
    "flax-linen-explicit": "#e377c2",
    "onehot": "#ff7f0e",
}


def figure(ncols: int, title: str, width: float = 6.0, height: float = 4.4):
    try:
        from matplotlib.figure import Figure  # the Agg canvas: no display, no pyplot state
    except ImportError as err:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from err
    fig = Figure(figsize=(width * ncols, height), dpi=90, layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    fig.suptitle(title, fontsize=10)
    return fig, axes


def subtitle(record: dict[str, Any]) -> str:
    m = record["machine"]
    return f"{m['device_count']} {m['platform']} devices on {m['cpu_count']} cores, jax {m['jax']}"


# --- variant groups: bench sparse, bags, routed ------------------------------------------------

GROUP_COLORS = {"sparse": "#1f77b4", "dense": "#9467bd", "xla": "#d62728", "rows": "#17becf",
              "routed": "#1f77b4", "auto": "#2ca02c", "jaxembed": "#1f77b4",
              "jaxembed[rows]": "#17becf", "jaxembed[mod]": "#8c564b", "jaxembed[flat]": "#ff7f0e",
              "jaxembed+optax": "#2ca02c"}  # fmt: skip


def group_series(ax, xs, series: dict[str, list[float | None]], *, ylabel: str, xlabel: str,
               log_x: bool = True, log_y: bool = True) -> None:  # fmt: skip
    for name, ys in series.items():
        pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
        if not pts:
            continue
        base = name.split(" ")[0]
        marker = {"rows": "s", "auto": "^", "dense": "D", "xla": "x"}.get(base, "o")
        dashed = "mod" in name or "adagrad" in name
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "--" if dashed else "-",
                marker=marker, markersize=7 if base == "rows" else 4, fillstyle="none",
                label=name, color=GROUP_COLORS.get(base))  # fmt: skip
    if log_x:
        ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def folder(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path
