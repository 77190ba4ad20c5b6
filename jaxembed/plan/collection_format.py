"""A `CollectionPlan` as a table, the TABLES.json format, and `jaxembed plan --tables`.

`str(plan)` prints the planner's statistics in the spirit of TorchRec's: one row per table
(placement, exchange, bytes, modelled time, memory, why), one per `embedding_bag` call, and
one per device (what it holds, the buffers, the peak against the budget).

TABLES.json (see docs/planner.md):

    {"tables":   [{"name": "item", "vocab_size": 1000000, "dim": 64},
                  {"name": "country", "vocab_size": 200, "dim": 16,
                   "placement": "replicated"}],
     "features": [{"name": "clicked", "table": "item", "combiner": "mean", "max_ids": 50},
                  {"name": "country", "table": "country"}]}

Table keys are `TableConfig`'s (`placement` defaults to `"auto"`; `dtype` a name such as
`"bfloat16"`), feature keys `FeatureConfig`'s; without `"features"`, each table gets one
single-id feature of its own name.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxembed.collection.config import FeatureConfig, TableConfig
from jaxembed.plan.format import format_bytes

if TYPE_CHECKING:
    from jaxembed.plan.collection import CollectionPlan

__all__ = ["format_collection_plan", "load_tables_json", "run_plan_tables"]

_MAX_ROWS = 16  # of the per-device table


def format_collection_plan(plan: CollectionPlan) -> str:
    """The plan as a readable table (what `str(plan)` and `jaxembed plan --tables` print)."""
    mesh = " x ".join(f"{n}={s}" for n, s in plan.mesh_axes)
    over = ", ".join(plan.batch_axes) or "no axis"
    lines = [
        f"CollectionPlan  mesh: {mesh}  batch {plan.batch_size} over ({over})  "
        f"backend {plan.backend}",
        f"  modelled step {plan.step_ms:.3f} ms (slowest device); peak memory "
        f"{format_bytes(plan.peak_bytes)} of {format_bytes(plan.memory_per_device)} per device",
        f"  ids: {plan.ids}; {plan.evaluations} layouts priced; "
        f"EmbeddingBagCollection(..., placements=plan, exchange={plan.exchange!r})",
        "",
        f"  {'table':<16} {'rows x dim':>18}  {'placement':<11}{'rows by':<8}{'exchange':<9}"
        f"{'wire/step':>11}{'ms':>9}{'mem/device':>12}  why",
    ]
    for t in plan.tables:
        by = t.row_sharding if t.placement in ("rows", "table_rows") else "-"
        lines.append(
            f"  {t.name:<16} {f'{t.vocab_size} x {t.dim}':>18}  {t.placement:<11}"
            f"{by:<8}{t.exchange:<9}{format_bytes(t.wire_bytes):>11}"
            f"{t.modelled_ms:>9.3f}{format_bytes(t.memory_bytes):>12}  {t.reason}"
        )
    lines += ["", f"  {'call':<48} {'ids':>12} {'bags':>5}  {'exchange':<9}{'forward':>11}"
              f"{'step':>11}{'ms':>9}"]  # fmt: skip
    for c in plan.calls:
        label = f"{c.stack_name} {c.combiner}"
        lines.append(
            f"  {label:<48} {f'{list(c.x_shape)}':>12} {c.num_bags:>5}  {c.exchange:<9}"
            f"{format_bytes(c.forward_bytes):>11}{format_bytes(c.wire_bytes):>11}"
            f"{c.modelled_ms:>9.3f}" + (f"  ({c.note})" if c.note else "")
        )
    lines += ["", f"  {'device':<8}{'tables+state used':>18}{'allocated':>12}{'buffers':>12}"
              f"{'peak':>12}{'update ms':>11}"]  # fmt: skip
    rows: list[list] = []  # devices with the same figures share a row
    for d, (used, update) in enumerate(zip(plan.used_bytes, plan.update_ms, strict=True)):
        if rows and rows[-1][1:] == [used, round(update, 3)]:
            rows[-1][0][1] = d
        else:
            rows.append([[d, d], used, round(update, 3)])
    for (first, last), used, update in rows[:_MAX_ROWS]:
        name = f"{first}" if first == last else f"{first}-{last}"
        lines.append(
            f"  {name:<8}{format_bytes(used):>18}{format_bytes(plan.allocated_bytes):>12}"
            f"{format_bytes(plan.buffer_bytes):>12}{format_bytes(plan.peak_bytes):>12}"
            f"{update:>11.3f}"
        )
    if len(rows) > _MAX_ROWS:
        used = plan.used_bytes
        lines.append(f"  ... {len(rows) - _MAX_ROWS} more rows; used from "
                     f"{format_bytes(min(used))} to {format_bytes(max(used))}")  # fmt: skip
    return "\n".join(lines)


_TABLE_KEYS = {f.name for f in dataclasses.fields(TableConfig)} - {"initializer"}
_FEATURE_KEYS = {f.name for f in dataclasses.fields(FeatureConfig)}


def _required(cls: type) -> list[str]:
    """The fields of a config without a default (in order): the keys every entry needs."""
    return [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]


def _keys_text(cls: type, allowed: set[str]) -> str:
    required = _required(cls)
    optional = [f.name for f in dataclasses.fields(cls) if f.name in allowed - set(required)]
    return f"an entry takes {required} and optionally {optional}"


def _entries(data: Any, key: str, cls: type, allowed: set[str], path: str) -> list[dict]:
    items = data.get(key)
    if not isinstance(items, list) or not all(isinstance(x, dict) for x in items):
        raise ValueError(f"{path}: {key!r} must be a list of objects, got {items!r}")
    for i, x in enumerate(items):
        entry = f"{key}[{i}]" + (f" ({x['name']!r})" if "name" in x else "")
        extra = sorted(set(x) - allowed)
        if extra:
            close = {k: difflib.get_close_matches(k, sorted(allowed), n=1) for k in extra}
            hints = [f"{k!r} -> {m[0]!r}" for k, m in close.items() if m]
            raise ValueError(
                f"{path}: {entry} has unknown keys {extra}: {_keys_text(cls, allowed)}"
                + (f" (did you mean {', '.join(hints)}?)" if hints else "")
            )
        missing = [k for k in _required(cls) if k not in x]
        if missing:
            raise ValueError(
                f"{path}: {entry} is missing the key{'s' if len(missing) > 1 else ''} "
                f"{missing}: {_keys_text(cls, allowed)}, e.g. {_EXAMPLES[key]}"
            )
    return items


_EXAMPLES = {
    "tables": '{"name": "item", "vocab_size": 1000000, "dim": 64}',
    "features": '{"name": "clicked", "table": "item", "combiner": "mean", "max_ids": 50}',
}


def _build(cls: type, x: dict, key: str, i: int, path: str) -> Any:
    """`cls(**x)`, its errors prefixed with the file and the entry (same exception type)."""
    try:
        return cls(**x)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{path}: {key}[{i}] ({x['name']!r}): {e}") from None


def load_tables_json(path: str | Path) -> tuple[list[TableConfig], list[FeatureConfig]]:
    """Reads a TABLES.json: `{"tables": [...], "features": [...]}` (see the module).

    Raises:
      ValueError: unreadable JSON, an entry with unknown keys or without a required one
        (tables need `name`, `vocab_size` and `dim`; features `name` and `table`), or a
        value `TableConfig` or `FeatureConfig` rejects with a ValueError; every message
        names the file and the entry (its index and name).
      TypeError: a value `TableConfig` or `FeatureConfig` rejects with a TypeError (e.g. a
        dtype that is not a float dtype), named likewise.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the tables file {str(path)!r}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected an object with 'tables' and 'features'")
    path = str(path)
    tables = [
        _build(TableConfig, x, "tables", i, path)  # a dtype name: TableConfig reads it
        for i, x in enumerate(_entries(data, "tables", TableConfig, _TABLE_KEYS, path))
    ]
    if "features" in data:
        entries = _entries(data, "features", FeatureConfig, _FEATURE_KEYS, path)
        features = [_build(FeatureConfig, x, "features", i, path) for i, x in enumerate(entries)]
    else:
        features = [FeatureConfig(t.name, t.name) for t in tables]
    return tables, features


def run_plan_tables(args: Any) -> int:
    """`jaxembed plan --tables ...`: plans the collection and prints it (exit code 0, or 2
    with the error on stderr)."""
    from jax.sharding import AbstractMesh, AxisType

    from jaxembed.plan.collection import plan_collection

    names, sizes = args.mesh
    if args.batch is None or args.memory is None:
        print("jaxembed plan: error: --tables needs --batch and --memory", file=sys.stderr)
        return 2
    mesh = AbstractMesh(sizes, names, axis_types=(AxisType.Explicit,) * len(names))
    try:
        tables, features = load_tables_json(args.tables)
        batch_axes = [a for a in args.batch_axes.split(",") if a] if args.batch_axes else None
        plan = plan_collection(
            tables, features, mesh, batch_size=args.batch, memory_per_device=args.memory,
            batch_axes=batch_axes, backend=args.backend,
        )  # fmt: skip
    except (TypeError, ValueError) as e:
        print(f"jaxembed plan: error: {e}", file=sys.stderr)
        return 2
    print(plan)
    return 0
