"""`jaxembed.flax.EmbeddingBagCollection`: a collection of embedding tables as a Linen module.

The Linen twin of `jaxembed.nnx.EmbeddingBagCollection` (see `jaxembed.nn.nnx_collection`): the
same tables, features, placements and stacks; its parameters are the stacks, each boxed in an
`nn.Partitioned` that carries its layout (so `nn.get_sharding` gives the shardings to
initialize it with), named as the stacks (`stack0_dim64_rows_dataxmodel`, ...).

A Linen module holds no state, so what `jaxembed.nnx.EmbeddingBagCollection` does to itself
(`tables()`, `load_tables`, `init_optimizer`, `export_optimizer`, `import_optimizer`) the Linen
collection does to the variables it is given, and returns new ones (`export_tables` is
`tables()`: `tables` is the attribute holding the configs). Call the methods on the
collection's definition with the model's variables and the collection's module path
(`model.embeddings.export_tables(variables, path="embeddings")`, a collection given to the
model as an attribute), or bound, on a collection of its own
(`coll.apply(variables, method="export_tables")`). `embed_tables` reads `nn.Embed` / `nnx.Embed`
weights (a checkpoint of the model being ported) as the tables `load_tables` takes.

The variables may be what `model.init` returns (`{"params": ...}`) or its `["params"]`, boxed
(`nn.Partitioned`) or not: `find_params` locates a module's parameters in either, and its error
names the path it looked for and what it found there.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import FrozenDict
from flax.linen.linear import default_embed_init
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxembed import tape
from jaxembed.collection.checks import check_exported_optimizer, check_tables
from jaxembed.collection.config import FeatureConfig, TableConfig
from jaxembed.collection.layout import CollectionLayout, layout_collection
from jaxembed.dynamic.config import StepStats
from jaxembed.kernels.arrays import place_table
from jaxembed.kernels.collection import collection_lookup
from jaxembed.kernels.tables import is_quantized
from jaxembed.nn.common import current_mesh, replicated_on
from jaxembed.nn.stacks import (
    auto_plan,
    build_stack,
    check_trainable,
    concat_features,
    export_states,
    import_states,
    planned,
    quantize_stacks,
    unstack,
)
from jaxembed.optim import dynamic_collection

__all__ = ["EmbeddingBagCollection", "embed_tables", "find_params", "replace_params"]


def _auto_plan(tables, features, mesh, placements, planner):
    """`auto_plan`, cached: a Linen module's properties are recomputed on every access."""
    if not (isinstance(placements, str) and placements == "auto"):
        return auto_plan(tables, features, mesh, placements, None if planner is None else
                         dict(planner))  # fmt: skip
    try:
        hash((tables, features, mesh, planner))
    except TypeError:  # e.g. id_stats: planned again on each use
        return auto_plan(tables, features, mesh, placements, dict(planner or ()))
    return _cached_plan(tables, features, mesh, planner)


@functools.lru_cache(maxsize=32)
def _cached_plan(tables, features, mesh, planner):
    return auto_plan(tables, features, mesh, "auto", None if planner is None else dict(planner))


def _keys_text(node: Any) -> str:
    return str(sorted(map(str, node))) if isinstance(node, Mapping) else type(node).__name__


def _walk(tree: Any, keys: Sequence[str]) -> tuple[Any, int]:
    """The node at `keys` in `tree` and how many keys were found (all of them: it is there)."""
    node = tree
    for i, key in enumerate(keys):
        if not isinstance(node, Mapping) or key not in node:
            return node, i
        node = node[key]
    return node, len(keys)


def find_params(
    tree: Any, path: str, names: Sequence[str], *, what: str, module: str = "module"
) -> tuple[str, ...]:
    """The keys that lead to the parameters of the Linen module at `path` in `tree`.

    `tree` is a model's variables (`{"params": ...}`, what `model.init` returns) or its params
    tree; the module's parameters must include every one of `names`.

    Args:
      tree: the variables or the params (boxed or not, dict or `FrozenDict`).
      path: the module's path, its names joined by "/" (`""`: the top module).
      names: the parameters the module must have there.
      what: who asks, the start of an error (e.g. `"init_sparse"`).
      module: what the module is, for the error (e.g. `"jaxembed.flax.Embed"`).

    Returns:
      The keys of the module's node: `("params", *path)` in variables, `(*path,)` in params.

    Raises:
      ValueError: the module is in neither form, or its parameters lack some of `names`: the
        error names the path looked for and what the tree holds where the path ends.

    Examples:
      >>> variables = {"params": {"Embed_0": {"embedding": np.zeros((4, 2))}}}
      >>> find_params(variables, "Embed_0", ["embedding"], what="demo")
      ('params', 'Embed_0')
      >>> find_params(variables["params"], "Embed_0", ["embedding"], what="demo")
      ('Embed_0',)
      >>> find_params(variables, "Embed_1", ["embedding"], what="demo")
      Traceback (most recent call last):
      ValueError: demo: no parameters of the module at 'Embed_1': looked for ...
    """
    if not isinstance(tree, Mapping):
        raise ValueError(
            f"{what}: expected the model's variables ({{'params': ...}}, as model.init returns "
            f"them) or their ['params'] tree, a dict, got {type(tree).__name__}"
        )
    parts = tuple(path.split("/")) if path else ()
    tries = [parts]
    if "params" in tree and parts[:1] != ("params",):
        tries.append(("params", *parts))
    for keys in tries:
        node, found = _walk(tree, keys)
        if found == len(keys) and isinstance(node, Mapping) and all(n in node for n in names):
            return keys
    shown = path or "(the top module)"
    for keys in reversed(tries):  # the module's node, in the form the tree has it
        node, found = _walk(tree, keys)
        if found == len(keys) and isinstance(node, Mapping):
            where = "/".join(keys) or "the root"
            raise ValueError(
                f"{what}: the {module} at {shown!r} has parameters {_keys_text(node)} (at "
                f"{where}), but it needs {list(names)}: the variables are of another model, or "
                "of this module built with other tables, placements or mesh (build and apply "
                "it under the same jax.set_mesh as model.init)"
            )
    looked = " and ".join("tree" + "".join(f"[{k!r}]" for k in keys) for keys in tries)
    node, found = _walk(tree, tries[-1])
    stop = "/".join(tries[-1][:found]) or "the root"
    raise ValueError(
        f"{what}: no parameters of the {module} at {shown!r}: looked for {looked}; at {stop} "
        f"the tree has keys {_keys_text(node)}. Pass what model.init returned (the variables, "
        "{'params': ...}) or its ['params'], for the same model the function applies"
    )


def replace_params(
    tree: Any, keys: Sequence[str], values: Mapping[str, Any], *, boxed: bool = True
) -> Any:
    """`tree` with the parameters `values` (by name) of the node at `keys` replaced: boxes
    (`nn.Partitioned`) keep their names (`boxed=False`: the values replace them, unboxed),
    a `FrozenDict` stays one; nothing else is copied."""

    def rebuild(node, rest):
        out = dict(node)
        if rest:
            out[rest[0]] = rebuild(node[rest[0]], rest[1:])
        else:
            for name, value in values.items():
                old = out[name]
                keep = boxed and isinstance(old, nn.Partitioned)
                out[name] = old.replace_boxed(value) if keep else value
        return FrozenDict(out) if isinstance(node, FrozenDict) else out

    return rebuild(tree, tuple(keys))


def _unbox(x: Any) -> Any:
    return x.value if isinstance(x, nn.Partitioned) else x


def _leaf(x: Any) -> Any:
    """The array in a Linen box or an `nnx.Variable`, or `x` as is."""
    if isinstance(x, nn.Partitioned):
        return x.value
    if callable(getattr(x, "get_value", None)):  # nnx.Variable (`.value` is deprecated)
        return x.get_value()
    return x


def embed_tables(tree: Any, names: Mapping[str, str]) -> dict[str, Any]:
    """The tables of `nn.Embed` / `nnx.Embed` modules of a checkpoint, for `load_tables`.

    A model being ported keeps each table as an embedding module's `embedding` parameter
    (`{"Embed_0": {"embedding": W}}`); this reads them out by table name. A plain
    `{table: array}` dict needs no conversion: pass it to `load_tables` as it is.

    Args:
      tree: the checkpoint: Linen variables (`{"params": ...}`) or params, boxed or not, or
        an NNX state (`nnx.state(model)`, or `nnx.to_pure_dict` of it).
      names: `{table: module path}`, e.g. `{"item": "Embed_0", "user": "towers/Embed_1"}`:
        the jaxembed table each embedding module's weights go to.

    Returns:
      `{table: [vocab_size, dim]}`, as the checkpoint holds them (numpy or jax arrays).

    Raises:
      ValueError: a module path not in the tree, or a module without an `embedding`: the
        path looked for and what the tree holds there are named.

    Examples:
      >>> ckpt = {"params": {"Embed_0": {"embedding": np.ones((10, 4))}}}
      >>> {k: v.shape for k, v in embed_tables(ckpt, {"item": "Embed_0"}).items()}
      {'item': (10, 4)}
    """
    out = {}
    for table, path in names.items():
        keys = find_params(
            tree, path, ["embedding"], what=f"embed_tables: table {table!r}", module="Embed"
        )
        out[table] = _leaf(_walk(tree, keys)[0]["embedding"])
    return out


class EmbeddingBagCollection(nn.Module):
    """Embedding tables and the sparse features that read them, placed over a mesh (Linen).

    Attributes:
      tables, features, mesh, placements, planner, x_sharding, exchange: as
        `jaxembed.nnx.EmbeddingBagCollection`'s arguments (`placements="auto"` plans once
        per module definition: `plan` is the result).
      deterministic: with dynamic tables (`TableConfig.dynamic`), read-only lookups. Their
        remap states, step, reset key and stats are the `"dynamic"` collection; a training
        call needs `apply(..., mutable=["dynamic"])`, and `jaxembed.flax.sparse_update`
        resets the step's rows of the stacks and optimizer states (docs/dynamic.md).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxembed, jaxembed.flax
      >>> tables = [jaxembed.TableConfig("item", 100, 8, placement="rows")]
      >>> features = [jaxembed.FeatureConfig("clicked", "item", combiner="mean")]
      >>> coll = jaxembed.flax.EmbeddingBagCollection(tables, features)
      >>> batch = {"clicked": jnp.array([[1, 2, -1]] * 8)}
      >>> with jax.set_mesh(jax.make_mesh((8,), ("data",))):
      ...     variables = coll.init(jax.random.key(0), batch)
      ...     out = coll.apply(variables, batch)
      >>> out["clicked"].shape, list(variables["params"])
      ((8, 8), ['stack0_dim8_rows_data'])
    """

    tables: Sequence[TableConfig]
    features: Sequence[FeatureConfig]
    mesh: Any = None
    placements: Any = None
    planner: Any = None
    x_sharding: Any = None
    exchange: str = "auto"
    deterministic: bool = False

    @property
    def plan(self) -> Any:
        """The `CollectionPlan` this module runs (None without one)."""
        placements = self._placements
        return placements if hasattr(placements, "table_configs") else None

    @property
    def _placements(self) -> Any:
        planner = None if self.planner is None else tuple(sorted(dict(self.planner).items()))
        return _auto_plan(tuple(self.tables), tuple(self.features), current_mesh(self.mesh),
                          self.placements, planner)  # fmt: skip

    @property
    def layout(self) -> CollectionLayout:
        placements = self._placements
        tables, _ = planned(self.tables, placements, self.exchange)
        return layout_collection(
            tables,
            self.features,
            current_mesh(self.mesh),
            getattr(placements, "placements", placements),
        )

    @property
    def _exchange(self) -> Any:
        return planned(self.tables, self._placements, self.exchange)[1]

    def _stack_params(self) -> dict[int, jax.Array]:
        layout = self.layout
        out = {}
        for s in layout.stacks:
            if self.has_variable("params", s.name):
                box = self.get_variable("params", s.name)
            else:
                box = self.param(s.name, self._init_stack(layout, s.index))
            out[s.index] = box.value if isinstance(box, nn.Partitioned) else box
        return out

    def _init_stack(self, layout: CollectionLayout, index: int):
        stack = layout.stacks[index]
        tables, _ = planned(self.tables, self._placements, self.exchange)
        configs = {t.name: t for t in tables}
        order = {t.name: i for i, t in enumerate(tables)}

        def init(key):
            values = {}
            for name in stack.tables:
                t = configs[name]
                init_fn = t.initializer or default_embed_init
                if t.dynamic is not None:  # every row is initialised when an id is admitted
                    values[name] = jnp.zeros((t.vocab_size, t.dim), t.dtype)
                    continue
                values[name] = init_fn(
                    jax.random.fold_in(key, order[name]), (t.vocab_size, t.dim), t.dtype
                )
            mesh = current_mesh(self.mesh)
            # Born in its layout (eager `model.init` under `jax.set_mesh` or with `mesh=`, or
            # under `jit`), not replicated until the first step splits it.
            array = place_table(build_stack(layout, stack, values), mesh, stack.spec)
            if mesh is None:
                return array
            return nn.Partitioned(array, names=tuple(stack.spec), mesh=None)

        return init

    @nn.compact
    def __call__(self, batch: Mapping[str, Any]) -> dict[str, jax.Array]:
        """Every feature's output (see `jaxembed.nnx.EmbeddingBagCollection.__call__`).

        With dynamic tables, a training call (`deterministic` False, the default) remaps
        their features and needs `apply(..., mutable=["dynamic"])`; `init` admits nothing.
        """
        stacks = self._stack_params()
        layout = self.layout
        dynamic = dynamic_collection.dynamic_tables(layout)
        remap_info = None
        if dynamic:
            batch, stacks, remap_info = self._remap(layout, dynamic, stacks, batch)
        if tape.active() is not None:
            stacks = jax.lax.stop_gradient(stacks)
        x_spec = None if self.x_sharding is None else P(*self.x_sharding)
        out = collection_lookup(
            self.layout, stacks, batch, mesh=current_mesh(self.mesh), x_spec=x_spec,
            exchange=self._exchange,
        )  # fmt: skip
        static = {"layout": self.layout, "mesh": current_mesh(self.mesh), "x_spec": x_spec,
                  "exchange": self._exchange}  # fmt: skip
        ours = {f.name: batch[f.name] for f in self.layout.features}
        if remap_info is not None:  # what sparse_update needs to reset as this step did
            resets, t, key = remap_info
            return tape.tap(self, "/".join(self.path), "collection", out,
                            (ours, resets, t, key), {**static, "dynamic": True})  # fmt: skip
        return tape.tap(self, "/".join(self.path), "collection", out, ours, static)

    def _remap(self, layout, dynamic, stacks, batch):
        """The dynamic features' rows, the stacks as the step's resets left them (a copy:
        `apply` keeps no write to `params`), and `(resets, t, key data)` in training."""
        mesh = current_mesh(self.mesh)
        here = replicated_on(mesh)
        zero = jnp.zeros((), jnp.int32)
        remaps = {t.name: self.variable("dynamic", f"remap_{t.name}",
                                        lambda t=t: dynamic_collection.init_states(
                                            layout, mesh=mesh)[t.name])
                  for _, t in dynamic}  # fmt: skip
        stats = {t.name: self.variable("dynamic", f"stats_{t.name}",
                                       lambda: StepStats(*(here(zero),) * 6))
                 for _, t in dynamic}  # fmt: skip
        step = self.variable("dynamic", "step", lambda: here(zero))
        reset_key = self.variable(
            "dynamic", "reset_key", lambda: here(jax.random.key_data(self.make_rng("params")))
        )
        values = {name: v.value for name, v in remaps.items()}
        if self.deterministic or self.is_initializing():
            rows = dynamic_collection.read_rows(layout, values, batch, mesh=mesh,
                                                check_ids=False)  # fmt: skip
            return rows, stacks, None
        if not self.is_mutable_collection("dynamic"):
            raise ValueError(
                "jaxembed.flax.EmbeddingBagCollection: a training call remaps the dynamic "
                "tables' ids (admission, eviction) and so writes the 'dynamic' collection: "
                "apply the model with mutable=['dynamic'] (and keep the returned updates), or "
                "build it with deterministic=True for read-only lookups"
            )
        t = step.value
        batch, stacks, values, new_stats, resets = dynamic_collection.remap_collection(
            layout, stacks, values, batch, t, key=jax.random.wrap_key_data(reset_key.value),
            mesh=mesh, check_ids=False,
        )  # fmt: skip
        for name, v in remaps.items():
            v.value = values[name]
        for name, v in stats.items():
            v.value = new_stats[name]
        step.value = t + 1
        return batch, stacks, (resets, t, reset_key.value)

    def concat(self, outputs: Mapping[str, jax.Array]) -> jax.Array:
        """The pooled features' outputs side by side, `[B, Σ dim]`, in feature order."""
        return concat_features(self.layout, outputs)

    def _own(self, variables: Any, path: str, what: str) -> tuple[Any, tuple[str, ...]]:
        """The tree the methods read (the bound module's variables when none is given) and
        the keys of this collection's parameters in it."""
        if variables is None:
            if self.scope is None:
                raise ValueError(
                    f"EmbeddingBagCollection.{what}: pass the variables (what model.init "
                    f"returned, or its ['params']) and the collection's path, e.g. "
                    f"coll.{what}(..., variables, path='EmbeddingBagCollection_0'), or call it "
                    f"bound: coll.apply(variables, method='{what}')"
                )
            variables = {"params": self.variables.get("params", {})}
        names = [s.name for s in self.layout.stacks]
        keys = find_params(
            variables, path, names, what=f"EmbeddingBagCollection.{what}",
            module="jaxembed.flax.EmbeddingBagCollection",
        )  # fmt: skip
        return variables, keys

    def _stacks_of(self, variables: Any, keys: Sequence[str]) -> dict[int, jax.Array]:
        node = _walk(variables, keys)[0]
        return {s.index: _unbox(node[s.name]) for s in self.layout.stacks}

    def export_tables(self, variables: Any = None, *, path: str = "") -> dict[str, jax.Array]:
        """Each table in id order, `[vocab_size, dim]`, read out of the variables' stacks.

        `jaxembed.nnx.EmbeddingBagCollection.tables()`'s twin (here `tables` is the
        attribute holding the `TableConfig`s). Call it under the mesh the variables were made
        with (the layout depends on it).

        Args:
          variables: the model's variables (`{"params": ...}`) or params; omitted when bound
            (`coll.apply(variables, method="export_tables")`).
          path: the collection's module path in them ("/"-joined; `""`: the collection is
            the model).

        Returns:
          `{table: [vocab_size, dim]}` (a gather: for export and checks).

        Raises:
          ValueError: no parameters of this collection at `path` (the path and what is
            there are named), or stacks of another layout.

        Examples:
          >>> import jax, jax.numpy as jnp
          >>> import jaxembed, jaxembed.flax
          >>> coll = jaxembed.flax.EmbeddingBagCollection(
          ...     [jaxembed.TableConfig("item", 10, 4)], [jaxembed.FeatureConfig("f", "item")])
          >>> variables = coll.init(jax.random.key(0), {"f": jnp.zeros((2, 3), jnp.int32)})
          >>> coll.export_tables(variables)["item"].shape
          (10, 4)
          >>> bool((coll.apply(variables, method="export_tables")["item"]
          ...       == coll.export_tables(variables["params"])["item"]).all())
          True
        """
        variables, keys = self._own(variables, path, "export_tables")
        return unstack(self.layout, self._stacks_of(variables, keys))

    def load_tables(
        self, values: Mapping[str, Any], variables: Any = None, *, path: str = ""
    ) -> Any:
        """The variables with every table set from `{name: [vocab_size, dim]}` in id order.

        As `jaxembed.nnx.EmbeddingBagCollection.load_tables`, but returning new variables (of
        the form given: variables or params, boxes kept, each stack in its old sharding):
        every table is checked before any is built.

        Args:
          values: every table of the collection, `[vocab_size, dim]` in id order, of a float
            dtype (`export_tables`' form; `embed_tables` reads an `nn.Embed` checkpoint as it).
          variables: the model's variables or params; omitted when bound
            (`coll.apply(variables, values, method="load_tables")`).
          path: the collection's module path in them.

        Returns:
          The variables (params), with this collection's stacks replaced.

        Raises:
          ValueError: a table missing or not in the collection (both named, beside the
            collection's); a table of another shape (never broadcast) or of an integer or bool
            dtype; no parameters of this collection at `path`.

        Examples:
          >>> import jax, jax.numpy as jnp, numpy as np
          >>> import jaxembed, jaxembed.flax
          >>> coll = jaxembed.flax.EmbeddingBagCollection(
          ...     [jaxembed.TableConfig("item", 10, 4)], [jaxembed.FeatureConfig("f", "item")])
          >>> variables = coll.init(jax.random.key(0), {"f": jnp.zeros((2, 3), jnp.int32)})
          >>> new = coll.load_tables({"item": np.ones((10, 4))}, variables)
          >>> float(coll.export_tables(new)["item"].sum())
          40.0
          >>> coll.load_tables({"item": np.ones((1, 4))}, variables)
          Traceback (most recent call last):
          ValueError: load_tables: table 'item' has shape [1, 4], but ...
        """
        variables, keys = self._own(variables, path, "load_tables")
        check_tables(self.layout, values)
        host = {k: np.asarray(v) for k, v in values.items()}
        old = self._stacks_of(variables, keys)
        new = {}
        for s in self.layout.stacks:
            array = build_stack(self.layout, s, host)
            if isinstance(getattr(old[s.index], "sharding", None), NamedSharding):
                array = jax.device_put(array, old[s.index].sharding)
            new[s.name] = jnp.asarray(array)
        return replace_params(variables, keys, new)

    def quantized(
        self, precision: Any, variables: Any = None, *, path: str = "", **options: Any
    ) -> Any:
        """The variables with this collection's tables quantized row-wise, for serving.

        As `jaxembed.nnx.EmbeddingBagCollection.quantized`, for Linen: the returned variables
        hold a `jaxembed.QuantizedTable` in place of each quantized stack (unboxed), and
        `coll.apply(served, batch)` looks up as before, reading `q · scale + bias`; training
        them is an error (train the float variables, then quantize).

        Args:
          precision: `"int8"`, `"int4"`, `"int2"` or `"fp8"`, or `{table: precision}` (tables
            left out stay float); the tables of one stack share a precision.
          variables: the model's variables or params; omitted when bound.
          path: the collection's module path in them.
          **options: `jaxembed.quantize`'s keywords.

        Returns:
          The variables (params), with this collection's stacks replaced.

        Raises:
          ValueError: as `jaxembed.nn.stacks.quantize_stacks`: a dim the precision cannot pack
            (the tables named) and, called eagerly, a row holding NaN or ±inf (named by its
            table, its row in that table and the value; under `jit` it reads NaN).

        Examples:
          >>> import jax, jax.numpy as jnp
          >>> import jaxembed, jaxembed.flax
          >>> coll = jaxembed.flax.EmbeddingBagCollection(
          ...     [jaxembed.TableConfig("item", 10, 4)], [jaxembed.FeatureConfig("f", "item")])
          >>> batch = {"f": jnp.array([[1, 2], [3, -1]])}
          >>> variables = coll.init(jax.random.key(0), batch)
          >>> served = coll.quantized("int8", variables)
          >>> bool(jnp.abs(coll.apply(served, batch)["f"] - coll.apply(variables, batch)["f"])
          ...      .max() < 1e-2)
          True
        """
        variables, keys = self._own(variables, path, "quantized")
        layout = self.layout
        new = quantize_stacks(layout, self._stacks_of(variables, keys), precision, **options)
        values = {s.name: new[s.index] for s in layout.stacks if is_quantized(new[s.index])}
        return replace_params(variables, keys, values, boxed=False)

    def init_optimizer(
        self, optimizer: Any, variables: Any = None, *, path: str = ""
    ) -> dict[int, Any]:
        """The row-sparse optimizer's state of every stack, laid out like it
        (`jaxembed.flax.init_sparse`'s entry for this collection).

        Args:
          optimizer: a `jaxembed.optim.RowSparseOptimizer`.
          variables, path: the model's variables (or params) and the collection's path in
            them; `variables` omitted when bound.

        Returns:
          `{stack index: RowSparseState}`.

        Raises:
          TypeError: variables whose tables are quantized (`quantized`'s), named: they are
            inference-only.
        """
        variables, keys = self._own(variables, path, "init_optimizer")
        stacks = self._stacks_of(variables, keys)
        check_trainable(
            self.layout, stacks,
            "Make the optimizer state from the float variables, train them, then quantize "
            "them for serving: served = coll.quantized(precision, variables)",
        )  # fmt: skip
        mesh = current_mesh(self.mesh)
        return {
            s.index: optimizer.init(stacks[s.index], mesh=mesh, weight_spec=s.spec)
            for s in self.layout.stacks
        }

    def export_optimizer(self, states: Mapping[int, Any]) -> dict[str, Any]:
        """The optimizer states per table in id order, `{table: {"count", "slots": {...}}}`,
        to checkpoint and `import_optimizer` onto any mesh or placement.

        Args:
          states: `{stack index: state}`: `init_optimizer`'s, or `init_sparse(...)[path]`
            (and the `sparse_update`s after it).
        """
        return export_states(self.layout, states)

    def import_optimizer(
        self, optimizer: Any, exported: Mapping[str, Any], variables: Any = None, *,
        path: str = "",
    ) -> dict[int, Any]:  # fmt: skip
        """States for this collection's layout from `export_optimizer`'s per-table form
        (checked, as `jaxembed.nnx.EmbeddingBagCollection.import_optimizer`, before any state
        is made).

        Args:
          optimizer: the `jaxembed.optim.RowSparseOptimizer` that exported the states.
          exported: `{table: {"count": int32[], "slots": {slot: [vocab_size] or
            [vocab_size, dim]}}}` for every table.
          variables, path: the variables the states are for (their stacks give the states'
            layout) and the collection's path in them; `variables` omitted when bound.

        Returns:
          `{stack index: RowSparseState}`: put it at the collection's path of `init_sparse`'s
          states.

        Raises:
          ValueError: a table missing or not in the collection; another optimizer's export;
            a slot of another shape or of an integer dtype; tables that share a stack here
            but were exported with different update counts (`jaxembed.collection.checks`).

        Examples:
          >>> import jax, jax.numpy as jnp
          >>> import jaxembed, jaxembed.flax
          >>> coll = jaxembed.flax.EmbeddingBagCollection(
          ...     [jaxembed.TableConfig("item", 10, 4)], [jaxembed.FeatureConfig("f", "item")])
          >>> variables = coll.init(jax.random.key(0), {"f": jnp.zeros((2, 3), jnp.int32)})
          >>> opt = jaxembed.optim.rowwise_adagrad(0.1)
          >>> exported = coll.export_optimizer(coll.init_optimizer(opt, variables))
          >>> sorted(exported["item"]["slots"])
          ['accumulator']
          >>> states = coll.import_optimizer(opt, exported, variables)
          >>> coll.import_optimizer(jaxembed.optim.adam(0.1), exported, variables)
          Traceback (most recent call last):
          ValueError: import_optimizer: the state of table 'item' has slots ['accumulator'], ...
        """
        check_exported_optimizer(self.layout, optimizer, exported)
        fresh = self.init_optimizer(optimizer, variables, path=path)
        return import_states(self.layout, optimizer, exported, fresh)
