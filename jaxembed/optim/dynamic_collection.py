"""Dynamic tables in a collection: one step's remap of every dynamic table's features.

A table whose `TableConfig.dynamic` is set is a dynamic table (`jaxembed.optim.dynamic`),
placed `"rows"` (block rows over the stack's axes, the remap state split with them) or
`"replicated"` in a stack of its own (the stack's row r is the remap's row r), or `"table"`:
whole on one device, in the stack of the other table-wise tables (its rows from `rows_at`,
`table_rows_at`), its remap state whole on every device. Its features take raw 64-bit
ids (`jaxembed.dynamic.as_keys` forms: keys `uint32[B, L, 2]` or `[B, 2]` under `jit`, never
int32, which is what `jit` narrows int64 ids to; with
`(keys, weights)` for weighted features, or bags of varying length as a
`jaxembed.dynamic.RaggedKeys`). `prepare` remaps them into ordinary row ids, resets the rows it
gives out (table and optimizer state), and returns a batch the static collection path reads
unchanged: `collection_lookup` and `collection_update` (ragged bags as a `jaxembed.Ragged` of
rows, the slots that got no row dropped from their bags).

    batch, stacks, states, remaps, stats = prepare(layout, stacks, states, remaps, batch, t,
                                                   key=key, optimizer=opt)
    outputs = collection_lookup(layout, stacks, batch)
    ...
    stacks, states = collection_update(layout, opt, stacks, states, batch, out_grads)

A table's features are remapped one after another with the same step (no feature takes a
row another's ids looked up at that step; an id a later feature admits is no row for an
earlier one's slots this step). An id without a row
becomes -1: it reads zeros, gets no gradient, and a bag's `mean` and `sqrtn` do not count it.
The reset rows of table i draw from `fold_in(key, i)` (i: its index in `layout.tables`).

For a training loop that holds the optimizer state elsewhere (`jaxembed.nnx`'s collection),
`remap_collection` returns the reset rows instead, `reset_states` resets them later, and
`read_rows` maps ids to rows read-only (evaluation, serving).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxembed.collection.layout import CollectionLayout
from jaxembed.dynamic.config import DynamicState, StepStats
from jaxembed.dynamic.keys import as_keys
from jaxembed.dynamic.ragged import RaggedKeys, in_bag_keys, to_ragged
from jaxembed.kernels import remap
from jaxembed.kernels.arrays import normalize_spec, place_table, resolve_mesh
from jaxembed.optim.dynamic import (
    DynamicTable,
    remap_table,
    reset_optimizer_rows,
    rows_for,
    state_specs,
)
from jaxembed.ragged import Ragged, segments_from_lengths

__all__ = [
    "DEFAULT_INITIALIZER",
    "dynamic_tables",
    "init_states",
    "prepare",
    "read_rows",
    "remap_collection",
    "reset_states",
    "table_rows_at",
]

DEFAULT_INITIALIZER = jax.nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
"""A dynamic table's reset rows without `TableConfig.initializer`: Flax's `Embed` default."""


def dynamic_tables(layout: CollectionLayout) -> list[tuple[int, Any]]:
    """`(index in layout.tables, TableConfig)` of each dynamic table of the collection."""
    return [(i, t) for i, t in enumerate(layout.tables) if t.dynamic is not None]


def table_rows_at(layout: CollectionLayout, name: str) -> int | None:
    """A table-wise dynamic table's first row in its stack (its shard's first row plus its
    offset there: `prepare`'s `rows_at`); None for one whose stack is its own."""
    p = layout.placement(name)
    if p.placement != "table":
        return None
    return p.shards[0] * layout.stack_of(name).local_rows + p.offset


def _state_axes(layout: CollectionLayout, name: str) -> Any:
    """The mesh axes a dynamic table's remap state splits over: its stack's rows', or None
    (whole on every device: replicated, or table-wise)."""
    if layout.state_shards(name) == 1:
        return None
    return (*layout.stack_of(name).spec, None)[0]


def init_states(layout: CollectionLayout, *, mesh: Any = None) -> dict[str, DynamicState]:
    """Every dynamic table's empty remap state, by table name (on `mesh`, split with its
    stack's rows: `jaxembed.optim.dynamic.state_specs`).

    Examples:
      >>> from jaxembed.collection import FeatureConfig, TableConfig, layout_collection
      >>> from jaxembed.dynamic import DynamicTableConfig
      >>> t = TableConfig("user", 64, 8, dynamic=DynamicTableConfig(capacity=64, bucket_size=8))
      >>> layout = layout_collection([t], [FeatureConfig("user_id", "user")], None)
      >>> list(init_states(layout)), init_states(layout)["user"].keys.shape
      (['user'], (64, 2))
    """
    mesh = resolve_mesh(mesh)
    out = {}
    for _, t in dynamic_tables(layout):
        state = remap.init_state(t.dynamic)
        if mesh is not None:
            # Born split (also under `jax.set_mesh`, where `mesh` is abstract), each spec
            # spelled to the array's rank, as a jitted step returns the state: a state born
            # replicated made the step's second call compile again.
            specs = state_specs(t.dynamic, _state_axes(layout, t.name))
            place = lambda a, sp: place_table(a, mesh, normalize_spec(sp, a.ndim))
            state = jax.tree.map(place, state, specs)
        out[t.name] = state
    return out


def _split(
    feature: str, table: str, value: Any, check_ids: bool
) -> tuple[jax.Array, Callable[[jax.Array], Any], Any]:
    """(the keys the remap sees, uint32 `[..., 2]`, checked and named by feature and table;
    the feature's new input from its rows (int32, -1: no row); the remap's slots that hold no
    id: a ragged block's slots past its total, which the remap sees as `EMPTY_ID` and
    `StepStats.reserved` must not count)."""
    what = f"feature {feature!r} (dynamic table {table!r}) ids"
    if isinstance(value, RaggedKeys):
        past = jnp.sum(segments_from_lengths(value.lengths, value.capacity) < 0, dtype=jnp.int32)
        keys = as_keys(in_bag_keys(value), what, check=check_ids)
        return keys, lambda rows: to_ragged(value, rows), past
    if isinstance(value, tuple) and len(value) == 2:
        ids, weights = value
        return as_keys(ids, what, check=check_ids), lambda rows: (rows, weights), 0
    if isinstance(value, Ragged):
        raise TypeError(
            f"feature {feature!r} reads a dynamic table, whose ids are raw 64-bit ids, but its "
            f"input is a jaxembed.Ragged of {value.values.dtype} ids: pass its bags as "
            "jaxembed.dynamic.RaggedKeys (RaggedKeys.from_lists(bags), or RaggedKeys(keys "
            "uint32[*lead, N, 2], lengths))"
        )
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise TypeError(
            f"feature {feature!r} reads a dynamic table: its input must be raw ids (keys "
            f"uint32[B, L, 2] or [B, 2], int64 with x64), (ids, weights) or a "
            f"jaxembed.dynamic.RaggedKeys, got {type(value).__name__}"
        )
    return as_keys(value, what, check=check_ids), lambda rows: rows, 0


def remap_collection(
    layout: CollectionLayout,
    stacks: Mapping[int, jax.Array],
    remaps: Mapping[str, DynamicState],
    batch: Mapping[str, Any],
    step_index: Any,
    *,
    key: Any,
    impl: str = "auto",
    mesh: Any = None,
    check_ids: bool = True,
) -> tuple[dict[str, Any], dict[int, jax.Array], dict, dict, dict[int, jax.Array]]:
    """`prepare` without the optimizer states: the rows reset in each stack come back.

    Returns:
      `(batch, stacks, remaps, stats, resets)`: as `prepare`'s, and each dynamic table's
      reset rows by table name, int32 `[M]` (its features' id slots; the table's own rows),
      the rows first, then `capacity`, for `reset_states`.
    """
    batch, stacks = dict(batch), dict(stacks)
    remaps, stats, resets = dict(remaps), {}, {}
    for index, t in dynamic_tables(layout):
        if t.name not in remaps:
            raise KeyError(
                f"prepare: no remap state for dynamic table {t.name!r} (got states of "
                f"{sorted(remaps)}): make them with init_states(layout)"
            )
        stack, rows_at = layout.stack_of(t.name), table_rows_at(layout, t.name)
        dyn, total, reset = DynamicTable(stacks[stack.index], remaps[t.name]), None, []
        for f in (f for f in layout.features if f.table == t.name):
            ids, finish, not_ids = _split(f.name, t.name, batch[f.name], check_ids)
            rows, dyn, rows_reset, step = remap_table(
                t.dynamic, dyn, ids, step_index,
                initializer=t.initializer or DEFAULT_INITIALIZER,
                key=jax.random.fold_in(key, index), impl=impl, mesh=mesh,
                weight_spec=stack.spec, check_ids=False, rows_at=rows_at,
            )  # fmt: skip
            batch[f.name] = finish(jnp.where(rows == t.dynamic.capacity, -1, rows))
            step = step._replace(reserved=step.reserved - not_ids)
            total = step if total is None else StepStats(*map(jnp.add, total, step))
            reset.append(rows_reset)
        stacks[stack.index], remaps[t.name] = dyn.table, dyn.state
        if total is not None:
            stats[t.name] = total
            # one list, the rows first (each feature's are; `capacity` sorts last)
            resets[t.name] = jnp.sort(jnp.concatenate(reset))
    return batch, stacks, remaps, stats, resets


def prepare(
    layout: CollectionLayout,
    stacks: Mapping[int, jax.Array],
    states: Mapping[int, Any] | None,
    remaps: Mapping[str, DynamicState],
    batch: Mapping[str, Any],
    step_index: Any,
    *,
    key: Any,
    optimizer: Any,
    impl: str = "auto",
    mesh: Any = None,
    check_ids: bool = True,
) -> tuple[dict[str, Any], dict[int, jax.Array], dict[int, Any] | None, dict, dict]:
    """One step's remap of every dynamic table's features, with the rows it gives out reset.

    Args:
      layout: the collection's layout.
      stacks: each stack's table, by stack index (as `collection_lookup` takes them).
      states: the row-sparse optimizer's state of each stack, by index (or None, with
        `optimizer=None`).
      remaps: each dynamic table's `DynamicState`, by table name (`init_states`).
      batch: every feature's input; a dynamic table's features hold raw ids (see the module).
      step_index: t, an integer scalar counting the steps, read modulo 2**32 (as `prepare`).
      key: the PRNG key the reset rows draw from (table i: `fold_in(key, i)`).
      optimizer: the `RowSparseOptimizer` of `states`, or None.
      impl, check_ids: as `jaxembed.optim.dynamic.prepare`'s.
      mesh: the mesh; default `jax.set_mesh`'s, else the stacks'.

    Returns:
      `(batch, stacks, states, remaps, stats)`: the batch with each dynamic feature's ids
      replaced by int32 rows (-1: no row), the stacks and states with the reset rows written,
      the new remap states, and each dynamic table's `StepStats` (its features' summed).

    Raises:
      KeyError: a dynamic table without a remap state.
      TypeError, ValueError: as `jaxembed.optim.dynamic.prepare`; a `jaxembed.Ragged` input
        for a dynamic feature (its bags go as a `jaxembed.dynamic.RaggedKeys`).
    """
    if optimizer is None and states is not None:
        raise ValueError(
            "prepare: got optimizer states but optimizer=None: pass the optimizer that made "
            "them, so that the rows it resets get their initial state"
        )
    batch, stacks, remaps, stats, resets = remap_collection(
        layout, stacks, remaps, batch, step_index, key=key, impl=impl, mesh=mesh,
        check_ids=check_ids,
    )  # fmt: skip
    if states is not None:
        states = reset_states(layout, stacks, optimizer, states, resets, mesh=mesh)
    return batch, stacks, states, remaps, stats


def reset_states(
    layout: CollectionLayout,
    stacks: Mapping[int, jax.Array],
    optimizer: Any,
    states: Mapping[int, Any],
    resets: Mapping[str, jax.Array],
    *,
    mesh: Any = None,
) -> dict[int, Any]:
    """The optimizer states with each dynamic table's reset rows (`remap_collection`'s
    `resets`, by table name) back at their initial values; the other rows as they are."""
    states = dict(states)
    for name, reset in resets.items():
        s = layout.stack_of(name).index
        states[s] = reset_optimizer_rows(
            layout.table(name).dynamic, stacks[s], optimizer, states[s], reset, mesh=mesh,
            weight_spec=layout.stacks[s].spec, rows_at=table_rows_at(layout, name),
        )  # fmt: skip
    return states


def read_rows(
    layout: CollectionLayout,
    remaps: Mapping[str, DynamicState],
    batch: Mapping[str, Any],
    *,
    impl: str = "auto",
    mesh: Any = None,
    check_ids: bool = True,
) -> dict[str, Any]:
    """The batch with each dynamic feature's ids as rows (-1: no row), read-only: nothing
    admitted or counted (`jaxembed.optim.dynamic.rows_for`), for evaluation and serving."""
    batch = dict(batch)
    for _, t in dynamic_tables(layout):
        for f in (f for f in layout.features if f.table == t.name):
            ids, finish, _ = _split(f.name, t.name, batch[f.name], check_ids)
            rows = rows_for(t.dynamic, remaps[t.name], ids, impl=impl, mesh=mesh,
                            weight_spec=P(_state_axes(layout, t.name)),
                            check_ids=False)  # fmt: skip
            batch[f.name] = finish(jnp.where(rows == t.dynamic.capacity, -1, rows))
    return batch
