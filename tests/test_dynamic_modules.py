"""The dynamic-table modules, `jaxembed.nnx.DynamicEmbed` and `jaxembed.flax.DynamicEmbed`,
trained with the row-sparse helpers against the float64 twin and the pure-Python remap of
`test_dynamic_table`.

The model: a `DynamicEmbed` read by bags of raw 64-bit ids (`[B, L]`, summed over L), a linear
head trained by optax SGD, a squared loss. Six steps on a stream where ids keep arriving and
the table is too small, so ids are admitted, evicted and refused. After every step the
module's remap state and counts equal the reference bitwise, and its table, optimizer state
(reset with the rows given out), head, pooled values and loss equal the float64 twin. On one
device, with the rows split over 8 devices, and on a (data=2, model=4) mesh with the ids split
over data.
"""

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_dynamic_table import BAGS, INIT, KEY, LR_HEAD, OPTIMIZERS, H, Model, config, stream

import jaxembed
import jaxembed.flax
import jaxembed.nnx
from jaxembed.dynamic import keys as K
from jaxembed.dynamic.config import DynamicState, DynamicTableConfig
from jaxembed.nn.common import replicated_on


class Net(nnx.Module):
    def __init__(self, cfg, rngs, metadata=None):
        self.embed = jaxembed.nnx.DynamicEmbed(
            cfg, H, embedding_init=INIT, impl="xla", rngs=rngs,
            embedding_metadata=metadata or {},
        )  # fmt: skip
        context = jax.sharding.get_abstract_mesh()
        here = replicated_on(None if context.empty else context)  # where a restore puts it
        self.embed.reset_key.set_value(here(jax.random.key_data(KEY)))  # the twin's draws
        self.w = nnx.Param(jnp.linspace(-1, 1, H))
        self.b = nnx.Param(jnp.float32(0.25))

    def __call__(self, keys):
        return self.embed(keys).sum(-2)  # f[B, L, H] -> f[B, H]


def loss_fn(net, keys, y):
    pooled = net(keys)
    return jnp.mean((pooled @ net.w[...] + net.b[...] - y) ** 2), pooled


@nnx.jit
def train_step(net, dense, sparse, keys, y):
    (loss, pooled), grads = jaxembed.nnx.value_and_grad(loss_fn, has_aux=True)(net, keys, y)
    dense.update(net, grads.dense)
    sparse.update(net, grads)
    return loss, pooled


LAYOUTS = {
    "one device": None,
    "rows over 8": ((8,), ("model",), P("model", None), P()),
    "data x model": ((2, 4), ("data", "model"), P("model", None), P("data", None, None)),
}


def layout_of(layout):
    """(mesh, table spec, keys spec) of a LAYOUTS entry (None, None, None: one device)."""
    if LAYOUTS[layout] is None:
        return None, None, None
    shape, names, table_spec, keys_spec = LAYOUTS[layout]
    return jax.make_mesh(shape, names), table_spec, keys_spec


def nnx_trainer(cfg, opt, table_spec):
    """NNX: `(step(keys, y) -> (loss, pooled), view() -> the module's arrays)`."""
    metadata = {"out_sharding": tuple(table_spec)} if table_spec is not None else None
    net = Net(cfg, nnx.Rngs(0), metadata)
    dense = nnx.Optimizer(net, optax.sgd(LR_HEAD), wrt=jaxembed.nnx.DENSE)
    sparse = jaxembed.nnx.SparseOptimizer(net, opt)

    def view():
        e = net.embed
        return dict(state=e.remap.get_value(), stats=e.stats.get_value(),
                    step=e.step.get_value(), table=e.embedding[...], w=net.w[...],
                    slots=sparse.states["embed"].slots, module=net)  # fmt: skip

    return (lambda keys, y: train_step(net, dense, sparse, keys, y)), view


class LinenNet(linen.Module):
    cfg: DynamicTableConfig
    table_spec: tuple | None = None

    @linen.compact
    def __call__(self, keys):
        init = INIT if self.table_spec is None else linen.with_partitioning(INIT, self.table_spec)
        pooled = jaxembed.flax.DynamicEmbed(self.cfg, H, embedding_init=init, impl="xla",
                                            name="embed")(keys).sum(-2)  # fmt: skip
        w = self.param("w", lambda _: jnp.linspace(-1, 1, H))
        b = self.param("b", lambda _: jnp.float32(0.25))
        return pooled, pooled @ w + b


def linen_trainer(cfg, opt, table_spec, sample):
    """Linen: the same, with the "dynamic" collection carried beside the params."""
    model = LinenNet(cfg, None if table_spec is None else tuple(table_spec))
    variables = model.init(jax.random.key(0), sample)
    params, dyn = variables["params"], dict(variables["dynamic"])
    context = jax.sharding.get_abstract_mesh()
    here = replicated_on(None if context.empty else context)  # as init placed it: one compile
    dyn["embed"] = {**dyn["embed"], "reset_key": here(jax.random.key_data(KEY))}  # twin's draws

    def loss_fn(params, dyn, keys, y):
        (pooled, logits), upd = model.apply({"params": params, "dynamic": dyn}, keys,
                                            mutable=["dynamic"])  # fmt: skip
        return jnp.mean((logits - y) ** 2), (pooled, upd["dynamic"])

    y0 = jnp.zeros(sample.shape[0])
    tx = optax.masked(optax.sgd(LR_HEAD), jaxembed.flax.dense_mask(loss_fn, params, dyn,
                                                                   sample, y0))  # fmt: skip
    box = dict(
        params=params,
        dyn=dyn,
        opt_state=tx.init(params),
        sparse=jaxembed.flax.init_sparse(opt, loss_fn, params, dyn, sample, y0),
    )

    @jax.jit
    def step(params, dyn, opt_state, sparse, keys, y):
        (loss, (pooled, dyn)), grads = jaxembed.flax.value_and_grad(loss_fn, has_aux=True)(
            params, dyn, keys, y)  # fmt: skip
        updates, opt_state = tx.update(grads.dense, opt_state, params)
        params = optax.apply_updates(params, updates)
        params, sparse = jaxembed.flax.sparse_update(opt, sparse, params, grads)
        return params, dyn, opt_state, sparse, loss, pooled

    def run(keys, y):
        out = step(box["params"], box["dyn"], box["opt_state"], box["sparse"], keys, y)
        box.update(zip(("params", "dyn", "opt_state", "sparse"), out[:4], strict=True))
        return out[4:]

    def view():
        assert step._cache_size() == 1  # the step compiled once
        d, p = box["dyn"]["embed"], box["params"]
        table = p["embed"]["embedding"]
        table = table.value if isinstance(table, linen.Partitioned) else table
        return dict(state=d["remap"], stats=d["stats"], step=d["step"], table=table,
                    w=p["w"], slots=box["sparse"]["embed"].slots)  # fmt: skip

    return run, view


def train_and_check(policy, opt_name, layout, api="nnx"):
    cfg, opt = config(policy), OPTIMIZERS[opt_name]
    mesh, table_spec, keys_spec = layout_of(layout)
    with jax.set_mesh(mesh) if mesh is not None else _nothing():
        batches = []
        for ids, y in stream():
            keys = K.as_keys(ids, check=False)
            if mesh is not None:
                keys = jax.device_put(keys, NamedSharding(mesh, keys_spec))
            batches.append((ids, keys, y))
        if api == "nnx":
            step, view = nnx_trainer(cfg, opt, table_spec)
        else:
            step, view = linen_trainer(cfg, opt, table_spec, batches[0][1])
        twin = Model(cfg, opt_name)
        prev, totals = np.zeros((cfg.capacity, H)), np.zeros(6, int)
        for t, (ids, keys, y) in enumerate(batches):
            loss, pooled = step(keys, jnp.asarray(y))
            ref, want_pooled, want_loss = twin.step(ids, y, t)
            got = view()

            where = f"{api} {policy}/{opt_name}/{layout} step {t}"
            for name in DynamicState._fields:
                np.testing.assert_array_equal(getattr(got["state"], name),
                                              getattr(ref.state, name),
                                              err_msg=f"{where}: state.{name}")  # fmt: skip
            assert tuple(int(x) for x in got["stats"]) == tuple(ref.stats), where
            assert int(got["step"]) == t + 1, where
            np.testing.assert_allclose(pooled, want_pooled, rtol=1e-5, atol=1e-6, err_msg=where)
            np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=where)
            np.testing.assert_allclose(got["w"], twin.w, rtol=1e-5, atol=1e-6, err_msg=where)

            table = np.asarray(got["table"])
            acc = np.asarray(got["slots"]["accumulator"]) if opt_name == "adagrad" else None
            live = ~K.is_reserved(np.asarray(ref.state.keys))
            for r in np.flatnonzero(live):
                i = int(K.to_uint64(np.asarray(ref.state.keys)[r]))
                np.testing.assert_allclose(table[r], twin.emb[i], rtol=2e-5, atol=1e-6,
                                           err_msg=f"{where}: row {r}")  # fmt: skip
                if acc is not None:  # a row given to a new id started from a fresh state
                    np.testing.assert_allclose(acc[r], twin.acc[i], rtol=2e-5, err_msg=where)
            moved = set(ref.reset_rows) | set(ref.rows[ref.found].tolist())
            still = [r for r in range(cfg.capacity) if r not in moved]
            np.testing.assert_array_equal(table[still], prev[still], err_msg=where)
            assert (table[~live] == 0).all() and (acc is None or (acc[~live] == 0.1).all())
            prev = table
            totals += np.array(ref.stats)
            if mesh is not None:
                assert got["table"].sharding.spec == table_spec, where
                for slot in got["slots"].values():
                    assert slot.sharding.spec[0] == "model", where
        hits, admitted, evicted, refused, _, reserved = totals
        assert hits > 0 and admitted > 0 and evicted > 0 and reserved > 0, totals
        if policy == "ttl":
            assert refused > 0, totals
        return view, batches[-1][1]


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize(
    "policy,opt_name,layout",
    [("lru", "sgd", "one device"), ("lfu", "adagrad", "rows over 8"),
     ("ttl", "adagrad", "data x model")],
)  # fmt: skip
def test_the_nnx_module_trains_like_the_references(policy, opt_name, layout):
    train_and_check(policy, opt_name, layout, "nnx")


@pytest.mark.parametrize(
    "policy,opt_name,layout",
    [("lfu", "adagrad", "one device"), ("lru", "adagrad", "rows over 8")],
)  # fmt: skip
def test_the_linen_module_trains_like_the_references(policy, opt_name, layout):
    train_and_check(policy, opt_name, layout, "linen")


def test_eval_mode_reads_without_admitting_or_counting():
    view, keys = train_and_check("lru", "sgd", "one device")
    net = view()["module"]
    before = jax.tree.map(np.asarray, nnx.state(net))
    net.eval()
    out = net.embed(keys)  # eagerly: padding (EMPTY_ID) reads zeros
    after = jax.tree.map(np.asarray, nnx.state(net))
    jax.tree.map(np.testing.assert_array_equal, after, before)  # nothing admitted, counted
    cfg = net.embed.config
    rows = jaxembed.optim.dynamic.rows_for(cfg, net.embed.remap.get_value(), keys, impl="xla",
                                           check_ids=False)  # fmt: skip
    table = np.asarray(net.embed.embedding[...])
    want = np.where((np.asarray(rows) < cfg.capacity)[..., None],
                    table[np.minimum(np.asarray(rows), cfg.capacity - 1)], 0.0)  # fmt: skip
    np.testing.assert_array_equal(out, want)
    assert (np.asarray(rows) < cfg.capacity).any() and (np.asarray(rows) == cfg.capacity).any()
    net.train()
    assert net.embed.deterministic is False


def test_a_checkpointed_state_continues_bitwise():
    """nnx.split mid-stream, the state copied to host and merged back: the rest of the run
    equals the uninterrupted one (the remap state, step and key are in the model's state)."""
    cfg, opt = config("lfu"), OPTIMIZERS["adagrad"]

    def run(split_at):
        net = Net(cfg, nnx.Rngs(0))
        dense = nnx.Optimizer(net, optax.sgd(LR_HEAD), wrt=jaxembed.nnx.DENSE)
        sparse = jaxembed.nnx.SparseOptimizer(net, opt)
        for t, (ids, y) in enumerate(stream()):
            if t == split_at:
                graph, state = nnx.split((net, dense, sparse))
                state = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), state)
                net, dense, sparse = nnx.merge(graph, state)
            train_step(net, dense, sparse, K.as_keys(ids, check=False), jnp.asarray(y))
        return jax.tree.map(np.asarray, nnx.state((net, sparse)))

    jax.tree.map(np.testing.assert_array_equal, run(3), run(None))


def test_hostile_construction_and_ids():
    cfg = DynamicTableConfig(capacity=16, bucket_size=2)
    with pytest.raises(TypeError, match="DynamicTableConfig"):
        jaxembed.nnx.DynamicEmbed({"capacity": 16}, H, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="impl='gpu'"):
        jaxembed.nnx.DynamicEmbed(cfg, H, impl="gpu", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="hidden=0"):
        jaxembed.nnx.DynamicEmbed(cfg, 0, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="embedding_init"):
        jaxembed.nnx.DynamicEmbed(cfg, H, embedding_init="normal", rngs=nnx.Rngs(0))
    net = jaxembed.nnx.DynamicEmbed(cfg, H, rngs=nnx.Rngs(0))
    call = nnx.jit(lambda m, i: m(i))
    with pytest.raises(TypeError, match="float"):
        call(net, jnp.ones((BAGS, 2), jnp.float32))
    for shape in [(BAGS, 3), (BAGS, 2), (2, 3)]:  # int64 ids narrowed to int32 by jit
        narrowed = np.arange(np.prod(shape), dtype=np.int64).reshape(shape) + 2**40
        with pytest.raises(TypeError, match=r"jaxembed.nnx.DynamicEmbed's ids are int32 of "
                                            r"shape .*jax.jit narrows .*as_keys\(ids\)"):  # fmt: skip
            call(net, narrowed)
    assert int(net.step.get_value()) == 0  # a refused call changed nothing
    with pytest.raises(ValueError, match="does not divide"):
        with jax.set_mesh(jax.make_mesh((8,), ("model",))):
            jaxembed.nnx.DynamicEmbed(
                DynamicTableConfig(capacity=12, bucket_size=4),
                H,
                rngs=nnx.Rngs(0),
                embedding_metadata={"out_sharding": ("model", None)},
            )


def test_linen_eval_reads_and_a_training_call_needs_the_mutable_collection():
    cfg = DynamicTableConfig(capacity=16, bucket_size=2)
    model = jaxembed.flax.DynamicEmbed(cfg, H, impl="xla")
    keys = K.as_keys(np.array([[5, 6], [5, -1]], np.int64), check=False)
    variables = model.init(jax.random.key(0), keys)
    assert int(variables["dynamic"]["step"]) == 0  # init admits nothing
    assert (np.asarray(variables["params"]["embedding"]) == 0).all()
    out, upd = jax.jit(lambda v, k: model.apply(v, k, mutable=["dynamic"]))(variables, keys)
    assert int(upd["dynamic"]["stats"].admitted) == 2 and int(upd["dynamic"]["step"]) == 1
    assert (np.asarray(out[1, 1]) == 0).all()  # padding reads zeros
    # read-only: the same rows, nothing admitted (the params were not reset: apply keeps
    # no write, so the table is still zeros here; sparse_update writes the reset rows)
    again = {"params": variables["params"], "dynamic": upd["dynamic"]}
    rows = jaxembed.optim.dynamic.rows_for(cfg, upd["dynamic"]["remap"], keys, check_ids=False)
    ro = model.apply(again, keys, deterministic=True)
    assert ro.shape == (2, 2, H) and (np.asarray(rows)[0] < cfg.capacity).all()
    with pytest.raises(ValueError, match="mutable=\\['dynamic'\\]"):
        model.apply(variables, keys)


# With the rows over 8 devices, where the reset rows are each shard's (one device's steps run
# the same functions unsplit, in every module test here).
@pytest.mark.parametrize("layout", ["rows over 8"])
def test_remap_then_reset_gives_prepares_bits(layout):
    """`remap_table` + `reset_optimizer_rows` == `prepare`, and `reset_table_rows` on the
    table before the step == the table `remap_table` reset: what the modules rely on."""
    D = jaxembed.optim.dynamic
    cfg, opt = config("lfu"), jaxembed.optim.adam(0.1)
    mesh, table_spec, _ = layout_of(layout)
    dyn = D.init_table(cfg, H, mesh=mesh, weight_spec=table_spec)
    state = opt.init(dyn.table)
    for t, (ids, _y) in enumerate(stream()):
        keys = K.as_keys(ids, check=False)
        common = dict(initializer=INIT, key=KEY, impl="xla", check_ids=False)
        want_rows, want_dyn, want_state, want_stats = D.prepare(
            cfg, dyn, state, keys, t, optimizer=opt, **common
        )
        rows, got_dyn, reset, stats = D.remap_table(cfg, dyn, keys, t, **common)
        got_state = D.reset_optimizer_rows(cfg, got_dyn.table, opt, state, reset)
        table, state2 = D.reset_table_rows(cfg, dyn.table, opt, state, reset, t,
                                           initializer=INIT, key=KEY)  # fmt: skip
        for got in (got_dyn.table, table):
            np.testing.assert_array_equal(got, want_dyn.table)
        for got in (got_state, state2):
            jax.tree.map(np.testing.assert_array_equal, got, want_state)
        np.testing.assert_array_equal(rows, want_rows)
        assert tuple(map(int, stats)) == tuple(map(int, want_stats))
        assert (np.asarray(reset)[: int(stats.admitted)] < cfg.capacity).all()
        if mesh is not None:
            assert table.sharding.spec == table_spec and got_state.slots["mu"].sharding.spec[0]
        # the next step starts from prepare's, with some moments to reset
        dyn = want_dyn._replace(table=want_dyn.table + 0.5)
        state = jax.tree.map(lambda a: a + 1 if a.ndim else a, want_state)
    with pytest.raises(TypeError, match="reset_rows must be the int32"):
        D.reset_optimizer_rows(cfg, dyn.table, opt, state, np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="int64"):  # row numbers are never narrowed
        D.reset_optimizer_rows(cfg, dyn.table, opt, state, np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="1-D"):
        D.reset_optimizer_rows(cfg, dyn.table, opt, state, np.zeros((2, 3), np.int32))
    with pytest.raises(TypeError, match="RowSparseOptimizer"):
        D.reset_optimizer_rows(cfg, dyn.table, None, state, np.zeros(3, np.int32))


def test_orbax_restores_a_dynamic_module_onto_another_mesh_and_it_continues(tmp_path):
    """Three steps on (data=2, model=4), an orbax checkpoint of the model and the sparse
    optimizer (table, remap state, step, reset key, accumulators), restored into a model
    built on 8 devices (rows over 8), three more steps: the remap state and counts equal the
    uninterrupted run's bitwise, the table and accumulators to float32 rounding."""
    import orbax.checkpoint as ocp

    cfg, opt = config("lfu"), OPTIMIZERS["adagrad"]
    batches = [(K.as_keys(ids, check=False), jnp.asarray(y)) for ids, y in stream()]

    def build(mesh):
        net = Net(cfg, nnx.Rngs(0), {"out_sharding": ("model", None)})
        dense = nnx.Optimizer(net, optax.sgd(LR_HEAD), wrt=jaxembed.nnx.DENSE)
        return net, dense, jaxembed.nnx.SparseOptimizer(net, opt)

    first = jax.make_mesh((2, 4), ("data", "model"))
    with jax.set_mesh(first):
        net, dense, sparse = build(first)
        for keys, y in batches[:3]:
            train_step(net, dense, sparse, keys, y)
        path = ocp.test_utils.erase_and_create_empty(tmp_path / "ckpt")
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(path / "state", {"model": nnx.state((net, dense)),
                                       "sparse": dict(sparse.states)})  # fmt: skip
        for keys, y in batches[3:]:  # the uninterrupted run
            train_step(net, dense, sparse, keys, y)
        want = jax.tree.map(np.asarray, nnx.state((net, sparse)))
    other = jax.make_mesh((8,), ("model",))
    with jax.set_mesh(other):
        net2, dense2, sparse2 = build(other)
        target = {"model": nnx.state((net2, dense2)), "sparse": dict(sparse2.states)}
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        with ocp.StandardCheckpointer() as ckpt:
            restored = ckpt.restore(path / "state", target)
        nnx.update((net2, dense2), restored["model"])
        sparse2.states = nnx.data(restored["sparse"])  # RowSparseStates: no nnx.update
        assert net2.embed.embedding[...].sharding.spec == P("model", None)
        assert int(net2.embed.step.get_value()) == 3
        for keys, y in batches[3:]:
            train_step(net2, dense2, sparse2, keys, y)
        got = jax.tree.map(np.asarray, nnx.state((net2, sparse2)))
    got, want = (jax.tree_util.tree_leaves_with_path(x) for x in (got, want))
    assert [p for p, _ in got] == [p for p, _ in want]
    for (path, a), (_, b) in zip(got, want, strict=True):
        if np.issubdtype(a.dtype, np.integer):  # the remap state, step, key, counts: bitwise
            np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
        else:
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7,
                                       err_msg=jax.tree_util.keystr(path))  # fmt: skip
