"""`jaxembed bench --quick`: the record's structure, and every implementation against the
dense reference. Timings are recorded but never asserted (DESIGN.md, testing conventions)."""

import json
import math

import pytest

from benchmarks.layouts import bench
from benchmarks.layouts.cases import LAYOUTS, MAIN_LAYOUTS
from benchmarks.layouts.impls import IMPLEMENTATIONS


# The tests of the whole `--quick` record (one ~35 s run) are marked slow (`pytest -m slow`);
# the default run keeps the flags' checks and the one-layout run of
# `test_one_layout_agrees_with_the_dense_reference`.
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One quick run for the whole module: the JSON record and the plot directory."""
    out = tmp_path_factory.mktemp("bench")
    argv = ["--quick", "--no-progress", "--json", str(out / "bench.json"),
            "--markdown", str(out / "bench.md")]  # fmt: skip
    try:
        import matplotlib  # noqa: F401

        argv += ["--plot", str(out / "plots")]
    except ImportError:
        pass
    assert bench.main(argv) == 0
    return json.loads((out / "bench.json").read_text()), out


@pytest.fixture(scope="module")
def record(run):
    return run[0]


@pytest.mark.slow
def test_record_structure(record):
    assert record["schema"] == bench.SCHEMA
    assert record["machine"]["device_count"] == 8
    assert record["config"]["quick"] is True
    assert set(record) >= {"machine", "config", "cases", "sweeps", "targets"}
    names = [c["layout"] for c in record["cases"] if not c["tag"]]
    assert names == list(LAYOUTS)
    assert [c["tag"] for c in record["cases"]].count("dense-regime") == 1
    for case in record["cases"]:
        assert case["name"].startswith(f"vocab={case['vocab']},hidden={case['hidden']},")
        assert case["minimum_wire_bytes"]["total"] >= 0
        assert case["plan"]["gradient_exchange"] in ("rows", "dense", "none")
        assert list(case["implementations"]) == list(IMPLEMENTATIONS)


@pytest.mark.slow
def test_every_implementation_agrees_with_the_dense_reference(record):
    ran = 0
    for case in record["cases"]:
        for name, result in case["implementations"].items():
            assert result["status"] in ("ok", "error", "compiled"), (case["name"], name)
            if result["status"] == "error":
                assert result["stage"] in ("build", "compile") and result["error_type"]
                assert not name.startswith("jaxembed"), result  # jaxembed runs everywhere
                continue
            for key in ("wire_bytes", "temp_bytes", "argument_bytes", "compile_time_in_s"):
                assert isinstance(result[key], int | float) and result[key] >= 0, key
            if result["status"] == "ok":
                ran += 1
                assert result["agrees_with_reference"], (case["name"], name, result)
                assert result["max_abs_error_out"] <= 1e-5
                assert result["time_median_in_ms"] > 0 and result["time_p90_in_ms"] > 0
    assert ran >= 4 * len(record["cases"])


@pytest.mark.slow
def test_jaxembed_bytes_against_minimum_and_xla(record):
    """Bytes come from the compiled HLO: deterministic, so they may be asserted."""
    for case in record["cases"]:
        summary = case["summary"]
        assert summary["jaxembed_wire_ratio_to_minimum"] <= 1.1, case["name"]
        assert summary["jaxembed_wire_ratio_to_xla"] <= 1.0, case["name"]
        largest = case["implementations"]["jaxembed"]["largest_collective"]
        assert largest is None or largest["result_bytes"] > 0


@pytest.mark.slow
def test_sweeps(record):
    vocab = record["sweeps"]["vocab"]
    assert [p["vocab"] for p in vocab] == list(bench.QUICK.vocab_sweep)
    flat = [p["implementations"]["jaxembed"]["wire_bytes"] for p in vocab]
    grows = [p["implementations"]["xla"]["wire_bytes"] for p in vocab]
    assert flat[-1] <= flat[0] * 1.1 and grows[-1] > grows[0]  # only the others grow with V
    devices = record["sweeps"]["devices"]
    assert {math.prod(p["mesh"].values()) for p in devices} == set(bench.QUICK.device_sweep)
    batch = record["sweeps"]["batch"]
    exchanges = [p["plan"]["gradient_exchange"] for p in batch]
    assert exchanges == ["rows", "dense"]  # the plan switches between the two batch sizes
    for p in (*devices, *batch):
        for result in p["implementations"].values():
            assert result["agrees_with_reference"], (p["name"], result)


@pytest.mark.slow
def test_targets_are_reported(record):
    targets = record["targets"]
    assert targets["at_target_shapes"] is False
    assert set(targets["wire_within_1.1x_of_minimum"]["per_layout"]) == set(MAIN_LAYOUTS)
    for key in ("wire_at_most_xla", "time_ratio_to_best_alternative_geomean",
                "time_ratio_to_xla_geomean", "dense_regime_time_ratio_to_xla"):  # fmt: skip
        assert isinstance(targets[key]["met"], bool)
    assert targets["all_agree_with_reference"] is True


@pytest.mark.slow
def test_markdown_and_plots(run):
    _, out = run
    text = (out / "bench.md").read_text()
    assert "| case | implementation |" in text and "rows-on-model" in text
    if (out / "plots").exists():
        pngs = sorted(p.name for p in (out / "plots").iterdir())
        assert pngs == ["bench_batch.png", "bench_devices.png", "bench_layouts.png",
                        "bench_vocab.png"]  # fmt: skip
        assert all((out / "plots" / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)


def test_one_layout_agrees_with_the_dense_reference(tmp_path):
    """The default run's check of the harness: one layout, two implementations, no sweeps."""
    path = tmp_path / "bench.json"
    argv = ["--quick", "--no-progress", "--layouts", "rows-on-model", "--impls", "jaxembed",
            "xla", "--sweeps", "--no-dense-regime", "--json", str(path)]  # fmt: skip
    assert bench.main(argv) == 0
    record = json.loads(path.read_text())
    assert record["schema"] == bench.SCHEMA and record["config"]["quick"] is True
    (case,) = record["cases"]
    assert case["layout"] == "rows-on-model"
    assert list(case["implementations"]) == ["jaxembed", "xla"]
    for name, result in case["implementations"].items():
        assert result["status"] == "ok", (name, result)
        assert result["agrees_with_reference"] and result["max_abs_error_out"] <= 1e-5, name
    assert case["summary"]["jaxembed_wire_ratio_to_minimum"] <= 1.1


def test_bad_flags():
    with pytest.raises(SystemExit):
        bench.main(["--layouts", "no-such-layout"])
    with pytest.raises(SystemExit):
        bench.main(["--vocab", "lots"])
