"""A donated table is updated in place even when the update does not depend on the forward.

With a linear loss or a fixed cotangent, nothing orders the forward's gather from the table
before the row-sparse update's scatter into it, and XLA copies the whole donated table every
step. `opt.update(..., after=out)` and `jaxembed.optim.sparse.after` order
the write after the reads by data; the training helpers do it with the loss. The compiled
steps are read for copies of the table's per-device shape (`jaxembed.hlo.table_copies`), and
the updated tables are checked against numpy.
"""

import contextlib
import warnings

import flax.linen as nn
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
from jaxembed.hlo import TableCopyWarning, check_in_place, table_copies
from jaxembed.optim.sparse import after

ROWS, HIDDEN, LR = 4096, 16, 0.5
LAYOUTS = {
    # name: (mesh shape, axis names, table spec, ids spec)
    "one-device": None,
    "rows-over-model-4": ((2, 4), ("data", "model"), P("model", None), P("data")),
    "rows-over-model-8": ((8,), ("model",), P("model", None), P()),
}


def _inputs(layout: str):
    """The table, ids (with duplicates) and a fixed cotangent, placed; and the mesh context."""
    rng = np.random.default_rng(0)
    table = rng.normal(size=(ROWS, HIDDEN)).astype(np.float32)
    ids = rng.integers(0, ROWS, (8, 6)).astype(np.int32)
    ids[0, :3] = ids[1, 0]  # duplicates, within and across examples
    cot = rng.normal(size=(8, 6, HIDDEN)).astype(np.float32)
    if LAYOUTS[layout] is None:
        return (jnp.asarray(table), jnp.asarray(ids), jnp.asarray(cot)), contextlib.nullcontext()
    shape, names, table_spec, ids_spec = LAYOUTS[layout]
    mesh = jax.make_mesh(shape, names)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    return (put(table, table_spec), put(ids, ids_spec), put(cot, ids_spec)), jax.set_mesh(mesh)


def _reference(table, ids, cot) -> np.ndarray:
    """sgd: table - lr * (the cotangent scatter-added at the ids)."""
    grad = np.zeros((ROWS, HIDDEN), np.float32)
    np.add.at(grad, np.asarray(ids).reshape(-1), np.asarray(cot).reshape(-1, HIDDEN))
    return np.asarray(table) - LR * grad


def _compiled_step(opt, args, *, ordered: bool):
    def step(table, state, ids, cot):
        out = jaxembed.embedding(ids, table)  # the forward reads the old table
        table, state = opt.update(table, state, ids, cot, after=out if ordered else None)
        return table, state, jnp.sum(out)

    table, ids, cot = args
    state = opt.init(table)
    return jax.jit(step, donate_argnums=(0, 1)).lower(table, state, ids, cot).compile(), state


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_fixed_cotangent_copies_the_donated_table_and_the_check_names_it(layout):
    """The trap itself: without an ordering XLA copies the table, and `check_in_place` says so
    once, naming the table, its shape and the fix."""
    opt = jaxembed.optim.sgd(LR)
    args, ctx = _inputs(layout)
    with ctx:
        compiled, _ = _compiled_step(opt, args, ordered=False)
    with pytest.warns(TableCopyWarning) as record:
        found = check_in_place(compiled, {"item": args[0]})
    assert len(record) == 1
    message = str(record[0].message)
    assert f"'item' (f32[{ROWS},{HIDDEN}]" in message and "after=" in message
    (copy,) = found
    assert copy.names == ("item",) and copy.shape == (ROWS, HIDDEN) and copy.copies
    assert copy.shard_shape == args[0].sharding.shard_shape((ROWS, HIDDEN))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_after_keeps_the_table_in_place_and_the_update_exact(layout):
    opt = jaxembed.optim.sgd(LR)
    args, ctx = _inputs(layout)
    want = _reference(*args)
    spec = args[0].sharding.spec if LAYOUTS[layout] else None
    with ctx:
        compiled, state = _compiled_step(opt, args, ordered=True)
        assert table_copies(compiled, {"item": args[0], "state": state}) == []
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert check_in_place(compiled, {"item": args[0]}) == []
        table, state, _ = compiled(args[0], state, args[1], args[2])
    np.testing.assert_allclose(np.asarray(table), want, rtol=1e-6, atol=1e-6)
    assert int(state.count) == 1
    if spec is not None:
        assert table.sharding.spec == spec


def test_after_is_bitwise_for_every_value_and_any_read():
    x = {"g": jnp.array([1.5, -0.0, jnp.inf, jnp.nan]), "i": jnp.arange(4, dtype=jnp.int32)}
    reads = (
        jnp.array([jnp.nan, jnp.inf, -jnp.inf, -0.0]),  # same shape: elementwise
        jnp.float32(jnp.nan),  # a scalar (a loss)
        jnp.ones((3, 5), jnp.bfloat16),  # another shape: reduced to a flag
        jnp.array([-(2**31), -1, 0, 2**31 - 1], jnp.int32),
        jnp.zeros((0,)),  # nothing to wait for
    )
    paired = {"g": jnp.array([jnp.nan, 0.0, 1.0, -jnp.inf]), "i": jnp.full((4,), -1, jnp.int32)}
    for got in (jax.jit(after)(x, *reads), jax.jit(after)(x, paired), after(x, paired, 3.0)):
        np.testing.assert_array_equal(np.asarray(got["g"]).view(np.uint32),
                                      np.asarray(x["g"]).view(np.uint32))  # fmt: skip
        np.testing.assert_array_equal(got["i"], x["i"])
    assert after(x) is x


def test_a_hand_written_collection_step_with_after_keeps_its_tables_in_place():
    tables = [jaxembed.TableConfig("item", ROWS, HIDDEN, placement="rows")]
    features = [jaxembed.FeatureConfig("clicked", "item", combiner="sum")]
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    opt = jaxembed.optim.sgd(LR)
    rng = np.random.default_rng(1)
    with jax.set_mesh(mesh):
        coll = jaxembed.nnx.EmbeddingBagCollection(tables, features, rngs=nnx.Rngs(0))
        states = coll.init_optimizer(opt)
        batch = {"clicked": jax.device_put(rng.integers(0, ROWS, (8, 4)).astype(np.int32),
                                           P("data"))}  # fmt: skip
        cot = {"clicked": jax.device_put(rng.normal(size=(8, HIDDEN)).astype(np.float32),
                                         P("data"))}  # fmt: skip
        before = {k: np.asarray(v) for k, v in coll.tables().items()}
        graphdef, params = nnx.split(coll)

        def step(params, states, batch, cot):
            coll = nnx.merge(graphdef, params)
            out = coll(batch)
            states = coll.apply_gradients(opt, states, batch, after(cot, out))
            return nnx.state(coll), states, jnp.sum(out["clicked"])

        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, states, batch, cot).compile()
        assert table_copies(compiled, {k: v[...] for k, v in coll.stacks.items()}) == []
        params, states, _ = compiled(params, states, batch, cot)
        coll = nnx.merge(graphdef, params)
        got = coll.tables()
    grad = np.zeros((ROWS, HIDDEN), np.float32)
    rows = np.asarray(batch["clicked"])
    for b in range(rows.shape[0]):
        np.add.at(grad, rows[b], np.asarray(cot["clicked"])[b][None].repeat(rows.shape[1], 0))
    np.testing.assert_allclose(np.asarray(got["item"]), before["item"] - LR * grad,
                               rtol=1e-6, atol=1e-6)  # fmt: skip


def _sharded_ids_and_cotangent(mesh):
    rng = np.random.default_rng(2)
    ids = rng.integers(0, ROWS, (8, 4)).astype(np.int32)
    ids[1, :2] = ids[0, 0]
    cot = rng.normal(size=(8, 4, HIDDEN)).astype(np.float32)
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))
    return put(ids), put(cot)


def test_nnx_helpers_keep_the_table_in_place_under_a_linear_loss():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    opt = jaxembed.optim.sgd(LR)
    init = nnx.with_partitioning(nnx.initializers.normal(), ("model", None))
    with jax.set_mesh(mesh):
        model = jaxembed.nnx.Embed(ROWS, HIDDEN, rngs=nnx.Rngs(0), embedding_init=init)
        sparse = jaxembed.nnx.SparseOptimizer(model, opt)
        ids, cot = _sharded_ids_and_cotangent(mesh)
        table = model.embedding[...]
        want = _reference(table, ids, cot)

        def loss_fn(model, ids, cot):  # linear: d loss / d lookup = cot, whatever the table
            return jnp.sum(model(ids) * cot)

        graphdef, state = nnx.split((model, sparse))

        def step(state, ids, cot):
            model, sparse = nnx.merge(graphdef, state)
            loss, grads = jaxembed.nnx.value_and_grad(loss_fn)(model, ids, cot)
            sparse.update(model, grads)
            return nnx.state((model, sparse)), loss

        compiled = jax.jit(step, donate_argnums=0).lower(state, ids, cot).compile()
        assert table_copies(compiled, {"embedding": table}) == []
        state, _ = compiled(state, ids, cot)
        model, _ = nnx.merge(graphdef, state)
    np.testing.assert_allclose(np.asarray(model.embedding[...]), want, rtol=1e-6, atol=1e-6)
    assert model.embedding[...].sharding.spec == P("model", None)


def test_linen_helpers_keep_the_table_in_place_under_a_linear_loss():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    opt = jaxembed.optim.sgd(LR)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, ids):
            init = nn.with_partitioning(nn.initializers.normal(), ("model", None))
            return jaxembed.flax.Embed(ROWS, HIDDEN, embedding_init=init)(ids)

    model = Model()
    with jax.set_mesh(mesh):
        ids, cot = _sharded_ids_and_cotangent(mesh)
        params = model.init(jax.random.key(0), ids)["params"]

        def loss_fn(params, ids, cot):
            return jnp.sum(model.apply({"params": params}, ids) * cot)

        sparse = jaxembed.flax.init_sparse(opt, loss_fn, params, ids, cot)
        table = params["Embed_0"]["embedding"].value
        want = _reference(table, ids, cot)

        def step(params, sparse, ids, cot):
            loss, grads = jaxembed.flax.value_and_grad(loss_fn)(params, ids, cot)
            params, sparse = jaxembed.flax.sparse_update(opt, sparse, params, grads)
            return params, sparse, loss

        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, sparse, ids, cot).compile()
        assert table_copies(compiled, {"embedding": table}) == []
        params, sparse, _ = compiled(params, sparse, ids, cot)
    got = params["Embed_0"]["embedding"].value
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


def test_check_in_place_warns_once_for_every_copied_table_and_not_otherwise():
    def keeps_the_old(t, u):  # returns the old tables too: XLA must copy both
        return t.at[0].add(1.0), u.at[0].add(1.0), t, u

    t, u = jnp.zeros((64, 8)), jnp.zeros((32, 8), jnp.bfloat16)
    compiled = jax.jit(keeps_the_old, donate_argnums=(0, 1)).lower(t, u).compile()
    with pytest.warns(TableCopyWarning) as record:
        found = check_in_place(compiled, {"item": t, "user": u, "scalar": jnp.zeros(())})
    assert len(record) == 1
    assert "'item' (f32[64,8])" in str(record[0].message)
    assert "'user' (bf16[32,8])" in str(record[0].message)
    assert [c.names for c in found] == [("item",), ("user",)]
    in_place = jax.jit(lambda t: t.at[0].add(1.0), donate_argnums=0).lower(t).compile()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_in_place(in_place, {"item": t}) == []
