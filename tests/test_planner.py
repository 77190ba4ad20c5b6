"""The collection planner: deterministic plans within budget, bytes equal to the compiled HLO.

`plan_collection` prices layouts from the same bag plans the collection's lookups run, so the
forward bytes it reports for the chosen layout must be the compiled program's to the byte; its
memory must match the stacks as `layout_collection` allocates them and stay within the budget;
an impossible budget names the smallest one that fits.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed
import jaxembed.flax
import jaxembed.nnx
from jaxembed import cli, hlo
from jaxembed.collection import FeatureConfig, TableConfig, collection_update, layout_collection
from jaxembed.kernels.collection import collection_lookup
from jaxembed.optim import reference
from jaxembed.plan.collection import parse_bytes, plan_collection
from jaxembed.plan.idstats import id_stats
from jaxembed.rowsharding import bucket_loads

MESH = AbstractMesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
B = 512

# Ten tables of three dims (12 and 4 do not split over 8 devices by columns; 16 does); one
# placement fixed by its config.
TABLES = [
    TableConfig("item", 100_000, 12), TableConfig("user", 20_000, 12),
    TableConfig("ad", 5000, 12), TableConfig("cat", 100, 12),
    TableConfig("country", 200, 4), TableConfig("hour", 24, 4),
    TableConfig("text", 3000, 16, placement="columns"), TableConfig("brand", 2000, 16),
    TableConfig("dev", 50, 4), TableConfig("os", 10, 4),
]  # fmt: skip
FEATURES = [
    FeatureConfig("clicked", "item", "mean", 8), FeatureConfig("target", "item"),
    FeatureConfig("user", "user"), FeatureConfig("ads", "ad", "sum", 5),
    FeatureConfig("cat", "cat", "sum", 3), FeatureConfig("country", "country"),
    FeatureConfig("hour", "hour"), FeatureConfig("words", "text", "sqrtn", 6),
    FeatureConfig("brand", "brand"), FeatureConfig("dev", "dev"),
    FeatureConfig("os", "os", None, 2),  # unpooled: two bags of one
]  # fmt: skip


def plan_for(memory, mesh=MESH, **kw):
    return plan_collection(TABLES, FEATURES, mesh, batch_size=B, memory_per_device=memory, **kw)


def allocated(plan, mesh_sizes, state_bytes_per_row):
    """Per device: every stack's shard and optimizer state, from `layout_collection`."""
    layout = layout_collection(plan.table_configs, FEATURES, MESH)
    total = 0
    for s in layout.stacks:
        h = s.dim // int(np.prod([mesh_sizes[a] for a in s.hidden_axes]))
        total += s.local_rows * (h * 4 + state_bytes_per_row(h))
    return total


def test_plans_are_deterministic_and_print():
    a, b = plan_for("16MiB"), plan_for("16MiB")
    assert a == b and str(a) == str(b)
    assert list(a.placements) == [t.name for t in TABLES]
    text = str(a)
    assert text.startswith("CollectionPlan  mesh: data=2 x model=4  batch 512 over (data, model)")
    for t in TABLES:
        assert re.search(rf"^  {t.name} +{t.vocab_size} x {t.dim} ", text, re.M), t.name
    assert a.step_ms == pytest.approx(sum(c.modelled_ms for c in a.calls) + max(a.update_ms))


@pytest.mark.parametrize("memory", ["64MiB", "1500KiB", "1300KiB"])
def test_every_plan_fits_its_budget(memory):
    plan = plan_for(memory)
    sizes = dict(plan.mesh_axes)
    assert plan.allocated_bytes == allocated(plan, sizes, lambda h: 4)  # row-wise Adagrad
    assert plan.peak_bytes == plan.allocated_bytes + plan.buffer_bytes <= parse_bytes(memory)
    assert all(u <= plan.allocated_bytes for u in plan.used_bytes)
    assert len(plan.used_bytes) == len(plan.update_ms) == 8
    # Each table's memory is its shard on the fullest device, with its accumulator.
    layout = layout_collection(plan.table_configs, FEATURES, MESH)
    for t in plan.tables:
        p = layout.placement(t.name)
        h = t.dim // (8 if t.placement == "columns" else 1)
        rows = t.vocab_size if t.placement in ("replicated", "columns") else p.rows_per_shard
        assert t.memory_bytes == rows * (h * 4 + 4), t.name


def test_optimizer_state_is_counted():
    fixed = [TableConfig(t.name, t.vocab_size, t.dim, placement="rows") for t in TABLES]
    kw = dict(batch_size=B, memory_per_device="64MiB")
    rowwise = plan_collection(fixed, FEATURES, MESH, **kw)
    adam = plan_collection(fixed, FEATURES, MESH, optimizer=jaxembed.optim.adam(0.1), **kw)
    sgd = plan_collection(fixed, FEATURES, MESH, optimizer=jaxembed.optim.sgd(0.1), **kw)
    sizes = dict(MESH.shape)
    assert rowwise.allocated_bytes == allocated(rowwise, sizes, lambda h: 4)
    assert adam.allocated_bytes == allocated(adam, sizes, lambda h: 2 * h * 4)  # m, v [V, H]
    assert sgd.allocated_bytes == allocated(sgd, sizes, lambda h: 0)
    assert sgd.step_ms < rowwise.step_ms < adam.step_ms  # the state's traffic in the update


def test_modelled_bytes_equal_the_compiled_lookup_and_update():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    plan = plan_for("4MiB", mesh=mesh, backend="gpu")
    # The plan mixes placements and exchanges: the check covers each of them.
    assert {"rows", "replicated", "columns"} <= set(plan.placements.values())
    assert {"routed", "dense", "none"} == {c.exchange for c in plan.calls}  # dense: small tables
    data = NamedSharding(mesh, P(("data", "model")))
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    with jax.set_mesh(mesh):  # abstract arrays: only the compiled programs are needed
        coll = nnx.eval_shape(lambda: jaxembed.nnx.EmbeddingBagCollection(
            TABLES, FEATURES, placements=plan, exchange=plan.exchange, rngs=nnx.Rngs(0)))  # fmt: skip
        batch = {f.name: jax.ShapeDtypeStruct((B, f.max_ids or 1), np.int32, sharding=data)
                 for f in FEATURES}  # fmt: skip
        graphdef, state = nnx.split(coll)
        lookup = jax.jit(lambda s, b: nnx.merge(graphdef, s)(b))
        text = lookup.lower(state, batch).compile().as_text()
        # The update, from output gradients in the batch layout (as a dense model makes them).
        grads = {k: jax.ShapeDtypeStruct(v.shape, np.float32, sharding=NamedSharding(
            mesh, P(("data", "model"), *(None,) * (v.ndim - 1))))
            for k, v in jax.eval_shape(lookup, state, batch).items()}  # fmt: skip
        stacks = {s.index: coll.stacks[s.name].get_value() for s in coll.layout.stacks}
        states = jax.eval_shape(lambda st: {s.index: opt.init(
            st[s.index], mesh=mesh, weight_spec=s.spec) for s in coll.layout.stacks}, stacks)  # fmt: skip
        update = jax.jit(lambda st, ss, b, g: collection_update(
            coll.layout, opt, st, ss, b, g, mesh=mesh, exchange=plan.exchanges))  # fmt: skip
        update_text = update.lower(stacks, states, batch, grads).compile().as_text()
    assert {t: p.placement for t, p in coll.layout.placements} == plan.placements
    assert coll.exchange == plan.exchanges and "routed" in plan.exchanges.values()
    # The routed exchange compiles its exact fallback beside it (a cond): both count.
    # ... and a columns stack's outputs move to the batch's layout.
    want = sum(c.forward_bytes + c.fallback_forward_bytes + c.out_move_bytes[0] for c in plan.calls)
    assert hlo.total_wire_bytes(text) == want
    want = sum(c.update_bytes + c.fallback_update_bytes + c.out_move_bytes[1] for c in plan.calls)
    assert hlo.total_wire_bytes(update_text) == want
    assert any(c.out_move_bytes[1] > 0 for c in plan.calls)  # the columns output's gradient


# (widths, combiners, weighted inputs), the call's form, and whether it moves per-slot factors:
# only with a mean or sqrtn feature, or per-id weights (FeatureConfig(weighted=True) and
# (ids, weights) inputs); unweighted sums and unpooled features move the ids alone.
FORMS = {
    "stacked,sum-mean-sqrtn": (((4, "sum", 0), (5, "mean", 0), (5, "sqrtn", 0)), 3, True),
    "flat,sum-mean": (((8, "sum", 0), (1, "mean", 0)), 2, True),
    "stacked,sum": (((4, "sum", 0), (5, "sum", 0), (5, "sum", 0)), 3, False),
    "flat,sum-unpooled": (((8, "sum", 0), (1, "sum", 0), (2, None, 0)), 2, False),
    "stacked,weighted-sum": (((4, "sum", 1), (5, "sum", 0), (5, "sum", 0)), 3, True),
    "flat,mixed": (((8, "sum", 0), (1, "sum", 1), (3, "mean", 0), (2, None, 0)), 2, True),
}


@pytest.mark.parametrize("form", FORMS)
def test_modelled_bytes_equal_the_compiled_call_of_each_form(form):
    # Pooled dense features of similar widths are one [B, F, L] call (padded to the widest),
    # others one [B, ΣL] call with lengths, weighted or not: the planner must price the call
    # that runs.
    spec, rank, weighted = FORMS[form]
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    tables = [TableConfig("t", 4000, 8, placement="rows"),
              TableConfig("u", 300, 8, placement="rows")]  # fmt: skip
    features = [FeatureConfig(f"f{i}", "t" if i % 2 == 0 else "u", c, w, weighted=bool(wt))
                for i, (w, c, wt) in enumerate(spec)]  # fmt: skip
    plan = plan_collection(tables, features, mesh, batch_size=B, memory_per_device="64MiB")
    assert [(len(c.x_shape), c.plan.bag.weighted) for c in plan.calls] == [(rank, weighted)]
    data = NamedSharding(mesh, P(("data", "model")))
    opt = jaxembed.optim.rowwise_adagrad(0.1)

    def ids(f):
        x = jax.ShapeDtypeStruct((B, f.max_ids), np.int32, sharding=data)
        return (x, jax.ShapeDtypeStruct(x.shape, np.float32, sharding=data)) if f.weighted else x

    with jax.set_mesh(mesh):
        coll = nnx.eval_shape(lambda: jaxembed.nnx.EmbeddingBagCollection(
            tables, features, placements=plan, exchange=plan.exchange, rngs=nnx.Rngs(0)))  # fmt: skip
        batch = {f.name: ids(f) for f in features}
        graphdef, state = nnx.split(coll)
        lookup = jax.jit(lambda s, b: nnx.merge(graphdef, s)(b))
        text = lookup.lower(state, batch).compile().as_text()
        grads = {k: jax.ShapeDtypeStruct(v.shape, np.float32, sharding=data)
                 for k, v in jax.eval_shape(lookup, state, batch).items()}  # fmt: skip
        stacks = {s.index: coll.stacks[s.name].get_value() for s in coll.layout.stacks}
        states = jax.eval_shape(lambda st: {s.index: opt.init(
            st[s.index], mesh=mesh, weight_spec=s.spec) for s in coll.layout.stacks}, stacks)  # fmt: skip
        update = jax.jit(lambda st, ss, b, g: collection_update(
            coll.layout, opt, st, ss, b, g, mesh=mesh, exchange=plan.exchanges))  # fmt: skip
        update_text = update.lower(stacks, states, batch, grads).compile().as_text()
    want = sum(c.forward_bytes + c.fallback_forward_bytes for c in plan.calls)
    assert hlo.total_wire_bytes(text) == want > 0
    want = sum(c.update_bytes + c.fallback_update_bytes for c in plan.calls)
    assert hlo.total_wire_bytes(update_text) == want > 0


def test_tiny_tables_are_replicated_when_memory_allows():
    plan = plan_for("4MiB")  # item's replica (100000 x (12 + 1) x 4 bytes) does not fit
    tiny = ("country", "hour", "dev", "os")  # dim 4: no columns split over 8 devices
    assert all(plan.placements[t] == "replicated" for t in tiny)
    assert plan.placements["item"] != "replicated"
    assert "replicated needs" in plan.tables[0].reason
    # On a GPU's constants (fast links, small latency) a 4096 batch replicates everything
    # that fits; a table whose replica is over the budget never is.
    mesh = AbstractMesh((8,), ("x",), axis_types=(AxisType.Explicit,))
    tables = [TableConfig("big", 1_000_000, 64), TableConfig("country", 200, 64),
              TableConfig("os", 10, 64)]  # fmt: skip
    features = [FeatureConfig("clicked", "big", "mean", 20), FeatureConfig("country", "country"),
                FeatureConfig("os", "os")]  # fmt: skip
    replica = 1_000_000 * (64 * 4 + 4)

    def plan(memory):
        return plan_collection(tables, features, mesh, batch_size=4096, memory_per_device=memory,
                               backend="gpu")  # fmt: skip

    roomy = plan(4 * replica)
    assert set(roomy.placements.values()) == {"replicated"}
    for memory in (replica, replica // 2, 64 * 2**20):
        tight = plan(memory)
        assert tight.placements["big"] != "replicated" and tight.peak_bytes <= memory
        assert "replicated needs" in tight.tables[0].reason


def test_infeasible_budget_names_the_smallest_that_fits():
    with pytest.raises(ValueError, match="no layout of the collection fits") as info:
        plan_for("600KiB")
    message = str(info.value)
    need = int(re.search(r"at least (\d+) bytes", message).group(1))
    assert re.search(r"Table 'item' \(100000 x 12, .* per device as '(rows|columns)'\)", message)
    assert plan_for(need).peak_bytes <= need
    with pytest.raises(ValueError, match=f"at least {need} bytes"):
        plan_for(need - 1)
    with pytest.raises(ValueError, match="activations and exchange buffers alone"):
        plan_collection(TABLES, FEATURES, MESH, batch_size=65536, memory_per_device="1MiB")
    with pytest.raises(ValueError, match=r"memory_per_device must be .* got '2 parsecs'"):
        plan_for("2 parsecs")
    with pytest.raises(ValueError, match="a positive multiple of 8"):
        plan_collection(TABLES, FEATURES, MESH, batch_size=100, memory_per_device="1GiB")


def zipf_batch(rng, batch, vocab, features):
    out = {}
    for f in features:
        ids = (rng.zipf(1.3, size=(batch, f.max_ids or 1)) - 1) % vocab[f.table]
        ids[rng.random(ids.shape) < 0.3] = -1
        out[f.name] = ids.astype(np.int32)
    return out


def test_id_stats_measure_bags_duplicates_and_skew():
    rng = np.random.default_rng(1)
    vocab = {t.name: t.vocab_size for t in TABLES}
    batches = [zipf_batch(rng, 64, vocab, FEATURES) for _ in range(3)]
    batches[0]["words"] = jaxembed.Ragged.from_lists([[1, 2, 2], [], [5]] + [[7]] * 61)
    stats = id_stats(batches, FEATURES)
    for f in FEATURES:
        per_bag = [np.sum(b[f.name] >= 0) / 64 for b in batches if f.name != "words"]
        if f.name == "words":
            per_bag = [(3 + 0 + 1 + 61) / 64] + [np.sum(b[f.name] >= 0) / 64 for b in batches[1:]]
        assert stats.ids_per_bag[f.name] == pytest.approx(np.mean(per_bag)), f.name
    ids = [np.concatenate([b[f.name][b[f.name] >= 0] for f in FEATURES if f.table == "item"])
           for b in batches]  # fmt: skip
    assert stats.ids_per_batch["item"] == pytest.approx(np.mean([x.size for x in ids]))
    unique = np.mean([np.unique(x).size for x in ids])
    assert stats.unique_per_batch["item"] == pytest.approx(unique)
    assert stats.duplication("item") > 1
    want = [bucket_loads(x, vocab_size=100_000, num_shards=8) for x in ids]
    got = stats.skew("item", vocab_size=100_000, num_shards=8)
    assert got == pytest.approx({k: np.mean([w[k] for w in want]) for k in ("block", "mod")})
    with pytest.raises(ValueError, match=r"batch 0 has no input for features \['user'\]"):
        id_stats([{k: v for k, v in batches[1].items() if k != "user"}], FEATURES)


def test_skewed_ids_choose_mod_rows_and_block_rows_overflow_routed():
    tables = [TableConfig("item", 100_000, 12)]
    features = [FeatureConfig("clicked", "item", "mean", 8)]
    rng = np.random.default_rng(0)
    hot = [{"clicked": rng.integers(0, 12_000, (512, 8))} for _ in range(3)]  # block shard 0
    stats = id_stats(hot, features)
    kw = dict(batch_size=2048, memory_per_device="5MiB", backend="gpu")  # routes when uniform
    plan = plan_collection(tables, features, MESH, id_stats=stats, **kw)
    assert plan.placements == {"item": "rows"} and plan.calls[0].exchange == "routed"
    assert plan.table_configs[0].row_sharding == "mod" and plan.tables[0].row_sharding == "mod"
    fixed = [TableConfig("item", 100_000, 12, placement="rows")]  # block rows, as configured
    assert plan_collection(fixed, features, MESH, **kw).calls[0].exchange == "routed"
    plan = plan_collection(fixed, features, MESH, id_stats=stats, **kw)
    assert plan.calls[0].exchange == "none" and "routed would overflow" in plan.calls[0].note


def test_a_hot_id_overflows_the_owners_slots_not_the_sources_distinct_ids():
    """Half of every batch's slots read id 3: pooled at the owner (slots travel) that owner's
    places overflow every step; pooled at the source (distinct ids travel) they do not. The
    planner reads the slots' skew (`IdStats.counts`) and never plans the overflowing way."""
    tables = [TableConfig("item", 4096, 16, placement="rows", row_sharding="mod")]
    features = [FeatureConfig("clicked", "item", "sum", 20)]
    rng = np.random.default_rng(1)

    def batch():
        ids = rng.integers(0, 4096, (512, 20))
        ids[rng.random((512, 20)) < 0.5] = 3
        return {"clicked": ids}

    stats = id_stats([batch() for _ in range(3)], features)
    got = stats.shard_shares("item", vocab_size=4096, num_shards=8, row_sharding="mod",
                             slots=True)  # fmt: skip
    flat = np.concatenate([np.asarray(b) for b in stats.samples["item"]])
    weights = np.concatenate([np.asarray(c) for c in stats.counts["item"]])
    assert weights.sum() == pytest.approx(3 * 512 * 20)
    assert got[3] > 0.5 and got.sum() == pytest.approx(1)  # id 3's shard: over half the slots
    distinct = stats.shard_shares("item", vocab_size=4096, num_shards=8, row_sharding="mod")
    assert distinct.max() < 0.14  # its distinct ids are spread evenly
    assert np.bincount(flat % 8, minlength=8).sum() == flat.size
    kw = dict(batch_size=4096, memory_per_device="64MiB", backend="cpu")
    plan = plan_collection(tables, features, MESH, id_stats=stats, **kw)
    (call,) = plan.calls  # routed beats the gather here, but not pooled at the owner
    assert call.exchange == "routed" and call.routed_pool == "source", call.note
    assert not call.plan.routed.pooled_at_owner
    assert "id slots" in call.note and "pooled at the source, capacity" in call.note
    # ... sized for the distinct ids its owners expect (`tests/test_routed_sized.py`)
    assert plan.exchanges == {0: f"routed:source:{call.capacity_factor:g}"}
    # the same collection, its plan's exchanges as given: the source-pooled route equals the
    # gather exchange (values and update), which the collection tests check against float64
    mesh = jax.make_mesh((8,), ("model",))
    layout = layout_collection(tables, features, mesh)
    (stack,) = layout.stacks
    table = jax.device_put(jnp.asarray(rng.normal(size=stack.shape), jnp.float32),
                           NamedSharding(mesh, stack.spec))  # fmt: skip
    ids = jax.device_put(jnp.asarray(batch()["clicked"][:64], jnp.int32),
                         NamedSharding(mesh, P("model")))  # fmt: skip
    out = {e: collection_lookup(layout, {0: table}, {"clicked": ids}, exchange={0: e})
           for e in ("rows", "routed:source", "routed:owner", plan.exchanges[0])}  # fmt: skip
    for e in ("routed:source", "routed:owner", plan.exchanges[0]):
        np.testing.assert_allclose(out[e]["clicked"], out["rows"]["clicked"], rtol=1e-6,
                                   atol=1e-6, err_msg=e)  # fmt: skip


def write_tables(tmp_path, tables=TABLES, features=FEATURES, extra=None):
    data = {
        "tables": [{"name": t.name, "vocab_size": t.vocab_size, "dim": t.dim,
                    "placement": t.placement} for t in tables],
        "features": [{"name": f.name, "table": f.table, "combiner": f.combiner,
                      "max_ids": f.max_ids} for f in features],
    }  # fmt: skip
    data["tables"][0].update(extra or {})
    path = tmp_path / "tables.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_cli_prints_the_plan(tmp_path, capsys):
    path = write_tables(tmp_path)
    argv = ["plan", "--tables", path, "--mesh", "data=2,model=4", "--batch", str(B),
            "--memory", "16MiB"]  # fmt: skip
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == str(plan_for("16MiB")) + "\n"
    assert cli.main([*argv[:-1], "600KiB"]) == 2
    assert "at least" in capsys.readouterr().err
    assert cli.main(["plan", "--tables", write_tables(tmp_path, extra={"rows": 3}), *argv[3:]]) == 2
    assert "unknown keys ['rows']" in capsys.readouterr().err
    assert cli.main(["plan", "--mesh", "data=2,model=4"]) == 2
    assert "give --ids and --table (one lookup) or --tables" in capsys.readouterr().err


def test_placements_auto_plans_when_the_collection_is_built():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    budget = {"batch_size": B, "memory_per_device": "4MiB", "backend": "gpu"}
    want = plan_collection(TABLES, FEATURES, mesh, **budget)
    with jax.set_mesh(mesh):
        coll = nnx.eval_shape(lambda: jaxembed.nnx.EmbeddingBagCollection(
            TABLES, FEATURES, placements="auto", planner=budget, rngs=nnx.Rngs(0)))  # fmt: skip
        linen = jaxembed.flax.EmbeddingBagCollection(
            TABLES, FEATURES, placements="auto", planner=budget
        )  # a Linen module reads the mesh in context
        assert coll.plan == want == linen.plan
        assert coll.layout == linen.layout and coll.exchange == want.exchanges == linen._exchange
    assert {t: p.placement for t, p in coll.layout.placements} == want.placements
    with pytest.raises(
        ValueError, match=r"placements='auto' .* \(missing \['memory_per_device'\]\)"
    ):
        jaxembed.nnx.EmbeddingBagCollection(TABLES, FEATURES, mesh=mesh, placements="auto",
                                            planner={"batch_size": B}, rngs=nnx.Rngs(0))  # fmt: skip
    with pytest.raises(ValueError, match=r"planner=.* is for placements='auto'"):
        jaxembed.nnx.EmbeddingBagCollection(TABLES, FEATURES, mesh=mesh, planner=budget,
                                            rngs=nnx.Rngs(0))  # fmt: skip


def test_row_sharding_auto_is_the_planners_choice():
    """`row_sharding="auto"` on a table placed `"rows"` by its config: the planner gives it
    mod rows for ids whose hot rows sit on one block shard, block rows for uniform ids, and
    mod rows without a sample (the robust choice, said in its line); unplanned it is block
    rows; a fixed row sharding is kept. The module
    built from the plan looks up and updates as the float64 reference."""
    features = [FeatureConfig("clicked", "item", "sum", 8)]
    auto = [TableConfig("item", 4096, 16, placement="rows", row_sharding="auto")]
    rng = np.random.default_rng(5)
    hot = id_stats([{"clicked": rng.integers(0, 400, (512, 8))} for _ in range(3)], features)
    flat = id_stats([{"clicked": rng.integers(0, 4096, (512, 8))} for _ in range(3)], features)
    mesh = jax.make_mesh((8,), ("model",))
    kw = dict(batch_size=4096, memory_per_device="64MiB", backend="cpu")
    got = {name: plan_collection(auto, features, mesh, id_stats=s, **kw).table_configs[0]
           for name, s in (("hot", hot), ("flat", flat), ("none", None))}  # fmt: skip
    assert {k: (t.placement, t.row_sharding) for k, t in got.items()} == {
        "hot": ("rows", "mod"), "flat": ("rows", "block"), "none": ("rows", "mod")}  # fmt: skip
    unseen = plan_collection(auto, features, mesh, **kw).tables[0].reason
    assert "mod rows: its ids are unseen (robust to hot ids in one block); id_stats=" in unseen
    seen = plan_collection(auto, features, mesh, id_stats=hot, **kw).tables[0].reason
    assert "unseen" not in seen
    assert layout_collection(auto, features, mesh).placement("item").row_sharding == "block"
    fixed = [TableConfig("item", 4096, 16, placement="rows")]  # block, as configured
    kept = plan_collection(fixed, features, mesh, id_stats=hot, **kw)
    assert kept.table_configs[0] == fixed[0]
    # ... and its line says what its block rows cost: all the hot ids on shard 0 of 8
    note = re.search(r"block rows: its busiest shard holds (\d+)% of a batch's distinct ids "
                     r"\((\d+)% by mod rows\), row_sharding='auto' lets the planner choose",
                     kept.tables[0].reason)  # fmt: skip
    assert note and int(note[1]) == 100 and 12 <= int(note[2]) <= 16, kept.tables[0].reason
    assert note[0] in str(kept)
    even = plan_collection(fixed, features, mesh, id_stats=flat, **kw)
    assert "block rows:" not in even.tables[0].reason, even.tables[0].reason
    with pytest.raises(ValueError, match=r"row_sharding must be one of \('block', 'mod', 'auto'\)"):
        TableConfig("item", 4096, 16, row_sharding="hash")

    batch = {"clicked": rng.integers(0, 400, (64, 8)).astype(np.int32)}
    batch["clicked"][rng.random((64, 8)) < 0.2] = -1
    cts = {"clicked": rng.normal(size=(64, 16)).astype(np.float32)}
    with jax.set_mesh(mesh):
        coll = jaxembed.nnx.EmbeddingBagCollection(
            auto, features, placements="auto", rngs=nnx.Rngs(0),
            planner=dict(batch_size=64, memory_per_device="64MiB", id_stats=hot),
        )  # fmt: skip
        assert coll.layout.placement("item").row_sharding == "mod"
        table = np.asarray(coll.tables()["item"], np.float64)
        ids = jax.device_put(batch["clicked"], NamedSharding(mesh, P("model")))
        out = np.asarray(coll({"clicked": ids})["clicked"])
        opt = jaxembed.optim.rowwise_adagrad(0.1)
        states = coll.init_optimizer(opt)
        states = coll.apply_gradients(opt, states, {"clicked": ids}, cts)
        new = np.asarray(coll.tables()["item"])
    x = batch["clicked"]
    want = np.stack([table[x[b][x[b] >= 0]].sum(0) for b in range(64)])
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    live = x >= 0
    grads = np.repeat(np.asarray(cts["clicked"], np.float64)[:, None], 8, axis=1)[live]
    ref, _ = reference.sparse_step(opt.formula, table,
                                   reference.init_states(opt.formula, *table.shape),
                                   x[live], grads, count=0)  # fmt: skip
    np.testing.assert_allclose(new, ref, rtol=1e-5, atol=1e-6)
