"""The einsum-notation propagation engine under the embedding rules."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jaxembed.rules import (
    DistSpec,
    ShardingConflictError,
    SpmdInfo,
    dims_mapping_for,
    einsum_rule,
    ids_letters,
    merge_letters,
    partial_dims_for,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# merge_letters
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "operands, merged",
    [
        pytest.param([("x", "ab", (0, -1))], {"a": 0, "b": -1}, id="one-tensor"),
        pytest.param([("x", "ab", (0, 1)), ("y", "ab", (0, 1))], {"a": 0, "b": 1}, id="equal-keep"),
        pytest.param(
            [("x", "ab", (-1, 1)), ("y", "ab", (0, -1))],
            {"a": 0, "b": 1},
            id="replicated-takes-the-split",
        ),
        pytest.param(
            [("x", "ab", (0, -1)), ("y", "bc", (1, -1))],
            {"a": 0, "b": 1, "c": -1},
            id="shared-letter",
        ),
        pytest.param([("x", "a", ((0, 1),)), ("y", "a", (-1,))], {"a": (0, 1)}, id="tuple-entry"),
        pytest.param(
            [("x", "a", ([0, 1],)), ("y", "a", ((0, 1),))], {"a": (0, 1)}, id="tuple-equal-list"
        ),
        pytest.param([("x", "a", ((1,),)), ("y", "a", (1,))], {"a": 1}, id="one-element-tuple"),
        pytest.param([("x", "", ())], {}, id="scalar"),
        pytest.param([], {}, id="nothing"),
    ],
)
def test_merge_letters(operands, merged):
    assert merge_letters(operands) == merged


def test_merge_letters_returns_every_letter_in_walk_order():
    merged = merge_letters([("x", "ca", (-1, -1)), ("y", "bz", (-1, 2))])
    assert list(merged) == ["c", "a", "b", "z"]


def test_merge_letter_split_two_ways_names_the_tensor_axes():
    pattern = (
        r"Tensor axis \[b\] is sharded by two different mesh dimensions \[1\] and \[0\] "
        r"\(x axis 1, y axis 0\)"
    )
    with pytest.raises(ShardingConflictError, match=pattern):
        merge_letters([("x", "ab", (-1, 1)), ("y", "bc", (0, -1))])


def test_merge_letter_split_by_a_tuple_and_an_int():
    with pytest.raises(ShardingConflictError, match=r"Tensor axis \[a\].*\[0,1\] and \[0\]"):
        merge_letters([("ids", "a", ((0, 1),)), ("out", "ak", (0, -1))])


def test_merge_mesh_axis_on_two_letters_names_the_tensor_axes():
    pattern = (
        r"Multiple tensor axes \[a,k\] are sharded by the same mesh dimension \[0\] "
        r"\(a: x axis 0; k: weight axis 1\)"
    )
    with pytest.raises(ShardingConflictError, match=pattern):
        merge_letters([("x", "ab", (0, -1)), ("weight", "jk", (-1, 0))])


def test_merge_mesh_axis_inside_a_tuple_on_two_letters():
    with pytest.raises(ShardingConflictError, match=r"\[a,b\].*mesh dimension \[1\]"):
        merge_letters([("x", "ab", ((0, 1), 1))])


def test_merge_conflict_names_every_letter_on_the_mesh_axis():
    with pytest.raises(ShardingConflictError, match=r"\[a,b,c\].*mesh dimension \[2\]"):
        merge_letters([("x", "abc", (2, -1, -1)), ("y", "bc", (2, 2))])


def test_merge_letters_rejects_mismatched_lengths():
    with pytest.raises(
        ValueError,
        match=r"weight: 2 axis letters 'jk' for a dims mapping of "
        r"length 1 \(0,\)",
    ) as excinfo:
        merge_letters([("weight", "jk", (0,))])
    assert not isinstance(excinfo.value, ShardingConflictError)


def test_sharding_conflict_error_is_a_value_error():
    assert issubclass(ShardingConflictError, ValueError)


# ---------------------------------------------------------------------------------------------
# dims_mapping_for, partial_dims_for, ids_letters, DistSpec
# ---------------------------------------------------------------------------------------------


def test_dims_mapping_for():
    merged = {"a": 0, "b": -1, "j": (1, 2)}
    assert dims_mapping_for("abj", merged) == (0, -1, (1, 2))
    assert dims_mapping_for("jba", merged) == ((1, 2), -1, 0)
    assert dims_mapping_for("ak", merged) == (0, -1)  # unseen letters are replicated
    assert dims_mapping_for("", merged) == ()


def test_partial_dims_for():
    merged = {"a": 0, "b": -1, "j": (1, 2)}
    assert partial_dims_for("j", merged) == frozenset({1, 2})
    assert partial_dims_for(["a", "j"], merged) == frozenset({0, 1, 2})
    assert partial_dims_for("b", merged) == frozenset()
    assert partial_dims_for("z", merged) == frozenset()
    assert partial_dims_for("", merged) == frozenset()


def test_ids_letters_skip_vocab_and_hidden():
    assert ids_letters(0) == ""
    assert ids_letters(3) == "abc"
    assert ids_letters(12) == "abcdefghilmn"
    assert "j" not in ids_letters(24) and "k" not in ids_letters(24)
    assert len(set(ids_letters(24))) == 24
    with pytest.raises(ValueError, match=r"ids of rank 25 are not supported \(0 to 24\)"):
        ids_letters(25)
    with pytest.raises(ValueError, match=r"ids of rank -1 are not supported"):
        ids_letters(-1)


def test_dist_spec_is_plain_data():
    spec = DistSpec([4, 5], [0, [1]], {1})
    assert spec == DistSpec((4, 5), (0, 1), frozenset({1}))
    assert hash(spec) == hash(DistSpec((4, 5), (0, 1), frozenset({1})))
    assert spec.shape == (4, 5) and spec.dims_mapping == (0, 1)
    assert spec.partial_dims == frozenset({1}) and spec.ndim == 2
    assert DistSpec((4, 5), ((0, 2), -1)).mesh_axes() == frozenset({0, 2})
    assert DistSpec((4, 5), (-1, -1)).partial_dims == frozenset()
    with pytest.raises(ValueError, match=r"partial dims are mesh axis indices >= 0, got \[-1\]"):
        DistSpec((4,), (-1,), {-1})
    assert DistSpec((4,), (0,)) != DistSpec((4,), (0,), {1})


# ---------------------------------------------------------------------------------------------
# einsum_rule
# ---------------------------------------------------------------------------------------------


def test_tied_output_projection():
    hidden = DistSpec((8, 16, 64), (0, -1, -1))
    table = DistSpec((1024, 64), (1, -1))
    info = einsum_rule("abk,jk->abj", hidden, table)
    assert isinstance(info, SpmdInfo)
    assert info.inputs == (hidden, table)
    assert info.outputs == (DistSpec((8, 16, 1024), (0, -1, 1)),)


def test_tied_output_projection_with_split_hidden_is_partial():
    hidden = DistSpec((8, 16, 64), (0, -1, -1))
    table = DistSpec((1024, 64), (-1, 1))
    info = einsum_rule("abk,jk->abj", hidden, table)
    assert info.inputs == (DistSpec((8, 16, 64), (0, -1, 1)), table)
    assert info.outputs == (DistSpec((8, 16, 1024), (0, -1, -1), frozenset({1})),)


def test_pooled_lookup():
    # onehot(ids) [batch, bag, vocab] . table [vocab, hidden] -> [batch, hidden]: the bag and
    # the vocab are summed away.
    onehot = DistSpec((8, 5, 1024), (0, 2, -1))
    table = DistSpec((1024, 64), (1, -1))
    info = einsum_rule("abj,jk->ak", onehot, table)
    assert info.inputs == (DistSpec((8, 5, 1024), (0, 2, 1)), table)
    assert info.outputs == (DistSpec((8, 64), (0, -1), frozenset({1, 2})),)


def test_matmul():
    lhs = DistSpec((32, 64), (0, 1))
    rhs = DistSpec((64, 16), (-1, -1))
    info = einsum_rule("ij,jk->ik", lhs, rhs)
    assert info.inputs == (lhs, DistSpec((64, 16), (1, -1)))
    assert info.outputs == (DistSpec((32, 16), (0, -1), frozenset({1})),)


def test_matmul_with_a_tuple_contracted_axis_and_spaces():
    lhs = DistSpec((32, 64), (-1, (0, 1)))
    rhs = DistSpec((64, 16), (-1, 2))
    info = einsum_rule("ij, jk -> ik", lhs, rhs)
    assert info.outputs == (DistSpec((32, 16), (-1, 2), frozenset({0, 1})),)


def test_einsum_rule_passes_input_partials_through():
    lhs = DistSpec((32, 64), (0, -1), {2})
    rhs = DistSpec((64, 16), (1, -1))
    info = einsum_rule("ij,jk->ik", lhs, rhs)
    assert info.inputs[0].partial_dims == frozenset({2})
    assert info.outputs[0].partial_dims == frozenset({1, 2})


def test_einsum_rule_three_operands_and_labels():
    a, b, c = DistSpec((4, 5), (0, -1)), DistSpec((5, 6), (-1, -1)), DistSpec((6, 7), (-1, 1))
    info = einsum_rule("ij,jk,kl->il", a, b, c)
    assert info.outputs == (DistSpec((4, 7), (0, 1)),)
    assert info.inputs[2] == c
    pattern = r"\[i,l\].*\[0\].*i: lhs axis 0; l: rhs axis 1"
    with pytest.raises(ShardingConflictError, match=pattern):
        einsum_rule("ij,jl->il", a, DistSpec((5, 7), (-1, 0)), names=("lhs", "rhs"))


def test_einsum_rule_conflict():
    with pytest.raises(
        ShardingConflictError,
        match=r"Tensor axis \[j\].*\[1\] and \[0\].*"
        r"in0 axis 1, in1 axis 0",
    ):
        einsum_rule("ij,jk->ik", DistSpec((4, 5), (-1, 1)), DistSpec((5, 6), (0, -1)))


@pytest.mark.parametrize(
    "equation, operands, pattern",
    [
        pytest.param(
            "ij,jk",
            [((4, 5), (-1, -1)), ((5, 6), (-1, -1))],
            r"needs an explicit output.*'ij,jk' for 2 operand\(s\)",
            id="no-arrow",
        ),
        pytest.param(
            "ij,jk->ik",
            [((4, 5), (-1, -1))],
            r"one letter group per operand.*for 1 operand\(s\)",
            id="too-few-operands",
        ),
        pytest.param(
            "ijk,jk->ik",
            [((4, 5), (-1, -1)), ((5, 6), (-1, -1))],
            r"in0 has rank 2 but 3 letters 'ijk'",
            id="letters-vs-rank",
        ),
        pytest.param(
            "ij,jk->ik",
            [((4, 5), (-1,)), ((5, 6), (-1, -1))],
            r"in0's rank \[2\] and in0's dims_mapping size \[1\]",
            id="mapping-vs-rank",
        ),
    ],
)
def test_einsum_rule_errors(equation, operands, pattern):
    with pytest.raises(ValueError, match=pattern) as excinfo:
        einsum_rule(equation, *[DistSpec(*o) for o in operands])
    assert not isinstance(excinfo.value, ShardingConflictError)


# ---------------------------------------------------------------------------------------------
# Importable without jax
# ---------------------------------------------------------------------------------------------


def test_rules_import_without_jax():
    script = textwrap.dedent(
        """
        import sys
        sys.modules["jax"] = None  # any `import jax` now raises ImportError
        import jaxembed.rules
        from jaxembed.rules import DistSpec, embedding_forward, embedding_grad, embedding_reverse

        x, w = DistSpec((4, 1024), (1, -1)), DistSpec((512, 768), (0, -1))
        out = embedding_forward(x, w).outputs[0]
        assert out == DistSpec((4, 1024, 768), (1, -1, -1), {0}), out
        assert embedding_reverse(x, w, out).inputs[0] == x
        og = DistSpec((4, 1024, 768), (-1, -1, -1))
        assert embedding_grad(x, w, og).outputs[0].partial_dims == {1}
        assert sys.modules["jax"] is None
        assert not any(m.startswith(("jax.", "jaxlib")) for m in sys.modules), sorted(
            m for m in sys.modules if m.startswith(("jax.", "jaxlib"))
        )
        print("ok")
        """
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
    }
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
