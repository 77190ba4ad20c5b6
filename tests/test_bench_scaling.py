"""`jaxembed bench planner-scaling`: the plans' strong-scaling table, on tiny shapes.

Through the console script (`jaxembed bench planner-scaling ...` must dispatch): the record
round-trips through its JSON, every figure is the plans' own (bytes, slots, capacities), the
gather exchange walks all G slots on every mesh while the routed one shrinks with n, and the
efficiency is the ratio it says it is. Nothing is timed.
"""

import doctest
import json
import math

import pytest

from benchmarks.planner import scaling
from jaxembed import cli
from jaxembed.collection import TableConfig
from jaxembed.plan.collection import plan_collection
from jaxembed.workloads import dlrm_workload

DEVICES = (8, 64)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """`--quick` (batch 512, 1/4096 of Criteo's rows), n = 8 and 64, both meshes."""
    out = tmp_path_factory.mktemp("scaling")
    argv = ["bench", "planner-scaling", "--quick", "--meshes", "1d,2d", "--json",
            str(out / "scaling.json"), "--markdown", str(out / "scaling.md")]  # fmt: skip
    assert cli.main(argv) == 0
    return json.loads((out / "scaling.json").read_text()), (out / "scaling.md").read_text()


def _rows(record, **where):
    return [r for r in record["rows"] if all(r[k] == v for k, v in where.items())]


def test_record_round_trips_and_covers_every_variant(run):
    record, _ = run
    assert record["schema"] == scaling.SCHEMA
    assert json.loads(json.dumps(record)) == record
    cfg = record["config"]
    assert cfg["quick"] is True and tuple(cfg["devices"]) == DEVICES
    assert len(record["plans"]) == 2 * len(DEVICES) * 2  # meshes x n x placements
    assert len(record["rows"]) == len(record["plans"]) * len(scaling.EXCHANGES)
    names = [r["name"] for r in record["rows"]]
    assert len(set(names)) == len(names)
    assert "scale=1/4096,mesh=8x8,placements=auto,exchange=routed" in names
    assert {p["mesh"]["hosts"] for p in record["plans"] if p["mesh_kind"] == "2d"} == {1, 8}


def test_gather_walks_every_slot_and_routed_shrinks(run):
    record, _ = run
    for kind in ("1d", "2d"):
        for placements in ("rows",):
            gather = sorted(_rows(record, mesh_kind=kind, placements=placements,
                                  exchange="gather"), key=lambda r: r["devices"])  # fmt: skip
            routed = sorted(_rows(record, mesh_kind=kind, placements=placements,
                                  exchange="routed"), key=lambda r: r["devices"])  # fmt: skip
            g = gather[0]["global_slots"]
            assert g == 512 * 26 * 20  # batch x features x max_ids, every bag full
            for r in gather:
                assert r["slots_per_device"] == r["forward_slots"] == g
                assert r["slots_over_g_per_n"] == pytest.approx(r["devices"])
            slots = [r["slots_per_device"] for r in routed]
            assert slots == sorted(slots, reverse=True) and slots[0] > slots[-1]
            for r in routed:
                (call,) = r["calls"]
                rp = call["routed"]
                assert rp["num_buckets"] == r["devices"] and rp["slots"] == g // r["devices"]
                own = 0 if rp["pooled_at_owner"] else rp["slots"]  # the owner pools: no rows back
                assert r["forward_slots"] == own + rp["num_buckets"] * rp["capacity"]
                assert r["update_slots"] == rp["rows_looked_up"] == r["buckets_times_capacity"]
                mu = rp["slots"] / rp["num_buckets"]
                # the default capacity, or less where the owners hold fewer rows than that
                # (no device sends an owner more distinct ids than it holds rows)
                assert r["capacity"][0] <= math.ceil(mu + 4 * math.sqrt(mu) + 1)
            bytes_ = [r["forward_wire_bytes"] + r["update_wire_bytes"] for r in routed]
            assert bytes_[-1] < bytes_[0]


def test_the_planners_table_wise_calls_walk_their_owners_slots(run):
    """With `placements="auto"` the planner may place tables whole on one device: those
    calls are table-wise whatever exchange the row is for, each owner walking its tables'
    slots `B · F_o · L`, fewer than the batch's; the rest follow the exchange (or, for an
    update of a small table, the dense exchange)."""
    record, _ = run
    tablewise = 0
    for r in _rows(record, placements="auto"):
        g = r["global_slots"]
        for call in r["calls"]:
            if call["exchange"] == "table":
                tablewise += 1
                assert 0 < call["forward_slots"] == call["update_slots"] < call["global_slots"]
            else:
                # gather: an update of a small table may sum its gradient shard (dense)
                want = {"gather": ("none", "rows", "dense"), "routed": ("routed",)}[r["exchange"]]
                assert call["exchange"] in want or not call["applies"]
        assert r["slots_per_device"] <= g
    # Since row-sparse updates can sum a small table's gradient shard (the dense exchange),
    # the planner may keep every table sharded or replicated (`tablewise` may be 0): the
    # table-wise calls it makes walk only their owners' slots, as checked above.


def test_bytes_are_the_plans_own():
    """The figures of `exchange_figures` against `plan_collection`'s calls and plans."""
    w = dlrm_workload(512, scale=1 / 4096, dim=16)
    tables = [TableConfig(t.name, t.rows, t.dim, placement="rows") for t in w.tables]
    mesh = scaling.make_mesh("1d", 64)
    plan = plan_collection(tables, scaling._features(w), mesh, batch_size=512,
                           memory_per_device="1TiB")  # fmt: skip
    (call,) = plan.calls
    assert call.exchange == "routed"
    routed = scaling.exchange_figures(plan, mesh, "routed")
    assert routed["forward_wire_bytes"] == call.plan.forward_wire_bytes == call.forward_bytes
    assert routed["update_wire_bytes"] == call.plan.backward_wire_bytes == call.update_bytes
    assert routed["modelled_step_in_ms"] == pytest.approx(plan.step_ms)
    gather = scaling.exchange_figures(plan, mesh, "gather")
    forced = scaling._replan(call, mesh, "none")
    assert forced.exchange == "none" and forced.routed is None
    assert gather["forward_wire_bytes"] == forced.forward_wire_bytes
    assert gather["update_wire_bytes"] == forced.backward_wire_bytes
    assert gather["modelled_step_in_ms"] > routed["modelled_step_in_ms"]


def test_efficiency_and_markdown(run):
    record, text = run
    for r in record["rows"]:
        (base,) = _rows(record, devices=8, mesh_kind=r["mesh_kind"], exchange=r["exchange"],
                        placements=r["placements"])  # fmt: skip
        want = base["modelled_step_in_ms"] * 8 / (r["devices"] * r["modelled_step_in_ms"])
        assert r["strong_scaling_efficiency"] == pytest.approx(want)
    assert "AbstractMesh((n,), ('x',))" in text and "AbstractMesh((n // 8, 8)" in text
    assert text.count("| x=64 | routed |") == 2  # one per placements table
    assert "The 2-D meshes against the 1-D ones" in text


def test_bad_flags_exit_2(capsys):
    assert scaling.main(["--meshes", "3d"]) == 2
    assert "unknown ['3d']" in capsys.readouterr().err
    with pytest.raises(ValueError, match="'2d' with n a multiple of 8"):
        scaling.make_mesh("2d", 12)


def test_docstring_examples():
    results = doctest.testmod(scaling, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert results.attempted >= 1 and results.failed == 0
