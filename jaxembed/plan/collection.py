"""`plan_collection`: where each table of a collection lives, chosen by the cost model.

For every table whose config says `placement="auto"`, the planner picks a placement
(`replicated`, `table`, `rows`, `columns`, `table_rows`), and where a sample of ids shows
skew, block or mod rows, so that the modelled step of the whole collection — the slowest
device's lookups, backward and row-sparse update, every collective included — is as short
as possible while every device's memory stays within a budget. Each candidate layout is
priced by `jaxembed.plan.collection_cost` from the same bag plans the lookups run.

**Search** (greedy, then local moves). Start from every auto table split by rows; if that
does not fit, from the layout that needs the least memory (the same moves, minimising
memory); if none fits, the error names the smallest budget found and the table that breaks
this one. Then, largest table first, give each table the placement whose whole layout
models fastest and fits, and move the k smallest tables of one dim together (tables that
share a stack share its collectives: one small table alone rarely pays for a call of its
own, several may); repeat until no move shortens the step (at most four passes). Largest
first because the big tables decide most of the memory and the bytes and the small ones fill
what is left (bin packing's rule); the later passes undo choices a later table made worse.
The same search runs a second time from every table placed `"table"` (where that fits), and
the faster of the two layouts wins: from there, moving the few tables that overload their
owner back to rows is one move each.
Table-wise tables go to the least filled shard, largest first (`layout_collection`), which
balances the devices' memory: a stack's shards are padded to its fullest.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxembed.collection.config import (
    DYNAMIC_PLACEMENTS,
    FeatureConfig,
    TableConfig,
    check_configs,
)
from jaxembed.plan import cost
from jaxembed.plan.collection_cost import CallCost, Context, LayoutCost, LayoutError, evaluate
from jaxembed.plan.idstats import IdStats
from jaxembed.plan.specs import backend_of, format_bytes
from jaxembed.quant import format as qformat

__all__ = ["CollectionPlan", "TablePlan", "parse_bytes", "plan_collection"]

_CHOICES = ("rows", "replicated", "table_rows", "table", "columns")  # ties: earlier wins
_PASSES = 4


@dataclasses.dataclass(frozen=True)
class TablePlan:
    """One table's row of a `CollectionPlan`.

    Attributes:
      name, vocab_size, dim: the table's.
      placement, row_sharding: chosen (or fixed by its config).
      stack: the name of the stack that holds it.
      exchange: the exchange of its stack's call (of its first feature's call).
      wire_bytes: per device and step, its share of its calls' bytes (by id slots).
      modelled_ms: likewise, its share of its calls' modelled time.
      memory_bytes: the most it puts on one device: its rows and their optimizer state.
      reason: why this placement.
    """

    name: str
    vocab_size: int
    dim: int
    placement: str
    row_sharding: str
    stack: str
    exchange: str
    wire_bytes: float
    modelled_ms: float
    memory_bytes: int
    reason: str


@dataclasses.dataclass(frozen=True)
class CollectionPlan:
    """Placements for a collection and what they cost, per table and per device.

    Pass it as `EmbeddingBagCollection(tables, features, placements=plan)`: the collection
    runs its placements, row sharding (`plan.table_configs`) and per-stack exchanges
    (`plan.exchanges`). `str(plan)` prints the planner's table.

    Attributes:
      mesh_axes: `((name, size), ...)`; batch_size, batch_axes: the batch and the mesh
        axes it is split over.
      memory_per_device: the budget, bytes.
      backend: the cost constants' backend; ids: what the ids were assumed to be.
      table_configs: the tables with their chosen placement and row sharding.
      tables: a `TablePlan` per table.
      calls: every `embedding_bag` call of a step (`CallCost`: plan, bytes, time).
      step_ms: the modelled step of the slowest device.
      allocated_bytes: per device, the stacks and optimizer state (the same on every
        device: a stack's shards are padded to its fullest); buffer_bytes: activations and
        exchange buffers; peak_bytes: their sum.
      used_bytes: per device, the rows it really holds and their state.
      update_ms: per device, the modelled optimizer state traffic.
      exchange: `"rows"` when no call routes, else `"auto"` (kept for round-1 callers:
        `exchanges` is what the calls run).
      evaluations: the layouts priced.
      serving: a plan of the lookups alone (no gradient, no update, no optimizer state).
      precision: `((table, precision), ...)`: the tables served quantized, for
        `coll.quantized(dict(plan.precision))`.
    """

    mesh_axes: tuple[tuple[str, int], ...]
    batch_size: int
    batch_axes: tuple[str, ...]
    memory_per_device: int
    backend: str
    ids: str
    table_configs: tuple[TableConfig, ...]
    tables: tuple[TablePlan, ...]
    calls: tuple[CallCost, ...]
    step_ms: float
    allocated_bytes: int
    buffer_bytes: int
    used_bytes: tuple[int, ...]
    update_ms: tuple[float, ...]
    exchange: str
    evaluations: int
    serving: bool = False
    precision: tuple[tuple[str, str], ...] = ()

    @property
    def placements(self) -> dict[str, str]:
        """`{table: placement}` for `EmbeddingBagCollection(..., placements=...)`."""
        return {t.name: t.placement for t in self.tables}

    @property
    def exchanges(self) -> dict[int, str]:
        """`{stack index: exchange}` as the planned calls run them: the `exchange=` of
        `jaxembed.collection.collection_lookup` and `collection_update` (the collection
        modules read it from `placements=plan`). A stack whose calls differ is left out
        (`"auto"` decides it); `"none"` runs as `"rows"` (nothing to exchange); `"table"`
        is the table-wise exchange (`jaxembed.kernels.tablewise`), and `"table+X"` a stack
        whose table-wise call is planned so and whose other call runs X. A routed call the
        planner pools or sizes where the plan alone would not says so: `"routed:source"`
        (pooled at the owner, the sample's hot ids would overflow the owner's places every
        step), `"routed:source:0.0789"` (and its capacity factor, `capacity_factor=` of
        the lookup: sized for the distinct ids the owners expect from the sample, not for
        every slot holding a distinct id)."""
        by_stack: dict[int, set[str]] = {}
        for call in self.calls:
            exchange = "rows" if call.exchange == "none" else call.exchange
            if call.routed_pool != "auto":  # the planner's pooling (and capacity)
                exchange += f":{call.routed_pool}"
            if call.capacity_factor is not None:
                exchange += f":{call.capacity_factor:g}"
            by_stack.setdefault(call.stack, set()).add(exchange)
        out = {}
        for s, e in sorted(by_stack.items()):
            if len(e) == 1:
                out[s] = e.pop()
            elif len(e) == 2 and "table" in e:
                out[s] = "table+" + (e - {"table"}).pop()
        return out

    @property
    def peak_bytes(self) -> int:
        return self.allocated_bytes + self.buffer_bytes

    @property
    def forward_bytes(self) -> float:
        """Wire bytes per device of the collection's lookup (every call's forward)."""
        return float(sum(c.forward_bytes for c in self.calls))


def parse_bytes(value: Any) -> int:
    """Bytes from an int or a string with a unit: `"2GiB"`, `"512 MiB"`, `"1.5GB"`, `"1e9"`.

    Raises:
      ValueError: anything else, or a budget that is not positive.

    Examples:
      >>> parse_bytes("2GiB"), parse_bytes("512 MiB"), parse_bytes("1.5GB"), parse_bytes(4096)
      (2147483648, 536870912, 1500000000, 4096)
    """
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip
    if isinstance(value, int | float | np.integer) and not isinstance(value, bool):
        n = float(value)
    else:
        m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(value))
        try:
            n = float(m.group(1)) * units[m.group(2).lower()] if m else math.nan
        except (KeyError, ValueError):
            n = math.nan
    if not n > 0 or math.isinf(n):
        raise ValueError(
            f"memory_per_device must be a positive number of bytes, like 2147483648 or "
            f"'2GiB' (units B, KB, MB, GB, KiB, MiB, GiB), got {value!r}"
        )
    return int(n)


def _check_precision(precision: Any, by_name: Mapping[str, TableConfig]) -> dict[str, str]:
    """`{table: precision}` of the tables served quantized (float ones left out), each dim
    one its precision packs."""
    if precision is None:
        return {}
    out = {}
    for name, p in qformat.table_precisions(precision, by_name).items():
        if p is None:
            continue
        try:
            qformat.check_dim(by_name[name].dim, p)
        except ValueError as e:
            raise ValueError(f"table {name!r}: {e}") from None
        out[name] = p
    return out


def _choices(t: TableConfig, sizes: dict[str, int]) -> list[str]:
    split = math.prod(s for s in sizes.values() if s > 1)
    out = ["rows", "replicated", "table"]
    if len(sizes) >= 2 and t.axes is None:
        out.append("table_rows")
    cols = math.prod(sizes[a] for a in t.axes) if t.axes else split
    if t.dim % cols == 0:
        out.append("columns")
    if t.dynamic is not None:  # its rows are reset where they live: block rows or whole
        out = [c for c in out if c in DYNAMIC_PLACEMENTS]
    return [c for c in _CHOICES if c in out] if split > 1 else ["replicated"]


def _row_sharding(ctx: Context, t: TableConfig, placement: str) -> str:
    """Mod rows where the sample's busiest block shard holds clearly more (>10%); where no
    sample holds the table's ids, mod rows too, the robust choice (`_unseen`): ids ranked by
    frequency put a block's worth of hot ids on one shard, and hashed ids split alike either
    way. A dynamic table (rows in blocks) and a placement without split rows keep their own
    (`"auto"`: block)."""
    own = "block" if t.row_sharding == "auto" else t.row_sharding
    if not _unseen(ctx, t, placement):
        skew = _skew(ctx, t, placement)
        return own if skew is None else "mod" if skew["mod"] < 0.9 * skew["block"] else "block"
    return "mod"


def _unseen(ctx: Context, t: TableConfig, placement: str) -> bool:
    """A table split by rows whose ids no sample (`id_stats`) holds: the planner cannot tell
    whether they crowd one block shard."""
    split = placement in ("rows", "table_rows") and t.dynamic is None
    return split and (ctx.stats is None or t.name not in ctx.stats.samples)


def _unseen_note(ctx: Context, t: TableConfig, placement: str, row_sharding: str) -> str:
    """What a table the planner split by mod rows without seeing its ids would gain from a
    sample: the plan says so."""
    if row_sharding != "mod" or not _unseen(ctx, t, placement):
        return ""
    return ("; mod rows: its ids are unseen (robust to hot ids in one block); id_stats= of a "
            "few batches lets the planner check the row sharding and size the routed capacity "
            "from the ids")  # fmt: skip


def _skew(ctx: Context, t: TableConfig, placement: str) -> dict[str, float] | None:
    """The busiest row shard's share of the sample's distinct ids, block and mod
    (`IdStats.skew`), for a table split by rows that the sample holds; else None."""
    stats = ctx.stats
    if (stats is None or placement not in ("rows", "table_rows") or t.dynamic is not None
            or t.name not in stats.samples):  # fmt: skip
        return None
    axes = t.axes or tuple(a for a, s in ctx.sizes.items() if s > 1)
    if placement == "table_rows":  # rows over `within`, the second of (across, within)
        axes = (t.axes or tuple(ctx.sizes))[1:2]
    n = math.prod(ctx.sizes[a] for a in axes)
    return stats.skew(t.name, vocab_size=t.vocab_size, num_shards=n)


def _block_note(ctx: Context, t: TableConfig, placement: str, row_sharding: str) -> str:
    """A table its config keeps in block rows says so where the sample puts clearly more of
    its ids on one block shard than mod rows would (`_row_sharding` would pick mod)."""
    skew = _skew(ctx, t, placement) if t.row_sharding == "block" else None
    if row_sharding != "block" or skew is None or skew["mod"] >= 0.9 * skew["block"]:
        return ""
    return (f"; block rows: its busiest shard holds {skew['block']:.0%} of a batch's distinct "
            f"ids ({skew['mod']:.0%} by mod rows), row_sharding='auto' lets the planner "
            "choose")  # fmt: skip


def _time_key(c: LayoutCost, placement: str) -> tuple:
    return (round(c.step_ms, 9), c.peak_bytes, _CHOICES.index(placement))


def _memory_key(c: LayoutCost, placement: str) -> tuple:
    return (c.peak_bytes, round(c.step_ms, 9), _CHOICES.index(placement))


def plan_collection(
    tables: Sequence[TableConfig],
    features: Sequence[FeatureConfig],
    mesh: Any,
    *,
    batch_size: int,
    memory_per_device: int | str,
    optimizer: Any = None,
    id_stats: IdStats | None = None,
    batch_axes: Sequence[str] | None = None,
    backend: str | None = None,
    serving: bool | None = None,
    precision: str | Mapping[str, str | None] | None = None,
) -> CollectionPlan:
    """Chooses a placement for every `"auto"` table: the fastest modelled step that fits.

    Args:
      tables: the `TableConfig`s; those with `placement="auto"` are planned, the others
        kept as given.
      features: the `FeatureConfig`s (`max_ids` is each feature's bag capacity L).
      mesh: a `Mesh` or `AbstractMesh`.
      batch_size: the global batch (examples per step).
      memory_per_device: the budget per device, bytes or a string like `"2GiB"`.
      optimizer: a `jaxembed.optim` optimizer (or its formula), for its state slots; None
        assumes row-wise Adagrad (one float per row).
      id_stats: `jaxembed.plan.idstats.id_stats(...)` of a sample of batches; None
        assumes every bag full (`max_ids`) and ids uniform over each vocabulary.
      batch_axes: the mesh axes the batch is split over (default: every axis larger than
        one: data parallel over all devices).
      backend: the cost constants (`"cpu"`, `"gpu"`, `"tpu"`; default the mesh's).
      serving: plan a serving step, the lookups alone: no gradient, no update, no optimizer
        state in memory (default: True where `precision` is given, else False).
      precision: the tables served quantized (`coll.quantized`): `"int8"`, `"int4"`,
        `"int2"` or `"fp8"` for every table, or `{table: precision}` (a table left out, or
        None, stays float). Memory counts each row's packed bytes and its float16 scale and
        bias (`jaxembed.quant`); the exchanges move float32 pooled rows, as for a float
        table. Tables that share a stack must share a precision (a stack is quantized
        whole): layouts that mix them are skipped, or raise where the placements are fixed.

    Returns:
      A `CollectionPlan`.

    Raises:
      ValueError: bad configs, a batch that does not divide over `batch_axes`, a backend
        without cost constants (not `"cpu"`, `"gpu"` or `"tpu"`), or a budget that no
        layout fits (the message names the smallest budget that does and the table that
        breaks this one); an unknown precision or table, a dim the precision cannot pack,
        quantized tables in a training plan (`serving=False`) or an optimizer in a serving
        plan.

    Examples:
      >>> import jax
      >>> from jaxembed.collection import FeatureConfig, TableConfig
      >>> mesh = jax.sharding.AbstractMesh((8,), ("x",))
      >>> tables = [TableConfig("item", 1_000_000, 64), TableConfig("user", 100_000, 64),
      ...           TableConfig("country", 200, 12), TableConfig("os", 10, 12)]
      >>> features = [FeatureConfig("clicked", "item", combiner="mean", max_ids=20),
      ...             FeatureConfig("user", "user"), FeatureConfig("country", "country"),
      ...             FeatureConfig("os", "os")]
      >>> plan = plan_collection(tables, features, mesh, batch_size=4096,
      ...                        memory_per_device="1GiB", backend="gpu")
      >>> plan.placements  # on a GPU's constants, replicas save the most collectives
      {'item': 'replicated', 'user': 'replicated', 'country': 'replicated', 'os': 'replicated'}
      >>> plan = plan_collection(tables, features, mesh, batch_size=4096,
      ...                        memory_per_device="256MiB", backend="gpu")
      >>> plan.placements  # a replica of item needs 260 MB
      {'item': 'rows', 'user': 'rows', 'country': 'replicated', 'os': 'replicated'}
      >>> plan.exchanges  # per stack: item and user routed; the small replicas sum a shard
      {0: 'routed', 1: 'dense'}
      >>> print(plan)
      CollectionPlan  mesh: x=8  batch 4096 over (x)  backend gpu
        modelled step 0.167 ms (slowest device); peak memory ...
      ...
      >>> plan_collection(tables, features, mesh, batch_size=4096, memory_per_device="8MiB")
      Traceback (most recent call last):
      ...
      ValueError: no layout of the collection fits memory_per_device=8.0 MiB ...

      A serving plan: as floats the item table does not fit whole in 64 MiB, so its columns
      are split (8 a device); as int4 a row takes 32 bytes and its float16 scale and bias 4
      more, so every device holds it whole and serves its lookups without a collective:

      >>> def served(precision):
      ...     plan = plan_collection(tables, features, mesh, batch_size=4096, backend="gpu",
      ...                            memory_per_device="64MiB", serving=True,
      ...                            precision=precision)
      ...     return plan.placements["item"], plan.tables[0].memory_bytes
      >>> served(None), served("int4")
      (('columns', 32000000), ('replicated', 36000000))
    """
    by_name = check_configs(tables, features)
    budget = parse_bytes(memory_per_device)
    names = tuple(getattr(mesh, "axis_names", ()))
    if not names:
        raise ValueError(f"plan_collection needs a Mesh or AbstractMesh, got {mesh!r}")
    sizes = dict(zip(names, (int(s) for s in mesh.axis_sizes), strict=True))
    axes = tuple(a for a in names if sizes[a] > 1) if batch_axes is None else tuple(batch_axes)
    unknown = [a for a in axes if a not in sizes]
    n_batch = math.prod(sizes[a] for a in axes if a in sizes)
    if unknown or batch_size < 1 or batch_size % n_batch:
        raise ValueError(
            f"batch_size={batch_size} over batch_axes={axes} of mesh {sizes}: the axes must "
            f"be mesh axes and the batch a positive multiple of {n_batch}"
            + (f" (unknown: {unknown})" if unknown else "")
        )
    served = _check_precision(precision, by_name)
    if serving is None:
        serving = bool(served)
    if served and not serving:
        raise ValueError(
            f"precision={precision!r} with serving=False: quantized tables are inference-only "
            "(no gradient reaches them), so plan them with serving=True, or plan the training "
            "step of float tables without precision"
        )
    if serving and optimizer is not None:
        raise ValueError(
            f"optimizer={optimizer!r} in a serving plan: a serving step updates nothing, so "
            "leave optimizer=None (or plan the training step with serving=False)"
        )
    formula = getattr(optimizer, "formula", optimizer)
    slots = (True,) if formula is None else tuple(s.per_row for s in formula.slots)
    slots = () if serving else slots
    if backend is None:
        backend = cost.check_backend(backend_of(mesh), source="the mesh's platform")
    cost.check_backend(backend)
    ctx = Context(
        mesh=mesh, sizes=sizes, batch_size=int(batch_size), batch_axes=axes, state_slots=slots,
        stats=id_stats, constants=cost.load_constants(backend), update=not serving,
        precision=served,
    )  # fmt: skip
    auto = sorted(
        (t for t in tables if t.placement == "auto"),
        key=lambda t: (-t.vocab_size * t.dim * np.dtype(t.dtype).itemsize, t.name),
    )
    current = {t.name: "rows" if "rows" in _choices(t, sizes) else "replicated" for t in auto}

    def configs(choice: Mapping[str, str]) -> list[TableConfig]:
        # the planner's placements, and the row sharding of every table it places or that
        # leaves its row sharding to it ("auto")
        out = []
        for t in tables:
            if t.name not in choice and t.row_sharding != "auto":
                out.append(t)
                continue
            placement = choice.get(t.name, t.placement)
            row_sharding = _row_sharding(ctx, t, placement)
            out.append(dataclasses.replace(t, placement=placement, row_sharding=row_sharding))
        return out

    def price(choice: Mapping[str, str]) -> LayoutCost | str:
        try:
            return evaluate(ctx, configs(choice), features)
        except LayoutError as e:  # a placement the table's axes do not allow
            return str(e)

    best = evaluate(ctx, configs(current), features)
    if best.peak_bytes > budget:  # then the layout that needs the least memory, or none
        current, best = _search(auto, current, best, price, sizes, _memory_key, None)
        if best.peak_bytes > budget:
            raise ValueError(_infeasible(best, budget, by_name))
    current, best = _search(auto, current, best, price, sizes, _time_key, budget)
    # A second start: every table that can be table-wise, each looked up by its owner alone
    # (`jaxembed.kernels.tablewise`); single moves from there reach layouts that moves from
    # all-rows do not (the few tables that overload their owner back to rows).
    whole = {t.name: "table" if "table" in _choices(t, sizes) else current[t.name] for t in auto}
    start = price(whole) if whole != current else None
    if not isinstance(start, str | None) and start.peak_bytes <= budget:
        other, found = _search(auto, whole, start, price, sizes, _time_key, budget)
        if (round(found.step_ms, 9), found.peak_bytes) < (round(best.step_ms, 9), best.peak_bytes):
            current, best = other, found
    reasons = {}
    for t in auto:  # every alternative of each table, against the final layout
        results = {p: best if p == current[t.name] else price({**current, t.name: p})
                   for p in _choices(t, sizes)}  # fmt: skip
        reasons[t.name] = _reason(current[t.name], results, budget)
    return _assemble(ctx, best, budget, reasons, tables)


def _search(auto, current, best, price, sizes, key, budget):
    """Single-table moves, largest first, then moves of the k smallest tables of one dim
    together (tables that share a stack share its collectives: one small table alone
    rarely pays for a call of its own, several may), until no move lowers `key` (the step
    or the memory) within `budget` (None: any)."""
    cohorts: dict[tuple, list[TableConfig]] = {}
    for t in reversed(auto):  # smallest first
        cohorts.setdefault((t.dim, np.dtype(t.dtype).name), []).append(t)
    moves = [[t] for t in auto]
    moves += [group[:k] for group in cohorts.values() for k in range(2, len(group) + 1)]
    for _ in range(_PASSES):
        changed = False
        for tables in moves:
            options = set.intersection(*(set(_choices(t, sizes)) for t in tables))
            for placement in sorted(options, key=_CHOICES.index):
                if all(current[t.name] == placement for t in tables):
                    continue
                choice = {**current, **{t.name: placement for t in tables}}
                c = price(choice)
                if isinstance(c, str) or (budget is not None and c.peak_bytes > budget):
                    continue
                if key(c, placement) < key(best, current[tables[0].name]):
                    current, best, changed = choice, c, True
        if not changed:
            break
    return current, best


def _dynamic_note(t: TableConfig, row_shards: int) -> str:
    """A dynamic table's line says so, and what its remap state (split with its rows over
    `row_shards`; 1: whole, replicated or table-wise) adds to each device's memory."""
    if t.dynamic is None:
        return ""
    d = t.dynamic
    return (f"; dynamic ({d.policy}, admit after {d.admit_after}): + "
            f"{format_bytes(d.shard(row_shards).state_bytes)} remap state a device")  # fmt: skip


def _reason(chosen: str, results: dict[str, Any], budget: int) -> str:
    mine = results[chosen]
    parts = []
    for p, c in results.items():
        if p == chosen:
            continue
        if isinstance(c, str):
            parts.append(f"{p} n/a")
        elif c.peak_bytes > budget:
            parts.append(f"{p} needs {format_bytes(c.peak_bytes)}")
        else:
            parts.append(f"{p} {c.step_ms - mine.step_ms:+.3f} ms")
    return f"fastest that fits ({mine.step_ms:.3f} ms); " + ", ".join(parts)


def _infeasible(c: LayoutCost, budget: int, by_name: dict[str, TableConfig]) -> str:
    need = c.peak_bytes
    head = (
        f"no layout of the collection fits memory_per_device={format_bytes(budget)} "
        f"({budget} bytes): the smallest needs {format_bytes(need)} ({need} bytes) per device "
        f"(tables and optimizer state "
        f"{format_bytes(c.allocated_bytes)}, activations and buffers "
        f"{format_bytes(c.buffer_bytes)}). "
    )
    fix = f"raise memory_per_device to at least {need} bytes, use more devices, "
    if c.buffer_bytes > budget:
        return head + (
            f"The batch's activations and exchange buffers alone need "
            f"{format_bytes(c.buffer_bytes)}: {fix}or a smaller batch_size"
        )
    total, breaker = c.buffer_bytes, None
    for name, n in sorted(c.table_bytes.items(), key=lambda kv: (-kv[1], kv[0])):
        total += n
        if total > budget:
            breaker = name
            break
    breaker = breaker or max(c.table_bytes, key=c.table_bytes.get)
    t = by_name[breaker]
    return head + (
        f"Table {breaker!r} ({t.vocab_size} x {t.dim}, {format_bytes(c.table_bytes[breaker])} "
        f"per device as {c.layout.placement(breaker).placement!r}) breaks the budget (adding "
        f"the tables largest first): {fix}or shrink the tables"
    )


def _assemble(ctx, best: LayoutCost, budget, reasons, tables) -> CollectionPlan:
    layout = best.layout
    share: dict[str, tuple[float, float, str]] = {}
    feats = {f.name: f for f in layout.features}
    for c in best.calls:
        slots = sum(feats[f].max_ids or 1 for f in c.features)
        for f in c.features:
            part = (feats[f].max_ids or 1) / slots
            wire, ms, exchange = share.get(feats[f].table, (0.0, 0.0, c.exchange))
            share[feats[f].table] = (wire + part * c.wire_bytes, ms + part * c.modelled_ms,
                                     exchange)  # fmt: skip
    rows = []
    for t in best.tables:
        p = layout.placement(t.name)
        wire, ms, exchange = share.get(t.name, (0.0, 0.0, "-"))
        rows.append(TablePlan(
            name=t.name, vocab_size=t.vocab_size, dim=t.dim, placement=p.placement,
            row_sharding=p.row_sharding, stack=layout.stacks[p.stack].name, exchange=exchange,
            wire_bytes=wire, modelled_ms=ms, memory_bytes=best.table_bytes[t.name],
            reason=reasons.get(t.name, "fixed by its config")
            + _block_note(ctx, t, p.placement, p.row_sharding)
            + _unseen_note(ctx, t, p.placement, p.row_sharding)
            + _dynamic_note(t, layout.state_shards(t.name)),
        ))  # fmt: skip
    routes = any(c.exchange == "routed" for c in best.calls)
    stats = ctx.stats
    ids = ("measured: " + f"{stats.num_batches} batches of {stats.batch_size:g}" if stats else
           "default: every bag full (max_ids), ids uniform over each vocabulary")  # fmt: skip
    return CollectionPlan(
        mesh_axes=tuple(ctx.sizes.items()), batch_size=ctx.batch_size,
        batch_axes=ctx.batch_axes, memory_per_device=budget, backend=ctx.constants.backend,
        ids=ids, table_configs=best.tables, tables=tuple(rows), calls=best.calls,
        step_ms=best.step_ms, allocated_bytes=best.allocated_bytes,
        buffer_bytes=best.buffer_bytes, used_bytes=best.used_bytes, update_ms=best.update_ms,
        exchange="auto" if routes else "rows", evaluations=ctx.evaluations,
        serving=not ctx.update, precision=tuple(ctx.precision.items()),
    )  # fmt: skip
