"""The tape behind `jaxembed.nnx.value_and_grad` and `jaxembed.flax.value_and_grad`.

A row-sparse optimizer (`jaxembed.optim`) needs, per embedding lookup of a step, the ids it
read and d loss / d its output; optax needs the gradients of every other parameter. The
training helpers get both from one differentiation: while they trace the loss, every jaxembed
module (`Embed`, `EmbeddingBagCollection`) looks up with its table held constant
(`stop_gradient`) and adds a zero **tap** to its output. Differentiating the loss with respect
to the taps gives each lookup's output gradient; with respect to the other parameters, their
gradients. The tape records what each lookup read, so that the optimizer can update the rows.

Two passes: `discover` (under `eval_shape`: the lookups' output shapes, so that the taps can
be made) and `tap` (the differentiated pass). Outside the helpers the tape is off and the
modules do nothing unusual.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["Record", "Tape", "active", "recording", "tap"]


@dataclasses.dataclass
class Record:
    """One lookup of the step: which module, what it read (arrays), how (static)."""

    key: str
    kind: str  # "embed" or "collection"
    static: dict[str, Any]
    index: int  # its position in the tape's taps and operands


@dataclasses.dataclass
class Tape:
    """The lookups of one traced loss (see the module docstring)."""

    mode: str  # "discover" or "tap"
    paths: dict[int, str] = dataclasses.field(default_factory=dict)
    shapes: list[Any] = dataclasses.field(default_factory=list)
    taps: list[Any] = dataclasses.field(default_factory=list)
    records: list[Record] = dataclasses.field(default_factory=list)
    operands: list[Any] = dataclasses.field(default_factory=list)

    def key_of(self, module: Any, fallback: str) -> str:
        return self.paths.get(id(module), fallback)


_TAPE: contextvars.ContextVar[Tape | None] = contextvars.ContextVar("jaxembed_tape", default=None)


def active() -> Tape | None:
    """The tape a training helper is recording, or None."""
    return _TAPE.get()


@contextlib.contextmanager
def recording(tape: Tape) -> Iterator[Tape]:
    """Makes `tape` the active tape for the block."""
    token = _TAPE.set(tape)
    try:
        yield tape
    finally:
        _TAPE.reset(token)


def tap(module: Any, key: str, kind: str, out: Any, operands: Any, static: dict[str, Any]):
    """Called by a jaxembed module with its (constant-table) output: records the lookup and
    returns `out + tap`. Without an active tape: `out` unchanged.

    Raises:
      ValueError: the same module looks up twice in one step (its rows would get two
        updates), which the row-sparse training does not support.
    """
    tape = active()
    if tape is None:
        return out
    key = tape.key_of(module, key)
    if any(r.key == key for r in tape.records):
        raise ValueError(
            f"the jaxembed module at {key!r} looks up twice in one training step: a row-sparse "
            "optimizer updates each table once per step from one lookup. Look the ids of both "
            "calls up in one call (concatenate them), or train this table with optax"
        )
    index = len(tape.records)
    tape.records.append(Record(key, kind, dict(static), index))
    if tape.mode == "discover":
        tape.shapes.append(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), out))
        return out
    tape.operands.append(operands)
    return jax.tree.map(jnp.add, out, tape.taps[index])


def refuse_dense_use(module: Any, what: str) -> None:
    """A tied head reads the whole table: under the sparse training helpers that is an error
    (its gradient would be dropped)."""
    if active() is not None:
        raise ValueError(
            f"{what} reads the whole table, whose dense gradient the row-sparse training "
            "helpers do not compute: train a table used as a tied head with optax "
            "(nnx.Optimizer / optax on the parameters), not with jaxembed.optim"
        )
