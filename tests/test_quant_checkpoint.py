"""Quantized tables checkpoint with orbax as they are: bitwise, sharded, onto another layout.

A `QuantizedTable` is a pytree of its arrays (`data`, `scale`, `bias`) with its precision
static, so orbax's `StandardCheckpointer` saves it like any pytree and restores it onto the
shardings of the target it is given: the same layout, another split (rows to columns, 8
devices to 4), or one device. A quantized collection's state (`coll.quantized(...)`) does the
same, and the restored collection's lookups equal the saved one's bitwise.
"""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed
import jaxembed.nnx
from jaxembed.collection import FeatureConfig, TableConfig
from jaxembed.quant import QuantizedTable, dequantize, quantize


def _host(q: QuantizedTable) -> dict:
    return {k: None if v is None else np.asarray(v) for k, v in
            (("data", q.data), ("scale", q.scale), ("bias", q.bias))}  # fmt: skip


def _save_restore(tree, target, path):
    with ocp.StandardCheckpointer() as ckpt:  # leaving it waits for the write
        ckpt.save(path, tree)
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(path, target)


def _target(q: QuantizedTable, mesh, spec) -> QuantizedTable:
    shardings = q.shardings(mesh, spec)
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), q, shardings
    )


# (precision, the saved layout, the restored one)
CASES = [
    ("int8", ((8,), P("x", None)), ((8,), P("x", None))),
    ("int4", ((8,), P("x", None)), ((2, 4), P(None, "b"))),  # rows -> columns
    ("int2", ((2, 4), P("a", "b")), ((4,), P("x", None))),  # 8 devices -> 4
    ("fp8", ((8,), P(None, "x")), ((1,), P())),  # columns -> one device
]


def _mesh(shape):
    names = ("x",) if len(shape) == 1 else ("a", "b")
    return jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])


@pytest.mark.parametrize("precision, saved, restored", CASES, ids=[c[0] for c in CASES])
def test_a_sharded_quantized_table_restores_bitwise_onto_another_layout(
    precision, saved, restored, tmp_path
):
    table = jax.random.normal(jax.random.key(0), (64, 32), jnp.float32)
    q = quantize(table, precision)
    src_mesh, src_spec = _mesh(saved[0]), saved[1]
    q = jax.device_put(q, q.shardings(src_mesh, src_spec))
    assert q.data.sharding.spec == src_spec
    dst_mesh, dst_spec = _mesh(restored[0]), restored[1]
    got = _save_restore(q, _target(q, dst_mesh, dst_spec), tmp_path / "ckpt")
    assert isinstance(got, QuantizedTable) and got.precision == precision
    assert (got.exponent_bits, got.exponent_bias) == (q.exponent_bits, q.exponent_bias)
    assert got.data.sharding.is_equivalent_to(NamedSharding(dst_mesh, dst_spec), 2)
    for name, want in _host(q).items():
        value = _host(got)[name]
        assert (value is None) == (want is None), name
        if want is not None:
            assert value.dtype == want.dtype and np.array_equal(value, want), name
    np.testing.assert_array_equal(np.asarray(dequantize(got)), np.asarray(dequantize(q)))


def test_a_quantized_collection_restores_and_serves_bitwise(tmp_path):
    mesh = jax.make_mesh((8,), ("x",))
    tables = [TableConfig("item", 800, 16), TableConfig("user", 96, 8, placement="table"),
              TableConfig("os", 8, 8, placement="replicated")]  # fmt: skip
    features = [FeatureConfig("clicked", "item", "mean", 4), FeatureConfig("user", "user"),
                FeatureConfig("os", "os")]  # fmt: skip
    with jax.set_mesh(mesh):
        coll = jaxembed.nnx.EmbeddingBagCollection(tables, features, rngs=nnx.Rngs(0))
        served = coll.quantized({"item": "int4", "user": "int8"})  # os stays float
        graphdef, state = nnx.split(served)
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        got = _save_restore(state, target, tmp_path / "ckpt")
        rng = np.random.default_rng(0)
        data = NamedSharding(mesh, P("x"))
        batch = {f.name: jax.device_put(rng.integers(0, t.vocab_size, (32, f.max_ids or 1))
                                        .astype(np.int32), data)
                 for f, t in zip(features, tables, strict=True)}  # fmt: skip
        lookup = jax.jit(lambda s, b: nnx.merge(graphdef, s)(b))
        want_out, got_out = lookup(state, batch), lookup(got, batch)
    kinds = {type(v).__name__ for v in jax.tree.leaves(
        got, is_leaf=lambda x: isinstance(x, QuantizedTable))}  # fmt: skip
    assert "QuantizedTable" in kinds
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(got), strict=True):
        assert a.sharding == b.sharding and np.array_equal(np.asarray(a), np.asarray(b))
    for name in want_out:
        np.testing.assert_array_equal(np.asarray(got_out[name]), np.asarray(want_out[name]))
