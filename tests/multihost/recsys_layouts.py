"""Run by tests/test_multihost.py under `python -m jaxembed.launch --processes 2`.

Bags across two processes: a sum-pooled `embedding_bag` and its row-sparse
`rowwise_adagrad` update, for each table layout that splits rows, each exchange and each
kernel implementation, on a (data=2, model=4) mesh whose `data` axis spans the processes.
Each process checks the pooled output, the updated table and the optimizer state shards it
holds against the float64 reference. Prints `OK <layout> <exchange> <impl> process <i>`.
Then a collection of four tables in each of `COLLECTIONS`' placements and exchanges
(table-wise, each feature's ids sent to the one device that holds its table; mod rows routed
and pooled at the source or at the owner; block rows gathered), over both processes' devices,
checked the same way with the slots the counters say each device pooled; prints
`COLLECTION OK <name> <impl> process <i>`.
"""

import sys

from jaxembed.launch import initialize

initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxembed  # noqa: E402
from jaxembed.kernels import native  # noqa: E402
from jaxembed.optim import reference  # noqa: E402

# name: (table, ids and output gradient, exchanges)
LAYOUTS = {
    "rows": (P("model", None), P("data"), ("rows",)),
    "rows-over-data-model": (P(("data", "model"), None), P("data"), ("rows", "routed")),
    "fully-sharded": (P(("data", "model"), None), P(("data", "model")), ("rows", "routed")),
    "replicated-table": (P(), P("data"), ("rows",)),
}


def global_array(value, mesh, spec):
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def check_shards(array, want, what):
    for shard in array.addressable_shards:
        np.testing.assert_allclose(
            np.asarray(shard.data), want[shard.index], rtol=1e-5, atol=1e-6, err_msg=what
        )


def main() -> int:
    assert jax.process_count() == 2, jax.process_count()
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(
        np.array(devices).reshape(2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2
    )
    rng = np.random.default_rng(0)  # the same global arrays on every process
    vocab, hidden, batch, slots = 64, 8, 16, 6
    table = rng.normal(size=(vocab, hidden)).astype(np.float32)
    ids = rng.integers(0, vocab, size=(batch, slots)).astype(np.int32)
    ids[rng.random(ids.shape) < 0.3] = -1  # empty slots
    ids[:, 0] = 7  # a duplicate in every bag
    ct = rng.normal(size=(batch, hidden)).astype(np.float32)
    valid = ids >= 0
    ref_out = (np.where(valid[..., None], table[np.where(valid, ids, 0)], 0)).sum(1)
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    state0 = tuple(
        np.asarray(s, np.float64) for s in reference.init_states(opt.formula, vocab, hidden)
    )
    slot_grads = np.broadcast_to(ct[:, None, :], (*ids.shape, hidden))  # sum pooling
    ref_table, ref_states = reference.sparse_step(
        opt.formula, table, state0, ids, slot_grads, count=0
    )
    impls = ("xla", "native") if native.available() else ("xla",)
    for name, (w_spec, x_spec, exchanges) in LAYOUTS.items():
        for exchange in exchanges:
            for impl in impls:
                kw = dict(combiner="sum", exchange=exchange, impl=impl, mesh=mesh)

                def step(t, s, i, c, kw=kw):
                    out = jaxembed.embedding_bag(i, t, **kw)
                    t, s = opt.update(t, s, i, c, **kw)
                    return out, t, s

                t = global_array(table, mesh, w_spec)
                s = opt.init(t)
                i = global_array(ids, mesh, x_spec)
                c = global_array(ct, mesh, x_spec)
                out, new, state = jax.jit(step, donate_argnums=(0, 1))(t, s, i, c)
                what = f"{name} {exchange} {impl}"
                check_shards(out, ref_out, f"{what} out")
                check_shards(new, ref_table, f"{what} table")
                (accumulator,) = state.slots.values()
                check_shards(accumulator, ref_states[0], f"{what} state")
                assert new.sharding.is_equivalent_to(NamedSharding(mesh, w_spec), 2), new.sharding
                print(f"OK {name} {exchange} {impl} process {jax.process_index()}", flush=True)
    for impl in impls:
        for name in COLLECTIONS:
            collection(mesh, impl, name)
    return 0


# name: (placement, row_sharding, exchange, routed_pool)
COLLECTIONS = {
    "tablewise": ("table", "block", "auto", "auto"),
    "mod-routed": ("rows", "mod", "routed", "source"),
    "mod-routed-owner-pooled": ("rows", "mod", "routed", "owner"),
    "mod-routed-sized": ("rows", "mod", "routed:source:0.6", "auto"),  # a plan's: C = 3
    "block-gathered": ("rows", "block", "auto", "auto"),
}


def collection(mesh, impl, name):
    """Four tables read by five pooled features on the 8 devices of two processes, placed and
    exchanged as `COLLECTIONS[name]` says (table-wise: each feature's ids sent to the one
    device that holds its table; mod rows routed, pooled at the source or at the owner, or
    at the source with a plan's capacity factor; block rows gathered): outputs, updated
    tables and accumulators against float64."""
    from jaxembed.collection import (
        FeatureConfig,
        TableConfig,
        collection_lookup,
        collection_update,
        layout_collection,
    )  # fmt: skip

    placement, row_sharding, exchange, routed_pool = COLLECTIONS[name]
    rng = np.random.default_rng(1)
    rows, hidden, batch, width = (40, 24, 9, 5), 8, 16, 3
    tables = [
        TableConfig(f"t{i}", r, hidden, placement=placement, row_sharding=row_sharding)
        for i, r in enumerate(rows)
    ]
    features = [FeatureConfig(f"f{i}", f"t{i % 4}", max_ids=width) for i in range(5)]
    layout = layout_collection(tables, features, mesh)
    (stack,) = layout.stacks
    host = {t.name: rng.normal(size=(t.vocab_size, hidden)).astype(np.float32) for t in tables}
    full = np.zeros(stack.shape, np.float32)
    gid = {}
    for t in tables:
        p = layout.placement(t.name)
        gid[t.name] = p.stack_ids(np.arange(t.vocab_size, dtype=np.int32), stack.local_rows)
        full[gid[t.name]] = host[t.name]
    ids = {f.name: rng.integers(-1, layout.table(f.table).vocab_size, (batch, width)).astype(
        np.int32) for f in features}  # fmt: skip
    ids["f0"][:, 0] = 0  # every table's row 0 is hot: a duplicate in every bag of f0
    cts = {f.name: rng.normal(size=(batch, hidden)).astype(np.float32) for f in features}
    spec = P(("data", "model"))
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    kw = dict(impl=impl, exchange=exchange, routed_pool=routed_pool)

    def step(stacks, states, batch_, cts_):
        out, stats = collection_lookup(layout, stacks, batch_, return_stats=True, **kw)
        stacks, states = collection_update(layout, opt, stacks, states, batch_, cts_, **kw)
        return out, stacks, states, stats

    stacks = {0: global_array(full, mesh, stack.spec)}
    with jax.set_mesh(mesh):
        states = {0: opt.init(stacks[0])}
        batch_ = {k: global_array(v, mesh, spec) for k, v in ids.items()}
        cts_ = {k: global_array(v, mesh, spec) for k, v in cts.items()}
        out, new, state, stats = jax.jit(step)(stacks, states, batch_, cts_)
    want_table, want_acc = full.astype(np.float64), np.zeros(stack.shape[0])
    for t in tables:
        slots, grads = [], []
        for f in features:
            if f.table == t.name:
                x = ids[f.name]
                slots.append(np.where(x >= 0, x, -1))
                grads.append(np.broadcast_to(cts[f.name][:, None], (*x.shape, hidden)))
        x, g = np.concatenate(slots, 1), np.concatenate(grads, 1)
        state0 = reference.init_states(opt.formula, t.vocab_size, hidden)
        tab, (acc,) = reference.sparse_step(opt.formula, host[t.name], state0, x, g, count=0)
        want_table[gid[t.name]], want_acc[gid[t.name]] = tab, acc
    for f in features:
        x = ids[f.name]
        ref = np.where((x >= 0)[..., None], host[f.table][np.maximum(x, 0)], 0).sum(1)
        check_shards(out[f.name], ref, f"{name} {impl} {f.name}")
    check_shards(new[0], want_table, f"{name} {impl} table")
    check_shards(state[0].slots["accumulator"], want_acc, f"{name} {impl} state")
    assert new[0].sharding.is_equivalent_to(NamedSharding(mesh, stack.spec), 2), new[0].sharding
    (st,) = stats.values()
    # The slots each device walked, from the counters: table-wise, its owned features' slots
    # (F_o of them per bag, padded alike on every device); routed, its own; gathered, all.
    walked = np.asarray(multihost_utils.process_allgather(st.slots, tiled=True))
    per_owner = max(sum(f.table == t.name for f in features) for t in tables)
    want = {
        "tablewise": batch * per_owner * width,
        "block-gathered": batch * width * len(features),
        "mod-routed": batch // 8 * width * len(features),
    }.get(name)
    if name == "mod-routed-sized":  # 3 places an owner: routed, or (overflowing) gathered
        routed, gathered = batch // 8 * width * len(features), batch * width * len(features)
        want = routed if walked.tolist() == [routed] * 8 else gathered
    if name == "mod-routed-owner-pooled":
        # Each owner walks what it received (8 sources' capacities) and reads each slot that
        # names a row once.
        reads = np.asarray(multihost_utils.process_allgather(st.rows, tiled=True))
        assert reads.sum() == sum(int((x >= 0).sum()) for x in ids.values()), (name, reads)
        want = walked[0]
    assert walked.tolist() == [want] * 8, (name, walked, want)
    print(f"COLLECTION OK {name} {impl} process {jax.process_index()}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
