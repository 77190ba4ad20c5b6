"""`jaxembed.flax.DynamicEmbed`: a dynamic table (raw 64-bit ids, admission, eviction) in Linen.

    cfg = DynamicTableConfig(capacity=2**20, bucket_size=16, admit_after=2, policy="lru")
    model = jaxembed.flax.DynamicEmbed(cfg, 64,
                                       embedding_init=nn.with_partitioning(init, ("model", None)))
    variables = model.init(key, keys)                      # an empty table, nothing admitted
    out, updates = model.apply(variables, keys, mutable=["dynamic"])   # one training step
    out = model.apply(variables, keys, deterministic=True)             # read-only

The parameter `embedding` (`[capacity, H]`, zeros until ids are admitted) is the table; the
collection `"dynamic"` holds the remap's state (`remap`), the step counter (`step`), the key
reset rows are drawn from (`reset_key`, from the `params` rng at `init`) and the last step's
`StepStats` (`stats`). A training call (`mutable=["dynamic"]`) is one step of
`jaxembed.optim.dynamic.remap_table`: ids are counted, admitted, evicted, and the rows given
out are re-initialised from `embedding_init` before the lookup reads them. An id without a row
reads zeros and gets no gradient. Linen's `apply` does not write `params`, so the reset of the
stored table happens in `jaxembed.flax.sparse_update`, which resets the same rows of the table
(the same bits: a row's value depends on the key, the step and the row) and of the optimizer
state before the row-sparse update. `init` admits nothing. See `jaxembed.nn.nnx_dynamic` for
the NNX module.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.linear import default_embed_init

from jaxembed import tape
from jaxembed.dynamic.config import DynamicTableConfig, StepStats
from jaxembed.dynamic.keys import as_keys
from jaxembed.nn.common import RowInitializer, check_mesh_names, dynamic_rows_lookup
from jaxembed.nn.linen_embed import box_layout
from jaxembed.optim.dynamic import IMPLS, DynamicTable, init_table, remap_table, rows_for

__all__ = ["DynamicEmbed"]


class DynamicEmbed(nn.Module):
    """A table of `config.capacity` rows for raw 64-bit ids, trained as they come and go.

    Attributes:
      config: the table's `jaxembed.dynamic.DynamicTableConfig`.
      features: H, the size of each embedding.
      param_dtype: the table's dtype (float32 or bfloat16).
      embedding_init: each (re)assigned row's initializer, called with shape `(1, H)`;
        `nn.with_partitioning(init, ("model", None))` gives the table's layout.
      impl: the remap's engine, `"auto"`, `"xla"` or `"native"`.
      exchange: the lookup's gradient exchange (see `jaxembed.embedding`).
      deterministic: read-only lookups (evaluation) when True; may be given to `__call__`.

    Examples:
      >>> import jax, numpy as np
      >>> import jaxembed.flax
      >>> from jaxembed.dynamic import DynamicTableConfig, as_keys
      >>> model = jaxembed.flax.DynamicEmbed(DynamicTableConfig(capacity=16, bucket_size=4), 4)
      >>> keys = as_keys(np.array([2**62 + 5, 17], np.int64))
      >>> variables = model.init(jax.random.key(0), keys)            # nothing admitted
      >>> out, updates = jax.jit(lambda v, k: model.apply(v, k, mutable=["dynamic"]))(
      ...     variables, keys)
      >>> int(updates["dynamic"]["stats"].admitted), int(updates["dynamic"]["step"])
      (2, 1)
    """

    config: DynamicTableConfig
    features: int
    param_dtype: Any = jnp.float32
    embedding_init: Any = default_embed_init
    impl: str = "auto"
    exchange: str = "auto"
    deterministic: bool | None = None

    def table_layout(self) -> tuple[Any, Any]:
        """The mesh and the table's `PartitionSpec`, from `embedding_init`'s box."""
        box = jax.eval_shape(
            lambda k: self.embedding_init(k, (1, self.features), self.param_dtype),
            jax.random.key(0),
        )
        mesh, spec = box_layout(box)
        check_mesh_names(spec, mesh, "the table's sharding")
        return mesh, spec

    def _empty(self, mesh: Any, spec: Any) -> DynamicTable:
        on_mesh = mesh is not None and spec is not None
        return init_table(
            self.config, self.features, dtype=self.param_dtype,
            mesh=mesh if on_mesh else None, weight_spec=spec if on_mesh else None,
        )  # fmt: skip

    @nn.compact
    def __call__(
        self, ids: Any, deterministic: bool | None = None, *, inputs_sharding: Any = None
    ) -> jax.Array:
        """Embeds raw ids along a new last axis; in training mode, one step of the table.

        Args:
          ids: raw ids in a form `jaxembed.dynamic.as_keys` takes (keys `uint32[*B, 2]`
            under `jit` without x64). `EMPTY_ID` (-1) is padding: it reads zeros.
          deterministic: read-only (evaluation) when True; default the attribute, else
            training (which needs `apply(..., mutable=["dynamic"])`).
          inputs_sharding: the ids' layout where it cannot be seen.

        Returns:
          `[*B, features]`: each id's row, zeros for an id without one.

        Raises:
          TypeError: `config` no `DynamicTableConfig`; ids in no accepted form.
          ValueError: a training call whose `"dynamic"` collection is not mutable.
        """
        cfg = self.config
        if not isinstance(cfg, DynamicTableConfig):
            raise TypeError(
                f"config must be a jaxembed.dynamic.DynamicTableConfig, got "
                f"{type(cfg).__name__}: e.g. DynamicTableConfig(capacity=2**20, bucket_size=16)"
            )
        if self.impl not in IMPLS:
            raise ValueError(f"impl={self.impl!r} must be one of {IMPLS}")
        ids = as_keys(ids, "jaxembed.flax.DynamicEmbed's ids", check=False)  # before any step
        mesh, spec = self.table_layout()

        def table_init(key, shape, dtype):
            box = self.embedding_init(key, (1, self.features), dtype)
            table = self._empty(mesh, spec).table
            return box.replace_boxed(table) if isinstance(box, nn.Partitioned) else table

        if self.has_variable("params", "embedding"):  # applying: read it as stored (Linen's
            table = self.get_variable("params", "embedding")  # shape check would trace init)
            table = table.value if isinstance(table, nn.Partitioned) else table
        else:
            table = self.param("embedding", table_init, (cfg.capacity, self.features),
                               self.param_dtype)  # fmt: skip
        remap = self.variable("dynamic", "remap", lambda: self._empty(mesh, spec).state)
        step = self.variable("dynamic", "step", lambda: jnp.zeros((), jnp.int32))
        reset_key = self.variable(
            "dynamic", "reset_key", lambda: jax.random.key_data(self.make_rng("params"))
        )
        zero = jnp.zeros((), jnp.int32)
        stats = self.variable("dynamic", "stats", lambda: StepStats(*(zero,) * 6))
        read_only = bool(self.deterministic if deterministic is None else deterministic)
        reset = None
        if read_only or self.is_initializing():
            rows = rows_for(cfg, remap.value, ids, impl=self.impl, mesh=mesh, weight_spec=spec,
                            check_ids=False)  # fmt: skip
        else:
            if not self.is_mutable_collection("dynamic"):
                raise ValueError(
                    "jaxembed.flax.DynamicEmbed: a training call remaps the ids (admission, "
                    "eviction) and so writes the 'dynamic' collection: apply the model with "
                    "mutable=['dynamic'] (and keep the returned updates), or pass "
                    "deterministic=True for read-only lookups"
                )
            key = jax.random.wrap_key_data(reset_key.value)
            t = step.value
            rows, dyn, reset, stats.value = remap_table(
                cfg, DynamicTable(table, remap.value), ids, t, initializer=RowInitializer(
                    self.embedding_init), key=key, impl=self.impl, mesh=mesh, weight_spec=spec,
                check_ids=False,
            )  # fmt: skip
            table, remap.value, step.value = dyn.table, dyn.state, t + 1
        out, static = dynamic_rows_lookup(
            rows, table, cfg.capacity, mesh, spec, self.exchange, inputs_sharding,
            recording=tape.active() is not None, function="jaxembed.flax.DynamicEmbed",
        )  # fmt: skip
        if reset is None:
            return out
        # What sparse_update needs to reset the stored table as this step did.
        dynamic = dict(config=cfg, initializer=RowInitializer(self.embedding_init))
        operands = (rows, reset, t, reset_key.value)
        return tape.tap(self, "/".join(self.path), "dynamic", out, operands,
                        {**static, "dynamic": dynamic})  # fmt: skip
