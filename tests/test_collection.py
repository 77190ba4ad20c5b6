"""Collections: every placement against the unsharded float64 reference, one lookup per stack.

A collection of five tables (every placement), eight features (sharing tables; sum, mean,
sqrtn, max, weighted and unpooled; dense and Ragged inputs, with empty slots, out-of-range
ids and duplicates) is looked up, differentiated and updated on (2, 4) and (8,) meshes; the
outputs, the tables' gradients (in id order) and the row-sparse update equal a float64 numpy
reference built from each table in id order.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bag_reference import embedding_bag_grad_reference, embedding_bag_reference
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed
import jaxembed.nnx
from jaxembed import hlo
from jaxembed.collection import FeatureConfig, TableConfig, layout_collection
from jaxembed.nn.stacks import unstack
from jaxembed.optim import reference

B = 16


def tables_for(row_sharding="block", two_axes=True):
    return [
        TableConfig("item", 203, 8, placement="rows", row_sharding=row_sharding),
        TableConfig("user", 50, 8, placement="table"),
        TableConfig(
            "ad", 37, 8, placement="table_rows" if two_axes else "rows", row_sharding=row_sharding
        ),
        TableConfig("country", 11, 4, placement="replicated"),
        TableConfig("text", 29, 16, placement="columns"),
    ]


FEATURES = [
    FeatureConfig("clicked", "item", combiner="mean", max_ids=5),
    FeatureConfig("target", "item"),
    FeatureConfig("user", "user", combiner="sqrtn", max_ids=3),
    FeatureConfig("ads", "ad", combiner="max", max_ids=4),
    FeatureConfig("ad_seq", "ad", combiner=None, max_ids=3),
    FeatureConfig("country", "country"),
    FeatureConfig("words", "text", combiner="sum", max_ids=6),  # a Ragged input
    FeatureConfig("weighted", "user", combiner="mean", max_ids=4),  # (ids, weights)
]


def make_batch(rng, layout):
    vocab = {t.name: t.vocab_size for t in layout.tables}

    def ids(table, shape, empty=0.25):
        x = rng.integers(0, vocab[table], size=shape).astype(np.int32)
        x[rng.random(shape) < empty] = -1
        return x

    batch = {
        "clicked": ids("item", (B, 5)),
        "target": ids("item", (B,), empty=0),
        "user": ids("user", (B, 3)),
        "ads": ids("ad", (B, 4)),
        "ad_seq": ids("ad", (B, 3)),
        "country": ids("country", (B,), empty=0),
        "weighted": (ids("user", (B, 4)), rng.uniform(0.5, 2, size=(B, 4)).astype(np.float32)),
    }
    batch["clicked"][0] = -1  # an empty bag
    batch["clicked"][1, :3] = [7, 7, 7]  # duplicates
    batch["clicked"][2, 0] = vocab["item"] + 3  # out of range: reads nothing (under jit)
    lengths = rng.integers(0, 4, size=(8, 4)).astype(np.int32)  # 8 blocks of 4 bags... (B/8 = 2)
    lengths = lengths[:, :2]  # two bags per block: 16 bags in all
    values = rng.integers(0, vocab["text"], size=(8, 8)).astype(np.int32)
    batch["words"] = jaxembed.Ragged(values, lengths)
    return batch


def reference_outputs(tables, batch, cts=None):
    """Outputs (and, with cotangents, each table's gradient in id order), float64."""
    out, grads = {}, {name: np.zeros_like(t, np.float64) for name, t in tables.items()}
    for f in FEATURES:
        t = np.asarray(tables[f.table], np.float64)
        value = batch[f.name]
        kw = dict(vocab_size=t.shape[0])
        if isinstance(value, jaxembed.Ragged):
            x, kw["lengths"] = np.asarray(value.values), np.asarray(value.lengths)
        elif isinstance(value, tuple):
            x, kw["per_id_weights"] = value
        else:
            x = value if value.ndim == 2 else value[:, None]
        if f.combiner is None:  # unpooled: each slot its own bag of one
            o = embedding_bag_reference(t, x[..., None], combiner="sum", **kw)
        else:
            o = embedding_bag_reference(t, x, combiner=f.combiner, **kw)
        out[f.name] = o.reshape(-1, t.shape[1]) if isinstance(value, jaxembed.Ragged) else o
        if cts is not None:
            ct = cts[f.name].reshape(o.shape)
            if f.combiner is None:
                grads[f.table] += embedding_bag_grad_reference(
                    t, x[..., None], combiner="sum", out_grad=ct, **kw
                )
            else:
                grads[f.table] += embedding_bag_grad_reference(
                    t, x, combiner=f.combiner, out_grad=ct, **kw
                )
    return out, grads


def put_batch(batch, mesh, spec):
    def put(a):
        return jax.device_put(a, NamedSharding(mesh, P(*spec, *(None,) * (a.ndim - len(spec)))))

    return {
        k: jaxembed.Ragged(put(v.values), put(v.lengths),
                           None if v.weights is None else put(v.weights))
        if isinstance(v, jaxembed.Ragged)
        else tuple(put(a) for a in v) if isinstance(v, tuple) else put(v)
        for k, v in batch.items()
    }  # fmt: skip


MESHES = {"2x4": ((2, 4), ("data", "model"), ("data",)), "8": ((8,), ("x",), ("x",))}


def outputs_and_grads(graphdef, state, batch, cts):
    """The collection's outputs and d(Σ out · ct)/d state, one jitted step."""

    @jax.jit
    def step(state, batch, cts):
        def loss(state):
            out = nnx.merge(graphdef, state)(batch)
            return sum(jnp.sum(out[k] * cts[k]) for k in out), out

        (_, out), g = jax.value_and_grad(loss, has_aux=True)(state)
        return out, g

    return step(state, batch, cts)


@pytest.mark.parametrize("row_sharding", ["block", "mod"])
@pytest.mark.parametrize("mesh_name", MESHES)
def test_every_placement_matches_the_reference(mesh_name, row_sharding):
    shape, names, batch_axes = MESHES[mesh_name]
    mesh = jax.make_mesh(shape, names)
    rng = np.random.default_rng(len(mesh_name) + len(row_sharding))
    with jax.set_mesh(mesh):
        coll = jaxembed.nnx.EmbeddingBagCollection(
            tables_for(row_sharding, len(shape) == 2), FEATURES, rngs=nnx.Rngs(0)
        )
        batch = make_batch(rng, coll.layout)
        device_batch = put_batch(batch, mesh, batch_axes)
        tables = {k: np.asarray(v) for k, v in coll.tables().items()}
        cts = {}
        for f in FEATURES:
            shape_f = {"ad_seq": (B, 3, 8), "words": (16, 16)}.get(f.name, None)
            dim = coll.layout.table(f.table).dim
            cts[f.name] = rng.normal(size=shape_f or (B, dim)).astype(np.float32)

        graphdef, state = nnx.split(coll)

        out, grads = outputs_and_grads(graphdef, state, device_batch, cts)
        # Every output in the batch's layout, the columns stack's too: a dense model can
        # concatenate them.
        for name, value in out.items():
            want = NamedSharding(mesh, P(batch_axes, *(None,) * (value.ndim - 1)))
            assert value.sharding.is_equivalent_to(want, value.ndim), (name, value.sharding)
        joined = np.asarray(coll.concat(out))
    ref_out, ref_grads = reference_outputs(tables, batch, cts)
    for name, want in ref_out.items():
        np.testing.assert_allclose(np.asarray(out[name]), want, rtol=1e-5, atol=1e-5, err_msg=name)
    want = np.concatenate([ref_out[f.name] for f in FEATURES if f.pooled], axis=-1)
    np.testing.assert_allclose(joined, want, rtol=1e-5, atol=1e-5)
    stacks = {s.index: np.asarray(grads["stacks"][s.name][...]) for s in coll.layout.stacks}
    for name, g in unstack(coll.layout, stacks).items():
        np.testing.assert_allclose(np.asarray(g), ref_grads[name], rtol=1e-5, atol=1e-5,
                                   err_msg=name)  # fmt: skip


def test_stacks_and_one_lookup_per_stack():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    layout = layout_collection(tables_for(), FEATURES, mesh)
    dims = sorted((s.dim, s.row_axes, s.hidden_axes) for s in layout.stacks)
    assert dims == [(4, (), ()), (8, ("data", "model"), ()), (16, (), ("data", "model"))]
    with jax.set_mesh(mesh):
        coll = jaxembed.nnx.EmbeddingBagCollection(tables_for(), FEATURES, rngs=nnx.Rngs(0))
        batch = put_batch(make_batch(np.random.default_rng(0), coll.layout), mesh, ("data",))
        dense = {k: v for k, v in batch.items() if k in ("clicked", "target", "user", "weighted")}
        sub = jaxembed.nnx.EmbeddingBagCollection(
            tables_for(), [f for f in FEATURES if f.name in dense], rngs=nnx.Rngs(0)
        )
        graphdef, state = nnx.split(sub)
        text = (
            jax.jit(lambda s, b: nnx.merge(graphdef, s)(b)).lower(state, dense).compile().as_text()
        )
    # Four features of one stack, one lookup: the ids of all four travel together
    # ([.., 5 + 1 + 3 + 4 slots]) and the pooled [.., 4, 8] block is what is reduced, once per
    # mesh axis of the plan: never per feature, never unpooled rows.
    found = hlo.collectives(text)
    reductions = [c for c in found if c.kind in ("all-reduce", "reduce-scatter")
                  and c.dtype == "f32"]  # fmt: skip
    assert reductions and all(c.result_shape[0][-2:] == (4, 8) for c in reductions), found
    assert all(c.result_shape[0][-1] == 13 for c in found if c.dtype == "s32" and c.kind ==
               "all-gather")  # fmt: skip
    pooled = B * 4 * 8
    for c in found:
        if c.dtype == "f32":
            assert np.prod(c.result_shape[0]) <= pooled, c


def test_row_sparse_update_of_the_collection():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    rng = np.random.default_rng(5)
    features = [f for f in FEATURES if f.name in ("clicked", "target", "user", "country")]
    with jax.set_mesh(mesh):
        coll = jaxembed.nnx.EmbeddingBagCollection(tables_for(), features, rngs=nnx.Rngs(0))
        batch = make_batch(rng, coll.layout)
        batch = {k: batch[k] for k in ("clicked", "target", "user", "country")}
        batch["clicked"][2, 0] = 3  # concrete ids are checked: keep them in range
        tables = {k: np.asarray(v, np.float64) for k, v in coll.tables().items()}
        opt = jaxembed.optim.rowwise_adagrad(0.1)
        states = coll.init_optimizer(opt)
        cts = {f.name: rng.normal(size=(B, coll.layout.table(f.table).dim)).astype(np.float32)
               for f in features}  # fmt: skip
        states = coll.apply_gradients(opt, states, put_batch(batch, mesh, ("data",)), cts)
        new = {k: np.asarray(v) for k, v in coll.tables().items()}
    # The reference: per table, every slot's gradient, one update per touched row.
    for t in ("item", "user", "country"):
        ids, grads = [], []
        for f in features:
            if f.table != t:
                continue
            x = batch[f.name] if batch[f.name].ndim == 2 else batch[f.name][:, None]
            for b in range(B):
                ok = [j for j in range(x.shape[1]) if 0 <= x[b, j] < tables[t].shape[0]]
                w = np.ones(len(ok))
                scale = {
                    "sum": w,
                    "mean": w / max(w.sum(), 1),
                    "sqrtn": w / np.sqrt(max(w.sum(), 1)),
                }
                for k, j in enumerate(ok):
                    ids.append(x[b, j])
                    grads.append(scale[f.combiner][k] * cts[f.name][b])
        ref, _ = reference.sparse_step(
            opt.formula, tables[t], reference.init_states(opt.formula, *tables[t].shape),
            np.asarray(ids), np.asarray(grads), count=0,
        )  # fmt: skip
        np.testing.assert_allclose(new[t], ref, rtol=1e-5, atol=1e-6, err_msg=t)


def test_tables_round_trip_and_bad_configs():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    with jax.set_mesh(mesh):
        coll = jaxembed.nnx.EmbeddingBagCollection(tables_for("mod"), FEATURES, rngs=nnx.Rngs(1))
        values = {k: np.asarray(v) + 1.0 for k, v in coll.tables().items()}
        coll.load_tables(values)
        for k, v in coll.tables().items():
            np.testing.assert_array_equal(np.asarray(v), values[k])
    with pytest.raises(ValueError, match="reads table 'nope', which is not in the collection"):
        layout_collection(tables_for(), [FeatureConfig("f", "nope")], mesh)
    with pytest.raises(ValueError, match="two tables are named 'item'"):
        layout_collection([*tables_for(), TableConfig("item", 3, 8)], FEATURES, mesh)
    with pytest.raises(ValueError, match="placement must be one of"):
        TableConfig("t", 3, 8, placement="everywhere")
    with pytest.raises(ValueError, match="'columns' splits dim 6 over"):
        layout_collection([TableConfig("t", 8, 6, placement="columns")], [FeatureConfig("f", "t")],
                          mesh)  # fmt: skip
    batch = make_batch(np.random.default_rng(0), coll.layout)
    batch["clicked"][2, 0] = 3
    batch["target"] = np.full((B,), 999, np.int32)
    with pytest.raises(ValueError, match=r"feature 'target': id 999 .* out of range for table"):
        with jax.set_mesh(mesh):
            coll(batch)


# Unweighted sums (and unpooled features) pass no per-slot factors: their empty slots (id -1,
# out-of-range ids, a Ragged's unused slots and gap bags) must read nothing and get no
# gradient by the ids alone. Beside them, calls with a weighted sum or a mean still scale.
MIXED_TABLES = [
    TableConfig("item", 61, 8, placement="rows"),
    TableConfig("user", 40, 8, placement="table"),  # the same stack as item: rows of it
    TableConfig("cat", 23, 4, placement="rows", row_sharding="mod"),
    TableConfig("hist", 30, 16, placement="columns"),
]
MIXED_FEATURES = [
    FeatureConfig("plain", "item", "sum", 3),  # unweighted sum ...
    FeatureConfig("scaled", "user", "sum", 4, weighted=True),  # ... weighted sum, (ids, w)
    FeatureConfig("avg", "item", "mean", 5),
    FeatureConfig("seq", "user", None, 2),  # ... unpooled: one flat call, with factors
    FeatureConfig("words", "item", "sum", 6),  # a Ragged: its own call, no factors
    FeatureConfig("c1", "cat", "sum", 4),
    FeatureConfig("c2", "cat", "sum", 3),  # stacked [B, 2, 4], no factors
    FeatureConfig("h_seq", "hist", None, 3),
    FeatureConfig("h_sum", "hist", "sum", 2),  # a flat call of the columns stack, no factors
    FeatureConfig("terms", "hist", "sum", 5, weighted=True),  # a weighted Ragged: factors
]
# Per call, whether it passes factors (`needs_factors`).
MIXED_CALLS = {
    ("plain", "scaled", "avg", "seq"): True, ("words",): False, ("c1", "c2"): False,
    ("h_seq", "h_sum"): False, ("terms",): True,
}  # fmt: skip


def mixed_batch(rng, vocab):
    def ids(table, shape, empty=0.3):
        x = rng.integers(0, vocab[table], size=shape).astype(np.int32)
        x[rng.random(shape) < empty] = -1
        return x

    def weights(shape):
        return rng.uniform(0.5, 2, size=shape).astype(np.float32)

    batch = {
        "plain": ids("item", (B, 3)), "scaled": (ids("user", (B, 4)), weights((B, 4))),
        "avg": ids("item", (B, 5)), "seq": ids("user", (B, 2)), "c1": ids("cat", (B, 4)),
        "c2": ids("cat", (B, 3)), "h_seq": ids("hist", (B, 3)), "h_sum": ids("hist", (B, 2)),
    }  # fmt: skip
    batch["plain"][0] = -1  # an empty bag
    batch["plain"][1] = [7, 7, -1]  # a duplicate
    batch["c1"][2, 0] = vocab["cat"] + 5  # out of range: reads nothing under jit
    batch["h_seq"][3, 1] = -1
    for name, table, lead in (("words", "item", 8), ("terms", "hist", 8)):
        lengths = rng.integers(0, 4, size=(lead, 2)).astype(np.int32)  # B/8 = 2 bags a block
        values = rng.integers(0, vocab[table], size=(lead, 8)).astype(np.int32)
        w = weights((lead, 8)) if name == "terms" else None
        batch[name] = jaxembed.Ragged(values, lengths, w)
    return batch


def mixed_reference(tables, batch, cts):
    """Every output and each table's gradient (in id order), float64."""
    out, grads = {}, {name: np.zeros_like(t, np.float64) for name, t in tables.items()}
    for f in MIXED_FEATURES:
        t = np.asarray(tables[f.table], np.float64)
        value, kw = batch[f.name], dict(vocab_size=t.shape[0])
        if isinstance(value, jaxembed.Ragged):
            x, kw["lengths"] = np.asarray(value.values), np.asarray(value.lengths)
            if value.weights is not None:
                kw["per_id_weights"] = np.asarray(value.weights)
        elif isinstance(value, tuple):
            x, kw["per_id_weights"] = value
        else:
            x = value
        combiner = f.combiner or "sum"
        if f.combiner is None:  # unpooled: each slot its own bag of one
            x = x[..., None]
            if "per_id_weights" in kw:
                kw["per_id_weights"] = kw["per_id_weights"][..., None]
        o = embedding_bag_reference(t, x, combiner=combiner, **kw)
        out[f.name] = o.reshape(-1, t.shape[1]) if isinstance(value, jaxembed.Ragged) else o
        ct = cts[f.name].reshape(o.shape).astype(np.float64)
        grads[f.table] += embedding_bag_grad_reference(t, x, combiner=combiner, out_grad=ct, **kw)
    return out, grads


@pytest.mark.parametrize("exchange", [
    pytest.param("auto", marks=pytest.mark.slow),  # 37 s; it runs one of the three below
    "rows", "routed", "dense"])  # fmt: skip
def test_unweighted_weighted_mean_and_unpooled_features_on_one_stack(exchange, fresh_warnings):
    from jaxembed.kernels.collection import checked_batch, groups_of, needs_factors

    mesh = jax.make_mesh((8,), ("x",))
    rng = np.random.default_rng(11)
    layout = layout_collection(MIXED_TABLES, MIXED_FEATURES, mesh)
    # The row-split stacks run `exchange`; the columns stack its own (auto).
    exchanges = {s.index: exchange for s in layout.stacks if s.row_axes}
    with jax.set_mesh(mesh):
        coll = jaxembed.nnx.EmbeddingBagCollection(
            MIXED_TABLES, MIXED_FEATURES, exchange=exchanges, rngs=nnx.Rngs(0)
        )
        batch = mixed_batch(rng, {t.name: t.vocab_size for t in MIXED_TABLES})
        groups = groups_of(coll.layout, checked_batch(coll.layout, batch))
        assert {g.features: needs_factors(coll.layout, g, batch) for g in groups} == MIXED_CALLS
        assert {g.kind for g in groups} == {"dense", "stacked", "ragged"}
        device_batch = put_batch(batch, mesh, ("x",))
        tables = {k: np.asarray(v) for k, v in coll.tables().items()}
        shapes = {"seq": (B, 2, 8), "h_seq": (B, 3, 16)}
        cts = {f.name: rng.normal(size=shapes.get(f.name, (B, coll.layout.table(f.table).dim)))
               .astype(np.float32) for f in MIXED_FEATURES}  # fmt: skip
        graphdef, state = nnx.split(coll)

        out, grads = outputs_and_grads(graphdef, state, device_batch, cts)
        # The row-sparse update (SGD: the table less lr times its gradient) from the same
        # operands; item's two calls (dense and Ragged) update it once each. (The dense
        # exchange builds table-shaped gradients, which a row-sparse update never does.)
        updated = None
        if exchange != "dense":
            opt = jaxembed.optim.sgd(0.5)
            states = coll.init_optimizer(opt)
            with pytest.warns(UserWarning, match="read by 2 calls in one step"):
                coll.apply_gradients(opt, states, device_batch, cts)
            updated = {k: np.asarray(v, np.float64) for k, v in coll.tables().items()}
    ref_out, ref_grads = mixed_reference(tables, batch, cts)
    for name, want in ref_out.items():
        np.testing.assert_allclose(np.asarray(out[name]), want, rtol=1e-5, atol=1e-5, err_msg=name)
    stacks = {s.index: np.asarray(grads["stacks"][s.name][...]) for s in coll.layout.stacks}
    for name, g in unstack(coll.layout, stacks).items():
        np.testing.assert_allclose(np.asarray(g), ref_grads[name], rtol=1e-5, atol=1e-5,
                                   err_msg=name)  # fmt: skip
        if updated is not None:
            want = np.asarray(tables[name], np.float64) - 0.5 * ref_grads[name]
            np.testing.assert_allclose(updated[name], want, rtol=1e-5, atol=1e-5, err_msg=name)
