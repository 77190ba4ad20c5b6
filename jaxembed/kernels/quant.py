"""The shard-local work of lookups on a quantized table: gather bytes, unpack, scale, pool.

The XLA twins of `jaxembed.kernels.local`'s `gather_rows`, `pool_sum` and `pool_max`, same
arguments and results, for a `jaxembed.quant.QuantizedTable` shard: they gather each slot's
packed bytes (and its row's scale and bias), unpack them with shifts and masks and read them
as `q · scale + bias` (fp8: its code's value) in the same fusion, so the float rows exist only
for the slots looked up, never for the table. They lower to plain StableHLO (no custom call),
so a serving function exported with them runs wherever jax does, CPU, GPU or TPU, and they are
the reference any native quantized kernel is tested against.

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

import jax
import jax.numpy as jnp

from jaxembed.quant import QuantizedTable, decode

__all__ = ["gather_rows", "pool_max", "pool_sum"]


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
