"""A dynamic table in a collection (`TableConfig(dynamic=...)`,
`jaxembed.optim.dynamic_collection.prepare`) trained beside a static table, against the
pure-Python remap and a float64 twin.

The collection: a dynamic "user" table read by two features (a history bag of 3 and the
current user, one id), a static "item" table read by one bag feature; a linear head on the
three pooled outputs, a squared loss, adagrad on the tables (`collection_update`). Six steps on
a drifting stream. After every step the user table's remap state and counts equal the
reference (both features remapped in order with the same step) bitwise, and the outputs, the
loss, every live user row, its accumulator and the item table equal the twin. On one device,
with the user table's rows over 8 devices, and (the functional path) replicated on 8; placed
"table", in `test_dynamic_tablewise.py`. The planner counts the remap's
state and places a dynamic table only "rows" or "replicated"; bad configs raise.
"""

import contextlib
import dataclasses

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from test_dynamic_table import BAGS, INIT, KEY, LR, LR_HEAD, SPREAD, H, config

import jaxembed
import jaxembed.flax
import jaxembed.nnx
from jaxembed.collection import FeatureConfig, TableConfig, layout_collection
from jaxembed.dynamic import keys as K
from jaxembed.dynamic import reference as R
from jaxembed.dynamic.config import DynamicState, DynamicTableConfig
from jaxembed.kernels.collection import collection_lookup, collection_update
from jaxembed.nn.common import replicated_on
from jaxembed.nn.stacks import build_stack, unstack
from jaxembed.optim import dynamic_collection as DC
from jaxembed.plan.specs import format_bytes

ITEMS, STEPS = 12, 6
ITEM_INIT = np.random.default_rng(5).normal(size=(ITEMS, H)).astype(np.float32)
FEATURES = (
    FeatureConfig("user_hist", "user", combiner="sum", max_ids=3),
    FeatureConfig("user_now", "user", combiner="sum", max_ids=1),
    FeatureConfig("item", "item", combiner="sum", max_ids=2),
)
OPT = jaxembed.optim.adagrad(LR)


def tables(placement, cfg):
    """The item table beside the user table: by rows, or as the user table is placed when
    that is "replicated" or "table" (then the two share a table-wise stack)."""
    item = placement if placement in ("replicated", "table") else "rows"
    return [
        TableConfig("item", ITEMS, H, placement=item),
        TableConfig("user", cfg.capacity, H, placement=placement, dynamic=cfg, initializer=INIT),
    ]


def stream(seed=1):
    rng = np.random.default_rng(seed)
    for t in range(STEPS):
        raw = (3 * t + rng.integers(0, 14, (BAGS, 4))).astype(np.uint64)
        ids = (raw * SPREAD).view(np.int64)
        ids[rng.random((BAGS, 4)) < 0.15] = -1
        items = rng.integers(-1, ITEMS, (BAGS, 2)).astype(np.int32)
        yield {"user_hist": ids[:, :3], "user_now": ids[:, 3:], "item": items}, rng.normal(
            size=(BAGS,)).astype(np.float32)  # fmt: skip


class Twin:
    """float64: a dict id -> (row, accumulator) for the users, a dense item table."""

    def __init__(self, cfg, user_index):
        self.cfg, self.state = cfg, R.init_state(cfg)
        self.key = jax.random.fold_in(KEY, user_index)
        self.emb, self.acc = {}, {}
        self.items, self.item_acc = ITEM_INIT.astype(np.float64), np.full((ITEMS, H), 0.1)
        self.w, self.b = np.linspace(-1, 1, 3 * H), 0.25

    def init_row(self, t, row):
        k = jax.random.fold_in(jax.random.fold_in(self.key, t), row)
        return np.asarray(INIT(k, (1, H), jnp.float32)[0], np.float64)

    def step(self, batch, y, t):
        refs, flats = [], {}
        for name in ("user_hist", "user_now"):
            ref = R.step(self.cfg, self.state, batch[name], t)
            for row, new, old in zip(ref.reset_rows, ref.admitted, ref.evicted, strict=True):
                if old is not None:
                    del self.emb[old], self.acc[old]
                self.emb[new], self.acc[new] = self.init_row(t, row), np.full(H, 0.1)
            self.state = ref.state
            flat = K.to_uint64(K.keys_to_host(batch[name], check=False)).tolist()
            flats[name] = np.array(flat, dtype=object).reshape(batch[name].shape)
            refs.append(ref)
        # an id reads the row it had when its feature was remapped: one the second feature
        # admits is no row for the first (its slot reads zeros and gets no gradient)
        found = {n: r.found for n, r in zip(flats, refs, strict=True)}
        for n, flat in flats.items():
            flats[n] = np.where(found[n], flat, None)
        vec = lambda i: self.emb[i] if i is not None else np.zeros(H)
        outs = {n: np.array([sum(vec(i) for i in bag) for bag in flats[n]]) for n in flats}
        outs["item"] = np.array([sum(self.items[i] for i in bag if i >= 0) + np.zeros(H)
                                 for bag in batch["item"]])  # fmt: skip
        x = np.concatenate([outs[f.name] for f in FEATURES], 1)
        logits = x @ self.w + self.b
        loss = np.mean((logits - y) ** 2)
        d = 2 * (logits - y) / len(y)
        g = {f.name: (d[:, None] * self.w[None, :])[:, i * H : (i + 1) * H]
             for i, f in enumerate(FEATURES)}  # fmt: skip
        grads, item_grads = {}, {}
        for name, flat in flats.items():
            for b, bag in enumerate(flat):
                for i in bag:
                    if i is not None:
                        grads[i] = grads.get(i, 0) + g[name][b]
        for b, bag in enumerate(batch["item"]):
            for i in bag:
                if i >= 0:
                    item_grads[int(i)] = item_grads.get(int(i), 0) + g["item"][b]
        for i, gi in grads.items():
            self.acc[i] = self.acc[i] + gi * gi
            self.emb[i] = self.emb[i] - LR * gi / np.sqrt(self.acc[i] + 1e-7)
        for i, gi in item_grads.items():
            self.item_acc[i] += gi * gi
            self.items[i] -= LR * gi / np.sqrt(self.item_acc[i] + 1e-7)
        self.w, self.b = self.w - LR_HEAD * x.T @ d, self.b - LR_HEAD * d.sum()
        return refs, outs, loss


def check_user_rows(twin, table, state, where, rows_at=None):
    """Every live user row and its accumulator equal the twin's (the user stack's rows are
    the remap's rows; in a table-wise stack, from `rows_at` on)."""
    table, acc = np.asarray(table), np.asarray(state.slots["accumulator"])
    if rows_at is not None:
        table, acc = table[rows_at:], acc[rows_at:]
    live = ~K.is_reserved(np.asarray(twin.state.keys))
    for r in np.flatnonzero(live):
        i = int(K.to_uint64(np.asarray(twin.state.keys)[r]))
        np.testing.assert_allclose(table[r], twin.emb[i], rtol=2e-5, atol=1e-6,
                                   err_msg=f"{where}: user row {r}")  # fmt: skip
        np.testing.assert_allclose(acc[r], twin.acc[i], rtol=2e-5, err_msg=where)


def make_step(layout, mesh):
    def step(stacks, states, remaps, head, batch, y, t):
        batch, stacks, states, remaps, stats = DC.prepare(
            layout, stacks, states, remaps, batch, t, key=KEY, optimizer=OPT, impl="xla",
            mesh=mesh,
        )  # fmt: skip
        outs = collection_lookup(layout, stacks, batch, mesh=mesh)

        def loss_fn(head, outs):
            x = jnp.concatenate([outs[f.name] for f in FEATURES], 1)
            return jnp.mean((x @ head["w"] + head["b"] - y) ** 2)

        loss, (g_head, g_outs) = jax.value_and_grad(loss_fn, (0, 1))(head, outs)
        stacks, states = collection_update(layout, OPT, stacks, states, batch, g_outs, mesh=mesh)
        head = jax.tree.map(lambda p, g: p - LR_HEAD * g, head, g_head)
        return stacks, states, remaps, head, loss, stats, outs

    return jax.jit(step)


def initial_head(mesh):
    """The head's weights, replicated on the mesh as the step returns them (else the step's
    second call sees another layout and compiles again)."""
    here = replicated_on(mesh)
    return {"w": here(jnp.linspace(-1, 1, 3 * H)), "b": here(jnp.float32(0.25))}


def initial_stacks(layout, cfg):
    """Each stack: the item table's initial rows, the user table's zeros."""
    return {s.index: build_stack(layout, s, {"item": ITEM_INIT,
                                             "user": np.zeros((cfg.capacity, H), np.float32)})
            for s in layout.stacks}  # fmt: skip


# Placed "table" (whole on one device, in a table-wise stack beside static tables), the
# functional path and both modules train like the references in tests/test_dynamic_tablewise.py.
@pytest.mark.parametrize("placement,devices", [("rows", 1), ("rows", 8), ("replicated", 8)])
def test_a_dynamic_table_in_a_collection_trains_like_the_references(placement, devices):
    cfg = config("lfu")
    mesh = jax.make_mesh((8,), ("model",)) if devices == 8 else None
    layout = layout_collection(tables(placement, cfg), FEATURES, mesh)
    user, rows_at = layout.stack_of("user"), DC.table_rows_at(layout, "user")
    assert user.tables == ("user",) and user.shape == (cfg.capacity, H) and rows_at is None
    stacks = initial_stacks(layout, cfg)
    for s in layout.stacks:
        if mesh is not None:
            stacks[s.index] = jax.device_put(stacks[s.index], NamedSharding(mesh, s.spec))
    states = {s.index: OPT.init(stacks[s.index], mesh=mesh, weight_spec=s.spec)
              for s in layout.stacks}  # fmt: skip
    remaps = DC.init_states(layout, mesh=mesh)
    head = initial_head(mesh)
    twin = Twin(cfg, [t.name for t in layout.tables].index("user"))
    step, totals = make_step(layout, mesh), np.zeros(6, int)
    for t, (raw, y) in enumerate(stream()):
        batch = {n: K.as_keys(v, check=False) if n != "item" else jnp.asarray(v)
                 for n, v in raw.items()}  # fmt: skip
        stacks, states, remaps, head, loss, stats, outs = step(
            stacks, states, remaps, head, batch, jnp.asarray(y), jnp.int32(t)
        )
        refs, want_outs, want_loss = twin.step(raw, y, t)
        where = f"{placement}/{devices} step {t}"
        for name in DynamicState._fields:
            np.testing.assert_array_equal(
                getattr(remaps["user"], name), getattr(twin.state, name), err_msg=where
            )
        want_stats = np.sum([np.array(r.stats) for r in refs], 0)
        np.testing.assert_array_equal([int(x) for x in stats["user"]], want_stats, where)
        for f in FEATURES:
            np.testing.assert_allclose(outs[f.name], want_outs[f.name], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{where}: {f.name}")  # fmt: skip
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=where)
        check_user_rows(twin, stacks[user.index], states[user.index], where, rows_at)
        item_stack = layout.stack_of("item").index
        items = unstack(layout, {item_stack: stacks[item_stack]})["item"]
        np.testing.assert_allclose(items, twin.items, rtol=2e-5, atol=1e-6, err_msg=where)
        if mesh is not None:
            assert stacks[user.index].sharding.spec == user.spec, where
        totals += want_stats
    hits, admitted, evicted, _, pending, _ = totals
    assert hits > 0 and admitted > 0 and evicted > 0 and pending > 0, totals


def test_the_planner_counts_the_remap_state_and_places_rows_table_or_replicated():
    cfg = DynamicTableConfig(capacity=1 << 16, bucket_size=16, admit_after=2)
    mesh = jax.make_mesh((8,), ("model",))
    tabs = [TableConfig("user", cfg.capacity, 32, dynamic=cfg),
            TableConfig("user_static", cfg.capacity, 32)]  # fmt: skip
    feats = [FeatureConfig("u", "user", max_ids=1), FeatureConfig("v", "user_static", max_ids=1)]
    plan = jaxembed.plan_collection(tabs, feats, mesh, batch_size=512,
                                    memory_per_device="1GiB", backend="cpu")  # fmt: skip
    assert plan.placements["user"] in ("rows", "table", "replicated")
    by = {t.name: t for t in plan.tables}
    if plan.placements["user"] == plan.placements["user_static"]:  # the same rows, + state
        n = 8 if plan.placements["user"] == "rows" else 1  # the state splits with the rows
        extra = by["user"].memory_bytes - by["user_static"].memory_bytes
        assert extra == cfg.shard(n).state_bytes, (plan.placements, extra)
        assert f"+ {format_bytes(cfg.shard(n).state_bytes)} remap state a device" in by[
            "user"].reason  # fmt: skip
    # both on "rows": the dynamic one holds an eighth of the remap state more
    fixed = [TableConfig("user", cfg.capacity, 32, placement="rows", dynamic=cfg),
             TableConfig("user_static", cfg.capacity, 32, placement="rows")]  # fmt: skip
    rows = jaxembed.plan_collection(fixed, feats, mesh, batch_size=512,
                                    memory_per_device="1GiB", backend="cpu")  # fmt: skip
    by = {t.name: t for t in rows.tables}
    shard = cfg.shard(8)  # an eighth of the keys, last_seen, counts and sketch; the total whole
    assert shard.state_bytes == (cfg.state_bytes - 4) // 8 + 4
    assert by["user"].memory_bytes - by["user_static"].memory_bytes == shard.state_bytes
    # both "table": the dynamic one's device holds its rows, and every device the whole state
    tablewise = [dataclasses.replace(t, placement="table") for t in fixed]
    whole = jaxembed.plan_collection(tablewise, feats, mesh, batch_size=512,
                                     memory_per_device="1GiB", backend="cpu")  # fmt: skip
    by = {t.name: t for t in whole.tables}
    assert whole.placements == {"user": "table", "user_static": "table"}
    assert by["user"].memory_bytes - by["user_static"].memory_bytes == cfg.state_bytes
    assert f"+ {format_bytes(cfg.state_bytes)} remap state a device" in by["user"].reason
    # no layout with too little memory for the remap state's shard
    with pytest.raises(ValueError, match="memory_per_device"):
        jaxembed.plan_collection(tabs[:1], feats[:1], mesh, batch_size=512,
                                 memory_per_device=shard.state_bytes, backend="cpu")  # fmt: skip


def test_bad_dynamic_configs_name_the_value_and_the_fix():
    cfg = DynamicTableConfig(capacity=16, bucket_size=2)
    with pytest.raises(ValueError, match="vocab_size=16"):
        TableConfig("user", 20, H, dynamic=cfg)
    with pytest.raises(ValueError, match="placement='columns'"):
        TableConfig("user", 16, H, placement="columns", dynamic=cfg)
    with pytest.raises(ValueError, match="row_sharding='block'"):
        TableConfig("user", 16, H, placement="rows", row_sharding="mod", dynamic=cfg)
    # "auto" is the planner's choice, which for a dynamic table is always block rows
    TableConfig("user", 16, H, placement="rows", row_sharding="auto", dynamic=cfg)
    with pytest.raises(TypeError, match="DynamicTableConfig"):
        TableConfig("user", 16, H, dynamic={"capacity": 16})
    odd = DynamicTableConfig(capacity=12, bucket_size=4)
    with pytest.raises(ValueError, match="capacity=32 \\(a multiple of 32\\)"):
        layout_collection(
            [TableConfig("user", 12, H, placement="rows", dynamic=odd)],
            [FeatureConfig("u", "user")],
            jax.make_mesh((8,), ("model",)),
        )
    with pytest.raises(ValueError, match="'rows', 'table' or 'replicated'"):
        layout_collection(
            [TableConfig("user", 16, H, dynamic=cfg)],
            [FeatureConfig("u", "user")],
            jax.make_mesh((8,), ("model",)),
            placements={"user": "columns"},
        )
    layout = layout_collection([TableConfig("user", 16, H, dynamic=cfg)],
                               [FeatureConfig("u", "user")], None)  # fmt: skip
    stacks = {0: jnp.zeros((16, H))}
    with pytest.raises(KeyError, match="init_states"):
        DC.prepare(layout, stacks, None, {}, {"u": np.array([1, 2], np.int64)}, 0,
                   key=KEY, optimizer=None)  # fmt: skip
    ragged = jaxembed.Ragged.from_lists([[1], [2, 3]])
    with pytest.raises(TypeError, match="RaggedKeys"):
        DC.prepare(layout, stacks, None, DC.init_states(layout), {"u": ragged}, 0, key=KEY,
                   optimizer=None)  # fmt: skip


def test_jaxembed_plan_reads_dynamic_tables(tmp_path, capsys):
    from jaxembed import cli

    spec = {"tables": [{"name": "item", "vocab_size": 100000, "dim": 32},
                       {"name": "user", "dim": 32, "dynamic": {"capacity": 1 << 16,
                        "bucket_size": 16, "admit_after": 2, "policy": "lfu"}}],
            "features": [{"name": "clicked", "table": "item", "max_ids": 8},
                         {"name": "user", "table": "user"}]}  # fmt: skip
    path = tmp_path / "tables.json"
    path.write_text(__import__("json").dumps(spec))
    argv = ["plan", "--tables", str(path), "--mesh", "model=8", "--batch", "1024",
            "--memory", "1GiB"]  # fmt: skip
    assert cli.main(argv) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("user"))
    assert "65536 x 32" in line and "dynamic (lfu, admit after 2)" in line, line
    assert line.split()[4] in ("rows", "table", "replicated"), line
    spec["tables"][1]["dynamic"]["policy"] = "fifo"
    path.write_text(__import__("json").dumps(spec))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "tables[1]" in err and "fifo" in err, err


class LinenNet(linen.Module):
    layout_tables: tuple

    @linen.compact
    def __call__(self, batch):
        coll = jaxembed.flax.EmbeddingBagCollection(self.layout_tables, FEATURES, name="coll")
        w = self.param("w", lambda _: jnp.linspace(-1, 1, 3 * H))
        b = self.param("b", lambda _: jnp.float32(0.25))
        return coll.concat(coll(batch)) @ w + b


MODULE_CASES = [("rows", 1), ("rows", 8)]


@pytest.mark.parametrize("placement,devices", MODULE_CASES)
def test_the_linen_collection_trains_a_dynamic_table_like_the_references(placement, devices):
    cfg = config("lfu")
    mesh = jax.make_mesh((8,), ("model",)) if devices == 8 else None
    model = LinenNet(tuple(tables(placement, cfg)))
    batches = [({n: K.as_keys(v, check=False) if n != "item" else jnp.asarray(v)
                 for n, v in raw.items()}, raw, y) for raw, y in stream()]  # fmt: skip
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        variables = model.init(jax.random.key(0), batches[0][0])
        params, dyn = variables["params"], dict(variables["dynamic"]["coll"])
        layout = jaxembed.flax.EmbeddingBagCollection(tuple(tables(placement, cfg)), FEATURES,
                                                      mesh=mesh).layout  # fmt: skip
        user, item = layout.stack_of("user"), layout.stack_of("item")
        rows_at = DC.table_rows_at(layout, "user")
        box = params["coll"][item.name]
        item_stack = initial_stacks(layout, cfg)[item.index]
        if mesh is not None:
            item_stack = jax.device_put(item_stack, NamedSharding(mesh, item.spec))
        item_stack = jnp.asarray(item_stack)  # a jax array, as the step returns it
        params = {
            **params,
            "coll": {
                **params["coll"],
                item.name: box.replace_boxed(item_stack)
                if isinstance(box, linen.Partitioned)
                else item_stack,
            },
        }
        key = jax.random.key_data(KEY)  # on one device uncommitted, as init made the rest
        dyn["reset_key"] = key if mesh is None else jax.device_put(key, dyn["reset_key"].sharding)
        users = np.asarray(unbox(params["coll"][user.name]))[rows_at or 0 :][: cfg.capacity]
        assert int(dyn["step"]) == 0 and (users == 0).all()  # rows start at admission

        def loss_fn(params, dyn, batch, y):
            out, upd = model.apply({"params": params, "dynamic": {"coll": dyn}}, batch,
                                   mutable=["dynamic"])  # fmt: skip
            return jnp.mean((out - y) ** 2), upd["dynamic"]["coll"]

        y0 = jnp.zeros(BAGS)
        mask = jaxembed.flax.dense_mask(loss_fn, params, dyn, batches[0][0], y0)
        tx = optax.masked(optax.sgd(LR_HEAD), mask)
        opt_state = tx.init(params)
        sparse = jaxembed.flax.init_sparse(OPT, loss_fn, params, dyn, batches[0][0], y0)

        @jax.jit
        def step(params, dyn, opt_state, sparse, batch, y):
            (loss, dyn), grads = jaxembed.flax.value_and_grad(loss_fn, has_aux=True)(
                params, dyn, batch, y)  # fmt: skip
            updates, opt_state = tx.update(grads.dense, opt_state, params)
            params = optax.apply_updates(params, updates)
            params, sparse = jaxembed.flax.sparse_update(OPT, sparse, params, grads)
            return params, dyn, opt_state, sparse, loss

        twin = Twin(cfg, [t.name for t in layout.tables].index("user"))
        for t, (batch, raw, y) in enumerate(batches):
            params, dyn, opt_state, sparse, loss = step(params, dyn, opt_state, sparse, batch,
                                                        jnp.asarray(y))  # fmt: skip
            refs, _, want_loss = twin.step(raw, y, t)
            where = f"linen {placement}/{devices} step {t}"
            for name in DynamicState._fields:
                np.testing.assert_array_equal(
                    getattr(dyn["remap_user"], name), getattr(twin.state, name), err_msg=where
                )
            want_stats = np.sum([np.array(r.stats) for r in refs], 0)
            np.testing.assert_array_equal([int(x) for x in dyn["stats_user"]], want_stats, where)
            np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=where)
            check_user_rows(twin, unbox(params["coll"][user.name]), sparse["coll"][user.index],
                            where, rows_at)  # fmt: skip
            items = unstack(layout, {item.index: unbox(params["coll"][item.name])})["item"]
            np.testing.assert_allclose(items, twin.items, rtol=2e-5, atol=1e-6, err_msg=where)
        assert step._cache_size() == 1  # init lays the dynamic state out as the step returns it
        # a training call without the mutable collection is refused, naming it
        with pytest.raises(ValueError, match=r"mutable=\['dynamic'\]"):
            model.apply({"params": params, "dynamic": {"coll": dyn}}, batches[0][0])


def unbox(x):
    return x.value if isinstance(x, linen.Partitioned) else x


class Net(nnx.Module):
    """The twin's model as an NNX collection: the two tables, the head on the three outputs."""

    def __init__(self, layout_tables, mesh):
        self.coll = jaxembed.nnx.EmbeddingBagCollection(layout_tables, FEATURES, mesh=mesh,
                                                        rngs=nnx.Rngs(0))  # fmt: skip
        self.coll.load_tables({"item": ITEM_INIT, "user": np.zeros((16, H), np.float32)})
        # the reset key and the head replicated on the mesh, as the step returns them (else
        # the first step's inputs differ from the next ones', and the step compiles twice)
        here = replicated_on(mesh)
        self.coll.reset_key.set_value(here(jax.random.key_data(KEY)))
        self.w = nnx.Param(here(jnp.linspace(-1, 1, 3 * H)))
        self.b = nnx.Param(here(jnp.float32(0.25)))

    def __call__(self, batch):
        return self.coll.concat(self.coll(batch)) @ self.w[...] + self.b[...]


def head_optimizer(net, mesh):
    """SGD on the dense parameters, its step counter replicated on the mesh (as the step
    returns it: the first step's inputs are then the next ones', and the step compiles once)."""
    dense = nnx.Optimizer(net, optax.sgd(LR_HEAD), wrt=jaxembed.nnx.DENSE)
    dense.step.set_value(replicated_on(mesh)(dense.step.get_value()))
    return dense


@nnx.jit
def nnx_step(net, dense, sparse, batch, y):
    def loss_fn(net):
        return jnp.mean((net(batch) - y) ** 2)

    loss, grads = jaxembed.nnx.value_and_grad(loss_fn)(net)
    dense.update(net, grads.dense)
    sparse.update(net, grads)
    return loss


@pytest.mark.parametrize("placement,devices", MODULE_CASES)
def test_the_nnx_collection_trains_a_dynamic_table_like_the_references(placement, devices):
    cfg = config("lfu")
    mesh = jax.make_mesh((8,), ("model",)) if devices == 8 else None
    net = Net(tables(placement, cfg), mesh)
    layout = net.coll.layout
    dense = head_optimizer(net, mesh)
    sparse = jaxembed.nnx.SparseOptimizer(net, OPT)
    twin = Twin(cfg, [t.name for t in layout.tables].index("user"))
    user = layout.stack_of("user")
    for t, (raw, y) in enumerate(stream()):
        batch = {n: K.as_keys(v, check=False) if n != "item" else jnp.asarray(v)
                 for n, v in raw.items()}  # fmt: skip
        loss = nnx_step(net, dense, sparse, batch, jnp.asarray(y))
        refs, _, want_loss = twin.step(raw, y, t)
        where = f"nnx {placement}/{devices} step {t}"
        for name in DynamicState._fields:
            np.testing.assert_array_equal(
                getattr(net.coll.remaps["user"].get_value(), name),
                getattr(twin.state, name),
                err_msg=where,
            )
        want_stats = np.sum([np.array(r.stats) for r in refs], 0)
        got_stats = [int(x) for x in net.coll.remap_stats["user"].get_value()]
        np.testing.assert_array_equal(got_stats, want_stats, where)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=where)
        check_user_rows(twin, net.coll.stacks[user.name][...], sparse.states["coll"][user.index],
                        where, DC.table_rows_at(layout, "user"))  # fmt: skip
        np.testing.assert_allclose(net.coll.tables()["item"], twin.items, rtol=2e-5, atol=1e-6,
                                   err_msg=where)  # fmt: skip
        if mesh is not None:
            assert net.coll.stacks[user.name][...].sharding.spec == user.spec, where
    # evaluation reads, and changes nothing
    before = jax.tree.map(np.asarray, nnx.state(net.coll))
    net.eval()
    out = net.coll(batch)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, nnx.state(net.coll)),
                 before)  # fmt: skip
    assert out["user_hist"].shape == (BAGS, H)
