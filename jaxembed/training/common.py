"""What both training helpers return (the loss's gradients, split for optax and the tables),
and how both read `argnums`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from jaxembed import tape as tape_mod

__all__ = ["Grads", "argnums_tuple"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Grads:
    """What `value_and_grad` returns beside the loss.

    Attributes:
      dense: the gradients of the arguments `argnums` selects (a tuple of them for a
        sequence), for optax: of a model's parameters in `jaxembed.nnx.DENSE` (an
        `nnx.State`), or for Linen a pytree like the params or variables (zeros at the tables).
      operands: per lookup, what it read (ids, or the collection's batch).
      out_grads: per lookup, d loss / d its output.
      records: per lookup, the module's path and its lookup's arguments (static).
    """

    dense: Any
    operands: list[Any]
    out_grads: list[Any]
    records: tuple[tape_mod.Record, ...] = dataclasses.field(metadata=dict(static=True))


def argnums_tuple(argnums: int | Sequence[int], nargs: int, *, what: str) -> tuple[int, ...]:
    """`argnums` as a tuple of non-negative positions among `nargs` positional arguments, with
    `jax.value_and_grad`'s rules (an int or a sequence of ints; negative ones count from the
    end)."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not nums or not all(isinstance(n, int) and not isinstance(n, bool) for n in nums):
        raise TypeError(f"{what}: argnums must be an int or a sequence of ints, got {argnums!r}")
    out = tuple(n + nargs if n < 0 else n for n in nums)
    bad = [n for n, m in zip(nums, out, strict=True) if not 0 <= m < nargs]
    if bad:
        raise TypeError(
            f"{what}: differentiating with respect to argnums={argnums!r} needs at least "
            f"{max(abs(n) + (n >= 0) for n in bad)} positional arguments, but the call passed "
            f"{nargs}: pass the differentiated arguments positionally"
        )
    return out
