"""Vocab-parallel metrics of a tied head: `argmax`, `top_k` and `accuracy` of `hidden @ table.T`.

Like the loss (`jaxembed.kernels.cross_entropy`), they never build the logits of the whole
vocabulary: they run in the layouts and chunks of `plan_cross_entropy`. Each device walks
its rows chunk by chunk (`[tokens, chunk]` logits, psummed over K when the table's hidden
axis is split), keeping its best `k` candidates per token (`[tokens, k]` values and ids);
then one `all_gather` of the `[R, tokens, k]` candidates over the vocab axes R and a last
top-k over the `R * k` candidates give every device the answer:

    local   = top_k(concat(best, top_k(chunk_logits)))        per chunk, f32[T, k], i32[T, k]
    answer  = top_k(all_gather_R(local))                        f32[T, R*k] -> [T, k]

Ties go to the lowest id, as `jax.lax.top_k` and `jnp.argmax` on the dense logits: a
candidate list keeps equal values in id order, earlier chunks and lower shards come first in
every concatenation, and `top_k` keeps the lower position of equal values. Padding rows
(past `vocab_size`) are `-inf` and never win while `k <= vocab_size`. The metrics take no
gradient (`stop_gradient` on the inputs); the public face is `jaxembed.losses`.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxembed.kernels.arrays import eager, move, normalize_spec
from jaxembed.kernels.cross_entropy import chunk_logits, softcap_logits, vary
from jaxembed.kernels.vocab_args import (
    Reduction,
    check_inputs,
    check_reduction,
    check_weights,
    reduce_tokens,
)
from jaxembed.plan.cross_entropy import CrossEntropyPlan, plan_cross_entropy

__all__ = ["accuracy", "argmax", "top_k"]


# --- the shard_map body ---------------------------------------------------------------------


def _best(values: jax.Array, ids: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The `k` largest of `values [T, n]` with their `ids`, equal values in position order."""
    if k == 1:  # a reduction, cheaper than a sort; argmax keeps the first of equal values
        pos = jnp.argmax(values, axis=-1, keepdims=True)
    else:
        _, pos = jax.lax.top_k(values, k)
    return jnp.take_along_axis(values, pos, -1), jnp.take_along_axis(ids, pos, -1)


def _top_k_body(plan: CrossEntropyPlan, k: int, h: jax.Array, t: jax.Array):
    # h: f[*tokens/B, H/K]   t: f[V/R, H/K]
    tokens = h.shape[:-1]
    h = h.reshape(-1, h.shape[-1])  # f[T, H/K]
    per_chunk = min(k, plan.chunk_rows)

    def step(carry, c):  # this device's best k so far, merged with the chunk's best
        values, ids = carry  # f32[T, k], i32[T, k]
        z, rows, _ = chunk_logits(plan, h, t, c)  # f32[T, C], whole over K
        z, _ = softcap_logits(plan, z)
        z = jnp.where(rows[None, :] < plan.vocab_size, z, -jnp.inf)  # padding never wins
        z_best, z_ids = _best(z, jnp.broadcast_to(rows, z.shape), per_chunk)  # [T, k'] each
        both = (jnp.concatenate([values, z_best], -1), jnp.concatenate([ids, z_ids], -1))
        return _best(*both, k), None

    empty = vary(jnp.full((h.shape[0], k), -jnp.inf, jnp.float32), h, t, drop=plan.hidden_axes)
    none = vary(jnp.full((h.shape[0], k), -1, jnp.int32), h, t, drop=plan.hidden_axes)
    (values, ids), _ = jax.lax.scan(step, (empty, none), jnp.arange(plan.num_chunks))
    if plan.row_axes:  # one collective: every shard's candidates, in shard (= id) order
        every = jax.lax.all_gather((values, ids), plan.row_axes, to="invarying")  # [R, T, k]
        flat = [a.transpose(1, 0, 2).reshape(a.shape[1], -1) for a in every]  # [T, R*k]
        values, ids = _best(*flat, k)
    return values.reshape(*tokens, k), ids.reshape(*tokens, k)  # [*tokens/B, k] each


def _run_top_k(plan: CrossEntropyPlan, mesh: Any, k: int, hidden, table):
    body = functools.partial(_top_k_body, plan, k)
    if mesh is None:
        return body(hidden, table)
    out = P(*normalize_spec(plan.tokens_spec, len(plan.hidden_shape) - 1), None)
    run = jax.shard_map(
        body, mesh=mesh, in_specs=(plan.hidden_spec, plan.weight_spec), out_specs=(out, out),
        check_vma=True,
    )  # fmt: skip
    return run(hidden, table)


# An eager call: one compiled program, not the `shard_map` body dispatched op by op.
_run_top_k_jit = jax.jit(_run_top_k, static_argnums=(0, 1, 2))


def _top_k_tokens(function, hidden, table, labels, k, *, vocab_size, softcap,
                  vocab_chunk_size, mesh, hidden_spec, weight_spec, ignore_index=None):  # fmt: skip
    """Checks, plans, and runs the body: `(plan, mesh, labels, values, ids)`, the last three
    in the plan's tokens layout (`labels` int32, or None)."""
    hidden, labels, mesh, hidden_spec, weight_spec = check_inputs(
        function, hidden, table, labels, mesh, hidden_spec, weight_spec
    )
    plan = plan_cross_entropy(
        mesh, hidden.shape, table.shape, hidden_spec=hidden_spec, weight_spec=weight_spec,
        vocab_size=vocab_size, vocab_chunk_size=vocab_chunk_size, softcap=softcap,
        ignore_index=ignore_index, table_move="none",  # the metrics' bodies psum over K
    )  # fmt: skip
    k = _check_k(k, plan.vocab_size)
    hidden = move(jax.lax.stop_gradient(hidden), mesh, plan.hidden_spec)
    run = _run_top_k_jit if eager(hidden, table) else _run_top_k
    values, ids = run(plan, mesh, k, hidden, jax.lax.stop_gradient(table))
    if labels is not None:
        labels = move(labels.astype(jnp.int32), mesh, plan.tokens_spec)
    return plan, mesh, labels, values, ids


def _check_k(k: Any, vocab_size: int) -> int:
    """`k` as an int in `[1, vocab_size]`, or a clear error."""
    try:
        if isinstance(k, bool):
            raise TypeError
        k = operator.index(k)
    except (TypeError, jax.errors.ConcretizationTypeError):
        raise TypeError(
            f"k must be a Python int, got {k!r}: it fixes the shape of the result"
        ) from None
    if not 1 <= k <= vocab_size:
        raise ValueError(
            f"k={k} must be in [1, vocab_size={vocab_size}]: ask for at most {vocab_size} "
            "candidates (padding rows past vocab_size are never candidates)"
        )
    return k


def _out(plan: CrossEntropyPlan, a: jax.Array, mesh: Any) -> jax.Array:
    """`a [*tokens, ...]` moved from the plan's tokens layout to the given hidden's."""
    out = normalize_spec(plan.out_spec, len(plan.hidden_shape) - 1)
    return move(a, mesh, P(*out, *(None,) * (a.ndim - len(out))))


# --- the public functions -------------------------------------------------------------------


def top_k(
    hidden: jax.Array,
    table: jax.Array,
    k: int,
    *,
    vocab_size: int | None = None,
    softcap: float | None = None,
    vocab_chunk_size: int | None = None,
    mesh: Any = None,
    hidden_spec: P | None = None,
    weight_spec: P | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The `k` largest logits of `hidden @ table.T` per token and their ids, vocab-parallel.

    Equal to `jax.lax.top_k(logits, k)` on the dense logits `hidden @ table[:vocab_size].T`
    (capped as `softcap * tanh(logits / softcap)` when `softcap` is given), ties to the
    lowest id, but no device holds more than `[tokens, V/n]` logits (`[tokens,
    vocab_chunk_size]` with chunking): each device keeps its best `k` per token and one
    `all_gather` of those candidates over the vocab axes decides. No gradient flows.

    Args:
      hidden: `[*tokens, H]`, float32 or bfloat16 (logits accumulate in float32).
      table: the tied table `[V, H]`, usually split on its vocab axis; `V` may be padded.
      k: how many, `1 <= k <= vocab_size`.
      vocab_size: the real rows (default `V`); padding rows are never candidates.
      softcap: Gemma 2's final-logit soft cap (see `vocab_parallel_cross_entropy`).
      vocab_chunk_size, mesh, hidden_spec, weight_spec: as for
        `vocab_parallel_cross_entropy`.

    Returns:
      `(values, ids)`: float32 `[*tokens, k]` in decreasing order and int32 `[*tokens, k]`,
      laid out like hidden's tokens.

    Raises:
      TypeError: a non-float table or hidden, a `k` that is not an int.
      ValueError: `k` outside `[1, vocab_size]`, mismatched shapes, splits that do not
        divide, a softcap <= 0.

    Examples:
      >>> import jax, numpy as np
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
      >>> k1, k2 = jax.random.split(jax.random.key(0))
      >>> table = jax.device_put(jax.random.normal(k1, (1024, 16)),
      ...                        NamedSharding(mesh, P("model", None)))
      >>> hidden = jax.device_put(jax.random.normal(k2, (4, 8, 16)),
      ...                         NamedSharding(mesh, P("data")))
      >>> values, ids = top_k(hidden, table, 5, vocab_chunk_size=64)
      >>> ids.shape, ids.dtype, ids.sharding.spec
      ((4, 8, 5), dtype('int32'), P('data', None, None))
      >>> dense_values, dense_ids = jax.lax.top_k(np.asarray(hidden) @ np.asarray(table).T, 5)
      >>> bool((ids == dense_ids).all()), bool(np.allclose(values, dense_values, rtol=1e-5))
      (True, True)
    """
    plan, mesh, _, values, ids = _top_k_tokens(
        "top_k", hidden, table, None, k, vocab_size=vocab_size, softcap=softcap,
        vocab_chunk_size=vocab_chunk_size, mesh=mesh, hidden_spec=hidden_spec,
        weight_spec=weight_spec,
    )  # fmt: skip
    return _out(plan, values, mesh), _out(plan, ids, mesh)


def argmax(
    hidden: jax.Array,
    table: jax.Array,
    *,
    vocab_size: int | None = None,
    softcap: float | None = None,
    vocab_chunk_size: int | None = None,
    mesh: Any = None,
    hidden_spec: P | None = None,
    weight_spec: P | None = None,
) -> jax.Array:
    """The id of the largest logit of `hidden @ table.T` per token (greedy decoding).

    Equal to `jnp.argmax(logits, -1)` on the dense logits (ties to the lowest id), without
    building them: `top_k` with `k=1`, each device's best per token reduced chunk by chunk.

    Args:
      hidden, table, vocab_size, softcap, vocab_chunk_size, mesh, hidden_spec, weight_spec:
        as for `top_k`. A cap never changes the order, but saturated logits may tie.

    Returns:
      int32 `[*tokens]`, laid out like hidden's tokens.

    Raises:
      TypeError, ValueError: as for `top_k`.

    Examples:
      >>> import jax, numpy as np
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("model",))
      >>> k1, k2 = jax.random.split(jax.random.key(1))
      >>> table = jax.device_put(jax.random.normal(k1, (512, 16)),
      ...                        NamedSharding(mesh, P("model", None)))
      >>> hidden = jax.random.normal(k2, (6, 16))
      >>> ids = argmax(hidden, table, vocab_size=500)
      >>> logits = np.asarray(hidden) @ np.asarray(table)[:500].T
      >>> ids.dtype, bool((ids == logits.argmax(-1)).all())
      (dtype('int32'), True)
    """
    plan, mesh, _, _, ids = _top_k_tokens(
        "argmax", hidden, table, None, 1, vocab_size=vocab_size, softcap=softcap,
        vocab_chunk_size=vocab_chunk_size, mesh=mesh, hidden_spec=hidden_spec,
        weight_spec=weight_spec,
    )  # fmt: skip
    return _out(plan, ids[..., 0], mesh)


def accuracy(
    hidden: jax.Array,
    table: jax.Array,
    labels: jax.Array,
    *,
    k: int = 1,
    vocab_size: int | None = None,
    softcap: float | None = None,
    ignore_index: int | None = None,
    weights: jax.Array | None = None,
    reduction: Reduction = "mean",
    vocab_chunk_size: int | None = None,
    mesh: Any = None,
    hidden_spec: P | None = None,
    weight_spec: P | None = None,
) -> jax.Array:
    """Top-k accuracy of `hidden @ table.T` against integer labels, vocab-parallel.

    A token is correct when its label is among `top_k(..., k)`'s ids (`k=1`: it is the
    argmax, ties to the lowest id). A label outside `[0, vocab_size)` is never correct.

    Args:
      hidden, table, vocab_size, softcap, vocab_chunk_size, mesh, hidden_spec, weight_spec:
        as for `top_k`.
      labels: integer `[*tokens]`.
      k: top-k accuracy (default 1, top-1).
      ignore_index: a label whose token counts neither as correct nor in the mean.
      weights: float `[*tokens]` per-token weights (e.g. a 0/1 mask of real tokens).
      reduction: `"mean"` (default): `sum(w * correct) / sum(w)` over the tokens not
        ignored (0 when those weights sum to 0); `"sum"`; `"none"`: `w * correct` per token.

    Returns:
      float32: a scalar, or `[*tokens]` laid out like hidden's tokens for `"none"`.

    Raises:
      TypeError: non-integer labels, non-float weights, hidden or table.
      ValueError: as for `top_k`; weights not shaped like the labels; a bad reduction.

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
      >>> k1, k2 = jax.random.split(jax.random.key(2))
      >>> table = jax.device_put(jax.random.normal(k1, (256, 16)),
      ...                        NamedSharding(mesh, P("model", None)))
      >>> hidden = jax.device_put(jax.random.normal(k2, (8, 16)), NamedSharding(mesh, P("data")))
      >>> logits = np.asarray(hidden) @ np.asarray(table).T
      >>> labels = jnp.asarray(logits.argmax(-1)).at[:2].set(-100)  # two tokens ignored
      >>> float(accuracy(hidden, table, labels, ignore_index=-100))
      1.0
      >>> float(accuracy(hidden, table, (labels + 1) % 256, k=256))  # every label in the top 256
      1.0
    """
    function = "accuracy"
    check_reduction(reduction)
    tokens = jnp.shape(hidden)[:-1]
    weights = check_weights(weights, tokens)
    plan, mesh, labels, _, ids = _top_k_tokens(
        function, hidden, table, labels, k, vocab_size=vocab_size, softcap=softcap,
        vocab_chunk_size=vocab_chunk_size, mesh=mesh, hidden_spec=hidden_spec,
        weight_spec=weight_spec, ignore_index=ignore_index,
    )  # fmt: skip
    in_vocab = (labels >= 0) & (labels < plan.vocab_size)
    correct = in_vocab & (ids == labels[..., None]).any(axis=-1)
    if ignore_index is not None:
        correct = correct & (labels != ignore_index)
    if weights is not None:
        weights = move(jax.lax.stop_gradient(weights), mesh, plan.tokens_spec)
    result = reduce_tokens(
        correct.astype(jnp.float32), labels, weights, ignore_index=ignore_index,
        reduction=reduction,
    )  # fmt: skip
    return _out(plan, result, mesh) if reduction == "none" else result
