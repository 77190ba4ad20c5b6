"""The loader's checks (`jaxembed.serving.loader`): the inputs a served model takes, and the
files of a damaged artifact.

A served model's integer inputs are checked on the host against the exported dtypes before
jax sees them: with x64 off jax narrows int64 ids to int32 silently (`2**32 + 7` would pool
row 7), so an id that does not fit is refused, naming the argument, the value, its index and
the fix; ids of a wider dtype that fit are cast and pool as the numpy reference does; ids that
fit but lie outside the table read nothing, as the lookup under `jit`; floats and bools are a
TypeError; 64-bit arrays given for a dynamic table's `uint32[..., 2]` keys are refused, and the
conversion the message names gives the keys `jaxembed.dynamic.as_keys` gives. A truncated or
empty `manifest.json`, `params.npz` or `exported.bin`, or a manifest missing a key, raises a
ValueError naming the file and the fix, chained to what the reader raised.
"""

import json
import re
import shutil
import struct
import sys
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bag_reference import embedding_bag_reference
from test_serving_export import BATCH, COMBINERS, LOOKUPS, V, _inputs, _params, _ranker

from jaxembed import serving
from jaxembed.dynamic import as_keys

ARTIFACT_FILES = ("manifest.json", "params.npz", "exported.bin")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """The float ranker of test_serving_export (tables of 40 rows) saved: its directory, its
    loaded model and its tables as numpy arrays."""
    ids, dense = _inputs()
    params = _params("float")
    path = serving.save(
        serving.export_inference(_ranker(LOOKUPS["float"]), params, ids, dense),
        tmp_path_factory.mktemp("loader") / "float",
    )
    return path, serving.load(path), [np.asarray(t) for t in params["tables"]]


def _pooled_reference(tables, ids):
    """The ranker's pooled features in numpy: `[B, F, H]`, ids outside [0, V) read nothing."""
    return np.stack(
        [
            embedding_bag_reference(table, np.asarray(ids)[:, f], combiner=combiner)
            for f, (table, combiner) in enumerate(zip(tables, COMBINERS, strict=True))
        ],
        axis=1,
    )


def _with(ids, dtype, *values):
    """`ids` as `dtype` with `values` written at [0, 1, 0], [0, 1, 1], ..."""
    ids = np.asarray(ids).astype(dtype)
    for slot, value in enumerate(values):
        ids[0, 1, slot] = value
    return ids


# --- inputs ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, value",
    [(np.int64, 2**32 + 7), (np.int64, -(2**31) - 1), (np.int64, 2**63 - 1),
     (np.uint64, 2**31), (np.uint32, 2**31 + 5)],
)  # fmt: skip
def test_ids_that_do_not_fit_the_exported_dtype_are_refused(artifact, dtype, value):
    _, model, _ = artifact
    ids, dense = _inputs()
    ids = _with(ids, dtype, 3, value)
    name = np.dtype(dtype).name
    with pytest.raises(
        ValueError,
        match=rf"argument 0 \(args\[0\]\) is {name}\[6, 3, 4\], and its value {value} at index "
        r"\(0, 1, 1\) does not fit int32, the dtype the model was exported for "
        r"\(int32\[6, 3, 4\].*map such ids .* or export and serve the model with jax_enable_x64 on",
    ):
        model(ids, dense)


def test_concrete_jax_ids_are_checked_too(artifact):
    _, model, _ = artifact
    ids, dense = _inputs()
    with pytest.raises(
        ValueError, match=r"argument 0 .* is uint32\[6, 3, 4\], and its value 2147483653"
    ):
        model(jnp.asarray(_with(ids, np.uint32, 2**31 + 5)), dense)
    with jax.enable_x64(True):  # int64 jax arrays exist only with x64 on
        wide = jnp.asarray(_with(ids, np.int64, 2**32 + 7))
        assert wide.dtype == jnp.int64
        with pytest.raises(ValueError, match=r"is int64\[6, 3, 4\], and its value 4294967303"):
            model(wide, dense)


@pytest.mark.parametrize(
    "dtype", [np.int64, np.uint64, np.uint32, np.int16, np.uint8, "jax-uint32"]
)
def test_ids_of_another_integer_dtype_that_fit_are_cast(artifact, dtype):
    _, model, tables = artifact
    ids, dense = _inputs()
    unsigned = dtype == "jax-uint32" or np.dtype(dtype).kind == "u"
    given = np.where(ids < 0, V, ids) if unsigned else ids  # V reads nothing, as -1 does
    given = jnp.asarray(given, jnp.uint32) if dtype == "jax-uint32" else given.astype(dtype)
    got = model(given, dense)["pooled"]
    np.testing.assert_allclose(got, _pooled_reference(tables, ids), rtol=1e-6, atol=1e-6)


def test_ids_that_fit_but_lie_outside_the_table_read_nothing(artifact):
    """As the lookup under jit: an id outside [0, V) adds nothing to a sum and is not counted
    in a mean (bag [0, 1] of the mean feature keeps one id of its four)."""
    _, model, tables = artifact
    ids, dense = _inputs()
    for dtype in (np.int32, np.int64):
        given = _with(ids, dtype, V, 2**31 - 1, -5, 17)
        got = np.asarray(model(given, dense)["pooled"])
        want = _pooled_reference(tables, given)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got[0, 1], tables[1][17], rtol=1e-6)  # the mean of row 17


@pytest.mark.parametrize("bad", [np.float32, np.float64, bool, "jax-float32"])
def test_float_or_bool_ids_are_a_type_error_never_rounded(artifact, bad):
    _, model, _ = artifact
    ids, dense = _inputs()
    given = jnp.asarray(ids, jnp.float32) if bad == "jax-float32" else ids.astype(bad)
    name = "float32" if bad == "jax-float32" else np.dtype(bad).name
    with pytest.raises(
        TypeError,
        match=rf"argument 0 \(args\[0\]\) is {name}\[6, 3, 4\], and the model was exported for "
        rf"int32\[6, 3, 4\]: the loader never rounds or converts {name} to integers.*astype",
    ):
        model(given, dense)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """A model of a dynamic table's input form: keys `uint32[B, 2]` (low, high halves), each
    read as row `(low ^ high) % V` of a table (a stand-in for the table's id -> row map)."""
    table = np.random.default_rng(3).standard_normal((V, 4)).astype(np.float32)

    def fn(params, keys):  # keys: u32[B, 2]
        return params["t"][(keys[:, 0] ^ keys[:, 1]) % V]

    keys = jnp.zeros((BATCH, 2), jnp.uint32)
    path = serving.save(
        serving.export_inference(fn, {"t": table}, keys), tmp_path_factory.mktemp("k")
    )
    return serving.load(path), table


@pytest.mark.parametrize("dtype", [np.uint64, np.int64])
def test_64_bit_arrays_for_uint32_keys_are_refused(keyed, dtype):
    """Even ids below 2**32: a uint64 [B, 2] of ids would read as B keys' halves."""
    model, _ = keyed
    ids = np.arange(2 * BATCH, dtype=dtype).reshape(BATCH, 2)
    with pytest.raises(
        ValueError,
        match=rf"argument 0 \(args\[0\]\) is {np.dtype(dtype).name}\[6, 2\], and the model was "
        r"exported for uint32\[6, 2\], a dynamic table's keys.*refused there whatever its "
        r"values.*keys = ids\.astype\(np\.uint64\)\.view\(np\.uint32\)\.reshape\(\*ids\.shape, 2\)"
        r".*as_keys",
    ):
        model(ids)


@pytest.mark.skipif(sys.byteorder != "little", reason="the conversion is for little-endian hosts")
def test_the_keys_conversion_the_message_names_gives_as_keys_keys(keyed):
    model, table = keyed
    ids = np.array([5, -2, 2**40 + 7, 2**63 - 1, 0, 2**32], np.int64)
    keys = ids.astype(np.uint64).view(np.uint32).reshape(*ids.shape, 2)
    halves = np.stack([ids & 0xFFFFFFFF, (ids >> 32) & 0xFFFFFFFF], axis=-1).astype(np.uint32)
    np.testing.assert_array_equal(keys, halves)
    np.testing.assert_array_equal(keys, np.asarray(as_keys(ids)))
    want = table[(halves[:, 0] ^ halves[:, 1]) % V]
    np.testing.assert_array_equal(np.asarray(model(keys)), want)


# --- damaged files -----------------------------------------------------------------------------

CAUSES = {  # what each file's reader raises, truncated to half and empty
    "manifest.json": (json.JSONDecodeError, json.JSONDecodeError),
    "params.npz": (zipfile.BadZipFile, EOFError),
    "exported.bin": (struct.error, struct.error),
}


@pytest.mark.parametrize("cut", ["half", "empty"])
@pytest.mark.parametrize("name", ARTIFACT_FILES)
def test_a_truncated_file_names_itself_and_the_fix(artifact, tmp_path, name, cut):
    shutil.copytree(artifact[0], tmp_path / "copy")
    file = tmp_path / "copy" / name
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if cut == "half" else b"")
    with pytest.raises(
        ValueError,
        match=rf"{re.escape(str(file))} .*: it is truncated or not a jaxembed\.serving artifact.*"
        r"Save the artifact again with jaxembed\.serving\.save\(artifact, path\), or copy it again",
    ) as info:
        serving.load(tmp_path / "copy", compile=False)
    assert isinstance(info.value.__cause__, CAUSES[name][cut == "empty"])


@pytest.mark.parametrize(
    "drop, named",
    [("params", r"\['params'\]"), ("args", r"\['args'\]"), ("native_targets", r"\['native_targets'\]"),
     ("params.0.dtype", r"\['params\[0\]\.dtype'\]")],
)  # fmt: skip
def test_a_manifest_missing_a_key_names_it(artifact, tmp_path, drop, named):
    shutil.copytree(artifact[0], tmp_path / "copy")
    file = tmp_path / "copy" / "manifest.json"
    manifest = json.loads(file.read_text())
    if drop == "params.0.dtype":
        del manifest["params"][0]["dtype"]
    else:
        del manifest[drop]
    file.write_text(json.dumps(manifest))
    with pytest.raises(
        ValueError,
        match=rf"{re.escape(str(file))} lacks the keys {named}, which a jaxembed\.serving/1 "
        r"manifest has: it is truncated or not a jaxembed\.serving artifact\. Save the artifact",
    ):
        serving.load(tmp_path / "copy", compile=False)


def test_the_manifest_records_the_dtypes_the_exported_function_takes(tmp_path):
    """With x64 off, numpy float64 params and int64 example ids export as float32 / int32:
    the manifest and params.npz say so, the artifact loads, and int64 ids that do not fit
    int32 are refused by the loader instead of narrowed."""
    import jaxembed

    table = np.arange(80, dtype=np.float64).reshape(40, 2) / 7
    ids = np.array([[1, 2, -1, 39]] * 3, np.int64)
    art = serving.export_inference(
        lambda p, i: jaxembed.embedding_bag(i, p["t"], impl="xla"), {"t": table}, ids
    )
    assert [(e["dtype"], e["stored_as"]) for e in art.manifest["params"]] == [("float32",) * 2]
    assert [e["dtype"] for e in art.manifest["args"]] == ["int32"]
    model = serving.load(serving.save(art, tmp_path / "f64"))
    want = embedding_bag_reference(table.astype(np.float32), ids, combiner="sum")
    np.testing.assert_allclose(model(ids), want, rtol=1e-6)
    with pytest.raises(ValueError, match=r"value 4294967303 at index \(0, 1\) does not fit int32"):
        model(np.where(np.arange(4) == 1, 2**32 + 7, ids))
