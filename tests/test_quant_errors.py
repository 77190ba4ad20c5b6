"""What `quantize` and the collections' `quantized` refuse, and how they name it.

A row holding NaN or ±inf (or values float16 scale and bias cannot hold) is named by its
row, column and value whatever the table's layout: one device, or split over a 1-D or 2x4
mesh, by rows or by columns, with Explicit or Auto axes. Under `jit` nothing can be raised:
such a row reads NaN, and the others are FBGEMM's rows (`test_quant`'s numpy references). A
collection names the table and its own row (not the stack's), the table a precision cannot
pack, and the tables a row-sparse optimizer cannot train.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_quant import hfp8_decode, hfp8_encode, nbit_rows, tbe_int8_rows

import jaxembed
import jaxembed.flax
import jaxembed.nnx
from jaxembed.quant import RowError, dequantize, quantize, to_fbgemm_rows

F32 = np.float32
V, H = 16, 32  # 4 values a column shard over 8 devices: every precision packs them

LAYOUTS = [  # (mesh shape, axis names, table spec); None: one device
    None,
    ((8,), ("model",), P("model")),
    ((8,), ("model",), P(None, "model")),
    ((2, 4), ("data", "model"), P(("data", "model"))),
    ((2, 4), ("data", "model"), P("model", "data")),
    ((2, 4), ("data", "model"), P(None, ("data", "model"))),
]
BAD = [  # (row, column, value, precision)
    (5, 3, np.nan, "int8"),
    (11, 30, np.inf, "int4"),
    (2, 17, -np.inf, "int2"),
]


EXPLICIT, AUTO = jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto


def with_axis_types(explicit, auto):
    """`(index, axis_type)` cases: the indices in `explicit` with Explicit axes, those in `auto`
    with Auto ones (one device, index 0 here, has no axes: it runs once)."""
    return [pytest.param(i, t, id=f"{name}-{i}")
            for t, name, which in ((EXPLICIT, "explicit", explicit), (AUTO, "auto", auto))
            for i in which]  # fmt: skip


def _put(x, layout, axis_type):
    if layout is None:
        return jnp.asarray(x)
    shape, names, spec = layout
    mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))
    return jax.device_put(x, NamedSharding(mesh, spec))


def _reference_rows(x, precision):
    """FBGEMM's fused rows of `x` (numpy), as `to_fbgemm_rows` writes them."""
    if precision == "int8":
        return tbe_int8_rows(x)
    return nbit_rows(x, {"int4": 4, "int2": 2}[precision])


# Every layout once: one device, the 1-D row and column splits and the 2-D row split with
# Explicit axes; the 2-D split of rows and columns and the 2-D column split with Auto ones.
@pytest.mark.parametrize(("layout", "axis_type"), with_axis_types([0, 1, 2, 3], [4, 5]))
def test_a_row_holding_nan_or_inf_is_named_on_any_layout(rng, layout, axis_type):
    clean = rng.standard_normal((V, H)).astype(F32)
    quantize_jit = jax.jit(quantize, static_argnums=1)
    for row, column, value, precision in BAD:
        x = clean.copy()
        x[row, column] = value
        table = _put(x, LAYOUTS[layout], axis_type)
        with pytest.raises(
            RowError,
            match=rf"^row {row} of the table holds {value} \(column {column}\): {precision} "
            r"rows need finite values .*jnp.nan_to_num.* or use 'fp8'",
        ) as caught:
            quantize(table, precision)
        assert isinstance(caught.value, ValueError) and caught.value.row == row
        # Under jit: no error; the row reads NaN in every column, the others are FBGEMM's.
        q = quantize_jit(table, precision)
        values = np.asarray(dequantize(q))
        assert np.isnan(values[row]).all() and not np.isnan(np.delete(values, row, 0)).any()
        rows = np.asarray(to_fbgemm_rows(q, scale_bias_last=precision != "int8"))
        np.testing.assert_array_equal(
            np.delete(rows, row, 0), _reference_rows(np.delete(x, row, 0), precision)
        )
        # fp8 saturates NaN and ±inf (FBGEMM's fminf), eagerly and under jit.
        for got in (quantize(table, "fp8"), quantize_jit(table, "fp8")):
            np.testing.assert_array_equal(np.asarray(got.data), hfp8_encode(x, 4, 7))


@pytest.mark.parametrize("layout", [1, 4, 5])
def test_a_row_fp16_cannot_scale_is_named_on_any_layout(rng, layout, axis_type):
    x = rng.standard_normal((V, H)).astype(F32)
    x[7, 4] = -7e4  # its min, the bias, is past fp16
    table = _put(x, LAYOUTS[layout], axis_type)
    with pytest.raises(
        ValueError,
        match=r"^row 7 of the table \(min -70000.0, max [0-9.]+\) gets an int4 scale inf and "
        r"bias -inf: float16 scale and bias .* scale_dtype=jnp.float32 with 'int8'",
    ):
        quantize(table, "int4")
    q = quantize(table, "int8", scale_dtype=jnp.float32)  # float32 holds it
    np.testing.assert_array_equal(
        np.asarray(to_fbgemm_rows(q, scale_bias_last=True)),
        np.concatenate([np.asarray(q.data), np.asarray(q.scale)[:, None].view(np.uint8),
                        np.asarray(q.bias)[:, None].view(np.uint8)], axis=1),
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(dequantize(q)), x, atol=np.ptp(x, 1).max() / 255)


def test_a_column_split_the_packed_bytes_do_not_divide(rng, axis_type):
    x = rng.standard_normal((4, 16)).astype(F32)  # 2 values a column shard over 8 devices
    mesh = jax.make_mesh((8,), ("model",), axis_types=(axis_type,))
    table = jax.device_put(x, NamedSharding(mesh, P(None, "model")))
    if axis_type == jax.sharding.AxisType.Explicit:  # packing splits each shard's columns
        with pytest.raises(
            ValueError,
            match=r"an int2 table of shape \(4, 16\) packs 4 bytes a row, which the 8 column "
            r"shards of mesh axes \('model',\) .* reshard its columns over fewer devices",
        ):
            quantize(table, "int2")
        with pytest.raises(ValueError, match=r"packs 4 bytes a row, which the 8 column shards"):
            jax.jit(quantize, static_argnums=1)(table, "int2")  # the layout is in the type
        table = jax.sharding.reshard(table, NamedSharding(mesh, P()))
    rows = np.asarray(to_fbgemm_rows(quantize(table, "int2"), scale_bias_last=True))
    np.testing.assert_array_equal(rows, nbit_rows(x, 2))


# --- collections --------------------------------------------------------------------------------

TABLES = [
    jaxembed.TableConfig("a", 40, 6, placement="rows"),
    jaxembed.TableConfig("b", 40, 6, placement="rows"),  # stacked with a: one array
    jaxembed.TableConfig("c", 10, 7, placement="replicated"),
]
FEATURES = [jaxembed.FeatureConfig(t.name, t.name) for t in TABLES]
MESHES = [None, ((8,), ("model",)), ((2, 4), ("data", "model"))]


def _mesh(which, axis_type):
    if MESHES[which] is None:
        return None
    shape, names = MESHES[which]
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))


def _stack_row(coll, table, row):
    """The stack row holding `table`'s `row`, found by its values (numpy)."""
    (stack,) = [s for s in coll.layout.stacks if table in s.tables]
    physical = np.asarray(coll.stacks[stack.name][...])
    want = np.asarray(coll.tables()[table])[row]
    (hit,) = np.flatnonzero((physical == want).all(1))
    return stack.name, int(hit)


# Each mesh once, and each axis type on a mesh (the layouts and axis types of a refused row
# are crossed above, on the functional `quantize` the collections call per stack).
@pytest.mark.parametrize(("which", "axis_type"), with_axis_types([0, 2], [1]))
def test_a_collection_names_the_table_and_its_row(which, axis_type):
    mesh = _mesh(which, axis_type)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        coll = jaxembed.nnx.EmbeddingBagCollection(TABLES, FEATURES, rngs=nnx.Rngs(0))
        tables = {k: np.asarray(v) for k, v in coll.tables().items()}
        for row, column, value in [(27, 2, np.nan), (3, 5, -np.inf)]:
            stack, stack_row = _stack_row(coll, "b", row)
            b = tables["b"].copy()
            b[row, column] = value
            coll.load_tables({**tables, "b": b})
            with pytest.raises(
                ValueError,
                match=rf"^quantized: row {row} of table 'b' \(row {stack_row} of stack "
                rf"'{stack}'\) holds {value} \(column {column}\): int8 rows need finite",
            ):
                coll.quantized({"a": "int8", "b": "int8"})
        # fp8 takes the row (saturated): a lookup reads FBGEMM's codes of it.
        served = coll.quantized({"a": "fp8", "b": "fp8"})
        ids = jnp.array([[3], [4]])
        got = np.asarray(served({"a": ids, "b": ids, "c": jnp.array([[0], [1]])})["b"])
        np.testing.assert_array_equal(got, hfp8_decode(hfp8_encode(b[[3, 4]], 4, 7), 4, 7))
        # Linen names them the same way.
        linen = jaxembed.flax.EmbeddingBagCollection(TABLES, FEATURES)
        batch = {t.name: jnp.zeros((8, 1), jnp.int32) for t in TABLES}
        variables = linen.load_tables({**tables, "b": b}, linen.init(jax.random.key(0), batch))
        with pytest.raises(ValueError, match=rf"^quantized: row 3 of table 'b' \(row {stack_row}"):
            linen.quantized("int8", variables)


def test_a_collection_under_jit_reads_the_refused_row_as_nan(axis_type):
    mesh = _mesh(2, axis_type)
    with jax.set_mesh(mesh):
        coll = jaxembed.nnx.EmbeddingBagCollection(TABLES, FEATURES, rngs=nnx.Rngs(0))
        tables = {k: np.array(v) for k, v in coll.tables().items()}
        tables["b"][27, 2] = np.nan
        coll.load_tables(tables)
        served = nnx.jit(lambda m: m.quantized({"a": "int8", "b": "int8"}))(coll)
        batch = {"a": jnp.array([[27]] * 8), "b": jnp.array([[27]] * 4 + [[26]] * 4),
                 "c": jnp.zeros((8, 1), jnp.int32)}  # fmt: skip
        out = {k: np.asarray(v) for k, v in served(batch).items()}
    assert np.isnan(out["b"][:4]).all()
    for name, row, got in [("b", 26, out["b"][4:]), ("a", 27, out["a"])]:
        fused = tbe_int8_rows(tables[name][row : row + 1])[0]  # FBGEMM's row: f16 scale, bias
        scale, bias = fused[:4].view(np.float16).astype(F32)
        np.testing.assert_array_equal(got, np.broadcast_to(fused[4:] * scale + bias, got.shape))


@pytest.mark.parametrize(("which", "axis_type"), with_axis_types([0, 2], [2]))
def test_a_dim_the_precision_cannot_pack_names_the_table(which, axis_type):
    mesh = _mesh(which, axis_type)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        coll = jaxembed.nnx.EmbeddingBagCollection(TABLES, FEATURES, rngs=nnx.Rngs(0))
        with pytest.raises(
            ValueError,
            match=r"^quantized: int4 packs 2 values a byte, so it cannot pack the rows of table "
            r"'c' \(dim 7\): give it an even dim \(TableConfig\('c', \.\.\., dim=8\)\), quantize "
            r"it to 'int8' or 'fp8', .*\{'c': 'int8'\}\), or keep it float \(\{'c': None\}\)",
        ):
            coll.quantized("int4")
        with pytest.raises(ValueError, match=r"cannot pack the rows of table 'c' \(dim 7\)"):
            nnx.jit(lambda m: m.quantized("int4"))(coll)  # a static check: under jit too
        with pytest.raises(
            ValueError,
            match=r"tables 'a', 'b' \(dim 6\): give them a dim that is a multiple of 4 "
            r"\(TableConfig\('a', \.\.\., dim=8\)\)",
        ):
            coll.quantized({"a": "int2", "b": "int2"})
        linen = jaxembed.flax.EmbeddingBagCollection(TABLES, FEATURES)
        batch = {t.name: jnp.zeros((8, 1), jnp.int32) for t in TABLES}
        with pytest.raises(ValueError, match=r"cannot pack the rows of table 'c' \(dim 7\)"):
            linen.quantized({"c": "int2"}, linen.init(jax.random.key(0), batch))
    if mesh is None:
        return
    # A column split: each shard's values must pack (8 over 8 devices: 1 value a shard).
    columns = [jaxembed.TableConfig("w", 16, 8, placement="columns")]
    with jax.set_mesh(mesh):
        wide = jaxembed.nnx.EmbeddingBagCollection(
            columns, [jaxembed.FeatureConfig("w", "w")], rngs=nnx.Rngs(0)
        )
        with pytest.raises(
            ValueError,
            match=r"table 'w' \(dim 8, split over 8 column shards of mesh axes \('data', "
            r"'model'\): 1 value a shard\): give it a dim that is a multiple of 16",
        ):
            wide.quantized("int4")
        served = wide.quantized("int8")
        ids = jnp.arange(16).reshape(8, 2)
        got = np.asarray(served({"w": ids})["w"])
    rows = np.asarray(dequantize(quantize(np.asarray(wide.tables()["w"]), "int8")), np.float64)
    np.testing.assert_allclose(got, rows[np.asarray(ids)].sum(1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("which", "axis_type"), with_axis_types([0, 2], [2]))
def test_a_row_sparse_optimizer_names_the_quantized_tables(which, axis_type):
    mesh = _mesh(which, axis_type)
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        coll = jaxembed.nnx.EmbeddingBagCollection(TABLES, FEATURES, rngs=nnx.Rngs(0))
        fix = r"Build the SparseOptimizer .* from the float collection, .* coll.quantized"
        with pytest.raises(
            TypeError,
            match=r"^tables \['a', 'b'\] of this collection are quantized .* quantized tables "
            r"are inference-only and take no optimizer\. " + fix,
        ):
            jaxembed.nnx.SparseOptimizer(coll.quantized({"a": "int8", "b": "int8"}), opt)
        with pytest.raises(TypeError, match=r"^tables \['a', 'b', 'c'\] .* inference-only"):
            coll.quantized("int8").init_optimizer(opt)
        jaxembed.nnx.SparseOptimizer(coll, opt)  # the float collection trains
        linen = jaxembed.flax.EmbeddingBagCollection(TABLES, FEATURES)
        batch = {t.name: jnp.zeros((8, 1), jnp.int32) for t in TABLES}
        variables = linen.init(jax.random.key(0), batch)
        with pytest.raises(
            TypeError,
            match=r"^tables \['c'\] .* inference-only .* served = coll.quantized\(precision, "
            r"variables\)",
        ):
            linen.init_optimizer(opt, linen.quantized({"c": "int8"}, variables))
