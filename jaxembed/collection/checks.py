"""Checks of what a collection is given to replace or update its tables: no silent wrong numbers.

A table, an optimizer state slot or an output gradient that is not exactly the shape of what it
stands for would otherwise be broadcast over every row (a `[1, dim]` array overwriting a whole
table), or fail deep inside with a bare `KeyError` or a numpy shape error. Each check here runs
before anything is written, and its error names the table (or feature), the shape it expected
and the one it got, and the fix.

* `check_array`: one array against the shape and dtype of what it replaces;
* `check_tables`: `load_tables`' `{table: [vocab_size, dim]}`, every table and no other;
* `check_exported_optimizer`: `import_optimizer`'s `export_optimizer` form, for this optimizer;
* `check_states`: the per-stack states `apply_gradients` updates;
* `check_out_grads`: `apply_gradients`' `{feature: d loss / d output}` against the batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxembed import ragged
from jaxembed.collection.layout import CollectionLayout

__all__ = [
    "check_array",
    "check_exported_optimizer",
    "check_out_grads",
    "check_states",
    "check_tables",
    "out_grad_shape",
]


def _shape_text(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def _dtype(value: Any) -> np.dtype:
    dtype = getattr(value, "dtype", None)
    return np.dtype(dtype if dtype is not None else np.asarray(value).dtype)


def check_array(
    what: str, value: Any, shape: tuple[int, ...], dtype: Any, *, target: str, fix: str
) -> None:
    """`value` must have exactly `shape` (nothing is broadcast) and a dtype that converts to
    `dtype` without losing its kind: any float for a float table or state, never an integer or
    bool array (whose values are not the table's numbers).

    Args:
      what: who asks and of what, e.g. `"load_tables: table 'item'"`.
      value: the array (numpy, jax, traced).
      shape: the shape it must have, e.g. `(vocab_size, dim)`.
      dtype: the dtype it is converted to.
      target: what it replaces, e.g. `"the collection's table 'item' ([vocab_size, dim])"`.
      fix: the advice that ends a shape error.

    Raises:
      ValueError: another shape (a `[1, dim]` row, a `[dim]` vector, a scalar, a transposed
        table), or an integer, bool or complex dtype for a float target.

    Examples:
      >>> check_array("load_tables: table 't'", np.ones((1, 4)), (10, 4), np.float32,
      ...             target="the table 't'", fix="pass all 10 rows")
      Traceback (most recent call last):
      ValueError: load_tables: table 't' has shape [1, 4], but the table 't' is [10, 4]: ...
    """
    got = tuple(int(d) for d in np.shape(value))
    if got != tuple(shape):
        raise ValueError(
            f"{what} has shape {_shape_text(got)}, but {target} is {_shape_text(shape)}: {fix} "
            "(an array of another shape is never broadcast over the rows)"
        )
    given = _dtype(value)
    want = np.dtype(dtype)
    if jnp.issubdtype(want, jnp.floating):
        ok = jnp.issubdtype(given, jnp.floating)
    else:
        ok = np.can_cast(given, want, casting="same_kind")
    if not ok:
        raise ValueError(
            f"{what} has dtype {given.name}, but {target} holds {want.name} values: pass "
            f"{want.name} (or another float) values, e.g. np.asarray(x, np.{want.name}); "
            f"{given.name} values are not converted"
        )


def check_tables(
    layout: CollectionLayout, values: Mapping[str, Any], *, what: str = "load_tables"
) -> None:
    """`values` must hold every table of the collection and no other, each `[vocab_size, dim]`
    in id order and of a dtype that converts to the table's.

    Raises:
      ValueError: a missing or unknown table (named, beside the collection's), or a table of
        another shape or kind of dtype (see `check_array`).
    """
    tables = [t.name for t in layout.tables]
    missing = [t for t in tables if t not in values]
    extra = [k for k in values if k not in tables]
    if missing:
        raise ValueError(
            f"{what}: no values for tables {missing}; the collection has tables {tables}: pass "
            "every table, each [vocab_size, dim] in id order (as coll.tables() gives them)"
        )
    if extra:
        raise ValueError(
            f"{what}: tables {sorted(extra)} are not in the collection, which has tables "
            f"{tables}: drop them, or build the collection with those tables"
        )
    for t in layout.tables:
        check_array(
            f"{what}: table {t.name!r}", values[t.name], (t.vocab_size, t.dim), t.dtype,
            target=f"the collection's table {t.name!r} ([vocab_size, dim])",
            fix="pass the whole table in id order, as coll.tables() gives it",
        )  # fmt: skip


def check_exported_optimizer(
    layout: CollectionLayout, optimizer: Any, exported: Mapping[str, Any]
) -> None:
    """`exported` must be `export_optimizer`'s form for this collection's tables and this
    optimizer: `{table: {"count": int32[], "slots": {slot: [vocab_size] or [vocab_size, dim]}}}`,
    every table, and one update count per stack.

    Raises:
      ValueError: a missing or unknown table; an entry without `"count"` or `"slots"`;
        another optimizer's slots (both sets of names and the optimizer are named); a slot of
        another shape or dtype kind (`check_array`); tables that now share a stack but were
        exported with different update counts.
    """
    what = "import_optimizer"
    tables = [t.name for t in layout.tables]
    missing = [t for t in tables if t not in exported]
    extra = [k for k in exported if k not in tables]
    if missing:
        raise ValueError(
            f"{what}: the export has no state for tables {missing}; the collection has tables "
            f"{tables}: pass export_optimizer(...)'s result for every table"
        )
    if extra:
        raise ValueError(
            f"{what}: the export has states of tables {sorted(extra)}, which are not in the "
            f"collection (it has tables {tables}): drop them, or build the collection with them"
        )
    slots = optimizer.formula.slots
    want = [s.name for s in slots]
    for t in layout.tables:
        entry = exported[t.name]
        for key in ("count", "slots"):
            if not isinstance(entry, Mapping) or key not in entry:
                have = sorted(entry) if isinstance(entry, Mapping) else type(entry).__name__
                raise ValueError(
                    f"{what}: the state of table {t.name!r} has no {key!r} (it has {have}): pass "
                    "export_optimizer(...)'s form, {table: {'count': ..., 'slots': {...}}}"
                )
        given = list(entry["slots"])
        if sorted(given) != sorted(want):
            raise ValueError(
                f"{what}: the state of table {t.name!r} has slots {sorted(given)}, but "
                f"{optimizer.name} keeps slots {sorted(want)}: import it with the optimizer "
                f"that exported it (whose slots are {sorted(given)}), or start this one from "
                "init_optimizer"
            )
        for s in slots:
            shape = s.shape(t.vocab_size, t.dim)
            kind = "one per row" if s.per_row else "one per element"
            check_array(
                f"{what}: table {t.name!r} slot {s.name!r}", entry["slots"][s.name], shape,
                np.float32, target=f"{optimizer.name}'s {s.name!r} of table {t.name!r}",
                fix=f"{optimizer.name}'s {s.name!r} is {kind} of the table, in id order (as "
                "export_optimizer gives it); a state of another optimizer (e.g. adagrad's "
                "[vocab_size, dim] accumulator for rowwise_adagrad's [vocab_size]) does not "
                "convert",
            )  # fmt: skip
        count = entry["count"]
        if np.shape(count) != () or not jnp.issubdtype(_dtype(count), jnp.integer):
            raise ValueError(
                f"{what}: the 'count' of table {t.name!r} must be an integer scalar (the updates "
                f"applied so far), got shape {_shape_text(np.shape(count))} dtype "
                f"{_dtype(count).name}"
            )
    for s in layout.stacks:
        counts = {t: int(np.asarray(exported[t]["count"])) for t in s.tables}
        if len(set(counts.values())) > 1:
            raise ValueError(
                f"{what}: tables {list(s.tables)} share one stack (one update count) here, but "
                f"were exported with different counts {counts}: their schedules and bias "
                "corrections would be wrong for some of them; place them in different stacks "
                "(another placement or dim), or import states of one step"
            )


def check_states(
    layout: CollectionLayout, optimizer: Any, states: Mapping[int, Any], *, what: str
) -> None:
    """`states` must be this optimizer's states of every stack (`init_optimizer`'s form).

    Raises:
      ValueError: a stack without a state, a state of another optimizer (other slots), or a
        slot of another stack's shape (states of another collection or layout).
    """
    missing = [s.index for s in layout.stacks if s.index not in states]
    if missing:
        raise ValueError(
            f"{what}: no optimizer state for stacks {missing} (the states have keys "
            f"{sorted(states, key=str)}; the collection's stacks are "
            f"{[s.index for s in layout.stacks]}): pass init_optimizer(opt)'s states, or the "
            "last update's"
        )
    want = sorted(s.name for s in optimizer.formula.slots)
    for s in layout.stacks:
        slots = getattr(states[s.index], "slots", None)
        if not isinstance(slots, Mapping) or sorted(slots) != want:
            given = sorted(slots) if isinstance(slots, Mapping) else type(states[s.index]).__name__
            raise ValueError(
                f"{what}: the state of stack {s.name} has slots {given}, but {optimizer.name} "
                f"keeps slots {want}: pass the states init_optimizer made for this optimizer"
            )
        for slot in optimizer.formula.slots:
            shape = slot.shape(*s.shape)
            got = tuple(np.shape(slots[slot.name]))
            if got != shape:
                raise ValueError(
                    f"{what}: the state of stack {s.name} has slot {slot.name!r} of shape "
                    f"{_shape_text(got)}, but the stack needs {_shape_text(shape)}: pass the "
                    "states init_optimizer made for this collection (import_optimizer converts "
                    "those of another layout)"
                )


def out_grad_shape(layout: CollectionLayout, feature: str, value: Any) -> tuple[int, ...]:
    """The shape of a feature's output (so of its gradient) for its batch input `value`:
    pooled `[B, dim]` (a `Ragged`: `[*lead·B, dim]`), unpooled `[B, L, dim]`."""
    f = {f.name: f for f in layout.features}[feature]
    dim = layout.table(f.table).dim
    if isinstance(value, ragged.Ragged):
        lead = tuple(np.shape(value.values))[:-1]
        return (math.prod(lead) * int(np.shape(value.lengths)[-1]), dim)
    ids = value[0] if isinstance(value, tuple) and len(value) == 2 else value
    shape = tuple(int(d) for d in np.shape(ids))
    if not isinstance(value, tuple) and len(shape) == 1:
        shape = (*shape, 1)  # one id per example
    return (*shape[:-1], dim) if f.pooled else (*shape, dim)


def check_out_grads(
    layout: CollectionLayout,
    batch: Mapping[str, Any],
    out_grads: Mapping[str, Any],
    *,
    what: str = "apply_gradients",
) -> None:
    """`out_grads` must hold d loss / d output of every feature and no other, each of its
    output's shape for `batch` and a float dtype. A batch whose features disagree on the batch
    size (or lack an input) is left to the lookup's own checks, which name it.

    Raises:
      ValueError: a missing or unknown feature (named, beside the collection's), or a
        gradient of another shape (the feature, its table, the expected and given shapes) or
        of an integer dtype.
    """
    features = [f.name for f in layout.features]
    missing = [f for f in features if f not in out_grads]
    extra = [k for k in out_grads if k not in features]
    if missing:
        raise ValueError(
            f"{what}: out_grads has no gradient for features {missing} (it has "
            f"{sorted(out_grads)}; the collection's features are {features}): pass d loss / d "
            "output of every feature, e.g. the gradient of the whole dict coll(batch) returned "
            "(a feature the loss does not use gets zeros)"
        )
    if extra:
        raise ValueError(
            f"{what}: out_grads has gradients of {sorted(extra)}, which are not features of "
            f"the collection (its features are {features}): drop them"
        )
    present = [f for f in layout.features if f.name in batch]  # else the lookup names it
    wants = {f.name: out_grad_shape(layout, f.name, batch[f.name]) for f in present}
    if len({w[0] for w in wants.values() if w}) > 1:
        return  # features of different batch sizes: the batch is wrong, the lookup says so
    for f in present:
        want = wants[f.name]
        g = out_grads[f.name]
        got = tuple(int(d) for d in np.shape(g))
        if got != want:
            raise ValueError(
                f"{what}: the gradient of feature {f.name!r} (table {f.table!r}) has shape "
                f"{_shape_text(got)}, but its output for this batch is {_shape_text(want)}: "
                "pass d loss / d coll(batch)[feature], of the output's shape, for the same "
                "batch"
            )
        dtype = _dtype(g)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"{what}: the gradient of feature {f.name!r} (table {f.table!r}) has dtype "
                f"{dtype.name}: pass a float gradient"
            )
