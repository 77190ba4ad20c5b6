"""A collection's checkpoint and training helpers refuse what does not fit, before writing.

`load_tables`, `import_optimizer` and `apply_gradients` (and Linen's `sparse_update`, NNX's
`SparseOptimizer.update`) are given arrays that stand for a table, an optimizer state slot or a
feature's output gradient. One of another shape (a `[1, dim]` row would be broadcast over the
whole table), an integer dtype, a missing or unknown table or feature, another optimizer's
export: each is a `ValueError` that names it, and nothing is written. A correct export
restores onto another mesh and placement exactly (8 devices by rows vs one device). The DLRM
example refuses to resume a checkpoint of another `--dim`, `--scale` or `--features`.
"""

import importlib.util
import pathlib
import sys

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

TABLES = [
    jaxembed.TableConfig("item", 40, 8, placement="rows"),
    jaxembed.TableConfig("user", 12, 8, placement="table"),
    jaxembed.TableConfig("country", 5, 4, placement="replicated"),
    jaxembed.TableConfig("text", 6, 8, placement="columns"),
]
FEATURES = [
    jaxembed.FeatureConfig("clicked", "item", combiner="mean"),
    jaxembed.FeatureConfig("user", "user"),
    jaxembed.FeatureConfig("country", "country"),
    jaxembed.FeatureConfig("words", "text", combiner="sum"),
]
B = 8


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("data",))


@pytest.fixture(scope="module")
def coll(mesh):
    with jax.set_mesh(mesh):
        return jaxembed.nnx.EmbeddingBagCollection(TABLES, FEATURES, rngs=nnx.Rngs(0))


def random_tables(seed=0):
    rng = np.random.default_rng(seed)
    return {t.name: rng.normal(size=(t.vocab_size, t.dim)).astype(np.float32) for t in TABLES}


def random_export(optimizer, seed=0, count=7):
    """`export_optimizer`'s form, numpy: every slot of every table random."""
    rng = np.random.default_rng(seed)
    return {
        t.name: {
            "count": np.int32(count),
            "slots": {
                s.name: rng.uniform(0, 2, size=s.shape(t.vocab_size, t.dim)).astype(np.float32)
                for s in optimizer.formula.slots
            },
        }
        for t in TABLES
    }


def host(tables):
    return {k: np.asarray(v) for k, v in tables.items()}


def put_batch(mesh):
    rng = np.random.default_rng(1)

    def put(a):
        return jax.device_put(a, NamedSharding(mesh, P("data", *(None,) * (a.ndim - 1))))

    return {
        "clicked": put(rng.integers(0, 40, (B, 3)).astype(np.int32)),
        "user": put(rng.integers(0, 12, (B,)).astype(np.int32)),
        "country": put(rng.integers(0, 5, (B,)).astype(np.int32)),
        "words": put(rng.integers(0, 6, (B, 4)).astype(np.int32)),
    }


def out_grads_for(batch):
    dims = {"clicked": 8, "user": 8, "country": 4, "words": 8}
    return {f: np.ones((B, d), np.float32) for f, d in dims.items()}


# --- load_tables ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [(1, 8), (8,), (), (8, 40), (41, 8)],
    ids=["row", "vector", "scalar", "transposed", "one_more_row"],
)
def test_load_tables_refuses_a_table_of_another_shape(coll, mesh, bad):
    values = random_tables()
    values["item"] = np.ones(bad, np.float32)
    shape = "[" + ", ".join(map(str, bad)) + "]"
    with jax.set_mesh(mesh), pytest.raises(
        ValueError,
        match=rf"load_tables: table 'item' has shape {re_escape(shape)}, but the collection's "
        r"table 'item' \(\[vocab_size, dim\]\) is \[40, 8\]: pass the whole table",
    ):  # fmt: skip
        coll.load_tables(values)


def re_escape(text):
    import re

    return re.escape(text)


def test_load_tables_checks_every_table_before_writing_any(coll, mesh):
    with jax.set_mesh(mesh):
        before = host(coll.tables())
        values = {k: v + 1 for k, v in before.items()}  # right: would be written first
        values["text"] = np.ones((1, 8), np.float32)  # the last stack's table: broadcast today
        with pytest.raises(ValueError, match=r"table 'text' has shape \[1, 8\]"):
            coll.load_tables(values)
        after = host(coll.tables())
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


@pytest.mark.parametrize("dtype", [np.int32, np.bool_])
def test_load_tables_refuses_integer_and_bool_tables(coll, mesh, dtype):
    values = random_tables()
    values["user"] = np.ones((12, 8), dtype)
    name = np.dtype(dtype).name
    with jax.set_mesh(mesh), pytest.raises(
        ValueError,
        match=rf"table 'user' has dtype {name}, but the collection's table 'user' .* holds "
        "float32 values",
    ):  # fmt: skip
        coll.load_tables(values)


def test_load_tables_refuses_missing_and_unknown_tables(coll, mesh):
    values = random_tables()
    del values["user"]
    with jax.set_mesh(mesh):
        with pytest.raises(
            ValueError,
            match=r"no values for tables \['user'\]; the collection has tables \['item', "
            r"'user', 'country', 'text'\]",
        ):  # fmt: skip
            coll.load_tables(values)
        with pytest.raises(ValueError, match=r"tables \['nope'\] are not in the collection"):
            coll.load_tables({**random_tables(), "nope": np.zeros((3, 8), np.float32)})


# --- import_optimizer -----------------------------------------------------------------------


def test_import_optimizer_refuses_another_optimizers_export(coll, mesh):
    rowwise = jaxembed.optim.rowwise_adagrad(0.1)
    with jax.set_mesh(mesh):
        with pytest.raises(
            ValueError,
            match=r"import_optimizer: the state of table 'item' has slots \['mu', 'nu'\], but "
            r"rowwise_adagrad keeps slots \['accumulator'\]",
        ):  # fmt: skip
            coll.import_optimizer(rowwise, random_export(jaxembed.optim.adam(0.1)))
        # adagrad's accumulator has rowwise_adagrad's name, but one per element.
        with pytest.raises(
            ValueError,
            match=r"table 'item' slot 'accumulator' has shape \[40, 8\], but rowwise_adagrad's "
            r"'accumulator' of table 'item' is \[40\]",
        ):  # fmt: skip
            coll.import_optimizer(rowwise, random_export(jaxembed.optim.adagrad(0.1)))


def test_import_optimizer_refuses_broadcast_slots_missing_tables_and_counts(coll, mesh):
    adam = jaxembed.optim.adam(0.1)
    with jax.set_mesh(mesh):
        exported = random_export(adam)
        exported["user"]["slots"]["nu"] = np.ones((1, 8), np.float32)
        with pytest.raises(ValueError, match=r"table 'user' slot 'nu' has shape \[1, 8\]"):
            coll.import_optimizer(adam, exported)

        exported = random_export(adam)
        exported["country"]["slots"]["mu"] = np.zeros((5, 4), np.int32)
        with pytest.raises(ValueError, match=r"table 'country' slot 'mu' has dtype int32"):
            coll.import_optimizer(adam, exported)

        exported = random_export(adam)
        del exported["text"]
        with pytest.raises(
            ValueError, match=r"the export has no state for tables \['text'\]; the collection"
        ):
            coll.import_optimizer(adam, exported)

        exported = {**random_export(adam), "nope": random_export(adam)["item"]}
        with pytest.raises(ValueError, match=r"the export has states of tables \['nope'\]"):
            coll.import_optimizer(adam, exported)

        exported = random_export(adam)
        del exported["item"]["count"]
        with pytest.raises(ValueError, match=r"the state of table 'item' has no 'count'"):
            coll.import_optimizer(adam, exported)


def test_import_optimizer_refuses_two_counts_in_one_stack(coll, mesh):
    """item (rows) and user (table) share a stack on (8,): one count for both."""
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    exported = random_export(opt)
    exported["user"]["count"] = np.int32(3)
    with jax.set_mesh(mesh), pytest.raises(
        ValueError,
        match=r"tables \['item', 'user'\] share one stack .* different counts "
        r"\{'item': 7, 'user': 3\}",
    ):  # fmt: skip
        coll.import_optimizer(opt, exported)


# --- apply_gradients ------------------------------------------------------------------------


def test_apply_gradients_refuses_missing_extra_and_misshapen_out_grads(coll, mesh):
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    batch = put_batch(mesh)
    with jax.set_mesh(mesh):
        states = coll.init_optimizer(opt)
        grads = out_grads_for(batch)
        del grads["country"]
        with pytest.raises(
            ValueError,
            match=r"apply_gradients: out_grads has no gradient for features \['country'\]",
        ):
            coll.apply_gradients(opt, states, batch, grads)

        grads = {**out_grads_for(batch), "nope": np.ones((B, 8), np.float32)}
        with pytest.raises(ValueError, match=r"gradients of \['nope'\], which are not features"):
            coll.apply_gradients(opt, states, batch, grads)

        for bad in [(1, 8), (B, 4), (B, 1, 8)]:
            grads = {**out_grads_for(batch), "user": np.ones(bad, np.float32)}
            shape = re_escape("[" + ", ".join(map(str, bad)) + "]")
            with pytest.raises(
                ValueError,
                match=rf"the gradient of feature 'user' \(table 'user'\) has shape {shape}, but "
                rf"its output for this batch is \[{B}, 8\]",
            ):  # fmt: skip
                coll.apply_gradients(opt, states, batch, grads)


def test_apply_gradients_refuses_another_optimizers_states(coll, mesh):
    batch = put_batch(mesh)
    with jax.set_mesh(mesh):
        adam_states = coll.init_optimizer(jaxembed.optim.adam(0.1))
        with pytest.raises(
            ValueError, match=r"has slots \['mu', 'nu'\], but rowwise_adagrad keeps slots"
        ):
            coll.apply_gradients(
                jaxembed.optim.rowwise_adagrad(0.1), adam_states, batch, out_grads_for(batch)
            )


# --- outside a mesh context -----------------------------------------------------------------


def test_init_optimizer_outside_the_mesh_context(coll, mesh):
    """Built under `jax.set_mesh`, the states are made on the tables' mesh without it."""
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    states = coll.init_optimizer(opt)  # no jax.set_mesh here
    for s in coll.layout.stacks:
        table = coll.stacks[s.name][...]
        acc = states[s.index].slots["accumulator"]
        assert acc.sharding == NamedSharding(table.sharding.mesh, P(s.spec[0])), s.name
        assert acc.shape == s.shape[:1]
    # And the round trip through them, still outside.
    exported = random_export(opt)
    back = coll.export_optimizer(coll.import_optimizer(opt, exported))
    for t in exported:
        np.testing.assert_array_equal(
            np.asarray(back[t]["slots"]["accumulator"]), exported[t]["slots"]["accumulator"]
        )


# --- the round trip onto another placement --------------------------------------------------


@pytest.mark.parametrize("name", ["rowwise_adagrad", "adam"])
def test_export_restores_exactly_onto_another_placement(coll, mesh, name):
    """8 devices (rows, table, replicated, columns) -> 1 device (all replicated, one stack per
    dim) -> the numpy reference, bitwise, for the tables and every slot and count."""
    opt = getattr(jaxembed.optim, name)(0.1)
    tables, exported = random_tables(3), random_export(opt, seed=4)
    with jax.set_mesh(mesh):
        coll.load_tables(tables)
        states = coll.import_optimizer(opt, exported)
        got_tables, got = host(coll.tables()), coll.export_optimizer(states)
    one = jaxembed.nnx.EmbeddingBagCollection(TABLES, FEATURES, rngs=nnx.Rngs(5))
    assert all(s.row_axes == () for s in one.layout.stacks)
    one.load_tables({k: v.astype(np.float64) for k, v in got_tables.items()})  # floats cast
    back = one.export_optimizer(one.import_optimizer(opt, got))
    for t in TABLES:
        np.testing.assert_array_equal(got_tables[t.name], tables[t.name], err_msg=t.name)
        np.testing.assert_array_equal(np.asarray(one.tables()[t.name]), tables[t.name])
        for s in opt.formula.slots:
            want = exported[t.name]["slots"][s.name]
            np.testing.assert_array_equal(np.asarray(got[t.name]["slots"][s.name]), want)
            np.testing.assert_array_equal(np.asarray(back[t.name]["slots"][s.name]), want)
        assert int(got[t.name]["count"]) == int(back[t.name]["count"]) == 7


# --- the training helpers -------------------------------------------------------------------


def test_linen_sparse_update_refuses_missing_and_foreign_states(mesh):
    module = jaxembed.flax.EmbeddingBagCollection(TABLES[:1], FEATURES[:1])
    batch = {"clicked": put_batch(mesh)["clicked"]}
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    with jax.set_mesh(mesh):
        params = module.init(jax.random.key(0), batch)["params"]

        def loss_fn(p, batch):
            return jnp.sum(module.apply({"params": p}, batch)["clicked"])

        _, grads = jaxembed.flax.value_and_grad(loss_fn)(params, batch)
        with pytest.raises(
            ValueError, match=r"sparse_update: no optimizer state for the collection lookup at"
        ):
            jaxembed.flax.sparse_update(opt, {}, params, grads)
        adam_states = jaxembed.flax.init_sparse(jaxembed.optim.adam(0.1), loss_fn, params, batch)
        with pytest.raises(
            ValueError, match=r"sparse_update: .* has slots \['mu', 'nu'\], but rowwise_adagrad"
        ):
            jaxembed.flax.sparse_update(opt, adam_states, params, grads)


def test_nnx_sparse_optimizer_of_another_model_is_an_error(mesh):
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.coll = jaxembed.nnx.EmbeddingBagCollection(TABLES[:1], FEATURES[:1], rngs=rngs)

    class Other(nnx.Module):
        def __init__(self, rngs):
            self.other = jaxembed.nnx.EmbeddingBagCollection(TABLES[:1], FEATURES[:1], rngs=rngs)

    batch = {"clicked": put_batch(mesh)["clicked"]}
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    with jax.set_mesh(mesh):
        model = Model(nnx.Rngs(0))
        sparse = jaxembed.nnx.SparseOptimizer(Other(nnx.Rngs(0)), opt)
        _, grads = jaxembed.nnx.value_and_grad(lambda m, b: jnp.sum(m.coll(b)["clicked"]))(
            model, batch
        )
        with pytest.raises(
            ValueError,
            match=r"SparseOptimizer.update: no optimizer state for the table at 'coll' \(it "
            r"holds states of \['other'\]\)",
        ):  # fmt: skip
            sparse.update(model, grads)


# --- examples/train_dlrm.py --resume --------------------------------------------------------

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
TINY = ["--scale", str(1 / 1024), "--features", "6", "--dim", "8", "--batch", "128",
        "--steps", "2", "--eval-every", "2", "--eval-size", "256", "--no-progress"]  # fmt: skip


@pytest.fixture(scope="module")
def example():
    sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location("train_dlrm", EXAMPLES / "train_dlrm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(example, argv):
    args = example.parse_args(argv)
    mesh = example.make_mesh(args.mesh)
    data = example.ClickModel(args.scale, args.seed, num_features=args.features)
    with jax.set_mesh(mesh):
        return args, mesh, example.build(args, data, mesh)


@pytest.fixture(scope="module")
def saved(example, tmp_path_factory):
    """A checkpoint of step 1 of the TINY run (--dim 8) on one device, without training:
    (directory, its tables)."""
    directory = tmp_path_factory.mktemp("dlrm") / "ckpt"
    argv = [*TINY, "--mesh", "data=1", "--placement", "replicated"]
    _, mesh, (model, optimizer, coll, _, row_states) = build(example, argv)
    manager = example.checkpoint_manager(str(directory))
    with jax.set_mesh(mesh):
        coll.load_tables(random_tables_like(coll))
        example.save(manager, 1, model, optimizer, coll, row_states)
        return directory, example.export_tables(coll)


def random_tables_like(coll):
    rng = np.random.default_rng(7)
    return {t.name: rng.normal(size=(t.vocab_size, t.dim)).astype(t.dtype)
            for t in coll.layout.tables}  # fmt: skip


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--dim", "16"], r"its tables have dim 8, this run asks for --dim 16\. Resume with the "
                          r"flags that wrote it \(--dim 8"),
        (["--scale", str(1 / 512)], r"its tables have other sizes \(rows in the checkpoint vs "
                                    r"this run: .*--scale"),
        (["--features", "4"], r"its dense model has other shapes \(checkpoint vs this run: "
                              r"dense/.*this run has --features 4\)"),
    ],
    ids=["dim", "scale", "features"],
)  # fmt: skip
def test_resume_with_other_shapes_names_the_checkpoints(example, saved, flags, match):
    directory, _ = saved
    argv = [*TINY, "--mesh", "data=1", "--placement", "replicated", *flags, "--resume",
            "--checkpoint-dir", str(directory)]  # fmt: skip
    with pytest.raises(SystemExit, match=rf"--resume: the checkpoint of step 1 in .*{match}"):
        example.main(argv)


def test_resume_restores_onto_another_mesh_and_placement(example, saved):
    """The check passes a checkpoint of the same shapes: (8,), rows, tables bitwise."""
    directory, tables = saved
    argv = [*TINY, "--mesh", "data=8", "--placement", "rows", "--resume",
            "--checkpoint-dir", str(directory)]  # fmt: skip
    args, mesh, (model, optimizer, coll, _, row_states) = build(example, argv)
    manager = example.checkpoint_manager(str(directory))
    with jax.set_mesh(mesh):
        example.restore(manager, 1, model, optimizer, coll, row_states, args)
        got = example.export_tables(coll)
    assert sorted(got) == sorted(tables)
    for name in tables:
        np.testing.assert_array_equal(got[name], tables[name], err_msg=name)
