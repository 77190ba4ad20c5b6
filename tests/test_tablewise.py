"""Table-wise lookups and updates: a table placed `"table"` is looked up only on its device.

A collection's features whose tables are each whole on one shard go, as ids, to that device
alone in one `all_to_all`, are pooled there, and come back in another
(`jaxembed.kernels.tablewise`); a stack that also holds row-split tables makes a second call
for those. Checked on 8 CPU devices against float64 numpy: the pooled outputs, the tables'
gradients under `jax.grad`, and a row-wise Adagrad update (table and accumulator); the
compiled program's collectives are all-to-alls only, and their bytes are the planner's; the
counters say each device walked `B · F_o · L` slots; the layout gives each table to the
shard with the fewest slots.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bag_reference import embedding_bag_grad_reference, embedding_bag_reference
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed
from jaxembed import hlo
from jaxembed.collection import (
    FeatureConfig,
    TableConfig,
    collection_lookup,
    collection_update,
    layout_collection,
)
from jaxembed.optim import reference
from jaxembed.plan.collection import plan_collection

B, H, L = 32, 8, 4
ROWS = {"t0": 300, "t1": 120, "t2": 64, "t3": 50, "t4": 10, "big": 203}
COMBINERS = ("sum", "mean", "sqrtn", "sum", "mean", "sum", "sqrtn")


def _configs(with_rows_table, combiners=COMBINERS):
    tables = [TableConfig(n, r, H, placement="table") for n, r in ROWS.items() if n != "big"]
    features = [FeatureConfig(f"f{i}", f"t{i % 5}", combiner=c, max_ids=L)
                for i, c in enumerate(combiners)]  # fmt: skip
    if with_rows_table:
        tables.append(TableConfig("big", ROWS["big"], H, placement="rows"))
        features.append(FeatureConfig("g", "big", combiner="mean", max_ids=L))
    return tables, features


def _setup(with_rows_table=True, weighted=False, seed=0, combiners=COMBINERS):
    mesh = jax.make_mesh((8,), ("x",))
    tables, features = _configs(with_rows_table, combiners)
    layout = layout_collection(tables, features, mesh)
    rng = np.random.default_rng(seed)
    host = {t.name: rng.normal(size=(t.vocab_size, H)).astype(np.float32) for t in tables}
    stacks = {}
    for s in layout.stacks:
        a = np.zeros(s.shape, np.float32)
        for t in s.tables:
            p = layout.placement(t)
            a[p.stack_ids(np.arange(p.vocab_size, dtype=np.int32), s.local_rows)] = host[t]
        stacks[s.index] = jax.device_put(a, NamedSharding(mesh, s.spec))
    batch, ref_in = {}, {}
    for i, f in enumerate(features):
        x = rng.integers(0, ROWS[f.table], (B, L)).astype(np.int32)
        x[rng.random((B, L)) < 0.3] = -1
        x[3] = -1  # an empty bag
        x[4, :3] = x[4, 0] if x[4, 0] >= 0 else 1  # duplicates
        put = NamedSharding(mesh, P("x", None))
        if weighted and i == 0:
            w = rng.uniform(0.5, 2.0, (B, L)).astype(np.float32)
            batch[f.name] = (jax.device_put(x, put), jax.device_put(w, put))
            ref_in[f.name] = (x, w)
        else:
            batch[f.name], ref_in[f.name] = jax.device_put(x, put), (x, None)
    return mesh, layout, features, host, stacks, batch, ref_in


def _read(layout, stacks, name):
    p = layout.placement(name)
    s = layout.stacks[p.stack]
    rows = p.stack_ids(np.arange(p.vocab_size, dtype=np.int32), s.local_rows)
    return np.asarray(stacks[p.stack])[rows]


def _reference(features, host, ref_in, cts):
    out, grads = {}, {n: np.zeros_like(t, np.float64) for n, t in host.items()}
    for f in features:
        t = np.asarray(host[f.table], np.float64)
        x, w = ref_in[f.name]
        out[f.name] = embedding_bag_reference(t, x, combiner=f.combiner, per_id_weights=w)
        grads[f.table] += embedding_bag_grad_reference(
            t, x, combiner=f.combiner, per_id_weights=w, out_grad=cts[f.name]
        )
    return out, grads


def test_values_gradients_and_update_match_float64():
    """Sum, mean, sqrtn and weighted features (factors beside the ids), and a row-split
    table's feature in a call of its own."""
    mesh, layout, features, host, stacks, batch, ref_in = _setup(weighted=True)
    rng = np.random.default_rng(1)
    cts = {f.name: rng.normal(size=(B, H)).astype(np.float32) for f in features}
    want, want_grads = _reference(features, host, ref_in, cts)
    opt = jaxembed.optim.rowwise_adagrad(0.1)

    def loss(stacks):
        out = collection_lookup(layout, stacks, batch)
        return sum(jnp.sum(out[f.name] * cts[f.name]) for f in features), out

    with jax.set_mesh(mesh):
        (_, got), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(stacks)
        states = {s.index: opt.init(stacks[s.index], mesh=mesh) for s in layout.stacks}
        new_stacks, new_states = jax.jit(
            lambda st, ss: collection_update(layout, opt, st, ss, batch, cts)
        )(stacks, states)
    for f in features:
        np.testing.assert_allclose(got[f.name], want[f.name], rtol=1e-5, atol=1e-5, err_msg=f.name)
    for name in host:
        np.testing.assert_allclose(_read(layout, grads, name), want_grads[name], rtol=1e-5,
                                   atol=1e-5, err_msg=name)  # fmt: skip
    # The update, per table: every slot's gradient summed per row, one row-wise Adagrad step.
    for name in host:
        ids, g = [], []
        for f in features:
            if f.table != name:
                continue
            x, w = ref_in[f.name]
            w = np.ones_like(x, np.float64) if w is None else w.astype(np.float64)
            for b in range(B):
                ok = [j for j in range(L) if x[b, j] >= 0]
                norm = {
                    "sum": 1.0,
                    "mean": max(w[b, ok].sum(), 1e-30) if ok else 1.0,
                    "sqrtn": np.sqrt(max((w[b, ok] ** 2).sum(), 1e-30)) if ok else 1.0,
                }
                for j in ok:
                    ids.append(x[b, j])
                    g.append(w[b, j] / norm[f.combiner] * cts[f.name][b])
        table, (acc,) = reference.sparse_step(
            opt.formula, host[name], reference.init_states(opt.formula, *host[name].shape),
            np.asarray(ids), np.asarray(g), count=0,
        )  # fmt: skip
        p = layout.placement(name)
        rows = p.stack_ids(
            np.arange(p.vocab_size, dtype=np.int32), layout.stacks[p.stack].local_rows
        )
        np.testing.assert_allclose(_read(layout, new_stacks, name), table, rtol=1e-5, atol=1e-6,
                                   err_msg=name)  # fmt: skip
        got_acc = np.asarray(new_states[p.stack].slots["accumulator"])[rows]
        np.testing.assert_allclose(got_acc, acc, rtol=1e-5, atol=1e-7, err_msg=name)


SUMS = ("sum",) * len(COMBINERS)  # unweighted sums: the ids travel alone


def test_only_all_to_alls_with_the_planners_bytes_and_the_counters():
    mesh, layout, features, _, stacks, batch, _ = _setup(with_rows_table=False, combiners=SUMS)
    with jax.set_mesh(mesh):
        lookup = jax.jit(lambda st: collection_lookup(layout, st, batch, return_stats=True))
        text = lookup.lower(stacks).compile().as_text()
        _, stats = lookup(stacks)
    kinds = {c.kind for c in hlo.collectives(text)}
    assert kinds == {"all-to-all"}, kinds
    tables, _ = _configs(False, SUMS)
    plan = plan_collection(tables, features, mesh, batch_size=B, memory_per_device="64MiB")
    (call,) = plan.calls
    assert call.exchange == "table" and plan.exchanges == {0: "table"}, plan.calls
    assert hlo.total_wire_bytes(text) == pytest.approx(call.forward_bytes)
    # Each device walks B · F_o · L slots: F_o, the most features any one device owns.
    owners = [layout.placement(f.table).shards[0] for f in features]
    f_o = max(owners.count(o) for o in set(owners))
    (s,) = stats.values()
    assert s.slots.tolist() == [B * f_o * L] * 8
    want_rows = [sum(int((np.asarray(batch[f.name]) >= 0).sum()) for f, o in zip(features, owners, strict=True) if o == d)
                 for d in range(8)]  # fmt: skip
    assert s.rows.tolist() == want_rows


def test_the_update_compiles_only_all_to_alls_with_the_planners_bytes():
    mesh, layout, features, _, stacks, batch, _ = _setup(with_rows_table=False, combiners=SUMS)
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    cts = {f.name: jnp.ones((B, H)) for f in features}
    with jax.set_mesh(mesh):
        states = {s.index: opt.init(stacks[s.index], mesh=mesh) for s in layout.stacks}
        step = jax.jit(lambda st, ss: collection_update(layout, opt, st, ss, batch, cts))
        text = step.lower(stacks, states).compile().as_text()
    assert {c.kind for c in hlo.collectives(text)} == {"all-to-all"}
    tables, _ = _configs(False, SUMS)
    (call,) = plan_collection(tables, features, mesh, batch_size=B,
                              memory_per_device="64MiB").calls  # fmt: skip
    assert hlo.total_wire_bytes(text) == pytest.approx(call.update_bytes)


def test_forced_rows_exchange_runs_the_gather_path_with_equal_results():
    mesh, layout, features, _, stacks, batch, _ = _setup()
    with jax.set_mesh(mesh):
        a = jax.jit(lambda st: collection_lookup(layout, st, batch))(stacks)
        text = jax.jit(lambda st: collection_lookup(layout, st, batch, exchange="rows")).lower(
            stacks).compile().as_text()  # fmt: skip
        b = jax.jit(lambda st: collection_lookup(layout, st, batch, exchange="rows"))(stacks)
    assert "all-gather" in {c.kind for c in hlo.collectives(text)}
    for f in features:
        np.testing.assert_allclose(a[f.name], b[f.name], rtol=1e-6, atol=1e-6)


def _kinds(layout, stacks, batch, mesh, exchange):
    with jax.set_mesh(mesh):
        f = jax.jit(lambda st: collection_lookup(layout, st, batch, exchange=exchange))
        return {c.kind for c in hlo.collectives(f.lower(stacks).compile().as_text())}, f(stacks)


def test_a_plans_table_plus_routed_routes_the_rest_and_auto_gathers_block_rows():
    """`"table+routed"` (a `CollectionPlan`'s exchange for a stack with a table-wise call and
    a routed one): the table-wise call as before, the row-split table's call routed (its
    overflow flag's all-reduce); under `"auto"` that block-rows table's call gathers (a
    frequency-ranked vocabulary's hot ids would overflow its owner's bucket). Values equal
    either way, and the float64 reference."""
    mesh, layout, features, host, stacks, batch, ref_in = _setup()
    assert layout.placement("big").row_sharding == "block"
    routed, a = _kinds(layout, stacks, batch, mesh, {0: "table+routed"})
    gathered, b = _kinds(layout, stacks, batch, mesh, "auto")
    assert "all-reduce" in routed and "all-to-all" in routed  # the overflow flag, the slots
    assert "all-reduce" not in gathered and "all-gather" in gathered
    want, _ = _reference(features, host, ref_in, {f.name: np.zeros((B, H)) for f in features})
    for f in features:
        np.testing.assert_allclose(a[f.name], want[f.name], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(b[f.name], want[f.name], rtol=1e-5, atol=1e-5)


def test_tables_go_to_the_shard_with_the_fewest_slots():
    mesh = jax.sharding.AbstractMesh((4,), ("x",))
    tables = [TableConfig(f"t{i}", 1000 - i, 8, placement="table") for i in range(6)]
    # t0 is read by three features of 20 ids: its shard gets no other table until the rest
    # have caught up.
    features = [FeatureConfig(f"a{i}", "t0", max_ids=20) for i in range(3)] + [
        FeatureConfig(f"b{i}", f"t{i}", max_ids=20) for i in range(1, 6)
    ]
    layout = layout_collection(tables, features, mesh)
    shard = {t.name: layout.placement(t.name).shards for t in tables}
    assert shard["t0"] == (0,) and 0 not in {s[0] for n, s in shard.items() if n != "t0"}
