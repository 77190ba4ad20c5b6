"""`jaxembed.nnx.DynamicEmbed`: a dynamic table (raw 64-bit ids, admission, eviction) in NNX.

    cfg = DynamicTableConfig(capacity=2**20, bucket_size=16, admit_after=2, policy="lru")
    embed = jaxembed.nnx.DynamicEmbed(cfg, 64, rngs=nnx.Rngs(0),
                                      embedding_metadata={"out_sharding": ("model", None)})
    out = embed(keys)          # training: one step of the table (count, admit, evict, reset)
    embed.eval()               # evaluation and serving: read-only, nothing admitted or counted
    out = embed(keys)

The module holds the table (`embedding`, a `jaxembed.nnx.Table` of `capacity` rows, laid out
as its metadata says) and, as `RemapState` variables (not parameters), the remap's state, its
step counter, the key its reset rows are drawn from and the last step's `StepStats`. A call in
training mode is one step of `jaxembed.optim.dynamic.remap_table`: the ids' rows are found or
given out, the rows given out are re-initialised from `embedding_init` in the same step, then
the rows are looked up as any table's (`jaxembed.embedding`). An id without a row reads zeros
and gets no gradient. Under `jaxembed.nnx.value_and_grad` the call records its rows and its
reset rows: `jaxembed.nnx.SparseOptimizer.update` resets those rows' optimizer state
(`reset_optimizer_rows`) before the row-sparse update, so that a row handed to a new id starts
with a fresh table row and a fresh optimizer state, as `jaxembed.optim.dynamic.prepare` does.

Train it with `jaxembed.nnx.value_and_grad` and `SparseOptimizer`; an optax optimizer over the
table would keep an evicted id's moments for the id that takes its row.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.linear import default_embed_init
from flax.nnx.variablelib import VariableMetadata

from jaxembed import tape
from jaxembed.dynamic.config import DynamicTableConfig, StepStats
from jaxembed.dynamic.keys import as_keys
from jaxembed.nn.common import (
    RowInitializer,
    check_mesh_names,
    current_mesh,
    dynamic_rows_lookup,
    replicated_on,
)
from jaxembed.nn.nnx_embed import Table, metadata_mesh, metadata_spec
from jaxembed.optim.dynamic import (
    IMPLS,
    DynamicTable,
    init_table,
    remap_table,
    reset_optimizer_rows,
    rows_for,
)

__all__ = ["DynamicEmbed", "RemapState"]


class RemapState(nnx.Variable):
    """A dynamic table's remap state, step, reset key or stats: checkpointed with the model,
    but no parameter (no optimizer or gradient filter treats it as trainable)."""


class DynamicEmbed(nnx.Module):
    """A table of `config.capacity` rows for raw 64-bit ids, trained as they come and go.

    Args:
      config: the table's `jaxembed.dynamic.DynamicTableConfig` (capacity, buckets,
        admission, eviction policy).
      features: H, the size of each embedding.
      param_dtype: the table's dtype (float32 or bfloat16).
      embedding_init: each (re)assigned row's initializer, called with shape `(1, H)` (Flax's
        `Embed` default; `nnx.with_partitioning(init, ("model", None))` gives the layout).
      impl: the remap's engine, `"auto"` (native where built), `"xla"` or `"native"`.
      exchange: the lookup's gradient exchange (see `jaxembed.embedding`).
      deterministic: evaluation mode (`model.eval()` sets it): read-only lookups.
      rngs: the rngs; the key the reset rows are drawn from is `rngs.params()`.
      embedding_metadata: metadata of the table, e.g. `{"out_sharding": ("model", None)}`
        (rows split over `"model"`; block row sharding, `capacity` divisible by the split).

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from flax import nnx
      >>> import jaxembed.nnx
      >>> from jaxembed.dynamic import DynamicTableConfig, as_keys
      >>> embed = jaxembed.nnx.DynamicEmbed(DynamicTableConfig(capacity=16, bucket_size=4,
      ...     admit_after=2), 4, rngs=nnx.Rngs(0))
      >>> keys = as_keys(np.array([2**62 + 5, 2**62 + 5, 17], np.int64))
      >>> out = nnx.jit(lambda m, k: m(k))(embed, keys)   # 2**62 + 5 seen twice: admitted
      >>> int(embed.stats.get_value().admitted), int(embed.stats.get_value().pending)
      (1, 1)
      >>> bool((out[0] == out[1]).all() and (out[0] != 0).any()), out[2].tolist()
      (True, [0.0, 0.0, 0.0, 0.0])
    """

    def __init__(
        self,
        config: DynamicTableConfig,
        features: int,
        *,
        param_dtype: Any = jnp.float32,
        embedding_init: Any = default_embed_init,
        impl: str = "auto",
        exchange: str = "auto",
        deterministic: bool = False,
        rngs: nnx.Rngs,
        embedding_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        if not isinstance(config, DynamicTableConfig):
            raise TypeError(
                f"config must be a jaxembed.dynamic.DynamicTableConfig, got "
                f"{type(config).__name__}: e.g. DynamicTableConfig(capacity=2**20, "
                "bucket_size=16)"
            )
        if impl not in IMPLS:
            raise ValueError(f"impl={impl!r} must be one of {IMPLS}")
        if not callable(embedding_init):
            raise TypeError(
                f"embedding_init must be an initializer (key, shape, dtype) -> array, got "
                f"{type(embedding_init).__name__}: e.g. nnx.initializers.normal(0.01)"
            )
        probe = embedding_init(jax.random.key(0), (1, 1), param_dtype)  # its metadata only
        metadata = dict(embedding_metadata)
        if isinstance(probe, VariableMetadata):
            metadata = {**metadata, **probe.metadata}  # the initializer's wins, as in Flax
        mesh, spec = current_mesh(metadata_mesh(metadata)), metadata_spec(metadata)
        check_mesh_names(spec, mesh, "the table's sharding")
        on_mesh = mesh is not None and spec is not None
        dyn = init_table(
            config, features, dtype=param_dtype, mesh=mesh if on_mesh else None,
            weight_spec=spec if on_mesh else None,
        )  # fmt: skip
        self.embedding = Table(dyn.table, **metadata)
        self.remap = RemapState(dyn.state)
        here = replicated_on(mesh if on_mesh else None)
        self.step = RemapState(here(jnp.zeros((), jnp.int32)))
        self.reset_key = RemapState(here(jax.random.key_data(rngs.params())))
        zero = here(jnp.zeros((), jnp.int32))
        self.stats = RemapState(StepStats(*(zero,) * len(StepStats._fields)))
        self.config = config
        self.features = features
        self.initializer = RowInitializer(embedding_init)
        self.impl = impl
        self.exchange = exchange
        self.deterministic = deterministic

    def table_layout(self) -> tuple[Any, Any]:
        """The mesh to run on and the table's `PartitionSpec` (as `jaxembed.nnx.Embed`'s)."""
        metadata = self.embedding.get_metadata()
        mesh, spec = current_mesh(metadata_mesh(metadata)), metadata_spec(metadata)
        check_mesh_names(spec, mesh, "the table's sharding")
        return mesh, spec

    def __call__(
        self, ids: Any, *, deterministic: bool | None = None, inputs_sharding: Any = None
    ) -> jax.Array:
        """Embeds raw ids along a new last axis; in training mode, one step of the table.

        Args:
          ids: raw ids in a form `jaxembed.dynamic.as_keys` takes: keys `uint32[*B, 2]`
            under `jit` without x64 (`as_keys(int64_ids)` outside the jitted step), or int64
            with x64. The reserved id `EMPTY_ID` (-1) is padding: it reads zeros.
          deterministic: read-only (evaluation) if True; default the module's attribute.
          inputs_sharding: the ids' layout where it cannot be seen (see `jaxembed.nnx.Embed`).

        Returns:
          `[*B, features]`: each id's row, zeros for an id without one.

        Raises:
          TypeError: ids in no accepted form: floats; int32 in any shape, which is what
            `jit` narrows numpy int64 ids to with x64 off (the message says so).
        """
        ids = as_keys(ids, "jaxembed.nnx.DynamicEmbed's ids", check=False)  # before any step
        mesh, spec = self.table_layout()
        cfg = self.config
        reset = None
        if self.deterministic if deterministic is None else deterministic:
            rows = rows_for(
                cfg, self.remap.get_value(), ids, impl=self.impl, mesh=mesh, weight_spec=spec,
                check_ids=False,
            )  # fmt: skip
            table = self.embedding[...]
        else:
            dyn = DynamicTable(self.embedding[...], self.remap.get_value())
            key = jax.random.wrap_key_data(self.reset_key.get_value())
            rows, dyn, reset, stats = remap_table(
                cfg, dyn, ids, self.step.get_value(), initializer=self.initializer, key=key,
                impl=self.impl, mesh=mesh, weight_spec=spec, check_ids=False,
            )  # fmt: skip
            self.embedding[...] = table = dyn.table
            self.remap.set_value(dyn.state)
            self.step.set_value(self.step.get_value() + 1)
            self.stats.set_value(stats)
        out, static = dynamic_rows_lookup(
            rows, table, cfg.capacity, mesh, spec, self.exchange, inputs_sharding,
            recording=tape.active() is not None, function="jaxembed.nnx.DynamicEmbed",
        )  # fmt: skip
        if reset is None:  # evaluation: nothing to train
            return out
        return tape.tap(self, "dynamic", "dynamic", out, (rows, reset), static)

    def reset_optimizer(self, optimizer: Any, opt_state: Any, reset_rows: jax.Array) -> Any:
        """`opt_state` with the rows a training call reset back at their initial values."""
        mesh, spec = self.table_layout()
        return reset_optimizer_rows(
            self.config, self.embedding[...], optimizer, opt_state, reset_rows, mesh=mesh,
            weight_spec=spec,
        )  # fmt: skip
