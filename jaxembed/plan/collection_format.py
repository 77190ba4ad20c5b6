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
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

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


def _entries(data: Any, key: str, allowed: set[str], path: str) -> list[dict]:
    items = data.get(key)
    if not isinstance(items, list) or not all(isinstance(x, dict) for x in items):
        raise ValueError(f"{path}: {key!r} must be a list of objects, got {items!r}")
    for x in items:
        extra = sorted(set(x) - allowed)
        if extra:
            raise ValueError(
                f"{path}: {key} entry {x.get('name', x)!r} has unknown keys {extra}; "
                f"allowed: {sorted(allowed)}"
            )
    return items


def load_tables_json(path: str | Path) -> tuple[list[TableConfig], list[FeatureConfig]]:
    """Reads a TABLES.json: `{"tables": [...], "features": [...]}` (see the module).

    Raises:
      ValueError: unreadable JSON, unknown keys, configs `TableConfig` or `FeatureConfig`
        reject.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the tables file {str(path)!r}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected an object with 'tables' and 'features'")
    tables = []
    for x in _entries(data, "tables", _TABLE_KEYS, str(path)):
        x = dict(x)
        if "dtype" in x:
            x["dtype"] = np.dtype(x["dtype"]) if x["dtype"] != "bfloat16" else _bfloat16()
        tables.append(TableConfig(**x))
    if "features" in data:
        features = [FeatureConfig(**x) for x in _entries(data, "features", _FEATURE_KEYS,
                                                          str(path))]  # fmt: skip
    else:
        features = [FeatureConfig(t.name, t.name) for t in tables]
    return tables, features


def _bfloat16() -> Any:
    import jax.numpy as jnp

    return jnp.bfloat16


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
