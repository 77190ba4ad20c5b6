"""Row-sparse tables and optax for the rest, in one step: jaxembed.nnx / jaxembed.flax helpers.

A small model (a collection, an Embed and a dense head) is trained with
`value_and_grad` + `SparseOptimizer` (NNX) and `value_and_grad` + `sparse_update` (Linen).
The dense gradients equal the plain gradients of the loss, and the tables' update equals
`opt.update` fed with d loss / d each lookup's output computed by hand; the state checkpoints
with orbax and restores onto another mesh.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed
import jaxembed.flax
import jaxembed.nnx

TABLES = [
    jaxembed.TableConfig("item", 100, 8, placement="rows"),
    jaxembed.TableConfig("country", 10, 8, placement="replicated"),
]
FEATURES = [
    jaxembed.FeatureConfig("clicked", "item", combiner="mean"),
    jaxembed.FeatureConfig("country", "country"),
]
spec = nnx.with_partitioning(nnx.initializers.normal(), ("model", None))


class Model(nnx.Module):
    def __init__(self, rngs):
        self.coll = jaxembed.nnx.EmbeddingBagCollection(TABLES, FEATURES, rngs=rngs)
        self.embed = jaxembed.nnx.Embed(52, 8, rngs=rngs, embedding_init=spec)
        self.head = nnx.Linear(24, 1, rngs=rngs)

    def features(self, batch):
        return self.coll.concat(self.coll(batch)), self.embed(batch["seq"]).mean(1)

    def __call__(self, batch):
        pooled, seq = self.features(batch)
        return self.head(jnp.concatenate([pooled, seq], -1))[..., 0]


def loss_fn(model, batch):
    return jnp.mean((model(batch) - batch["y"]) ** 2)


def make_batch(rng, mesh):
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))
    return {
        "clicked": put(rng.integers(-1, 100, (8, 5)).astype(np.int32)),
        "country": put(rng.integers(0, 10, (8,)).astype(np.int32)),
        "seq": put(rng.integers(0, 52, (8, 3)).astype(np.int32)),
        "y": put(rng.normal(size=(8,)).astype(np.float32)),
    }


def test_nnx_step_equals_the_hand_made_one():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    with jax.set_mesh(mesh):
        model = Model(nnx.Rngs(0))
        batch = make_batch(np.random.default_rng(0), mesh)
        dense = nnx.Optimizer(model, optax.adam(1e-2), wrt=jaxembed.nnx.DENSE)
        sparse = jaxembed.nnx.SparseOptimizer(model, opt)

        # By hand: d loss / d lookups' outputs and d loss / d dense params, then each update.
        coll_out = model.coll(batch)
        seq_out = model.embed(batch["seq"])

        def by_hand(head, coll_out, seq_out):
            pooled = model.coll.concat(coll_out)
            x = jnp.concatenate([pooled, seq_out.mean(1)], -1)
            return jnp.mean((head(x)[..., 0] - batch["y"]) ** 2)

        want_loss, (g_head, g_coll, g_seq) = nnx.value_and_grad(by_hand, argnums=(0, 1, 2))(
            model.head, coll_out, seq_out
        )
        states = model.coll.init_optimizer(opt)
        want_coll = model.coll.apply_gradients(opt, states, batch, g_coll)  # on a copy below
        want_tables = {k: np.asarray(v) for k, v in model.coll.tables().items()}
        want_embed, _ = opt.update(model.embed.embedding[...], opt.init(model.embed.embedding[...]),
                                   batch["seq"], g_seq)  # fmt: skip
        del want_coll

        model = Model(nnx.Rngs(0))  # fresh, for the helpers
        dense = nnx.Optimizer(model, optax.adam(1e-2), wrt=jaxembed.nnx.DENSE)
        sparse = jaxembed.nnx.SparseOptimizer(model, opt)

        @nnx.jit
        def step(model, dense, sparse, batch):
            loss, grads = jaxembed.nnx.value_and_grad(loss_fn)(model, batch)
            dense.update(model, grads.dense)
            sparse.update(model, grads)
            return loss, grads.dense

        loss, g_dense = step(model, dense, sparse, batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    np.testing.assert_allclose(g_dense["head"]["kernel"][...], g_head["kernel"][...], rtol=1e-5)
    assert "embedding" not in g_dense.get("embed", {})  # the tables are not dense parameters
    for k, v in model.coll.tables().items():
        np.testing.assert_allclose(np.asarray(v), want_tables[k], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(model.embed.embedding[...]), np.asarray(want_embed),
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    assert model.embed.embedding.sharding.spec == P("model", None)


def test_nnx_training_lowers_the_loss_and_checkpoints(tmp_path):
    import orbax.checkpoint as ocp

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    opt = jaxembed.optim.adam(0.05)
    with jax.set_mesh(mesh):
        model = Model(nnx.Rngs(1))
        batch = make_batch(np.random.default_rng(1), mesh)
        dense = nnx.Optimizer(model, optax.adam(1e-2), wrt=jaxembed.nnx.DENSE)
        sparse = jaxembed.nnx.SparseOptimizer(model, opt)

        @nnx.jit
        def step(model, dense, sparse, batch):
            loss, grads = jaxembed.nnx.value_and_grad(loss_fn)(model, batch)
            dense.update(model, grads.dense)
            sparse.update(model, grads)
            return loss

        losses = [float(step(model, dense, sparse, batch)) for _ in range(6)]
        assert losses[-1] < 0.5 * losses[0], losses
        exported = {
            "embed": sparse.states["embed"],
            "coll": model.coll.export_optimizer(sparse.states["coll"]),
            "tables": model.coll.tables(),
        }
        path = ocp.test_utils.erase_and_create_empty(tmp_path / "ckpt")
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(path / "state", exported)
    # Restore onto another mesh and placement: the same tables and states, in the new layout.
    other = jax.make_mesh((8,), ("data",))
    with jax.set_mesh(other):
        fresh = jaxembed.nnx.EmbeddingBagCollection(
            [jaxembed.TableConfig("item", 100, 8, placement="table"), TABLES[1]], FEATURES,
            rngs=nnx.Rngs(9),
        )  # fmt: skip
        with ocp.StandardCheckpointer() as ckpt:
            restored = ckpt.restore(path / "state")
        fresh.load_tables(restored["tables"])
        states = fresh.import_optimizer(opt, restored["coll"])
        for k, v in fresh.tables().items():
            np.testing.assert_array_equal(np.asarray(v), np.asarray(exported["tables"][k]))
        back = fresh.export_optimizer(states)
        for t in back:
            for name, v in back[t]["slots"].items():
                np.testing.assert_array_equal(np.asarray(v),
                                              np.asarray(exported["coll"][t]["slots"][name]))  # fmt: skip
        assert int(states[0].count) == 6


def test_dense_use_of_a_table_and_two_lookups_are_errors():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    with jax.set_mesh(mesh):
        model = Model(nnx.Rngs(0))
        batch = make_batch(np.random.default_rng(2), mesh)

        def tied(m, batch):
            return jnp.sum(m.embed.attend(jnp.ones((2, 8))))

        with pytest.raises(ValueError, match="reads the whole table"):
            jaxembed.nnx.value_and_grad(tied)(model, batch)

        def twice(m, batch):
            return jnp.sum(m.embed(batch["seq"])) + jnp.sum(m.embed(batch["seq"]))

        with pytest.raises(ValueError, match="looks up twice in one training step"):
            jaxembed.nnx.value_and_grad(twice)(model, batch)


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, batch):
        coll = jaxembed.flax.EmbeddingBagCollection(TABLES, FEATURES)
        seq = jaxembed.flax.Embed(52, 8, embedding_init=nn.with_partitioning(
            nn.initializers.normal(), ("model", None)))(batch["seq"]).mean(1)  # fmt: skip
        return nn.Dense(1)(jnp.concatenate([coll.concat(coll(batch)), seq], -1))[..., 0]


def test_linen_step():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    model = LinenModel()
    with jax.set_mesh(mesh):
        batch = make_batch(np.random.default_rng(3), mesh)
        params = model.init(jax.random.key(0), batch)["params"]

        def loss(p, batch):
            return jnp.mean((model.apply({"params": p}, batch) - batch["y"]) ** 2)

        sparse = jaxembed.flax.init_sparse(opt, loss, params, batch)
        mask = jaxembed.flax.dense_mask(loss, params, batch)
        assert mask["Dense_0"]["kernel"] and not mask["Embed_0"]["embedding"]
        tx = optax.masked(optax.adamw(1e-2, weight_decay=0.5), mask)
        opt_state = tx.init(params)

        @jax.jit
        def step(params, opt_state, sparse, batch):
            value, grads = jaxembed.flax.value_and_grad(loss)(params, batch)
            updates, opt_state = tx.update(grads.dense, opt_state, params)
            params = optax.apply_updates(params, updates)
            params, sparse = jaxembed.flax.sparse_update(opt, sparse, params, grads)
            return params, opt_state, sparse, value, grads

        new, _, _, value, grads = step(params, opt_state, sparse, batch)
        # The table's update is opt.update with d loss / d its lookup's output.
        seq_ids = batch["seq"]

        def by_hand(out):
            coll = model.apply({"params": params}, batch, method=lambda m, b: m.__call__(b))
            del coll
            return out

        del by_hand
        table = params["Embed_0"]["embedding"].value
        og = grads.out_grads[[r.kind for r in grads.records].index("embed")]
        want, _ = opt.update(table, opt.init(table), seq_ids, og, vocab_size=52)
    np.testing.assert_allclose(np.asarray(new["Embed_0"]["embedding"].value), np.asarray(want),
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    assert np.isfinite(float(value))
    # optax left the tables alone (no weight decay on them): rows no id read are unchanged.
    read = np.zeros(52, bool)
    read[np.asarray(seq_ids).reshape(-1)] = True
    np.testing.assert_array_equal(np.asarray(new["Embed_0"]["embedding"].value)[~read],
                                  np.asarray(table)[~read])  # fmt: skip
