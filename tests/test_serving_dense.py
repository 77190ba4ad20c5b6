"""Dense sum bags pooled without a scatter: what an exported ranker's lookups run.

`jaxembed.embedding_bag(ids [*batch, L], table, combiner="sum", impl="xla")` without weights
pools dense bags of up to 64 slots by adding each bag's rows slot after slot
(`jaxembed.kernels.bag._pool_dense`), not by the segment sum (a scatter-add on XLA:CPU) that
longer, ragged, weighted, mean and sqrtn bags use. The adds are the segment sum's, in its
order: the results are the same floats, for float and quantized tables, with padding and ids
past the table, and the gradients too. An export of such lookups holds no scatter, and one
artifact with a symbolic batch serves batch 1, 7, 64 and 513 in a process without jaxembed
bitwise as the segment-sum lookup does here.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxembed
from jaxembed import serving
from jaxembed.kernels import bag
from jaxembed.quant import quantize

V, H, F, L = 30, 8, 3, 4  # rows, dim, features (a table each), ids a bag
SERVED_BATCHES = (1, 7, 64, 513)
PRECISIONS = ("float32", "bfloat16", "int8", "int4", "int2", "fp8")


def _table(precision, seed=0):
    table = jnp.asarray(np.random.default_rng(seed).standard_normal((V, H)), jnp.float32)
    if precision in ("float32", "bfloat16"):
        return table.astype(precision)
    return quantize(table, precision)


def _ids(shape, seed=1):
    """Ids with empty slots (-1), rows past the table and the padding id 4 among them."""
    return np.random.default_rng(seed).integers(-2, V + 2, shape).astype(np.int32)


def _segment_sum_path(monkeypatch):
    """From here on dense bags pool as ragged ones do (the segment sum)."""
    monkeypatch.setattr(bag, "_SLOTS_ADDED_IN_ORDER", 0)


def _lookup(combiner, weighted, padding_idx):
    def lookup(ids, table, weights):
        return jaxembed.embedding_bag(
            ids, table, combiner=combiner, padding_idx=padding_idx, check_ids=False,
            per_id_weights=weights if weighted else None, impl="xla",
        )  # fmt: skip

    return lookup


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("shape", [(5,), (7, 3), (2, 3, 5), (4, 64), (1, 1)])
def test_dense_sum_bags_pool_to_the_segment_sums_floats(monkeypatch, precision, shape):
    """Bitwise the segment sum's results, under jit and eagerly, with and without padding
    (one bag of 5 ids, bags of 3, 5, 64 and 1)."""
    table, ids = _table(precision), _ids(shape)
    fast = {pad: np.asarray(jax.jit(_lookup("sum", False, pad))(ids, table, None))
            for pad in (None, 4)}  # fmt: skip
    eager = np.asarray(_lookup("sum", False, 4)(ids, table, None))
    _segment_sum_path(monkeypatch)
    for pad, got in fast.items():
        want = np.asarray(jax.jit(_lookup("sum", False, pad))(ids, table, None))
        assert got.shape == (*shape[:-1], H)
        assert got.tobytes() == want.tobytes(), pad
    assert eager.tobytes() == np.asarray(_lookup("sum", False, 4)(ids, table, None)).tobytes()


@pytest.mark.parametrize(("combiner", "weighted"), [("sum", True), ("mean", False),
                                                    ("sqrtn", False)])  # fmt: skip
def test_other_factors_keep_the_segment_sum(monkeypatch, combiner, weighted):
    """Mean, sqrtn and weighted bags pool as before (bitwise: the same program)."""
    table, ids = _table("int8"), _ids((7, L))
    weights = np.random.default_rng(2).random(ids.shape).astype(np.float32)
    lookup = jax.jit(_lookup(combiner, weighted, None))
    assert "scatter" in lookup.lower(ids, table, weights).as_text()
    got = np.asarray(lookup(ids, table, weights))
    _segment_sum_path(monkeypatch)
    want = np.asarray(jax.jit(_lookup(combiner, weighted, None))(ids, table, weights))
    assert got.tobytes() == want.tobytes()


def test_dense_sum_bags_equal_the_float64_sums():
    table, ids = _table("float32"), _ids((9, L))
    got = jax.jit(_lookup("sum", False, None))(ids, table, None)
    rows = np.asarray(table, np.float64)
    want = [rows[[i for i in bag_ids if 0 <= i < V]].sum(axis=0) for bag_ids in ids]
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dense_sum_bags_train_with_the_segment_sums_gradients(monkeypatch, dtype):
    table, ids = _table(dtype), _ids((6, L))

    def loss(table):
        pooled = _lookup("sum", False, 4)(ids, table, None).astype(jnp.float32)
        return jnp.sum(pooled * jnp.arange(H, dtype=jnp.float32)[None])

    fast = jax.jit(jax.value_and_grad(loss))(table)
    _segment_sum_path(monkeypatch)
    want = jax.jit(jax.value_and_grad(loss))(table)
    for got, expected in zip(fast, want, strict=True):
        assert np.asarray(got).tobytes() == np.asarray(expected).tobytes()


def _ranker(params, ids):  # ids: i32[B, F, L] -> f32[B, F, H]
    pooled = [jaxembed.embedding_bag(ids[:, f], table, impl="xla")  # f32[B, H]
              for f, table in enumerate(params)]  # fmt: skip
    return jnp.stack(pooled, axis=1)


@pytest.mark.parametrize("precision", ["float32", "int8"])
def test_an_export_of_dense_bags_holds_no_scatter(precision):
    """The exported program gathers and adds; bags longer than 64 slots keep the scatter."""
    params = [_table(precision, seed=f) for f in range(F)]

    def compiled(slots):  # the program XLA runs where the artifact is loaded
        ids = jnp.zeros((4, F, slots), jnp.int32)
        artifact = serving.export_inference(_ranker, params, ids)
        return jax.jit(artifact.exported.call).lower(artifact.leaves, ids).compile().as_text()

    assert " scatter(" not in compiled(L)
    assert " scatter(" in compiled(65)


CHILD = """
import sys
from pathlib import Path

sys.modules["jaxembed"] = None  # from here on, `import jaxembed` raises ImportError
work = Path(sys.argv[1])
sys.path.insert(0, str(work))
import numpy as np
import loader  # the copy beside the artifacts

batches = np.load(work / "batches.npz")
out = {}
for name in sys.argv[2:]:
    model = loader.load(work / name)
    for n in batches.files:
        out[f"{name}/{n}"] = np.asarray(model(batches[n]))
leaked = [m for m, v in sys.modules.items() if m.startswith("jaxembed") and v is not None]
assert not leaked, leaked
np.savez(work / "outputs.npz", **out)
"""


def test_one_dense_artifact_serves_every_batch_without_jaxembed(monkeypatch, tmp_path):
    """Float, int8 and int4 tables, exported once with a symbolic batch: in a process without
    jaxembed, batch 1, 7, 64 and 513 answer as the segment-sum lookup does here (bitwise)."""
    (b,) = jax.export.symbolic_shape("b")
    spec = jax.ShapeDtypeStruct((b, F, L), jnp.int32)
    batches = {str(n): _ids((n, F, L), seed=n) for n in SERVED_BATCHES}
    np.savez(tmp_path / "batches.npz", **batches)
    names = ("float32", "int8", "int4")
    params = {p: [_table(p, seed=f) for f in range(F)] for p in names}
    for p in names:
        artifact = serving.export_inference(_ranker, params[p], spec)
        assert artifact.manifest["args"][0]["shape"] == ["b", F, L]
        serving.save(artifact, tmp_path / p)
    (tmp_path / "loader.py").write_bytes((tmp_path / names[0] / "loader.py").read_bytes())
    (tmp_path / "child.py").write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "child.py"), str(tmp_path), *names],
        cwd=tmp_path, env=env | {"JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    with np.load(tmp_path / "outputs.npz") as f:
        served = dict(f)
    _segment_sum_path(monkeypatch)
    for p in names:
        for n, ids in batches.items():
            want = np.asarray(jax.jit(_ranker)(params[p], ids))
            assert served[f"{p}/{n}"].shape == (int(n), F, H)
            assert served[f"{p}/{n}"].tobytes() == want.tobytes(), (p, n)
