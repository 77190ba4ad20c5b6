"""`jaxembed.flax.EmbeddingBagCollection`: a collection of embedding tables as a Linen module.

The Linen twin of `jaxembed.nnx.EmbeddingBagCollection` (see `jaxembed.nn.nnx_collection`): the
same tables, features, placements and stacks; its parameters are the stacks, each boxed in an
`nn.Partitioned` that carries its layout (so `nn.get_sharding` gives the shardings to
initialize it with), named as the stacks (`stack0_dim64_rows_dataxmodel`, ...).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.linear import default_embed_init
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxembed import tape
from jaxembed.collection.config import FeatureConfig, TableConfig
from jaxembed.collection.layout import CollectionLayout, layout_collection
from jaxembed.kernels.arrays import is_explicit
from jaxembed.kernels.collection import collection_lookup
from jaxembed.nn.common import current_mesh
from jaxembed.nn.stacks import auto_plan, build_stack, concat_features, planned

__all__ = ["EmbeddingBagCollection"]


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


class EmbeddingBagCollection(nn.Module):
    """Embedding tables and the sparse features that read them, placed over a mesh (Linen).

    Attributes:
      tables, features, mesh, placements, planner, x_sharding, exchange: as
        `jaxembed.nnx.EmbeddingBagCollection`'s arguments (`placements="auto"` plans once
        per module definition: `plan` is the result).

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
                values[name] = init_fn(
                    jax.random.fold_in(key, order[name]), (t.vocab_size, t.dim), t.dtype
                )
            array = jnp.asarray(build_stack(layout, stack, values))
            mesh = current_mesh(self.mesh)
            if mesh is None:
                return array
            if is_explicit(mesh):  # born in its layout, as jaxembed.flax.Embed's table
                array = jax.sharding.reshard(array, NamedSharding(mesh, stack.spec))
            return nn.Partitioned(array, names=tuple(stack.spec), mesh=None)

        return init

    @nn.compact
    def __call__(self, batch: Mapping[str, Any]) -> dict[str, jax.Array]:
        """Every feature's output (see `jaxembed.nnx.EmbeddingBagCollection.__call__`)."""
        stacks = self._stack_params()
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
        return tape.tap(self, "/".join(self.path), "collection", out, ours, static)

    def concat(self, outputs: Mapping[str, jax.Array]) -> jax.Array:
        """The pooled features' outputs side by side, `[B, Σ dim]`, in feature order."""
        return concat_features(self.layout, outputs)
