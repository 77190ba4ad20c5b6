"""jaxembed.flax.Embed (Linen) against flax.linen.Embed: one device, sharded, training.

The reference is Linen's own `nn.Embed` on one device with the same key; lookup outputs are
compared bit for bit, logits and gradients with allclose.
"""

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax_inputs import IDS_SHAPE, H, V, make_data
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed.flax

init = nn.linear.default_embed_init
KEY = jax.random.key(0)


def make_mesh(axis_type):
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)


def objective(model, params, ids, query, ct_out, ct_logits):
    out = model.apply({"params": params}, ids)
    logits = model.apply({"params": params}, query, method="attend")
    return jnp.sum(out * ct_out) + jnp.sum(logits * ct_logits), (out, logits)


def reference(ids, query, ct_out, ct_logits, vocab=V):
    ref = nn.Embed(vocab, H)
    params = ref.init(KEY, ids)["params"]
    (_, (out, logits)), grads = jax.value_and_grad(objective, argnums=1, has_aux=True)(
        ref, params, ids, query, ct_out, ct_logits
    )
    return params["embedding"], out, logits, grads["embedding"]


def unboxed(params):
    return nn.meta.unbox(params)


def assumes_ids_layout(expected=True):
    """Traced ids in an Auto mesh without inputs_sharding: jaxembed warns of its assumption."""
    if not expected:
        return contextlib.nullcontext()
    return pytest.warns(UserWarning, match=r"ids of shape .* are traced in an Auto mesh")


def test_one_device_matches_linen_exactly():
    ids, query, ct_out, ct_logits = make_data()
    ref_table, ref_out, ref_logits, ref_grad = reference(ids, query, ct_out, ct_logits)
    model = jaxembed.flax.Embed(V, H)
    params = model.init(KEY, ids)["params"]
    np.testing.assert_array_equal(params["embedding"], ref_table)
    (_, (out, logits)), grads = jax.jit(
        jax.value_and_grad(objective, argnums=1, has_aux=True), static_argnums=0
    )(model, params, ids, query, ct_out, ct_logits)
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_array_equal(logits, ref_logits)
    np.testing.assert_allclose(grads["embedding"], ref_grad, rtol=1e-6, atol=1e-6)


LAYOUTS = {
    "rows": ("model", None),
    "hidden": (None, "model"),
    "rows-over-data-model": (("data", "model"), None),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_sharded_matches_linen(layout, axis_type, fresh_warnings):
    names = LAYOUTS[layout]
    mesh = make_mesh(axis_type)
    ids, query, ct_out, ct_logits = make_data(1)
    ref_table, ref_out, ref_logits, ref_grad = reference(ids, query, ct_out, ct_logits)
    model = jaxembed.flax.Embed(V, H, embedding_init=nn.with_partitioning(init, names))
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh), assumes_ids_layout(axis_type == AxisType.Auto):
        abstract = jax.eval_shape(model.init, KEY, ids)
        variables = jax.jit(model.init, out_shardings=nn.get_sharding(abstract, mesh))(KEY, ids)
    with jax.set_mesh(mesh):
        params = variables["params"]
        table = params["embedding"].value
        assert table.sharding.spec == P(*names)
        np.testing.assert_array_equal(table, ref_table)

        def f(params, ids, query, ct_out, ct_logits):
            out = model.apply({"params": params}, ids, inputs_sharding=P("data"))
            logits = model.apply({"params": params}, query, method="attend")
            return jnp.sum(out * ct_out) + jnp.sum(logits * ct_logits), (out, logits)

        (_, (out, logits)), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(
            params, put(ids), put(query), put(ct_out), put(ct_logits)
        )
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
    grad = grads["embedding"].value  # the gradient keeps the Partitioned box
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-5)
    assert grad.sharding.is_equivalent_to(NamedSharding(mesh, P(*names)), 2)


def test_logical_partitioning_and_padding(fresh_warnings):
    vocab = 61  # rows over model (4): padded to 64
    mesh = make_mesh(AxisType.Auto)
    rules = [("vocab", "model"), ("embed", None)]
    ids, query, ct_out, ct_logits = make_data(2, vocab)
    ref_table, ref_out, ref_logits, ref_grad = reference(ids, query, ct_out, ct_logits, vocab)
    model = jaxembed.flax.Embed(
        vocab, H, embedding_init=nn.with_logical_partitioning(init, ("vocab", "embed"))
    )
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules), assumes_ids_layout():
        abstract = jax.eval_shape(model.init, KEY, ids)
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
        params = jax.jit(model.init, out_shardings=shardings)(KEY, ids)["params"]
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules), assumes_ids_layout():
        table = np.asarray(params["embedding"].value)
        assert table.shape == (64, H)
        assert params["embedding"].value.sharding.spec == P("model", None)
        np.testing.assert_array_equal(table[:vocab], ref_table)
        assert not table[vocab:].any()
        f = lambda p: objective(model, p, ids, query, ct_out, ct_logits)
        (_, (out, logits)), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
    np.testing.assert_array_equal(out, ref_out)
    assert logits.shape == (*IDS_SHAPE, vocab)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
    grad = np.asarray(grads["embedding"].value)
    np.testing.assert_allclose(grad[:vocab], ref_grad, rtol=1e-5, atol=1e-5)
    assert not grad[vocab:].any()


class TiedLM(nn.Module):
    """Embed -> Dense -> tied head; loss by attend + optax, or by the vocab-parallel loss."""

    embed: nn.Module
    vocab_parallel: bool

    @nn.compact
    def __call__(self, ids, labels):
        h = jnp.tanh(nn.Dense(H)(self.embed(ids)))
        if self.vocab_parallel:
            return self.embed.cross_entropy(h, labels, reduction="mean")
        logits = self.embed.attend(h)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def train(model, params, batches):
    tx = optax.adamw(1e-2, weight_decay=0.1)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, ids, labels):
        loss, grads = jax.value_and_grad(lambda p: model.apply({"params": p}, ids, labels))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for ids, labels in batches:
        params, opt_state, loss = step(params, opt_state, ids, labels)
        losses.append(float(loss))
    return params, losses


def test_eight_adamw_steps_match_unsharded_linen():
    vocab = 61
    rng = np.random.default_rng(3)
    batches = [
        (rng.integers(0, vocab, IDS_SHAPE).astype(np.int32),
         rng.integers(0, vocab, IDS_SHAPE).astype(np.int32)) for _ in range(8)
    ]  # fmt: skip
    ref = TiedLM(nn.Embed(vocab, H), False)
    ref_params, ref_losses = train(ref, ref.init(KEY, *batches[0])["params"], batches)

    mesh = make_mesh(AxisType.Explicit)
    model = TiedLM(
        jaxembed.flax.Embed(vocab, H, embedding_init=nn.with_partitioning(init, ("model", None))),
        True,
    )
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(model.init, KEY, *batches[0])
        params = jax.jit(model.init, out_shardings=nn.get_sharding(abstract, mesh))(
            KEY, *batches[0]
        )["params"]
        params, losses = train(model, params, [(put(i), put(y)) for i, y in batches])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    table = params["embed"]["embedding"].value
    assert table.sharding.spec == P("model", None)
    table = np.asarray(table)
    np.testing.assert_allclose(
        table[:vocab], ref_params["embed"]["embedding"], rtol=1e-4, atol=1e-6
    )
    assert not table[vocab:].any()


def test_bad_input():
    model = jaxembed.flax.Embed(V, H)
    ids = jnp.zeros((2,), jnp.int32)
    params = model.init(KEY, ids)
    with pytest.raises(ValueError, match=r"integer or unsigned integer, got float32"):
        model.apply(params, ids.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"padding_idx must be in \[0, 64\)"):
        jaxembed.flax.Embed(V, H, padding_idx=-1).init(KEY, ids)


def test_exchange_and_its_deprecated_old_name():
    """`exchange` is the attribute; `gradient_exchange` (its old name) warns and still works."""
    ids = jnp.arange(16).reshape(2, 8) % V
    table_init = nn.with_partitioning(init, ("model", None))
    new = jaxembed.flax.Embed(V, H, exchange="rows", embedding_init=table_init)
    with pytest.warns(
        DeprecationWarning,
        match=r"gradient_exchange is deprecated, use exchange: "
        r"jaxembed\.flax\.Embed\(\.\.\., exchange='rows'\)",
    ):
        old = jaxembed.flax.Embed(V, H, gradient_exchange="rows", embedding_init=table_init)
    assert old.exchange == new.exchange == "rows" and old.gradient_exchange is None
    with jax.set_mesh(make_mesh(AxisType.Explicit)):
        ids = jax.device_put(ids, P("data"))
        params = new.init(KEY, ids)["params"]
        loss = lambda p, m: jnp.sum(m.apply({"params": p}, ids) ** 2)
        (old_loss, old_grad), (new_loss, new_grad) = (  # compiled: op by op takes seconds
            jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, m) for m in (old, new)
        )
        np.testing.assert_array_equal(old_loss, new_loss)
        np.testing.assert_array_equal(
            unboxed(old_grad)["embedding"], unboxed(new_grad)["embedding"]
        )
    with pytest.raises(
        ValueError, match=r"disagree.*pass jaxembed\.flax\.Embed\(\.\.\., exchange='dense'\) only"
    ):
        jaxembed.flax.Embed(V, H, exchange="dense", gradient_exchange="rows")
