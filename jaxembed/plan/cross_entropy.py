"""The plan of a vocab-parallel softmax cross-entropy (`jaxembed.losses`).

`plan_cross_entropy` asks the rule `jaxembed.rules.cross_entropy` how the loss of
`hidden @ table.T` against integer labels is laid out on a mesh, and writes down the layouts,
the logits chunks and every collective; the kernels (`jaxembed.kernels.cross_entropy`)
execute the plan. With R the mesh axes splitting the table's rows, K its hidden axis and B
the tokens: the forward all-gathers each token's softmax statistics over R, the backward
sums the hidden gradient over R and the table's over B (see `jaxembed.losses`).

With K split, two moves are priced in ring-model wire bytes (`jaxembed.plan.cost`) and peak
memory: `"none"` runs every token on every device of K and psums each logits chunk over K;
`"gather"` (FSDP's weight gather; tokens every device of K holds are sliced over K) gathers the
table's shard over K once in the forward, keeps it for the backward, and reduce-scatters the
table's gradient back over K, so that no logits cross K. The plan takes the cheaper (or the
one asked for) and keeps the other's price. Chunks are `"auto"` by default: the largest
divisor of the rows per device whose float32 logits block fits a memory target (64 MiB).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec as P

from jaxembed import layout
from jaxembed.plan.cost import ring_wire_bytes
from jaxembed.plan.specs import validate_scalars
from jaxembed.plan.table_moves import check_table_move, choose_move, format_mib
from jaxembed.rules.cross_entropy import cross_entropy_forward, cross_entropy_grad
from jaxembed.rules.engine import DistSpec, SpmdInfo

__all__ = ["CrossEntropyPlan", "plan_cross_entropy"]

DEFAULT_MEMORY_TARGET = 64 * 2**20  # one f32 logits block per device, for "auto" chunks


@dataclasses.dataclass(frozen=True)
class CrossEntropyPlan:
    """What `vocab_parallel_cross_entropy` runs for one mesh, shapes and layouts.

    Attributes:
      mesh_axes: `((name, size), ...)` of the mesh (empty: one device, no collectives).
      hidden_shape, table_shape: global shapes; the table may be padded past `vocab_size`.
      vocab_size: the real rows; rows at or past it never enter the softmax.
      hidden_spec: the layout the kernel runs `hidden` in (given: `given_hidden_spec`).
      weight_spec: the table's layout, never changed.
      tokens_spec: the kernel's layout of labels and of the per-token loss.
      out_spec: the loss as returned: the tokens' layout of the given `hidden`.
      row_axes, hidden_axes, batch_axes: R, K and B (see the module docstring).
      rows_per_shard, chunk_rows: table rows per device, and per logits chunk.
      label_smoothing, z_loss, ignore_index: the loss's options.
      softcap: the logits' soft cap `c` (`c * tanh(logits / c)`, Gemma 2's), or None.
      forward_rule, grad_rule: the rules' answers the plan was derived from (for `"gather"`,
        on the table as the bodies see it: its hidden axis whole).
      table_move: `"none"` or `"gather"` (see the module docstring).
      dtype, table_dtype: of hidden and of the table, for the bytes.
      memory_target: the bytes `"auto"` chunks keep one float32 logits block under.
      chunk_reason, move_reason: why these chunks, and why this move.
      alternatives: `(move, wire_bytes, peak_bytes)` of every move priced.

    Properties give derived values: `num_chunks`, `local_tokens` (tokens per device),
    `collectives` (`(phase, op, axes, operand)` each), `priced_collectives` (with their
    bytes), `wire_bytes`, `peak_bytes`, `logits_block_bytes`, `saves_block` (unchunked, the
    backward reuses the forward's block), `saves_logits` (and so skips the psum of its logits
    over K), `gathered_axes`, `partial_axes` (the axes the bodies' logits are partial over),
    `body_table_spec` and `logits_spec`. `str(plan)` prints it as a table.

    Examples:
      >>> import jax
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
      >>> plan = plan_cross_entropy(mesh, (8, 128, 64), (65536, 64), hidden_spec=P("data"),
      ...                           weight_spec=P("model", None), vocab_chunk_size=4096)
      >>> plan.row_axes, plan.batch_axes, plan.rows_per_shard, plan.num_chunks
      (('model',), ('data',), 16384, 4)
      >>> plan.out_spec == P("data", None), plan.local_tokens   # the loss f32[8, 128]
      (True, 512)
      >>> print(plan)
      CrossEntropyPlan  mesh: data=2 x model=4
      ...
        forward  all_gather   model           softmax statistics                0.02 MiB
        backward psum         model           hidden_grad                       0.19 MiB
        backward psum         data            table_grad                        4.00 MiB
        total wire bytes per device and step 4.21 MiB
    """

    mesh_axes: tuple[tuple[str, int], ...]
    hidden_shape: tuple[int, ...]
    table_shape: tuple[int, int]
    vocab_size: int
    given_hidden_spec: P
    hidden_spec: P
    weight_spec: P
    tokens_spec: P
    out_spec: P
    row_axes: tuple[str, ...]
    hidden_axes: tuple[str, ...]
    batch_axes: tuple[str, ...]
    rows_per_shard: int
    chunk_rows: int
    label_smoothing: float
    z_loss: float
    ignore_index: int | None
    softcap: float | None
    forward_rule: SpmdInfo
    grad_rule: SpmdInfo
    table_move: str = "none"
    dtype: str = "float32"
    table_dtype: str = "float32"
    memory_target: int = DEFAULT_MEMORY_TARGET
    chunk_reason: str = ""
    move_reason: str = ""
    alternatives: tuple[tuple[str, float, int], ...] = ()

    @property
    def gathered_axes(self) -> tuple[str, ...]:
        """The table's hidden axes K all-gathered in the body (the weight-gathering move)."""
        return self.hidden_axes if self.table_move == "gather" else ()

    @property
    def partial_axes(self) -> tuple[str, ...]:
        """The axes the body's logits are partial over: K, unless the table is gathered."""
        return () if self.table_move == "gather" else self.hidden_axes

    @property
    def body_table_spec(self) -> P:
        """The table as the loss's bodies multiply it: `weight_spec`, or, gathered, the
        transposed `[H, V]` as `P(None, R)` (the bodies multiply `h @ tT`: see the kernel)."""
        if not self.gathered_axes:
            return self.weight_spec
        return P(None, *tuple(self.weight_spec)[:1])

    @property
    def num_chunks(self) -> int:
        return self.rows_per_shard // self.chunk_rows

    @property
    def saves_block(self) -> bool:
        """Whether the forward keeps its one block `f32[T, V/R]` for the backward: unchunked.

        The block is the exponentials `exp(z - m)` the forward summed (with `m` per token),
        so that the backward's softmax is one multiply, `exp(z - lse) = e * exp(m - lse)`,
        not a second product and a second `exp` of every logit; under a soft cap it is the
        logits (the chain rule needs `tanh(z / c)`). Chunked, each chunk is recomputed, so
        that no more than one chunk lives at a time.
        """
        return self.num_chunks == 1

    @property
    def saves_logits(self) -> bool:
        """Whether the backward skips the psum of its logits over K: the forward's block,
        whole over K, is saved (`saves_block`) where the table's hidden axis splits the
        product. Chunked, each chunk is recomputed and psummed again."""
        return bool(self.partial_axes) and self.saves_block

    @property
    def logits_spec(self) -> P:
        """The layout of the logits `[*tokens, V]` (the rule's): tokens over B, vocab over R."""
        names = [n for n, _ in self.mesh_axes]
        return layout.to_partition_spec(self.forward_rule.outputs[1].dims_mapping, names)

    @property
    def local_tokens(self) -> int:
        """Tokens each device runs (after any gather of `hidden` the layout needs)."""
        sizes = dict(self.mesh_axes)
        dm = self.forward_rule.outputs[0].dims_mapping
        names = [n for n, _ in self.mesh_axes]
        split = [math.prod(sizes[names[a]] for a in layout.entry_mesh_axes(e)) for e in dm]
        return math.prod(d // s for d, s in zip(self.hidden_shape[:-1], split, strict=True))

    @property
    def collectives(self) -> tuple[tuple[str, str, tuple[str, ...], str], ...]:
        """`(phase, op, axes, operand)` of every collective, in order (per chunk once)."""
        return tuple(c[:4] for c in self.priced_collectives)

    @property
    def priced_collectives(self) -> tuple[tuple[str, str, tuple[str, ...], str, float], ...]:
        """`(phase, op, axes, operand, wire_bytes)`: the collectives with their ring-model
        bytes per device and step, a chunked collective's bytes times the chunks."""
        return tuple(_priced_collectives(self))

    @property
    def wire_bytes(self) -> float:
        """Ring-model bytes each device sends in one step (forward and backward)."""
        return float(sum(c[4] for c in self.priced_collectives))

    @property
    def peak_bytes(self) -> int:
        """The loss's own largest buffers per device: the logits block (twice when the
        forward's is saved for the backward) and the gathered table shard `[V/R, H]`."""
        blocks = self.logits_block_bytes * (2 if self.saves_logits else 1)
        gathered = self.rows_per_shard * self.table_shape[1] * _itemsize(self.table_dtype)
        return blocks + (gathered if self.gathered_axes else 0)

    @property
    def logits_block_bytes(self) -> int:
        """Bytes of the largest logits block a device holds: f32[tokens, chunk_rows]."""
        return self.local_tokens * self.chunk_rows * 4


def plan_cross_entropy(
    mesh: Any,
    hidden_shape: tuple[int, ...],
    table_shape: tuple[int, int],
    *,
    hidden_spec: Any = None,
    weight_spec: Any = None,
    vocab_size: int | None = None,
    vocab_chunk_size: int | str | None = "auto",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    ignore_index: int | None = None,
    softcap: float | None = None,
    table_move: str = "auto",
    memory_target: int | None = None,
    dtype: Any = "float32",
    table_dtype: Any = None,
) -> CrossEntropyPlan:
    """Plans a vocab-parallel cross-entropy from the rule `jaxembed.rules.cross_entropy`.

    With the table's hidden axis split (K), two moves are priced: `"none"` runs every token
    on every device of K and psums each logits block over K; `"gather"` (FSDP's layout: the
    tokens split over K, or sliced over it where every device of K holds them, their loss and
    gradient gathered back) all-gathers the table's shard over K once in the forward, and
    reduce-scatters the table's gradient back over K. `"auto"` takes the one that sends
    fewer ring-model bytes (ties: less memory); the plan keeps the alternatives
    (`alternatives`, `move_reason`).

    Args:
      mesh: a `Mesh` or `AbstractMesh`, or None for one device.
      hidden_shape: `[*tokens, H]`; table_shape: `[V (padded), H]`.
      hidden_spec, weight_spec: the given layouts (None: replicated).
      vocab_size, label_smoothing, z_loss, ignore_index, softcap: see
        `vocab_parallel_cross_entropy`.
      vocab_chunk_size: rows per logits chunk; `"auto"` (default): the largest divisor of
        the rows per device whose f32 logits block fits `memory_target`; None: all rows.
      table_move: `"auto"`, `"gather"` or `"none"` (see above).
      memory_target: bytes of one f32 logits block per device for `"auto"` chunks
        (default 64 MiB).
      dtype, table_dtype: of hidden and of the table (default: hidden's), for the bytes.

    Returns:
      A `CrossEntropyPlan`.

    Raises:
      ValueError: a split that does not divide, a chunk that does not divide the rows a
        device holds, options out of range, mismatched shapes, `table_move="gather"` where
        the tokens cannot stay split over the table's hidden axes.

    Examples:
      >>> import jax
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
      >>> plan = plan_cross_entropy(mesh, (8, 128, 64), (65536, 64), hidden_spec=P("data"),
      ...                           weight_spec=P("model", None), vocab_chunk_size=4096)
      >>> plan.hidden_spec, plan.num_chunks, plan.logits_block_bytes // 2**20
      (P('data', None, None), 4, 8)
      >>> [(op, axes) for _, op, axes, _ in plan.collectives]
      [('all_gather', ('model',)), ('psum', ('model',)), ('psum', ('data',))]
    """
    if mesh is None:
        names: tuple[str, ...] = ()
        sizes: dict[str, int] = {}
    else:
        names = layout.axis_names_of(mesh)
        sizes = dict(zip(names, (int(s) for s in mesh.axis_sizes), strict=True))
    hidden_shape = tuple(int(d) for d in hidden_shape)
    table_shape = tuple(int(d) for d in table_shape)
    if len(table_shape) != 2:
        raise ValueError(f"table must be a 2-D table [vocab, hidden], got shape {table_shape}")
    check_table_move(table_move)
    vocab_size = validate_scalars(table_shape[0], vocab_size, None)
    validate_loss_options(label_smoothing, z_loss, ignore_index, hidden_spec, weight_spec)
    softcap = validate_softcap(softcap)
    target = DEFAULT_MEMORY_TARGET if memory_target is None else int(memory_target)
    if target < 1:
        raise ValueError(f"memory_target must be a positive number of bytes, got {memory_target}")
    h_dm = layout.to_dims_mapping(hidden_spec, names, len(hidden_shape))
    w_dm = layout.to_dims_mapping(weight_spec, names, 2)
    row_axes, hidden_axes = table_axes(table_shape, w_dm, names, sizes, vocab_size)
    rows = table_shape[0] // math.prod(sizes[a] for a in row_axes)
    common = dict(
        mesh_axes=tuple(sizes.items()),
        hidden_shape=hidden_shape,
        table_shape=table_shape,
        vocab_size=int(vocab_size),
        given_hidden_spec=layout.to_partition_spec(h_dm, names),
        weight_spec=layout.to_partition_spec(w_dm, names),
        out_spec=layout.to_partition_spec(h_dm[:-1], names),
        row_axes=row_axes,
        hidden_axes=hidden_axes,
        rows_per_shard=rows,
        label_smoothing=float(label_smoothing),
        z_loss=float(z_loss),
        ignore_index=None if ignore_index is None else int(ignore_index),
        softcap=softcap,
        dtype=np.dtype(dtype).name,
        table_dtype=np.dtype(dtype if table_dtype is None else table_dtype).name,
        memory_target=target,
    )
    plans, refused = {}, ""
    for move in ("none", "gather"):
        # The gathered table is, to the rule, a table whose hidden axis is whole; hidden's
        # tokens, where K does not split them, are sliced over K (free: every device of K
        # holds them all), so that each device of K runs its share of the tokens.
        body_w = w_dm if move == "none" else (w_dm[0], -1)
        body_h = h_dm if move == "none" else _tokens_over(h_dm, hidden_shape, hidden_axes,
                                                          names, sizes)  # fmt: skip
        forward = cross_entropy_forward(
            DistSpec(hidden_shape, body_h), DistSpec(table_shape, body_w)
        )
        grad = cross_entropy_grad(DistSpec(hidden_shape, body_h), DistSpec(table_shape, body_w))
        batch = tuple(names[a] for a in sorted(grad.outputs[1].partial_dims))
        if move == "gather":
            missing = [a for a in hidden_axes if a not in batch]
            if not hidden_axes or missing:
                refused = (
                    "the table's hidden axis is not split: there is nothing to gather"
                    if not hidden_axes
                    else f"hidden uses {tuple(missing)} for another dim, or no token dim "
                    "divides over them (gathering the table there would not make each "
                    "device's share of the work smaller)"
                )
                continue
        partial = dataclasses.replace(
            _EMPTY, **common, hidden_spec=layout.to_partition_spec(
                forward.inputs[0].dims_mapping, names),
            tokens_spec=layout.to_partition_spec(forward.outputs[0].dims_mapping, names),
            batch_axes=batch, chunk_rows=rows, forward_rule=forward, grad_rule=grad,
            table_move=move,
        )  # fmt: skip
        chunk, why = chunk_rows(rows, vocab_chunk_size, table_shape, row_axes,
                                tokens=partial.local_tokens, target=target)  # fmt: skip
        plans[move] = dataclasses.replace(partial, chunk_rows=chunk, chunk_reason=why)
    if table_move == "gather" and "gather" not in plans:
        raise ValueError(
            f"table_move='gather' needs hidden's tokens split (or free to split) over the "
            f"table's hidden axes, but "
            f"{refused}: hidden {common['given_hidden_spec']}, table "
            f"{common['weight_spec']}; "
            + (f"split hidden's tokens over {hidden_axes}, or " if hidden_axes else "")
            + "pass table_move='none' (or 'auto')"
        )
    costs = {m: (p.wire_bytes, p.peak_bytes) for m, p in plans.items()}
    pick, why, alternatives = choose_move(table_move, costs, refused)
    return dataclasses.replace(plans[pick], move_reason=why, alternatives=alternatives)


def _tokens_over(h_dm, hidden_shape, axes, names, sizes):
    """hidden's dims mapping with its tokens also split over the mesh `axes` (names) that no
    dim of it uses: the first token dim they divide takes them, minor to its own axes. The
    mapping as given where an axis is used already or no token dim divides."""
    index = {n: i for i, n in enumerate(names)}
    used = {a for e in h_dm for a in layout.entry_mesh_axes(e)}
    free = [index[a] for a in axes if index[a] not in used]
    if not free:
        return h_dm
    for d, e in enumerate(h_dm[:-1]):
        have = layout.entry_mesh_axes(e)
        ways = math.prod(sizes[names[a]] for a in (*have, *free))
        if hidden_shape[d] % ways == 0:
            entry = layout.normalize_entry((*have, *free))
            return (*h_dm[:d], entry, *h_dm[d + 1 :])
    return h_dm


def _itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize


def _priced_collectives(plan: CrossEntropyPlan):
    """The plan's collectives with their ring-model bytes (see `CrossEntropyPlan`)."""
    sizes = dict(plan.mesh_axes)
    n = lambda axes: math.prod(sizes[a] for a in axes)
    t, rows, h = plan.local_tokens, plan.rows_per_shard, plan.table_shape[1]
    h_body = h // n(plan.partial_axes)  # the hidden width the body multiplies
    f32, t_item, h_item = 4, _itemsize(plan.table_dtype), _itemsize(plan.dtype)
    out = []
    move = _hidden_move(plan)
    if move is not None:  # a reshard XLA writes as it likes: priced as a gather, an estimate
        op, axes, result = move
        operand = "hidden" if op == "all_gather" else "hidden (estimate)"
        out.append(("forward", op, axes, operand,
                    ring_wire_bytes("all-gather", n(axes), result * h_item)))  # fmt: skip
    tokens_moved = _tokens_move(plan)
    if tokens_moved:  # labels (int32) go where the tokens run
        out.append(("forward", "all_gather", tokens_moved, "labels",
                    ring_wire_bytes("all-gather", n(tokens_moved), t * 4)))  # fmt: skip
    gathered = plan.gathered_axes
    table_block = rows * h * t_item  # the gathered shard f[V/R, H], kept for the backward
    if gathered:
        out.append(("forward", "all_gather", gathered, "table shard",
                    ring_wire_bytes("all-gather", n(gathered), table_block)))  # fmt: skip
    k = plan.partial_axes
    chunk = ring_wire_bytes("all-reduce", n(k), t * plan.chunk_rows * f32) * plan.num_chunks
    if k:
        out.append(("forward", "psum", k, "logits chunk", chunk))
        # A capped logit is not linear in the rows: its sum is taken chunk by chunk.
        capped = plan.softcap is not None
        operand = "label logit" if capped else "label logit and logit sum"
        stats = (1 if capped else 2) * t * f32  # f32[T] once or twice
        out.append(("forward", "psum", k, operand, ring_wire_bytes("all-reduce", n(k), stats)))
    r = plan.row_axes
    if r:
        out.append(("forward", "all_gather", r, "softmax statistics",
                    ring_wire_bytes("all-gather", n(r), n(r) * 4 * t * f32)))  # fmt: skip
    if tokens_moved:  # a per-token cotangent (reduction="none") goes where the tokens run
        out.append(("backward", "all_gather", tokens_moved, "loss cotangent",
                    ring_wire_bytes("all-gather", n(tokens_moved), t * f32)))  # fmt: skip
    if k and not plan.saves_logits:
        out.append(("backward", "psum", k, "logits chunk", chunk))
    if r:
        out.append(("backward", "psum", r, "hidden_grad",
                    ring_wire_bytes("all-reduce", n(r), t * h_body * f32)))  # fmt: skip
    grad_block = rows * (h // n(plan.hidden_axes)) * f32  # the table's own shard, f32
    if gathered:
        out.append(("backward", "psum_scatter", gathered, "table_grad",
                    ring_wire_bytes("reduce-scatter", n(gathered), grad_block)))  # fmt: skip
    rest = tuple(a for a in plan.batch_axes if a not in gathered)
    if rest:
        out.append(("backward", "psum", rest, "table_grad",
                    ring_wire_bytes("all-reduce", n(rest), grad_block)))  # fmt: skip
    if move is not None and move[0] != "all_gather":  # hidden_grad back: more than a slice
        out.append(("backward", move[0], move[1], "hidden_grad (estimate)",
                    ring_wire_bytes("all-gather", n(move[1]), move[2] * h_item)))  # fmt: skip
    sliced = _hidden_slice(plan)
    if sliced:  # hidden was sliced into the kernel's layout: loss and gradient gather back
        names = [a for a, _ in plan.mesh_axes]
        given_dm = layout.to_dims_mapping(plan.given_hidden_spec, names, len(plan.hidden_shape))
        split = n(tuple(names[a] for e in given_dm for a in layout.entry_mesh_axes(e)))
        given = math.prod(plan.hidden_shape) // split  # elements a device holds, given layout
        out.insert(len([c for c in out if c[0] == "forward"]),
                   ("forward", "all_gather", sliced, "per-token loss (reduction='none')",
                    ring_wire_bytes("all-gather", n(sliced), given // h * f32)))  # fmt: skip
        out.append(("backward", "all_gather", sliced, "hidden_grad",
                    ring_wire_bytes("all-gather", n(sliced), given * h_item)))  # fmt: skip
    return out


def _axes_only_in(plan: CrossEntropyPlan, spec: P, other: P, ndim: int) -> tuple[str, ...]:
    """The mesh axes some dim of `spec` uses that the same dim of `other` does not."""
    names = [a for a, _ in plan.mesh_axes]
    a = layout.to_dims_mapping(spec, names, ndim)
    b = layout.to_dims_mapping(other, names, ndim)
    only = set()
    for x, y in zip(a, b, strict=True):
        only |= set(layout.entry_mesh_axes(x)) - set(layout.entry_mesh_axes(y))
    return tuple(names[i] for i in sorted(only))


def _hidden_slice(plan: CrossEntropyPlan) -> tuple[str, ...]:
    """The mesh axes the kernel's hidden layout adds to the given one where it drops none (a
    slice in the forward, an all-gather of hidden_grad in the backward)."""
    if _hidden_move(plan) is not None:
        return ()
    ndim = len(plan.hidden_shape)
    return _axes_only_in(plan, plan.hidden_spec, plan.given_hidden_spec, ndim)


def _tokens_move(plan: CrossEntropyPlan) -> tuple[str, ...]:
    """The mesh axes the tokens give up between hidden's given layout and the kernel's."""
    ndim = len(plan.hidden_shape) - 1
    return _axes_only_in(plan, plan.out_spec, plan.tokens_spec, ndim)


def _hidden_move(plan: CrossEntropyPlan):
    """`(op, axes, result elements)` of moving `hidden` from its given layout into the
    kernel's (None when it is already there or only sliced): an all-gather over the axes it
    drops, or a "reshard" when it also takes new ones (the hidden axis over K)."""
    names = [a for a, _ in plan.mesh_axes]
    sizes = dict(plan.mesh_axes)
    ndim = len(plan.hidden_shape)
    given = layout.to_dims_mapping(plan.given_hidden_spec, names, ndim)
    kernel = layout.to_dims_mapping(plan.hidden_spec, names, ndim)
    g_axes = [set(layout.entry_mesh_axes(e)) for e in given]
    k_axes = [set(layout.entry_mesh_axes(e)) for e in kernel]
    dropped = set().union(*(g - k for g, k in zip(g_axes, k_axes, strict=True)))
    added = set().union(*(k - g for g, k in zip(g_axes, k_axes, strict=True)))
    if not dropped:
        return None
    axes = tuple(names[a] for a in sorted(dropped))
    split = math.prod(math.prod(sizes[names[a]] for a in k) for k in k_axes)
    result = math.prod(plan.hidden_shape) // split
    return ("reshard" if added else "all_gather"), axes, result


def validate_loss_options(label_smoothing, z_loss, ignore_index, hidden_spec, weight_spec):
    """Checks the loss's options, and that neither layout holds partial sums."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if not z_loss >= 0.0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    if ignore_index is not None and (
        isinstance(ignore_index, bool) or not isinstance(ignore_index, int | np.integer)
    ):
        raise TypeError(f"ignore_index must be an int or None, got {ignore_index!r}")
    for what, spec in (("hidden_spec", hidden_spec), ("weight_spec", weight_spec)):
        if getattr(spec, "unreduced", None):
            raise ValueError(f"{what}={spec} holds partial sums: reduce it before the loss")


def validate_softcap(softcap: Any) -> float | None:
    """`softcap` as a float, or None; it must be a positive, finite number."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, int | float | np.integer | np.floating):
        raise TypeError(
            f"softcap must be a positive float or None, got {softcap!r} "
            f"({type(softcap).__name__}): pass a Python number such as softcap=30.0 "
            "(Gemma 2's final-logit cap); it is static, not an array"
        )
    if not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(
            f"softcap must be a positive, finite float or None, got {softcap}: logits are "
            "capped as softcap * tanh(logits / softcap) (Gemma 2 uses softcap=30.0); pass "
            "softcap=None for no cap"
        )
    return float(softcap)


def table_axes(table_shape, w_dm, names, sizes, vocab_size) -> tuple[tuple[str, ...], ...]:
    """R and K, the mesh axes splitting the table's rows and its hidden axis; both divide."""
    row_axes = tuple(names[a] for a in layout.entry_mesh_axes(w_dm[0]))
    hidden_axes = tuple(names[a] for a in layout.entry_mesh_axes(w_dm[1]))
    n_rows = math.prod(sizes[a] for a in row_axes)
    if table_shape[0] % n_rows:
        padded = -(-table_shape[0] // n_rows) * n_rows
        raise ValueError(
            f"vocab (table rows) {table_shape[0]} does not divide mesh axes {row_axes} "
            f"(shards: {n_rows}): pad the table to {padded} rows and pass "
            f"vocab_size={vocab_size}, or split rows over a smaller mesh axis."
        )
    n_hidden = math.prod(sizes[a] for a in hidden_axes)
    if table_shape[1] % n_hidden:
        raise ValueError(
            f"hidden {table_shape[1]} does not divide mesh axes {hidden_axes} (shards: "
            f"{n_hidden}): use a hidden size that is a multiple of {n_hidden}, or do not "
            "split the table's hidden axis."
        )
    return row_axes, hidden_axes


def chunk_rows(
    rows: int,
    vocab_chunk_size,
    table_shape,
    row_axes,
    *,
    tokens: int = 1,
    target: int = DEFAULT_MEMORY_TARGET,
) -> tuple[int, str]:
    """The rows of one logits chunk (all `rows` a device holds, or a divisor of them), and
    why: `"auto"` takes the largest divisor whose f32 block `[tokens, chunk]` fits `target`."""
    if isinstance(vocab_chunk_size, str):
        if vocab_chunk_size != "auto":
            raise ValueError(
                f"vocab_chunk_size must be 'auto', None or an int, got {vocab_chunk_size!r}"
            )
        fit = max(1, target // (4 * max(tokens, 1)))
        chunk = max(d for d in range(1, rows + 1) if rows % d == 0 and (d <= fit or d == 1))
        block, fits = format_mib(4 * tokens * chunk), format_mib(target)
        if chunk == rows:
            return chunk, f"auto: all {rows} rows, f32[{tokens}, {rows}] = {block} fits {fits}"
        return chunk, (
            f"auto: the largest divisor of {rows} rows whose f32[{tokens}, {chunk}] = {block} "
            f"fits {fits}"
        )
    chunk = rows if vocab_chunk_size is None else int(vocab_chunk_size)
    if chunk < 1 or rows % chunk:
        divisors = [d for d in range(1, rows + 1) if rows % d == 0]
        below = [d for d in divisors if d < chunk][-1:]
        near = below + [d for d in divisors if d > chunk][:1]
        raise ValueError(
            f"vocab_chunk_size={vocab_chunk_size} does not divide the {rows} table rows each "
            f"device holds (table {table_shape[0]} rows over {row_axes or 'no mesh axis'}): "
            f"use a divisor of {rows}, such as {' or '.join(str(d) for d in sorted(near))}"
        )
    return chunk, ("None given: all rows" if vocab_chunk_size is None else "given")


# fmt: off
_EMPTY = CrossEntropyPlan(
    mesh_axes=(), hidden_shape=(), table_shape=(0, 0), vocab_size=0, given_hidden_spec=P(),
    hidden_spec=P(), weight_spec=P(), tokens_spec=P(), out_spec=P(), row_axes=(),
    hidden_axes=(), batch_axes=(), rows_per_shard=0, chunk_rows=1, label_smoothing=0.0,
    z_loss=0.0, ignore_index=None, softcap=None,
    forward_rule=None, grad_rule=None,  # type: ignore[arg-type]
)  # a blank the planner fills with dataclasses.replace
# fmt: on
