"""Tables of a `jaxembed bench` record: in the terminal (rich when installed) and as Markdown."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "bags_tables",
    "markdown",
    "markdown_tables",
    "print_table_list",
    "print_tables",
    "progress_bar",
    "routed_tables",
    "sparse_tables",
    "tables",
]

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
    machine = record["machine"]
    header = (
        f"jaxembed bench on {machine['device_count']} {machine['platform']} devices, "
        f"{machine['cpu_count']} CPU cores; jax {machine['jax']}, flax {machine['flax']}"
    )
    print_table_list(header, tables(record), file)


def print_table_list(header: str, table_list: list[Table], file: Any = None) -> None:
    """Prints a header line and tables (rich tables when rich is installed)."""
    file = sys.stdout if file is None else file
    try:
        from rich.console import Console
        from rich.table import Table as RichTable
    except ImportError:
        print(header, file=file)
        for table in table_list:
            print("\n" + _plain(table), file=file)
        return
    from rich.markup import escape

    console = Console(file=file, width=max(200, Console(file=file).width))
    console.print(escape(header))
    for title, headers, rows in table_list:
        t = RichTable(title=escape(title), title_justify="left", show_lines=False)
        for h in headers:
            t.add_column(escape(h), overflow="fold")
        for r in rows:
            t.add_row(*(escape(str(c)) for c in r))
        console.print(t)


def markdown(record: dict[str, Any]) -> str:
    """Every table of a record as Markdown."""
    return markdown_tables(tables(record))


def markdown_tables(table_list: list[Table]) -> str:
    """Tables as Markdown, each under a `####` title."""
    parts = []
    for title, headers, rows in table_list:
        parts.append(f"#### {title}\n")
        parts.append("| " + " | ".join(headers) + " |")
        parts.append("|" + "|".join("---" for _ in headers) + "|")
        parts += ["| " + " | ".join(str(c).replace("|", "/") for c in r) + " |" for r in rows]
        parts.append("")
    return "\n".join(parts)


# --- round 2: bench sparse, bags, routed ------------------------------------------------------


def _r2_status(result: dict[str, Any]) -> str:
    if result.get("status") == "error":
        return f"error ({result['stage']}): {result['error_type']}"
    if "not_run" in result:
        return "not run: " + result["not_run"].split(";")[0]
    if result.get("status") == "ok":
        text = "ok" if result.get("agrees_with_reference") else "MISMATCH"
        return text + (" (fell back)" if result.get("fallback") else "")
    return str(result.get("status", "-"))


def _r2_cells(result: dict[str, Any]) -> list[str]:
    """status, wire bytes, temp, median ms, p90 ms."""
    return [_r2_status(result), _bytes(result.get("wire_bytes")), _bytes(result.get("temp_bytes")),
            _num(result.get("time_median_in_ms")), _num(result.get("time_p90_in_ms"))]  # fmt: skip


def round2_targets_table(targets: dict[str, Any], title: str) -> Table:
    """One row per target: what was measured, the threshold and whether it is met."""
    rows = []
    for key, t in targets.items():
        if not isinstance(t, dict) or "met" not in t:
            continue
        if t.get("geomean") is not None or "per_layout" in t:
            value = f"geomean {_num(t.get('geomean'))}"
        elif "value" in t:
            value = _num(t["value"])
        else:
            values = [v for v in t.get("per_case", {}).values() if v is not None]
            value = f"max {_num(max(values))}" if values else "-"
        where = t.get("where", "")
        threshold = t.get("threshold")
        rows.append([key, value, f"<= {threshold}" if threshold is not None else "",
                     "yes" if t["met"] else "NO", where])  # fmt: skip
    rows.append(["all implementations agree with the float64 reference",
                 str(targets.get("all_agree_with_reference")), "", "", ""])  # fmt: skip
    if not targets.get("at_issue_shapes", True):
        title += " (quick shapes: indicative only)"
    return title, ["target", "measured", "threshold", "met", "where"], rows


def sparse_tables(record: dict[str, Any]) -> list[Table]:
    """`bench sparse`: the vocabulary sweep, the layouts, the targets."""
    headers = ["V", "optimizer", "implementation", "status", "wire bytes", "temp", "median ms",
               "p90 ms", "compile s", "x dense"]  # fmt: skip
    rows = []
    for p in record["vocab_sweep"]:
        dense = p["implementations"].get("dense", {}).get("time_median_in_ms")
        for name, r in p["implementations"].items():
            t = r.get("time_median_in_ms")
            rows.append([str(p["vocab"]), p["optimizer"], name, *_r2_cells(r),
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
                         name, *_r2_cells(r),
                         _num(t / xla if t and xla else None, "{:.3g}")])  # fmt: skip
            first = False
    vocab = record["layouts"][0]["vocab"] if record["layouts"] else "-"
    layouts = (f"layouts at V={vocab}, SGD", headers, rows)
    return [sweep, layouts, round2_targets_table(record["targets"], "bench sparse targets")]


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
            rows.append([title, name, r.get("exchange", "-"), _r2_status(r),
                         _bytes(r.get("effective_wire_bytes")), _num(s.get("wire_ratio_to_xla")),
                         _bytes(r.get("temp_bytes")), _num(r.get("time_median_in_ms")),
                         _num(r.get("time_p90_in_ms")),
                         _num(s.get("time_ratio_to_xla"))])  # fmt: skip
            first = False
    cfg = record["config"]
    title = (f"bags: B={cfg['num_bags']}, {cfg['min_ids']}-{cfg['max_ids']} Zipf({cfg['zipf']}) "
             f"ids per bag, table {cfg['vocab']}x{cfg['hidden']}; step = fwd + bwd + SGD; "
             "bytes of the path this batch took")  # fmt: skip
    return [(title, headers, rows), round2_targets_table(record["targets"], "bench bags targets")]


def routed_tables(record: dict[str, Any]) -> list[Table]:
    """`bench routed`: exchanges per point, the routing's numbers, the batch sweep, targets."""
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
            rows.append([*head, name, r.get("exchange", "-"), _r2_status(r),
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
    out = [main, routing]
    if record.get("batch_sweep"):
        title, headers, rows = batch_table(record["batch_sweep"])
        out.append(("batch sweep (rows-on-model, fwd + bwd + optax SGD): " + title.split(": ")[-1],
                    headers, rows))  # fmt: skip
    out.append(round2_targets_table(record["targets"], "bench routed targets"))
    return out
