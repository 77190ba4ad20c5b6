"""`python -m benchmarks grid`: its cells, its runners' float64 check, its summary. Timings
mean nothing here (tiny cells, two steps); FBGEMM's runner runs where fbgemm_gpu is installed."""

import importlib.util
import sys

import numpy as np
import pytest

from benchmarks.grid import bench, runner
from benchmarks.grid import cells as C


def test_the_sample_covers_every_level_and_keeps_tables_in_memory():
    cells = C.sample_cells(24, seed=3, max_table_bytes=2**30)
    for levels, key in ((C.BATCHES, "batch"), (C.DIMS, "dim"), (C.BAGS, "bags"),
                        (C.IDS, "ids")):  # fmt: skip
        counts = [sum(getattr(c, key) == v for c in cells) for v in levels]
        assert min(counts) >= 24 // len(levels) - 1, (key, counts)
    assert all(c.table_bytes <= 2**30 for c in cells)
    assert (cells[0].batch, cells[0].bags) == (16384, "1-100")
    assert (cells[1].batch, cells[1].bags) == (512, "1")


def test_a_cell_on_disk_is_the_csr_ids_it_says(tmp_path):
    cell = C.Cell(64, 8, "1-20", "zipf1.3", 1000)
    C.write_cell(str(tmp_path / "c.npz"), [cell], steps=2, seed=1)
    got = C.read_cell(str(tmp_path / "c.npz"))
    assert got["rows"] == [1000] and got["batch"] == 64 and got["dim"] == 8
    for step in got["steps"]:
        values, lengths = step[0]
        assert lengths.shape == (64,) and 1 <= lengths.min() and lengths.max() <= 20
        assert values.shape == (lengths.sum(),) and 0 <= values.min() and values.max() < 1000
    assert got["cotangent"].shape == (64, 1, 8)
    u = C.Cell(64, 8, "1", "uniform", 50)
    C.write_cell(str(tmp_path / "u.npz"), [u], steps=1)
    (values, lengths), = C.read_cell(str(tmp_path / "u.npz"))["steps"][0]
    assert (lengths == 1).all() and len(np.unique(values)) > 30  # uniform: not the hot ids


def test_the_reference_is_fbgemms_rowwise_adagrad():
    """Two ids of one bag on one row: the row's gradient is their sum, once."""
    cell = {"rows": [4], "dim": 2, "cotangent": np.array([[[1.0, 3.0]]], np.float32),
            "steps": [[(np.array([2, 2], np.int32), np.array([2], np.int32))]]}  # fmt: skip
    rows, accs = runner.reference(cell, 1)
    g = np.array([2.0, 6.0])
    s = np.mean(g * g)
    np.testing.assert_allclose(rows[0][2], C.TABLE_VALUE - C.LEARNING_RATE * g / (np.sqrt(s) + C.EPS))
    assert accs[0][2] == pytest.approx(s) and set(rows[0]) == {2}


@pytest.mark.parametrize("form", ["ragged", "dense"])
def test_the_jaxembed_runner_steps_as_the_float64_reference(tmp_path, form):
    from benchmarks.grid import jaxembed_runner

    C.write_cell(str(tmp_path / "c.npz"), [C.Cell(32, 8, "1-20", "zipf1.1", 200),
                                           C.Cell(32, 8, "1", "uniform", 50)], steps=2)  # fmt: skip
    out = tmp_path / "j.json"
    assert jaxembed_runner.main(["--cell", str(tmp_path / "c.npz"), "--out", str(out),
                                 "--check", "2", "--steps", "2", "--warmup", "0",
                                 "--form", form]) == 0  # fmt: skip
    import json

    record = json.loads(out.read_text())
    assert record["check"]["agrees"], record["check"]
    assert len(record["step_samples_in_ms"]) == 2


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("fbgemm_gpu") is None, reason="needs fbgemm_gpu")
def test_quick_grid_with_the_peer(tmp_path):
    assert bench.main(["--quick", "--torch-python", sys.executable,
                       "--json", str(tmp_path / "g.json")]) == 0  # fmt: skip


@pytest.mark.slow  # ~10 s, a whole `--quick` grid; the runner's check runs by default (above)
def test_quick_grid_without_the_peer_and_the_summary(tmp_path, monkeypatch):
    monkeypatch.delenv("JAXEMBED_TORCHREC_PYTHON", raising=False)
    assert bench.main(["--quick", "--forms", "ragged", "--json", str(tmp_path / "g.json")]) == 0
    import json

    record = json.loads((tmp_path / "g.json").read_text())
    assert [g["checked"] for g in record["groups"]] == [True, True]
    assert all("jaxembed_median_in_ms" in g and "ratio" not in g for g in record["groups"])
    s = bench.summarize([{"name": "a", "ratio": 1.2, "ratio_q25": 1.0},
                         {"name": "b", "ratio": 0.3, "ratio_q25": 0.9},
                         {"name": "workload (a)", "ratio": 9.0}])  # fmt: skip
    assert s["ratio"]["worst_cell"] == "a" and s["ratio"]["cells"] == 2
    assert s["ratio"]["geomean"] == pytest.approx(0.6)


def test_planner_cells_fitting_and_summary(tmp_path):
    """The 8-device planner sweep's parts that need no 8-device process: which uniform
    placements fit a budget (by the planner's model), and the summary over cells."""
    from benchmarks.grid import planner_cells as PC

    C.write_cell(str(tmp_path / "c.npz"), [C.Cell(512, 64, "1-20", "zipf1.1", 100_000)], steps=1)
    cell = C.read_cell(str(tmp_path / "c.npz"))
    roomy = PC.fitting(cell, 2**40)
    assert set(roomy) == set(PC.UNIFORM)
    tight = PC.fitting(cell, 16 * 2**20)  # a 25.6 MB table (and its state) replicated: no
    assert "replicated" not in tight and "rows" in tight
    cells = [{"cell": "a", "fitting": ["rows"], "ratio": 1.0},
             {"cell": "b", "fitting": ["rows", "table"], "ratio": 1.21},
             {"cell": "c", "fitting": []}]  # fmt: skip
    s = PC.summarize(cells)
    assert s["cells"] == 2 and s["worst_cell"] == "b" and s["within_1_1"] == 1
    assert s["geomean"] == pytest.approx(1.21**0.5) and s["skipped_no_fit"] == ["c"]
