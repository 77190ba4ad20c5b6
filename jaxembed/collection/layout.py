"""Stacks: the physical tables a collection holds, and where each table lives in them.

Tables of one dim and dtype whose placements split rows over the same mesh axes R (and the
hidden axis over the same K) are **stacked** into one physical table `[n·L, dim]` split
over R (n shards of L local rows). Each table occupies some of the stack's shards — all of
them (`rows`), one (`table`), a column of the R grid (`table_rows`), the only one
(`replicated`, `columns`) — at the same local offset on each. An id i of table t is looked
up at the stack row

    gid = shard · L + offset_t + r,   (shard, r) = (shards_t[i div L_t], i mod L_t)  block
                                                   (shards_t[i mod k],  i div k)    mod

so a batch of many features is one lookup (and one set of collectives) per stack, and the
kernels see a plain block-split table. Table-wise placement is a row split of the stack whose
shard boundaries fall on table boundaries: each table whole on the shard whose tables have
the fewest id slots per example so far (its device pools them: `jaxembed.kernels.tablewise`),
the emptiest on a tie, tables taken largest first.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec as P

from jaxembed.collection.config import DYNAMIC_PLACEMENTS, FeatureConfig, TableConfig, check_configs

__all__ = ["CollectionLayout", "Stack", "TablePlacement", "layout_collection", "stacked_width"]


@dataclasses.dataclass(frozen=True)
class TablePlacement:
    """Where one table's rows live in its stack.

    Attributes:
      name, vocab_size, dim: the table's.
      placement: the resolved placement (never `"auto"`).
      stack: the index of its stack.
      shards: the stack's row shards that hold it (consecutive), in the order its rows
        fill them.
      rows_per_shard: L_t, its rows on each of those shards (padded).
      offset: its first local row on each of them.
      row_sharding: `"block"` or `"mod"` over its shards.
      rotation: mod rows: row r goes to the table's shard `(r + rotation) % k` (local row
        `r // k`). `layout_collection` gives the i-th mod table of a stack (in packing
        order, the most rows first) rotation i % k, so the tables' low rows, a Zipf's
        hottest, spread over the shards instead of all landing on the first (whose device
        would pool and update the hot rows of every table).
    """

    name: str
    vocab_size: int
    dim: int
    placement: str
    stack: int
    shards: tuple[int, ...]
    rows_per_shard: int
    offset: int
    row_sharding: str
    rotation: int = 0

    def stack_ids(self, ids: Any, local_rows: int) -> Any:
        """The stack rows of `ids` (jnp or numpy), -1 for ids outside `[0, vocab_size)`."""
        xp = np if isinstance(ids, np.ndarray) else _jnp()
        valid = (ids >= 0) & (ids < self.vocab_size)
        safe = xp.where(valid, ids, 0)
        k = len(self.shards)
        if k == 1:  # the whole table on one shard: no division (XLA:CPU divides slowly)
            which, r = 0, safe
        elif self.row_sharding == "mod":
            which, r = (safe + self.rotation) % k, safe // k
        else:
            which, r = safe // self.rows_per_shard, safe % self.rows_per_shard
        shard = self.shards[0] + which  # a table's shards are consecutive
        return xp.where(valid, shard * local_rows + self.offset + r, -1).astype(np.int32)


def stacked_width(widths: Sequence[int]) -> int | None:
    """The L of pooled dense features' ids stacked as `[B, F, L]` (the dense bag form: bag
    `(b, f)` is row `(b, f)`), when padding every feature to the widest adds at most a
    quarter more slots than putting them side by side (`[B, ΣL_f]`, the flat form, whose
    bags need segments made from lengths); else None.

    Examples:
      >>> stacked_width([20, 20, 16]), stacked_width([20, 1, 1])
      (20, None)
    """
    widest = max(widths)
    return widest if len(widths) * widest <= 1.25 * sum(widths) else None


def _jnp():
    import jax.numpy as jnp

    return jnp


@dataclasses.dataclass(frozen=True)
class Stack:
    """One physical table of a collection: `[num_shards · local_rows, dim]` split over R.

    Attributes:
      index: its index in the layout.
      dim, dtype: of its rows.
      row_axes, hidden_axes: R and K.
      num_shards: n, the devices along R.
      local_rows: L, the rows of each shard.
      tables: the names of the tables it holds.
    """

    index: int
    dim: int
    dtype: str
    row_axes: tuple[str, ...]
    hidden_axes: tuple[str, ...]
    num_shards: int
    local_rows: int
    tables: tuple[str, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_shards * self.local_rows, self.dim)

    @property
    def spec(self) -> P:
        def entry(axes):
            return None if not axes else axes[0] if len(axes) == 1 else axes

        return P(entry(self.row_axes), entry(self.hidden_axes))

    @property
    def name(self) -> str:
        where = "x".join(self.row_axes) or "replicated"
        cols = f"_cols_{'x'.join(self.hidden_axes)}" if self.hidden_axes else ""
        return f"stack{self.index}_dim{self.dim}_rows_{where}{cols}"


@dataclasses.dataclass(frozen=True)
class CollectionLayout:
    """Every table's placement and the stacks they form, on one mesh.

    Attributes:
      mesh_axes: `((name, size), ...)`.
      tables: the configs, by name; features: the features, in order.
      placements: each table's `TablePlacement`, by name.
      stacks: the stacks.
    """

    mesh_axes: tuple[tuple[str, int], ...]
    tables: tuple[TableConfig, ...]
    features: tuple[FeatureConfig, ...]
    placements: tuple[tuple[str, TablePlacement], ...]
    stacks: tuple[Stack, ...]

    def placement(self, table: str) -> TablePlacement:
        return dict(self.placements)[table]

    def stack_of(self, table: str) -> Stack:
        return self.stacks[self.placement(table).stack]

    def table(self, name: str) -> TableConfig:
        return {t.name: t for t in self.tables}[name]

    def state_shards(self, table: str) -> int:
        """The shards a dynamic table's remap state splits over: its stack's row shards
        (`"rows"`), or 1, whole on every device (`"table"`, `"replicated"`)."""
        whole = self.placement(table).placement == "table"
        return 1 if whole else self.stack_of(table).num_shards

    def __str__(self) -> str:
        lines = [f"CollectionLayout  mesh: {' x '.join(f'{n}={s}' for n, s in self.mesh_axes)}"]
        for s in self.stacks:
            lines.append(f"  {s.name}  [{s.shape[0]}, {s.shape[1]}] {s.spec}  ({s.num_shards} x "
                         f"{s.local_rows} rows)")  # fmt: skip
            for t in s.tables:
                p = self.placement(t)
                lines.append(
                    f"    {t:<16} {p.placement:<11} {p.vocab_size:>10} rows on shards "
                    f"{_shards_text(p.shards)} at {p.offset} ({p.rows_per_shard} per shard, "
                    f"{p.row_sharding})"
                )
        return "\n".join(lines)


def _shards_text(shards: Sequence[int]) -> str:
    if len(shards) > 2 and list(shards) == list(range(shards[0], shards[-1] + 1)):
        return f"{shards[0]}..{shards[-1]}"
    return ",".join(str(s) for s in shards)


def _resolve_axes(t: TableConfig, placement: str, names, sizes) -> tuple[tuple, tuple, int]:
    """(R, K, n_within) for a placement; n_within: the shards a table_rows table spans."""
    axes = t.axes
    for a in axes or ():
        if a not in sizes:
            raise ValueError(
                f"table {t.name!r}: axes {axes} name {a!r}, which is not a mesh axis {names}"
            )
    if placement == "replicated":
        return (), (), 1
    if placement == "columns":
        k = axes or tuple(a for a in names if sizes[a] > 1)
        n = math.prod(sizes[a] for a in k)
        if t.dim % n:
            raise ValueError(
                f"table {t.name!r}: placement 'columns' splits dim {t.dim} over {k} ({n} "
                f"devices), which does not divide it: use a dim that is a multiple of {n}, or "
                "another placement"
            )
        return (), k, 1
    if placement in ("rows", "table"):
        r = axes or tuple(a for a in names if sizes[a] > 1)
        return r, (), math.prod(sizes[a] for a in r)
    if placement == "table_rows":
        given = axes if axes else tuple(names[:2])  # default: the mesh's first two axes
        if len(given) != 2:
            got = f"axes={axes}" if axes else "no axes (default: the mesh's first two)"
            fix = (
                f"pass two of them, e.g. axes={tuple(names[:2])}"
                if len(names) >= 2
                else "use a mesh of two axes"
            )
            raise ValueError(
                f"table {t.name!r}: placement 'table_rows' needs axes=(across, within), two "
                f"mesh axes (rows over `within`, tables over `across`), got {got} on mesh "
                f"axes {names}: {fix}, or use placement='rows' to split the rows over "
                f"{axes or names}"
            )
        across, within = given
        return (across, within), (), sizes[within]
    raise ValueError(f"table {t.name!r}: placement {placement!r} must be resolved first")


def layout_collection(
    tables: Sequence[TableConfig],
    features: Sequence[FeatureConfig],
    mesh: Any,
    placements: Mapping[str, str] | None = None,
) -> CollectionLayout:
    """Resolves every table's placement on `mesh` and packs the tables into stacks.

    Args:
      tables: the tables.
      features: the features reading them.
      mesh: a `Mesh` or `AbstractMesh` (or None: one device, everything replicated).
      placements: placements for the tables whose config says `"auto"` (the planner's
        choice); without one, an `"auto"` table is placed by rows (the whole mesh).

    Returns:
      The `CollectionLayout`.

    Raises:
      ValueError: unknown tables or axes, a columns split that does not divide the dim, a
        `"table_rows"` placement without two axes `(across, within)` (named in `axes`, or
        the mesh's first two).
    """
    by_name = check_configs(tables, features)
    if mesh is None:
        names, sizes = (), {}
    else:
        names = tuple(mesh.axis_names)
        sizes = dict(zip(names, (int(s) for s in mesh.axis_sizes), strict=True))
    placements = dict(placements or {})
    resolved: dict[str, tuple[str, tuple, tuple, int]] = {}
    for t in tables:
        placement = t.placement if t.placement != "auto" else placements.get(t.name, "rows")
        if t.dynamic is not None and placement not in DYNAMIC_PLACEMENTS:
            raise ValueError(
                f"table {t.name!r}: a dynamic table is placed 'rows', 'table' or 'replicated', "
                f"got {placement!r} (from the placements given): place it 'rows', 'table' or "
                "'replicated'"
            )
        if not names:
            placement = "replicated"
        r, k, within = _resolve_axes(t, placement, names, sizes)
        if placement in ("rows", "table", "table_rows") and not r:
            placement, r, k, within = "replicated", (), (), 1  # a one-device mesh
        resolved[t.name] = (placement, r, k, within)

    # Group into stacks: same dim, dtype, R and K; a dynamic table by rows or replicated alone
    # (its stack's rows are its rows: the remap's row r is the stack's row r), one placed
    # "table" with the other table-wise tables (its rows at `offset` of its shard).
    groups: dict[tuple, list[str]] = {}
    for t in tables:
        placement, r, k, _ = resolved[t.name]
        alone = t.dynamic is not None and placement != "table"
        key = (t.dim, np.dtype(t.dtype).name, r, k, t.name if alone else None)
        groups.setdefault(key, []).append(t.name)
        n = math.prod(sizes[a] for a in r)
        if alone and t.dynamic.num_buckets % n:
            step = n * t.dynamic.bucket_size  # each shard owns whole buckets
            raise ValueError(
                f"table {t.name!r}: a dynamic table's capacity {t.vocab_size} does not divide "
                f"over its {n} row shards ({placement} over {r}) in whole buckets of "
                f"{t.dynamic.bucket_size}: use capacity={-(-t.vocab_size // step) * step} (a "
                f"multiple of {step})"
            )

    stacks, table_placements = [], {}
    order = {"rows": 0, "table_rows": 1, "table": 2, "replicated": 3, "columns": 3}
    slots = {t.name: 0 for t in tables}  # a table's id slots per example, over its features
    for f in features:
        slots[f.table] += f.max_ids or 1
    for index, ((dim, dtype, r, k, _), members) in enumerate(groups.items()):
        n = math.prod(sizes[a] for a in r)
        fill = [0] * n
        load = [0] * n  # the slots of the tables placed whole on each shard
        rows_of: dict[str, int] = {}
        mods = 0  # the stack's mod tables so far: each rotated by one more shard
        todo = sorted(members, key=lambda m: (order[resolved[m][0]], -by_name[m].vocab_size))
        for name in todo:
            t = by_name[name]
            placement, _, _, within = resolved[name]
            if placement == "rows":
                shards = tuple(range(n))
            elif placement == "table":  # the least loaded shard (its owner pools its ids)
                shards = (min(range(n), key=lambda s: (load[s], fill[s], s)),)
                load[shards[0]] += slots[name]
            elif placement == "table_rows":
                across = n // within
                loads = [max(fill[p * within : (p + 1) * within]) for p in range(across)]
                p = min(range(across), key=lambda q: (loads[q], q))
                shards = tuple(range(p * within, (p + 1) * within))
            else:
                shards = (0,)
            per_shard = -(-t.vocab_size // len(shards))
            offset = max(fill[s] for s in shards)
            for s in shards:
                fill[s] = offset + per_shard
            rows_of[name] = per_shard
            # "auto" is the planner's to resolve (`plan.table_configs`); unplanned, block rows
            split = len(shards) > 1 and t.row_sharding != "auto"
            row_sharding = t.row_sharding if split else "block"
            rotation = mods % len(shards) if row_sharding == "mod" else 0
            mods += row_sharding == "mod"
            table_placements[name] = TablePlacement(
                name=name, vocab_size=t.vocab_size, dim=t.dim, placement=placement,
                stack=index, shards=shards, rows_per_shard=per_shard, offset=offset,
                row_sharding=row_sharding, rotation=rotation,
            )  # fmt: skip
        stack = Stack(
            index=index, dim=dim, dtype=dtype, row_axes=r, hidden_axes=k, num_shards=n,
            local_rows=max(max(fill), 1), tables=tuple(members),
        )  # fmt: skip
        stacks.append(stack)
    return CollectionLayout(
        mesh_axes=tuple(sizes.items()),
        tables=tuple(tables),
        features=tuple(features),
        placements=tuple((t.name, table_placements[t.name]) for t in tables),
        stacks=tuple(stacks),
    )
