"""The arguments of the vocab-parallel head functions: checks, layouts, weights, reductions.

`vocab_parallel_cross_entropy` (`jaxembed.kernels.cross_entropy`) and the metrics `argmax`,
`top_k` and `accuracy` (`jaxembed.kernels.vocab_metrics`) take the same `hidden`, `table`,
`labels`, layouts, per-token `weights` and `reduction`; this module checks them once, with
errors that name the value and the fix, and reduces per-token values the same way for all.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxembed.ids import as_ids
from jaxembed.kernels.arrays import (
    is_explicit,
    normalize_spec,
    resolve_mesh,
    spec_of,
    warn_if_layout_unknown,
)

__all__ = ["Reduction", "check_inputs", "check_reduction", "check_weights", "reduce_tokens"]

Reduction = Literal["none", "sum", "mean"]


def check_inputs(
    function: str,
    hidden: Any,
    table: jax.Array,
    labels: Any,
    mesh: Any,
    hidden_spec: P | None,
    weight_spec: P | None,
) -> tuple[jax.Array, jax.Array | None, Any, P | None, P | None]:
    """Checks `hidden`, `table` and `labels` (None: no labels) for `function`, and finds the
    mesh and both layouts (see `vocab_parallel_cross_entropy`'s `mesh`, `hidden_spec` and
    `weight_spec`). Returns `(hidden, labels, mesh, hidden_spec, weight_spec)`, with the
    labels as int32-fitting ids and mesh None for one device."""
    hidden = hidden if isinstance(hidden, jax.Array | jax.core.Tracer) else jnp.asarray(hidden)
    if labels is not None:
        labels = as_ids(labels, "labels")  # any width, checked before it is narrowed
    for name, a in (("hidden", hidden), ("table", table)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"{name} must be floating point, got {a.dtype}")
    if jnp.ndim(table) != 2:
        raise ValueError(f"table must be a 2-D table [vocab, hidden], got shape {table.shape}")
    tokens = hidden.shape[:-1]
    if (
        hidden.ndim < 1
        or hidden.shape[-1] != table.shape[1]
        or (labels is not None and labels.shape != tokens)
    ):
        got = "" if labels is None else f" and labels {labels.shape}"
        raise ValueError(
            f"expected hidden [*tokens, {table.shape[1]}]"
            f"{'' if labels is None else ' and labels [*tokens]'} for a table "
            f"{table.shape}; got hidden {hidden.shape}{got}"
        )
    mesh = resolve_mesh(mesh, table, hidden)
    if mesh is not None and mesh.size == 1 and hidden_spec is None and weight_spec is None:
        return hidden, labels, None, None, None
    if mesh is None:
        return hidden, labels, None, hidden_spec, weight_spec
    given = spec_of(table, mesh)
    if weight_spec is None:
        warn_if_layout_unknown(table, mesh, function=function, arg="weight_spec", what="table")
        weight_spec = given
    elif is_explicit(mesh) and normalize_spec(given, 2) != normalize_spec(weight_spec, 2):
        raise ValueError(
            f"table is laid out as {given} but weight_spec={weight_spec}: {function} never "
            "moves the table; drop weight_spec, or reshard the table once with "
            "jax.sharding.reshard(table, weight_spec)"
        )
    if hidden_spec is None:
        warn_if_layout_unknown(
            hidden, mesh, function=function, arg="hidden_spec", what="hidden array"
        )
        hidden_spec = spec_of(hidden, mesh)
    return hidden, labels, mesh, hidden_spec, weight_spec


def check_reduction(reduction: Any) -> None:
    """Raises for a `reduction` other than "none", "sum" and "mean"."""
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction must be 'none', 'sum' or 'mean', got {reduction!r}")


def check_weights(weights: Any, tokens: tuple[int, ...]) -> jax.Array | None:
    """`weights` as a float array of shape `tokens`, or None; a clear error otherwise."""
    if weights is None:
        return None
    if not isinstance(weights, jax.Array | jax.core.Tracer):
        weights = jnp.asarray(weights)
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        raise TypeError(
            f"weights must be floating point (a weight per token, e.g. a 0/1 loss mask), got "
            f"{weights.dtype}: pass weights=mask.astype(jnp.float32)"
        )
    if weights.shape != tuple(tokens):
        raise ValueError(
            f"weights must have the labels' shape {tuple(tokens)} (one weight per token), got "
            f"{weights.shape}"
            + (
                f": drop its last axis (weights[..., 0]) or reshape it to {tuple(tokens)}"
                if weights.size == math.prod(tokens)
                else ""
            )
        )
    return weights


def reduce_tokens(
    values: jax.Array,
    labels: jax.Array,
    weights: jax.Array | None,
    *,
    ignore_index: int | None,
    reduction: Reduction,
) -> jax.Array:
    """Per-token values (zero at ignored tokens) weighted, then reduced over the tokens.

    `"sum"` is `sum(w * v)`; `"mean"` is `sum(w * v) / sum(w)` over the tokens whose label is
    not `ignore_index` (0 when that weight is 0); `"none"` returns `w * v`. Without weights,
    `w` is 1. `values`, `labels` and `weights` share one layout.

    Examples:
      >>> import jax.numpy as jnp
      >>> loss, labels = jnp.array([2.0, 4.0, 0.0]), jnp.array([5, 6, -100])
      >>> w = jnp.array([1.0, 3.0, 1.0])
      >>> float(reduce_tokens(loss, labels, w, ignore_index=-100, reduction="mean"))  # 14 / 4
      3.5
      >>> float(reduce_tokens(loss, labels, None, ignore_index=-100, reduction="mean"))
      3.0
    """
    if weights is not None:
        values = values * weights.astype(jnp.float32)
    if reduction == "none":
        return values
    if reduction == "sum":
        return values.sum()
    if weights is None and ignore_index is None:
        return values.mean()
    if weights is None:
        count = (labels != ignore_index).sum()
        return values.sum() / jnp.maximum(count, 1).astype(jnp.float32)
    kept = weights.astype(jnp.float32)
    if ignore_index is not None:
        kept = jnp.where(labels == ignore_index, 0.0, kept)
    total = kept.sum()
    return values.sum() / jnp.where(total == 0, 1.0, total)
