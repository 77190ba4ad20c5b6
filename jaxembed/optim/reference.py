"""The float64 numpy reference of a row-sparse optimizer step: the spec tests check against.

`sparse_step(formula, table, states, ids, grads, count=...)` is what one training step does
to a table and its optimizer state, written as plainly as possible:

1. ids that are negative, >= vocab_size or == padding_idx contribute nothing;
2. the gradients of duplicate ids are summed (`dedup_grads`);
3. every touched row gets exactly one update (`update_rows`), in float64;
4. untouched rows and their state are returned unchanged.

`update_rows` is independent of `jaxembed.optim.formulas`: it reads only the formula's name
and hyperparameters and restates each optimizer's math in numpy, so a mistake in the float32
formula does not carry into the reference. The row mean of g² is the mean over the row's H
columns; learning-rate schedules are evaluated at `count`, the number of earlier updates,
and Adam's bias correction uses t = count + 1.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxembed.optim.formulas import RowFormula

__all__ = ["dedup_grads", "init_states", "sparse_step", "update_rows"]


def init_states(formula: RowFormula, num_rows: int, hidden: int) -> tuple[np.ndarray, ...]:
    """The initial optimizer state of a `[num_rows, hidden]` table, in float64.

    Examples:
      >>> from jaxembed.optim import formulas
      >>> [s.shape for s in init_states(formulas.partial_rowwise_adam(0.1), 4, 3)]
      [(4, 3), (4,)]
      >>> init_states(formulas.ftrl(0.1), 2, 2)[0].tolist()
      [[0.1, 0.1], [0.1, 0.1]]
    """
    return tuple(
        np.full(slot.shape(num_rows, hidden), slot.init, np.float64) for slot in formula.slots
    )


def dedup_grads(
    ids: np.ndarray,
    grads: np.ndarray,
    *,
    vocab_size: int,
    padding_idx: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The touched rows and each one's summed gradient.

    Args:
      ids: integer ids of any shape.
      grads: `[*ids.shape, H]`, one gradient row per id.
      vocab_size: ids >= vocab_size (and negative ids) contribute nothing.
      padding_idx: an id that contributes nothing, or None.

    Returns:
      `(rows, summed)`: the sorted unique valid ids, int64[U], and float64[U, H].

    Examples:
      >>> rows, summed = dedup_grads(np.array([3, 1, 3, -1, 9, 0]), np.arange(6.0)[:, None],
      ...                            vocab_size=5, padding_idx=0)
      >>> rows.tolist(), summed.tolist()
      ([1, 3], [[1.0], [2.0]])
    """
    ids = np.asarray(ids)
    grads = np.asarray(grads, np.float64)
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"ids must be integers, got dtype {ids.dtype}")
    if grads.shape[:-1] != ids.shape or grads.ndim != ids.ndim + 1:
        raise ValueError(f"grads {grads.shape} must be [*ids.shape, H] with ids {ids.shape}")
    flat = ids.reshape(-1).astype(np.int64)
    flat_grads = grads.reshape(-1, grads.shape[-1])
    valid = (flat >= 0) & (flat < vocab_size)
    if padding_idx is not None:
        valid &= flat != padding_idx
    rows, inverse = np.unique(flat[valid], return_inverse=True)
    summed = np.zeros((rows.size, grads.shape[-1]), np.float64)
    np.add.at(summed, inverse, flat_grads[valid])
    return rows, summed


def _learning_rate(h: dict[str, Any], count: int) -> float:
    lr = h["learning_rate"]
    return float(lr(count)) if callable(lr) else float(lr)


def update_rows(
    formula: RowFormula,
    rows: np.ndarray,
    grads: np.ndarray,
    states: tuple[np.ndarray, ...],
    *,
    count: int,
) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """One update of whole rows in float64: the math `RowFormula.apply` must match.

    Args:
      formula: the optimizer (only its name and hyperparameters are read).
      rows: `[U, H]` whole rows.
      grads: `[U, H]`, each row's summed gradient.
      states: in slot order, `[U, H]` or `[U]` (per-row slots).
      count: the number of updates applied before this one.

    Returns:
      `(new_rows, new_states)`, float64.

    Examples:
      >>> from jaxembed.optim import formulas
      >>> new, (s,) = update_rows(formulas.rowwise_adagrad(1.0, eps=0.0), np.ones((1, 2)),
      ...                         np.array([[3.0, 4.0]]), (np.zeros(1),), count=0)
      >>> new.round(6).tolist(), s.tolist()  # mean g² = 12.5
      ([[0.151472, -0.131371]], [12.5])
    """
    h = formula.hparams
    lr = _learning_rate(h, count)
    w = np.asarray(rows, np.float64)
    g = np.asarray(grads, np.float64)
    st = [np.asarray(s, np.float64) for s in states]
    name = formula.name
    t = count + 1

    if name == "sgd":
        g = g + h["weight_decay"] * w
        return w - lr * g, ()

    if name == "adagrad":  # optax's: eps inside the root, no step where s = 0
        s = st[0] + g**2
        r = np.where(s > 0, 1.0 / np.sqrt(np.where(s > 0, s, 1.0) + h["eps"]), 0.0)
        return w - lr * g * r, (s,)

    if name == "fbgemm_adagrad":  # FBGEMM's EXACT_ADAGRAD: eps outside the root
        s = st[0] + g**2
        return w - lr * g / (np.sqrt(s) + h["eps"]), (s,)

    if name == "rowwise_adagrad":
        wd = h["weight_decay"]
        if h["weight_decay_mode"] == "l2":
            g = g + wd * w
            decay = 1.0
        else:
            decay = 1.0 - lr * wd
        s = st[0] + np.mean(g**2, axis=-1)
        return decay * w - lr * g / (np.sqrt(s)[:, None] + h["eps"]), (s,)

    if name in ("adam", "partial_rowwise_adam"):
        b1, b2 = h["b1"], h["b2"]
        m = b1 * st[0] + (1 - b1) * g
        if name == "adam":
            v = b2 * st[1] + (1 - b2) * g**2
            v_hat = v / (1 - b2**t)
        else:
            v = b2 * st[1] + (1 - b2) * np.mean(g**2, axis=-1)
            v_hat = (v / (1 - b2**t))[:, None]
        m_hat = m / (1 - b1**t)
        return w - lr * (m_hat / (np.sqrt(v_hat) + h["eps"]) + h["weight_decay"] * w), (m, v)

    if name == "ftrl":
        n, z = st
        p = h["learning_rate_power"]
        n_new = n + g**2
        z = z + g - (n_new ** (-p) - n ** (-p)) / lr * w
        quadratic = n_new ** (-p) / lr + 2 * h["l2"] + h["beta"] / lr
        new_w = np.where(np.abs(z) > h["l1"], (np.sign(z) * h["l1"] - z) / quadratic, 0.0)
        return new_w, (n_new, z)

    raise ValueError(f"no reference for optimizer {name!r}")


def sparse_step(
    formula: RowFormula,
    table: np.ndarray,
    states: tuple[np.ndarray, ...],
    ids: np.ndarray,
    grads: np.ndarray,
    *,
    count: int,
    vocab_size: int | None = None,
    padding_idx: int | None = None,
) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """One row-sparse optimizer step of a whole table, in float64.

    Args:
      formula: the optimizer.
      table: `[V, H]`, any float dtype.
      states: the optimizer state in slot order, `[V, H]` or `[V]` (per-row slots).
      ids: integer ids of any shape; negative ids, ids >= vocab_size and padding_idx are
        skipped.
      grads: `[*ids.shape, H]`, the gradient of each id's lookup.
      count: the number of updates applied before this one (0 at the first step).
      vocab_size: the real rows (default V); rows past it are padding and never move.
      padding_idx: an id that contributes nothing, or None.

    Returns:
      `(new_table, new_states)`, float64; only the touched rows differ from the inputs.

    Raises:
      ValueError: shapes that do not match the table or the formula's slots, or a
        vocab_size larger than the table.

    Examples:
      >>> from jaxembed.optim import formulas
      >>> table, ids = np.zeros((4, 2)), np.array([[1, 1], [3, -1]])
      >>> new, _ = sparse_step(formulas.sgd(0.5), table, (), ids, np.ones((2, 2, 2)),
      ...                      count=0, vocab_size=3)
      >>> new.tolist()  # row 1 twice: one step with the summed gradient; 3 is past vocab
      [[0.0, 0.0], [-1.0, -1.0], [0.0, 0.0], [0.0, 0.0]]
    """
    table = np.asarray(table, np.float64)
    if table.ndim != 2:
        raise ValueError(f"table must be [V, H], got shape {table.shape}")
    num_rows, hidden = table.shape
    vocab_size = num_rows if vocab_size is None else vocab_size
    if not 0 <= vocab_size <= num_rows:
        raise ValueError(f"vocab_size={vocab_size} must be in [0, {num_rows}], the table's rows")
    if len(states) != len(formula.slots):
        raise ValueError(
            f"{formula.name} has {len(formula.slots)} state slots, got {len(states)} arrays"
        )
    states = tuple(np.asarray(s, np.float64) for s in states)
    for slot, s in zip(formula.slots, states, strict=True):
        if s.shape != slot.shape(num_rows, hidden):
            raise ValueError(
                f"state {slot.name!r} has shape {s.shape}, expected "
                f"{slot.shape(num_rows, hidden)} for a table of shape {table.shape}"
            )
    grads = np.asarray(grads)
    if grads.shape[-1:] != (hidden,):
        raise ValueError(f"grads {grads.shape} must end in the table's hidden size {hidden}")
    rows, summed = dedup_grads(ids, grads, vocab_size=vocab_size, padding_idx=padding_idx)
    new_rows, new_row_states = update_rows(
        formula, table[rows], summed, tuple(s[rows] for s in states), count=count
    )
    new_table = table.copy()
    new_table[rows] = new_rows
    new_states = []
    for s, new in zip(states, new_row_states, strict=True):
        s = s.copy()
        s[rows] = new
        new_states.append(s)
    return new_table, tuple(new_states)
