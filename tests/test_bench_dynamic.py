"""`jaxembed bench dynamic-throughput --quick`: the remap benchmark's record (structure and
agreement, never timings): every policy runs, and the XLA steps make the native steps'
decisions, bit for bit."""

import json

import pytest

from benchmarks.dynamic import throughput
from jaxembed.kernels import remap_native


# ~9 s; the engines' decisions against each other and the reference: tests/test_dynamic_remap.py
@pytest.mark.slow
def test_quick_throughput_record(tmp_path):
    path = tmp_path / "t.json"
    assert throughput.main(["--quick", "--json", str(path)]) == 0
    cases = json.loads(path.read_text())["cases"]
    impls = {"native", "xla"} if remap_native.available() else {"xla"}
    assert {(c["policy"], c["impl"]) for c in cases} == {
        (p, i) for p in ("lru", "lfu", "ttl") for i in impls
    }
    for c in cases:
        assert c["matches_native"] is not False, c["name"]
        assert c["ids_per_s_median"] > 0 and c["admitted"] > 0, c["name"]


def test_quick_sharded_record(tmp_path):
    """The sharded remap benchmark: every layout gives the one device's rows, and the rows
    over 8 hold an eighth of the state a device (structure, never timings)."""
    from benchmarks.dynamic import sharded

    path = tmp_path / "s.json"
    assert sharded.main(["--quick", "--json", str(path)]) == 0
    cases = {c["case"]: c for c in json.loads(path.read_text())["cases"]}
    assert set(cases) == set(sharded.CASES)
    assert all(c["rows_equal"] and c["median_ms"] > 0 for c in cases.values())
    whole = cases["1 device"]["state_bytes_per_device"]
    assert cases["replicated on 8"]["state_bytes_per_device"] == whole
    assert cases["rows over 8"]["state_bytes_per_device"] == (whole - 4) // 8 + 4
    assert cases["rows over 8, routed"]["state_bytes_per_device"] == (whole - 4) // 8 + 4
