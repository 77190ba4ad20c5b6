"""Mod rows rotate by table: the tables' hottest rows spread over the shards.

With `row_sharding="mod"` row r of a table lives on shard r % k; every table's row 0 (a Zipf's
hottest id) would then live on shard 0, which would pool and update the hot rows of every
table of the stack. `layout_collection` rotates the i-th mod table of a stack by i % k: row r
goes to shard (r + i) % k, local row r // k (i in packing order: the most rows first). The rotation must stay a bijection onto each
table's rows of the stack, and the planner's per-shard rows and id shares must follow it.
"""

import jax
import numpy as np
import pytest

from jaxembed.collection import FeatureConfig, TableConfig, layout_collection
from jaxembed.plan import collection_cost
from jaxembed.plan.idstats import id_stats

MESH = jax.sharding.AbstractMesh((8,), ("x",))
TABLES = [
    TableConfig("a", 1000, 16, placement="rows", row_sharding="mod"),
    TableConfig("b", 37, 16, placement="rows", row_sharding="mod"),
    TableConfig("c", 5, 16, placement="rows", row_sharding="mod"),  # fewer rows than shards
    TableConfig("d", 300, 16, placement="rows"),  # block: not rotated
    TableConfig("e", 64, 16, placement="rows", row_sharding="mod"),
]
FEATURES = [FeatureConfig(t.name, t.name, "sum", 4) for t in TABLES]


def _layout():
    return layout_collection(TABLES, FEATURES, MESH)


def test_the_ith_mod_table_of_a_stack_is_rotated_by_i():
    layout = _layout()
    (stack,) = layout.stacks
    mods = [n for n in stack.tables if layout.placement(n).row_sharding == "mod"]
    mods.sort(key=lambda n: -layout.placement(n).vocab_size)  # packing order: the most rows first
    assert [layout.placement(n).rotation for n in mods] == list(range(len(mods)))
    assert layout.placement("d").rotation == 0
    # Each mod table's row 0 on a shard of its own.
    shard_of_row0 = [int(layout.placement(n).stack_ids(np.array([0]), stack.local_rows)[0])
                     // stack.local_rows for n in mods]  # fmt: skip
    assert len(set(shard_of_row0)) == len(mods)


@pytest.mark.parametrize("table", [t.name for t in TABLES])
def test_rotated_rows_are_a_bijection_onto_the_tables_rows(table):
    layout = _layout()
    (stack,) = layout.stacks
    p = layout.placement(table)
    rows = p.stack_ids(np.arange(p.vocab_size), stack.local_rows)
    assert len(set(rows.tolist())) == p.vocab_size  # no two rows share a stack row
    shard, local = rows // stack.local_rows, rows % stack.local_rows
    assert set(shard.tolist()) <= set(p.shards)
    # ... within the table's block [offset, offset + rows_per_shard) of every shard.
    assert (local >= p.offset).all() and (local < p.offset + p.rows_per_shard).all()
    if p.row_sharding == "mod":
        r = np.arange(p.vocab_size)
        np.testing.assert_array_equal(shard - p.shards[0], (r + p.rotation) % len(p.shards))
        np.testing.assert_array_equal(local - p.offset, r // len(p.shards))
    # Ids outside the vocabulary read nothing.
    assert p.stack_ids(np.array([-1, p.vocab_size]), stack.local_rows).tolist() == [-1, -1]


def test_the_planner_counts_the_rows_each_rotated_shard_holds():
    layout = _layout()
    (stack,) = layout.stacks
    shards = np.arange(stack.num_shards)
    for t in TABLES:
        p = layout.placement(t.name)
        rows = p.stack_ids(np.arange(t.vocab_size), stack.local_rows)
        want = np.bincount(rows // stack.local_rows, minlength=stack.num_shards)
        got = collection_cost._held_rows(layout, t, stack, shards)
        np.testing.assert_array_equal(got, want, err_msg=t.name)


def test_the_planner_shares_ids_over_the_rotated_shards():
    layout = _layout()
    (stack,) = layout.stacks
    rng = np.random.default_rng(0)
    batches = [{t.name: rng.zipf(1.3, (64, 4)).clip(max=t.vocab_size) - 1 for t in TABLES}
               for _ in range(3)]  # fmt: skip
    stats = id_stats(batches, FEATURES)
    ctx = collection_cost.Context(
        mesh=MESH, sizes={"x": 8}, batch_size=64, batch_axes=("x",), state_slots=(True,),
        stats=stats, constants=collection_cost.cost.load_constants("cpu"),
    )  # fmt: skip
    for t in TABLES:
        p = layout.placement(t.name)
        got = collection_cost._shares(ctx, t, layout, stack)
        owners = []
        for b in batches:
            ids = np.unique(b[t.name][b[t.name] >= 0])
            owners.append(np.bincount(p.stack_ids(ids, stack.local_rows) // stack.local_rows,
                                      minlength=8) / ids.size)  # fmt: skip
        np.testing.assert_allclose(got, np.mean(owners, axis=0), err_msg=t.name)
