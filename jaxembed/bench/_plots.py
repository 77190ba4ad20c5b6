"""PNG plots of a `jaxembed bench` record (matplotlib, no display needed).

`plot_all(record, path)` writes up to four figures: the layouts (wire bytes against the
minimum, time against jaxembed), the vocabulary sweep, the device sweep and the batch sweep.
"""

from __future__ import annotations

import math
import os
from typing import Any

__all__ = ["plot_all"]

_COLORS = {
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

_MARKERS = {"jaxembed": "o", "jaxembed[rows]": "v", "jaxembed[dense]": "^", "xla": "s",
            "flax-nnx": "D", "flax-linen": "x", "onehot": "*", "minimum": "."}  # fmt: skip


def _figure(ncols: int, title: str, width: float = 6.0, height: float = 4.4):
    try:
        from matplotlib.figure import Figure  # the Agg canvas: no display, no pyplot state
    except ImportError as err:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from err
    fig = Figure(figsize=(width * ncols, height), dpi=90, layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    fig.suptitle(title, fontsize=10)
    return fig, axes


def _paths(path: str) -> dict[str, str]:
    names = ("layouts", "vocab", "devices", "batch")
    if path.endswith(".png"):
        stem = path[: -len(".png")]
        return {n: f"{stem}_{n}.png" for n in names}
    return {n: os.path.join(path, f"bench_{n}.png") for n in names}


def _subtitle(record: dict[str, Any]) -> str:
    m = record["machine"]
    return f"{m['device_count']} {m['platform']} devices on {m['cpu_count']} cores, jax {m['jax']}"


def plot_layouts(record: dict[str, Any], path: str) -> None:
    """Wire bytes per device (log) with DESIGN.md's minimum, and time relative to jaxembed."""
    cases = record["cases"]
    labels = [c["layout"] + (f"\n{c['tag']}" if c["tag"] else "") for c in cases]
    impls = list(dict.fromkeys(n for c in cases for n in c["implementations"]))
    ran = [n for n in impls if any("wire_bytes" in c["implementations"].get(n, {}) for c in cases)]
    fig, (ax_bytes, ax_time) = _figure(2, "per layout: " + _subtitle(record), width=8.0,
                                       height=5.6)  # fmt: skip
    width = 0.8 / max(len(ran), 1)
    for i, name in enumerate(ran):
        xs, wires, xt, times = [], [], [], []
        for j, c in enumerate(cases):
            r = c["implementations"].get(name, {})
            x = j - 0.4 + (i + 0.5) * width
            if r.get("wire_bytes") is not None:
                xs.append(x)
                wires.append(max(r["wire_bytes"], 1.0))
            if r.get("time_ratio_to_jaxembed") is not None:
                xt.append(x)
                times.append(r["time_ratio_to_jaxembed"])
        color = _COLORS.get(name)
        ax_bytes.bar(xs, wires, width, label=name, color=color)
        ax_time.bar(xt, times, width, label=name, color=color)
    minimum = [max(c["minimum_wire_bytes"]["total"], 1.0) for c in cases]
    ax_bytes.scatter(range(len(cases)), minimum, marker="_", s=400, color="k", zorder=3,
                     label="minimum (DESIGN.md)")  # fmt: skip
    ax_bytes.set_yscale("log")
    low, high = ax_bytes.get_ylim()
    ax_bytes.set_ylim(low, high * 30)  # room for the legend
    ax_bytes.set_ylabel("wire bytes per device (HLO, ring model)")
    ax_bytes.set_title("communication per step", fontsize=9)
    ax_time.axhline(1.0, color="k", lw=0.8)
    ax_time.set_yscale("log")
    ax_time.set_ylabel("median step time / jaxembed's (log)")
    ax_time.set_title("fwd + bwd + SGD step time, relative to jaxembed", fontsize=9)
    for ax in (ax_bytes, ax_time):
        ax.set_xticks(range(len(cases)), labels, rotation=35, ha="right", fontsize=7)
    ax_bytes.legend(fontsize=7, ncols=4, loc="upper left")
    failed = []
    for name in impls:
        errors = {c["implementations"][name].get("error_type") for c in cases
                  if c["implementations"].get(name, {}).get("status") == "error"}  # fmt: skip
        if errors:
            n = sum(c["implementations"].get(name, {}).get("status") == "error" for c in cases)
            failed.append(f"{name}: {'/'.join(sorted(errors))} on {n} of {len(cases)} layouts")
    if failed:
        fig.text(0.01, 0.005, "raised (no bars): " + "; ".join(failed), fontsize=7)
    fig.savefig(path)


def _line_plot(ax, xs, series: dict[str, list[float | None]], *, ylabel: str, xlabel: str,
               log_x: bool = True, log_y: bool = True) -> None:  # fmt: skip
    for name, ys in series.items():
        pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
        if not pts:
            continue
        base = name.split(" ")[0]
        style = "--" if "minimum" in name else ("-" if "fully" not in name else ":")
        marker = _MARKERS.get(base, "o")
        ax.plot([p[0] for p in pts], [max(p[1], 1e-3) for p in pts], style, marker=marker,
                markersize=5 if base == "jaxembed" else 4, fillstyle="none",
                lw=2.5 if base == "jaxembed" else 1.2, label=name,
                color=_COLORS.get(base, "k"))  # fmt: skip
    if log_x:
        ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def plot_vocab(record: dict[str, Any], path: str) -> None:
    """Bytes and temp memory per device against V (compile only)."""
    points = record["sweeps"]["vocab"]
    xs = [p["vocab"] for p in points]
    impls = list(points[0]["implementations"])
    wire = {n: [p["implementations"][n].get("wire_bytes") for p in points] for n in impls}
    wire = {n: v for n, v in wire.items() if any(x is not None for x in v)}
    wire["minimum (DESIGN.md)"] = [p["minimum_wire_bytes"]["total"] for p in points]
    temp = {n: [p["implementations"][n].get("temp_bytes") for p in points] for n in impls}
    temp = {n: v for n, v in temp.items() if any(x is not None for x in v)}
    ids = "x".join(map(str, points[0]["ids_shape"]))
    fig, (a, b) = _figure(2, f"vocabulary sweep, rows-on-model (2x4), ids {ids}, "
                             f"H={points[0]['hidden']}: " + _subtitle(record))  # fmt: skip
    _line_plot(a, xs, wire, ylabel="wire bytes per device", xlabel="vocabulary V (rows)")
    _line_plot(b, xs, temp, ylabel="temp bytes per device (memory_analysis)",
               xlabel="vocabulary V (rows)")  # fmt: skip
    fig.savefig(path)


def plot_devices(record: dict[str, Any], path: str) -> None:
    """Step time and bytes against the device count at a fixed global batch."""
    points = record["sweeps"]["devices"]
    counts = sorted({math.prod(p["mesh"].values()) for p in points})
    time_s: dict[str, list[float | None]] = {}
    wire_s: dict[str, list[float | None]] = {}
    for p in points:
        n = counts.index(math.prod(p["mesh"].values()))
        for name, r in p["implementations"].items():
            key = f"{name} {p['layout']}"
            time_s.setdefault(key, [None] * len(counts))[n] = r.get("time_median_in_ms")
            wire_s.setdefault(key, [None] * len(counts))[n] = r.get("wire_bytes")
    ids = "x".join(map(str, points[0]["ids_shape"]))
    fig, (a, b) = _figure(2, f"device sweep, 1-D mesh, V={points[0]['vocab']}, ids {ids}: "
                             + _subtitle(record))  # fmt: skip
    _line_plot(a, counts, time_s, ylabel="median step time, ms", xlabel="devices")
    _line_plot(b, counts, wire_s, ylabel="wire bytes per device", xlabel="devices",
               log_y=False)  # fmt: skip
    fig.savefig(path)


def plot_batch(record: dict[str, Any], path: str) -> None:
    """Bytes and time against the batch: where jaxembed's plan switches exchange."""
    points = record["sweeps"]["batch"]
    xs = [p["ids_shape"][0] for p in points]
    impls = list(points[0]["implementations"])
    wire = {n: [p["implementations"][n].get("wire_bytes") for p in points] for n in impls}
    times = {n: [p["implementations"][n].get("time_median_in_ms") for p in points] for n in impls}
    seq = points[0]["ids_shape"][1]
    fig, (a, b) = _figure(2, f"batch sweep, rows-on-model (2x4), V={points[0]['vocab']}, "
                             f"ids Bx{seq}: " + _subtitle(record))  # fmt: skip
    _line_plot(a, xs, wire, ylabel="wire bytes per device", xlabel="batch B")
    _line_plot(b, xs, times, ylabel="median step time, ms", xlabel="batch B")
    switch = [p["ids_shape"][0] for p in points if p["plan"].get("gradient_exchange") == "dense"]
    if switch:
        for ax in (a, b):
            ax.axvline(switch[0], color="k", lw=0.8, ls="--")
            ax.text(switch[0], ax.get_ylim()[1], " plan: dense", va="top", fontsize=7)
    fig.savefig(path)


def plot_all(record: dict[str, Any], path: str) -> list[str]:
    """Writes every plot the record has data for.

    Args:
      record: what `jaxembed.bench.run_bench` returned.
      path: a directory (files `bench_<name>.png`) or a `NAME.png` prefix (`NAME_<name>.png`).

    Returns:
      The paths written.
    """
    paths = _paths(path)
    os.makedirs(os.path.dirname(paths["layouts"]) or ".", exist_ok=True)
    written = []
    plot_layouts(record, paths["layouts"])
    written.append(paths["layouts"])
    for name, fn in (("vocab", plot_vocab), ("devices", plot_devices), ("batch", plot_batch)):
        if record.get("sweeps", {}).get(name):
            fn(record, paths[name])
            written.append(paths[name])
    return written


# --- round 2 -------------------------------------------------------------------------------------

_R2_COLORS = {"sparse": "#1f77b4", "dense": "#9467bd", "xla": "#d62728", "rows": "#17becf",
              "routed": "#1f77b4", "auto": "#2ca02c", "jaxembed": "#1f77b4",
              "jaxembed[rows]": "#17becf", "jaxembed[mod]": "#8c564b", "jaxembed[flat]": "#ff7f0e",
              "jaxembed+optax": "#2ca02c"}  # fmt: skip


def _r2_series(ax, xs, series: dict[str, list[float | None]], *, ylabel: str, xlabel: str,
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
                label=name, color=_R2_COLORS.get(base))  # fmt: skip
    if log_x:
        ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _r2_dir(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path


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
             f"{', '.join(optimizers)}: " + _subtitle(record))  # fmt: skip
    fig, (a, b) = _figure(2, title)
    _r2_series(a, xs, time_s, ylabel="median step time, ms (fwd + bwd + update)",
               xlabel="vocabulary V (rows)")  # fmt: skip
    _r2_series(b, xs, temp_s, ylabel="temp bytes per device (memory_analysis)",
               xlabel="vocabulary V (rows)")  # fmt: skip
    skipped = sorted({f"{n} V={p['vocab']}" for p in points
                      for n, r in p["implementations"].items() if "not_run" in r})  # fmt: skip
    if skipped:
        fig.text(0.01, 0.005, "not run (memory): " + ", ".join(skipped), fontsize=7)
    out = os.path.join(_r2_dir(path), "sparse_vocab.png")
    fig.savefig(out)
    return [out]


def _bars(ax, groups: list[str], series: dict[str, list[float | None]], ylabel: str) -> None:
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [j - 0.4 + (i + 0.5) * width for j, v in enumerate(values) if v is not None]
        ys = [v for v in values if v is not None]
        ax.bar(xs, ys, width, label=name, color=_R2_COLORS.get(name, _COLORS.get(name)))
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
             f"{cfg['vocab']}x{cfg['hidden']}: " + _subtitle(record))  # fmt: skip
    fig, (a, b) = _figure(2, title)
    _bars(a, groups, wire, "wire bytes per device (compiled HLO, path taken)")
    _bars(b, groups, times, "median step time, ms (fwd + bwd + SGD)")
    out = os.path.join(_r2_dir(path), "bags.png")
    fig.savefig(out)
    return [out]


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
                 f"{ids} (dashed: mod rows): " + _subtitle(record))  # fmt: skip
        fig, (a, b) = _figure(2, title)
        _r2_series(a, xs, wire, ylabel="wire bytes per device (path taken)",
                   xlabel="Zipf exponent of the ids (0: uniform)", log_x=False)  # fmt: skip
        _r2_series(b, xs, times, ylabel="median step time, ms (lookup + sparse SGD)",
                   xlabel="Zipf exponent of the ids (0: uniform)", log_x=False)  # fmt: skip
        out = os.path.join(_r2_dir(path), "routed_zipf.png")
        fig.savefig(out)
        written.append(out)
    if record.get("batch_sweep"):
        out = os.path.join(_r2_dir(path), "routed_batch.png")
        plot_batch({"machine": record["machine"], "sweeps": {"batch": record["batch_sweep"]}}, out)
        written.append(out)
    return written
