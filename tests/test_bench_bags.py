"""`jaxembed bench bags --quick`: pooled lookups against XLA's take + sum.

The record's structure, every implementation against the float64 reference, and the byte
targets that the compiled HLO makes deterministic. Timings are recorded, never asserted.
"""

import pytest
from bench_runs import check_ok, quick_run

import benchmarks
from benchmarks.bags import bench as bags


# The tests of the `--quick` run (~16 s) are marked slow (`pytest -m slow`); the bags'
# construction runs by default.
@pytest.fixture(scope="module")
def bags_run(tmp_path_factory):
    return quick_run(tmp_path_factory, "bags", benchmarks.main)


@pytest.mark.slow
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
            check_ok(result, (p["name"], name))


@pytest.mark.slow
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
