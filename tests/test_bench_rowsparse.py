"""`jaxembed bench sparse --quick`: row-sparse optimizer steps against dense ones.

The record's structure, every implementation against the float64 reference (touched rows
updated by the formula, untouched rows bitwise unchanged), and the byte targets that the
compiled HLO makes deterministic. Timings are recorded, never asserted.
"""

import pytest
from bench_runs import check_ok, quick_run

import benchmarks
from benchmarks.layouts.cases import MAIN_LAYOUTS
from benchmarks.rowsparse import bench as sparse

# The whole module reads one `--quick` run (~25 s): marked slow (`pytest -m slow`). The
# row-sparse steps it times are tested against the float64 reference by tests/test_optim*.py.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sparse_run(tmp_path_factory):
    return quick_run(tmp_path_factory, "sparse", benchmarks.main)


def test_sparse_record(sparse_run):
    record, out = sparse_run
    assert record["schema"] == sparse.SCHEMA and record["config"]["quick"] is True
    assert record["machine"]["device_count"] == 8
    sweep = record["vocab_sweep"]
    assert [(p["vocab"], p["optimizer"]) for p in sweep] == [
        (v, o) for v in sparse.QUICK.vocab_sweep for o in sparse.QUICK.optimizers
    ]
    assert [p["layout"] for p in record["layouts"]] == list(MAIN_LAYOUTS)
    for p in sweep:
        assert list(p["implementations"]) == ["sparse", "dense"]
    for p in record["layouts"]:
        assert list(p["implementations"]) == ["sparse", "dense", "xla"]
    for p in (*sweep, *record["layouts"]):
        for name, result in p["implementations"].items():
            check_ok(result, (p["name"], name))
    assert "| V | optimizer | implementation |" in (out / "r.md").read_text()


def test_sparse_memory_and_bytes(sparse_run):
    """temp memory (memory_analysis) and wire bytes (HLO) are deterministic."""
    record, _ = sparse_run
    for optimizer in sparse.QUICK.optimizers:
        points = [p for p in record["vocab_sweep"] if p["optimizer"] == optimizer]
        first, last = (p["implementations"] for p in (points[0], points[-1]))
        # the sparse step holds no buffer that grows with the table; the dense one does
        assert last["sparse"]["temp_bytes"] <= 1.2 * first["sparse"]["temp_bytes"]
        assert last["dense"]["temp_bytes"] > 4 * first["dense"]["temp_bytes"]
    for p in record["layouts"]:
        impls = p["implementations"]
        assert impls["sparse"]["wire_bytes"] <= impls["xla"]["wire_bytes"], p["layout"]
        assert impls["sparse"]["fallback_wire_bytes"] is None  # no routed exchange at V=8192


def test_sparse_targets_are_reported(sparse_run):
    targets = sparse_run[0]["targets"]
    assert targets["at_target_shapes"] is False and targets["all_agree_with_reference"] is True
    assert targets["sparse_temp_flat_in_vocab"]["met"] is True
    for key in ("sparse_time_flat_in_vocab", "sparse_vs_dense", "sparse_vs_xla_geomean"):
        assert isinstance(targets[key]["met"], bool), key
    assert set(targets["sparse_vs_xla_geomean"]["per_layout"]) == set(MAIN_LAYOUTS)
