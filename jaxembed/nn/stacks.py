"""A collection's stacks for the Flax modules: built from tables, read back, and planned.

Shared by `jaxembed.nn.nnx_collection` and `jaxembed.nn.linen_collection`:

* `build_stack`, `place`: the physical stack holding its tables' rows, put in its layout;
* `unstack`: each table back in id order (for export and checks);
* `export_states`, `import_states`: optimizer states per table in id order, and back;
* `concat_features`: the pooled outputs side by side;
* `quantize_stacks`: the stacks quantized row-wise for serving (per-table precisions);
* `auto_plan`, `planned`: `placements="auto"` planned now, a `jaxembed.plan_collection`
  result's tables and exchanges applied.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxembed.collection.checks import check_array
from jaxembed.collection.config import TableConfig
from jaxembed.collection.layout import CollectionLayout, Stack
from jaxembed.kernels.arrays import is_explicit
from jaxembed.kernels.tables import is_quantized
from jaxembed.plan.collection import plan_collection
from jaxembed.quant import RowError, dequantize, quantize
from jaxembed.quant.format import table_precisions, values_per_byte

__all__ = [
    "auto_plan",
    "build_stack",
    "check_trainable",
    "concat_features",
    "export_states",
    "import_states",
    "place",
    "planned",
    "quantize_stacks",
    "unstack",
]


def build_stack(
    layout: CollectionLayout,
    stack: Stack,
    values: Mapping[str, jax.Array],
    *,
    per_row: bool = False,
    dtype: Any = None,
):
    """The physical stack holding `values[name]` (each `[V, dim]` in id order, or `[V]` with
    `per_row`, a one-per-row optimizer state) in its rows.

    Args:
      layout, stack: the collection's layout and the stack to build.
      values: every table of the stack, by name (numpy, jax or traced).
      per_row: the values are one per row, `[V]` (f32 unless `dtype` says otherwise).
      dtype: the stack's dtype; default the tables' (f32 for `per_row`).

    Raises:
      ValueError: a table missing from `values`, or one whose shape is not exactly `[V, dim]`
        (`[V]`): it would be broadcast over every row (`jaxembed.collection.checks`).
    """
    shape = stack.shape[:1] if per_row else stack.shape
    if dtype is None:
        dtype = jnp.float32 if per_row else stack.dtype
    missing = [n for n in stack.tables if n not in values]
    if missing:
        raise ValueError(f"build_stack: no values for tables {missing} of stack {stack.name}")
    for name in stack.tables:
        p = layout.placement(name)
        want = (p.vocab_size,) if per_row else (p.vocab_size, p.dim)
        check_array(
            f"build_stack: table {name!r}", values[name], want, dtype,
            target=f"table {name!r} ({'one value per row' if per_row else '[vocab_size, dim]'})",
            fix="a table's values are in id order, one row per id (an initializer must return "
            "the shape it is given)",
        )  # fmt: skip
    concrete = not any(isinstance(values[n], jax.core.Tracer) for n in stack.tables)
    # Concrete values are stacked on the host (numpy, one buffer), not by an op per table on
    # arrays that a mesh context may replicate on every device.
    out = np.zeros(shape, dtype) if concrete else jnp.zeros(shape, dtype)
    for name in stack.tables:
        p = layout.placement(name)
        rows = p.stack_ids(np.arange(p.vocab_size, dtype=np.int32), stack.local_rows)
        if concrete:
            out[rows] = np.asarray(values[name], dtype)
        else:
            out = out.at[rows].set(jnp.asarray(values[name], dtype))
    return out


def place(array: Any, mesh: Any, spec: P) -> Any:
    """A host-built stack put straight into its layout on the mesh (a traced one as is)."""
    if not isinstance(array, np.ndarray):
        return array
    if isinstance(mesh, jax.sharding.AbstractMesh):
        concrete = jax.sharding.get_mesh()
        mesh = concrete if getattr(concrete, "axis_names", None) == mesh.axis_names else None
    if not isinstance(mesh, jax.sharding.Mesh) or mesh.empty:
        return jnp.asarray(array)
    return jax.device_put(array, NamedSharding(mesh, spec))


def unstack(layout: CollectionLayout, stacks: Mapping[int, jax.Array]) -> dict[str, jax.Array]:
    """Each table in id order, `[V, dim]` (or `[V]` for one-per-row state), read out of the
    stacks (a gather: for export)."""
    out = {}
    for s in layout.stacks:
        if s.index not in stacks:
            continue
        for name in s.tables:
            p = layout.placement(name)
            rows = p.stack_ids(np.arange(p.vocab_size, dtype=np.int32), s.local_rows)
            array = stacks[s.index]
            if is_quantized(array):  # a serving copy: its rows as the lookups read them
                array = dequantize(array)
            if isinstance(array, np.ndarray):
                out[name] = array[rows]
                continue
            sharding = jax.typeof(array).sharding
            if is_explicit(getattr(sharding, "mesh", None)):
                spec = P(None, s.spec[1]) if array.ndim == 2 else P(None)
                value = array.at[rows].get(out_sharding=NamedSharding(sharding.mesh, spec))
            else:
                value = jnp.take(array, rows, axis=0)
            if not isinstance(value, jax.core.Tracer):
                # One eager gather at a time: many collective programs in flight at once
                # can starve XLA:CPU's rendezvous (it aborts after 40 s).
                value = jax.block_until_ready(value)
            out[name] = value
    return out


def _stack_precisions(layout: CollectionLayout, precision: Any) -> dict[int, str | None]:
    """Each stack's precision (None: kept float) from one precision or `{table: precision}`."""
    try:
        per_table = table_precisions(precision, [t for s in layout.stacks for t in s.tables])
    except ValueError as e:
        raise ValueError(f"quantized: {e}") from None
    out = {}
    for s in layout.stacks:
        wanted = {per_table[t] for t in s.tables}
        if len(wanted) > 1:
            given = {t: per_table[t] for t in s.tables}
            raise ValueError(
                f"quantized: stack {s.name!r} holds tables {list(s.tables)}, one array, so they "
                f"share a precision; got {given}. Give them one precision, or place them apart "
                "(another placement or dim puts a table in a stack of its own)"
            )
        out[s.index] = wanted.pop()
    return out


def quantize_stacks(
    layout: CollectionLayout, stacks: Mapping[int, Any], precision: Any, **options: Any
) -> dict[int, Any]:
    """The stacks quantized row-wise (`jaxembed.quantize`) for serving, each in its layout.

    Row-wise quantization reads each row alone, so a stack quantized whole is its tables
    quantized one by one and stacked. Every stack's dim is checked before any is quantized;
    called eagerly, a row holding NaN or ±inf is refused, named by its table and its row in
    that table (under `jit` it reads NaN, as `jaxembed.quantize`'s).

    Args:
      layout: the collection's layout.
      stacks: each stack's float array, by stack index.
      precision: `"int8"`, `"int4"`, `"int2"` or `"fp8"` for every table, or
        `{table: precision}` (a table left out, or mapped to None, stays float: small tables
        cost little and read fastest as floats). The tables of one stack share a precision.
      **options: `jaxembed.quantize`'s keywords (`search`, `scale_dtype`, fp8's format).

    Returns:
      `{stack index: QuantizedTable or the float stack}`, laid out as the stacks were.

    Raises:
      ValueError: an unknown precision or table, tables of one stack given different
        precisions, a dim the precision cannot pack (over the stack's column shards), the
        tables named; a row holding NaN or ±inf, or one fp16 scale and bias cannot hold,
        named by table, row and value.
    """
    precisions = _stack_precisions(layout, precision)
    for s in layout.stacks:
        if precisions[s.index] is not None and not is_quantized(stacks[s.index]):
            _check_packs(layout, s, precisions[s.index])
    out = {}
    for s in layout.stacks:
        array = stacks[s.index]
        if precisions[s.index] is None or is_quantized(array):
            out[s.index] = array
            continue
        try:
            q = quantize(array, precisions[s.index], **options)
        except RowError as e:
            raise ValueError(f"quantized: {_row_name(layout, s, e.row)} {e.detail}") from None
        sharding = getattr(array, "sharding", None)
        if isinstance(sharding, NamedSharding) and not isinstance(array, jax.core.Tracer):
            q = jax.device_put(q, q.shardings(sharding.mesh, s.spec))
        out[s.index] = q
    return out


def _check_packs(layout: CollectionLayout, stack: Stack, precision: str) -> None:
    """Raises, naming the stack's tables, unless `precision` packs each of its column shards'
    values into whole bytes (without a column split: the dim)."""
    sizes = dict(layout.mesh_axes)
    shards = math.prod(sizes[a] for a in stack.hidden_axes)
    n = values_per_byte(precision)
    if stack.dim % (n * shards) == 0:
        return
    tables, step = list(stack.tables), n * shards
    them = "them" if len(tables) > 1 else "it"
    per_shard = stack.dim // shards
    split = (
        f", split over {shards} column shards of mesh axes {stack.hidden_axes}: {per_shard} "
        f"value{'s' if per_shard > 1 else ''} a shard"
        if shards > 1
        else ""
    )
    want = "an even dim" if step == 2 else f"a dim that is a multiple of {step}"
    example = tables[0]
    raise ValueError(
        f"quantized: {precision} packs {n} values a byte, so it cannot pack the rows of "
        f"{'tables' if len(tables) > 1 else 'table'} {', '.join(map(repr, tables))} (dim "
        f"{stack.dim}{split}): give {them} {want} (TableConfig({example!r}, ..., "
        f"dim={-(-stack.dim // step) * step})), quantize {them} to 'int8' or 'fp8', which pack "
        f"any dim ({{{example!r}: 'int8'}}), or keep {them} float ({{{example!r}: None}})"
    )


def _row_name(layout: CollectionLayout, stack: Stack, row: int) -> str:
    """A stack row as its table's row: "row 27 of table 'b' (row 67 of stack ...)"."""
    for name in stack.tables:
        p = layout.placement(name)
        ids = np.flatnonzero(p.stack_ids(np.arange(p.vocab_size), stack.local_rows) == row)
        if ids.size:
            return f"row {int(ids[0])} of table {name!r} (row {row} of stack {stack.name!r})"
    return f"row {row} of stack {stack.name!r} (a padding row, of no table)"


def check_trainable(layout: CollectionLayout, stacks: Mapping[int, Any], fix: str) -> None:
    """Raises, naming the tables, if any stack is quantized (a serving copy's): quantized
    tables are inference-only, so they take no optimizer state or update.

    Args:
      layout: the collection's layout.
      stacks: each stack's array, by stack index.
      fix: the call that trains the float collection instead (the message's end).

    Raises:
      TypeError: a quantized stack; its tables named.
    """
    quantized = [t for s in layout.stacks if is_quantized(stacks[s.index]) for t in s.tables]
    if quantized:
        raise TypeError(
            f"tables {quantized} of this collection are quantized (a serving copy from "
            f"quantized(...)): quantized tables are inference-only and take no optimizer. {fix}"
        )


def concat_features(layout: CollectionLayout, outputs: Mapping[str, jax.Array]) -> jax.Array:
    """The pooled features' outputs side by side, `[B, Σ dim]`, in feature order."""
    pooled = [outputs[f.name] for f in layout.features if f.pooled]
    return jnp.concatenate(pooled, axis=-1)


def auto_plan(tables, features, mesh, placements: Any, planner: Mapping[str, Any] | None):
    """`placements="auto"`: the `jaxembed.plan_collection` result for `planner`'s budget
    (`batch_size`, `memory_per_device`, and optionally `optimizer`, `id_stats`, `backend`);
    any other `placements` as given."""
    if not (isinstance(placements, str) and placements == "auto"):
        if planner:
            raise ValueError(
                f"planner={dict(planner)!r} is for placements='auto' (plan now), but placements "
                f"is {placements!r}: drop planner, or pass placements='auto'"
            )
        return placements
    planner = dict(planner or {})
    missing = [k for k in ("batch_size", "memory_per_device") if k not in planner]
    if missing:
        raise ValueError(
            "placements='auto' plans the collection when it is built and needs the step's "
            f"batch and each device's memory: pass planner={{'batch_size': ..., "
            f"'memory_per_device': '2GiB'}} (missing {missing}), or "
            "placements=jaxembed.plan_collection(...)"
        )
    if mesh is None:  # one device: everything is replicated, nothing to choose
        return None
    return plan_collection(tuple(tables), tuple(features), mesh, **planner)


def planned(tables: Sequence[TableConfig], placements: Any, exchange: Any):
    """The tables and exchange a `jaxembed.plan_collection` result chose (else as given)."""
    configs = getattr(placements, "table_configs", None)
    if configs is None:
        return tuple(tables), exchange
    return tuple(configs), placements.exchanges if exchange == "auto" else exchange


def export_states(layout: CollectionLayout, states: Mapping[int, Any]) -> dict[str, Any]:
    """Per-stack optimizer states as `{table: {"count", "slots": {slot: in id order}}}` (the
    collections' `export_optimizer`)."""
    out: dict[str, Any] = {}
    for s in layout.stacks:
        state = states[s.index]
        for name, slot in state.slots.items():
            for table, value in unstack(layout, {s.index: slot}).items():
                entry = out.setdefault(table, {"count": state.count, "slots": {}})
                entry["slots"][name] = value
    return out


def import_states(
    layout: CollectionLayout, optimizer: Any, exported: Mapping[str, Any], fresh: Mapping[int, Any]
) -> dict[int, Any]:
    """`export_states`' form (already checked) built back into per-stack states shaped, typed
    and placed like `fresh` (`optimizer.init`'s states of this layout)."""
    out = {}
    for s in layout.stacks:
        state = fresh[s.index]
        slots = {}
        for slot in optimizer.formula.slots:
            values = {t: np.asarray(exported[t]["slots"][slot.name]) for t in s.tables}
            old = state.slots[slot.name]
            array = build_stack(layout, s, values, per_row=slot.per_row, dtype=old.dtype)
            if isinstance(getattr(old, "sharding", None), NamedSharding):
                array = jax.device_put(array, old.sharding)
            slots[slot.name] = jnp.asarray(array)
        count = np.asarray(exported[s.tables[0]]["count"], np.int32)
        if isinstance(getattr(state.count, "sharding", None), NamedSharding):
            count = jax.device_put(count, state.count.sharding)
        out[s.index] = state._replace(slots=slots, count=jnp.asarray(count))
    return out
