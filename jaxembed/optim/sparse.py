"""`RowSparseOptimizer`: an optimizer for embedding tables whose step costs what the batch touches.

    opt = jaxembed.optim.rowwise_adagrad(learning_rate=0.05, eps=1e-8)
    state = opt.init(table)                          # laid out like the table
    emb = jaxembed.embedding(ids, table)             # forward, as usual
    g = jax.grad(loss_of_embeddings)(emb)            # d loss / d emb, [*batch, H]
    table, state = opt.update(table, state, ids, g)  # backward + update, fused

`update` takes the same ids and keyword arguments as `jaxembed.embedding` (and, for bags, as
`jaxembed.embedding_bag`: then `out_grad` is the pooled gradient). Under `jax.jit` with the
table and state donated they are updated in place: no table-sized buffer, no copy, provided
XLA can order the step's reads of the old table first. When `out_grad` does not depend on the
forward (a linear loss, a fixed cotangent) say what read it: `opt.update(..., after=emb)`
(`after`); the training helpers do it for you.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxembed.ids import as_ids
from jaxembed.kernels.arrays import (
    eager,
    is_explicit,
    move,
    resolve_mesh,
    stated_spec,
    typed_like,
    whole_on_one_device,
)
from jaxembed.kernels.bag import Bags, prepare_bags
from jaxembed.kernels.common import (
    UpdateStats,
    check_table,
    companion_spec,
    cotangent_spec,
    resolve_layouts,
)
from jaxembed.kernels.options import LookupOptions
from jaxembed.kernels.update import after as after
from jaxembed.kernels.update import sparse_update, update_body
from jaxembed.optim.formulas import RowFormula
from jaxembed.plan import EmbeddingPlan, plan_embedding, plan_embedding_bag
from jaxembed.ragged import check_weights_allowed

__all__ = ["RowSparseOptimizer", "RowSparseState", "after"]


class RowSparseState(NamedTuple):
    """A table's optimizer state: laid out like the table (per-row slots: like its rows).

    Attributes:
      count: int32[], the updates applied so far (schedules and Adam's bias correction).
      slots: the state arrays by name (`accumulator`, `mu`, `nu`, `linear`), f32 `[V, H]`
        or, for one-per-row slots, `[V]`.
      routed_fallbacks: int32[], the steps whose routed exchange overflowed its capacity
        and ran the exact gather exchange instead.
    """

    count: jax.Array
    slots: dict[str, jax.Array]
    routed_fallbacks: jax.Array


_BAG_ARGS = ("lengths", "offsets", "per_id_weights", "combiner", "include_last_offset")


@dataclasses.dataclass(frozen=True)
class RowSparseOptimizer:
    """A row-sparse optimizer: `init` its state, `update` a table from a batch's gradient.

    Build one with `jaxembed.optim.sgd`, `adagrad`, `fbgemm_adagrad`, `rowwise_adagrad`, `adam`,
    `partial_rowwise_adam` or `ftrl`.

    Attributes:
      formula: the per-row update (`jaxembed.optim.formulas.RowFormula`).
    """

    formula: RowFormula

    @property
    def name(self) -> str:
        return self.formula.name

    def init(self, table: jax.Array, *, mesh: Any = None, weight_spec: P | None = None):
        """The initial state of `table`, laid out like it.

        Args:
          table: the table `[V, H]` (concrete, or traced in an Explicit mesh).
          mesh: the mesh; default `jax.set_mesh`'s, else the table's own.
          weight_spec: the table's layout where it cannot be read (a traced table in an
            Auto mesh).

        Returns:
          A `RowSparseState` with `count` 0 and every slot at its initial value.

        Raises:
          ValueError: a traced table in an Auto mesh without `weight_spec`.
        """
        check_table(table)
        num_rows, hidden = table.shape
        mesh = resolve_mesh(mesh, table)
        arrays = {s.name: jnp.full(s.shape(num_rows, hidden), s.init, jnp.float32)
                  for s in self.formula.slots}  # fmt: skip
        count, fallbacks = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)
        if mesh is None:  # two buffers: a donated state must not hold one twice
            return RowSparseState(count, arrays, fallbacks)
        spec = weight_spec if weight_spec is not None else stated_spec(table, mesh)
        if spec is None:
            if isinstance(table, jax.core.Tracer):
                raise ValueError(
                    "opt.init: the table is traced in an Auto mesh, where its layout cannot be "
                    "read: pass weight_spec=PartitionSpec(...)"
                )
            spec = P()
        spec = P(*tuple(spec) + (None,) * (2 - len(tuple(spec))))
        placed = {}
        for s in self.formula.slots:
            placed[s.name] = _place(arrays[s.name], mesh, P(spec[0]) if s.per_row else spec)
        return RowSparseState(_place(count, mesh, P()), placed, _place(fallbacks, mesh, P()))

    def update(
        self,
        table: jax.Array,
        state: RowSparseState,
        x: Any,
        out_grad: jax.Array,
        *,
        padding_idx: int | None = None,
        vocab_size: int | None = None,
        mesh: Any = None,
        x_spec: P | None = None,
        weight_spec: P | None = None,
        out_spec: P | None = None,
        exchange: str = "auto",
        gradient_exchange: str | None = None,
        row_sharding: str = "block",
        capacity: int | None = None,
        capacity_factor: float | None = None,
        impl: str = "auto",
        lengths: jax.Array | None = None,
        offsets: jax.Array | None = None,
        per_id_weights: jax.Array | None = None,
        combiner: str | None = None,
        include_last_offset: bool = False,
        x_hint: P | None = None,
        after: Any = None,
        routed_pool: str = "auto",
        return_stats: bool = False,
    ) -> Any:
        """Applies one step to the rows the batch touched: backward and update in one kernel.

        The gradients of duplicate ids (within a bag, across bags, across devices) are summed
        first, then every touched row gets exactly one update; untouched rows and their state
        are left bitwise as they were; ids out of range or equal to `padding_idx` contribute
        nothing.

        Args:
          table: the table, as passed to the lookup.
          state: this optimizer's state of the table.
          x: the ids the lookup read (for bags: any `jaxembed.embedding_bag` input form).
          out_grad: d loss / d output of the lookup, in its output's layout (for bags: the
            pooled `[B, H]` gradient).
          padding_idx, vocab_size, mesh, x_spec, weight_spec, out_spec, row_sharding,
            capacity, capacity_factor, impl: the lookup's arguments (see
            `jaxembed.embedding`).
          exchange: `"auto"` (the cost model's choice), `"rows"`, `"routed"` or `"dense"`
            (a `psum` of the gradient shard and of each row's count of slots over the batch
            axes, then every device updates the rows any batch read: for tables small beside
            the batch; not for max-pooled bags).
          gradient_exchange: the old name of `exchange`.
          lengths, offsets, per_id_weights, combiner, include_last_offset: the bag lookup's
            arguments; any of them makes this a bag update.
          x_hint: a layout for the ids used where it divides (as the Flax modules' lookups).
          after: what the step read from the old table (the lookup's output, or the loss):
            the update then writes in place only after it (`jaxembed.optim.sparse.after`).
            Pass it when `out_grad` does not depend on the forward (a linear loss, a fixed
            cotangent): without it XLA may copy the whole donated table every step.
          routed_pool: where the routed exchange pools a sum-like bag (`"auto"`,
            `"source"`, `"owner"`; see `jaxembed.plan_embedding_bag`).
          return_stats: also return `jaxembed.UpdateStats`: the distinct rows each device
            updated (one scatter of flags over its shard's rows to count them) and the
            routed exchange's fallback.

        Returns:
          `(table, state)`, in their own layouts; `(table, state, stats)` with
          `return_stats`.

        Raises:
          ValueError: as the lookup, and `exchange="dense"`.
        """
        if after is not None:  # the in-place write waits for the step's reads of the table
            out_grad = _order_after(out_grad, after)
        check_table(table)
        is_bag = (
            any(v is not None for v in (lengths, offsets, per_id_weights, combiner))
            or include_last_offset
        )
        options = LookupOptions(
            padding_idx=padding_idx, vocab_size=vocab_size, mesh=mesh, x_spec=x_spec,
            weight_spec=weight_spec, out_spec=out_spec,
            exchange=exchange if gradient_exchange is None else gradient_exchange,
            row_sharding=row_sharding, capacity=capacity, capacity_factor=capacity_factor,
            impl=impl, combiner=(combiner or "sum") if is_bag else None,
            include_last_offset=include_last_offset, x_hint=x_hint, function="opt.update",
            routed_pool=routed_pool, return_stats=return_stats,
        )  # fmt: skip
        bags = None
        if is_bag:
            bags = prepare_bags(x, lengths, offsets, per_id_weights, include_last_offset)
        return self._update(table, state, x, bags, out_grad, options)

    def _update(
        self,
        table: jax.Array,
        state: RowSparseState,
        x: Any,
        bags: Bags | None,
        out_grad: jax.Array,
        options: LookupOptions,
    ) -> Any:
        """`update` with its keywords as one `LookupOptions` (`bags`: `prepare_bags`'s, or
        None for a lookup that pools nothing)."""
        if bags is not None:
            operands, ids = bags.operands(), bags.ids
            check_weights_allowed(options.combiner, bags.weights is not None)
        else:
            ids = as_ids(x)
            operands = (ids,)
        mesh = resolve_mesh(options.mesh, table, ids)
        x_spec, weight_spec = options.x_spec, options.weight_spec
        if mesh is None or (mesh.size == 1 and x_spec is None and weight_spec is None):
            return self._local(table, state, ids, bags, operands, out_grad, options)
        weight_spec, x_spec = resolve_layouts(ids, table, mesh, **options.layout_kwargs())
        if weight_spec is None:
            raise ValueError(
                "opt.update: the table is traced in an Auto mesh and its layout is unknown; the "
                "row-sparse update runs in the table's layout: pass weight_spec=PartitionSpec(...)"
            )
        plan = self._plan(mesh, ids, table, bags, options, x_spec, weight_spec,
                          options.out_spec, options.exchange)  # fmt: skip
        _check_out_grad(plan, out_grad, bags)
        if ids.size == 0:  # no id touched a row: the table and its slots are unchanged
            slots = tuple(state.slots[s.name] for s in self.formula.slots)
            zero = jnp.zeros((), jnp.int32)
            return self._result(table, state, slots, zero, jnp.zeros(mesh.size, jnp.int32),
                                options)  # fmt: skip
        operands = tuple(
            move(a, mesh, op.given) if not isinstance(a, jax.core.Tracer) else a
            for a, op in zip(operands, plan.operands, strict=True)
        )
        ct_spec = cotangent_spec(plan)
        out_grad = move(out_grad, mesh, ct_spec)
        slots = tuple(state.slots[s.name] for s in self.formula.slots)
        run = _sparse_update_jit if eager(table, slots, operands, out_grad) else sparse_update
        (new_table, new_slots), overflow, rows = run(
            plan, self.formula, mesh, table, slots, state.count, operands, out_grad, ct_spec,
            options.return_stats,
        )  # fmt: skip
        return self._result(new_table, state, new_slots, overflow, rows, options)

    def _result(self, table, state, slots, overflow, rows, options) -> Any:
        new = (table, self._state(state, slots, overflow))
        return (*new, UpdateStats(overflow, rows)) if options.return_stats else new

    def local_update(
        self,
        table: jax.Array,
        state: RowSparseState,
        x: jax.Array,
        out_grad: jax.Array,
        *,
        lengths: jax.Array | None = None,
        per_id_weights: jax.Array | None = None,
        combiner: str | None = None,
        impl: str = "auto",
        return_stats: bool = False,
    ) -> Any:
        """`update` of one device's arrays as they are, with no mesh and no collective: the
        body of a caller's own `shard_map` (a table-wise collection's owner updating the
        table it holds whole), or an unsharded update.

        Args:
          table, state: one device's table (or shard) and its state.
          x: ids into `table`'s rows (negative: empty slots).
          out_grad: d loss / d output of the lookup of `x` (pooled `[..., H]` for bags).
          lengths, per_id_weights, combiner: the bag's, as `update` takes them.
          impl: `"auto"`, `"native"` or `"xla"`.
          return_stats: also return `UpdateStats` (rows: int32[1], the distinct rows updated).

        Returns:
          `(table, state)`; `(table, state, stats)` with `return_stats`.
        """
        is_bag = any(v is not None for v in (lengths, per_id_weights, combiner))
        options = LookupOptions(impl=impl, combiner=(combiner or "sum") if is_bag else None,
                                function="opt.local_update", return_stats=return_stats)  # fmt: skip
        bags = prepare_bags(x, lengths, None, per_id_weights, False) if is_bag else None
        ids = bags.ids if is_bag else as_ids(x)
        operands = bags.operands() if is_bag else (ids,)
        return self._local(table, state, ids, bags, operands, out_grad, options)

    def _local(self, table, state, ids, bags, operands, out_grad, options):
        """The update on one device: the arrays whole, no collective."""
        plan = self._plan(AbstractMesh((1,), ("_",)), ids, table, bags, options, P(), P(),
                          None, "auto")  # fmt: skip
        _check_out_grad(plan, out_grad, bags)
        slots = tuple(state.slots[s.name] for s in self.formula.slots)
        if ids.size == 0:
            zero = jnp.zeros((), jnp.int32)
            return self._result(table, state, slots, zero, zero[None], options)
        whole = [whole_on_one_device(a) for a in (table, *slots, *operands, out_grad)]
        (new_table, new_slots), overflow, rows = update_body(
            plan, self.formula, len(slots), whole[0], *whole[1 : 1 + len(slots)],
            state.count, *whole[1 + len(slots) :], count_rows=options.return_stats,
        )  # fmt: skip
        new_table = typed_like(new_table, table)
        new_slots = tuple(typed_like(n, o) for n, o in zip(new_slots, slots, strict=True))
        return self._result(new_table, state, new_slots, overflow, rows, options)

    def _plan(self, mesh, ids, table, bags, options, x_spec, weight_spec, out_spec,
              exchange) -> EmbeddingPlan:  # fmt: skip
        common = dict(
            x_spec=x_spec, weight_spec=weight_spec, out_spec=out_spec, exchange=exchange,
            dtype=table.dtype, ids_dtype=ids.dtype, update=True, **options.plan_kwargs(),
        )  # fmt: skip
        if bags is None:
            return plan_embedding(mesh, ids.shape, table.shape, **common)
        return plan_embedding_bag(
            mesh, ids.shape, table.shape,
            num_bags=None if bags.lengths is None else bags.lengths.shape[-1],
            combiner=options.combiner, weighted=bags.weights is not None,
            lengths_spec=companion_spec(bags.lengths, mesh, x_spec) if x_spec else None,
            weights_spec=companion_spec(bags.weights, mesh, x_spec) if x_spec else None,
            routed_pool=options.routed_pool, **common,
        )  # fmt: skip

    def _state(self, state: RowSparseState, slots, overflow) -> RowSparseState:
        names = [s.name for s in self.formula.slots]
        return RowSparseState(
            state.count + 1, dict(zip(names, slots, strict=True)),
            state.routed_fallbacks + overflow,
        )  # fmt: skip

    def plan(self, *args, **kwargs) -> EmbeddingPlan:
        """`jaxembed.plan_embedding(..., update=True)` (or `plan_embedding_bag` when `num_bags`
        or `combiner` is given): the collectives and exchange `update` runs."""
        slots = tuple(s.per_row for s in self.formula.slots)
        if "combiner" in kwargs or "num_bags" in kwargs:
            return plan_embedding_bag(*args, update=True, optimizer_slots=slots, **kwargs)
        return plan_embedding(*args, update=True, optimizer_slots=slots, **kwargs)


def _place(a: jax.Array, mesh: Any, spec: P) -> jax.Array:
    """Puts a fresh state array in `spec` (outside jit: device_put; inside: the mesh's way)."""
    if isinstance(mesh, jax.sharding.Mesh) and not isinstance(a, jax.core.Tracer):
        return jax.device_put(a, NamedSharding(mesh, spec))
    if is_explicit(mesh):
        return jax.sharding.reshard(a, spec)
    return move(a, mesh, spec)


def _check_out_grad(plan: EmbeddingPlan, out_grad: Any, bags: Any) -> None:
    """The output gradient must have the lookup's output shape."""
    want = (*plan.out_batch_shape, plan.weight_shape[1])
    got = tuple(getattr(out_grad, "shape", ()))
    if got == want:
        return
    hint = ""
    if bags is None and len(got) == len(want) - 1:
        hint = (
            "; a pooled gradient (of `embedding_bag`) needs the bag's arguments as the lookup "
            "got them (combiner=, lengths=, offsets=, per_id_weights=)"
        )
    raise ValueError(
        f"opt.update: out_grad has shape {got}, but the lookup's output has shape {want} "
        f"({'bags' if bags is not None else 'ids'} {plan.x_shape}, hidden "
        f"{plan.weight_shape[1]}): pass the gradient of the lookup's output{hint}"
    )


# `update`'s `after=` keyword shadows `after` inside it.
_order_after = after

# An eager update: one compiled program rather than a `shard_map` run op by op.
_sparse_update_jit = jax.jit(sparse_update, static_argnums=(0, 1, 2, 8, 9))
