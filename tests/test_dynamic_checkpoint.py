"""Checkpoints of dynamic tables (`jaxembed.optim.dynamic_io`): nothing lost, no bit changed.

The tiny model of tests/test_dynamic_table.py (a sum bag over raw 64-bit ids, a linear head,
a squared loss, adagrad) trains on a stream where new ids keep arriving, with an `lfu` table
that counts ids in a sketch before it admits them and evicts before and after the checkpoint:

* orbax saves the `DynamicTable`, its optimizer state and the head as they are; restored on
  the same mesh, three more steps are bitwise the uninterrupted run's;
* `export_rows` -> orbax -> `restore_rows` moves the table from one device to 8 (rows split)
  and back, with the same config: the import is the exported table bit for bit, and three more
  steps are bitwise the run that moved its arrays in memory (`jax.device_put`). (A run on 8
  devices is not bitwise a run on one: the bags' partial sums are added in another order.)
* into a larger table of another seed and bucket size every id re-buckets and keeps its row
  vector, optimizer row and metadata exactly, and lookups equal a float64 sum of the exported
  rows; into a too-small one the ids that do not fit are refused, or reported with their ids;
* hostile inputs raise errors that name the value and the fix.

The training step is compiled once per mesh for the whole file.
"""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed
from jaxembed.dynamic import keys as K
from jaxembed.dynamic.config import DynamicTableConfig
from jaxembed.optim import dynamic as D
from jaxembed.optim import dynamic_io as io
from jaxembed.optim.sparse import RowSparseState

H, BAGS, L, BEFORE, AFTER = 4, 4, 3, 3, 3
LR, LR_HEAD = 0.3, 0.1
INIT = jax.nn.initializers.normal(0.5)
KEY = jax.random.key(7)
SPREAD = np.uint64(0x9E3779B97F4A7C15)  # spreads small ints over all 64 bits
CFG = DynamicTableConfig(capacity=16, bucket_size=2, seed=3, policy="lfu", admit_after=2,
                         sketch_depth=2, sketch_width=32, sketch_window=24)  # fmt: skip
OPT = jaxembed.optim.adagrad(LR)
SPLIT = P("model", None)


def stream(seed=0):
    """Batches of bags [BAGS, L] of int64 ids from a window that drifts by 4 a step, some
    slots padding (-1), and labels: evictions at steps 2 to 5."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(BEFORE + AFTER):
        raw = (4 * t + rng.integers(0, 8, (BAGS, L))).astype(np.uint64)
        ids = (raw * SPREAD).view(np.int64)
        ids[rng.random((BAGS, L)) < 0.15] = -1
        out.append((K.as_keys(ids, check=False), rng.normal(size=(BAGS,)).astype(np.float32)))
    return out


BATCHES = stream()


def loss_fn(head, pooled, y):
    return jnp.mean((pooled @ head["w"] + head["b"] - y) ** 2)


def train_step(dyn, opt_state, head, keys, y, t):
    rows, dyn, opt_state, stats = D.prepare(CFG, dyn, opt_state, keys, t, initializer=INIT,
                                            key=KEY, optimizer=OPT)  # fmt: skip
    pooled = jaxembed.embedding_bag(rows, dyn.table, combiner="sum")
    loss, (g_head, g_pooled) = jax.value_and_grad(loss_fn, (0, 1))(head, pooled, y)
    table, opt_state = OPT.update(dyn.table, opt_state, rows, g_pooled, combiner="sum",
                                  after=pooled)  # fmt: skip
    head = jax.tree.map(lambda p, g: p - LR_HEAD * g, head, g_head)
    return dyn._replace(table=table), opt_state, head, (rows, pooled, loss, stats)


STEP = jax.jit(train_step, donate_argnums=(0, 1))
COMPILED = {}  # one program per mesh (None: one device) for the whole file


def step_for(args):
    sharding = args[0].table.sharding
    mesh = sharding.mesh if isinstance(sharding, NamedSharding) else None
    if mesh not in COMPILED:
        COMPILED[mesh] = STEP.lower(*args).compile()
    return COMPILED[mesh]


@pytest.fixture(scope="module")
def mesh8():
    return jax.make_mesh((8,), ("model",), axis_types=(AxisType.Explicit,))


def fresh(mesh):
    dyn = D.init_table(CFG, H, mesh=mesh, weight_spec=SPLIT if mesh is not None else None)
    head = {"w": jnp.linspace(-1, 1, H), "b": jnp.float32(0.25)}
    if mesh is not None:
        head = jax.device_put(head, NamedSharding(mesh, P()))
    return {"dyn": dyn, "opt": OPT.init(dyn.table), "head": head}


def run(carry, steps):
    """The training loop over `steps`: the carry after them and each step's outputs (numpy)."""
    outs = []
    for t in steps:
        keys, y = BATCHES[t]
        args = (carry["dyn"], carry["opt"], carry["head"], keys, jnp.asarray(y), jnp.int32(t))
        dyn, opt_state, head, out = step_for(args)(*args)
        carry = {"dyn": dyn, "opt": opt_state, "head": head}
        outs.append(jax.tree.map(np.asarray, out))
    return carry, outs


def on(mesh, fn, *args):
    if mesh is None:
        return fn(*args)
    with jax.set_mesh(mesh):
        return fn(*args)


def host(tree):
    return jax.tree.map(np.asarray, tree)


def assert_bitwise(got, want, where):
    assert jax.tree.structure(got) == jax.tree.structure(want), where
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                            strict=True):  # fmt: skip
        np.testing.assert_array_equal(a, b, err_msg=f"{where}{jax.tree_util.keystr(path)}")


def evictions(outs):
    return sum(int(o[3].evicted) for o in outs)


def state_shardings(mesh):
    """Where the remap state lives with the rows split over 'model': split with them."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), D.state_specs(CFG, "model"),
                        is_leaf=lambda x: isinstance(x, P))  # fmt: skip


def assert_state_split(state, mesh):
    for name, leaf, want in zip(state._fields, state, state_shardings(mesh), strict=True):
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (name, leaf.sharding)


def place(carry, mesh):
    """The carry moved in memory onto `mesh` (None: one device) in the import's layout."""
    if mesh is None:  # via the host: device_put to one device would keep the mesh's type
        return jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), carry)
    split = lambda a: NamedSharding(mesh, P(*tuple(SPLIT)[: a.ndim]) if a.ndim else P())
    rep = NamedSharding(mesh, P())
    return {
        "dyn": D.DynamicTable(jax.device_put(carry["dyn"].table, split(carry["dyn"].table)),
                              jax.device_put(carry["dyn"].state, state_shardings(mesh))),
        "opt": jax.tree.map(lambda a: jax.device_put(a, split(a)), carry["opt"]),
        "head": jax.device_put(carry["head"], rep),
    }  # fmt: skip


@pytest.fixture(scope="module")
def trained():
    """One device, all the steps: the carry and its export."""
    carry, outs = run(fresh(None), range(BEFORE + AFTER))
    assert evictions(outs) > 0
    return carry, io.export_rows(CFG, carry["dyn"], carry["opt"])


# --- (a) orbax as is, same mesh ---------------------------------------------------------------


def test_orbax_restores_a_trained_table_bitwise_on_its_mesh(mesh8, tmp_path):
    with jax.set_mesh(mesh8):
        carry, before = run(fresh(mesh8), range(BEFORE))
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, carry)
        saved = host(carry)
        with ocp.StandardCheckpointer() as ckpt:  # leaving it waits for the write
            ckpt.save(tmp_path / "ckpt", carry)
        want, want_outs = run(carry, range(BEFORE, BEFORE + AFTER))  # donates `carry`
        with ocp.StandardCheckpointer() as ckpt:
            restored = ckpt.restore(tmp_path / "ckpt", target)
        assert isinstance(restored["dyn"], D.DynamicTable)
        assert isinstance(restored["opt"], RowSparseState)
        assert_bitwise(host(restored), saved, "restored")
        assert restored["dyn"].table.sharding.spec == SPLIT
        assert_state_split(restored["dyn"].state, mesh8)
        got, got_outs = run(restored, range(BEFORE, BEFORE + AFTER))
    assert evictions(before) > 0 and evictions(want_outs) > 0
    assert_bitwise(got_outs, want_outs, "outputs")
    assert_bitwise(host(got), host(want), "after")


@pytest.mark.parametrize("devices", [4, 1])
def test_orbax_restores_onto_another_shard_count(mesh8, devices, tmp_path):
    """Saved from 8 row shards, restored by orbax as is onto 4 or 1: an id's bucket and row do
    not depend on the shard count, so the state needs no re-bucketing; the run goes on as the
    uninterrupted 8-shard run (the ids' rows, the state and the counts exactly, the floats to
    the summation order of the pooled bags)."""
    with jax.set_mesh(mesh8):
        carry, _ = run(fresh(mesh8), range(BEFORE))
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(tmp_path / "ckpt", carry)
        want, want_outs = run(carry, range(BEFORE, BEFORE + AFTER))
    mesh = jax.make_mesh((devices,), ("model",), axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:devices])  # fmt: skip
    target = fresh(mesh)  # the layout to restore into: rows (and the state) over `devices`
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "ckpt", target)
    assert_state_split(restored["dyn"].state, mesh)
    assert restored["dyn"].state.keys.addressable_shards[0].data.shape[0] == CFG.capacity // devices
    with jax.set_mesh(mesh):
        got, got_outs = run(restored, range(BEFORE, BEFORE + AFTER))
    assert evictions(want_outs) > 0
    for t, (g, w) in enumerate(zip(got_outs, want_outs, strict=True)):
        np.testing.assert_array_equal(g[0], w[0], err_msg=f"step {t}: rows")
        assert tuple(map(int, g[3])) == tuple(map(int, w[3])), t
        np.testing.assert_allclose(g[1], w[1], rtol=1e-5, atol=1e-6, err_msg=f"step {t}")
    assert_bitwise(host(got["dyn"].state), host(want["dyn"].state), "state")
    np.testing.assert_allclose(got["dyn"].table, want["dyn"].table, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["opt"].slots["accumulator"], want["opt"].slots["accumulator"],
                               rtol=1e-5, atol=1e-6)  # fmt: skip


def test_orbax_saves_a_table_that_admits_at_once(tmp_path):
    """`admit_after=1` keeps no sketch: its state holds a [1, 1] placeholder orbax can save."""
    cfg = DynamicTableConfig(capacity=16, bucket_size=2)
    dyn = D.init_table(cfg, 4)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", dyn)
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(
            tmp_path / "ckpt", jax.tree.map(ocp.utils.to_shape_dtype_struct, dyn)
        )
    assert_bitwise(host(restored), host(dyn), "restored")


# --- (b) export -> orbax -> import onto another mesh ------------------------------------------


@pytest.mark.parametrize("src,dst", [(None, "8"), ("8", None)], ids=["1to8", "8to1"])
def test_export_and_import_move_a_table_between_meshes_bitwise(src, dst, mesh8, tmp_path):
    src, dst = (mesh8 if m == "8" else None for m in (src, dst))
    carry, _ = on(src, run, fresh(src), range(BEFORE))
    ex = io.export_rows(CFG, carry["dyn"], carry["opt"])
    keys = np.asarray(carry["dyn"].state.keys)
    live = np.flatnonzero(~K.is_reserved(keys))
    np.testing.assert_array_equal(ex.metadata.row, live)  # every live id, by row
    np.testing.assert_array_equal(ex.ids, keys[live])
    np.testing.assert_array_equal(ex.rows, np.asarray(carry["dyn"].table)[live])
    np.testing.assert_array_equal(ex.opt_state_rows.slots["accumulator"],
                                  np.asarray(carry["opt"].slots["accumulator"])[live])  # fmt: skip
    assert int(ex.opt_state_rows.count) == BEFORE

    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "rows", {"export": ex, "head": host(carry["head"])})
    with ocp.StandardCheckpointer() as ckpt:
        loaded = ckpt.restore(tmp_path / "rows")  # no target: nested dicts of numpy arrays
    moved = place(carry, dst)  # the uninterrupted run: the same arrays, moved in memory

    res = io.restore_rows(CFG, loaded["export"], optimizer=OPT, mesh=dst,
                          weight_spec=SPLIT if dst is not None else None)  # fmt: skip
    assert res.placement.kept == res.placement.placed == live.size, res.placement
    assert res.placement.overflow == 0 and res.sketch_carried
    head = loaded["head"] if dst is None else jax.device_put(loaded["head"],
                                                             NamedSharding(dst, P()))  # fmt: skip
    imported = {"dyn": res.dyn_table, "opt": res.opt_state, "head": jax.tree.map(jnp.asarray, head)}
    assert_bitwise(host(imported), host(moved), "imported")
    if dst is not None:
        assert res.dyn_table.table.sharding.spec == SPLIT
        assert res.opt_state.slots["accumulator"].sharding.spec == SPLIT
        assert_state_split(res.dyn_table.state, dst)

    want, want_outs = on(dst, run, moved, range(BEFORE, BEFORE + AFTER))
    got, got_outs = on(dst, run, imported, range(BEFORE, BEFORE + AFTER))
    assert evictions(want_outs) > 0
    assert_bitwise(got_outs, want_outs, "outputs")
    assert_bitwise(host(got), host(want), "after")


@pytest.mark.parametrize("spec", [P(("data", "model"), None), P("data", "model")],
                         ids=["rows_over_both", "rows_and_hidden"])  # fmt: skip
def test_every_layout_imports_and_exports_the_same_rows(trained, axis_type, spec):
    """Rows split over both axes of a (2, 4) mesh, or rows over one and the hidden dim over
    the other, in Auto and Explicit meshes: the export reads back what the import wrote."""
    _, ex = trained
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)
    res = io.restore_rows(CFG, ex, optimizer=OPT, mesh=mesh, weight_spec=spec)
    assert res.dyn_table.table.sharding.spec == spec
    assert res.opt_state.slots["accumulator"].sharding.spec == spec
    assert_bitwise(io.export_rows(CFG, res.dyn_table, res.opt_state), ex, "round trip")


# --- (c) another capacity ---------------------------------------------------------------------


def by_id(ex):
    """An export as {id: (row vector, accumulator row, last_seen, count)}, numpy."""
    acc = ex.opt_state_rows.slots["accumulator"]
    return {int(i): (ex.rows[n], acc[n], int(ex.metadata.last_seen[n]), int(ex.metadata.count[n]))
            for n, i in enumerate(ex.ids_uint64())}  # fmt: skip


def test_a_larger_table_of_another_seed_holds_every_id_exactly(trained, mesh8):
    carry, ex = trained
    big = DynamicTableConfig(capacity=64, bucket_size=8, seed=11, policy="lru")
    res = io.restore_rows(big, ex, optimizer=OPT, mesh=mesh8, weight_spec=SPLIT)
    n = ex.ids.shape[0]
    assert res.placement.placed == n and res.placement.overflow == 0
    assert not res.sketch_carried  # another seed and shape: admission counts afresh
    assert int(res.opt_state.count) == int(carry["opt"].count)
    rows = np.asarray(D.rows_for(big, res.dyn_table, ex.ids))
    np.testing.assert_array_equal(rows, res.placement.row)
    assert (rows < big.capacity).all()
    buckets = K.bucket_of(ex.ids, big.num_buckets, big.seed)
    np.testing.assert_array_equal(rows // big.bucket_size, buckets)  # re-bucketed
    back = io.export_rows(big, res.dyn_table, res.opt_state)
    want, got = by_id(ex), by_id(back)
    assert got.keys() == want.keys()
    for i, (row, acc, last, count) in want.items():
        np.testing.assert_array_equal(got[i][0], row, err_msg=f"id {i}")
        np.testing.assert_array_equal(got[i][1], acc, err_msg=f"id {i}")
        assert got[i][2:] == (last, count), i
    # Lookups: bags of the exported ids, an unseen id and padding, against float64 sums.
    ids64 = ex.ids_uint64()
    bags = np.full((4, 5), K.EMPTY_ID, np.uint64)
    bags.reshape(-1)[:n] = ids64
    bags[3, 4] = 12345  # never seen: no row, reads zeros
    keys = K.as_keys(bags, check=False)
    lookup = lambda dyn, keys: jaxembed.embedding_bag(D.rows_for(big, dyn, keys), dyn.table,
                                                      combiner="sum")  # fmt: skip
    with jax.set_mesh(mesh8):
        pooled = jax.jit(lookup)(res.dyn_table, keys)  # traced: padding and "no row" read zeros
    vec = dict(zip(ids64.tolist(), ex.rows.astype(np.float64), strict=True))
    want_pooled = [sum((vec.get(int(i), np.zeros(H)) for i in bag), np.zeros(H)) for bag in bags]
    np.testing.assert_allclose(pooled, np.array(want_pooled), rtol=1e-6, atol=1e-7)
    # The same ids given in another order are placed alike.
    perm = np.random.default_rng(0).permutation(n)
    meta = io.RowMetadata(*(a[perm] for a in ex.metadata))
    again = io.placement(big, ex.ids[perm], metadata=meta)
    np.testing.assert_array_equal(again.row, res.placement.row[perm])


def test_a_too_small_table_refuses_or_reports_the_ids_that_do_not_fit(trained):
    _, ex = trained
    small = DynamicTableConfig(capacity=8, bucket_size=4, seed=3, policy="lfu")
    n = ex.ids.shape[0]
    with pytest.raises(ValueError, match=rf"\d+ of {n} ids do not fit .*the first is "
                                         r"ids\[\d+\] = \d+\. Import into a larger capacity "
                                         r"\(e\.g\. capacity=\d+\), or pass overflow='report'"):  # fmt: skip
        io.restore_rows(small, ex, optimizer=OPT)
    res = io.restore_rows(small, ex, optimizer=OPT, overflow="report")
    p = res.placement
    assert p.overflow > 0 and p.placed + p.overflow == n and p.placed <= small.capacity
    np.testing.assert_array_equal(p.overflow_ids, ex.ids[p.overflow_index])
    rows = np.asarray(D.rows_for(small, res.dyn_table, ex.ids))
    np.testing.assert_array_equal(rows, p.row)
    lost = np.zeros(n, bool)
    lost[p.overflow_index] = True
    assert (rows[lost] == small.capacity).all() and (rows[~lost] < small.capacity).all()
    np.testing.assert_array_equal(np.asarray(res.dyn_table.table)[rows[~lost]], ex.rows[~lost])
    np.testing.assert_array_equal(np.asarray(res.opt_state.slots["accumulator"])[rows[~lost]],
                                  ex.opt_state_rows.slots["accumulator"][~lost])  # fmt: skip
    # lfu keeps the most frequently, then most recently seen ids of each full bucket
    bucket = K.bucket_of(ex.ids, small.num_buckets, small.seed)
    rank = lambda i: (-ex.metadata.count[i], -ex.metadata.last_seen[i], *ex.ids[i, ::-1])
    for o in p.overflow_index:
        mates = np.flatnonzero((bucket == bucket[o]) & ~lost)
        assert mates.size == small.bucket_size
        assert all(rank(m) < rank(o) for m in mates), o


# --- (d) hostile input ------------------------------------------------------------------------


def test_hostile_imports_name_the_value_and_the_fix(trained):
    carry, ex = trained
    ids, rows = ex.ids[:4], ex.rows[:4]
    meta = io.RowMetadata(*(a[:4] for a in ex.metadata))
    opt_rows = jax.tree.map(lambda a: a[:4] if np.ndim(a) else a, ex.opt_state_rows)
    ok = dict(opt_state_rows=opt_rows, metadata=meta, optimizer=OPT)
    call = lambda ids=ids, rows=rows, **over: io.import_rows(CFG, ids, rows, **(ok | over))
    with pytest.raises(ValueError, match=r"rows has 3 rows but ids has 4 ids: pass one row per id"):
        call(rows=rows[:3])
    with pytest.raises(ValueError, match=r"rows must be f\[N, H\], .*got shape \[4\]"):
        call(rows=rows[:, 0])
    with pytest.raises(TypeError, match=r"rows must be floats .*got int32 rows"):
        call(rows=np.ones((4, H), np.int32))
    with pytest.raises(ValueError, match=r"opt_state_rows.slots\['accumulator'\] is float32\[4, 5\], "
                                         r"but 4 ids of rows of 4 need \[4, 4\]"):  # fmt: skip
        call(opt_state_rows=opt_rows._replace(slots={"accumulator": np.ones((4, 5), np.float32)}))
    dup = np.concatenate([ids[:3], ids[:1]])
    with pytest.raises(ValueError, match=rf"ids\[3\] = {int(K.to_uint64(ids[0]))} repeats ids\[0\]"
                                         r": .*np.unique"):  # fmt: skip
        call(ids=dup)
    with pytest.raises(ValueError, match=r"ids\[1\] = 18446744073709551615 .* is EMPTY_ID"):
        call(ids=np.array([1, -1, 2, 3], np.int64))
    with pytest.raises(TypeError, match=r"got float64 ids of shape \(4,\)"):
        call(ids=np.arange(4.0))
    with pytest.raises(ValueError, match=r"ids must be one flat list of N ids .*shape \[2, 2\]"):
        call(ids=ids.reshape(2, 2, 2), rows=rows)
    with pytest.raises(ValueError, match=r"metadata.last_seen must be int32\[4\], .*int32\[3\]"):
        call(metadata=meta._replace(last_seen=meta.last_seen[:3]))
    with pytest.raises(ValueError, match=r"metadata.count\[2\] = -5 is outside \[0, 2147483647\]"):
        call(metadata=meta._replace(count=np.array([1, 1, -5, 1], np.int32)))
    with pytest.raises(ValueError, match=r"metadata.row\[2\] = \d+ repeats metadata.row\[0\]"):
        call(metadata=meta._replace(row=meta.row[[0, 1, 0, 3]]))
    with pytest.raises(ValueError, match=r"got opt_state_rows but optimizer=None: pass"):
        call(optimizer=None)
    with pytest.raises(ValueError, match=r"not a state of optimizer 'sgd'"):
        call(optimizer=jaxembed.optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"overflow='drop' must be one of \('raise', 'report'\)"):
        call(overflow="drop")
    with pytest.raises(TypeError, match=r"config must be a DynamicTableConfig, got dict"):
        io.import_rows({"capacity": 16}, ids, rows)
    with pytest.raises(ValueError, match=r"export has no 'rows'"):
        io.restore_rows(CFG, {"ids": ids})
    # export: the table and optimizer state it is given must be this config's
    with pytest.raises(TypeError, match=r"dyn_table must be a DynamicTable .*got tuple"):
        io.export_rows(CFG, tuple(carry["dyn"]))
    with pytest.raises(ValueError, match=r"opt_state.slots\['accumulator'\] has shape \[32, 4\], "
                                         r"but a per-row leaf of this table has 16 rows"):  # fmt: skip
        io.export_rows(CFG, carry["dyn"], OPT.init(jnp.zeros((32, H))))
    with pytest.raises(ValueError, match=r"state.keys is uint32\[16, 2\], but .* needs"):
        io.export_rows(DynamicTableConfig(capacity=32, bucket_size=4), carry["dyn"])
