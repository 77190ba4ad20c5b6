"""examples/train_dynamic.py: the `--quick` run learns, its dynamic tables decide as
`jaxembed.dynamic.reference` does, and the hashing trick collides where the dynamic table
does not; the stream of examples/dynamic_data.py is what its docstring says.

One `--quick` run (3 days of 24 steps, the three variants, one device) in this process through
the example's `main`, shared by the tests of this module.
"""

import importlib.util
import json
import pathlib
import re
import sys

import numpy as np
import pytest

from jaxembed.dynamic import EMPTY_ID, DynamicTableConfig
from jaxembed.dynamic import reference as R

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
EXAMPLE = EXAMPLES / "train_dynamic.py"
sys.path.insert(0, str(EXAMPLES))
import dynamic_data  # noqa: E402  (beside the example)

TRACE_STEPS = 4


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_dynamic", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick(example, tmp_path_factory):
    """The `--quick` run: (returned metrics, the --metrics-out file's, the tmp folder)."""
    tmp = tmp_path_factory.mktemp("dynamic")
    metrics = example.main(["--quick", "--no-progress", "--trace-steps", str(TRACE_STEPS),
                            "--metrics-out", str(tmp / "m.json"),
                            "--plot", str(tmp / "auc.png")])  # fmt: skip
    return metrics, json.loads((tmp / "m.json").read_text()), tmp


def test_it_learns(quick):
    metrics, written, tmp = quick
    assert metrics["variants"] == ["dynamic", "hash", "unbounded"] and metrics["devices"] == 1
    days = metrics["days"]
    assert [d["day"] for d in days] == [1, 2, 3]
    for v in metrics["variants"]:
        aucs = [d["auc"][v] for d in days]
        assert all(0.6 < a < d["bayes_auc"] for a, d in zip(aucs, days, strict=True)), (v, aucs)
        assert aucs[-1] > aucs[0], (v, aucs)
        losses = metrics["train"][v]["loss"]
        assert losses[-1] < losses[0] < np.log(2), (v, losses)
    s = metrics["summary"]
    assert s["days_averaged"] == [2, 3]
    assert s["mean_auc"]["dynamic"] == pytest.approx(np.mean([d["auc"]["dynamic"]
                                                              for d in days[1:]]))  # fmt: skip
    # The file holds the metrics (less the trace); the plot is a PNG.
    assert "trace" in metrics and "trace" not in written
    assert written["days"] == json.loads(json.dumps(days))
    assert (tmp / "auc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_dynamic_tables_decide_as_the_reference(quick):
    """The first steps' rows and counts of every feature's dynamic table, replayed through
    the pure-Python policy from an empty table."""
    metrics, _, _ = quick
    trace = metrics["trace"]
    assert len(trace) == TRACE_STEPS
    cfg = DynamicTableConfig(**metrics["config"]["dynamic_table"])
    assert cfg.admit_after == 2 and cfg.policy == "lru"
    totals = {feature: np.zeros(6, int) for feature in trace[0]}
    for feature in trace[0]:
        state = R.init_state(cfg)
        for t, step in enumerate(trace):
            got = step[feature]
            ref = R.step(cfg, state, got["keys"], t)
            where = f"{feature} step {t}"
            np.testing.assert_array_equal(got["rows"], ref.rows, err_msg=where)
            assert got["stats"] == tuple(ref.stats), where
            state = ref.state
            totals[feature] += np.array(ref.stats)
    for feature in ("user", "item"):  # admission at work: ids pending, ids admitted, hits
        hits, admitted, _, _, pending, _ = totals[feature]
        assert hits > 0 and admitted > 0 and pending > 0, (feature, totals[feature])
    assert totals["tag"][5] > 0  # the tags' padding: the reserved id, read as no row


def test_the_hashing_trick_collides_and_the_dynamic_table_does_not(quick):
    metrics, _, _ = quick
    rows, train = metrics["rows"], metrics["train"]
    assert rows["dynamic"] == rows["hash"] == dict.fromkeys(rows["hash"], 1536)  # equal memory
    assert all(rows["unbounded"][f] >= rows["hash"][f] for f in ("user", "item"))
    for f in ("user", "item"):
        hashed = [t[f] for t in train["hash"]["tables"]]
        assert all(t["shared"] > 0 and t["ids_sharing_a_row"] > 0 for t in hashed), hashed
        assert all(t["distinct_ids"] > rows["hash"][f] for t in hashed), hashed  # over capacity
        dyn = [t[f] for t in train["dynamic"]["tables"]]
        assert all(t["shared"] == 0 for t in dyn), dyn
        assert sum(t["evicted"] for t in dyn) > 0 and dyn[-1]["live"] <= rows["dynamic"][f]
        assert all(t[f]["shared"] == 0 for t in train["unbounded"]["tables"])
    for d in metrics["days"]:  # every hashed id reads a row; not every dynamic one
        assert d["coverage"]["hash"] == 1.0
        assert d["coverage"]["dynamic"] < d["coverage"]["unbounded"] < 1.0


def test_the_stream_drifts_and_its_bayes_auc_is_known():
    s = dynamic_data.DriftingStream(seed=1)
    assert dynamic_data.PAD == EMPTY_ID
    ids0, ids1, ids2 = (s.day_ids("user", d) for d in range(3))
    assert len(np.unique(ids0)) == ids0.size and (ids0 < 2**62).all()
    assert abs((ids1 != ids0).mean() - 0.2) < 0.01  # 20% of the ranks get new ids a day
    kept = ids1 == ids0
    assert abs((ids2[kept] == ids1[kept]).mean() - 0.8) < 0.01
    assert (s.day_ids("context", 2) == s.day_ids("context", 0)).all()  # no drift
    assert s.distinct_ids("user", 2) == len(np.unique(np.concatenate([ids0, ids1, ids2])))
    # A day's draws take yesterday's id of a replaced rank about `fade` of the time.
    b = s.batch(1, 0, 20_000)
    users = b.ids["user"][:, 0]
    new, old = set(ids1[~kept].tolist()), set(ids0[~kept].tolist())
    n_new = sum(u in new for u in users.tolist())
    n_old = sum(u in old for u in users.tolist())
    assert abs(n_old / (n_new + n_old) - 0.3) < 0.03
    # Effects are a function of the id; bags are 1 to 3 tags, then padding.
    b2 = s.batch(1, 0, 20_000)
    np.testing.assert_array_equal(b.logits, b2.logits)
    bias, u = s.effects("user", users[:5])
    assert bias.shape == (5,) and u.shape == (5, 4)
    np.testing.assert_array_equal(s.effects("user", users[:5])[0], bias)
    lengths = (b.ids["tag"] != dynamic_data.PAD).sum(1)
    assert lengths.min() == 1 and lengths.max() == 3
    # The true logit beats perturbed ones, and the click rate follows it.
    y, z = b.labels, b.logits
    best = dynamic_data.auc(z, y)
    rng = np.random.default_rng(0)
    assert best > dynamic_data.auc(z + rng.normal(0, 0.5, z.shape), y)
    assert 0.75 < best < 0.85
    assert abs(y.mean() - (1 / (1 + np.exp(-z))).mean()) < 0.01


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--variants", "dynamic,cuckoo"], "each must be one of dynamic, hash, unbounded"),
        (["--capacity", "1000"], "must be a multiple of 32 .* use --capacity 1024 or 992"),
        (["--batch", "100", "--devices", "8"], "--batch 100 must be a positive multiple of --"),
    ],
)
def test_bad_flags(example, capsys, argv, message):
    with pytest.raises(SystemExit):
        example.parse_args(argv)
    assert re.search(message, capsys.readouterr().err), argv


def test_bad_streams():
    with pytest.raises(ValueError, match="a latent feature's bags hold one id"):
        dynamic_data.DriftingStream(features=(dynamic_data.FeatureSpec("u", 10, 0.1, max_ids=2,
                                                                       latent=True),))  # fmt: skip
    with pytest.raises(ValueError, match=r"zipf=1\.0 must be positive and not 1"):
        dynamic_data.DriftingStream(zipf=1.0)
