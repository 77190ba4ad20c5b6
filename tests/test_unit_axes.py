"""Mesh axes of size 1 cost nothing: no collective spans a group of one device.

A mesh `(data=1, model=8)` or `(data=8, model=1)` is what a program that names both axes gets
on 8 devices. A split into one piece moves nothing, so the plans drop those axes
(`jaxembed.plan.specs.drop_unit_axes`): the lookup, its gradient, the bag lookup, the
row-sparse update and the collection compile no collective whose groups hold one device, and
the plans list none. Values, gradients and updated tables are checked against float64 numpy;
in an Explicit mesh the outputs and gradients keep the types the caller's layouts name.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed
import jaxembed.nnx
from jaxembed import hlo

V, H, B, L = 64, 8, 16, 4
SHAPES = [(1, 8), (8, 1)]


def _mesh(shape, axis_type):
    return jax.make_mesh(shape, ("data", "model"), axis_types=(axis_type,) * 2)


def _inputs(mesh, seed=0):
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(V, H)).astype(np.float32)
    ids = rng.integers(-1, V, (B, L)).astype(np.int32)
    ids[0, :2] = ids[1, 0]  # duplicates
    cot = rng.normal(size=(B, L, H)).astype(np.float32)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    return (table, ids, cot), (put(table, P("model", None)), put(ids, P("data")),
                               put(cot, P("data")))  # fmt: skip


def _unit_groups(text):
    return [(c.kind, c.result_shape) for c in hlo.collectives(text) if c.group_size == 1]


def _rows(table, ids):
    t = np.asarray(table, np.float64)
    return np.where((ids >= 0)[..., None], t[np.maximum(ids, 0)], 0.0)


def _scatter(ids, cot):
    g = np.zeros((V, H))
    ok = ids >= 0
    np.add.at(g, ids[ok], np.asarray(cot, np.float64)[ok])
    return g


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("shape", SHAPES)
def test_lookup_and_gradient(shape, axis_type):
    mesh = _mesh(shape, axis_type)
    (table, ids, cot), (t, x, c) = _inputs(mesh)
    spec_kw = {} if axis_type == AxisType.Explicit else dict(
        x_spec=P("data"), weight_spec=P("model", None))  # fmt: skip
    f = lambda t, x: jaxembed.embedding(x, t, **spec_kw)
    g = lambda t, x, c: jax.grad(lambda t: jnp.sum(f(t, x) * c))(t)
    with jax.set_mesh(mesh):
        for fn, args in ((f, (t, x)), (g, (t, x, c))):
            assert _unit_groups(jax.jit(fn).lower(*args).compile().as_text()) == []
        out, grad = jax.jit(f)(t, x), jax.jit(g)(t, x, c)
    np.testing.assert_allclose(np.asarray(out, np.float64), _rows(table, ids), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad, np.float64), _scatter(ids, cot), rtol=1e-5,
                               atol=1e-6)  # fmt: skip
    if axis_type == AxisType.Explicit:  # the types the caller's layouts name
        assert out.sharding.spec[0] == "data" and grad.sharding.spec[0] == "model"
    plan = jaxembed.plan_embedding(mesh, ids.shape, table.shape, x_spec=P("data"),
                                   weight_spec=P("model", None))  # fmt: skip
    unit = {a for a, n in plan.mesh_axes if n == 1}
    assert not [c for c in (*plan.forward, *plan.backward) if set(c.axes) & unit]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("combiner", ["sum", "mean", "max"])
def test_bag_and_its_gradient(shape, combiner):
    mesh = _mesh(shape, AxisType.Explicit)
    (table, ids, cot), (t, x, _) = _inputs(mesh)
    pooled_cot = cot[:, 0]
    c = jax.device_put(pooled_cot, NamedSharding(mesh, P("data")))
    f = lambda t, x: jaxembed.embedding_bag(x, t, combiner=combiner)
    g = lambda t, x, c: jax.grad(lambda t: jnp.sum(f(t, x) * c))(t)
    with jax.set_mesh(mesh):
        for fn, args in ((f, (t, x)), (g, (t, x, c))):
            assert _unit_groups(jax.jit(fn).lower(*args).compile().as_text()) == []
        out, grad = jax.jit(f)(t, x), jax.jit(g)(t, x, c)
    rows, valid = _rows(table, ids), ids >= 0
    if combiner == "max":
        want = np.where(valid[..., None], rows, -np.inf).max(1)
        want = np.where(np.isfinite(want), want, 0.0)
    else:
        want = rows.sum(1)
        if combiner == "mean":
            want = want / np.maximum(valid.sum(1, keepdims=True), 1)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-5, atol=1e-6)
    if combiner != "max":
        scale = 1.0 if combiner == "sum" else 1.0 / np.maximum(valid.sum(1, keepdims=True), 1)
        want_grad = _scatter(ids, np.broadcast_to((pooled_cot * scale)[:, None], cot.shape))
        np.testing.assert_allclose(np.asarray(grad, np.float64), want_grad, rtol=1e-5, atol=1e-6)
    assert out.sharding.spec[0] == "data" and grad.sharding.spec[0] == "model"


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("shape", SHAPES)
def test_row_sparse_update(shape, axis_type):
    mesh = _mesh(shape, axis_type)
    (table, ids, cot), (t, x, c) = _inputs(mesh)
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    kw = {} if axis_type == AxisType.Explicit else dict(
        x_spec=P("data"), weight_spec=P("model", None))  # fmt: skip
    with jax.set_mesh(mesh):
        state = opt.init(t, mesh=mesh, weight_spec=P("model", None))
        step = jax.jit(lambda t, s, x, c: opt.update(t, s, x, c, **kw))
        assert _unit_groups(step.lower(t, state, x, c).compile().as_text()) == []
        new_table, new_state = step(t, state, x, c)
    grad = _scatter(ids, cot)
    touched = np.zeros(V, bool)
    touched[ids[ids >= 0]] = True
    # Row-wise Adagrad from s = 0: s = mean_H(g²) on touched rows, w -= lr·g/(√s + eps).
    want_acc = np.where(touched, (grad**2).mean(1), 0.0)
    (accumulator,) = jax.tree.leaves(new_state.slots)
    np.testing.assert_allclose(np.asarray(accumulator, np.float64), want_acc, rtol=1e-5,
                               atol=1e-7)  # fmt: skip
    want = table - 0.1 * grad / (np.sqrt(want_acc)[:, None] + 1e-8)
    np.testing.assert_allclose(np.asarray(new_table, np.float64), want, rtol=1e-4, atol=1e-5)
    if axis_type == AxisType.Explicit:
        assert new_table.sharding.spec == t.sharding.spec


@pytest.mark.parametrize("shape", SHAPES)
def test_collection_step_has_no_group_of_one(shape):
    mesh = _mesh(shape, AxisType.Explicit)
    tables = [jaxembed.TableConfig("a", 64, 8, placement="rows"),
              jaxembed.TableConfig("b", 32, 8, placement="table"),
              jaxembed.TableConfig("c", 40, 8, placement="columns")]  # fmt: skip
    features = [jaxembed.FeatureConfig(f"f{t.name}", t.name, max_ids=4) for t in tables]
    rng = np.random.default_rng(0)
    data = NamedSharding(mesh, P(("data", "model")))
    batch = {f.name: jax.device_put(rng.integers(0, t.vocab_size, (B, 4)).astype(np.int32), data)
             for f, t in zip(features, tables, strict=True)}  # fmt: skip
    with jax.set_mesh(mesh):
        coll = jaxembed.nnx.EmbeddingBagCollection(tables, features, rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(coll)
        lookup = jax.jit(lambda s, b: nnx.merge(graphdef, s)(b))
        assert _unit_groups(lookup.lower(state, batch).compile().as_text()) == []
        out = lookup(state, batch)
        want = {}
        for f, t in zip(features, tables, strict=True):
            rows = np.asarray(coll.tables()[t.name], np.float64)[np.asarray(batch[f.name])]
            want[f.name] = rows.sum(1)
    for name, value in want.items():
        np.testing.assert_allclose(np.asarray(out[name], np.float64), value, rtol=1e-5,
                                   atol=1e-6)  # fmt: skip


@pytest.mark.parametrize(
    "fn, kw, match",
    [
        (jaxembed.embedding, {"exchange": "route"}, "exchange must be one of"),
        (jaxembed.embedding_bag, {"exchange": "route"}, "exchange must be one of"),
        (jaxembed.embedding_bag, {"routed_pool": "owners"}, "routed_pool must be one of"),
        (jaxembed.embedding_bag, {"routed_pool": "owner", "combiner": "max"}, "a max bag"),
    ],
)
def test_one_device_checks_the_exchange_and_routed_pool_as_a_mesh_does(fn, kw, match):
    """No plan is made on one device, yet a misspelt choice is an error there too."""
    table, ids = jnp.ones((V, H)), jnp.zeros((B, L), jnp.int32)
    with pytest.raises(ValueError, match=match):
        fn(ids, table, **kw)
