"""jaxembed.nnx.Embed against flax.nnx.Embed: on one device, sharded, and in training.

The reference is always Flax's own `nnx.Embed` on one device with the same rngs. Outputs of
the lookup are compared bit for bit (the sharded lookup only adds zeros); logits and
gradients (float32 sums in another order) with allclose.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax_inputs import IDS_SHAPE, H, V, make_data
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed.nnx

init = nnx.nn.linear.default_embed_init


def make_mesh(axis_type):
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)


def objective(model, ids, query, ct_out, ct_logits, **call_kwargs):
    """A scalar touching both the lookup and attend, so both gradients are checked."""
    out = model(ids, **call_kwargs)
    logits = model.attend(query)
    return jnp.sum(out * ct_out) + jnp.sum(logits * ct_logits), (out, logits)


def reference(seed, ids, query, ct_out, ct_logits, vocab=V):
    ref = nnx.Embed(vocab, H, rngs=nnx.Rngs(seed))
    (_, (out, logits)), grads = nnx.value_and_grad(objective, has_aux=True)(
        ref, ids, query, ct_out, ct_logits
    )
    return ref, out, logits, grads.embedding[...]


def test_one_device_matches_flax_exactly():
    ids, query, ct_out, ct_logits = make_data()
    ref, ref_out, ref_logits, ref_grad = reference(3, ids, query, ct_out, ct_logits)
    model = jaxembed.nnx.Embed(V, H, rngs=nnx.Rngs(3))
    np.testing.assert_array_equal(model.embedding[...], ref.embedding[...])
    (_, (out, logits)), grads = nnx.jit(nnx.value_and_grad(objective, has_aux=True))(
        model, ids, query, ct_out, ct_logits
    )
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_array_equal(logits, ref_logits)
    np.testing.assert_allclose(grads.embedding[...], ref_grad, rtol=1e-6, atol=1e-6)


LAYOUTS = {
    "rows": P("model", None),
    "hidden": P(None, "model"),
    "rows-over-data-model": P(("data", "model"), None),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_sharded_matches_flax(layout, axis_type):
    spec = LAYOUTS[layout]
    mesh = make_mesh(axis_type)
    ids, query, ct_out, ct_logits = make_data(1)
    ref, ref_out, ref_logits, ref_grad = reference(0, ids, query, ct_out, ct_logits)
    with jax.set_mesh(mesh):
        model = jaxembed.nnx.Embed(
            V, H, rngs=nnx.Rngs(0), embedding_init=nnx.with_partitioning(init, spec)
        )
        assert model.embedding.sharding.spec == spec  # Flax placed it from the metadata
        np.testing.assert_array_equal(model.embedding[...], ref.embedding[...])
        put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))
        f = lambda m, *a: objective(m, *a, inputs_sharding=P("data"))
        (_, (out, logits)), grads = nnx.jit(nnx.value_and_grad(f, has_aux=True))(
            model, put(ids), put(query), put(ct_out), put(ct_logits)
        )
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads.embedding[...], ref_grad, rtol=1e-5, atol=1e-5)
    grad = grads.embedding[...]
    assert grad.sharding.is_equivalent_to(NamedSharding(mesh, spec), 2)  # the table's layout
    if axis_type == AxisType.Explicit:  # the types say it: ids' batch, whole vocab in logits
        hidden_split = spec[1] if len(spec) > 1 else None
        assert out.sharding.spec == P("data", None, hidden_split)
        assert logits.sharding.spec == P("data", None, None)


def test_auto_mesh_init_under_jit():
    """Created inside `nnx.jit` in an Auto mesh: the output is laid out from the metadata."""
    mesh = make_mesh(AxisType.Auto)
    ids, *_ = make_data(7, vocab=61)
    with jax.set_mesh(mesh):
        model = nnx.jit(
            lambda: jaxembed.nnx.Embed(
                61, H, rngs=nnx.Rngs(0), embedding_init=nnx.with_partitioning(init, ("model", None))
            )
        )()
        out = nnx.jit(lambda m, i: m(i, inputs_sharding=P("data")))(model, ids)
    assert model.embedding.sharding.is_equivalent_to(NamedSharding(mesh, P("model", None)), 2)
    assert model.embedding.shape == (64, H)
    np.testing.assert_array_equal(out, nnx.Embed(61, H, rngs=nnx.Rngs(0))(ids))


def test_sequence_parallel_output():
    mesh = make_mesh(AxisType.Explicit)
    ids, *_ = make_data(2)
    ref = nnx.Embed(V, H, rngs=nnx.Rngs(0))
    with jax.set_mesh(mesh):
        model = jaxembed.nnx.Embed(
            V, H, rngs=nnx.Rngs(0), embedding_init=nnx.with_partitioning(init, ("model", None))
        )
        ids_d = jax.device_put(ids, P("data"))
        out = nnx.jit(lambda m, i: m(i, P("data", "model", None)))(model, ids_d)
    assert out.sharding.spec == P("data", "model", None)
    np.testing.assert_array_equal(out, ref(ids))


# --- padding --------------------------------------------------------------------------------


def test_uneven_vocab_pads_the_parameter():
    vocab = 61  # rows split over model (4): padded to 64
    mesh = make_mesh(AxisType.Explicit)
    ids, query, ct_out, ct_logits = make_data(4, vocab)
    ref, ref_out, ref_logits, ref_grad = reference(0, ids, query, ct_out, ct_logits, vocab)
    with jax.set_mesh(mesh):
        model = jaxembed.nnx.Embed(
            vocab, H, rngs=nnx.Rngs(0), embedding_init=nnx.with_partitioning(init, ("model", None))
        )
        table = np.asarray(model.embedding[...])
        assert table.shape == (64, H) and model.num_embeddings == vocab
        np.testing.assert_array_equal(table[:vocab], ref.embedding[...])  # Flax's values
        assert not table[vocab:].any()  # padding rows are zero
        put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))
        (_, (out, logits)), grads = nnx.jit(nnx.value_and_grad(objective, has_aux=True))(
            model, put(ids), put(query), put(ct_out), put(ct_logits)
        )
        padding_ids = put(np.full(IDS_SHAPE, 62, np.int32))
        assert not np.asarray(nnx.jit(lambda m, i: m(i))(model, padding_ids)).any()
        with pytest.raises(ValueError, match=r"id 62 at index \(0, 0\) is out of range for a "
                           r"vocabulary of 61 rows"):  # fmt: skip
            model(padding_ids)
    assert logits.shape == (*IDS_SHAPE, vocab)
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
    grad = np.asarray(grads.embedding[...])
    np.testing.assert_allclose(grad[:vocab], ref_grad, rtol=1e-5, atol=1e-5)
    assert not grad[vocab:].any()  # exactly zero: never read


def test_pad_to_multiple_of_without_a_mesh():
    model = jaxembed.nnx.Embed(61, H, pad_to_multiple_of=32, rngs=nnx.Rngs(0))
    assert model.embedding.shape == (64, H)
    np.testing.assert_array_equal(
        model.embedding[...][:61], nnx.Embed(61, H, rngs=nnx.Rngs(0)).embedding[...]
    )
    with pytest.raises(
        ValueError, match=r"pad_to_multiple_of must be a positive int or None, got 0"
    ):
        jaxembed.nnx.Embed(61, H, pad_to_multiple_of=0, rngs=nnx.Rngs(0))


# --- training -------------------------------------------------------------------------------


class TiedLM(nnx.Module):
    """Embed -> Linear -> tied head; loss by attend + optax, or by the vocab-parallel loss."""

    def __init__(self, embed, vocab_parallel, rngs):
        self.embed = embed
        self.proj = nnx.Linear(H, H, rngs=rngs)
        self.vocab_parallel = vocab_parallel

    def __call__(self, ids, labels):
        h = jnp.tanh(self.proj(self.embed(ids)))
        if self.vocab_parallel:
            return self.embed.cross_entropy(
                h, labels, reduction="mean", vocab_chunk_size=8, query_sharding=P("data")
            )
        logits = self.embed.attend(h)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def train(model, batches, steps=8):
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2, weight_decay=0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, ids, labels):
        loss, grads = nnx.value_and_grad(lambda m: m(ids, labels))(model)
        optimizer.update(model, grads)
        return loss

    return [float(step(model, optimizer, *batches[i])) for i in range(steps)]


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_eight_adamw_steps_match_unsharded_flax(axis_type, fresh_warnings):
    vocab = 61  # padded to 64 on the model axis: AdamW's decay must leave the padding at zero
    rng = np.random.default_rng(5)
    batches = [
        (rng.integers(0, vocab, IDS_SHAPE).astype(np.int32),
         rng.integers(0, vocab, IDS_SHAPE).astype(np.int32)) for _ in range(8)
    ]  # fmt: skip
    rngs = nnx.Rngs(0)
    ref_model = TiedLM(nnx.Embed(vocab, H, rngs=rngs), False, rngs)
    ref_losses = train(ref_model, batches)

    mesh = make_mesh(axis_type)
    with jax.set_mesh(mesh):
        rngs = nnx.Rngs(0)
        embed = jaxembed.nnx.Embed(
            vocab, H, rngs=rngs, embedding_init=nnx.with_partitioning(init, ("model", None))
        )
        model = TiedLM(embed, True, rngs)
        put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))
        if axis_type == AxisType.Auto:  # traced ids: the data-parallel layout is assumed, once
            with pytest.warns(UserWarning, match=r"assumes P\('data', None\).*inputs_sharding"):
                losses = train(model, [(put(i), put(y)) for i, y in batches])
        else:
            losses = train(model, [(put(i), put(y)) for i, y in batches])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    table = np.asarray(model.embed.embedding[...])
    np.testing.assert_allclose(table[:vocab], ref_model.embed.embedding[...], rtol=1e-4, atol=1e-6)
    assert not table[vocab:].any()  # zero gradient, zero value: AdamW keeps them zero
    assert model.embed.embedding.sharding.spec == P("model", None)


# --- metadata -------------------------------------------------------------------------------


def test_logical_axis_rules_resolve_the_layout():
    mesh = make_mesh(AxisType.Explicit)
    rules = [("vocab", "model"), ("embed", None)]
    ids, *_ = make_data(6)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        model = jaxembed.nnx.Embed(
            V, H, rngs=nnx.Rngs(0), embedding_init=nnx.with_partitioning(init, ("vocab", "embed"))
        )
        assert model.embedding.sharding.spec == P("model", None)
        assert model.table_layout()[1] == P("model", None)
        out = nnx.jit(lambda m, i: m(i))(model, jax.device_put(ids, P("data")))
    np.testing.assert_array_equal(out, nnx.Embed(V, H, rngs=nnx.Rngs(0))(ids))
    # Called where the rules are no longer active: the names resolve as at construction.
    with jax.set_mesh(mesh):
        assert model.table_layout()[1] == P("model", None)
        out = nnx.jit(lambda m, i: m(i))(model, jax.device_put(ids, P("data")))
    np.testing.assert_array_equal(out, nnx.Embed(V, H, rngs=nnx.Rngs(0))(ids))


def test_embedding_metadata_out_sharding():
    mesh = make_mesh(AxisType.Explicit)
    with jax.set_mesh(mesh):
        model = jaxembed.nnx.Embed(
            V, H, rngs=nnx.Rngs(0), embedding_metadata={"out_sharding": (None, "model")}
        )
    assert model.embedding.sharding.spec == P(None, "model")
    assert nnx.spmd.get_var_pspec(model.embedding) == P(None, "model")


def test_optimizer_state_takes_the_parameter_layout():
    mesh = make_mesh(AxisType.Explicit)
    with jax.set_mesh(mesh):
        model = jaxembed.nnx.Embed(
            V, H, rngs=nnx.Rngs(0), embedding_init=nnx.with_partitioning(init, ("model", None))
        )
        optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    mu = optimizer.opt_state[0].mu["embedding"]
    assert mu.sharding.spec == P("model", None)
    assert nnx.get_named_sharding(nnx.state(optimizer), mesh).opt_state[0].mu[
        "embedding"
    ].spec == P("model", None)


# --- bad input ------------------------------------------------------------------------------


def test_float_ids_are_rejected():
    model = jaxembed.nnx.Embed(V, H, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"integer or unsigned integer, got float32.*astype"):
        model(jnp.zeros((2,), jnp.float32))


def test_padding_idx():
    model = jaxembed.nnx.Embed(V, H, padding_idx=3, rngs=nnx.Rngs(0))
    ids = jnp.array([3, 4])
    assert not np.asarray(model(ids))[0].any()
    grad = np.asarray(nnx.grad(lambda m: jnp.sum(m(ids)))(model).embedding[...])
    assert not grad[3].any() and grad[4].all()
    with pytest.raises(
        ValueError, match=r"padding_idx must be in \[0, 64\) \(the vocabulary\), got 64"
    ):
        jaxembed.nnx.Embed(V, H, padding_idx=64, rngs=nnx.Rngs(0))


def test_exchange_and_its_deprecated_old_name():
    """`exchange` is the option; `gradient_exchange` (its old name) warns and still works."""
    ids = jnp.arange(16).reshape(2, 8) % V
    table_init = nnx.with_partitioning(init, ("model", None))
    # Compiled: run op by op, the sharded lookup and its gradient take seconds each.
    grad_of = nnx.jit(lambda m, x: nnx.grad(lambda m: jnp.sum(m(x) ** 2))(m).embedding[...])
    look = nnx.jit(lambda m, x: m(x))
    with jax.set_mesh(make_mesh(AxisType.Explicit)):
        ids = jax.device_put(ids, P("data"))
        new = jaxembed.nnx.Embed(V, H, exchange="rows", embedding_init=table_init, rngs=nnx.Rngs(0))
        with pytest.warns(
            DeprecationWarning,
            match=r"gradient_exchange is deprecated, use exchange: "
            r"jaxembed\.nnx\.Embed\(\.\.\., exchange='rows'\)",
        ):
            old = jaxembed.nnx.Embed(
                V, H, gradient_exchange="rows", embedding_init=table_init, rngs=nnx.Rngs(0)
            )
        assert old.exchange == new.exchange == "rows"
        np.testing.assert_array_equal(look(old, ids), look(new, ids))
        np.testing.assert_array_equal(grad_of(old, ids), grad_of(new, ids))
    with pytest.raises(
        ValueError, match=r"disagree.*pass jaxembed\.nnx\.Embed\(\.\.\., exchange='dense'\) only"
    ):
        jaxembed.nnx.Embed(V, H, exchange="dense", gradient_exchange="rows", rngs=nnx.Rngs(0))
