"""Fresh rows (`jaxembed.serving.DeltaWriter`, `Model.apply_delta`): a served model takes the
rows training changed, without re-export or reload.

Each delta is checked against the model loaded afresh with the same parameters (float
within 1e-6 of `fn` itself, quantized and dynamic tables bitwise); requests from threads
running while deltas apply each see one version whole; deltas of another model, out of
order, of other leaves or damaged are refused, naming the file or field.
"""

import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxembed
from jaxembed import serving
from jaxembed.quant import quantize
from jaxembed.serving import loader

V, H, B, L = 200, 8, 16, 4  # rows, dim, batch, ids a bag


def _fn(params, ids):  # ids: i32[B, 2, L] -> per-table pooled rows and a score
    pooled = [jaxembed.embedding_bag(ids[:, t], params["tables"][t], combiner="sum")
              for t in range(2)]  # fmt: skip
    x = jnp.concatenate(pooled, axis=-1)
    return {"pooled": jnp.stack(pooled, 1), "score": x @ params["w"] + params["b"]}


def _params(rng, precision="float"):
    tables = [jnp.asarray(rng.standard_normal((V, H)), jnp.float32) for _ in range(2)]
    if precision != "float":
        tables = [quantize(t, precision) for t in tables]
    w = jnp.asarray(rng.standard_normal((2 * H, 1)), jnp.float32)
    return {"tables": tables, "w": w, "b": jnp.zeros((), jnp.float32)}


def _trained(rng, params, fraction=0.01, precision="float"):
    """`params` with ~`fraction` of each table's rows (at least 2) and the bias changed."""
    tables = []
    for t in params["tables"]:
        dense = jaxembed.dequantize(t) if precision != "float" else t
        rows = rng.choice(V, max(2, int(fraction * V)), replace=False)
        dense = dense.at[rows].add(jnp.asarray(rng.standard_normal((len(rows), H)), jnp.float32))
        tables.append(quantize(dense, precision) if precision != "float" else dense)
    return {"tables": tables, "w": params["w"], "b": params["b"] + 0.5}


def _ids(seed, batch=B):
    return np.random.default_rng(seed).integers(-1, V, (batch, 2, L)).astype(np.int32)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A float model saved, its writer, and five deltas of ~1% of the rows each, with the
    parameters after each: `(path, [(delta path, params)], ...)`."""
    work = tmp_path_factory.mktemp("delta")
    rng = np.random.default_rng(0)
    params = _params(rng)
    path = serving.save(serving.export_inference(_fn, params, jnp.asarray(_ids(0))), work / "m")
    writer = serving.DeltaWriter(path)
    deltas = []
    for k in range(5):
        params = _trained(rng, params)
        deltas.append((writer.write(params, work / f"d{k}"), params))
    return path, deltas, _params(np.random.default_rng(0))


def _leaves(params):
    return {jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}  # fmt: skip


def test_each_delta_holds_the_changed_rows_and_the_model_then_answers_as_trained(served):
    path, deltas, first = served
    model = serving.load(path)
    ids = jnp.asarray(_ids(1))
    before = _leaves(first)
    for delta, params in deltas:
        manifest = json.loads((delta / loader.DELTA_MANIFEST).read_text())
        after = _leaves(params)
        for entry in manifest["leaves"]:  # exactly the rows that differ
            a, b = before[entry["name"]], after[entry["name"]]
            want = np.flatnonzero(np.any(a != b, axis=-1)) if a.ndim else [0]
            assert entry["rows"] == len(want)
        names = {e["name"] for e in manifest["leaves"]}
        assert names == {"['tables'][0]", "['tables'][1]", "['b']"}  # w did not change
        assert model.apply_delta(delta) == manifest["version"] == model.version
        got, want = model(ids), jax.jit(_fn)(params, ids)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6)
        fresh = serving.load(path, params=after)  # the same leaves, loaded afresh: bitwise
        for k, v in fresh(ids).items():
            np.testing.assert_array_equal(got[k], v)
        before = after


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_quantized_tables_take_deltas_bitwise(tmp_path, precision):
    rng = np.random.default_rng(5)
    params = _params(rng, precision)
    path = serving.save(serving.export_inference(_fn, params, jnp.asarray(_ids(0))), tmp_path / "m")
    model, writer = serving.load(path), serving.DeltaWriter(path)
    for k in range(2):
        params = _trained(rng, params, 0.05, precision)
        model.apply_delta(writer.write(params, tmp_path / f"d{k}"))
    ids = jnp.asarray(_ids(2))
    fresh = serving.load(path, params=_leaves(params))
    for key, value in fresh(ids).items():
        np.testing.assert_array_equal(model(ids)[key], value)
    want = jax.jit(_fn)(params, ids)["pooled"]
    np.testing.assert_array_equal(model(ids)["pooled"], want)


def test_a_dynamic_tables_map_and_rows_take_deltas(tmp_path):
    """A `DynamicEmbed` trained further after its export: the delta carries the remap
    state's changed buckets and the new rows; served, every id reads what the module reads."""
    from flax import nnx

    import jaxembed.nnx
    from jaxembed.dynamic import DynamicTableConfig, as_keys

    emb = jaxembed.nnx.DynamicEmbed(DynamicTableConfig(capacity=32, bucket_size=4), H,
                                    rngs=nnx.Rngs(0))  # fmt: skip
    rng = np.random.default_rng(7)
    ids = rng.integers(-(2**62), 2**62, 80, dtype=np.int64)
    train = nnx.jit(lambda m, k: m(k))
    train(emb, as_keys(ids[:20]))
    emb.deterministic = True
    graphdef, state = nnx.split(emb)
    serve = lambda s, k: nnx.merge(graphdef, s)(k)
    path = serving.save(
        serving.export_inference(serve, state, jax.ShapeDtypeStruct((len(ids), 2), jnp.uint32)),
        tmp_path / "m",
    )
    model, writer = serving.load(path), serving.DeltaWriter(path)
    emb.deterministic = False
    for k in range(3):  # new ids admitted, old ones evicted: the map changes
        train(emb, as_keys(ids[20 * k : 20 * k + 40]))
    emb.deterministic = True
    _, state = nnx.split(emb)
    manifest = json.loads((writer.write(state, tmp_path / "d") / loader.DELTA_MANIFEST).read_text())
    assert any("remap" in e["name"] for e in manifest["leaves"])
    model.apply_delta(tmp_path / "d")
    keys = as_keys(ids)
    np.testing.assert_array_equal(model(keys), serve(state, jnp.asarray(keys)))


def test_requests_from_threads_see_one_version_whole(served):
    """Four threads call the model while the main thread applies the five deltas: every
    answer equals the answer of one version, all of its outputs; each thread's versions
    never go back, and a call made after the last delta sees it."""
    path, deltas, first = served
    model = serving.load(path)
    ids = jnp.asarray(_ids(3))
    versions = [first] + [p for _, p in deltas]
    expected = [jax.tree.map(np.asarray, serving.load(path, params=_leaves(p))(ids))
                for p in versions]  # fmt: skip
    errors, seen = [], [[] for _ in range(4)]
    done = threading.Event()

    def serve(k):
        try:
            last = False
            while not last:  # one more call after the last delta: it must see that version
                last = done.is_set()
                out = jax.tree.map(np.asarray, model(ids))
                match = [v for v, e in enumerate(expected)
                         if all(np.array_equal(out[n], e[n]) for n in e)]  # fmt: skip
                if not match:
                    errors.append("an answer of no version (a mix)")
                    return
                seen[k].append(match[0])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=serve, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for delta, _ in deltas:
        model.apply_delta(delta)
    done.set()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[:3]
    for versions_seen in seen:
        assert versions_seen == sorted(versions_seen)
    assert all(v[-1] == len(deltas) for v in seen)  # calls after the last delta see it


def test_bad_deltas_are_refused_naming_the_file_or_field(served, tmp_path):
    path, deltas, _ = served
    model = serving.load(path)
    with pytest.raises(ValueError, match=r"was written from version .* apply the deltas in the"):
        model.apply_delta(deltas[1][0])  # delta 1 before delta 0
    # a delta of another model
    other = serving.export_inference(lambda p, i: {"x": p["t"][i]}, {"t": jnp.ones((V, H))},
                                     jnp.zeros((3,), jnp.int32))  # fmt: skip
    other_path = serving.save(other, tmp_path / "other")
    with pytest.raises(ValueError, match=r"is a delta of model .* apply deltas written from"):
        model.apply_delta(serving.DeltaWriter(other_path).write({"t": jnp.zeros((V, H))},
                                                                tmp_path / "od"))  # fmt: skip
    # a writer given another tree
    with pytest.raises(ValueError, match=r"params has the leaves .* pass the tree"):
        serving.DeltaWriter(path).write({"tables": []}, tmp_path / "x")
    # integer leaves that do not fit the exported dtype: refused, never narrowed
    other_ids = serving.save(serving.export_inference(
        lambda p, i: {"x": p["t"][p["ids"][i]]},
        {"t": jnp.ones((V, H)), "ids": np.arange(4, dtype=np.int32)},
        jnp.zeros((3,), jnp.int32)), tmp_path / "ids")  # fmt: skip
    wide = {"t": np.ones((V, H), np.float32), "ids": np.array([0, 1, 2, 2**40], np.int64)}
    with pytest.raises(ValueError, match=r"params\['ids'\] is int64 holding values that int32"):
        serving.DeltaWriter(other_ids).write(wide, tmp_path / "wide")
    # damaged and foreign files
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / loader.DELTA_MANIFEST).write_text('{"format": "jaxembed.serving.delta/1", "mod')
    with pytest.raises(ValueError, match=r"delta.json is not a JSON delta"):
        model.apply_delta(bad)
    (bad / loader.DELTA_MANIFEST).write_text('{"format": "other/9"}')
    with pytest.raises(ValueError, match="is of format 'other/9'"):
        model.apply_delta(bad)
    with pytest.raises(FileNotFoundError, match=r"delta.json does not exist"):
        model.apply_delta(tmp_path / "nothing")
    # rows out of range and values of another shape, named by leaf
    good = json.loads((deltas[0][0] / loader.DELTA_MANIFEST).read_text())
    for name, rows, values, message in (
        ("['w']", np.array([2 * H]), np.zeros((1, 1), np.float32), "has 16 rows"),
        ("['w']", np.array([0]), np.zeros((1, 3), np.float32), "takes float32"),
    ):
        forged = tmp_path / f"forged{len(message)}"
        forged.mkdir()
        np.savez(forged / loader.DELTA_ARRAYS, **{f"rows/{name}": rows, f"values/{name}": values})
        entry = dict(good, leaves=[{"name": name, "rows": 1}])
        (forged / loader.DELTA_MANIFEST).write_text(json.dumps(entry))
        with pytest.raises(ValueError, match=message):
            model.apply_delta(forged)
    assert model.version == json.loads((path / loader.MANIFEST).read_text())["version"]
