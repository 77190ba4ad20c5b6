"""Table-wise lookups and updates: a table held whole by one device is looked up there only.

A collection's `"table"` placement puts each table whole on one of the stack's row shards
(`jaxembed.collection.layout`). With the batch split over the same axes as the stack's rows
(data parallel), the gather exchange would still send every feature's ids to every device and
reduce-scatter `[B, F, H]` partial sums of which each device holds the features of its own
tables only. Here, as TorchRec's table-wise sharding does, each feature's ids go to the one
device that holds its table, which pools them, and the pooled rows come back:

    ids [B/n, F, L] ──(features by owner)──▶ [B/n, n·F_o, L] ──all_to_all──▶ [B, F_o, L]
    owner: pool its F_o features over its shard              ▶ [B, F_o, H]
    [B, F_o, H] ──all_to_all──▶ [B/n, n·F_o, H] ──(features back in order)──▶ [B/n, F, H]

with F_o the most features any one device owns (the others' padded with empty slots). Per
device that is `B·F_o·(L·4 + H·itemsize)·(n-1)/n` bytes against the gather exchange's
`B·F·(L·4 + H·itemsize)·(n-1)/n` and more; each device walks `B·F_o·L` slots, not `B·F·L`.
The update is the same exchange in reverse for the output gradients: each owner receives its
features' `[B, F_o, H]` gradients (and ids) and updates its table in place with the
optimizer's one-device kernels (`RowSparseOptimizer.local_update`). The gradient of the
lookup (under `jax.grad`) is the transpose, an `all_to_all` back to the owners.

Where it applies (`owner_map`): a dense `[B, F, L]` call of pooled features (the collection's
stacked form) whose tables are each on one shard, the stack's rows and the batch split over
the same mesh axes, the hidden axis whole.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxembed.kernels.arrays import move
from jaxembed.kernels.bag import local_bag
from jaxembed.kernels.common import UpdateStats
from jaxembed.kernels.tables import table_specs

__all__ = ["OwnerMap", "by_owner", "from_owner", "lookup", "owner_map", "update"]


@dataclasses.dataclass(frozen=True)
class OwnerMap:
    """Which device pools which feature of a call (static).

    Attributes:
      axes: the mesh axes the stack's rows and the batch are split over (R).
      num_shards: n, the devices along them.
      local_rows: the rows of each stack shard.
      features: the call's number of features F.
      slots: per owner (shard index), the call's feature indices it pools, padded with -1
        to F_o (the most any owner has).
    """

    axes: tuple[str, ...]
    num_shards: int
    local_rows: int
    features: int
    slots: tuple[tuple[int, ...], ...]

    @property
    def per_owner(self) -> int:
        """F_o: the features each owner pools (padded)."""
        return len(self.slots[0])

    @property
    def order(self) -> np.ndarray:
        """int32[n·F_o]: the call's feature at each owner slot (-1: padding)."""
        return np.asarray([f for s in self.slots for f in s], np.int32)

    @property
    def position(self) -> np.ndarray:
        """int32[F]: each feature's owner slot in `order`."""
        where = np.zeros(self.features, np.int32)
        for i, f in enumerate(self.order):
            if f >= 0:
                where[f] = i
        return where


def owner_map(
    owners: tuple[int, ...], axes: tuple[str, ...], num_shards: int, local_rows: int
) -> OwnerMap:
    """The `OwnerMap` of a call whose feature f's table is whole on shard `owners[f]`.

    Examples:
      >>> m = owner_map((0, 2, 0), ("data",), 4, 16)
      >>> m.slots, m.per_owner, m.order.tolist(), m.position.tolist()
      (((0, 2), (-1, -1), (1, -1), (-1, -1)), 2, [0, 2, -1, -1, 1, -1, -1, -1], [0, 4, 1])
    """
    held: list[list[int]] = [[] for _ in range(num_shards)]
    for f, o in enumerate(owners):
        held[o].append(f)
    width = max(1, max(len(h) for h in held))
    slots = tuple(tuple(h + [-1] * (width - len(h))) for h in held)
    return OwnerMap(tuple(axes), num_shards, local_rows, len(owners), slots)


def by_owner(x: jax.Array, m: OwnerMap, fill: Any) -> jax.Array:
    """`x [B, F, ...]` with its features in owner order, `[B, n·F_o, ...]` (`fill` in the
    padding slots). Elementwise along the batch: no collective."""
    order = m.order
    picked = jnp.take(x, jnp.asarray(np.maximum(order, 0)), axis=1)
    keep = jnp.asarray(order >= 0).reshape((1, -1) + (1,) * (x.ndim - 2))
    return jnp.where(keep, picked, jnp.asarray(fill, x.dtype))


def from_owner(y: jax.Array, m: OwnerMap) -> jax.Array:
    """`y [B, n·F_o, ...]` back in the call's feature order, `[B, F, ...]`."""
    return jnp.take(y, jnp.asarray(m.position), axis=1)


def _axis(m: OwnerMap) -> Any:
    return m.axes[0] if len(m.axes) == 1 else m.axes


def _to_owners(x: jax.Array, m: OwnerMap) -> jax.Array:
    """`[B/n, n·F_o, ...]` on each source → `[B, F_o, ...]` on each owner (the batch in order)."""
    return jax.lax.all_to_all(x, _axis(m), split_axis=1, concat_axis=0, tiled=True)


def _to_sources(y: jax.Array, m: OwnerMap) -> jax.Array:
    """`[B, F_o, ...]` on each owner → `[B/n, n·F_o, ...]` on each source."""
    return jax.lax.all_to_all(y, _axis(m), split_axis=0, concat_axis=1, tiled=True)


def _local_rows(gid: jax.Array, m: OwnerMap) -> jax.Array:
    """Stack rows → this shard's rows (-1: an empty slot, or padding)."""
    shard = jax.lax.axis_index(_axis(m))
    return jnp.where(gid >= 0, gid - shard * m.local_rows, -1)


def _specs(m: OwnerMap, ndim: int) -> P:
    return P(_axis(m), *(None,) * (ndim - 1))


def lookup(
    table: jax.Array,
    ids: jax.Array,
    weights: jax.Array | None,
    m: OwnerMap,
    mesh: Any,
    *,
    impl: str = "auto",
    return_counts: bool = False,
) -> Any:
    """The pooled `[B, F, H]` of stack rows `ids [B, F, L]` (factors `weights [B, F, L]` or
    None), each feature pooled by the device that holds its table.

    Args:
      table: the stack `[n·local_rows, H]`, rows split over `m.axes`.
      ids, weights: the call's, the batch split over `m.axes`.
      m: the call's `OwnerMap`.
      mesh: the mesh.
      impl: the pooling kernels (`"auto"`, `"native"`, `"xla"`).
      return_counts: also return int32 `[n, 2]`: each device's slots walked (`B·F_o·L`) and
        rows read (its valid slots), in the order of the devices along `m.axes`.
    """
    xs = [by_owner(ids, m, -1)] + ([] if weights is None else [by_owner(weights, m, 0.0)])
    xs = [move(x, mesh, _specs(m, 3)) for x in xs]  # the batch split over R

    def body(shard, x, *w):
        # shard: [local_rows, H]   x: i32[B/n, n·F_o, L]   w: f32[B/n, n·F_o, L]
        local = _local_rows(_to_owners(x, m), m)  # [B, F_o, L], this shard's rows
        factors = _to_owners(w[0], m) if w else None
        pooled = local_bag(local, shard, per_id_weights=factors, impl=impl)  # [B, F_o, H]
        out = _to_sources(pooled, m)  # [B/n, n·F_o, H]
        if not return_counts:
            return out
        rows = jnp.sum(local >= 0, dtype=jnp.int32)
        return out, jnp.stack([jnp.asarray(local.size, jnp.int32), rows])[None]

    out_specs = (_specs(m, 3), _specs(m, 2)) if return_counts else _specs(m, 3)
    run = jax.shard_map(
        body, mesh=mesh, in_specs=(table_specs(table, _specs(m, 2)), *(_specs(m, 3) for _ in xs)),
        out_specs=out_specs,
    )  # fmt: skip
    if not return_counts:
        return from_owner(run(table, *xs), m)
    out, counts = run(table, *xs)
    return from_owner(out, m), counts


def update(
    optimizer: Any,
    table: jax.Array,
    state: Any,
    ids: jax.Array,
    weights: jax.Array | None,
    out_grad: jax.Array,
    m: OwnerMap,
    mesh: Any,
    *,
    impl: str = "auto",
    return_stats: bool = False,
) -> Any:
    """The row-sparse update of the stack from `out_grad [B, F, H]`, each table updated in
    place by the device that holds it (`lookup`'s exchange in reverse).

    Args:
      optimizer: a `jaxembed.optim.RowSparseOptimizer` (its `local_update` runs at the owner).
      table, state: the stack and its optimizer state (`RowSparseState`), rows split over
        `m.axes`.
      ids, weights, m, mesh, impl: as `lookup`.
      out_grad: d loss / d pooled output, in the batch's layout.
      return_stats: also return `UpdateStats`, with each row shard's distinct rows updated
        (int32[n], in the order of the devices along `m.axes`).

    Returns:
      `(table, state)`, in their layouts; `(table, state, stats)` with `return_stats`.
    """
    xs = [by_owner(ids, m, -1), by_owner(out_grad, m, 0.0)]
    if weights is not None:
        xs.append(by_owner(weights, m, 0.0))
    xs = [move(x, mesh, _specs(m, 3)) for x in xs]  # the batch split over R
    names = list(state.slots)
    slot_specs = [P(_axis(m)) if state.slots[k].ndim == 1 else _specs(m, 2) for k in names]

    def body(shard, count, fallbacks, *rest):
        # shard: [local_rows, H]  slots: [local_rows(, H)]  x: i32[B/n, n·F_o, L]
        # g: f32[B/n, n·F_o, H]  w: f32[B/n, n·F_o, L]
        slots, (x, g, *w) = rest[: len(names)], rest[len(names) :]
        local = _local_rows(_to_owners(x, m), m)  # [B, F_o, L]
        grads = _to_owners(g, m)  # [B, F_o, H]
        factors = _to_owners(w[0], m) if w else None
        here = type(state)(count, dict(zip(names, slots, strict=True)), fallbacks)
        done = optimizer.local_update(
            shard, here, local, grads, per_id_weights=factors, combiner="sum", impl=impl,
            return_stats=return_stats,
        )  # fmt: skip
        new_shard, new = done[:2]
        rows = done[2].rows if return_stats else jnp.zeros((1,), jnp.int32)  # i32[1]
        if missing := _unvarying(rows, m.axes):
            rows = jax.lax.pcast(rows, missing, to="varying")
        return new_shard, new.count, new.routed_fallbacks, rows, *(new.slots[k] for k in names)

    run = jax.shard_map(
        body, mesh=mesh,
        in_specs=(_specs(m, 2), P(), P(), *slot_specs, _specs(m, 3), _specs(m, 3),
                  *([_specs(m, 3)] if weights is not None else [])),
        out_specs=(_specs(m, 2), P(), P(), P(_axis(m)), *slot_specs),
    )  # fmt: skip
    new_table, count, fallbacks, rows, *slots = run(
        table, state.count, state.routed_fallbacks, *(state.slots[k] for k in names), *xs
    )
    new_state = type(state)(count, dict(zip(names, slots, strict=True)), fallbacks)
    if return_stats:
        return new_table, new_state, UpdateStats(jnp.zeros((), jnp.int32), rows)
    return new_table, new_state


def _unvarying(x: jax.Array, axes: tuple[str, ...]) -> tuple[str, ...]:
    """The axes of `axes` that `x` does not vary over yet (`pcast` needs them)."""
    axis_type = getattr(jax.typeof(x), "manual_axis_type", None)
    varying = frozenset(axis_type.varying) if axis_type is not None else frozenset()
    return tuple(a for a in axes if a not in varying)
