"""Markdown tables and a PNG of a `jaxembed bench planner` record.

`markdown(record)`: the targets (the planner's step against the fastest uniform placement,
the budget), one row per layout with the model beside the measurement (step, memory, wire
bytes), where the time goes (the traced ops by category), and the planner's plan as it
prints. `plot(record, folder)`: `planner.png`, modelled against measured step per layout and
the memory per device against the budget.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["layout_row", "markdown", "plot"]

_MIB = 2**20


def _mib(v: Any) -> str:
    return f"{v / _MIB:.1f}" if isinstance(v, int | float) else "–"


def _mb(v: Any) -> str:
    return f"{v / 1e6:.2f}" if isinstance(v, int | float) else "–"


def _num(v: Any, digits: int = 1) -> str:
    return f"{v:.{digits}f}" if isinstance(v, int | float) else "–"


def _check(rec: dict[str, Any]) -> str:
    if rec.get("status") != "ok":
        return f"{rec.get('status')}: {rec.get('error') or rec.get('reason') or ''}"[:120]
    rel = rec.get("check", {}).get("max_rel_error")
    tail = f" (max rel {rel:.2g})" if isinstance(rel, int | float) else ""
    return ("ok" if rec.get("agrees_with_reference") else "DISAGREES") + tail


def layout_row(name: str, rec: dict[str, Any], budget: int) -> str:
    """One layout as a Markdown table row (see `markdown`'s header).

    Examples:
      >>> rec = {"status": "ok", "agrees_with_reference": True, "check": {"max_rel_error": 2e-5},
      ...        "step_time_median_in_ms": 250.0, "step_time_p90_in_ms": 260.0,
      ...        "step_time_cpu_median_in_ms": 240.0, "forward_time_median_in_ms": 90.0,
      ...        "compiled_peak_bytes": 3 * 2**20, "wire_bytes": 2e6,
      ...        "modelled": {"placement_counts": {"rows": 18}, "calls": [{"exchange": "none"}],
      ...                     "modelled_step_in_ms": 100.0, "modelled_peak_bytes": 2**21,
      ...                     "modelled_wire_bytes": 3e6}}
      >>> cells = layout_row("rows", rec, 2**22).split(" | ")
      >>> cells[:7]
      ['| rows', 'rows 18', 'none', '100.0', '250.0 (260.0)', '240.0', '2.50']
      >>> cells[7:]
      ['90.0', '2.0', '3.0', '4.0', '3.00', '2.00', 'ok (max rel 2e-05) |']
    """
    m = rec.get("modelled", {})
    counts = ", ".join(f"{p} {n}" for p, n in m.get("placement_counts", {}).items())
    exchanges = "/".join(dict.fromkeys(c["exchange"] for c in m.get("calls", []))) or "–"
    wall = rec.get("step_time_median_in_ms")
    model = m.get("modelled_step_in_ms")
    ratio = f"{wall / model:.2f}" if wall and model else "–"
    p90 = rec.get("step_time_p90_in_ms")
    step = f"{_num(wall)} ({_num(p90)})" if wall is not None else "–"
    return (
        f"| {name} | {counts} | {exchanges} | {_num(model)} | {step} | "
        f"{_num(rec.get('step_time_cpu_median_in_ms'))} | {ratio} | "
        f"{_num(rec.get('forward_time_median_in_ms'))} | {_mib(m.get('modelled_peak_bytes'))} | "
        f"{_mib(rec.get('compiled_peak_bytes'))} | {_mib(budget)} | "
        f"{_mb(m.get('modelled_wire_bytes'))} | {_mb(rec.get('wire_bytes'))} | {_check(rec)} |"
    )


def _yes(met: bool) -> str:
    return "met" if met else "missed"


def _load(values: Any) -> str:
    return "/".join(f"{x:.1f}" for x in values) if values else "?"


def _constants(constants: dict[str, Any]) -> str:
    return ", ".join(f"{k} ({v.get('source', '?')})" for k, v in constants.items()) or "?"


def _targets(record: dict[str, Any]) -> list[str]:
    t = record["targets"]
    goal = t["step_goal"]
    budget = record.get("memory_per_device_bytes")
    planner = record["layouts"].get("planner", {})
    m = planner.get("modelled", {})
    lines = [
        "| target | measured | status |", "|---|---|---|",
        f"| planner step <= {goal}x the fastest uniform placement | planner / "
        f"{t['fastest_uniform']} = **{_num(t['step_ratio'], 3)}** (CPU time "
        f"{_num(t['step_ratio_cpu'], 3)}) | {_yes(t['planner_step_within_goal'])} |",
        f"| planner never over budget ({_mib(budget)} MiB per device) | modelled peak "
        f"{_mib(m.get('modelled_peak_bytes'))} MiB, compiled peak "
        f"{_mib(planner.get('compiled_peak_bytes'))} MiB | model: "
        f"{_yes(t['planner_within_budget_modelled'])}, compiled: "
        f"{_yes(t['planner_within_budget_compiled'])} |",
        f"| every layout agrees with the float64 reference | | {_yes(t['all_checks_pass'])} |",
    ]  # fmt: skip
    same = ", ".join(t["same_layout_as"]) or "none"
    lines += [
        "",
        f"The planner's layout is the same as: {same}. Fastest uniform placement within the "
        f"budget (by the model's peak): {t['fastest_uniform_within_budget']} (planner / it = "
        f"{_num(t['step_ratio_within_budget'], 3)}).",
        f"How good is the model: Spearman rank correlation of modelled against measured step "
        f"over the layouts: {t['spearman_wall']} (wall), {t['spearman_cpu']} (process CPU); "
        f"the layout the model prices fastest is the measured fastest: "
        f"{t['model_picks_fastest']}.",
    ]  # fmt: skip
    return lines


def _where(record: dict[str, Any]) -> list[str]:
    lines = []
    for name, rec in record["layouts"].items():
        prof = rec.get("profile") or {}
        shares = prof.get("share_by_category")
        if not shares:
            continue
        parts = ", ".join(f"{k} {v:.0%}" for k, v in list(shares.items())[:7])
        lines.append(f"- **{name}** ({prof['total_in_ms']:.1f} ms of op spans a step, summed "
                     f"over devices): {parts}")  # fmt: skip
    if lines:
        lines = ["Where the time goes (`jax.profiler`, traced ops' self time by category, "
                 "summed over the device threads):", "", *lines]  # fmt: skip
    return lines


def _calls(record: dict[str, Any]) -> list[str]:
    lines = ["| layout | call | ids | exchange | modelled ms (options) | forward bytes | "
             "update bytes |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, rec in record["layouts"].items():
        for c in rec.get("modelled", {}).get("calls", []):
            opts = ", ".join(f"{k} {v:.1f}" for k, v in c["options_in_ms"].items())
            lines.append(
                f"| {name} | {c['stack']} {c['combiner']} | {c['x_shape']} | {c['exchange']} | "
                f"{c['modelled_in_ms']:.1f} ({opts}) | {c['forward_bytes'] / 1e6:.2f} MB | "
                f"{c['update_bytes'] / 1e6:.2f} MB |"
            )
    return lines


def markdown(record: dict[str, Any]) -> str:
    """The record as Markdown: targets, the per-layout table, per-call models, profiles."""
    m = record["machine"]
    cfg = record["config"]["worker"]
    out = [
        f"# jaxembed bench planner{' (quick)' if record['config'].get('quick') else ''}", "",
        f"{m['cpus']} CPUs ({m['platform']}); load average {_load(m.get('loadavg_start'))} at "
        f"the start, {_load(m.get('loadavg_end'))} at the end; {record.get('started')} to "
        f"{record.get('finished')}",
    ]  # fmt: skip
    if record.get("error"):
        return "\n".join([*out, "", f"**The worker failed**: {record['error']}"])
    w = record["workload"]
    budget = record["memory_per_device_bytes"]
    out += [
        "",
        f"Workload `{w['name']}`: batch {w['batch_size']}, {w['num_features']} features over "
        f"{w['num_tables']} tables, {w['total_rows']:,} rows x {w['dim']}; mesh data="
        f"{cfg['devices']} (simulated CPU devices); budget {_mib(budget)} MiB per device; "
        f"row-wise Adagrad; cost constants {_constants(record.get('cost_constants', {}))}"
        f"{' from ' + record['calibration_file'] if record.get('calibration_file') else ''}.",
        "", "## Targets", "", *_targets(record), "", "## Layouts", "",
        "Step: forward + backward + row-sparse update, median of interleaved steps (p90); "
        "memory and wire bytes per device.", "",
        "| layout | placements | exchange | modelled ms | step ms (p90) | CPU ms | measured / "
        "modelled | forward ms | modelled peak MiB | compiled peak MiB | budget MiB | "
        "modelled wire MB | compiled wire MB | check |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(layout_row(n, r, budget) for n, r in record["layouts"].items()),
        "", "### The model's calls", "", *_calls(record), "", *_where(record),
    ]  # fmt: skip
    if record.get("planner_text"):
        out += ["", "### The planner's plan", "", "```", record["planner_text"], "```"]
    return "\n".join(out) + "\n"


def plot(record: dict[str, Any], folder: str) -> list[str]:
    """Writes `planner.png` into `folder` (modelled vs measured step; memory vs budget).

    Raises:
      RuntimeError: matplotlib is not installed.
    """
    try:
        from matplotlib.figure import Figure  # the Agg canvas: no display, no pyplot state
    except ImportError as err:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from err
    os.makedirs(folder, exist_ok=True)
    rows = {n: r for n, r in record["layouts"].items() if r.get("step_time_median_in_ms")}
    names = list(rows)
    fig = Figure(figsize=(12.8, 4.6), dpi=90, layout="constrained")
    ax, mx = fig.subplots(1, 2)
    w = record["workload"]
    devices = record["config"]["worker"]["devices"]
    fig.suptitle(f"jaxembed bench planner: {w['name']}, batch {w['batch_size']}, "
                 f"{devices} simulated devices", fontsize=10)  # fmt: skip
    model = [rows[n]["modelled"]["modelled_step_in_ms"] for n in names]
    wall = [rows[n]["step_time_median_in_ms"] for n in names]
    cpu = [rows[n].get("step_time_cpu_median_in_ms") or 0 for n in names]
    ax.scatter(model, wall, label="wall (median)", zorder=3)
    ax.scatter(model, cpu, marker="x", label="process CPU (median)", zorder=3)
    for n, x, y in zip(names, model, wall, strict=True):
        ax.annotate(f" {n}", (x, y), fontsize=8)
    lo, hi = min(model + wall) * 0.7, max(model + wall) * 1.4
    ax.plot([lo, hi], [lo, hi], color="grey", linestyle="--", label="measured = modelled")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("modelled step (ms)")
    ax.set_ylabel("measured step (ms)")
    ax.set_title(f"step: Spearman {record['targets']['spearman_wall']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    y = list(range(len(names)))
    mx.barh([v - 0.2 for v in y], [rows[n]["modelled"]["modelled_peak_bytes"] / _MIB
                                   for n in names], 0.4, label="modelled peak")  # fmt: skip
    mx.barh([v + 0.2 for v in y], [(rows[n].get("compiled_peak_bytes") or 0) / _MIB
                                   for n in names], 0.4, label="compiled peak")  # fmt: skip
    mx.axvline(record["memory_per_device_bytes"] / _MIB, color="red", linestyle="--",
               label="budget")  # fmt: skip
    mx.set_yticks(y, names, fontsize=8)
    mx.invert_yaxis()
    mx.set_xlabel("memory per device (MiB)")
    mx.legend(fontsize=8)
    path = os.path.join(folder, "planner.png")
    fig.savefig(path)
    return [path]
