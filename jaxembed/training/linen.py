"""One training step for Linen models whose tables take a row-sparse optimizer and the rest optax.

    loss_fn = lambda params, batch: loss(model.apply({"params": params}, batch), batch)
    sparse = jaxembed.flax.init_sparse(opt, loss_fn, params, batch)      # the tables' state
    tx = optax.masked(optax.adam(1e-3), jaxembed.flax.dense_mask(loss_fn, params, batch))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, sparse, batch):
        loss, grads = jaxembed.flax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads.dense, opt_state, params)   # every other parameter
        params = optax.apply_updates(params, updates)
        params, sparse = jaxembed.flax.sparse_update(opt, sparse, params, grads)  # the tables
        return params, opt_state, sparse, loss

`params` may as well be what `model.init` returns, the variables (`{"params": ...}`), with
`loss_fn = lambda variables, batch: ...model.apply(variables, batch)...`: every helper finds
the tables in either form and returns the form it was given.

The tables' entries of `grads.dense` are zeros (the lookups held them constant); `dense_mask`
keeps optax off them (a decoupled weight decay would otherwise shrink them). See
`jaxembed.training.nnx` for how the gradients are taken.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxembed import tape as tape_mod
from jaxembed.collection.checks import check_out_grads, check_states
from jaxembed.kernels.collection import collection_update
from jaxembed.kernels.update import after
from jaxembed.nn.linen_collection import find_params, replace_params
from jaxembed.optim.dynamic import reset_table_rows
from jaxembed.optim.dynamic_collection import DEFAULT_INITIALIZER, dynamic_tables, table_rows_at
from jaxembed.training.common import Grads, argnums_tuple

__all__ = [
    "Grads",
    "dense_mask",
    "init_sparse",
    "sparse_update",
    "value_and_grad",
]


def _discover(fn: Callable[..., Any], params: Any, *args, **kwargs) -> tape_mod.Tape:
    discover = tape_mod.Tape("discover")

    def traced(p):
        with tape_mod.recording(discover):
            return fn(p, *args, **kwargs)

    jax.eval_shape(traced, params)
    return discover


def value_and_grad(
    fn: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    allow_int: bool = False,
    reduce_axes: Sequence[Any] = (),
) -> Callable[..., Any]:
    """`jax.value_and_grad(fn, ...)` for Linen params holding jaxembed tables trained row-sparse.

    Takes `jax.value_and_grad`'s arguments (but `holomorphic`), which mean what they mean
    there; the lookups' output gradients are taken beside, whatever `argnums` selects.

    Args:
      fn: `fn(*args, **kwargs) -> loss` (or `(loss, aux)`), applying the model, e.g.
        `fn(params, batch)` or `fn(variables, batch)`.
      argnums: the positional arguments `Grads.dense` is the gradient of: an int (the
        gradient of that argument) or a sequence of ints (a tuple of gradients).
      has_aux: `fn` returns `(loss, aux)`.
      allow_int: integer arguments selected by `argnums` get `float0` gradients (as jax's).
      reduce_axes: as jax's (only `()`: jax has retired it).

    Returns:
      `(*args, **kwargs) -> (value, Grads)`: `value` the loss (or `(loss, aux)`);
      `Grads.dense` has the selected arguments' structure (zeros at the tables), the rest is
      for `sparse_update`.

    Raises:
      TypeError: `argnums` not ints or beyond the call's positional arguments, or an integer
        argument without `allow_int` (jax's error).

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> import jaxembed, jaxembed.flax
      >>> model = jaxembed.flax.Embed(10, 4)
      >>> ids = jnp.array([1, 2, 2])
      >>> variables = model.init(jax.random.key(0), ids)
      >>> def loss(scale, variables, ids):
      ...     return scale * model.apply(variables, ids).sum()
      >>> value, grads = jaxembed.flax.value_and_grad(loss, argnums=0)(2.0, variables, ids)
      >>> bool(jnp.allclose(grads.dense, value / 2.0)), grads.out_grads[0].shape
      (True, (3, 4))
    """

    def wrapped(*args, **kwargs):
        nums = argnums_tuple(argnums, len(args), what="jaxembed.flax.value_and_grad")
        discover = tape_mod.Tape("discover")

        def traced(*selected):
            full = list(args)
            for n, a in zip(nums, selected, strict=True):
                full[n] = a
            with tape_mod.recording(discover):
                return fn(*full, **kwargs)

        jax.eval_shape(traced, *(args[n] for n in nums))
        taps = [jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), s) for s in discover.shapes]
        tape = tape_mod.Tape("tap")

        def loss_with_taps(taps, *args):
            tape.taps, tape.records, tape.operands = taps, [], []
            with tape_mod.recording(tape):
                out = fn(*args, **kwargs)
            loss, aux = out if has_aux else (out, None)
            return loss, (aux, tape.operands)

        (loss, (aux, operands)), (out_grads, *dense) = jax.value_and_grad(
            loss_with_taps, argnums=(0, *(n + 1 for n in nums)), has_aux=True,
            allow_int=allow_int, reduce_axes=reduce_axes,
        )(taps, *args)  # fmt: skip
        out_grads = after(out_grads, loss)  # the tables' update waits for the loss (see nnx)
        dense = dense[0] if isinstance(argnums, int) else tuple(dense)
        grads = Grads(dense, list(operands), list(out_grads), tuple(tape.records))
        return ((loss, aux) if has_aux else loss), grads

    return wrapped


_MODULES = {
    "embed": "jaxembed.flax.Embed",
    "dynamic": "jaxembed.flax.DynamicEmbed",
    "collection": "jaxembed.flax.EmbeddingBagCollection",
}
_ONE_TABLE = ("embed", "dynamic")  # modules whose one table is the parameter `embedding`


def _names(record: tape_mod.Record) -> list[str]:
    """The parameters of a lookup's module that are its tables."""
    if record.kind in _ONE_TABLE:
        return ["embedding"]
    return [s.name for s in record.static["layout"].stacks]


def _keys(record: tape_mod.Record, params: Any, what: str) -> tuple[str, ...]:
    """The keys of a lookup's module in `params` (the variables or the params tree)."""
    return find_params(params, record.key, _names(record), what=what, module=_MODULES[record.kind])


def _unbox(x: Any) -> Any:
    return x.value if isinstance(x, nn.Partitioned) else x


def _tables(record: tape_mod.Record, params: Any, what: str) -> dict[Any, jax.Array]:
    """The table arrays a lookup reads, by their name in its module's params."""
    node = params
    for key in _keys(record, params, what):
        node = node[key]
    if record.kind in _ONE_TABLE:
        return {"embedding": _unbox(node["embedding"])}
    layout = record.static["layout"]
    return {s.index: _unbox(node[s.name]) for s in layout.stacks}


def init_sparse(optimizer: Any, fn: Callable[..., Any], params: Any, *args, **kwargs) -> dict:
    """The row-sparse optimizer state of every table `fn` looks up, by module path.

    Args:
      optimizer: a `jaxembed.optim.RowSparseOptimizer`.
      fn: the loss, `fn(params, *args, **kwargs)`; it is traced, not run.
      params: the model's variables (`{"params": ...}`, what `model.init` returns) or its
        params tree: whichever `fn` takes.
      args, kwargs: a sample of `fn`'s other arguments.

    Returns:
      `{module path: state}` (for a collection: `{stack index: state}`).

    Raises:
      ValueError: a lookup's module has no parameters in `params` (the error names the path
        looked for, in both forms, and what is there).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxembed, jaxembed.flax
      >>> model = jaxembed.flax.Embed(10, 4)
      >>> ids = jnp.array([1, 2])
      >>> variables = model.init(jax.random.key(0), ids)
      >>> loss = lambda v, ids: model.apply(v, ids).sum()
      >>> opt = jaxembed.optim.rowwise_adagrad(0.1)
      >>> list(jaxembed.flax.init_sparse(opt, loss, variables, ids))  # the top module: ''
      ['']
    """
    what = "init_sparse"
    states = {}
    for record in _discover(fn, params, *args, **kwargs).records:
        tables = _tables(record, params, what)
        if record.kind in _ONE_TABLE:
            states[record.key] = optimizer.init(
                tables["embedding"], mesh=record.static["mesh"],
                weight_spec=record.static["weight_spec"],
            )  # fmt: skip
        else:
            layout = record.static["layout"]
            states[record.key] = {
                s.index: optimizer.init(
                    tables[s.index], mesh=record.static["mesh"], weight_spec=s.spec
                )
                for s in layout.stacks
            }
    return states


def dense_mask(fn: Callable[..., Any], params: Any, *args, **kwargs) -> Any:
    """A pytree like `params`: False at the jaxembed tables `fn` looks up, True elsewhere
    (for `optax.masked`).

    Args:
      fn, params, args, kwargs: as `init_sparse`'s (`params` the variables or the params).

    Returns:
      The mask, of `params`' form (under `"params"` for the variables).

    Raises:
      ValueError: as `init_sparse`.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import flax.linen as nn
      >>> import jaxembed, jaxembed.flax
      >>> class Model(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, ids):
      ...         return nn.Dense(1)(jaxembed.flax.Embed(10, 4)(ids)).sum()
      >>> model, ids = Model(), jnp.array([1, 2])
      >>> variables = model.init(jax.random.key(0), ids)
      >>> jaxembed.flax.dense_mask(model.apply, variables, ids)
      {'params': {'Dense_0': {'bias': True, 'kernel': True}, 'Embed_0': {'embedding': False}}}
    """
    tables = set()
    for record in _discover(fn, params, *args, **kwargs).records:
        keys = _keys(record, params, "dense_mask")
        tables.update((*keys, name) for name in _names(record))

    def mark(path, _):
        return tuple(str(getattr(p, "key", p)) for p in path) not in tables

    return jax.tree_util.tree_map_with_path(
        mark, params, is_leaf=lambda x: isinstance(x, nn.Partitioned)
    )


def _reset_dynamic_stacks(layout, optimizer, tables, states, resets, t, key, mesh):
    """The dynamic stacks' and their states' reset rows afresh, as the step's remap set them:
    table i's rows drew from `fold_in(key, i)` (`jaxembed.optim.dynamic_collection`)."""
    tables, states = dict(tables), dict(states)
    key = jax.random.wrap_key_data(key)
    for index, t_cfg in dynamic_tables(layout):
        stack = layout.stack_of(t_cfg.name)
        if t_cfg.name not in resets:
            continue
        tables[stack.index], states[stack.index] = reset_table_rows(
            t_cfg.dynamic, tables[stack.index], optimizer, states[stack.index],
            resets[t_cfg.name], t, initializer=t_cfg.initializer or DEFAULT_INITIALIZER,
            key=jax.random.fold_in(key, index), mesh=mesh, weight_spec=stack.spec,
            rows_at=table_rows_at(layout, t_cfg.name),
        )  # fmt: skip
    return tables, states


def sparse_update(optimizer: Any, states: dict, params: Any, grads: Grads) -> tuple[Any, dict]:
    """Updates the rows each lookup of the step read; returns the new params and states.

    A `DynamicEmbed`'s rows given out in the step are reset first, in the table (as the
    step's forward reset them) and in the optimizer state.

    Args:
      optimizer: the `jaxembed.optim.RowSparseOptimizer` of `init_sparse`.
      states: from `init_sparse` (or the last step).
      params: the variables or the params (boxed or not) the loss was applied with.
      grads: what `value_and_grad` returned.

    Returns:
      `(params, states)`, updated; `params` of the form given (variables or params).

    Raises:
      ValueError: `states` has no state for a lookup's module (states of another loss or
        model); a lookup's module has no parameters in `params` (the path looked for and
        what is there are named); a collection's states or gradients do not fit it
        (`jaxembed.collection.checks`).

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> import jaxembed, jaxembed.flax
      >>> model, ids = jaxembed.flax.Embed(10, 4), jnp.array([1, 2, 2])
      >>> variables = model.init(jax.random.key(0), ids)
      >>> loss = lambda v, ids: model.apply(v, ids).sum()
      >>> opt = jaxembed.optim.sgd(0.5)
      >>> states = jaxembed.flax.init_sparse(opt, loss, variables, ids)
      >>> _, grads = jaxembed.flax.value_and_grad(loss)(variables, ids)
      >>> new, states = jaxembed.flax.sparse_update(opt, states, variables, grads)
      >>> old, w = variables["params"]["embedding"], new["params"]["embedding"]
      >>> np.asarray(old - w)[:3, 0].tolist()  # row 2 was read twice: 2 x 0.5 x 1
      [0.0, 0.5, 1.0]
    """
    what = "sparse_update"
    states = dict(states)
    for record, operands, out_grad in zip(
        grads.records, grads.operands, grads.out_grads, strict=True
    ):
        if record.key not in states:
            raise ValueError(
                f"sparse_update: no optimizer state for the {record.kind} lookup at "
                f"{record.key or '(the top module)'!r} (the states are of {sorted(states)}): "
                "pass init_sparse(optimizer, loss_fn, params, batch)'s states for this loss"
            )
        keys = _keys(record, params, what)
        tables = _tables(record, params, what)
        if record.kind == "embed":
            table, states[record.key] = optimizer.update(
                tables["embedding"], states[record.key], *operands, out_grad, **record.static
            )
            params = replace_params(params, keys, {"embedding": table})
            continue
        if record.kind == "dynamic":  # the step's reset rows afresh (apply kept no write)
            static = dict(record.static)
            dyn = static.pop("dynamic")
            rows, reset, t, key = operands
            table, state = reset_table_rows(
                dyn["config"], tables["embedding"], optimizer, states[record.key], reset, t,
                initializer=dyn["initializer"], key=jax.random.wrap_key_data(key),
                mesh=static["mesh"], weight_spec=static["weight_spec"],
            )  # fmt: skip
            table, states[record.key] = optimizer.update(table, state, rows, out_grad, **static)
            params = replace_params(params, keys, {"embedding": table})
            continue
        static = record.static
        layout = static["layout"]
        check_states(layout, optimizer, states[record.key], what="sparse_update")
        state = states[record.key]
        if static.get("dynamic"):  # the step's reset rows afresh (apply kept no write)
            operands, resets, t, key = operands
            tables, state = _reset_dynamic_stacks(
                layout, optimizer, tables, state, resets, t, key, static["mesh"]
            )
        check_out_grads(layout, operands, out_grad, what="sparse_update")
        new, states[record.key] = collection_update(
            layout, optimizer, tables, state, operands, out_grad,
            mesh=static["mesh"], x_spec=static["x_spec"], exchange=static["exchange"],
        )  # fmt: skip
        params = replace_params(params, keys, {s.name: new[s.index] for s in layout.stacks})
    return params, states
