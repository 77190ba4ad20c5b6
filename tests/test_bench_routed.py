"""`jaxembed bench routed --quick`: the routed exchange against the gather path.

Run through the console script (`jaxembed bench routed ...` must dispatch): the record's
structure, the exchange's two branches in the HLO, the fallback against the buckets, and the
targets. Timings are recorded, never asserted. Then `benchmarks.routed.pieces --quick`: the
routed exchange in pieces against the copies XLA:CPU makes without them.
"""

import json

import pytest
from bench_runs import check_ok, quick_run

from benchmarks.routed import bench as routed
from jaxembed import cli

# Both runs of this module (`--quick`, ~27 s, and the pieces, ~16 s) are marked slow
# (`pytest -m slow`): the routed exchange itself, its HLO, fallback and native bucketing, is
# tested by tests/test_routed*.py and tests/test_native_routing.py.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def routed_run(tmp_path_factory):
    """Through the console script's `main`: `jaxembed bench routed ...` must dispatch."""
    return quick_run(tmp_path_factory, "routed", lambda argv: cli.main(["bench", *argv]))


def test_routed_record(routed_run):
    record, out = routed_run
    assert record["schema"] == routed.SCHEMA
    cfg = routed.QUICK
    assert len(record["points"]) == len(routed.ROUTED_LAYOUTS) * 2 * len(cfg.main_zipf)
    for p in record["points"]:
        assert list(p["implementations"]) == list(cfg.exchanges)
        for name, result in p["implementations"].items():
            check_ok(result, (p["name"], name))
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
        main = sum(c["wire_bytes"] * c["trips"] for c in r["collectives"] if c["branch"] == "main")
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


def test_routed_bucketing_native_vs_xla(routed_run):
    """The bucketing sweep: both implementations timed on the same slots, bitwise equal."""
    from jaxembed.kernels import native

    points = routed_run[0]["bucketing"]
    if not native.available():
        assert points == []
        return
    assert {(p["slots"], p["devices"]) for p in points} == {(1024, 1), (1024, 8)}
    for p in points:
        assert p["bitwise_equal"] is True, p["name"]
        assert list(p["implementations"]) == ["xla", "native"]
        assert p["summary"]["xla_time_over_native"] > 0


def test_pieces_against_copies_quick(tmp_path):
    """`benchmarks.routed.pieces`: the copies program (the pieces kernels swapped for their
    whole-buffer twins while it is traced) joins more of the `all_to_all`'s pieces than the
    library's, and pools the same; the swap is undone after it."""
    from benchmarks.routed import pieces
    from jaxembed.kernels import native, routed

    def now():
        return (routed._apart, native.pool_sum_pieces, native.bag_scatter_add_pieces,
                native.apply_rows_pieces, native.scatter_add_pieces)  # fmt: skip

    kept = now()
    out = tmp_path / "pieces.json"
    assert pieces.main(["--workloads", "a,tokens:64", "--quick", "--repeats", "1",
                        "--max-seconds", "0.2", "--json", str(out)]) == 0  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [r["workload"] for r in rows] == ["a", "tokens:64"]
    for row in rows:
        runs = {"8 devices, pieces", "8 devices, copies", "1 device"}
        assert set(row["median_ms"]) == set(row["median_cpu_ms"]) == runs
        joins = row["concatenates"]
        assert joins["8 devices, copies"] > joins["8 devices, pieces"], joins
        assert "routed" in str(row["exchange"]), row["exchange"]
    assert now() == kept
