"""`jaxembed.workloads` (the recommender benchmark's inputs and float64 reference) and the
TorchRec / keras-rs runners. The runner tests skip where their framework is not installed: run
them with the framework's Python, e.g. `/work/venvs/torchrec/bin/python -m pytest ...`."""

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

from benchmarks.common.reference import compare_tables, reference_pooled, reference_steps
from benchmarks.common.timing import summarize_times, time_calls
from benchmarks.recsys.files import load_inputs, load_tables, save_inputs, save_tables
from jaxembed import workloads as W


def tiny(batch_size=6):
    """Shared tables (x read by p and r), an empty-bag feature, an unused table (z)."""
    tables = (W.TableSpec("x", 40, 8), W.TableSpec("y", 5, 8), W.TableSpec("z", 30, 8))
    features = (W.FeatureSpec("p", "x", 0, 5), W.FeatureSpec("q", "y", 1, 3),
                W.FeatureSpec("r", "x", 2, 6, zipf=1.5))  # fmt: skip
    return W.Workload("tiny", tables, features, batch_size)


def naive_steps(workload, tables, batches, cot, lr, eps, optimizer):
    """Row by row, id by id: the definition the vectorized reference must match."""
    out = {n: t.astype(np.float64).copy() for n, t in tables.items()}
    acc = {t.name: np.zeros(t.rows if optimizer == "rowwise_adagrad" else (t.rows, t.dim))
           for t in workload.tables}  # fmt: skip
    for batch in batches:
        grads = {t.name: {} for t in workload.tables}
        for i, f in enumerate(workload.features):
            values, lengths = batch[f.name]
            pos = 0
            for b, n in enumerate(lengths):
                for r in values[pos : pos + n]:
                    g = grads[f.table].setdefault(int(r), np.zeros(workload.dim))
                    g += cot[b, i]
                pos += n
        for name, rows in grads.items():
            for r, g in rows.items():
                if optimizer == "rowwise_adagrad":
                    acc[name][r] += np.mean(g * g)
                    out[name][r] -= lr * g / (np.sqrt(acc[name][r]) + eps)
                else:
                    acc[name][r] += g * g
                    out[name][r] -= lr * g / np.sqrt(acc[name][r] + eps)
    return out, acc


# --- workloads --------------------------------------------------------------------------------


def test_workload_a_is_the_issue_s():
    w = W.workload_a()
    rows = [1_000_000, 500_000, 100_000, 100_000, 50_000, 10_000, 1000, 100]
    assert [t.rows for t in w.tables] == rows
    assert {t.dim for t in w.tables} == {64} and w.batch_size == 4096
    assert [f.table for f in w.features] == [t.name for t in w.tables]
    assert all((f.min_ids, f.max_ids, f.zipf) == (1, 20, 1.1) for f in w.features)
    assert w.num_ids_expected == 4096 * 8 * 10.5 and w.total_rows == 1_761_100


def test_dlrm_workload_scales_criteo_and_shares_the_small_tables():
    w = W.dlrm_workload()
    assert len(w.features) == 26 and len(w.tables) == 20 and w.dim == 64
    rows = [w.table(f.table).rows for f in w.features]
    expect = [max(10, round(c / 8)) for c in W.CRITEO_KAGGLE_CARDINALITIES]
    assert rows == expect and min(rows) == 10 and max(rows) == 1_266_403
    shared = [f.name for f in w.features if w.table(f.table).rows == 10]
    assert shared == ["C6", "C9", "C14", "C17", "C20", "C22", "C23"]
    assert len({w.features[int(n[1:]) - 1].table for n in shared}) == 1
    assert 4e6 < w.total_rows < 4.5e6 and w.num_ids_expected == 4096 * 26 * 10.5
    full = W.dlrm_workload(batch_size=8, scale=1.0)
    assert sum(t.rows for t in full.tables) > 33_000_000 and len(full.tables) == 24
    with pytest.raises(ValueError, match=r"scale must be in \(0, 1\], got 2"):
        W.dlrm_workload(scale=2)


@pytest.mark.parametrize("tables, features, match", [
    ((W.TableSpec("x", 4, 2), W.TableSpec("x", 5, 2)), (W.FeatureSpec("f", "x"),), r"duplicate table names \['x'\]"),
    ((W.TableSpec("x", 4, 2),), (W.FeatureSpec("f", "y"),), r"feature 'f': reads unknown table 'y': choose from \['x'\]"),
    ((W.TableSpec("x", 4, 2),), (W.FeatureSpec("f", "x", 3, 2),), r"feature 'f': need 0 <= min_ids <= max_ids .* got 3..2"),
    ((W.TableSpec("x", 4, 2),), (W.FeatureSpec("f", "x", zipf=0.0),), r"zipf exponent must be > 0, got 0.0"),
    ((W.TableSpec("x", 4, 2), W.TableSpec("y", 4, 3)), (W.FeatureSpec("f", "x"),), r"need one dim for all tables .* got dims \[2, 3\]"),
])  # fmt: skip
def test_workload_rejects_bad_specs(tables, features, match):
    with pytest.raises(ValueError, match=match):
        W.Workload("bad", tables, features, 4)


def test_zipf_ids_follow_the_finite_zipf_law():
    rows, s, n = 50, 1.1, 400_000
    ids = W.zipf_ids(np.random.default_rng(1), n, rows, s)
    assert ids.dtype == np.int32 and ids.min() == 0 and ids.max() == rows - 1
    pmf = np.arange(1, rows + 1, dtype=np.float64) ** -s
    pmf /= pmf.sum()
    freq = np.bincount(ids, minlength=rows) / n
    np.testing.assert_allclose(freq, pmf, atol=5 * np.sqrt(pmf / n).max())


def test_make_batch_shapes_determinism_and_ranges():
    w = tiny(batch_size=64)
    b0, again, b1 = W.make_batch(w, 3, 0), W.make_batch(w, 3, 0), W.make_batch(w, 3, 1)
    for f in w.features:
        values, lengths = b0[f.name]
        n = int(lengths.sum())
        assert values.dtype == lengths.dtype == np.int32
        assert values.shape == (64 * f.max_ids,) and lengths.shape == (64,)
        assert f.min_ids <= lengths.min() and lengths.max() <= f.max_ids
        assert 0 <= values[:n].min() and values[:n].max() < w.table(f.table).rows
        assert not values[n:].any()  # the unused tail holds 0
        np.testing.assert_array_equal(values, again[f.name][0])
        assert not np.array_equal(values, b1[f.name][0])
    assert not np.array_equal(b0["p"][0], W.make_batch(w, 4, 0)["p"][0])


def test_make_batch_permute_maps_ranks_through_one_permutation_per_table():
    w = tiny(batch_size=256)
    plain, perm = W.make_batch(w, 0, 0), W.make_batch(w, 0, 0, permute=True)
    maps = {}
    for f in w.features:
        (v, lengths), (pv, plengths) = plain[f.name], perm[f.name]
        np.testing.assert_array_equal(lengths, plengths)
        n = int(lengths.sum())
        for rank, mapped in zip(v[:n], pv[:n], strict=True):
            assert maps.setdefault((f.table, rank), mapped) == mapped  # one map per table
    for table in ("x", "y"):
        mapped = [m for (t, _), m in maps.items() if t == table]
        assert len(set(mapped)) == len(mapped)  # a bijection on the ranks seen
    hot = np.bincount(perm["p"][0][: int(perm["p"][1].sum())], minlength=40).argmax()
    assert hot == maps[("x", 0)]  # the hot id is wherever the permutation sends rank 1


def test_make_tables_and_cotangent():
    w = tiny()
    tables = W.make_tables(w, 0)
    assert list(tables) == ["x", "y", "z"]
    for t in w.tables:
        x = tables[t.name]
        assert x.shape == (t.rows, t.dim) and x.dtype == np.float32
        assert -0.01 <= x.min() and x.max() < 0.01 and x.std() > 0.004
    np.testing.assert_array_equal(tables["x"], W.make_tables(w, 0)["x"])
    assert not np.array_equal(tables["x"], W.make_tables(w, 1)["x"])
    cot = W.make_cotangent(w, 0)
    assert cot.shape == (6, 3, 8) and cot.dtype == np.float32


def test_save_and_load_inputs_round_trip(tmp_path):
    w = tiny()
    tables, cot = W.make_tables(w, 0), W.make_cotangent(w, 0)
    batches = [W.make_batch(w, 0, s) for s in range(3)]
    save_inputs(str(tmp_path / "in.npz"), w, tables, batches, cot, learning_rate=0.1, eps=1e-6)
    got = load_inputs(str(tmp_path / "in.npz"))
    assert got.workload == w and (got.learning_rate, got.eps) == (0.1, 1e-6)
    assert all(np.array_equal(got.tables[n], tables[n]) for n in tables)
    np.testing.assert_array_equal(got.cotangent, cot)
    for g, b in zip(got.batches, batches, strict=True):
        assert all(np.array_equal(g[k][i], b[k][i]) for k in b for i in (0, 1))
    with np.load(tmp_path / "in.npz") as z:
        assert json.loads(str(z["meta"]))["feature_table"] == {"p": "x", "q": "y", "r": "x"}


def test_reference_pooled_sums_each_bag():
    w = tiny()
    tables, batch = W.make_tables(w, 0), W.make_batch(w, 0, 0)
    got = reference_pooled(w, tables, batch)
    for i, f in enumerate(w.features):
        values, lengths = batch[f.name]
        starts = np.concatenate([[0], np.cumsum(lengths)])
        for b in range(w.batch_size):
            rows = tables[f.table][values[starts[b] : starts[b + 1]]].astype(np.float64)
            np.testing.assert_allclose(got[b, i], rows.sum(axis=0), atol=1e-15)


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adagrad"])
def test_reference_steps_matches_the_row_by_row_definition(optimizer):
    w = tiny(batch_size=16)
    tables, cot = W.make_tables(w, 0), W.make_cotangent(w, 0)
    batches = [W.make_batch(w, 0, s) for s in range(3)]
    got, acc = reference_steps(w, tables, batches, cot, 0.05, 1e-8, optimizer=optimizer)
    want, want_acc = naive_steps(w, tables, batches, cot, 0.05, 1e-8, optimizer)
    for name in tables:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(acc[name], want_acc[name], rtol=1e-12)
    np.testing.assert_array_equal(got["z"], tables["z"])  # no feature reads z


def test_reference_steps_one_id_in_closed_form():
    w = W.Workload("one", (W.TableSpec("t", 3, 4),), (W.FeatureSpec("f", "t", 1, 1),), 1)
    tables = {"t": np.zeros((3, 4), np.float32)}
    batch = {"f": (np.array([2], np.int32), np.array([1], np.int32))}
    cot = np.array([[[1.0, -1.0, 2.0, 0.0]]], np.float32)
    got, acc = reference_steps(w, tables, [batch], cot, lr=0.1, eps=0.0)
    assert acc["t"].tolist() == [0.0, 0.0, 1.5]
    np.testing.assert_allclose(got["t"][2], -0.1 * cot[0, 0] / np.sqrt(1.5))
    with pytest.raises(ValueError, match="must be 'rowwise_adagrad' or 'adagrad', got 'sgd'"):
        reference_steps(w, tables, [batch], cot, optimizer="sgd")


def test_save_tables_compare_and_summaries(tmp_path):
    w = tiny()
    tables = W.make_tables(w, 0)
    accs = {t.name: np.arange(t.rows, dtype=np.float32) for t in w.tables}
    save_tables(str(tmp_path / "t.npz"), w, tables, accs)
    got, got_accs = load_tables(str(tmp_path / "t.npz"))
    exact = {"max_abs_error": 0.0, "max_rel_error": 0.0, "num_over_rtol": 0, "num_entries": 600}
    assert compare_tables(got, tables) == exact
    off = {**tables, "y": tables["y"] + np.float32(1e-3)}  # 40 entries 2% of lr off
    assert compare_tables(off, tables)["num_over_rtol"] == 40
    assert all(np.array_equal(got_accs[n], accs[n]) for n in accs)
    with pytest.raises(ValueError, match=r"table 'x': got shape \(40, 8\), reference \(2, 2\)"):
        compare_tables(got, {"x": np.zeros((2, 2))})
    summary = summarize_times([0.004, 0.001, 0.002, 0.003], [0.001] * 4, "step_time")
    assert summary["step_time_median_in_ms"] == 2.5
    assert summary["step_time_samples_in_ms"] == [4.0, 1.0, 2.0, 3.0]
    assert summary["step_time_cpu_median_in_ms"] == 1.0
    calls = []
    wall, cpu = time_calls(calls.append, 3)
    assert calls == [0, 1, 2] and len(wall) == len(cpu) == 3


# --- runners ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Tiny inputs with shared tables, empty bags and many duplicate ids; 3 steps."""
    path = tmp_path_factory.mktemp("recsys") / "in.npz"
    w = tiny(batch_size=32)
    tables, cot = W.make_tables(w, 0), W.make_cotangent(w, 0)
    batches = [W.make_batch(w, 0, s) for s in range(3)]
    save_inputs(str(path), w, tables, batches, cot)
    return path, w, tables, batches, cot


def run_runner(module, inputs_path, tmp_path, *extra):
    out, saved = tmp_path / "result.json", tmp_path / "tables.npz"
    cmd = [sys.executable, "-m", f"benchmarks.recsys.{module}", "--inputs", str(inputs_path),
           "--out", str(out), "--steps", "2", "--warmup", "1", "--threads", "1",
           "--check-steps", "3", "--verify", "--save-tables", str(saved), *extra]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), load_tables(str(saved))


@pytest.mark.parametrize("impl", ["fused-ebc", "tbe"])
def test_torchrec_runner_agrees_with_rowwise_adagrad_reference(inputs, tmp_path, impl):
    pytest.importorskip("torchrec")
    path, w, tables, batches, cot = inputs
    result, (got, accs) = run_runner("torchrec_runner", path, tmp_path, "--impl", impl)
    assert result["framework"] == "torchrec" and result["impl"] == impl
    assert result["check"]["agrees_with_reference"] is True
    assert result["check"]["forward_max_abs_error"] < 1e-6
    assert len(result["step_time_samples_in_ms"]) == 2
    want, want_acc = reference_steps(w, tables, batches, cot)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(accs[name], want_acc[name], rtol=1e-4, atol=1e-6)


def test_kerasrs_runner_agrees_with_dense_adagrad_reference(inputs, tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", "jax")  # keras' default backend would import TensorFlow
    pytest.importorskip("keras_rs")
    path, w, tables, batches, cot = inputs
    result, (got, accs) = run_runner("kerasrs_runner", path, tmp_path)
    assert result["framework"] == "keras-rs"
    assert result["impl"] == "DistributedEmbedding[default_device]"
    assert result["check"]["agrees_with_reference"] is True
    want, want_acc = reference_steps(w, tables, batches, cot, optimizer="adagrad")
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(accs[name], want_acc[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("module, framework", [("torchrec_runner", "torch"),
                                               ("kerasrs_runner", "keras")])  # fmt: skip
def test_runner_without_its_framework_fails_in_one_line(inputs, module, framework):
    if importlib.util.find_spec(framework) is not None:
        pytest.skip(f"{framework} is installed here")
    cmd = [sys.executable, "-m", f"benchmarks.recsys.{module}", "--inputs", str(inputs[0])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{module}: error: {framework} is not installed" in lines[0]
