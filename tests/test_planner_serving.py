"""Serving plans: the planner prices the lookups alone, with quantized tables' packed bytes.

A serving plan (`plan_collection(..., serving=True)`, implied by `precision=`) holds no
optimizer state and models no update; a quantized table's rows take their packed bytes and,
for the integer formats, a float16 scale and bias. The checks build the planned collection,
quantize it as the plan says (`coll.quantized(dict(plan.precision))`), and compare the plan's
memory with the bytes each device really holds and its wire bytes with the compiled lookup.
"""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed
import jaxembed.nnx
from jaxembed import cli, hlo
from jaxembed.collection import FeatureConfig, TableConfig
from jaxembed.plan.collection import plan_collection

B = 512
TABLES = [
    TableConfig("item", 40_000, 16), TableConfig("user", 8000, 16),
    TableConfig("ad", 3000, 16), TableConfig("cat", 100, 8),
    TableConfig("country", 200, 8), TableConfig("text", 2000, 32, placement="columns"),
]  # fmt: skip
FEATURES = [
    FeatureConfig("clicked", "item", "mean", 8), FeatureConfig("target", "item"),
    FeatureConfig("user", "user"), FeatureConfig("ads", "ad", "sum", 5),
    FeatureConfig("cat", "cat", "sum", 3), FeatureConfig("country", "country"),
    FeatureConfig("words", "text", "sqrtn", 6),
]  # fmt: skip


def _mesh():
    return jax.make_mesh((2, 4), ("data", "model"))


def _device_bytes(tree) -> dict:
    """Per device: the bytes of every leaf's shard it holds."""
    out: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


def _built(plan, mesh, tables=TABLES):
    with jax.set_mesh(mesh):
        coll = jaxembed.nnx.EmbeddingBagCollection(
            tables, FEATURES, placements=plan, exchange=plan.exchange, rngs=nnx.Rngs(0)
        )
    return coll.quantized(dict(plan.precision)) if plan.precision else coll


@pytest.mark.parametrize("precision", [None, "int8", "int4", "int2", "fp8"])
def test_serving_memory_is_what_each_device_holds(precision):
    mesh = _mesh()
    plan = plan_collection(TABLES, FEATURES, mesh, batch_size=B, memory_per_device="1MiB",
                           backend="gpu", serving=True, precision=precision)  # fmt: skip
    assert plan.serving and dict(plan.precision) == dict.fromkeys(
        [t.name for t in TABLES] if precision else [], precision)  # fmt: skip
    assert all(u == 0 for u in plan.update_ms)
    assert all(c.update_bytes == 0 and c.out_move_bytes[1] == 0 for c in plan.calls)
    served = _built(plan, mesh)
    stacks = {s.name: served.stacks[s.name].get_value() for s in served.layout.stacks}
    if precision:
        assert all(jaxembed.quant.QuantizedTable is type(v) for v in stacks.values())
    held = _device_bytes(stacks)
    assert set(held) == set(mesh.devices.flat)
    # Every device holds the padded stacks: what the plan allocates, to the byte.
    assert set(held.values()) == {plan.allocated_bytes}
    float_plan = plan_collection(TABLES, FEATURES, mesh, batch_size=B, serving=True,
                                 memory_per_device="1MiB", backend="gpu")  # fmt: skip
    if precision and float_plan.placements == plan.placements:
        assert plan.allocated_bytes < float_plan.allocated_bytes


def test_serving_bytes_equal_the_compiled_quantized_lookup():
    mesh = _mesh()
    tables = [dataclasses.replace(t, placement="rows") if t.name == "ad" else t for t in TABLES]
    plan = plan_collection(tables, FEATURES, mesh, batch_size=B, memory_per_device="400KiB",
                           backend="gpu", precision="int4")  # fmt: skip
    # The check covers replicas, columns (the outputs move to the batch's layout) and rows
    # split over the mesh, looked up over the gather exchange.
    assert {t.placement for t in plan.tables} == {"replicated", "columns", "rows"}
    assert {c.exchange for c in plan.calls} == {"none", "rows"}
    served = _built(plan, mesh, tables)
    data = NamedSharding(mesh, P(("data", "model")))
    rng = np.random.default_rng(0)
    batch = {
        f.name: jax.device_put(rng.integers(0, dict((t.name, t.vocab_size) for t in TABLES)[
            f.table], (B, f.max_ids or 1)).astype(np.int32), data)
        for f in FEATURES
    }  # fmt: skip
    graphdef, state = nnx.split(served)
    with jax.set_mesh(mesh):
        lookup = jax.jit(lambda s, b: nnx.merge(graphdef, s)(b))
        text = lookup.lower(state, batch).compile().as_text()
        got = lookup(state, batch)
    want = sum(c.forward_bytes + c.fallback_forward_bytes + c.out_move_bytes[0] for c in plan.calls)
    assert hlo.total_wire_bytes(text) == want
    assert set(got) == {f.name for f in FEATURES}
    assert all(np.isfinite(np.asarray(v)).all() for v in got.values())


def test_serving_plan_prints_its_precision(tmp_path, capsys):
    path = tmp_path / "tables.json"
    path.write_text(json.dumps({
        "tables": [{"name": t.name, "vocab_size": t.vocab_size, "dim": t.dim,
                    "placement": t.placement} for t in TABLES],
        "features": [{"name": f.name, "table": f.table, "combiner": f.combiner,
                      "max_ids": f.max_ids} for f in FEATURES],
    }))  # fmt: skip
    argv = ["plan", "--tables", str(path), "--mesh", "data=2,model=4", "--batch", str(B),
            "--memory", "1MiB", "--backend", "gpu"]  # fmt: skip
    assert cli.main([*argv, "--precision", "int4"]) == 0
    out = capsys.readouterr().out
    mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
    want = plan_collection(TABLES, FEATURES, mesh, batch_size=B, memory_per_device="1MiB",
                           backend="gpu", precision="int4")  # fmt: skip
    assert out == str(want) + "\n" and "quantized: item int4" in out
    assert cli.main([*argv, "--precision", "item=int4,user"]) == 2
    assert "table=precision pairs" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(precision="int3"), "unknown precision 'int3'"),
        (dict(precision={"nope": "int4"}), "no table named ['nope'] in this collection"),
        (dict(precision="int4", serving=False), "quantized tables are inference-only"),
        (dict(serving=True, optimizer=jaxembed.optim.adagrad(0.1)), "a serving step updates"),
        (dict(precision={"item": "int4"}), "share stack"),  # item and user: one stack
        (dict(precision=4), "precision must be a precision like 'int4'"),
    ],
)
def test_bad_serving_plans_say_why(kwargs, error):
    mesh = jax.sharding.AbstractMesh((8,), ("x",))
    with pytest.raises(
        (ValueError, TypeError), match=error.replace("[", r"\[").replace("(", r"\(")
    ):
        plan_collection(TABLES, FEATURES, mesh, batch_size=B, memory_per_device="1GiB", **kwargs)


def test_a_dim_the_precision_cannot_pack_names_the_table():
    tables = [TableConfig("odd", 100, 6)]
    mesh = jax.sharding.AbstractMesh((8,), ("x",))
    with pytest.raises(ValueError, match="table 'odd': int2 packs 4 values a byte"):
        plan_collection(tables, [FeatureConfig("odd", "odd")], mesh, batch_size=64,
                        memory_per_device="1GiB", precision={"odd": "int2"})  # fmt: skip
