"""The shard-local work of every lookup: which rows are here, gather, pool, scatter.

These run inside the `shard_map` bodies, on one device's block, with no communication. They
are the seam where a native kernel may replace XLA (`jaxembed.kernels.native`, chosen by
`jaxembed.kernels.select.kernels_for`): each function here is the reference its native twin,
of the same name and signature, is tested against.

Row sharding. A table split over R mesh axes (n shards) holds, on shard s:

* `"block"`: ids `[s·V/n, (s+1)·V/n)`, id i at local row `i - s·V/n`;
* `"mod"`: ids with `i mod n = s`, id i at local row `i div n` (hot ids of a skewed
  vocabulary spread over every shard).

`bucket_ids` is the routed exchange's bucketing of a device's ids by owner
(`jaxembed.kernels.routed.bucketize`): a comparison sort by (owner, id) here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxembed.ragged import running_sum, segments_from_lengths

__all__ = [
    "bag_scatter_add",
    "bag_scatter_add_pieces",
    "bucket_ids",
    "gather_rows",
    "local_rows",
    "owner_of",
    "pool_max",
    "pool_sum",
    "pool_sum_pieces",
    "reads_a_row",
    "scaled_bag_grads",
    "scatter_add",
    "scatter_add_pieces",
    "segments_from_lengths",
]


def reads_a_row(ids: jax.Array, vocab_size: int, padding_idx: int | None) -> jax.Array:
    """Whether each id reads a table row: in `[0, vocab_size)` and not `padding_idx`."""
    valid = (ids >= 0) & (ids < vocab_size)
    if padding_idx is not None:
        valid &= ids != padding_idx
    return valid


def owner_of(ids: jax.Array, rows_per_shard: int, num_shards: int, row_sharding: str) -> jax.Array:
    """The row shard (in `[0, num_shards)`) that holds each id's row (ids must be >= 0)."""
    if row_sharding == "mod":
        return ids % num_shards
    return ids // rows_per_shard


def local_rows(plan: Any, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """This shard's row index of each id, and whether the id reads a row of this shard.

    Args:
      plan: the `EmbeddingPlan` (its row axes, rows per shard, vocabulary, padding id,
        row sharding).
      ids: int ids of any shape, global ids.

    Returns:
      `(local, valid)`: local row indices (meaningful where valid) and a bool mask.
    """
    valid = reads_a_row(ids, plan.vocab_size, plan.padding_idx)
    rows = plan.rows_per_shard
    if not plan.row_axes:
        return ids, valid
    me = jax.lax.axis_index(plan.row_axes)
    if plan.row_sharding == "mod":
        n = plan.num_row_shards
        return ids // n, valid & (ids % n == me)
    local = ids - me * rows
    return local, valid & (local >= 0) & (local < rows)


def gather_rows(table: jax.Array, local: jax.Array, valid: jax.Array) -> jax.Array:
    """`table[local]` where valid, zero rows elsewhere: `[*ids, H]`.

    Never `jnp.take`'s default NaN fill: masked slots read row 0 and are zeroed.
    """
    rows = jnp.take(table, jnp.where(valid, local, 0), axis=0, mode="clip")
    return jnp.where(valid[..., None], rows, jnp.zeros((), table.dtype))


def pool_sum(
    table: jax.Array,
    local: jax.Array,
    valid: jax.Array,
    segments: jax.Array,
    scale: jax.Array,
    num_segments: int,
) -> jax.Array:
    """`out[s] = Σ_{i: segments[i] = s, valid[i]} scale[i] · table[local[i]]`, float32.

    Args:
      table: f[V_local, H] this device's shard.
      local, valid: int[M], bool[M] from `local_rows` (flattened).
      segments: int[M] in `[0, num_segments)`, or -1 for a slot that belongs to no bag.
      scale: f32[M] each slot's factor (weights and the combiner's normalization).
      num_segments: the number of bags.

    Returns:
      f32[num_segments, H].
    """
    rows = gather_rows(table, local, valid & (segments >= 0)).astype(jnp.float32)
    rows = rows * scale[:, None]
    seg = jnp.where(valid & (segments >= 0), segments, num_segments)
    return jax.ops.segment_sum(rows, seg, num_segments=num_segments + 1)[:num_segments]


def pool_sum_pieces(
    pieces: Sequence[jax.Array],
    local: jax.Array,
    valid: jax.Array,
    segments: jax.Array,
    scale: jax.Array,
    num_segments: int,
) -> jax.Array:
    """`pool_sum` over a table held as n pieces f[C, H], row r in piece r // C: the results
    of an `all_to_all`, which XLA:CPU makes separate buffers (the native twin reads them in
    place; here they are concatenated)."""
    return pool_sum(jnp.concatenate(list(pieces)), local, valid, segments, scale, num_segments)


def pool_max(
    table: jax.Array,
    local: jax.Array,
    valid: jax.Array,
    segments: jax.Array,
    num_segments: int,
) -> tuple[jax.Array, jax.Array]:
    """Element-wise maximum of each bag's rows on this shard, and the slot that gave it.

    Args:
      table, local, valid, segments, num_segments: as `pool_sum`.

    Returns:
      `(maxima, winners)`: f32[num_segments, H] with `-inf` for a bag with no row here,
      and int32[num_segments, H], the earliest slot reaching the maximum (M where none).
    """
    m = local.shape[0]
    live = valid & (segments >= 0)
    rows = gather_rows(table, local, live).astype(jnp.float32)
    rows = jnp.where(live[:, None], rows, -jnp.inf)
    seg = jnp.where(live, segments, num_segments)
    maxima = jax.ops.segment_max(rows, seg, num_segments=num_segments + 1)
    hit = live[:, None] & (rows == maxima[seg])
    slot = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32)[:, None], rows.shape)
    winners = jax.ops.segment_min(jnp.where(hit, slot, m), seg, num_segments=num_segments + 1)
    return maxima[:num_segments], jnp.minimum(winners[:num_segments], m)


def scatter_add(
    shape: tuple[int, int], local: jax.Array, valid: jax.Array, grads: jax.Array
) -> jax.Array:
    """A zero f32 shard of `shape` with `grads[i]` added at row `local[i]` where valid.

    Args:
      shape: the gradient shard's `(V_local, H_local)`.
      local, valid: int[*ids], bool[*ids].
      grads: f[*ids, H_local].

    Returns:
      f32[V_local, H_local].
    """
    rows = shape[0]
    out = jnp.zeros(shape, jnp.float32)
    return out.at[jnp.where(valid, local, rows)].add(grads.astype(jnp.float32), mode="drop")


def scaled_bag_grads(segments: jax.Array, scale: jax.Array, out_grad: jax.Array) -> jax.Array:
    """f32[M, H]: each bag slot's gradient `scale[i] · out_grad[segments[i]]`, zero where the
    segment is outside `[0, S)` (`out_grad`: f[S, H], the pooled output's cotangent)."""
    s = out_grad.shape[0]
    inside = (segments >= 0) & (segments < s)
    rows = jnp.take(out_grad.astype(jnp.float32), jnp.where(inside, segments, s), axis=0,
                    mode="fill", fill_value=0)  # fmt: skip
    return rows * scale.astype(jnp.float32)[:, None]


def bag_scatter_add(
    shape: tuple[int, int],
    local: jax.Array,
    valid: jax.Array,
    segments: jax.Array,
    scale: jax.Array,
    out_grad: jax.Array,
) -> jax.Array:
    """`scatter_add` of the bag slots' gradients `scale[i] · out_grad[segments[i]]`.

    The XLA twin of `jaxembed.kernels.native.bag_scatter_add` (same arguments and result):
    the `[M, H]` slot gradients (`scaled_bag_grads`), then `scatter_add`.

    Args:
      shape: the gradient shard's `(V_local, H)`.
      local, valid, segments, scale: int[M], bool[M], int[M], f32[M] as `pool_sum`.
      out_grad: f[S, H] the pooled output's cotangent.

    Returns:
      f32[V_local, H].
    """
    return scatter_add(shape, local, valid, scaled_bag_grads(segments, scale, out_grad))


def scatter_add_pieces(
    shape: tuple[int, int], local: jax.Array, valid: jax.Array, pieces: Sequence[jax.Array]
) -> jax.Array:
    """`scatter_add` with the slots' gradients as n pieces f[C, H], slot i's in piece i // C:
    the results of an `all_to_all`, which XLA:CPU makes separate buffers (the native twin
    reads them in place; here they are concatenated)."""
    return scatter_add(shape, local, valid, jnp.concatenate(list(pieces)))


def bag_scatter_add_pieces(
    num_pieces: int,
    shape: tuple[int, int],
    local: jax.Array,
    valid: jax.Array,
    segments: jax.Array,
    scale: jax.Array,
    out_grad: jax.Array,
) -> list[jax.Array]:
    """`bag_scatter_add` into `num_pieces` pieces f32[C, H] (`shape` is `(C, H)`), row r in
    piece r // C: the operands of an `all_to_all`, which XLA:CPU would otherwise slice out
    of one f32[n·C, H] (the native twin writes them in place)."""
    c, h = shape
    out = bag_scatter_add((num_pieces * c, h), local, valid, segments, scale, out_grad)
    return list(out.reshape(num_pieces, c, h))


def bucket_ids(
    dest: jax.Array, key: jax.Array, num_buckets: int, capacity: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each bucket's distinct ids, ascending, and each slot's place among them.

    The sort + dedup of the routed exchange (`jaxembed.kernels.routed.bucketize`): one XLA
    comparison sort of the slots by `(dest, key)`, O(M log M); the native twin
    (`jaxembed.kernels.native.bucket_ids`) gives the same results, bitwise, without one.

    Args:
      dest: i32[M] each slot's bucket in `[0, num_buckets]` (`num_buckets`: the slot reads no
        row; such slots are ranked among themselves like any bucket's, and never sent).
      key: i32[M] each slot's id.
      num_buckets: n, the buckets (owners).
      capacity: C, the places per bucket.

    Returns:
      `(send, pos, overflow)`: i32[n, C] each bucket's distinct ids in ascending order (-1: an
      empty place); i32[M] the rank of each slot's id among its bucket's distinct ids (>= C:
      it did not fit); bool[] whether some bucket `b < n` holds more than C distinct ids.

    Examples:
      >>> import jax.numpy as jnp
      >>> send, pos, over = bucket_ids(jnp.array([1, 0, 1, 2, 1]), jnp.array([9, 4, 3, 0, 9]),
      ...                              num_buckets=2, capacity=2)
      >>> send.tolist(), pos.tolist(), bool(over)
      ([[4, -1], [3, 9]], [1, 0, 0, 0, 1], False)
    """
    n, c = int(num_buckets), int(capacity)
    m = dest.shape[0]
    dest, key = dest.astype(jnp.int32), key.astype(jnp.int32)
    slot = jnp.arange(m, dtype=jnp.int32)
    sorted_dest, sorted_key, order = jax.lax.sort((dest, key, slot), num_keys=2)
    changed = (sorted_dest[1:] != sorted_dest[:-1]) | (sorted_key[1:] != sorted_key[:-1])
    new = jnp.concatenate([jnp.ones((min(m, 1),), bool), changed])
    rank = running_sum(new, dtype=jnp.int32) - 1  # distinct id number, in sorted order
    distinct = jax.ops.segment_sum(new.astype(jnp.int32), sorted_dest, num_segments=n + 1)
    start = running_sum(distinct) - distinct  # each bucket's first distinct number
    sorted_pos = rank - start[sorted_dest]
    pos = jnp.zeros((m,), jnp.int32).at[order].set(sorted_pos, unique_indices=True)
    keep = new & (sorted_dest < n) & (sorted_pos < c)
    send = (
        jnp.full((n, c), -1, jnp.int32)
        .at[jnp.where(keep, sorted_dest, n), jnp.where(keep, sorted_pos, c)]
        .set(sorted_key, mode="drop")
    )
    return send, pos, jnp.any(distinct[:n] > c)
