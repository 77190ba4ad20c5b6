"""Porting a Flax model onto jaxembed (issue 23): the variables dict, tables in and out, grads.

* the Linen training helpers take what `model.init` returns (`{"params": ...}`) as well as its
  params, return the form they were given, and name the path they looked for otherwise;
* the Linen collection's `export_tables` / `load_tables` / `init_optimizer` /
  `export_optimizer` / `import_optimizer`, with the NNX collection's checks; an orbax
  checkpoint of a Linen model of `nn.Embed`s (and an `nnx.Embed` state) loaded into the port
  gives the original's outputs;
* both `value_and_grad`s take `jax.value_and_grad`'s `argnums`, `has_aux`, `allow_int` and
  `reduce_axes`, and behave as jax's.

Every value is compared with a float64 numpy computation or the Flax original.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.core import FrozenDict
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed
import jaxembed.flax
import jaxembed.nnx

B, DIM = 8, 8
TABLES = [
    jaxembed.TableConfig("item", 64, DIM, placement="rows"),
    jaxembed.TableConfig("user", 16, DIM, placement="replicated"),
]
FEATURES = [
    jaxembed.FeatureConfig("items", "item", combiner="sum"),
    jaxembed.FeatureConfig("user", "user", combiner="sum"),
]
VOCABS = {"items": 64, "user": 16}


class Original(nn.Module):
    """The model being ported: one `nn.Embed` per feature, bags sum-pooled (-1: empty)."""

    @nn.compact
    def __call__(self, batch):
        pooled = []
        for feature, vocab in VOCABS.items():
            ids = batch[feature] if batch[feature].ndim == 2 else batch[feature][:, None]
            rows = nn.Embed(vocab, DIM)(jnp.maximum(ids, 0))
            pooled.append(jnp.where((ids >= 0)[..., None], rows, 0.0).sum(1))
        return nn.Dense(1)(jnp.concatenate(pooled, -1))[..., 0]


class Port(nn.Module):
    """The port: the collection is an attribute, so its definition is `model.embeddings`."""

    embeddings: jaxembed.flax.EmbeddingBagCollection

    @nn.compact
    def __call__(self, batch):
        return nn.Dense(1)(self.embeddings.concat(self.embeddings(batch)))[..., 0]


def make_batch(rng, mesh=None):
    items = rng.integers(0, 64, (B, 5)).astype(np.int32)
    items[rng.random((B, 5)) < 0.3] = -1
    batch = {
        "items": items,
        "user": rng.integers(0, 16, (B,)).astype(np.int32),
        "y": rng.normal(size=(B,)).astype(np.float32),
    }
    if mesh is None:
        return batch
    return {k: jax.device_put(v, NamedSharding(mesh, P("data"))) for k, v in batch.items()}


def pooled64(tables, batch):
    """Each feature's sum-pooled rows in float64, `[B, Σ dim]` in feature order."""
    out = []
    for feature, table in (("items", "item"), ("user", "user")):
        ids = np.asarray(batch[feature]).reshape(B, -1)
        w = np.asarray(tables[table], np.float64)
        out.append(np.where((ids >= 0)[..., None], w[np.maximum(ids, 0)], 0.0).sum(1))
    return np.concatenate(out, -1)


def unbox(x):
    return x.value if isinstance(x, nn.Partitioned) else x


@pytest.fixture
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"))


@pytest.fixture
def port():
    return Port(jaxembed.flax.EmbeddingBagCollection(TABLES, FEATURES))


def loss_v(model):
    return lambda v, batch: jnp.mean((model.apply(v, batch) - batch["y"]) ** 2)


# 1. The variables dict and the params tree alike ------------------------------------------


def test_helpers_take_the_variables_and_the_params_alike(mesh, port):
    opt = jaxembed.optim.sgd(0.5)
    coll = port.embeddings
    with jax.set_mesh(mesh):
        batch = make_batch(np.random.default_rng(0), mesh)
        variables = port.init(jax.random.key(0), batch)
        params = variables["params"]
        by_vars = loss_v(port)

        def by_params(p, batch):
            return by_vars({"params": p}, batch)

        sv = jaxembed.flax.init_sparse(opt, by_vars, variables, batch)
        sp = jaxembed.flax.init_sparse(opt, by_params, params, batch)
        assert list(sv) == list(sp) == ["embeddings"]
        mv = jaxembed.flax.dense_mask(by_vars, variables, batch)
        mp = jaxembed.flax.dense_mask(by_params, params, batch)
        assert mv == {"params": mp}
        stacks = [s.name for s in coll.layout.stacks]
        assert mp["Dense_0"] == {"kernel": True, "bias": True}
        assert mp["embeddings"] == dict.fromkeys(stacks, False)

        value_v, grads_v = jaxembed.flax.value_and_grad(by_vars)(variables, batch)
        value_p, grads_p = jaxembed.flax.value_and_grad(by_params)(params, batch)
        new_v, _ = jaxembed.flax.sparse_update(opt, sv, variables, grads_v)
        new_p, _ = jaxembed.flax.sparse_update(opt, sp, params, grads_p)
        before = {k: np.asarray(v) for k, v in coll.export_tables(variables, path="embeddings").items()}  # fmt: skip
        after_v = coll.export_tables(new_v, path="embeddings")
        after_p = coll.export_tables(new_p, path="embeddings")
    assert list(new_v) == ["params"] and sorted(new_p) == sorted(params)
    assert all(isinstance(new_p["embeddings"][s], nn.Partitioned) for s in stacks)
    assert isinstance(grads_v.dense, dict) and list(grads_v.dense) == ["params"]

    # The float64 reference: y = x k + b, loss = mean((y - t)^2), sgd on the rows read.
    k = np.asarray(unbox(params["Dense_0"]["kernel"]), np.float64)[:, 0]
    bias = float(np.asarray(unbox(params["Dense_0"]["bias"]))[0])
    x = pooled64(before, batch)
    resid = x @ k + bias - np.asarray(batch["y"], np.float64)
    np.testing.assert_allclose(float(value_v), np.mean(resid**2), rtol=1e-5)
    np.testing.assert_allclose(float(value_p), np.mean(resid**2), rtol=1e-5)
    dy = 2 * resid / B
    np.testing.assert_allclose(
        np.asarray(unbox(grads_v.dense["params"]["Dense_0"]["kernel"]))[:, 0], x.T @ dy,
        rtol=1e-4, atol=1e-6,
    )  # fmt: skip
    dx = dy[:, None] * k[None, :]  # d loss / d each feature's pooled output
    for feature, table, cols in (("items", "item", slice(0, DIM)), ("user", "user", slice(DIM, None))):  # fmt: skip
        want = before[table].astype(np.float64)
        ids = np.asarray(batch[feature]).reshape(B, -1)
        for b, i in zip(*np.nonzero(ids >= 0), strict=True):
            want[ids[b, i]] -= 0.5 * dx[b, cols]
        np.testing.assert_allclose(np.asarray(after_v[table]), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(after_p[table]), want, rtol=1e-5, atol=1e-6)


def test_a_frozen_dict_stays_one_and_jit_takes_the_variables(mesh, port):
    opt = jaxembed.optim.sgd(0.1)
    with jax.set_mesh(mesh):
        batch = make_batch(np.random.default_rng(1), mesh)
        variables = FrozenDict(port.init(jax.random.key(0), batch))
        loss = loss_v(port)
        states = jaxembed.flax.init_sparse(opt, loss, variables, batch)

        @jax.jit
        def step(variables, states, batch):
            _, grads = jaxembed.flax.value_and_grad(loss)(variables, batch)
            return jaxembed.flax.sparse_update(opt, states, variables, grads)

        new, _ = step(variables, states, batch)
        eager, _ = jaxembed.flax.sparse_update(
            opt, states, variables, jaxembed.flax.value_and_grad(loss)(variables, batch)[1]
        )
    assert isinstance(new, FrozenDict) and isinstance(new["params"], FrozenDict)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(eager), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_other_trees_name_the_path_looked_for_and_what_is_there(mesh, port):
    opt = jaxembed.optim.sgd(0.1)
    with jax.set_mesh(mesh):
        batch = make_batch(np.random.default_rng(2), mesh)
        variables = port.init(jax.random.key(0), batch)
        loss = loss_v(port)
        states = jaxembed.flax.init_sparse(opt, loss, variables, batch)
        _, grads = jaxembed.flax.value_and_grad(loss)(variables, batch)
        other = {"params": {"Dense_0": variables["params"]["Dense_0"]}}
        with pytest.raises(ValueError, match=r"sparse_update: no parameters of the jaxembed"
                           r"\.flax\.EmbeddingBagCollection at 'embeddings': looked for "
                           r"tree\['embeddings'\] and tree\['params'\]\['embeddings'\]; at "
                           r"params the tree has keys \['Dense_0'\]"):  # fmt: skip
            jaxembed.flax.sparse_update(opt, states, other, grads)
        renamed = {"params": {**variables["params"], "embeddings": {"stack9": 1}}}
        with pytest.raises(ValueError, match=r"at 'embeddings' has parameters \['stack9'\] "
                           r"\(at params/embeddings\), but it needs \['stack0"):  # fmt: skip
            jaxembed.flax.sparse_update(opt, states, renamed, grads)
        with pytest.raises(ValueError, match="or their \\['params'\\] tree, a dict, got list"):
            jaxembed.flax.sparse_update(opt, states, [variables], grads)
        with pytest.raises(ValueError, match=r"tree\['EmbeddingBagCollection_0'\] and "
                           r"tree\['params'\]\['EmbeddingBagCollection_0'\]; at params the tree "
                           r"has keys \['Dense_0', 'embeddings'\]"):  # fmt: skip
            port.embeddings.export_tables(variables, path="EmbeddingBagCollection_0")
        with pytest.raises(ValueError, match=r"pass the variables .* path='Embedding"):
            port.embeddings.export_tables()


# 4. Tables and optimizer states in and out; an nn.Embed checkpoint into the port ---------


def test_an_orbax_checkpoint_of_nn_embeds_restores_into_the_port(mesh, port, tmp_path):
    import orbax.checkpoint as ocp

    original = Original()  # trained and saved on one device, as the program had it
    host = make_batch(np.random.default_rng(3))
    saved = original.init(jax.random.key(1), host)
    want = original.apply(saved, host)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "original", saved)
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "original")
    assert sorted(restored["params"]) == ["Dense_0", "Embed_0", "Embed_1"]
    with jax.set_mesh(mesh):
        batch = {k: jax.device_put(v, NamedSharding(mesh, P("data"))) for k, v in host.items()}
        variables = port.init(jax.random.key(0), batch)
        layout_before = jax.tree.map(lambda a: jax.typeof(a).sharding.spec, variables)
        tables = jaxembed.flax.embed_tables(restored, {"item": "Embed_0", "user": "Embed_1"})
        variables = port.embeddings.load_tables(tables, variables, path="embeddings")
        variables["params"]["Dense_0"] = jax.tree.map(  # the dense head, placed as the port's
            lambda a, old: jax.device_put(a, old.sharding),
            restored["params"]["Dense_0"], variables["params"]["Dense_0"],
        )  # fmt: skip
        got = port.apply(variables, batch)
        back = port.embeddings.export_tables(variables, path="embeddings")
    # The stacks kept their boxes and layout.
    assert jax.tree.map(lambda a: jax.typeof(a).sharding.spec,
                        {"params": {"embeddings": variables["params"]["embeddings"]}}) == {
        "params": {"embeddings": layout_before["params"]["embeddings"]}}  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    k = np.asarray(saved["params"]["Dense_0"]["kernel"], np.float64)[:, 0]
    b = float(np.asarray(saved["params"]["Dense_0"]["bias"])[0])
    w = {"item": saved["params"]["Embed_0"]["embedding"], "user": saved["params"]["Embed_1"]["embedding"]}  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), pooled64(w, batch) @ k + b, rtol=1e-5, atol=1e-5)
    for name in w:
        np.testing.assert_array_equal(np.asarray(back[name]), np.asarray(w[name]))


def test_an_nnx_embed_state_loads_into_the_nnx_collection(mesh):
    class OriginalNNX(nnx.Module):
        def __init__(self, rngs):
            self.items = nnx.Embed(64, DIM, rngs=rngs)
            self.user = nnx.Embed(16, DIM, rngs=rngs)

    old = OriginalNNX(nnx.Rngs(4))
    with jax.set_mesh(mesh):
        coll = jaxembed.nnx.EmbeddingBagCollection(TABLES, FEATURES, rngs=nnx.Rngs(0))
        names = {"item": "items", "user": "user"}
        for tree in (nnx.state(old), nnx.to_pure_dict(nnx.state(old))):
            coll.load_tables(jaxembed.nnx.embed_tables(tree, names))
            batch = make_batch(np.random.default_rng(5), mesh)
            got = coll.concat(coll(batch))
            w = {"item": old.items.embedding[...], "user": old.user.embedding[...]}
            np.testing.assert_allclose(np.asarray(got), pooled64(w, batch), rtol=1e-5, atol=1e-6)
        with pytest.raises(ValueError, match=r"embed_tables: table 'item': no parameters of the "
                           r"Embed at 'Embed_0': looked for tree\['Embed_0'\]; at the root the "
                           r"tree has keys \['items', 'user'\]"):  # fmt: skip
            jaxembed.nnx.embed_tables(nnx.state(old), {"item": "Embed_0"})


def test_load_tables_checks_before_it_builds(mesh, port):
    coll = port.embeddings
    with jax.set_mesh(mesh):
        variables = port.init(jax.random.key(0), make_batch(np.random.default_rng(6), mesh))
        good = {k: np.asarray(v) for k, v in coll.export_tables(variables, path="embeddings").items()}  # fmt: skip
        cases = [
            ({"item": good["item"]}, r"load_tables: no values for tables \['user'\]"),
            ({**good, "ad": good["user"]}, r"tables \['ad'\] are not in the collection"),
            ({**good, "user": good["user"][:1]}, r"table 'user' has shape \[1, 8\], but"),
            ({**good, "user": good["user"].astype(np.int32)}, "table 'user' has dtype int32"),
        ]
        for values, match in cases:
            with pytest.raises(ValueError, match=match):
                coll.load_tables(values, variables, path="embeddings")
        doubled = {k: 2 * v for k, v in good.items()}
        new = coll.load_tables(doubled, variables["params"], path="embeddings")
        bound = jaxembed.flax.EmbeddingBagCollection(TABLES, FEATURES)
        own = {"params": variables["params"]["embeddings"]}
        via_apply = bound.apply(own, method="export_tables")
        reloaded = bound.apply(own, doubled, method="load_tables")
        got_new = coll.export_tables(new, path="embeddings")
        got_reloaded = bound.export_tables(reloaded)
        unchanged = coll.export_tables(variables, path="embeddings")
    # Outside the mesh the layout is another (one device): the stacks are not this one's.
    with pytest.raises(ValueError, match=r"has parameters \['stack0_dim8_rows_dataxmodel', "
                       r"'stack1_dim8_rows_replicated'\] \(at params/embeddings\), but it "
                       r"needs \['stack0_dim8_rows_replicated'\]"):  # fmt: skip
        coll.export_tables(variables, path="embeddings")
    assert sorted(new) == sorted(variables["params"])  # the params form, as given
    for name in good:
        np.testing.assert_array_equal(np.asarray(got_new[name]), doubled[name])
        np.testing.assert_array_equal(np.asarray(via_apply[name]), good[name])
        np.testing.assert_array_equal(np.asarray(got_reloaded[name]), doubled[name])
        np.testing.assert_array_equal(np.asarray(unchanged[name]), good[name])  # as given


def test_optimizer_states_export_and_import_onto_another_placement(mesh, port):
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    other_tables = [jaxembed.TableConfig("item", 64, DIM, placement="replicated"), TABLES[1]]
    other = Port(jaxembed.flax.EmbeddingBagCollection(other_tables, FEATURES))
    with jax.set_mesh(mesh):
        batch = make_batch(np.random.default_rng(7), mesh)
        variables = port.init(jax.random.key(0), batch)
        loss = loss_v(port)
        states = jaxembed.flax.init_sparse(opt, loss, variables, batch)
        fresh = port.embeddings.init_optimizer(opt, variables, path="embeddings")
        for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(states["embeddings"]), strict=True):  # fmt: skip
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        _, grads = jaxembed.flax.value_and_grad(loss)(variables, batch)
        variables, states = jaxembed.flax.sparse_update(opt, states, variables, grads)
        exported = port.embeddings.export_optimizer(states["embeddings"])
        tables = port.embeddings.export_tables(variables, path="embeddings")

        theirs = other.init(jax.random.key(9), batch)
        theirs = other.embeddings.load_tables(tables, theirs, path="embeddings")
        imported = other.embeddings.import_optimizer(opt, exported, theirs, path="embeddings")
        again = other.embeddings.export_optimizer(imported)
        # Two stacks (rows over the mesh, replicated) there, one replicated stack here.
        assert [s.tables for s in port.embeddings.layout.stacks] == [("item",), ("user",)]
        assert [s.tables for s in other.embeddings.layout.stacks] == [("item", "user")]
        with pytest.raises(ValueError, match=r"import_optimizer: the state of table 'item' has "
                           r"slots \['accumulator'\], but adam keeps"):  # fmt: skip
            other.embeddings.import_optimizer(jaxembed.optim.adam(0.1), exported, theirs,
                                              path="embeddings")  # fmt: skip
        with pytest.raises(ValueError, match=r"import_optimizer: the export has no state for "
                           r"tables \['user'\]"):  # fmt: skip
            other.embeddings.import_optimizer(opt, {"item": exported["item"]}, theirs,
                                              path="embeddings")  # fmt: skip
    # rowwise adagrad's accumulator after one step: the mean of the squared row gradient.
    read = np.zeros(64, bool)
    read[np.asarray(batch["items"])[np.asarray(batch["items"]) >= 0]] = True
    acc = np.asarray(exported["item"]["slots"]["accumulator"])
    assert (acc[read] > 0).all() and (acc[~read] == 0).all()
    for name in ("item", "user"):
        assert int(again[name]["count"]) == int(exported[name]["count"]) == 1
        np.testing.assert_array_equal(np.asarray(again[name]["slots"]["accumulator"]),
                                      np.asarray(exported[name]["slots"]["accumulator"]))  # fmt: skip


# 5. value_and_grad takes jax.value_and_grad's arguments ---------------------------------


def reference(scale, table, n, ids, *, offset=0.0):
    """The loss both faces compute, on the table itself (jax differentiates the gather)."""
    return scale * n * jnp.sum((table[ids] + offset) ** 2)


def ours_and_jax(face):
    """The same loss through a jaxembed Embed of each face, and its table."""
    if face == "linen":
        model = jaxembed.flax.Embed(10, 4)
        ids = jnp.array([1, 2, 2, 7])
        variables = model.init(jax.random.key(0), ids)
        table = variables["params"]["embedding"]

        def fn(scale, variables, n, ids, *, offset=0.0):
            return scale * n * jnp.sum((model.apply(variables, ids) + offset) ** 2)

        return jaxembed.flax.value_and_grad, fn, variables, table, ids
    model = jaxembed.nnx.Embed(10, 4, rngs=nnx.Rngs(0))
    ids = jnp.array([1, 2, 2, 7])

    def fn(scale, model, n, ids, *, offset=0.0):
        return scale * n * jnp.sum((model(ids) + offset) ** 2)

    return jaxembed.nnx.value_and_grad, fn, model, model.embedding[...], ids


def scatter64(ids, out_grad, vocab=10):
    dense = np.zeros((vocab, np.shape(out_grad)[-1]))
    np.add.at(dense, np.asarray(ids), np.asarray(out_grad, np.float64))
    return dense


@pytest.mark.parametrize("face", ["linen", "nnx"])
def test_value_and_grad_takes_jaxs_arguments(face):
    vg, fn, model, table, ids = ours_and_jax(face)
    args, ref_args = (1.5, model, 3, ids), (1.5, table, 3, ids)
    w = np.asarray(table, np.float64)
    want = 1.5 * 3 * np.sum(w[np.asarray(ids)] ** 2)
    d_table = 1.5 * 3 * scatter64(ids, 2 * w[np.asarray(ids)])  # float64 d loss / d table

    # argnums: an int (one gradient), negative, or a tuple (a tuple of gradients).
    for argnums in (0, -4):
        value, grads = vg(fn, argnums=argnums)(*args)
        ref_value, ref_grad = jax.value_and_grad(reference, argnums=argnums)(*ref_args)
        np.testing.assert_allclose(float(value), want, rtol=1e-5)
        np.testing.assert_allclose(float(ref_value), want, rtol=1e-5)
        np.testing.assert_allclose(float(grads.dense), float(ref_grad), rtol=1e-5)
        np.testing.assert_allclose(float(grads.dense), want / 1.5, rtol=1e-5)
        # The lookup's output gradient is taken whatever argnums selects.
        np.testing.assert_allclose(scatter64(ids, grads.out_grads[0]), d_table, rtol=1e-5)
    value, grads = vg(fn, argnums=(0, 1))(*args)
    assert isinstance(grads.dense, tuple) and len(grads.dense) == 2
    np.testing.assert_allclose(float(grads.dense[0]), want / 1.5, rtol=1e-5)
    dense_model = grads.dense[1]
    assert not jax.tree.leaves(dense_model) or all(
        not np.any(np.asarray(x)) for x in jax.tree.leaves(dense_model)
    )  # the table is trained row-sparse: no dense gradient (zeros, or no entry for NNX)

    # allow_int: an int argument is refused as jax refuses it, or gets jax's float0.
    with pytest.raises(TypeError, match="allow_int"):
        jax.value_and_grad(reference, argnums=2)(*ref_args)
    with pytest.raises(TypeError, match="allow_int"):
        vg(fn, argnums=2)(*args)
    _, grads = vg(fn, argnums=(0, 2), allow_int=True)(*args)
    _, ref = jax.value_and_grad(reference, argnums=(0, 2), allow_int=True)(*ref_args)
    assert grads.dense[1].dtype == ref[1].dtype == jax.dtypes.float0

    # has_aux, keyword arguments (never differentiated), reduce_axes.
    def with_aux(*a, **k):
        return fn(*a, **k), {"n": a[2]}

    (value, aux), grads = vg(with_aux, has_aux=True)(*args, offset=1.0)
    want_offset = 1.5 * 3 * np.sum((w[np.asarray(ids)] + 1.0) ** 2)
    np.testing.assert_allclose(float(value), want_offset, rtol=1e-5)
    np.testing.assert_allclose(float(grads.dense), want_offset / 1.5, rtol=1e-5)
    assert aux == {"n": 3}
    with pytest.raises(NotImplementedError, match="reduce_axes"):
        jax.value_and_grad(reference, reduce_axes=("i",))(*ref_args)
    with pytest.raises(NotImplementedError, match="reduce_axes"):
        vg(fn, reduce_axes=("i",))(*args)
    with pytest.raises(TypeError, match=r"argnums=5 needs at least 6 positional arguments, "
                       r"but the call passed 4"):  # fmt: skip
        vg(fn, argnums=5)(*args)
    with pytest.raises(TypeError, match="argnums must be an int or a sequence of ints"):
        vg(fn, argnums="0")(*args)


def test_nnx_model_in_another_position_trains_row_sparse():
    model = jaxembed.nnx.Embed(10, 4, rngs=nnx.Rngs(0))
    ids = jnp.array([1, 2, 2, 7])
    w = np.asarray(model.embedding[...], np.float64)
    opt = jaxembed.nnx.SparseOptimizer(model, jaxembed.optim.sgd(0.5))

    def loss(ids, model):
        return jnp.sum(model(ids) ** 2)

    value, grads = jaxembed.nnx.value_and_grad(loss, argnums=1)(ids, model)
    opt.update(model, grads)
    np.testing.assert_allclose(float(value), np.sum(w[np.asarray(ids)] ** 2), rtol=1e-5)
    want = w - 0.5 * scatter64(ids, 2 * w[np.asarray(ids)])
    np.testing.assert_allclose(np.asarray(model.embedding[...]), want, rtol=1e-5, atol=1e-6)
