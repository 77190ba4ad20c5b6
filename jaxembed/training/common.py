"""What both training helpers return: the loss's gradients, split for optax and the tables."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxembed import tape as tape_mod

__all__ = ["Grads"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Grads:
    """What `value_and_grad` returns beside the loss.

    Attributes:
      dense: the other parameters' gradients, for optax: of those in `jaxembed.nnx.DENSE` (an
        `nnx.State`), or for Linen a pytree like the params (zeros at the tables).
      operands: per lookup, what it read (ids, or the collection's batch).
      out_grads: per lookup, d loss / d its output.
      records: per lookup, the module's path and its lookup's arguments (static).
    """

    dense: Any
    operands: list[Any]
    out_grads: list[Any]
    records: tuple[tape_mod.Record, ...] = dataclasses.field(metadata=dict(static=True))
