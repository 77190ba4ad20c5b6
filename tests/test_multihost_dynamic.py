"""A dynamic table trained over two processes x 4 CPU devices equals one device's run."""

import io
import re
import time
from pathlib import Path

import pytest

from jaxembed import launch

HERE = Path(__file__).parent / "multihost"


# ~90 s over two processes; tests/test_multihost.py runs a quicker multi-process check by
# default, and the dynamic tables' sharded steps are checked on 8 devices of one process by
# tests/test_dynamic_*.py.
@pytest.mark.slow
def test_dynamic_tables_over_two_processes_match_one_device():
    out, start = io.StringIO(), time.monotonic()
    code = launch.launch([str(HERE / "dynamic_tables.py")], processes=2, devices_per_process=4,
                         out=out, timeout_seconds=400)  # fmt: skip
    text = out.getvalue()
    assert code == 0, text[-3000:]
    found = set(re.findall(r"^\[p(\d)\] DYNAMIC OK (\S+) (\S+) process (\d)$", text, re.M))
    want = {
        (p, policy, layout, p)
        for p in "01"
        for policy in ("lru", "lfu", "ttl")
        for layout in ("rows-over-model", "rows-over-data-model", "rows-over-data-model-routed")
    }
    assert found == want, (time.monotonic() - start, text[-3000:])
