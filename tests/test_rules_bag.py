"""The embedding_bag sharding rules (jaxembed.rules.bag), as tables of cases.

Meshes are `[2, 4]` (mesh axis 0 has 2 devices, axis 1 has 4); the rules only see mesh axis
indices. Dense form: x `[32, 8]` (32 bags of 8 slots, letters `a` batch, `b` bag axis), table
`[1000, 64]` (`jk`), out `[32, 64]`. Flat form: x `[2, 4096]` (`a` lead, `b` slots), lengths
`[2, 512]` (`a` lead, `c` bags), out `[2, 512, 64]`. ERR rows raise ShardingConflictError
naming the letters and the mesh axis. Every dense case is also checked against the engine's
`einsum_rule` on the equivalent einsum `'abj,jk->ak'` of onehot(x) and the table.
"""

import pytest

from jaxembed.rules import DistSpec, ShardingConflictError, SpmdInfo, einsum_rule
from jaxembed.rules.bag import embedding_bag_forward, embedding_bag_grad

X, W, OUT = (32, 8), (1000, 64), (32, 64)  # dense form
FX, FL, FOUT = (2, 4096), (2, 512), (2, 512, 64)  # flat form


def _fmt(dm):
    return "[" + ",".join(str(e) for e in dm) + "]"


def _id(**mappings):
    return "-".join(f"{k}{_fmt(v)}" for k, v in mappings.items())


def _letters_on_axis(letters, mesh_axis):
    """A regex for 'Multiple tensor axes [p,q] ... mesh dimension [m]', letters in any order."""
    a, b = letters
    return rf"Multiple tensor axes \[({a},{b}|{b},{a})\] are sharded by the same mesh dimension \[{mesh_axis}\]"


def _letter_on_two_axes(letter, m1, m2):
    return rf"Tensor axis \[{letter}\] is sharded by two different mesh dimensions \[({m1}\] and \[{m2}|{m2}\] and \[{m1})\]"


# --- dense forward ---------------------------------------------------------------------------

# (x_dm, w_dm, expected x, expected w, expected out, expected partial)
DENSE_FORWARD = [
    ((-1, -1), (-1, -1), (-1, -1), (-1, -1), (-1, -1), set()),
    ((0, -1), (-1, -1), (0, -1), (-1, -1), (0, -1), set()),
    ((0, -1), (1, -1), (0, -1), (1, -1), (0, -1), {1}),  # rows split: partial over them
    ((0, -1), (-1, 1), (0, -1), (-1, 1), (0, 1), set()),  # hidden split follows the table
    ((-1, 1), (-1, -1), (-1, 1), (-1, -1), (-1, -1), {1}),  # the bag axis split: pooled away
    ((0, 1), (-1, -1), (0, 1), (-1, -1), (0, -1), {1}),
    ((-1, 1), (0, -1), (-1, 1), (0, -1), (-1, -1), {0, 1}),  # slots and rows both split
    ((-1, -1), ((0, 1), -1), (-1, -1), ((0, 1), -1), (-1, -1), {0, 1}),  # rows on all 8
    ((1, -1), (-1, 0), (1, -1), (-1, 0), (1, 0), set()),
]

DENSE_FORWARD_ERR = [
    ((1, -1), (1, -1), _letters_on_axis("aj", 1)),  # bags and rows on one mesh axis
    ((-1, 0), (0, -1), _letters_on_axis("bj", 0)),  # slots and rows on one mesh axis
    ((0, -1), (-1, 0), _letters_on_axis("ak", 0)),  # bags and hidden on one mesh axis
    ((0, 0), (-1, -1), _letters_on_axis("ab", 0)),
    ((0, 1), (1, 0), _letters_on_axis("ak", 0) + "|" + _letters_on_axis("bj", 1)),
]


@pytest.mark.parametrize(
    "x_dm, w_dm, exp_x, exp_w, exp_out, exp_partial",
    [pytest.param(*row, id=_id(x=row[0], w=row[1])) for row in DENSE_FORWARD],
)
def test_dense_forward(x_dm, w_dm, exp_x, exp_w, exp_out, exp_partial):
    info = embedding_bag_forward(DistSpec(X, x_dm), DistSpec(W, w_dm))
    assert isinstance(info, SpmdInfo)
    assert info.inputs == (DistSpec(X, exp_x), DistSpec(W, exp_w))
    assert info.outputs == (DistSpec(OUT, exp_out, frozenset(exp_partial)),)
    # The engine's rule of the same einsum: out[a, k] = Σ_b Σ_j onehot(x)[a, b, j] w[j, k].
    onehot = DistSpec((*X, W[0]), (*x_dm, w_dm[0]))
    assert einsum_rule("abj,jk->ak", onehot, DistSpec(W, w_dm)).outputs == info.outputs


@pytest.mark.parametrize(
    "x_dm, w_dm, pattern",
    [pytest.param(x, w, pat, id=_id(x=x, w=w) + "-err") for x, w, pat in DENSE_FORWARD_ERR],
)
def test_dense_forward_conflict(x_dm, w_dm, pattern):
    with pytest.raises(ShardingConflictError, match=pattern):
        embedding_bag_forward(DistSpec(X, x_dm), DistSpec(W, w_dm))


def test_dense_forward_other_ranks_and_partial_tables():
    x3 = DistSpec((4, 16, 8), (0, -1, -1))  # [batch, seq, bag]
    out = embedding_bag_forward(x3, DistSpec(W, (1, -1))).outputs[0]
    assert out == DistSpec((4, 16, 64), (0, -1, -1), frozenset({1}))
    one_bag = embedding_bag_forward(DistSpec((8,), (-1,)), DistSpec(W, (0, 1))).outputs[0]
    assert one_bag == DistSpec((64,), (1,), frozenset({0}))
    partial_table = DistSpec(W, (-1, -1), frozenset({1}))
    info = embedding_bag_forward(DistSpec(X, (0, -1)), partial_table)
    assert info.inputs[1] == partial_table and info.outputs[0].partial_dims == {1}
    as_tuples = embedding_bag_forward((X, (0, -1)), (W, (1, -1)))  # (shape, dims_mapping)
    assert as_tuples == embedding_bag_forward(DistSpec(X, (0, -1)), DistSpec(W, (1, -1)))


# --- flat forward ----------------------------------------------------------------------------

# (x_dm, lengths_dm, w_dm, expected x, expected lengths, expected out, expected partial)
FLAT_FORWARD = [
    ((-1, -1), (-1, -1), (-1, -1), (-1, -1), (-1, -1), (-1, -1, -1), set()),
    ((0, -1), (-1, -1), (1, -1), (0, -1), (0, -1), (0, -1, -1), {1}),  # lead per data shard
    ((-1, -1), (0, -1), (-1, -1), (0, -1), (0, -1), (0, -1, -1), set()),  # lengths lead wins
    ((-1, 1), (-1, -1), (-1, -1), (-1, 1), (-1, -1), (-1, -1, -1), {1}),  # slots split
    ((-1, -1), (-1, 1), (-1, 0), (-1, -1), (-1, 1), (-1, 1, 0), set()),  # bags split
    ((0, 1), (0, -1), (-1, -1), (0, 1), (0, -1), (0, -1, -1), {1}),
    ((-1, 1), (0, -1), (-1, -1), (0, 1), (0, -1), (0, -1, -1), {1}),
]

FLAT_FORWARD_ERR = [
    ((-1, 1), (-1, 1), (-1, -1), _letters_on_axis("bc", 1)),  # slots and bags on one axis
    ((0, -1), (1, -1), (-1, -1), _letter_on_two_axes("a", 0, 1)),  # x's and lengths' lead
    ((0, -1), (-1, -1), (0, -1), _letters_on_axis("aj", 0)),  # lead and rows
    ((-1, -1), (-1, 1), (1, -1), _letters_on_axis("cj", 1)),  # bags and rows
    ((-1, 0), (-1, -1), (-1, 0), _letters_on_axis("bk", 0)),  # slots and hidden
]


@pytest.mark.parametrize(
    "x_dm, l_dm, w_dm, exp_x, exp_l, exp_out, exp_partial",
    [pytest.param(*row, id=_id(x=row[0], lengths=row[1], w=row[2])) for row in FLAT_FORWARD],
)
def test_flat_forward(x_dm, l_dm, w_dm, exp_x, exp_l, exp_out, exp_partial):
    info = embedding_bag_forward(DistSpec(FX, x_dm), DistSpec(W, w_dm), lengths=DistSpec(FL, l_dm))
    assert info.inputs == (DistSpec(FX, exp_x), DistSpec(W, w_dm), DistSpec(FL, exp_l))
    assert info.outputs == (DistSpec(FOUT, exp_out, frozenset(exp_partial)),)


@pytest.mark.parametrize(
    "x_dm, l_dm, w_dm, pattern",
    [
        pytest.param(x, ln, w, pat, id=_id(x=x, lengths=ln, w=w) + "-err")
        for x, ln, w, pat in FLAT_FORWARD_ERR
    ],
)
def test_flat_forward_conflict(x_dm, l_dm, w_dm, pattern):
    with pytest.raises(ShardingConflictError, match=pattern):
        embedding_bag_forward(DistSpec(FX, x_dm), DistSpec(W, w_dm), lengths=DistSpec(FL, l_dm))


def test_flat_forward_without_lead():
    info = embedding_bag_forward(
        DistSpec((4096,), (-1,)), DistSpec(W, (0, -1)), lengths=DistSpec((512,), (1,))
    )
    assert info.outputs == (DistSpec((512, 64), (1, -1), frozenset({0})),)
    with pytest.raises(ShardingConflictError, match=_letters_on_axis("aj", 0)):
        embedding_bag_forward(
            DistSpec((4096,), (0,)), DistSpec(W, (0, -1)), lengths=DistSpec((512,), (-1,))
        )


# --- grad ------------------------------------------------------------------------------------

# (x_dm, w_dm, og_dm, expected x, expected og, expected weight_grad, expected partial)
DENSE_GRAD = [
    ((0, -1), (1, -1), (-1, -1), (0, -1), (0, -1), (1, -1), {0}),
    ((-1, -1), (1, -1), (0, -1), (0, -1), (0, -1), (1, -1), {0}),  # out_grad's batch wins
    ((-1, 1), (-1, -1), (-1, -1), (-1, 1), (-1, -1), (-1, -1), {1}),  # the bag axis split
    ((0, -1), (-1, 1), (-1, 1), (0, -1), (0, 1), (-1, 1), {0}),
    ((-1, -1), (0, 1), (-1, 1), (-1, -1), (-1, 1), (0, 1), set()),  # born in the layout
    ((0, 1), (-1, -1), (-1, -1), (0, 1), (0, -1), (-1, -1), {0, 1}),
]

DENSE_GRAD_ERR = [
    ((1, -1), (1, -1), (-1, -1), _letters_on_axis("aj", 1)),
    ((0, -1), (-1, -1), (1, -1), _letter_on_two_axes("a", 0, 1)),
    ((0, -1), (-1, -1), (-1, 0), _letters_on_axis("ak", 0)),
    ((-1, 0), (0, -1), (-1, -1), _letters_on_axis("bj", 0)),
]


@pytest.mark.parametrize(
    "x_dm, w_dm, og_dm, exp_x, exp_og, exp_wg, exp_partial",
    [pytest.param(*row, id=_id(x=row[0], w=row[1], og=row[2])) for row in DENSE_GRAD],
)
def test_dense_grad(x_dm, w_dm, og_dm, exp_x, exp_og, exp_wg, exp_partial):
    info = embedding_bag_grad(DistSpec(X, x_dm), DistSpec(W, w_dm), DistSpec(OUT, og_dm))
    assert info.inputs == (DistSpec(X, exp_x), DistSpec(W, w_dm), DistSpec(OUT, exp_og))
    assert info.outputs == (DistSpec(W, exp_wg, frozenset(exp_partial)),)
    # The engine's rule of weight_grad[j, k] = Σ_a Σ_b onehot(x)[a, b, j] out_grad[a, k].
    onehot = DistSpec((*X, W[0]), (*x_dm, w_dm[0]))
    engine = einsum_rule("abj,ak->jk", onehot, DistSpec(OUT, og_dm)).outputs[0]
    assert engine == info.outputs[0]


@pytest.mark.parametrize(
    "x_dm, w_dm, og_dm, pattern",
    [pytest.param(*row, id=_id(x=row[0], w=row[1], og=row[2]) + "-err") for row in DENSE_GRAD_ERR],
)
def test_dense_grad_conflict(x_dm, w_dm, og_dm, pattern):
    with pytest.raises(ShardingConflictError, match=pattern):
        embedding_bag_grad(DistSpec(X, x_dm), DistSpec(W, w_dm), DistSpec(OUT, og_dm))


# (x_dm, lengths_dm, w_dm, og_dm, expected x, expected lengths, expected og, wg, partial)
FLAT_GRAD = [
    ((0, -1), (-1, -1), (1, -1), (-1, -1, -1), (0, -1), (0, -1), (0, -1, -1), (1, -1), {0}),
    ((-1, 1), (-1, -1), (-1, -1), (-1, -1, -1), (-1, 1), (-1, -1), (-1, -1, -1), (-1, -1), {1}),
    ((-1, -1), (-1, 1), (0, -1), (-1, 1, -1), (-1, -1), (-1, 1), (-1, 1, -1), (0, -1), {1}),
    ((-1, -1), (-1, -1), (0, 1), (-1, -1, 1), (-1, -1), (-1, -1), (-1, -1, 1), (0, 1), set()),
]

FLAT_GRAD_ERR = [
    ((-1, 1), (-1, -1), (-1, -1), (-1, 1, -1), _letters_on_axis("bc", 1)),
    ((0, -1), (-1, -1), (0, -1), (-1, -1, -1), _letters_on_axis("aj", 0)),
    ((0, -1), (-1, -1), (-1, -1), (1, -1, -1), _letter_on_two_axes("a", 0, 1)),
]


@pytest.mark.parametrize(
    "x_dm, l_dm, w_dm, og_dm, exp_x, exp_l, exp_og, exp_wg, exp_partial",
    [
        pytest.param(*row, id=_id(x=row[0], lengths=row[1], w=row[2], og=row[3]))
        for row in FLAT_GRAD
    ],
)
def test_flat_grad(x_dm, l_dm, w_dm, og_dm, exp_x, exp_l, exp_og, exp_wg, exp_partial):
    info = embedding_bag_grad(
        DistSpec(FX, x_dm), DistSpec(W, w_dm), DistSpec(FOUT, og_dm), lengths=DistSpec(FL, l_dm)
    )
    assert info.inputs == (
        DistSpec(FX, exp_x),
        DistSpec(W, w_dm),
        DistSpec(FOUT, exp_og),
        DistSpec(FL, exp_l),
    )
    assert info.outputs == (DistSpec(W, exp_wg, frozenset(exp_partial)),)


@pytest.mark.parametrize(
    "x_dm, l_dm, w_dm, og_dm, pattern",
    [
        pytest.param(*row, id=_id(x=row[0], lengths=row[1], w=row[2], og=row[3]) + "-err")
        for row in FLAT_GRAD_ERR
    ],
)
def test_flat_grad_conflict(x_dm, l_dm, w_dm, og_dm, pattern):
    with pytest.raises(ShardingConflictError, match=pattern):
        embedding_bag_grad(
            DistSpec(FX, x_dm), DistSpec(W, w_dm), DistSpec(FOUT, og_dm), lengths=DistSpec(FL, l_dm)
        )


def test_grad_partial_out_grad_passes_through():
    og = DistSpec(OUT, (-1, -1), frozenset({1}))
    wg = embedding_bag_grad(DistSpec(X, (0, -1)), DistSpec(W, (-1, -1)), og).outputs[0]
    assert wg == DistSpec(W, (-1, -1), frozenset({0, 1}))


# --- malformed inputs: ValueError, not a conflict --------------------------------------------


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: embedding_bag_forward(DistSpec(X, (0,)), DistSpec(W, (-1, -1))), r"x's rank \[2\] and x's dims_mapping size \[1\]"),
        (lambda: embedding_bag_forward(DistSpec(X, (0, -1)), DistSpec((4, 5, 6), (-1, -1, -1))), r"weight must be a 2-D table"),
        (lambda: embedding_bag_forward(DistSpec((), ()), DistSpec(W, (-1, -1))), r"bag ids have rank >= 1"),
        (lambda: embedding_bag_forward(DistSpec(FX, (0, -1)), DistSpec(W, (-1, -1)), lengths=DistSpec((3, 512), (-1, -1))), r"lengths \(3, 512\) must be \[\*lead, B\] with x's leading dims \(2,\)"),
        (lambda: embedding_bag_forward(DistSpec(FX, (0, -1)), DistSpec(W, (-1, -1)), lengths=DistSpec((512,), (-1,))), r"lengths \(512,\) must be \[\*lead, B\]"),
        (lambda: embedding_bag_forward(DistSpec(FX, (0, -1)), DistSpec(W, (-1, -1)), lengths=DistSpec(FL, (-1,))), r"lengths's rank \[2\]"),
        (lambda: embedding_bag_grad(DistSpec(X, (0, -1)), DistSpec(W, (-1, -1)), DistSpec((32, 8, 64), (-1, -1, -1))), r"out_grad \(32, 8, 64\) must be the output's shape \(32, 64\)"),
        (lambda: embedding_bag_grad(DistSpec(FX, (0, -1)), DistSpec(W, (-1, -1)), DistSpec(OUT, (-1, -1)), lengths=DistSpec(FL, (-1, -1))), r"out_grad \(32, 64\) must be the output's shape \(2, 512, 64\).*lengths \(2, 512\)"),
        (lambda: embedding_bag_grad(DistSpec(X, (0, -1)), DistSpec(W, (-1, -1)), DistSpec(OUT, (-1,))), r"out_grad's rank \[2\]"),
    ],
)  # fmt: skip
def test_malformed_inputs(call, match):
    with pytest.raises(ValueError, match=match) as excinfo:
        call()
    assert not isinstance(excinfo.value, ShardingConflictError)
