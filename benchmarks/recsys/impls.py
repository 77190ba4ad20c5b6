"""The JAX implementations of `jaxembed bench recsys`: one training step, four ways.

Every implementation runs the step `jaxembed.workloads` defines — look up and sum-pool
every feature (`pooled [B, F, H]`), `loss = sum(pooled * cotangent)`, update the tables — as
one `jax.jit` with the tables and optimizer state donated, on a 1-D mesh `("data",)` of all
devices: the bags split over it, every table's rows split over it.

| name | lookup | update |
|---|---|---|
| `jaxembed` | `collection_lookup`, `impl="auto"` (native) | `collection_update`, row-wise Adagrad |
| `jaxembed[xla]` | the same, `impl="xla"` | the same, `impl="xla"` |
| `jaxembed[rows]` | the same, `exchange="rows"` | the same, `exchange="rows"` |
| `jaxembed[mod]` | `jaxembed` with mod rows (`row_sharding="mod"`, each table rotated) | the same |
| `jaxembed[planned]`, `[mod-planned]` | `jaxembed`, `[mod]`, the exchanges planned | the same |
| `jaxembed[rows-planned]` | `row_sharding="auto"`: row sharding, exchanges planned | the same |
| `jaxembed[routed]` | the same, `exchange="routed"` (each id to its owner) | the same |
| `jaxembed[routed,mod]` | `jaxembed[routed]` with mod rows | the same |
| `jaxembed[table]`, `[columns]` | every table `"table"` (table-wise), or `"columns"` | the same |
| `jaxembed[auto]` | placements, exchanges: `plan_collection` (384 MiB, `id_stats`) | the same |
| `xla` | `jnp.take` + sum over the bag (XLA partitions it) | `optax.adagrad` (dense) |
| `flax` | one `nnx.Embed` per table + sum | `nnx.Optimizer(optax.adagrad)` |

The jaxembed tables form one stack (`jaxembed.collection.layout`); its update is row-sparse
and in place (the stack and state donated).
optax has no row-wise Adagrad, so `xla` and `flax` run the element-wise one (`s += g²`,
`w -= lr g / sqrt(s + eps)`, `s0 = 0`: what keras' does) and are checked against
`reference_steps(..., optimizer="adagrad")`. Their tables are padded to a multiple of the
device count (XLA's row split needs it); the padding rows are never read.

Each `Variant` has its abstract state and inputs (to compile before anything is allocated),
a `make_state` from the host tables, a `prepare` of a batch and a `read` of some rows of a
table and of its optimizer accumulator (for the check).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxembed import workloads as W

__all__ = ["VARIANTS", "Variant", "build_variant", "collection_variant", "dense_ids", "read_rows"]

VARIANTS = (
    "jaxembed",
    "jaxembed[xla]",
    "jaxembed[rows]",
    "jaxembed[mod]",
    "jaxembed[planned]",
    "jaxembed[mod-planned]",
    "jaxembed[rows-planned]",
    "jaxembed[routed]",
    "jaxembed[routed,mod]",
    "jaxembed[table]",
    "jaxembed[columns]",
    "jaxembed[auto]",
    "xla",
    "flax",
)
PLANNER_BUDGET = "384MiB"
"""The per-device memory `jaxembed[auto]` gives the planner (as the issue's NNX step had)."""
"""The implementations this module builds (`build_variant`)."""


@dataclasses.dataclass
class Variant:
    """One implementation of the step on one mesh.

    Attributes:
      name: one of `VARIANTS`.
      optimizer: `"rowwise_adagrad"` or `"adagrad"` (the reference it is checked against).
      mesh: its mesh.
      step: `(state, inputs, cotangent) -> (state, loss)`, to jit with the state donated.
      forward: `(state, inputs) -> pooled [B, F, H]`.
      abstract_state: the state as `ShapeDtypeStruct`s with shardings.
      make_state: `host tables -> state` (fresh device arrays).
      input_sharding: of every `ids [B, L]` input.
      read: `(state, table, rows) -> (table rows [U, H], accumulator rows [U] or [U, H])`.
      info: what to record about it (exchange, impl, ...).
      out_shardings: the step's, or None to let jit choose.
    """

    name: str
    optimizer: str
    mesh: Any
    step: Callable[..., Any]
    forward: Callable[..., Any]
    abstract_state: Any
    make_state: Callable[[Mapping[str, np.ndarray]], Any]
    input_sharding: NamedSharding
    read: Callable[[Any, str, np.ndarray], tuple[np.ndarray, np.ndarray]]
    info: dict[str, Any]
    out_shardings: Any = None

    def prepare(self, workload: W.Workload, batch: W.Batch) -> dict[str, jax.Array]:
        """A batch as device arrays: `{feature: ids [B, L]}`, -1 in the empty slots."""
        return {k: jax.device_put(v, self.input_sharding)
                for k, v in dense_ids(workload, batch).items()}  # fmt: skip

    def abstract_inputs(self, workload: W.Workload) -> tuple[Any, Any]:
        """`(inputs, cotangent)` as `ShapeDtypeStruct`s."""
        b = workload.batch_size
        ids = {f.name: jax.ShapeDtypeStruct((b, f.max_ids), jnp.int32,
                                            sharding=self.input_sharding)
               for f in workload.features}  # fmt: skip
        cot = jax.ShapeDtypeStruct((b, len(workload.features), workload.dim), jnp.float32,
                                   sharding=self.cotangent_sharding)  # fmt: skip
        return ids, cot

    @property
    def cotangent_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P("data", None, None))


def dense_ids(workload: W.Workload, batch: W.Batch) -> dict[str, np.ndarray]:
    """Each feature's bags as `ids [B, max_ids]` int32, -1 in the slots past a bag's length.

    Examples:
      >>> w = W.workload_a(batch_size=2)
      >>> ids = dense_ids(w, W.make_batch(w, seed=0, step=0))["f7"]
      >>> ids.shape, int((ids >= 0).sum()) == int(W.make_batch(w, 0, 0)["f7"][1].sum())
      ((2, 20), True)
    """
    out = {}
    for f in workload.features:
        values, lengths = batch[f.name]
        ids = np.full((workload.batch_size, f.max_ids), -1, np.int32)
        ids[np.arange(f.max_ids)[None, :] < lengths[:, None]] = values[: int(lengths.sum())]
        out[f.name] = ids
    return out


def read_rows(array: jax.Array, rows: np.ndarray) -> np.ndarray:
    """`array[rows]` on the host from its addressable shards, split over rows, columns, both
    or neither; every replica of an entry is read and must agree.

    Raises:
      ValueError: replicas that differ, or rows on no addressable shard.

    Examples:
      >>> read_rows(jnp.arange(12.0).reshape(6, 2), np.array([4, 1])).tolist()
      [[8.0, 9.0], [2.0, 3.0]]
    """
    rows = np.asarray(rows, np.int64)
    out = np.zeros((rows.size, *array.shape[1:]), array.dtype)
    seen = np.zeros(out.shape, bool)
    for shard in array.addressable_shards:
        index = tuple(shard.index) + (slice(None),) * (array.ndim - len(shard.index))
        start, stop, _ = index[0].indices(array.shape[0])
        want = np.nonzero((rows >= start) & (rows < stop))[0]
        if not want.size:
            continue
        where = (want, *index[1:])
        values = np.asarray(shard.data)[rows[want] - start]
        if np.any(seen[where] & (out[where] != values)):
            raise ValueError(f"the replicas of rows {rows[want][:5].tolist()}... differ "
                             f"(device {shard.device})")  # fmt: skip
        out[where], seen[where] = values, True
    if not seen.all():
        missing = np.unique(np.nonzero(~seen)[0])
        raise ValueError(f"rows {rows[missing][:5].tolist()} are on no addressable shard")
    return out


def _mesh(num_devices: int, axis_type: AxisType, devices: Any = None) -> Any:
    return jax.make_mesh((num_devices,), ("data",), axis_types=(axis_type,), devices=devices)


def _loss_and_grad_input(pooled: jax.Array, cot: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`sum(pooled * cot)` and d loss / d pooled (= `cot`, read through the forward so that
    the in-place update is ordered after the lookup that reads the same table)."""
    return jnp.sum(pooled * cot), jnp.where(jnp.isfinite(pooled), cot, 0.0)


# --- jaxembed ---------------------------------------------------------------------------------


def _jaxembed(workload: W.Workload, n: int, lr: float, eps: float, *, impl: str,
              exchange: str, name: str, devices: Any = None) -> Variant:  # fmt: skip
    import jaxembed
    from jaxembed.collection import FeatureConfig, TableConfig, layout_collection

    mesh = _mesh(n, AxisType.Explicit, devices)
    placement = {"jaxembed[auto]": "auto", "jaxembed[table]": "table",
                 "jaxembed[columns]": "columns"}.get(name, "rows")  # fmt: skip
    rows_by = "mod" if "mod" in name else "block"  # mod: a Zipf's hot rows spread
    if name == "jaxembed[rows-planned]":  # the planner's, from the sampled ids
        rows_by = "auto"
    tables = [TableConfig(t.name, t.rows, t.dim, placement=placement, row_sharding=rows_by)
              for t in workload.tables]  # fmt: skip
    features = [FeatureConfig(f.name, f.table, max_ids=f.max_ids) for f in workload.features]
    if (placement == "auto" or name.endswith("planned]")) and n > 1:  # one device: no plan
        from jaxembed.plan.idstats import id_stats

        # As a user would: the planner measures a few batches of the ids it will see.
        sample = [dense_ids(workload, W.make_batch(workload, seed=1, step=i)) for i in range(2)]
        # placements fixed (`[planned]`): only the exchanges are chosen, whatever they hold
        budget = PLANNER_BUDGET if placement == "auto" else "1TiB"
        plan = jaxembed.plan_collection(tables, features, mesh, batch_size=workload.batch_size,
                                        memory_per_device=budget,
                                        id_stats=id_stats(sample, features))  # fmt: skip
        # its tables carry the placement and the row sharding it chose (`plan.placements`, the
        # placement alone, would leave a table it splits by mod rows by block rows)
        tables, exchange = list(plan.table_configs), plan.exchanges
    layout = layout_collection(tables, features, mesh)
    opt = jaxembed.optim.rowwise_adagrad(lr, eps=eps)
    info = {"impl": impl, "exchange": exchange, "layout": str(layout),
            **_plan_info(layout, workload, mesh, exchange, impl)}  # fmt: skip
    return collection_variant(name, layout, mesh, opt, [f.name for f in workload.features],
                              info, impl=impl, exchange=exchange)  # fmt: skip


def collection_variant(name: str, layout: Any, mesh: Any, opt: Any, names: list[str],
                       info: dict[str, Any], **kw: Any) -> Variant:  # fmt: skip
    """The jaxembed step on a collection layout: `collection_lookup` of every feature (as
    `pooled [B, F, H]` in the batch layout), the loss, `collection_update` of every stack.

    Args:
      name: the variant's name; layout: a `jaxembed.collection` layout on `mesh` (1-D,
        `("data",)`); opt: a row-sparse optimizer with an `"accumulator"` slot; names: the
        features in the cotangent's order; info: what to record.
      **kw: for every lookup and update (`impl`, `exchange`: one or per stack).
    """
    from jaxembed.collection import collection_lookup, collection_update

    kw = {"mesh": mesh, "x_spec": P("data", None), **kw}

    def forward(state, inputs):
        out = collection_lookup(layout, state[0], inputs, **kw)
        pooled = jnp.stack([out[f] for f in names], axis=1)  # [B, F, H]
        return jax.sharding.reshard(pooled, P("data", None, None))  # the batch layout

    def step(state, inputs, cot):
        stacks, states = state
        loss, g = _loss_and_grad_input(forward(state, inputs), cot)
        grads = {f: g[:, i] for i, f in enumerate(names)}
        stacks, states = collection_update(layout, opt, stacks, states, inputs, grads, **kw)
        return (stacks, states), loss

    def sharding(s):
        return NamedSharding(mesh, s.spec)

    with jax.set_mesh(mesh):
        table_sds = {s.index: jax.ShapeDtypeStruct(s.shape, jnp.float32, sharding=sharding(s))
                     for s in layout.stacks}  # fmt: skip
        opt_sds = {s.index: jax.eval_shape(
            lambda t, s=s: opt.init(t, mesh=mesh, weight_spec=s.spec), table_sds[s.index])
            for s in layout.stacks}  # fmt: skip

    def make_state(host):
        stacks = {}
        for s in layout.stacks:
            array = np.zeros(s.shape, np.float32)
            for t in s.tables:
                p = layout.placement(t)
                array[p.stack_ids(np.arange(p.vocab_size, dtype=np.int32), s.local_rows)] = host[t]
            stacks[s.index] = jax.device_put(array, sharding(s))
            del array
        with jax.set_mesh(mesh):
            states = {s.index: opt.init(stacks[s.index], mesh=mesh, weight_spec=s.spec)
                      for s in layout.stacks}  # fmt: skip
        return stacks, states

    def read(state, table, rows):
        p = layout.placement(table)
        gid = p.stack_ids(np.asarray(rows, np.int32), layout.stacks[p.stack].local_rows)
        acc = state[1][p.stack].slots["accumulator"]
        return read_rows(state[0][p.stack], gid), read_rows(acc, gid)

    return Variant(name, "rowwise_adagrad", mesh, step, forward, (table_sds, opt_sds),
                   make_state, NamedSharding(mesh, P("data", None)), read, info)  # fmt: skip


def _plan_info(layout, workload: W.Workload, mesh, exchange: Any, impl: str) -> dict[str, Any]:
    """The exchange jaxembed's plan picks for each stack's (one) call, in the form the
    collection runs it (`[B, F, L]` stacked, or `[B, ΣL]` with lengths)."""
    import jaxembed
    from jaxembed.collection.layout import stacked_width
    from jaxembed.kernels.collection import stack_exchange

    out = {}
    for s in layout.stacks:
        feats = [f for f in workload.features if layout.placement(f.table).stack == s.index]
        width = stacked_width([f.max_ids for f in feats])
        shape, bags = ((workload.batch_size, len(feats), width), None) if width else (
            (workload.batch_size, sum(f.max_ids for f in feats)), len(feats))  # fmt: skip
        try:
            plans = [jaxembed.plan_embedding_bag(
                mesh.abstract_mesh, shape, s.shape, num_bags=bags,
                lengths_spec=P() if bags else None, x_spec=P("data", None), weight_spec=s.spec,
                exchange=stack_exchange(exchange, layout, s.index),
                impl=impl,
                update=update, optimizer_slots=(False,) if update else (),
            ) for update in (False, True)]  # fmt: skip
        except Exception as err:  # the plan is a record here, not a requirement
            out[s.name] = {"error": f"{type(err).__name__}: {err}"[:300]}
            continue
        out[s.name] = {"forward_exchange": plans[0].exchange,
                       "update_exchange": plans[1].exchange,
                       "reason": plans[1].exchange_reason}  # fmt: skip
    return {"plan": out}


# --- XLA and Flax ------------------------------------------------------------------------------


def _padded_rows(rows: int, n: int) -> int:
    return -(-rows // n) * n


def _padded(host: Mapping[str, np.ndarray], workload: W.Workload, n: int) -> dict[str, Any]:
    out = {}
    for t in workload.tables:
        rows = _padded_rows(t.rows, n)
        out[t.name] = (np.asarray(host[t.name], np.float32) if rows == t.rows else
                       np.concatenate([host[t.name], np.zeros((rows - t.rows, t.dim),
                                                              np.float32)]))  # fmt: skip
    return out


def _pool(take: Callable[[str, jax.Array], jax.Array], workload: W.Workload, inputs):
    """Sum over each bag of `take(table, ids)`, the empty slots masked: `[B, F, H]`."""
    outs = []
    for f in workload.features:
        ids = inputs[f.name]
        valid = ids >= 0
        rows = take(f.table, jnp.where(valid, ids, 0))  # [B, L, H]
        outs.append(jnp.sum(jnp.where(valid[..., None], rows, 0.0), axis=1))
    return jnp.stack(outs, axis=1)


def _tx(lr: float, eps: float) -> optax.GradientTransformation:
    return optax.adagrad(lr, initial_accumulator_value=0.0, eps=eps)


def _xla(workload: W.Workload, n: int, lr: float, eps: float) -> Variant:
    mesh = _mesh(n, AxisType.Auto)
    row = NamedSharding(mesh, P("data", None))
    tx = _tx(lr, eps)
    params_sds = {t.name: jax.ShapeDtypeStruct((_padded_rows(t.rows, n), t.dim), jnp.float32,
                                               sharding=row) for t in workload.tables}  # fmt: skip
    state_sds = (params_sds, _with_shardings(jax.eval_shape(tx.init, params_sds), mesh))

    def forward(state, inputs):
        params = state[0]
        return _pool(lambda t, ids: jnp.take(params[t], ids, axis=0, mode="clip"), workload,
                     inputs)  # fmt: skip

    def step(state, inputs, cot):
        params, opt_state = state

        def loss_fn(p):
            return jnp.sum(forward((p, None), inputs) * cot)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    def make_state(host):
        params = {k: jax.device_put(v, row) for k, v in _padded(host, workload, n).items()}
        return params, jax.device_put(tx.init(params), _shardings(state_sds[1]))

    def read(state, table, rows):
        acc = state[1][0].sum_of_squares[table]  # (ScaleByRssState, EmptyState)
        return read_rows(state[0][table], rows), read_rows(acc, rows)

    return Variant("xla", "adagrad", mesh, step, forward, state_sds, make_state, row, read,
                   {"tables": "padded to a multiple of the devices, rows split over them",
                    "optimizer": "optax.adagrad (dense, element-wise), s0 = 0"},
                   out_shardings=(_shardings(state_sds), NamedSharding(mesh, P())))  # fmt: skip


def _with_shardings(tree: Any, mesh: Any) -> Any:
    """Tables and their per-element state split by rows, scalars replicated."""
    row, rep = NamedSharding(mesh, P("data", None)), NamedSharding(mesh, P())
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                       sharding=row if x.ndim == 2 else rep),
                        tree)  # fmt: skip


def _shardings(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.sharding, tree)


def _flax(workload: W.Workload, n: int, lr: float, eps: float) -> Variant:
    from flax import nnx

    mesh = _mesh(n, AxisType.Auto)
    row = NamedSharding(mesh, P("data", None))

    class Tables(nnx.Module):
        """One `nnx.Embed` per table, initialized from `values`."""

        def __init__(self, values: Mapping[str, Any]):
            self.embeds = nnx.Dict({
                name: nnx.Embed(v.shape[0], v.shape[1], embedding_init=lambda *_, v=v: v,
                                rngs=nnx.Rngs(0))
                for name, v in values.items()
            })  # fmt: skip

        def __call__(self, inputs):
            return _pool(lambda t, ids: self.embeds[t](ids), workload, inputs)

    def build(values):
        model = Tables(values)
        return model, nnx.Optimizer(model, _tx(lr, eps), wrt=nnx.Param)

    shapes = {t.name: jax.ShapeDtypeStruct((_padded_rows(t.rows, n), t.dim), jnp.float32)
              for t in workload.tables}  # fmt: skip
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: build(shapes)))
    state_sds = _with_shardings(abstract, mesh)

    def forward(state, inputs):
        model, _ = nnx.merge(graphdef, state)
        return model(inputs)

    def step(state, inputs, cot):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(lambda m: jnp.sum(m(inputs) * cot))(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    def make_state(host):
        values = {k: jax.device_put(v, row) for k, v in _padded(host, workload, n).items()}
        state = nnx.state(build(values))
        return jax.device_put(state, _shardings(state_sds))

    def read(state, table, rows):
        model, optimizer = nnx.merge(graphdef, state)
        acc = optimizer.opt_state[0].sum_of_squares["embeds"][table]["embedding"]
        return read_rows(model.embeds[table].embedding[...], rows), read_rows(acc[...], rows)

    return Variant("flax", "adagrad", mesh, step, forward, state_sds, make_state, row, read,
                   {"module": "flax.nnx.Embed per table", "optimizer":
                    "nnx.Optimizer(optax.adagrad), s0 = 0"},
                   out_shardings=(_shardings(state_sds), NamedSharding(mesh, P())))  # fmt: skip


def build_variant(
    name: str,
    workload: W.Workload,
    num_devices: int,
    *,
    learning_rate: float = W.LEARNING_RATE,
    eps: float = W.EPS,
    devices: Any = None,
) -> Variant:
    """One implementation of the benchmark's step on the first `num_devices` devices.

    Args:
      name: one of `VARIANTS`.
      workload: the tables, features and batch size.
      num_devices: the mesh's size; the batch size must be a multiple of it.
      learning_rate, eps: the optimizer's.
      devices: the mesh's devices (default: the first `num_devices`); jaxembed's variants only.

    Returns:
      The `Variant` (nothing is allocated yet: call `make_state`).

    Raises:
      ValueError: an unknown name, too few devices, a batch that does not split.

    Examples:
      >>> v = build_variant("xla", W.workload_a(batch_size=8), 8)
      >>> v.optimizer, v.abstract_state[0]["t7"].shape     # 100 rows padded to 104
      ('adagrad', (104, 64))
    """
    if name not in VARIANTS:
        raise ValueError(f"unknown implementation {name!r}: choose from {VARIANTS}")
    if num_devices > jax.device_count():
        raise ValueError(
            f"{name}: needs {num_devices} devices, jax has {jax.device_count()}: set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={num_devices} before jax starts"
        )
    if workload.batch_size % num_devices:
        raise ValueError(f"batch size {workload.batch_size} does not split over {num_devices} "
                         f"devices: use a multiple of {num_devices}")  # fmt: skip
    lr, eps = learning_rate, eps
    if devices is not None and not name.startswith("jaxembed"):
        raise ValueError(f"{name}: devices= is for jaxembed's variants only")
    if name == "xla":
        return _xla(workload, num_devices, lr, eps)
    if name == "flax":
        return _flax(workload, num_devices, lr, eps)
    impl = "xla" if name == "jaxembed[xla]" else "auto"
    exchange = {"jaxembed[rows]": "rows", "jaxembed[routed]": "routed",
                "jaxembed[routed,mod]": "routed"}.get(name, "auto")  # fmt: skip
    return _jaxembed(
        workload, num_devices, lr, eps, impl=impl, exchange=exchange, name=name, devices=devices
    )
