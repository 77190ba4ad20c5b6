"""Tables set from host values (numpy, as checkpoint loaders return), and state trees that map
together with Flax's.

A host value set into `jaxembed.nnx.Embed`'s table is put in the layout its metadata states
(when set where the mesh is known, else on the first call outside `jit`); one that reaches
`jit` unplaced is an error naming the parameter and the `device_put` that fixes it, never the
kernels' `weight_spec`. `param_type=nnx.Param` makes the module's state map together with
`flax.nnx.Embed`'s.
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

import jaxembed.flax
import jaxembed.nnx

V, H = 64, 8
SPEC = P("model", None)
IDS = np.arange(16, dtype=np.int32).reshape(2, 8) * 3 % V
PLACEMENT_ERROR = (
    r"jaxembed\.nnx\.Embed: the parameter `embedding` is laid out as P\(\) \(whole on every "
    r"device\), but its "
    r"sharding metadata says P\('model', None\) \(mesh axes \{'data': 2, 'model': 4\}\)\. "
    r"A table set from host values \(numpy.*Place it once, before the jitted step: "
    r"embed\.embedding\.set_value\(jax\.device_put\(value, NamedSharding\(mesh, "
    r"P\('model', None\)\)\)\), or, for a whole model, nnx\.update\(model, "
)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"))  # Explicit axes


@pytest.fixture(scope="module")
def host_table():
    return np.random.default_rng(0).normal(size=(V, H)).astype(np.float32)


def sharded_embed(mesh, **kwargs):
    init = nnx.with_partitioning(nnx.nn.linear.default_embed_init, SPEC)
    with jax.set_mesh(mesh):
        return jaxembed.nnx.Embed(V, H, embedding_init=init, rngs=nnx.Rngs(0), **kwargs)


def lookup_under_jit(embed, mesh):
    with jax.set_mesh(mesh):
        return nnx.jit(lambda m, i: m(i))(embed, jax.device_put(IDS, P("data")))


def test_set_under_the_mesh_is_placed_at_once(mesh, host_table):
    embed = sharded_embed(mesh)
    with jax.set_mesh(mesh):
        embed.embedding.set_value(host_table)
    assert embed.embedding.get_raw_value().sharding.spec == SPEC
    np.testing.assert_array_equal(lookup_under_jit(embed, mesh), host_table[IDS])


def test_value_setter_and_nnx_update_place_it(mesh, host_table):
    embed = sharded_embed(mesh)
    with jax.set_mesh(mesh), pytest.deprecated_call(match=r"'\.value' setter is now deprecated"):
        embed.embedding.value = host_table  # Flax's deprecated spelling, still used by loaders
    assert embed.embedding.get_raw_value().sharding.spec == SPEC
    # nnx.update with a state of numpy leaves (a checkpoint restored as host arrays).
    state = jax.tree.map(np.asarray, nnx.state(embed))
    state["embedding"].set_raw_value(host_table + 1.0)
    other = sharded_embed(mesh)
    with jax.set_mesh(mesh):
        nnx.update(other, state)
    assert other.embedding.get_raw_value().sharding.spec == SPEC
    np.testing.assert_array_equal(lookup_under_jit(other, mesh), (host_table + 1.0)[IDS])
    # Assigned into the module's state, then updated from it, as restore-and-update loaders do.
    third = sharded_embed(mesh)
    with jax.set_mesh(mesh):
        state = nnx.state(third)
        state["embedding"].set_value(host_table)
        nnx.update(third, state)
    assert third.embedding.get_raw_value().sharding.spec == SPEC


def test_set_without_a_mesh_is_placed_by_the_first_eager_call(mesh, host_table):
    embed = sharded_embed(mesh)
    embed.embedding.set_value(host_table)  # no mesh in sight: it stays on the host for now
    assert isinstance(embed.embedding.get_raw_value(), np.ndarray)
    with jax.set_mesh(mesh):
        out = embed(jax.device_put(IDS, P("data")))  # placed here, once, and kept
    assert embed.embedding.get_raw_value().sharding.spec == SPEC
    np.testing.assert_array_equal(out, host_table[IDS])
    np.testing.assert_array_equal(lookup_under_jit(embed, mesh), host_table[IDS])


def test_unplaced_under_jit_names_the_parameter_and_the_fix(mesh, host_table):
    embed = sharded_embed(mesh)
    embed.embedding.set_value(host_table)
    with pytest.raises(ValueError, match=PLACEMENT_ERROR) as info:
        lookup_under_jit(embed, mesh)
    assert "weight_spec" not in str(info.value)
    # The fix the message gives, verbatim.
    with jax.set_mesh(mesh):
        embed.embedding.set_value(jax.device_put(host_table, NamedSharding(mesh, SPEC)))
    np.testing.assert_array_equal(lookup_under_jit(embed, mesh), host_table[IDS])
    # The whole-model fix.
    embed.embedding.set_value(host_table)
    state = nnx.state(embed)
    nnx.update(embed, jax.device_put(state, nnx.get_named_sharding(state, mesh)))
    np.testing.assert_array_equal(lookup_under_jit(embed, mesh), host_table[IDS])


def test_cross_entropy_under_jit_names_it_too(mesh, host_table):
    embed = sharded_embed(mesh, param_type=nnx.Param)  # a plain Param: no placement when set
    loss_fn = nnx.jit(lambda m, h, y: m.cross_entropy(h, y))
    with jax.set_mesh(mesh):
        embed.embedding.set_value(host_table)
        h = jax.device_put(np.ones((2, 8, H), np.float32), P("data"))
        labels = jax.device_put(IDS, P("data"))
        with pytest.raises(ValueError, match=PLACEMENT_ERROR):
            loss_fn(embed, h, labels)
        with pytest.raises(ValueError, match=PLACEMENT_ERROR), jaxembed.nnx.deferred_logits():
            nnx.jit(lambda m, h: m.attend(h).table)(embed, h)
        embed(labels)  # an eager call places it, once, and keeps it
        assert embed.embedding.get_raw_value().sharding.spec == SPEC
        loss = loss_fn(embed, h, labels)
    want = optax.softmax_cross_entropy_with_integer_labels(np.ones((2, 8, H)) @ host_table.T, IDS)
    np.testing.assert_allclose(loss, want, rtol=1e-5)


def test_linen_host_params(mesh, host_table):
    model = jaxembed.flax.Embed(
        V, H, embedding_init=nn.with_partitioning(nn.linear.default_embed_init, SPEC)
    )
    params = {"params": {"embedding": host_table}}  # unboxed numpy, as a checkpoint gives
    ids = jax.device_put(IDS, NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
        np.testing.assert_array_equal(model.apply(params, ids), host_table[IDS])  # eager
        with pytest.raises(
            ValueError,
            match=r"jaxembed\.flax\.Embed: the parameter `embedding` is laid out as "
            r"P\(\) \(whole on every device\), but its sharding metadata says P\('model', None\).*"
            r"jax\.device_put\(table, NamedSharding\(mesh, P\('model', None\)\)\)",
        ):
            jax.jit(model.apply)(params, ids)
        placed = {"params": {"embedding": jax.device_put(host_table, NamedSharding(mesh, SPEC))}}
        np.testing.assert_array_equal(jax.jit(model.apply)(placed, ids), host_table[IDS])


# --- state trees next to Flax's -------------------------------------------------------------


def test_param_type_param_maps_together_with_flax_embed(mesh):
    flax_embed = nnx.Embed(V, H, rngs=nnx.Rngs(0))
    ours = jaxembed.nnx.Embed(V, H, rngs=nnx.Rngs(0), param_type=nnx.Param)
    assert type(ours.embedding) is nnx.Param
    diff = jax.tree.map(lambda a, b: jnp.abs(a - b).max(), nnx.state(flax_embed), nnx.state(ours))
    assert float(diff["embedding"][...]) == 0.0
    # With a layout: the same metadata on both sides, the same tree.
    init = nnx.with_partitioning(nnx.nn.linear.default_embed_init, SPEC)
    with jax.set_mesh(mesh):
        flax_embed = nnx.Embed(V, H, embedding_init=init, rngs=nnx.Rngs(0))
        ours = jaxembed.nnx.Embed(V, H, embedding_init=init, rngs=nnx.Rngs(0), param_type=nnx.Param)
        table = jaxembed.nnx.Embed(V, H, embedding_init=init, rngs=nnx.Rngs(0))
    jax.tree.map(np.testing.assert_array_equal, nnx.state(flax_embed), nnx.state(ours))
    # The default Table is another Variable type, so another pytree node: map pure dicts.
    with pytest.raises(ValueError, match=r"different types at key path"):
        jax.tree.map(np.testing.assert_array_equal, nnx.state(flax_embed), nnx.state(table))
    jax.tree.map(
        np.testing.assert_array_equal,
        nnx.to_pure_dict(nnx.state(flax_embed)),
        nnx.to_pure_dict(nnx.state(table)),
    )


def test_param_type_is_checked_and_refused_by_the_row_sparse_step():
    with pytest.raises(TypeError, match=r"param_type must be an nnx\.Param subclass .* got"):
        jaxembed.nnx.Embed(V, H, rngs=nnx.Rngs(0), param_type=nnx.Variable)
    embed = jaxembed.nnx.Embed(V, H, rngs=nnx.Rngs(0), param_type=nnx.Param)
    with pytest.raises(ValueError, match=r"param_type=nnx\.Param\): the table is a plain "
                       r"nnx\.Param.*param_type=jaxembed\.nnx\.Table"):  # fmt: skip
        jaxembed.nnx.value_and_grad(lambda m: m(IDS).sum())(embed)
    # Trained with optax like any parameter, it takes its gradient densely.
    grads = nnx.grad(lambda m: m(IDS).sum())(embed)
    assert grads.embedding[...].shape == (V, H)


def test_linen_params_map_together_with_flax_embed():
    init = nn.with_partitioning(nn.linear.default_embed_init, SPEC)
    ids = jnp.asarray(IDS)
    ref = nn.Embed(V, H, embedding_init=init).init(jax.random.key(0), ids)
    ours = jaxembed.flax.Embed(V, H, embedding_init=init).init(jax.random.key(0), ids)
    jax.tree.map(np.testing.assert_array_equal, ref, ours)
