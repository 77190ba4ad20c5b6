"""`jaxembed bench planner`: a `--quick` run end to end (the planner's layout and the four
uniform ones, each checked against the float64 reference), the record's schema, the
targets' arithmetic, the uniform layouts' construction and `read_rows` on every sharding.

No timing is asserted: the times of a quick run mean nothing.
"""

import dataclasses
import json

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.planner import bench as planner
from benchmarks.planner import report as planner_report
from benchmarks.planner import worker as planner_worker
from benchmarks.recsys import impls as recsys_impls
from jaxembed.collection import FeatureConfig, TableConfig
from jaxembed.plan.collection import parse_bytes, plan_collection

TARGET_BOOLS = ("planner_step_within_goal", "planner_within_budget_modelled",
                "planner_within_budget_compiled", "planner_within_budget", "all_checks_pass",
                "model_picks_fastest")  # fmt: skip
TIME_KEYS = ("step_time_median_in_ms", "step_time_p90_in_ms", "step_time_cpu_median_in_ms",
             "forward_time_median_in_ms")  # fmt: skip


# The tests of the `--quick` run (~30 s, a worker subprocess) are marked slow (`pytest -m
# slow`); the targets' arithmetic, the flags, the uniform layouts and `read_rows` run by
# default.
@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One `--quick` run through the command (a worker subprocess on 8 devices)."""
    folder = tmp_path_factory.mktemp("planner")
    argv = ["--quick", "--json", str(folder / "planner.json"), "--markdown",
            str(folder / "planner.md")]  # fmt: skip
    status = planner.main(argv)
    return status, json.loads((folder / "planner.json").read_text()), folder


@pytest.mark.slow
def test_quick_run_writes_the_documented_record(quick):
    status, record, _ = quick
    assert status == 0 and "error" not in record
    assert record["schema"] == "jaxembed.bench.planner/1"
    assert set(record) >= {"config", "machine", "workload", "memory_per_device_bytes", "layouts",
                           "targets", "planner_text", "cost_constants"}  # fmt: skip
    assert record["config"]["quick"] is True
    assert record["memory_per_device_bytes"] == parse_bytes("1MiB")
    w = record["workload"]
    assert (w["num_features"], w["batch_size"], w["dim"]) == (26, 64, 16)
    assert list(record["layouts"]) == list(planner_worker.LAYOUTS)
    for name, rec in record["layouts"].items():
        assert rec["status"] == "ok" and rec["agrees_with_reference"] is True, (name, rec)
        check = rec["check"]
        assert check["num_over_rtol"] == 0 and check["accumulator_num_over_rtol"] == 0
        assert check["untouched_rows_moved"] == 0 and check["forward_max_abs_error"] <= 1e-5
        assert all(isinstance(rec[k], float) for k in TIME_KEYS), name
        m = rec["modelled"]
        assert m["modelled_step_in_ms"] > 0 and m["modelled_peak_bytes"] > 0
        assert rec["compiled_peak_bytes"] > 0 and rec["wire_bytes"] > 0
        # The lookup's bytes are the model's to the byte; the fused step shares the ids the
        # update would move again with the lookup (plus the loss's 4-byte all-reduce).
        assert rec["forward_wire_bytes"] == m["modelled_forward_wire_bytes"], name
        fused = m["modelled_wire_bytes"] - m["modelled_update_ids_again_bytes"]
        assert abs(rec["wire_bytes"] - fused) <= 8, (name, rec["wire_bytes"], fused)
    layouts = record["layouts"]
    for uniform in ("rows", "table", "columns"):
        assert set(layouts[uniform]["modelled"]["placements"].values()) == {uniform}
    assert set(layouts["replicated"]["modelled"]["placements"].values()) == {"rows", "replicated"}
    assert layouts["replicated"]["modelled"]["over_budget"] is False
    assert layouts["planner"]["modelled"]["over_budget"] is False


@pytest.mark.slow
def test_quick_targets_are_booleans_and_follow_the_times(quick):
    _, record, folder = quick
    t = record["targets"]
    for key in TARGET_BOOLS:
        assert isinstance(t[key], bool), key
    assert t["all_checks_pass"] is True and t["planner_within_budget_modelled"] is True
    layouts = record["layouts"]
    uniform = {n: r["step_time_median_in_ms"] for n, r in layouts.items() if n != "planner"}
    assert t["fastest_uniform"] == min(uniform, key=uniform.get)
    want = layouts["planner"]["step_time_median_in_ms"] / uniform[t["fastest_uniform"]]
    assert t["step_ratio"] == pytest.approx(want, abs=1e-3)
    assert t["planner_step_within_goal"] == (t["step_ratio"] <= planner.STEP_GOAL)
    assert -1 <= t["spearman_wall"] <= 1
    text = (folder / "planner.md").read_text()
    assert "| planner |" in text and "## Targets" in text and "CollectionPlan" in text


@pytest.mark.slow
def test_plot_writes_a_png(quick, tmp_path):
    pytest.importorskip("matplotlib")
    _, record, _ = quick
    (path,) = planner_report.plot(record, str(tmp_path))
    assert path.endswith("planner.png") and (tmp_path / "planner.png").stat().st_size > 1000


def test_targets_when_the_planner_did_not_run():
    rec = {"status": "ok", "agrees_with_reference": True, "step_time_median_in_ms": 5.0,
           "step_time_cpu_median_in_ms": 5.0, "compiled_peak_bytes": 10,
           "modelled": {"modelled_step_in_ms": 1.0, "modelled_peak_bytes": 10,
                        "placements": {"t": "rows"}, "exchanges": {}}}  # fmt: skip
    record = {"memory_per_device_bytes": 100, "layouts": {
        "planner": {"status": "error", "error": "boom"}, "rows": rec}}  # fmt: skip
    t = planner.targets(record)
    assert t["step_ratio"] is None and t["fastest_uniform"] == "rows"
    assert t["planner_step_within_goal"] is False and t["planner_within_budget"] is False
    assert t["all_checks_pass"] is False and t["spearman_wall"] is None


def test_spearman_ties_and_degenerate_inputs():
    assert planner.spearman([1, 2, 3, 4, 5], [5, 4, 3, 2, 1]) == -1.0
    assert planner.spearman([1, 1, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.949, abs=1e-3)
    assert planner.spearman([1, 1, 1], [1, 2, 3]) is None


def test_bad_flags_exit_2(capsys):
    assert planner.main(["--quick", "--layouts", "rows,diagonal"]) == 2
    assert "unknown layouts ['diagonal']" in capsys.readouterr().err
    assert planner.main(["--quick", "--memory", "lots"]) == 2
    assert "memory_per_device must be a positive number of bytes" in capsys.readouterr().err


def test_config_from_flags():
    args = planner._parser().parse_args(["--batch-size", "512", "--memory", "8MiB",
                                         "--layouts", "planner,rows", "--max-load", "6"])  # fmt: skip
    config = planner.config_from_args(args)
    assert config.worker == dataclasses.replace(
        planner_worker.WorkerConfig(), batch_size=512, memory_per_device="8MiB",
        layouts=("planner", "rows"),
    )  # fmt: skip
    assert config.max_load == 6 and not config.quick


def test_uniform_layouts_and_the_replicated_fill():
    mesh = AbstractMesh((8,), ("data",))
    tables = [TableConfig("big", 400_000, 16), TableConfig("mid", 20_000, 16),
              TableConfig("small", 100, 16, placement="rows")]  # fmt: skip
    features = [FeatureConfig("a", "big", max_ids=4), FeatureConfig("b", "mid"),
                FeatureConfig("c", "small")]  # fmt: skip
    plans = planner_worker.plan_layouts(tables, features, mesh, batch_size=256,
                                        memory_per_device="8MiB")  # fmt: skip
    assert list(plans) == list(planner_worker.LAYOUTS)
    budget = parse_bytes("8MiB")
    assert plans["planner"].peak_bytes <= budget
    # Smallest first, each kept while the layout fits: big's replica (27 MB) never does.
    assert plans["replicated"].placements == {"big": "rows", "mid": "replicated",
                                              "small": "replicated"}  # fmt: skip
    assert plans["replicated"].peak_bytes <= budget
    every = [dataclasses.replace(t, placement="replicated") for t in tables]
    assert plan_collection(every, features, mesh, batch_size=256,
                           memory_per_device="1TiB").peak_bytes > budget  # fmt: skip
    for p in ("rows", "table", "columns"):  # a fixed placement in the config is replaced too
        assert set(plans[p].placements.values()) == {p}
    with pytest.raises(ValueError, match="unknown layout 'diagonal'"):
        planner_worker.plan_layouts(tables, features, mesh, batch_size=256,
                                    memory_per_device="8MiB", layouts=("diagonal",))  # fmt: skip


@pytest.mark.parametrize("spec", [P("x", None), P(None, "x"), P(None, None), P("x")])
def test_read_rows_on_every_sharding(spec):
    mesh = jax.make_mesh((8,), ("x",))
    host = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    if len(spec) == 1:
        host = host[:, 0]
    array = jax.device_put(host, NamedSharding(mesh, spec))
    rows = np.array([63, 0, 17, 17, 40])
    np.testing.assert_array_equal(recsys_impls.read_rows(array, rows), host[rows])


def test_read_rows_finds_replicas_that_differ():
    mesh = jax.make_mesh((8,), ("x",))
    sharding = NamedSharding(mesh, P())
    pieces = [jax.device_put(np.full((4, 2), float(d == 5), np.float32), dev)
              for d, dev in enumerate(mesh.devices.flat)]  # fmt: skip
    array = jax.make_array_from_single_device_arrays((4, 2), sharding, pieces)
    with pytest.raises(ValueError, match=r"the replicas of rows \[1, 2\]\.\.\. differ"):
        recsys_impls.read_rows(array, np.array([1, 2]))
