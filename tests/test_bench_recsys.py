"""`jaxembed bench recsys`: structure of a `--quick` run, every JAX implementation against the
float64 reference, the framework runners skipped cleanly, the targets' arithmetic.

No timing is asserted: the times of a quick run mean nothing.
"""

import dataclasses
import importlib.util
import json
import sys

import numpy as np
import pytest

from benchmarks.common.reference import reference_steps
from benchmarks.recsys import bench as recsys
from benchmarks.recsys import check as recsys_check
from benchmarks.recsys import impls as recsys_impls
from benchmarks.recsys import report
from benchmarks.recsys.files import save_inputs
from benchmarks.recsys.worker import WorkerConfig, run_worker, split_name
from jaxembed import workloads as W

TIME_KEYS = ("step_time_median_in_ms", "step_time_p90_in_ms", "step_time_cpu_median_in_ms",
             "forward_time_median_in_ms", "forward_time_p90_in_ms")  # fmt: skip


def test_quick_run_writes_the_documented_record(tmp_path, capsys):
    out = tmp_path / "recsys.json"
    status = recsys.main([
        "--quick", "--workloads", "a", "--devices", "1", "--variants", "jaxembed,xla",
        "--frameworks", "torchrec,keras-rs", "--torchrec-python", str(tmp_path / "no-python"),
        "--kerasrs-python", str(tmp_path / "no-python"), "--sweep-rows", "1000,2000",
        "--sweep-devices", "1", "--profile", "1", "--json", str(out),
        "--markdown", str(tmp_path / "recsys.md"), "--plot", str(tmp_path / "plots"),
    ])  # fmt: skip
    assert status == 0
    record = json.loads(out.read_text())
    assert record["schema"] == "jaxembed.bench.recsys/1"
    assert set(record) >= {"config", "machine", "workloads", "sweep", "targets"}
    rows = record["workloads"]["a"]["implementations"]
    assert [(r["implementation"], r["devices"]) for r in rows] == [
        ("jaxembed", 1),
        ("xla", 1),
        ("torchrec", None),
        ("keras-rs", None),
    ]
    for r in rows[:2]:
        assert r["status"] == "ok" and r["agrees_with_reference"] is True, r
        assert all(isinstance(r[k], float) for k in TIME_KEYS), r
        assert r["check"]["num_over_rtol"] == 0 and r["check"]["untouched_rows_moved"] == 0
        assert r["memory_per_device_bytes"]["argument"] > 0 and "wire_bytes" in r
        assert r["profile"]["calls"] == 1 and r["profile"]["by_category_in_ms"]
    assert rows[0]["info"]["impl"] == "auto" and "plan" in rows[0]["info"]
    for r in rows[2:]:
        assert r["status"] == "skipped" and "cannot start" in r["reason"], r
    # The sweep: 1000 rows is workload (a)'s own largest table at --quick: reused, not rerun.
    sweep = {(r["largest_table_rows"], r["implementation"]): r for r in record["sweep"]}
    assert sorted(sweep) == [(1000, "jaxembed"), (1000, "xla"), (2000, "jaxembed"), (2000, "xla")]
    assert sweep[1000, "jaxembed"]["reused_from"] == "workload a"
    assert "reused_from" not in sweep[2000, "xla"] and sweep[2000, "xla"]["agrees_with_reference"]
    by_name = {t["target"]: t for t in record["targets"]}
    t = by_name["(a) jaxembed step <= 0.25x XLA dense step, 1 device(s)"]
    assert t["status"] in ("met", "missed") and t["ratio"] == pytest.approx(
        t["numerator_in_ms"] / t["denominator_in_ms"], rel=1e-2)  # fmt: skip
    assert by_name["(a) jaxembed step <= 1.5x TorchRec+FBGEMM, 1 device"]["status"] == (
        "not measured")  # fmt: skip
    assert by_name["(a) jaxembed step within 1.3x as the largest table grows"]["status"] in (
        "met", "missed")  # fmt: skip
    text = (tmp_path / "recsys.md").read_text()
    assert "## Targets" in text and "jaxembed@1" in text and "skipped: cannot start" in text
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "recsys_a.png",
        "recsys_sweep.png",
    ]
    assert "wrote" in capsys.readouterr().out


# ~80 s for both: marked slow (`pytest -m slow`); by default the quick run above checks
# jaxembed and XLA against the reference, and the check itself is tested below.
@pytest.mark.slow
@pytest.mark.parametrize("workload,devices", [("a", 8), ("dlrm", 1)])
def test_every_jax_implementation_agrees_with_the_reference(workload, devices):
    variants = [v for v in recsys_impls.VARIANTS if devices > 1 or v != "jaxembed[rows]"]
    if devices > 1:  # the 1-device step timed beside the others, on the first device
        variants.append("jaxembed@1")
    config = WorkerConfig(workload=workload, devices=devices, variants=tuple(variants),
                          quick=True, batches=2, repeats=1, warmup=0, min_samples=1,
                          profile_calls=0)  # fmt: skip
    result = run_worker(config)
    assert result["devices"] == devices and len(result["ids_per_step"]) == 2
    assert list(result["implementations"]) == variants
    for name, r in result["implementations"].items():
        assert r["status"] == "ok", (name, r)
        c = r["check"]
        assert c["agrees_with_reference"] and c["num_over_rtol"] == 0, (name, c)
        assert c["accumulator_num_over_rtol"] == 0 and c["untouched_rows_moved"] == 0, (name, c)
        assert c["forward_max_abs_error"] < 1e-6 and c["max_rel_error"] < 1e-4, (name, c)
        assert r["optimizer"] == ("rowwise_adagrad" if name.startswith("jaxembed") else "adagrad")
        assert all(k in r for k in TIME_KEYS), name
    if devices > 1:  # the donated, row-split step: collectives, and no table-sized temp
        # every table "rows", its row sharding the planner's: the Zipf-hot tables by mod rows
        planned = result["implementations"]["jaxembed[rows-planned]"]["info"]["layout"]
        assert "mod)" in planned and "auto" not in planned, planned
        one = result["implementations"]["jaxembed@1"]
        assert one["wire_bytes"] == 0 and not one["collectives"], one
        assert result["implementations"]["jaxembed"]["wire_bytes"] > 0
        r = result["implementations"]["jaxembed[rows]"]
        table_bytes = (
            max(t.rows for t in recsys.make_workload(workload, quick=True).tables) * 16 * 4
        )
        assert r["wire_bytes"] > 0 and r["collectives"]
        assert r["memory_per_device_bytes"]["alias"] >= table_bytes // devices


def test_the_check_catches_a_wrong_row_and_a_moved_untouched_row():
    w = recsys.make_workload("a", quick=True)
    tables = W.make_tables(w, 0)
    batches, cot = [W.make_batch(w, 0, 0)], W.make_cotangent(w, 0)
    expected = recsys_check.touched_reference(w, tables, batches, cot, optimizer="rowwise_adagrad")
    untouched = recsys_check.untouched_sample(w, expected, tables, size=8)
    new, acc = reference_steps(w, tables, batches, cot)  # the full float64 reference
    state = {"t": {k: v.astype(np.float32) for k, v in new.items()}, "a": acc}

    def read(table, rows):
        return state["t"][table][rows], state["a"][table][rows]

    kw = {"optimizer": "rowwise_adagrad", "steps": 1, "num_table_entries": 1780 * 16}
    good = recsys_check.compare(read, expected, untouched, **kw)
    assert good["agrees_with_reference"] and good["num_over_rtol"] == 0
    row = int(expected["t1"].rows[3])
    state["t"]["t1"][row, 5] += 1e-3
    bad = recsys_check.compare(read, expected, untouched, **kw)
    assert not bad["agrees_with_reference"] and bad["num_over_rtol"] == 1
    state["t"]["t1"][row, 5] -= 1e-3
    free = int(untouched["t2"][0][0])
    state["a"]["t2"][free] = 1.0
    moved = recsys_check.compare(read, expected, untouched, **kw)
    assert not moved["agrees_with_reference"] and moved["untouched_rows_moved"] == 1


def test_runners_are_skipped_cleanly_when_their_framework_is_missing(tmp_path):
    w = recsys.make_workload("a", quick=True)
    inputs = str(tmp_path / "in.npz")
    save_inputs(inputs, w, W.make_tables(w, 0), [W.make_batch(w, 0, 0)], W.make_cotangent(w, 0))
    config = recsys.QUICK
    missing = recsys.dataclasses.replace(config, torchrec_python=str(tmp_path / "nope"))
    r = recsys._runner(missing, str(tmp_path), "torchrec", inputs)
    assert r["status"] == "skipped" and "cannot start" in r["reason"] and r["devices"] is None
    if importlib.util.find_spec("torch") is None:  # this Python has no torch: exit status 3
        here = recsys.dataclasses.replace(config, torchrec_python=sys.executable)
        r = recsys._runner(here, str(tmp_path), "fbgemm", inputs)
        assert r["status"] == "skipped" and "not installed" in r["reason"], r


def _row(name, devices, step, forward=None, ok=True):
    return {"implementation": name, "devices": devices, "status": "ok",
            "agrees_with_reference": ok, "step_time_median_in_ms": step,
            "forward_time_median_in_ms": forward or step / 4}  # fmt: skip


def test_targets_are_ratios_of_medians_and_say_what_was_not_measured():
    rows = [_row("jaxembed", 8, 40.0), _row("xla", 8, 400.0), _row("jaxembed", 1, 30.0, 6.0),
            _row("xla", 1, 100.0, ok=False), _row("torchrec", None, 25.0),
            _row("fbgemm", None, 20.0, 5.0)]  # fmt: skip
    sweep = [{"largest_table_rows": r, **_row("jaxembed", 1, s)}
             for r, s in ((10**5, 30.0), (10**7, 45.0))]  # fmt: skip
    record = {"workloads": {"a": {"implementations": rows}}, "sweep": sweep}
    got = {t["target"]: (t["status"], t.get("ratio")) for t in recsys.targets(record)}
    assert got == {
        "(a) jaxembed step <= 0.25x XLA dense step, 8 device(s)": ("met", 0.1),
        "(a) jaxembed step <= 0.25x XLA dense step, 1 device(s)": ("not measured", None),
        "(a) jaxembed step <= 1.0x TorchRec+FBGEMM (ambitious), 1 device": ("missed", 1.2),
        "(a) jaxembed step <= 1.5x TorchRec+FBGEMM, 1 device": ("met", 1.2),
        "(a) jaxembed forward <= 1.5x FBGEMM forward, 1 device": ("met", 1.2),
        "(a) jaxembed step on 8 devices <= 1.5x the 1-device step (every table by rows)": (
            "met",
            1.333,
        ),
        "(a) jaxembed step within 1.3x as the largest table grows": ("missed", 1.5),
    }


def test_scale_out_divides_by_the_1_device_step_timed_beside_it():
    rows = [_row("jaxembed", 8, 60.0), _row("jaxembed[mod]", 8, 45.0),
            {**_row("jaxembed", 1, 40.0), "beside": 8}, _row("jaxembed", 1, 30.0)]  # fmt: skip
    record = {"workloads": {"a": {"implementations": rows}}, "sweep": []}
    got = {t["target"]: t for t in recsys.targets(record) if "on 8 devices" in t["target"]}
    rows_goal = got[
        "(a) jaxembed step on 8 devices <= 1.5x the 1-device step (every table by rows)"
    ]
    assert rows_goal["ratio"] == 1.5 and rows_goal["status"] == "met"
    assert rows_goal["compares"] == "jaxembed@8 / jaxembed@1 beside @8"
    assert rows_goal["ratio_to_the_1_device_process"] == 2.0
    mod = got[
        "(a) jaxembed[mod] step on 8 devices <= 1.5x the 1-device step (every table by mod rows)"
    ]
    assert mod["ratio"] == 1.125
    # the 1-device worker's own targets still read its own row, not the one beside @8
    one = {t["target"]: t for t in recsys.targets(record)}[
        "(a) jaxembed step <= 0.25x XLA dense step, 1 device(s)"]  # fmt: skip
    assert one["status"] == "not measured"
    assert report.label(rows[2]) == "jaxembed@1 beside @8"
    assert split_name("jaxembed@1", 8) == ("jaxembed", 1)
    with pytest.raises(ValueError, match=r"'jaxembed@9': the mesh size after '@' must be"):
        split_name("jaxembed@9", 8)
    cfg = recsys.RecsysConfig(variants=("jaxembed", "xla"))
    assert recsys._variants_for(cfg, "a", 8) == ["jaxembed", "xla", "jaxembed@1"]
    assert recsys._variants_for(cfg, "a", 1) == ["jaxembed", "xla"]
    off = dataclasses.replace(cfg, one_beside=False)
    assert recsys._variants_for(off, "a", 8) == ["jaxembed", "xla"]


def test_bad_names_raise_with_the_choices():
    with pytest.raises(ValueError, match="workload must be 'a' or 'dlrm', got 'b'"):
        recsys.make_workload("b")
    with pytest.raises(ValueError, match=r"unknown implementation 'tf'.*'jaxembed'"):
        recsys_impls.build_variant("tf", recsys.make_workload("a", quick=True), 1)
    with pytest.raises(ValueError, match="batch size 64 does not split over 3 devices"):
        recsys_impls.build_variant("xla", recsys.make_workload("a", quick=True), 3)
    assert recsys.main(["--workloads", "a,c", "--quick"]) == 2


@pytest.mark.slow  # ~11 s
def test_floor_quick_run_times_the_split_the_mesh_and_one_device(tmp_path):
    """`bench recsys-floor`: the split steps, the n-device step and the 1-device step, each
    with a ratio to the last; the split share has 1/n of the batch and rows."""
    from benchmarks.recsys import floor
    from jaxembed import cli

    out = tmp_path / "floor.json"
    argv = ["bench", "recsys-floor", "--quick", "--workloads", "a", "--variants", "jaxembed",
            "--repeats", "1", "--max-seconds", "0.05", "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    rows = json.loads(out.read_text())["workloads"]["a"]
    assert set(rows) == {"split", "jaxembed", "1 device"}, rows
    assert rows["1 device"]["ratio_to_1_device"] == 1.0
    for rec in rows.values():
        assert rec["step_time_median_in_ms"] > 0 and len(rec["step_time_samples_in_ms"]) == 1
    share = floor.split_workload(recsys.make_workload("a", quick=True), 8)
    assert share.batch_size == 8 and share.tables[0].rows == 125
