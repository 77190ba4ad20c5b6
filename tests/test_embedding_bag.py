"""jaxembed.embedding_bag against a float64 loop reference, on every table layout.

Every case checks the pooled output (float32 sums in another order: allclose) and the table
gradient for a random cotangent, with a padded vocabulary, a padding_idx, out-of-range ids,
duplicates and empty bags in every batch, and that the compiled program's collectives are
exactly the plan's (pooled partial sums cross devices, never unpooled rows).
"""

import jax
import numpy as np
import pytest
from bag_reference import embedding_bag_grad_reference, embedding_bag_reference
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_embedding import check_hlo_against_plan, make_mesh, put

import jaxembed
from jaxembed import hlo
from jaxembed.kernels import native

ROWS, HIDDEN, VOCAB, PAD = 64, 16, 59, 7  # a padded table: 5 rows past the vocabulary


def dense_bags(rng, batch, length):
    """[batch, length] ids with empty slots (-1), padding, out-of-range ids and repeats."""
    x = rng.integers(0, VOCAB, size=(batch, length)).astype(np.int32)
    x[rng.random(x.shape) < 0.3] = -1
    x[0, :] = -1  # an empty bag
    x[1, :3] = [PAD, VOCAB + 2, 3]
    x[2, :3] = [5, 5, 5]
    return x


def flat_bags(rng, lead, bags, capacity):
    """values [*lead, N] and lengths [*lead, B] with empty bags and unused tail slots."""
    lengths = rng.integers(0, 4, size=(*lead, bags)).astype(np.int32)
    lengths[..., 0] = 0
    while (lengths.sum(-1) > capacity - 2).any():
        lengths = np.maximum(lengths - 1, 0)
    values = rng.integers(0, VOCAB, size=(*lead, capacity)).astype(np.int32)
    values.reshape(-1, capacity)[:, :2] = [PAD, ROWS + 1]
    return values, lengths


def reference(table, x, ct, **kw):
    out = embedding_bag_reference(table, x, vocab_size=VOCAB, padding_idx=PAD, **kw)
    grad = embedding_bag_grad_reference(
        table, x, vocab_size=VOCAB, padding_idx=PAD, out_grad=ct, **kw
    )
    return out, grad


def run(mesh, x, table, ct, *, x_spec, weight_spec, out_spec=None, arrays_specs=(), **kw):
    """One compiled program returning the pooled output and the table gradient."""
    extra = {
        k: put(v, mesh, s)
        for (k, v), s in zip(kw.pop("arrays", {}).items(), arrays_specs, strict=True)
    }
    plan = jaxembed.plan_embedding_bag(
        mesh, x.shape, table.shape, x_spec=x_spec, weight_spec=weight_spec, out_spec=out_spec,
        num_bags=extra["lengths"].shape[-1] if "lengths" in extra else None,
        weighted="per_id_weights" in extra, vocab_size=VOCAB, padding_idx=PAD,
        lengths_spec=arrays_specs[0] if "lengths" in extra else None,
        weights_spec=arrays_specs[-1] if "per_id_weights" in extra else None, **kw,
    )  # fmt: skip
    x_d, t_d = put(x, mesh, x_spec), put(table, mesh, weight_spec)
    ct_d = put(ct, mesh, plan.out_spec)

    def step(x, t, ct, extra):
        f = lambda t: jaxembed.embedding_bag(
            x, t, vocab_size=VOCAB, padding_idx=PAD, out_spec=out_spec, **extra, **kw
        )
        out, vjp = jax.vjp(f, t)
        return out, vjp(ct)[0]

    compiled = jax.jit(step).lower(x_d, t_d, ct_d, extra).compile()
    out, grad = compiled(x_d, t_d, ct_d, extra)
    return plan, compiled.as_text(), out, grad


# (mesh shape, table spec, ids spec, out spec)
LAYOUTS = {
    "rows": ((2, 4), P("model", None), P("data"), None),
    "rows-batch-on-rows-axis": ((2, 4), P("model", None), P("model"), None),
    "rows-over-data-model": ((2, 4), P(("data", "model"), None), P("data"), None),
    "hidden": ((2, 4), P(None, "model"), P("data"), None),
    "replicated": ((2, 4), P(), P("data"), None),
    "rows-out-split-over-rows": ((2, 4), P("model", None), P("data"), P(("data", "model"), None)),
    "rows-bag-axis-split": ((2, 4), P("model", None), P("data", "model"), None),
    "1d-rows": ((8,), P("model", None), P(), None),
    "1d-rows-ids-split": ((8,), P("model", None), P("model"), None),
}  # fmt: skip
COMBINERS = ["sum", "mean", "sqrtn", "max"]


def alternating(layouts, options, second):
    """Every (layout, option) pair once, `second`'s two values in turn: each layout and each
    option meets both."""
    return [pytest.param(layout, option, second[(n + k) % 2], id=f"{layout}-{option}-{second[(n + k) % 2]}")
            for n, layout in enumerate(layouts) for k, option in enumerate(options)]  # fmt: skip


# Every layout with every combiner; the gradient's exchange (dense or rows) in turn.
@pytest.mark.parametrize(
    ("layout", "combiner", "exchange"), alternating(LAYOUTS, COMBINERS, ("dense", "rows"))
)
def test_dense_form_matches_reference(layout, combiner, exchange):
    mesh_shape, w_spec, x_spec, out_spec = LAYOUTS[layout]
    mesh = make_mesh(mesh_shape, AxisType.Explicit)
    rng = np.random.default_rng(len(layout) + len(combiner))
    x = dense_bags(rng, 24, 8)
    table = rng.normal(size=(ROWS, HIDDEN)).astype(np.float32)
    ct = rng.normal(size=(24, HIDDEN)).astype(np.float32)
    plan, text, out, grad = run(
        mesh, x, table, ct, x_spec=x_spec, weight_spec=w_spec, out_spec=out_spec,
        combiner=combiner, exchange=exchange,
    )  # fmt: skip
    ref_out, ref_grad = reference(table, x, ct, combiner=combiner)
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-5, atol=1e-5)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, plan.out_spec), out.ndim)
    assert grad.sharding.is_equivalent_to(NamedSharding(mesh, plan.weight_spec), 2)
    check_bag_hlo(plan, text, mesh)


def check_bag_hlo(plan, text, mesh):
    """The plan's collectives, exactly; and no collective carries unpooled rows."""
    check_hlo_against_plan(
        plan, text, mesh, extra_kinds={"pmax": "all-reduce", "pmin": "all-reduce"}
    )
    pooled = np.prod(plan.out_batch_shape) * plan.weight_shape[1]
    for c in hlo.collectives(text):
        if c.dtype in ("f32", "bf16") and c.result_shape[0] != plan.table_shard_shape:
            assert np.prod(c.result_shape[0]) <= pooled, f"more than the pooled output moves: {c}"


# Every layout with every combiner, unweighted and weighted in turn.
@pytest.mark.parametrize(
    ("layout", "combiner", "weighted"),
    alternating(["rows", "rows-over-data-model", "hidden", "1d-rows-ids-split",
                 "rows-bag-axis-split"], ["sum", "mean", "sqrtn"], (False, True)),
)  # fmt: skip
def test_flat_form_matches_reference(layout, combiner, weighted):
    mesh_shape, w_spec, x_spec, _ = LAYOUTS[layout]
    mesh = make_mesh(mesh_shape, AxisType.Explicit)
    rng = np.random.default_rng(3 + len(layout))
    lead = (8,)  # eight independent blocks of 4 bags
    values, lengths = flat_bags(rng, lead, 4, 12)
    table = rng.normal(size=(ROWS, HIDDEN)).astype(np.float32)
    ct = rng.normal(size=(*lead, 4, HIDDEN)).astype(np.float32)
    arrays = {"lengths": lengths}
    lead_spec = P(*(tuple(x_spec)[:1]))
    specs = [P(*lead_spec, None)]
    kw = {}
    if weighted:
        w = rng.uniform(0.5, 2.0, size=values.shape).astype(np.float32)
        arrays["per_id_weights"] = w
        specs.append(P(*lead_spec, None))
        kw["per_id_weights"] = w
    plan, text, out, grad = run(
        mesh, values, table, ct, x_spec=P(*lead_spec, None), weight_spec=w_spec,
        arrays=arrays, arrays_specs=specs, combiner=combiner,
    )  # fmt: skip
    ref_out, ref_grad = reference(table, values, ct, lengths=lengths, combiner=combiner, **kw)
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-5, atol=1e-5)
    check_bag_hlo(plan, text, mesh)


@pytest.mark.parametrize("combiner", COMBINERS)
def test_flat_bags_split_over_devices_by_output(combiner):
    """One flat block, its bag axis split over `data` by out_spec: each device pools its own."""
    mesh = make_mesh((2, 4), AxisType.Explicit)
    rng = np.random.default_rng(11)
    values, lengths = flat_bags(rng, (), 8, 24)
    table = rng.normal(size=(ROWS, HIDDEN)).astype(np.float32)
    ct = rng.normal(size=(8, HIDDEN)).astype(np.float32)
    plan, text, out, grad = run(
        mesh, values, table, ct, x_spec=P(None), weight_spec=P("model", None),
        out_spec=P("data", None), arrays={"lengths": lengths}, arrays_specs=[P(None)],
        combiner=combiner,
    )  # fmt: skip
    assert plan.bag_split_axes == ("data",)
    ref_out, ref_grad = reference(table, values, ct, lengths=lengths, combiner=combiner)
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-5, atol=1e-5)
    check_bag_hlo(plan, text, mesh)


def test_bytes_grow_with_bags_not_their_length():
    """Pooling before communicating: the forward's bytes are those of [B, H], whatever L."""
    mesh = make_mesh((2, 4), AxisType.Explicit)
    sizes = {}
    for length in (4, 64):
        plan = jaxembed.plan_embedding_bag(
            mesh, (4096, length), (1 << 20, 64), x_spec=P("data"), weight_spec=P("model", None)
        )
        sizes[length] = plan.forward_wire_bytes
        assert plan.forward[0].shape == (2048, 64)
    assert sizes[4] == sizes[64]


def test_one_device_and_eager():
    rng = np.random.default_rng(5)
    x = dense_bags(rng, 6, 5)
    table = rng.normal(size=(ROWS, HIDDEN)).astype(np.float32)
    x = np.where(x >= VOCAB, 1, x)  # concrete out-of-range ids raise: keep them in range
    for combiner in COMBINERS:
        out = jaxembed.embedding_bag(x, table, combiner=combiner, vocab_size=VOCAB, padding_idx=PAD)
        ref = embedding_bag_reference(
            table, x, combiner=combiner, vocab_size=VOCAB, padding_idx=PAD
        )
        np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-6)


IMPLS = ["xla", "native"] if native.available() else ["xla"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("form", ["dense", "flat", "flat-weighted"])
@pytest.mark.parametrize("combiner", COMBINERS)
def test_one_device_values_and_gradients(impl, form, combiner):
    """Without a mesh: the native kernels (or XLA's ops) under jit, against float64."""
    if combiner == "max" and form == "flat-weighted":
        pytest.skip("a maximum is not weighted")
    rng = np.random.default_rng(6)
    table = rng.normal(size=(ROWS, HIDDEN)).astype(np.float32)
    kw = dict(combiner=combiner, vocab_size=VOCAB, padding_idx=PAD)
    if form == "dense":
        x, arrays = dense_bags(rng, 6, 5), {}
        x = np.where(x >= VOCAB, 1, x)  # ids past the table read nothing; keep them
        ct = rng.normal(size=(6, HIDDEN)).astype(np.float32)
    else:
        x, lengths = flat_bags(rng, (3,), 4, 12)
        x = np.where(x >= ROWS, 1, x)
        arrays = {"lengths": lengths}
        if form == "flat-weighted":
            arrays["per_id_weights"] = rng.uniform(0.5, 2, x.shape).astype(np.float32)
        ct = rng.normal(size=(3, 4, HIDDEN)).astype(np.float32)

    def step(t, x, ct, arrays):
        out, vjp = jax.vjp(lambda t: jaxembed.embedding_bag(x, t, impl=impl, **arrays, **kw), t)
        return out, vjp(ct)[0]

    text = jax.jit(step).lower(table, x, ct, arrays).compile().as_text()
    assert ("jaxembed_pool" in text) == (impl == "native")
    out, grad = jax.jit(step)(table, x, ct, arrays)
    want_out, want_grad = reference(table, x, ct, **arrays, combiner=combiner)
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-5)


def test_bad_inputs_name_the_value():
    table = np.zeros((8, 2), np.float32)
    with pytest.raises(ValueError, match="combiner must be one of"):
        jaxembed.embedding_bag(np.zeros((2, 3), np.int32), table, combiner="median")
    with pytest.raises(ValueError, match="cannot be used with combiner='max'"):
        jaxembed.embedding_bag(
            np.zeros((2, 3), np.int32), table, combiner="max",
            per_id_weights=np.ones((2, 3), np.float32),
        )  # fmt: skip
    with pytest.raises(ValueError, match="lengths or offsets, not both"):
        jaxembed.embedding_bag(
            np.zeros(4, np.int32), table, lengths=np.array([1, 1]), offsets=np.array([0, 1])
        )
    with pytest.raises(ValueError, match=r"id 9 .*out of range"):
        jaxembed.embedding_bag(np.array([[1, 9]]), table)
    with pytest.raises(TypeError, match="integers"):
        jaxembed.embedding_bag(np.zeros((2, 3), np.float32), table)
