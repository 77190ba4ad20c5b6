"""Every row of `spec/embedding-rules.md` (normative), one parametrized case each.

Meshes are `[2, 4]` unless a row says otherwise; the rules only see mesh axis indices, so the
mesh appears in a case's id, not in its inputs. Ids name the rule and the inputs' mappings,
e.g. `fwd-x[1,-1]-w[0,-1]`.
"""

import pytest
from jax.sharding import PartitionSpec as P

from jaxembed.layout import to_dims_mapping, to_partial_dims, to_partition_spec
from jaxembed.rules import (
    DistSpec,
    ShardingConflictError,
    SpmdInfo,
    embedding_forward,
    embedding_grad,
    embedding_reverse,
)

NAMES = ("data", "model")

# Shapes of the forward and reverse tables: x [4, 1024], weight [512, 768].
X_SHAPE, W_SHAPE = (4, 1024), (512, 768)
OUT_SHAPE = (*X_SHAPE, W_SHAPE[1])

# Shapes of the grad tables: x [4, 5], weight [10, 3], out_grad [4, 5, 3].
GX_SHAPE, GW_SHAPE, GOG_SHAPE = (4, 5), (10, 3), (4, 5, 3)


def _fmt(dm):
    return "[" + ",".join(str(e) for e in dm) + "]"


def _id(rule, **mappings):
    return "-".join([rule] + [f"{k}{_fmt(v)}" for k, v in mappings.items()])


def _conflict_pattern(*alternatives):
    """A regex naming the letters (in either order) and the mesh axis of a shared mesh axis.

    Each alternative is `(letters, mesh_axis)`, e.g. `("ak", 0)`; any one may match.
    """
    pats = []
    for letters, mesh_axis in alternatives:
        a, b = letters
        pats.append(rf"\[({a},{b}|{b},{a})\].*\[{mesh_axis}\]")
    return "|".join(pats)


def _two_mesh_axes_pattern(letter, m1, m2):
    """A regex naming one letter split by two different mesh axes, in either order."""
    return rf"\[{letter}\].*(\[{m1}\].*\[{m2}\]|\[{m2}\].*\[{m1}\])"


def _check_conflict(excinfo):
    assert isinstance(excinfo.value, ValueError)
    assert issubclass(ShardingConflictError, ValueError)


# --------------------------------------------------------------------------------------------
# Forward, vocab_parallel=True (default)
# --------------------------------------------------------------------------------------------

# (x_dm, w_dm, options, expected x, expected w, expected out, expected partial, id suffix)
FORWARD_VP = [
    ((1, -1), (-1, -1), {}, (1, -1), (-1, -1), (1, -1, -1), set(), ""),
    ((1, -1), (-1, 0), {}, (1, -1), (-1, 0), (1, -1, 0), set(), ""),
    ((1, -1), (0, -1), {}, (1, -1), (0, -1), (1, -1, -1), {0}, ""),
    ((-1, -1), (1, 0), {}, (-1, -1), (1, 0), (-1, -1, 0), {1}, ""),
    ((0, 1), (-1, -1), {}, (0, 1), (-1, -1), (0, 1, -1), set(), ""),
    # Paddle raises for these two; jaxembed's kernels support them.
    (
        (1, -1),
        (0, -1),
        {"padding_idx": 128},
        (1, -1),
        (0, -1),
        (1, -1, -1),
        {0},
        "-padding_idx=128",
    ),
    ((1, -1), (0, -1), {"sparse": True}, (1, -1), (0, -1), (1, -1, -1), {0}, "-sparse"),
]

FORWARD_VP_ERR = [
    ((0, -1), (-1, 0), "mesh[4]", _conflict_pattern(("ak", 0))),
    ((-1, 0), (0, -1), "mesh[4]", _conflict_pattern(("bj", 0))),
    ((0, 1), (1, 0), "mesh[2,4]", _conflict_pattern(("ak", 0), ("bj", 1))),
    ((0, 0), (-1, -1), "mesh[2,4]", _conflict_pattern(("ab", 0))),
]


@pytest.mark.parametrize(
    "x_dm, w_dm, options, exp_x, exp_w, exp_out, exp_partial",
    [pytest.param(*row[:-1], id=_id("fwd", x=row[0], w=row[1]) + row[-1]) for row in FORWARD_VP],
)
def test_forward_vocab_parallel(x_dm, w_dm, options, exp_x, exp_w, exp_out, exp_partial):
    info = embedding_forward(DistSpec(X_SHAPE, x_dm), DistSpec(W_SHAPE, w_dm), **options)
    assert isinstance(info, SpmdInfo)
    assert info.inputs == (DistSpec(X_SHAPE, exp_x), DistSpec(W_SHAPE, exp_w))
    assert info.outputs == (DistSpec(OUT_SHAPE, exp_out, frozenset(exp_partial)),)
    assert isinstance(info.outputs[0].dims_mapping, tuple)
    assert isinstance(info.outputs[0].partial_dims, frozenset)


@pytest.mark.parametrize(
    "x_dm, w_dm, pattern",
    [
        pytest.param(x, w, pat, id=_id("fwd", x=x, w=w) + f"-{mesh}-err")
        for x, w, mesh, pat in FORWARD_VP_ERR
    ],
)
def test_forward_vocab_parallel_conflict(x_dm, w_dm, pattern):
    with pytest.raises(ShardingConflictError, match=pattern) as excinfo:
        embedding_forward(DistSpec(X_SHAPE, x_dm), DistSpec(W_SHAPE, w_dm))
    _check_conflict(excinfo)


# --------------------------------------------------------------------------------------------
# Forward, vocab_parallel=False (Paddle's kernel-facing variant)
# --------------------------------------------------------------------------------------------

FORWARD_PADDLE = [
    ((-1, 0), (0, -1), "mesh[4]", (-1, 0), (-1, -1), (-1, 0, -1)),
    ((1, -1), (0, -1), "mesh[2,4]", (1, -1), (-1, -1), (1, -1, -1)),
]

FORWARD_PADDLE_ERR = [
    ((0, -1), (-1, 0), "mesh[4]", _conflict_pattern(("ak", 0))),
]


@pytest.mark.parametrize(
    "x_dm, w_dm, exp_x, exp_w, exp_out",
    [
        pytest.param(x, w, ex, ew, eo, id=_id("fwd-paddle", x=x, w=w) + f"-{mesh}")
        for x, w, mesh, ex, ew, eo in FORWARD_PADDLE
    ],
)
def test_forward_paddle(x_dm, w_dm, exp_x, exp_w, exp_out):
    info = embedding_forward(DistSpec(X_SHAPE, x_dm), DistSpec(W_SHAPE, w_dm), vocab_parallel=False)
    assert info.inputs == (DistSpec(X_SHAPE, exp_x), DistSpec(W_SHAPE, exp_w))
    assert info.outputs == (DistSpec(OUT_SHAPE, exp_out),)
    assert info.outputs[0].partial_dims == frozenset()


@pytest.mark.parametrize(
    "x_dm, w_dm, pattern",
    [
        pytest.param(x, w, pat, id=_id("fwd-paddle", x=x, w=w) + f"-{mesh}-err")
        for x, w, mesh, pat in FORWARD_PADDLE_ERR
    ],
)
def test_forward_paddle_conflict(x_dm, w_dm, pattern):
    with pytest.raises(ShardingConflictError, match=pattern) as excinfo:
        embedding_forward(DistSpec(X_SHAPE, x_dm), DistSpec(W_SHAPE, w_dm), vocab_parallel=False)
    _check_conflict(excinfo)


@pytest.mark.parametrize("vocab_parallel", [True, False], ids=["vp", "paddle"])
@pytest.mark.parametrize(
    "options",
    [
        {"padding_idx": 128},
        {"padding_idx": 0},
        {"sparse": True},
        {"padding_idx": 7, "sparse": True},
    ],
    ids=["padding_idx=128", "padding_idx=0", "sparse", "padding_idx=7-sparse"],
)
@pytest.mark.parametrize(
    "x_dm, w_dm",
    [((1, -1), (0, -1)), ((-1, -1), (1, 0)), ((0, -1), (1, -1))],
    ids=["x[1,-1]-w[0,-1]", "x[-1,-1]-w[1,0]", "x[0,-1]-w[1,-1]"],
)
def test_forward_options_never_change_layouts(x_dm, w_dm, options, vocab_parallel):
    """Paddle raises for padding_idx / sparse with a row-split table; jaxembed supports it."""
    x, w = DistSpec(X_SHAPE, x_dm), DistSpec(W_SHAPE, w_dm)
    plain = embedding_forward(x, w, vocab_parallel=vocab_parallel)
    assert embedding_forward(x, w, vocab_parallel=vocab_parallel, **options) == plain


# --------------------------------------------------------------------------------------------
# Reverse
# --------------------------------------------------------------------------------------------

REVERSE = [
    ((1, -1, -1), set(), (1, -1), (-1, -1)),
    ((-1, 0, 1), set(), (-1, 0), (-1, 1)),
    ((1, 0, -1), set(), (1, 0), (-1, -1)),
    ((1, -1, -1), {0}, (1, -1), (-1, -1)),  # out's partial passes through unchanged
]

# x's and weight's given mappings are ignored by the reverse rule: each row runs with several.
GIVEN_INPUTS = [
    pytest.param((-1, -1), (-1, -1), id="given-replicated"),
    pytest.param((0, 1), (1, 0), id="given-conflicting"),
    pytest.param((1, 0), (0, 1), id="given-swapped"),
]


@pytest.mark.parametrize("given_x, given_w", GIVEN_INPUTS)
@pytest.mark.parametrize(
    "out_dm, out_partial, exp_x, exp_w",
    [
        pytest.param(*row, id=_id("rev", out=row[0]) + ("-P{0}" if row[1] else ""))
        for row in REVERSE
    ],
)
def test_reverse(out_dm, out_partial, exp_x, exp_w, given_x, given_w):
    out = DistSpec(OUT_SHAPE, out_dm, frozenset(out_partial))
    info = embedding_reverse(DistSpec(X_SHAPE, given_x), DistSpec(W_SHAPE, given_w), out)
    assert info.inputs == (DistSpec(X_SHAPE, exp_x), DistSpec(W_SHAPE, exp_w))
    assert info.outputs == (out,)
    assert info.outputs[0].partial_dims == frozenset(out_partial)


@pytest.mark.parametrize(
    "options", [{}, {"padding_idx": 3, "sparse": True}], ids=["rev-out[0,-1,0]-err", "options"]
)
def test_reverse_conflict(options):
    out = DistSpec(OUT_SHAPE, (0, -1, 0))
    with pytest.raises(ShardingConflictError, match=_conflict_pattern(("ak", 0))) as excinfo:
        embedding_reverse(DistSpec(X_SHAPE, (-1, -1)), DistSpec(W_SHAPE, (-1, -1)), out, **options)
    _check_conflict(excinfo)


# --------------------------------------------------------------------------------------------
# Grad: mesh [2, 3], x [4, 5], weight [10, 3], out_grad [4, 5, 3] unless noted.
# --------------------------------------------------------------------------------------------

# (shapes (x, w, og) or None, x_dm, w_dm, og_dm, exp x, exp w (paddle), exp og, exp wg, partial)
GRAD_COMMON = [
    (None, (1, -1), (-1, -1), (-1, -1, -1), (1, -1), (-1, -1), (1, -1, -1), (-1, -1), {1}),
    (None, (-1, -1), (-1, 1), (-1, 1, -1), (-1, 1), (-1, 1), (-1, 1, -1), (-1, -1), {1}),
    (((5,), (10, 3), (5, 3)), (0,), (-1, -1), (-1, 1), (0,), (-1, -1), (0, 1), (-1, 1), {0}),
    (
        ((12, 16), (10, 4), (12, 16, 4)),
        (-1, -1),
        (-1, 0),
        (-1, -1, 0),
        (-1, -1),
        (-1, 0),
        (-1, -1, 0),
        (-1, 0),
        set(),
    ),
]
# The row with a row-split table: Paddle replicates the rows, jaxembed keeps them split.
GRAD_ROW_SPLIT_PADDLE = (
    None,
    (1, -1),
    (0, -1),
    (-1, -1, -1),
    (1, -1),
    (-1, -1),
    (1, -1, -1),
    (-1, -1),
    {1},
)
GRAD_ROW_SPLIT_VP = (
    None,
    (1, -1),
    (0, -1),
    (-1, -1, -1),
    (1, -1),
    (0, -1),
    (1, -1, -1),
    (0, -1),
    {1},
)

GRAD_ERR_COMMON = [
    ((1, -1), (-1, -1), (0, -1, -1), _two_mesh_axes_pattern("a", 0, 1)),
    ((0, -1), (-1, -1), (-1, -1, 0), _conflict_pattern(("ak", 0))),
]
# vocab_parallel=True: a batch axis split over the mesh axis of the table's rows conflicts.
GRAD_ERR_VP = [
    ((0, -1), (0, -1), (-1, -1, -1), _conflict_pattern(("aj", 0))),
    ((-1, -1), (0, -1), (0, -1, -1), _conflict_pattern(("aj", 0))),
    ((-1, 1), (1, -1), (-1, -1, -1), _conflict_pattern(("bj", 1))),
]


def _grad_param(rule, row):
    shapes, x_dm, w_dm, og_dm = row[:4]
    suffix = "" if shapes is None else f"-shape{_fmt(shapes[0])}"
    return pytest.param(*row, id=_id(rule, x=x_dm, w=w_dm, og=og_dm) + suffix)


def _run_grad(shapes, x_dm, w_dm, og_dm, vocab_parallel, **options):
    xs, ws, ogs = shapes or (GX_SHAPE, GW_SHAPE, GOG_SHAPE)
    info = embedding_grad(
        DistSpec(xs, x_dm),
        DistSpec(ws, w_dm),
        DistSpec(ogs, og_dm),
        vocab_parallel=vocab_parallel,
        **options,
    )
    return info, (xs, ws, ogs)


def _check_grad(info, shapes, exp_x, exp_w, exp_og, exp_wg, exp_partial):
    xs, ws, ogs = shapes
    assert isinstance(info, SpmdInfo)
    assert info.inputs == (DistSpec(xs, exp_x), DistSpec(ws, exp_w), DistSpec(ogs, exp_og))
    assert info.outputs == (DistSpec(ws, exp_wg, frozenset(exp_partial)),)


@pytest.mark.parametrize(
    "shapes, x_dm, w_dm, og_dm, exp_x, exp_w, exp_og, exp_wg, exp_partial",
    [_grad_param("grad-paddle", row) for row in [*GRAD_COMMON, GRAD_ROW_SPLIT_PADDLE]],
)
def test_grad_paddle(shapes, x_dm, w_dm, og_dm, exp_x, exp_w, exp_og, exp_wg, exp_partial):
    info, shapes = _run_grad(shapes, x_dm, w_dm, og_dm, vocab_parallel=False)
    _check_grad(info, shapes, exp_x, exp_w, exp_og, exp_wg, exp_partial)


@pytest.mark.parametrize(
    "shapes, x_dm, w_dm, og_dm, exp_x, exp_w, exp_og, exp_wg, exp_partial",
    [_grad_param("grad-vp", row) for row in [*GRAD_COMMON, GRAD_ROW_SPLIT_VP]],
)
def test_grad_vocab_parallel(shapes, x_dm, w_dm, og_dm, exp_x, exp_w, exp_og, exp_wg, exp_partial):
    info, shapes = _run_grad(shapes, x_dm, w_dm, og_dm, vocab_parallel=True)
    _check_grad(info, shapes, exp_x, exp_w, exp_og, exp_wg, exp_partial)


def test_grad_vocab_parallel_is_the_default():
    x, w = DistSpec(GX_SHAPE, (1, -1)), DistSpec(GW_SHAPE, (0, -1))
    og = DistSpec(GOG_SHAPE, (-1, -1, -1))
    assert embedding_grad(x, w, og) == embedding_grad(x, w, og, vocab_parallel=True)
    assert embedding_grad(x, w, og) != embedding_grad(x, w, og, vocab_parallel=False)


@pytest.mark.parametrize(
    "x_dm, w_dm, og_dm, pattern",
    [
        pytest.param(x, w, og, pat, id=_id("grad-paddle", x=x, w=w, og=og) + "-err")
        for x, w, og, pat in GRAD_ERR_COMMON
    ],
)
def test_grad_paddle_conflict(x_dm, w_dm, og_dm, pattern):
    with pytest.raises(ShardingConflictError, match=pattern) as excinfo:
        _run_grad(None, x_dm, w_dm, og_dm, vocab_parallel=False)
    _check_conflict(excinfo)


@pytest.mark.parametrize(
    "x_dm, w_dm, og_dm, pattern",
    [
        pytest.param(x, w, og, pat, id=_id("grad-vp", x=x, w=w, og=og) + "-err")
        for x, w, og, pat in [*GRAD_ERR_COMMON, *GRAD_ERR_VP]
    ],
)
def test_grad_vocab_parallel_conflict(x_dm, w_dm, og_dm, pattern):
    with pytest.raises(ShardingConflictError, match=pattern) as excinfo:
        _run_grad(None, x_dm, w_dm, og_dm, vocab_parallel=True)
    _check_conflict(excinfo)


@pytest.mark.parametrize("vocab_parallel", [True, False], ids=["vp", "paddle"])
@pytest.mark.parametrize(
    "options",
    [{"padding_idx": 4}, {"sparse": True}, {"padding_idx": 0, "sparse": True}],
    ids=["padding_idx=4", "sparse", "padding_idx=0-sparse"],
)
@pytest.mark.parametrize(
    "row",
    [GRAD_ROW_SPLIT_VP, *GRAD_COMMON],
    ids=lambda row: _id("grad", x=row[1], w=row[2], og=row[3]),
)
def test_grad_options_never_change_layouts(row, options, vocab_parallel):
    """Paddle's grad rule raises for sparse (and padding_idx with split rows); jaxembed doesn't."""
    shapes, x_dm, w_dm, og_dm = row[:4]
    plain, _ = _run_grad(shapes, x_dm, w_dm, og_dm, vocab_parallel)
    flagged, _ = _run_grad(shapes, x_dm, w_dm, og_dm, vocab_parallel, **options)
    assert flagged == plain


# --------------------------------------------------------------------------------------------
# Layout bridge rows
# --------------------------------------------------------------------------------------------


def test_bridge_row_split_to_spec():
    spec = to_partition_spec((1, -1), NAMES)
    assert spec == P("model", None)
    assert spec.partitions == ("model", None)


def test_bridge_two_mesh_axes_to_spec():
    spec = to_partition_spec(((0, 1), -1), NAMES)
    assert spec == P(("data", "model"), None)
    assert spec.partitions == (("data", "model"), None)


def test_bridge_spec_to_dims_mapping():
    assert to_dims_mapping(P(None, "data"), NAMES, ndim=2) == (-1, 0)


@pytest.mark.parametrize(
    "dm, spec",
    [
        pytest.param((-1, -1), P(None, None, unreduced={"model"}), id="replicated"),
        pytest.param((0, -1), P("data", None, unreduced={"model"}), id="rows-on-data"),
        pytest.param((-1, 0, -1), P(None, "data", None, unreduced={"model"}), id="rank3"),
    ],
)
def test_bridge_partial_dims_both_ways(dm, spec):
    made = to_partition_spec(dm, NAMES, partial_dims={1})
    assert made == spec
    assert made.unreduced == frozenset({"model"})
    assert to_partial_dims(spec, NAMES) == frozenset({1})
    assert to_dims_mapping(spec, NAMES, ndim=len(dm)) == dm


def test_bridge_forward_output_to_spec():
    """The forward rule's partial output (row 3) is a valid spec with `unreduced`."""
    out = embedding_forward(DistSpec(X_SHAPE, (1, -1)), DistSpec(W_SHAPE, (0, -1))).outputs[0]
    spec = to_partition_spec(out.dims_mapping, NAMES, out.partial_dims)
    assert spec == P("model", None, None, unreduced={"data"})


# --------------------------------------------------------------------------------------------
# Rank checks, argument forms and option types
# --------------------------------------------------------------------------------------------

RANK_ERRORS = [
    pytest.param(
        lambda: embedding_forward(DistSpec(X_SHAPE, (1,)), DistSpec(W_SHAPE, (-1, -1))),
        r"x's rank \[2\] and x's dims_mapping size \[1\]",
        id="fwd-x-mapping-short",
    ),
    pytest.param(
        lambda: embedding_forward(DistSpec(X_SHAPE, (1, -1, -1)), DistSpec(W_SHAPE, (-1, -1))),
        r"x's rank \[2\] and x's dims_mapping size \[3\]",
        id="fwd-x-mapping-long",
    ),
    pytest.param(
        lambda: embedding_forward(DistSpec(X_SHAPE, (1, -1)), DistSpec(W_SHAPE, (0,))),
        r"weight's rank \[2\] and weight's dims_mapping size \[1\]",
        id="fwd-w-mapping",
    ),
    pytest.param(
        lambda: embedding_forward(DistSpec(X_SHAPE, (1, -1)), DistSpec((512,), (-1,))),
        r"weight must be a 2-D table .*\(512,\)",
        id="fwd-w-1d",
    ),
    pytest.param(
        lambda: embedding_forward(
            DistSpec(X_SHAPE, (1, -1)), DistSpec((512, 768, 2), (-1, -1, -1))
        ),
        r"weight must be a 2-D table .*\(512, 768, 2\)",
        id="fwd-w-3d",
    ),
    pytest.param(
        lambda: embedding_reverse(
            DistSpec(X_SHAPE, (-1, -1)), DistSpec(W_SHAPE, (-1, -1)), DistSpec(X_SHAPE, (1, -1))
        ),
        r"x's rank \[2\] must be out's rank \[2\] minus one",
        id="rev-out-rank",
    ),
    pytest.param(
        lambda: embedding_reverse(
            DistSpec((4,), (-1,)), DistSpec(W_SHAPE, (-1, -1)), DistSpec(OUT_SHAPE, (1, -1, -1))
        ),
        r"x's rank \[1\] must be out's rank \[3\] minus one",
        id="rev-x-rank",
    ),
    pytest.param(
        lambda: embedding_reverse(
            DistSpec(X_SHAPE, (-1, -1)), DistSpec(W_SHAPE, (-1, -1)), DistSpec(OUT_SHAPE, (1,))
        ),
        r"out's rank \[3\] and out's dims_mapping size \[1\]",
        id="rev-out-mapping",
    ),
    pytest.param(
        lambda: embedding_grad(
            DistSpec(GX_SHAPE, (1, -1)), DistSpec(GW_SHAPE, (-1, -1)), DistSpec(GOG_SHAPE, (-1,))
        ),
        r"out_grad's rank \[3\] and out_grad's dims_mapping size \[1\]",
        id="grad-og-mapping",
    ),
    pytest.param(
        lambda: embedding_grad(
            DistSpec(GX_SHAPE, (1,)), DistSpec(GW_SHAPE, (-1, -1)), DistSpec(GOG_SHAPE, (-1,) * 3)
        ),
        r"x's rank \[2\] and x's dims_mapping size \[1\]",
        id="grad-x-mapping",
    ),
    pytest.param(
        lambda: embedding_grad(
            DistSpec(GX_SHAPE, (1, -1)), DistSpec(GW_SHAPE, (-1,)), DistSpec(GOG_SHAPE, (-1,) * 3)
        ),
        r"weight's rank \[2\] and weight's dims_mapping size \[1\]",
        id="grad-w-mapping",
    ),
    pytest.param(
        lambda: embedding_grad(
            DistSpec(GX_SHAPE, (1, -1)), DistSpec((10,), (-1,)), DistSpec(GOG_SHAPE, (-1,) * 3)
        ),
        r"weight must be a 2-D table",
        id="grad-w-1d",
    ),
    pytest.param(
        lambda: embedding_grad(
            DistSpec(GX_SHAPE, (1, -1)), DistSpec(GW_SHAPE, (-1, -1)), DistSpec((4, 3), (-1, -1))
        ),
        r"out_grad's rank \[2\] must be x's rank \[2\] plus one",
        id="grad-og-rank-low",
    ),
    pytest.param(
        lambda: embedding_grad(
            DistSpec(GX_SHAPE, (1, -1)),
            DistSpec(GW_SHAPE, (-1, -1)),
            DistSpec((4, 5, 1, 3), (-1,) * 4),
        ),
        r"out_grad's rank \[4\] must be x's rank \[2\] plus one",
        id="grad-og-rank-high",
    ),
]


@pytest.mark.parametrize("call, pattern", RANK_ERRORS)
def test_rank_mismatch_raises_value_error(call, pattern):
    with pytest.raises(ValueError, match=pattern) as excinfo:
        call()
    assert not isinstance(excinfo.value, ShardingConflictError)


def test_rules_accept_tuples_for_dist_specs():
    as_specs = embedding_forward(DistSpec(X_SHAPE, (1, -1)), DistSpec(W_SHAPE, (0, -1)))
    assert embedding_forward((X_SHAPE, (1, -1)), [W_SHAPE, [0, -1]]) == as_specs
    assert embedding_forward((X_SHAPE, (1, -1), ()), (W_SHAPE, (0, -1), frozenset())) == as_specs

    out = DistSpec(OUT_SHAPE, (1, -1, -1), frozenset({0}))
    as_specs = embedding_reverse(DistSpec(X_SHAPE, (-1, -1)), DistSpec(W_SHAPE, (-1, -1)), out)
    as_tuples = embedding_reverse(
        (X_SHAPE, (-1, -1)), (W_SHAPE, (-1, -1)), (OUT_SHAPE, (1, -1, -1), {0})
    )
    assert as_tuples == as_specs
    assert as_tuples.outputs[0].partial_dims == frozenset({0})

    grad = embedding_grad(
        DistSpec(GX_SHAPE, (1, -1)), DistSpec(GW_SHAPE, (0, -1)), DistSpec(GOG_SHAPE, (-1,) * 3)
    )
    assert embedding_grad((GX_SHAPE, (1, -1)), (GW_SHAPE, (0, -1)), (GOG_SHAPE, (-1,) * 3)) == grad


@pytest.mark.parametrize(
    "call, pattern",
    [
        pytest.param(
            lambda: embedding_forward("x", (W_SHAPE, (-1, -1))),
            r"x must be a DistSpec",
            id="fwd-x-str",
        ),
        pytest.param(
            lambda: embedding_forward((X_SHAPE, (-1, -1)), (W_SHAPE,)),
            r"weight must be a DistSpec",
            id="fwd-w-1-tuple",
        ),
        pytest.param(
            lambda: embedding_reverse((X_SHAPE, (-1, -1)), (W_SHAPE, (-1, -1)), None),
            r"out must be a DistSpec",
            id="rev-out-none",
        ),
        pytest.param(
            lambda: embedding_grad((GX_SHAPE, (-1, -1)), (GW_SHAPE, (-1, -1)), 3),
            r"out_grad must be a DistSpec",
            id="grad-og-int",
        ),
    ],
)
def test_rules_reject_other_argument_types(call, pattern):
    with pytest.raises(TypeError, match=pattern):
        call()


@pytest.mark.parametrize(
    "options, pattern",
    [
        pytest.param({"padding_idx": "0"}, r"padding_idx must be an int.*'0'", id="padding-str"),
        pytest.param({"padding_idx": 1.0}, r"padding_idx must be an int.*1\.0", id="padding-float"),
        pytest.param({"padding_idx": True}, r"padding_idx must be an int.*True", id="padding-bool"),
        pytest.param({"padding_idx": None}, r"padding_idx must be an int.*None", id="padding-none"),
        pytest.param({"sparse": 1}, r"sparse must be a bool.*1", id="sparse-int"),
    ],
)
@pytest.mark.parametrize("rule", ["fwd", "rev", "grad"])
def test_bad_option_types_raise_type_error(rule, options, pattern):
    with pytest.raises(TypeError, match=pattern):
        if rule == "fwd":
            embedding_forward((X_SHAPE, (1, -1)), (W_SHAPE, (0, -1)), **options)
        elif rule == "rev":
            embedding_reverse(
                (X_SHAPE, (-1, -1)), (W_SHAPE, (-1, -1)), (OUT_SHAPE, (1, -1, -1)), **options
            )
        else:
            embedding_grad(
                (GX_SHAPE, (1, -1)), (GW_SHAPE, (0, -1)), (GOG_SHAPE, (-1,) * 3), **options
            )


def test_conflict_error_is_a_value_error():
    assert issubclass(ShardingConflictError, ValueError)
    with pytest.raises(ValueError, match=r"mesh dimension \[0\]"):
        embedding_forward((X_SHAPE, (0, 0)), (W_SHAPE, (-1, -1)))
