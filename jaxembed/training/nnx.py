"""One training step for NNX models whose tables take a row-sparse optimizer and the rest optax.

    model = MyModel(..., rngs=nnx.Rngs(0))                    # jaxembed.nnx.Embed and/or
                                                              # EmbeddingBagCollection inside
    dense = nnx.Optimizer(model, optax.adam(1e-3), wrt=jaxembed.nnx.DENSE)
    sparse = jaxembed.nnx.SparseOptimizer(model, jaxembed.optim.rowwise_adagrad(0.05))

    @nnx.jit
    def step(model, dense, sparse, batch):
        loss, grads = jaxembed.nnx.value_and_grad(loss_fn)(model, batch)
        dense.update(model, grads.dense)                      # optax, every other parameter
        sparse.update(model, grads)                           # the tables, rows the batch read
        return loss

`value_and_grad` differentiates the loss with respect to every parameter that is not a
`jaxembed.nnx.Table` and, instead of the tables, with respect to each jaxembed lookup's
output (`jaxembed.tape`): the row-sparse update needs no more. A table read densely (a tied
head's `attend` or `cross_entropy`) cannot be trained this way: that is an error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxembed import tape as tape_mod
from jaxembed.kernels.update import after
from jaxembed.nn.nnx_collection import EmbeddingBagCollection
from jaxembed.nn.nnx_embed import Embed, Table
from jaxembed.training.common import Grads

__all__ = ["DENSE", "Grads", "SparseOptimizer", "value_and_grad"]

DENSE = nnx.All(nnx.Param, nnx.Not(Table))
"""The parameters optax trains: every `nnx.Param` but the jaxembed tables (`wrt=DENSE`)."""


def _paths(model: Any) -> dict[int, str]:
    return {
        id(node): "/".join(str(p) for p in path)
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.Module)
    }


def _module_at(model: Any, key: str) -> Any:
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and "/".join(str(p) for p in path) == key:
            return node
    raise KeyError(f"no module at {key!r} in the model")


def value_and_grad(fn: Callable[..., Any], *, has_aux: bool = False) -> Callable[..., Any]:
    """`nnx.value_and_grad(fn)` for models with jaxembed tables trained row-sparse.

    Args:
      fn: `fn(model, *args, **kwargs) -> loss` (or `(loss, aux)` with `has_aux`).
      has_aux: as in `nnx.value_and_grad`.

    Returns:
      A function `(model, *args, **kwargs) -> (value, Grads)`, with `value` the loss (or
      `(loss, aux)`); `Grads.dense` for optax over `DENSE`, the rest for `SparseOptimizer`.

    Raises:
      ValueError: a table read densely (a tied head), or a module that looks up twice.
    """

    def wrapped(model, *args, **kwargs):
        # Pass 1: the lookups' output shapes, for the taps.
        discover = tape_mod.Tape("discover")

        def shapes_of(m):
            discover.paths = _paths(m)
            with tape_mod.recording(discover):
                return fn(m, *args, **kwargs)

        nnx.eval_shape(shapes_of, model)
        taps = [jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), s) for s in discover.shapes]
        tape = tape_mod.Tape("tap", taps=taps)

        def loss_with_taps(m, taps):
            tape.taps, tape.paths = taps, _paths(m)
            tape.records, tape.operands = [], []
            with tape_mod.recording(tape):
                out = fn(m, *args, **kwargs)
            loss, aux = out if has_aux else (out, None)
            return loss, (aux, tape.operands)

        grad_fn = nnx.value_and_grad(
            loss_with_taps, argnums=(nnx.DiffState(0, DENSE), 1), has_aux=True
        )
        (loss, (aux, operands)), (dense, out_grads) = grad_fn(model, taps)
        # The tables' in-place update waits for the loss (so for every lookup): else, with
        # out_grads independent of the forward (a linear loss), XLA copies each table.
        out_grads = after(out_grads, loss)
        grads = Grads(dense, list(operands), list(out_grads), tuple(tape.records))
        return ((loss, aux) if has_aux else loss), grads

    return wrapped


class SparseOptimizer(nnx.Pytree):
    """Row-sparse optimizer state for every jaxembed table of a model, and its update.

    Args:
      model: the model; every `jaxembed.nnx.Embed` and `EmbeddingBagCollection` in it gets
        a state, laid out like its table.
      optimizer: a `jaxembed.optim.RowSparseOptimizer` (e.g. `rowwise_adagrad(0.05)`).

    Examples: see `jaxembed.training.nnx` (and `docs/recsys.md`).
    """

    def __init__(self, model: Any, optimizer: Any):
        self.optimizer = nnx.static(optimizer)
        states = {}
        for key, module in ((k, _module_at(model, k)) for k in _paths(model).values()):
            if isinstance(module, Embed):
                mesh, spec = module.table_layout()
                states[key] = optimizer.init(module.embedding[...], mesh=mesh, weight_spec=spec)
            elif isinstance(module, EmbeddingBagCollection):
                states[key] = module.init_optimizer(optimizer)
        self.states = nnx.data(states)

    def update(self, model: Any, grads: Grads) -> None:
        """Updates, in place, the rows each lookup of the step read, and the states.

        Args:
          model: the model (the same one `value_and_grad` differentiated).
          grads: what `value_and_grad` returned.

        Raises:
          ValueError: a lookup of a module this optimizer holds no state for (it was built
            from another model), or a collection's gradients that do not fit it.
        """
        opt = self.optimizer
        states = dict(self.states)
        for record, operands, out_grad in zip(
            grads.records, grads.operands, grads.out_grads, strict=True
        ):
            module = _module_at(model, record.key)
            if record.key not in states:
                raise ValueError(
                    f"SparseOptimizer.update: no optimizer state for the table at "
                    f"{record.key!r} (it holds states of {sorted(states)}): build the "
                    "SparseOptimizer from this model, SparseOptimizer(model, optimizer)"
                )
            if isinstance(module, EmbeddingBagCollection):
                states[record.key] = module.apply_gradients(
                    opt, states[record.key], operands, out_grad
                )
                continue
            table, state = opt.update(
                module.embedding[...], states[record.key], *operands, out_grad, **record.static
            )
            module.embedding[...] = table
            states[record.key] = state
        self.states = nnx.data(states)
