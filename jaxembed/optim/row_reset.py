"""Re-initialise rows of a table and of its row-sparse optimizer state, in their layouts.

When a dynamic table hands a row to a new id (`jaxembed.optim.dynamic`), the row must start
afresh before anything reads it: its values from the table's initializer, its optimizer state
from the optimizer's initial values. These are the pieces, each a few lines, that work on one
device's block of rows inside a `shard_map` (or on the whole array on one device):

* `initial_rows`: the fresh values of the rows being reset, `f[M, H]`, drawn per row from
  `fold_in(fold_in(key, step), row)`: the same bits whatever the layout or the batch;
* `row_leaves`: which leaves of an optimizer state are per row, and their initial one-row
  values, read generically from `RowSparseOptimizer.init` of a one-row table (the leaves
  whose leading dim is 1 there; `count` and the other scalars are not per row);
* `reset_rows`: a block `[V/n, ...]` with the global rows it holds set to given values
  (block row sharding; the columns sliced to the block's own where they are split).

`check_key` and `check_initializer` raise, naming what they got, for a key that is no PRNG key
and an initializer that does not give one row of the table's shape.

Examples:
  >>> import jax, jax.numpy as jnp
  >>> rows = jnp.array([2, 0, 4])                    # 4: past the end (padding), dropped
  >>> reset_rows(jnp.zeros((4, 2)), None, rows, jnp.ones((3, 2))).tolist()
  [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]
  >>> init = jax.nn.initializers.constant(0.5)
  >>> initial_rows(init, jax.random.key(0), 3, rows, 2, jnp.float32).shape
  (3, 2)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxembed.optim.sparse import RowSparseOptimizer

__all__ = [
    "RowLeaves",
    "axes_of",
    "check_initializer",
    "check_key",
    "initial_rows",
    "reset_rows",
    "row_leaves",
]


def axes_of(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one `PartitionSpec` entry: `None` -> `()`, `"a"` -> `("a",)`."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


# --- checks ----------------------------------------------------------------------------------


def check_key(key: Any) -> None:
    """Raises TypeError unless `key` is one PRNG key: typed (`jax.random.key`) or raw
    (`jax.random.PRNGKey`, `uint32[2]`)."""
    dtype = getattr(key, "dtype", None)
    shape = tuple(getattr(key, "shape", ()))
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key) and shape == ():
        return
    if dtype is not None and np.dtype(dtype) == np.uint32 and len(shape) == 1:
        return  # a raw key, jax.random.PRNGKey(...)
    got = f"{np.dtype(dtype).name if dtype is not None else type(key).__name__}{list(shape)}"
    raise TypeError(
        f"key must be one PRNG key, e.g. key=jax.random.key(0) (or jax.random.PRNGKey(0)), "
        f"got {got}: the rows a step resets are drawn from fold_in(fold_in(key, step), row)"
    )


def check_initializer(initializer: Any, key: Any, hidden: int, dtype: Any) -> None:
    """Raises unless `initializer(key, (1, hidden), dtype)` gives floats `[1, hidden]`.

    Raises:
      TypeError: not a function, or not callable as `(key, shape, dtype)`.
      ValueError: it returns another shape, or no floats.
    """
    if not callable(initializer):
        raise TypeError(
            f"initializer must be a function (key, shape, dtype) -> array, as jax.nn."
            f"initializers makes, got {type(initializer).__name__} {initializer!r:.60}: e.g. "
            "initializer=jax.nn.initializers.normal(0.01)"
        )
    try:
        out = jax.eval_shape(lambda k: initializer(k, (1, hidden), dtype), key)
    except TypeError as e:
        raise TypeError(
            f"initializer must be called as initializer(key, shape, dtype), as jax.nn."
            f"initializers' are; calling it with shape (1, {hidden}) failed: {e}"
        ) from e
    got = (tuple(getattr(out, "shape", ())), np.dtype(getattr(out, "dtype", np.float32)))
    if got[0] != (1, hidden) or not jnp.issubdtype(got[1], jnp.floating):
        raise ValueError(
            f"initializer(key, (1, {hidden}), {np.dtype(dtype).name}) returned "
            f"{got[1].name}{list(got[0])}, not {np.dtype(dtype).name}[1, {hidden}]: it must "
            "return floats of the shape it is given (one row of the table), e.g. "
            "jax.nn.initializers.normal(0.01)"
        )


# --- fresh values ----------------------------------------------------------------------------


def initial_rows(
    initializer: Any, key: Any, step: Any, rows: jax.Array, hidden: int, dtype: Any
) -> jax.Array:
    """`f[M, H]`: the fresh value of each row in `rows` (int32[M]) reset at `step`.

    Row r's is `initializer(fold_in(fold_in(key, step), r), (1, H), dtype)[0]`: it depends on
    the key, the step and the row only (entries past the table, padding, are computed too;
    `reset_rows` drops them).
    """
    base = jax.random.fold_in(key, step)
    one = lambda r: initializer(jax.random.fold_in(base, r), (1, hidden), dtype)[0]
    return jax.vmap(one)(rows).astype(dtype)


class RowLeaves(NamedTuple):
    """An optimizer state split into its per-row leaves and the rest.

    Attributes:
      leaves: every leaf of the state, in `jax.tree.flatten` order.
      treedef: the state's structure (None: no state).
      per_row: for each leaf, whether it is one entry per table row (`[V, ...]`).
      fresh: each per-row leaf's initial value for one row, `[1, ...]`.
    """

    leaves: list[Any]
    treedef: Any
    per_row: tuple[bool, ...]
    fresh: tuple[jax.Array, ...]

    @property
    def rows(self) -> tuple[jax.Array, ...]:
        """The per-row leaves, in order."""
        return tuple(a for a, r in zip(self.leaves, self.per_row, strict=True) if r)

    def rebuild(self, new_rows: tuple[jax.Array, ...]) -> Any:
        """The state with its per-row leaves replaced by `new_rows` (None without a state)."""
        if self.treedef is None:
            return None
        it = iter(new_rows)
        leaves = [next(it) if r else a for a, r in zip(self.leaves, self.per_row, strict=True)]
        return jax.tree.unflatten(self.treedef, leaves)


def row_leaves(
    optimizer: RowSparseOptimizer | None, opt_state: Any, num_rows: int, hidden: int, dtype: Any
) -> RowLeaves:
    """The per-row leaves of `opt_state` and their initial values, from `optimizer.init`.

    `optimizer.init` of a one-row table `[1, H]` has the state's structure; its leaves with
    leading dim 1 are the per-row ones (`[V, H]` and `[V]` slots), and their values are a
    fresh row's. The other leaves (the step count) are kept as they are.

    Raises:
      TypeError: an optimizer that is not a `RowSparseOptimizer`.
      ValueError: a state without an optimizer, of another optimizer's structure, or with a
        leaf of another table's shape (naming its path, its shape and the one needed).
    """
    if optimizer is None:
        if opt_state is not None:
            raise ValueError(
                "prepare: got an opt_state but optimizer=None: pass the optimizer that made it "
                "(optimizer=opt), so that the rows it resets get their initial state"
            )
        return RowLeaves([], None, (), ())
    if not isinstance(optimizer, RowSparseOptimizer):
        raise TypeError(
            f"optimizer must be a jaxembed.optim.RowSparseOptimizer (e.g. "
            f"jaxembed.optim.adagrad(0.1)), got {type(optimizer).__name__}: a dynamic table is "
            "trained by the row-sparse update of its rows"
        )
    fresh = optimizer.init(jnp.zeros((1, hidden), dtype), weight_spec=P())
    leaves, treedef = jax.tree.flatten(opt_state)
    fresh_leaves, fresh_def = jax.tree.flatten(fresh)
    if treedef != fresh_def:
        raise ValueError(
            f"opt_state is not a state of optimizer {optimizer.name!r}: its structure "
            f"{treedef} differs from optimizer.init's {fresh_def}; pass "
            "opt_state=optimizer.init(dyn_table.table)"
        )
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(fresh)]
    per_row = []
    for path, leaf, f in zip(paths, leaves, fresh_leaves, strict=True):
        is_row = f.ndim >= 1 and f.shape[0] == 1
        want = (num_rows, *f.shape[1:]) if is_row else tuple(f.shape)
        if tuple(leaf.shape) != want:
            raise ValueError(
                f"opt_state{path} is {np.dtype(leaf.dtype).name}{list(leaf.shape)}, but a "
                f"table of {num_rows} rows of {hidden} needs {list(want)}: pass "
                "opt_state=optimizer.init(dyn_table.table)"
            )
        per_row.append(is_row)
    fresh_rows = tuple(f for f, r in zip(fresh_leaves, per_row, strict=True) if r)
    return RowLeaves(leaves, treedef, tuple(per_row), fresh_rows)


# --- the reset of one device's block ---------------------------------------------------------


def _local_columns(whole: jax.Array, spec: P | None, local_shape: tuple[int, ...]) -> jax.Array:
    """This device's columns of `whole [M, *rest]` under `spec`'s entries past the first."""
    if spec is None:
        return whole
    for dim, entry in enumerate(tuple(spec)[1:], start=1):
        axes = axes_of(entry)
        if axes:
            size = local_shape[dim]
            start = jax.lax.axis_index(axes) * size
            whole = jax.lax.dynamic_slice_in_dim(whole, start, size, axis=dim)
    return whole


def reset_rows(local: jax.Array, spec: P | None, rows: jax.Array, values: jax.Array) -> jax.Array:
    """`local` with the global `rows` it holds set to `values`.

    Args:
      local: one device's block `[V/n, ...]` of an array laid out as `spec` (inside a
        `shard_map`), or the whole array with `spec=None`.
      spec: the array's layout (block row sharding: shard s holds rows `[s·V/n, (s+1)·V/n)`),
        or None.
      rows: int32[M] global rows; those past the end (padding) and other shards' are dropped.
      values: `[M, ...]` whole rows (columns split by `spec` are sliced here).

    Returns:
      The block, every row not in `rows` bitwise as it was.
    """
    here = rows
    row_axes = axes_of(next(iter(spec), None)) if spec is not None else ()
    if row_axes:
        vl = local.shape[0]
        here = rows - jax.lax.axis_index(row_axes) * vl
        here = jnp.where((here >= 0) & (here < vl), here, vl)
    values = _local_columns(values, spec, local.shape).astype(local.dtype)
    return local.at[here].set(values, mode="drop")
