"""A dynamic table trained end to end (`jaxembed.optim.dynamic`) against two references.

A tiny model (a sum bag over raw 64-bit ids, a linear head, a squared loss) trains for six
steps on a stream where new ids keep arriving and the table is too small to hold them, so
ids are admitted, evicted and refused. After every step:

* the remap's decisions (id -> row, the state, the counts) equal `jaxembed.dynamic.reference`;
* the pooled values, the loss, the table and the optimizer state equal a float64 numpy model
  that keeps a dict id -> (row vector, accumulator), re-initialised on admission from the same
  initializer and key;
* an id without a row reads zeros and gets no gradient: every row but the ones reset or read
  this step is bitwise unchanged, and free rows stay zero.

For each policy (lru, lfu with a count-min admission, ttl), on one device and with the table
split over 8 devices (`P("model", None)`); each configuration is compiled once.
"""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed
from jaxembed.dynamic import keys as K
from jaxembed.dynamic import reference as R
from jaxembed.dynamic.config import DynamicState, DynamicTableConfig
from jaxembed.hlo import table_copies
from jaxembed.kernels import remap_native
from jaxembed.optim import dynamic as D

H, BAGS, L, STEPS = 4, 4, 3, 6
LR, LR_HEAD = 0.3, 0.1
INIT = jax.nn.initializers.normal(0.5)
KEY = jax.random.key(7)
SPREAD = np.uint64(0x9E3779B97F4A7C15)  # spreads small ints over all 64 bits
NATIVE = remap_native.available()

CONFIGS = {
    "lru": dict(policy="lru"),
    "lfu": dict(policy="lfu", admit_after=2, sketch_depth=2, sketch_width=32, sketch_window=24),
    "ttl": dict(policy="ttl", ttl_steps=1),
}
OPTIMIZERS = {"sgd": jaxembed.optim.sgd(LR), "adagrad": jaxembed.optim.adagrad(LR)}


def config(policy):
    return DynamicTableConfig(capacity=16, bucket_size=2, seed=3, **CONFIGS[policy])


def stream(seed=0):
    """Batches of bags [BAGS, L] of int64 ids: a window of popular ids that drifts by 4 a step
    (new ids keep coming), some slots padding (-1), and labels."""
    rng = np.random.default_rng(seed)
    for t in range(STEPS):
        raw = (4 * t + rng.integers(0, 14, (BAGS, L))).astype(np.uint64)
        ids = (raw * SPREAD).view(np.int64)
        ids[rng.random((BAGS, L)) < 0.15] = -1
        yield ids, rng.normal(size=(BAGS,)).astype(np.float32)


def init_row(t, row):
    """The value a row reset at step t starts from: the documented draw, one row at a time."""
    k = jax.random.fold_in(jax.random.fold_in(KEY, t), row)
    return np.asarray(INIT(k, (1, H), jnp.float32)[0], np.float64)


class Model:
    """The float64 numpy twin: a dict id -> row vector and accumulator, the remap's reference,
    a dense linear head; one update per touched id from its summed gradient."""

    def __init__(self, cfg, name):
        self.cfg, self.name = cfg, name
        self.state = R.init_state(cfg)
        self.emb, self.acc = {}, {}
        self.w, self.b = np.linspace(-1, 1, H), 0.25

    def step(self, ids, y, t):
        ref = R.step(self.cfg, self.state, ids, t)
        for row, new, old in zip(ref.reset_rows, ref.admitted, ref.evicted, strict=True):
            if old is not None:
                del self.emb[old], self.acc[old]
            self.emb[new], self.acc[new] = init_row(t, row), np.full(H, 0.1)
        flat = K.to_uint64(K.keys_to_host(ids, check=False)).tolist()
        flat = np.array(flat, dtype=object).reshape(ids.shape)
        assert [i in self.emb for i in flat.ravel()] == ref.found.ravel().tolist()
        vec = lambda i: self.emb.get(i, np.zeros(H))  # no row: zeros
        pooled = np.array([sum(vec(i) for i in bag) for bag in flat])
        logits = pooled @ self.w + self.b
        loss = np.mean((logits - y) ** 2)
        d_logits = 2 * (logits - y) / len(y)
        g_pooled = d_logits[:, None] * self.w[None, :]
        grads = {}
        for b, bag in enumerate(flat):
            for i in bag:
                if i in self.emb:
                    grads[i] = grads.get(i, 0) + g_pooled[b]
        for i, g in grads.items():
            if self.name == "sgd":
                self.emb[i] = self.emb[i] - LR * g
            else:  # optax's adagrad: s += g², w -= lr·g/√(s + 1e-7)
                self.acc[i] = self.acc[i] + g * g
                self.emb[i] = self.emb[i] - LR * g / np.sqrt(self.acc[i] + 1e-7)
        self.w, self.b = self.w - LR_HEAD * pooled.T @ d_logits, self.b - LR_HEAD * d_logits.sum()
        self.state = ref.state
        return ref, pooled, loss


def loss_fn(head, pooled, y):
    logits = pooled @ head["w"] + head["b"]
    return jnp.mean((logits - y) ** 2)


def make_step(cfg, opt, impl):
    def train_step(dyn, opt_state, head, keys, y, t):
        rows, dyn, opt_state, stats = D.prepare(cfg, dyn, opt_state, keys, t, initializer=INIT,
                                                key=KEY, optimizer=opt, impl=impl)  # fmt: skip
        pooled = jaxembed.embedding_bag(rows, dyn.table, combiner="sum")
        loss, (g_head, g_pooled) = jax.value_and_grad(loss_fn, (0, 1))(head, pooled, y)
        table, opt_state = opt.update(dyn.table, opt_state, rows, g_pooled, combiner="sum",
                                      after=pooled)  # fmt: skip
        head = jax.tree.map(lambda p, g: p - LR_HEAD * g, head, g_head)
        return dyn._replace(table=table), opt_state, head, rows, pooled, loss, stats

    return jax.jit(train_step, donate_argnums=(0, 1))


def train_and_check(policy, opt_name, mesh=None, impl="xla"):
    cfg, opt = config(policy), OPTIMIZERS[opt_name]
    spec = P("model", None) if mesh is not None else None
    dyn = D.init_table(cfg, H, mesh=mesh, weight_spec=spec)
    opt_state = opt.init(dyn.table)
    head = {"w": jnp.linspace(-1, 1, H), "b": jnp.float32(0.25)}
    model = Model(cfg, opt_name)
    step, compiled, totals = make_step(cfg, opt, impl), None, np.zeros(6, int)
    prev = np.zeros((cfg.capacity, H))
    for t, (ids, y) in enumerate(stream()):
        keys = K.as_keys(ids, check=False)
        args = (dyn, opt_state, head, keys, jnp.asarray(y), jnp.int32(t))
        if compiled is None:  # jit once; the donated table and state are written in place
            compiled = step.lower(*args).compile()
            assert table_copies(compiled, {"table": dyn.table, "opt": opt_state}) == []
            if mesh is not None:  # no table-sized collective: the pooled bags' psum and
                # the owner-split remap's id-sized answers (rows, reset rows, counts) alone
                found = re.findall(r"= (\S+) (all-\S+|reduce-scatter|collective-permute)\(",
                                   compiled.as_text())  # fmt: skip
                pooled = (f"f32[{BAGS},{H}]{{1,0}}", "all-reduce")
                for shape, op in set(found) - {pooled}:
                    dims = re.findall(r"\d+", shape.split("{")[0].split("[")[1])
                    size = int(np.prod([int(d) for d in dims])) if dims else 1
                    assert shape.startswith("s32[") and size <= keys.size, (shape, op)
        dyn, opt_state, head, rows, pooled, loss, stats = compiled(*args)
        ref, want_pooled, want_loss = model.step(ids, y, t)

        where = f"{policy}/{opt_name} step {t}"
        np.testing.assert_array_equal(rows, ref.rows, err_msg=f"{where}: id -> row")
        assert tuple(int(x) for x in stats) == tuple(ref.stats), where
        for name in DynamicState._fields:
            np.testing.assert_array_equal(getattr(dyn.state, name), getattr(ref.state, name),
                                          err_msg=f"{where}: state.{name}")  # fmt: skip
        np.testing.assert_allclose(pooled, want_pooled, rtol=1e-5, atol=1e-6, err_msg=where)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=where)

        table = np.asarray(dyn.table)
        acc = np.asarray(opt_state.slots["accumulator"]) if opt_name == "adagrad" else None
        live = ~K.is_reserved(np.asarray(ref.state.keys))
        for r in np.flatnonzero(live):
            i = int(K.to_uint64(np.asarray(ref.state.keys)[r]))
            np.testing.assert_allclose(table[r], model.emb[i], rtol=2e-5, atol=1e-6,
                                       err_msg=f"{where}: row {r}")  # fmt: skip
            if acc is not None:
                np.testing.assert_allclose(acc[r], model.acc[i], rtol=2e-5, err_msg=where)
        # no gradient for ids without a row: only rows reset or read this step move
        moved = set(ref.reset_rows) | set(ref.rows[ref.found].tolist())
        still = [r for r in range(cfg.capacity) if r not in moved]
        np.testing.assert_array_equal(table[still], prev[still], err_msg=where)
        assert (table[~live] == 0).all() and (acc is None or (acc[~live] == 0.1).all())
        prev = table
        totals += np.array(ref.stats)
        if mesh is not None:  # the layouts survive the step
            assert dyn.table.sharding.spec == P("model", None), where
            for slot in opt_state.slots.values():
                assert slot.sharding.spec[0] == "model", where
            specs = D.state_specs(cfg, "model")  # the state splits with the rows
            for name in DynamicState._fields:
                leaf, want = getattr(dyn.state, name), NamedSharding(mesh, getattr(specs, name))
                assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (where, name)
    hits, admitted, evicted, refused, pending, reserved = totals
    assert hits > 0 and admitted > 0 and evicted > 0 and reserved > 0, totals
    assert (pending > 0) == cfg.uses_sketch, totals
    if policy == "ttl":
        assert refused > 0, totals
    return dyn


@pytest.mark.parametrize(
    "policy,opt_name", [("lru", "sgd"), ("lfu", "adagrad"), ("ttl", "adagrad")]
)
def test_one_device_trains_like_the_references(policy, opt_name):
    train_and_check(policy, opt_name)


@pytest.mark.parametrize(
    "policy,opt_name", [("lru", "adagrad"), ("lfu", "sgd"), ("ttl", "adagrad")]
)
def test_rows_split_over_8_devices_train_like_the_references(policy, opt_name):
    mesh = jax.make_mesh((8,), ("model",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        train_and_check(policy, opt_name, mesh=mesh)


def test_native_remap_and_the_2d_mesh_give_the_same_bits():
    """On a (data 2, model 4) Auto mesh, ids split over data, the table over both axes: the
    XLA and the native remap (where built) give one device's rows, table and state, bitwise,
    with the table's layout passed (`weight_spec`), as an Auto mesh cannot tell it."""
    cfg, opt = config("lfu"), OPTIMIZERS["adagrad"]
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    spec = P(("data", "model"), None)

    def run(dyn, opt_state, keys, t, impl, weight_spec=None):
        return D.prepare(cfg, dyn, opt_state, keys, t, initializer=INIT, key=KEY,
                         optimizer=opt, impl=impl, weight_spec=weight_spec)  # fmt: skip

    one = jax.jit(run, static_argnums=(4,))
    split = jax.jit(run, static_argnums=(4, 5), donate_argnums=(0, 1))
    want = D.init_table(cfg, H)
    want_state = opt.init(want.table)
    runs = {impl: None for impl in (("xla", "native") if NATIVE else ("xla",))}
    for impl in runs:
        dyn = D.init_table(cfg, H, mesh=mesh, weight_spec=spec)
        runs[impl] = (dyn, opt.init(dyn.table))
    for t, (ids, _) in enumerate(itertools.islice(stream(seed=1), 4)):
        keys = K.as_keys(ids, check=False)
        rows, want, want_state, stats = one(want, want_state, keys, t, "xla")
        placed = jax.device_put(keys, NamedSharding(mesh, P("data")))
        for impl, (dyn, opt_state) in runs.items():
            got_rows, dyn, opt_state, got_stats = split(dyn, opt_state, placed, t, impl, spec)
            runs[impl] = (dyn, opt_state)
            for a, b in zip(jax.tree.leaves((got_rows, dyn, opt_state, got_stats)),
                            jax.tree.leaves((rows, want, want_state, stats)), strict=True):  # fmt: skip
                np.testing.assert_array_equal(a, b, err_msg=f"{impl} step {t}")
            assert dyn.table.sharding.spec == spec


def test_rows_for_reads_without_admitting_and_exports_without_custom_calls():
    cfg = config("lru")
    dyn = D.init_table(cfg, H)
    ids, _ = next(stream())
    keys = K.as_keys(ids, check=False)
    rows, dyn, _, _ = jax.jit(lambda d, k: D.prepare(cfg, d, None, k, 0, initializer=INIT,
                                                     key=KEY, optimizer=None))(dyn, keys)  # fmt: skip
    fresh = K.as_keys(np.array([[123456789, -5]], np.int64))  # never seen
    serve = jax.jit(lambda s, k: D.rows_for(cfg, s, k, impl="xla"))
    np.testing.assert_array_equal(serve(dyn.state, keys), rows)
    assert serve(dyn.state, fresh).tolist() == [[cfg.capacity] * 2]
    before = jax.tree.map(np.asarray, dyn.state)
    D.rows_for(cfg, dyn, fresh)  # read-only: nothing counted, nothing admitted
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(dyn.state), strict=True):
        np.testing.assert_array_equal(a, b)
    text = jax.export.export(serve)(dyn.state, keys).mlir_module()
    assert "stablehlo.custom_call" not in text  # an exported serving function needs no jaxembed
    mesh = jax.make_mesh((2, 4), ("data", "model"))  # each device looks up its own ids
    with jax.set_mesh(mesh):
        state = jax.device_put(dyn.state, NamedSharding(mesh, P()))
        placed = jax.device_put(keys, NamedSharding(mesh, P("data")))
        got = jax.jit(lambda s, k: D.rows_for(cfg, s, k))(state, placed)
    np.testing.assert_array_equal(got, rows)
    assert got.sharding.spec == P("data", None)


def test_eager_rows_for_compiles_once_per_table_and_layout():
    """An eager `rows_for` runs one jitted program; the next call with the same table and
    layout reuses it (a fresh closure per call compiled again every time)."""
    cfg = config("lru")
    mesh = jax.make_mesh((8,), ("model",), axis_types=(AxisType.Explicit,))
    ids = np.array([[5, 6], [7, -1]], np.int64)
    split = D.init_table(cfg, H, mesh=mesh, weight_spec=P("model", None))
    for dyn in (D.init_table(cfg, H), split):
        first = D.rows_for(cfg, dyn, ids, check_ids=False)
        compiled = D._lookup_jit._cache_size()
        again = D.rows_for(cfg, dyn, ids + 1, check_ids=False)
        assert D._lookup_jit._cache_size() == compiled
        assert first.tolist() == again.tolist() == [[cfg.capacity] * 2] * 2  # nothing admitted


def test_an_empty_or_all_padding_batch_changes_nothing():
    cfg, opt = config("lru"), OPTIMIZERS["adagrad"]
    dyn = D.init_table(cfg, H)
    opt_state = opt.init(dyn.table)
    for ids in (np.zeros((0, 3), np.int64), np.full((2, 3), -1, np.int64)):
        rows, new, new_state, stats = D.prepare(
            cfg, dyn, opt_state, ids, 0, initializer=INIT, key=KEY, optimizer=opt,
            check_ids=False,
        )  # fmt: skip
        assert rows.shape == ids.shape and (np.asarray(rows) == cfg.capacity).all()
        assert int(stats.admitted) == 0 and int(stats.reserved) == ids.size
        for a, b in zip(jax.tree.leaves((new, new_state)), jax.tree.leaves((dyn, opt_state)),
                        strict=True):  # fmt: skip
            np.testing.assert_array_equal(a, b)


def test_hostile_calls_name_the_value_and_the_fix():
    cfg, opt = config("lru"), OPTIMIZERS["adagrad"]
    dyn = D.init_table(cfg, H)
    st = opt.init(dyn.table)
    ids = np.array([[1, 2]], np.int64)
    kw = dict(initializer=INIT, key=KEY, optimizer=opt)
    call = lambda **over: D.prepare(**(dict(config=cfg, dyn_table=dyn, opt_state=st, ids=ids,
                                            step_index=0) | kw | over))  # fmt: skip
    with pytest.raises(TypeError, match=r"got float32 ids of shape \(2,\)"):
        call(ids=jnp.array([1.0, 2.0]))
    # int64 ids passed into jit without x64 arrive as int32: refused in every shape (an
    # int64 [B, 2] would read as B keys' halves), naming the narrowing and as_keys
    for shape in [(2,), (1, 3), (3, 2), (2, 2, 2)]:
        narrowed = np.arange(np.prod(shape), dtype=np.int64).reshape(shape) + 2**40
        with pytest.raises(TypeError, match=r"int32 ids are refused: .*jax.jit narrows.*as_keys"):
            jax.jit(lambda i: call(ids=i))(narrowed)
    with pytest.raises(ValueError, match=r"is EMPTY_ID.*check=False"):
        call(ids=np.array([5, -1], np.int64))
    with pytest.raises(ValueError, match=r"returned float32\[2, 8\], not float32\[1, 4\]"):
        call(initializer=lambda k, shape, dtype: jnp.zeros((2, 8), dtype))
    with pytest.raises(TypeError, match=r"initializer must be a function .*got float 0.1"):
        call(initializer=0.1)
    with pytest.raises(TypeError, match=r"called as initializer\(key, shape, dtype\)"):
        call(initializer=lambda k: jnp.zeros((1, H)))
    with pytest.raises(TypeError, match=r"key must be one PRNG key, .* got int"):
        call(key=0)
    with pytest.raises(TypeError, match=r"key must be one PRNG key, .* got float32\[2\]"):
        call(key=jnp.zeros(2))
    with pytest.raises(ValueError, match=r"opt_state.slots\['accumulator'\] is float32\[32, 4\], "
                                         r"but a table of 16 rows of 4 needs \[16, 4\]"):  # fmt: skip
        call(opt_state=opt.init(jnp.zeros((32, H))))
    with pytest.raises(ValueError, match=r"not a state of optimizer 'adagrad'"):
        call(opt_state=OPTIMIZERS["sgd"].init(dyn.table))
    with pytest.raises(ValueError, match=r"got an opt_state but optimizer=None"):
        call(optimizer=None)
    with pytest.raises(TypeError, match=r"RowSparseOptimizer .*got GradientTransformation"):
        call(optimizer=optax.adagrad(0.1))
    with pytest.raises(TypeError, match=r"dyn_table must be a DynamicTable .*got tuple"):
        call(dyn_table=tuple(dyn))
    with pytest.raises(ValueError, match=r"dyn_table.table has 8 rows, but config.capacity=16"):
        call(dyn_table=dyn._replace(table=jnp.zeros((8, H))))
    with pytest.raises(ValueError, match=r"state.keys is uint32\[32, 2\], but .* needs"):
        call(dyn_table=D.init_table(DynamicTableConfig(capacity=32, bucket_size=4), H))
    with pytest.raises(ValueError, match=r"impl='cuda' must be one of"):
        call(impl="cuda")
    with pytest.raises(TypeError, match=r"step_index must be an integer .*got 1.5"):
        call(step_index=1.5)
    with pytest.raises(ValueError, match=r"step_index must be a scalar, got shape \(2,\)"):
        call(step_index=np.array([1, 2]))
    # The step is read modulo 2**32: -1 (an int32 counter's wrap) is step 2**32 - 1.
    wrapped, full = call(step_index=-1), call(step_index=2**32 - 1)
    for a, b in zip(jax.tree.leaves(wrapped), jax.tree.leaves(full), strict=True):
        np.testing.assert_array_equal(a, b)
    mesh = jax.make_mesh((8,), ("model",), axis_types=(AxisType.Auto,))
    with pytest.raises(ValueError, match=r"capacity 12 does not divide over mesh axes \('model',\) "
                                         r"\(size 8\).*use capacity=32"):  # fmt: skip
        D.init_table(DynamicTableConfig(capacity=12, bucket_size=4), H, mesh=mesh,
                     weight_spec=P("model", None))  # fmt: skip
    with pytest.raises(ValueError, match=r"weight_spec=.* needs a mesh"):
        D.init_table(cfg, H, weight_spec=P("model", None))
    with pytest.raises(ValueError, match=r"hidden=0 must be a positive int"):
        D.init_table(cfg, 0)
    split = D.init_table(cfg, H, mesh=mesh, weight_spec=P("model", None))
    with pytest.raises(ValueError, match=r"traced in an Auto mesh.*pass weight_spec="):
        jax.jit(lambda d, s: call(dyn_table=d, opt_state=s))(split, opt.init(split.table))
