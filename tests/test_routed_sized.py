"""The planner sizes a routed call's capacity from the ids it samples (`id_stats`).

A batch's ids repeat (a Zipf's head): each device sends an owner far fewer distinct ids than
slots. The default capacity assumes every slot a distinct id; the planner sizes it for the
distinct ids the busiest owner expects (from each sampled id's slot count), carries the
factor in the plan's exchange (`"routed:source:0.0794"`), and the collection's lookup and
update run with it: smaller buffers, the same numbers (float64 reference), and a batch that
overflows the sized capacity still exact through the fallback.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bag_reference import embedding_bag_reference
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed
from jaxembed import hlo
from jaxembed.collection import FeatureConfig, TableConfig, collection_update, layout_collection
from jaxembed.kernels import native
from jaxembed.kernels.collection import collection_lookup
from jaxembed.optim import reference
from jaxembed.plan.collection import plan_collection
from jaxembed.plan.idstats import id_stats
from jaxembed.plan.routed import capacity_for

N = 8
B = 512
TABLES = [
    TableConfig("item", 40_000, 16, placement="rows", row_sharding="mod"),
    TableConfig("shop", 9_000, 16, placement="rows", row_sharding="mod"),
]
FEATURES = [
    FeatureConfig("clicked", "item", "sum", 12),
    FeatureConfig("viewed", "item", "sum", 12),
    FeatureConfig("shops", "shop", "sum", 8),
]


def zipf_batch(rng, batch=B):
    """Zipf ids (a = 1.2) over each table, a quarter of the slots empty."""
    vocab = {t.name: t.vocab_size for t in TABLES}
    out = {}
    for f in FEATURES:
        ids = (rng.zipf(1.2, (batch, f.max_ids)) - 1) % vocab[f.table]
        ids[rng.random(ids.shape) < 0.25] = -1
        out[f.name] = ids.astype(np.int32)
    return out


def planned(rng):
    stats = id_stats([zipf_batch(rng) for _ in range(3)], FEATURES)
    mesh = jax.make_mesh((N,), ("data",))
    kw = dict(batch_size=B, memory_per_device="64MiB", backend="cpu")
    return mesh, plan_collection(TABLES, FEATURES, mesh, id_stats=stats, **kw)


def busiest_owner(layout, batch, pooled_at_owner):
    """The most a device sends one owner in `batch`: distinct ids (pooled at the source) or
    slots (at the owner), counted in numpy from the layout's own row placement."""
    (stack,) = layout.stacks
    most = 0
    size = len(next(iter(batch.values())))
    for d in range(N):
        rows = []
        for f in FEATURES:
            ids = batch[f.name][d * size // N : (d + 1) * size // N]
            ids = ids[ids >= 0]
            rows.append(np.asarray(layout.placement(f.table).stack_ids(ids, stack.local_rows)))
        rows = np.concatenate(rows)
        if not pooled_at_owner:
            rows = np.unique(rows)
        most = max(most, int(np.bincount(rows // stack.local_rows, minlength=N).max()))
    return most


def test_the_planner_sizes_the_route_for_the_distinct_ids_it_expects():
    rng = np.random.default_rng(0)
    mesh, plan = planned(rng)
    (call,) = plan.calls
    routed = call.plan.routed
    assert call.exchange == "routed" and call.capacity_factor is not None, call.note
    assert plan.exchanges == {0: f"routed:{call.routed_pool}:{call.capacity_factor:g}"}
    assert not routed.pooled_at_owner  # the distinct ids travel: far fewer than the slots
    mean = routed.slots / routed.num_buckets
    assert routed.capacity == int(np.ceil(call.capacity_factor * mean))
    default = capacity_for(routed.slots, routed.num_buckets, None, None)
    assert routed.capacity < 0.5 * default, (routed.capacity, default)
    assert "from the ids" in call.note
    # Fresh batches: the busiest owner fits, and the size is not loose (within 1.5x).
    layout = layout_collection(plan.table_configs, FEATURES, mesh)
    counts = [busiest_owner(layout, zipf_batch(rng), False) for _ in range(4)]
    assert max(counts) <= routed.capacity < 1.5 * min(counts), (counts, routed.capacity)
    # Its buffers are smaller than the default capacity's, so the plan prices it cheaper.
    unsized = plan_collection(TABLES, FEATURES, mesh, batch_size=B, memory_per_device="64MiB",
                              backend="cpu")  # fmt: skip
    assert unsized.calls[0].capacity_factor is None
    assert call.forward_bytes < unsized.calls[0].forward_bytes


def test_a_sample_smaller_than_a_devices_share_is_extrapolated():
    """Sampled batches of 64 examples, a plan for 4096 (512 a device): a device sees more
    distinct ids than a sampled batch holds, so the planner sizes from the duplication model
    (which extrapolates), not from the sample's own ids; the real busiest owner fits."""
    rng = np.random.default_rng(4)
    stats = id_stats([zipf_batch(rng, 64) for _ in range(3)], FEATURES)
    mesh = jax.make_mesh((N,), ("data",))
    plan = plan_collection(TABLES, FEATURES, mesh, batch_size=4096, memory_per_device="1GiB",
                           backend="cpu", id_stats=stats)  # fmt: skip
    (call,) = plan.calls
    assert call.exchange == "routed", call.note
    layout = layout_collection(plan.table_configs, FEATURES, mesh)
    most = max(busiest_owner(layout, zipf_batch(rng, 4096), call.plan.routed.pooled_at_owner)
               for _ in range(2))  # fmt: skip
    assert most <= call.plan.routed.capacity, (most, call.plan.routed.capacity, call.note)


def reference_step(tables, batch, cts, opt):
    """Float64: each feature's pooled sum, and each table and its accumulator after one
    row-wise Adagrad step."""
    out = {f.name: embedding_bag_reference(tables[f.table], batch[f.name], combiner="sum",
                                           vocab_size=tables[f.table].shape[0])
           for f in FEATURES}  # fmt: skip
    new, accumulators = {}, {}
    for name, table in tables.items():
        ids, grads = [], []
        for f in FEATURES:
            if f.table == name:
                x = batch[f.name]
                for b, j in zip(*np.nonzero(x >= 0), strict=True):
                    ids.append(x[b, j])
                    grads.append(cts[f.name][b])
        states = reference.init_states(opt.formula, *table.shape)
        new[name], (accumulators[name],) = reference.sparse_step(
            opt.formula, table, states, np.asarray(ids), np.asarray(grads), count=0
        )
    return out, new, accumulators


@pytest.mark.parametrize("impl", ["native", "xla"])
@pytest.mark.parametrize("sized", ["planned", "overflowing"])
def test_a_sized_route_matches_float64_and_overflows_exactly(sized, impl):
    if impl == "native" and not native.available():
        pytest.skip(f"native kernels unavailable: {native.why_unavailable()}")
    rng = np.random.default_rng(1)
    mesh, plan = planned(rng)
    exchange = dict(plan.exchanges)
    if sized == "overflowing":  # capacity 1: every step runs the gather exchange instead
        exchange = {0: re.sub(r":[0-9.e-]+$", ":1e-06", exchange[0])}
    layout = layout_collection(plan.table_configs, FEATURES, mesh)
    (stack,) = layout.stacks
    host = {t.name: rng.normal(size=(t.vocab_size, t.dim)) for t in TABLES}
    array = np.zeros(stack.shape, np.float32)
    for t in TABLES:
        p = layout.placement(t.name)
        array[np.asarray(p.stack_ids(np.arange(t.vocab_size), stack.local_rows))] = host[t.name]
    table = jax.device_put(array, NamedSharding(mesh, stack.spec))
    batch = zipf_batch(rng)
    ids = {k: jax.device_put(v, NamedSharding(mesh, P("data", None))) for k, v in batch.items()}
    cts = {f.name: rng.normal(size=(B, 16)).astype(np.float32) for f in FEATURES}
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    kw = dict(mesh=mesh, exchange=exchange, return_stats=True, impl=impl)

    def step(stacks, states, ids, cts):
        out, looked = collection_lookup(layout, stacks, ids, **kw)
        stacks, states, updated = collection_update(layout, opt, stacks, states, ids, cts, **kw)
        return out, stacks, states, looked, updated

    with jax.set_mesh(mesh):
        states = {0: opt.init(table, mesh=mesh, weight_spec=stack.spec)}
        compiled = jax.jit(step).lower({0: table}, states, ids, cts).compile()
        out, stacks, states, looked, updated = compiled({0: table}, states, ids, cts)
    (name,) = looked
    fell_back = sized == "overflowing"
    assert bool(looked[name].routed_fallback) == fell_back
    assert bool(updated[name].routed_fallback) == fell_back
    want_out, want_tables, want_acc = reference_step(host, batch, cts, opt)
    for f in FEATURES:
        np.testing.assert_allclose(out[f.name], want_out[f.name], rtol=1e-5, atol=1e-5,
                                   err_msg=f.name)  # fmt: skip
    got = np.asarray(stacks[0])
    for t in TABLES:
        rows = np.asarray(layout.placement(t.name).stack_ids(np.arange(t.vocab_size),
                                                             stack.local_rows))  # fmt: skip
        np.testing.assert_allclose(got[rows], want_tables[t.name], rtol=1e-5, atol=1e-5,
                                   err_msg=t.name)  # fmt: skip
        acc = np.asarray(states[0].slots["accumulator"])[rows]
        np.testing.assert_allclose(acc, want_acc[t.name], rtol=1e-5, atol=1e-6, err_msg=t.name)
    # The all_to_all of ids carries the sized capacity: [n, C] a device.
    (call,) = plan.calls
    c = 1 if fell_back else call.plan.routed.capacity
    shapes = [s for x in hlo.collectives(compiled.as_text()) if x.kind == "all-to-all"
              for s in x.result_shape]  # fmt: skip
    assert {(N, c), (1, c)} & set(shapes), (shapes, c)  # the ids to their owners (XLA may
    # split the all_to_all into one array per peer)


def test_a_plan_exchange_with_a_bad_factor_names_the_fix():
    mesh = jax.make_mesh((N,), ("data",))
    layout = layout_collection(TABLES, FEATURES, mesh)
    (stack,) = layout.stacks
    table = jnp.zeros(stack.shape, jnp.float32)
    batch = {k: jnp.asarray(v) for k, v in zipf_batch(np.random.default_rng(2), 16).items()}
    with pytest.raises(ValueError, match=r"'routed:source:big'.*not a capacity factor"):
        collection_lookup(layout, {0: table}, batch, mesh=mesh,
                          exchange={0: "routed:source:big"})  # fmt: skip


def test_the_nnx_collection_runs_the_planned_capacity():
    """`EmbeddingBagCollection(placements=plan)` looks up with the plan's sized exchange."""
    from flax import nnx

    import jaxembed.nnx

    rng = np.random.default_rng(3)
    mesh, plan = planned(rng)
    batch = {k: jax.device_put(v, NamedSharding(mesh, P("data", None)))
             for k, v in zipf_batch(rng).items()}  # fmt: skip
    with jax.set_mesh(mesh):
        coll = jaxembed.nnx.EmbeddingBagCollection(TABLES, FEATURES, placements=plan,
                                                   rngs=nnx.Rngs(0))  # fmt: skip
        assert coll.exchange == plan.exchanges
        graphdef, state = nnx.split(coll)
        lookup = jax.jit(lambda s, b: nnx.merge(graphdef, s)(b))
        out = lookup(state, batch)
        text = lookup.lower(state, batch).compile().as_text()
        tables = {k: np.asarray(v, np.float64) for k, v in coll.tables().items()}
    (call,) = plan.calls
    c = call.plan.routed.capacity
    shapes = [s for x in hlo.collectives(text) if x.kind == "all-to-all" for s in x.result_shape]
    assert {(N, c), (1, c)} & set(shapes), (shapes, c)
    # the planned bytes are the compiled lookup's, its fallback compiled beside it (a cond)
    want = call.forward_bytes + call.fallback_forward_bytes + call.out_move_bytes[0]
    assert hlo.total_wire_bytes(text) == want
    got = {k: np.asarray(v) for k, v in out.items()}
    ids = {k: np.asarray(v) for k, v in batch.items()}
    for f in FEATURES:
        want = embedding_bag_reference(tables[f.table], ids[f.name], combiner="sum",
                                       vocab_size=tables[f.table].shape[0])  # fmt: skip
        np.testing.assert_allclose(got[f.name], want, rtol=1e-5, atol=1e-5, err_msg=f.name)
