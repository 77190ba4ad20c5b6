"""Row-sparse fused optimizers for embedding tables: a step costs what the batch touches.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> import jaxembed
    >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
    >>> table = jax.device_put(jnp.ones((64, 8)), NamedSharding(mesh, P("model", None)))
    >>> ids = jax.device_put(jnp.array([[1, 2, 2, 9]] * 2), NamedSharding(mesh, P("data")))
    >>> opt = jaxembed.optim.rowwise_adagrad(learning_rate=0.5)
    >>> state = opt.init(table)
    >>> g = jnp.ones((2, 4, 8))                       # d loss / d embeddings
    >>> table, state = jax.jit(opt.update, donate_argnums=(0, 1))(table, state, ids, g)
    >>> np.asarray(table)[[0, 1, 2, 9], 0].round(3).tolist()   # row 0 untouched
    [1.0, 0.5, 0.5, 0.5]
    >>> state.slots["accumulator"].sharding.spec, int(state.count)
    (P('model',), 1)

Optimizers named like optax's compute optax's formula at optax's defaults, wherever the
row-sparse step can equal the dense one (an untouched row has a zero gradient, so its dense
step is zero): `sgd(lr)` is `optax.sgd(lr)` and `adagrad(lr)` is `optax.adagrad(lr)`, tables
and accumulators alike. FBGEMM's variants keep their own names; the rest have no optax twin.

| name | state, start | update of a touched row (g: its summed gradient) | the same as |
|---|---|---|---|
| `sgd` | – | w -= lr·g | `optax.sgd(lr)` |
| `adagrad` | s [H], 0.1 | s += g²; w -= lr·g/√(s + eps), 0 if s = 0 | `optax.adagrad(lr)` |
| `fbgemm_adagrad` | s [H], 0 | s += g²; w -= lr·g/(√s + eps) | FBGEMM EXACT_ADAGRAD |
| `rowwise_adagrad` | s [], 0 | s += mean(g²); w -= lr·g/(√s + eps) | FBGEMM (no optax twin) |
| `adam` | m, v [H], 0 | LAZY Adam: untouched rows' moments stay | not `optax.adam` |
| `partial_rowwise_adam` | m [H], v [], 0 | lazy Adam, v from mean(g²) | FBGEMM |
| `ftrl` | n [H], 0.1; z [H] | FTRL-proximal | TensorFlow's `Ftrl` |

eps: 1e-7 for `adagrad` (optax's), 1e-8 for the others. optax's sgd momentum is refused (it
moves untouched rows); lazy Adam differs from `optax.adam` on purpose (`formulas` says how).

Earlier releases' `adagrad` was FBGEMM's (s from 0, eps = 1e-8 outside the root): that is now
`fbgemm_adagrad`, with the same defaults. See `jaxembed.optim.formulas` for the exact
formulas and how lazy Adam differs from dense Adam and from `torch.optim.SparseAdam`.

Dynamic tables (raw 64-bit ids, admission and eviction) train with these optimizers through
`jaxembed.optim.dynamic.prepare`, which remaps the ids to rows and resets the rows it
(re)assigns, table and optimizer state, before they are read (docs/dynamic.md).
"""

from __future__ import annotations

from typing import Any

from jaxembed.optim import dynamic as dynamic
from jaxembed.optim import dynamic_io as dynamic_io
from jaxembed.optim import formulas
from jaxembed.optim.sparse import RowSparseOptimizer as RowSparseOptimizer
from jaxembed.optim.sparse import RowSparseState as RowSparseState
from jaxembed.optim.sparse import after as after

__all__ = [
    "RowSparseOptimizer",
    "RowSparseState",
    "adagrad",
    "adam",
    "after",
    "dynamic",
    "dynamic_io",
    "fbgemm_adagrad",
    "ftrl",
    "partial_rowwise_adam",
    "rowwise_adagrad",
    "sgd",
]


def sgd(
    learning_rate: Any,
    *,
    momentum: float | None = None,
    nesterov: bool = False,
    weight_decay: float = 0.0,
) -> RowSparseOptimizer:
    """Row-sparse SGD, `optax.sgd(learning_rate)` on the touched rows (`formulas.sgd`).

    A momentum is refused (ValueError): optax's keeps moving untouched rows. `weight_decay`
    decays touched rows only.
    """
    return RowSparseOptimizer(
        formulas.sgd(learning_rate, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
    )


def adagrad(
    learning_rate: Any, *, initial_accumulator_value: float = 0.1, eps: float = 1e-7
) -> RowSparseOptimizer:
    """Row-sparse Adagrad, exactly `optax.adagrad` with its defaults (`formulas.adagrad`).

    s += g²; w -= lr·g/√(s + eps) (0 where s = 0), s from 0.1. FBGEMM's EXACT_ADAGRAD
    (eps outside the root, s from 0) is `fbgemm_adagrad`.
    """
    return RowSparseOptimizer(
        formulas.adagrad(
            learning_rate, initial_accumulator_value=initial_accumulator_value, eps=eps
        )
    )


def fbgemm_adagrad(
    learning_rate: Any, *, initial_accumulator_value: float = 0.0, eps: float = 1e-8
) -> RowSparseOptimizer:
    """FBGEMM's element-wise EXACT_ADAGRAD: s += g²; w -= lr·g/(√s + eps), s from 0
    (`formulas.fbgemm_adagrad`). Not optax's `adagrad`: see `adagrad`."""
    return RowSparseOptimizer(
        formulas.fbgemm_adagrad(
            learning_rate, initial_accumulator_value=initial_accumulator_value, eps=eps
        )
    )


def rowwise_adagrad(
    learning_rate: Any,
    *,
    eps: float = 1e-8,
    initial_accumulator_value: float = 0.0,
    weight_decay: float = 0.0,
    weight_decay_mode: str = "l2",
) -> RowSparseOptimizer:
    """Row-wise Adagrad, one accumulator per row: FBGEMM's EXACT_ROWWISE_ADAGRAD
    (`formulas.rowwise_adagrad`). It has no optax twin."""
    return RowSparseOptimizer(
        formulas.rowwise_adagrad(
            learning_rate,
            eps=eps,
            initial_accumulator_value=initial_accumulator_value,
            weight_decay=weight_decay,
            weight_decay_mode=weight_decay_mode,
        )
    )


def adam(
    learning_rate: Any,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> RowSparseOptimizer:
    """LAZY (row-sparse) Adam, not `optax.adam`: only the touched rows' moments move
    (`formulas.adam`).

    Dense Adam decays every row's moments each step and keeps moving rows the batch did not
    touch; this one leaves them alone. Bias correction uses the global step.
    """
    return RowSparseOptimizer(
        formulas.adam(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    )


def partial_rowwise_adam(
    learning_rate: Any,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> RowSparseOptimizer:
    """Lazy Adam with one second moment per row (`formulas.partial_rowwise_adam`)."""
    return RowSparseOptimizer(
        formulas.partial_rowwise_adam(
            learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay
        )
    )


def ftrl(
    learning_rate: Any,
    *,
    learning_rate_power: float = -0.5,
    l1: float = 0.0,
    l2: float = 0.0,
    beta: float = 0.0,
    initial_accumulator_value: float = 0.1,
) -> RowSparseOptimizer:
    """FTRL-proximal per element, as TensorFlow's (`formulas.ftrl`)."""
    return RowSparseOptimizer(
        formulas.ftrl(
            learning_rate,
            learning_rate_power=learning_rate_power,
            l1=l1,
            l2=l2,
            beta=beta,
            initial_accumulator_value=initial_accumulator_value,
        )
    )
