"""Markdown tables and PNG plots of a `jaxembed bench recsys` record.

`markdown(record)`: the targets (met / missed, with the ratios), one table per workload (every
implementation: step and forward medians, CPU time, the check, compile time, memory, bytes),
where the time goes (jaxembed's and XLA's traced ops by category, TorchRec's profile) and the
sweep of the largest table. `plot_all(record, folder)`: `recsys_sweep.png` (step time against
the largest table's rows) and `recsys_<workload>.png` (bars per implementation).

Medians of wall time are what the targets use; the process CPU time per step (all threads) is
shown beside them where the machine is shared: other processes stretch wall time, not it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from benchmarks.common.plots import figure

__all__ = ["label", "markdown", "plot_all", "status_text"]


def label(row: dict[str, Any]) -> str:
    """`jaxembed@8` for a JAX implementation on 8 devices, the framework's name otherwise;
    a 1-device step timed inside the 8-device worker is `jaxembed@1 beside @8`.

    Examples:
      >>> label({"implementation": "xla", "devices": 8}), label({"implementation": "torchrec"})
      ('xla@8', 'torchrec')
      >>> label({"implementation": "jaxembed", "devices": 1, "beside": 8})
      'jaxembed@1 beside @8'
    """
    n = row.get("devices")
    if not n:
        return row["implementation"]
    beside = f" beside @{row['beside']}" if row.get("beside") else ""
    return f"{row['implementation']}@{n}{beside}"


def status_text(row: dict[str, Any]) -> str:
    """The check's outcome in a few words.

    Examples:
      >>> status_text({"status": "skipped", "reason": "torch is not installed"})
      'skipped: torch is not installed'
      >>> status_text({"status": "ok", "agrees_with_reference": True,
      ...              "check": {"max_rel_error": 1.2e-06}})
      'ok (max rel 1.2e-06)'
    """
    status = row.get("status", "?")
    if status == "skipped":
        return f"skipped: {row.get('reason', '')}"[:120]
    if status == "not_run":
        return f"not run: {row.get('reason', '')}"
    if status == "error":
        return f"error ({row.get('stage', 'run')}): {row.get('error', '')}"[:160]
    check = row.get("check", {})
    rel = check.get("max_rel_error")
    detail = f" (max rel {rel:.2g})" if isinstance(rel, int | float) else ""
    return ("ok" if row.get("agrees_with_reference") else "DISAGREES") + detail


def _ms(row: dict[str, Any], key: str, p90: bool = False) -> str:
    v = row.get(f"{key}_time_median_in_ms")
    if v is None:
        return "–"
    text = f"{v:.1f}" if v >= 10 else f"{v:.2f}"
    q = row.get(f"{key}_time_p90_in_ms")
    return f"{text} ({q:.1f})" if p90 and q is not None else text


def _baseline(rows: Sequence[dict], row: dict) -> dict | None:
    n = row.get("devices") or 1
    for r in rows:
        if (
            r["implementation"] == "jaxembed"
            and r.get("devices") == n
            and r.get("beside") == row.get("beside")
            and (r.get("step_time_median_in_ms"))
        ):
            return r
    return None


def _workload_table(entry: dict[str, Any]) -> list[str]:
    w = entry["workload"]
    rows = entry["implementations"]
    out = [f"## {w['name']}: batch {w['batch_size']}, {w['num_features']} features over "
           f"{w['num_tables']} tables, {w['total_rows']:,} rows x {w['dim']} "
           f"(largest {w['largest_table_rows']:,}), ~{w['ids_per_step_expected']:,.0f} ids a step",
           "",
           "| implementation | step ms (p90) | step CPU ms | forward ms | step / jaxembed | check "
           "| compile s | temp MiB/dev | wire MB/dev | exchange / notes |",
           "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        base = _baseline(rows, r)
        ratio = "–"
        if base and r.get("step_time_median_in_ms"):
            ratio = f"{r['step_time_median_in_ms'] / base['step_time_median_in_ms']:.2f}x"
        cpu = r.get("step_time_cpu_median_in_ms")
        mem = r.get("memory_per_device_bytes", {}).get("temp")
        wire = r.get("wire_bytes")
        notes = _notes(r)
        cells = [
            label(r), _ms(r, "step", True), f"{cpu:.1f}" if cpu else "–", _ms(r, "forward"),
            ratio, status_text(r), str(r.get("compile_time_in_s", "–")),
            f"{mem / 2**20:.1f}" if mem is not None else "–",
            f"{wire / 1e6:.2f}" if wire is not None else "–", notes,
        ]  # fmt: skip
        out.append("| " + " | ".join(cells) + " |")
    return out


def _notes(r: dict[str, Any]) -> str:
    info = r.get("info", {})
    plan = info.get("plan", {})
    if plan:
        first = next(iter(plan.values()))
        if "update_exchange" in first:
            return (f"exchange={info['exchange']}, impl={info['impl']}; plan: "
                    f"{first['forward_exchange']}/{first['update_exchange']}")  # fmt: skip
    if r.get("threads"):
        return f"{r['threads']} threads" + (f", {r['impl']}" if r.get("impl") else "")
    return ""


def _breakdown(entry: dict[str, Any]) -> list[str]:
    out = []
    for r in entry["implementations"]:
        prof = r.get("profile")
        if not prof or "error" in prof:
            continue
        if "share_by_category" in prof:
            shares = list(prof["share_by_category"].items())[:7]
            cats = ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares)
            out.append(f"- **{label(r)}** ({prof['total_in_ms']:.1f} ms of op spans a step, "
                       f"summed over devices): {cats}")  # fmt: skip
        elif "forward_in_ms" in prof or "backward_update_in_ms" in prof:
            top = list(prof.get("top_ops_self_in_ms", {}).items())[:4]
            ops = ", ".join(f"{k} {v:.1f}" for k, v in top)
            fwd, bwd = prof.get("forward_in_ms", 0), prof.get("backward_update_in_ms", 0)
            out.append(f"- **{label(r)}** (torch.profiler): forward {fwd:.1f} ms, "
                       f"backward+update {bwd:.1f} ms; top ops: {ops}")  # fmt: skip
    head = ("Where the time goes: for the JAX implementations, each category's share of the "
            "traced ops' spans (`jax.profiler`, summed over the device threads, which on "
            "oversubscribed cores include waiting for a core); for TorchRec, torch.profiler's "
            "CPU ms per step.")  # fmt: skip
    return ["", head, "", *out] if out else []


def markdown(record: dict[str, Any]) -> str:
    """The record as Markdown: targets, one table per workload, breakdowns, the sweep."""
    m = record["machine"]
    lines = ["# jaxembed bench recsys", "",
             f"{m['cpus']} CPUs ({m['platform']}); load average {_load(m.get('loadavg_start'))} "
             f"at the start, {_load(m.get('loadavg_end'))} at the end; "
             f"{record.get('started', '')} to {record.get('finished', '')}"
             + f"; glibc malloc {record['config'].get('malloc', 'default')} (`jaxembed.host`)"
             + (" — QUICK: tiny shapes, the times mean nothing" if record["config"]["quick"]
                else ""), "",
             "## Targets", "", "| target | compares | ratio | CPU-time ratio | status |",
             "|---|---|---|---|---|"]  # fmt: skip
    for t in record.get("targets", []):
        ratio = f"{t['ratio']:.3f} (goal <= {t['goal_ratio']})" if "ratio" in t else "–"
        if "ratio_to_the_1_device_process" in t:
            ratio += f"; {t['ratio_to_the_1_device_process']:.3f} to the 1-device process's"
        lines.append(f"| {t['target']} | {t['compares']} | {ratio} | "
                     f"{t.get('cpu_time_ratio', '–')} | {t['status']} |")  # fmt: skip
    for entry in record["workloads"].values():
        lines += ["", *_workload_table(entry), *_breakdown(entry)]
    sweep = record.get("sweep", [])
    if sweep:
        impls = list(dict.fromkeys(r["implementation"] for r in sweep))
        lines += ["", "## Sweep of the largest table of workload (a)", "",
                  "| largest table rows | "
                  + " | ".join(f"{i} step ms (p90)" for i in impls) + " |",
                  "|---" * (len(impls) + 1) + "|"]  # fmt: skip
        for rows in sorted({r["largest_table_rows"] for r in sweep}):
            cells = []
            for i in impls:
                r = next((r for r in sweep if r["largest_table_rows"] == rows
                          and r["implementation"] == i), None)  # fmt: skip
                ok = r and r.get("status") == "ok" and r.get("agrees_with_reference")
                cells.append(_ms(r, "step", True) if ok else status_text(r or {}))
            lines.append(f"| {rows:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _load(values: Any) -> str:
    return "/".join(f"{v:.1f}" for v in values) if values else "?"


# --- plots ----------------------------------------------------------------------------------


def _figure(ncols: int, title: str):
    return figure(ncols, title, width=6.4)


def _null_formatter() -> Any:
    from matplotlib.ticker import NullFormatter

    return NullFormatter()


def _log_axis(axis: Any) -> None:
    """A log scale with plain major labels and no minor ones."""
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    if axis is axis.axes.xaxis:
        axis.axes.set_xscale("log")
    else:
        axis.axes.set_yscale("log")
    axis.set_major_formatter(ScalarFormatter())
    axis.set_minor_formatter(NullFormatter())


def _timed(rows: Sequence[dict]) -> list[dict]:
    return [r for r in rows if r.get("status") == "ok" and r.get("agrees_with_reference")
            and r.get("step_time_median_in_ms")]  # fmt: skip


def plot_all(record: dict[str, Any], folder: str) -> list[str]:
    """Writes the PNGs into `folder`; returns their paths."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    load = _load(record["machine"].get("loadavg_start"))
    for kind, entry in record["workloads"].items():
        rows = _timed(entry["implementations"])
        if not rows:
            continue
        fig, (ax,) = _figure(1, f"{entry['workload']['name']}: one training step "
                                f"({record['machine']['cpus']} CPUs, load {load})")  # fmt: skip
        names = [label(r) for r in rows]
        y = list(range(len(rows)))
        ax.barh([v + 0.2 for v in y], [r["step_time_median_in_ms"] for r in rows], 0.4,
                label="step (forward + backward + update)", color="#1f77b4")  # fmt: skip
        ax.barh([v - 0.2 for v in y], [r.get("forward_time_median_in_ms") or 0 for r in rows],
                0.4, label="forward", color="#ff7f0e")  # fmt: skip
        for v, r in zip(y, rows, strict=True):
            t = r["step_time_median_in_ms"]
            ax.annotate(f" {t:.0f}" if t >= 100 else f" {t:.3g}", (t, v + 0.2), va="center",
                        fontsize=7)  # fmt: skip
        ax.set_yticks(y, names, fontsize=8)
        ax.invert_yaxis()
        _log_axis(ax.xaxis)
        ax.set_xlabel("median time (ms, log)")
        fig.legend(loc="outside lower center", ncols=2, fontsize=8)
        path = os.path.join(folder, f"recsys_{kind}.png")
        fig.savefig(path)
        paths.append(path)
    sweep = _timed(record.get("sweep", []))
    if sweep:
        fig, (ax,) = _figure(1, "workload (a), largest table resized: median step time")
        for impl in dict.fromkeys(r["implementation"] for r in sweep):
            pts = sorted((r["largest_table_rows"], r["step_time_median_in_ms"],
                          r.get("step_time_cpu_median_in_ms"))
                         for r in sweep if r["implementation"] == impl)  # fmt: skip
            name = f"{impl}@{record['config']['sweep_devices']}"
            line = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                           label=f"{name} wall")  # fmt: skip
            cpu = [(p[0], p[2]) for p in pts if p[2]]
            ax.plot([p[0] for p in cpu], [p[1] for p in cpu], marker="x", linestyle="--",
                    color=line[0].get_color(), label=f"{name} process CPU")  # fmt: skip
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(_null_formatter())
        _log_axis(ax.yaxis)
        ax.set_xlabel("rows of the largest table")
        ax.set_ylabel("median step time (ms, log)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        path = os.path.join(folder, "recsys_sweep.png")
        fig.savefig(path)
        paths.append(path)
    return paths
