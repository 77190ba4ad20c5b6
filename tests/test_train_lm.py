"""examples/train_lm.py: it trains, and a checkpoint moves between meshes exactly.

The script runs in subprocesses with tiny flags (it sets its own device count); the
checkpoint round trip runs in this process through the example's own functions.
"""

import importlib.util
import json
import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_lm.py"
TINY = ["--vocab", "61", "--hidden", "32", "--blocks", "1", "--batch", "8", "--seq", "16",
        "--steps", "6", "--save-every", "3", "--no-progress"]  # fmt: skip


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(*flags):
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), *TINY, *flags], capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow  # heavy; what it checks is covered by the quicker tests beside it
def test_resume_on_another_mesh_continues_the_same_numbers(tmp_path):
    """6 steps on (2, 4) == 3 steps on (2, 4), preempted, then 3 more on (4, 2)."""
    whole, first, second = (tmp_path / n for n in ("whole.json", "first.json", "second.json"))
    out = run_script("--ckpt-dir", str(tmp_path / "a"), "--metrics-out", str(whole))
    assert "the chain's own loss" in out and "entropy rate" in out
    run_script("--ckpt-dir", str(tmp_path / "b"), "--stop-after", "3", "--metrics-out", str(first))
    run_script("--ckpt-dir", str(tmp_path / "b"), "--resume", "--mesh", "data=4,model=2",
               "--metrics-out", str(second))  # fmt: skip
    whole, first, second = (json.loads(p.read_text()) for p in (whole, first, second))
    assert whole["mesh"] == {"data": 2, "model": 4} and second["mesh"] == {"data": 4, "model": 2}
    assert second["first_step"] == 4
    assert whole["table_shape"] == second["table_shape"] == [64, 32]  # 61 padded to 64
    assert second["table_spec"] == str(P("model", None))
    expected = [whole["losses"][str(s)] for s in range(1, 7)]
    resumed = [first["losses"][str(s)] for s in (1, 2, 3)] + [
        second["losses"][str(s)] for s in (4, 5, 6)
    ]
    np.testing.assert_array_equal(resumed[:3], expected[:3])  # same mesh, same program
    np.testing.assert_allclose(resumed[3:], expected[3:], rtol=1e-5)  # sums in another order
    assert expected[-1] < expected[0]


def build(example, mesh_spec, argv):
    args = example.parse_args([*TINY, *argv])
    mesh = example.make_mesh(mesh_spec)
    with jax.set_mesh(mesh), nn.logical_axis_rules(example.logical_rules(mesh)):
        model, optimizer = example.build(args, mesh)
    return args, mesh, model, optimizer


@pytest.mark.parametrize("target", ["data=4,model=2", "model=8"])
def test_checkpoint_restores_bitwise_on_another_mesh(example, tmp_path, target):
    args, mesh, model, optimizer = build(example, "data=2,model=4", [])
    corpus = example.MarkovCorpus(args.vocab, args.branching, args.seed)
    with jax.set_mesh(mesh), nn.logical_axis_rules(example.logical_rules(mesh)):
        for step in (1, 2):  # a non-trivial optimizer state
            tokens = example.shard_batch(corpus.batch(step, args.batch, args.seq), mesh)
            example.train_step(model, optimizer, tokens[:, :-1], tokens[:, 1:])
    manager = example.checkpoint_manager(str(tmp_path / "ckpt"))
    example.save(manager, 2, model, optimizer)
    manager.wait_until_finished()
    saved = example.checkpoint_state(model, optimizer)

    _, new_mesh, new_model, new_optimizer = build(example, target, [])
    with jax.set_mesh(new_mesh), nn.logical_axis_rules(example.logical_rules(new_mesh)):
        example.restore(manager, 2, new_model, new_optimizer)
    restored = example.checkpoint_state(new_model, new_optimizer)
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), saved, restored
    )
    assert int(new_optimizer.step[...]) == 2
    table = new_model.embed.embedding
    assert table.sharding.mesh.shape == new_mesh.shape
    assert table.sharding.spec == P("model", None)
    mu = new_optimizer.opt_state[0].mu["embed"]["embedding"]
    assert mu.sharding.spec == P("model", None) and mu.sharding.mesh.shape == new_mesh.shape
    assert not np.asarray(table[...])[61:].any()  # padding rows stayed zero under AdamW


def test_corpus_entropy_rate_is_the_chain_loss(example):
    corpus = example.MarkovCorpus(vocab=61, branching=4, seed=1)
    tokens = corpus.batch(0, batch=64, seq=512)
    assert tokens.min() >= 0 and tokens.max() < 61
    assert abs(corpus.oracle_loss(tokens) - corpus.entropy_rate) < 0.05
    np.testing.assert_array_equal(tokens, corpus.batch(0, batch=64, seq=512))


def test_mesh_flag_errors(example):
    with pytest.raises(SystemExit, match=r"--mesh 'data=2,model=8' needs 16 devices but jax has 8"):
        example.make_mesh("data=2,model=8")
    with pytest.raises(SystemExit, match=r"axes must be 'data' and/or 'model'"):
        example.make_mesh("seq=8")
