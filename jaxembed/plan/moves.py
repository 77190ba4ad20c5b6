"""Moves: how a small operand changes layout inside a `shard_map` body, step by step.

A layout is one tuple of mesh axis names per array axis (major first), as `PartitionSpec`
entries. Going from a layout `src` to a layout `dst` takes two kinds of steps:

* `all_gather` over the axes of `src` that `dst` does not keep on that array axis (a
  collective, with bytes);
* `slice` by the device's position on the axes `dst` adds (free: `axis_index` and a
  dynamic slice).

Per array axis, the longest common prefix of `src` and `dst` stays; the rest of `src` is
gathered in one `all_gather`, then the rest of `dst` is sliced. All gathers run before any
slice, so an axis may move from one array axis to another. The plan lists the moves and the
kernels execute the same list (`jaxembed.kernels.reshard`), so the compiled program holds
exactly the collectives the plan names.

Examples:
  >>> plan_moves(((), ("data",)), (("data",), ()))       # data moves from axis 1 to axis 0
  (Move(op='all_gather', dim=1, axes=('data',)), Move(op='slice', dim=0, axes=('data',)))
  >>> plan_moves((("data", "model"),), (("data",),))     # keep data, gather model
  (Move(op='all_gather', dim=0, axes=('model',)),)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from jaxembed.plan.types import Entries, Move

__all__ = ["Entries", "Move", "local_shape", "move_shapes", "plan_moves"]


def plan_moves(src: Sequence[Sequence[str]], dst: Sequence[Sequence[str]]) -> tuple[Move, ...]:
    """The moves from layout `src` to layout `dst` (gathers first, then slices).

    Args:
      src, dst: one tuple of mesh axis names per array axis, major first.

    Returns:
      The moves, empty when the layouts are equal.

    Raises:
      ValueError: layouts of different ranks.
    """
    if len(src) != len(dst):
        raise ValueError(f"layouts of different ranks: {tuple(src)} and {tuple(dst)}")
    gathers, slices = [], []
    for dim, (s, d) in enumerate(zip(src, dst, strict=True)):
        s, d = tuple(s), tuple(d)
        keep = 0
        while keep < min(len(s), len(d)) and s[keep] == d[keep]:
            keep += 1
        if s[keep:]:
            gathers.append(Move("all_gather", dim, s[keep:]))
        if d[keep:]:
            slices.append(Move("slice", dim, d[keep:]))
    return tuple(gathers + slices)


def local_shape(
    shape: Sequence[int], entries: Sequence[Sequence[str]], sizes: Mapping[str, int]
) -> tuple[int, ...]:
    """The per-device block of a global `shape` laid out as `entries`."""
    return tuple(
        d // math.prod(sizes[a] for a in axes) for d, axes in zip(shape, entries, strict=True)
    )


def move_shapes(
    start: Sequence[int], moves: Sequence[Move], sizes: Mapping[str, int]
) -> tuple[tuple[int, ...], ...]:
    """The per-device shape after each move, starting from the block `start`."""
    shape, out = list(start), []
    for m in moves:
        n = math.prod(sizes[a] for a in m.axes)
        shape[m.dim] = shape[m.dim] * n if m.op == "all_gather" else shape[m.dim] // n
        out.append(tuple(shape))
    return tuple(out)
