"""The plan of a vocab-parallel softmax cross-entropy (`jaxembed.losses`).

`plan_cross_entropy` asks the rule `jaxembed.rules.cross_entropy` how the loss of
`hidden @ table.T` against integer labels is laid out on a mesh, and writes down the layouts,
the logits chunks and every collective; the kernels (`jaxembed.kernels.cross_entropy`)
execute the plan. With R the mesh axes splitting the table's rows, K its hidden axis and B
the tokens: the forward all-gathers each token's softmax statistics over R, the backward
sums the hidden gradient over R and the table's over B (see `jaxembed.losses`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec as P

from jaxembed import layout
from jaxembed.plan.specs import validate_scalars
from jaxembed.rules.cross_entropy import cross_entropy_forward, cross_entropy_grad
from jaxembed.rules.engine import DistSpec, SpmdInfo

__all__ = ["CrossEntropyPlan", "plan_cross_entropy"]


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
      forward_rule, grad_rule: the rules' answers the plan was derived from.

    Properties give derived values: `num_chunks`, `local_tokens` (tokens per device),
    `collectives` (`(phase, op, axes, operand)` each), `logits_block_bytes`, `saves_logits`
    (the backward reuses the forward's psummed logits block) and `logits_spec`. `str(plan)`
    prints it as a table.

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
        forward  all_gather  model           softmax statistics
        backward psum        model           hidden_grad
        backward psum        data            table_grad
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

    @property
    def num_chunks(self) -> int:
        return self.rows_per_shard // self.chunk_rows

    @property
    def saves_logits(self) -> bool:
        """Whether the forward keeps its one logits block `f32[T, V/R]` for the backward.

        With the table's hidden axis split (K), the logits are whole only after a psum over
        K. Unchunked, the backward reuses the forward's block, kept between the passes,
        rather than psum the same block again (whether XLA would merge the two psums is left
        to no chance: it did in float32, not in bfloat16). Chunked, each chunk is recomputed
        and psummed again, so that no more than one chunk lives at a time.
        """
        return bool(self.hidden_axes) and self.num_chunks == 1

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
        out = []
        if self.hidden_axes:
            out.append(("forward", "psum", self.hidden_axes, "logits chunk"))
            # A capped logit is not linear in the rows: its sum is taken chunk by chunk.
            operand = "label logit" if self.softcap is not None else "label logit and logit sum"
            out.append(("forward", "psum", self.hidden_axes, operand))
        if self.row_axes:
            out.append(("forward", "all_gather", self.row_axes, "softmax statistics"))
        if self.hidden_axes and not self.saves_logits:
            out.append(("backward", "psum", self.hidden_axes, "logits chunk"))
        if self.row_axes:
            out.append(("backward", "psum", self.row_axes, "hidden_grad"))
        if self.batch_axes:
            out.append(("backward", "psum", self.batch_axes, "table_grad"))
        return tuple(out)

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
    vocab_chunk_size: int | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    ignore_index: int | None = None,
    softcap: float | None = None,
) -> CrossEntropyPlan:
    """Plans a vocab-parallel cross-entropy from the rule `jaxembed.rules.cross_entropy`.

    Args:
      mesh: a `Mesh` or `AbstractMesh`, or None for one device.
      hidden_shape: `[*tokens, H]`; table_shape: `[V (padded), H]`.
      hidden_spec, weight_spec: the given layouts (None: replicated).
      vocab_size, vocab_chunk_size, label_smoothing, z_loss, ignore_index, softcap: see
        `vocab_parallel_cross_entropy`.

    Returns:
      A `CrossEntropyPlan`.

    Raises:
      ValueError: a split that does not divide, a chunk that does not divide the rows a
        device holds, options out of range, mismatched shapes.

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
    vocab_size = validate_scalars(table_shape[0], vocab_size, None)
    validate_loss_options(label_smoothing, z_loss, ignore_index, hidden_spec, weight_spec)
    softcap = validate_softcap(softcap)
    h_dm = layout.to_dims_mapping(hidden_spec, names, len(hidden_shape))
    w_dm = layout.to_dims_mapping(weight_spec, names, 2)
    row_axes, hidden_axes = table_axes(table_shape, w_dm, names, sizes, vocab_size)
    forward = cross_entropy_forward(DistSpec(hidden_shape, h_dm), DistSpec(table_shape, w_dm))
    grad = cross_entropy_grad(DistSpec(hidden_shape, h_dm), DistSpec(table_shape, w_dm))
    hidden_k = forward.inputs[0]
    loss = forward.outputs[0]
    rows = table_shape[0] // math.prod(sizes[a] for a in row_axes)
    chunk = chunk_rows(rows, vocab_chunk_size, table_shape, row_axes)
    return CrossEntropyPlan(
        mesh_axes=tuple(sizes.items()),
        hidden_shape=hidden_shape,
        table_shape=table_shape,  # type: ignore[arg-type]
        vocab_size=int(vocab_size),
        given_hidden_spec=layout.to_partition_spec(h_dm, names),
        hidden_spec=layout.to_partition_spec(hidden_k.dims_mapping, names),
        weight_spec=layout.to_partition_spec(w_dm, names),
        tokens_spec=layout.to_partition_spec(loss.dims_mapping, names),
        out_spec=layout.to_partition_spec(h_dm[:-1], names),
        row_axes=row_axes,
        hidden_axes=hidden_axes,
        batch_axes=tuple(names[a] for a in sorted(grad.outputs[1].partial_dims)),
        rows_per_shard=rows,
        chunk_rows=chunk,
        label_smoothing=float(label_smoothing),
        z_loss=float(z_loss),
        ignore_index=None if ignore_index is None else int(ignore_index),
        softcap=softcap,
        forward_rule=forward,
        grad_rule=grad,
    )


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


def chunk_rows(rows: int, vocab_chunk_size, table_shape, row_axes) -> int:
    """The rows of one logits chunk: all `rows` a device holds, or a divisor of them."""
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
    return chunk
