"""Errors that name what is wrong: table and feature configs, table_rows axes, the planner's
backend, and TABLES.json entries."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxembed import cli
from jaxembed.cli import load_tables_json
from jaxembed.collection import FeatureConfig, TableConfig
from jaxembed.collection.config import DTYPES
from jaxembed.collection.layout import layout_collection
from jaxembed.plan import cost
from jaxembed.plan.collection import plan_collection

MESH_2X4 = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
MESH_8 = jax.sharding.AbstractMesh((8,), ("model",))


# 1. TableConfig / FeatureConfig


@pytest.mark.parametrize(
    ("dtype", "name"),
    [
        (np.float32, "float32"),
        ("float32", "float32"),
        (jnp.bfloat16, "bfloat16"),
        ("bfloat16", "bfloat16"),
        (np.dtype("float16"), "float16"),
        ("float64", "float64"),
    ],
)
def test_float_dtypes_are_accepted_and_made_canonical(dtype, name):
    t = TableConfig("item", 100, 8, dtype=dtype)
    assert t.dtype == jnp.dtype(name) and t.dtype.name == name
    assert t == TableConfig("item", 100, 8, dtype=name)
    assert hash(t) == hash(TableConfig("item", 100, 8, dtype=name))


def test_the_default_dtype_is_float32():
    assert TableConfig("item", 100, 8).dtype == np.dtype("float32")
    assert set(DTYPES) == {"float32", "bfloat16", "float16", "float64"}


@pytest.mark.parametrize(
    ("dtype", "got"),
    [
        (np.int32, r"got <class 'numpy\.int32'> \(int32\)"),
        ("int8", r"got 'int8' \(int8\)"),
        (jnp.float8_e4m3fn, r"\(float8_e4m3fn\)"),
        ("bfloat17", r"got 'bfloat17'"),
        (None, r"got None"),
        (object(), r"got <object object"),
    ],
)
def test_a_dtype_that_is_not_a_float_dtype_is_a_type_error_naming_table_and_dtype(dtype, got):
    with pytest.raises(
        TypeError,
        match=r"table 'item': dtype must be a float dtype, one of \('float32', 'bfloat16', "
        r"'float16', 'float64'\) .*" + got + r".*use dtype='float32'",
    ):
        TableConfig("item", 100, 8, dtype=dtype)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"name": ""}, ValueError, r"a table needs a non-empty str name, got ''"),
        ({"vocab_size": 0}, ValueError, r"table 'item': vocab_size must be a positive int, got 0"),
        ({"dim": 2.5}, ValueError, r"table 'item': dim must be a positive int, got 2\.5"),
        ({"dim": True}, ValueError, r"table 'item': dim must be a positive int, got True"),
        ({"placement": "row"}, ValueError, r"table 'item': placement must be one of .*'row'"),
        ({"row_sharding": "cyclic"}, ValueError, r"row_sharding must be one of .*'auto'.*'cyclic'"),
        ({"axes": 3}, TypeError, r"table 'item': axes must be None, a mesh axis name .*got 3"),
        ({"axes": ("data", 1)}, TypeError, r"table 'item': axes must be .*got \('data', 1\)"),
        ({"axes": ("model", "model")}, ValueError, r"axes \('model', 'model'\) name a mesh axis"),
        ({"initializer": 0.01}, TypeError, r"table 'item': initializer must be a callable"),
    ],
)
def test_table_config_fields_are_validated(kwargs, error, match):
    args = {"name": "item", "vocab_size": 100, "dim": 8, **kwargs}
    with pytest.raises(error, match=match):
        TableConfig(**args)


def test_numpy_ints_and_axis_lists_are_accepted():
    t = TableConfig("item", np.int64(100), np.int32(8), axes=["data", "model"])
    assert t.axes == ("data", "model")
    assert TableConfig("item", 100, 8, axes="model").axes == ("model",)
    assert FeatureConfig("f", "item", max_ids=np.int64(3)).max_ids == 3


def test_weighted_is_a_planner_hint_kept_as_a_bool():
    assert FeatureConfig("f", "item").weighted is False
    assert FeatureConfig("f", "item", weighted=np.bool_(True)).weighted is True
    assert FeatureConfig("f", "item", combiner="mean", weighted=True) != FeatureConfig(
        "f", "item", combiner="mean"
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"name": ""}, ValueError, r"a feature needs a non-empty str name, got ''"),
        ({"combiner": "avg"}, ValueError, r"feature 'f': combiner must be one of .*got 'avg'"),
        ({"max_ids": 0}, ValueError, r"feature 'f': max_ids must be a positive int, got 0"),
        (
            {"weighted": 1},
            TypeError,
            r"feature 'f': weighted must be a bool \(True when the input is \(ids, weights\)\), "
            r"got 1 of type int",
        ),
        ({"weighted": "yes"}, TypeError, r"weighted must be a bool .*got 'yes' of type str"),
        (
            {"combiner": "max", "weighted": True},
            ValueError,
            r"feature 'f': per-id weights do not apply to combiner='max': pass weighted=False, "
            r"or use combiner 'sum', 'mean' or 'sqrtn'",
        ),
        ({"table": ""}, TypeError, r"feature 'f': table must be the name of a table"),
        (
            {"table": TableConfig("item", 100, 8)},
            TypeError,
            r"feature 'f': table must be the name of a table .*like table='item', got TableConf",
        ),
    ],
)
def test_feature_config_fields_are_validated(kwargs, error, match):
    with pytest.raises(error, match=match):
        FeatureConfig(**{"name": "f", "table": "item", **kwargs})


def test_a_feature_reading_an_unknown_table_names_it_and_the_tables():
    with pytest.raises(ValueError, match=r"feature 'f' reads table 'itme', which is not in the "):
        layout_collection([TableConfig("item", 100, 8)], [FeatureConfig("f", "itme")], MESH_8)


# 2. table_rows axes


@pytest.mark.parametrize(
    ("mesh", "axes", "match"),
    [
        (
            MESH_2X4,
            ("model",),
            r"got axes=\('model',\) on mesh axes \('data', 'model'\): pass "
            r"two of them, e.g. axes=\('data', 'model'\)",
        ),
        (
            jax.sharding.AbstractMesh((2, 2, 2), ("a", "b", "c")),
            ("a", "b", "c"),
            r"got axes=\('a', 'b', 'c'\) on mesh axes \('a', 'b', 'c'\): pass two of them, "
            r"e.g. axes=\('a', 'b'\)",
        ),
        (
            MESH_8,
            None,
            r"got no axes \(default: the mesh's first two\) on mesh axes "
            r"\('model',\): use a mesh of two axes",
        ),
    ],
)
def test_table_rows_without_two_axes_names_the_table_and_the_form(mesh, axes, match):
    table = TableConfig("item", 1000, 8, placement="table_rows", axes=axes)
    with pytest.raises(
        ValueError,
        match=r"table 'item': placement 'table_rows' needs axes=\(across, within\), two mesh "
        r"axes \(rows over `within`, tables over `across`\), " + match + r".*, or use "
        r"placement='rows'",
    ):
        layout_collection([table], [FeatureConfig("f", "item")], mesh)


def test_table_rows_with_two_axes_still_lays_out():
    table = TableConfig("item", 1000, 8, placement="table_rows", axes=("data", "model"))
    layout = layout_collection([table], [FeatureConfig("f", "item")], MESH_2X4)
    assert layout.placement("item").shards == (0, 1, 2, 3)


# 3. the planner's backend


def plan(backend, mesh=MESH_8):
    tables, features = [TableConfig("item", 1000, 8)], [FeatureConfig("f", "item")]
    return plan_collection(
        tables, features, mesh, batch_size=64, memory_per_device="1GiB", backend=backend
    )


def test_an_unknown_backend_is_a_value_error_naming_it_and_the_known_ones():
    with pytest.raises(
        ValueError,
        match=r"backend='npu' has no cost constants: the known backends are "
        r"\('cpu', 'gpu', 'tpu'\)",
    ):
        plan("npu")


@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu"])
def test_the_known_backends_plan(backend):
    assert plan(backend).backend == backend


def test_the_cost_constants_refuse_an_unknown_backend():
    with pytest.raises(ValueError, match=r"backend='npu' has no cost constants"):
        cost.load_constants("npu")
    with pytest.raises(ValueError, match=r"backend='npu' \(the mesh's platform\)"):
        cost.check_backend("npu", source="the mesh's platform")
    assert cost.load_constants("cpu", "native").backend == "cpu-native"


def test_plan_embedding_refuses_an_unknown_backend():
    from jax.sharding import PartitionSpec as P

    from jaxembed.plan import plan_embedding

    mesh = jax.make_mesh((8,), ("model",))
    with pytest.raises(ValueError, match=r"backend='npu' has no cost constants"):
        plan_embedding(mesh, (64, 4), (1000, 16), weight_spec=P("model", None), backend="npu")


# 4. TABLES.json


def write(tmp_path, tables, features=None):
    data = {"tables": tables, **({} if features is None else {"features": features})}
    path = tmp_path / "tables.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_a_table_entry_without_dim_names_the_file_the_entry_and_the_key(tmp_path):
    path = write(tmp_path, [{"name": "user", "vocab_size": 10, "dim": 4},
                            {"name": "item", "vocab_size": 100}])  # fmt: skip
    with pytest.raises(
        ValueError,
        match=r"tables\.json: tables\[1\] \('item'\) is missing the key \['dim'\]: an entry "
        r"takes \['name', 'vocab_size', 'dim'\] and optionally \['placement', 'axes', "
        r"'row_sharding', 'dtype', 'dynamic'\]",
    ):
        load_tables_json(path)


def test_an_entry_without_a_name_is_named_by_its_index(tmp_path):
    with pytest.raises(ValueError, match=r"tables\[0\] is missing the keys \['name', 'dim'\]"):
        load_tables_json(write(tmp_path, [{"vocab_size": 100}]))


def test_a_feature_entry_without_table_names_the_key(tmp_path):
    path = write(tmp_path, [{"name": "item", "vocab_size": 100, "dim": 4}], [{"name": "f"}])
    with pytest.raises(
        ValueError,
        match=r"features\[0\] \('f'\) is missing the key \['table'\]: an entry takes "
        r"\['name', 'table'\] and optionally \['combiner', 'max_ids', 'weighted'\]",
    ):
        load_tables_json(path)


def test_unknown_keys_are_named_with_a_close_match(tmp_path):
    path = write(tmp_path, [{"name": "item", "vocab": 100, "dim": 4, "rows": 3}])
    with pytest.raises(
        ValueError,
        match=r"tables\[0\] \('item'\) has unknown keys \['rows', 'vocab'\]: an entry takes "
        r".*\(did you mean 'vocab' -> 'vocab_size'\?\)",
    ):
        load_tables_json(path)


def test_a_rejected_value_names_the_file_and_the_entry(tmp_path):
    path = write(tmp_path, [{"name": "item", "vocab_size": 100, "dim": 4, "dtype": "int8"}])
    with pytest.raises(
        TypeError, match=r"tables\.json: tables\[0\] \('item'\): table 'item': dtype must be a"
    ):
        load_tables_json(path)
    path = write(tmp_path, [{"name": "item", "vocab_size": 100, "dim": 4}],
                 [{"name": "f", "table": "item", "combiner": "avg"}])  # fmt: skip
    with pytest.raises(ValueError, match=r"features\[0\] \('f'\): feature 'f': combiner must"):
        load_tables_json(path)


def test_a_dtype_name_loads(tmp_path):
    tables, features = load_tables_json(
        write(tmp_path, [{"name": "item", "vocab_size": 100, "dim": 4, "dtype": "bfloat16"}])
    )
    assert tables[0].dtype == jnp.bfloat16 and features == [FeatureConfig("item", "item")]


def test_a_weighted_feature_loads_and_a_weighted_max_names_the_entry(tmp_path):
    table = [{"name": "item", "vocab_size": 100, "dim": 4}]
    feature = {"name": "f", "table": "item", "max_ids": 3, "weighted": True}
    _, features = load_tables_json(write(tmp_path, table, [feature]))
    assert features == [FeatureConfig("f", "item", max_ids=3, weighted=True)]
    with pytest.raises(
        ValueError, match=r"features\[0\] \('f'\): feature 'f': per-id weights do not apply"
    ):
        load_tables_json(write(tmp_path, table, [{**feature, "combiner": "max"}]))


def test_the_cli_prints_the_missing_key(tmp_path, capsys):
    path = write(tmp_path, [{"name": "item", "vocab_size": 100}])
    argv = ["plan", "--tables", path, "--mesh", "data=2,model=4", "--batch", "64"]
    assert cli.main([*argv, "--memory", "1GiB"]) == 2
    assert "tables[0] ('item') is missing the key ['dim']" in capsys.readouterr().err
