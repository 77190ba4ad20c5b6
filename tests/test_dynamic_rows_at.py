"""A dynamic table stored in part of a larger table (`rows_at`): a collection's table-wise
stack holds it on one shard beside other tables.

`prepare(..., rows_at=r)` on an `[8·24, H]` stack split over 8 devices (or over model on a
(data 2, model 4) mesh, two replicas a shard), the table from row 76 on, gives what `prepare` gives the table alone on one device, bit for bit: rows,
counts, remap state, and the stack's rows `[r, r + capacity)` and their optimizer state; every
other row of the stack and its state stays as it was. `remap_table` then `reset_optimizer_rows`
and `reset_table_rows` with `rows_at` give the same bits. Bad `rows_at` values are named.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_dynamic_table import INIT, KEY, H, config, stream

import jaxembed
from jaxembed.dynamic import keys as K
from jaxembed.optim import dynamic as D

OPT = jaxembed.optim.adagrad(0.3)
LOCAL, SHARD, OFFSET = 24, 3, 4
ROWS_AT = SHARD * LOCAL + OFFSET  # on (model 8) shard 3's fifth row; on (model 4), shard 1's


def stack_and_state(mesh, capacity):
    """A stack of 8 x 24 rows split over model: other tables' values (random) and the dynamic
    table's (zeros, as a collection starts it), with an adagrad state of the same kinds."""
    rng = np.random.default_rng(0)
    mine = slice(ROWS_AT, ROWS_AT + capacity)
    rows = rng.normal(size=(8 * LOCAL, H)).astype(np.float32)
    acc = rng.uniform(0.2, 1, (8 * LOCAL, H)).astype(np.float32)
    rows[mine], acc[mine] = 0, np.asarray(OPT.init(jnp.zeros((1, H))).slots["accumulator"])
    stack = jax.device_put(jnp.asarray(rows), NamedSharding(mesh, P("model", None)))
    state = OPT.init(stack)
    state = state._replace(slots={"accumulator": jax.device_put(acc, stack.sharding)})
    return stack, state


@pytest.mark.parametrize(
    "policy,shape", [("lru", (8,)), ("lfu", (8,)), ("lfu", (2, 4)), ("ttl", (2, 4))]
)
def test_a_table_inside_a_stack_steps_as_the_table_alone(policy, shape):
    """On (model 8), and on (data 2, model 4) where the stack splits over model and each of
    its row shards has two replicas, both of which must reset the rows."""
    cfg = config(policy)
    mesh = jax.make_mesh(shape, ("data", "model")[-len(shape) :])
    alone = D.init_table(cfg, H)
    alone_state = OPT.init(alone.table)
    stack, stack_state = stack_and_state(mesh, cfg.capacity)
    others = np.ones(8 * LOCAL, bool)
    others[ROWS_AT : ROWS_AT + cfg.capacity] = False
    before = np.asarray(stack)[others], np.asarray(stack_state.slots["accumulator"])[others]
    dyn = D.DynamicTable(stack, D.init_table(cfg, H).state)

    def run(dyn, state, keys, t, rows_at):
        return D.prepare(cfg, dyn, state, keys, t, initializer=INIT, key=KEY, optimizer=OPT,
                         rows_at=rows_at)  # fmt: skip

    one = jax.jit(run, static_argnums=4)
    admitted = 0
    for t, (ids, _) in enumerate(stream()):
        keys = K.as_keys(ids, check=False)
        want_rows, alone, alone_state, want_stats = one(alone, alone_state, keys, t, None)
        rows, dyn, stack_state, stats = one(dyn, stack_state, keys, t, ROWS_AT)
        where = f"{policy} step {t}"
        np.testing.assert_array_equal(rows, want_rows, err_msg=where)
        np.testing.assert_array_equal(stats, want_stats, err_msg=where)
        for a, b in zip(dyn.state, alone.state, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=where)
        mine = slice(ROWS_AT, ROWS_AT + cfg.capacity)
        np.testing.assert_array_equal(np.asarray(dyn.table)[mine], alone.table, err_msg=where)
        np.testing.assert_array_equal(np.asarray(stack_state.slots["accumulator"])[mine],
                                      alone_state.slots["accumulator"], err_msg=where)  # fmt: skip
        np.testing.assert_array_equal(np.asarray(dyn.table)[others], before[0], err_msg=where)
        np.testing.assert_array_equal(np.asarray(stack_state.slots["accumulator"])[others],
                                      before[1], err_msg=where)  # fmt: skip
        assert dyn.table.sharding.spec == P("model", None)
        assert all(a.sharding.is_fully_replicated for a in dyn.state)  # the state whole
        admitted += int(stats.admitted)
    assert admitted > 0


def test_remap_then_reset_with_rows_at_equals_prepare():
    cfg = config("lru")
    mesh = jax.make_mesh((8,), ("model",))
    stack, state = stack_and_state(mesh, cfg.capacity)
    ids, _ = next(stream())
    keys = K.as_keys(ids, check=False)
    fresh = D.init_table(cfg, H).state
    kw = dict(initializer=INIT, key=KEY, rows_at=ROWS_AT)
    check = dict(check_ids=False)
    _, want, want_state, _ = D.prepare(cfg, D.DynamicTable(stack, fresh), state, keys, 0,
                                       optimizer=OPT, **kw, **check)  # fmt: skip
    _, dyn, reset, _ = D.remap_table(cfg, D.DynamicTable(stack, fresh), keys, 0, **kw, **check)
    got_state = D.reset_optimizer_rows(cfg, dyn.table, OPT, state, reset, rows_at=ROWS_AT)
    np.testing.assert_array_equal(dyn.table, want.table)
    jax.tree.map(np.testing.assert_array_equal, got_state, want_state)
    # the Linen path: the stored (unreset) stack and state reset from the rows, key and step
    table, again = D.reset_table_rows(cfg, stack, OPT, state, reset, 0, **kw)
    np.testing.assert_array_equal(table, want.table)
    jax.tree.map(np.testing.assert_array_equal, again, want_state)


def test_bad_rows_at_names_the_value():
    cfg = config("lru")
    table = D.DynamicTable(jnp.zeros((20, H)), D.init_table(cfg, H).state)
    keys = K.as_keys(np.array([1, 2], np.int64))
    kw = dict(initializer=INIT, key=KEY, optimizer=None)
    for bad in (True, 1.5, "4"):
        with pytest.raises(TypeError, match=f"rows_at={bad!r} must be an int"):
            D.prepare(cfg, table, None, keys, 0, rows_at=bad, **kw)
    with pytest.raises(ValueError, match="rows_at=-1 must be >= 0"):
        D.prepare(cfg, table, None, keys, 0, rows_at=-1, **kw)
    with pytest.raises(ValueError, match=r"rows_at=5 \+ capacity=16 is past the 20 rows"):
        D.prepare(cfg, table, None, keys, 0, rows_at=5, **kw)
