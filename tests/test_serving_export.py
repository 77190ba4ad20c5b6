"""Serving (`jaxembed.serving`): an exported inference function runs where jaxembed is not.

A small ranker (three pooled features, sum and mean bags, and a 2-layer MLP) is exported with
float, int8 and int4 tables and saved; one fresh subprocess, in which `import jaxembed` fails,
loads each artifact with the copied `loader.py` and runs it: float outputs equal the in-process
ones within 1e-6, quantized ones bitwise. The same subprocess then loads a native export
(custom calls to jaxembed's FFI kernels) after registering them. The bad inputs (native calls
in an XLA export, parameters of another shape or dtype, a native artifact loaded without its
kernels) fail with errors that name the value and the fix.
"""

import ast
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxembed
from jaxembed import serving
from jaxembed.kernels import native
from jaxembed.quant import quantize

ROOT = Path(__file__).resolve().parents[1]
V, H, L, BATCH, DENSE, HIDDEN = 40, 8, 4, 6, 3, 16  # rows, dim, ids a bag, batch, dense, MLP
COMBINERS = ("sum", "mean", "sum")  # one table a feature
needs_native = pytest.mark.skipif(
    not native.available(), reason=f"native kernels unavailable: {native.why_unavailable()}"
)


def _ranker(lookup):
    def ranker(params, ids, dense):  # ids: i32[B, F, L]   dense: f32[B, D]
        pooled = [
            lookup(ids[:, f], table, combiner)  # f32[B, H]
            for f, (table, combiner) in enumerate(zip(params["tables"], COMBINERS, strict=True))
        ]
        x = jnp.concatenate([*pooled, dense], axis=-1)  # f32[B, F·H + D]
        (w1, b1), (w2, b2) = ((layer["w"], layer["b"]) for layer in params["mlp"])
        hidden = jax.nn.relu(x @ w1 + b1[None])  # f32[B, HIDDEN]
        return {"pooled": jnp.stack(pooled, axis=1), "score": hidden @ w2 + b2[None]}

    return ranker


LOOKUPS = {  # how each variant's tables are read
    "float": lambda ids, t, c: jaxembed.embedding_bag(ids, t, combiner=c, impl="xla"),
    "int8": lambda ids, t, c: jaxembed.embedding_bag(ids, t, combiner=c, impl="xla"),
    "int4": lambda ids, t, c: jaxembed.embedding_bag(ids, t, combiner=c, impl="xla"),
    "native": lambda ids, t, c: jaxembed.embedding_bag(ids, t, combiner=c, impl="native"),
}


def _params(precision):
    rng = np.random.default_rng(0)
    tables = [jnp.asarray(rng.standard_normal((V, H)), jnp.float32) for _ in COMBINERS]
    if precision in ("int8", "int4"):
        tables = [quantize(t, precision) for t in tables]
    sizes = [len(COMBINERS) * H + DENSE, HIDDEN, 1]
    mlp = [
        {"w": jnp.asarray(rng.standard_normal((m, n)) / np.sqrt(m), jnp.float32),
         "b": jnp.asarray(rng.standard_normal(n) * 0.1, jnp.float32)}
        for m, n in itertools.pairwise(sizes)
    ]  # fmt: skip
    return {"tables": tables, "mlp": mlp}


def _collection(precision):
    """An NNX collection at its defaults (no `impl=` anywhere: "auto", native kernels here),
    over the ranker's three features; `precision` quantizes a serving copy of it. Returns
    `fn(state, ids)` for `export_inference` and the state."""
    from flax import nnx

    import jaxembed.nnx

    tables = [jaxembed.TableConfig(f"t{f}", V, H) for f in range(len(COMBINERS))]
    features = [jaxembed.FeatureConfig(f"f{f}", f"t{f}", combiner=c)
                for f, c in enumerate(COMBINERS)]  # fmt: skip
    coll = jaxembed.nnx.EmbeddingBagCollection(tables, features, rngs=nnx.Rngs(0))
    if precision != "float":
        coll = coll.quantized(precision)
    graphdef, state = nnx.split(coll)

    def fn(state, ids):  # ids: i32[B, F, L]
        pooled = nnx.merge(graphdef, state)({f"f{f}": ids[:, f] for f in range(len(COMBINERS))})
        return {"pooled": jnp.stack([pooled[f"f{f}"] for f in range(len(COMBINERS))], axis=1)}

    return fn, state


COLLECTIONS = {"collection": "float", "collection-int8": "int8"}
ANY_BATCH = {"any-batch": "float", "any-batch-int8": "int8"}  # one artifact, a symbolic batch
SERVED_BATCHES = (1, 7, 64, 513)


def _served_ids(batch):
    return np.random.default_rng(batch).integers(-1, V, (batch, len(COMBINERS), L)).astype(
        np.int32
    )


def _dynamic_config():
    from jaxembed.dynamic import DynamicTableConfig

    return DynamicTableConfig(capacity=32, bucket_size=4, admit_after=2, policy="lru")


def _dynamic():
    """A `DynamicEmbed` trained a few steps (some ids admitted, some evicted or refused), in
    evaluation mode: `fn(state, keys)`, its state, and the keys served (trained ids and ids
    never seen)."""
    from flax import nnx

    import jaxembed.nnx
    from jaxembed.dynamic import as_keys

    emb = jaxembed.nnx.DynamicEmbed(_dynamic_config(), H, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(3)
    seen = rng.integers(-(2**62), 2**62, 60, dtype=np.int64)
    train = nnx.jit(lambda m, k: m(k))
    for _ in range(6):
        train(emb, as_keys(seen[rng.integers(0, len(seen), 24)]))
    emb.deterministic = True
    graphdef, state = nnx.split(emb)
    fresh = rng.integers(-(2**62), 2**62, 20, dtype=np.int64)
    return (lambda state, keys: nnx.merge(graphdef, state)(keys)), state, as_keys(
        np.concatenate([seen, fresh])
    )


def _inputs():
    rng = np.random.default_rng(1)
    ids = rng.integers(-1, V, (BATCH, len(COMBINERS), L)).astype(np.int32)  # -1: empty slots
    ids[0, 1] = -1  # an empty mean bag
    return ids, rng.standard_normal((BATCH, DENSE)).astype(np.float32)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Every variant exported and saved under one directory, with the inputs and the
    in-process outputs: `{variant: (artifact, expected outputs)}` and the directory."""
    work = tmp_path_factory.mktemp("serving")
    ids, dense = _inputs()
    np.savez(work / "inputs.npz", ids=ids, dense=dense)
    variants = ["float", "int8", "int4"] + (["native"] if native.available() else [])
    out = {}
    for name in variants:
        fn, params = _ranker(LOOKUPS[name]), _params(name)
        artifact = serving.export_inference(
            fn, params, jnp.asarray(ids), jnp.asarray(dense), native=name == "native"
        )
        serving.save(artifact, work / name)
        expected = jax.tree.map(np.asarray, jax.jit(fn)(params, ids, dense))
        out[name] = artifact, expected
    for name, precision in COLLECTIONS.items():  # exported at their defaults, native=False
        fn, state = _collection(precision)
        artifact = serving.export_inference(fn, state, jnp.asarray(ids))
        serving.save(artifact, work / name)
        out[name] = artifact, jax.tree.map(np.asarray, fn(state, jnp.asarray(ids)))
    (b,) = jax.export.symbolic_shape("b")
    for name, precision in ANY_BATCH.items():
        fn, state = _collection(precision)
        spec = jax.ShapeDtypeStruct((b, len(COMBINERS), L), jnp.int32)
        artifact = serving.export_inference(fn, state, spec)
        serving.save(artifact, work / name)
        expected = {f"{n}": np.asarray(fn(state, jnp.asarray(_served_ids(n)))["pooled"])
                    for n in SERVED_BATCHES}  # fmt: skip
        out[name] = artifact, expected
    np.savez(work / "batches.npz", **{str(n): _served_ids(n) for n in SERVED_BATCHES})
    fn, state, keys = _dynamic()
    (b,) = jax.export.symbolic_shape("b")
    artifact = serving.export_inference(fn, state, jax.ShapeDtypeStruct((b, 2), jnp.uint32))
    serving.save(artifact, work / "dynamic")
    np.save(work / "keys.npy", keys)
    out["dynamic"] = artifact, (np.asarray(fn(state, jnp.asarray(keys))), state, keys)
    shutil.copyfile(ROOT / "jaxembed" / "serving" / "loader.py", work / "loader.py")
    return out, work


CHILD = """
import sys
from pathlib import Path

sys.modules["jaxembed"] = None  # from here on, `import jaxembed` raises ImportError
try:
    import jaxembed
except ImportError:
    pass
else:
    raise SystemExit("jaxembed was importable")
work, root = Path(sys.argv[1]), sys.argv[2]
sys.path.insert(0, str(work))
import numpy as np
import loader  # the copy beside the artifacts

inputs = np.load(work / "inputs.npz")
out = {}
for name in ("float", "int8", "int4"):
    result = loader.load(work / name)(inputs["ids"], inputs["dense"])
    out.update({f"{name}/{k}": np.asarray(v) for k, v in result.items()})
for name in ("collection", "collection-int8"):
    result = loader.load(work / name)(inputs["ids"])
    out.update({f"{name}/{k}": np.asarray(v) for k, v in result.items()})
batches = np.load(work / "batches.npz")
for name in ("any-batch", "any-batch-int8"):
    model = loader.load(work / name)
    for n in batches.files:
        out[f"{name}/{n}"] = np.asarray(model(batches[n])["pooled"])
keys = np.load(work / "keys.npy")
out["dynamic/all"] = np.asarray(loader.load(work / "dynamic")(keys))
out["dynamic/first"] = np.asarray(loader.load(work / "dynamic")(keys[:1]))
leaked = [m for m, v in sys.modules.items() if m.startswith("jaxembed") and v is not None]
assert not leaked, leaked
if (work / "native").exists():  # a native artifact: register jaxembed's kernels first
    del sys.modules["jaxembed"]
    sys.path.append(root)
    import jaxembed.serving

    model = loader.load(work / "native", register=jaxembed.serving.register)
    result = model(inputs["ids"], inputs["dense"])
    out.update({f"native/{k}": np.asarray(v) for k, v in result.items()})
np.savez(work / "outputs.npz", **out)
"""


@pytest.fixture(scope="module")
def reloaded(exported):
    """The outputs of one fresh process that loads every artifact: `{"float/score": ...}`."""
    _, work = exported
    (work / "child.py").write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    proc = subprocess.run(
        [sys.executable, str(work / "child.py"), str(work), str(ROOT)],
        cwd=work, env=env | {"JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    with np.load(work / "outputs.npz") as f:
        return dict(f)


@pytest.mark.parametrize("name", ["float", "int8", "int4"])
def test_an_xla_export_has_no_custom_call_of_jaxembed(exported, name):
    artifact, _ = exported[0][name]
    text = artifact.exported.mlir_module()
    assert "jaxembed_" not in text.replace("jaxembed_version", "")
    assert serving.native_targets(artifact.exported) == artifact.native_targets == ()
    manifest = json.loads((exported[1] / name / "manifest.json").read_text())
    assert manifest["native_targets"] == [] and manifest["nr_devices"] == 1


def test_the_float_model_reloads_without_jaxembed(exported, reloaded):
    _, expected = exported[0]["float"]
    for key in ("pooled", "score"):
        np.testing.assert_allclose(reloaded[f"float/{key}"], expected[key], rtol=1e-6, atol=1e-7)
    assert not expected["pooled"][0, 1].any()  # the empty mean bag: zeros


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_a_quantized_model_reloads_bitwise(exported, reloaded, name):
    _, expected = exported[0][name]
    for key in ("pooled", "score"):
        np.testing.assert_array_equal(reloaded[f"{name}/{key}"], expected[key])


@needs_native
def test_a_native_export_loads_where_the_kernels_are_registered(exported, reloaded):
    artifact, expected = exported[0]["native"]
    assert artifact.native_targets == ("jaxembed_pool_sum",)
    assert "custom_call @jaxembed_pool_sum" in artifact.exported.mlir_module()
    for key in ("pooled", "score"):
        np.testing.assert_allclose(reloaded[f"native/{key}"], expected[key], rtol=1e-6, atol=1e-7)


@needs_native
def test_native_kernels_in_an_xla_export_are_refused(exported):
    ids, dense = (jnp.asarray(a) for a in _inputs())
    fn = _ranker(LOOKUPS["native"])
    with pytest.raises(
        ValueError,
        match=r"ranker calls jaxembed's native kernels \(custom calls jaxembed_pool_sum\).*"
        r"impl='xla'.*DisabledSafetyCheck\.custom_call\('jaxembed_pool_sum'\)",
    ):
        serving.export_inference(fn, _params("float"), ids, dense)


@needs_native
def test_a_native_artifact_needs_its_kernels_registered(exported):
    with pytest.raises(RuntimeError, match=r"FFI targets jaxembed_pool_sum.*register=jaxembed"):
        serving.load(exported[1] / "native")


def test_the_manifest_names_each_leaf_and_the_loader_is_copied(exported):
    artifact, _ = exported[0]["int4"]
    work = exported[1] / "int4"
    manifest = json.loads((work / "manifest.json").read_text())
    leaves = {e["name"]: (e["dtype"], tuple(e["shape"])) for e in manifest["params"]}
    assert leaves["['tables'][0].data"] == ("uint8", (V, H // 2))
    assert leaves["['tables'][2].scale"] == ("float16", (V,))
    assert leaves["['mlp'][1]['w']"] == ("float32", (HIDDEN, 1))
    assert [e["name"] for e in manifest["params"]] == list(artifact.leaf_names)
    assert [a["shape"] for a in manifest["args"]] == [[BATCH, 3, L], [BATCH, DENSE]]
    assert (work / "loader.py").read_bytes() == Path(serving.loader.__file__).read_bytes()


def test_the_loader_imports_only_the_standard_library_numpy_and_jax():
    tree = ast.parse(Path(serving.loader.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                for a in n.names}  # fmt: skip
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported - set(sys.stdlib_module_names) == {"jax", "numpy"}


@pytest.mark.parametrize(
    "leaf, bad, message",
    [
        ("['mlp'][0]['w']", np.zeros((3 * H + DENSE, HIDDEN + 1), np.float32),
         r"leaf \['mlp'\]\[0\]\['w'\] from params= is float32\[27, 17\], but the model was exported for float32\[27, 16\]"),
        ("['tables'][1]", np.zeros((V, H), np.float16),
         r"leaf \['tables'\]\[1\] from params= is float16\[40, 8\].*float32\[40, 8\].*astype\('float32'\)"),
    ],
)  # fmt: skip
def test_params_of_another_shape_or_dtype_name_the_leaf(exported, leaf, bad, message):
    with pytest.raises(ValueError, match=message):
        serving.load(exported[1] / "float", params={leaf: bad}, compile=False)


def test_a_tampered_npz_names_the_leaf(exported, tmp_path):
    shutil.copytree(exported[1] / "float", tmp_path / "float")
    with np.load(tmp_path / "float" / "params.npz") as f:
        stored = dict(f)
    stored["['mlp'][1]['b']"] = np.zeros((2,), np.float32)
    np.savez(tmp_path / "float" / "params.npz", **stored)
    with pytest.raises(
        ValueError, match=r"leaf \['mlp'\]\[1\]\['b'\] from .*params\.npz is float32\[2\]"
    ):
        serving.load(tmp_path / "float", compile=False)


def test_an_artifact_saved_without_params_shares_anothers(exported, tmp_path):
    artifact, expected = exported[0]["int8"]
    ids, dense = _inputs()
    first = serving.load(exported[1] / "int8")
    serving.save(artifact, tmp_path / "shared", params=False)
    assert not (tmp_path / "shared" / "params.npz").exists()
    with pytest.raises(ValueError, match=r"saved without its parameters .* params=other\.params"):
        serving.load(tmp_path / "shared")
    second = serving.load(tmp_path / "shared", params=first.params)
    np.testing.assert_array_equal(np.asarray(second(ids, dense)["score"]), expected["score"])


def test_bfloat16_leaves_are_stored_as_their_bits(tmp_path):
    table = jnp.asarray(np.random.default_rng(2).standard_normal((V, H)), jnp.bfloat16)
    fn = lambda p, ids: jaxembed.embedding_bag(ids, p["t"], combiner="sum", impl="xla")
    ids = _inputs()[0][:, 0]
    path = serving.save(serving.export_inference(fn, {"t": table}, ids), tmp_path / "bf16")
    assert json.loads((path / "manifest.json").read_text())["params"][0]["stored_as"] == "uint16"
    got = serving.load(path)(ids)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(got, np.float32), np.asarray(fn({"t": table}, ids), np.float32)
    )


def test_a_leaf_that_is_not_an_array_is_named():
    with pytest.raises(TypeError, match=r"params\['scale'\] is a str, not an array"):
        serving.export_inference(lambda p, x: x, {"scale": "2"}, jnp.zeros(2))


def test_inputs_of_another_shape_say_what_the_model_takes(exported):
    ids, dense = _inputs()
    model = serving.load(exported[1] / "float", compile=False)
    with pytest.raises(
        ValueError, match=r"exported for inputs \(int32\[6, 3, 4\], float32\[6, 3\]\)"
    ):
        model(ids[:2], dense[:2])


@pytest.mark.parametrize("name", list(COLLECTIONS))
def test_a_collection_at_its_defaults_exports_and_serves_without_jaxembed(exported, reloaded, name):
    """The NNX collection (float, and its int8 serving copy) takes no `impl=`: traced by
    `export_inference`, its "auto" lookups run XLA's kernels, and the artifact loads and
    answers in the process without jaxembed as the collection does in this one (float
    within 1e-6, quantized bitwise)."""
    artifact, expected = exported[0][name]
    assert artifact.native_targets == ()
    got = reloaded[f"{name}/pooled"]
    if name == "collection":
        np.testing.assert_allclose(got, expected["pooled"], rtol=1e-6, atol=1e-6)
    else:
        np.testing.assert_array_equal(got, expected["pooled"])


def test_default_impl_reaches_every_auto_lookup_and_is_scoped():
    """`jaxembed.default_impl`: "auto" resolves as the block says, explicit impls keep
    theirs, and the setting ends with the block."""
    from jaxembed.plan.impl import resolve_impl

    with jaxembed.default_impl("xla"):
        assert resolve_impl("auto", "cpu", np.float32) == "xla"
        if native.available():
            assert resolve_impl("native", "cpu", np.float32) == "native"
    if native.available():
        assert resolve_impl("auto", "cpu", np.float32) == "native"
    with pytest.raises(ValueError, match="default_impl takes one of"):
        with jaxembed.default_impl("fast"):
            pass


@pytest.mark.parametrize("name", list(ANY_BATCH))
def test_one_artifact_serves_every_batch_size(exported, reloaded, name):
    """A collection exported once with a symbolic batch (`jax.export.symbolic_shape("b")`)
    answers at batch 1, 7, 64 and 513 in the process without jaxembed as the collection does
    here (float within 1e-6, int8 bitwise); the manifest names the dimension."""
    artifact, expected = exported[0][name]
    assert artifact.manifest["args"][0]["shape"] == ["b", len(COMBINERS), L]
    for n in SERVED_BATCHES:
        got = reloaded[f"{name}/{n}"]
        assert got.shape == (n, len(COMBINERS), H)
        if name == "any-batch":
            np.testing.assert_allclose(got, expected[str(n)], rtol=1e-6, atol=1e-6)
        else:
            np.testing.assert_array_equal(got, expected[str(n)])


def test_ragged_bags_with_a_symbolic_total_serve_any_batch():
    """`Ragged(values, lengths)` with symbolic `n` ids and `b` bags: one artifact, any batch,
    equal to the float64 sum of each bag's rows."""
    b, n = jax.export.symbolic_shape("b, n")
    table = np.random.default_rng(0).standard_normal((V, H)).astype(np.float32)

    def fn(params, values, lengths):
        bags = jaxembed.Ragged(values, lengths)
        return jaxembed.embedding_bag(bags, params["table"], combiner="sum")

    artifact = serving.export_inference(
        fn, {"table": jnp.asarray(table)},
        jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32),
    )  # fmt: skip
    assert artifact.native_targets == ()
    for lengths in ([2, 0, 3], [1] * 9, [4] * 40):
        rng = np.random.default_rng(len(lengths))
        values = rng.integers(0, V, sum(lengths)).astype(np.int32)
        got = np.asarray(artifact(jnp.asarray(values), jnp.asarray(lengths, jnp.int32)))
        starts = np.cumsum([0, *lengths])
        want = np.stack([table.astype(np.float64)[values[s:e]].sum(0)
                         for s, e in itertools.pairwise(starts)])  # fmt: skip
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_dynamic_table_serves_raw_ids_without_jaxembed(exported, reloaded):
    """A trained `DynamicEmbed` exported at its defaults (a symbolic batch of keys
    `uint32[b, 2]`): the id -> row map travels in the artifact and is read by XLA ops. In the
    process without jaxembed every id reads what the training side reads: an admitted id its
    row of the table, an id without one (never seen, refused or evicted) zeros."""
    from jaxembed.optim.dynamic import rows_for

    artifact, (expected, state, keys) = exported[0]["dynamic"]
    assert artifact.native_targets == ()
    emb = state["embedding"][...]
    cfg_rows = rows_for(_dynamic_config(), state["remap"].get_value(), keys, impl="xla")
    rows = np.asarray(cfg_rows)
    table = np.concatenate([np.asarray(emb), np.zeros((1, H), np.float32)])
    np.testing.assert_array_equal(reloaded["dynamic/all"], table[rows])
    np.testing.assert_array_equal(reloaded["dynamic/all"], expected)
    np.testing.assert_array_equal(reloaded["dynamic/first"], expected[:1])
    admitted = rows < 32
    assert 0 < admitted.sum() < len(rows)  # some ids have rows, some read zeros
    assert not admitted[-20:].any()  # the ids never seen


def test_a_linen_collection_at_its_defaults_exports_for_every_batch():
    """The Linen collection (its `apply` on the variables `init` made), exported as written:
    no custom call, one artifact for every batch size, equal to `apply` here."""
    import jaxembed.flax

    tables = [jaxembed.TableConfig("t0", V, H), jaxembed.TableConfig("t1", V, H)]
    features = [jaxembed.FeatureConfig("f0", "t0", combiner="mean"),
                jaxembed.FeatureConfig("f1", "t1")]  # fmt: skip
    model = jaxembed.flax.EmbeddingBagCollection(tables, features)
    example = {"f0": jnp.zeros((2, L), jnp.int32), "f1": jnp.zeros((2,), jnp.int32)}
    variables = model.init(jax.random.key(0), example)

    def serve(variables, ids0, ids1):
        out = model.apply(variables, {"f0": ids0, "f1": ids1})
        return {"f0": out["f0"], "f1": out["f1"]}

    (b,) = jax.export.symbolic_shape("b")
    artifact = serving.export_inference(
        serve, variables, jax.ShapeDtypeStruct((b, L), jnp.int32),
        jax.ShapeDtypeStruct((b,), jnp.int32),
    )  # fmt: skip
    assert artifact.native_targets == ()
    for n in (1, 9):
        rng = np.random.default_rng(n)
        ids0 = jnp.asarray(rng.integers(-1, V, (n, L)), jnp.int32)
        ids1 = jnp.asarray(rng.integers(0, V, (n,)), jnp.int32)
        got, want = artifact(ids0, ids1), serve(variables, ids0, ids1)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6)
