"""The modelled step and memory of one layout of a collection: the planner's inner loop.

A layout (`jaxembed.collection.layout_collection`) makes one `embedding_bag` call per stack
and combiner (max-pooled features apart), exactly as `jaxembed.kernels.collection` runs it:
pooled features of similar widths stacked `[batch, F, max_ids]` (the dense form), others'
dense ids side by side, `[batch, Σ max_ids]`, one bag per pooled feature and one per slot of
an unpooled one, lengths made on the device (replicated); weighted (the combiners' per-slot
factors, gathered beside the ids) only where some feature of the call is mean- or
sqrtn-pooled or says its input carries per-id weights (`FeatureConfig.weighted`), as the
lookup passes them (`jaxembed.kernels.collection.needs_factors`). Each call is planned with
`plan_embedding_bag(..., update=True)` once per exchange that applies, and per device:

    time   = Σ calls  the plan's modelled ms of the cheapest exchange (lookup and backward:
                      wire bytes / link + rows touched · row bytes / memory + latency per
                      collective), + what the row-sparse update sends besides (the ids
                      moved into its body again; a per-row state's row sum over a split
                      hidden axis), + moving the output to the batch layout and its
                      gradient back where the lookup leaves it elsewhere (columns)
           + max over devices of the optimizer state its update reads and writes
             (distinct rows it owns × state bytes per row × 2 / memory bandwidth)
    memory = the stacks' shards and optimizer state (padded as allocated)
           + every call's output and output gradient + the largest call's ids, weights
             and exchange buffers.

The routed exchange is charged its exact fallback (the gather path) when the busiest
owner's expected distinct ids (pooled at the owner: id slots) exceed its static capacity:
then nearly every step falls back. Where it fits, it is sized: the capacity shrinks to what
the busiest owner expects from the sampled ids (`id_stats`: each id's slot count gives its
chance to be in a device's share of the batch), with the default's margin, and never above
the rows that owner holds; the plan's exchange carries the factor
(`"routed:source:0.0794"`). A batch's ids repeat, so a device sends an owner far fewer
distinct ids than slots, and the buffers shrink with them (the DLRM tables by mod rows on 8
devices: 2 643 places an owner instead of 34 011).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec as P

from jaxembed.collection.config import FeatureConfig, TableConfig
from jaxembed.collection.layout import CollectionLayout, Stack, layout_collection, stacked_width
from jaxembed.plan import cost
from jaxembed.plan.idstats import IdStats, distinct_draws, effective_vocab
from jaxembed.plan.lookup import plan_embedding_bag
from jaxembed.plan.specs import spec_entry
from jaxembed.plan.types import EmbeddingPlan
from jaxembed.quant import format as qformat

__all__ = ["CallCost", "Context", "LayoutCost", "LayoutError", "evaluate"]


class LayoutError(ValueError):
    """A placement the mesh or the table's axes do not allow (the planner skips it)."""


@dataclasses.dataclass
class Context:
    """What every evaluation shares (internal): the mesh, the batch, the cost constants."""

    mesh: Any
    sizes: dict[str, int]
    batch_size: int
    batch_axes: tuple[str, ...]
    state_slots: tuple[bool, ...]  # per optimizer slot: one float per row (True) or per element
    stats: IdStats | None
    constants: cost.CostConstants
    plans: dict = dataclasses.field(default_factory=dict)  # per-call plan options, cached
    evaluations: int = 0
    update: bool = True  # a training step; False: a serving step, the lookups alone
    precision: dict[str, str] = dataclasses.field(default_factory=dict)  # served quantized

    @property
    def x_spec(self) -> P:
        return P(spec_entry(self.batch_axes))

    @property
    def out_spec(self) -> P:
        return P(spec_entry(self.batch_axes), None, None)

    def mean_ids(self, f: FeatureConfig) -> float:
        """A feature's ids per bag: measured, else every slot full."""
        cap = f.max_ids or 1
        if self.stats is None or f.name not in self.stats.ids_per_bag:
            return float(cap)
        return min(float(cap), self.stats.ids_per_bag[f.name])

    def vocab_eff(self, t: TableConfig) -> float:
        """The uniform vocabulary that repeats ids as the sample did (default: the table's)."""
        s = self.stats
        if s is None or t.name not in s.ids_per_batch:
            return float(t.vocab_size)
        return effective_vocab(s.ids_per_batch[t.name], s.unique_per_batch[t.name], t.vocab_size)


def _norm(spec: P, rank: int) -> tuple:
    parts = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]
    return tuple(parts + [()] * (rank - len(parts)))


@dataclasses.dataclass(frozen=True)
class _Option:
    """One exchange of one call, from its plan (cached across layouts)."""

    name: str
    plan: EmbeddingPlan  # as the collection's lookup runs it (its own output layout)
    ms: float  # modelled step: lookup, update, output moves
    update_bytes: float
    out_move_bytes: tuple[float, float]
    transient_bytes: int
    lookup_bytes: float | None = None  # the lookup's, where the plan is not its exchange's
    again_bytes: float | None = None  # the update's second move of the ids, likewise
    owner_slots: int = 0  # a table-wise call: the slots its busiest owner walks

    @property
    def ids_again_bytes(self) -> float:
        """The update's move of the ids (and weights) into its body again: compiled in one
        step with the lookup, XLA may share the lookup's collectives instead."""
        if self.again_bytes is not None:
            return self.again_bytes
        return float(sum(c.wire_bytes for c in self.plan.backward
                         if c.why.startswith("the update moves")))  # fmt: skip

    @property
    def forward_bytes(self) -> float:
        return self.plan.forward_wire_bytes if self.lookup_bytes is None else self.lookup_bytes

    @property
    def wire_bytes(self) -> float:
        return self.forward_bytes + self.update_bytes + sum(self.out_move_bytes)


def _out_move(ctx: Context, p: EmbeddingPlan) -> tuple[float, float, int]:
    """`(forward, backward wire bytes, collectives)` of moving a lookup's output to the batch
    layout and its gradient back, where the plan leaves it elsewhere (columns: `[B, bags,
    H/K]` on every device). Modelled as XLA reshards it: an all_to_all over K each way, and
    an all_gather over the K axes the batch does not use (the batch layout replicates)."""
    out = _norm(p.out_spec, 3)
    if out == _norm(ctx.out_spec, 3):
        return 0.0, 0.0, 0
    k_axes, b_axes = out[2], out[0]
    n_k = math.prod(ctx.sizes[a] for a in k_axes)
    n_rest = math.prod(ctx.sizes[a] for a in k_axes if a not in ctx.batch_axes)
    block = math.prod(p.out_batch_shape) * p.weight_shape[1] * np.dtype(p.dtype).itemsize
    block /= math.prod(ctx.sizes[a] for a in b_axes) * n_k  # per device, either side
    a2a = cost.ring_wire_bytes("all-to-all", n_k, block)
    gather = cost.ring_wire_bytes("all-gather", n_rest, block * n_rest)
    return a2a + gather, a2a, 2 + (n_rest > 1)


def _update_extra(ctx: Context, p: EmbeddingPlan) -> tuple[float, int]:
    """`(wire bytes, collectives)` of the update plan's backward beyond the gradient's: the
    ids (lengths, weights) moved into its body again, and a per-row optimizer state's `psum`
    of each row's g² over a split hidden axis. The plan lists them; its candidates' modelled
    times do not count them (they price the exchange), so they are added here."""
    del ctx
    extra = [
        c for c in p.backward
        if c.operand == "row_sum" or c.why.startswith("the update moves")
    ]  # fmt: skip
    return sum(c.wire_bytes for c in extra), len(extra)


_OPERANDS = ("ids", "lengths", "weights")


def _weighted(combiner: str, group: Sequence[FeatureConfig]) -> bool:
    """Whether a call of `group` passes per-slot factors, as the lookup decides it
    (`needs_factors`): a summed call with a mean or sqrtn feature or a weighted input."""
    return combiner == "sum" and any(f.combiner in ("mean", "sqrtn") or f.weighted for f in group)


def _call_plan(ctx: Context, x_shape, stack: Stack, num_bags: int, combiner: str,
               dense: bool, weighted: bool, exchange: str, routed_pool: str = "auto",
               capacity_factor: float | None = None):  # fmt: skip
    """The `EmbeddingPlan` of one call of the stack with `exchange` (and `routed_pool`, and
    the routed exchange's `capacity_factor`)."""
    return plan_embedding_bag(
        ctx.mesh, x_shape, stack.shape, num_bags=None if dense else num_bags,
        combiner=combiner, weighted=weighted, x_spec=ctx.x_spec,
        lengths_spec=None if dense else P(),
        weights_spec=ctx.x_spec if weighted else None, weight_spec=stack.spec,
        dtype=stack.dtype, exchange=exchange, update=ctx.update, backend=ctx.constants.backend,
        optimizer_slots=ctx.state_slots, routed_pool=routed_pool,
        capacity_factor=capacity_factor,
    )  # fmt: skip


def _option_of(ctx: Context, stack: Stack, weighted: bool, p: EmbeddingPlan, c) -> _Option:
    """The option of running plan `p` (candidate `c` of its exchange): its modelled step with
    the output's moves and the update's second move of the ids, and its buffers."""
    k = ctx.constants
    out_fwd, out_bwd, n_out = _out_move(ctx, p)
    again, n_again = _update_extra(ctx, p)
    extra = (out_fwd + out_bwd + again) / k.link_bytes_per_s + (n_out + n_again) * k.latency_s
    ms, update_bytes = c.modelled_ms + extra * 1e3, p.backward_wire_bytes
    if not ctx.update:  # serving: the lookup's way alone
        out_bwd, update_bytes = 0.0, 0.0
        ms = _serving_seconds(ctx, stack, p, c, out_fwd, 1 + (n_out > 2) if n_out else 0)
    mem = p.memory
    return _Option(
        name=c.name, plan=p, ms=ms, update_bytes=update_bytes, out_move_bytes=(out_fwd, out_bwd),
        transient_bytes=mem.ids * (2 if weighted else 1) + mem.out + mem.exchange_buffers
        + mem.update_buffers,
    )  # fmt: skip


def _call_key(x_shape, stack: Stack, num_bags: int, combiner: str, dense: bool,
              weighted: bool) -> tuple:  # fmt: skip
    """What a call's plans depend on (`ctx.plans`' key): layouts with the same stack shape
    and calls share them."""
    return (x_shape, stack.shape, stack.spec, num_bags, combiner, stack.dtype, dense, weighted)


def _routed_variant(ctx: Context, call: tuple, pool: str, factor: float | None) -> _Option:
    """The routed option of `call` (`_options`' arguments) pooled at `pool` (`"owner"` or
    `"source"`) with capacity `factor` (None: the plan's default), cached like the options."""
    key = (*_call_key(*call), pool, factor)
    if key not in ctx.plans:
        _, stack, _, _, _, weighted = call
        p = _call_plan(ctx, *call, "routed", pool, factor)
        (c,) = [c for c in p.candidates if c.name == "routed"]
        ctx.plans[key] = _option_of(ctx, stack, weighted, p, c)
    return ctx.plans[key]


def _options(
    ctx: Context, x_shape, stack: Stack, num_bags: int, combiner: str, dense: bool, weighted: bool
):
    key = _call_key(x_shape, stack, num_bags, combiner, dense, weighted)
    if key in ctx.plans:
        return ctx.plans[key]

    def plan(exchange):
        return _call_plan(ctx, x_shape, stack, num_bags, combiner, dense, weighted, exchange)

    auto = plan("auto")
    options = {}
    for c in auto.candidates:
        p = auto if auto.exchange == c.name else plan("rows" if c.name == "none" else c.name)
        options[c.name] = _option_of(ctx, stack, weighted, p, c)
    if not ctx.update:  # the gather exchanges share their forward: keep one of them
        same = [n for n in ("none", "rows", "dense") if n in options]
        for n in same[1:]:
            del options[n]
    ctx.plans[key] = options
    return options


def _serving_seconds(ctx, stack, p, c, out_wire: float, out_count: int) -> float:
    """The modelled ms of a serving call, the lookup alone: its forward collectives and the
    output's move to the batch layout, and the rows it reads: a `1/R` share of the gathered
    slots on the gather path (each shard reads the rows it holds), the owners' rows on the
    routed one, which also buckets the slots once. Quantized rows read their packed bytes."""
    k = cost.load_constants(ctx.constants.backend, p.impl)
    routed = c.name == "routed"
    h_local = stack.dim // math.prod(ctx.sizes[a] for a in stack.hidden_axes)
    seconds = cost.modelled_seconds(
        k, wire_bytes=p.forward_wire_bytes + out_wire,
        rows=c.rows_gathered * (1.0 if routed else 1.0 / max(stack.num_shards, 1)),
        row_bytes=_row_bytes(ctx, stack, h_local), collectives=len(p.forward) + out_count,
        sorted_ids=p.routed.slots if routed and p.routed is not None else 0,
        slots=c.rows_gathered,
    )  # fmt: skip
    return seconds * 1e3


def _calls(ctx, layout, stack, whole, combiner):
    """The calls the collection makes of one stack's features of one combiner, as
    `jaxembed.kernels.collection` splits them: `[(features, stacked, table-wise)]`. A dense
    summed group's features whose tables are each whole on one shard make a table-wise call
    of their own (on a stack split over the batch's axes, the hidden axis whole)."""
    stacked = all(f.pooled for f in whole) and stacked_width(
        [f.max_ids or 1 for f in whole]) is not None  # fmt: skip
    if (not stacked or combiner != "sum" or stack.hidden_axes or stack.num_shards < 2
            or tuple(stack.row_axes) != tuple(ctx.batch_axes)):  # fmt: skip
        return [(whole, stacked, False)]
    single = [f for f in whole if len(layout.placement(f.table).shards) == 1]
    rest = [f for f in whole if len(layout.placement(f.table).shards) != 1]
    if not single:
        return [(whole, stacked, False)]
    return [(single, True, True)] + ([(rest, True, False)] if rest else [])


def _tablewise_option(ctx, layout, stack, group, width, weighted, options) -> _Option:
    """The table-wise exchange of a call (`jaxembed.kernels.tablewise`) that `_calls` made:
    a stacked summed call whose tables are each whole on one shard. Each feature's ids (and
    factors) go to its table's device in one `all_to_all`, the pooled rows come back in
    another; the update sends the ids again and the output gradients. The busiest owner walks
    `batch · F_o · L` slots (F_o: the most features one device owns)."""
    owners = [layout.placement(f.table).shards for f in group]
    held: dict[int, int] = {}
    for (o,) in owners:
        held[o] = held.get(o, 0) + 1
    n, f_o, b = stack.num_shards, max(held.values()), ctx.batch_size
    itemsize = np.dtype(stack.dtype).itemsize
    ids = b * f_o * width * 4  # each owner's [B, F_o, L], per device
    out = b * f_o * stack.dim * itemsize  # each owner's pooled [B, F_o, H] (and its gradient)
    ids_again = sum(cost.ring_wire_bytes("all-to-all", n, r) for r in (ids, ids * weighted))
    one_way = ids_again + cost.ring_wire_bytes("all-to-all", n, out)
    ways = 2 if ctx.update else 1  # serving: the lookup's way alone
    collectives = ways * (2 + int(weighted))
    base = next(iter(options.values()))
    impl = base.plan.impl
    slots = b * f_o * width
    seconds = cost.modelled_seconds(
        cost.load_constants(ctx.constants.backend, impl), wire_bytes=ways * one_way,
        rows=ways * slots, row_bytes=stack.dim * itemsize, collectives=collectives,
        sorted_ids=slots if ctx.update else 0, slots=ways * slots,
    )  # fmt: skip
    return _Option(  # its plan: the gather path's, the layouts and memory it shares
        name="table", plan=base.plan, ms=seconds * 1e3, update_bytes=one_way * (ways - 1),
        out_move_bytes=(0.0, 0.0), transient_bytes=ways * ids * (2 if weighted else 1) + ways * out,
        lookup_bytes=one_way, again_bytes=ids_again * (ways - 1), owner_slots=slots,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class CallCost:
    """One `embedding_bag` call of a layout, as modelled.

    Attributes:
      stack, stack_name: the stack's index and name.
      features: the features it reads; combiner: `"sum"` (sum, mean, sqrtn, unpooled) or
        `"max"`; the call is weighted (`plan.bag.weighted`: per-slot factors move with the
        ids) where a feature is mean- or sqrtn-pooled or `FeatureConfig.weighted`.
      x_shape, num_bags: the call's ids (`[batch, F, max_ids]` stacked, or `[batch, Σ
        max_ids]`) and its bags per example.
      exchange: the chosen exchange; plan: its `EmbeddingPlan` (the lookup's own output
        layout: what the collection's lookup compiles to).
      forward_bytes: wire bytes per device of the lookup (`plan.forward`).
      update_bytes: of the row-sparse update (`plan.backward`, the ids moved again, the
        per-row state's `row_sum` over a split hidden axis).
      out_move_bytes: `(forward, backward)`: moving the output to the batch layout, and its
        gradient back (columns).
      wire_bytes: (property) of the step: all of the above.
      modelled_ms: the plan's modelled time of the step (the same on every device).
      update_ms: per device, the optimizer state traffic of its update.
      activation_bytes, transient_bytes: per device: output and its gradient; ids, weights
        and exchange buffers.
      options: `((exchange, modelled ms), ...)` of every exchange weighed.
      note: why an exchange was charged more (a routed overflow), or "".
      ids_again_bytes: of `update_bytes`, the update's move of the ids (and weights) into its
        body again, which XLA may share with the lookup's when both are in one step.
      owner_slots: a table-wise call (`exchange="table"`): the slots its busiest owner walks,
        `batch · F_o · L` (0 for the other exchanges: their plan's candidates count them).
      routed_pool: a routed call's pooling where the planner chose it against the plan's
        own choice (`"source"`: pooled at the owner, a hot id's slots would overflow the
        owner's capacity, or it costs more once sized), or sized it, else `"auto"`.
      capacity_factor: a routed call's capacity factor where the planner sized it from
        the ids (`_routed_choice`), else None.
      fallback_forward_bytes, fallback_update_bytes: (properties) the routed fallback's.
    """

    stack: int
    stack_name: str
    features: tuple[str, ...]
    combiner: str
    x_shape: tuple[int, ...]
    num_bags: int
    exchange: str
    plan: EmbeddingPlan
    forward_bytes: float
    update_bytes: float
    out_move_bytes: tuple[float, float]
    modelled_ms: float
    update_ms: tuple[float, ...]
    activation_bytes: int
    transient_bytes: int
    options: tuple[tuple[str, float], ...]
    note: str
    ids_again_bytes: float = 0.0
    owner_slots: int = 0
    routed_pool: str = "auto"
    capacity_factor: float | None = None

    @property
    def wire_bytes(self) -> float:
        return self.forward_bytes + self.update_bytes + sum(self.out_move_bytes)

    @property
    def fallback_forward_bytes(self) -> float:
        """The routed exchange's exact fallback, compiled beside it (0 for the others): a
        compiled lookup's collectives are `forward_bytes + fallback_forward_bytes`."""
        routed = self.plan.routed
        return float(sum(c.wire_bytes for c in routed.fallback_forward)) if routed else 0.0

    @property
    def fallback_update_bytes(self) -> float:
        """Likewise for the update: its fallback's collectives (`fallback_backward`)."""
        routed = self.plan.routed
        return float(sum(c.wire_bytes for c in routed.fallback_backward)) if routed else 0.0


@dataclasses.dataclass(frozen=True)
class LayoutCost:
    """A layout's modelled step and per-device memory (see the module's docstring)."""

    tables: tuple[TableConfig, ...]
    layout: CollectionLayout
    calls: tuple[CallCost, ...]
    step_ms: float
    allocated_bytes: int  # stacks + state, per device (padded: every device the same)
    used_bytes: tuple[int, ...]  # per device: the rows it really holds, + their state
    buffer_bytes: int  # activations + the largest call's transient buffers
    table_bytes: dict[str, int]  # per table: the most it puts on one device (+ state)
    update_ms: tuple[float, ...]  # per device

    @property
    def peak_bytes(self) -> int:
        return self.allocated_bytes + self.buffer_bytes


def _device_shards(ctx: Context, stack: Stack) -> np.ndarray:
    """Per device (row-major over the mesh), the index of the stack's row shard it holds."""
    names = list(ctx.sizes)
    coords = np.indices([ctx.sizes[a] for a in names]).reshape(len(names), -1)
    shard = np.zeros(coords.shape[1], np.int64)
    for a in stack.row_axes:
        shard = shard * ctx.sizes[a] + coords[names.index(a)]
    return shard


def _shares(ctx: Context, t: TableConfig, layout: CollectionLayout, stack: Stack,
            slots: bool = False) -> np.ndarray:  # fmt: skip
    """Per row shard of the stack, its share of the table's distinct ids (`slots`: of its
    id slots)."""
    p = layout.placement(t.name)
    out = np.zeros(max(stack.num_shards, 1))
    k = len(p.shards)
    if ctx.stats is not None and k > 1:
        q = ctx.stats.shard_shares(
            t.name, vocab_size=t.vocab_size, num_shards=k, row_sharding=p.row_sharding,
            rotation=p.rotation, slots=slots,
        )  # fmt: skip
    else:
        q = np.full(k, 1.0 / k)
    out[list(p.shards)] = q
    return out


def _held_rows(layout: CollectionLayout, t: TableConfig, stack: Stack, shards) -> np.ndarray:
    """The rows of `t` that each of `shards` (row shard indices, one per device) holds; one
    array operation, so a 512-device mesh prices as fast as an 8-device one."""
    p = layout.placement(t.name)
    shards = np.asarray(shards)
    k = len(p.shards)
    if stack.row_axes:
        position = np.full(max(stack.num_shards, 1), -1)
        position[list(p.shards)] = np.arange(k)
        j = position[shards]  # the shard's place among the table's shards; -1: none of them
    else:
        j = np.zeros(shards.shape, int)
    if p.row_sharding == "mod" and k > 1:  # shard j holds the rows r = j - rotation (mod k)
        held = t.vocab_size // k + ((j - p.rotation) % k < t.vocab_size % k)
    else:
        held = np.clip(t.vocab_size - np.maximum(j, 0) * p.rows_per_shard, 0, p.rows_per_shard)
    return np.where(j >= 0, held, 0).astype(np.int64)


def _pool_of(option: _Option) -> str:
    """Where a routed option pools a bag: `"owner"` or `"source"`."""
    return "owner" if option.plan.routed.pooled_at_owner else "source"


def _bucket_of_shard(ctx: Context, stack: Stack, routed) -> np.ndarray:
    """Per row shard of the stack, the routed bucket (owner position along S) it is in."""
    row_axes = list(stack.row_axes)
    coords = np.indices([ctx.sizes[a] for a in row_axes]).reshape(len(row_axes), -1)
    bucket = np.zeros(coords.shape[1], np.int64)
    for a in routed.axes:
        bucket = bucket * ctx.sizes[a] + coords[row_axes.index(a)]
    return bucket


def _present(ctx: Context, t: TableConfig, layout: CollectionLayout, stack: Stack,
             examples: float, ids_per_example: float) -> np.ndarray | None:  # fmt: skip
    """Per row shard, the distinct ids of `t` that a device holding `examples` of the batch
    sends it, from the sample's slot counts: an id filling k of a sampled batch's slots is
    in a device's share p of the examples with probability 1 - (1 - p)^k. None without
    counts, or where a device holds more examples than a sampled batch (then
    `distinct_draws` of the duplication model, which extrapolates)."""
    s = ctx.stats
    if (
        s is None
        or not s.counts.get(t.name)
        or not s.ids_per_batch.get(t.name)
        or not 0 < examples <= s.batch_size
    ):
        return None
    p = layout.placement(t.name)
    share = examples / s.batch_size
    scale = ids_per_example * s.batch_size / s.ids_per_batch[t.name]  # the call's part

    def present(count):  # each id's chance to be among a device's examples
        if share >= 1:
            return np.ones(count.shape)
        return -np.expm1(count * scale * math.log1p(-share))

    loads = s.shard_loads(t.name, present, vocab_size=t.vocab_size, num_shards=len(p.shards),
                          row_sharding=p.row_sharding, rotation=p.rotation)  # fmt: skip
    if not loads:
        return None
    out = np.zeros(max(stack.num_shards, 1))
    out[list(p.shards)] = np.mean(loads, axis=0)
    return out


def _owner_loads(ctx, option, stack, calls_tables, layout, by_table, per_slot):
    """Per routed bucket, what a device expects to send it in a step, and at most how much
    it can: `(expected, bound, measured)`. Pooled at the owner, id slots (a hot id's slots
    all go to one owner; no bound but the capacity); else distinct ids, bounded by the rows
    the owner holds of the call's tables. `measured`: the expectation comes from the
    sample's own ids (slots: their skew; distinct ids: `_present`), not the models alone."""
    routed = option.plan.routed
    slots = routed.pooled_at_owner
    b_dev = routed.slots / per_slot  # examples a device holds
    bucket = _bucket_of_shard(ctx, stack, routed)
    load = np.zeros(routed.num_buckets)
    held = np.zeros(routed.num_buckets)
    measured = ctx.stats is not None
    for name, ids_per_example in calls_tables.items():
        t = by_table[name]
        sent = b_dev * ids_per_example
        present = None if slots else _present(ctx, t, layout, stack, b_dev, ids_per_example)
        if present is None:
            if not slots:  # the uniform-draw model: it underestimates a Zipf's new ids
                sent, measured = distinct_draws(sent, ctx.vocab_eff(t)), False
            present = sent * _shares(ctx, t, layout, stack, slots=slots)
        np.add.at(load, bucket, present)
        np.add.at(held, bucket, _held_rows(layout, t, stack, np.arange(len(bucket))))
    return load, (np.full_like(held, np.inf) if slots else held), measured


def _routed_choice(ctx, call, option, stack, calls_tables, layout, by_table, per_slot):
    """The routed option to price for `call`: `(option, pool, factor, why)`, `option` None
    where every pooling's busiest owner overflows its capacity (`why` says so).

    Each pooling the plan weighed (at the owner: slots; at the source: distinct ids) is
    sized for what its busiest owner expects from the sample, `x + 4√x + 1` (the default
    capacity's bound on `x`, see `capacity_for`; without a sample, or with batches smaller
    than a device's share, the default), and never for more than the rows that owner holds
    (a device cannot send it more distinct ids):
    the capacity factor goes to the plan, whose buffers then shrink to fit. The cheapest
    that fits is kept; `pool` is `"auto"` and `factor` None where that is the plan's own."""
    own = _pool_of(option)
    pools = ("owner", "source") if option.plan.routed.pool_costs else (own,)
    fitting, why = [], []
    for pool in pools:
        base = option if pool == own else _routed_variant(ctx, call, pool, None)
        routed = base.plan.routed
        load, bound, measured = _owner_loads(ctx, base, stack, calls_tables, layout, by_table,
                                             per_slot)  # fmt: skip
        busiest = float(load.max(initial=0.0))
        if busiest > routed.capacity:
            what = "id slots" if routed.pooled_at_owner else "distinct ids"
            why.append(f"pooled at the {pool}, its busiest owner expects {busiest:.0f} {what} "
                       f"per device, over its capacity {routed.capacity}")  # fmt: skip
            continue
        # unmeasured (no sample, or one smaller than a device's share of the batch), only
        # the rows an owner holds bound what it receives
        expect = load + 4 * np.sqrt(load) + 1 if measured else routed.capacity
        need = float(np.max(np.minimum(expect, bound), initial=1.0))
        mean = routed.slots / routed.num_buckets
        factor = _round_up(max(need, 1.0) / mean) if mean else None
        if factor is not None and math.ceil(factor * mean) > _SIZED * routed.capacity:
            factor = None  # not much tighter than the plan's own: keep its
        sized = base if factor is None else _routed_variant(ctx, call, pool, factor)
        fitting.append((sized.ms, pool, factor, sized))
    if not fitting:
        why = "; ".join(why)
        return None, own, None, f"routed would overflow: {why}, so it would run its fallback"
    _, pool, factor, sized = min(fitting, key=lambda f: (f[0], f[3].wire_bytes))
    if pool == own and factor is None:
        return sized, "auto", None, ""
    fit = f"capacity {sized.plan.routed.capacity} from the ids" if factor else "it fits"
    note = "; ".join([*why, f"pooled at the {pool}, {fit}"])
    return sized, pool, factor, note


_SIZED = 0.8
"""A routed call is sized from the ids only where that shrinks its capacity by a fifth or
more (else its plan keeps the default, and its exchange stays plain)."""


def _round_up(x: float) -> float:
    """`x` rounded up to 3 significant digits (a capacity factor a plan's exchange carries
    as text, `"routed:source:0.0789"`, and reads back exactly)."""
    e = math.floor(math.log10(x)) - 2
    return float(f"{math.ceil(round(x / 10.0**e, 9))}e{e}")


def _row_bytes(ctx: Context, stack: Stack, h_local: int) -> int:
    """A row's bytes on one device: `h_local` floats, or served quantized (`ctx.precision`)
    the packed values and, for the integer formats, a float16 scale and bias
    (`jaxembed.quant.format`). The tables of a stack are quantized together, so they must
    share a precision, as `coll.quantized` requires."""
    given = {ctx.precision.get(name) for name in stack.tables}
    if len(given) > 1:
        names = ", ".join(f"{n!r}: {ctx.precision.get(n)}" for n in stack.tables)
        raise LayoutError(
            f"tables {{{names}}} share stack {stack.name} (same dim, dtype and placement axes), "
            "which is quantized whole: give them one precision (None: float), or another "
            "dtype or placement to split the stack"
        )
    (precision,) = given
    if precision is None:
        return h_local * np.dtype(stack.dtype).itemsize
    if h_local % qformat.values_per_byte(precision):
        raise LayoutError(
            f"stack {stack.name}: {precision} cannot pack the {h_local} columns a device holds "
            f"(it packs {qformat.values_per_byte(precision)} values a byte)"
        )
    side = 0 if precision == "fp8" else 2 * 2  # float16 scale and bias
    return qformat.packed_bytes(h_local, precision) + side


REMAP_SLOT_S = 60e-9
"""Seconds a dynamic table's remap spends on each id slot a device steps on: one core at the
throughput benchmark's 35 M ids/s on two (`benchmarks/dynamic/throughput.py`), about 57 ns."""


def _remap_ms(ctx: Context, layout: CollectionLayout, t: TableConfig, features) -> float:
    """A dynamic table's remap a step: by rows with the batch split over the same axes, each
    device steps on its share of the slots (routed to their owners); otherwise (table-wise,
    replicated, or the batch split elsewhere) every device steps on every slot."""
    slots = ctx.batch_size * sum(f.max_ids or 1 for f in features if f.table == t.name)
    stack = layout.stack_of(t.name)
    routed = (layout.placement(t.name).placement == "rows"
              and tuple(stack.row_axes) == tuple(ctx.batch_axes))  # fmt: skip
    return (slots / stack.num_shards if routed else slots) * REMAP_SLOT_S * 1e3


def evaluate(
    ctx: Context, tables: Sequence[TableConfig], features: Sequence[FeatureConfig]
) -> LayoutCost:
    """The modelled step and memory of `tables` (placements resolved) on the context's mesh."""
    ctx.evaluations += 1
    try:
        layout = layout_collection(tables, features, ctx.mesh)
    except ValueError as e:
        raise LayoutError(str(e)) from None
    by_table = {t.name: t for t in tables}
    n_dev = math.prod(ctx.sizes.values())
    e_state = 4
    calls, allocated, used = [], 0, np.zeros(n_dev)
    table_bytes: dict[str, int] = {}
    update_total = np.zeros(n_dev)
    for stack in layout.stacks:
        k_cols = math.prod(ctx.sizes[a] for a in stack.hidden_axes)
        h_local = stack.dim // k_cols
        row_bytes = _row_bytes(ctx, stack, h_local)
        state_row = sum(e_state if per_row else h_local * e_state for per_row in ctx.state_slots)
        allocated += stack.local_rows * (row_bytes + state_row)
        shards = _device_shards(ctx, stack)
        for name in stack.tables:
            held = _held_rows(layout, by_table[name], stack, shards)
            used += held * (row_bytes + state_row)
            table_bytes[name] = int(held.max() * (row_bytes + state_row))
            if by_table[name].dynamic is not None:  # the remap's state, split with the rows
                remap = by_table[name].dynamic.shard(layout.state_shards(name)).state_bytes
                allocated, used = allocated + remap, used + remap
                table_bytes[name] += remap
        members = [f for f in features if layout.placement(f.table).stack == stack.index]
        for combiner in ("sum", "max"):
            whole = [f for f in members if (f.combiner == "max") == (combiner == "max")]
            if not whole:
                continue
            for group, stacked, table_wise in _calls(ctx, layout, stack, whole, combiner):
                widths = [f.max_ids or 1 for f in group]
                width = max(widths) if stacked else None
                if width is not None:  # as the lookup stacks them: [B, F, L], the dense form
                    per_slot, num_bags = len(group) * width, len(group)
                    x_shape = (ctx.batch_size, len(group), width)
                else:
                    per_slot = sum(widths)
                    num_bags = sum(1 if f.pooled else (f.max_ids or 1) for f in group)
                    x_shape = (ctx.batch_size, per_slot)
                weighted = _weighted(combiner, group)
                call = (x_shape, stack, num_bags, combiner, width is not None, weighted)
                options = dict(_options(ctx, *call))  # a copy: the cache keeps the plan's own
                ids_of: dict[str, float] = {}
                for f in group:
                    ids_of[f.table] = ids_of.get(f.table, 0.0) + ctx.mean_ids(f)
                if table_wise:  # the call of the table-placed features: table-wise only
                    options = {"table": _tablewise_option(ctx, layout, stack, group, width,
                                                          weighted, options)}  # fmt: skip
                costs, notes, repooled, factor = {}, {}, "auto", None
                for name, o in list(options.items()):
                    costs[name] = o.ms
                    if name == "routed" and "none" in options:
                        sized, pool, f, why = _routed_choice(ctx, call, o, stack, ids_of, layout,
                                                             by_table, per_slot)  # fmt: skip
                        if why:
                            notes[name] = why
                        if sized is None:  # the flag's all-reduce, then the gather path
                            costs[name] = options["none"].ms + ctx.constants.latency_s * 1e3
                        else:
                            options[name], costs[name] = sized, sized.ms
                            repooled, factor = pool, f
                best = min(options, key=lambda n: (costs[n], options[n].wire_bytes))
                o = options[best]
                rows = np.zeros(n_dev)
                for name, ids_per_example in ids_of.items():
                    t = by_table[name]
                    distinct = distinct_draws(ctx.batch_size * ids_per_example, ctx.vocab_eff(t))
                    rows += distinct * _shares(ctx, t, layout, stack)[shards]
                memory_rate = cost.load_constants(ctx.constants.backend, o.plan.impl + (
                    "-dedup" if o.plan.impl == "native" and stack.hidden_axes else ""
                )).memory_bytes_per_s  # the kernels that update this stack's rows  # fmt: skip
                update = rows * state_row * 2 / memory_rate * 1e3 * ctx.update
                update_total += update
                out_bytes = (ctx.batch_size // math.prod(ctx.sizes[a] for a in ctx.batch_axes)
                             * num_bags * stack.dim * np.dtype(stack.dtype).itemsize)  # fmt: skip
                out_bytes *= 1 if ctx.update else 0.5  # serving: no output gradient
                calls.append(CallCost(
                    stack=stack.index, stack_name=stack.name,
                    features=tuple(f.name for f in group), combiner=combiner,
                    x_shape=x_shape, num_bags=num_bags, exchange=best, plan=o.plan,
                    forward_bytes=o.forward_bytes, update_bytes=o.update_bytes,
                    out_move_bytes=o.out_move_bytes, modelled_ms=costs[best],
                    update_ms=tuple(float(u) for u in update), activation_bytes=2 * out_bytes,
                    transient_bytes=o.transient_bytes,
                    options=tuple((n, costs[n]) for n in options),
                    note="; ".join(notes.values()), ids_again_bytes=o.ids_again_bytes,
                    owner_slots=o.owner_slots, routed_pool=repooled if best == "routed" else "auto",
                    capacity_factor=factor if best == "routed" else None,
                ))  # fmt: skip
    buffers = sum(c.activation_bytes for c in calls) + max(
        (c.transient_bytes for c in calls), default=0
    )
    step = sum(c.modelled_ms for c in calls) + float(update_total.max(initial=0.0))
    step += sum(_remap_ms(ctx, layout, t, features) for t in tables if t.dynamic is not None)
    return LayoutCost(
        tables=tuple(tables), layout=layout, calls=tuple(calls), step_ms=step,
        allocated_bytes=int(allocated), used_bytes=tuple(int(u) for u in used),
        buffer_bytes=int(buffers), table_bytes=table_bytes,
        update_ms=tuple(float(u) for u in update_total),
    )  # fmt: skip
