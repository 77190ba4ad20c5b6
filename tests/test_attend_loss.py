"""A model whose `__call__` ends in `Embed.attend` trains with the vocab-parallel loss, unchanged.

Inside `deferred_logits()` `attend` returns a `DeferredLogits` handle; `cross_entropy(handle,
labels)` is the vocab-parallel loss. Checked on a small decoder (embed -> Linear -> tied head),
NNX and Linen, on one device and on 8 (table `P("tensor", "fsdp")` and `P("tensor", None)` on
a 2x4 mesh): the loss and every parameter's gradient against a float64 numpy reference, and
against optax on the dense logits of the same model called outside the context.
"""

import contextlib
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed.flax
import jaxembed.nnx

VOCAB, H = 62, 16  # 62 rows: padded to 64 where "tensor" (2) splits them
TOKENS = (4, 6)
KEY = jax.random.key(0)

# name: (table spec, the projection kernel's spec, the ids' spec); None: no mesh. With the
# hidden axis split over "fsdp" the projection contracts over it (FSDP's kernel P("fsdp", None))
# and its output is stated whole (Explicit axes ask for it).
LAYOUTS = {
    "one-device": None,
    "rows-hidden": (P("tensor", "fsdp"), P("fsdp", None), P()),
    "rows": (P("tensor", None), P(None, None), P("fsdp")),
}


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, TOKENS).astype(np.int32)
    labels = rng.integers(0, VOCAB, TOKENS).astype(np.int32)
    return ids, labels


def make_mesh():
    return jax.make_mesh((2, 4), ("tensor", "fsdp"))  # Explicit axes


def reference(table, kernel, bias, ids, labels):
    """The mean cross-entropy of `embed -> x @ W + b -> h @ E[:VOCAB].T` and its gradients,
    in float64 numpy (padding rows: zero gradient)."""
    e, w, b = (np.asarray(a, np.float64) for a in (table, kernel, bias))
    x = e[ids]  # [*T, H]
    h = x @ w + b
    logits = h @ e[:VOCAB].T  # [*T, V]
    m = logits.max(axis=-1, keepdims=True)
    p = np.exp(logits - m)
    p /= p.sum(axis=-1, keepdims=True)
    picked = np.take_along_axis(p, labels[..., None], axis=-1)[..., 0]
    loss = -np.log(picked).mean()
    dlogits = p.copy()
    np.put_along_axis(dlogits, labels[..., None], (picked - 1.0)[..., None], axis=-1)
    dlogits /= labels.size
    dlogits, h, x = dlogits.reshape(-1, VOCAB), h.reshape(-1, H), x.reshape(-1, H)
    de = np.zeros_like(e)
    de[:VOCAB] = dlogits.T @ h
    dh = dlogits @ e[:VOCAB]
    dw, db = x.T @ dh, dh.sum(axis=0)
    np.add.at(de, ids.reshape(-1), dh @ w.T)
    return loss, de, dw, db


def assert_matches(loss, grads, ref):
    ref_loss, *ref_grads = ref
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-6)


# --- NNX ----------------------------------------------------------------------------------


class Decoder(nnx.Module):
    """Embed -> Linear -> tied head: `__call__` ends in `attend`, as a Flax LM's does."""

    def __init__(self, table_spec: Any, kernel_spec: Any, rngs: nnx.Rngs):
        embed_init = nnx.nn.linear.default_embed_init
        kernel_init = nnx.nn.linear.default_kernel_init
        if table_spec is not None:
            embed_init = nnx.with_partitioning(embed_init, table_spec)
            kernel_init = nnx.with_partitioning(kernel_init, kernel_spec)
        self.embed = jaxembed.nnx.Embed(VOCAB, H, embedding_init=embed_init, rngs=rngs)
        self.proj = nnx.Linear(H, H, kernel_init=kernel_init, rngs=rngs)
        self.proj_out = P() if kernel_spec is not None and kernel_spec[0] else None

    def __call__(self, ids):
        return self.embed.attend(self.proj(self.embed(ids), out_sharding=self.proj_out))


def deferred_loss(model, ids, labels):
    with jaxembed.nnx.deferred_logits():
        logits = model(ids)
    assert isinstance(logits, jaxembed.nnx.DeferredLogits) and logits.shape == (*TOKENS, VOCAB)
    return jaxembed.nnx.cross_entropy(logits, labels, reduction="mean")


def dense_loss(model, ids, labels):
    return optax.softmax_cross_entropy_with_integer_labels(model(ids), labels).mean()


def nnx_grads(grads):
    return grads.embed.embedding[...], grads.proj.kernel[...], grads.proj.bias[...]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nnx_decoder_trains_with_the_vocab_parallel_loss(layout, batch):
    ids, labels = batch
    if LAYOUTS[layout] is None:
        mesh, inputs = None, (ids, labels)
        model = Decoder(None, None, nnx.Rngs(0))
    else:
        table_spec, kernel_spec, ids_spec = LAYOUTS[layout]
        mesh = make_mesh()
        with jax.set_mesh(mesh):
            model = Decoder(table_spec, kernel_spec, nnx.Rngs(0))
        inputs = tuple(jax.device_put(a, NamedSharding(mesh, ids_spec)) for a in batch)
    both = lambda *a: (nnx.value_and_grad(deferred_loss)(*a), nnx.value_and_grad(dense_loss)(*a))
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        (loss, grads), (dense, dense_grads) = nnx.jit(both)(model, *inputs)
    params = (model.embed.embedding[...], model.proj.kernel[...], model.proj.bias[...])
    assert_matches(loss, nnx_grads(grads), reference(*params, ids, labels))
    np.testing.assert_allclose(loss, dense, rtol=1e-5)
    for got, want in zip(nnx_grads(grads), nnx_grads(dense_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    if LAYOUTS[layout] is not None:  # the gradient is born in the table's layout
        assert grads.embed.embedding[...].sharding.spec == LAYOUTS[layout][0]


# --- Linen --------------------------------------------------------------------------------


class LinenDecoder(nn.Module):
    """Embed -> Dense -> tied head, ending in `attend`."""

    table_spec: Any = None

    @nn.compact
    def __call__(self, ids):
        embed_init = nn.linear.default_embed_init
        if self.table_spec is not None:
            embed_init = nn.with_partitioning(embed_init, tuple(self.table_spec))
        embed = jaxembed.flax.Embed(VOCAB, H, embedding_init=embed_init, name="embed")
        x = embed(ids)
        if self.table_spec is not None and self.table_spec[1] is not None:
            x = jax.sharding.reshard(x, P())  # the hidden split, gathered for the Dense
        return embed.attend(nn.Dense(H, name="proj")(x))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_linen_decoder_trains_with_the_vocab_parallel_loss(layout, batch):
    ids, labels = batch
    if LAYOUTS[layout] is None:
        model, mesh = LinenDecoder(), None
        params = model.init(KEY, ids)["params"]
        inputs = (ids, labels)
    else:
        table_spec, _, ids_spec = LAYOUTS[layout]
        model, mesh = LinenDecoder(table_spec), make_mesh()
        with jax.set_mesh(mesh):
            abstract = jax.eval_shape(model.init, KEY, ids)
            params = jax.jit(model.init, out_shardings=nn.get_sharding(abstract, mesh))(KEY, ids)
        params = params["params"]
        inputs = tuple(jax.device_put(a, NamedSharding(mesh, ids_spec)) for a in batch)

    def loss_fn(params, ids, labels):
        with jaxembed.flax.deferred_logits():
            logits = model.apply({"params": params}, ids)
        return jaxembed.flax.cross_entropy(logits, labels, reduction="mean")

    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, *inputs)
    p, g = nn.unbox(params), nn.unbox(grads)
    ref = reference(p["embed"]["embedding"], p["proj"]["kernel"], p["proj"]["bias"], ids, labels)
    assert_matches(loss, (g["embed"]["embedding"], g["proj"]["kernel"], g["proj"]["bias"]), ref)


# --- the handle -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_device_model():
    return Decoder(None, None, nnx.Rngs(1))


def test_outside_the_context_attend_returns_the_logits(one_device_model, batch):
    logits = one_device_model(batch[0])
    assert isinstance(logits, jax.Array) and logits.shape == (*TOKENS, VOCAB)


def test_the_handle_refuses_every_other_use(one_device_model, batch):
    ids, labels = batch
    with jaxembed.nnx.deferred_logits():
        logits = one_device_model(ids)
    assert (logits.shape, logits.ndim, logits.dtype) == ((*TOKENS, VOCAB), 3, jnp.float32)
    advice = (
        r"jaxembed\.nnx\.Embed\.attend ran inside jaxembed\.nnx\.deferred_logits\(\).*"
        r"logits of shape \(4, 6, 62\).*jaxembed\.nnx\.cross_entropy\(logits, labels.*"
        r"outside the `with jaxembed\.nnx\.deferred_logits\(\):` block.*materialize\(\)"
    )
    with pytest.raises(TypeError, match=r"__add__ on a DeferredLogits: " + advice):
        logits + 1.0
    with pytest.raises(TypeError, match=r"__rmul__ on a DeferredLogits"):
        2.0 * logits
    with pytest.raises(TypeError, match=r"__jax_array__ on a DeferredLogits: " + advice):
        jnp.exp(logits)
    with pytest.raises(TypeError, match=r"__jax_array__ on a DeferredLogits"):
        optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    with pytest.raises(AttributeError, match=r"\.max on a DeferredLogits: " + advice):
        logits.max(axis=-1)
    with pytest.raises(TypeError, match=r"astype\(bfloat16\) on a DeferredLogits"):
        logits.astype(jnp.bfloat16)
    with pytest.raises(TypeError, match=r"indexing with .* \(only the token axes can be indexed\)"):
        logits[..., :10]
    with pytest.raises(TypeError, match=r"cross_entropy takes the DeferredLogits .* got ArrayImpl "
                       r"of shape \(4, 6, 62\): call the model inside `with jaxembed\.nnx\."
                       r"deferred_logits\(\):`"):  # fmt: skip
        jaxembed.nnx.cross_entropy(one_device_model(ids), labels)


def test_the_handle_slices_tokens_materializes_and_passes_options(one_device_model, batch):
    ids, labels = batch
    dense = one_device_model(ids)
    with jaxembed.nnx.deferred_logits():
        logits = nnx.jit(lambda m, i: m(i))(one_device_model, ids)  # a pytree: crosses jit
    assert isinstance(logits, jaxembed.nnx.DeferredLogits)
    np.testing.assert_allclose(logits.materialize(), dense, rtol=1e-6, atol=1e-6)
    assert logits.astype(jnp.float32) is logits  # the loss computes the logits in float32
    shifted = logits[:, :-1, :]  # next-token slicing: the token axes only
    assert shifted.shape == (4, 5, VOCAB)
    h = one_device_model.proj(one_device_model.embed(ids))
    kwargs = dict(label_smoothing=0.1, z_loss=1e-3, ignore_index=3, reduction="sum")

    @nnx.jit
    def losses(model, logits, shifted, h, labels):
        return (
            shifted.cross_entropy(labels[:, 1:]),
            jaxembed.nnx.cross_entropy(logits, labels, **kwargs),  # options pass through
            model.embed.cross_entropy(h, labels, **kwargs),
        )

    loss, with_options, module_loss = losses(one_device_model, logits, shifted, h, labels)
    want = optax.softmax_cross_entropy_with_integer_labels(dense[:, :-1], labels[:, 1:])
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    np.testing.assert_allclose(with_options, module_loss, rtol=1e-5)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'not_an_option'"):
        logits.cross_entropy(labels, not_an_option=1)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'not_an_option'"):
        one_device_model.embed.cross_entropy(h, labels, not_an_option=1)


def test_linen_handle_names_the_linen_context(batch):
    ids, _ = batch
    model = LinenDecoder()
    params = model.init(KEY, ids)
    with jaxembed.flax.deferred_logits():
        logits = model.apply(params, ids)
    with pytest.raises(TypeError, match=r"jaxembed\.flax\.Embed\.attend ran inside "
                       r"jaxembed\.flax\.deferred_logits\(\).*jaxembed\.flax\.cross_entropy"):  # fmt: skip
        logits - 1.0
    np.testing.assert_allclose(logits.materialize(), model.apply(params, ids), rtol=1e-6)


def test_the_context_is_left_on_exit_and_nests():
    assert jaxembed.nnx.deferred_logits is jaxembed.flax.deferred_logits
    from jaxembed.nn.deferred import deferring

    assert deferring() is None
    with jaxembed.nnx.deferred_logits(query_sharding=P("data")):
        assert deferring().query_sharding == P("data")
        with jaxembed.nnx.deferred_logits():
            assert deferring().query_sharding is None
        assert deferring().query_sharding == P("data")
    assert deferring() is None
