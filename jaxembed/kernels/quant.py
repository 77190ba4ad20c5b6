"""The shard-local work of lookups on a quantized table: gather bytes, unpack, scale, pool.

The XLA twins of `jaxembed.kernels.local`'s `gather_rows`, `pool_sum` and `pool_max`, same
arguments and results, for a `jaxembed.quant.QuantizedTable` shard: they gather each slot's
packed bytes (and its row's scale and bias), unpack them with shifts and masks and read them
as `q · scale + bias` (fp8: its code's value) in the same fusion, so the float rows exist only
for the slots looked up, never for the table. They lower to plain StableHLO (no custom call),
so a serving function exported with them runs wherever jax does, CPU, GPU or TPU, and they are
the reference any native quantized kernel is tested against. `pool_bags` is the whole
one-device pooled lookup of sum, mean and sqrtn bags in one call, from the bags as the caller
holds them (dense ids, or flat ids and lengths, and weights): the canonical form
(`jaxembed.ragged`), each slot's factor, then `pool_sum`.

A shard is a `QuantizedTable` of one device's blocks, as a `shard_map` body over
`table.specs(weight_spec)` sees it: `data u8[V/R, B/K]`, `scale`, `bias f16[V/R]` (None for
fp8); its `dim` is the block's, `H/K`.

Examples:
  >>> import jax.numpy as jnp
  >>> from jaxembed.quant import quantize
  >>> q = quantize(jnp.array([[0.0, 15.0], [2.0, 32.0], [8.0, 8.0]]), "int4")
  >>> gather_rows(q, jnp.array([1, 2, 0]), jnp.array([True, True, False])).tolist()
  [[2.0, 32.0], [8.0, 8.0], [0.0, 0.0]]
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxembed import ragged
from jaxembed.quant import QuantizedTable, decode

__all__ = ["POOLED_COMBINERS", "gather_rows", "pool_bags", "pool_max", "pool_sum"]

POOLED_COMBINERS = ("sum", "mean", "sqrtn")
"""The combiners `pool_bags` pools (weighted sums of the bags' rows)."""


def _take(table: QuantizedTable, rows: jax.Array) -> QuantizedTable:
    """The table's rows `rows` (any shape; in range), still quantized: data u8[*rows, B]."""
    return jax.tree.map(lambda a: jnp.take(a, rows, axis=0, mode="clip"), table)


def gather_rows(table: QuantizedTable, local: jax.Array, valid: jax.Array) -> jax.Array:
    """f32 `[*ids, H]`: row `local` of the quantized shard where `valid`, zero rows elsewhere.

    Args:
      table: a `QuantizedTable` shard, `data u8[V_local, B]`.
      local, valid: int `[*ids]` this shard's row of each id, bool `[*ids]` whether it reads one
        (`jaxembed.kernels.local.local_rows`).

    Returns:
      f32 `[*ids, H]`, H = `table.dim` (the shard's columns).
    """
    rows = decode(_take(table, jnp.where(valid, local, 0)))  # f32[*ids, H]
    return jnp.where(valid[..., None], rows, 0.0)


def pool_sum(
    table: QuantizedTable,
    local: jax.Array,
    valid: jax.Array,
    segments: jax.Array,
    scale: jax.Array,
    num_segments: int,
) -> jax.Array:
    """`out[s] = Σ_{i: segments[i] = s, valid[i]} scale[i] · row(local[i])`, float32.

    Sum, mean and sqrtn bags are this with `jaxembed.ragged.bag_scales`' factors, as for a
    float table (`jaxembed.kernels.local.pool_sum`).

    Args:
      table: a `QuantizedTable` shard, `data u8[V_local, B]`.
      local, valid: int[M], bool[M] from `local_rows` (flattened).
      segments: int[M] in `[0, num_segments)`, or -1 for a slot that belongs to no bag.
      scale: f32[M] each slot's factor (weights and the combiner's normalization); not the
        rows' quantization scale, which `table` holds.
      num_segments: the number of bags.

    Returns:
      f32[num_segments, H].
    """
    live = valid & (segments >= 0)
    rows = gather_rows(table, local, live) * scale.astype(jnp.float32)[:, None]  # f32[M, H]
    seg = jnp.where(live, segments, num_segments)
    return jax.ops.segment_sum(rows, seg, num_segments=num_segments + 1)[:num_segments]


def pool_max(
    table: QuantizedTable,
    local: jax.Array,
    valid: jax.Array,
    segments: jax.Array,
    num_segments: int,
) -> tuple[jax.Array, jax.Array]:
    """Element-wise maximum of each bag's rows on this shard, and the slot that gave it.

    Args:
      table, local, valid, segments, num_segments: as `pool_sum`.

    Returns:
      `(maxima, winners)`: f32[num_segments, H] with `-inf` for a bag with no row here, and
      int32[num_segments, H], the earliest slot reaching the maximum (M where none), as
      `jaxembed.kernels.local.pool_max`.
    """
    m = local.shape[0]
    live = valid & (segments >= 0)
    rows = jnp.where(live[:, None], gather_rows(table, local, live), -jnp.inf)  # f32[M, H]
    seg = jnp.where(live, segments, num_segments)
    maxima = jax.ops.segment_max(rows, seg, num_segments=num_segments + 1)
    hit = live[:, None] & (rows == maxima[seg])
    slot = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32)[:, None], rows.shape)
    winners = jax.ops.segment_min(jnp.where(hit, slot, m), seg, num_segments=num_segments + 1)
    return maxima[:num_segments], jnp.minimum(winners[:num_segments], m)


def pool_bags(
    table: QuantizedTable,
    ids: jax.Array,
    lengths: jax.Array | None = None,
    weights: jax.Array | None = None,
    *,
    combiner: str = "sum",
    vocab_size: int | None = None,
    padding_idx: int | None = None,
) -> jax.Array:
    """Sum, mean or sqrtn bags pooled from a quantized table, the bags read as given.

    One device's whole pooled lookup (`jaxembed.embedding_bag`'s semantics): a slot reads a
    row when its id is in `[0, vocab_size)` and not `padding_idx` (negative ids are empty
    slots); its factor is `jaxembed.ragged.bag_scales`'; the bags pool as `pool_sum`.

    Args:
      table: a `QuantizedTable` (or one device's shard of whole rows), `data u8[V, B]`.
      ids: int `[*batch, L]`, a bag a row (no `lengths`), or `[*lead, N]` with `lengths`.
      lengths: int `[*lead, B]`: bag b is the next `lengths[..., b]` ids; or None.
      weights: float, shaped like `ids`, or None.
      combiner: `"sum"`, `"mean"` or `"sqrtn"` (max: `pool_max`).
      vocab_size: the rows ids may read (default: the table's).
      padding_idx: an id that reads nothing and is not counted, or None.

    Returns:
      f32 `[*batch, H]` (dense ids) or `[*lead, B, H]`.

    Raises:
      ValueError: a combiner other than sum, mean and sqrtn; and `jaxembed.ragged.to_bag_batch`'s
        errors for malformed bags.
    """
    if combiner not in POOLED_COMBINERS:
        raise ValueError(
            f"pool_bags pools {', '.join(POOLED_COMBINERS)} bags, got combiner={combiner!r}: "
            "max bags pool with pool_max"
        )
    batch = ragged.to_bag_batch(ids, lengths=lengths, per_id_weights=weights)
    vocab = table.rows if vocab_size is None else int(vocab_size)
    valid = ragged.valid_slots(batch, vocab, padding_idx)
    scale = ragged.bag_scales(valid, batch.segments, batch.weights, batch.num_bags, combiner)
    seg = ragged.global_segments(jnp.where(valid, batch.segments, -1), batch.num_bags)
    lead = batch.ids.shape[:-1]
    local = jnp.where(valid, batch.ids, 0).reshape(-1)
    num = math.prod(lead) * batch.num_bags
    pooled = pool_sum(table, local, valid.reshape(-1), seg.reshape(-1), scale.reshape(-1), num)
    if batch.dense:
        return pooled.reshape(*lead, table.dim)
    return pooled.reshape(*lead, batch.num_bags, table.dim)
