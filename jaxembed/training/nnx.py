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

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.graph import is_graph_node

from jaxembed import tape as tape_mod
from jaxembed.kernels.update import after
from jaxembed.nn.nnx_collection import EmbeddingBagCollection
from jaxembed.nn.nnx_dynamic import DynamicEmbed
from jaxembed.nn.nnx_embed import Embed, Table
from jaxembed.training.common import Grads, argnums_tuple

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


def _paths_of(args: Sequence[Any]) -> dict[int, str]:
    """The module paths of every model among the positional arguments."""
    out: dict[int, str] = {}
    for a in args:
        if isinstance(a, nnx.Module):
            out.update(_paths(a))
    return out


def value_and_grad(
    fn: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    allow_int: bool = False,
    reduce_axes: Sequence[Any] = (),
) -> Callable[..., Any]:
    """`nnx.value_and_grad(fn, ...)` for models with jaxembed tables trained row-sparse.

    Takes `jax.value_and_grad`'s arguments (but `holomorphic`), which mean what they mean
    there; a model selected by `argnums` is differentiated over `DENSE` (its parameters but
    the tables), and the lookups' output gradients are taken beside.

    Args:
      fn: `fn(*args, **kwargs) -> loss` (or `(loss, aux)` with `has_aux`), e.g.
        `fn(model, batch)`; the model is any positional argument.
      argnums: the positional arguments `Grads.dense` is the gradient of: an int (that
        argument's: an `nnx.State` over `DENSE` for a model) or a sequence of ints (a tuple).
      has_aux: `fn` returns `(loss, aux)`.
      allow_int: integer arguments selected by `argnums` get `float0` gradients (as jax's).
      reduce_axes: as jax's (only `()`: jax has retired it).

    Returns:
      A function `(*args, **kwargs) -> (value, Grads)`, with `value` the loss (or
      `(loss, aux)`); `Grads.dense` for optax, the rest for `SparseOptimizer`.

    Raises:
      ValueError: a table read densely (a tied head), or a module that looks up twice.
      TypeError: `argnums` not ints or beyond the call's positional arguments, or an integer
        argument without `allow_int` (jax's error).

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import jaxembed, jaxembed.nnx
      >>> model = jaxembed.nnx.Embed(10, 4, rngs=nnx.Rngs(0))
      >>> ids = jnp.array([1, 2, 2])
      >>> def loss(scale, model, ids):
      ...     return scale * model(ids).sum()
      >>> value, grads = jaxembed.nnx.value_and_grad(loss, argnums=0)(2.0, model, ids)
      >>> bool(jnp.allclose(grads.dense, value / 2.0)), grads.out_grads[0].shape
      (True, (3, 4))
    """

    def wrapped(*args, **kwargs):
        nums = argnums_tuple(argnums, len(args), what="jaxembed.nnx.value_and_grad")
        # Pass 1: the lookups' output shapes, for the taps.
        discover = tape_mod.Tape("discover")
        graph = [i for i, a in enumerate(args) if is_graph_node(a)]

        def shapes_of(*nodes):
            full = list(args)
            for i, node in zip(graph, nodes, strict=True):
                full[i] = node
            discover.paths = _paths_of(full)
            with tape_mod.recording(discover):
                return fn(*full, **kwargs)

        nnx.eval_shape(shapes_of, *(args[i] for i in graph))
        taps = [jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), s) for s in discover.shapes]
        tape = tape_mod.Tape("tap", taps=taps)

        def loss_with_taps(taps, *args):
            tape.taps, tape.paths = taps, _paths_of(args)
            tape.records, tape.operands = [], []
            with tape_mod.recording(tape):
                out = fn(*args, **kwargs)
            loss, aux = out if has_aux else (out, None)
            return loss, (aux, tape.operands)

        wrt = [nnx.DiffState(n + 1, DENSE) if is_graph_node(args[n]) else n + 1 for n in nums]
        grad_fn = nnx.value_and_grad(
            loss_with_taps, argnums=(0, *wrt), has_aux=True, allow_int=allow_int,
            reduce_axes=reduce_axes,
        )  # fmt: skip
        (loss, (aux, operands)), (out_grads, *dense) = grad_fn(taps, *args)
        # The tables' in-place update waits for the loss (so for every lookup): else, with
        # out_grads independent of the forward (a linear loss), XLA copies each table.
        out_grads = after(out_grads, loss)
        dense = dense[0] if isinstance(argnums, int) else tuple(dense)
        grads = Grads(dense, list(operands), list(out_grads), tuple(tape.records))
        return ((loss, aux) if has_aux else loss), grads

    return wrapped


class SparseOptimizer(nnx.Pytree):
    """Row-sparse optimizer state for every jaxembed table of a model, and its update.

    Args:
      model: the model; every `jaxembed.nnx.Embed`, `DynamicEmbed` and
        `EmbeddingBagCollection` in it gets a state, laid out like its table.
      optimizer: a `jaxembed.optim.RowSparseOptimizer` (e.g. `rowwise_adagrad(0.05)`).

    Examples: see `jaxembed.training.nnx` (and `docs/recsys.md`).
    """

    def __init__(self, model: Any, optimizer: Any):
        self.optimizer = nnx.static(optimizer)
        states = {}
        for key, module in ((k, _module_at(model, k)) for k in _paths(model).values()):
            if isinstance(module, Embed | DynamicEmbed):
                mesh, spec = module.table_layout()
                states[key] = optimizer.init(module.embedding[...], mesh=mesh, weight_spec=spec)
            elif isinstance(module, EmbeddingBagCollection):
                states[key] = module.init_optimizer(optimizer)
        self.states = nnx.data(states)

    def update(self, model: Any, grads: Grads) -> None:
        """Updates, in place, the rows each lookup of the step read, and the states.

        A `DynamicEmbed`'s rows given out in the step get their initial optimizer state
        first (`jaxembed.optim.dynamic.reset_optimizer_rows`).

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
                batch, resets = operands if isinstance(operands, tuple) else (operands, None)
                states[record.key] = module.apply_gradients(
                    opt, states[record.key], batch, out_grad, resets=resets
                )
                continue
            state = states[record.key]
            if isinstance(module, DynamicEmbed):  # rows handed out this step start afresh
                operands, reset = operands[:1], operands[1]
                state = module.reset_optimizer(opt, state, reset)
            table, state = opt.update(
                module.embedding[...], state, *operands, out_grad, **record.static
            )
            module.embedding[...] = table
            states[record.key] = state
        self.states = nnx.data(states)
