"""`jaxembed.nnx.Embed`: Flax NNX's `Embed`, with the lookup and the tied head sharded.

A drop-in for `flax.nnx.Embed`: the same constructor arguments, the parameter `embedding`
with Flax's shape, initializer and rng stream (`params`), so that on one device the outputs
are Flax's exactly and a Flax checkpoint loads. The table's layout is Flax's own metadata:
`embedding_init=nnx.with_partitioning(init, ("model", None))`, or
`embedding_metadata={"out_sharding": ...}`, with logical names resolved through
`flax.linen.logical_axis_rules`. The lookup runs `jaxembed.embedding` on that layout (the table
never moves); `cross_entropy` is the tied head's vocab-parallel loss
(`jaxembed.losses.vocab_parallel_cross_entropy`), which never builds full-vocabulary logits,
and inside `jaxembed.nnx.deferred_logits()` `attend` returns a handle to that loss
(`jaxembed.nn.deferred.DeferredLogits`) for models whose `__call__` ends in `attend`.

The helpers it shares with the Linen module (`jaxembed.nn.linen_embed`) are in
`jaxembed.nn.common`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import spmd as core_spmd
from flax.nnx.nn import dtypes
from flax.nnx.nn.linear import default_embed_init
from flax.nnx.variablelib import VariableMetadata
from flax.typing import MISSING
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxembed import tape
from jaxembed.kernels.cross_entropy import Reduction, vocab_parallel_cross_entropy
from jaxembed.kernels.lookup import lookup
from jaxembed.nn.common import (
    IDS_ADVICE,
    as_spec,
    batch_hint,
    check_mesh_names,
    check_table_placed,
    current_mesh,
    host_value,
    names_mesh_axes,
    pad_rows,
    padded_rows,
    place_host_table,
    resolve_exchange,
    tied_logits,
)
from jaxembed.nn.deferred import DeferredLogits, deferring

__all__ = ["Embed", "Table"]


# --- layouts from NNX metadata -------------------------------------------------------------


def metadata_spec(metadata: Mapping[str, Any]) -> P | None:
    """The table's `PartitionSpec` from NNX metadata (`nnx.spmd.get_var_pspec`'s rules)."""
    sharding = metadata.get("out_sharding")
    if not sharding:
        return None
    if isinstance(sharding, NamedSharding):
        return sharding.spec
    context, local = core_spmd.get_logical_axis_rules(), metadata.get("sharding_rules") or ()
    if context or local:
        rules = core_spmd.composite_rules(context, local)
        return P(*core_spmd.from_sharding_rules(tuple(sharding), rules))
    return P(*sharding)


def metadata_mesh(metadata: Mapping[str, Any]) -> Any:
    sharding = metadata.get("out_sharding")
    if isinstance(sharding, NamedSharding):
        return sharding.mesh
    return metadata.get("mesh")


# --- the module --------------------------------------------------------------------------


class Table(nnx.Param):
    """An embedding table parameter (an `nnx.Param`, so optax, `nnx.Optimizer` and orbax treat
    it as any parameter): jaxembed's row-sparse optimizers update it, and
    `jaxembed.nnx.value_and_grad` leaves it out of the dense gradients.

    A value set from the host (numpy, as checkpoint loaders return) by `.value = ...`,
    `set_value` or `nnx.update` is put in the layout its sharding metadata states, once, as
    Flax places a parameter when it creates it, wherever the mesh is known then (the
    metadata's, or `jax.set_mesh`'s); otherwise the module places it when first called
    outside `jit`.
    """

    def set_value(self, value: Any, *, index: Any = MISSING) -> None:
        super().set_value(value, index=index)
        self._place_host_value()

    def update_from_state(self, variable_state: Any) -> None:
        super().update_from_state(variable_state)
        self._place_host_value()

    def _place_host_value(self) -> None:
        value = self.get_raw_value()
        if host_value(value):
            metadata = self.get_metadata()
            if metadata.get("ref") or metadata.get("hijax"):  # a reference: not ours to move
                return
            placed = place_host_table(value, metadata_mesh(metadata), metadata_spec(metadata))
            if placed is not value:
                self.set_raw_value(placed, _unsafe_bypass_check=True)


class QuantizedStack(nnx.Variable):
    """A serving copy's quantized table (`jaxembed.QuantizedTable`): not an `nnx.Param`, so no
    optimizer or gradient filter treats it as trainable (`EmbeddingBagCollection.quantized`)."""


def _placement_fix(spec: P | None) -> str:
    return (
        f"embed.embedding.set_value(jax.device_put(value, NamedSharding(mesh, {spec}))), or, "
        "for a whole model, nnx.update(model, jax.device_put(nnx.state(model), "
        "nnx.get_named_sharding(nnx.state(model), mesh))); or call it once under "
        "jax.set_mesh(mesh) outside jit, which places it"
    )


_NNX_TABLE_ADVICE = (
    "give the parameter its layout, e.g. jaxembed.nnx.Embed(..., embedding_init="
    "nnx.with_partitioning(init, ('model', None))) or embedding_metadata={'out_sharding': "
    "('model', None)}, as for flax.nnx.Embed"
)


class Embed(nnx.Module):
    """An embedding table whose lookup and tied head run sharded, as Flax's `nnx.Embed`.

    The parameter `embedding` has Flax's shape `[num_embeddings, features]`, initializer and
    rng stream, so that with the same `rngs` its values (and on one device its outputs) are
    exactly `flax.nnx.Embed`'s. Its layout is the parameter's metadata
    (`nnx.with_partitioning`, `embedding_metadata={"out_sharding": ...}`, logical names
    through `flax.linen.logical_axis_rules`); the lookup keeps the table in that layout in the
    forward and the backward (`jaxembed.embedding`), in Explicit meshes (where
    `flax.nnx.Embed` raises `ShardingTypeError` on a row-split table) and Auto ones.

    **Padding.** When `num_embeddings` does not divide the mesh axes that split the rows
    (or `pad_to_multiple_of`), the parameter has more rows: `num_embeddings` rounded up. The
    real rows hold Flax's values; the padding rows are initialized to zero, never read (an id
    there is out of range and reads as a zero row, `attend` and `cross_entropy` leave them
    out of the softmax), and their gradient is exactly zero. So an optimizer whose update is
    zero for a zero gradient and a zero parameter, such as `optax.adamw` with weight decay
    (its decay term is `weight_decay * 0`), leaves them exactly zero. Pass
    `pad_to_multiple_of` to make the parameter's shape independent of the mesh, e.g. to
    restore a checkpoint onto another mesh.

    Ids outside `[0, num_embeddings)` (and `padding_idx`) read as zero rows and get no
    gradient under `jit`; called eagerly with concrete ids, they raise. (Flax's `Embed`
    wraps negative ids and returns NaN for ids past the end.)

    Args:
      num_embeddings: number of embeddings (the vocabulary).
      features: the size of each embedding.
      dtype: the dtype of the lookup and `attend` (default: the parameter's).
      param_dtype: the parameter's dtype.
      embedding_init: the initializer (Flax's default:
        `variance_scaling(1.0, 'fan_in', 'normal', out_axis=0)`), optionally wrapped in
        `nnx.with_partitioning(init, spec_or_logical_names)`.
      promote_dtype: as in Flax: promotes `(embedding,)` in `__call__` and
        `(query, embedding)` in `attend` to `dtype`.
      padding_idx: an id whose row reads as zero and gets no gradient.
      pad_to_multiple_of: pad the rows to a multiple of this too (see Padding).
      exchange: the gradient's exchange, `"auto"`, `"dense"` or `"rows"` (see
        `jaxembed.embedding`).
      gradient_exchange: deprecated, the old name of `exchange`.
      rngs: the rngs; the table is drawn from `rngs.params()`, as in Flax.
      embedding_metadata: metadata of the parameter, e.g. `{"out_sharding": ("model", None)}`.
      param_type: the parameter's `nnx.Variable` type: `jaxembed.nnx.Table` (default), which
        `jaxembed.nnx.DENSE` leaves to the row-sparse optimizers, or `nnx.Param`, Flax's own,
        for a table trained with optax with the rest (a tied head): then `nnx.state` of this
        module and of a `flax.nnx.Embed` map together (`jax.tree.map` compares the Variable
        types), and `jaxembed.nnx.value_and_grad` refuses it.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> import jaxembed.nnx
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
      >>> with jax.set_mesh(mesh):
      ...     embed = jaxembed.nnx.Embed(1000, 16, rngs=nnx.Rngs(0), embedding_init=
      ...         nnx.with_partitioning(nnx.initializers.normal(), ("model", None)))
      ...     ids = jax.device_put(jnp.arange(32).reshape(4, 8), P("data"))
      ...     out = nnx.jit(lambda m, i: m(i))(embed, ids)
      >>> embed.embedding.shape, embed.embedding.sharding.spec  # 1000 rows -> 1000 (4 | 1000)
      ((1000, 16), P('model', None))
      >>> out.shape, out.sharding.spec
      ((4, 8, 16), P('data', None, None))
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        embedding_init: Any = default_embed_init,
        promote_dtype: Any = dtypes.promote_dtype,
        padding_idx: int | None = None,
        pad_to_multiple_of: int | None = None,
        exchange: str = "auto",
        gradient_exchange: str | None = None,
        rngs: nnx.Rngs,
        embedding_metadata: Mapping[str, Any] = MappingProxyType({}),
        param_type: type[nnx.Param] = Table,
    ):
        exchange = resolve_exchange(exchange, gradient_exchange, "jaxembed.nnx.Embed")
        if not (isinstance(param_type, type) and issubclass(param_type, nnx.Param)):
            raise TypeError(
                f"param_type must be an nnx.Param subclass (jaxembed.nnx.Table or nnx.Param), "
                f"got {param_type!r}"
            )
        if padding_idx is not None and not 0 <= padding_idx < num_embeddings:
            raise ValueError(
                f"padding_idx must be in [0, {num_embeddings}) (the vocabulary), got {padding_idx}"
            )
        value = embedding_init(rngs.params(), (num_embeddings, features), param_dtype)
        metadata = dict(embedding_metadata)
        if isinstance(value, VariableMetadata):
            metadata = {**metadata, **value.metadata}  # the initializer's wins, as in Flax
        spec = metadata_spec(metadata)
        mesh = current_mesh(metadata_mesh(metadata))
        # The layout as the program states it now (logical names through the rules active at
        # construction), kept for calls made where those rules are no longer active.
        self.table_spec_at_init = spec if names_mesh_axes(spec, mesh) else None
        rows = padded_rows(num_embeddings, spec, mesh, pad_to_multiple_of)
        if isinstance(value, VariableMetadata):
            value = dataclasses.replace(value, raw_value=pad_rows(value.raw_value, rows))
        else:
            value = pad_rows(value, rows)
        self.embedding = param_type(value, **embedding_metadata)

        self.num_embeddings = num_embeddings
        self.features = features
        self.dtype = dtype or self.embedding.dtype
        self.param_dtype = param_dtype
        self.promote_dtype = promote_dtype
        self.padding_idx = padding_idx
        self.exchange = exchange

    def table_layout(self) -> tuple[Any, P | None]:
        """The mesh to run on and the table's `PartitionSpec`, from the metadata.

        The mesh is the metadata's, else `jax.set_mesh`'s, else None (the arrays' own, or
        one device). Logical names resolve through the logical axis rules active now, else
        those active when the module was built. Without sharding metadata the spec is None:
        the table's own layout is read where it can be (a concrete array, an Explicit mesh).
        """
        metadata = self.embedding.get_metadata()
        mesh = current_mesh(metadata_mesh(metadata))
        spec = metadata_spec(metadata)
        if not names_mesh_axes(spec, mesh) and names_mesh_axes(self.table_spec_at_init, mesh):
            spec = self.table_spec_at_init  # logical names, resolved by the rules at __init__
        check_mesh_names(spec, mesh, "the table's sharding")
        return mesh, spec

    def _placed_table(self) -> tuple[jax.Array, Any, P | None]:
        """The parameter's value, in the layout its metadata states, and that layout.

        A host value (numpy, set after construction, e.g. by a checkpoint loader) is put
        there first, once, and kept (`Table` does so when it is set, where the mesh is known
        then). A table laid out otherwise (under `jit`, where it cannot be placed) is an
        error that names the placement to make.
        """
        mesh, spec = self.table_layout()
        value = self.embedding.get_raw_value()
        if host_value(value):
            placed = place_host_table(value, mesh, spec)
            if placed is not value:
                self.embedding.set_raw_value(placed)
        table = self.embedding[...]
        check_table_placed(table, mesh, spec, "jaxembed.nnx.Embed", _placement_fix(spec))
        return table, mesh, spec

    def __call__(
        self, inputs: jax.Array, out_sharding: Any = None, *, inputs_sharding: Any = None
    ) -> jax.Array:
        """Embeds the inputs along a new last axis.

        Args:
          inputs: integer ids of any shape `[*batch]`.
          out_sharding: the output's layout (a `PartitionSpec` or `NamedSharding`); default
            the ids' layout plus the table's hidden split. Splitting a batch axis over the
            table's row axis gives a sequence-parallel output (`psum_scatter`).
          inputs_sharding: the ids' layout where it cannot be seen (under `jit` in an Auto
            mesh): used as far as it divides the ids (a `[1, 1]` decoding batch is
            replicated). Default: the logical rules' `"batch"` axis, else the batch split
            over the mesh axes the table does not use (with a warning naming it).

        Returns:
          `[*batch, features]` in `dtype`.
        """
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError(
                f"Input type must be an integer or unsigned integer, got {inputs.dtype}: cast "
                "the ids with inputs.astype(jnp.int32)"
            )
        if tape.active() is not None and not isinstance(self.embedding, Table):
            raise ValueError(
                "jaxembed.nnx.Embed(param_type=nnx.Param): the table is a plain nnx.Param, "
                "which jaxembed.nnx.DENSE gives to optax, so jaxembed.nnx.value_and_grad cannot "
                "train it row-sparse: build the module with param_type=jaxembed.nnx.Table (the "
                "default), or train it with nnx.value_and_grad and optax"
            )
        table, mesh, spec = self._placed_table()
        (table,) = self.promote_dtype((table,), dtype=self.dtype, inexact=False)
        recording = tape.active() is not None
        static = dict(
            padding_idx=self.padding_idx, vocab_size=self.num_embeddings, mesh=mesh,
            weight_spec=spec, x_hint=batch_hint(inputs_sharding, current_mesh(mesh)),
            out_spec=as_spec(out_sharding), exchange=self.exchange,
        )  # fmt: skip
        out = lookup(
            inputs, jax.lax.stop_gradient(table) if recording else table, **static,
            function="jaxembed.nnx.Embed", ids_advice=IDS_ADVICE, table_advice=_NNX_TABLE_ADVICE,
        )  # fmt: skip
        return tape.tap(self, "embed", "embed", out, (inputs,), static)

    def attend(self, query: jax.Array, out_sharding: Any = None) -> jax.Array | DeferredLogits:
        """Logits `query @ embedding.T` over the real rows (the tied output head).

        The logits of the whole vocabulary materialize: for training, `cross_entropy` gives
        the loss without them; so does a model that ends in `attend` when called inside
        `jaxembed.nnx.deferred_logits()`, where `attend` returns a `DeferredLogits` handle
        whose `cross_entropy(labels)` is that loss.

        Args:
          query: `[*batch, features]`.
          out_sharding: the logits' layout. Default: in an Explicit mesh, the query's batch
            axes with the vocab axis whole (so `optax` losses work on the logits unchanged);
            otherwise left to XLA, as in Flax.

        Returns:
          `[*batch, num_embeddings]`; inside `deferred_logits()`, a `DeferredLogits` of that
          shape.
        """
        tape.refuse_dense_use(self, "jaxembed.nnx.Embed.attend")
        deferral = deferring()
        if deferral is None:
            query, table = self.promote_dtype((query, self.embedding[...]), dtype=self.dtype)
            mesh = self.table_layout()[0]
            return tied_logits(query, table, self.num_embeddings, mesh, out_sharding)
        table, mesh, spec = self._placed_table()
        query, table = self.promote_dtype((query, table), dtype=self.dtype)
        return DeferredLogits(
            query, table, vocab_size=self.num_embeddings, mesh=mesh, weight_spec=spec,
            query_sharding=deferral.query_sharding, out_sharding=out_sharding,
            where="jaxembed.nnx.Embed.attend",
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

        Equals `optax.softmax_cross_entropy_with_integer_labels(self.attend(query), labels)`
        (with the options below), with its gradients, but no device holds logits of more
        than its own rows. See `jaxembed.losses.vocab_parallel_cross_entropy`.

        Args:
          query: `[*tokens, features]`, e.g. the last hidden states.
          labels: integer `[*tokens]`.
          label_smoothing, z_loss, ignore_index, vocab_chunk_size, reduction: see
            `vocab_parallel_cross_entropy`.
          query_sharding: the query's layout; needed under `jit` in an Auto mesh.
          **options: further keywords of `vocab_parallel_cross_entropy`, passed through.

        Returns:
          float32 per-token losses `[*tokens]`, or a scalar when reduced.
        """
        tape.refuse_dense_use(self, "jaxembed.nnx.Embed.cross_entropy")
        table, mesh, spec = self._placed_table()
        query, table = self.promote_dtype((query, table), dtype=self.dtype)
        return vocab_parallel_cross_entropy(
            query, table, labels, vocab_size=self.num_embeddings, mesh=mesh,
            hidden_spec=as_spec(query_sharding), weight_spec=spec,
            label_smoothing=label_smoothing, z_loss=z_loss, ignore_index=ignore_index,
            vocab_chunk_size=vocab_chunk_size, reduction=reduction, **options,
        )  # fmt: skip
