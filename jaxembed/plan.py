"""The execution plan of a sharded lookup: layouts, collectives, bytes, memory.

`plan_embedding` asks the rules (`jaxembed.rules`) how the lookup must be laid out, resolves
what they call a conflict by moving the ids or the output gradient (never the table), and
writes down every collective of the forward and the backward with its mesh axes and its
bytes. The kernels in `jaxembed.ops` execute a plan; they decide nothing themselves.

Derivation, with R the mesh axes that split the table's rows and K those that split its
hidden axis:

1. The ids run in the layout the output asks for, restricted to the *free* mesh axes (outside
   R, K and the output's unreduced axes): for each batch axis, the longest prefix of the
   output's mesh axes that are free. The ids are resharded to it (a gather or a free slice).
2. The local lookup is partial over R (the forward rule). For each axis of R, the output
   either splits a batch axis over it (`psum_scatter`, sequence parallel), keeps it
   unreduced, or is summed over it (`psum`).
3. The backward is the transpose: `psum_scatter` -> `all_gather` of out_grad; `psum` ->
   nothing. The gradient is then partial over the batch axes B (the grad rule), resolved by
   the cheaper of `dense` (`psum` of the gradient shard over B) and `rows` (`all_gather` of
   ids and out_grad over B before the scatter-add).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from jax.sharding import PartitionSpec as P

from jaxembed import layout, rules
from jaxembed.hlo import ring_wire_bytes
from jaxembed.layout import entry_mesh_axes

__all__ = [
    "Collective",
    "EmbeddingPlan",
    "MemoryEstimate",
    "format_bytes",
    "format_plan",
    "plan_embedding",
]

GradientExchange = Literal["auto", "dense", "rows"]
_GRAD_ACCUM_BYTES = 4  # gradients accumulate in float32


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the plan, per device.

    An `EmbeddingPlan` lists them in `forward` and `backward`, in the order they run; the
    compiled program has the same collectives (`jaxembed.hlo.Collective` reads them back).

    Attributes:
      phase: `"forward"` or `"backward"`.
      op: `psum`, `psum_scatter`, `all_gather`, or `reshard` (left to XLA, outside the body).
      axes: mesh axis names it runs over.
      operand: what travels: `ids`, `out`, `out_grad`, `weight_grad`.
      shape: per-device shape of the result.
      dtype: element type name.
      result_bytes: bytes of the per-device result.
      wire_bytes: bytes each device sends under the ring model (DESIGN.md).
      why: a short reason.

    Examples:
      >>> import jax
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
      >>> plan = plan_embedding(mesh, (16, 128), (65536, 128),
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
class MemoryEstimate:
    """Per-device bytes of the buffers the lookup holds.

    Attributes:
      table_shard: the device's shard of the table, `[V/R, H/K]` in the table's dtype.
      ids: the ids in the layout the kernel runs them in.
      out: the kernel's output block, `[*batch / ids layout, H/K]`.
      weight_grad_f32: the gradient shard, accumulated in float32.
      exchange_buffers: the gathered ids and output gradients of the rows exchange (0 for
        the dense exchange).
      peak_backward: (property) `weight_grad_f32 + exchange_buffers + out`.

    Examples:
      >>> import jax
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
      >>> memory = plan_embedding(mesh, (16, 128), (65536, 128), x_spec=P("data", None),
      ...                         weight_spec=P("model", None)).memory
      >>> memory.table_shard // 2**20, memory.out // 2**10, memory.peak_backward
      (8, 512, 9969664)
    """

    table_shard: int
    ids: int
    out: int
    weight_grad_f32: int
    exchange_buffers: int

    @property
    def peak_backward(self) -> int:
        return self.weight_grad_f32 + self.exchange_buffers + self.out


@dataclasses.dataclass(frozen=True)
class EmbeddingPlan:
    """What `jaxembed.embedding` runs for one mesh, shapes and layouts.

    `str(plan)` prints it as a table. All specs are `PartitionSpec`s over `mesh_axes`.

    Attributes:
      mesh_axes: `((name, size), ...)` of the mesh.
      x_shape, weight_shape: global shapes of the ids and the (possibly padded) table.
      vocab_size: real rows of the table; rows at or past it are padding.
      padding_idx: the id whose row is zero and gets no gradient, or None.
      dtype, ids_dtype: element types of the table and the ids.
      x_spec: the ids' layout as given; `ids_spec`: the layout the kernel runs them in.
      weight_spec: the table's layout (never changed).
      body_out_spec: the layout the kernel's body produces; `out_spec`: the one returned
        (equal, or reached by a final `reshard` that XLA performs).
      row_axes, hidden_axes: mesh axes splitting the table's rows and hidden axis (R, K).
      batch_axes: mesh axes splitting the ids in the kernel (B): the gradient is partial
        over them.
      scatters: `((out_dim, axes), ...)`: forward `psum_scatter`s, backward `all_gather`s.
      psum_axes: R axes the forward sums over; unreduced_axes: R axes left unreduced.
      gradient_exchange: `"dense"`, `"rows"`, or `"none"` when B is empty.
      exchange_reason: why; dense_exchange_bytes / rows_exchange_bytes: both sides.
      forward, backward: every collective, in order.
      memory: per-device buffer sizes.
      forward_rule, grad_rule: the rules' answers the plan was derived from.

    Properties give derived values: `rows_per_shard`, `table_shard_shape`,
    `batch_gathers`, `needs_out_reshard`, `forward_wire_bytes`, `backward_wire_bytes`.

    Examples:
      >>> import jax
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
      >>> plan = plan_embedding(mesh, (16, 128), (65536, 128),
      ...                       x_spec=P("data", None), weight_spec=P("model", None))
      >>> plan.row_axes, plan.batch_axes, plan.table_shard_shape, plan.gradient_exchange
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
    gradient_exchange: str
    exchange_reason: str
    dense_exchange_bytes: float
    rows_exchange_bytes: float
    forward: tuple[Collective, ...]
    backward: tuple[Collective, ...]
    memory: MemoryEstimate
    forward_rule: rules.SpmdInfo
    grad_rule: rules.SpmdInfo

    @property
    def rows_per_shard(self) -> int:
        return self.weight_shape[0] // self._size(self.row_axes)

    @property
    def table_shard_shape(self) -> tuple[int, int]:
        return (self.rows_per_shard, self.weight_shape[1] // self._size(self.hidden_axes))

    @property
    def batch_gathers(self) -> tuple[tuple[int, tuple[str, ...]], ...]:
        """`((ids_dim, axes), ...)`: how the rows exchange gathers ids and out_grad."""
        out = []
        for dim, entry in enumerate(self.ids_spec.partitions):
            axes = _entry_names(entry)
            if axes:
                out.append((dim, axes))
        return tuple(out)

    @property
    def needs_out_reshard(self) -> bool:
        return self.body_out_spec != self.out_spec

    @property
    def forward_wire_bytes(self) -> float:
        return sum(c.wire_bytes for c in self.forward)

    @property
    def backward_wire_bytes(self) -> float:
        return sum(c.wire_bytes for c in self.backward)

    def wire_bytes_over(self, mesh_axes: Sequence[str]) -> float:
        """Wire bytes per device of the collectives that run over any of `mesh_axes`.

        With those mesh axes spanning hosts, this is the traffic that leaves a host (per
        device, ring model): pick the host-spanning axis that makes it smallest. Reshards
        left to XLA count when they gather over one of them.
        """
        wanted = set(mesh_axes)
        unknown = wanted - {n for n, _ in self.mesh_axes}
        if unknown:
            raise ValueError(f"{sorted(unknown)} are not axes of the plan's mesh {self.mesh_axes}")
        return sum(c.wire_bytes for c in (*self.forward, *self.backward) if wanted & set(c.axes))

    def _size(self, axes: Sequence[str]) -> int:
        sizes = dict(self.mesh_axes)
        return math.prod(sizes[a] for a in axes)

    def __str__(self) -> str:
        return format_plan(self)


def _entry_names(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _spec_entry(axes: Sequence[str]) -> Any:
    axes = tuple(axes)
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def _as_spec(spec: Any) -> P:
    if spec is None:
        return P()
    if isinstance(spec, P):
        return spec
    if isinstance(spec, tuple | list):
        return P(*spec)
    raise TypeError(f"expected a PartitionSpec, got {spec!r}")


def _itemsize(dtype: Any) -> int:
    return np.dtype(dtype).itemsize


def _local_shape(shape: Sequence[int], entries: Sequence[tuple[str, ...]], sizes) -> tuple:
    return tuple(
        d // math.prod(sizes[a] for a in axes) for d, axes in zip(shape, entries, strict=True)
    )


def _reshard_bytes(shape, src, dst, sizes, itemsize) -> float:
    """Bytes of XLA's reshard from `src` to `dst` entries: gathers cost, slices are free."""
    # The gather lands on the common refinement: per axis, the src axes also kept in dst.
    kept = [tuple(a for a in s if a in d) for s, d in zip(src, dst, strict=True)]
    gathered = {a for s, k in zip(src, kept, strict=True) for a in s if a not in k}
    if not gathered:
        return 0.0
    n = math.prod(sizes[a] for a in gathered)
    result = math.prod(_local_shape(shape, kept, sizes)) * itemsize
    return ring_wire_bytes("all-gather", n, result)


def _check_divides(what: str, dim: int, axes: tuple[str, ...], sizes, fix: str) -> None:
    n = math.prod(sizes[a] for a in axes)
    if dim % n:
        shown = ", ".join(f"{a!r} (size {sizes[a]})" for a in axes)
        padded = -(-dim // n) * n
        raise ValueError(
            f"{what} {dim} does not divide mesh axis {shown} (shards: {n}): "
            + fix.format(padded=padded, dim=dim, n=n)
        )


def plan_embedding(
    mesh: Any,
    x_shape: Sequence[int],
    weight_shape: Sequence[int],
    *,
    x_spec: Any = None,
    weight_spec: Any = None,
    out_spec: Any = None,
    padding_idx: int | None = None,
    vocab_size: int | None = None,
    dtype: Any = np.float32,
    ids_dtype: Any = np.int32,
    gradient_exchange: GradientExchange = "auto",
) -> EmbeddingPlan:
    """Plans a sharded lookup `weight[x]` and its gradient on `mesh`.

    Args:
      mesh: a `jax.sharding.Mesh` or `AbstractMesh`.
      x_shape: global shape of the ids, any rank.
      weight_shape: global shape of the table `[vocab (padded), hidden]`.
      x_spec: the ids' `PartitionSpec` (None: replicated).
      weight_spec: the table's `PartitionSpec` (None: replicated). Never changed.
      out_spec: the output's `PartitionSpec`; `unreduced={...}` keeps partial sums over row
        axes (Explicit meshes only). None: the ids' layout plus the table's hidden split.
      padding_idx: an id in `[0, vocab_size)` whose row reads as zero and gets no gradient.
      vocab_size: the real rows (default `weight_shape[0]`); rows past it are padding.
      dtype: the table's element type; ids_dtype: the ids'.
      gradient_exchange: `"auto"` (fewest bytes), `"dense"` or `"rows"`.

    Returns:
      An `EmbeddingPlan`.

    Raises:
      ValueError: a table not 2-D, unknown mesh axes, specs longer than ranks, a split that
        does not divide, `padding_idx` or `vocab_size` out of range, an impossible out_spec.

    Examples:
      >>> import jax
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
      >>> plan = plan_embedding(mesh, (16, 128), (65536, 128),
      ...                       x_spec=P("data", None), weight_spec=P("model", None))
      >>> [(c.op, c.axes) for c in plan.forward]
      [('psum', ('model',))]
      >>> plan.gradient_exchange, [(c.op, c.axes, c.operand) for c in plan.backward]
      ('rows', [('all_gather', ('data',), 'ids'), ('all_gather', ('data',), 'out_grad')])
    """
    names = layout.axis_names_of(mesh)
    sizes = dict(zip(names, _mesh_sizes(mesh), strict=True))
    explicit = _is_explicit(mesh)
    return _plan_cached(
        tuple(sizes.items()),
        explicit,
        tuple(int(d) for d in x_shape),
        tuple(int(d) for d in weight_shape),
        _as_spec(x_spec),
        _as_spec(weight_spec),
        None if out_spec is None else _as_spec(out_spec),
        padding_idx,
        vocab_size,
        np.dtype(dtype).name,
        np.dtype(ids_dtype).name,
        gradient_exchange,
    )


def _mesh_sizes(mesh: Any) -> tuple[int, ...]:
    sizes = getattr(mesh, "axis_sizes", None)
    if sizes is None:
        raise TypeError(f"expected a jax.sharding.Mesh or AbstractMesh, got {mesh!r}")
    return tuple(int(s) for s in sizes)


def _is_explicit(mesh: Any) -> bool:
    types = getattr(mesh, "axis_types", ())
    return bool(types) and all(str(t).endswith("Explicit") for t in types)


@functools.lru_cache(maxsize=256)
def _plan_cached(
    mesh_axes, explicit, x_shape, weight_shape, x_spec, weight_spec, out_spec,
    padding_idx, vocab_size, dtype, ids_dtype, gradient_exchange,
) -> EmbeddingPlan:  # fmt: skip
    names = tuple(n for n, _ in mesh_axes)
    sizes = dict(mesh_axes)
    if gradient_exchange not in ("auto", "dense", "rows"):
        raise ValueError(
            f"gradient_exchange must be 'auto', 'dense' or 'rows', got {gradient_exchange!r}"
        )
    if len(weight_shape) != 2:
        raise ValueError(f"weight must be a 2-D table [vocab, hidden], got shape {weight_shape}")
    num_rows, hidden = weight_shape
    vocab_size = num_rows if vocab_size is None else vocab_size
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int | np.integer):
        raise TypeError(f"vocab_size must be an int, got {vocab_size!r}")
    if not 1 <= vocab_size <= num_rows:
        raise ValueError(
            f"vocab_size must be in [1, {num_rows}] (the table's rows), got {vocab_size}"
        )
    if padding_idx is not None:
        if isinstance(padding_idx, bool) or not isinstance(padding_idx, int | np.integer):
            raise TypeError(f"padding_idx must be an int or None, got {padding_idx!r}")
        if not 0 <= padding_idx < vocab_size:
            raise ValueError(
                f"padding_idx must be in [0, {vocab_size}) (the vocabulary), got {padding_idx}"
            )

    # Layouts as dims mappings, through the bridge (it checks names, ranks and repeats).
    x_dm = _named(layout.to_dims_mapping(x_spec, names, len(x_shape)), names)
    w_dm = _named(layout.to_dims_mapping(weight_spec, names, 2), names)
    if layout.to_partial_dims(weight_spec, names) or layout.to_partial_dims(x_spec, names):
        raise ValueError("the table and the ids cannot be unreduced (partial sums)")
    row_axes, hidden_axes = w_dm
    _check_divides(
        "vocab (table rows)", num_rows, row_axes, sizes,
        "pad the table to {padded} rows and pass vocab_size={dim}, "
        "or split rows over a smaller mesh axis.",
    )  # fmt: skip
    _check_divides(
        "hidden", hidden, hidden_axes, sizes,
        "use a hidden size that is a multiple of {n}, or do not split the hidden axis.",
    )  # fmt: skip
    table_axes = set(row_axes) | set(hidden_axes)
    x_spec = P(*(_spec_entry(e) for e in x_dm))  # normalized: one entry per ids axis

    # The output's layout: requested, or the ids' layout with the table's hidden split.
    n = len(x_shape)
    if out_spec is None:
        out_entries = [tuple(a for a in e if a not in hidden_axes) for e in x_dm]
        out_entries.append(hidden_axes)
        unreduced: tuple[str, ...] = ()
        out_spec = P(*(_spec_entry(e) for e in out_entries))
    else:
        out_entries = _named(layout.to_dims_mapping(out_spec, names, n + 1), names)
        unreduced = tuple(names[a] for a in sorted(layout.to_partial_dims(out_spec, names)))
        stray = [a for a in unreduced if a not in row_axes]
        if stray:
            raise ValueError(
                f"out_spec {out_spec} keeps {stray} unreduced, but the lookup is partial only "
                f"over the table's row axes {row_axes}: drop them from unreduced"
            )
        if unreduced and not explicit:
            raise ValueError(
                f"out_spec {out_spec} has unreduced axes, which need a mesh whose axes are all "
                "AxisType.Explicit: make the mesh with jax.make_mesh(..., axis_types="
                "(AxisType.Explicit, ...)) or request a reduced output"
            )
        for dim, (d, e) in enumerate(zip((*x_shape, hidden), out_entries, strict=True)):
            _check_divides(f"output axis {dim} of size", d, e, sizes, "choose another out_spec.")

    free = set(names) - table_axes - set(unreduced)
    ids_entries, scatters, body_entries = [], [], []
    for dim in range(n):
        wanted = out_entries[dim]
        k = 0
        while k < len(wanted) and wanted[k] in free:
            k += 1
        scattered = []
        while k + len(scattered) < len(wanted) and wanted[k + len(scattered)] in row_axes:
            scattered.append(wanted[k + len(scattered)])
        ids_entries.append(wanted[:k])
        body_entries.append(wanted[:k] + tuple(scattered))
        if scattered:
            scatters.append((dim, tuple(scattered)))
    body_entries.append(hidden_axes)
    scattered_axes = {a for _, axes in scatters for a in axes}
    psum_axes = tuple(a for a in row_axes if a not in scattered_axes and a not in unreduced)
    if unreduced:
        body_out_spec = P(*(_spec_entry(e) for e in body_entries), unreduced=set(unreduced))
    else:
        body_out_spec = P(*(_spec_entry(e) for e in body_entries))
    ids_spec = P(*(_spec_entry(e) for e in ids_entries))

    # Ask the rules: the forward is partial over R, the gradient over the batch axes.
    idx = {a: i for i, a in enumerate(names)}
    ids_dm = tuple(layout.normalize_entry(tuple(idx[a] for a in e)) for e in ids_entries)
    w_rule_dm = tuple(layout.normalize_entry(tuple(idx[a] for a in e)) for e in w_dm)
    x_ds = rules.DistSpec(x_shape, ids_dm)
    w_ds = rules.DistSpec(weight_shape, w_rule_dm)
    forward_rule = rules.embedding_forward(x_ds, w_ds)
    out_rule = forward_rule.outputs[0]
    grad_rule = rules.embedding_grad(
        x_ds, w_ds, rules.DistSpec(out_rule.shape, out_rule.dims_mapping)
    )
    assert {names[a] for a in out_rule.partial_dims} == set(row_axes)
    assert grad_rule.outputs[0].dims_mapping == w_rule_dm
    batch_axes = tuple(names[a] for a in sorted(grad_rule.outputs[0].partial_dims))

    # Bytes, per device.
    e, e_ids = _itemsize(dtype), _itemsize(ids_dtype)
    ids_local = _local_shape(x_shape, ids_entries, sizes)
    out_local = (*ids_local, hidden // math.prod(sizes[a] for a in hidden_axes))
    forward: list[Collective] = []
    backward: list[Collective] = []

    def collective(phase, op, axes, operand, shape, dtype, wire, why) -> Collective:
        nbytes = math.prod(shape) * _itemsize(dtype)
        return Collective(phase, op, tuple(axes), operand, tuple(shape), dtype, nbytes, wire, why)

    if tuple(x_dm) != tuple(ids_entries):
        gathered = {a for s in x_dm for a in s} - {a for s in ids_entries for a in s}
        wire = _reshard_bytes(x_shape, x_dm, ids_entries, sizes, e_ids)
        why = f"ids {x_spec} -> {ids_spec}: the ids move, the table stays"
        forward.append(
            collective(
                "forward", "reshard", sorted(gathered), "ids", ids_local, ids_dtype, wire, why
            )
        )
    shape = list(out_local)
    for dim, axes in scatters:
        k = math.prod(sizes[a] for a in axes)
        before = tuple(shape)
        shape[dim] //= k
        result = math.prod(shape) * e
        why = f"sum the row shards; out_spec splits axis {dim}"
        forward.append(
            collective(
                "forward",
                "psum_scatter",
                axes,
                "out",
                shape,
                dtype,
                ring_wire_bytes("reduce-scatter", k, result),
                why,
            )
        )
        why = f"transpose of the forward psum_scatter on axis {dim}"
        wire = ring_wire_bytes("all-gather", k, math.prod(before) * e)
        backward.insert(
            0, collective("backward", "all_gather", axes, "out_grad", before, dtype, wire, why)
        )
    if psum_axes:
        k = math.prod(sizes[a] for a in psum_axes)
        wire = ring_wire_bytes("all-reduce", k, math.prod(shape) * e)
        why = "sum the row shards (each holds its rows, zeros elsewhere)"
        forward.append(collective("forward", "psum", psum_axes, "out", shape, dtype, wire, why))
    if body_out_spec != out_spec:
        full = (*x_shape, hidden)
        body = [tuple(b) for b in body_entries]
        final_local = _local_shape(full, out_entries, sizes)
        wire = _reshard_bytes(full, body, out_entries, sizes, e)
        why = f"out {body_out_spec} -> {out_spec}, done by XLA"
        forward.append(collective("forward", "reshard", (), "out", final_local, dtype, wire, why))
        wire = _reshard_bytes(full, out_entries, body, sizes, e)
        why = f"out_grad {out_spec} -> {body_out_spec}, done by XLA"
        backward.insert(
            0, collective("backward", "reshard", (), "out_grad", shape, dtype, wire, why)
        )

    # The gradient exchange over the batch axes B.
    nb = math.prod(sizes[a] for a in batch_axes)
    grad_shard_shape = (num_rows // math.prod(sizes[a] for a in row_axes), out_local[-1])
    grad_shard = math.prod(grad_shard_shape) * _GRAD_ACCUM_BYTES
    dense_bytes = ring_wire_bytes("all-reduce", nb, grad_shard)
    # The rows exchange gathers ids and out_grad one split ids axis at a time, as the body does.
    rows_gathers: list[Collective] = []
    ids_shape, grad_shape = list(ids_local), list(out_local)
    for dim, axes in ((d, e) for d, e in enumerate(ids_entries) if e):
        k = math.prod(sizes[a] for a in axes)
        ids_shape[dim] *= k
        grad_shape[dim] *= k
        why = f"rows exchange: gather the batch's ids axis {dim} before the scatter-add"
        wire = ring_wire_bytes("all-gather", k, math.prod(ids_shape) * e_ids)
        rows_gathers.append(
            collective("backward", "all_gather", axes, "ids", ids_shape, ids_dtype, wire, why)
        )
        wire = ring_wire_bytes("all-gather", k, math.prod(grad_shape) * e)
        rows_gathers.append(
            collective("backward", "all_gather", axes, "out_grad", grad_shape, dtype, wire, why)
        )
    rows_bytes = sum(c.wire_bytes for c in rows_gathers)
    if not batch_axes:
        exchange, reason = "none", "the ids are not split: every device sees the whole batch"
    elif gradient_exchange != "auto":
        exchange, reason = gradient_exchange, f"forced by gradient_exchange={gradient_exchange!r}"
    elif rows_bytes <= dense_bytes:
        exchange = "rows"
        reason = (
            f"rows {format_bytes(rows_bytes)} <= dense {format_bytes(dense_bytes)}: the batch's "
            "ids and output gradients are smaller than the gradient shard"
        )
    else:
        exchange = "dense"
        reason = (
            f"dense {format_bytes(dense_bytes)} < rows {format_bytes(rows_bytes)}: the batch's "
            "output gradients outweigh the gradient shard"
        )
    exchange_buffers = 0
    if exchange == "rows":  # every device scatter-adds the whole batch into its own shard
        backward.extend(rows_gathers)
        exchange_buffers = math.prod(x_shape) * e_ids + math.prod(grad_shape) * _GRAD_ACCUM_BYTES
    elif exchange == "dense":
        backward.append(collective(
            "backward", "psum", batch_axes, "weight_grad", grad_shard_shape, "float32",
            dense_bytes, "dense exchange: sum the partial gradient shards",
        ))  # fmt: skip

    memory = MemoryEstimate(
        table_shard=grad_shard // _GRAD_ACCUM_BYTES * e,
        ids=math.prod(ids_local) * e_ids,
        out=math.prod(out_local) * e,
        weight_grad_f32=grad_shard,
        exchange_buffers=exchange_buffers,
    )
    return EmbeddingPlan(
        mesh_axes=tuple(mesh_axes),
        x_shape=x_shape,
        weight_shape=(num_rows, hidden),
        vocab_size=int(vocab_size),
        padding_idx=None if padding_idx is None else int(padding_idx),
        dtype=dtype,
        ids_dtype=ids_dtype,
        x_spec=x_spec,
        ids_spec=ids_spec,
        weight_spec=P(*(_spec_entry(e) for e in w_dm)),
        body_out_spec=body_out_spec,
        out_spec=out_spec,
        row_axes=row_axes,
        hidden_axes=hidden_axes,
        batch_axes=batch_axes,
        scatters=tuple(scatters),
        psum_axes=psum_axes,
        unreduced_axes=unreduced,
        gradient_exchange=exchange,
        exchange_reason=reason,
        dense_exchange_bytes=dense_bytes,
        rows_exchange_bytes=rows_bytes,
        forward=tuple(forward),
        backward=tuple(backward),
        memory=memory,
        forward_rule=forward_rule,
        grad_rule=grad_rule,
    )


def _named(dims_mapping, names) -> list[tuple[str, ...]]:
    return [tuple(names[a] for a in entry_mesh_axes(e)) for e in dims_mapping]


def format_bytes(n: float) -> str:
    """Bytes for people: `512 B`, `4.0 KiB`, `1.3 MiB`, `2.0 GiB`.

    >>> format_bytes(1536), format_bytes(3 * 2**20)
    ('1.5 KiB', '3.0 MiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def format_plan(plan: EmbeddingPlan) -> str:
    """A readable table of the plan (what `str(plan)` and `jaxembed plan` print)."""
    mesh = " x ".join(f"{n}={s}" for n, s in plan.mesh_axes)
    vocab = f"{plan.vocab_size}" + (
        f" (table padded to {plan.weight_shape[0]})"
        if plan.vocab_size < plan.weight_shape[0]
        else ""
    )
    lines = [
        f"EmbeddingPlan  mesh: {mesh}",
        f"  table   {plan.dtype}{list(plan.weight_shape)}  vocab {vocab}  layout {plan.weight_spec}"
        f"  shard {list(plan.table_shard_shape)}",
        f"  ids     {plan.ids_dtype}{list(plan.x_shape)}  given {plan.x_spec}"
        f"  runs as {plan.ids_spec}",
        f"  out     {plan.out_spec}"
        + (f"  (body emits {plan.body_out_spec})" if plan.needs_out_reshard else ""),
        f"  rows split over {plan.row_axes or '-'}, hidden over {plan.hidden_axes or '-'}, "
        f"batch over {plan.batch_axes or '-'}"
        + (f", padding_idx {plan.padding_idx}" if plan.padding_idx is not None else ""),
        "",
        f"  {'phase':<9}{'collective':<14}{'axes':<18}{'operand':<12}{'per-device result':<26}"
        f"{'wire bytes':>12}",
    ]
    for c in (*plan.forward, *plan.backward):
        res = f"{c.dtype}{list(c.shape)}"
        lines.append(
            f"  {c.phase:<9}{c.op:<14}{','.join(c.axes) or '-':<18}{c.operand:<12}{res:<26}"
            f"{format_bytes(c.wire_bytes):>12}"
        )
    if not plan.forward and not plan.backward:
        lines.append("  (no collectives)")
    m = plan.memory
    lines += [
        "",
        f"  wire bytes per device: forward {format_bytes(plan.forward_wire_bytes)}, "
        f"backward {format_bytes(plan.backward_wire_bytes)}",
        f"  gradient exchange: {plan.gradient_exchange} ({plan.exchange_reason})",
        f"  memory per device: table shard {format_bytes(m.table_shard)}, "
        f"ids {format_bytes(m.ids)}, out {format_bytes(m.out)}, "
        f"weight_grad f32 {format_bytes(m.weight_grad_f32)}, "
        f"exchange buffers {format_bytes(m.exchange_buffers)}",
    ]
    return "\n".join(lines)
