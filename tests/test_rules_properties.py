"""Property tests of the rules over random meshes (1-D to 3-D) and random dims mappings.

Only the number of mesh axes matters to the rules. Every expectation is computed here,
independently of `jaxembed.rules.engine`: a small reference merge that follows DESIGN.md.
"""

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxembed.rules import (
    DistSpec,
    ShardingConflictError,
    einsum_rule,
    embedding_forward,
    embedding_grad,
    embedding_reverse,
)

SETTINGS = settings(max_examples=200, deadline=None)
IDS_LETTERS = "abc"  # ids of rank <= 3; j is the vocab, k the hidden letter

MULTI_AXIS = re.compile(
    r"Multiple tensor axes \[([a-z,]+)\] are sharded by the same mesh dimension \[(\d+)\]"
)
TWO_MESH_AXES = re.compile(
    r"Tensor axis \[([a-z])\] is sharded by two different mesh dimensions \[([\d,]+)\] and "
    r"\[([\d,]+)\]"
)


# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------


@st.composite
def entries(draw, n_mesh):
    """-1 (often), one mesh axis (often), or a tuple of two different mesh axes (sometimes)."""
    kind = draw(st.integers(0, 9))
    if kind < 4:
        return -1
    if kind < 9 or n_mesh < 2:
        return draw(st.integers(0, n_mesh - 1))
    return tuple(draw(st.permutations(range(n_mesh)))[:2])


def mappings(n_mesh, ndim):
    return st.tuples(*[entries(n_mesh) for _ in range(ndim)])


@st.composite
def disjoint_entries(draw, n_mesh, n_slots):
    """`n_slots` entries that never share a mesh axis: the layouts that merge without conflict.

    Independent random mappings collide often; these make sure the valid cases get explored.
    """
    slots = [[] for _ in range(n_slots)]
    for mesh_axis in draw(st.permutations(range(n_mesh))):
        slot = draw(st.integers(-1, n_slots - 1))  # -1: the mesh axis stays unused
        if slot >= 0:
            slots[slot].append(mesh_axis)
    return tuple(-1 if not s else s[0] if len(s) == 1 else tuple(s) for s in slots)


@st.composite
def dropped(draw, entries_):
    """Each entry, or -1 in its place: an operand that leaves a letter to the others."""
    return tuple(e if draw(st.booleans()) else -1 for e in entries_)


n_meshes = st.integers(1, 3)
shapes = st.integers(1, 9)


# ---------------------------------------------------------------------------------------------
# A reference merge, written from DESIGN.md ("Rules", 1. Merge)
# ---------------------------------------------------------------------------------------------


def axes_of(entry):
    if isinstance(entry, tuple):
        return entry
    return () if entry == -1 else (entry,)


def reference_merge(operands):
    """`{letter: entry}` and the conflicts: letters split two ways, mesh axes on two letters.

    Returns `(merged, split_letters, shared)` where `split_letters` maps a letter to the set of
    different entries it was given and `shared` maps a mesh axis to the letters it splits,
    both holding only the conflicts.
    """
    seen = {}
    for letters, mapping in operands:
        for letter, entry in zip(letters, mapping, strict=True):
            seen.setdefault(letter, set()).add(entry)
    split_letters = {ltr: es - {-1} for ltr, es in seen.items() if len(es - {-1}) > 1}
    merged = {ltr: next(iter(es - {-1}), -1) for ltr, es in seen.items()}
    owners = {}
    for letter, entry in merged.items():
        for mesh_axis in axes_of(entry):
            owners.setdefault(mesh_axis, set()).add(letter)
    shared = {m: ltrs for m, ltrs in owners.items() if len(ltrs) > 1}
    return merged, split_letters, shared


def mesh_axes_used(dims_mapping):
    return [a for e in dims_mapping for a in axes_of(e)]


def _repeats(axes):
    return len(axes) != len(set(axes))


def assert_no_mesh_axis_twice(spec):
    used = mesh_axes_used(spec.dims_mapping)
    assert len(used) == len(set(used)), f"a mesh axis is used twice in {spec}"
    assert not set(used) & spec.partial_dims, f"a mesh axis both splits and is partial in {spec}"


def _fmt_entry(entry):
    return ",".join(str(a) for a in entry) if isinstance(entry, tuple) else str(entry)


def assert_conflict_message(message, split_letters, shared):
    """The message names a conflicting letter and its two mesh axes, or a shared mesh axis and
    exactly the letters it splits. A letter split two ways is found during the walk, before
    any mesh axis is checked for sharing."""
    if split_letters:
        m = TWO_MESH_AXES.search(message)
        assert m, message
        letter = m.group(1)
        assert letter in split_letters, message
        named = {m.group(2), m.group(3)}
        assert len(named) == 2
        assert named <= {_fmt_entry(e) for e in split_letters[letter]}, message
    else:
        m = MULTI_AXIS.search(message)
        assert m, message
        mesh_axis = int(m.group(2))
        assert mesh_axis in shared, message
        assert set(m.group(1).split(",")) == shared[mesh_axis], message


# ---------------------------------------------------------------------------------------------
# Forward and reverse
# ---------------------------------------------------------------------------------------------


@st.composite
def forward_case(draw):
    n_mesh = draw(n_meshes)
    ndim = draw(st.integers(0, 3))
    x_shape = tuple(draw(shapes) for _ in range(ndim))
    w_shape = (draw(shapes), draw(shapes))
    if draw(st.booleans()):
        x_dm, w_dm = draw(mappings(n_mesh, ndim)), draw(mappings(n_mesh, 2))
    else:
        merged = draw(disjoint_entries(n_mesh, ndim + 2))
        x_dm, w_dm = merged[:ndim], merged[ndim:]
    return DistSpec(x_shape, x_dm), DistSpec(w_shape, w_dm), draw(st.booleans())


@SETTINGS
@given(forward_case())
def test_forward(case):
    x, w, vocab_parallel = case
    row = w.dims_mapping[0] if vocab_parallel else -1
    hidden = w.dims_mapping[1]
    letters = IDS_LETTERS[: x.ndim]
    _, split_letters, shared = reference_merge([(letters, x.dims_mapping), ("jk", (row, hidden))])
    assert not split_letters  # the forward never names one letter twice

    # Raises exactly when one mesh axis would split two letters.
    used = mesh_axes_used((*x.dims_mapping, row, hidden))
    assert bool(shared) == (len(used) != len(set(used)))
    if shared:
        try:
            embedding_forward(x, w, vocab_parallel=vocab_parallel)
        except ShardingConflictError as e:
            assert_conflict_message(str(e), split_letters, shared)
        else:
            raise AssertionError(f"no conflict raised for {x}, {w}: mesh axes {shared}")
        return

    info = embedding_forward(x, w, vocab_parallel=vocab_parallel)
    x_out, w_out = info.inputs
    (out,) = info.outputs
    for spec in (x_out, w_out, out):
        assert_no_mesh_axis_twice(spec)
    assert x_out == DistSpec(x.shape, x.dims_mapping)
    assert w_out == DistSpec(w.shape, (row, hidden))
    assert out.shape == (*x.shape, w.shape[1])
    # out's batch axes follow the ids' mapping, its hidden the table's hidden.
    assert out.dims_mapping[:-1] == x_out.dims_mapping
    assert out.dims_mapping[-1] == w.dims_mapping[1]
    # Partial exactly over the mesh axes of the contracted vocab axis, when it stays split.
    expected_partial = frozenset(axes_of(w.dims_mapping[0])) if vocab_parallel else frozenset()
    assert out.partial_dims == expected_partial

    # The reverse of the forward's output gives back the ids' mapping.
    rev = embedding_reverse(x, w, out)
    assert rev.inputs[0] == DistSpec(x.shape, x.dims_mapping)
    assert rev.inputs[1] == DistSpec(w.shape, (-1, w.dims_mapping[1]))
    assert rev.outputs == (out,)


@SETTINGS
@given(forward_case(), st.integers(-1, 100), st.booleans())
def test_forward_options_never_change_layouts(case, padding_idx, sparse):
    x, w, vocab_parallel = case
    try:
        plain = embedding_forward(x, w, vocab_parallel=vocab_parallel)
    except ShardingConflictError as e:
        plain = type(e), str(e)
    try:
        flagged = embedding_forward(
            x, w, vocab_parallel=vocab_parallel, padding_idx=padding_idx, sparse=sparse
        )
    except ShardingConflictError as e:
        flagged = type(e), str(e)
    assert flagged == plain


@st.composite
def out_case(draw):
    n_mesh = draw(n_meshes)
    ndim = draw(st.integers(0, 3))
    x_shape = tuple(draw(shapes) for _ in range(ndim))
    hidden = draw(shapes)
    out_dm = draw(mappings(n_mesh, ndim + 1))
    partial = draw(st.frozensets(st.integers(0, n_mesh - 1)))
    return x_shape, hidden, out_dm, partial


@SETTINGS
@given(out_case())
def test_reverse(case):
    x_shape, hidden, out_dm, partial = case
    x = DistSpec(x_shape, (-1,) * len(x_shape))
    w = DistSpec((7, hidden), (-1, -1))
    out = DistSpec((*x_shape, hidden), out_dm, partial)
    used = mesh_axes_used(out_dm)
    if len(used) != len(set(used)):
        _, split_letters, shared = reference_merge([(IDS_LETTERS[: len(x_shape)] + "k", out_dm)])
        try:
            embedding_reverse(x, w, out)
        except ShardingConflictError as e:
            assert_conflict_message(str(e), split_letters, shared)
        else:
            raise AssertionError(f"no conflict raised for out {out}")
        return
    info = embedding_reverse(x, w, out)
    assert info.inputs == (DistSpec(x_shape, out_dm[:-1]), DistSpec(w.shape, (-1, out_dm[-1])))
    assert info.outputs == (out,)
    assert info.outputs[0].partial_dims == partial


# ---------------------------------------------------------------------------------------------
# Grad
# ---------------------------------------------------------------------------------------------


@st.composite
def grad_case(draw):
    n_mesh = draw(n_meshes)
    ndim = draw(st.integers(0, 3))
    x_shape = tuple(draw(shapes) for _ in range(ndim))
    w_shape = (draw(shapes), draw(shapes))
    # The table is a valid layout on its own: no mesh axis on both its axes.
    w_dm = draw(mappings(n_mesh, 2).filter(lambda dm: not _repeats(mesh_axes_used(dm))))
    if draw(st.booleans()):
        x_dm, og_dm = draw(mappings(n_mesh, ndim)), draw(mappings(n_mesh, ndim + 1))
    else:  # batch, row and hidden on disjoint mesh axes; x and out_grad each carry some
        *batch, row, hidden = draw(disjoint_entries(n_mesh, ndim + 2))
        x_dm, og_dm = draw(dropped(batch)), (*draw(dropped(batch)), hidden)
        other = draw(entries(n_mesh).filter(lambda e: not set(axes_of(e)) & set(axes_of(row))))
        w_dm = (row, other)
    return (
        DistSpec(x_shape, x_dm),
        DistSpec(w_shape, w_dm),
        DistSpec((*x_shape, w_shape[1]), og_dm),
        draw(st.booleans()),
    )


@SETTINGS
@given(grad_case())
def test_grad(case):
    x, w, og, vocab_parallel = case
    row = w.dims_mapping[0] if vocab_parallel else -1
    batch = IDS_LETTERS[: x.ndim]
    merged, split_letters, shared = reference_merge(
        [(batch + "j", (*x.dims_mapping, row)), (batch + "k", og.dims_mapping)]
    )
    if split_letters or shared:
        try:
            embedding_grad(x, w, og, vocab_parallel=vocab_parallel)
        except ShardingConflictError as e:
            assert_conflict_message(str(e), split_letters, shared)
        else:
            raise AssertionError(f"no conflict raised for {x}, {og}: {split_letters}, {shared}")
        return

    info = embedding_grad(x, w, og, vocab_parallel=vocab_parallel)
    x_out, w_out, og_out = info.inputs
    (wg,) = info.outputs
    merged_batch = tuple(merged[ltr] for ltr in batch)
    for spec in (x_out, w_out, og_out, wg):
        assert_no_mesh_axis_twice(spec)
    # x and out_grad take the same, merged batch mapping.
    assert x_out == DistSpec(x.shape, merged_batch)
    assert og_out == DistSpec(og.shape, (*merged_batch, og.dims_mapping[-1]))
    assert og_out.dims_mapping[:-1] == x_out.dims_mapping
    # The table keeps its rows split iff vocab_parallel; so does the gradient.
    assert w_out == DistSpec(w.shape, (row, w.dims_mapping[1]))
    assert wg.shape == w.shape
    assert wg.dims_mapping == (row, og.dims_mapping[-1])
    assert (wg.dims_mapping[0] == w.dims_mapping[0]) == (vocab_parallel or w.dims_mapping[0] == -1)
    # Partial exactly over the mesh axes that split the merged batch axes.
    assert wg.partial_dims == frozenset(mesh_axes_used(merged_batch))


@SETTINGS
@given(grad_case(), st.integers(-1, 100), st.booleans())
def test_grad_options_never_change_layouts(case, padding_idx, sparse):
    x, w, og, vocab_parallel = case
    try:
        plain = embedding_grad(x, w, og, vocab_parallel=vocab_parallel)
    except ShardingConflictError as e:
        plain = type(e), str(e)
    try:
        flagged = embedding_grad(
            x, w, og, vocab_parallel=vocab_parallel, padding_idx=padding_idx, sparse=sparse
        )
    except ShardingConflictError as e:
        flagged = type(e), str(e)
    assert flagged == plain


# ---------------------------------------------------------------------------------------------
# The generic einsum rule
# ---------------------------------------------------------------------------------------------

EINSUM_LETTERS = "abcdefgh"


@st.composite
def einsum_case(draw):
    n_mesh = draw(n_meshes)
    sizes = {ltr: draw(shapes) for ltr in EINSUM_LETTERS}
    distinct = st.lists(st.sampled_from(EINSUM_LETTERS), unique=True, max_size=4)
    lhs, rhs = "".join(draw(distinct)), "".join(draw(distinct))
    union = sorted(set(lhs) | set(rhs))
    out = "".join(draw(st.permutations(union))[: draw(st.integers(0, len(union)))])
    if draw(st.booleans()):
        dms = [draw(mappings(n_mesh, len(letters))) for letters in (lhs, rhs)]
    else:  # letters on disjoint mesh axes, each operand carrying some of them
        by_letter = dict(zip(union, draw(disjoint_entries(n_mesh, len(union))), strict=True))
        dms = [draw(dropped([by_letter[ltr] for ltr in letters])) for letters in (lhs, rhs)]
    operands = [
        DistSpec(tuple(sizes[ltr] for ltr in letters), dm)
        for letters, dm in zip((lhs, rhs), dms, strict=True)
    ]
    return f"{lhs},{rhs}->{out}", lhs, rhs, out, operands, sizes


@SETTINGS
@given(einsum_case())
def test_einsum_rule(case):
    equation, lhs, rhs, out_letters, operands, sizes = case
    merged, split_letters, shared = reference_merge(
        [(lhs, operands[0].dims_mapping), (rhs, operands[1].dims_mapping)]
    )
    if split_letters or shared:
        try:
            einsum_rule(equation, *operands)
        except ShardingConflictError as e:
            assert_conflict_message(str(e), split_letters, shared)
        else:
            raise AssertionError(f"no conflict raised for {equation} {operands}")
        return

    info = einsum_rule(equation, *operands)
    for spec, letters in zip(info.inputs, (lhs, rhs), strict=True):
        assert spec.dims_mapping == tuple(merged[ltr] for ltr in letters)
        assert_no_mesh_axis_twice(spec)
    (out,) = info.outputs
    assert out.shape == tuple(sizes[ltr] for ltr in out_letters)
    assert out.dims_mapping == tuple(merged[ltr] for ltr in out_letters)
    contracted = (set(lhs) | set(rhs)) - set(out_letters)
    assert out.partial_dims == frozenset(a for ltr in contracted for a in axes_of(merged[ltr]))
    assert_no_mesh_axis_twice(out)


@SETTINGS
@given(einsum_case(), st.data())
def test_einsum_rule_passes_input_partials_through(case, data):
    equation, lhs, rhs, _, operands, _ = case
    _, split_letters, shared = reference_merge(
        [(lhs, operands[0].dims_mapping), (rhs, operands[1].dims_mapping)]
    )
    if split_letters or shared:
        return
    used = mesh_axes_used(operands[0].dims_mapping) + mesh_axes_used(operands[1].dims_mapping)
    free = sorted(set(range(3)) - set(used))
    partial = data.draw(st.frozensets(st.sampled_from(free)) if free else st.just(frozenset()))
    lhs_spec = DistSpec(operands[0].shape, operands[0].dims_mapping, partial)
    plain = einsum_rule(equation, *operands)
    info = einsum_rule(equation, lhs_spec, operands[1])
    assert info.inputs[0].partial_dims == partial
    assert info.outputs[0].partial_dims == plain.outputs[0].partial_dims | partial
