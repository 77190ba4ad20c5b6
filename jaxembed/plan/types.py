"""The plan's data: moves, collectives, exchange candidates, memory, `EmbeddingPlan` itself.

Plain frozen dataclasses that compare and hash; `jaxembed.plan.lookup` builds them. This
module imports nothing from `jaxembed.plan`: every other plan module may import it. The
formatters (`jaxembed.plan.format`) sit above it; the face `jaxembed.plan` makes
`str(plan)` print their table.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from jax.sharding import PartitionSpec as P

from jaxembed import rules

__all__ = [
    "COMBINERS",
    "BagGeometry",
    "Collective",
    "EmbeddingPlan",
    "Entries",
    "ExchangeCandidate",
    "MemoryEstimate",
    "Move",
    "Operand",
    "RoutedPlan",
]

COMBINERS = ("sum", "mean", "sqrtn", "max")

Entries = tuple[tuple[str, ...], ...]
"""A layout: the mesh axes splitting each array axis, major first."""


@dataclasses.dataclass(frozen=True)
class Move:
    """One step of a layout change inside a `shard_map` body (`jaxembed.plan.moves`).

    Attributes:
      op: `"all_gather"` (tiled, over `axes` along `dim`) or `"slice"` (this device's block
        along `dim` by its position on `axes`).
      dim: the array axis.
      axes: mesh axis names, major first.
    """

    op: str
    dim: int
    axes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the plan, per device.

    An `EmbeddingPlan` lists them in `forward` and `backward`, in the order they run; the
    compiled program has the same collectives (`jaxembed.hlo.Collective` reads them back).

    Attributes:
      phase: `"forward"` or `"backward"`.
      op: `psum`, `psum_scatter`, `all_gather` or `all_to_all`.
      axes: mesh axis names it runs over.
      operand: what travels: `ids`, `lengths`, `weights`, `out`, `out_grad`, `weight_grad`.
      shape: per-device shape of the result.
      dtype: element type name.
      result_bytes: bytes of the per-device result.
      wire_bytes: bytes each device sends under the ring model (DESIGN.md).
      why: a short reason.

    Examples:
      >>> import jax, jaxembed
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
      >>> plan = jaxembed.plan_embedding(mesh, (16, 128), (65536, 128),
      ...                       x_spec=P("data", None), weight_spec=P("model", None))
      >>> c = plan.forward[0]                      # sum the row shards of the output
      >>> c.op, c.axes, c.operand, c.shape, c.dtype, c.wire_bytes
      ('psum', ('model',), 'out', (8, 128, 128), 'float32', 786432.0)
    """

    phase: str
    op: str
    axes: tuple[str, ...]
    operand: str
    shape: tuple[int, ...]
    dtype: str
    result_bytes: int
    wire_bytes: float
    why: str


@dataclasses.dataclass(frozen=True)
class ExchangeCandidate:
    """One way to resolve the gradient's partial sum, as the plan weighed it.

    Attributes:
      name: `"dense"`, `"rows"`, `"routed"` or `"none"` (nothing to exchange).
      wire_bytes: forward + backward bytes per device with this exchange.
      rows_gathered: table rows one device gathers in the forward.
      rows_scattered: table rows one device scatters (or updates) in the backward.
      modelled_ms: the cost model's time for the step's lookup, per device.
      why: what it does, or why it does not apply.
    """

    name: str
    wire_bytes: float
    rows_gathered: int
    rows_scattered: int
    modelled_ms: float
    why: str


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-device bytes of the buffers the lookup holds.

    Attributes:
      table_shard: the device's shard of the table, `[V/R, H/K]` in the table's dtype.
      ids: the ids in the layout the kernel runs them in.
      out: the kernel's output block, `[*batch / ids layout, H/K]`.
      weight_grad_f32: the gradient shard, accumulated in float32.
      exchange_buffers: the gathered ids and output gradients of the rows exchange, or the
        routed exchange's send and receive buffers (0 for the dense exchange).
      touched_rows: the id slots one device scatters (a gradient) or updates (a row-sparse
        update): an upper bound on the distinct rows it touches.
      update_buffers: a row-sparse update's buffers: the touched rows, their gradients and
        their optimizer state, float32 (0 for a gradient plan; it builds `weight_grad_f32`).
      state_bytes: the optimizer state's shard (0 unless the plan was made for an update with
        its optimizer's slots).
      gathered_table: the table's shard gathered over the weight gather's axes, `[V/R, H/K']`
        in the table's dtype, live in the forward only (0 without the weight gather).
      peak_backward: (property) `weight_grad_f32 + update_buffers + exchange_buffers + out`.
      peak_bytes: (property) the larger of `gathered_table + out` and `peak_backward`.

    Examples:
      >>> import jax, jaxembed
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
      >>> memory = jaxembed.plan_embedding(mesh, (16, 128), (65536, 128), x_spec=P("data", None),
      ...                         weight_spec=P("model", None)).memory
      >>> memory.table_shard // 2**20, memory.out // 2**10, memory.peak_backward
      (8, 512, 9969664)
    """

    table_shard: int
    ids: int
    out: int
    weight_grad_f32: int
    exchange_buffers: int
    touched_rows: int = 0
    update_buffers: int = 0
    state_bytes: int = 0
    gathered_table: int = 0

    @property
    def peak_backward(self) -> int:
        return self.weight_grad_f32 + self.update_buffers + self.exchange_buffers + self.out

    @property
    def peak_bytes(self) -> int:
        """The step's own largest live buffers: the forward's gathered table and output, or
        the backward's (`peak_backward`), whichever is larger (the table shard not counted)."""
        return max(self.gathered_table + self.out, self.peak_backward)


@dataclasses.dataclass(frozen=True)
class BagGeometry:
    """How a bag lookup's ids map onto its pooled output.

    Attributes:
      form: `"dense"` (ids `[*batch, L]`, a bag per row, output `[*batch, H]`) or `"flat"`
        (ids `[*lead, N]` with lengths `[*lead, B]`, output `[*lead, B, H]`).
      num_bags: bags per lead element (1 for the dense form).
      combiner: `"sum"`, `"mean"`, `"sqrtn"` or `"max"`.
      weighted: whether per-id weights scale the rows.
    """

    form: str
    num_bags: int
    combiner: str
    weighted: bool


@dataclasses.dataclass(frozen=True)
class Operand:
    """A batch operand that travels with the ids (ids, lengths, weights), per layout."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    given: P
    spec: P  # the layout inside the kernel
    moves: tuple[Move, ...]


@dataclasses.dataclass(frozen=True)
class EmbeddingPlan:
    """What `jaxembed.embedding` (or `embedding_bag`) runs for one mesh, shapes and layouts.

    `str(plan)` prints it as a table. All specs are `PartitionSpec`s over `mesh_axes`.

    Attributes:
      mesh_axes: `((name, size), ...)` of the mesh.
      x_shape, weight_shape: global shapes of the ids and the (possibly padded) table.
      vocab_size: real rows of the table; rows at or past it are padding.
      padding_idx: the id whose row is zero and gets no gradient, or None.
      dtype, ids_dtype: element types of the table and the ids.
      x_spec: the ids' layout as given; `ids_spec`: the layout the kernel runs them in.
      weight_spec: the table's layout (never changed; the kernels never move the table).
      body_out_spec: the layout the kernel's body produces before its last move; `out_spec`:
        the one returned (reached inside the kernel by `out_moves`).
      row_axes, hidden_axes: mesh axes splitting the table's rows and hidden axis (R, K).
      batch_axes: mesh axes splitting the output's batch inside the kernel (B): the gradient
        is partial over them.
      scatters: `((out_dim, axes), ...)`: forward `psum_scatter`s, backward `all_gather`s.
      psum_axes: R axes the forward sums over; unreduced_axes: R axes left unreduced.
      bag_split_axes: mesh axes over which each device pools only its range of bags (flat
        bags whose output splits the bag axis over free mesh axes).
      batch_gathers: `((out_dim, axes), ...)`: the rows exchange gathers, one output batch
        axis at a time, the batch operands that have that axis and then out_grad.
      exchange: `"dense"`, `"rows"`, `"routed"`, or `"none"` when B is empty.
      exchange_reason: why; `candidates`: every exchange weighed, with bytes, work and
        modelled time.
      operands: the batch operands (ids, and for bags lengths and weights) with their moves.
      out_moves: the output's moves from `body_out_spec` to `out_spec`; `grad_moves`: the
        output gradient's moves back, the backward's first step.
      forward, backward: every collective, in order.
      memory: per-device buffer sizes.
      forward_rule, grad_rule: the rules' answers the plan was derived from.
      bag: the bag geometry, or None for a plain lookup.
      row_sharding: `"block"` (contiguous row blocks) or `"mod"` (id i on shard i mod n).
      backend: the platform the cost model was evaluated for.
      for_update: planned for a row-sparse update (`jaxembed.optim`): no dense exchange.
      routed: the routed exchange's `jaxembed.plan.routed.RoutedPlan` when `exchange` is
        `"routed"` (its capacity, buckets and the exact fallback's collectives), else None.
      impl: the shard-local kernels that run: `"xla"` or `"native"` (C++ on CPU).
      out_type_spec: in an Explicit mesh whose axes of size 1 the caller's layouts name, the
        output's type with them (the kernels retype it, free: a split into one piece), else
        None.
      table_move: `"none"` (the table stays; ids and activations move) or `"gather"`
        (FSDP's weight gather: the table's shard is all-gathered over `gathered_axes` for the
        step and its gradient reduce-scattered back over them, `jaxembed.plan.table_moves`).
      gathered_axes: G, the table's hidden axes the weight gather gathers (empty for
        `"none"`); the body runs the table as `(R, K less G)`, and `batch_axes` leaves G out
        (the reduce-scatter sums over G).
      move_reason, move_alternatives: why this move, and `((move, wire bytes, peak bytes),
        ...)` of every move priced (empty where the table's hidden axes split no batch).

    Every spec names no mesh axis of size 1 (a split into one piece): plans drop them, so no
    collective or copy spans a group of one device.

    Properties give derived values: `rows_per_shard`, `table_shard_shape`,
    `gradient_exchange`, `forward_wire_bytes`, `backward_wire_bytes`.

    Examples:
      >>> import jax, jaxembed
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
      >>> plan = jaxembed.plan_embedding(mesh, (16, 128), (65536, 128),
      ...                       x_spec=P("data", None), weight_spec=P("model", None))
      >>> plan.row_axes, plan.batch_axes, plan.table_shard_shape, plan.exchange
      (('model',), ('data',), (16384, 128), 'rows')
      >>> plan.out_spec == P("data", None, None)
      True
      >>> print(plan)
      EmbeddingPlan  mesh: data=2 x model=4
      ...
        phase    collective    axes              operand     per-device result           wire bytes
        forward  psum          model             out         float32[8, 128, 128]         768.0 KiB
        backward all_gather    data              ids         int32[16, 128]                 4.0 KiB
        backward all_gather    data              out_grad    float32[16, 128, 128]        512.0 KiB
      ...

      With `data` spanning hosts, the bytes that leave a host per device:

      >>> plan.wire_bytes_over(["data"]), plan.wire_bytes_over(["model"])
      (528384.0, 786432.0)
    """

    mesh_axes: tuple[tuple[str, int], ...]
    x_shape: tuple[int, ...]
    weight_shape: tuple[int, int]
    vocab_size: int
    padding_idx: int | None
    dtype: str
    ids_dtype: str
    x_spec: P
    ids_spec: P
    weight_spec: P
    body_out_spec: P
    out_spec: P
    row_axes: tuple[str, ...]
    hidden_axes: tuple[str, ...]
    batch_axes: tuple[str, ...]
    scatters: tuple[tuple[int, tuple[str, ...]], ...]
    psum_axes: tuple[str, ...]
    unreduced_axes: tuple[str, ...]
    bag_split_axes: tuple[str, ...]
    batch_gathers: tuple[tuple[int, tuple[str, ...]], ...]
    exchange: str
    exchange_reason: str
    candidates: tuple[ExchangeCandidate, ...]
    operands: tuple[Operand, ...]
    out_moves: tuple[Move, ...]
    grad_moves: tuple[Move, ...]
    forward: tuple[Collective, ...]
    backward: tuple[Collective, ...]
    memory: MemoryEstimate
    forward_rule: rules.SpmdInfo
    grad_rule: rules.SpmdInfo
    bag: BagGeometry | None = None
    row_sharding: str = "block"
    backend: str = "cpu"
    for_update: bool = False
    routed: RoutedPlan | None = None
    impl: str = "xla"
    out_type_spec: P | None = None
    table_move: str = "none"
    gathered_axes: tuple[str, ...] = ()
    move_reason: str = ""
    move_alternatives: tuple[tuple[str, float, int], ...] = ()

    @property
    def body_hidden_axes(self) -> tuple[str, ...]:
        """The hidden axes of the table as the body runs it: K less the gathered ones."""
        return tuple(a for a in self.hidden_axes if a not in self.gathered_axes)

    @property
    def body_table_shard_shape(self) -> tuple[int, int]:
        """The table's block in the body: `table_shard_shape`, or `[V/R, H/K']` gathered."""
        return (self.rows_per_shard, self.weight_shape[1] // self._size(self.body_hidden_axes))

    @property
    def wire_bytes(self) -> float:
        """Ring-model bytes each device sends in one step (forward and backward)."""
        return self.forward_wire_bytes + self.backward_wire_bytes

    @property
    def gradient_exchange(self) -> str:
        """The exchange's old name: the same as `exchange`."""
        return self.exchange

    @property
    def dense_exchange_bytes(self) -> float:
        """Backward bytes of the dense exchange (a `psum` of the gradient shard over B)."""
        return self._backward_bytes_of("dense")

    @property
    def rows_exchange_bytes(self) -> float:
        """Backward bytes of the rows exchange (ids and out_grad gathered over B)."""
        return self._backward_bytes_of("rows")

    def _backward_bytes_of(self, name: str) -> float:
        forward = sum(c.wire_bytes for c in self.forward)
        for c in self.candidates:
            if c.name == name:
                return c.wire_bytes - forward
        return 0.0  # not a candidate here (no batch axes, or an update): nothing to send

    @property
    def mesh_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.mesh_axes)

    @property
    def num_row_shards(self) -> int:
        return self._size(self.row_axes)

    @property
    def rows_per_shard(self) -> int:
        return self.weight_shape[0] // self.num_row_shards

    @property
    def table_shard_shape(self) -> tuple[int, int]:
        return (self.rows_per_shard, self.weight_shape[1] // self._size(self.hidden_axes))

    @property
    def ids_operand(self) -> Operand:
        return self.operands[0]

    @property
    def out_batch_shape(self) -> tuple[int, ...]:
        """The output's shape without its hidden axis."""
        if self.bag is None:
            return self.x_shape
        if self.bag.form == "dense":
            return self.x_shape[:-1]
        return (*self.x_shape[:-1], self.bag.num_bags)

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The output's global shape, `[*out_batch_shape, H]`."""
        return (*self.out_batch_shape, self.weight_shape[1])

    @property
    def needs_out_reshard(self) -> bool:
        return bool(self.out_moves)

    @property
    def forward_wire_bytes(self) -> float:
        return sum(c.wire_bytes for c in self.forward)

    @property
    def backward_wire_bytes(self) -> float:
        return sum(c.wire_bytes for c in self.backward)

    def wire_bytes_over(self, mesh_axes: Sequence[str]) -> float:
        """Wire bytes per device of the collectives that run over any of `mesh_axes`.

        With those mesh axes spanning hosts, this is the traffic that leaves a host (per
        device, ring model): pick the host-spanning axis that makes it smallest.
        """
        wanted = set(mesh_axes)
        unknown = wanted - {n for n, _ in self.mesh_axes}
        if unknown:
            raise ValueError(f"{sorted(unknown)} are not axes of the plan's mesh {self.mesh_axes}")
        return sum(c.wire_bytes for c in (*self.forward, *self.backward) if wanted & set(c.axes))

    def _size(self, axes: Sequence[str]) -> int:
        sizes = dict(self.mesh_axes)
        return math.prod(sizes[a] for a in axes)


@dataclasses.dataclass(frozen=True)
class RoutedPlan:
    """How the routed exchange runs, per device.

    Attributes:
      axes: S, the mesh axes it routes over (the ids' and the rows' common axes).
      dim: the ids axis (and output batch axis) split over S.
      rest_axes: the table's other row axes; the owners sum their rows over them.
      num_buckets: n_S, the devices along S.
      slots: M, the id slots one device routes.
      capacity: C, the distinct ids (pooled at the owner: the slots) one device may send to
        one owner in a step.
      capacity_factor: C over the uniform expectation M / n_S (when C was not set).
      ids_spec: the layout the ids run in (split over S as well).
      forward, backward: the routed path's collectives.
      fallback_forward, fallback_backward: the exact fallback's (the gather exchange), run
        only in a step where some bucket overflowed.
      pooled_at_owner: a bag lookup (sum, mean, sqrtn, weighted) whose owners pool: each
        device sends its slots (id, bag, factor) to the owners, which pool them into partial
        sums per (source, bag) that a `psum_scatter` returns to the sources; False: each
        distinct id's row comes back and the source pools (and every plain lookup).
      pool_costs: `(variant, wire bytes, modelled ms)` of each pooling the plan weighed
        (`"source"`, `"owner"`); empty where only one applies.
    """

    axes: tuple[str, ...]
    dim: int
    rest_axes: tuple[str, ...]
    num_buckets: int
    slots: int
    capacity: int
    capacity_factor: float
    forward: tuple[Collective, ...]
    backward: tuple[Collective, ...]
    fallback_forward: tuple[Collective, ...]
    fallback_backward: tuple[Collective, ...]
    pooled_at_owner: bool = False
    pool_costs: tuple[tuple[str, float, float], ...] = ()

    @property
    def rows_looked_up(self) -> int:
        """Rows an owner gathers per step: n_S · C (every slot of every bucket)."""
        return self.num_buckets * self.capacity
