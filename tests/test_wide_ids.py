"""Ids of every integer width, bad collection inputs, empty batches: never a wrong row.

With x64 off (JAX's default) `jnp.asarray` turns a numpy int64 id `2**32 + 3` into 3, a real
row. jaxembed checks ids in their own width before anything narrows them: a concrete id int32
cannot hold raises, naming it; a traced one (uint32 here, int64 under x64 in the subprocess
cases) saturates to an id outside every table, so it reads zero and gets no gradient. Every
computed result is compared with a float64 numpy reference.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed
import jaxembed.nnx
from jaxembed.collection import FeatureConfig, TableConfig
from jaxembed.ids import INT32_MAX, as_ids

V, H = 40, 4
WIDE = 2**32 + 3  # wraps onto row 3 under a plain int32 cast
NEG_WRAP = 2**31  # wraps onto a negative id (an empty slot) under a plain int32 cast


def table_np(seed=0):
    return np.random.default_rng(seed).normal(size=(V, H))


def mesh_of(n):
    return jax.make_mesh((n,), ("model",), axis_types=(jax.sharding.AxisType.Explicit,))


def placed(table, mesh):
    return jax.device_put(jnp.asarray(table, jnp.float32), NamedSharding(mesh, P("model", None)))


# --- concrete wide ids raise, eagerly and closed over inside jit --------------------------------


@pytest.mark.parametrize("bad", [WIDE, NEG_WRAP, -(2**40)])
@pytest.mark.parametrize("n", [1, 8])
def test_embedding_refuses_concrete_ids_int32_cannot_hold(bad, n):
    mesh = mesh_of(n)
    table = placed(table_np(), mesh)
    ids = np.array([[1, bad]], np.int64)
    with pytest.raises(ValueError, match=rf"ids\[0, 1\] = {bad} does not fit int32"):
        jaxembed.embedding(ids, table)
    with pytest.raises(ValueError, match=rf"= {bad} does not fit int32"):
        jax.jit(lambda t: jaxembed.embedding(ids, t))(table)  # ids closed over: concrete


@pytest.mark.parametrize("n", [1, 8])
def test_embedding_bag_refuses_wide_ids_and_lengths(n):
    mesh = mesh_of(n)
    table = placed(table_np(), mesh)
    with pytest.raises(ValueError, match=rf"ids\[1, 0\] = {WIDE} does not fit int32"):
        jaxembed.embedding_bag(np.array([[1, 2], [WIDE, -1]], np.int64), table)
    with pytest.raises(ValueError, match=rf"= {NEG_WRAP} does not fit int32"):
        jax.jit(lambda t: jaxembed.embedding_bag(np.array([[NEG_WRAP, 2]]), t, combiner="mean"))(
            table
        )
    with pytest.raises(ValueError, match=r"lengths\[0\] = 4294967298 does not fit int32"):
        jaxembed.embedding_bag(
            np.array([1, 2, 3]), table, lengths=np.array([2**32 + 2, 1], np.int64)
        )


def test_wide_ids_with_check_ids_false_read_nothing():
    table = table_np()
    ids = np.array([[1, WIDE, 5], [NEG_WRAP, 2, -(2**40)]], np.int64)
    out = jaxembed.embedding_bag(ids, jnp.asarray(table, jnp.float32), check_ids=False)
    want = np.stack([table[1] + table[5], table[2]])  # the wide ids read nothing
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)


def test_ragged_refuses_wide_values():
    with pytest.raises(ValueError, match=rf"values\[1\] = {WIDE} does not fit int32"):
        jaxembed.Ragged(np.array([1, WIDE], np.int64), np.array([2]))
    with pytest.raises(ValueError, match=rf"bag 1\[0\] = {NEG_WRAP} does not fit int32"):
        jaxembed.Ragged.from_lists([[1], [NEG_WRAP]])
    with pytest.raises(ValueError, match=rf"values\[0\] = {WIDE} does not fit int32"):
        jaxembed.Ragged.from_offsets(np.array([WIDE, 1], np.int64), np.array([0, 1]))


@pytest.mark.parametrize("n", [1, 8])
def test_collection_and_update_refuse_wide_ids(n):
    mesh = mesh_of(n)
    tables = [TableConfig("item", V, H, placement="rows")]
    features = [FeatureConfig("a", "item", combiner="sum", max_ids=2)]
    with jax.set_mesh(mesh):
        coll = jaxembed.nnx.EmbeddingBagCollection(tables, features, rngs=nnx.Rngs(0))
        batch = {"a": np.array([[1, WIDE]] * 8, np.int64)}
        with pytest.raises(
            ValueError, match=rf"feature 'a' \(table 'item'\): ids\[0, 1\] = {WIDE}"
        ):
            coll(batch)
        opt = jaxembed.optim.sgd(0.1)
        table = placed(table_np(), mesh)
        state = opt.init(table)
        with pytest.raises(ValueError, match=rf"ids\[0, 1\] = {WIDE} does not fit int32"):
            opt.update(table, state, np.array([[1, WIDE]], np.int64), jnp.ones((1, 2, H)))


def test_float_and_object_ids_raise():
    with pytest.raises(TypeError, match=r"ids must be integers, got float32"):
        as_ids(np.array([1.0, 2.0], np.float32))
    with pytest.raises(ValueError, match=r"do not fit a 64-bit integer"):
        as_ids([2**70])


# --- traced wide ids saturate: zero row, no gradient ------------------------------------------


@pytest.mark.parametrize("n", [1, 8])
def test_traced_uint32_ids_past_int32_read_zero_and_get_no_gradient(n):
    mesh = mesh_of(n)
    t = table_np(1)
    table = placed(t, mesh)
    raw = np.array([[3, 2**31 + 3, 7, 2**32 - 1]] * 8, np.uint32)
    ids = jax.device_put(jnp.asarray(raw), NamedSharding(mesh, P()))
    rng = np.random.default_rng(0)
    ct = rng.normal(size=(8, 4, H))

    def loss(table, ids):
        return jnp.sum(jaxembed.embedding(ids, table) * ct)

    value, grad = jax.jit(jax.value_and_grad(loss))(table, ids)
    ok = raw < V
    rows = np.where(ok, raw, 0).astype(np.int64)
    want_out = np.where(ok[..., None], t[rows], 0.0)
    want_grad = np.zeros((V, H))
    np.add.at(want_grad, rows[ok], ct[ok])
    np.testing.assert_allclose(float(value), float(np.sum(want_out * ct)), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-6)


def test_saturation_keeps_every_id_out_of_range():
    x = jnp.array([0, 5, 2**31 - 1, 2**31, 2**32 - 1], jnp.uint32)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(as_ids)(x)), [0, 5, INT32_MAX, INT32_MAX, INT32_MAX]
    )


# --- x64 on: traced int64 ids in every API, 1 and 8 devices (a subprocess) ---------------------

X64_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxembed, jaxembed.nnx
    from jaxembed.collection import FeatureConfig, TableConfig

    V, H = 40, 4
    raw = np.array([[3, 2**32 + 3, 7, -(2**40)], [2**31, 5, 2**63 - 1, 1]] * 4, np.int64)
    rng = np.random.default_rng(0)
    t = rng.normal(size=(V, H)).astype(np.float32)
    ct = rng.normal(size=(8, H)).astype(np.float32)
    out = {}
    for n in (1, 8):
        mesh = jax.make_mesh((n,), ("model",), axis_types=(jax.sharding.AxisType.Explicit,))
        table = jax.device_put(jnp.asarray(t), NamedSharding(mesh, P("model", None)))
        ids = jax.device_put(jnp.asarray(raw), NamedSharding(mesh, P()))
        look = jax.jit(lambda tb, x: jaxembed.embedding(x, tb))(table, ids)
        bag = jax.jit(lambda tb, x: jaxembed.embedding_bag(x, tb, combiner="mean"))(table, ids)
        opt = jaxembed.optim.sgd(0.5)
        state = opt.init(table)
        upd, _ = jax.jit(lambda tb, s, x: opt.update(tb, s, x, jnp.asarray(ct), combiner="sum"))(
            table, state, ids)
        with jax.set_mesh(mesh):
            coll = jaxembed.nnx.EmbeddingBagCollection(
                [TableConfig("item", V, H, placement="rows")],
                [FeatureConfig("a", "item", combiner="sum", max_ids=4)], rngs=nnx.Rngs(0))
            coll.load_tables({"item": t})
            c = jax.jit(lambda x: coll({"a": x})["a"])(ids)
        out[n] = dict(look=np.asarray(look, np.float64).tolist(),
                      bag=np.asarray(bag, np.float64).tolist(),
                      upd=np.asarray(upd, np.float64).tolist(),
                      coll=np.asarray(c, np.float64).tolist())
    print(json.dumps(dict(table=t.astype(np.float64).tolist(), ct=ct.astype(np.float64).tolist(),
                          raw=raw.tolist(), out=out)))
    """
)


@pytest.fixture(scope="module")
def x64_run():
    env = dict(os.environ, JAX_ENABLE_X64="1")
    proc = subprocess.run(
        [sys.executable, "-c", X64_SCRIPT], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("n", ["1", "8"])
def test_x64_traced_int64_ids_never_wrap(x64_run, n):
    t = np.asarray(x64_run["table"])
    ct = np.asarray(x64_run["ct"])
    raw = np.array(x64_run["raw"], dtype=object)
    ok = np.vectorize(lambda v: 0 <= v < V)(raw).astype(bool)
    rows = np.where(ok, raw, 0).astype(np.int64)
    got = x64_run["out"][n]
    want_look = np.where(ok[..., None], t[rows], 0.0)
    np.testing.assert_allclose(np.asarray(got["look"]), want_look, rtol=1e-6)
    sums = want_look.sum(1)
    counts = ok.sum(1, keepdims=True)
    np.testing.assert_allclose(np.asarray(got["bag"]), sums / np.maximum(counts, 1), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got["coll"]), sums, rtol=1e-5)
    grad = np.zeros((V, H))
    np.add.at(grad, rows[ok], np.broadcast_to(ct[:, None, :], (*raw.shape, H))[ok])
    np.testing.assert_allclose(np.asarray(got["upd"]), t - 0.5 * grad, rtol=1e-5, atol=1e-6)
    # row 3 is read by id 3 only: the wide id 2**32 + 3 did not land on it
    assert ok[0, 0] and not ok[0, 1]


# --- one validation for collections and embedding_bag -------------------------------------------

TABLES = [
    TableConfig("item", V, H, placement="rows"),
    TableConfig("user", 12, H, placement="table"),
]
FEATURES = [
    FeatureConfig("clicks", "item", combiner="mean", max_ids=3),
    FeatureConfig("top", "item", combiner="max", max_ids=2),
    FeatureConfig("user", "user", combiner="sum", max_ids=1),
]


@pytest.fixture(scope="module")
def coll8():
    with jax.set_mesh(mesh_of(8)):
        return jaxembed.nnx.EmbeddingBagCollection(TABLES, FEATURES, rngs=nnx.Rngs(0))


def batch_of(b, rng=None):
    rng = rng or np.random.default_rng(0)
    return {
        "clicks": rng.integers(-1, V, size=(b, 3)).astype(np.int32),
        "top": rng.integers(0, V, size=(b, 2)).astype(np.int32),
        "user": rng.integers(0, 12, size=(b,)).astype(np.int32),
    }


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"clicks": np.array([[1.7, 2.0, 3.0]] * 8, np.float32)}, TypeError,
         r"feature 'clicks' \(table 'item'\): ids must be integers, got float32"),
        ({"clicks": np.array([[np.nan, 2.0, 3.0]] * 8)}, TypeError,
         r"feature 'clicks' \(table 'item'\): ids must be integers, got float64"),
        ({"top": (np.ones((8, 2), np.int32), np.ones((8, 2), np.float32))}, ValueError,
         r"feature 'top' \(table 'item'\): per_id_weights cannot be used with combiner='max'"),
        ({"clicks": (np.ones((8, 3), np.int32), np.ones((8, 2), np.float32))}, ValueError,
         r"feature 'clicks' \(table 'item'\): per-id weights \(8, 2\) must have the shape"),
        ({"clicks": (np.ones((8, 3), np.int32), np.ones((8, 3), np.int32))}, TypeError,
         r"feature 'clicks' \(table 'item'\): per-id weights must be floats, got int32"),
        ({"user": np.zeros((4,), np.int32)}, ValueError,
         r"different batch sizes \('clicks': 8, 'top': 8, 'user': 4\)"),
    ],
)  # fmt: skip
@pytest.mark.filterwarnings("ignore:the collection's stack")
def test_collection_refuses_what_embedding_bag_refuses(coll8, change, error, match):
    batch = {**batch_of(8), **change}
    with jax.set_mesh(mesh_of(8)), pytest.raises(error, match=match):
        coll8(batch)
    opt = jaxembed.optim.sgd(0.1)
    with jax.set_mesh(mesh_of(8)):
        states = coll8.init_optimizer(opt)
        grads = {f.name: jnp.zeros((8, H)) for f in FEATURES}
        with pytest.raises(error, match=match):
            coll8.apply_gradients(opt, states, batch, grads)


def test_embedding_bag_and_update_refuse_weights_with_max():
    table = jnp.ones((V, H))
    msg = r"per_id_weights cannot be used with combiner='max'"
    with pytest.raises(ValueError, match=msg):
        jaxembed.embedding_bag(jnp.ones((2, 3), jnp.int32), table, combiner="max",
                               per_id_weights=jnp.ones((2, 3)))  # fmt: skip
    opt = jaxembed.optim.sgd(0.1)
    with pytest.raises(ValueError, match=msg):
        opt.update(table, opt.init(table), jnp.ones((2, 3), jnp.int32), jnp.ones((2, H)),
                   combiner="max", per_id_weights=jnp.ones((2, 3)))  # fmt: skip


# --- empty batches work and return empty outputs ---------------------------------------------


@pytest.mark.filterwarnings("ignore:the collection's stack")  # max beside mean on one table
@pytest.mark.parametrize("n", [1, 8])
@pytest.mark.parametrize("jit", [False, True])
def test_collection_empty_batch(n, jit):
    mesh = mesh_of(n)
    with jax.set_mesh(mesh):
        coll = jaxembed.nnx.EmbeddingBagCollection(TABLES, FEATURES, rngs=nnx.Rngs(0))
        before = {k: np.asarray(v) for k, v in coll.tables().items()}
        batch = {
            k: jax.device_put(v, NamedSharding(mesh, P("model"))) for k, v in batch_of(0).items()
        }
        look = nnx.jit(lambda c, b: c(b)) if jit else (lambda c, b: c(b))
        out = look(coll, batch)
        assert {k: v.shape for k, v in out.items()} == {f.name: (0, H) for f in FEATURES}
        opt = jaxembed.optim.rowwise_adagrad(0.1)
        states = coll.init_optimizer(opt)
        slots = {i: {k: np.asarray(v) for k, v in s.slots.items()} for i, s in states.items()}
        grads = {k: jnp.zeros_like(v) for k, v in out.items()}
        states = coll.apply_gradients(opt, states, batch, grads)
        for name, t in coll.tables().items():
            np.testing.assert_array_equal(np.asarray(t), before[name])
        for i, s in states.items():
            for k, v in s.slots.items():
                np.testing.assert_array_equal(np.asarray(v), slots[i][k])


@pytest.mark.parametrize("n", [1, 8])
def test_empty_ragged_feature_and_empty_bags(n):
    mesh = mesh_of(n)
    t = table_np(2)
    table = placed(t, mesh)
    # [4, 0]: four bags of no slot pool to zeros; [0, 3]: no bag at all
    out = jaxembed.embedding_bag(np.zeros((4, 0), np.int32), table)
    np.testing.assert_array_equal(np.asarray(out), np.zeros((4, H)))
    assert jaxembed.embedding_bag(np.zeros((0, 3), np.int32), table).shape == (0, H)
    assert jax.jit(lambda tb: jaxembed.embedding(jnp.zeros((0, 2), jnp.int32), tb))(
        table
    ).shape == (0, 2, H)
    opt = jaxembed.optim.sgd(0.1)
    new, state = opt.update(table, opt.init(table), np.zeros((0, 3), np.int32), jnp.zeros((0, H)),
                            combiner="sum")  # fmt: skip
    np.testing.assert_array_equal(np.asarray(new), np.asarray(table))
    assert int(state.count) == 1
    tables = [TableConfig("item", V, H, placement="rows")]
    features = [FeatureConfig("words", "item", combiner="sum", max_ids=4)]
    with jax.set_mesh(mesh):
        coll = jaxembed.nnx.EmbeddingBagCollection(tables, features, rngs=nnx.Rngs(0))
        batch = {"words": jaxembed.Ragged(np.zeros((0,), np.int32), np.zeros((0,), np.int32))}
        out = coll(batch)
        assert out["words"].shape == (0, H)
        states = coll.init_optimizer(opt)
        coll.apply_gradients(opt, states, batch, {"words": jnp.zeros((0, H))})
