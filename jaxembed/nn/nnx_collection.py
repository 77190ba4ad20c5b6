"""`jaxembed.nnx.EmbeddingBagCollection`: a collection of embedding tables as a Flax NNX module.

    tables = [jaxembed.TableConfig("item", vocab_size=1_000_000, dim=64, placement="rows"),
              jaxembed.TableConfig("user", vocab_size=200_000, dim=64, placement="table")]
    features = [jaxembed.FeatureConfig("clicked_items", table="item", combiner="mean"),
                jaxembed.FeatureConfig("user_id", table="user")]
    coll = jaxembed.nnx.EmbeddingBagCollection(tables, features, rngs=nnx.Rngs(0))
    out = coll(batch)      # {feature: [B, dim]}; batch: {feature: ids [B, L] | Ragged}
    x = coll.concat(out)   # [B, Σ dim] in feature order

The parameters are the collection's stacks (`jaxembed.collection.layout`), one `Table` (an
`nnx.Param`) each, laid out as their `out_sharding` metadata says, so `nnx.Optimizer`, optax
and orbax handle them as any parameter. `tables()` and `load_tables()` convert to and from
each table in id order (for checkpoints that restore onto another layout, or for inspection).
`quantized("int8")` (or per table) gives a serving copy whose stacks are row-wise quantized
(`QuantizedStack` variables: lookups only). The lookup and the update are
`jaxembed.kernels.collection`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn.linear import default_embed_init
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxembed import tape
from jaxembed.collection.checks import (
    check_exported_optimizer,
    check_out_grads,
    check_states,
    check_tables,
)
from jaxembed.collection.config import FeatureConfig, TableConfig
from jaxembed.collection.layout import layout_collection
from jaxembed.dynamic.config import StepStats
from jaxembed.kernels.arrays import place_table
from jaxembed.kernels.collection import collection_lookup, collection_update
from jaxembed.kernels.tables import is_quantized
from jaxembed.nn.common import current_mesh, replicated_on
from jaxembed.nn.nnx_dynamic import RemapState
from jaxembed.nn.nnx_embed import QuantizedStack, Table
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

__all__ = ["EmbeddingBagCollection"]


def _placed_mesh(mesh: Any, table: Any) -> Any:
    """Outside any `jax.set_mesh`, the concrete mesh a placed (concrete) stack lives on, where
    `mesh` is the abstract mesh of the context the collection was built under (which the
    state's placement would need); else `mesh` as is."""
    if not isinstance(mesh, jax.sharding.AbstractMesh) or isinstance(table, jax.core.Tracer):
        return mesh
    if not jax.sharding.get_abstract_mesh().empty:
        return mesh
    sharding = getattr(table, "sharding", None)
    placed = getattr(sharding, "mesh", None)
    if isinstance(placed, jax.sharding.Mesh) and placed.axis_names == mesh.axis_names:
        return placed
    return mesh


class EmbeddingBagCollection(nnx.Module):
    """Embedding tables and the sparse features that read them, placed over a mesh.

    Features pool bags of ids (`combiner` sum, mean, sqrtn, max: `[B, dim]`) or keep them
    unpooled (`combiner=None`: `[B, L, dim]`); several may read one table. Tables of one dim
    whose placements split rows the same way are stacked into one physical table, so that a
    batch is one lookup per stack (`jaxembed.collection.layout`).

    Args:
      tables: `TableConfig`s.
      features: `FeatureConfig`s.
      mesh: the mesh; default `jax.set_mesh`'s (None: one device, all replicated).
      placements: placements for tables whose config says `"auto"`: a dict
        `{table: placement}`, a `jaxembed.plan_collection` result (its placements, row
        shardings and each stack's exchange), or `"auto"` to run the planner now with
        `planner`'s budget (the plan is kept as `self.plan`); without any, `"auto"` tables
        are split by rows over the whole mesh.
      planner: with `placements="auto"`, `jaxembed.plan_collection`'s keyword arguments:
        `batch_size` and `memory_per_device` (required), `optimizer`, `id_stats`, `backend`.
      x_sharding: the inputs' layout where it cannot be read (under `jit` in an Auto mesh),
        e.g. `P("data")`. Default: the batch split over all the mesh's axes where that divides
        (data parallel, as `jax.jit(in_shardings=P(axes))` lays it out; see
        `jaxembed.kernels.collection`); inputs that carry their layout are read.
      exchange: the lookups' exchange (`"auto"`, `"rows"`, `"routed"`, ...).
      rngs: the rngs; each table draws from `rngs.params()` in table order (then, with
        dynamic tables, the key their reset rows draw from).

    **Dynamic tables** (`TableConfig(dynamic=...)`: raw 64-bit ids, admission, eviction;
    docs/dynamic.md): their features take raw ids (keys `uint32[B, L, 2]` under `jit`), their
    stacks start at zeros, and the remap's state of each (`remaps`), the step (`remap_step`),
    the reset key and the last step's `StepStats` (`remap_stats`) are `RemapState` variables.
    A call in training mode remaps their features
    (`jaxembed.optim.dynamic_collection.remap_collection`: rows given out are reset in the
    stack) and records the reset rows, which `SparseOptimizer.update` resets in the optimizer
    state before the update; in evaluation mode (`model.eval()`) it only reads.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import jaxembed, jaxembed.nnx
      >>> tables = [jaxembed.TableConfig("item", 100, 8, placement="rows"),
      ...           jaxembed.TableConfig("country", 10, 4, placement="replicated")]
      >>> features = [jaxembed.FeatureConfig("clicked", "item", combiner="mean"),
      ...             jaxembed.FeatureConfig("country", "country")]
      >>> with jax.set_mesh(jax.make_mesh((8,), ("data",))):
      ...     coll = jaxembed.nnx.EmbeddingBagCollection(tables, features, rngs=nnx.Rngs(0))
      ...     batch = {"clicked": jnp.array([[1, 2, -1]] * 8), "country": jnp.arange(8)}
      ...     out = coll(batch)
      >>> out["clicked"].shape, out["country"].shape, coll.concat(out).shape
      ((8, 8), (8, 4), (8, 12))
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        features: Sequence[FeatureConfig],
        *,
        mesh: Any = None,
        placements: Any = None,
        planner: Mapping[str, Any] | None = None,
        x_sharding: Any = None,
        exchange: str = "auto",
        rngs: nnx.Rngs,
    ):
        mesh = current_mesh(mesh)
        placements = auto_plan(tables, features, mesh, placements, planner)
        self.plan = placements if hasattr(placements, "table_configs") else None
        tables, exchange = planned(tables, placements, exchange)
        self.layout = layout_collection(tables, features, mesh, getattr(
            placements, "placements", placements))  # fmt: skip
        self.mesh = mesh
        self.x_sharding = x_sharding if x_sharding is None else P(*x_sharding)
        self.exchange = exchange
        values = {}
        for t in tables:
            init = t.initializer or default_embed_init
            key = rngs.params()
            if t.dynamic is not None:  # every row is initialised when an id is admitted to it
                values[t.name] = np.zeros((t.vocab_size, t.dim), t.dtype)
            else:
                values[t.name] = init(key, (t.vocab_size, t.dim), t.dtype)
        stacks = {}
        for s in self.layout.stacks:
            # Born in its layout, eager (under `jax.set_mesh` or with `mesh=`) or traced.
            array = place_table(build_stack(self.layout, s, values), mesh, s.spec)
            metadata = {"out_sharding": tuple(s.spec) if mesh is not None else None}
            if isinstance(mesh, jax.sharding.Mesh):  # no mesh context: Flax needs it named
                metadata["mesh"] = mesh
            stacks[s.name] = Table(array, **metadata)
        self.stacks = nnx.Dict(stacks)
        self.deterministic = False
        dynamic = dynamic_collection.dynamic_tables(self.layout)
        if dynamic:
            remaps = dynamic_collection.init_states(self.layout, mesh=mesh)
            here = replicated_on(mesh)
            zero = here(jnp.zeros((), jnp.int32))
            self.remaps = nnx.Dict({n: RemapState(v) for n, v in remaps.items()})
            self.remap_stats = nnx.Dict(
                {t.name: RemapState(StepStats(*(zero,) * 6)) for _, t in dynamic}
            )
            self.remap_step = RemapState(zero)
            self.reset_key = RemapState(here(jax.random.key_data(rngs.params())))

    def _remap(self, batch: Mapping[str, Any], read_only: bool) -> tuple[dict, dict | None]:
        """The batch with the dynamic features' ids as rows; in training, one remap step
        (the stacks, remaps, step and stats written) and its reset rows by stack."""
        remaps = {n: v.get_value() for n, v in self.remaps.items()}
        if read_only:
            return dynamic_collection.read_rows(
                self.layout, remaps, batch, mesh=self.mesh, check_ids=False
            ), None  # fmt: skip
        t = self.remap_step.get_value()
        key = jax.random.wrap_key_data(self.reset_key.get_value())
        batch, stacks, remaps, stats, resets = dynamic_collection.remap_collection(
            self.layout, self._stacks(), remaps, batch, t, key=key, mesh=self.mesh,
            check_ids=False,
        )  # fmt: skip
        for s in {self.layout.stack_of(name).index for name in resets}:
            self.stacks[self.layout.stacks[s].name][...] = stacks[s]
        for name, state in remaps.items():
            self.remaps[name].set_value(state)
        for name, value in stats.items():
            self.remap_stats[name].set_value(value)
        self.remap_step.set_value(t + 1)
        return batch, resets

    def _stacks(self) -> dict[int, jax.Array]:
        return {s.index: self.stacks[s.name].get_value() for s in self.layout.stacks}

    def __call__(
        self, batch: Mapping[str, Any], *, deterministic: bool | None = None
    ) -> dict[str, jax.Array]:
        """Every feature's output.

        Args:
          batch: `{feature: ids [B] | ids [B, L] | (ids, weights) | jaxembed.Ragged}`;
            negative ids are empty slots, ids outside a table's vocabulary read nothing. A
            dynamic table's features: raw ids (`jaxembed.dynamic.as_keys` forms), dense.
          deterministic: with dynamic tables, read-only (no admission, no counting) if True;
            default the module's attribute (`model.eval()` sets it).

        Returns:
          `{feature: [B, dim]}` for pooled features (`[*lead·B, dim]` for a `Ragged`), and
          `[B, L, dim]` for unpooled ones, in feature order. Read them by name, or with
          `concat`: a dict that passes through a JAX transformation (`value_and_grad`,
          `jit`'s outputs) comes back with its keys sorted, as every pytree dict.
        """
        resets = None
        if hasattr(self, "remaps"):
            read_only = self.deterministic if deterministic is None else deterministic
            batch, resets = self._remap(batch, bool(read_only))
        recording = tape.active() is not None
        stacks = self._stacks()
        if recording:
            stacks = jax.lax.stop_gradient(stacks)
        out = collection_lookup(
            self.layout, stacks, batch, mesh=self.mesh, x_spec=self.x_sharding,
            exchange=self.exchange,
        )  # fmt: skip
        ours = {f.name: batch[f.name] for f in self.layout.features}
        operands = ours if resets is None else (ours, resets)  # (rows, the reset rows)
        return tape.tap(self, "collection", "collection", out, operands, {})

    def quantized(self, precision: Any, **options: Any) -> EmbeddingBagCollection:
        """A serving copy of this collection, its tables quantized row-wise.

        The copy looks up as this one does (same layout, placements and exchange), reading
        each quantized row as `q · scale + bias` in float32; its stacks are `QuantizedStack`
        variables, not parameters, and training it is an error (train this collection, then
        quantize it). This collection is left as it is.

        Args:
          precision: `"int8"`, `"int4"`, `"int2"` or `"fp8"`, or `{table: precision}` (tables
            left out stay float); the tables of one stack share a precision.
          **options: `jaxembed.quantize`'s keywords (e.g. `search="greedy"` for int4/int2).

        Returns:
          A new `EmbeddingBagCollection`.

        Raises:
          ValueError: as `jaxembed.nn.stacks.quantize_stacks`: a dim the precision cannot pack
            (the tables named) and, called eagerly, a row holding NaN or ±inf (named by its
            table, its row in that table and the value). Under `nnx.jit` such a row is not
            refused: it reads NaN, so quantize eagerly.

        Examples:
          >>> import jax.numpy as jnp
          >>> from flax import nnx
          >>> import jaxembed, jaxembed.nnx
          >>> coll = jaxembed.nnx.EmbeddingBagCollection(
          ...     [jaxembed.TableConfig("item", 100, 8)], [jaxembed.FeatureConfig("f", "item")],
          ...     rngs=nnx.Rngs(0))
          >>> served = coll.quantized("int8")
          >>> batch = {"f": jnp.array([[1, 2], [3, -1]])}
          >>> bool(jnp.abs(served(batch)["f"] - coll(batch)["f"]).max() < 1e-2)
          True
        """
        quantized = quantize_stacks(self.layout, self._stacks(), precision, **options)
        new = nnx.clone(self)
        stacks = {}
        for s in self.layout.stacks:
            value = quantized[s.index]
            stacks[s.name] = QuantizedStack(value) if is_quantized(value) else new.stacks[s.name]
        new.stacks = nnx.Dict(stacks)
        return new

    def concat(self, outputs: Mapping[str, jax.Array]) -> jax.Array:
        """The pooled features' outputs side by side, `[B, Σ dim]`, in feature order."""
        return concat_features(self.layout, outputs)

    def tables(self) -> dict[str, jax.Array]:
        """Each table in id order, `[vocab_size, dim]` (a gather: for export and checks)."""
        return unstack(self.layout, self._stacks())

    def load_tables(self, values: Mapping[str, jax.Array]) -> None:
        """Sets every table from `{name: [vocab_size, dim]}` in id order (any layout).

        Every table is checked before any is written: on an error the collection is as it was.

        Args:
          values: every table of the collection, `[vocab_size, dim]` in id order (as `tables()`
            gives them, e.g. from a checkpoint of another mesh or placement), of a float dtype
            (converted to the table's).

        Raises:
          ValueError: a table missing or not in the collection (both named, beside the
            collection's tables); a table of another shape (a `[1, dim]` row, a `[dim]`
            vector or a scalar is never broadcast over the rows), or of an integer or bool
            dtype.
        """
        check_tables(self.layout, values)
        values = {k: np.asarray(v) for k, v in values.items()}
        new = {}
        for s in self.layout.stacks:
            array = build_stack(self.layout, s, values)
            old = self.stacks[s.name][...]
            if isinstance(getattr(old, "sharding", None), NamedSharding):
                array = jax.device_put(array, old.sharding)
            new[s.name] = jnp.asarray(array)
        for name, array in new.items():
            self.stacks[name][...] = array

    def init_optimizer(self, optimizer: Any) -> dict[int, Any]:
        """The row-sparse optimizer's state of every stack (`jaxembed.optim`), laid out like it.

        Outside `jax.set_mesh` (a collection built under one, its tables placed on the mesh)
        the states are placed on the tables' own mesh.

        Args:
          optimizer: a `jaxembed.optim.RowSparseOptimizer`.

        Returns:
          `{stack index: RowSparseState}`.

        Raises:
          TypeError: a serving copy's quantized tables (`quantized`), named: they are
            inference-only (`jaxembed.nnx.SparseOptimizer(model, ...)` calls this for every
            collection in the model).
        """
        check_trainable(
            self.layout, self._stacks(),
            "Build the SparseOptimizer (or init_optimizer) from the float collection, train "
            "it, then quantize it for serving: served = coll.quantized(precision)",
        )  # fmt: skip
        out = {}
        for s in self.layout.stacks:
            table = self.stacks[s.name][...]
            mesh = _placed_mesh(self.mesh, table)
            out[s.index] = optimizer.init(table, mesh=mesh, weight_spec=s.spec)
        return out

    def export_optimizer(self, states: Mapping[int, Any]) -> dict[str, Any]:
        """The optimizer states per table in id order, `{table: {"count", "slots": {...}}}`,
        to checkpoint and `import_optimizer` onto any mesh or placement."""
        return export_states(self.layout, states)

    def import_optimizer(self, optimizer: Any, exported: Mapping[str, Any]) -> dict[int, Any]:
        """States for this collection's layout from `export_optimizer`'s per-table form.

        Everything is checked before any state is made.

        Args:
          optimizer: the `jaxembed.optim.RowSparseOptimizer` that exported the states.
          exported: `{table: {"count": int32[], "slots": {slot: [vocab_size] or
            [vocab_size, dim]}}}` for every table (`export_optimizer`'s result, e.g. from a
            checkpoint of another mesh or placement).

        Returns:
          `{stack index: RowSparseState}` in this collection's layout.

        Raises:
          ValueError: a table missing or not in the collection; an entry without `"count"` or
            `"slots"`; another optimizer's export (its slot names differ from this
            optimizer's: both are named); a slot of another shape (a per-element slot for a
            per-row one, a broadcastable `[1, dim]`...) or of an integer dtype; tables that
            share a stack here but were exported with different update counts.
        """
        check_exported_optimizer(self.layout, optimizer, exported)
        return import_states(self.layout, optimizer, exported, self.init_optimizer(optimizer))

    def apply_gradients(
        self,
        optimizer: Any,
        states: Mapping[int, Any],
        batch: Mapping[str, Any],
        out_grads: Mapping[str, jax.Array],
        *,
        resets: Mapping[str, jax.Array] | None = None,
    ) -> dict[int, Any]:
        """Updates the tables in place from the outputs' gradients; returns the new states.

        With `resets` (a training call's reset rows of its dynamic tables, by table name),
        those rows' optimizer state is reset first.

        Args:
          optimizer: a `jaxembed.optim.RowSparseOptimizer`.
          states: from `init_optimizer` (or the last call).
          batch: the batch the outputs were looked up for.
          out_grads: d loss / d output of every feature, each of its output's shape.

        Returns:
          The new states, by stack index.

        Raises:
          ValueError: a feature's gradient missing from `out_grads`, or one that is not a
            feature; a gradient of another shape than its output (the feature, its table, the
            expected and given shapes) or of an integer dtype; states missing a stack or made
            for another optimizer or layout.
        """
        check_states(self.layout, optimizer, states, what="apply_gradients")
        check_out_grads(self.layout, batch, out_grads)
        if resets:
            states = dynamic_collection.reset_states(
                self.layout, self._stacks(), optimizer, states, resets, mesh=self.mesh
            )
        stacks, states = collection_update(
            self.layout, optimizer, self._stacks(), states, batch, out_grads, mesh=self.mesh,
            x_spec=self.x_sharding, exchange=self.exchange,
        )  # fmt: skip
        for s in self.layout.stacks:
            self.stacks[s.name][...] = stacks[s.index]
        return states
