"""The routed remap: a dynamic table's rows over 8 devices, the batch split over the same axis,
each id sent to its owner (`jaxembed.kernels.remap_routed`).

For each policy and remap engine, six training steps (`prepare`, a sum bag, adagrad) on a
drifting stream equal one device's steps bit for bit (rows, counts, remap state, table,
optimizer state), and the remap's decisions equal the pure-Python policy. A batch whose ids
all belong to one shard overflows the places and runs the gather exchange, still exact. The
program holds the `all-to-all`s, and no table-sized collective.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_dynamic_table import INIT, KEY, NATIVE, SPREAD, H

import jaxembed
from jaxembed.dynamic import DynamicTableConfig
from jaxembed.dynamic import keys as K
from jaxembed.dynamic import reference as R
from jaxembed.dynamic.config import DynamicState
from jaxembed.kernels import remap_routed
from jaxembed.optim import dynamic as D

BAGS, L, STEPS = 16, 3, 6
OPT = jaxembed.optim.adagrad(0.3)
CONFIGS = {
    "lru": dict(policy="lru"),
    "lfu": dict(policy="lfu", admit_after=2, sketch_depth=2, sketch_width=64, sketch_window=40),
    "ttl": dict(policy="ttl", ttl_steps=1),
}
IMPLS = ("xla", "native") if NATIVE else ("xla",)
# Every policy on the default remap engine (native where built); XLA's engine once, with ttl
# (its refusals), where the native one runs (its policies against the reference on one device
# and split by rows: tests/test_dynamic_remap.py and tests/test_dynamic_table.py).
ROUTED_CASES = [(p, IMPLS[-1]) for p in ("lru", "lfu", "ttl")] + (
    [("ttl", "xla")] if NATIVE else []
)


def config(policy):
    return DynamicTableConfig(capacity=64, bucket_size=2, seed=5, **CONFIGS[policy])


def stream(seed=0, owner=None, cfg=None, bags=BAGS):
    """Batches [BAGS, L] of int64 ids from a drifting window, some padding (-1); with `owner`,
    only ids whose bucket lies on that shard of 8 (every slot of every device to one owner)."""
    rng = np.random.default_rng(seed)
    for t in range(STEPS):
        raw = (6 * t + rng.integers(0, 60, (bags, L))).astype(np.uint64)
        ids = (raw * SPREAD).view(np.int64)
        if owner is not None:
            pool = (np.arange(4000, dtype=np.uint64) * SPREAD).view(np.int64)
            own = K.owner_of(K.keys_to_host(pool), cfg.num_buckets, 8, cfg.seed) == owner
            ids = pool[own][rng.integers(0, 40, (bags, L))]
        ids[rng.random((bags, L)) < 0.15] = -1
        yield ids


def make_step(cfg, impl):
    def step(dyn, opt_state, keys, t):
        rows, dyn, opt_state, stats = D.prepare(cfg, dyn, opt_state, keys, t, initializer=INIT,
                                                key=KEY, optimizer=OPT, impl=impl)  # fmt: skip
        pooled = jaxembed.embedding_bag(rows, dyn.table, combiner="sum")
        g = jnp.cos(pooled)  # any function of the pooled values: the gradient of sum(sin)
        table, opt_state = OPT.update(dyn.table, opt_state, rows, g, combiner="sum",
                                      after=pooled)  # fmt: skip
        return dyn._replace(table=table), opt_state, rows, pooled, stats

    return jax.jit(step, donate_argnums=(0, 1))


def run_both(cfg, impl, batches):
    """Yields (step, one device's outputs, the routed 8 devices' outputs, the compiled text)."""
    mesh = jax.make_mesh((8,), ("model",))
    one, split = make_step(cfg, impl), make_step(cfg, impl)
    dyn1 = D.init_table(cfg, H)
    st1 = OPT.init(dyn1.table)
    dyn8 = D.init_table(cfg, H, mesh=mesh, weight_spec=P("model", None))
    st8 = OPT.init(dyn8.table)
    for t, ids in enumerate(batches):
        keys = K.as_keys(ids, check=False)
        placed = jax.device_put(keys, NamedSharding(mesh, P("model")))  # the batch over model
        text = split.lower(dyn8, st8, placed, jnp.int32(t)).compile().as_text() if t == 0 else ""
        dyn1, st1, *want = one(dyn1, st1, keys, jnp.int32(t))
        dyn8, st8, *got = split(dyn8, st8, placed, jnp.int32(t))
        assert got[0].sharding.spec[0] == "model"  # the rows come back where the ids are
        yield t, (dyn1, st1, *want), (dyn8, st8, *got), text


def same(got, want, where):
    """Integers (rows, counts, the remap state) bit for bit; floats (the table, the pooled
    bags, adagrad's state: summed in another order over 8 devices) to float32 rounding."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if jnp.issubdtype(a.dtype, jnp.floating):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=where)
        else:
            np.testing.assert_array_equal(a, b, err_msg=where)


@pytest.mark.parametrize(("policy", "impl"), ROUTED_CASES)
def test_the_routed_remap_equals_one_device_and_the_reference(policy, impl):
    cfg = config(policy)
    ref_state, totals = R.init_state(cfg), np.zeros(6, int)
    batches = list(stream())
    for t, want, got, text in run_both(cfg, impl, batches):
        if text:
            assert "all-to-all" in text  # the ids go to their owners, the rows come back
            for shape, op in re.findall(r"= (\S+) (all-\S+|reduce-scatter)\(", text):
                dims = [int(d) for d in re.findall(r"\d+", shape.split("{")[0].split("[")[1])]
                assert np.prod(dims) <= 8 * BAGS * L * 2 or shape.startswith("f32"), (shape, op)
        same(got, want, f"{policy}/{impl} step {t}")
        ref = R.step(cfg, ref_state, batches[t], t)
        ref_state = ref.state
        np.testing.assert_array_equal(got[2], ref.rows, err_msg=f"step {t}: id -> row")
        assert tuple(int(x) for x in got[4]) == tuple(ref.stats), t
        for name in DynamicState._fields:
            np.testing.assert_array_equal(getattr(got[0].state, name), getattr(ref_state, name))
        totals += np.array(ref.stats)
    hits, admitted, evicted, refused, _, reserved = totals
    assert hits > 0 and admitted > 0 and evicted > 0 and refused > 0 and reserved > 0, totals


# The default engine: the gather exchange it falls back to is the one of a table split by rows
# (tests/test_dynamic_table.py, both engines).
@pytest.mark.parametrize("impl", IMPLS[-1:])
def test_a_batch_for_one_owner_overflows_into_the_gather_exchange_exactly(impl):
    cfg = config("lru")
    batches = list(stream(seed=2, owner=3, cfg=cfg, bags=128))
    m = 128 * L // 8
    assert 0.7 * m > remap_routed.capacity(m, 8)  # each device's slots overflow one owner
    for t, want, got, _ in run_both(cfg, impl, batches):
        same(got, want, f"{impl} step {t}")
    assert int(np.asarray(got[4].admitted)) >= 0


def test_routes_keep_slot_order_and_flag_overflow():
    keys = K.as_keys((np.arange(40, dtype=np.uint64) * SPREAD).view(np.int64))
    keys = keys.at[7].set(jnp.uint32(K.EMPTY_HALF))  # padding goes nowhere
    nb, n, seed = 32, 4, 5
    owner = np.asarray(K.owner_of(np.asarray(keys), nb, n, seed))
    r = remap_routed.route(keys, nb, n, seed, c=40)
    assert int(r.owner[7]) == n and not bool(r.overflow)
    for j in range(n):
        mine = [i for i in range(40) if i != 7 and owner[i] == j]
        np.testing.assert_array_equal(np.asarray(r.pos)[mine], np.arange(len(mine)))
        np.testing.assert_array_equal(r.send[j, : len(mine)], keys[np.array(mine)])
        assert K.is_reserved(np.asarray(r.send[j, len(mine) :])).all()
    small = remap_routed.route(keys, nb, n, seed, c=2)
    assert bool(small.overflow)


def test_an_empty_batch_split_over_the_rows_changes_nothing():
    cfg = config("lfu")
    mesh = jax.make_mesh((8,), ("model",))
    dyn = D.init_table(cfg, H, mesh=mesh, weight_spec=P("model", None))
    for shape in [(0, L), (8, 0)]:
        keys = jax.device_put(jnp.zeros((*shape, 2), jnp.uint32), NamedSharding(mesh, P("model")))
        rows, after, _, stats = D.prepare(cfg, dyn, None, keys, 0, initializer=INIT, key=KEY,
                                          optimizer=None, check_ids=False)  # fmt: skip
        assert rows.shape == shape and [int(x) for x in stats] == [0] * 6
        for a, b in zip(after.state, dyn.state, strict=True):
            np.testing.assert_array_equal(a, b)
