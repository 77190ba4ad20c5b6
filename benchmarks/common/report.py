"""The one report writer: tables in the terminal (rich when installed) and as Markdown, the
record as JSON, the plots; the machine a record was measured on; the formatting every
benchmark's tables share (each capability's `report.py` builds its own tables with these)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import sys
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "Table", "fmt_bytes", "fmt_num", "group_cells", "group_status", "group_targets_table",
    "json_default", "machine", "markdown_tables", "print_table_list", "progress_bar", "to_json",
    "write", "write_outputs",
]  # fmt: skip

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


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _plain(table: Table) -> str:
    title, headers, rows = table
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


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


# --- variant groups: bench sparse, bags, routed ----------------------------------------------


def group_status(result: dict[str, Any]) -> str:
    if result.get("status") == "error":
        return f"error ({result['stage']}): {result['error_type']}"
    if "not_run" in result:
        return "not run: " + result["not_run"].split(";")[0]
    if result.get("status") == "ok":
        text = "ok" if result.get("agrees_with_reference") else "MISMATCH"
        return text + (" (fell back)" if result.get("fallback") else "")
    return str(result.get("status", "-"))


def group_cells(result: dict[str, Any]) -> list[str]:
    """status, wire bytes, temp, median ms, p90 ms."""
    return [group_status(result), fmt_bytes(result.get("wire_bytes")),
            fmt_bytes(result.get("temp_bytes")), fmt_num(result.get("time_median_in_ms")),
            fmt_num(result.get("time_p90_in_ms"))]  # fmt: skip


def group_targets_table(targets: dict[str, Any], title: str) -> Table:
    """One row per target: what was measured, the threshold and whether it is met."""
    rows = []
    for key, t in targets.items():
        if not isinstance(t, dict) or "met" not in t:
            continue
        if t.get("geomean") is not None or "per_layout" in t:
            value = f"geomean {fmt_num(t.get('geomean'))}"
        elif "value" in t:
            value = fmt_num(t["value"])
        else:
            values = [v for v in t.get("per_case", {}).values() if v is not None]
            value = f"max {fmt_num(max(values))}" if values else "-"
        where = t.get("where", "")
        threshold = t.get("threshold")
        rows.append([key, value, f"<= {threshold}" if threshold is not None else "",
                     "yes" if t["met"] else "NO", where])  # fmt: skip
    rows.append(["all implementations agree with the float64 reference",
                 str(targets.get("all_agree_with_reference")), "", "", ""])  # fmt: skip
    if not targets.get("at_target_shapes", True):
        title += " (quick shapes: indicative only)"
    return title, ["target", "measured", "threshold", "met", "where"], rows


# --- files -----------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """The platform, devices, versions and XLA flags a record was measured with."""
    import flax
    import jax
    import optax

    devices = jax.devices()
    return {
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def json_default(value: Any) -> Any:
    """`json.dumps`'s fallback: tuples and sets as lists, anything else as its text."""
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    return str(value)


def to_json(record: dict[str, Any], *, allow_nan: bool = False) -> str:
    """The record as indented JSON (NaN and infinities refused unless `allow_nan`)."""
    return json.dumps(record, indent=1, allow_nan=allow_nan, default=json_default)


def write(path: str, text: str) -> None:
    """Writes `text` (newline-terminated) to `path`, making its directory."""
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        f.write(text + ("" if text.endswith("\n") else "\n"))


def write_outputs(
    record: dict[str, Any],
    *,
    json_path: str | None = None,
    markdown_path: str | None = None,
    markdown: Callable[[], str] | None = None,
    plot_path: str | None = None,
    plot: Callable[[dict[str, Any], str], list[str]] | None = None,
    allow_nan: bool = False,
) -> None:
    """Writes what a benchmark's flags ask for and says where: `--json` (the record),
    `--markdown` (`markdown()`'s tables) and `--plot` (`plot(record, plot_path)`'s files)."""
    if json_path:
        write(json_path, to_json(record, allow_nan=allow_nan))
        print(f"wrote {json_path}")
    if markdown_path and markdown is not None:
        write(markdown_path, markdown())
        print(f"wrote {markdown_path}")
    if plot_path and plot is not None:
        for path in plot(record, plot_path):
            print(f"wrote {path}")
