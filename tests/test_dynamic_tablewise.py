"""Dynamic tables placed `"table"` in a collection: several in one stack, beside static tables.

The collection: a static "item" table by rows and, in the same stack (same dim, dtype and row
axes), a static table-wise "shop" table and two dynamic table-wise tables, "user" (lfu with a
count-min admission, read by two features) and "page" (lru, a mean bag). Each table-wise table
is whole on its own shard, after item's rows there, so each dynamic table's rows are rows
`[base, base + capacity)` of the stack with base = its shard's first row + its offset, and its
remap state is whole on every device. Six steps on a drifting stream too large for the tables
(ids admitted, evicted, refused, pending), the batch split over the devices. After every step:

* each dynamic table's remap state, the step's counts and the rows given to the batch equal
  the pure-Python policy (`jaxembed.dynamic.reference`) bitwise, features remapped in order;
* the outputs, the loss, every table's rows and adagrad accumulators equal a float64 twin
  (a dynamic table's rows reset from `fold_in(fold_in(fold_in(key, i), t), row)`); rows never
  handed out, and the stack's rows that hold no table, are bitwise as they started;
* the stacks keep their layout and the remap states stay whole on every device.

On 8 devices and on one (where every table is replicated and each dynamic table gets a stack
of its own); the NNX and Linen collections train the same model on 8 devices like the twin.
The planner places small dynamic tables `"table"` under `"auto"` and counts each device's
memory exactly (its rows on the owner, the whole remap state on every device); `jaxembed
plan` prints it; placements that cannot work are refused, naming the value and the fix.
"""

import json

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_dynamic_table import INIT, KEY, LR, LR_HEAD, SPREAD, H, config

import jaxembed
import jaxembed.flax
import jaxembed.nnx
from jaxembed.collection import FeatureConfig, TableConfig, layout_collection
from jaxembed.dynamic import reference as R
from jaxembed.dynamic.config import DynamicState, DynamicTableConfig
from jaxembed.kernels.collection import collection_lookup, collection_update
from jaxembed.nn.common import replicated_on
from jaxembed.nn.stacks import build_stack
from jaxembed.optim import dynamic_collection as DC
from jaxembed.plan.specs import format_bytes

B, STEPS, ACC0 = 16, 6, 0.1  # bags a step (2 a device on 8), steps, adagrad's first s
ITEMS, SHOPS = 40, 12
_rng = np.random.default_rng(11)
STATIC = {"item": _rng.normal(size=(ITEMS, H)), "shop": _rng.normal(size=(SHOPS, H))}
STATIC = {name: v.astype(np.float32) for name, v in STATIC.items()}
TABLES = (
    TableConfig("item", ITEMS, H, placement="rows"),
    TableConfig("shop", SHOPS, H, placement="table"),
    TableConfig("user", 16, H, placement="table", dynamic=config("lfu"), initializer=INIT),
    TableConfig("page", 16, H, placement="table", dynamic=config("lru"), initializer=INIT),
)
FEATURES = (
    FeatureConfig("user_hist", "user", combiner="sum", max_ids=2),
    FeatureConfig("user_now", "user", combiner="sum", max_ids=1),
    FeatureConfig("page", "page", combiner="mean", max_ids=2),
    FeatureConfig("shop", "shop", combiner="sum", max_ids=2),
    FeatureConfig("item", "item", combiner="sum", max_ids=2),
)
DYNAMIC = {"user_hist", "user_now", "page"}
OPT = jaxembed.optim.adagrad(LR)
MESH8 = jax.make_mesh((8,), ("model",))


def stream(seed=3):
    """Raw batches: int64 ids of drifting windows (user: 14 ids moving by 3 a step, page: 20
    moving by 5; 15% padding, -1), static ids in range or -1, and labels."""
    rng = np.random.default_rng(seed)
    for t in range(STEPS):
        user = ((3 * t + rng.integers(0, 14, (B, 3))).astype(np.uint64) * SPREAD).view(np.int64)
        page = ((1000 + 5 * t + rng.integers(0, 20, (B, 2))).astype(np.uint64) * SPREAD).view(
            np.int64)  # fmt: skip
        for ids in (user, page):
            ids[rng.random(ids.shape) < 0.15] = -1
        raw = {"user_hist": user[:, :2], "user_now": user[:, 2:], "page": page,
               "shop": rng.integers(-1, SHOPS, (B, 2)).astype(np.int32),
               "item": rng.integers(-1, ITEMS, (B, 2)).astype(np.int32)}  # fmt: skip
        yield raw, rng.normal(size=(B,)).astype(np.float32)


class Twin:
    """The float64 model: every table `[V, H]` by rows with its accumulator, each dynamic
    table's remap the pure-Python policy's, a linear head on the concatenated outputs."""

    def __init__(self, layout):
        self.layout = layout
        self.rows = {t.name: np.zeros((t.vocab_size, H)) for t in layout.tables}
        self.rows.update({name: v.astype(np.float64) for name, v in STATIC.items()})
        self.acc = {t.name: np.full((t.vocab_size, H), ACC0) for t in layout.tables}
        self.given = {t.name: np.zeros(t.vocab_size, bool) for t in layout.tables}  # ever reset
        self.remaps = {t.name: R.init_state(t.dynamic) for _, t in DC.dynamic_tables(layout)}
        self.keys = {t.name: jax.random.fold_in(KEY, i) for i, t in DC.dynamic_tables(layout)}
        self.w, self.b = np.linspace(-1, 1, len(FEATURES) * H), 0.25

    def remap(self, raw, t):
        """Each feature's rows (-1: none) and each dynamic table's reference steps."""
        rows, refs = {f: raw[f] for f in raw if f not in DYNAMIC}, {}
        for _, table in DC.dynamic_tables(self.layout):
            for f in (f for f in self.layout.features if f.table == table.name):
                ref = R.step(table.dynamic, self.remaps[table.name], raw[f.name], t)
                for r in ref.reset_rows:  # (re)initialised before anything reads them
                    k = jax.random.fold_in(jax.random.fold_in(self.keys[table.name], t), r)
                    self.rows[table.name][r] = np.asarray(INIT(k, (1, H), jnp.float32)[0])
                    self.acc[table.name][r], self.given[table.name][r] = ACC0, True
                self.remaps[table.name] = ref.state
                rows[f.name] = np.where(ref.found, ref.rows, -1)
                refs.setdefault(table.name, []).append(ref)
        return rows, refs

    def step(self, raw, y, t):
        rows, refs = self.remap(raw, t)
        outs, weights = {}, {}
        for f in FEATURES:  # each slot's weight in its bag: 1 (sum) or 1/count (mean)
            ok = rows[f.name] >= 0
            count = np.maximum(ok.sum(1, keepdims=True), 1)
            weights[f.name] = ok / count if f.combiner == "mean" else ok * 1.0
            vecs = self.rows[f.table][np.where(ok, rows[f.name], 0)]  # [B, L, H]
            outs[f.name] = np.einsum("bl,blh->bh", weights[f.name], vecs)
        x = np.concatenate([outs[f.name] for f in FEATURES], 1)
        logits = x @ self.w + self.b
        d = 2 * (logits - y) / len(y)
        grads = {name: np.zeros_like(v) for name, v in self.rows.items()}
        touched = {name: np.zeros(len(v), bool) for name, v in self.rows.items()}
        for i, f in enumerate(FEATURES):
            g = d[:, None] * self.w[None, i * H : (i + 1) * H]  # d loss / d output, [B, H]
            ok = rows[f.name] >= 0
            np.add.at(
                grads[f.table], rows[f.name][ok], (weights[f.name][..., None] * g[:, None])[ok]
            )
            touched[f.table][rows[f.name][ok]] = True
        # optax's adagrad, one update per row read: s += g², w -= lr·g/√(s + eps)
        for name, g in grads.items():
            m = touched[name]
            self.acc[name][m] += g[m] ** 2
            self.rows[name][m] -= LR * g[m] / np.sqrt(self.acc[name][m] + 1e-7)
        self.w, self.b = self.w - LR_HEAD * x.T @ d, self.b - LR_HEAD * d.sum()
        return rows, refs, outs, np.mean((logits - y) ** 2)


def initial_stacks(layout, mesh):
    """Each stack: the static tables' rows, the dynamic tables' zeros, in its layout."""
    values = {**STATIC, **{t.name: np.zeros((t.vocab_size, H), np.float32)
                           for _, t in DC.dynamic_tables(layout)}}  # fmt: skip
    out = {}
    for s in layout.stacks:
        out[s.index] = jnp.asarray(build_stack(layout, s, values))
        if mesh is not None:
            out[s.index] = jax.device_put(out[s.index], NamedSharding(mesh, s.spec))
    return out


def put_batch(raw, mesh):
    """The batch as the step takes it: dynamic features as keys, split over the devices."""
    out = {n: jaxembed.dynamic.as_keys(v, check=False) if n in DYNAMIC else jnp.asarray(v)
           for n, v in raw.items()}  # fmt: skip
    if mesh is None:
        return out
    return {n: jax.device_put(v, NamedSharding(mesh, P("model", *(None,) * (v.ndim - 1))))
            for n, v in out.items()}  # fmt: skip


def check_step(twin, layout, got, want, where):
    """The remap (bitwise) and the values (float64 twin) of one step.

    got: (remaps, stats, rows or None, outs or None, loss, stacks, states) of the model."""
    remaps, stats, rows, outs, loss, stacks, states = got
    want_rows, refs, want_outs, want_loss = want
    for name, state in remaps.items():
        for field in DynamicState._fields:
            np.testing.assert_array_equal(getattr(state, field),
                                          getattr(twin.remaps[name], field),
                                          err_msg=f"{where}: {name}.{field}")  # fmt: skip
        want_stats = np.sum([np.array(r.stats) for r in refs[name]], 0)
        np.testing.assert_array_equal([int(x) for x in stats[name]], want_stats,
                                      err_msg=f"{where}: {name} stats")  # fmt: skip
    for f in FEATURES:
        if rows is not None and f.name in DYNAMIC:
            np.testing.assert_array_equal(rows[f.name], want_rows[f.name], err_msg=where)
        if outs is not None:
            np.testing.assert_allclose(outs[f.name], want_outs[f.name], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{where}: {f.name}")  # fmt: skip
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=where)
    check_stacks(twin, layout, stacks, states, where)


def check_stacks(twin, layout, stacks, states, where):
    """Every table's rows and accumulators against the twin; the rows never handed out and
    the stack rows of no table bitwise as they started (zeros, s = 0.1)."""
    for s in layout.stacks:
        table = np.asarray(stacks[s.index])
        acc = np.asarray(states[s.index].slots["accumulator"])
        other = np.ones(s.shape[0], bool)  # the stack's rows that hold no table
        for name in s.tables:
            p = layout.placement(name)
            at = p.stack_ids(np.arange(p.vocab_size, dtype=np.int32), s.local_rows)
            other[at] = False
            np.testing.assert_allclose(table[at], twin.rows[name], rtol=2e-5, atol=1e-6,
                                       err_msg=f"{where}: {name} rows")  # fmt: skip
            np.testing.assert_allclose(acc[at], twin.acc[name], rtol=2e-5,
                                       err_msg=f"{where}: {name} accumulator")  # fmt: skip
            if layout.table(name).dynamic is not None:
                never = at[~twin.given[name]]
                assert (table[never] == 0).all() and (acc[never] == np.float32(ACC0)).all(), where
        assert (table[other] == 0).all() and (acc[other] == np.float32(ACC0)).all(), where


def check_layout(layout, mesh):
    """On 8 devices, one stack of four tables, each table-wise one whole on a shard of its own
    after item's rows there; on one device, every table replicated, each dynamic one alone."""
    if mesh is None:
        assert {layout.placement(t.name).placement for t in TABLES} == {"replicated"}
        for name in ("user", "page"):
            assert layout.stack_of(name).tables == (name,)
            assert DC.table_rows_at(layout, name) is None
        return
    (stack,) = layout.stacks
    assert set(stack.tables) == {t.name for t in TABLES} and stack.num_shards == 8
    shards = set()
    for name in ("shop", "user", "page"):
        p = layout.placement(name)
        assert p.placement == "table" and p.offset == ITEMS // 8, p
        shards.add(p.shards)
        if name != "shop":
            want = p.shards[0] * stack.local_rows + p.offset
            assert DC.table_rows_at(layout, name) == want
    assert len(shards) == 3


def whole(x, mesh):
    """`x` on every device: the head's gradient sums over the batch, which is split."""
    return x if mesh is None else jax.sharding.reshard(x, NamedSharding(mesh, P()))


def make_step(layout, mesh):
    def step(stacks, states, remaps, head, batch, y, t):
        batch, stacks, states, remaps, stats = DC.prepare(
            layout, stacks, states, remaps, batch, t, key=KEY, optimizer=OPT, impl="xla",
            mesh=mesh,
        )  # fmt: skip
        outs = collection_lookup(layout, stacks, batch, mesh=mesh)

        def loss_fn(head, outs):
            x = whole(jnp.concatenate([outs[f.name] for f in FEATURES], 1), mesh)
            return jnp.mean((x @ head["w"] + head["b"] - y) ** 2)

        loss, (g_head, g_outs) = jax.value_and_grad(loss_fn, (0, 1))(head, outs)
        stacks, states = collection_update(layout, OPT, stacks, states, batch, g_outs, mesh=mesh)
        head = jax.tree.map(lambda p, g: p - LR_HEAD * g, head, g_head)
        rows = {n: batch[n] for n in DYNAMIC}
        return stacks, states, remaps, head, loss, stats, outs, rows

    return jax.jit(step, donate_argnums=(0, 1))


@pytest.mark.parametrize("devices", [8, 1])
def test_dynamic_tables_in_a_tablewise_stack_train_like_the_references(devices):
    mesh = MESH8 if devices == 8 else None
    layout = layout_collection(TABLES, FEATURES, mesh)
    check_layout(layout, mesh)
    stacks = initial_stacks(layout, mesh)
    states = {s.index: OPT.init(stacks[s.index], mesh=mesh, weight_spec=s.spec)
              for s in layout.stacks}  # fmt: skip
    remaps = DC.init_states(layout, mesh=mesh)
    here = replicated_on(mesh)  # the head where the step returns it: the step compiles once
    head = {"w": here(jnp.linspace(-1, 1, len(FEATURES) * H)), "b": here(jnp.float32(0.25))}
    twin, step = Twin(layout), make_step(layout, mesh)
    totals = {name: np.zeros(6, int) for name in remaps}
    for t, (raw, y) in enumerate(stream()):
        stacks, states, remaps, head, loss, stats, outs, rows = step(
            stacks, states, remaps, head, put_batch(raw, mesh), jnp.asarray(y), jnp.int32(t)
        )
        want = twin.step(raw, y, t)
        where = f"{devices} devices, step {t}"
        check_step(twin, layout, (remaps, stats, rows, outs, loss, stacks, states), want, where)
        if mesh is not None:
            for s in layout.stacks:
                assert stacks[s.index].sharding.spec == s.spec, where
            for state in remaps.values():  # whole on every device
                assert all(a.sharding.is_fully_replicated for a in jax.tree.leaves(state))
        for name in totals:
            totals[name] += np.sum([np.array(r.stats) for r in want[1][name]], 0)
    for name, (hits, admitted, evicted, *_) in totals.items():
        assert hits > 0 and admitted > 0 and evicted > 0, (name, totals[name])
    assert totals["user"][4] > 0  # lfu admits after two sightings: some ids wait (pending)


class NnxNet(nnx.Module):
    def __init__(self, mesh):
        self.coll = jaxembed.nnx.EmbeddingBagCollection(TABLES, FEATURES, mesh=mesh,
                                                        rngs=nnx.Rngs(0))  # fmt: skip
        zeros = {t.name: np.zeros((t.vocab_size, H), np.float32) for t in TABLES if t.dynamic}
        self.coll.load_tables({**STATIC, **zeros})
        # replicated on the mesh, as the step returns them (then it compiles once)
        here = replicated_on(mesh)
        self.coll.reset_key.set_value(here(jax.random.key_data(KEY)))
        self.w = nnx.Param(here(jnp.linspace(-1, 1, len(FEATURES) * H)))
        self.b = nnx.Param(here(jnp.float32(0.25)))

    def __call__(self, batch):
        return whole(self.coll.concat(self.coll(batch)), MESH8) @ self.w[...] + self.b[...]


@nnx.jit
def nnx_step(net, dense, sparse, batch, y):
    def loss_fn(net):
        return jnp.mean((net(batch) - y) ** 2)

    loss, grads = jaxembed.nnx.value_and_grad(loss_fn)(net)
    dense.update(net, grads.dense)
    sparse.update(net, grads)  # the reset rows' optimizer state afresh, then the update
    return loss


def test_the_nnx_collection_trains_tablewise_dynamic_tables_like_the_references():
    net = NnxNet(MESH8)
    layout = net.coll.layout
    check_layout(layout, MESH8)
    dense = nnx.Optimizer(net, optax.sgd(LR_HEAD), wrt=jaxembed.nnx.DENSE)
    dense.step.set_value(replicated_on(MESH8)(dense.step.get_value()))
    sparse = jaxembed.nnx.SparseOptimizer(net, OPT)
    twin = Twin(layout)
    for t, (raw, y) in enumerate(stream()):
        loss = nnx_step(net, dense, sparse, put_batch(raw, MESH8), jnp.asarray(y))
        want = twin.step(raw, y, t)
        coll = net.coll
        remaps = {n: v.get_value() for n, v in coll.remaps.items()}
        stats = {n: v.get_value() for n, v in coll.remap_stats.items()}
        stacks = {s.index: coll.stacks[s.name][...] for s in layout.stacks}
        got = (remaps, stats, None, None, loss, stacks, sparse.states["coll"])
        check_step(twin, layout, got, want, f"nnx step {t}")


class LinenNet(linen.Module):
    @linen.compact
    def __call__(self, batch):
        coll = jaxembed.flax.EmbeddingBagCollection(TABLES, FEATURES, name="coll")
        w = self.param("w", lambda _: jnp.linspace(-1, 1, len(FEATURES) * H))
        b = self.param("b", lambda _: jnp.float32(0.25))
        return whole(coll.concat(coll(batch)), MESH8) @ w + b


@pytest.mark.slow  # heavy; what it checks is covered by the quicker tests beside it
def test_the_linen_collection_trains_tablewise_dynamic_tables_like_the_references():
    model, batches = LinenNet(), list(stream())
    with jax.set_mesh(MESH8):
        first = put_batch(batches[0][0], MESH8)
        variables = model.init(jax.random.key(0), first)
        layout = jaxembed.flax.EmbeddingBagCollection(TABLES, FEATURES, mesh=MESH8).layout
        check_layout(layout, MESH8)
        params, dyn = dict(variables["params"]), dict(variables["dynamic"]["coll"])
        coll = dict(params["coll"])
        for s, array in zip(layout.stacks, initial_stacks(layout, MESH8).values(), strict=True):
            box = coll[s.name]
            coll[s.name] = box.replace_boxed(array) if isinstance(box, linen.Partitioned) else array
        params["coll"] = coll
        dyn["reset_key"] = jax.device_put(jax.random.key_data(KEY), dyn["reset_key"].sharding)

        def loss_fn(params, dyn, batch, y):
            out, upd = model.apply({"params": params, "dynamic": {"coll": dyn}}, batch,
                                   mutable=["dynamic"])  # fmt: skip
            return jnp.mean((out - y) ** 2), upd["dynamic"]["coll"]

        y0 = jnp.zeros(B)
        tx = optax.masked(optax.sgd(LR_HEAD), jaxembed.flax.dense_mask(loss_fn, params, dyn,
                                                                       first, y0))  # fmt: skip
        opt_state = tx.init(params)
        sparse = jaxembed.flax.init_sparse(OPT, loss_fn, params, dyn, first, y0)

        @jax.jit
        def step(params, dyn, opt_state, sparse, batch, y):
            (loss, dyn), grads = jaxembed.flax.value_and_grad(loss_fn, has_aux=True)(
                params, dyn, batch, y)  # fmt: skip
            updates, opt_state = tx.update(grads.dense, opt_state, params)
            params = optax.apply_updates(params, updates)
            params, sparse = jaxembed.flax.sparse_update(OPT, sparse, params, grads)
            return params, dyn, opt_state, sparse, loss

        twin = Twin(layout)
        for t, (raw, y) in enumerate(batches):
            params, dyn, opt_state, sparse, loss = step(
                params, dyn, opt_state, sparse, put_batch(raw, MESH8), jnp.asarray(y)
            )
            want = twin.step(raw, y, t)
            remaps = {name: dyn[f"remap_{name}"] for name in ("user", "page")}
            stats = {name: dyn[f"stats_{name}"] for name in ("user", "page")}
            stacks = {s.index: unbox(params["coll"][s.name]) for s in layout.stacks}
            got = (remaps, stats, None, None, loss, stacks, sparse["coll"])
            check_step(twin, layout, got, want, f"linen step {t}")


def unbox(x):
    return x.value if isinstance(x, linen.Partitioned) else x


# --- the planner -------------------------------------------------------------------------------

PLAN_CFG = DynamicTableConfig(capacity=1 << 12, bucket_size=16, admit_after=2, policy="lfu")
PLAN_TABLES = [TableConfig(f"dyn{i}", PLAN_CFG.capacity, 32, dynamic=PLAN_CFG) for i in range(3)]
PLAN_TABLES += [TableConfig(f"static{i}", 3000 + i, 32) for i in range(3)]
PLAN_FEATURES = [FeatureConfig(f"f_{t.name}", t.name, max_ids=20) for t in PLAN_TABLES]


def plan(tables, memory="64MiB"):
    return jaxembed.plan_collection(tables, PLAN_FEATURES, MESH8, batch_size=1024,
                                    memory_per_device=memory, optimizer=OPT,
                                    backend="cpu")  # fmt: skip


def test_the_planner_places_small_dynamic_tables_tablewise_and_counts_them_exactly():
    chosen = plan(PLAN_TABLES)  # small tables, 20 ids a bag: each whole on one device
    assert set(chosen.placements.values()) == {"table"}, chosen.placements
    layout = layout_collection(chosen.table_configs, PLAN_FEATURES, MESH8)
    (stack,) = layout.stacks  # one dim: the dynamic tables share the static ones' stack
    assert {t.name: t.stack for t in chosen.tables} == {t.name: stack.name for t in PLAN_TABLES}
    row = 32 * 4 * 2  # a row of f32 and its adagrad accumulator
    state = PLAN_CFG.state_bytes  # a dynamic table's whole remap state, on every device
    by = {t.name: t for t in chosen.tables}
    used = np.full(8, 3 * state)  # device d = shard d (a 1-D mesh)
    for t in PLAN_TABLES:
        (owner,) = layout.placement(t.name).shards
        used[owner] += t.vocab_size * row
        mine = t.vocab_size * row + (state if t.dynamic is not None else 0)
        assert by[t.name].memory_bytes == mine, (t.name, by[t.name].memory_bytes, mine)
    np.testing.assert_array_equal(chosen.used_bytes, used)
    assert chosen.allocated_bytes == stack.local_rows * row + 3 * state
    for i in range(3):
        assert f"+ {format_bytes(state)} remap state a device" in by[f"dyn{i}"].reason
    # placed by rows instead, each device holds an eighth of the rows and of the state
    rows = plan([TableConfig(t.name, t.vocab_size, 32, placement="rows", dynamic=t.dynamic)
                 for t in PLAN_TABLES])  # fmt: skip
    by_rows = {t.name: t for t in rows.tables}
    share = PLAN_CFG.capacity // 8 * row + PLAN_CFG.shard(8).state_bytes
    assert by_rows["dyn0"].memory_bytes == share


def test_jaxembed_plan_prints_a_tablewise_dynamic_table(tmp_path, capsys):
    from jaxembed import cli

    dynamic = {"capacity": PLAN_CFG.capacity, "bucket_size": PLAN_CFG.bucket_size,
               "admit_after": PLAN_CFG.admit_after, "policy": PLAN_CFG.policy}  # fmt: skip
    spec = {
        "tables": [{"name": t.name, "dim": 32, **({"dynamic": dynamic} if t.dynamic else
                    {"vocab_size": t.vocab_size})} for t in PLAN_TABLES],
        "features": [{"name": f.name, "table": f.table, "max_ids": 20} for f in PLAN_FEATURES],
    }  # fmt: skip
    path = tmp_path / "tables.json"
    path.write_text(json.dumps(spec))
    argv = ["plan", "--tables", str(path), "--mesh", "model=8", "--batch", "1024",
            "--memory", "64MiB"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith("dyn0"))
    assert line.split()[4] == "table", out
    assert "dynamic (lfu, admit after 2)" in line, line
    assert f"+ {format_bytes(PLAN_CFG.state_bytes)} remap state a device" in line, line


# --- what cannot work --------------------------------------------------------------------------


def test_placements_that_cannot_work_name_the_value_and_the_fix():
    cfg = config("lru")
    user = TableConfig("user", cfg.capacity, H, dynamic=cfg)
    feats = [FeatureConfig("u", "user")]
    for bad in ("columns", "table_rows"):
        with pytest.raises(ValueError, match=f"got '{bad}'.*place it 'rows', 'table' or"):
            layout_collection([user], feats, MESH8, placements={"user": bad})
        with pytest.raises(ValueError, match=f"placement='{bad}'"):
            TableConfig("user", cfg.capacity, H, placement=bad, dynamic=cfg)
    with pytest.raises(ValueError, match="row_sharding='block'"):
        TableConfig("user", cfg.capacity, H, placement="table", row_sharding="mod", dynamic=cfg)
    # a table-wise dynamic table that its device cannot hold: its rows and the whole state
    big = DynamicTableConfig(capacity=1 << 16, bucket_size=16)
    fixed = [TableConfig("user", big.capacity, 32, placement="table", dynamic=big)]
    need = big.capacity * 32 * 4 * 2 + big.state_bytes
    with pytest.raises(ValueError, match=r"memory_per_device=.*Table 'user'.*as 'table'") as e:
        jaxembed.plan_collection(fixed, feats, MESH8, batch_size=64, memory_per_device=need // 2,
                                 optimizer=OPT, backend="cpu")  # fmt: skip
    assert "raise memory_per_device to at least" in str(e.value)
    # placed by rows, the same table fits the same budget: the state splits with the rows
    rows = [TableConfig("user", big.capacity, 32, placement="rows", dynamic=big)]
    ok = jaxembed.plan_collection(rows, feats, MESH8, batch_size=64, memory_per_device=need // 2,
                                  optimizer=OPT, backend="cpu")  # fmt: skip
    assert ok.placements == {"user": "rows"}
