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

The tables' entries of `grads.dense` are zeros (the lookups held them constant); `dense_mask`
keeps optax off them (a decoupled weight decay would otherwise shrink them). See
`jaxembed.training.nnx` for how the gradients are taken.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxembed import tape as tape_mod
from jaxembed.collection.checks import check_out_grads, check_states
from jaxembed.kernels.collection import collection_update
from jaxembed.kernels.update import after
from jaxembed.training.common import Grads

__all__ = ["Grads", "dense_mask", "init_sparse", "sparse_update", "value_and_grad"]


def _discover(fn: Callable[..., Any], params: Any, *args, **kwargs) -> tape_mod.Tape:
    discover = tape_mod.Tape("discover")

    def traced(p):
        with tape_mod.recording(discover):
            return fn(p, *args, **kwargs)

    jax.eval_shape(traced, params)
    return discover


def value_and_grad(fn: Callable[..., Any], *, has_aux: bool = False) -> Callable[..., Any]:
    """`jax.value_and_grad(fn)` for Linen params holding jaxembed tables trained row-sparse.

    Args:
      fn: `fn(params, *args, **kwargs) -> loss` (or `(loss, aux)`), applying the model.
      has_aux: as in `jax.value_and_grad`.

    Returns:
      `(params, *args, **kwargs) -> (value, Grads)`: `Grads.dense` has the params' structure
      (zeros at the tables), the rest is for `sparse_update`.
    """

    def wrapped(params, *args, **kwargs):
        discover = _discover(fn, params, *args, **kwargs)
        taps = [jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), s) for s in discover.shapes]
        tape = tape_mod.Tape("tap")

        def loss_with_taps(p, taps):
            tape.taps, tape.records, tape.operands = taps, [], []
            with tape_mod.recording(tape):
                out = fn(p, *args, **kwargs)
            loss, aux = out if has_aux else (out, None)
            return loss, (aux, tape.operands)

        (loss, (aux, operands)), (dense, out_grads) = jax.value_and_grad(
            loss_with_taps, argnums=(0, 1), has_aux=True
        )(params, taps)
        out_grads = after(out_grads, loss)  # the tables' update waits for the loss (see nnx)
        grads = Grads(dense, list(operands), list(out_grads), tuple(tape.records))
        return ((loss, aux) if has_aux else loss), grads

    return wrapped


def _node(params: Any, key: str) -> Any:
    node = params
    for part in key.split("/") if key else ():
        node = node[part]
    return node


def _unbox(x: Any) -> Any:
    return x.value if isinstance(x, nn.Partitioned) else x


def _tables(record: tape_mod.Record, params: Any) -> dict[Any, jax.Array]:
    """The table arrays a lookup reads, by their name in its module's params."""
    node = _node(params, record.key)
    if record.kind == "embed":
        return {"embedding": _unbox(node["embedding"])}
    layout = record.static["layout"]
    return {s.index: _unbox(node[s.name]) for s in layout.stacks}


def init_sparse(optimizer: Any, fn: Callable[..., Any], params: Any, *args, **kwargs) -> dict:
    """The row-sparse optimizer state of every table `fn` looks up, by module path.

    Args:
      optimizer: a `jaxembed.optim.RowSparseOptimizer`.
      fn, params, args, kwargs: the loss and a sample of its arguments (it is traced, not run).

    Returns:
      `{module path: state}` (for a collection: `{stack index: state}`).
    """
    states = {}
    for record in _discover(fn, params, *args, **kwargs).records:
        if record.kind == "embed":
            states[record.key] = optimizer.init(
                _tables(record, params)["embedding"], mesh=record.static["mesh"],
                weight_spec=record.static["weight_spec"],
            )  # fmt: skip
        else:
            layout = record.static["layout"]
            tables = _tables(record, params)
            states[record.key] = {
                s.index: optimizer.init(
                    tables[s.index], mesh=record.static["mesh"], weight_spec=s.spec
                )
                for s in layout.stacks
            }
    return states


def dense_mask(fn: Callable[..., Any], params: Any, *args, **kwargs) -> Any:
    """A pytree like `params`: False at the jaxembed tables `fn` looks up, True elsewhere
    (for `optax.masked`)."""
    keys = {}
    for record in _discover(fn, params, *args, **kwargs).records:
        layout = record.static.get("layout")
        names = ["embedding"] if record.kind == "embed" else [s.name for s in layout.stacks]
        for name in names:
            keys[f"{record.key}/{name}" if record.key else name] = True

    def mark(path, _):
        key = "/".join(getattr(p, "key", str(p)) for p in path)
        return not any(key == k or key.startswith(k + "/") for k in keys)

    return jax.tree_util.tree_map_with_path(
        mark, params, is_leaf=lambda x: isinstance(x, nn.Partitioned)
    )


def _set(params: Any, key: str, name: Any, value: jax.Array) -> Any:
    parts = key.split("/") if key else []

    def replace(node, rest):
        node = dict(node)
        if not rest:
            old = node[name]
            node[name] = old.replace_boxed(value) if isinstance(old, nn.Partitioned) else value
            return node
        node[rest[0]] = replace(node[rest[0]], rest[1:])
        return node

    return replace(params, parts)


def sparse_update(optimizer: Any, states: dict, params: Any, grads: Grads) -> tuple[Any, dict]:
    """Updates the rows each lookup of the step read; returns the new params and states.

    Args:
      optimizer: the `jaxembed.optim.RowSparseOptimizer` of `init_sparse`.
      states: from `init_sparse` (or the last step).
      params: the params (boxed or not).
      grads: what `value_and_grad` returned.

    Returns:
      `(params, states)`, updated.

    Raises:
      ValueError: `states` has no state for a lookup's module (states of another loss or
        model), or a collection's states or gradients do not fit it
        (`jaxembed.collection.checks`).
    """
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
        tables = _tables(record, params)
        if record.kind == "embed":
            table, states[record.key] = optimizer.update(
                tables["embedding"], states[record.key], *operands, out_grad, **record.static
            )
            params = _set(params, record.key, "embedding", table)
            continue
        static = record.static
        layout = static["layout"]
        check_states(layout, optimizer, states[record.key], what="sparse_update")
        check_out_grads(layout, operands, out_grad, what="sparse_update")
        new, states[record.key] = collection_update(
            layout, optimizer, tables, states[record.key], operands, out_grad,
            mesh=static["mesh"], x_spec=static["x_spec"], exchange=static["exchange"],
        )  # fmt: skip
        for s in layout.stacks:
            params = _set(params, record.key, s.name, new[s.index])
    return params, states
