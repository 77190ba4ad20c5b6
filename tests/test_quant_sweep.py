"""`python -m benchmarks quant-sweep`: its cells, the bytes its runners share, and a `--quick` run
(structure and checks, never timings). FBGEMM's side runs where `JAXEMBED_TORCHREC_PYTHON` names
a Python with torch and fbgemm-gpu-cpu; without it the sweep times jaxembed alone."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.quant import cells as C
from benchmarks.quant import sweep
from jaxembed.kernels import native
from jaxembed.quant import QuantizedTable, to_fbgemm_rows


def test_the_sample_covers_every_level_and_the_issues_tables():
    cells = C.sample_cells(8, seed=3)
    tables = {c.table for c in cells}
    assert len(tables) == 8 and len(cells) == 8 * len(C.BATCHES) * len(C.IDS)
    assert set(C.ISSUE_CELLS) <= set(cells)
    for i, levels in enumerate((C.PRECISIONS, C.ROWS, C.DIMS)):
        assert {t[i] for t in tables} == set(levels)
    assert len(C.sample_cells(0)) == 108
    for c in cells:
        assert C.Cell.parse(c.name) == c
    with pytest.raises(ValueError, match="a cell reads like 'int8,batch=4096"):
        C.Cell.parse("int8,batch=4096")


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_fbgemm_rows_are_jaxembeds_bytes(tmp_path, precision):
    C.write_table(str(tmp_path), precision, 50, 32, seed=1)
    data, scale, bias = C.read_table(str(tmp_path))
    table = QuantizedTable(jnp.asarray(data), jnp.asarray(scale), jnp.asarray(bias), precision)
    want = np.asarray(to_fbgemm_rows(table))
    np.testing.assert_array_equal(C.fused_rows(data, scale, bias), want)


@pytest.mark.skipif(not native.available(), reason="needs the native kernels")
def test_quick_sweep(tmp_path):
    path = tmp_path / "sweep.json"
    peer = os.environ.get("JAXEMBED_TORCHREC_PYTHON")
    argv = ["--quick", "--json", str(path), "--workdir", str(tmp_path)]
    assert sweep.main(argv + (["--torch-python", peer] if peer else [])) == 0
    record = json.loads(path.read_text())
    assert [c["name"] for c in record["cells"]] == sorted(c.name for c in sweep.QUICK_CELLS)
    for c in record["cells"]:
        assert c["checked"] and c["forms_equal"] and c["agrees_with_float64"], c["name"]
        assert not c["errors"] and c["same_bytes"]
        assert set(c["jaxembed"]) == {"1", "2"} and c["jaxembed_best_in_ms"] > 0
        if peer:
            assert set(c["fbgemm"]) == {"default", "passive"}
            assert c["ratio_best"] > 0 and c["ratio_1_q25"] > 0
    if peer:
        assert set(record["summary"]) == set(sweep.RATIOS)
