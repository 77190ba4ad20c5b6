"""Block and mod row sharding: where each id's row lives, and moving a table between them.

A table split over n row shards holds, on shard s (its rows `[s·L, (s+1)·L)` of the array,
L = V/n):

* `"block"` (JAX's own layout of a split axis): ids `[s·L, (s+1)·L)`, id i at local row
  `i - s·L`;
* `"mod"`: the ids with `i mod n = s`, id i at local row `i div n`. A skewed vocabulary
  (Zipf: the hot ids are the low ones) then spreads its hot rows over every shard instead of
  piling them on shard 0, which keeps the routed exchange's buckets balanced.

A mod-sharded table is the id-ordered table with its rows permuted: `to_mod_order` and
`from_mod_order` convert (padding the rows to a multiple of n). Checkpoints can keep the id
order (`from_mod_order` before saving) so that they restore onto any number of shards.

Examples:
  >>> import numpy as np
  >>> table = np.arange(8)[:, None] * np.ones((1, 2))        # row i holds i
  >>> to_mod_order(table, 4)[:, 0].tolist()                   # shard s: ids s, s+4
  [0.0, 4.0, 1.0, 5.0, 2.0, 6.0, 3.0, 7.0]
  >>> np.array_equal(from_mod_order(to_mod_order(table, 4), 4), table)
  True
  >>> bucket_loads(np.array([0, 1, 2, 3, 0, 1]), vocab_size=8, num_shards=2)
  {'block': 1.0, 'mod': 0.5}
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["bucket_loads", "from_mod_order", "suggest_row_sharding", "to_mod_order"]


def _xp(table: Any):
    return np if isinstance(table, np.ndarray) else __import__("jax.numpy", fromlist=["x"])


def to_mod_order(table: Any, num_shards: int) -> Any:
    """The id-ordered table `[V, H]` laid out for `row_sharding="mod"` over `num_shards`.

    Rows are padded with zeros to a multiple of `num_shards` (pass the real count as
    `vocab_size` to the lookups). Works on numpy and jax arrays (under `jit` too).

    Args:
      table: `[V, H]` in id order.
      num_shards: n, the row shards the table will be split over.

    Returns:
      `[ceil(V/n)·n, H]`: shard s's block holds ids s, s+n, s+2n, ...
    """
    xp = _xp(table)
    rows, hidden = table.shape
    per_shard = -(-rows // num_shards)
    if per_shard * num_shards != rows:
        pad = xp.zeros((per_shard * num_shards - rows, hidden), table.dtype)
        table = xp.concatenate([table, pad])
    # id r·n + s at [r, s] -> shard s, local row r
    return table.reshape(per_shard, num_shards, hidden).transpose(1, 0, 2).reshape(-1, hidden)


def from_mod_order(table: Any, num_shards: int, vocab_size: int | None = None) -> Any:
    """The id-ordered table of a mod-ordered one (the inverse of `to_mod_order`).

    Args:
      table: `[n·L, H]` in mod order over `num_shards`.
      num_shards: n.
      vocab_size: keep only the first `vocab_size` ids (drop the padding); default all.

    Returns:
      `[vocab_size, H]` in id order.
    """
    rows, hidden = table.shape
    if rows % num_shards:
        raise ValueError(
            f"a mod-ordered table has a multiple of num_shards={num_shards} rows, got {rows}"
        )
    per_shard = rows // num_shards
    out = table.reshape(num_shards, per_shard, hidden).transpose(1, 0, 2).reshape(-1, hidden)
    return out if vocab_size is None else out[:vocab_size]


def bucket_loads(ids: Any, *, vocab_size: int, num_shards: int) -> dict[str, float]:
    """How unevenly a sample of ids spreads over the row shards, block vs mod.

    For each sharding, the busiest shard's share of the distinct ids (1/n is perfect
    balance, 1 puts every id on one shard): the routed exchange's largest bucket per
    distinct id, which decides whether its capacity overflows.

    Args:
      ids: a sample of ids (any shape; ids outside `[0, vocab_size)` are ignored).
      vocab_size: the table's real rows.
      num_shards: n.

    Returns:
      `{"block": share, "mod": share}`.
    """
    ids = np.unique(np.asarray(ids).reshape(-1))
    ids = ids[(ids >= 0) & (ids < vocab_size)]
    if ids.size == 0:
        return {"block": 0.0, "mod": 0.0}
    per_shard = -(-vocab_size // num_shards)
    block = np.bincount(ids // per_shard, minlength=num_shards).max() / ids.size
    mod = np.bincount(ids % num_shards, minlength=num_shards).max() / ids.size
    return {"block": float(block), "mod": float(mod)}


def suggest_row_sharding(ids: Any, *, vocab_size: int, num_shards: int) -> tuple[str, str]:
    """`("block" | "mod", why)`: the row sharding that balances a sample's buckets better.

    Block is kept unless mod's busiest shard holds clearly fewer distinct ids (by 10%).
    """
    loads = bucket_loads(ids, vocab_size=vocab_size, num_shards=num_shards)
    even = 1.0 / num_shards
    why = (
        f"the busiest of {num_shards} shards holds {loads['block']:.0%} of the distinct ids "
        f"with block rows, {loads['mod']:.0%} with mod rows (even: {even:.0%})"
    )
    return ("mod" if loads["mod"] < 0.9 * loads["block"] else "block"), why
