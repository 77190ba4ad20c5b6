"""`jaxembed.flax.Embed`: Flax Linen's `Embed`, with the lookup and the tied head sharded.

A drop-in for `flax.linen.Embed`: the same attributes, the parameter `embedding` with Linen's
shape, initializer and rng stream, so that on one device the outputs are Linen's exactly and
a Linen checkpoint loads. The table's layout is Linen's own metadata: the `nn.Partitioned` box
of `embedding_init=nn.with_partitioning(init, ("model", None))`, or the
`nn.LogicallyPartitioned` box of `nn.with_logical_partitioning(init, ("vocab", "embed"))`
resolved through `nn.logical_axis_rules`. Inside `jaxembed.flax.deferred_logits()`, `attend`
returns a handle to the vocab-parallel loss (`jaxembed.nn.deferred.DeferredLogits`) for models
whose `__call__` ends in `attend`. See `jaxembed.nnx` for the NNX module.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype as linen_promote_dtype
from flax.linen.linear import default_embed_init
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxembed import tape
from jaxembed.kernels.arrays import is_explicit, warn_once
from jaxembed.kernels.cross_entropy import Reduction, vocab_parallel_cross_entropy
from jaxembed.kernels.lookup import lookup
from jaxembed.nn.common import (
    IDS_ADVICE,
    as_spec,
    batch_hint,
    check_mesh_names,
    check_table_placed,
    current_mesh,
    names_mesh_axes,
    pad_rows,
    padded_rows,
    place_host_table,
    resolve_exchange,
    tied_logits,
)
from jaxembed.nn.deferred import DeferredLogits, deferring

__all__ = ["Embed"]


def box_layout(box: Any) -> tuple[Any, P | None]:
    """The mesh and `PartitionSpec` a Linen parameter box carries (None, None: no box)."""
    if isinstance(box, nn.LogicallyPartitioned):
        return current_mesh(box.mesh), nn.logical_to_mesh_axes(box.names, box.rules)
    if isinstance(box, nn.Partitioned):
        return current_mesh(box.mesh), box.get_partition_spec()
    return current_mesh(), None


# Logical names -> the mesh axes they resolved to when a table was initialized under
# `nn.logical_axis_rules`. Linen programs often unbox their parameters and apply the model
# with no rules active (Flax's lm1b, MaxText): then the names are all that is left, and this
# is the layout the program gave them.
_RESOLVED_AT_INIT: dict[tuple[Any, ...], P] = {}

_LINEN_TABLE_ADVICE = (
    "keep the parameter's partitioning box (do not unbox it), or apply the model inside "
    "flax.linen.logical_axis_rules([...]) as at initialization, or give "
    "jaxembed.flax.Embed an embedding_init wrapped in nn.with_partitioning(init, "
    "('model', None))"
)


def _placement_fix(spec: P | None) -> str:
    return (
        f"jax.device_put(table, NamedSharding(mesh, {spec})) where the table goes into the "
        "params, or, for variables that keep their partitioning boxes, "
        "jax.device_put(variables, nn.get_sharding(variables, mesh))"
    )


def _names(box: Any) -> tuple[Any, ...] | None:
    names = getattr(box, "names", None)
    return tuple(names) if names is not None else None


class Embed(nn.Module):
    """An embedding table whose lookup and tied head run sharded, as Linen's `nn.Embed`.

    The parameter `embedding` has Linen's shape `[num_embeddings, features]`, initializer
    and rng stream (`params`), so that with the same key its values (and on one device the
    outputs) are exactly `flax.linen.Embed`'s. Its layout is the box `embedding_init`
    returns (`nn.with_partitioning`, `nn.with_logical_partitioning`); the lookup keeps the
    table in that layout in the forward and the backward (`jaxembed.embedding`). Initialize
    it in an Auto mesh with `jax.jit(model.init, out_shardings=nn.get_sharding(abstract,
    mesh))` (for logical names, `nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract),
    mesh, rules)`), or in an Explicit one under `jax.set_mesh`.

    **Padding.** When `num_embeddings` does not divide the mesh axes that split the rows at
    initialization (or `pad_to_multiple_of`), the parameter has more rows: `num_embeddings`
    rounded up. The real rows hold Linen's values; the padding rows are initialized to zero,
    never read (an id there is out of range and reads as a zero row; `attend` and
    `cross_entropy` leave them out), and their gradient is exactly zero, so `optax.adamw`
    (weight decay included) leaves them exactly zero.

    Ids outside `[0, num_embeddings)` (and `padding_idx`) read as zero rows with no gradient
    under `jit`, and raise when concrete (Linen's `Embed` wraps negative ids, and returns NaN
    past the end).

    Attributes:
      num_embeddings: number of embeddings (the vocabulary).
      features: the size of each embedding.
      dtype: the dtype of the lookup and `attend` (default: the parameter's).
      param_dtype: the parameter's dtype.
      embedding_init: the initializer, optionally wrapped in `nn.with_partitioning` or
        `nn.with_logical_partitioning`.
      promote_dtype: as in Linen: promotes `embedding` in `__call__` and `(query, embedding)`
        in `attend` to `dtype`.
      padding_idx: an id whose row reads as zero and gets no gradient.
      pad_to_multiple_of: pad the rows to a multiple of this too, e.g. so that the shape does
        not depend on the mesh.
      exchange: the gradient's exchange, `"auto"`, `"dense"` or `"rows"` (see
        `jaxembed.embedding`).
      gradient_exchange: deprecated, the old name of `exchange`.

    Examples:
      >>> import functools, jax, jax.numpy as jnp
      >>> import flax.linen as nn
      >>> from jax.sharding import AxisType, PartitionSpec as P
      >>> import jaxembed.flax
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
      >>> model = jaxembed.flax.Embed(1000, 16, embedding_init=nn.with_logical_partitioning(
      ...     nn.initializers.normal(), ("vocab", "embed")))
      >>> ids = jnp.zeros((4, 8), jnp.int32)
      >>> rules = [("vocab", "model"), ("embed", None)]
      >>> with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      ...     init = functools.partial(model.init, inputs_sharding=P("data"))
      ...     abstract = jax.eval_shape(init, jax.random.key(0), ids)
      ...     shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
      ...     variables = jax.jit(init, out_shardings=shardings)(jax.random.key(0), ids)
      ...     out = jax.jit(functools.partial(model.apply, inputs_sharding=P("data")))(
      ...         variables, ids)
      >>> variables["params"]["embedding"].value.sharding.spec, out.shape
      (P('model', None), (4, 8, 16))
    """

    num_embeddings: int
    features: int
    dtype: Any = None
    param_dtype: Any = jnp.float32
    embedding_init: Any = default_embed_init
    promote_dtype: Any = linen_promote_dtype
    padding_idx: int | None = None
    pad_to_multiple_of: int | None = None
    exchange: str = "auto"
    gradient_exchange: str | None = None  # deprecated: exchange's old name

    def __post_init__(self):
        if self.gradient_exchange is not None:  # resolved once: clones see `exchange` only
            exchange = resolve_exchange(
                self.exchange, self.gradient_exchange, "jaxembed.flax.Embed"
            )
            object.__setattr__(self, "exchange", exchange)
            object.__setattr__(self, "gradient_exchange", None)
        super().__post_init__()

    def setup(self):
        if self.padding_idx is not None and not 0 <= self.padding_idx < self.num_embeddings:
            raise ValueError(
                f"padding_idx must be in [0, {self.num_embeddings}) (the vocabulary), got "
                f"{self.padding_idx}"
            )
        if self.has_variable("params", "embedding"):
            # Applying: read the parameter as stored, without Linen's check of its shape
            # against `_init`'s here (a table padded for the mesh at initialization keeps its
            # rows when applied outside that mesh).
            box = self.get_variable("params", "embedding")
        else:
            box = self.param(
                "embedding", self._init, (self.num_embeddings, self.features),
                self.param_dtype, unbox=False,
            )  # fmt: skip
        self.embedding = box.value if isinstance(box, nn.Partitioned) else box

    def _init(self, key: jax.Array, shape: tuple[int, int], dtype: Any) -> Any:
        """Linen's initializer on the real rows, then zero padding rows (inside the box).

        In an Explicit mesh the table is placed in the box's layout here, so that the lookup
        at initialization finds it there.
        """
        value = self.embedding_init(key, shape, dtype)
        mesh, spec = box_layout(value)
        if isinstance(value, nn.LogicallyPartitioned) and any(spec or ()):
            if names_mesh_axes(spec, mesh):
                _RESOLVED_AT_INIT[_names(value)] = spec
        rows = padded_rows(self.num_embeddings, spec, mesh, self.pad_to_multiple_of)
        table = pad_rows(value.value if isinstance(value, nn.Partitioned) else value, rows)
        if spec is not None and is_explicit(mesh):  # born in its layout, as NNX's eager sharding
            check_mesh_names(spec, mesh, "the table's sharding")
            table = jax.sharding.reshard(table, NamedSharding(mesh, spec))
        return value.replace_boxed(table) if isinstance(value, nn.Partitioned) else table

    def table_layout(self) -> tuple[Any, P | None]:
        """The mesh to run on and the table's `PartitionSpec`, from the parameter's box.

        The box is the parameter's, or, for a parameter stored unboxed (Flax's lm1b and
        MaxText unbox before training), the one `embedding_init` returns. Logical names are
        resolved with the current `nn.logical_axis_rules`, else (with a warning) as they
        were at initialization. Without any of these the spec is None: the table's own
        layout is read where it can be, and otherwise the lookup falls back to XLA's.
        """
        box = self.scope.get_variable("params", "embedding")
        if not isinstance(box, nn.Partitioned):  # unboxed: the initializer still names it
            shape = (self.num_embeddings, self.features)
            box = jax.eval_shape(
                lambda key: self.embedding_init(key, shape, self.param_dtype), jax.random.key(0)
            )
        mesh, spec = box_layout(box)
        if isinstance(box, nn.LogicallyPartitioned) and not names_mesh_axes(spec, mesh):
            spec = None
        if isinstance(box, nn.LogicallyPartitioned) and not any(spec or ()):
            # No rules active now: the layout these names had at initialization, if any.
            known = _RESOLVED_AT_INIT.get(_names(box))
            if known is not None and any(known):
                warn_once(
                    "linen-names-at-init",
                    f"jaxembed.flax.Embed: no logical axis rules are active, so the table's "
                    f"names {_names(box)} resolve to nothing; jaxembed uses the layout they "
                    f"had at initialization, {known}. Apply the model inside "
                    "flax.linen.logical_axis_rules([...]) to state it.",
                )
                spec = known
            elif spec is not None and not any(spec) and mesh is not None and mesh.size > 1:
                spec = None  # replicated by default, or unknown: let the table's layout tell
        check_mesh_names(spec, mesh, "the table's sharding")
        return mesh, spec

    def _placed_table(self) -> tuple[jax.Array, Any, P | None]:
        """The parameter's value in the layout its box states, and that layout.

        A host value (numpy, as checkpoint loaders return) is put there first, on every call
        (a Linen module keeps no state: place the params once for a loop of eager calls); a
        table laid out otherwise (under `jit`, where it cannot be placed) is an error that
        names the placement to make.
        """
        mesh, spec = self.table_layout()
        table = place_host_table(self.embedding, mesh, spec)
        check_table_placed(table, mesh, spec, "jaxembed.flax.Embed", _placement_fix(spec))
        return table, mesh, spec

    def __call__(
        self, inputs: jax.Array, *, out_sharding: Any = None, inputs_sharding: Any = None
    ) -> jax.Array:
        """Embeds the inputs along a new last axis.

        Args:
          inputs: integer ids of any shape `[*batch]`.
          out_sharding: the output's layout; default the ids' layout plus the table's hidden
            split (see `jaxembed.embedding`'s `out_spec`).
          inputs_sharding: the ids' layout where it cannot be seen (under `jit` in an Auto
            mesh), used as far as it divides the ids. Default: the logical rules' `"batch"`
            axis, else the batch split over the mesh axes the table does not use (with a
            warning naming it).

        Returns:
          `[*batch, features]` in `dtype`.
        """
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError(
                f"Input type must be an integer or unsigned integer, got {inputs.dtype}: cast "
                "the ids with inputs.astype(jnp.int32)"
            )
        table, mesh, spec = self._placed_table()
        (table,) = self.promote_dtype(table, dtype=self.dtype, inexact=False)
        recording = tape.active() is not None
        static = dict(
            padding_idx=self.padding_idx, vocab_size=self.num_embeddings, mesh=mesh,
            weight_spec=spec, x_hint=batch_hint(inputs_sharding, current_mesh(mesh)),
            out_spec=as_spec(out_sharding), exchange=self.exchange,
        )  # fmt: skip
        out = lookup(
            inputs, jax.lax.stop_gradient(table) if recording else table, **static,
            function="jaxembed.flax.Embed", ids_advice=IDS_ADVICE, table_advice=_LINEN_TABLE_ADVICE,
        )  # fmt: skip
        return tape.tap(self, "/".join(self.path), "embed", out, (inputs,), static)

    def attend(self, query: jax.Array, *, out_sharding: Any = None) -> jax.Array | DeferredLogits:
        """Logits `query @ embedding.T` over the real rows (the tied output head).

        Inside `jaxembed.flax.deferred_logits()` it returns a `DeferredLogits` handle instead,
        whose `cross_entropy(labels)` is the vocab-parallel loss of these logits (see
        `jaxembed.nnx.Embed.attend`).

        Args:
          query: `[*batch, features]`.
          out_sharding: the logits' layout. Default: in an Explicit mesh, the query's batch
            axes with the vocab axis whole; otherwise left to XLA, as in Linen.

        Returns:
          `[*batch, num_embeddings]`; inside `deferred_logits()`, a `DeferredLogits` of that
          shape.
        """
        tape.refuse_dense_use(self, "jaxembed.flax.Embed.attend")
        deferral = deferring()
        if deferral is None:
            query, table = self.promote_dtype(query, self.embedding, dtype=self.dtype)
            mesh = self.table_layout()[0]
            return tied_logits(query, table, self.num_embeddings, mesh, out_sharding)
        table, mesh, spec = self._placed_table()
        query, table = self.promote_dtype(query, table, dtype=self.dtype)
        return DeferredLogits(
            query, table, vocab_size=self.num_embeddings, mesh=mesh, weight_spec=spec,
            query_sharding=deferral.query_sharding, out_sharding=out_sharding,
            where="jaxembed.flax.Embed.attend",
        )  # fmt: skip

    def cross_entropy(
        self,
        query: jax.Array,
        labels: jax.Array,
        *,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        ignore_index: int | None = None,
        vocab_chunk_size: int | str | None = "auto",
        reduction: Reduction = "none",
        query_sharding: Any = None,
        **options: Any,
    ) -> jax.Array:
        """Softmax cross-entropy of `attend(query)` against labels, vocab-parallel.

        See `jaxembed.nnx.Embed.cross_entropy` and
        `jaxembed.losses.vocab_parallel_cross_entropy`.

        Args:
          query: `[*tokens, features]`.
          labels: integer `[*tokens]`.
          label_smoothing, z_loss, ignore_index, vocab_chunk_size, reduction: see
            `vocab_parallel_cross_entropy`.
          query_sharding: the query's layout; needed under `jit` in an Auto mesh.
          **options: further keywords of `vocab_parallel_cross_entropy`, passed through.

        Returns:
          float32 per-token losses `[*tokens]`, or a scalar when reduced.
        """
        tape.refuse_dense_use(self, "jaxembed.flax.Embed.cross_entropy")
        table, mesh, spec = self._placed_table()
        query, table = self.promote_dtype(query, table, dtype=self.dtype)
        return vocab_parallel_cross_entropy(
            query, table, labels, vocab_size=self.num_embeddings, mesh=mesh,
            hidden_spec=as_spec(query_sharding), weight_spec=spec,
            label_smoothing=label_smoothing, z_loss=z_loss, ignore_index=ignore_index,
            vocab_chunk_size=vocab_chunk_size, reduction=reduction, **options,
        )  # fmt: skip
