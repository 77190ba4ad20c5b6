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
from jaxembed.collection.config import FeatureConfig, TableConfig
from jaxembed.collection.layout import CollectionLayout, Stack, layout_collection
from jaxembed.collection.lookup import collection_lookup, collection_update
from jaxembed.kernels.arrays import is_explicit
from jaxembed.nnx import Table

__all__ = ["EmbeddingBagCollection", "build_stack", "concat_features", "unstack"]


def build_stack(
    layout: CollectionLayout, stack: Stack, values: Mapping[str, jax.Array], *, per_row=False
):
    """The physical stack holding `values[name]` (each `[V, dim]` in id order, or `[V]` with
    `per_row`, a one-per-row optimizer state) in its rows."""
    shape = stack.shape[:1] if per_row else stack.shape
    dtype = jnp.float32 if per_row else stack.dtype
    concrete = not any(isinstance(values[n], jax.core.Tracer) for n in stack.tables)
    # Concrete values are stacked on the host (numpy, one buffer), not by an op per table on
    # arrays that a mesh context may replicate on every device.
    out = np.zeros(shape, dtype) if concrete else jnp.zeros(shape, dtype)
    for name in stack.tables:
        p = layout.placement(name)
        rows = p.stack_ids(np.arange(p.vocab_size, dtype=np.int32), stack.local_rows)
        if concrete:
            out[rows] = np.asarray(values[name], dtype)
        else:
            out = out.at[rows].set(jnp.asarray(values[name], dtype))
    return out


def place(array: Any, mesh: Any, spec: P) -> Any:
    """A host-built stack put straight into its layout on the mesh (a traced one as is)."""
    if not isinstance(array, np.ndarray):
        return array
    if isinstance(mesh, jax.sharding.AbstractMesh):
        concrete = jax.sharding.get_mesh()
        mesh = concrete if getattr(concrete, "axis_names", None) == mesh.axis_names else None
    if not isinstance(mesh, jax.sharding.Mesh) or mesh.empty:
        return jnp.asarray(array)
    return jax.device_put(array, NamedSharding(mesh, spec))


def unstack(layout: CollectionLayout, stacks: Mapping[int, jax.Array]) -> dict[str, jax.Array]:
    """Each table in id order, `[V, dim]` (or `[V]` for one-per-row state), read out of the
    stacks (a gather: for export)."""
    out = {}
    for s in layout.stacks:
        if s.index not in stacks:
            continue
        for name in s.tables:
            p = layout.placement(name)
            rows = p.stack_ids(np.arange(p.vocab_size, dtype=np.int32), s.local_rows)
            array = stacks[s.index]
            if isinstance(array, np.ndarray):
                out[name] = array[rows]
                continue
            sharding = jax.typeof(array).sharding
            if is_explicit(getattr(sharding, "mesh", None)):
                spec = P(None, s.spec[1]) if array.ndim == 2 else P(None)
                value = array.at[rows].get(out_sharding=NamedSharding(sharding.mesh, spec))
            else:
                value = jnp.take(array, rows, axis=0)
            if not isinstance(value, jax.core.Tracer):
                # One eager gather at a time: many collective programs in flight at once
                # can starve XLA:CPU's rendezvous (it aborts after 40 s).
                value = jax.block_until_ready(value)
            out[name] = value
    return out


def concat_features(layout: CollectionLayout, outputs: Mapping[str, jax.Array]) -> jax.Array:
    """The pooled features' outputs side by side, `[B, Σ dim]`, in feature order."""
    pooled = [outputs[f.name] for f in layout.features if f.pooled]
    return jnp.concatenate(pooled, axis=-1)


def auto_plan(tables, features, mesh, placements: Any, planner: Mapping[str, Any] | None):
    """`placements="auto"`: the `jaxembed.plan_collection` result for `planner`'s budget
    (`batch_size`, `memory_per_device`, and optionally `optimizer`, `id_stats`, `backend`);
    any other `placements` as given."""
    if not (isinstance(placements, str) and placements == "auto"):
        if planner:
            raise ValueError(
                f"planner={dict(planner)!r} is for placements='auto' (plan now), but placements "
                f"is {placements!r}: drop planner, or pass placements='auto'"
            )
        return placements
    planner = dict(planner or {})
    missing = [k for k in ("batch_size", "memory_per_device") if k not in planner]
    if missing:
        raise ValueError(
            "placements='auto' plans the collection when it is built and needs the step's "
            f"batch and each device's memory: pass planner={{'batch_size': ..., "
            f"'memory_per_device': '2GiB'}} (missing {missing}), or "
            "placements=jaxembed.plan_collection(...)"
        )
    if mesh is None:  # one device: everything is replicated, nothing to choose
        return None
    from jaxembed.plan.collection import plan_collection

    return plan_collection(tuple(tables), tuple(features), mesh, **planner)


def planned(tables: Sequence[TableConfig], placements: Any, exchange: Any):
    """The tables and exchange a `jaxembed.plan_collection` result chose (else as given)."""
    configs = getattr(placements, "table_configs", None)
    if configs is None:
        return tuple(tables), exchange
    return tuple(configs), placements.exchanges if exchange == "auto" else exchange


def _mesh(mesh: Any) -> Any:
    if mesh is not None:
        return mesh
    ctx = jax.sharding.get_abstract_mesh()
    return None if ctx.empty else ctx


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
      x_sharding: the dense inputs' layout where it cannot be read (under `jit` in an Auto
        mesh), e.g. `P("data")`.
      exchange: the lookups' exchange (`"auto"`, `"rows"`, `"routed"`, ...).
      rngs: the rngs; each table draws from `rngs.params()` in table order.

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
        mesh = _mesh(mesh)
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
            values[t.name] = init(rngs.params(), (t.vocab_size, t.dim), t.dtype)
        stacks = {}
        for s in self.layout.stacks:
            array = place(build_stack(self.layout, s, values), mesh, s.spec)
            if mesh is not None and isinstance(mesh, jax.sharding.Mesh) and not is_explicit(mesh):
                array = jax.device_put(array, NamedSharding(mesh, s.spec))
            stacks[s.name] = Table(array, out_sharding=tuple(s.spec) if mesh is not None else None)
        self.stacks = nnx.Dict(stacks)

    def _stacks(self) -> dict[int, jax.Array]:
        return {s.index: self.stacks[s.name][...] for s in self.layout.stacks}

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, jax.Array]:
        """Every feature's output.

        Args:
          batch: `{feature: ids [B] | ids [B, L] | (ids, weights) | jaxembed.Ragged}`;
            negative ids are empty slots, ids outside a table's vocabulary read nothing.

        Returns:
          `{feature: [B, dim]}` for pooled features (`[*lead·B, dim]` for a `Ragged`), and
          `[B, L, dim]` for unpooled ones, in feature order. Read them by name, or with
          `concat`: a dict that passes through a JAX transformation (`value_and_grad`,
          `jit`'s outputs) comes back with its keys sorted, as every pytree dict.
        """
        recording = tape.active() is not None
        stacks = self._stacks()
        if recording:
            stacks = jax.lax.stop_gradient(stacks)
        out = collection_lookup(
            self.layout, stacks, batch, mesh=self.mesh, x_spec=self.x_sharding,
            exchange=self.exchange,
        )  # fmt: skip
        ours = {f.name: batch[f.name] for f in self.layout.features}
        return tape.tap(self, "collection", "collection", out, ours, {})

    def concat(self, outputs: Mapping[str, jax.Array]) -> jax.Array:
        """The pooled features' outputs side by side, `[B, Σ dim]`, in feature order."""
        return concat_features(self.layout, outputs)

    def tables(self) -> dict[str, jax.Array]:
        """Each table in id order, `[vocab_size, dim]` (a gather: for export and checks)."""
        return unstack(self.layout, self._stacks())

    def load_tables(self, values: Mapping[str, jax.Array]) -> None:
        """Sets every table from `{name: [vocab_size, dim]}` in id order (any layout)."""
        values = {k: np.asarray(v) for k, v in values.items()}
        for s in self.layout.stacks:
            array = build_stack(self.layout, s, values)
            old = self.stacks[s.name][...]
            if isinstance(getattr(old, "sharding", None), NamedSharding):
                array = jax.device_put(array, old.sharding)
            array = jnp.asarray(array)
            self.stacks[s.name][...] = array

    def init_optimizer(self, optimizer: Any) -> dict[int, Any]:
        """The row-sparse optimizer's state of every stack (`jaxembed.optim`)."""
        return {
            s.index: optimizer.init(self.stacks[s.name][...], mesh=self.mesh, weight_spec=s.spec)
            for s in self.layout.stacks
        }

    def export_optimizer(self, states: Mapping[int, Any]) -> dict[str, Any]:
        """The optimizer states per table in id order, `{table: {"count", "slots": {...}}}`,
        to checkpoint and `import_optimizer` onto any mesh or placement."""
        out: dict[str, Any] = {}
        for s in self.layout.stacks:
            state = states[s.index]
            for name, slot in state.slots.items():
                for table, value in unstack(self.layout, {s.index: slot}).items():
                    entry = out.setdefault(table, {"count": state.count, "slots": {}})
                    entry["slots"][name] = value
        return out

    def import_optimizer(self, optimizer: Any, exported: Mapping[str, Any]) -> dict[int, Any]:
        """States for this collection's layout from `export_optimizer`'s per-table form."""
        states = self.init_optimizer(optimizer)
        out = {}
        for s in self.layout.stacks:
            state = states[s.index]
            slots = {}
            for slot in optimizer.formula.slots:
                values = {t: np.asarray(exported[t]["slots"][slot.name]) for t in s.tables}
                array = build_stack(self.layout, s, values, per_row=slot.per_row)
                old = state.slots[slot.name]
                if isinstance(getattr(old, "sharding", None), NamedSharding):
                    array = jax.device_put(array, old.sharding)
                slots[slot.name] = jnp.asarray(array)
            count = np.asarray(exported[s.tables[0]]["count"], np.int32)
            if isinstance(getattr(state.count, "sharding", None), NamedSharding):
                count = jax.device_put(count, state.count.sharding)
            out[s.index] = state._replace(slots=slots, count=jnp.asarray(count))
        return out

    def apply_gradients(
        self,
        optimizer: Any,
        states: Mapping[int, Any],
        batch: Mapping[str, Any],
        out_grads: Mapping[str, jax.Array],
    ) -> dict[int, Any]:
        """Updates the tables in place from the outputs' gradients; returns the new states.

        Args:
          optimizer: a `jaxembed.optim.RowSparseOptimizer`.
          states: from `init_optimizer` (or the last call).
          batch: the batch the outputs were looked up for.
          out_grads: d loss / d output, per feature.
        """
        stacks, states = collection_update(
            self.layout, optimizer, self._stacks(), states, batch, out_grads, mesh=self.mesh,
            x_spec=self.x_sharding, exchange=self.exchange,
        )  # fmt: skip
        for s in self.layout.stacks:
            self.stacks[s.name][...] = stacks[s.index]
        return states
