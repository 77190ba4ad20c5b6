"""Vocab-parallel softmax cross-entropy for tied output heads.

`vocab_parallel_cross_entropy(hidden, table, labels)` is the softmax cross-entropy of the
logits `hidden @ table.T` against integer labels, computed without ever holding the logits
of the whole vocabulary on one device. Each device multiplies its tokens by its own rows of
the table (`[tokens, V/n]`, or `[tokens, chunk]` with `vocab_chunk_size`) and keeps four
numbers per token: the running max and the sum of exponentials below it (an online
log-sum-exp over the chunks), the label's logit and the sum of the logits (for label
smoothing; both linear in the rows, so computed from the rows without a logits block). One
`all_gather` of those `[n, 4, tokens]` statistics over the vocab axes lets every device
combine them into the log-sum-exp, where Megatron's form needs two collectives (a `pmax`,
then one all-reduce of the two sums); the statistics are a few bytes per token, so the
gather's extra bytes cost less than the second collective's latency.

The backward (`jax.custom_vjp`) recomputes each chunk of logits from the saved
log-sum-exp, so nothing `[tokens, V/n]`-sized lives between the passes:

    dlogits      = g * ((1 + 2 z lse) softmax - targets)      per chunk, f32[T, C]
    hidden_grad  = psum_R(dlogits @ table_chunk)               f[T, H/K]
    table_grad   = psum_B(dlogits.T @ hidden)                  f[V/R, H/K], the table's layout

with R the mesh axes splitting the table's rows, K its hidden axis and B the tokens. The
layouts come from the rule `jaxembed.rules.cross_entropy`; `plan_cross_entropy` prints them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxembed import layout
from jaxembed.ids import as_ids
from jaxembed.ops import (
    is_explicit,
    move,
    normalize_spec,
    resolve_mesh,
    spec_of,
    warn_if_layout_unknown,
)
from jaxembed.rules.cross_entropy import cross_entropy_forward, cross_entropy_grad
from jaxembed.rules.engine import DistSpec, SpmdInfo

__all__ = ["CrossEntropyPlan", "plan_cross_entropy", "vocab_parallel_cross_entropy"]

Reduction = Literal["none", "sum", "mean"]


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
      forward_rule, grad_rule: the rules' answers the plan was derived from.

    Properties give derived values: `num_chunks`, `local_tokens` (tokens per device),
    `collectives` (`(phase, op, axes, operand)` each) and `logits_block_bytes`. `str(plan)`
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
    forward_rule: SpmdInfo
    grad_rule: SpmdInfo

    @property
    def num_chunks(self) -> int:
        return self.rows_per_shard // self.chunk_rows

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
            out.append(("forward", "psum", self.hidden_axes, "label logit and logit sum"))
        if self.row_axes:
            out.append(("forward", "all_gather", self.row_axes, "softmax statistics"))
        if self.hidden_axes:
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

    def __str__(self) -> str:
        mesh = " x ".join(f"{n}={s}" for n, s in self.mesh_axes) or "one device"
        lines = [
            f"CrossEntropyPlan  mesh: {mesh}",
            f"  table   {list(self.table_shape)}  vocab {self.vocab_size}  layout "
            f"{self.weight_spec}  rows per device {self.rows_per_shard} in "
            f"{self.num_chunks} chunk(s) of {self.chunk_rows}",
            f"  hidden  {list(self.hidden_shape)}  given {self.given_hidden_spec}  runs as "
            f"{self.hidden_spec}",
            f"  loss    {self.out_spec}  logits block per device f32"
            f"[{self.local_tokens}, {self.chunk_rows}]",
        ]
        for phase, op, axes, operand in self.collectives:
            lines.append(f"  {phase:<9}{op:<12}{','.join(axes):<16}{operand}")
        return "\n".join(lines)


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
) -> CrossEntropyPlan:
    """Plans a vocab-parallel cross-entropy from the rule `jaxembed.rules.cross_entropy`.

    Args:
      mesh: a `Mesh` or `AbstractMesh`, or None for one device.
      hidden_shape: `[*tokens, H]`; table_shape: `[V (padded), H]`.
      hidden_spec, weight_spec: the given layouts (None: replicated).
      vocab_size, vocab_chunk_size, label_smoothing, z_loss, ignore_index: see
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
    vocab_size = table_shape[0] if vocab_size is None else vocab_size
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int | np.integer):
        raise TypeError(f"vocab_size must be an int, got {vocab_size!r}")
    if not 1 <= vocab_size <= table_shape[0]:
        raise ValueError(
            f"vocab_size must be in [1, {table_shape[0]}] (the table's rows), got {vocab_size}"
        )
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
    h_dm = layout.to_dims_mapping(hidden_spec, names, len(hidden_shape))
    w_dm = layout.to_dims_mapping(weight_spec, names, 2)
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
    forward = cross_entropy_forward(DistSpec(hidden_shape, h_dm), DistSpec(table_shape, w_dm))
    grad = cross_entropy_grad(DistSpec(hidden_shape, h_dm), DistSpec(table_shape, w_dm))
    hidden_k = forward.inputs[0]
    loss = forward.outputs[0]
    rows = table_shape[0] // n_rows
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
        forward_rule=forward,
        grad_rule=grad,
    )


# --- the shard_map bodies -----------------------------------------------------------------


def _vary(x: jax.Array, *refs: jax.Array, drop: tuple[str, ...] = ()) -> jax.Array:
    """`x` typed as varying over the mesh axes `refs` vary over, less `drop` (check_vma)."""
    want = frozenset().union(*(_varying(r) for r in refs)) - set(drop) - _varying(x)
    return jax.lax.pcast(x, tuple(sorted(want)), to="varying") if want else x


def _varying(x: jax.Array) -> frozenset[str]:
    axis_type = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(axis_type.varying) if axis_type is not None else frozenset()


def _row_start(plan: CrossEntropyPlan) -> jax.Array | int:
    """The global row id of this device's first table row."""
    if not plan.row_axes:
        return 0
    return jax.lax.axis_index(plan.row_axes) * plan.rows_per_shard


def _chunk_logits(plan: CrossEntropyPlan, h: jax.Array, t: jax.Array, c: jax.Array):
    """Logits of chunk `c` of this device's rows, their global row ids, and the rows."""
    size = plan.chunk_rows
    t_c = jax.lax.dynamic_slice_in_dim(t, c * size, size, axis=0)  # f[C, H/K]
    z = jnp.einsum("th,vh->tv", h, t_c, preferred_element_type=jnp.float32)  # f32[T, C]
    if plan.hidden_axes:  # each device multiplied its slice of the hidden axis
        z = jax.lax.psum(z, plan.hidden_axes)
    rows = _row_start(plan) + c * size + jnp.arange(size)  # i32[C]
    return z, rows, t_c


def _target_mass(plan: CrossEntropyPlan, labels: jax.Array) -> jax.Array:
    """The targets' sum per token: 1, or `eps` for a label outside the vocabulary (optax's)."""
    in_vocab = (labels >= 0) & (labels < plan.vocab_size)
    return jnp.where(in_vocab, 1.0, plan.label_smoothing)


def _forward_body(plan: CrossEntropyPlan, h: jax.Array, t: jax.Array, labels: jax.Array):
    # h: f[*tokens/B, H/K]   t: f[V/R, H/K]   labels: i32[*tokens/B]
    tokens = labels.shape
    h = h.reshape(-1, h.shape[-1])  # f[T, H/K]
    labels = labels.reshape(-1)  # i32[T]

    def step(carry, c):  # the online log-sum-exp of this device's rows, chunk by chunk
        m, s = carry  # f32[T] each
        z, rows, _ = _chunk_logits(plan, h, t, c)  # f32[T, C]
        zm = jnp.where(rows[None, :] < plan.vocab_size, z, -jnp.inf)  # padding rows get no mass
        m_new = jnp.maximum(m, zm.max(axis=-1))
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # all rows so far are padding
        s = s * jnp.exp(m - shift) + jnp.exp(zm - shift[:, None]).sum(axis=-1)
        return (m_new, s), None

    zeros = _vary(jnp.zeros(labels.shape, jnp.float32), h, t, labels, drop=plan.hidden_axes)
    (m, s), _ = jax.lax.scan(step, (zeros - jnp.inf, zeros), jnp.arange(plan.num_chunks))
    # The label's logit and the sum of the logits are linear in the rows: no [T, C] block.
    start = _row_start(plan)
    local = labels - start
    own = (local >= 0) & (local < plan.rows_per_shard) & (labels < plan.vocab_size)
    t_label = jnp.take(t, jnp.where(own, local, 0), axis=0, mode="clip")  # f[T, H/K]
    z_label = jnp.where(
        own, jnp.einsum("th,th->t", h, t_label, preferred_element_type=jnp.float32), 0.0
    )
    real = (start + jnp.arange(plan.rows_per_shard)) < plan.vocab_size  # bool[V/R]
    row_sum = jnp.einsum("v,vh->h", real.astype(t.dtype), t, preferred_element_type=jnp.float32)
    z_sum = jnp.einsum("th,h->t", h, row_sum, preferred_element_type=jnp.float32)  # f32[T]
    if plan.hidden_axes:  # partial over the table's hidden split
        z_label, z_sum = jax.lax.psum((z_label, z_sum), plan.hidden_axes)
    if plan.row_axes:  # one collective: every device combines every shard's statistics
        stats = jnp.stack([m, s, z_label, z_sum])  # f32[4, T]
        every = jax.lax.all_gather(stats, plan.row_axes, to="invarying")  # f32[R, 4, T]
        m = every[:, 0].max(axis=0)
        shift = jnp.where(jnp.isfinite(m), m, 0.0)
        s = (every[:, 1] * jnp.exp(every[:, 0] - shift[None, :])).sum(axis=0)
        z_label, z_sum = every[:, 2].sum(axis=0), every[:, 3].sum(axis=0)
    else:
        shift = jnp.where(jnp.isfinite(m), m, 0.0)
    lse = shift + jnp.log(s)  # f32[T]
    eps = plan.label_smoothing
    loss = (
        _target_mass(plan, labels) * lse - (1.0 - eps) * z_label - (eps / plan.vocab_size) * z_sum
    )
    if plan.z_loss:
        loss = loss + plan.z_loss * lse**2
    if plan.ignore_index is not None:
        loss = jnp.where(labels == plan.ignore_index, 0.0, loss)
    return loss.reshape(tokens), lse.reshape(tokens)  # f32[*tokens/B] twice


def _backward_body(plan, h, t, labels, lse, g):
    # h: f[*tokens/B, H/K]   t: f[V/R, H/K]   labels: i32[*tokens/B]   lse, g: f32[*tokens/B]
    h_shape = h.shape
    h = h.reshape(-1, h.shape[-1])  # f[T, H/K]
    labels, lse, g = labels.reshape(-1), lse.reshape(-1), g.reshape(-1).astype(jnp.float32)
    if plan.ignore_index is not None:
        g = jnp.where(labels == plan.ignore_index, 0.0, g)
    eps = plan.label_smoothing
    p_coef = g * (_target_mass(plan, labels) + 2.0 * plan.z_loss * lse)  # f32[T]
    size = plan.chunk_rows

    def step(carry, c):
        dh, dt = carry  # f32[T, H/K], f32[V/R, H/K]
        z, rows, t_c = _chunk_logits(plan, h, t, c)  # f32[T, C]
        valid = rows[None, :] < plan.vocab_size  # bool[1, C]
        p = jnp.where(valid, jnp.exp(z - lse[:, None]), 0.0)
        target = (1.0 - eps) * (valid & (rows[None, :] == labels[:, None])) + jnp.where(
            valid, eps / plan.vocab_size, 0.0
        )
        dz = p_coef[:, None] * p - g[:, None] * target  # f32[T, C]
        dh = dh + dz @ t_c.astype(jnp.float32)
        dt_c = dz.T @ h.astype(jnp.float32)  # f32[C, H/K]
        return (dh, jax.lax.dynamic_update_slice_in_dim(dt, dt_c, c * size, axis=0)), None

    dh = _vary(jnp.zeros(h.shape, jnp.float32), h, t, labels, lse, g)
    dt = _vary(jnp.zeros(t.shape, jnp.float32), h, t, labels, lse, g)
    (dh, dt), _ = jax.lax.scan(step, (dh, dt), jnp.arange(plan.num_chunks))
    if plan.row_axes:  # every vocab shard contributed to every token's hidden gradient
        dh = jax.lax.psum(dh, plan.row_axes)
    if plan.batch_axes:  # every token shard contributed to the table's gradient
        dt = jax.lax.psum(dt, plan.batch_axes)
    return dh.reshape(h_shape).astype(h.dtype), dt.astype(t.dtype)


# --- custom_vjp over the two shard_maps ----------------------------------------------------


def _run(body, plan: CrossEntropyPlan, mesh: Any, in_specs, out_specs):
    fn = functools.partial(body, plan)
    if mesh is None:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)


def _forward(plan, mesh, hidden, table, labels):
    specs = (plan.hidden_spec, plan.weight_spec, plan.tokens_spec)
    run = _run(_forward_body, plan, mesh, specs, (plan.tokens_spec, plan.tokens_spec))
    return run(hidden, table, labels)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _cross_entropy(plan, mesh, hidden, table, labels):
    return _forward(plan, mesh, hidden, table, labels)[0]


def _cross_entropy_fwd(plan, mesh, hidden, table, labels):
    loss, lse = _forward(plan, mesh, hidden, table, labels)
    return loss, (hidden, table, labels, lse)


def _cross_entropy_bwd(plan, mesh, residuals, g):
    hidden, table, labels, lse = residuals
    g = move(g, mesh, plan.tokens_spec)
    tok = plan.tokens_spec
    run = _run(
        _backward_body, plan, mesh, (plan.hidden_spec, plan.weight_spec, tok, tok, tok),
        (plan.hidden_spec, plan.weight_spec),
    )  # fmt: skip
    hidden_grad, table_grad = run(hidden, table, labels, lse, g)
    return hidden_grad, table_grad, None


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


# --- the public entry point ----------------------------------------------------------------


def vocab_parallel_cross_entropy(
    hidden: jax.Array,
    table: jax.Array,
    labels: jax.Array,
    *,
    vocab_size: int | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    ignore_index: int | None = None,
    vocab_chunk_size: int | None = None,
    reduction: Reduction = "none",
    mesh: Any = None,
    hidden_spec: P | None = None,
    weight_spec: P | None = None,
) -> jax.Array:
    """Softmax cross-entropy of `hidden @ table.T` against integer labels, vocab-parallel.

    Equal, with its gradients for `hidden` and `table`, to
    `optax.softmax_cross_entropy(logits, optax.smooth_labels(one_hot(labels, vocab_size),
    label_smoothing)) + z_loss * logsumexp(logits) ** 2` on the dense logits
    `hidden @ table[:vocab_size].T`, but no device holds more than `[tokens, V/n]` logits
    (`[tokens, vocab_chunk_size]` with chunking), nor the table's rows of another device.

    Args:
      hidden: `[*tokens, H]`, float32 or bfloat16 (logits accumulate in float32).
      table: the tied table `[V, H]`, usually split on its vocab axis; `V` may be padded.
      labels: integer `[*tokens]`. A label outside `[0, vocab_size)` (other than
        `ignore_index`) has no target logit, as `optax` with `jax.nn.one_hot` has.
      vocab_size: the real rows (default `V`); padding rows get no probability and a zero
        gradient.
      label_smoothing: `eps` in `[0, 1)`: targets `(1 - eps) * one_hot + eps / vocab_size`.
      z_loss: weight of `logsumexp(logits) ** 2` per token (PaLM's z-loss).
      ignore_index: a label whose token has loss 0 and no gradient (e.g. -100).
      vocab_chunk_size: rows per logits chunk on each device; must divide the rows a device
        holds. Bounds the logits block to `[tokens, vocab_chunk_size]` (default: all rows).
      reduction: `"none"` (per-token loss), `"sum"`, or `"mean"` over tokens whose label is
        not `ignore_index`.
      mesh: the mesh; default `jax.set_mesh`'s, else the arrays' own, else one device.
      hidden_spec, weight_spec: layouts; default read from the arrays (a concrete array's
        sharding, or its type in an Explicit mesh). Under `jit` in an Auto mesh pass both.

    Returns:
      float32 loss: `[*tokens]` laid out like hidden's tokens, or a scalar when reduced.

    Raises:
      TypeError: non-integer labels, a non-float table or hidden.
      ValueError: mismatched shapes, splits that do not divide, options out of range, a
        table whose layout differs from `weight_spec` in an Explicit mesh.

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np, optax
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
      >>> k1, k2 = jax.random.split(jax.random.key(0))
      >>> table = jax.device_put(jax.random.normal(k1, (1024, 16)),
      ...                        NamedSharding(mesh, P("model", None)))
      >>> hidden = jax.device_put(jax.random.normal(k2, (4, 8, 16)),
      ...                         NamedSharding(mesh, P("data")))
      >>> labels = jnp.arange(32).reshape(4, 8)
      >>> loss = vocab_parallel_cross_entropy(hidden, table, labels)
      >>> loss.shape, loss.sharding.spec
      ((4, 8), P('data', None))
      >>> logits = np.asarray(hidden) @ np.asarray(table).T  # the dense reference, in numpy
      >>> dense = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
      >>> bool(jnp.allclose(loss, dense, rtol=1e-5))
      True
    """
    hidden = hidden if isinstance(hidden, jax.Array | jax.core.Tracer) else jnp.asarray(hidden)
    labels = as_ids(labels, "labels")  # any width, checked before it is narrowed
    for name, a in (("hidden", hidden), ("table", table)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"{name} must be floating point, got {a.dtype}")
    if jnp.ndim(table) != 2:
        raise ValueError(f"table must be a 2-D table [vocab, hidden], got shape {table.shape}")
    if hidden.ndim < 1 or hidden.shape[-1] != table.shape[1] or labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"expected hidden [*tokens, {table.shape[1]}] and labels [*tokens] for a table "
            f"{table.shape}; got hidden {hidden.shape} and labels {labels.shape}"
        )
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
    mesh = resolve_mesh(mesh, table, hidden)
    if mesh is not None and mesh.size == 1 and hidden_spec is None and weight_spec is None:
        mesh = None
    if mesh is not None:
        given = spec_of(table, mesh)
        if weight_spec is None:
            warn_if_layout_unknown(
                table,
                mesh,
                function="vocab_parallel_cross_entropy",
                arg="weight_spec",
                what="table",
            )
            weight_spec = given
        elif is_explicit(mesh) and normalize_spec(given, 2) != normalize_spec(weight_spec, 2):
            raise ValueError(
                f"table is laid out as {given} but weight_spec={weight_spec}: the loss never "
                "moves the table; drop weight_spec, or reshard the table once with "
                "jax.sharding.reshard(table, weight_spec)"
            )
        if hidden_spec is None:
            warn_if_layout_unknown(
                hidden,
                mesh,
                function="vocab_parallel_cross_entropy",
                arg="hidden_spec",
                what="hidden array",
            )
            hidden_spec = spec_of(hidden, mesh)
    plan = plan_cross_entropy(
        mesh, hidden.shape, table.shape, hidden_spec=hidden_spec, weight_spec=weight_spec,
        vocab_size=vocab_size, vocab_chunk_size=vocab_chunk_size,
        label_smoothing=label_smoothing, z_loss=z_loss, ignore_index=ignore_index,
    )  # fmt: skip
    hidden = move(hidden, mesh, plan.hidden_spec)
    labels = move(labels.astype(jnp.int32), mesh, plan.tokens_spec)  # int32 holds them
    loss = _cross_entropy(plan, mesh, hidden, table, labels)
    loss = move(loss, mesh, plan.out_spec)  # a free slice when the tokens were gathered
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        if ignore_index is None:
            return loss.mean()
        count = (labels != ignore_index).sum()
        return loss.sum() / jnp.maximum(count, 1).astype(jnp.float32)
    return loss
