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

| optimizer | state per row | row update (g: the row's summed gradient) |
|---|---|---|
| `sgd` | – | w -= lr·g |
| `adagrad` | s [H] | s += g²; w -= lr·g/(√s + eps) |
| `rowwise_adagrad` | s [] | s += mean(g²); w -= lr·g/(√s + eps) (FBGEMM's default) |
| `adam` | m, v [H] | lazy Adam: only touched rows' moments move; t = the global step |
| `partial_rowwise_adam` | m [H], v [] | as adam, v from mean(g²) |
| `ftrl` | n, z [H] | FTRL-proximal (TensorFlow's) |

See `jaxembed.optim.formulas` for the exact formulas and how lazy Adam differs from dense
Adam and from `torch.optim.SparseAdam`.
"""

from __future__ import annotations

from typing import Any

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
    "ftrl",
    "partial_rowwise_adam",
    "rowwise_adagrad",
    "sgd",
]


def sgd(learning_rate: Any, *, weight_decay: float = 0.0) -> RowSparseOptimizer:
    """Row-sparse SGD: w -= lr·g on the touched rows (`formulas.sgd`)."""
    return RowSparseOptimizer(formulas.sgd(learning_rate, weight_decay=weight_decay))


def adagrad(
    learning_rate: Any, *, initial_accumulator_value: float = 0.0, eps: float = 1e-8
) -> RowSparseOptimizer:
    """Row-sparse Adagrad, one accumulator per element (`formulas.adagrad`)."""
    return RowSparseOptimizer(
        formulas.adagrad(
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
    (`formulas.rowwise_adagrad`)."""
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
    """Lazy Adam: only the touched rows' moments move (`formulas.adam`)."""
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
