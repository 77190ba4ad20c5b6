"""`jaxembed bench serving-torchrec --quick`: the exported ranker against TorchRec's quantized
EBC on latency's tiny model (structure and agreement, never timings): the loading process never
imports jaxembed, TorchRec holds int4 rows bitwise jaxembed's, and a TorchRec module on
jaxembed's own rows scores as the exported model does.

Skipped without torchrec (the repository's `bench-torchrec` extra)."""

import json

import pytest

pytest.importorskip("torchrec")

from benchmarks.serving import torchrec_qebc


def test_quick_record(tmp_path):
    path = tmp_path / "t.json"
    assert torchrec_qebc.main(["--quick", "--batches", "4", "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    (process,) = record["loading_processes"].values()
    assert not process["jaxembed_imported"] and process["device_count"] == 1
    assert process["settings"]["torch_num_threads"] == 1
    assert record["rows"]["int4"]["rows_equal_fraction"] == 1.0
    assert record["rows"]["float"]["rows_equal_fraction"] == 1.0
    assert record["rows"]["int8"]["max_code_difference"] <= 1  # two quantizers, one format
    assert {c["precision"] for c in record["cases"]} == {"float", "int8", "int4"}
    for c in record["cases"]:
        assert c["jaxembed_matches_in_process"], c["name"]
        assert c["torchrec_matches"] in (True, None), c["name"]
        assert c["torchrec_on_jaxembed_rows_matches"] in (True, None), c["name"]
        assert c["torchrec"]["time_median_in_ms"] > 0 and c["jaxembed"]["time_median_in_ms"] > 0
    assert record["cases"][-1]["torchrec_matches"] is True  # int4: the same rows
