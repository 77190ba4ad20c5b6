"""Bags of raw 64-bit ids (`jaxembed.dynamic.RaggedKeys`) for a dynamic table's feature.

The collection of `test_dynamic_collection.py` with its history feature given as ragged bags
(the dense stream's bags without their padding, and garbage ids past each block's total) trains
like the pure-Python remap and the float64 twin, with the user rows over 8 devices, in the
functional path and the NNX collection. A weighted `mean` feature gives what the same bags
padded densely give. `RaggedKeys` packs, checks and converts like `jaxembed.Ragged`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from test_dynamic_collection import (
    FEATURES,
    ITEM_INIT,
    OPT,
    LinenNet,
    Net,
    Twin,
    check_user_rows,
    head_optimizer,
    initial_head,
    make_step,
    nnx_step,
    stream,
    tables,
)
from test_dynamic_table import BAGS, KEY, H, config

import jaxembed
import jaxembed.nnx
from jaxembed.collection import FeatureConfig, TableConfig, layout_collection
from jaxembed.dynamic import EMPTY_ID, RaggedKeys
from jaxembed.dynamic import keys as K
from jaxembed.dynamic.config import DynamicState
from jaxembed.dynamic.ragged import in_bag_keys, to_ragged
from jaxembed.kernels.collection import collection_lookup, collection_update
from jaxembed.nn.stacks import build_stack
from jaxembed.optim import dynamic_collection as DC

GARBAGE = 5  # slots past the bags' total, holding real ids the remap must not count


def ragged(hist: np.ndarray, seed: int) -> RaggedKeys:
    """The dense history `[B, L]` (int64, -1 padding) as ragged bags, ids past the total."""
    bags = [[int(i) for i in row if i != -1] for row in hist]
    r = RaggedKeys.from_lists(bags, capacity=hist.size + GARBAGE)
    keys = np.array(r.keys)
    total = int(np.asarray(r.lengths).sum())
    rng = np.random.default_rng(seed)
    keys[total:] = K.keys_to_host(rng.integers(0, 2**62, keys.shape[0] - total, np.int64))
    return RaggedKeys(keys, r.lengths)


def batch_of(raw: dict, t: int) -> dict:
    return {
        "user_hist": ragged(raw["user_hist"], t),
        "user_now": ragged(raw["user_now"], t + 100),  # one form a table (one update a row)
        "item": jnp.asarray(raw["item"]),
    }


def placed_stacks(layout, mesh):
    stacks = {}
    for s in layout.stacks:
        if s.tables == ("item",):
            stacks[s.index] = build_stack(layout, s, {"item": ITEM_INIT})
        else:
            stacks[s.index] = jnp.zeros(s.shape, jnp.float32)
        if mesh is not None:
            stacks[s.index] = jax.device_put(stacks[s.index], NamedSharding(mesh, s.spec))
    return stacks


def check_remap(remap, twin, where):
    for name in DynamicState._fields:
        np.testing.assert_array_equal(
            getattr(remap, name), getattr(twin.state, name), err_msg=f"{where}: {name}"
        )


# With the user rows over 8 devices (on one device, the dynamic collection trains like the
# references in tests/test_dynamic_collection.py, and ragged bags pool in tests/test_ragged.py).
@pytest.mark.parametrize("devices", [8])
def test_ragged_bags_of_a_dynamic_table_train_like_the_references(devices):
    cfg = config("lfu")
    mesh = jax.make_mesh((8,), ("model",)) if devices == 8 else None
    layout = layout_collection(tables("rows", cfg), FEATURES, mesh)
    user = layout.stack_of("user")
    stacks = placed_stacks(layout, mesh)
    states = {s.index: OPT.init(stacks[s.index], mesh=mesh, weight_spec=s.spec)
              for s in layout.stacks}  # fmt: skip
    remaps = DC.init_states(layout, mesh=mesh)
    head = initial_head(mesh)
    twin = Twin(cfg, [t.name for t in layout.tables].index("user"))
    step, totals = make_step(layout, mesh), np.zeros(6, int)
    for t, (raw, y) in enumerate(stream()):
        stacks, states, remaps, head, loss, stats, outs = step(
            stacks, states, remaps, head, batch_of(raw, t), jnp.asarray(y), jnp.int32(t)
        )
        refs, want_outs, want_loss = twin.step(raw, y, t)
        where = f"ragged {devices} step {t}"
        check_remap(remaps["user"], twin, where)
        want_stats = np.sum([np.array(r.stats) for r in refs], 0)
        want_stats[-1] = 0  # reserved: the dense padding is no slot of a bag here, nor are
        # the garbage slots past the total
        np.testing.assert_array_equal([int(x) for x in stats["user"]], want_stats, where)
        for f in FEATURES:
            np.testing.assert_allclose(outs[f.name], want_outs[f.name], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{where}: {f.name}")  # fmt: skip
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=where)
        check_user_rows(twin, stacks[user.index], states[user.index], where)
        totals += want_stats
    hits, admitted, evicted, _, pending, _ = totals
    assert hits > 0 and admitted > 0 and evicted > 0 and pending > 0, totals


def test_the_nnx_collection_takes_ragged_bags_of_a_dynamic_table():
    cfg = config("lfu")
    mesh = jax.make_mesh((8,), ("model",))
    net = Net(tables("rows", cfg), mesh)
    dense = head_optimizer(net, mesh)
    sparse = jaxembed.nnx.SparseOptimizer(net, OPT)
    twin = Twin(cfg, [t.name for t in net.coll.layout.tables].index("user"))
    user = net.coll.layout.stack_of("user")
    for t, (raw, y) in enumerate(stream()):
        loss = nnx_step(net, dense, sparse, batch_of(raw, t), jnp.asarray(y))
        _, _, want_loss = twin.step(raw, y, t)
        where = f"nnx ragged step {t}"
        check_remap(net.coll.remaps["user"].get_value(), twin, where)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=where)
        check_user_rows(twin, net.coll.stacks[user.name][...], sparse.states["coll"][user.index],
                        where)  # fmt: skip
    net.eval()  # evaluation reads ragged bags too
    out = net.coll(batch_of(raw, 0))
    assert out["user_hist"].shape == (BAGS, H)


@pytest.mark.slow  # heavy; what it checks is covered by the quicker tests beside it
def test_weighted_mean_ragged_bags_equal_the_same_bags_padded_densely():
    """`mean` over the ids that got a row: the ragged path drops a no-row slot from its bag,
    the dense path reads it as padding; both must give the same outputs, table and state."""
    cfg = config("lru")
    features = (FeatureConfig("hist", "user", combiner="mean", max_ids=3),)
    mesh = jax.make_mesh((8,), ("model",))
    layout = layout_collection([TableConfig("user", cfg.capacity, H, dynamic=cfg)], features,
                               mesh)  # fmt: skip
    (stack,) = layout.stacks

    def run(make_input):
        table = jax.device_put(jnp.zeros(stack.shape), NamedSharding(mesh, stack.spec))
        stacks, states = {0: table}, {0: OPT.init(table, mesh=mesh, weight_spec=stack.spec)}
        remaps, outs = DC.init_states(layout, mesh=mesh), []
        for t, (raw, _) in enumerate(stream(seed=3)):
            hist = raw["user_hist"]
            w = np.random.default_rng(t).uniform(0.5, 2, hist.shape).astype(np.float32)
            batch = {"hist": make_input(hist, w)}
            batch, stacks, states, remaps, _ = DC.prepare(
                layout, stacks, states, remaps, batch, jnp.int32(t), key=KEY, optimizer=OPT,
                mesh=mesh, check_ids=False,
            )  # fmt: skip
            out = collection_lookup(layout, stacks, batch, mesh=mesh)
            g = {"hist": jnp.cos(out["hist"])}
            stacks, states = collection_update(layout, OPT, stacks, states, batch, g, mesh=mesh)
            outs.append(np.asarray(out["hist"]))
        return outs, stacks, states, remaps

    def dense(hist, w):
        return K.as_keys(hist, check=False), jnp.asarray(np.where(hist == -1, 0, w))

    def bags(hist, w):
        keep = hist != -1
        r = RaggedKeys.from_lists(
            [row[k] for row, k in zip(hist, keep, strict=True)],
            weights=[row[k] for row, k in zip(w, keep, strict=True)],
        )
        return r  # fmt: skip

    want, got = run(dense), run(bags)
    for t, (a, b) in enumerate(zip(want[0], got[0], strict=True)):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7, err_msg=f"step {t}")
    np.testing.assert_allclose(got[1][0], want[1][0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got[2][0].slots["accumulator"], want[2][0].slots["accumulator"],
                               rtol=1e-6)  # fmt: skip
    jax.tree.map(np.testing.assert_array_equal, got[3], want[3])
    assert np.any(np.asarray(got[1][0]) != 0)  # rows were admitted and trained


def test_ragged_keys_pack_convert_and_compact():
    big = [2**63 + 5, 2**40, 7]
    r = RaggedKeys.from_lists([[big[0], big[1]], [], [big[2]], [big[1]]], blocks=2,
                              capacity=4, weights=[[1.0, 2.0], [], [3.0], [4.0]])  # fmt: skip
    assert r.lead_shape == (2,) and r.num_bags == 2 and r.capacity == 4
    assert r.to_lists() == [[big[0], big[1]], [], [big[2]], [big[1]]]
    assert jax.jit(lambda r: r)(r).to_lists() == r.to_lists()  # a pytree
    # past the total the remap sees EMPTY_ID, whatever the slot holds
    np.testing.assert_array_equal(K.to_uint64(in_bag_keys(r))[0, 2:], [EMPTY_ID] * 2)
    # to_ragged drops no-row slots from their bags, keeping order and weights
    rows = jnp.array([[3, -1, 9, 9], [-1, 4, 9, 9]], jnp.int32)
    out = to_ragged(r, rows)
    assert out.to_lists(with_weights=True) == ([[3], [], [], [4]], [[1.0], [], [], [4.0]])
    # a numpy compaction of a random batch
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 4, (3, 5))
    r = RaggedKeys(rng.integers(0, 2**32, (3, 16, 2), np.uint64).astype(np.uint32), lengths)
    rows = rng.integers(-1, 6, (3, 16)).astype(np.int32)
    want, at = [], 0
    for i in range(3):
        at = 0
        for n in lengths[i]:
            want.append([int(x) for x in rows[i, at : at + n] if x >= 0])
            at += n
    assert jax.jit(to_ragged)(r, jnp.asarray(rows)).to_lists() == want


def test_bad_ragged_keys_name_the_value_and_the_fix():
    with pytest.raises(TypeError, match="64-bit integer ids, got float32"):
        RaggedKeys(jnp.zeros((4,), jnp.float32), jnp.array([4]))
    with pytest.raises(ValueError, match="hold 5 ids but x's capacity"):
        RaggedKeys(np.arange(4, dtype=np.int64), np.array([2, 3]))
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        RaggedKeys(np.arange(4, dtype=np.int64), np.array([2, -1]))
    with pytest.raises(ValueError, match=r"weights \(3,\) must have the shape of values"):
        RaggedKeys(np.arange(4, dtype=np.int64), np.array([2, 2]), jnp.ones(3))
    with pytest.raises(ValueError, match="does not fit 64 bits"):
        RaggedKeys.from_lists([[2**64]])
    # a static table's Ragged of int32 ids is refused for a dynamic feature, naming the form
    cfg = config("lru")
    layout = layout_collection([TableConfig("user", cfg.capacity, H, dynamic=cfg)],
                               [FeatureConfig("hist", "user", max_ids=3)], None)  # fmt: skip
    with pytest.raises(TypeError, match=r"jaxembed\.dynamic\.RaggedKeys"):
        DC.read_rows(layout, DC.init_states(layout), {"hist": jaxembed.Ragged.from_lists([[1]])})


@pytest.mark.slow  # 50 s; the NNX collection's ragged test above runs the same kernels
def test_the_linen_collection_reads_ragged_bags_as_the_same_bags_padded_densely():
    cfg = config("lfu")
    model = LinenNet(tuple(tables("rows", cfg)))
    with jax.set_mesh(jax.make_mesh((8,), ("model",))):
        runs = []
        for form in ("dense", "ragged"):
            batches = [
                (
                    batch_of(raw, t)
                    if form == "ragged"
                    else {
                        n: K.as_keys(v, check=False) if n != "item" else jnp.asarray(v)
                        for n, v in raw.items()
                    }
                )
                for t, (raw, _) in enumerate(stream())
            ]
            variables = model.init(jax.random.key(0), batches[0])  # fmt: skip
            params, dyn = variables["params"], variables["dynamic"]
            apply = jax.jit(lambda p, d, b: model.apply({"params": p, "dynamic": d}, b,
                                                        mutable=["dynamic"]))  # fmt: skip
            outs = []
            for batch in batches:
                out, upd = apply(params, dyn, batch)
                dyn = upd["dynamic"]
                outs.append(np.asarray(out))
            runs.append((outs, jax.tree.map(np.asarray, dyn)))
    (want, want_dyn), (got, got_dyn) = runs
    for t, (a, b) in enumerate(zip(want, got, strict=True)):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7, err_msg=f"step {t}")
    for name in DynamicState._fields:
        np.testing.assert_array_equal(getattr(got_dyn["coll"]["remap_user"], name),
                                      getattr(want_dyn["coll"]["remap_user"], name))  # fmt: skip
    assert np.any(want[-1] != want[0])  # the rows were admitted and read
