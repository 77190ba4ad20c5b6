"""Moves inside a `shard_map` body: the plan's gathers and slices, executed.

`jaxembed.plan.moves` decides how a small operand (ids, lengths, an output, an output
gradient) changes layout; `apply_moves` runs the same list inside a body, so the compiled
program holds exactly the collectives the plan lists. A gather is a tiled `all_gather`
over the move's mesh axes; a slice takes this device's block by `axis_index` (free).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from jaxembed.plan.moves import Move

__all__ = ["apply_moves", "gather", "take_block"]


def gather(x: jax.Array, axes: tuple[str, ...], dim: int) -> jax.Array:
    """All-gathers `x` along `dim` over `axes` (tiled, major first); the result is invariant."""
    return jax.lax.all_gather(x, axes, axis=dim, tiled=True, to="invarying")


def take_block(x: jax.Array, axes: tuple[str, ...], dim: int) -> jax.Array:
    """This device's block of `x` along `dim` by its position on `axes` (major first)."""
    n = 1
    for a in axes:
        n *= jax.lax.axis_size(a)
    size = x.shape[dim] // n
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axes) * size, size, axis=dim)


def apply_moves(x: jax.Array, moves: Sequence[Move]) -> jax.Array:
    """Runs a plan's moves on `x`, in order."""
    for m in moves:
        x = gather(x, m.axes, m.dim) if m.op == "all_gather" else take_block(x, m.axes, m.dim)
    return x
