"""`jaxembed bench dynamic-dlrm --quick`: the DLRM step with dynamic tables, its record's
structure and checks (never its timings). The JAX variants always; the TorchRec child only
where torchrec is installed (the repository's `bench-torchrec` extra)."""

import dataclasses
import json

import numpy as np
import pytest

from benchmarks.dynamic import dlrm_step


def test_raw_ids_are_a_bijection_that_keeps_padding():
    ids = np.array([[0, 5, -1], [5, 7, -1]], np.int32)
    raw = dlrm_step.raw_ids(ids, table_index=1)
    assert raw.dtype == np.int64 and (raw[:, 2] == -1).all()
    assert raw[0, 1] == raw[1, 0] and len({raw[0, 0], raw[0, 1], raw[1, 1]}) == 3
    assert not np.array_equal(raw, dlrm_step.raw_ids(ids, table_index=2))  # a salt per table
    assert np.unique(dlrm_step.raw_ids(np.arange(100_000), 0)).size == 100_000


def test_workload_rounds_the_dynamic_tables_to_whole_buckets():
    w = dlrm_step.workload(dlrm_step.QUICK)
    rows = dict(w.tables)
    assert len(w.dynamic) == 2 and all(
        rows[t] % dlrm_step.QUICK.bucket_size == 0 for t in w.dynamic
    )
    assert min(rows[t] for t in w.dynamic) >= max(r for t, r in w.tables if t not in w.dynamic)


@pytest.mark.slow  # ~22 s; a DLRM trained with dynamic tables: tests/test_train_dynamic.py
def test_quick_jax_variants(tmp_path):
    path = tmp_path / "d.json"
    assert dlrm_step.main(["--quick", "--no-torchrec", "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert set(record["variants"]) == set(dlrm_step.JAX_VARIANTS)
    check = record["check"]
    assert check["equal"] and check["no_evictions_or_refusals"], check
    assert all(n > 0 for n in check["rows_trained"].values())  # the check compared trained rows
    dyn = record["variants"]["dynamic"]
    assert dyn["losses"]["finite"] and dyn["losses"]["calls"] >= dyn["losses"]["timed"]
    assert all(s["admitted"] > 0 for s in dyn["stats"].values())
    targets = record["targets"]
    assert targets["dynamic / static"]["threshold"] == dlrm_step.TARGET_DYNAMIC
    assert not targets["at_target_shapes"] and targets["equivalence"] is True
    assert "torchrec_mch / dynamic" not in targets


@pytest.mark.slow  # ~13 s, with the check it guards
def test_equivalence_check_sees_a_wrong_row():
    """The check is not vacuous: a dynamic table fed another batch's raw ids than the static
    table's ids trains other rows, and the check says so."""
    config = dataclasses.replace(dlrm_step.QUICK, check_steps=2)
    w = dlrm_step.workload(config)
    batches = dlrm_step.make_batches(config, w, 3)
    hyper = {"table": 0.05, "dense": 3e-3, "eps": 1e-8}
    inputs = dlrm_step.Inputs(w, batches, dlrm_step.initial_dense(w), hyper)
    assert dlrm_step.check_equivalence(config, inputs)["equal"]
    raw_of = lambda b: {k: v for k, v in b.items() if k.startswith("raw_")}
    swapped = [{**b, **raw_of(batches[i + 1])} for i, b in enumerate(batches[:2])]
    assert not dlrm_step.check_equivalence(config, inputs._replace(batches=swapped))["equal"]


def test_quick_torchrec_variants(tmp_path):
    pytest.importorskip("torchrec")
    path = tmp_path / "t.json"
    assert dlrm_step.main(["--quick", "--check-steps", "0", "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert set(dlrm_step.TORCHREC_VARIANTS) <= set(record["variants"])
    assert record["torchrec"]["jax_imported"] is False
    assert record["torchrec"]["mcebc_refuses_fused_ebc"].startswith("AttributeError")
    assert record["first_static_loss_vs_torchrec"]["equal"], record["first_static_loss_vs_torchrec"]
    for name in dlrm_step.TORCHREC_VARIANTS:
        v = record["variants"][name]
        assert v["losses"]["finite"] and v["ratio_to_dynamic"] > 0, name
        assert (v["paired_ratio_to_dynamic"] is None) == (name in dlrm_step.MEAN_VARIANTS), name
    assert record["targets"]["torchrec_mch / dynamic"]["threshold"] == dlrm_step.TARGET_TORCHREC
