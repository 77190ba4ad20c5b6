"""`LookupStats` counts each device's work: the id slots its lookup walked, the rows it read.

Checked against numpy on 8 devices: the gather exchange pools every slot of the batch on
every device and reads a row for each slot it owns; the routed exchange pools a device's own
slots (G/n) and reads one row per distinct id per source; a step that overflows counts the gather exchange it ran instead; one device walks
the batch once.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed

V, H, B, L, N = 64, 4, 16, 6, 8


def _setup(seed=0, skew=False):
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(V, H)).astype(np.float32)
    ids = rng.integers(-1, V, (B, L)).astype(np.int32)
    if skew:
        ids = rng.integers(0, V // N, (B, L)).astype(np.int32)  # every id on device 0
    mesh = jax.make_mesh((N,), ("x",))
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    return mesh, table, ids, put(table, P("x", None)), put(ids, P("x"))


def _owned(ids):
    """Per device, the ids of `ids` whose row it holds (block row sharding)."""
    valid = ids[ids >= 0]
    return [valid[valid // (V // N) == d] for d in range(N)]


@pytest.mark.parametrize("bag", [False, True])
def test_gather_exchange_walks_the_whole_batch_everywhere(bag):
    mesh, _, ids, t, x = _setup()
    fn = jaxembed.embedding_bag if bag else jaxembed.embedding
    with jax.set_mesh(mesh):
        _, stats = jax.jit(lambda t, x: fn(x, t, exchange="rows", return_stats=True))(t, x)
    assert stats.slots.shape == stats.rows.shape == (N,)
    np.testing.assert_array_equal(stats.slots, np.full(N, ids.size))
    np.testing.assert_array_equal(stats.rows, [len(o) for o in _owned(ids)])
    assert int(stats.routed_fallback) == 0


@pytest.mark.parametrize("bag", [False, True])
def test_routed_exchange_walks_a_share(bag):
    mesh, _, ids, t, x = _setup()
    fn = jaxembed.embedding_bag if bag else jaxembed.embedding
    with jax.set_mesh(mesh):
        plan = (jaxembed.plan_embedding_bag if bag else jaxembed.plan_embedding)(
            mesh, ids.shape, (V, H), x_spec=P("x"), weight_spec=P("x", None),
            exchange="routed", capacity_factor=4.0)  # fmt: skip
        pool = {"routed_pool": "source"} if bag else {}  # the owner pools: its own test file
        _, stats = jax.jit(lambda t, x: fn(x, t, exchange="routed", capacity_factor=4.0,
                                           return_stats=True, **pool))(t, x)  # fmt: skip
    assert int(stats.routed_fallback) == 0
    assert plan.routed.num_buckets == N
    np.testing.assert_array_equal(stats.slots, np.full(N, ids.size // N))  # its own: G / n
    # Device d reads, for each source s, the distinct ids of s's slots that d owns.
    blocks = ids.reshape(N, -1)
    want = np.zeros(N, int)
    for s in range(N):
        for d, owned in enumerate(_owned(blocks[s])):
            want[d] += len(np.unique(owned))
    np.testing.assert_array_equal(stats.rows, want)
    assert stats.rows.sum() <= ids.size


def test_overflow_counts_the_gather_it_ran():
    mesh, table, ids, t, x = _setup(skew=True)
    with jax.set_mesh(mesh):
        out, stats = jax.jit(lambda t, x: jaxembed.embedding_bag(
            x, t, exchange="routed", capacity=1, return_stats=True))(t, x)  # fmt: skip
    assert int(stats.routed_fallback) == 1
    np.testing.assert_array_equal(stats.slots, np.full(N, ids.size))
    np.testing.assert_array_equal(stats.rows, [len(o) for o in _owned(ids)])
    want = np.asarray(table, np.float64)[ids].sum(1)  # exact through the fallback
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-5, atol=1e-6)


def test_one_device_walks_the_batch_once():
    _, table, ids, _, _ = _setup()
    _, stats = jaxembed.embedding_bag(jnp.asarray(ids), jnp.asarray(table), return_stats=True)
    assert stats.slots.tolist() == [ids.size] and stats.rows.tolist() == [int((ids >= 0).sum())]
    lookup = jax.jit(lambda x, t: jaxembed.embedding(x, t, return_stats=True))  # -1: zero rows
    _, stats = lookup(jnp.asarray(ids), jnp.asarray(table))
    assert stats.slots.tolist() == [ids.size] and stats.rows.tolist() == [int((ids >= 0).sum())]


def test_collection_counts_per_stack():
    from jaxembed.collection import FeatureConfig, TableConfig, collection_lookup, layout_collection

    mesh = jax.make_mesh((N,), ("x",))
    tables = [TableConfig("a", 64, 8, placement="rows"), TableConfig("b", 32, 8, placement="rows")]
    features = [FeatureConfig("fa", "a", max_ids=4), FeatureConfig("fb", "b", max_ids=2),
                FeatureConfig("fm", "a", combiner="max", max_ids=3)]  # fmt: skip
    layout = layout_collection(tables, features, mesh)
    rng = np.random.default_rng(0)
    batch = {"fa": rng.integers(0, 64, (B, 4)), "fb": rng.integers(0, 32, (B, 2)),
             "fm": rng.integers(0, 64, (B, 3))}  # fmt: skip
    data = NamedSharding(mesh, P("x"))
    batch = {k: jax.device_put(v.astype(np.int32), data) for k, v in batch.items()}
    stacks = {s.index: jax.device_put(jnp.zeros(s.shape), NamedSharding(mesh, s.spec))
              for s in layout.stacks}  # fmt: skip
    with jax.set_mesh(mesh):
        _, stats = jax.jit(lambda st, b: collection_lookup(
            layout, st, b, exchange="rows", return_stats=True))(stacks, batch)  # fmt: skip
    (name,) = stats  # one stack: same dim, both by rows
    # Two calls (sum, max), each gathered to every device: every slot walked everywhere.
    slots = B * (4 + 2) + B * 3
    np.testing.assert_array_equal(stats[name].slots, np.full(N, slots))
    assert int(stats[name].rows.sum()) == slots  # every slot read once, by its owner


def _distinct_owned(ids):
    """Per device, the distinct rows of `ids` it holds: the rows its update writes."""
    return [len(np.unique(o)) for o in _owned(ids)]


@pytest.mark.parametrize("exchange", ["rows", "routed"])
@pytest.mark.parametrize("bag", [False, True])
def test_update_counts_the_distinct_rows_each_device_writes(exchange, bag):
    mesh, table, ids, t, x = _setup(seed=1)
    opt = jaxembed.optim.sgd(0.1)
    state = opt.init(t)
    out_grad = np.ones((B, H) if bag else (B, L, H), np.float32)
    kw = {"combiner": "sum"} if bag else {}

    def step(t, state, x, g):
        return opt.update(t, state, x, g, exchange=exchange, capacity_factor=4.0,
                          return_stats=True, **kw)  # fmt: skip

    with jax.set_mesh(mesh):
        g = jax.device_put(out_grad, NamedSharding(mesh, P("x")))
        new, _, stats = jax.jit(step)(t, state, x, g)
    np.testing.assert_array_equal(stats.rows, _distinct_owned(ids))
    # The counted rows are the rows that changed, and no other.
    changed = np.any(np.asarray(new) != table, axis=1).reshape(N, -1).sum(1)
    np.testing.assert_array_equal(changed, _distinct_owned(ids))
    # One device: the whole table's distinct rows, once.
    _, _, one = opt.update(jnp.asarray(table), opt.init(jnp.asarray(table)), jnp.asarray(ids),
                           jnp.asarray(out_grad), return_stats=True, **kw)  # fmt: skip
    np.testing.assert_array_equal(one.rows, [len(np.unique(ids[ids >= 0]))])


def test_collection_update_counts_table_wise_and_row_wise_stacks():
    from jaxembed.collection import FeatureConfig, TableConfig, collection_update, layout_collection

    mesh = jax.make_mesh((N,), ("x",))
    tables = [TableConfig("a", 64, 8, placement="rows")] + [
        TableConfig(f"t{i}", 16, 4, placement="table") for i in range(N)
    ]
    features = [FeatureConfig("fa", "a", max_ids=4)] + [
        FeatureConfig(f"f{i}", f"t{i}", max_ids=3) for i in range(N)
    ]
    layout = layout_collection(tables, features, mesh)
    rng = np.random.default_rng(2)
    batch = {"fa": rng.integers(0, 64, (B, 4))}
    batch |= {f"f{i}": rng.integers(0, 16, (B, 3)) for i in range(N)}
    data = NamedSharding(mesh, P("x"))
    dev = {k: jax.device_put(v.astype(np.int32), data) for k, v in batch.items()}
    stacks = {s.index: jax.device_put(jnp.zeros(s.shape), NamedSharding(mesh, s.spec))
              for s in layout.stacks}  # fmt: skip
    opt = jaxembed.optim.sgd(0.1)
    states = {i: opt.init(s) for i, s in stacks.items()}
    grads = {k: jax.device_put(np.ones((B, 8 if k == "fa" else 4), np.float32), data)
             for k in batch}  # fmt: skip
    with jax.set_mesh(mesh):
        _, _, stats = jax.jit(lambda st, ss, b, g: collection_update(
            layout, opt, st, ss, b, g, return_stats=True))(stacks, states, dev, grads)  # fmt: skip
    by_table = {s.tables[0]: stats[s.name] for s in layout.stacks}
    np.testing.assert_array_equal(by_table["a"].rows, _distinct_owned(batch["fa"]))
    # Table-wise: each table's distinct rows are written by the one device holding it.
    (wise,) = {s.name for s in layout.stacks if s.tables[0] != "a"}
    owner = {t: layout.placement(t).shards[0] for t in (f"t{i}" for i in range(N))}
    want = np.zeros(N, int)
    for i in range(N):
        want[owner[f"t{i}"]] += len(np.unique(batch[f"f{i}"]))
    np.testing.assert_array_equal(stats[wise].rows, want)
