"""Row-sparse updates: a training step that costs what the batch touches, not the table.

The update runs as one `shard_map` body driven by the lookup's plan:

    out_grad's moves and transposes (as the backward)
      -> the exchange: rows (gather ids and out_grad over the batch axes) or routed
      -> per shard: each slot's gradient; the slots this shard owns
      -> dedup (sort + segment sum, static size)        unique rows u: i32[M]
      -> gather table[u], state[u]                      f[M, H/K]
      -> the optimizer formula on those rows
      -> scatter back at the unique rows                (in place when donated)

No buffer of the table's shape exists besides the table and its state. The gradients of
duplicate ids are summed before the formula, so every touched row gets exactly one update;
untouched rows and their state stay bitwise as they were.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxembed.kernels.local import scaled_bag_grads
from jaxembed.ragged import running_sum

__all__ = ["apply_rows", "bag_apply_rows", "dedup_rows", "row_sum_over"]


def dedup_rows(local: jax.Array, valid: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """The distinct local rows of the valid slots, and each slot's index among them.

    Args:
      local: int32[M] local row of each slot.
      valid: bool[M] whether the slot reads a row of this shard.
      num_rows: the shard's rows (invalid slots share the out-of-range row `num_rows`).

    Returns:
      `(unique, which)`: int32[M] sorted distinct row indices, padded with distinct
      out-of-range indices (`num_rows + position`), so that a scatter there drops; and
      int32[M], the position in `unique` of each slot's row.
    """
    m = local.shape[0]
    key = jnp.where(valid, local, num_rows).astype(jnp.int32)
    order = jnp.argsort(key, stable=True)
    sorted_key = key[order]
    first = jnp.concatenate([jnp.ones((1,), bool), sorted_key[1:] != sorted_key[:-1]])
    position = running_sum(first, dtype=jnp.int32) - 1  # in sorted order
    which = jnp.zeros((m,), jnp.int32).at[order].set(position, unique_indices=True)
    unique = (num_rows + jnp.arange(m, dtype=jnp.int32)).at[position].set(sorted_key)
    return unique, which


def row_sum_over(hidden_axes: tuple[str, ...]):
    """`row_sum` for the formulas: the sum over the whole hidden axis of a shard's columns."""

    def row_sum(x: jax.Array) -> jax.Array:
        s = jnp.sum(x, axis=-1)
        return jax.lax.psum(s, hidden_axes) if hidden_axes else s

    return row_sum


def apply_rows(
    formula: Any,
    table: jax.Array,
    slots: tuple[jax.Array, ...],
    count: jax.Array,
    local: jax.Array,
    valid: jax.Array,
    grads: jax.Array,
    *,
    hidden_axes: tuple[str, ...],
    hidden_size: int,
    dedup: Any = None,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """One row-sparse step on a shard: dedup, gather, the formula, scatter.

    Args:
      formula: a `jaxembed.optim.formulas.RowFormula`.
      table: f[V/R, H/K] this device's shard.
      slots: the optimizer state, each f32[V/R, H/K] or f32[V/R] (one per row).
      count: int32[] updates applied before this one.
      local, valid: int32[M], bool[M]: each slot's local row, and whether it is this
        shard's and reads a row.
      grads: f[M, H/K] each slot's gradient.
      hidden_axes: the mesh axes splitting the hidden axis (a row's mean of g² sums them).
      hidden_size: the global H.
      dedup: `dedup_rows` or a twin with its result (the native kernels' radix sort: a
        split hidden axis keeps the rest of the step here, for the row sums' `psum`).

    Returns:
      The new shard and state.
    """
    rows = table.shape[0]
    unique, which = (dedup or dedup_rows)(local, valid, rows)  # i32[M], i32[M]
    g = jnp.where(valid[:, None], grads.astype(jnp.float32), 0.0)
    g = jax.ops.segment_sum(g, which, num_segments=local.shape[0])  # f32[M, H/K] summed
    w = table.at[unique].get(mode="fill", fill_value=0)
    state = tuple(s.at[unique].get(mode="fill", fill_value=0) for s in slots)
    new_w, new_state = formula.apply(
        w, g, state, count, row_sum=row_sum_over(hidden_axes), hidden_size=hidden_size
    )
    put = dict(mode="drop", indices_are_sorted=True, unique_indices=True)
    table = table.at[unique].set(new_w.astype(table.dtype), **put)
    pairs = zip(slots, new_state, strict=True)
    slots = tuple(s.at[unique].set(n.astype(s.dtype), **put) for s, n in pairs)
    return table, slots


def bag_apply_rows(
    formula: Any,
    table: jax.Array,
    slots: tuple[jax.Array, ...],
    count: jax.Array,
    local: jax.Array,
    valid: jax.Array,
    segments: jax.Array,
    scale: jax.Array,
    out_grad: jax.Array,
    *,
    hidden_size: int,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """`apply_rows` of the bag slots' gradients `scale[i] · out_grad[segments[i]]`.

    The XLA twin of `jaxembed.kernels.native.bag_apply_rows` (whole rows on each device): the
    `[M, H]` slot gradients (`jaxembed.kernels.local.scaled_bag_grads`), then `apply_rows`.

    Args:
      formula, table, slots, count, local, valid, hidden_size: as `apply_rows`.
      segments: int32[M] each slot's bag.
      scale: f32[M] each slot's factor.
      out_grad: f[S, H] the pooled output's cotangent.

    Returns:
      The new shard and state.
    """
    grads = scaled_bag_grads(segments, scale, out_grad)
    return apply_rows(formula, table, slots, count, local, valid, grads, hidden_axes=(),
                      hidden_size=hidden_size)  # fmt: skip
