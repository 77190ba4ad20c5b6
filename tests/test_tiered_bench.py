"""`python -m benchmarks tiered --quick`: the tiered benchmark's record (structure and
exactness, never timings): both cache sizes run against the in-memory step and end bitwise
equal to it, and the larger-than-RAM part runs on a small file."""

import json

from benchmarks import SUBCOMMANDS
from benchmarks import tiered as bench


def test_quick_record(tmp_path):
    assert SUBCOMMANDS["tiered"] == "benchmarks.tiered"
    path, md = tmp_path / "t.json", tmp_path / "t.md"
    assert bench.main(["--quick", "--json", str(path), "--markdown", str(md)]) == 0
    record = json.loads(path.read_text())
    fits = record["fits"]
    assert [c["cache_fraction"] for c in fits] == [0.05, 0.2]
    for c in fits:
        assert c["equal_bitwise"], c["name"]
        assert 0 < c["hit_rate"] < 1 and c["store_bytes_per_step"] > 0
        assert len(c["tiered"]["time_samples_in_ms"]) == bench.QUICK.steps // bench.QUICK.block
        assert c["prefetch"] and 0 < c["prefetched_fraction"] <= 1 and c["cpu_ratio_to_memory"] > 0
        assert c["ratio_to_memory"] > 0
    assert fits[1]["hit_rate"] >= fits[0]["hit_rate"]
    large = record["large"]
    assert large["steps"] == bench.QUICK.large_steps and large["steps_per_s"] > 0
    assert large["disk_random_read"]["reads"] == bench.QUICK.read_samples
    assert large["disk_random_read"]["bytes_per_s"] > 0
    assert "larger than RAM" in md.read_text()


def test_zipf_bags():
    import numpy as np

    ids = bench.zipf_bags(np.random.default_rng(0), 500, 1000, 20, 1.1)
    assert ids.shape == (500, 20) and ids.max() < 1000
    lengths = (ids >= 0).sum(1)
    assert lengths.min() >= 1 and lengths.max() <= 20
    assert ((ids >= 0) == (np.arange(20) < lengths[:, None])).all()  # padding at the end
