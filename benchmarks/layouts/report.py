"""The layouts benchmark's tables (terminal and Markdown) and PNG plots (matplotlib, no display).

`tables(record)` lists the tables: per case, the summary, the targets and the three sweeps;
`plot_all(record, path)` writes up to four figures: the layouts (wire bytes against the
minimum, time against jaxembed), the vocabulary sweep, the device sweep and the batch sweep.
"""

from __future__ import annotations

import math
import os
from typing import Any

from benchmarks.common.plots import COLORS, figure, subtitle
from benchmarks.common.report import Table, markdown_tables, print_table_list
from benchmarks.common.report import fmt_bytes as _bytes
from benchmarks.common.report import fmt_num as _num

__all__ = ["batch_table", "markdown", "plot_all", "plot_batch", "print_tables", "tables"]


def _largest(result: dict[str, Any]) -> str:
    c = result.get("largest_collective")
    if not c:
        return "none"
    axes = ",".join(c["mesh_axes"]) or "-"
    return f"{c['kind']} {axes} {c['shape']} ({_bytes(c['result_bytes'])})"


def _status(result: dict[str, Any]) -> str:
    if result["status"] == "error":
        return f"error ({result['stage']}): {result['error_type']}"
    if "not_run" in result:
        return "compiled, not run"
    if result["status"] == "ok":
        return "ok" if result.get("agrees_with_reference") else "MISMATCH"
    return result["status"]


def _case_title(case: dict[str, Any]) -> str:
    """`rows-on-model V=65536 ids 16x128`, plus the tag (e.g. `dense-regime`)."""
    ids = "x".join(map(str, case["ids_shape"]))
    tag = f" {case['tag']}" if case["tag"] else ""
    return f"{case['layout']}{tag} V={case['vocab']} ids {ids}"


def case_table(cases: list[dict[str, Any]], title: str) -> Table:
    """One row per (case, implementation)."""
    headers = ["case", "implementation", "status", "wire bytes", "x minimum", "largest collective",
               "temp", "args", "compile s", "median ms", "p90 ms", "x jaxembed"]  # fmt: skip
    rows = []
    for case in cases:
        minimum = case["minimum_wire_bytes"]["total"]
        first = True
        for name, r in case["implementations"].items():
            wire = r.get("wire_bytes")
            ratio = (wire / minimum if minimum else None) if wire is not None else None
            rows.append([
                _case_title(case) if first else "", name, _status(r), _bytes(wire),
                _num(ratio), _largest(r) if "wire_bytes" in r else "-",
                _bytes(r.get("temp_bytes")), _bytes(r.get("argument_bytes")),
                _num(r.get("compile_time_in_s")), _num(r.get("time_median_in_ms")),
                _num(r.get("time_p90_in_ms")), _num(r.get("time_ratio_to_jaxembed")),
            ])  # fmt: skip
            first = False
        floor = case.get("update_floor", {}).get("time_median_in_ms")
        rows.append(["", "(minimum, DESIGN.md)", case["minimum_wire_bytes"]["exchange"],
                     _bytes(minimum), "1.00", "", "", "", "", _num(floor), "", ""])  # fmt: skip
    return title, headers, rows


def summary_table(cases: list[dict[str, Any]]) -> Table:
    """Per case: jaxembed's bytes against the minimum and XLA, its time against the rest."""
    headers = ["case", "minimum", "jaxembed", "x minimum", "xla", "jaxembed / xla bytes",
               "plan exchange", "time / xla", "best alternative", "time / best",
               "update floor ms"]  # fmt: skip
    rows = []
    for case in cases:
        s = case["summary"]
        xla = case["implementations"].get("xla", {})
        rows.append([
            _case_title(case), _bytes(case["minimum_wire_bytes"]["total"]),
            _bytes(s.get("jaxembed_wire_bytes")), _num(s.get("jaxembed_wire_ratio_to_minimum")),
            _bytes(xla.get("wire_bytes")), _num(s.get("jaxembed_wire_ratio_to_xla")),
            case["plan"].get("gradient_exchange", "-"), _num(s.get("jaxembed_time_ratio_to_xla")),
            s.get("best_alternative", "-"), _num(s.get("jaxembed_time_ratio_to_best_alternative")),
            _num(case.get("update_floor", {}).get("time_median_in_ms")),
        ])  # fmt: skip
    return "jaxembed per case", headers, rows


def targets_table(targets: dict[str, Any]) -> Table:
    headers = ["target", "measured", "threshold", "met"]
    rows = []
    for key, t in targets.items():
        if not isinstance(t, dict):
            continue
        if "geomean" in t:
            value = f"geomean {_num(t['geomean'])}"
        elif "value" in t:
            value = _num(t["value"])
        else:
            values = list(t.get("per_layout", t.get("per_case", {})).values())
            value = f"max {_num(max(values))}" if values else "-"
        rows.append([key, value, f"<= {t['threshold']}", "yes" if t["met"] else "NO"])
    rows.append(["all implementations agree with the dense reference",
                 str(targets.get("all_agree_with_reference")), "", ""])  # fmt: skip
    shapes = (
        "" if targets.get("at_target_shapes") else " (not the targets' shapes: indicative only)"
    )
    return f"targets at V={targets.get('vocab')}{shapes}", headers, rows


def vocab_table(points: list[dict[str, Any]]) -> Table:
    impls = list(points[0]["implementations"]) if points else []
    headers = ["V", "minimum"] + [f"{n} wire / temp" for n in impls]
    rows = []
    for p in points:
        cells = []
        for n in impls:
            r = p["implementations"][n]
            if "wire_bytes" not in r:
                cells.append(r.get("error_type", r["status"]))
            else:
                cells.append(f"{_bytes(r['wire_bytes'])} / {_bytes(r['temp_bytes'])}")
        rows.append([str(p["vocab"]), _bytes(p["minimum_wire_bytes"]["total"]), *cells])
    return "vocabulary sweep (rows-on-model, compile only): bytes per device", headers, rows


def _sweep_rows(points, key_fn) -> list[list[str]]:
    rows = []
    for p in points:
        for n, r in p["implementations"].items():
            rows.append([*key_fn(p), n, _bytes(r.get("wire_bytes")), _bytes(r.get("temp_bytes")),
                         _num(r.get("time_median_in_ms")), _num(r.get("time_ratio_to_jaxembed")),
                         _status(r)])  # fmt: skip
    return rows


def device_table(points: list[dict[str, Any]]) -> Table:
    headers = ["devices", "layout", "implementation", "wire bytes", "temp", "median ms",
               "x jaxembed", "status"]  # fmt: skip
    rows = _sweep_rows(points, lambda p: [str(_devices(p)), p["layout"]])
    return "device sweep (1-D mesh, fixed global batch)", headers, rows


def _devices(point: dict[str, Any]) -> int:
    n = 1
    for size in point["mesh"].values():
        n *= size
    return n


def batch_table(points: list[dict[str, Any]]) -> Table:
    headers = ["ids", "plan exchange", "implementation", "wire bytes", "temp", "median ms",
               "x jaxembed", "status"]  # fmt: skip
    rows = _sweep_rows(
        points,
        lambda p: ["x".join(map(str, p["ids_shape"])), p["plan"].get("gradient_exchange", "-")],
    )
    return "batch sweep (rows-on-model): where the plan switches exchange", headers, rows


def tables(record: dict[str, Any]) -> list[Table]:
    """Every table of a record, in the order they are printed."""
    cases = record["cases"]
    out = [case_table(cases, "layouts: every implementation"), summary_table(cases)]
    if record.get("targets"):
        out.append(targets_table(record["targets"]))
    sweeps = record.get("sweeps", {})
    if sweeps.get("vocab"):
        out.append(vocab_table(sweeps["vocab"]))
    if sweeps.get("devices"):
        out.append(device_table(sweeps["devices"]))
    if sweeps.get("batch"):
        out.append(batch_table(sweeps["batch"]))
    return out


def print_tables(record: dict[str, Any], file: Any = None) -> None:
    """Prints every table of a record (rich tables when rich is installed)."""
    machine = record["machine"]
    header = (
        f"jaxembed bench on {machine['device_count']} {machine['platform']} devices, "
        f"{machine['cpu_count']} CPU cores; jax {machine['jax']}, flax {machine['flax']}"
    )
    print_table_list(header, tables(record), file)


def markdown(record: dict[str, Any]) -> str:
    """Every table of a record as Markdown."""
    return markdown_tables(tables(record))


_MARKERS = {"jaxembed": "o", "jaxembed[rows]": "v", "jaxembed[dense]": "^", "xla": "s",
            "flax-nnx": "D", "flax-linen": "x", "onehot": "*", "minimum": "."}  # fmt: skip


def _paths(path: str) -> dict[str, str]:
    names = ("layouts", "vocab", "devices", "batch")
    if path.endswith(".png"):
        stem = path[: -len(".png")]
        return {n: f"{stem}_{n}.png" for n in names}
    return {n: os.path.join(path, f"bench_{n}.png") for n in names}


def plot_layouts(record: dict[str, Any], path: str) -> None:
    """Wire bytes per device (log) with DESIGN.md's minimum, and time relative to jaxembed."""
    cases = record["cases"]
    labels = [c["layout"] + (f"\n{c['tag']}" if c["tag"] else "") for c in cases]
    impls = list(dict.fromkeys(n for c in cases for n in c["implementations"]))
    ran = [n for n in impls if any("wire_bytes" in c["implementations"].get(n, {}) for c in cases)]
    fig, (ax_bytes, ax_time) = figure(2, "per layout: " + subtitle(record), width=8.0,
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
        color = COLORS.get(name)
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
                color=COLORS.get(base, "k"))  # fmt: skip
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
    fig, (a, b) = figure(2, f"vocabulary sweep, rows-on-model (2x4), ids {ids}, "
                             f"H={points[0]['hidden']}: " + subtitle(record))  # fmt: skip
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
    fig, (a, b) = figure(2, f"device sweep, 1-D mesh, V={points[0]['vocab']}, ids {ids}: "
                             + subtitle(record))  # fmt: skip
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
    fig, (a, b) = figure(2, f"batch sweep, rows-on-model (2x4), V={points[0]['vocab']}, "
                             f"ids Bx{seq}: " + subtitle(record))  # fmt: skip
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
      record: what `benchmarks.layouts.bench.run_bench` returned.
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
