"""The routed exchange of a dynamic table's remap: each id goes to the row shard that owns it.

A dynamic table split by rows over n shards gives each id one owner, the shard holding its
bucket (`jaxembed.dynamic.keys.owner_of`); each shard holds its buckets' state alone
(`jaxembed.optim.dynamic`). Where the batch is split over the same mesh axes as the rows, each
device sends its own slots' keys to their owners and gets their rows back, inside the step's
`shard_map` body:

    owner of each slot over the n shards     owner: i32[m]      (n: EMPTY_ID, no owner)
    its place among this device's slots      pos: i32[m]        (slot order kept)
      for that owner
    send[owner, pos] = key                   send: u32[n, C, 2] (EMPTY_ID: an empty place)
    all_to_all over the row axes             recv: u32[n, C, 2] (recv[j]: source j's slots)
    the owner's step on recv                 (`remap.step` with the shard's state)
    all_to_all back                          back: i32[n, C]    (each place's row)
    rows[slot] = back[owner, pos]

A step decides on the batch's multiset of ids (`jaxembed.dynamic.reference`: counts add each
occurrence, candidates rank by estimate and id), so an owner that receives every occurrence of
its ids decides exactly what one device stepping the whole batch decides. Slots travel, not
distinct ids, C places for each (source, owner) pair (`capacity`). A device with more than C
slots for one owner raises the overflow flag, and a step in which any device did runs the
gather exchange instead (every shard sees every id and keeps its own), so no id is dropped.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxembed.dynamic.keys import EMPTY_HALF, is_reserved, owner_of
from jaxembed.ragged import running_sum

__all__ = ["SLACK", "Routes", "capacity", "route", "rows_back", "send_keys"]

SLACK = 2.0
"""Places for a (source, owner) pair, in units of the even share `m / n` of a source's m slots
(plus 8): a hot id's slots all go to one owner, and a step past the places runs the gather."""


def capacity(m: int, n: int, slack: float = SLACK) -> int:
    """C, the places a source keeps for each owner: `ceil(slack · m / n) + 8`, at most m.

    Examples:
      >>> capacity(4096, 8), capacity(10, 8)
      (1032, 10)
    """
    return int(min(m, math.ceil(slack * m / n) + 8))


class Routes(NamedTuple):
    """Where one device's slots go.

    Attributes:
      send: u32[n, C, 2], each owner's keys in slot order (`EMPTY_ID`: an empty place).
      owner: i32[m], each slot's owner (n: the slot holds `EMPTY_ID` and goes nowhere).
      pos: i32[m], its place among this device's slots for that owner (>= C: no place).
      overflow: bool[], some owner has more than C of this device's slots.
    """

    send: jax.Array
    owner: jax.Array
    pos: jax.Array
    overflow: jax.Array


def route(keys: jax.Array, num_buckets: int, n: int, seed: int, c: int) -> Routes:
    """Buckets one device's keys by owner, in slot order, into C places an owner.

    # keys u32[m, 2] -> send u32[n, C, 2], owner / pos i32[m]
    """
    m = keys.shape[0]
    owner = jnp.where(is_reserved(keys), n, owner_of(keys, num_buckets, n, seed))  # i32[m]
    # Each slot's rank among its owner's, by a running count per owner: O(m·n) int32, small
    # beside the step for the shard counts of one host's devices (a stable sort by owner
    # would do for many more).
    hit = owner[:, None] == jnp.arange(n, dtype=jnp.int32)[None, :]  # bool[m, n]
    before = running_sum(hit, axis=0, dtype=jnp.int32) - 1  # i32[m, n]: the slot's rank
    pos = jnp.take_along_axis(before, jnp.minimum(owner, n - 1)[:, None], axis=1)[:, 0]
    pos = jnp.where(owner < n, pos, c)  # i32[m]
    flat = jnp.where((owner < n) & (pos < c), owner * c + pos, n * c)  # i32[m]: its place
    send = jnp.full((n * c, 2), EMPTY_HALF, jnp.uint32).at[flat].set(keys, mode="drop")
    overflow = jnp.any(jnp.sum(hit, axis=0) > c) if m else jnp.zeros((), bool)
    return Routes(send.reshape(n, c, 2), owner, pos, overflow)


def send_keys(send: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """To the owners: u32[n, C, 2] -> u32[n, C, 2], row j from the source at position j."""
    return jax.lax.all_to_all(send, axes, 0, 0, tiled=True)


def rows_back(routes: Routes, rows: jax.Array, axes: tuple[str, ...], none: int) -> jax.Array:
    """Each of this device's slots' row, from the owners' rows of what they received.

    # rows i32[n, C] (the owner's answer, place by place) -> i32[m] (`none`: no row)
    """
    n, c = rows.shape
    back = jax.lax.all_to_all(rows, axes, 0, 0, tiled=True)  # i32[n, C]: row j from owner j
    fits = (routes.owner < n) & (routes.pos < c)
    got = back.reshape(n * c)[jnp.where(fits, routes.owner * c + routes.pos, 0)]
    return jnp.where(fits, got, none)
