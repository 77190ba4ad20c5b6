"""jaxembed.ragged: input forms, their canonical BagBatch, per-slot scales, Ragged, errors.

The canonical form is checked by pooling with it (a few lines of test code below: gather
rows, multiply by `bag_scales`, segment-sum; max by segment-max with the gradient routed to
the earliest max slot) against the float64 loops of `tests/bag_reference.py`, for the output
and, through `jax.grad`, the table's gradient. Where torch is installed, the reference itself
is checked against `torch.nn.functional.embedding_bag`.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bag_reference import embedding_bag_grad_reference, embedding_bag_reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from jaxembed.ragged import (
    BagBatch,
    Ragged,
    bag_counts,
    bag_scales,
    check_bag_ids,
    global_segments,
    lengths_from_offsets,
    segments_from_lengths,
    to_bag_batch,
    valid_slots,
)

ROWS, VOCAB, HIDDEN = 12, 10, 4  # table rows (ids 10 and 11 are padding rows: out of range)
RTOL, ATOL = 1e-5, 1e-6


# --- the little pooled function (test code only) -------------------------------------------


def pool(table, batch: BagBatch, *, combiner, vocab_size=VOCAB, padding_idx=None):
    """embedding_bag on one device from the canonical form."""
    valid = valid_slots(batch, vocab_size, padding_idx)
    scale = bag_scales(valid, batch.segments, batch.weights, batch.num_bags, combiner)
    lead, num_bags, hidden = batch.ids.shape[:-1], batch.num_bags, table.shape[1]
    size = math.prod(lead) * num_bags
    if size == 0:  # segment_sum's transpose fails on zero segments: nothing to pool
        shape = (*lead, hidden) if batch.dense else (*lead, num_bags, hidden)
        return jnp.zeros(shape, table.dtype) + 0.0 * jnp.sum(table)
    rows = jnp.take(table, jnp.where(valid, batch.ids, 0), axis=0).reshape(-1, hidden)
    g = global_segments(jnp.where(valid, batch.segments, -1), num_bags).reshape(-1)
    if combiner == "max":
        best = jax.ops.segment_max(jax.lax.stop_gradient(rows), g, num_segments=size)
        in_bag = (g < size)[:, None]
        is_max = in_bag & (rows == jnp.take(best, g, axis=0, mode="fill", fill_value=0))
        slot = jnp.arange(rows.shape[0])[:, None]
        first = jax.ops.segment_min(jnp.where(is_max, slot, rows.shape[0]), g, num_segments=size)
        wins = is_max & (slot == jnp.take(first, g, axis=0, mode="fill", fill_value=-1))
        out = jax.ops.segment_sum(jnp.where(wins, rows, 0.0), g, num_segments=size)
    else:
        out = jax.ops.segment_sum(rows * scale.reshape(-1, 1), g, num_segments=size)
    out = out.reshape(*lead, num_bags, hidden)
    return out[..., 0, :] if batch.dense else out


def pool_inputs(table, x, lengths, offsets, weights, *, include_last_offset=False, **kwargs):
    batch = to_bag_batch(
        x, lengths=lengths, offsets=offsets, per_id_weights=weights,
        include_last_offset=include_last_offset,
    )  # fmt: skip
    return pool(table, batch, **kwargs)


def pool_and_grad(table, x, lengths, offsets, weights, out_grad, **kwargs):
    f = functools.partial(pool_inputs, **kwargs)
    out = f(table, x, lengths, offsets, weights)
    grad = jax.grad(lambda t: jnp.sum(f(t, x, lengths, offsets, weights) * out_grad))(table)
    return out, grad


def check_against_reference(table, x, *, lengths=None, offsets=None, weights=None, combiner,
                            padding_idx=None, include_last_offset=False, jit=False, seed=0):  # fmt: skip
    ref_kwargs = dict(
        lengths=lengths, offsets=offsets, per_id_weights=weights, combiner=combiner,
        padding_idx=padding_idx, vocab_size=VOCAB, include_last_offset=include_last_offset,
    )  # fmt: skip
    want = embedding_bag_reference(table, x, **ref_kwargs)
    out_grad = np.random.default_rng(seed).normal(size=want.shape).astype(np.float32)
    want_grad = embedding_bag_grad_reference(table, x, out_grad=out_grad, **ref_kwargs)
    fn = functools.partial(
        pool_and_grad, combiner=combiner, padding_idx=padding_idx,
        include_last_offset=include_last_offset,
    )  # fmt: skip
    if jit:
        fn = jax.jit(fn)
    out, grad = fn(table, x, lengths, offsets, weights, out_grad)
    assert out.shape == want.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=RTOL, atol=ATOL)
    return want


# --- every input form x combiner x weights x padding_idx -----------------------------------

# Empty bags, duplicates, out-of-range ids (10, 11 in the padded rows, 12 past the table,
# negatives), padding id 3, and flat blocks with ignored ids past the bags' total.
FORMS = {
    "dense-1d": (np.array([4, 4, -1, 12, 3, 0]), {}),
    "dense-2d": (
        np.array([[1, 3, 3, -1, 7], [-1, -1, -1, -1, -1], [10, 2, 2, 11, 0], [5, -1, 9, 4, 3]]),
        {},
    ),
    "dense-3d": (np.array([[[1, 3, 3], [-1, -1, -1]], [[10, 2, 2], [5, -7, 9]]]), {}),
    "lengths": (
        np.array([1, 3, 3, -2, 7, 10, 2, 2, 5, 9, 6, 8]),
        {"lengths": np.array([3, 0, 4, 2, 0])},
    ),
    "lengths-lead": (
        np.array([[3, 3, 1, 0, 11, 4, 4, 4], [9, 8, 7, 6, 5, 3, 2, 1]]),
        {"lengths": np.array([[2, 3, 0], [0, 8, 0]])},
    ),
    "offsets": (np.array([1, 3, 3, 7, 10, 2, 2, 5, 9, 3]), {"offsets": np.array([0, 2, 2, 5])}),
    "offsets-last": (
        np.array([1, 3, 3, 7, 10, 2, 2, 5, 9, 3]),
        {"offsets": np.array([0, 3, 3, 7]), "include_last_offset": True},
    ),
    "offsets-lead": (
        np.array([[8, 3, 3, 0, 2, 6], [1, 3, 10, 3, 2, 2]]),
        {"offsets": np.array([[0, 1, 4], [0, 0, 6]])},
    ),
}

COMBOS = [("sum", False), ("sum", True), ("mean", False), ("mean", True), ("sqrtn", False),
          ("sqrtn", True), ("max", False)]  # fmt: skip


@pytest.fixture(scope="module")
def table():
    return np.random.default_rng(1).normal(size=(ROWS, HIDDEN)).astype(np.float32)


def form_cases():
    """Every form with every combiner, with padding id 3 (which changes the bags' counts, so
    the scales: the harder case); without a padding id, every combiner on the 2-D dense form
    and every form with weighted mean (the canonical form and the scales alone)."""
    cases = [(f, c, w, 3) for f in FORMS for c, w in COMBOS]
    cases += [("dense-2d", c, w, None) for c, w in COMBOS]
    cases += [(f, "mean", True, None) for f in FORMS if f != "dense-2d"]
    return [pytest.param(*case, id=f"{case[0]}-{case[1]}-w{int(case[2])}-{case[3]}")
            for case in cases]  # fmt: skip


@pytest.mark.parametrize(("form", "combiner", "weighted", "padding_idx"), form_cases())
def test_forms_match_reference(table, form, combiner, weighted, padding_idx):
    x, kwargs = FORMS[form]
    weights = None
    if weighted:
        weights = np.random.default_rng(2).uniform(0.5, 2.0, x.shape).astype(np.float32)
    want = check_against_reference(
        table, x, weights=weights, combiner=combiner, padding_idx=padding_idx, **kwargs
    )
    assert np.isfinite(want).all()


@pytest.mark.parametrize(
    ("combiner", "weighted"), COMBOS, ids=[f"{c}-w{int(w)}" for c, w in COMBOS]
)
def test_ragged_with_blocks_matches_reference(table, combiner, weighted):
    bags = [[1, 3], [], [3, 3, 10, 2], [5], [0, 9, 9], [], [4, 4, 4, 4], [7]]
    weights = (
        [[0.5 + i + j for j in range(len(b))] for i, b in enumerate(bags)] if weighted else None
    )
    r = Ragged.from_lists(bags, blocks=4, weights=weights)
    assert r.lead_shape == (4,) and r.num_bags == 2 and r.capacity == 5
    want = embedding_bag_reference(
        table, r.values, lengths=r.lengths, per_id_weights=r.weights, combiner=combiner,
        vocab_size=VOCAB,
    )  # fmt: skip
    out = pool(table, to_bag_batch(r), combiner=combiner)
    np.testing.assert_allclose(np.asarray(out), want, rtol=RTOL, atol=ATOL)
    assert out.shape == (4, 2, HIDDEN)


def test_reference_by_hand():
    """A few bags computed by hand: the reference's own semantics, without torch."""
    t = np.array([[1.0, 0.0], [0.0, 2.0], [3.0, -1.0], [5.0, 5.0]])
    x, lengths, w = (
        np.array([0, 1, 2, 9, 3, 0]),
        np.array([3, 0, 2]),
        np.array([1.0, 2, 3, 4, 5, 6]),
    )
    ref = functools.partial(embedding_bag_reference, t, x, lengths=lengths, vocab_size=4)
    np.testing.assert_allclose(ref(), [[4, 1], [0, 0], [5, 5]])
    np.testing.assert_allclose(ref(combiner="mean"), [[4 / 3, 1 / 3], [0, 0], [5, 5]])
    np.testing.assert_allclose(ref(combiner="max"), [[3, 2], [0, 0], [5, 5]])
    np.testing.assert_allclose(ref(combiner="sum", per_id_weights=w), [[10, 1], [0, 0], [25, 25]])
    # weighted mean Σwe/Σw: bag 0 (1·e0 + 2·e1 + 3·e2)/6; bag 2 has id 9 (out of range, w 4)
    np.testing.assert_allclose(
        ref(combiner="mean", per_id_weights=w), [[10 / 6, 1 / 6], [0, 0], [5, 5]]
    )
    np.testing.assert_allclose(
        ref(combiner="sqrtn", per_id_weights=w)[0], np.array([10, 1]) / math.sqrt(1 + 4 + 9)
    )
    np.testing.assert_allclose(
        ref(combiner="sqrtn", padding_idx=2)[0], np.array([1, 2]) / math.sqrt(2)
    )
    g = embedding_bag_grad_reference(t, x, lengths=lengths, vocab_size=4, combiner="max",
                                     out_grad=np.array([[1.0, 10], [7, 7], [100, 1000]]))  # fmt: skip
    np.testing.assert_allclose(g, [[0, 0], [0, 10], [1, 0], [100, 1000]])


def test_max_ties_go_to_the_earliest_slot():
    table = np.array([[0.0, 1.0], [2.0, 5.0], [2.0, 3.0], [2.0, 5.0]], np.float32)
    x = np.array([[2, 1, 3, 1], [3, 1, -1, 0]])  # rows 1, 2, 3 tie on column 0; 1 and 3 on 1
    out_grad = np.array([[1.0, 10.0], [100.0, 1000.0]], np.float32)
    want = embedding_bag_grad_reference(table, x, out_grad=out_grad, combiner="max")
    # bag 0: column 0 -> slot 0 (id 2), column 1 -> slot 1 (id 1); bag 1: id 3 for both.
    np.testing.assert_allclose(want, [[0, 0], [0, 10], [1, 0], [100, 1000]])
    check_against_reference(table, x, combiner="max")


def test_weighted_mean_with_zero_total_weight_is_zero_not_nan(table):
    x, lengths = np.array([1, 2, 3, 4]), np.array([2, 2])
    weights = np.array([1.0, -1.0, 0.0, 0.0], np.float32)
    for combiner in ("mean", "sqrtn"):
        want = check_against_reference(
            table, x, lengths=lengths, weights=weights, combiner=combiner
        )
        np.testing.assert_array_equal(want[1], 0.0)


# --- the reference against PyTorch (skipped where torch is not installed) -------------------

TORCH_X = np.array([4, 3, 3, 0, 7, 11, 2, 5, 3, 9, 9, 1])  # in range; duplicates; padding id 3
TORCH_OFFSETS = [
    pytest.param(np.array([0, 3, 3, 5, 9]), False, id="offsets"),  # an empty bag
    # PyTorch's last offset must be N ("the size of indices"): its CPU kernel runs the last bag
    # to N whatever the last offset says, where jaxembed ends it there (N is a capacity).
    pytest.param(np.array([0, 2, 3, 3, 8, 12]), True, id="include_last_offset"),
    pytest.param(np.array([0, 1, 3]), False, id="padding-only-bag"),  # bag 1 is [3, 3]
]


def _torch_bag(torch, table, x, **kwargs):
    weight = torch.tensor(table, dtype=torch.float64, requires_grad=True)
    out = torch.nn.functional.embedding_bag(torch.tensor(x), weight, **kwargs)
    out_grad = np.random.default_rng(5).normal(size=tuple(out.shape))
    out.backward(torch.tensor(out_grad))
    return out.detach().numpy(), weight.grad.numpy(), out_grad


@pytest.mark.parametrize("padding_idx", [None, 3])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize(("offsets", "include_last_offset"), TORCH_OFFSETS)
def test_reference_matches_torch_offsets(table, offsets, include_last_offset, mode, padding_idx):
    torch = pytest.importorskip("torch")
    out, grad, out_grad = _torch_bag(
        torch, table, TORCH_X, offsets=torch.tensor(offsets), mode=mode,
        include_last_offset=include_last_offset, padding_idx=padding_idx,
    )  # fmt: skip
    kwargs = dict(offsets=offsets, combiner=mode, include_last_offset=include_last_offset,
                  padding_idx=padding_idx)  # fmt: skip
    np.testing.assert_allclose(embedding_bag_reference(table, TORCH_X, **kwargs), out, rtol=1e-12)
    want_grad = embedding_bag_grad_reference(table, TORCH_X, out_grad=out_grad, **kwargs)
    np.testing.assert_allclose(want_grad, grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("padding_idx", [None, 3])
def test_reference_matches_torch_per_sample_weights(table, padding_idx):
    torch = pytest.importorskip("torch")
    offsets = np.array([0, 3, 3, 5, 9])
    w = np.random.default_rng(6).uniform(0.5, 2.0, TORCH_X.shape)
    out, grad, out_grad = _torch_bag(
        torch, table, TORCH_X, offsets=torch.tensor(offsets), mode="sum",
        per_sample_weights=torch.tensor(w), padding_idx=padding_idx,
    )  # fmt: skip
    kwargs = dict(offsets=offsets, per_id_weights=w, padding_idx=padding_idx)
    np.testing.assert_allclose(embedding_bag_reference(table, TORCH_X, **kwargs), out, rtol=1e-12)
    want_grad = embedding_bag_grad_reference(table, TORCH_X, out_grad=out_grad, **kwargs)
    np.testing.assert_allclose(want_grad, grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("padding_idx", [None, 3])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_reference_matches_torch_dense(table, mode, padding_idx):
    torch = pytest.importorskip("torch")
    x = TORCH_X.reshape(4, 3)  # row 1 is [0, 7, 11]; with padding_idx=3, row 0 keeps id 4 only
    out, grad, out_grad = _torch_bag(torch, table, x, mode=mode, padding_idx=padding_idx)
    kwargs = dict(combiner=mode, padding_idx=padding_idx)
    np.testing.assert_allclose(embedding_bag_reference(table, x, **kwargs), out, rtol=1e-12)
    want_grad = embedding_bag_grad_reference(table, x, out_grad=out_grad, **kwargs)
    np.testing.assert_allclose(want_grad, grad, rtol=1e-12, atol=1e-12)


# --- jit semantics of malformed lengths and offsets -----------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lengths": np.array([2, -3, 5, 4])},  # a negative length counts as 0; past capacity
        {"lengths": np.array([[9, 1], [-1, 0]])},
        {"offsets": np.array([3, 1, 4, 99])},  # first starts at 0; running max; clamped
        {"offsets": np.array([0, 5, 2, 7]), "include_last_offset": True},
    ],
    ids=["lengths", "lengths-lead", "offsets", "offsets-last"],
)
@pytest.mark.parametrize("combiner", ["sum", "mean", "max"])
def test_under_jit_bad_sizes_follow_the_documented_convention(table, kwargs, combiner):
    lead = np.shape(next(v for v in kwargs.values() if isinstance(v, np.ndarray)))[:-1]
    x = np.arange(np.prod(lead, dtype=int) * 6).reshape(*lead, 6) % VOCAB
    with pytest.raises(ValueError):  # concrete: refused
        to_bag_batch(x, **kwargs)
    check_against_reference(table, x, combiner=combiner, jit=True, **kwargs)


def test_segments_and_lengths_edge_cases():
    assert segments_from_lengths(jnp.zeros((0,), jnp.int32), 3).tolist() == [-1, -1, -1]
    assert segments_from_lengths(jnp.array([2, 1]), 0).shape == (0,)
    seg = segments_from_lengths(jnp.array([[[1, 1], [0, 3]], [[2, 0], [-4, 1]]]), 3)
    assert seg.tolist() == [[[0, 1, -1], [1, 1, 1]], [[0, 0, -1], [1, -1, -1]]]
    assert seg.dtype == jnp.int32
    assert lengths_from_offsets(jnp.array([[0, 4], [0, 0]]), 5).tolist() == [[4, 1], [0, 5]]
    assert lengths_from_offsets(jnp.array([0]), 5, include_last_offset=True).shape == (0,)
    assert lengths_from_offsets(jnp.array([7, -2, 3, 1]), 5).tolist() == [0, 3, 0, 2]
    empty = to_bag_batch(jnp.zeros((0,), jnp.int32), lengths=jnp.zeros((2,), jnp.int32))
    assert empty.num_bags == 2 and empty.ids.shape == (0,)
    for combiner in ("sum", "mean", "sqrtn", "max"):
        valid = valid_slots(empty, VOCAB)
        assert bag_scales(valid, empty.segments, None, 2, combiner).shape == (0,)
        assert pool(jnp.ones((ROWS, HIDDEN)), empty, combiner=combiner).tolist() == [[0.0] * 4] * 2
    no_bags = to_bag_batch(jnp.array([[1, 2]]), lengths=jnp.zeros((1, 0), jnp.int32))
    assert no_bags.segments.tolist() == [[-1, -1]] and no_bags.num_bags == 0
    assert bag_scales(valid_slots(no_bags, VOCAB), no_bags.segments, None, 0, "mean").tolist() == [
        [0.0, 0.0]
    ]


def test_canonical_form_fields():
    b = to_bag_batch(
        np.array([[5, -1], [2, 2]], np.int64), per_id_weights=np.ones((2, 2), np.float16)
    )
    assert b.ids.dtype == jnp.int32 and b.segments.dtype == jnp.int32
    assert b.weights.dtype == jnp.float32 and b.num_bags == 1 and b.dense
    assert b.segments.tolist() == [[0, -1], [0, 0]]
    f = to_bag_batch(jnp.array([[1, 2, 3], [4, 5, 6]]), offsets=jnp.array([[0, 2], [0, 0]]))
    assert not f.dense and f.num_bags == 2
    assert f.segments.tolist() == [[0, 0, 1], [1, 1, 1]]
    assert global_segments(f.segments, 2).tolist() == [[0, 0, 1], [3, 3, 3]]
    assert bag_counts(valid_slots(f, 5), f.segments, 2).tolist() == [[2, 1], [0, 1]]
    scales = bag_scales(valid_slots(f, 5), f.segments, None, 2, "sqrtn")
    np.testing.assert_allclose(scales, [[2**-0.5, 2**-0.5, 1], [1, 0, 0]], rtol=1e-6)


def test_canonical_form_inside_shard_map():
    """Each device canonicalizes and pools its own lead block: the same as the whole batch."""
    mesh = jax.make_mesh((8,), ("data",))
    rng = np.random.default_rng(3)
    x = rng.integers(-1, ROWS, size=(8, 7)).astype(np.int32)
    lengths = rng.integers(0, 3, size=(8, 3)).astype(np.int32)
    w = rng.uniform(0.5, 2, size=x.shape).astype(np.float32)
    table = jnp.asarray(rng.normal(size=(ROWS, HIDDEN)), jnp.float32)

    def body(x, lengths, w, table):  # x: i32[1, 7]  lengths: i32[1, 3]  w: f32[1, 7]
        batch = to_bag_batch(x, lengths=lengths, per_id_weights=w)
        return pool(table, batch, combiner="mean")  # f32[1, 3, H]

    x, lengths, w = (jax.device_put(a, jax.NamedSharding(mesh, P("data"))) for a in (x, lengths, w))
    sharded = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"),) * 3 + (P(),),
                                    out_specs=P("data")))  # fmt: skip
    want = embedding_bag_reference(table, x, lengths=lengths, per_id_weights=w, combiner="mean",
                                   vocab_size=VOCAB)  # fmt: skip
    np.testing.assert_allclose(
        np.asarray(sharded(x, lengths, w, table)), want, rtol=RTOL, atol=ATOL
    )


def test_canonical_form_keeps_a_split_lead_in_an_explicit_mesh(mesh_2x4):
    """At top level under jit, a lead split over the mesh stays split (no gather)."""
    rng = np.random.default_rng(7)
    spec = jax.NamedSharding(mesh_2x4, P("data", "model"))
    x = jax.device_put(rng.integers(-1, ROWS, size=(2, 4, 6)).astype(np.int32), spec)
    lengths = jax.device_put(rng.integers(0, 3, size=(2, 4, 3)).astype(np.int32), spec)

    def scales_and_counts(x, lengths):
        batch = to_bag_batch(x, lengths=lengths)
        valid = valid_slots(batch, VOCAB, padding_idx=2)
        scales = bag_scales(valid, batch.segments, None, batch.num_bags, "sqrtn")
        return batch.segments, scales, bag_counts(valid, batch.segments, batch.num_bags)

    with jax.set_mesh(mesh_2x4):
        got = jax.jit(scales_and_counts)(x, lengths)
    if mesh_2x4.axis_types[0] == jax.sharding.AxisType.Explicit:
        assert all(jax.typeof(a).sharding.spec[:2] == ("data", "model") for a in got)
    want = scales_and_counts(np.asarray(x), np.asarray(lengths))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)


# --- Ragged ---------------------------------------------------------------------------------


def test_ragged_constructors_and_round_trips():
    bags = [[3, 1], [], [4, 1, 5]]
    r = Ragged.from_lists(bags)
    assert (r.num_bags, r.capacity, r.lead_shape) == (3, 5, ())
    assert r.values.dtype == jnp.int32 and r.weights is None
    assert repr(r) == "Ragged(num_bags=3, capacity=5, lead_shape=(), values=int32)"
    assert r.to_lists() == bags
    padded = Ragged.from_lists(bags, capacity=8, dtype=np.int64)
    assert padded.capacity == 8 and padded.values.tolist()[5:] == [0, 0, 0]
    assert padded.to_lists() == bags
    same = Ragged.from_offsets(jnp.array([3, 1, 4, 1, 5]), jnp.array([0, 2, 2]))
    assert same.lengths.tolist() == [2, 0, 3] and same.to_lists() == bags
    last = Ragged.from_offsets(jnp.array([3, 1, 4, 1, 5, 9]), jnp.array([0, 2, 2, 5]),
                               include_last_offset=True)  # fmt: skip
    assert last.to_lists() == bags and last.capacity == 6
    wb = Ragged.from_lists(bags, weights=[[1.0, 2.0], [], [3.0, 4.0, 5.0]])
    assert wb.to_lists(with_weights=True) == (bags, [[1.0, 2.0], [], [3.0, 4.0, 5.0]])
    assert "weighted" in repr(wb)
    assert Ragged.from_lists([[], []]).capacity == 0


def test_ragged_blocks():
    bags = [[1], [2, 3], [], [4], [5, 6, 7], [8]]
    r = Ragged.from_lists(bags, blocks=3)
    assert r.lead_shape == (3,) and r.num_bags == 2 and r.capacity == 4
    assert r.values.tolist() == [[1, 2, 3, 0], [4, 0, 0, 0], [5, 6, 7, 8]]
    assert r.lengths.tolist() == [[1, 2], [0, 1], [3, 1]]
    assert r.to_lists() == bags
    assert Ragged.from_lists(bags, blocks=1).lead_shape == (1,)
    assert Ragged.from_lists(bags, blocks=2, capacity=9).values.shape == (2, 9)


def test_ragged_is_a_pytree_under_jit_and_vmap():
    r = Ragged.from_lists([[1, 2], [3], [4, 5, 6]], weights=[[1.0, 1.0], [2.0], [0.5, 0.5, 0.5]])
    leaves = jax.tree_util.tree_leaves(r)
    assert len(leaves) == 3
    assert len(jax.tree_util.tree_leaves(Ragged.from_lists([[1]]))) == 2
    back = jax.jit(lambda r: r)(r)
    assert isinstance(back, Ragged) and back.to_lists(with_weights=True) == r.to_lists(
        with_weights=True
    )

    @jax.jit
    def scaled_total(values, lengths):
        inner = Ragged(values, lengths)  # traced: static checks only
        assert inner.num_bags == 3 and inner.capacity == 6
        return jnp.sum(bag_scales(inner.values >= 0, to_bag_batch(inner).segments, None, 3, "mean"))

    assert float(scaled_total(r.values, r.lengths)) == pytest.approx(3.0)
    blocks = Ragged.from_lists([[1], [2, 3], [4, 5], []], blocks=2)
    sums = jax.vmap(lambda r: bag_counts(r.values >= 0, to_bag_batch(r).segments, 2))(blocks)
    assert sums.tolist() == [[1, 2], [2, 0]]


# --- error messages -------------------------------------------------------------------------

I = jnp.array  # noqa: E741


# (make, error, match): one case a line.
# fmt: off
ERROR_CASES = [
    (lambda: Ragged(I([1, 2]), I([1, -2])), ValueError, r"lengths must be >= 0, got lengths\[1\] = -2"),
    (lambda: Ragged(I([1, 2, 3, 4]), I([3, 2])), ValueError, r"the bags hold 5 ids but x's capacity \(last axis\) is 4: pad x to at least 5"),
    (lambda: Ragged(I([[1, 2], [3, 4]]), I([[1, 1], [2, 1]])), ValueError, r"the bags of lead element \(1,\) hold 3 ids"),
    (lambda: Ragged(I([[1, 2]]), I([1])), ValueError, r"lengths \(1,\) must have x's leading dims \(1,\).*reshape lengths to \(1, 1\)"),
    (lambda: Ragged(I([1.0, 2.0]), I([2])), TypeError, r"values must be integers, got float32.*astype\(jnp.int32\)"),
    (lambda: Ragged(I([1, 2]), I([2.0])), TypeError, r"lengths must be integers, got float32"),
    (lambda: Ragged(I([1, 2]), I([2]), I([1, 2])), TypeError, r"weights must be floats, got int32"),
    (lambda: Ragged(I([1, 2]), I([2]), I([1.0])), ValueError, r"weights \(1,\) must have the shape of values \(2,\)"),
    (lambda: Ragged(I(3), I(1)), ValueError, r"rank >= 1: got x \(\), lengths \(\)"),
    (lambda: Ragged.from_lists([[1], [2], [3]], blocks=2), ValueError, r"3 bags do not split into blocks=2 equal blocks"),
    (lambda: Ragged.from_lists([[1, 2], [3, 4, 5]], blocks=2, capacity=2), ValueError, r"block 1 holds 3 ids, past capacity=2: pass capacity >= 3"),
    (lambda: Ragged.from_lists([[1, 2]], weights=[[1.0]]), ValueError, r"bag lengths \[2\], weight lengths \[1\]"),
    (lambda: Ragged.from_lists([[1.5]]), TypeError, r"bag 0 holds non-integer ids \[1.5\]"),
    (lambda: Ragged.from_offsets(I([1, 2, 3]), I([1, 2])), ValueError, r"the first bag must start at 0 \(as in PyTorch\), got offsets\[0\] = 1"),
    (lambda: Ragged.from_offsets(I([1, 2, 3]), I([0, 2, 1])), ValueError, r"non-decreasing: offsets\[1\] = 2 > offsets\[2\] = 1"),
    (lambda: Ragged.from_offsets(I([1, 2, 3]), I([0, 4]), include_last_offset=True), ValueError, r"offsets\[1\] = 4 \(the end of the last bag\) is past the end of x \(capacity 3\)"),
    (lambda: Ragged.from_offsets(I([1, 2, 3]), I([0, 4])), ValueError, r"offsets\[1\] = 4 is past the end of x \(capacity 3\)"),
    (lambda: Ragged.from_offsets(I([1, 2]), I([], jnp.int32), include_last_offset=True), ValueError, r"needs offsets \[\*lead, B\+1\] with at least one entry"),
    (lambda: Ragged.from_offsets(I([[1, 2], [3, 4]]), I([[0, 1], [1, 1]])), ValueError, r"offsets\[1, 0\] = 1"),
    (lambda: Ragged.from_offsets(I([1, 2]), I([0.0])), TypeError, r"offsets must be integers, got float32"),
    (lambda: to_bag_batch(I([1, 2]), lengths=I([1]), offsets=I([0])), ValueError, r"pass lengths or offsets, not both"),
    (lambda: to_bag_batch(I([1, 2]), lengths=I([1]), include_last_offset=True), ValueError, r"include_last_offset=True needs offsets"),
    (lambda: to_bag_batch(I([[1, 2]]), per_id_weights=I([1.0, 2.0])), ValueError, r"per_id_weights \(2,\) must have the shape of x \(1, 2\)"),
    (lambda: to_bag_batch(I([1, 2]), per_id_weights=I([1, 2])), TypeError, r"per_id_weights must be floats, got int32"),
    (lambda: to_bag_batch(I([1.0, 2.0])), TypeError, r"ids must be integers, got float32"),
    (lambda: to_bag_batch(I(4)), ValueError, r"dense ids are \[\*batch, L\], rank >= 1"),
    (lambda: to_bag_batch(I([1, 2]), lengths=I([[1]])), ValueError, r"lengths \(1, 1\) must have x's leading dims \(\)"),
    (lambda: to_bag_batch(Ragged.from_lists([[1]]), lengths=I([1])), ValueError, r"a Ragged carries its own lengths"),
    (lambda: to_bag_batch(Ragged.from_lists([[1]], weights=[[1.0]]), per_id_weights=I([1.0])), ValueError, r"the Ragged has weights already"),
    (lambda: bag_scales(I([True]), I([0]), None, 1, "median"), ValueError, r"combiner must be one of \('sum', 'mean', 'sqrtn', 'max'\), got 'median'"),
    (lambda: bag_scales(I([True]), I([0]), I([1.0]), 1, "max"), ValueError, r"per-id weights do not apply to combiner='max'"),
    (lambda: jax.jit(lambda r: r.to_lists())(Ragged.from_lists([[1]])), ValueError, r"to_lists\(\) needs concrete arrays"),
]
# fmt: on


@pytest.mark.parametrize(("make", "error", "match"), ERROR_CASES)
def test_errors_name_the_value_and_the_fix(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_check_bag_ids():
    check_bag_ids(to_bag_batch(I([[1, -1], [2, 3]])), vocab_size=4)  # dense negatives: empty
    check_bag_ids(to_bag_batch(I([1, 2, 99]), lengths=I([2])), vocab_size=4)  # past the total
    with pytest.raises(
        ValueError,
        match=r"id -1 at x\[0, 1\] \(bag 1\) is out of range for a vocabulary of 4 rows \(valid ids: 0 to 3\)",
    ):
        check_bag_ids(to_bag_batch(I([[1, -1]]), lengths=I([[1, 1]])), vocab_size=4)
    with pytest.raises(ValueError, match=r"id 4 at x\[1, 0\] \(bag 0\)"):
        check_bag_ids(to_bag_batch(I([[1, -1], [4, 0]])), vocab_size=4)
    jax.jit(lambda x: check_bag_ids(to_bag_batch(x), vocab_size=4))(I([[9]]))  # traced: no-op


# --- a property test over random ragged batches ---------------------------------------------


@st.composite
def ragged_batches(draw):
    lead = draw(st.sampled_from([(), (2,)]))
    num_bags = draw(st.sampled_from([0, 1, 3, 5]))
    capacity = draw(st.sampled_from([0, 4, 9]))
    size = math.prod(lead)
    lengths = np.array(draw(st.lists(st.integers(-1, 4), min_size=size * num_bags,
                                     max_size=size * num_bags)), np.int32).reshape(*lead, num_bags)  # fmt: skip
    ids = np.array(draw(st.lists(st.integers(-2, ROWS + 1), min_size=size * capacity,
                                 max_size=size * capacity)), np.int32).reshape(*lead, capacity)  # fmt: skip
    combiner = draw(st.sampled_from(["sum", "mean", "sqrtn", "max"]))
    weighted = combiner != "max" and draw(st.booleans())
    weights = None
    if weighted:
        weights = np.array(draw(st.lists(st.floats(0.25, 4.0, width=32), min_size=size * capacity,
                                         max_size=size * capacity)), np.float32).reshape(ids.shape)  # fmt: skip
    padding_idx = draw(st.sampled_from([None, 0, 5]))
    return ids, lengths, weights, combiner, padding_idx


# Each example compiles its own shapes; the edges (every form x combiner x weights x padding,
# empty bags and batches, negative lengths, totals past the capacity, out-of-range ids) run
# every time in the deterministic tests above, so a few random draws are enough here.
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ragged_batches())
def test_random_ragged_batches_match_reference(case):
    """Random lengths (negative ones, totals past the capacity), capacities, ids, weights."""
    ids, lengths, weights, combiner, padding_idx = case
    table = np.random.default_rng(4).normal(size=(ROWS, HIDDEN)).astype(np.float32)
    check_against_reference(table, ids, lengths=lengths, weights=weights, combiner=combiner,
                            padding_idx=padding_idx, jit=True)  # fmt: skip
