"""`jaxembed bench quant-fbgemm --quick`: the record of quantized pooled lookups against FBGEMM's
IntNBit TBE (structure and agreement, never timings), every precision: int8, int4, int2 and
fp8, the last at FBGEMM's default format and at one other (both sides take the format).

Skipped without torch and fbgemm_gpu (the repository's `bench-torchrec` extra)."""

import dataclasses
import json

import pytest

pytest.importorskip("fbgemm_gpu")

from benchmarks.quant import fbgemm
from jaxembed.kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the native kernels")


def test_quick_record_every_precision(tmp_path):
    path = tmp_path / "f.json"
    assert fbgemm.main(["--quick", "--no-progress", "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert [c["precision"] for c in record["cases"]] == ["int8", "int4", "int2", "fp8"]
    for c in record["cases"]:
        assert c["same_bytes"], c["case"]
        for impl in ("jaxembed", "jaxembed[xla]"):
            r = c["implementations"][impl]
            assert r["bitwise_equal_to_fbgemm"] and r["agrees_with_reference"], (c["case"], impl)
    targets = record["targets"]
    assert targets["all_agree_with_reference"]
    assert targets["int2 batch=16 threads=1: time vs fbgemm"]["threshold"] is None
    assert targets["int8 batch=16 threads=1: time vs fbgemm"]["threshold"] == 1.0


def test_fp8_other_format_matches():
    config = dataclasses.replace(
        fbgemm.QUICK, precisions=("fp8",), fp8_exponent_bits=5, fp8_exponent_bias=15
    )
    (case,) = fbgemm.run_fbgemm(config)["cases"]
    assert case["same_bytes"]
    assert case["implementations"]["jaxembed"]["bitwise_equal_to_fbgemm"]
