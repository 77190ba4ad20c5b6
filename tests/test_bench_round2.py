"""`jaxembed bench sparse | bags | routed --quick` and `jaxembed bench --calibrate`.

Each subcommand runs once per module at tiny shapes: the record's structure, every
implementation against the float64 reference (touched rows updated by the formula, untouched
rows bitwise unchanged), and the byte targets that the compiled HLO makes deterministic.
Timings are recorded, never asserted (DESIGN.md, testing conventions).
"""

import json
import subprocess
import sys

import pytest

from jaxembed import bench, cli
from jaxembed.bench import bags, routed, sparse
from jaxembed.bench._cases import MAIN_LAYOUTS
from jaxembed.kernels import native
from jaxembed.plan import cost


def _plot_flag(out):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return []
    return ["--plot", str(out / "plots")]


def _run(tmp_path_factory, name, entry):
    out = tmp_path_factory.mktemp(name)
    argv = [name, "--quick", "--no-progress", "--json", str(out / "r.json"),
            "--markdown", str(out / "r.md"), *_plot_flag(out)]  # fmt: skip
    assert entry(argv) == 0
    return json.loads((out / "r.json").read_text()), out


@pytest.fixture(scope="module")
def sparse_run(tmp_path_factory):
    return _run(tmp_path_factory, "sparse", bench.main)


@pytest.fixture(scope="module")
def bags_run(tmp_path_factory):
    return _run(tmp_path_factory, "bags", bench.main)


@pytest.fixture(scope="module")
def routed_run(tmp_path_factory):
    """Through the console script's `main`: `jaxembed bench routed ...` must dispatch."""
    return _run(tmp_path_factory, "routed", lambda argv: cli.main(["bench", *argv]))


def _check_ok(result, where):
    assert result["status"] == "ok", (where, result)
    assert result["agrees_with_reference"], (where, result)
    assert result["untouched_rows_unchanged"], where
    assert result["max_abs_error_out"] <= 1e-5 and result["max_abs_error_table"] <= 1e-5, where
    assert result["time_median_in_ms"] > 0 and result["time_p90_in_ms"] > 0, where
    for key in ("wire_bytes", "temp_bytes", "argument_bytes", "compile_time_in_s"):
        assert isinstance(result[key], int | float) and result[key] >= 0, (where, key)


# --- bench sparse ---------------------------------------------------------------------------------


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
            _check_ok(result, (p["name"], name))
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
    assert targets["at_issue_shapes"] is False and targets["all_agree_with_reference"] is True
    assert targets["sparse_temp_flat_in_vocab"]["met"] is True
    for key in ("sparse_time_flat_in_vocab", "sparse_vs_dense", "sparse_vs_xla_geomean"):
        assert isinstance(targets[key]["met"], bool), key
    assert set(targets["sparse_vs_xla_geomean"]["per_layout"]) == set(MAIN_LAYOUTS)


# --- bench bags -----------------------------------------------------------------------------------


def test_bags_record(bags_run):
    record, _ = bags_run
    assert record["schema"] == bags.SCHEMA
    assert [p["layout"] for p in record["layouts"]] == list(bags.BAG_LAYOUTS)
    cfg = bags.QUICK
    for p in record["layouts"]:
        assert cfg.min_ids <= p["mean_bag_length"] <= cfg.max_ids
        names = list(p["implementations"])
        assert names[0] == "jaxembed" and names[-2:] == ["jaxembed+optax", "xla"]
        assert "jaxembed[flat]" in names
        for name, result in p["implementations"].items():
            _check_ok(result, (p["name"], name))


def test_bags_pool_before_communicating(bags_run):
    """jaxembed sends pooled partial sums: at most XLA's bytes / L̄ (deterministic bytes)."""
    record, _ = bags_run
    for p in record["layouts"]:
        impls = p["implementations"]
        limit = impls["xla"]["effective_wire_bytes"] / p["mean_bag_length"]
        assert impls["jaxembed"]["effective_wire_bytes"] <= limit, p["layout"]
        assert record["targets"][f"{p['layout']}: bytes vs xla"]["met"] is True


def test_make_bags_forms_agree():
    host = bags.make_bags(bags.QUICK, blocks=8)
    ids, values, lengths = host["ids"], host["values"], host["lengths"]
    assert ids.shape == (64, 6) and values.shape == (8, 48) and lengths.shape == (8, 8)
    assert ((ids >= 0).sum(axis=1) == lengths.reshape(-1)).all()
    for k in range(8):  # block k holds bags 8k..8k+7 back to back, in order
        block = ids[8 * k : 8 * k + 8]
        n = int(lengths[k].sum())
        assert (values[k, :n] == block[block >= 0]).all() and (values[k, n:] == 0).all()


# --- bench routed ---------------------------------------------------------------------------------


def test_routed_record(routed_run):
    record, out = routed_run
    assert record["schema"] == routed.SCHEMA
    cfg = routed.QUICK
    assert len(record["points"]) == len(routed.ROUTED_LAYOUTS) * 2 * len(cfg.main_zipf)
    for p in record["points"]:
        assert list(p["implementations"]) == list(cfg.exchanges)
        for name, result in p["implementations"].items():
            _check_ok(result, (p["name"], name))
            assert 0 <= result["fallback_rate"] <= 1
        impls = p["implementations"]
        assert impls["rows"]["exchange"] == "none" and impls["routed"]["exchange"] == "routed"
    assert [p["ids_shape"][0] for p in record["batch_sweep"]] == list(cfg.batch_sweep)
    assert [p["plan"]["gradient_exchange"] for p in record["batch_sweep"]] == ["rows", "dense"]
    if (out / "plots").exists():
        assert sorted(f.name for f in (out / "plots").iterdir()) == [
            "routed_batch.png", "routed_zipf.png"]  # fmt: skip


def test_routed_branches_in_the_hlo(routed_run):
    """The routed program holds both paths; its bytes are told apart by branch."""
    for p in routed_run[0]["points"]:
        r = p["implementations"]["routed"]
        kinds = {b: {c["kind"] for c in r["collectives"] if c["branch"] == b}
                 for b in ("main", "routed", "fallback")}  # fmt: skip
        assert "all-to-all" in kinds["routed"], p["name"]  # (+ a psum over the other row axes)
        assert kinds["fallback"] and "all-to-all" not in kinds["fallback"], p["name"]
        main = sum(c["wire_bytes"] for c in r["collectives"] if c["branch"] == "main")
        total = r["wire_bytes"] + r["fallback_wire_bytes"] - main
        assert r["all_branches_wire_bytes"] == pytest.approx(total)
        rows = p["implementations"]["rows"]
        assert rows["fallback_wire_bytes"] is None
        assert {c["branch"] for c in rows["collectives"]} == {"main"}


def test_routed_fallback_matches_the_buckets(routed_run):
    """The kernel falls back exactly when the batch's busiest bucket passes the capacity
    (counted on the host from the ids), and then moves the fallback path's bytes."""
    fell = []
    for p in routed_run[0]["points"]:
        r = p["implementations"]["routed"]
        assert bool(r["fallback"]) == p["routing"]["overflows"], p["name"]
        want = r["fallback_wire_bytes"] if r["fallback"] else r["wire_bytes"]
        assert r["effective_wire_bytes"] == want
        fell.append((p["layout"], p["row_sharding"], p["zipf"], bool(r["fallback"])))
    # Zipf's hot ids all live on shard 0 with block rows; mod rows spread them
    assert ("fully-sharded-8", "block", 1.1, True) in fell
    assert ("fully-sharded-8", "mod", 1.1, False) in fell


def test_routed_targets_are_reported(routed_run):
    targets = routed_run[0]["targets"]
    assert targets["all_agree_with_reference"] is True
    for layout in routed.ROUTED_LAYOUTS:
        for what in ("routed bytes / gather path", "rows looked up / (G/n_S)",
                     "uniform ids, auto / gather path time"):  # fmt: skip
            assert isinstance(targets[f"{layout}: {what}"]["met"], bool)
    assert set(targets["batch sweep: auto / fastest forced"]["per_case"]) == {"B=2", "B=512"}


# --- the command line -----------------------------------------------------------------------------


def test_calibrate(tmp_path, monkeypatch, capsys):
    path = tmp_path / "cost.json"
    monkeypatch.setenv("JAXEMBED_COST_FILE", str(path))
    try:
        assert bench.main(["--calibrate", "--repeats", "3"]) == 0
        text = capsys.readouterr().out
        assert f"saved to {path}" in text and "link bandwidth" in text
        saved = json.loads(path.read_text())
        assert set(saved) == ({"cpu", "cpu-native"} if native.available() else {"cpu"})
        for entry in saved.values():
            for key in ("link_bytes_per_s", "memory_bytes_per_s", "latency_s", "sort_ids_per_s"):
                assert entry[key] > 0, key
        assert cost.load_constants("cpu").source.startswith("jaxembed bench --calibrate")
        other = tmp_path / "other.json"
        monkeypatch.setenv("JAXEMBED_COST_FILE", str(other))
        assert bench.main(["--calibrate", "--no-save", "--repeats", "3"]) == 0
        assert "not saved" in capsys.readouterr().out and not other.exists()
    finally:
        monkeypatch.undo()
        cost.load_constants.cache_clear()  # later plans use the defaults again


def test_bad_flags(capsys):
    assert bench.main(["--no-save"]) == 2
    assert "--calibrate" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["routed", "--layouts", "no-such-layout"])
    with pytest.raises(SystemExit):
        bench.main(["sparse", "--optimizers", "adam"])


def test_workloads_import_without_jax():
    code = "import sys, jaxembed.bench.workloads; assert 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
