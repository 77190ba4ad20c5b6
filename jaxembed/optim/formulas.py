"""Row-sparse optimizer formulas: the update a training step applies to each touched row.

A row-sparse step (FBGEMM's "exact" optimizers) deduplicates the ids a table shard owns,
sums the gradients of duplicate ids, gathers those rows of the table and of the optimizer
state, applies a `RowFormula` to them and scatters them back; untouched rows and their
state do not move. This module is only the formula: pure `jnp` on the gathered rows, no
sharding. The one cross-column quantity, a row's mean of g², comes from `row_sum`, which
the kernel makes a `psum` over the mesh axes that split the hidden dimension.

With g the summed gradient of a touched row, w the row, mean_H the mean over all H
columns, lr = learning_rate(count) and t = count + 1 (the optimizer's global step):

    optimizer             state per row            update of a touched row
    sgd                   -                        g += wd·w;  w -= lr·g
    adagrad (optax's)     s f32[H]                 s += g²;  w -= lr·(g·r),
                                                   r = 1/√(s + eps) where s > 0, else 0
    fbgemm_adagrad        s f32[H]                 s += g²;  w -= lr·g/(√s + eps)
    rowwise_adagrad       s f32[]                  l2: g += wd·w;  s += mean_H(g²);
                                                   w = c·w - lr·g/(√s + eps),
                                                   c = 1 - lr·wd if decoupled else 1
    adam (lazy)           m, v f32[H]              m = b1·m + (1-b1)·g;  v = b2·v + (1-b2)·g²;
                                                   w -= lr·(m̂/(√v̂ + eps) + wd·w),
                                                   m̂ = m/(1-b1^t),  v̂ = v/(1-b2^t)
    partial_rowwise_adam  m f32[H], v f32[]        as adam, v = b2·v + (1-b2)·mean_H(g²)
    ftrl                  n, z f32[H]              n' = n + g²;  z += g - (n'^-p - n^-p)/lr·w;
                                                   w = (clip(z, ±l1) - z) / q,
                                                   q = n'^-p/lr + 2·l2 + beta/lr

(slot names: s accumulator, m mu, v nu, n accumulator, z linear.)

**Named like optax, computed like optax.** `sgd` and `adagrad` are optax's `sgd` and
`adagrad`, formula and defaults (adagrad: s starts at 0.1, eps = 1e-7 inside the root, no step
where s = 0): an untouched row has a zero gradient, so its dense update is zero and its
accumulator does not grow, and restricting optax's step to the touched rows is exact (the
same float32 operations in the same order). `sgd`'s `weight_decay` (default 0) is not optax's:
it decays touched rows only, where `optax.chain(optax.add_decayed_weights(wd), optax.sgd(lr))`
decays every row; optax's momentum is refused, since it moves untouched rows. FBGEMM's
element-wise Adagrad (EXACT_ADAGRAD: eps outside the root, s from 0) is `fbgemm_adagrad`.
`rowwise_adagrad` and `partial_rowwise_adam` are FBGEMM's and have no optax twin; `adam` is
lazy Adam, not `optax.adam`, and `ftrl` is TensorFlow's.

**Lazy Adam vs dense Adam.** Only touched rows move, moments included: an untouched row's
m and v stay as they were, where dense Adam (`optax.adam`) decays them every step and,
since its m is not zero, keeps moving the row by lr·m̂/(√v̂ + eps) with a zero gradient.
Bias correction uses the global step t, not the row's: a row first touched at step 1000 has
m = (1-b1)·g, v = (1-b2)·g² and 1 - b^t ≈ 1, so it moves by about lr·(1-b1)/√(1-b2) ≈ 3.2·lr
per element where a per-row count (FBGEMM's `use_rowwise_bias_correction`, not offered
here) would move it by lr; dense Adam does the same as ours for such a row, whose moments
were zero too. The decoupled weight decay only decays touched rows.

**Lazy Adam vs torch.optim.SparseAdam.** The moments and t agree; torch folds the bias
correction into step_size = lr·√(1-b2^t)/(1-b1^t) and adds eps to √v (uncorrected), so
its update is lr·m̂/(√v̂ + eps/√(1-b2^t)): the same as ours with eps replaced by
eps/√(1-b2^t) (31.6·eps at t=1, b2=0.999, tending to eps). They agree exactly when eps = 0
and differ only where √v̂ is not large against eps. SparseAdam has no weight decay.

**FBGEMM's row-wise Adagrad** (EXACT_ROWWISE_ADAGRAD) keeps one accumulator per row (V
floats instead of V·H), grown by the row's mean of g². With `weight_decay_mode="l2"`
(FBGEMM mode 1) wd·w joins g before the accumulator and the step. With "decoupled" (mode 2)
g is left alone and the OLD weight is scaled: w = (1 - lr·wd)·w - lr·g/(√s + eps), the same
as decaying before the step (FBGEMM's `correction * w - multiplier * g`).

All arithmetic is float32 (rows and state of another float dtype are computed in float32 and
returned in their own dtype). Learning-rate schedules are evaluated at `count`, the number
of updates before this one, as optax does. Bias corrections 1 - b^t are computed as
-expm1(t·log b): a float32 `b2 ** t` with b2 = 0.999 is off by ~1e-5 relative, since 0.999
itself rounds in float32. FTRL's n'^-p - n^-p is computed as g²/(√n' + √n) (p = -0.5) or
n^-p·expm1(-p·log1p(g²/n)), never as a difference of two nearby powers.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "RowFormula",
    "StateSlot",
    "adagrad",
    "adam",
    "fbgemm_adagrad",
    "ftrl",
    "partial_rowwise_adam",
    "rowwise_adagrad",
    "sgd",
]

WEIGHT_DECAY_MODES = ("l2", "decoupled")


@dataclasses.dataclass(frozen=True)
class StateSlot:
    """One optimizer state array of a table.

    Attributes:
      name: "accumulator", "mu", "nu" or "linear".
      per_row: True for one float per table row (`[V]`), False for one per element (`[V, H]`).
      init: the value every entry starts at.
    """

    name: str
    per_row: bool
    init: float

    def shape(self, num_rows: int, hidden: int) -> tuple[int, ...]:
        """The slot's shape for a table of `num_rows` rows of `hidden` columns."""
        return (num_rows,) if self.per_row else (num_rows, hidden)


@dataclasses.dataclass(frozen=True)
class RowFormula:
    """An optimizer as plain data: its name, its state slots and its hyperparameters.

    Build one with a constructor (`sgd`, `adagrad`, `fbgemm_adagrad`, `rowwise_adagrad`,
    `adam`, `partial_rowwise_adam`, `ftrl`); it prints, compares and hashes, so it can be a static
    argument of `jax.jit`.

    Attributes:
      name: the optimizer, one of `FORMULAS`.
      slots: its state arrays, in the order `apply` takes and returns them.
      hyperparams: `((name, value), ...)`; `learning_rate` is a float or a schedule.
    """

    name: str
    slots: tuple[StateSlot, ...]
    hyperparams: tuple[tuple[str, Any], ...]

    def __post_init__(self):
        if self.name not in FORMULAS:
            raise ValueError(f"unknown optimizer {self.name!r}: expected one of {FORMULAS}")

    @property
    def hparams(self) -> dict[str, Any]:
        """The hyperparameters as a dict."""
        return dict(self.hyperparams)

    def init_state(self, num_rows: int, hidden: int, dtype: Any = jnp.float32) -> tuple:
        """The initial state of a `[num_rows, hidden]` table, one array per slot.

        Examples:
          >>> [s.shape for s in rowwise_adagrad(0.1).init_state(5, 8)]
          [(5,)]
          >>> [s.shape for s in adam(0.1).init_state(5, 8)]
          [(5, 8), (5, 8)]
        """
        return tuple(
            jnp.full(slot.shape(num_rows, hidden), slot.init, dtype) for slot in self.slots
        )

    def learning_rate_at(self, count: Any) -> Any:
        """f32[]: the learning rate of the update after `count` updates (a schedule's value).

        Examples:
          >>> float(sgd(lambda count: 0.5 / (count + 1)).learning_rate_at(1))
          0.25
        """
        lr = self.hparams["learning_rate"]
        return jnp.asarray(lr(count) if callable(lr) else lr, jnp.float32)

    def step_scalars(self, count: Any) -> Any:
        """f32[3]: the per-step scalars every row's update shares, `lr, 1 - b1^t, 1 - b2^t`.

        `lr` is `learning_rate_at(count)` and t = count + 1 (the bias corrections are 1 for
        the optimizers without moments), computed as `apply` computes them: a kernel that
        runs the formula elsewhere (`jaxembed.kernels.native`) takes them as its operand.

        Examples:
          >>> adam(0.1, b1=0.5, b2=0.5).step_scalars(0).tolist()
          [0.10000000149011612, 0.5, 0.5]
          >>> sgd(0.1).step_scalars(3).tolist()[1:]
          [1.0, 1.0]
        """
        h = self.hparams
        step = jnp.asarray(count, jnp.float32) + 1.0
        one = jnp.float32(1.0)
        moments = self.name in ("adam", "partial_rowwise_adam")
        bc1 = _one_minus_pow(h["b1"], step) if moments else one
        bc2 = _one_minus_pow(h["b2"], step) if moments else one
        scalars = (self.learning_rate_at(count), bc1, bc2)
        return jnp.stack([jnp.asarray(x, jnp.float32).reshape(()) for x in scalars])

    def apply(
        self,
        rows: Any,
        grads: Any,
        states: tuple,
        count: Any,
        *,
        row_sum: Callable[[Any], Any],
        hidden_size: int,
    ) -> tuple[Any, tuple]:
        """One update of the touched rows.

        Args:
          rows: f[U, Hl], the touched rows (the local columns of a shard).
          grads: f[U, Hl], each row's gradient, duplicates already summed.
          states: one array per slot in slot order, f[U, Hl] or f[U] (per-row).
          count: int32 scalar, the number of updates applied before this one (0 first).
          row_sum: f32[U, Hl] -> f32[U], the sum over the WHOLE hidden axis: `jnp.sum(x, -1)`
            on one device, a psum of it over the hidden mesh axes inside a shard_map.
          hidden_size: the global H, for row means.

        Returns:
          `(new_rows, new_states)` in the dtypes given.

        Raises:
          ValueError: shapes that do not match, or a wrong number of states.
        """
        if rows.shape != grads.shape or rows.ndim != 2:
            raise ValueError(
                f"{self.name}: rows {rows.shape} and grads {grads.shape} must both be [U, Hl]"
            )
        if len(states) != len(self.slots):
            raise ValueError(
                f"{self.name}: got {len(states)} state arrays, expected {len(self.slots)} "
                f"({', '.join(s.name for s in self.slots) or 'none'})"
            )
        for slot, s in zip(self.slots, states, strict=True):
            want = rows.shape[:1] if slot.per_row else rows.shape
            if s.shape != want:
                raise ValueError(f"{self.name}: state {slot.name!r} is {s.shape}, expected {want}")
        if not (isinstance(hidden_size, numbers.Integral) and hidden_size >= rows.shape[1]):
            raise ValueError(
                f"{self.name}: hidden_size={hidden_size!r} must be the global H, an int >= "
                f"the local columns {rows.shape[1]}"
            )
        h = self.hparams
        lr = self.learning_rate_at(count)
        f32 = [jnp.asarray(s, jnp.float32) for s in states]
        w, g = jnp.asarray(rows, jnp.float32), jnp.asarray(grads, jnp.float32)
        step = jnp.asarray(count, jnp.float32) + 1.0
        new_w, new_states = _UPDATES[self.name](h, lr, step, w, g, f32, row_sum, hidden_size)
        return new_w.astype(rows.dtype), tuple(
            n.astype(s.dtype) for n, s in zip(new_states, states, strict=True)
        )


# --- updates: f32 in, f32 out.  w, g: f32[U, Hl]; per-row state f32[U] ------------------------


def _one_minus_pow(b: float, t):
    """1 - b^t in float32, accurate for b near 1 (log b is taken in float64)."""
    if b == 0.0:
        return jnp.float32(1.0)
    return -jnp.expm1(t * jnp.float32(math.log(b)))


def _sgd(h, lr, t, w, g, states, row_sum, hidden):
    if h["weight_decay"]:
        g = g + h["weight_decay"] * w
    return w - lr * g, ()


def _adagrad(h, lr, t, w, g, states, row_sum, hidden):
    """optax.adagrad: scale_by_rss, then -lr, then w + u (the same ops in the same order)."""
    (s,) = states
    s = s + g * g
    r = jnp.where(s > 0, jax.lax.rsqrt(s + h["eps"]), 0.0)
    return w - lr * (r * g), (s,)


def _fbgemm_adagrad(h, lr, t, w, g, states, row_sum, hidden):
    (s,) = states
    s = s + g * g
    return w - lr * g / (jnp.sqrt(s) + h["eps"]), (s,)


def _rowwise_adagrad(h, lr, t, w, g, states, row_sum, hidden):
    (s,) = states  # f32[U]
    wd, decoupled = h["weight_decay"], h["weight_decay_mode"] == "decoupled"
    if wd and not decoupled:
        g = g + wd * w  # L2: the decay joins the accumulator and the step
    s = s + row_sum(g * g) / hidden
    multiplier = lr / (jnp.sqrt(s) + h["eps"])  # f32[U]
    if wd and decoupled:
        w = (1.0 - lr * wd) * w  # the old weight, as FBGEMM's `correction`
    return w - multiplier[:, None] * g, (s,)


def _adam_step(h, lr, t, w, m, v_root):
    """w - lr·(m̂/(√v̂ + eps) + wd·w), given m and √v̂ (f32[U, Hl] or f32[U, 1])."""
    m_hat = m / _one_minus_pow(h["b1"], t)
    return w - lr * (m_hat / (v_root + h["eps"]) + h["weight_decay"] * w)


def _adam(h, lr, t, w, g, states, row_sum, hidden):
    m, v = states
    b1, b2 = h["b1"], h["b2"]
    m = b1 * m + (1.0 - b1) * g
    v = b2 * v + (1.0 - b2) * (g * g)
    v_root = jnp.sqrt(v / _one_minus_pow(b2, t))
    return _adam_step(h, lr, t, w, m, v_root), (m, v)


def _partial_rowwise_adam(h, lr, t, w, g, states, row_sum, hidden):
    m, v = states  # f32[U, Hl], f32[U]
    b1, b2 = h["b1"], h["b2"]
    m = b1 * m + (1.0 - b1) * g
    v = b2 * v + (1.0 - b2) * (row_sum(g * g) / hidden)
    v_root = jnp.sqrt(v / _one_minus_pow(b2, t))[:, None]
    return _adam_step(h, lr, t, w, m, v_root), (m, v)


def _power_increase(n, n_new, g2, q: float):
    """n_new^q - n^q (n_new = n + g2, q >= 0) without subtracting two nearby powers."""
    if q == 0.0:
        return jnp.zeros_like(n)
    if q == 0.5:  # √n' - √n = g²/(√n' + √n)
        denom = jnp.sqrt(n_new) + jnp.sqrt(n)
        return jnp.where(n_new > 0, g2 / jnp.where(n_new > 0, denom, 1.0), 0.0)
    safe_n = jnp.where(n > 0, n, 1.0)  # n^q·((1 + g²/n)^q - 1), and n'^q where n = 0
    return jnp.where(n > 0, n**q * jnp.expm1(q * jnp.log1p(g2 / safe_n)), n_new**q)


def _ftrl(h, lr, t, w, g, states, row_sum, hidden):
    n, z = states
    q = -h["learning_rate_power"]
    n_new = n + g * g
    z = z + g - _power_increase(n, n_new, g * g, q) / lr * w
    quadratic = (jnp.sqrt(n_new) if q == 0.5 else n_new**q) / lr + 2.0 * h["l2"] + h["beta"] / lr
    l1 = h["l1"]
    return (jnp.clip(z, -l1, l1) - z) / quadratic, (n_new, z)


_UPDATES = {
    "sgd": _sgd,
    "adagrad": _adagrad,
    "fbgemm_adagrad": _fbgemm_adagrad,
    "rowwise_adagrad": _rowwise_adagrad,
    "adam": _adam,
    "partial_rowwise_adam": _partial_rowwise_adam,
    "ftrl": _ftrl,
}
FORMULAS = tuple(_UPDATES)


# --- hyperparameter checks -------------------------------------------------------------------


def _learning_rate(opt: str, lr: Any, *, positive: bool = False) -> Any:
    if callable(lr):
        return lr
    try:
        value = float(lr)
    except (TypeError, ValueError):
        raise TypeError(
            f"{opt}: learning_rate={lr!r} must be a float or an optax schedule `count -> lr`"
        ) from None
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(
            f"{opt}: learning_rate={lr!r} must be a finite float {bound}, e.g. learning_rate=0.01"
        )
    return value


def _number(
    opt: str, name: str, value: Any, lo: float, hi: float | None = None, *, hi_open: bool = True
) -> float:
    """float(value), checked to lie in [lo, hi) ([lo, hi] with hi_open=False; hi None: inf)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and value >= lo and (hi is None or (value < hi if hi_open else value <= hi))
    if not ok:
        valid = f"[{lo}, {'inf' if hi is None else hi}{')' if hi is None or hi_open else ']'}"
        raise ValueError(f"{opt}: {name}={value!r} is outside the valid range {valid}")
    return float(value)


def _formula(name: str, slots: tuple[StateSlot, ...], **hyperparams: Any) -> RowFormula:
    return RowFormula(name, slots, tuple(hyperparams.items()))


# --- constructors ----------------------------------------------------------------------------


def sgd(
    learning_rate: Any,
    *,
    momentum: float | None = None,
    nesterov: bool = False,
    weight_decay: float = 0.0,
) -> RowFormula:
    """optax's `sgd` on the touched rows: g += wd·w;  w -= lr·g (no state).

    With the defaults this is `optax.sgd(learning_rate)` exactly: an untouched row's
    gradient is zero, so its dense step is zero too. optax's momentum is not offered: it
    keeps moving rows the batch did not touch, which a row-sparse step cannot do.

    Args:
      learning_rate: a float >= 0 or an optax schedule `count -> lr`.
      momentum: None (or 0), as optax's default; any other value is refused.
      nesterov: optax's flag, meaningless without momentum: accepted and ignored.
      weight_decay: wd >= 0, an L2 term added to the gradient of touched rows only (not
        optax's `add_decayed_weights`, which decays every row).

    Returns:
      The `RowFormula`.

    Raises:
      ValueError: a hyperparameter out of its range, or a momentum (the message names it).

    Examples:
      >>> import jax.numpy as jnp
      >>> rows, grads = jnp.ones((2, 4)), jnp.full((2, 4), 2.0)
      >>> new_rows, states = sgd(0.25).apply(rows, grads, (), 0, row_sum=lambda x: x.sum(-1),
      ...                                    hidden_size=4)
      >>> new_rows.tolist(), states
      ([[0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]], ())
    """
    lr = _learning_rate("sgd", learning_rate)
    if momentum is not None and momentum != 0:
        raise ValueError(
            f"sgd: momentum={momentum!r} is not row-sparse: optax's momentum keeps moving rows "
            "the batch did not touch, so a row-sparse step cannot equal it. Use "
            "jaxembed.optim.sgd(learning_rate) without momentum, jaxembed.optim.adam (lazy "
            "Adam: touched rows' moments only), or optax.sgd(learning_rate, momentum) on a "
            "dense table gradient"
        )
    if not isinstance(nesterov, bool):
        raise ValueError(f"sgd: nesterov={nesterov!r} must be a bool")
    wd = _number("sgd", "weight_decay", weight_decay, 0.0)
    return _formula("sgd", (), learning_rate=lr, weight_decay=wd)


def adagrad(
    learning_rate: Any, *, initial_accumulator_value: float = 0.1, eps: float = 1e-7
) -> RowFormula:
    """optax's `adagrad`, formula and defaults: s += g²;  w -= lr·g/√(s + eps) where s > 0.

    Where s = 0 (a zero gradient and a zero start) the step is 0, as optax's
    `jnp.where(s > 0, rsqrt(s + eps), 0)`. Restricted to the touched rows this equals
    `optax.adagrad(learning_rate, initial_accumulator_value, eps)` on the dense gradient:
    untouched rows have g = 0, so neither they nor their accumulator move. FBGEMM's
    element-wise Adagrad (eps outside the root, s from 0) is `fbgemm_adagrad`.

    Args:
      learning_rate: a float >= 0 or an optax schedule `count -> lr`.
      initial_accumulator_value: s at the start, >= 0 (optax's default 0.1).
      eps: >= 0, added to s inside the root (optax's default 1e-7).

    Returns:
      The `RowFormula`, state `(accumulator f32[V, H],)`.

    Raises:
      ValueError: a hyperparameter out of its range (the message names it).

    Examples:
      >>> import jax.numpy as jnp
      >>> f = adagrad(0.5, initial_accumulator_value=0.0, eps=0.0)
      >>> rows, grads = jnp.ones((1, 3)), jnp.array([[2.0, -4.0, 0.0]])
      >>> new_rows, (s,) = f.apply(rows, grads, f.init_state(1, 3), 0,
      ...                          row_sum=lambda x: x.sum(-1), hidden_size=3)
      >>> new_rows.tolist(), s.tolist()
      ([[0.5, 1.5, 1.0]], [[4.0, 16.0, 0.0]])
      >>> adagrad(0.1).init_state(1, 2)[0].tolist()   # optax's start
      [[0.10000000149011612, 0.10000000149011612]]
    """
    lr = _learning_rate("adagrad", learning_rate)
    init = _number("adagrad", "initial_accumulator_value", initial_accumulator_value, 0.0)
    eps = _number("adagrad", "eps", eps, 0.0)
    return _formula("adagrad", (StateSlot("accumulator", False, init),), learning_rate=lr, eps=eps)


def fbgemm_adagrad(
    learning_rate: Any, *, initial_accumulator_value: float = 0.0, eps: float = 1e-8
) -> RowFormula:
    """FBGEMM's element-wise EXACT_ADAGRAD: s += g²;  w -= lr·g/(√s + eps).

    eps is added to √s, outside the root, and s starts at 0: not optax's `adagrad` (see
    `adagrad`), which no choice of these hyperparameters reproduces except eps = 0.

    Args:
      learning_rate: a float >= 0 or an optax schedule `count -> lr`.
      initial_accumulator_value: s at the start, >= 0 (FBGEMM's 0).
      eps: >= 0, added to √s (FBGEMM's 1e-8).

    Returns:
      The `RowFormula`, state `(accumulator f32[V, H],)`.

    Raises:
      ValueError: a hyperparameter out of its range (the message names it).

    Examples:
      >>> import jax.numpy as jnp
      >>> f = fbgemm_adagrad(0.5, eps=0.0)
      >>> rows, grads = jnp.ones((1, 2)), jnp.array([[2.0, -4.0]])
      >>> new_rows, (s,) = f.apply(rows, grads, f.init_state(1, 2), 0,
      ...                          row_sum=lambda x: x.sum(-1), hidden_size=2)
      >>> new_rows.tolist(), s.tolist()
      ([[0.5, 1.5]], [[4.0, 16.0]])
    """
    opt = "fbgemm_adagrad"
    lr = _learning_rate(opt, learning_rate)
    init = _number(opt, "initial_accumulator_value", initial_accumulator_value, 0.0)
    eps = _number(opt, "eps", eps, 0.0)
    return _formula(opt, (StateSlot("accumulator", False, init),), learning_rate=lr, eps=eps)


def rowwise_adagrad(
    learning_rate: Any,
    *,
    eps: float = 1e-8,
    initial_accumulator_value: float = 0.0,
    weight_decay: float = 0.0,
    weight_decay_mode: str = "l2",
) -> RowFormula:
    """FBGEMM's EXACT_ROWWISE_ADAGRAD: one accumulator per row, grown by the row's mean g².

    "l2":        g += wd·w;  s += mean_H(g²);  w -= lr·g/(√s + eps)
    "decoupled": s += mean_H(g²);  w = (1 - lr·wd)·w - lr·g/(√s + eps)

    Args:
      learning_rate: a float >= 0 or an optax schedule `count -> lr`.
      eps: >= 0, added to √s.
      initial_accumulator_value: s at the start, >= 0.
      weight_decay: wd >= 0.
      weight_decay_mode: "l2" (FBGEMM's L2 = 1) or "decoupled" (DECOUPLE = 2).

    Returns:
      The `RowFormula`, state `(accumulator f32[V],)`.

    Raises:
      ValueError: a hyperparameter out of its range (the message names it).

    Examples:
      >>> import jax.numpy as jnp
      >>> f = rowwise_adagrad(0.5, eps=0.0)
      >>> rows, grads = jnp.ones((1, 2)), jnp.array([[1.0, 7.0]])  # mean g² = 25
      >>> new_rows, (s,) = f.apply(rows, grads, f.init_state(1, 2), 0,
      ...                          row_sum=lambda x: x.sum(-1), hidden_size=2)
      >>> print(new_rows, s)
      [[0.9 0.3]] [25.]
    """
    opt = "rowwise_adagrad"
    lr = _learning_rate(opt, learning_rate)
    eps = _number(opt, "eps", eps, 0.0)
    init = _number(opt, "initial_accumulator_value", initial_accumulator_value, 0.0)
    wd = _number(opt, "weight_decay", weight_decay, 0.0)
    if weight_decay_mode not in WEIGHT_DECAY_MODES:
        raise ValueError(
            f"{opt}: weight_decay_mode={weight_decay_mode!r} is not one of {WEIGHT_DECAY_MODES}"
        )
    return _formula(
        opt,
        (StateSlot("accumulator", True, init),),
        learning_rate=lr,
        eps=eps,
        weight_decay=wd,
        weight_decay_mode=weight_decay_mode,
    )


def _adam_args(opt: str, learning_rate, b1, b2, eps, weight_decay) -> dict[str, Any]:
    return dict(
        learning_rate=_learning_rate(opt, learning_rate),
        b1=_number(opt, "b1", b1, 0.0, 1.0),
        b2=_number(opt, "b2", b2, 0.0, 1.0),
        eps=_number(opt, "eps", eps, 0.0),
        weight_decay=_number(opt, "weight_decay", weight_decay, 0.0),
    )


def adam(
    learning_rate: Any,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> RowFormula:
    """Lazy Adam: only touched rows' moments move; bias correction from the global step.

    With t = count + 1:  m = b1·m + (1-b1)·g;  v = b2·v + (1-b2)·g²;
    w -= lr·(m/(1-b1^t) / (√(v/(1-b2^t)) + eps) + wd·w)  (decoupled decay, as optax.adamw).
    See the module docstring for how it differs from dense Adam and torch's SparseAdam.

    Args:
      learning_rate: a float >= 0 or an optax schedule `count -> lr`.
      b1, b2: moment decay rates in [0, 1).
      eps: >= 0, added to √v̂.
      weight_decay: wd >= 0 (decoupled).

    Returns:
      The `RowFormula`, state `(mu f32[V, H], nu f32[V, H])`.

    Raises:
      ValueError: a hyperparameter out of its range (the message names it).

    Examples:
      >>> import jax.numpy as jnp
      >>> f = adam(0.5)  # the first step moves each element by lr·sign(g)
      >>> rows, grads = jnp.ones((1, 3)), jnp.array([[3.0, -0.5, 0.0]])
      >>> new_rows, (m, v) = f.apply(rows, grads, f.init_state(1, 3), 0,
      ...                            row_sum=lambda x: x.sum(-1), hidden_size=3)
      >>> bool(jnp.allclose(new_rows, jnp.array([[0.5, 1.5, 1.0]])))
      True
    """
    return _formula(
        "adam",
        (StateSlot("mu", False, 0.0), StateSlot("nu", False, 0.0)),
        **_adam_args("adam", learning_rate, b1, b2, eps, weight_decay),
    )


def partial_rowwise_adam(
    learning_rate: Any,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> RowFormula:
    """Lazy Adam with one second moment per row (FBGEMM's PARTIAL_ROWWISE_ADAM).

    As `adam`, but v is a scalar per row: v = b2·v + (1-b2)·mean_H(g²).

    Args:
      learning_rate: a float >= 0 or an optax schedule `count -> lr`.
      b1, b2: moment decay rates in [0, 1).
      eps: >= 0, added to √v̂.
      weight_decay: wd >= 0 (decoupled).

    Returns:
      The `RowFormula`, state `(mu f32[V, H], nu f32[V])`.

    Raises:
      ValueError: a hyperparameter out of its range (the message names it).

    Examples:
      >>> import jax.numpy as jnp
      >>> f = partial_rowwise_adam(0.5)
      >>> rows, grads = jnp.ones((1, 2)), jnp.array([[1.0, 7.0]])  # √mean g² = 5
      >>> new_rows, (m, v) = f.apply(rows, grads, f.init_state(1, 2), 0,
      ...                            row_sum=lambda x: x.sum(-1), hidden_size=2)
      >>> bool(jnp.allclose(new_rows, jnp.array([[0.9, 0.3]]))), v.shape  # 1 - 0.5·g/5
      (True, (1,))
    """
    return _formula(
        "partial_rowwise_adam",
        (StateSlot("mu", False, 0.0), StateSlot("nu", True, 0.0)),
        **_adam_args("partial_rowwise_adam", learning_rate, b1, b2, eps, weight_decay),
    )


def ftrl(
    learning_rate: Any,
    *,
    learning_rate_power: float = -0.5,
    l1: float = 0.0,
    l2: float = 0.0,
    beta: float = 0.0,
    initial_accumulator_value: float = 0.1,
) -> RowFormula:
    """FTRL-proximal per element, as TensorFlow / Keras `Ftrl` (p = learning_rate_power).

    n' = n + g²;  z += g - (n'^-p - n^-p)/lr·w;
    w = (clip(z, -l1, l1) - z) / (n'^-p/lr + 2·l2 + beta/lr)   (0 where |z| <= l1)

    Keras' `l2_shrinkage_regularization_strength` is not offered.

    Args:
      learning_rate: a float > 0 or an optax schedule `count -> lr` (it must stay > 0).
      learning_rate_power: p <= 0; -0.5 is the paper's 1/√n, 0 a fixed rate.
      l1, l2: regularization strengths >= 0.
      beta: >= 0, Keras' `beta` (adds beta/lr to the denominator).
      initial_accumulator_value: n at the start, >= 0.

    Returns:
      The `RowFormula`, state `(accumulator f32[V, H], linear f32[V, H])`.

    Raises:
      ValueError: a hyperparameter out of its range (the message names it).

    Examples:
      >>> import jax.numpy as jnp
      >>> f = ftrl(0.1, l1=1.0)  # |z| <= l1: the weight is exactly zero
      >>> rows, grads = jnp.zeros((1, 3)), jnp.array([[0.5, -2.0, 3.0]])
      >>> new_rows, (n, z) = f.apply(rows, grads, f.init_state(1, 3), 0,
      ...                            row_sum=lambda x: x.sum(-1), hidden_size=3)
      >>> (new_rows == 0).tolist(), z.tolist()
      ([[True, False, False]], [[0.5, -2.0, 3.0]])
    """
    opt = "ftrl"
    lr = _learning_rate(opt, learning_rate, positive=True)
    power = _number(opt, "learning_rate_power", learning_rate_power, -math.inf, 0.0, hi_open=False)
    init = _number(opt, "initial_accumulator_value", initial_accumulator_value, 0.0)
    return _formula(
        opt,
        (StateSlot("accumulator", False, init), StateSlot("linear", False, 0.0)),
        learning_rate=lr,
        learning_rate_power=power,
        l1=_number(opt, "l1", l1, 0.0),
        l2=_number(opt, "l2", l2, 0.0),
        beta=_number(opt, "beta", beta, 0.0),
    )
