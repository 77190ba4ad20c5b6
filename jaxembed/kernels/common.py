"""Plumbing every kernel shares: the bodies' reductions, layouts, checks and stats.

The plain lookup (`jaxembed.kernels.lookup`), the bag lookup (`jaxembed.kernels.bag`), the
row-sparse update (`jaxembed.kernels.update`, `jaxembed.optim`) and the collections' lookups
take these from here, by their public names:

* in a body: `reduce_over_rows` (the forward's psum_scatter / psum), `out_grad_to_body`
  (the backward's first moves), `finish_gradient` (the dense exchange's psum), `shard_map`;
* layouts: `resolve_layouts` (read, checked, or assumed), `companion_spec` (a bag's lengths
  and weights), `cotangent_spec`;
* checks: `check_table`, `validate_scalars`, `runs_on_one_device`;
* results: `LookupStats`, `with_stats`, and the sharded lookups' counters (`work_counts`,
  `counts_spec`, `stats_of`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxembed.kernels.arrays import (
    assumed_ids_spec,
    layout_known,
    normalize_spec,
    spec_of,
    stated_spec,
    warn_once,
)
from jaxembed.kernels.reshard import apply_moves, gather
from jaxembed.plan import EmbeddingPlan
from jaxembed.quant import QuantizedTable

__all__ = [
    "LookupStats",
    "UpdateStats",
    "check_table",
    "companion_spec",
    "cotangent_spec",
    "counts_spec",
    "device_count",
    "finish_gradient",
    "out_grad_to_body",
    "reduce_over_rows",
    "resolve_layouts",
    "runs_on_one_device",
    "shard_map",
    "stats_of",
    "validate_scalars",
    "with_stats",
    "work_counts",
]


# --- in a body ---------------------------------------------------------------------------------


def reduce_over_rows(plan: EmbeddingPlan, out: jax.Array) -> jax.Array:
    """Sums the row shards' partial outputs: `psum_scatter` where the output splits a batch
    axis over a row axis, `psum` over the rest (unreduced axes are left alone)."""
    for dim, axes in plan.scatters:
        out = jax.lax.psum_scatter(out, axes, scatter_dimension=dim, tiled=True)
    if plan.psum_axes:
        out = jax.lax.psum(out, plan.psum_axes)
    return out


def out_grad_to_body(plan: EmbeddingPlan, out_grad: jax.Array) -> jax.Array:
    """The backward's first step: out_grad from the output's layout to the body's, then the
    transpose of each forward `psum_scatter` (an `all_gather`)."""
    out_grad = apply_moves(out_grad, plan.grad_moves)
    for dim, axes in reversed(plan.scatters):
        out_grad = gather(out_grad, axes, dim)
    return out_grad


def finish_gradient(plan: EmbeddingPlan, weight_grad: jax.Array) -> jax.Array:
    """The dense exchange's `psum` over the batch axes, and the table's dtype."""
    if plan.exchange == "dense":
        weight_grad = jax.lax.psum(weight_grad, plan.batch_axes)
    return weight_grad.astype(plan.dtype)


def shard_map(body, plan: EmbeddingPlan, mesh: Any, in_specs, out_specs):
    """`jax.shard_map` of `body(plan, ...)` with the VMA check on."""
    return jax.shard_map(
        functools.partial(body, plan),
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        check_vma=True,
    )


def cotangent_spec(plan: EmbeddingPlan) -> P:
    """The layout the output's cotangent arrives in (reduced where the output is unreduced)."""
    return plan.out_spec.to_ct_spec() if plan.unreduced_axes else plan.out_spec


# --- layouts: read, checked, or assumed --------------------------------------------------------


def check_table(weight: Any) -> None:
    """Raises for a table that is not a 2-D float array (a quantized table included: only
    lookups read one, `jaxembed.kernels.tables.check_lookup_table`)."""
    if isinstance(weight, QuantizedTable):
        raise TypeError(
            f"got a quantized table ({weight!r}) where a float table is needed: quantized "
            "tables are inference-only (lookups with embedding, embedding_bag and the "
            "collections); train the float table and quantize it for serving with "
            "jaxembed.quantize(table, precision)"
        )
    if jnp.ndim(weight) != 2:
        raise ValueError(
            f"weight must be a 2-D table [vocab, hidden], got shape {jnp.shape(weight)}"
        )
    if not jnp.issubdtype(weight.dtype, jnp.floating):
        raise TypeError(f"weight must be a float table, got {weight.dtype}")


def resolve_layouts(
    x: jax.Array,
    weight: jax.Array,
    mesh: Any,
    *,
    x_spec: P | None,
    weight_spec: P | None,
    x_hint: P | None = None,
    function: str = "embedding",
    table_advice: str | None = None,
    ids_advice: str | None = None,
) -> tuple[P | None, P]:
    """The table's and the ids' layouts, read where visible, checked, or assumed.

    Returns `(weight_spec, x_spec)`; `weight_spec` is None when the table's layout cannot be
    known (a traced table in an Auto mesh and no `weight_spec`): the caller then falls back
    to XLA's lookup rather than run a kernel that would make XLA gather the table.

    Args:
      x, weight: the ids and the table (concrete or traced).
      mesh: the mesh the lookup runs on.
      x_spec, weight_spec: layouts the caller states (None: read them).
      x_hint: a layout the program states for the ids without forcing it (a module's
        `inputs_sharding`): used where it divides, else reduced.
      function: the caller's name, for messages.
      table_advice: what to tell the caller when the table's layout is unknown.
      ids_advice: what to tell the caller when the ids' layout is assumed.

    Raises:
      ValueError: a `weight_spec` or `x_spec` contradicting an Explicit array's type.
    """
    if weight_spec is None:
        if layout_known(weight, mesh):
            weight_spec = spec_of(weight, mesh)
        else:
            advice = table_advice or (
                f"pass weight_spec=PartitionSpec(...) to {function}(), or use an Explicit mesh"
            )
            warn_once(
                "table-unknown",
                f"{function}(): the table is traced in an Auto mesh and its layout is not known "
                f"(a traced array does not carry it there), so jaxembed does not run its "
                f"sharded kernel (XLA would gather the table to feed it) and falls back to "
                f"XLA's own partitioning of the lookup. To run sharded: {advice}.",
            )
            return None, P()
    elif (given := stated_spec(weight, mesh)) is not None:
        if normalize_spec(given, 2) != normalize_spec(weight_spec, 2):
            raise ValueError(
                f"weight is laid out as {given} but weight_spec={weight_spec}: jaxembed never "
                "moves the table; drop weight_spec, or reshard the table once with "
                "jax.sharding.reshard(weight, weight_spec)"
            )
    if x_spec is not None:
        if isinstance(x, jax.core.Tracer) and (given := stated_spec(x, mesh)) is not None:
            if normalize_spec(given, x.ndim) != normalize_spec(x_spec, x.ndim):
                raise ValueError(
                    f"the ids are laid out as {given} but x_spec={x_spec}: drop x_spec "
                    "(jaxembed reads the layout from the ids' type in an Explicit mesh), or "
                    "reshard the ids first"
                )
        return weight_spec, x_spec
    if layout_known(x, mesh):
        return weight_spec, spec_of(x, mesh)
    assumed = assumed_ids_spec(tuple(x.shape), mesh, weight_spec, x_hint)
    if x_hint is not None and normalize_spec(assumed, x.ndim) == normalize_spec(x_hint, x.ndim):
        return weight_spec, assumed  # the program states it: nothing assumed
    advice = ids_advice or f"pass x_spec=PartitionSpec(...) to {function}()"
    if x_hint is not None:
        why = f"the stated layout {x_hint} does not divide them, so they run as {assumed}"
    else:
        why = (
            f"jaxembed assumes {assumed}: the batch split over the mesh axes the table does "
            "not use, as far as that divides"
        )
    warn_once(
        "ids-assumed",
        f"{function}(): the ids of shape {tuple(x.shape)} are traced in an Auto mesh, where "
        f"their layout cannot be seen; {why}. To state it: {advice}.",
    )
    return weight_spec, assumed


def companion_spec(a: jax.Array | None, mesh: Any, x_spec: P) -> P | None:
    """The layout of lengths or weights: their own where they state one, else x's lead."""
    if a is None:
        return None
    stated = stated_spec(a, mesh)
    if stated is not None:
        return stated
    if layout_known(a, mesh) and not isinstance(a, jax.core.Tracer):
        spec = spec_of(a, mesh)
        if spec != P():
            return spec
    parts = tuple(x_spec) + (None,) * (a.ndim - len(tuple(x_spec)))
    lead = parts[: a.ndim - 1]
    if any(p is not None for p in parts[a.ndim - 1 :]) and a.ndim == len(tuple(x_spec)):
        warn_once(
            "bag-axis-split",
            "embedding_bag(): the ids' last axis (the bag slots) is split; the kernel "
            "gathers it, since a bag's ids must be whole to pool it.",
        )
    return P(*lead, None)


# --- checks and results ----------------------------------------------------------------------


def validate_scalars(vocab_size: int, padding_idx: int | None, num_rows: int) -> None:
    """Raises for a vocab_size or padding_idx out of range (the plan checks them too)."""
    if not 1 <= vocab_size <= num_rows:
        raise ValueError(
            f"vocab_size must be in [1, {num_rows}] (the table's rows), got {vocab_size}"
        )
    if padding_idx is not None and not 0 <= padding_idx < vocab_size:
        raise ValueError(
            f"padding_idx must be in [0, {vocab_size}) (the vocabulary), got {padding_idx}"
        )


def runs_on_one_device(mesh: Any, *specs: Any) -> bool:
    """No mesh, or a one-device mesh with no layout asked for: no kernel needed."""
    return mesh is None or (mesh.size == 1 and all(s is None for s in specs))


class LookupStats(NamedTuple):
    """What a lookup did that its plan cannot know in advance (returned with `return_stats`).

    Attributes:
      routed_fallback: int32[], 1 when some bucket of the routed exchange overflowed its
        capacity in this step and the exact gather exchange ran instead (0 otherwise, and
        always 0 for the other exchanges). Sum it over steps to count the fallbacks.
      slots: int32[devices], the id slots each device's lookup pooled (walked) in this step,
        in the mesh's device order: the gather exchange, every slot gathered to it (the
        group's whole batch); the routed one, its own slots.
      rows: int32[devices], the rows each device read from its table shard: the gather
        exchange, one per slot it owns; the routed one, one per distinct id a source sent.
    """

    routed_fallback: jax.Array
    slots: jax.Array
    rows: jax.Array


class UpdateStats(NamedTuple):
    """What a row-sparse update did in its step (`opt.update(..., return_stats=True)`).

    Attributes:
      routed_fallback: int32[], 1 when the routed exchange overflowed and the exact gather
        exchange ran instead (as `LookupStats.routed_fallback`).
      rows: int32[devices], the distinct rows each device updated (its shard's rows the step
        wrote, each once), in the mesh's device order: the work an update divides.
    """

    routed_fallback: jax.Array
    rows: jax.Array


def work_counts(plan: EmbeddingPlan, slots: Any, rows: jax.Array) -> jax.Array:
    """One device's `(slots walked, rows read)` as int32[1, 2], varying over every mesh
    axis (its out_spec: `counts_spec(plan)`): the `LookupStats` counters."""
    counts = jnp.stack([jnp.asarray(slots, jnp.int32), jnp.asarray(rows, jnp.int32)])[None]
    return _varying(plan, counts)


def device_count(plan: EmbeddingPlan, value: Any) -> jax.Array:
    """One device's counter `value` as int32[1], varying over every mesh axis (its out_spec:
    `P(counts_spec(plan)[0])`): concatenated over the devices, in the mesh's order."""
    return _varying(plan, jnp.asarray(value, jnp.int32).reshape(1))


def _varying(plan: EmbeddingPlan, counts: jax.Array) -> jax.Array:
    axis_type = getattr(jax.typeof(counts), "manual_axis_type", None)
    varying = frozenset(axis_type.varying) if axis_type is not None else frozenset()
    missing = tuple(a for a in plan.mesh_names if a not in varying)
    if not missing or not _bound(plan.mesh_names):  # a one-device body run without shard_map
        return counts
    return jax.lax.pcast(counts, missing, to="varying")


def _bound(names: tuple[str, ...]) -> bool:
    """Whether the mesh axes `names` are bound here (inside a `shard_map` over them)."""
    try:
        for name in names:
            jax.lax.axis_size(name)
    except NameError:
        return False
    return True


def counts_spec(plan: EmbeddingPlan) -> P:
    """The layout of the counters: one row per device, in the mesh's order."""
    return P(plan.mesh_names, None)


def stats_of(overflow: jax.Array, counts: jax.Array) -> LookupStats:
    """The `LookupStats` of a sharded lookup: its fallback flag and counters `[devices, 2]`."""
    return LookupStats(overflow, counts[:, 0], counts[:, 1])


def with_stats(out: jax.Array, return_stats: bool, ids: Any = None, valid: Any = None, *,
               devices: int = 1):  # fmt: skip
    """`out`, and the `LookupStats` of a lookup that cannot fall back (with `return_stats`):
    one device (or XLA's own lookup, counted as one) walks every slot of `ids` and reads a
    row for each of `valid`; `devices` zeros for a batch of no slot."""
    if not return_stats:
        return out
    n = 0 if ids is None else math.prod(jnp.shape(ids))
    slots = jnp.full((devices,), n if devices == 1 else 0, jnp.int32)
    if valid is None or devices != 1:
        rows = jnp.zeros((devices,), jnp.int32)
    else:
        rows = jnp.sum(valid, dtype=jnp.int32)[None]
    return out, LookupStats(jnp.zeros((), jnp.int32), slots, rows)
