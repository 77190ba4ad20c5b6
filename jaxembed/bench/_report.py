"""Tables of a `jaxembed bench` record: in the terminal (rich when installed) and as Markdown."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["markdown", "print_tables", "progress_bar", "tables"]

Table = tuple[str, list[str], list[list[str]]]  # title, headers, rows


@contextlib.contextmanager
def progress_bar(total: int, *, enabled: bool = True) -> Iterator[Callable[[str, int], None]]:
    """A progress bar on stderr (rich); yields `tick(description, units)`.

    Without rich, or when disabled, `tick` does nothing.
    """
    try:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )
    except ImportError:
        enabled = False
    if not enabled:
        yield lambda description, units: None
        return
    columns = (TextColumn("{task.description:<32}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, console=Console(stderr=True), transient=False) as progress:
        task = progress.add_task("jaxembed bench", total=total)

        def tick(description: str, units: int) -> None:
            progress.update(task, advance=units, description=description)

        yield tick


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


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
    shapes = "" if targets.get("at_issue_shapes") else " (not the issues' shapes: indicative only)"
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


def _plain(table: Table) -> str:
    title, headers, rows = table
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def print_tables(record: dict[str, Any], file: Any = None) -> None:
    """Prints every table of a record (rich tables when rich is installed)."""
    file = sys.stdout if file is None else file
    machine = record["machine"]
    header = (
        f"jaxembed bench on {machine['device_count']} {machine['platform']} devices, "
        f"{machine['cpu_count']} CPU cores; jax {machine['jax']}, flax {machine['flax']}"
    )
    try:
        from rich.console import Console
        from rich.table import Table as RichTable
    except ImportError:
        print(header, file=file)
        for table in tables(record):
            print("\n" + _plain(table), file=file)
        return
    from rich.markup import escape

    console = Console(file=file, width=max(200, Console(file=file).width))
    console.print(escape(header))
    for title, headers, rows in tables(record):
        t = RichTable(title=escape(title), title_justify="left", show_lines=False)
        for h in headers:
            t.add_column(escape(h), overflow="fold")
        for r in rows:
            t.add_row(*(escape(str(c)) for c in r))
        console.print(t)


def markdown(record: dict[str, Any]) -> str:
    """Every table of a record as Markdown."""
    parts = []
    for title, headers, rows in tables(record):
        parts.append(f"#### {title}\n")
        parts.append("| " + " | ".join(headers) + " |")
        parts.append("|" + "|".join("---" for _ in headers) + "|")
        parts += ["| " + " | ".join(str(c).replace("|", "/") for c in r) + " |" for r in rows]
        parts.append("")
    return "\n".join(parts)
