"""The routed bag exchange pooled at the owner: exact, and the same as pooling at the source.

Each device sends its slots (id, bag, factor) to their rows' owners in one all_to_all; the
owners pool them into partial sums per (source, bag), which a psum_scatter returns to the
sources; the backward gathers out_grad and sends the slots again. On 8 devices, for sum,
mean, sqrtn and weighted bags in the dense, flat and stacked forms: values, table gradients
and a row-sparse update equal the float64 reference and the variant that pools at the
source; a capacity of 1 with every id on one owner runs the exact fallback and says so; the
compiled program's collective bytes are the plan's; the counters count the owner's work; and
"auto" takes the variant the plan's own model prices lower.
"""

import collections

import jax
import numpy as np
import pytest
from bag_reference import embedding_bag_grad_reference, embedding_bag_reference, iter_bags
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from test_counters import _owned, _setup
from test_embedding import make_mesh, put
from test_optim import per_slot_grads, slots_of
from test_routed import HIDDEN, KINDS, NATIVE, PAD, ROWS, VOCAB

import jaxembed
from jaxembed import hlo
from jaxembed.optim import reference

# (mesh shape, table spec, ids spec): where the routed exchange applies
LAYOUTS = {
    "1d-fully-sharded": ((8,), P("model", None), P("model")),
    "2d-ids-over-both": ((2, 4), P(("data", "model"), None), P(("data", "model"))),
    "2d-ids-on-data": ((2, 4), P(("data", "model"), None), P("data")),  # a psum over model
}
COMBINERS = {"sum": ("sum", False), "mean": ("mean", False), "sqrtn": ("sqrtn", False),
             "weighted-mean": ("mean", True), "weighted-sqrtn": ("sqrtn", True)}  # fmt: skip
FORMS = ("dense", "flat", "stacked")
B = 16


def make_bags(form, weighted, seed):
    """`(x, lengths or None, weights or None, out_grad)` with duplicates, padding, empty
    slots, out-of-range ids and an empty bag."""
    rng = np.random.default_rng(seed)
    shape = {"dense": (B, 6), "flat": (B, 12), "stacked": (B, 2, 6)}[form]
    x = rng.integers(0, VOCAB, size=shape).astype(np.int32)
    x[rng.random(x.shape) < 0.25] = -1
    x[0] = -1
    x[1, ..., :3] = [PAD, VOCAB + 1, 4]
    x[2, ..., :3] = [4, 4, 9]
    lengths = rng.integers(0, 5, size=(B, 3)).astype(np.int32) if form == "flat" else None
    weights = rng.uniform(0.5, 2.0, size=shape).astype(np.float32) if weighted else None
    out_shape = {"dense": (B,), "flat": (B, 3), "stacked": (B, 2)}[form]
    ct = rng.normal(size=(*out_shape, HIDDEN)).astype(np.float32)
    return x, lengths, weights, ct


def live_ids(x, lengths):
    """The ids as the reference reads them: slots past a flat row's bags are -1."""
    if lengths is None:
        return x
    live = np.zeros(x.shape, bool)
    for _, slots in iter_bags(x, lengths=lengths):
        for s in slots:
            live[s] = True
    return np.where(live, x, -1)


def check_bytes(plan, text, mesh, phases):
    """The compiled program's collectives are the plan's, kind, axes and wire bytes."""
    planned = collections.Counter((KINDS[c.op], tuple(c.axes), round(c.wire_bytes)) for c in phases)
    actual = collections.Counter(
        (c.kind, hlo.mesh_axes(c, mesh), round(c.wire_bytes)) for c in hlo.collectives(text)
    )
    assert actual == planned, f"HLO {sorted(actual.items())} != plan {sorted(planned.items())}"


def run_bag(mesh, x_spec, w_spec, table, x, lengths, weights, ct, **kw):
    """Compiles and runs forward + table gradient: `(plan, out, fallback, grad, counts, text)`."""
    plan = jaxembed.plan_embedding_bag(
        mesh, x.shape, table.shape, x_spec=x_spec, weight_spec=w_spec,
        num_bags=None if lengths is None else lengths.shape[-1], weighted=weights is not None,
        **{k: v for k, v in kw.items() if k != "capacity" or v is not None},
    )  # fmt: skip

    def step(t, x, lengths, weights, ct):
        f = lambda t: jaxembed.embedding_bag(
            x, t, lengths=lengths, per_id_weights=weights, return_stats=True, **kw
        )
        (out, stats), vjp = jax.vjp(f, t)
        zero = jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), stats)
        return out, stats, vjp((ct, zero))[0]

    opt = lambda a: None if a is None else put(a, mesh, x_spec)
    args = (put(table, mesh, w_spec), put(x, mesh, x_spec), opt(lengths), opt(weights),
            put(ct, mesh, x_spec))  # fmt: skip
    compiled = jax.jit(step).lower(*args).compile()
    out, stats, grad = compiled(*args)
    return plan, np.asarray(out), stats, np.asarray(grad), compiled.as_text()


XLA_LAYOUT = "1d-fully-sharded"
"""The layout the XLA kernels run on here (the native ones run every layout)."""


def case(layout, combiner, form, impl):
    marks = NATIVE.marks if impl == "native" else ()
    return pytest.param(layout, combiner, form, impl, marks=marks,
                        id=f"{layout}-{combiner}-{form}-{impl}")  # fmt: skip


def rotated(layout, combiners, impl, shift=0):
    """One case per form on `layout`, the combiners rotated over the forms from `shift`."""
    return [case(layout, combiners[(i + shift) % len(combiners)], form, impl)
            for i, form in enumerate(FORMS)]  # fmt: skip


# The native kernels on the 1-D layout: every combiner in every form (where the factors and
# the bag boundaries differ). Each 2-D layout: each form once, with sum, mean and weighted
# sqrtn rotated over the forms, so that each layout meets every form and every kind of factor.
# XLA's kernels (their bodies are shared across layouts): each form once on the 1-D layout,
# unweighted and weighted.
VALUE_CASES = [
    *(case(XLA_LAYOUT, c, f, "native") for c in COMBINERS for f in FORMS),
    *rotated("2d-ids-over-both", ("sum", "mean", "weighted-sqrtn"), "native"),
    *rotated("2d-ids-on-data", ("sum", "mean", "weighted-sqrtn"), "native", shift=1),
    *rotated(XLA_LAYOUT, ("sum", "weighted-sqrtn"), "xla"),
]


@pytest.mark.parametrize(("layout", "combiner", "form", "impl"), VALUE_CASES)
def test_values_and_gradients(layout, combiner, form, impl):
    mesh_shape, w_spec, x_spec = LAYOUTS[layout]
    mesh = make_mesh(mesh_shape, AxisType.Explicit)
    comb, weighted = COMBINERS[combiner]
    x, lengths, weights, ct = make_bags(form, weighted, len(layout) + len(combiner))
    table = np.random.default_rng(5).normal(size=(ROWS, HIDDEN)).astype(np.float32)
    kw = dict(vocab_size=VOCAB, padding_idx=PAD, combiner=comb, exchange="routed", impl=impl)
    results = {}
    for pool in ("owner", "source"):
        results[pool] = run_bag(mesh, x_spec, w_spec, table, x, lengths, weights, ct,
                                routed_pool=pool, **kw)  # fmt: skip
    plan, out, stats, grad, text = results["owner"]
    assert plan.exchange == "routed" and plan.routed.pooled_at_owner
    assert not results["source"][0].routed.pooled_at_owner
    ref_kw = dict(lengths=lengths, per_id_weights=weights, combiner=comb, vocab_size=VOCAB,
                  padding_idx=PAD)  # fmt: skip
    ref = embedding_bag_reference(table, x, **ref_kw)
    ref_grad = embedding_bag_grad_reference(table, x, out_grad=ct, **ref_kw)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, results["source"][1], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grad, results["source"][3], rtol=1e-6, atol=1e-6)
    assert int(stats.routed_fallback) == 0
    r = plan.routed
    check_bytes(plan, text, mesh, (*plan.forward, *plan.backward, *r.fallback_forward,
                                   *r.fallback_backward))  # fmt: skip


# The native kernels on the 1-D layout: both combiners in every form. Each 2-D layout and
# XLA's kernels: each form once, unweighted and weighted rotated over the forms (the two 2-D
# layouts together meet every (combiner, form) pair).
UPDATE_CASES = [
    *(case(XLA_LAYOUT, c, f, "native") for c in ("sum", "weighted-mean") for f in FORMS),
    *rotated("2d-ids-over-both", ("sum", "weighted-mean"), "native"),
    *rotated("2d-ids-on-data", ("sum", "weighted-mean"), "native", shift=1),
    *rotated(XLA_LAYOUT, ("weighted-mean", "sum"), "xla"),
]


@pytest.mark.parametrize(("layout", "combiner", "form", "impl"), UPDATE_CASES)
def test_row_sparse_update(layout, combiner, form, impl):
    mesh_shape, w_spec, x_spec = LAYOUTS[layout]
    mesh = make_mesh(mesh_shape, AxisType.Explicit)
    comb, weighted = COMBINERS[combiner]
    x, lengths, weights, ct = make_bags(form, weighted, 3 + len(layout))
    table = np.random.default_rng(6).normal(size=(ROWS, HIDDEN)).astype(np.float32)
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    opt_arg = lambda a: None if a is None else put(a, mesh, x_spec)
    got = {}
    for pool in ("owner", "source"):
        kw = dict(combiner=comb, vocab_size=VOCAB, padding_idx=PAD, exchange="routed",
                  impl=impl, routed_pool=pool)  # fmt: skip
        t = put(table, mesh, w_spec)
        state = opt.init(t)
        args = (t, state, put(x, mesh, x_spec), put(ct, mesh, x_spec), opt_arg(lengths),
                opt_arg(weights))  # fmt: skip
        update = jax.jit(lambda t, s, x, g, lengths, weights, kw=kw: opt.update(
            t, s, x, g, lengths=lengths, per_id_weights=weights, **kw))  # fmt: skip
        compiled = update.lower(*args).compile()
        new_t, new_state = compiled(*args)
        got[pool] = np.asarray(new_t), np.asarray(slots_of(opt, new_state)[0])
        assert int(new_state.routed_fallbacks) == 0
        plan = opt.plan(mesh, x.shape, table.shape, x_spec=x_spec, weight_spec=w_spec,
                        num_bags=None if lengths is None else lengths.shape[-1],
                        weighted=weighted, **kw)  # fmt: skip
        assert plan.routed.pooled_at_owner == (pool == "owner")
        if pool == "owner":
            check_bytes(plan, compiled.as_text(), mesh,
                        (*plan.backward, *plan.routed.fallback_backward))  # fmt: skip
    ids = live_ids(x, lengths)
    grads = per_slot_grads(ids, ct, comb, table.astype(np.float64), weights=weights,
                           lengths=lengths)  # fmt: skip
    ref_t, ref_s = reference.sparse_step(
        opt.formula, table, reference.init_states(opt.formula, ROWS, HIDDEN), ids, grads,
        count=0, vocab_size=VOCAB, padding_idx=PAD,
    )  # fmt: skip
    for pool, (new_t, acc) in got.items():
        np.testing.assert_allclose(new_t, ref_t, rtol=1e-5, atol=1e-6, err_msg=pool)
        np.testing.assert_allclose(acc, ref_s[0], rtol=1e-5, atol=1e-6, err_msg=pool)
    np.testing.assert_allclose(got["owner"][0], got["source"][0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", [NATIVE, "xla"])
def test_overflow_falls_back_exactly(impl):
    """Capacity 1, every id on owner 0: the fallback runs, exactly, and is counted."""
    mesh = make_mesh((8,), AxisType.Explicit)
    rng = np.random.default_rng(4)
    table = rng.normal(size=(ROWS, HIDDEN)).astype(np.float32)
    x = rng.integers(0, ROWS // 8, size=(B, 6)).astype(np.int32)  # owner 0 holds ids < 8
    weights = rng.uniform(0.5, 2.0, size=x.shape).astype(np.float32)
    ct = rng.normal(size=(B, HIDDEN)).astype(np.float32)
    kw = dict(combiner="mean", exchange="routed", routed_pool="owner", capacity=1, impl=impl,
              vocab_size=VOCAB, padding_idx=PAD)  # fmt: skip
    plan, out, stats, grad, _ = run_bag(mesh, P("model"), P("model", None), table, x, None,
                                        weights, ct, **kw)  # fmt: skip
    assert plan.routed.pooled_at_owner and plan.routed.capacity == 1
    ref_kw = dict(per_id_weights=weights, combiner="mean", vocab_size=VOCAB, padding_idx=PAD)
    np.testing.assert_allclose(out, embedding_bag_reference(table, x, **ref_kw), rtol=1e-5,
                               atol=1e-5)  # fmt: skip
    np.testing.assert_allclose(grad, embedding_bag_grad_reference(table, x, out_grad=ct,
                               **ref_kw), rtol=1e-5, atol=1e-5)  # fmt: skip
    assert int(stats.routed_fallback) == 1
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    t = put(table, mesh, P("model", None))
    new_t, state = jax.jit(lambda t, s, x, g, w: opt.update(t, s, x, g, per_id_weights=w, **kw))(
        t, opt.init(t), put(x, mesh, P("model")), put(ct, mesh, P("model")),
        put(weights, mesh, P("model")),
    )  # fmt: skip
    assert int(state.routed_fallbacks) == 1
    grads = per_slot_grads(x, ct, "mean", table.astype(np.float64), weights=weights)
    ref_t, _ = reference.sparse_step(opt.formula, table, reference.init_states(
        opt.formula, ROWS, HIDDEN), x, grads, count=0, vocab_size=VOCAB, padding_idx=PAD)  # fmt: skip
    np.testing.assert_allclose(np.asarray(new_t), ref_t, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", [NATIVE, "xla"])
def test_counters_count_the_owners_work(impl):
    """Pooled at the owner, a device walks the n·C slots it received and reads a row for
    each valid one (every source's slots that it owns, duplicates included)."""
    mesh, _, ids, t, x = _setup()
    kw = dict(exchange="routed", routed_pool="owner", capacity_factor=4.0, impl=impl)
    with jax.set_mesh(mesh):
        plan = jaxembed.plan_embedding_bag(mesh, ids.shape, t.shape, x_spec=P("x"),
                                           weight_spec=P("x", None), **kw)  # fmt: skip
        _, stats = jax.jit(lambda t, x: jaxembed.embedding_bag(x, t, return_stats=True, **kw))(t, x)
    assert plan.routed.pooled_at_owner and int(stats.routed_fallback) == 0
    r = plan.routed
    np.testing.assert_array_equal(stats.slots, np.full(8, r.num_buckets * r.capacity))
    blocks = ids.reshape(8, -1)
    want = np.zeros(8, int)
    for s in range(8):
        for d, owned in enumerate(_owned(blocks[s])):
            want[d] += len(owned)  # every slot, not each distinct id
    np.testing.assert_array_equal(stats.rows, want)
    assert stats.rows.sum() == (ids >= 0).sum()


def _costs(plan):
    return {variant: (wire, ms) for variant, wire, ms in plan.routed.pool_costs}


def test_auto_weighs_both_poolings():
    """Long bags, few of them: fewer bytes at the owner; one slot per bag, many duplicates:
    the source's rows are fewer than the owner's partial sums. "auto" follows the plan's
    own modelled times, and the forced variants report the same numbers."""
    mesh = jax.sharding.AbstractMesh((8,), ("model",))
    kw = dict(x_spec=P("model"), weight_spec=P("model", None), exchange="routed")
    long_bags = dict(x_shape=(64, 64), weight_shape=(1 << 20, 64))
    plan = jaxembed.plan_embedding_bag(mesh, **long_bags, **kw)
    costs = _costs(plan)
    assert costs["owner"][0] < costs["source"][0]  # bytes
    assert costs["owner"][1] < costs["source"][1]  # modelled time
    assert plan.routed.pooled_at_owner
    for pool in ("owner", "source"):
        forced = jaxembed.plan_embedding_bag(mesh, **long_bags, routed_pool=pool, **kw)
        assert forced.routed.pooled_at_owner == (pool == "owner")
        assert _costs(forced) == costs
        total = forced.forward_wire_bytes + forced.backward_wire_bytes
        assert total == pytest.approx(costs[pool][0])
    one_slot = dict(x_shape=(4096, 1), weight_shape=(1 << 20, 64))
    plan = jaxembed.plan_embedding_bag(mesh, **one_slot, **kw)
    costs = _costs(plan)
    assert costs["source"][0] < costs["owner"][0]
    assert costs["source"][1] < costs["owner"][1]
    assert not plan.routed.pooled_at_owner


def test_owner_pooling_needs_a_sum():
    mesh = jax.sharding.AbstractMesh((8,), ("model",))
    kw = dict(x_spec=P("model"), weight_spec=P("model", None), exchange="routed")
    with pytest.raises(ValueError, match=r"routed_pool='owner'.*a max bag.*routed_pool='auto'"):
        jaxembed.plan_embedding_bag(mesh, (16, 4), (64, 8), combiner="max", routed_pool="owner",
                                    **kw)  # fmt: skip
    with pytest.raises(ValueError, match=r"routed_pool must be one of .*got 'sink'"):
        jaxembed.plan_embedding_bag(mesh, (16, 4), (64, 8), routed_pool="sink", **kw)
