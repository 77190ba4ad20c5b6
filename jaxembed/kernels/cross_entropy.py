"""The vocab-parallel cross-entropy's `shard_map` bodies, and the entry point that runs them.

`vocab_parallel_cross_entropy` checks its arguments, plans the loss
(`jaxembed.plan.cross_entropy.plan_cross_entropy`), moves `hidden` and the labels into the
plan's layouts and runs two `shard_map`s under one `jax.custom_vjp`: the forward (an online
log-sum-exp over the chunks of each device's rows, one `all_gather` of the statistics over
R) and the backward (each chunk of logits recomputed from the saved log-sum-exp, or, in one
chunk, the forward's exponentials reused). The math is in `jaxembed.losses`' docstring;
`jaxembed.losses` is the public face.

The products are laid out for the CPU's (and any BLAS's) sake: a gathered table is gathered
transposed, `[H, V/R]`, so that the gather runs over its major axis and its gradient
`hT @ p` is born in the layout the reduce-scatter sends back; no product reads an operand
across its rows (`dz.T @ h`), and no `[T, C]` gradient block is written (`_softmax_grads`).

The body pieces the vocab-parallel metrics (`jaxembed.kernels.vocab_metrics`) share with the
loss are public here: `chunk_logits` and `softcap_logits` (one chunk of this device's logits,
capped), `row_start` and `vary`; the arguments' checks, weights and reductions they share are
in `jaxembed.kernels.vocab_args`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxembed.kernels.arrays import eager, move
from jaxembed.kernels.vocab_args import (
    Reduction,
    check_inputs,
    check_reduction,
    check_weights,
    reduce_tokens,
)
from jaxembed.plan.cross_entropy import CrossEntropyPlan, plan_cross_entropy

__all__ = [
    "Reduction",
    "chunk_logits",
    "row_start",
    "softcap_logits",
    "vary",
    "vocab_parallel_cross_entropy",
]


# --- the shard_map bodies -----------------------------------------------------------------


def vary(x: jax.Array, *refs: jax.Array, drop: tuple[str, ...] = ()) -> jax.Array:
    """`x` typed as varying over the mesh axes `refs` vary over, less `drop` (check_vma)."""
    want = frozenset().union(*(_varying(r) for r in refs)) - set(drop) - _varying(x)
    return jax.lax.pcast(x, tuple(sorted(want)), to="varying") if want else x


def _varying(x: jax.Array) -> frozenset[str]:
    axis_type = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(axis_type.varying) if axis_type is not None else frozenset()


def row_start(plan: CrossEntropyPlan) -> jax.Array | int:
    """The global row id of this device's first table row."""
    if not plan.row_axes:
        return 0
    return jax.lax.axis_index(plan.row_axes) * plan.rows_per_shard


def chunk_logits(
    plan: CrossEntropyPlan, h: jax.Array, t: jax.Array, c: jax.Array, z: jax.Array | None = None
):
    """Logits of chunk `c` of this device's rows, their global row ids, and the rows. `z`:
    the chunk's logits already at hand (the forward's, saved: no product, no psum)."""
    size = plan.chunk_rows
    t_c = jax.lax.dynamic_slice_in_dim(t, c * size, size, axis=0)  # f[C, H/K]
    if z is None:
        z = jnp.einsum("th,vh->tv", h, t_c, preferred_element_type=jnp.float32)  # f32[T, C]
        if plan.partial_axes:  # each device multiplied its slice of the hidden axis
            z = jax.lax.psum(z, plan.partial_axes)
    rows = row_start(plan) + c * size + jnp.arange(size)  # i32[C]
    return z, rows, t_c


def softcap_logits(plan: CrossEntropyPlan, z: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """Gemma 2's soft cap `c * tanh(z / c)` of whole logits (after the psum over K), and the
    `tanh` the backward's chain rule needs (`d capped / dz = 1 - tanh**2`); `z, None` when the
    plan has no cap."""
    if plan.softcap is None:
        return z, None
    a = jnp.tanh(z / plan.softcap)
    return plan.softcap * a, a


def _target_mass(plan: CrossEntropyPlan, labels: jax.Array) -> jax.Array:
    """The targets' sum per token: 1, or `eps` for a label outside the vocabulary (optax's)."""
    in_vocab = (labels >= 0) & (labels < plan.vocab_size)
    return jnp.where(in_vocab, 1.0, plan.label_smoothing)


def gather_table(plan: CrossEntropyPlan, t: jax.Array) -> jax.Array:
    """The table's shard whole over its hidden axis when the plan gathers it (FSDP's
    weight gather): f[V/R, H/K] -> f[V/R, H]; else `t` as it is."""
    if not plan.gathered_axes:
        return t
    # invarying: the same whole shard on every device of K, kept for the backward as it is
    return jax.lax.all_gather(t, plan.gathered_axes, axis=1, tiled=True, to="invarying")


def _loss_table(plan: CrossEntropyPlan, t: jax.Array) -> jax.Array:
    """The table as the loss's bodies multiply it: gathered over K and transposed,
    f[V/R, H/K] -> f[H, V/R], when the plan gathers it; else `t` as it is, f[V/R, H/K].

    Transposed, the gather runs over the major axis (no copy of the gathered table on either
    side of it) and every product reads it as it lies: `h @ tT` for the logits, `p @ tT.T`
    for hidden's gradient, and `hT @ p` for the table's is born in the gathered layout that
    the reduce-scatter sends back. Only the device's own shard is transposed, twice (here, and
    its gradient at the end), where the gather of `[V/R, H]` over its minor axis copied the
    whole gathered table twice and the reduce-scatter's operand once more.
    """
    if not plan.gathered_axes:
        return t
    # invarying: the same whole block on every device of K, kept for the backward as it is
    return jax.lax.all_gather(t.T, plan.gathered_axes, axis=0, tiled=True, to="invarying")


def _logits(plan: CrossEntropyPlan, h: jax.Array, tb: jax.Array, c: jax.Array):
    """Chunk `c`'s logits `f32[T, C]` (whole over K) and the chunk of `tb` they came from."""
    size = plan.chunk_rows
    if plan.gathered_axes:  # tb: f[H, V/R]
        t_c = jax.lax.dynamic_slice_in_dim(tb, c * size, size, axis=1)  # f[H, C]
        return jnp.matmul(h, t_c, preferred_element_type=jnp.float32), t_c
    z, _, t_c = chunk_logits(plan, h, tb, c)  # f[C, H/K], psummed over K
    return z, t_c


def _padded(plan: CrossEntropyPlan) -> bool:
    """Whether the table has rows past `vocab_size` (to be masked out of every block)."""
    return plan.vocab_size < plan.table_shape[0]


def _rows(plan: CrossEntropyPlan, c: jax.Array) -> jax.Array:
    """The global row ids of chunk `c` of this device's rows: i32[C]."""
    return row_start(plan) + c * plan.chunk_rows + jnp.arange(plan.chunk_rows)


def _forward_body(plan: CrossEntropyPlan, h: jax.Array, t: jax.Array, labels: jax.Array):
    # h: f[*tokens/B, H/K]   t: f[V/R, H/K]   labels: i32[*tokens/B]
    # (K: the table's hidden axes the body leaves split; none when it gathers the table)
    tb = _loss_table(plan, t)  # f[H, V/R] gathered, else f[V/R, H/K]
    tokens = labels.shape
    h = h.reshape(-1, h.shape[-1])  # f[T, H/K]
    labels = labels.reshape(-1)  # i32[T]

    # A capped logit is not linear in the rows: its sum (smoothing's) is taken chunk by chunk.
    capped = plan.softcap is not None
    padded = _padded(plan)

    def step(carry, c):  # the online log-sum-exp of this device's rows, chunk by chunk
        m, s, z_sum = carry  # f32[T] each
        z_raw, _ = _logits(plan, h, tb, c)  # f32[T, C]
        z, _ = softcap_logits(plan, z_raw)
        valid = _rows(plan, c)[None, :] < plan.vocab_size  # bool[1, C]: padding gets no mass
        zm = jnp.where(valid, z, -jnp.inf) if padded else z
        m_new = jnp.maximum(m, zm.max(axis=-1))
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # all rows so far are padding
        e = jnp.exp(zm - shift[:, None])  # f32[T, C]
        s = s * jnp.exp(m - shift) + e.sum(axis=-1)
        if capped and plan.label_smoothing > 0:
            z_sum = z_sum + (jnp.where(valid, z, 0.0) if padded else z).sum(axis=-1)
        # One chunk: the backward reuses its block (the capped logits' chain rule needs z)
        return (m_new, s, z_sum), ((z_raw if capped else e) if plan.saves_block else None)

    zeros = vary(jnp.zeros(labels.shape, jnp.float32), h, tb, labels, drop=plan.partial_axes)
    init = (zeros - jnp.inf, zeros, zeros)
    (m, s, z_sum), saved = jax.lax.scan(step, init, jnp.arange(plan.num_chunks))
    local_shift = jnp.where(jnp.isfinite(m), m, 0.0)  # what the saved block is relative to
    # The label's logit (and the uncapped logits' sum) are linear in the rows: no [T, C] block.
    start = row_start(plan)
    local = labels - start
    own = (local >= 0) & (local < plan.rows_per_shard) & (labels < plan.vocab_size)
    at = jnp.where(own, local, 0)
    if plan.gathered_axes:  # tb: f[H, V/R]: the labels' columns
        t_label = jnp.take(tb, at, axis=1, mode="clip")  # f[H, T]
        dot = jnp.einsum("th,ht->t", h, t_label, preferred_element_type=jnp.float32)
    else:
        t_label = jnp.take(tb, at, axis=0, mode="clip")  # f[T, H/K]
        dot = jnp.einsum("th,th->t", h, t_label, preferred_element_type=jnp.float32)
    z_label = jnp.where(own, dot, 0.0)
    if not capped:
        real = (start + jnp.arange(plan.rows_per_shard)) < plan.vocab_size  # bool[V/R]
        row_sum = _row_sum(plan, tb, real)  # f32[H/K]
        z_sum = jnp.einsum("th,h->t", h, row_sum, preferred_element_type=jnp.float32)  # f32[T]
    if plan.partial_axes and capped:  # partial over the table's hidden split
        z_label = jax.lax.psum(z_label, plan.partial_axes)
    elif plan.partial_axes:
        z_label, z_sum = jax.lax.psum((z_label, z_sum), plan.partial_axes)
    if capped:  # the whole label logit, capped on the shard that owns it
        z_label = jnp.where(own, softcap_logits(plan, z_label)[0], 0.0)
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
    out = (loss.reshape(tokens), lse.reshape(tokens))  # f32[*tokens/B] twice
    if plan.saves_block:  # the one chunk's block, for the backward: f32[*tokens/B, V/R]
        out = (*out, saved[0].reshape(*tokens, -1))
        if not capped:  # the exponentials are relative to this device's own max
            out = (*out, local_shift.reshape(*tokens, 1))  # f32[*tokens/B, 1] per shard of R
    if plan.gathered_axes:  # the gathered table f[H, V/R], for the backward: no second gather
        out = (*out, tb)
    return out


def _backward_body(plan, h, t, labels, lse, g, *saved):
    # h: f[*tokens/B, H/K]   t: f[V/R, H/K]   labels: i32[*tokens/B]   lse, g: f32[*tokens/B]
    # t: the forward's gathered, transposed table f[H, V/R] when the plan gathers it
    # saved (one chunk): the forward's block f32[*tokens/B, V/R], the exponentials
    # exp(z - local_shift) and local_shift f32[*tokens/B, 1] (the logits under a soft cap)
    h_shape, h_dtype = h.shape, h.dtype
    h = h.reshape(-1, h.shape[-1]).astype(jnp.float32)  # f32[T, H/K]
    labels, lse, g = labels.reshape(-1), lse.reshape(-1), g.reshape(-1).astype(jnp.float32)
    if plan.ignore_index is not None:
        g = jnp.where(labels == plan.ignore_index, 0.0, g)
    block = saved[0].reshape(h.shape[0], -1) if saved else None  # f32[T, V/R]
    tb = t.astype(jnp.float32)  # f32[V/R, H/K], or f32[H, V/R] gathered
    p_coef = g * (_target_mass(plan, labels) + 2.0 * plan.z_loss * lse)  # f32[T]
    if plan.softcap is None:
        dh, dt = _softmax_grads(plan, h, tb, labels, lse, g, p_coef, block, saved[1:])
    else:
        dh, dt = _capped_grads(plan, h, tb, labels, lse, g, p_coef, block)
    if plan.row_axes:  # every vocab shard contributed to every token's hidden gradient
        dh = jax.lax.psum(dh, plan.row_axes)
    if plan.gathered_axes:  # summed over the token shards of K and split back over K
        dt = jax.lax.psum_scatter(dt, plan.gathered_axes, scatter_dimension=0, tiled=True)
    rest = tuple(a for a in plan.batch_axes if a not in plan.gathered_axes)
    if rest:  # every token shard contributed to the table's gradient
        dt = jax.lax.psum(dt, rest)
    return dh.reshape(h_shape).astype(h_dtype), dt.T.astype(t.dtype)  # dt: f[V/R, H/K]


def _softmax_grads(plan, h, tb, labels, lse, g, p_coef, block, shift):
    """Hidden's gradient f32[T, H/K] and the table's, transposed, f32[H/K, V/R], uncapped.

    `dz = p_coef * p - g * target` with `p = exp(z - lse)` and `target = (1 - eps) *
    one_hot + eps / V`: only `p` is a `[T, C]` block, and it enters the products as it is,
    its per-token factor `p_coef` applied to their `[T, H]` sides (the rows of `dh`, the
    columns of `hT`). The one-hot part is a gather of the labels' rows (for `dh`) and a
    scatter of the tokens into the labels' columns (for `dt`), the smoothing part a rank-1
    term: no `dz` block is written, nor read twice.
    """
    eps, size = plan.label_smoothing, plan.chunk_rows
    padded = _padded(plan)
    w = p_coef  # the products' per-token factor
    if block is not None:  # p = e * exp(local_shift - lse): the factor takes the second term
        w = w * jnp.exp(shift[0].reshape(-1) - lse)
    # hT: the table's gradient `hT @ p` reads both as they lie (p.T @ h would read p across
    # its rows); the barrier keeps XLA from folding the transpose back into the product.
    hw_t = jax.lax.optimization_barrier((h * w[:, None]).T)  # f32[H/K, T]

    def step(carry, c):
        dh, dt = carry  # f32[T, H/K], f32[H/K, V/R]
        if block is not None:
            p, t_c = block, _table_chunk(plan, tb, c)  # zero on padding rows already
        else:
            z, t_c = _logits(plan, h, tb, c)
            p = jnp.exp(z - lse[:, None])
            p = jnp.where(_rows(plan, c)[None, :] < plan.vocab_size, p, 0.0) if padded else p
        dh = dh + (jnp.einsum("tc,hc->th", p, t_c) if plan.gathered_axes else p @ t_c)
        return (dh, jax.lax.dynamic_update_slice_in_dim(dt, hw_t @ p, c * size, axis=1)), None

    dh = vary(jnp.zeros(h.shape, jnp.float32), h, tb, labels, lse, g)
    dt = jnp.zeros((hw_t.shape[0], plan.rows_per_shard), jnp.float32)
    dt = vary(dt, h, tb, labels, lse, g)
    (dh, dt), _ = jax.lax.scan(step, (dh, dt), jnp.arange(plan.num_chunks))
    dh = dh * w[:, None]
    # The targets: (1 - eps) on the label's row where this device holds it, eps / V on each row
    local = labels - row_start(plan)
    own = (local >= 0) & (local < plan.rows_per_shard) & (labels < plan.vocab_size)
    at = jnp.where(own, local, 0)
    hit = jnp.where(own, (1.0 - eps) * g, 0.0)  # f32[T]
    if plan.gathered_axes:  # tb: f32[H, V/R]
        t_label = jnp.take(tb, at, axis=1, mode="clip").T  # f32[T, H]
    else:
        t_label = jnp.take(tb, at, axis=0, mode="clip")  # f32[T, H/K]
    dh = dh - hit[:, None] * t_label
    dt = dt.at[:, at].add(-(hit[:, None] * h).T, mode="promise_in_bounds")
    if eps:
        real = (row_start(plan) + jnp.arange(plan.rows_per_shard)) < plan.vocab_size
        row_sum = _row_sum(plan, tb, real)  # f32[H/K]: this device's real rows, summed
        dh = dh - (eps / plan.vocab_size) * g[:, None] * row_sum[None, :]
        h_g = (eps / plan.vocab_size) * (g @ h)  # f32[H/K]
        dt = dt - h_g[:, None] * real.astype(jnp.float32)[None, :]
    return dh, dt


def _row_sum(plan: CrossEntropyPlan, tb: jax.Array, real: jax.Array) -> jax.Array:
    """The sum of this device's real rows of the bodies' table: f32[H] or f32[H/K]."""
    spec = "hv,v->h" if plan.gathered_axes else "vh,v->h"
    return jnp.einsum(spec, tb, real.astype(tb.dtype), preferred_element_type=jnp.float32)


def _capped_grads(plan, h, tb, labels, lse, g, p_coef, block):
    """Hidden's gradient and the table's, transposed, under a soft cap: `dz` per chunk, times
    `1 - tanh(z / c) ** 2` (the chain rule through `c * tanh(z / c)`)."""
    eps, size = plan.label_smoothing, plan.chunk_rows
    padded = _padded(plan)
    h_t = jax.lax.optimization_barrier(h.T)  # f32[H/K, T]: see _softmax_grads

    def step(carry, c):
        dh, dt = carry  # f32[T, H/K], f32[H/K, V/R]
        rows = _rows(plan, c)
        valid = rows[None, :] < plan.vocab_size  # bool[1, C]
        if block is not None:  # the forward's whole logits
            z, t_c = block, _table_chunk(plan, tb, c)
        else:
            z, t_c = _logits(plan, h, tb, c)
        z, tanh = softcap_logits(plan, z)
        p = jnp.exp(z - lse[:, None])
        hit = rows[None, :] == labels[:, None]
        if padded:
            p, hit = jnp.where(valid, p, 0.0), hit & valid
        target = (1.0 - eps) * hit + (eps / plan.vocab_size)
        target = jnp.where(valid, target, 0.0) if padded else target
        dz = (p_coef[:, None] * p - g[:, None] * target) * (1.0 - tanh * tanh)  # f32[T, C]
        dh = dh + (jnp.einsum("tc,hc->th", dz, t_c) if plan.gathered_axes else dz @ t_c)
        return (dh, jax.lax.dynamic_update_slice_in_dim(dt, h_t @ dz, c * size, axis=1)), None

    dh = vary(jnp.zeros(h.shape, jnp.float32), h, tb, labels, lse, g)
    dt = jnp.zeros((h_t.shape[0], plan.rows_per_shard), jnp.float32)
    dt = vary(dt, h, tb, labels, lse, g)
    (dh, dt), _ = jax.lax.scan(step, (dh, dt), jnp.arange(plan.num_chunks))
    return dh, dt


def _table_chunk(plan: CrossEntropyPlan, tb: jax.Array, c: jax.Array) -> jax.Array:
    """Chunk `c` of the bodies' table: f[H, C] gathered (transposed), else f[C, H/K]."""
    axis = 1 if plan.gathered_axes else 0
    return jax.lax.dynamic_slice_in_dim(tb, c * plan.chunk_rows, plan.chunk_rows, axis=axis)


# --- custom_vjp over the two shard_maps ----------------------------------------------------


def _run(body, plan: CrossEntropyPlan, mesh: Any, in_specs, out_specs):
    fn = functools.partial(body, plan)
    if mesh is None:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)


def _forward(plan, mesh, hidden, table, labels):
    """`(loss, lse)`, then what the backward reuses: the one chunk's block (and the shift its
    exponentials are relative to, uncapped) when the plan saves it, the gathered table."""
    specs = (plan.hidden_spec, plan.weight_spec, plan.tokens_spec)
    outs = (plan.tokens_spec, plan.tokens_spec, *_saved_specs(plan))
    if plan.gathered_axes:
        outs = (*outs, plan.body_table_spec)
    return _run(_forward_body, plan, mesh, specs, outs)(hidden, table, labels)


def _saved_specs(plan: CrossEntropyPlan) -> tuple[P, ...]:
    """The layouts of the forward's saved block (and its shift, uncapped), if it saves one."""
    if not plan.saves_block:
        return ()
    return (plan.logits_spec,) if plan.softcap is not None else (plan.logits_spec,) * 2


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _cross_entropy(plan, mesh, hidden, table, labels):
    return _forward(plan, mesh, hidden, table, labels)[0]


def _cross_entropy_fwd(plan, mesh, hidden, table, labels):
    loss, *saved = _forward(plan, mesh, hidden, table, labels)
    if plan.gathered_axes:  # the gathered table stands in for the table
        *saved, table = saved
    return loss, (hidden, table, labels, *saved)


def _cross_entropy_bwd(plan, mesh, residuals, g):
    hidden, table, labels, *saved = residuals  # lse, and the logits when saved
    g = move(g, mesh, plan.tokens_spec)
    tok = plan.tokens_spec
    in_specs = (plan.hidden_spec, plan.body_table_spec, tok, tok, tok, *_saved_specs(plan))
    run = _run(_backward_body, plan, mesh, in_specs, (plan.hidden_spec, plan.weight_spec))
    lse, *block = saved
    hidden_grad, table_grad = run(hidden, table, labels, lse, g, *block)
    return hidden_grad, table_grad, None


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)
# An eager call: one compiled program, not the `shard_map` bodies dispatched op by op.
_cross_entropy_jit = jax.jit(_cross_entropy, static_argnums=(0, 1))


# --- the public entry point ----------------------------------------------------------------


def vocab_parallel_cross_entropy(
    hidden: jax.Array,
    table: jax.Array,
    labels: jax.Array,
    *,
    vocab_size: int | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    ignore_index: int | None = None,
    weights: jax.Array | None = None,
    vocab_chunk_size: int | str | None = "auto",
    reduction: Reduction = "none",
    mesh: Any = None,
    hidden_spec: P | None = None,
    weight_spec: P | None = None,
    table_move: str = "auto",
    memory_target: int | None = None,
) -> jax.Array:
    """Softmax cross-entropy of `hidden @ table.T` against integer labels, vocab-parallel.

    Equal, with its gradients for `hidden` and `table`, to
    `optax.softmax_cross_entropy(logits, optax.smooth_labels(one_hot(labels, vocab_size),
    label_smoothing)) + z_loss * logsumexp(logits) ** 2` on the dense logits
    `hidden @ table[:vocab_size].T` (capped to `softcap * tanh(logits / softcap)` first when
    `softcap` is given), times `weights`, but no device holds more than `[tokens, V/n]`
    logits (`[tokens, vocab_chunk_size]` with chunking), nor the table's rows of another
    device.

    Args:
      hidden: `[*tokens, H]`, float32 or bfloat16 (logits accumulate in float32).
      table: the tied table `[V, H]`, usually split on its vocab axis; `V` may be padded.
      labels: integer `[*tokens]`. A label outside `[0, vocab_size)` (other than
        `ignore_index`) has no target logit, as `optax` with `jax.nn.one_hot` has.
      vocab_size: the real rows (default `V`); padding rows get no probability and a zero
        gradient.
      label_smoothing: `eps` in `[0, 1)`: targets `(1 - eps) * one_hot + eps / vocab_size`.
      z_loss: weight of `logsumexp(logits) ** 2` per token (PaLM's z-loss).
      softcap: Gemma 2's final-logit soft cap `c > 0` (Gemma 2 uses 30.0): the logits
        become `c * tanh(logits / c)` before the softmax, the smoothing and the z-loss, and
        the gradients go through the `tanh`. None (default): no cap.
      ignore_index: a label whose token has loss 0 and no gradient (e.g. -100).
      weights: float `[*tokens]`, a weight per token (e.g. a 0/1 loss mask): the per-token
        loss is multiplied by it. With `reduction="mean"` the result is the weighted mean
        `sum(w * loss) / sum(w)` over the tokens not `ignore_index` (both masks apply; 0
        when those weights sum to 0). Differentiable, like the loss.
      vocab_chunk_size: rows per logits chunk on each device; must divide the rows a device
        holds. Bounds the logits block to `[tokens, vocab_chunk_size]`. `"auto"` (default):
        the largest divisor of the rows per device whose float32 block fits
        `memory_target`; None: all rows in one block.
      reduction: `"none"` (per-token loss), `"sum"`, or `"mean"` over tokens whose label is
        not `ignore_index` (weighted by `weights` when given).
      mesh: the mesh; default `jax.set_mesh`'s, else the arrays' own, else one device.
      hidden_spec, weight_spec: layouts; default read from the arrays (a concrete array's
        sharding, or its type in an Explicit mesh). Under `jit` in an Auto mesh pass both.
      table_move: with the table's hidden axis split over axes that also split the tokens
        (FSDP), `"gather"` all-gathers the table's shard over them once (the forward's is
        kept for the backward) and reduce-scatters its gradient back, the tokens staying split;
        `"none"` runs every token on every device of those axes and psums each logits block
        over them; `"auto"` (default) takes the one that sends fewer bytes
        (`plan_cross_entropy` prints both).
      memory_target: bytes of one float32 logits block per device for `"auto"` chunks
        (default 64 MiB).

    Returns:
      float32 loss: `[*tokens]` laid out like hidden's tokens, or a scalar when reduced.

    Raises:
      TypeError: non-integer labels, a non-float table, hidden or weights, a softcap that is
        not a number.
      ValueError: mismatched shapes (weights included), splits that do not divide, options
        out of range (a softcap <= 0), a table whose layout differs from `weight_spec` in an
        Explicit mesh.

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

      Gemma 2's soft cap, and a loss mask as weights (the mean over the kept tokens):

      >>> mask = (labels % 4 != 0).astype(jnp.float32)
      >>> loss = vocab_parallel_cross_entropy(hidden, table, labels, softcap=5.0,
      ...                                     weights=mask, reduction="mean")
      >>> capped = optax.softmax_cross_entropy_with_integer_labels(
      ...     5.0 * np.tanh(logits / 5.0), labels)
      >>> bool(jnp.allclose(loss, (capped * mask).sum() / mask.sum(), rtol=1e-5))
      True
    """
    function = "vocab_parallel_cross_entropy"
    hidden, labels, mesh, hidden_spec, weight_spec = check_inputs(
        function, hidden, table, labels, mesh, hidden_spec, weight_spec
    )
    check_reduction(reduction)
    weights = check_weights(weights, labels.shape)
    plan = plan_cross_entropy(
        mesh, hidden.shape, table.shape, hidden_spec=hidden_spec, weight_spec=weight_spec,
        vocab_size=vocab_size, vocab_chunk_size=vocab_chunk_size,
        label_smoothing=label_smoothing, z_loss=z_loss, ignore_index=ignore_index,
        softcap=softcap, table_move=table_move, memory_target=memory_target,
        dtype=hidden.dtype, table_dtype=table.dtype,
    )  # fmt: skip
    hidden = move(hidden, mesh, plan.hidden_spec)
    labels = move(labels.astype(jnp.int32), mesh, plan.tokens_spec)  # int32 holds them
    if weights is not None:
        weights = move(weights, mesh, plan.tokens_spec)
    run = _cross_entropy_jit if eager(hidden, table, labels) else _cross_entropy
    loss = run(plan, mesh, hidden, table, labels)
    loss = reduce_tokens(loss, labels, weights, ignore_index=plan.ignore_index, reduction=reduction)
    if reduction == "none":  # a slice when the tokens were gathered, a gather when sliced
        return move(loss, mesh, plan.out_spec, known=plan.tokens_spec)
    return loss
