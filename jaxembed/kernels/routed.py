"""The routed exchange inside a body: bucket ids by owner, send each distinct id once.

On every device, for its M id slots (`jaxembed.plan.routed` has the plan):

    owner of each id over S          dest: i32[M]   (n_S: the id reads no row)
    bucket by owner, dedup, sort     pos: i32[M]    each slot's distinct id's place in its bucket
    send[owner, pos] = id            send: i32[n_S, C]   (-1: empty)
    all_to_all over S                -> the owners; they look their rows up (partial over the
                                        table's other row axes: psum), and all_to_all back
    out[slot] = back[dest, pos]

Each bucket holds its distinct ids in ascending order. The bucketing is `bucket_ids` of the
plan's kernels (`kernels_for(plan)`): `jaxembed.kernels.local`'s is one XLA comparison sort of
the slots by (owner, id), O(M log M), the reference and the GPU/TPU path; with
`plan.impl == "native"` it is `jaxembed.kernels.native`'s, a counting sort by owner and a hash
dedup per bucket, O(M + distinct ids), with the same results bit for bit.

The backward sums each distinct id's gradient in the same buckets and sends it to the owner.

With the native kernels the rows and gradients stay in the n_S pieces f[C, H/K] that
XLA:CPU's `all_to_all` runs on (it slices its operand into one buffer per peer and
concatenates the results): `fetch_pieces` gathers each source's rows as its own buffer and
returns the received pieces, and `send_grads` takes and returns pieces, which
`pool_sum_pieces`, `bag_scatter_add_pieces` and `apply_rows_pieces` read or write in place.

Whether any bucket of any device overflowed its capacity C is one all-reduced flag; a step
that overflowed runs the gather exchange instead (the callers' `lax.cond`), so no id is ever
dropped.

A bag lookup pooled at the owner (`plan.routed.pooled_at_owner`) buckets the slots instead
(`bucket_slots`: the same `bucket_ids`, keyed by slot index) and sends each slot's (id, bag,
factor) in one `all_to_all` (`route_slots`); `jaxembed.kernels.bag` pools them at the owner.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxembed.kernels import local as local_ops
from jaxembed.kernels.select import kernels_for
from jaxembed.plan import EmbeddingPlan

__all__ = [
    "Buckets",
    "bucket_slots",
    "bucketize",
    "fetch_pieces",
    "fetch_rows",
    "joined",
    "overflowed",
    "places",
    "route_grads",
    "route_rows",
    "route_slots",
    "scatter_grads",
    "send_grads",
]


class Buckets(NamedTuple):
    """One device's ids, bucketed by owner.

    Attributes:
      send: i32[n_S, C], each bucket's distinct ids (-1: an empty place).
      dest: i32[M], each slot's bucket (n_S: the slot reads no row).
      pos: i32[M], the place of each slot's id in its bucket (>= C: it did not fit).
      overflow: bool[], some bucket of this device holds more than C distinct ids.
    """

    send: jax.Array
    dest: jax.Array
    pos: jax.Array
    overflow: jax.Array

    def fits(self) -> jax.Array:
        n, c = self.send.shape
        return (self.dest < n) & (self.pos < c)


def _owner_coordinate(plan: EmbeddingPlan, ids: jax.Array) -> jax.Array:
    """The position, along the routed axes S, of the row shard that owns each id."""
    routed = plan.routed
    owner = local_ops.owner_of(
        jnp.maximum(ids, 0), plan.rows_per_shard, plan.num_row_shards, plan.row_sharding
    )
    sizes = dict(plan.mesh_axes)
    coordinate = jnp.zeros_like(owner)
    # Unravel the owner's index over the row axes (major first); ravel its S coordinates.
    rest = owner
    coords = {}
    for axis in reversed(plan.row_axes):
        coords[axis] = rest % sizes[axis]
        rest = rest // sizes[axis]
    for axis in routed.axes:
        coordinate = coordinate * sizes[axis] + coords[axis]
    return coordinate


def bucketize(plan: EmbeddingPlan, ids: jax.Array, valid: jax.Array) -> Buckets:
    """Buckets a device's ids by owner and removes duplicates in each bucket.

    The owners are computed here; the sort + dedup is `bucket_ids` of the plan's kernels
    (`kernels_for(plan)`: XLA's comparison sort, or the native counting sort + hash).

    Args:
      plan: a plan whose exchange is routed.
      ids: i32[M] the device's ids (flattened).
      valid: bool[M] whether each id reads a row.

    Returns:
      The `Buckets`.
    """
    n, c = plan.routed.num_buckets, plan.routed.capacity
    dest = jnp.where(valid, _owner_coordinate(plan, ids), n).astype(jnp.int32)  # i32[M]
    key = jnp.where(valid, ids, 0).astype(jnp.int32)  # i32[M]
    send, pos, overflow = kernels_for(plan).bucket_ids(dest, key, n, c)  # i32[n_S, C], i32[M]
    return Buckets(send, dest, pos, overflow)


def bucket_slots(plan: EmbeddingPlan, ids: jax.Array, valid: jax.Array) -> Buckets:
    """Buckets a device's slots (not its distinct ids) by owner: the bag variant whose
    owners pool (`jaxembed.kernels.bag`).

    The same `bucket_ids` with each slot's own index as its key: the keys are distinct, so
    `send[b]` lists bucket b's slots in ascending order, `pos` is each slot's stable rank in
    its bucket, and `overflow` says that some bucket holds more than C slots.

    Args:
      plan: a plan whose exchange is routed.
      ids: i32[M] the device's ids (flattened).
      valid: bool[M] whether each slot reads a row.

    Returns:
      The `Buckets`, `send` holding slot indices (-1: an empty place).
    """
    n, c = plan.routed.num_buckets, plan.routed.capacity
    dest = jnp.where(valid, _owner_coordinate(plan, ids), n).astype(jnp.int32)  # i32[M]
    slot = jnp.arange(ids.shape[0], dtype=jnp.int32)  # i32[M], all distinct
    send, pos, overflow = kernels_for(plan).bucket_ids(dest, slot, n, c)  # i32[n_S, C], i32[M]
    return Buckets(send, dest, pos, overflow)


def route_slots(
    plan: EmbeddingPlan, buckets: Buckets, ids: jax.Array, segment: jax.Array, scale: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sends each bucketed slot's (id, bag, factor) to its owner, in one `all_to_all`.

    Args:
      plan: the routed plan.
      buckets: `bucket_slots`' buckets of the device's slots.
      ids, segment, scale: i32[M], i32[M], f32[M] each slot's id, bag and factor.

    Returns:
      `(ids, segment, scale)` at the owner, i32[n_S, C], i32[n_S, C], f32[n_S, C]: row j
      from the source at position j along S (-1, -1, 0: an empty place).
    """
    slot = buckets.send  # i32[n_S, C] slot indices
    full = slot >= 0
    at = jnp.where(full, slot, 0)
    bits = jax.lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.int32)
    packed = jnp.stack([
        jnp.where(full, ids[at], -1), jnp.where(full, segment[at], -1),
        jnp.where(full, bits[at], 0),
    ], axis=-1).astype(jnp.int32)  # fmt: skip  # i32[n_S, C, 3]
    recv = _to_owners(plan, packed)  # i32[n_S, C, 3] from each source
    factor = jax.lax.bitcast_convert_type(recv[..., 2], jnp.float32)
    return recv[..., 0], recv[..., 1], factor


def overflowed(buckets: Buckets, mesh_axes: tuple[str, ...]) -> jax.Array:
    """Whether any device's bucket overflowed: the same answer on every device."""
    flag = buckets.overflow.astype(jnp.int32)
    axis_type = getattr(jax.typeof(flag), "manual_axis_type", None)
    varying = frozenset(axis_type.varying) if axis_type is not None else frozenset()
    missing = tuple(a for a in mesh_axes if a not in varying)
    if missing:  # a psum over every axis needs a value typed as varying over every axis
        flag = jax.lax.pcast(flag, missing, to="varying")
    return jax.lax.psum(flag, mesh_axes) > 0


def _to_owners(plan: EmbeddingPlan, x: jax.Array) -> jax.Array:
    # x: [n_S, C, ...] -> [n_S, C, ...]: row j goes to the device at position j along S.
    return jax.lax.all_to_all(x, plan.routed.axes, 0, 0, tiled=True)


def places(buckets: Buckets) -> tuple[jax.Array, jax.Array]:
    """Each slot's place in the flat buckets, i32[M] (`dest · C + pos`; n_S·C: none), and
    whether it fits, bool[M]: the row of `fetch_rows`' output that holds its id's row."""
    n, c = buckets.send.shape
    fits = buckets.fits()
    return jnp.where(fits, buckets.dest * c + buckets.pos, n * c), fits


def route_rows(plan: EmbeddingPlan, table: jax.Array, buckets: Buckets, *, count: bool = False):
    """Each slot's row, fetched from its owner: f[M, H/K] (zero for slots that read none);
    with `count`, `(rows, reads)`: also the rows this device read for its sources, i32[].
    With the native kernels the rows are read from the pieces the `all_to_all` returns, each
    slot as a bag of one (`pool_sum_pieces`), so no f[n_S·C, H/K] is joined first."""
    place, fits = places(buckets)
    if _apart(plan):  # each slot a bag of its own, read where the all_to_all left the rows
        pieces, reads = fetch_pieces(plan, table, buckets)
        m = place.shape[0]
        got = kernels_for(plan).pool_sum_pieces(pieces, place, fits, *_bags_of_one(m), m)
        out = got.astype(pieces[0].dtype)  # one row times 1, exact
        return (out, reads) if count else out
    back, reads = fetch_rows(plan, table, buckets)
    got = back[jnp.where(fits, place, 0)]
    out = jnp.where(fits[:, None], got, jnp.zeros((), got.dtype))
    return (out, reads) if count else out


def _bags_of_one(m: int) -> tuple[jax.Array, jax.Array]:
    """The segments and factors of M bags of one slot each, i32[M] and f32[M]: a bag kernel
    run over single slots (its sum of one row times 1 is that row, exactly)."""
    return jnp.arange(m, dtype=jnp.int32), jnp.ones((m,), jnp.float32)


def fetch_rows(plan: EmbeddingPlan, table: jax.Array, buckets: Buckets):
    """My distinct ids' rows, fetched from their owners, by place (`places`): `(f[n_S·C,
    H/K], reads)`, with the rows this device read for its sources, i32[]."""
    pieces, reads = fetch_pieces(plan, table, buckets)
    return jnp.concatenate(pieces), reads


def _apart(plan: EmbeddingPlan) -> bool:
    """Whether the owner gathers each source's rows as a buffer of its own: with the native
    kernels (XLA:CPU, whose `all_to_all` runs on one buffer per peer); XLA's kernels (GPU,
    TPU) gather them as one."""
    return plan.impl == "native"


def fetch_pieces(plan: EmbeddingPlan, table: jax.Array, buckets: Buckets):
    """`fetch_rows` as the n_S pieces f[C, H/K] the `all_to_all` returns, one per owner (row
    `dest · C + pos` is row pos of piece dest): `(pieces, reads)`. A bag pools them where
    they are (`pool_sum_pieces`), so neither an f[n_S·C, H] nor an f[M, H] is built.

    XLA:CPU runs an `all_to_all` on n_S separate buffers: it slices its operand into them and
    concatenates its results. With the native kernels each owner's rows are gathered as their
    own buffer and the bag reads the results in place, so neither copy is made (measured in
    `benchmarks/RESULTS.md`, "Stop 40")."""
    recv = _to_owners(plan, buckets.send)  # i32[n_S, C] ids from each source
    local, valid = local_ops.local_rows(plan, recv)
    n, c = recv.shape
    reads = valid & (recv >= 0)
    gather = kernels_for(plan, table).gather_rows
    if _apart(plan):  # one buffer per source: the all_to_all sends them as they are
        rows = jnp.stack([gather(table, local[j], reads[j]) for j in range(n)])
    else:
        rows = gather(table, local.reshape(-1), reads.reshape(-1)).reshape(n, c, -1)
    # rows: f[n_S, C, H/K]
    if plan.routed.rest_axes:
        rows = jax.lax.psum(rows, plan.routed.rest_axes)  # the owners' other row shards
    back = _to_owners(plan, rows)  # f[n_S, C, H/K]: my ids' rows, by bucket and place
    return [back[j] for j in range(n)], jnp.sum(reads, dtype=jnp.int32)


def route_grads(
    plan: EmbeddingPlan, buckets: Buckets, grads: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Sends each distinct id's summed gradient to its owner.

    Args:
      plan: the routed plan.
      buckets: the device's buckets (as in the forward).
      grads: f[M, H/K] each slot's gradient.

    Returns:
      `(ids, grads)` at the owner: i32[n_S·C] (-1: none) and f32[n_S·C, H/K]; with the
      native kernels, the grads as the n_S pieces f32[C, H/K] the `all_to_all` returns
      (summed into pieces, `bag_scatter_add_pieces`, each slot a bag of one; `joined`
      makes them one array).
    """
    n, c = buckets.send.shape
    place, fits = places(buckets)
    if _apart(plan):  # summed into the pieces the all_to_all sends as they are
        summed = kernels_for(plan).bag_scatter_add_pieces(
            n, (c, grads.shape[-1]), place, fits, *_bags_of_one(place.shape[0]), grads
        )  # n_S × f32[C, H/K]
        return send_grads(plan, buckets, summed)
    summed = kernels_for(plan).scatter_add((n * c, grads.shape[-1]), place, fits, grads)
    return send_grads(plan, buckets, summed)


def send_grads(plan: EmbeddingPlan, buckets: Buckets, summed: Any):
    """`(ids, grads)` at the owner from my distinct ids' summed gradients by place,
    f32[n_S·C, H/K] (`route_grads`): i32[n_S·C] and f32[n_S·C, H/K]. Given as the n_S pieces
    f32[C, H/K] (a bag sums them fused into pieces, `bag_scatter_add_pieces`, which the
    `all_to_all` sends as they are), the grads come back as the n_S pieces it returns (the
    native update reads them in place, `apply_rows_pieces`)."""
    n, c = buckets.send.shape
    ids = _to_owners(plan, buckets.send).reshape(n * c)
    if isinstance(summed, list | tuple):
        back = _to_owners(plan, jnp.stack(list(summed)))  # f32[n_S, C, H/K]
        return ids, [back[j] for j in range(n)]
    summed = _to_owners(plan, summed.reshape(n, c, -1)).reshape(n * c, -1)
    return ids, summed


def scatter_grads(plan: EmbeddingPlan, local: jax.Array, valid: jax.Array, grads: Any):
    """The table's gradient shard, f32[V/R, H/K]: each slot's gradient added at its row
    `local` where `valid`. `grads` is f[..., H/K], one row a slot, or the n_S pieces
    `send_grads` returns, which are scattered where the `all_to_all` left them."""
    ops, shape = kernels_for(plan), plan.table_shard_shape
    if isinstance(grads, list | tuple):
        return ops.scatter_add_pieces(shape, local, valid, grads)
    rows = grads.reshape(-1, grads.shape[-1])
    return ops.scatter_add(shape, local.reshape(-1), valid.reshape(-1), rows)


def joined(grads: Any) -> jax.Array:
    """`send_grads`' grads as one f32[n_S·C, H/K] (its pieces concatenated; else as given)."""
    return jnp.concatenate(list(grads)) if isinstance(grads, list | tuple) else grads
