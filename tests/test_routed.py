"""The routed exchange: exact on every layout where it applies, and never drops an id.

Each case runs the lookup (or bag lookup, or row-sparse update) with exchange="routed" and
compares it with the dense float64 reference, with duplicates, padding, out-of-range ids and a
padded vocabulary, in block and in mod row order; a capacity of 1 and an adversarial batch
(every id on one shard) force the fallback, which must be just as exact and be reported; the
compiled program holds exactly the plan's collectives (routed, flag and fallback), with the
native kernels (the bucketing by owner too) and with XLA's.
"""

import collections

import jax
import numpy as np
import pytest
from bag_reference import embedding_bag_grad_reference, embedding_bag_reference
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_embedding import dense_reference, make_inputs, make_mesh, put

import jaxembed
from jaxembed import hlo
from jaxembed.kernels import native
from jaxembed.optim import reference

ROWS, HIDDEN, VOCAB, PAD = 64, 8, 59, 7
# (mesh shape, table spec, ids spec): ids and rows split over common axes
LAYOUTS = {
    "1d-fully-sharded": ((8,), P("model", None), P("model")),
    "rows-over-data-model": ((2, 4), P(("data", "model"), None), P("data")),
    "rows-and-ids-on-data": ((2, 4), P("data", None), P("data")),
}
KINDS = {"psum": "all-reduce", "psum_scatter": "reduce-scatter", "all_gather": "all-gather",
         "all_to_all": "all-to-all"}  # fmt: skip


def physical(table, row_sharding, mesh_shape, w_spec):
    """The table as stored: id order, or mod order over its row shards."""
    if row_sharding == "block":
        return table
    n = int(np.prod([s for s, a in zip(mesh_shape, ("data", "model")[-len(mesh_shape):],
                                        strict=True) if a in str(w_spec[0])]))  # fmt: skip
    return np.asarray(jaxembed.to_mod_order(table, n))


def check_program(plan, text, mesh):
    """Every collective of the compiled program is one of the plan's (routed, flag or
    fallback), and each planned one is there."""
    r = plan.routed
    planned = collections.Counter(
        (KINDS[c.op], tuple(c.axes))
        for c in (*plan.forward, *plan.backward, *r.fallback_forward, *r.fallback_backward)
    )
    actual = collections.Counter((c.kind, hlo.mesh_axes(c, mesh)) for c in hlo.collectives(text))
    assert actual == planned, f"HLO {sorted(actual.items())} != plan {sorted(planned.items())}"
    for c in hlo.collectives(text):  # never a table-shaped collective
        assert tuple(plan.table_shard_shape) not in c.result_shape, c


NATIVE = pytest.param("native", marks=pytest.mark.skipif(
    not native.available(), reason=f"native kernels unavailable: {native.why_unavailable()}"))  # fmt: skip


def lookup_cases():
    """Each layout in block and mod row order, at the default capacity and at 1 (the
    fallback); the kernels alternate, so that each layout and each (row order, capacity) pair
    runs on both."""
    cases = []
    for n, layout in enumerate(LAYOUTS):
        for k, (row_sharding, capacity) in enumerate(
            [("block", None), ("block", 1), ("mod", None), ("mod", 1)]
        ):
            impl = NATIVE if (n + k + k // 2) % 2 == 0 else "xla"
            name = "native" if impl is NATIVE else "xla"
            cases.append(pytest.param(layout, row_sharding, capacity, name,
                                      marks=impl.marks if impl is NATIVE else (),
                                      id=f"{layout}-{row_sharding}-{capacity}-{name}"))  # fmt: skip
    return cases


@pytest.mark.parametrize(("layout", "row_sharding", "capacity", "impl"), lookup_cases())
def test_lookup_and_gradient(layout, row_sharding, capacity, impl):
    mesh_shape, w_spec, x_spec = LAYOUTS[layout]
    mesh = make_mesh(mesh_shape, AxisType.Explicit)
    ids, table, ct = make_inputs(
        np.random.default_rng(len(layout)), (16, 8), vocab_size=VOCAB, padding_idx=PAD
    )
    stored = physical(table, row_sharding, mesh_shape, w_spec)
    kw = dict(vocab_size=VOCAB, padding_idx=PAD, exchange="routed", capacity=capacity,
              row_sharding=row_sharding, impl=impl)  # fmt: skip
    plan = jaxembed.plan_embedding(mesh, ids.shape, stored.shape, x_spec=x_spec,
                                   weight_spec=w_spec, **kw)  # fmt: skip
    assert plan.exchange == "routed" and plan.routed.capacity == (capacity or plan.routed.capacity)

    def step(ids, t, ct):
        f = lambda t: jaxembed.embedding(ids, t, return_stats=True, **kw)
        (out, stats), vjp = jax.vjp(f, t)
        zero = jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), stats)
        return out, stats.routed_fallback, vjp((ct, zero))[0]

    args = put(ids, mesh, x_spec), put(stored, mesh, w_spec), put(ct, mesh, plan.out_spec)
    compiled = jax.jit(step).lower(*args).compile()
    out, fallback, grad = compiled(*args)
    ref_out, ref_grad = dense_reference(ids, table, ct, VOCAB, PAD)
    np.testing.assert_array_equal(np.asarray(out), ref_out.astype(np.float32))
    got = np.asarray(grad)
    if row_sharding == "mod":
        got = np.asarray(jaxembed.from_mod_order(got, plan.num_row_shards, ROWS))
    np.testing.assert_allclose(got, ref_grad, rtol=1e-5, atol=1e-5)
    assert int(fallback) == (1 if capacity == 1 else 0)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, plan.out_spec), out.ndim)
    check_program(plan, compiled.as_text(), mesh)


def test_adversarial_skew_falls_back_exactly():
    """Every id on shard 0 (block rows): the default capacity overflows; nothing is lost."""
    mesh = make_mesh((8,), AxisType.Explicit)
    rng = np.random.default_rng(3)
    table = rng.normal(size=(1024, HIDDEN)).astype(np.float32)
    ids = rng.integers(0, 128, size=(64, 16)).astype(np.int32)  # shard 0 holds ids < 128
    t, x = put(table, mesh, P("model", None)), put(ids, mesh, P("model"))
    f = jax.jit(lambda x, t: jaxembed.embedding(x, t, exchange="routed", return_stats=True))
    out, stats = f(x, t)
    np.testing.assert_array_equal(np.asarray(out), table[ids])
    assert int(stats.routed_fallback) == 1
    # The same batch in mod order spreads over all shards: no fallback.
    tm = put(np.asarray(jaxembed.to_mod_order(table, 8)), mesh, P("model", None))
    g = jax.jit(lambda x, t: jaxembed.embedding(
        x, t, exchange="routed", row_sharding="mod", return_stats=True))  # fmt: skip
    out, stats = g(x, tm)
    np.testing.assert_array_equal(np.asarray(out), table[ids])
    assert int(stats.routed_fallback) == 0
    assert jaxembed.rowsharding.suggest_row_sharding(ids, vocab_size=1024, num_shards=8)[0] == "mod"


def bag_cases():
    """Each layout at both capacities, pooled at the source and at the owner, the combiners
    in turn: every pair of (layout, capacity, pool, combiner) values runs (the combiners in
    every form and pooling: tests/test_routed_owner_pool.py)."""
    combos = [(layout, capacity, pool) for layout in ("1d-fully-sharded", "rows-over-data-model")
              for capacity in (None, 1) for pool in ("source", "owner")]  # fmt: skip
    combiners = ("sum", "mean", "sqrtn")
    return [pytest.param(layout, combiners[n % 3], capacity, pool,
                         id=f"{layout}-{capacity}-{combiners[n % 3]}-{pool}")
            for n, (layout, capacity, pool) in enumerate(combos)]  # fmt: skip


@pytest.mark.parametrize(("layout", "combiner", "capacity", "routed_pool"), bag_cases())
def test_bags(layout, combiner, capacity, routed_pool):
    mesh_shape, w_spec, x_spec = LAYOUTS[layout]
    mesh = make_mesh(mesh_shape, AxisType.Explicit)
    rng = np.random.default_rng(7)
    table = rng.normal(size=(ROWS, HIDDEN)).astype(np.float32)
    x = rng.integers(0, VOCAB, size=(16, 6)).astype(np.int32)
    x[rng.random(x.shape) < 0.3] = -1
    x[0] = -1
    x[1, :3] = [PAD, VOCAB + 1, 4]
    x[2, :3] = [4, 4, 9]
    ct = rng.normal(size=(16, HIDDEN)).astype(np.float32)
    kw = dict(vocab_size=VOCAB, padding_idx=PAD, combiner=combiner, exchange="routed",
              capacity=capacity, routed_pool=routed_pool)  # fmt: skip

    def step(x, t, ct):
        f = lambda t: jaxembed.embedding_bag(x, t, **kw)
        out, vjp = jax.vjp(f, t)
        return out, vjp(ct)[0]

    out, grad = jax.jit(step)(put(x, mesh, x_spec), put(table, mesh, w_spec), put(ct, mesh, x_spec))
    ref = embedding_bag_reference(table, x, combiner=combiner, vocab_size=VOCAB, padding_idx=PAD)
    ref_grad = embedding_bag_grad_reference(
        table, x, combiner=combiner, vocab_size=VOCAB, padding_idx=PAD, out_grad=ct
    )
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("capacity", [None, 1])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_row_sparse_update(layout, capacity):
    mesh_shape, w_spec, x_spec = LAYOUTS[layout]
    mesh = make_mesh(mesh_shape, AxisType.Explicit)
    opt = jaxembed.optim.adam(0.01)
    rng = np.random.default_rng(11)
    ids, table, grad = make_inputs(rng, (16, 8), vocab_size=VOCAB, padding_idx=PAD)
    t = put(table, mesh, w_spec)
    state = opt.init(t)
    update = jax.jit(lambda t, s, x, g: opt.update(
        t, s, x, g, vocab_size=VOCAB, padding_idx=PAD, exchange="routed", capacity=capacity))  # fmt: skip
    for _ in range(2):
        t, state = update(t, state, put(ids, mesh, x_spec), put(grad, mesh, x_spec))
    ref_t = table.astype(np.float64)
    ref_s = reference.init_states(opt.formula, ROWS, table.shape[1])
    for count in range(2):
        ref_t, ref_s = reference.sparse_step(opt.formula, ref_t, ref_s, ids, grad, count=count,
                                             vocab_size=VOCAB, padding_idx=PAD)  # fmt: skip
    np.testing.assert_allclose(np.asarray(t), ref_t, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state.slots["mu"]), ref_s[0], rtol=1e-5, atol=1e-6)


def test_bytes_and_lookups_per_device():
    """V = 1M, H = 128, ids 64 x 128 on (8,): the routed bytes and rows looked up."""
    mesh = jax.sharding.AbstractMesh((8,), ("model",))
    kw = dict(x_spec=P("model"), weight_spec=P("model", None))
    gathered = jaxembed.plan_embedding(mesh, (64, 128), (1 << 20, 128), exchange="rows", **kw)
    routed = jaxembed.plan_embedding(mesh, (64, 128), (1 << 20, 128), exchange="routed", **kw)
    total = lambda p: p.forward_wire_bytes + p.backward_wire_bytes
    assert total(routed) <= 0.35 * total(gathered)
    g = 64 * 128
    assert routed.routed.rows_looked_up <= 1.5 * g / 8  # μ + 4√μ + 1 per bucket
    auto = jaxembed.plan_embedding(mesh, (64, 128), (1 << 20, 128), **kw)
    assert auto.exchange == "routed", auto.exchange_reason


def test_routed_where_it_does_not_apply_is_an_error():
    mesh = make_mesh((2, 4), AxisType.Explicit)
    with pytest.raises(ValueError, match=r"exchange='routed' does not apply.*share no mesh axis"):
        jaxembed.plan_embedding(mesh, (8, 8), (64, 8), x_spec=P(), weight_spec=P("model", None),
                                exchange="routed")  # fmt: skip
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        jaxembed.plan_embedding(mesh, (8, 8), (64, 8), x_spec=P("model"),
                                weight_spec=P("model", None), exchange="routed", capacity=0)  # fmt: skip


def test_auto_mesh():
    mesh = make_mesh((8,), AxisType.Auto)
    ids, table, ct = make_inputs(
        np.random.default_rng(2), (16, 8), vocab_size=ROWS, padding_idx=None
    )
    f = jax.jit(lambda x, t: jaxembed.embedding(
        x, t, exchange="routed", x_spec=P("model"), weight_spec=P("model", None)))  # fmt: skip
    out = f(put(ids, mesh, P("model")), put(table, mesh, P("model", None)))
    np.testing.assert_array_equal(
        np.asarray(out), dense_reference(ids, table, ct, ROWS, None)[0].astype(np.float32)
    )
