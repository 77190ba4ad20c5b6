"""Quantized tables in the public lookups: `embedding`, `embedding_bag` and the collections.

Every output is checked against float64 lookups of the dequantized table (numpy), on one
device and on 8 (rows, columns, rows over both axes with the routed exchange pooled at the
source and at the owner, replicated, table-wise), for every precision, combiner and input
form; and quantized tables are refused where a float table is trained.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed
import jaxembed.flax
import jaxembed.nnx
from jaxembed import hlo
from jaxembed.quant import dequantize, quantize

V, H = 64, 16


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"))


def _table(precision, seed=0):
    t = np.random.default_rng(seed).normal(size=(V, H)).astype(np.float32)
    q = quantize(jnp.asarray(t), precision)
    return q, np.asarray(dequantize(q), np.float64)


def _bags64(rows, ids, weights, combiner):
    """float64 pooled bags `[B, H]` of dense ids `[B, L]` (negative: empty slots)."""
    live = ids >= 0
    got = np.where(live[..., None], rows[np.maximum(ids, 0)], 0.0)
    if combiner == "max":
        return np.where(live.any(1)[:, None], np.where(live[..., None], got, -np.inf).max(1), 0)
    w = np.where(live, 1.0 if weights is None else weights, 0.0)
    total = (got * w[..., None]).sum(1)
    if combiner == "mean":
        return total / np.maximum(w.sum(1), 1e-30)[:, None] * (w.sum(1) > 0)[:, None]
    if combiner == "sqrtn":
        norm = np.sqrt((w**2).sum(1))
        return np.where(norm[:, None] > 0, total / np.maximum(norm, 1e-30)[:, None], 0.0)
    return total


def _ids(seed, shape=(8, 5)):
    return np.random.default_rng(seed).integers(-1, V, size=shape)


LAYOUTS = [  # (table spec, ids spec, exchange, routed_pool)
    (P("model", None), P("data"), "auto", "auto"),
    (P(None, "model"), P("data"), "auto", "auto"),
    (P(("data", "model"), None), P(("data", "model")), "routed", "source"),
    (P(("data", "model"), None), P(("data", "model")), "routed", "owner"),
    (P(), P("data"), "auto", "auto"),
]


@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
def test_sharded_bags_read_the_dequantized_rows(mesh, layout):
    spec, ids_spec, exchange, pool = LAYOUTS[layout]
    precision = ("int8", "int4", "int2", "fp8", "int4")[layout]
    q, rows = _table(precision, seed=layout)
    ids = _ids(layout)
    weights = np.random.default_rng(9).uniform(0.5, 2.0, size=ids.shape).astype(np.float32)
    qs = jax.device_put(q, q.shardings(mesh, spec))
    put = lambda a: jax.device_put(jnp.asarray(a), NamedSharding(mesh, ids_spec))

    @jax.jit
    def run(x, w, table):
        kw = dict(exchange=exchange, routed_pool=pool, check_ids=False)
        return (jaxembed.embedding_bag(x, table, combiner="sum", **kw),
                jaxembed.embedding_bag(x, table, per_id_weights=w, combiner="sqrtn", **kw))  # fmt: skip

    summed, normed = run(put(ids), put(weights), qs)
    np.testing.assert_allclose(summed, _bags64(rows, ids, None, "sum"), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(normed, _bags64(rows, ids, weights, "sqrtn"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision", ["int8", "int4", "int2", "fp8"])
def test_one_device_every_combiner_and_the_plain_lookup(precision):
    q, rows = _table(precision, seed=3)
    ids = _ids(4)
    combiners = ("sum", "mean", "sqrtn", "max")

    @jax.jit
    def run(x, table):
        bags = [jaxembed.embedding_bag(x, table, combiner=c, check_ids=False) for c in combiners]
        return bags, jaxembed.embedding(jnp.abs(x), table)

    bags, plain = run(jnp.asarray(ids), q)
    for combiner, got in zip(combiners, bags, strict=True):
        want = _bags64(rows, ids, None, combiner)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=combiner)
    np.testing.assert_array_equal(plain, rows[np.abs(ids)])


def test_every_input_form_and_max_on_a_row_split_table(mesh):
    q, rows = _table("int4", seed=5)
    qs = jax.device_put(q, q.shardings(mesh, P("model", None)))
    flat = np.random.default_rng(6).integers(0, V, size=(2, 12))
    lengths = np.array([[3, 0, 5, 4], [1, 6, 2, 3]])
    starts = np.concatenate([np.zeros((2, 1), int), np.cumsum(lengths, 1)[:, :-1]], 1)
    want = np.zeros((2, 4, H))
    for b in range(2):
        for k in range(4):
            want[b, k] = rows[flat[b, starts[b, k] : starts[b, k] + lengths[b, k]]].sum(0)
    x = jax.device_put(jnp.asarray(flat), NamedSharding(mesh, P("data")))
    by_lengths = jaxembed.embedding_bag(x, qs, lengths=jnp.asarray(lengths))
    by_offsets = jaxembed.embedding_bag(x, qs, offsets=jnp.asarray(starts))
    as_ragged = jaxembed.embedding_bag(jaxembed.Ragged(jnp.asarray(flat), jnp.asarray(lengths)), qs)
    for got in (by_lengths, by_offsets, as_ragged):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    ids = _ids(7)
    got = jaxembed.embedding_bag(jnp.asarray(ids), qs, combiner="max", check_ids=False)
    np.testing.assert_allclose(got, _bags64(rows, ids, None, "max"), rtol=1e-6, atol=1e-6)
    plain = np.abs(_ids(8))
    x = jax.device_put(jnp.asarray(plain), NamedSharding(mesh, P("data")))
    np.testing.assert_array_equal(jaxembed.embedding(x, qs), rows[plain])


def test_the_plan_bytes_are_the_compiled_bytes(mesh):
    q, _ = _table("int8")
    qs = jax.device_put(q, q.shardings(mesh, P("model", None)))
    x = jax.device_put(jnp.asarray(np.abs(_ids(1))), NamedSharding(mesh, P("data")))
    plan = jaxembed.plan_embedding_bag(mesh, x.shape, q.shape, x_spec=P("data"),
                                       weight_spec=P("model", None))  # fmt: skip
    text = hlo.compiled_hlo(lambda a, t: jaxembed.embedding_bag(a, t), x, qs)
    assert hlo.total_wire_bytes(text) == pytest.approx(plan.forward_wire_bytes)


TABLES = [
    jaxembed.TableConfig("item", 96, 16, placement="rows"),
    jaxembed.TableConfig("user", 40, 8, placement="table"),
    jaxembed.TableConfig("shop", 24, 8, placement="table"),
    jaxembed.TableConfig("country", 10, 4, placement="replicated"),
]
FEATURES = [
    jaxembed.FeatureConfig("clicked", "item", combiner="mean"),
    jaxembed.FeatureConfig("user", "user"),
    jaxembed.FeatureConfig("shop", "shop"),
    jaxembed.FeatureConfig("country", "country"),
]


def _batch(seed):
    rng = np.random.default_rng(seed)
    return {
        "clicked": jnp.asarray(rng.integers(-1, 96, size=(8, 4))),
        "user": jnp.asarray(rng.integers(0, 40, size=(8, 1))),
        "shop": jnp.asarray(rng.integers(0, 24, size=(8, 1))),
        "country": jnp.asarray(rng.integers(0, 10, size=(8,))),
    }


def test_a_collection_serves_quantized_per_table(mesh):
    precisions = {"item": "int4", "user": "int8", "shop": "int8"}  # country stays float
    with jax.set_mesh(jax.make_mesh((8,), ("data",))):
        coll = jaxembed.nnx.EmbeddingBagCollection(TABLES, FEATURES, rngs=nnx.Rngs(0))
        served = coll.quantized(precisions)
        batch = _batch(1)
        got = nnx.jit(lambda m, b: m(b))(served, batch)
        float_tables = {k: np.asarray(v, np.float64) for k, v in coll.tables().items()}
    kinds = {s.name: type(v).__name__ for s, v in
             zip(served.layout.stacks, served.stacks.values(), strict=True)}  # fmt: skip
    assert sorted(kinds.values()).count("QuantizedStack") == 2, kinds  # item's, user+shop's
    for t in TABLES:
        want_rows = float_tables[t.name]
        if t.name in precisions:
            q = quantize(jnp.asarray(want_rows, jnp.float32), precisions[t.name])
            want_rows = np.asarray(dequantize(q), np.float64)
        f = next(f for f in FEATURES if f.table == t.name)
        ids = np.asarray(batch[f.name]).reshape(8, -1)
        want = _bags64(want_rows, ids, None, f.combiner or "sum")
        np.testing.assert_allclose(got[f.name], want, rtol=1e-5, atol=1e-5, err_msg=t.name)
    # Linen: the same tables quantized in its variables give the same outputs.
    linen = jaxembed.flax.EmbeddingBagCollection(TABLES, FEATURES)
    with jax.set_mesh(jax.make_mesh((8,), ("data",))):
        variables = linen.init(jax.random.key(0), batch)
        variables = linen.load_tables(coll.tables(), variables)
        linen_out = linen.apply(linen.quantized(precisions, variables), batch)
    for name in got:
        np.testing.assert_allclose(linen_out[name], got[name], rtol=1e-6, atol=1e-6)


def test_quantized_tables_are_not_trained(mesh):
    q, _ = _table("int8")
    with pytest.raises(TypeError, match="quantized tables are inference-only"):
        jaxembed.optim.adagrad(0.1).init(q)
    with pytest.raises(TypeError, match="quantized tables are inference-only"):
        jaxembed.optim.sgd(0.1).update(q, None, jnp.zeros((2, 3), jnp.int32), jnp.ones((2, 3, H)))
    coll = jaxembed.nnx.EmbeddingBagCollection(TABLES[:1], FEATURES[:1], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="unknown precision 'int3'"):
        coll.quantized("int3")
    with pytest.raises(ValueError, match=r"no table named \['itme'\]"):
        coll.quantized({"itme": "int8"})
    shared = [jaxembed.TableConfig("a", 8, 4), jaxembed.TableConfig("b", 8, 4)]
    two = jaxembed.nnx.EmbeddingBagCollection(
        shared, [jaxembed.FeatureConfig("a", "a"), jaxembed.FeatureConfig("b", "b")],
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    with pytest.raises(ValueError, match="share a precision"):
        two.quantized({"a": "int8"})
    # A quantized lookup passes no gradient to its table; the rest of the model trains.
    x = jnp.asarray(np.abs(_ids(2)))
    grad = jax.grad(lambda w: jnp.sum(jaxembed.embedding_bag(x, q) @ w))(jnp.ones((H, 2)))
    assert grad.shape == (H, 2) and bool(jnp.all(jnp.isfinite(grad)))
