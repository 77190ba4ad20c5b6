"""examples/train_dlrm.py: one step on any mesh, a resume onto another layout, 2 processes,
and the generative model's best loss and AUC.

The training runs are tiny (6 of the 26 features, tables of 10 to ~10k rows, 6 steps) and
run in this process through the example's `main` (the 2-process run starts the script under
`jaxembed.launch`); they share one reference run on the (2, 4) mesh.
"""

import importlib.util
import itertools
import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
EXAMPLE = EXAMPLES / "train_dlrm.py"
sys.path.insert(0, str(EXAMPLES))
import dlrm_data  # noqa: E402  (beside the example)

TINY = ["--scale", str(1 / 1024), "--features", "6", "--dim", "8", "--batch", "128",
        "--steps", "6", "--eval-every", "3", "--eval-size", "1024", "--no-progress"]  # fmt: skip


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_dlrm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference(example, tmp_path_factory):
    """6 steps on the (2, 4) mesh, checkpoints at steps 3 and 6: (metrics, tables, dir)."""
    tmp = tmp_path_factory.mktemp("dlrm")
    metrics = example.main([*TINY, "--checkpoint-dir", str(tmp / "ckpt"),
                            "--checkpoint-every", "3", "--tables-out", str(tmp / "t.npz"),
                            "--quantized", "int8"])  # fmt: skip
    return metrics, dict(np.load(tmp / "t.npz")), tmp


def losses(metrics, steps):
    return [metrics["losses"][str(s)] for s in steps]


def assert_tables_close(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_it_learns_and_one_device_computes_the_same(example, reference, tmp_path):
    metrics, tables, _ = reference
    assert metrics["mesh"] == {"data": 2, "model": 4}
    assert metrics["placements"] == metrics["planned"]  # --placement auto: the planner's
    evals = metrics["evals"]
    assert sorted(evals, key=int) == ["3", "6"]
    assert 0.5 < evals["6"]["auc"] <= 1 and evals["6"]["log_loss"] < evals["3"]["log_loss"]
    assert metrics["bayes"]["log_loss"] < evals["6"]["log_loss"] < np.log(2)
    first, last = losses(metrics, (1, 2)), losses(metrics, (5, 6))
    assert np.mean(last) < np.mean(first)
    # The int8 serving copy: (dim 8 + 4 bytes of scale and bias) a row against 4·8, about the
    # float AUC (a tiny model's, so only loosely).
    q = metrics["quantized"]["int8"]
    rows = sum(t.shape[0] for t in tables.values())
    assert q["float_table_bytes"] >= rows * 8 * 4 and q["table_bytes"] >= rows * 12
    assert q["float_table_bytes"] / q["table_bytes"] == pytest.approx(32 / 12, rel=0.01)
    assert abs(q["auc"] - evals["6"]["auc"]) < 0.01

    single = example.main([*TINY, "--mesh", "data=1", "--tables-out", str(tmp_path / "t.npz")])
    assert single["placements"] == single["planned"]
    np.testing.assert_allclose(losses(single, range(1, 7)), losses(metrics, range(1, 7)),
                               rtol=1e-5)  # fmt: skip
    assert_tables_close(dict(np.load(tmp_path / "t.npz")), tables)
    for step in ("3", "6"):
        for key in ("log_loss", "auc"):
            np.testing.assert_allclose(single["evals"][step][key], evals[step][key], rtol=1e-5)


@pytest.mark.slow  # heavy; what it checks is covered by the quicker tests beside it
def test_resume_onto_another_mesh_and_placement_continues_the_run(example, reference, tmp_path):
    """Steps 4-6 from the step-3 checkpoint on (8,) with every table whole on one device
    equal steps 4-6 of the uninterrupted (2, 4) run with the planner's placements."""
    metrics, tables, tmp = reference
    shutil.copytree(tmp / "ckpt" / "3", tmp_path / "ckpt" / "3")
    resumed = example.main([*TINY, "--mesh", "data=8", "--placement", "table", "--resume",
                            "--checkpoint-dir", str(tmp_path / "ckpt"),
                            "--tables-out", str(tmp_path / "t.npz")])  # fmt: skip
    assert resumed["first_step"] == 4 and sorted(resumed["losses"], key=int) == ["4", "5", "6"]
    assert set(resumed["placements"].values()) == {"table"}
    np.testing.assert_allclose(losses(resumed, (4, 5, 6)), losses(metrics, (4, 5, 6)), rtol=1e-5)
    assert_tables_close(dict(np.load(tmp_path / "t.npz")), tables)


@pytest.mark.slow  # ~30 s; the default run's multi-process check is tests/test_multihost.py's
def test_two_processes_compute_what_one_does(reference, tmp_path):
    metrics, tables, _ = reference
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *TINY, "--processes", "2", "--checkpoint-dir",
         str(tmp_path / "ckpt"), "--checkpoint-every", "3", "--metrics-out",
         str(tmp_path / "m.json"), "--tables-out", str(tmp_path / "t.npz")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    multi = json.loads((tmp_path / "m.json").read_text())
    assert multi["processes"] == 2 and metrics["processes"] == 1
    np.testing.assert_allclose(losses(multi, range(1, 7)), losses(metrics, range(1, 7)),
                               rtol=1e-5)  # fmt: skip
    assert_tables_close(dict(np.load(tmp_path / "t.npz")), tables)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["3", "6"]


# --- the generative model's numbers ---------------------------------------------------------


@pytest.fixture(scope="module")
def eval_set():
    data = dlrm_data.ClickModel(scale=1 / 1024, seed=3, num_features=6)
    batches = data.eval_set(20_000, 4096)
    z = np.concatenate([b.logits for b in batches])
    y = np.concatenate([b.labels for b in batches])
    return z, y


def test_the_true_probability_has_the_least_loss(eval_set):
    z, y = eval_set
    p = 1 / (1 + np.exp(-z))
    best = dlrm_data.log_loss(z, y)
    assert best == pytest.approx(np.mean(-y * np.log(p) - (1 - y) * np.log1p(-p)), rel=1e-12)
    rng = np.random.default_rng(0)
    perturbed = [z + rng.normal(0, s, z.shape) for s in (0.2, 0.5, 1.0)]
    base_rate = np.zeros_like(z) + np.log(y.mean() / (1 - y.mean()))
    perturbed += [z + 0.2, z - 0.2, 1.2 * z, 0.8 * z, base_rate]
    for q in perturbed:
        assert best < dlrm_data.log_loss(q, y)
        # In expectation over the labels the true p wins exactly (Gibbs' inequality).
        qp = 1 / (1 + np.exp(-q))
        expected = np.mean(-p * np.log(qp) - (1 - p) * np.log1p(-qp))
        assert np.mean(-p * np.log(p) - (1 - p) * np.log1p(-p)) < expected
    assert dlrm_data.auc(z, y) > max(dlrm_data.auc(q, y) for q in perturbed[:3])


def test_auc_is_the_pairwise_probability(eval_set):
    z, y = eval_set
    rng = np.random.default_rng(1)
    pick = rng.choice(z.size, 300, replace=False)
    scores, labels = np.round(z[pick], 1), y[pick]  # rounding makes ties
    pos, neg = scores[labels == 1], scores[labels == 0]
    brute = np.mean([1.0 if a > b else 0.5 if a == b else 0.0
                     for a, b in itertools.product(pos, neg)])  # fmt: skip
    assert dlrm_data.auc(scores, labels) == pytest.approx(brute, abs=1e-12)
    assert dlrm_data.auc(-scores, labels) == pytest.approx(1 - brute, abs=1e-12)
    with pytest.raises(ValueError, match="AUC needs both classes, got 0 positives and 3"):
        dlrm_data.auc(np.arange(3.0), np.zeros(3))


def test_the_default_stream_is_learnable_but_not_trivial():
    data = dlrm_data.ClickModel(seed=0)  # the default scale, 1/8: 10 to 1.27M rows
    assert min(data.tables.values()) == 10 and max(data.tables.values()) == 1_266_403
    assert len(data.features) == 26 and len(data.tables) == 20
    batch = data.batch(0, 8192, dlrm_data.EVAL)
    a = dlrm_data.auc(batch.logits, batch.labels)
    assert 0.8 < a < 0.9, a
    lengths = (batch.ids["C3"] >= 0).sum(axis=1)
    assert lengths.min() == 1 and lengths.max() == 20
    assert (batch.ids["C3"][:, 0] >= 0).all() and batch.ids["C3"].max() < 1_266_403
    p = 1 / (1 + np.exp(-batch.logits))
    assert abs(batch.labels.mean() - p.mean()) < 0.02


def test_bad_flags(example):
    with pytest.raises(SystemExit, match=r"--mesh 'data=2,model=8' needs 16 devices"):
        example.make_mesh("data=2,model=8")
    with pytest.raises(SystemExit, match=r"--batch 100 must be a multiple of the 8 devices"):
        example.main([*TINY, "--batch", "100"])
