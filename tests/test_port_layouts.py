"""A Linen DLRM-style model ported onto jaxembed, as issue 23 ported one: the layouts it states.

The batch is laid out only by `jax.jit(step, in_shardings=..., out_shardings=...)` over a
`Mesh(devices, "x")` (Auto axes), the collection gets no `x_sharding`: nothing warns, and the
compiled step moves exactly the bytes of the step that states `x_sharding=P("x")`. On one
device nothing is assumed and nothing is communicated; unweighted bags move no all-ones weight
array (the planner models the same: a call is weighted only with a mean or sqrtn feature or
per-id weights), while weighted and mean bags still scale; tables initialized eagerly inside
a mesh are born in their layout. Values are checked against a float64 numpy reference.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed
import jaxembed.flax
import jaxembed.nnx
from jaxembed import hlo
from jaxembed.nn.stacks import unstack

VOCABS = (64, 48, 32)
WIDTHS = (3, 5, 2)
B = 16
TABLES = [
    jaxembed.TableConfig("t0", VOCABS[0], 8, placement="rows"),
    jaxembed.TableConfig("t1", VOCABS[1], 8, placement="rows"),
    jaxembed.TableConfig("t2", VOCABS[2], 8, placement="replicated"),
]
FEATURES = [jaxembed.FeatureConfig(f"f{i}", f"t{i}", combiner="sum") for i in range(3)]


class DLRM(nn.Module):
    """Three sum-pooled sparse features and a dense MLP, as nn.Embed + sum would be."""

    x_sharding: object = None

    @nn.compact
    def __call__(self, batch):
        coll = jaxembed.flax.EmbeddingBagCollection(TABLES, FEATURES, x_sharding=self.x_sharding)
        h = jnp.concatenate([coll.concat(coll(batch)), batch["dense"]], -1)
        h = nn.relu(nn.Dense(16)(h))
        return nn.Dense(1)(h)[..., 0]


def make_batch(seed=0):
    rng = np.random.default_rng(seed)
    batch = {
        f"f{i}": rng.integers(-1, VOCABS[i], (B, WIDTHS[i])).astype(np.int32) for i in range(3)
    }
    batch["dense"] = rng.normal(size=(B, 4)).astype(np.float32)
    batch["y"] = (rng.random(B) < 0.5).astype(np.float32)
    return batch


def build(mesh, x_sharding=None, batch_spec=None):
    """The model, its eager init inside the mesh, and the jitted step with stated shardings."""
    model = DLRM(x_sharding=x_sharding)
    batch_spec = P("x") if batch_spec is None else batch_spec
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    batch = make_batch()
    with jax.set_mesh(mesh):
        params = model.init(jax.random.key(0), batch)["params"]

        def loss(p, b):
            logits = model.apply({"params": p}, b)
            return optax.sigmoid_binary_cross_entropy(logits, b["y"]).mean()

        sparse = jaxembed.flax.init_sparse(opt, loss, params, batch)
        tx = optax.masked(optax.adagrad(0.05), jaxembed.flax.dense_mask(loss, params, batch))
        opt_state = tx.init(params)

        def step(params, opt_state, sparse, batch):
            value, grads = jaxembed.flax.value_and_grad(loss)(params, batch)
            updates, opt_state = tx.update(grads.dense, opt_state, params)
            params = optax.apply_updates(params, updates)
            params, sparse = jaxembed.flax.sparse_update(opt, sparse, params, grads)
            return params, opt_state, sparse, value

        state = (params, opt_state, sparse)
        shardings = jax.tree.map(lambda a: a.sharding, state)
        batch_shardings = jax.tree.map(lambda _: NamedSharding(mesh, batch_spec), batch)
        jitted = jax.jit(
            step,
            in_shardings=(*shardings, batch_shardings),
            out_shardings=(*shardings, NamedSharding(mesh, P())),
        )
    return model, jitted, state, batch


def compiled_text(mesh, **kwargs):
    _, jitted, state, batch = build(mesh, **kwargs)
    with jax.set_mesh(mesh):
        return jitted.lower(*state, batch).compile().as_text()


def wire(text):
    return sorted((c.kind, c.dtype, c.result_shape, c.wire_bytes) for c in hlo.collectives(text))


def collection_params(params):
    return params["EmbeddingBagCollection_0"]


def test_batch_stated_in_jit_needs_no_x_sharding(fresh_warnings):
    mesh = Mesh(np.array(jax.devices()), ("x",))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning (jaxembed's or another) fails the test
        default = compiled_text(mesh)
    stated = compiled_text(mesh, x_sharding=P("x"))
    assert wire(default) == wire(stated)
    assert hlo.total_wire_bytes(default) == hlo.total_wire_bytes(stated) > 0
    # The pooled outputs are reduce-scattered onto the batch, not all-reduced whole.
    assert not any(
        c.kind == "all-reduce" and c.result_shape == ((B, 3, 8),) for c in hlo.collectives(default)
    )


def test_default_that_does_not_divide_warns_naming_x_sharding(fresh_warnings):
    mesh = Mesh(np.array(jax.devices()), ("x",))
    coll = jaxembed.flax.EmbeddingBagCollection(TABLES[:1], FEATURES[:1])
    batch = {"f0": np.zeros((6, 2), np.int32)}  # 6 examples do not divide 8 devices
    with jax.set_mesh(mesh):
        variables = coll.init(jax.random.key(0), batch)
        with pytest.warns(UserWarning, match=r"EmbeddingBagCollection.*x_sharding=") as caught:
            jax.jit(coll.apply).lower(variables, batch)
    assert not any("embedding_bag()" in str(w.message) or "x_spec" in str(w.message)
                   for w in caught)  # fmt: skip


def test_values_match_a_float64_reference():
    mesh = Mesh(np.array(jax.devices()), ("x",))
    model, jitted, state, batch = build(mesh)
    params = state[0]
    with jax.set_mesh(mesh):
        out = jax.jit(model.apply)({"params": params}, batch)
        _, _, _, value = jitted(*state, batch)
        layout = jaxembed.flax.EmbeddingBagCollection(TABLES, FEATURES).layout
    stacks = {
        s.index: np.asarray(collection_params(params)[s.name].value, np.float64)
        for s in layout.stacks
    }
    tables = unstack(layout, stacks)
    pooled = []
    for i in range(3):
        ids = batch[f"f{i}"]
        rows = tables[f"t{i}"][np.maximum(ids, 0)]
        pooled.append(np.where((ids >= 0)[..., None], rows, 0.0).sum(1))
    h = np.concatenate([*pooled, batch["dense"].astype(np.float64)], -1)
    dense = jax.tree.map(lambda a: np.asarray(a, np.float64), nn.unbox(params))
    h = np.maximum(h @ dense["Dense_0"]["kernel"] + dense["Dense_0"]["bias"], 0)
    want = (h @ dense["Dense_1"]["kernel"] + dense["Dense_1"]["bias"])[..., 0]
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-5, atol=1e-5)
    y = batch["y"].astype(np.float64)
    want_loss = np.mean(np.maximum(want, 0) - want * y + np.log1p(np.exp(-np.abs(want))))
    np.testing.assert_allclose(float(value), want_loss, rtol=1e-5)


def test_one_device_assumes_nothing_and_communicates_nothing(fresh_warnings):
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    for x_sharding in (None, P("x")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            text = compiled_text(mesh, x_sharding=x_sharding)
        assert "all-gather" not in text and "all-reduce" not in text
        assert hlo.collectives(text) == []


def test_unweighted_bags_move_no_weight_array(fresh_warnings):
    mesh = Mesh(np.array(jax.devices()), ("x",))
    text = compiled_text(mesh)
    gathered = [c for c in hlo.collectives(text) if c.kind == "all-gather" and c.dtype == "f32"]
    ids_shapes = {(B, sum(WIDTHS[:2])), (B, 2, max(WIDTHS[:2]))}
    assert not [c for c in gathered if c.result_shape[0] in ids_shapes], gathered


def test_weighted_and_mean_bags_still_scale():
    mesh = Mesh(np.array(jax.devices()), ("x",))
    tables = [jaxembed.TableConfig("t", 16, 4, placement="rows")]
    features = [
        jaxembed.FeatureConfig("w", "t", combiner="sum"),
        jaxembed.FeatureConfig("m", "t", combiner="mean"),
    ]
    coll = jaxembed.flax.EmbeddingBagCollection(tables, features)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 16, (8, 3)).astype(np.int32)
    weights = rng.random((8, 3)).astype(np.float32)
    batch = {"w": (ids, weights), "m": ids}
    with jax.set_mesh(mesh):
        variables = coll.init(jax.random.key(0), batch)
        out = jax.jit(coll.apply)(variables, batch)
    (stack,) = nn.unbox(variables)["params"].values()
    table = np.asarray(stack, np.float64)[:16]  # one table: its rows in id order
    rows = table[ids]
    np.testing.assert_allclose(np.asarray(out["w"]), (rows * weights[..., None]).sum(1),
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    np.testing.assert_allclose(np.asarray(out["m"]), rows.mean(1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit])
def test_eager_init_inside_a_mesh_places_the_tables(axis_type):
    mesh = jax.make_mesh((8,), ("x",), axis_types=(axis_type,))
    batch = make_batch()
    with jax.set_mesh(mesh):
        params = DLRM().init(jax.random.key(0), batch)["params"]
    for name, box in collection_params(params).items():
        want = P("x", None) if "rows_x" in name else P(None, None)
        assert box.value.sharding.spec == want, name  # the raw value, not unboxed
        assert box.value.sharding.mesh.size == 8
    layouts = {}
    with jax.set_mesh(mesh):
        nnx_coll = jaxembed.nnx.EmbeddingBagCollection(TABLES, FEATURES, rngs=nnx.Rngs(0))
    layouts["set_mesh"] = {k: v[...].sharding.spec for k, v in nnx_coll.stacks.items()}
    # With mesh= and no mesh context (Flax's Table(out_sharding=...) needs the mesh named).
    nnx_coll = jaxembed.nnx.EmbeddingBagCollection(TABLES, FEATURES, mesh=mesh, rngs=nnx.Rngs(0))
    layouts["mesh="] = {k: v[...].sharding.spec for k, v in nnx_coll.stacks.items()}
    for where, specs in layouts.items():
        for name, spec in specs.items():
            assert spec == (P("x", None) if "rows_x" in name else P(None, None)), (where, name)
    out = nnx_coll({f"f{i}": make_batch()[f"f{i}"] for i in range(3)})
    assert out["f0"].shape == (B, 8)
