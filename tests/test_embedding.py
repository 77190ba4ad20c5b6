"""jaxembed.embedding against the dense single-device lookup, on a matrix of layouts.

Every case checks the output (bit-exact: the sharded lookup only adds zeros) and the table
gradient for a random cotangent (float32 sums in another order: allclose), with a padded
vocabulary, a padding_idx and out-of-range ids mixed into the batch.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed
from jaxembed import hlo

VOCAB_ROWS, HIDDEN = 64, 16  # table rows (a multiple of 8) and hidden size
IDS_SHAPE = (8, 8)


def make_mesh(shape, axis_type):
    names = ("data", "model") if len(shape) == 2 else ("model",)
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


def dense_reference(ids, table, ct, vocab_size, padding_idx):
    """Output and table gradient of the lookup on one device, in numpy/float64."""
    ids, table, ct = np.asarray(ids), np.asarray(table, np.float64), np.asarray(ct, np.float64)
    valid = (ids >= 0) & (ids < vocab_size)
    if padding_idx is not None:
        valid &= ids != padding_idx
    safe = np.where(valid, ids, 0)
    out = np.where(valid[..., None], table[safe], 0.0)
    grad = np.zeros_like(table)
    np.add.at(grad, safe[valid], ct[valid])
    return out, grad


def make_inputs(rng, ids_shape, vocab_rows=VOCAB_ROWS, hidden=HIDDEN, *, vocab_size, padding_idx):
    table = rng.normal(size=(vocab_rows, hidden)).astype(np.float32)
    ids = rng.integers(0, vocab_size, size=ids_shape).astype(np.int32)
    flat = ids.reshape(-1)
    if flat.size >= 6:  # out of range on both sides, a padding row, the padding_idx, repeats
        flat[:6] = [-1, vocab_size, vocab_rows - 1, padding_idx or 0, flat[6 % flat.size], 3]
        flat[-1] = vocab_rows + 5
    ct = rng.normal(size=(*ids_shape, hidden)).astype(np.float32)
    return ids, table, ct


def put(a, mesh, spec):
    return jax.device_put(a, NamedSharding(mesh, spec))


def run_lookup(mesh, ids, table, ct, *, x_spec, weight_spec, out_spec, **kwargs):
    """Compiles one program returning out and the table gradient for cotangent ct."""
    plan = jaxembed.plan_embedding(
        mesh, ids.shape, table.shape, x_spec=x_spec, weight_spec=weight_spec,
        out_spec=out_spec, dtype=table.dtype, **kwargs,
    )  # fmt: skip
    ids_d, table_d = put(ids, mesh, x_spec), put(table, mesh, weight_spec)
    ct_spec = plan.out_spec.to_ct_spec() if plan.unreduced_axes else plan.out_spec
    ct_d = put(ct, mesh, ct_spec)

    def step(ids, table, ct):
        def f(t):
            return jaxembed.embedding(
                ids, t, x_spec=x_spec, weight_spec=weight_spec, out_spec=out_spec, **kwargs
            )

        out, vjp = jax.vjp(f, table)
        if plan.unreduced_axes:  # sum the partial results so that they can be compared
            out = jax.sharding.reshard(out, NamedSharding(mesh, P(*out_spec.partitions)))
        return out, vjp(ct)[0]

    compiled = jax.jit(step).lower(ids_d, table_d, ct_d).compile()
    out, grad = compiled(ids_d, table_d, ct_d)
    return plan, compiled.as_text(), out, grad


# (mesh shape, table spec, ids spec, out spec, ids shape)
LAYOUTS = {
    "replicated-table": ((2, 4), P(), P("data"), None, IDS_SHAPE),
    "replicated-table-ids-2d": ((2, 4), P(), P("data", "model"), None, IDS_SHAPE),
    "rows": ((2, 4), P("model", None), P("data"), None, IDS_SHAPE),
    "rows-seq-split-out": ((2, 4), P("model", None), P("data"), P("data", "model", None), IDS_SHAPE),
    "rows-batch-split-out": ((2, 4), P("model", None), P("data"), P("model", None, None), IDS_SHAPE),
    "rows-replicated-out": ((2, 4), P("model", None), P("data"), P(None, None, None), IDS_SHAPE),
    "rows-hidden-split-out": ((2, 4), P("model", None), P("data"), P("data", None, "model"), IDS_SHAPE),
    "hidden": ((2, 4), P(None, "model"), P("data"), None, IDS_SHAPE),
    "rows-and-hidden": ((2, 4), P("model", "data"), P(), None, IDS_SHAPE),
    "rows-over-data-model": ((2, 4), P(("data", "model"), None), P("data"), None, IDS_SHAPE),
    "rows-ids-replicated": ((2, 4), P("model", None), P(), None, IDS_SHAPE),
    "rows-ids-on-seq": ((2, 4), P("model", None), P(None, "data"), None, IDS_SHAPE),
    "rows-ids-on-rows-axis": ((2, 4), P("model", None), P("data", "model"), None, IDS_SHAPE),
    "hidden-ids-on-hidden-axis": ((2, 4), P(None, "model"), P("model", None), None, IDS_SHAPE),
    "rows-and-ids-same-axis": ((2, 4), P("data", None), P("data"), None, IDS_SHAPE),
    "rows-ids-rank3": ((2, 4), P("model", None), P("data", None, None), P("data", None, "model", None), (2, 4, 8)),
    "rows-ids-rank1": ((2, 4), P("model", None), P("data"), None, (24,)),
    "rows-ids-rank0": ((2, 4), P("model", None), P(), None, ()),
    "1d-rows": ((8,), P("model", None), P(), None, IDS_SHAPE),
    "1d-rows-ids-split": ((8,), P("model", None), P("model"), None, IDS_SHAPE),
    "1d-hidden": ((8,), P(None, "model"), P(), None, IDS_SHAPE),
    "1d-data-parallel": ((8,), P(), P("model"), None, IDS_SHAPE),
}  # fmt: skip


def reference_cases():
    """Every layout with both gradient exchanges, once with Explicit axes and once with Auto
    ones (the pairing alternates over the layouts, so that each exchange meets both too)."""
    types = [(AxisType.Explicit, "explicit"), (AxisType.Auto, "auto")]
    cases = []
    for n, layout in enumerate(LAYOUTS):
        for k, exchange in enumerate(["dense", "rows"]):
            axis_type, name = types[(n + k) % 2]
            case_id = f"{name}-{layout}-{exchange}"
            cases.append(pytest.param(layout, exchange, axis_type, id=case_id))
    return cases


@pytest.mark.parametrize(("layout", "exchange", "axis_type"), reference_cases())
def test_matches_dense_reference(layout, exchange, axis_type):
    mesh_shape, w_spec, x_spec, out_spec, ids_shape = LAYOUTS[layout]
    mesh = make_mesh(mesh_shape, axis_type)
    vocab_size, padding_idx = VOCAB_ROWS - 5, 7  # a padded table: 5 rows past the vocab
    ids, table, ct = make_inputs(
        np.random.default_rng(len(layout)),
        ids_shape,
        vocab_size=vocab_size,
        padding_idx=padding_idx,
    )
    plan, text, out, grad = run_lookup(
        mesh, ids, table, ct, x_spec=x_spec, weight_spec=w_spec, out_spec=out_spec,
        vocab_size=vocab_size, padding_idx=padding_idx, gradient_exchange=exchange,
    )  # fmt: skip
    ref_out, ref_grad = dense_reference(ids, table, ct, vocab_size, padding_idx)
    np.testing.assert_array_equal(np.asarray(out), ref_out.astype(np.float32))
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-5, atol=1e-5)
    # The contracts: output in out_spec, gradient born in the table's layout.
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, plan.out_spec), out.ndim)
    assert grad.sharding.is_equivalent_to(NamedSharding(mesh, plan.weight_spec), 2)
    assert plan.gradient_exchange == (exchange if plan.batch_axes else "none")
    check_hlo_against_plan(plan, text, mesh)


def check_hlo_against_plan(plan, text, mesh, extra_kinds=None):
    """The compiled program issues the plan's collectives and never gathers the table."""
    found = hlo.collectives(text)
    table_shapes = {tuple(plan.weight_shape), tuple(plan.table_shard_shape)}
    for c in found:
        if c.kind == "all-gather":
            assert not table_shapes & set(c.result_shape), f"the table is gathered: {c}"
    kinds = {"psum": "all-reduce", "psum_scatter": "reduce-scatter", "all_gather": "all-gather",
             "all_to_all": "all-to-all"}  # fmt: skip
    kinds.update(extra_kinds or {})
    listed = [*plan.forward, *plan.backward]
    if plan.routed is not None:  # the compiled program holds the exact fallback's branch too
        listed += [*plan.routed.fallback_forward, *plan.routed.fallback_backward]
    unknown = [c.op for c in listed if c.op not in kinds]
    assert not unknown, f"collectives the check does not know: {unknown}"
    planned = sorted((kinds[c.op], tuple(c.axes)) for c in listed)
    moved = [c for c in (*plan.forward, *plan.backward) if c.op == "reshard"]
    actual = sorted((c.kind, hlo.mesh_axes(c, mesh)) for c in found)
    if not moved:  # no reshard left to XLA: the program is exactly the plan
        assert actual == planned, f"HLO {actual} != plan {planned}"
    else:  # XLA adds the reshard's own collectives; every planned one is there
        for item in planned:
            assert item in actual, f"{item} planned but not in HLO {actual}"


@pytest.mark.parametrize(
    "layout", ["rows", "rows-seq-split-out", "rows-over-data-model", "hidden", "replicated-table"]
)
def test_auto_exchange_picks_rows_for_a_large_vocab(layout):
    """With B*S*H far below a table shard, 'auto' sends rows, and nothing shard-sized moves."""
    mesh_shape, w_spec, x_spec, out_spec, ids_shape = LAYOUTS[layout]
    mesh = make_mesh(mesh_shape, AxisType.Explicit)
    ids, table, ct = make_inputs(
        np.random.default_rng(1), ids_shape, 8192, 32, vocab_size=8192, padding_idx=None
    )
    plan, text, out, grad = run_lookup(
        mesh, ids, table, ct, x_spec=x_spec, weight_spec=w_spec, out_spec=out_spec, vocab_size=8192
    )
    assert plan.gradient_exchange in ("rows", "none")
    assert plan.rows_exchange_bytes < plan.dense_exchange_bytes or not plan.batch_axes
    ref_out, ref_grad = dense_reference(ids, table, ct, 8192, None)
    np.testing.assert_array_equal(np.asarray(out), ref_out.astype(np.float32))
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-5, atol=1e-5)
    shard_bytes = np.prod(plan.table_shard_shape) * 4
    assert max(c.result_bytes for c in hlo.collectives(text)) < shard_bytes
    check_hlo_against_plan(plan, text, mesh)


def test_auto_exchange_picks_dense_for_a_large_batch():
    mesh = make_mesh((2, 4), AxisType.Explicit)
    plan = jaxembed.plan_embedding(
        mesh, (256, 128), (512, 64), x_spec=P("data"), weight_spec=P("model", None)
    )
    assert plan.gradient_exchange == "dense"
    assert plan.dense_exchange_bytes < plan.rows_exchange_bytes
    assert "dense" in plan.exchange_reason and "rows" in plan.exchange_reason


def test_unreduced_output_returns_partial_sums():
    mesh = make_mesh((2, 4), AxisType.Explicit)
    ids, table, ct = make_inputs(
        np.random.default_rng(2), IDS_SHAPE, vocab_size=VOCAB_ROWS, padding_idx=None
    )
    out_spec = P("data", None, None, unreduced={"model"})
    plan, _, out, grad = run_lookup(
        mesh, ids, table, ct, x_spec=P("data"), weight_spec=P("model", None), out_spec=out_spec
    )
    assert plan.psum_axes == () and plan.unreduced_axes == ("model",)
    assert not [c for c in plan.forward if c.op == "psum"]
    ref_out, ref_grad = dense_reference(ids, table, ct, VOCAB_ROWS, None)
    np.testing.assert_array_equal(np.asarray(out), ref_out.astype(np.float32))
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-5, atol=1e-5)

    # Each model shard holds only its own rows' contributions.
    raw = jax.jit(lambda i, t: jaxembed.embedding(i, t, out_spec=out_spec))(
        put(ids, mesh, P("data")), put(table, mesh, P("model", None))
    )
    assert jax.typeof(raw).sharding.spec.unreduced == frozenset({"model"})


@pytest.mark.parametrize("exchange", ["dense", "rows"])
def test_bfloat16_table_accumulates_in_float32(exchange):
    mesh = make_mesh((2, 4), AxisType.Explicit)
    rng = np.random.default_rng(3)
    ids = np.zeros((8, 64), np.int32)  # every id hits row 0: 512 additions in one row
    table = rng.normal(size=(64, 16)).astype(jnp.bfloat16)
    ct = np.full((8, 64, 16), 1.0 + 2**-7, dtype=jnp.bfloat16)
    _, _, out, grad = run_lookup(
        mesh, ids, table, ct, x_spec=P("data"), weight_spec=P("model", None), out_spec=None,
        gradient_exchange=exchange,
    )  # fmt: skip
    assert out.dtype == jnp.bfloat16 and grad.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(table, np.float32)[ids])
    expected = np.float32(512 * (1.0 + 2**-7)).astype(jnp.bfloat16)  # bfloat16 sums drift off it
    np.testing.assert_array_equal(np.asarray(grad)[0], np.full(16, expected))
    assert not np.asarray(grad, np.float32)[1:].any()


def test_explicit_mesh_reads_layouts_from_types_under_jit():
    mesh = make_mesh((2, 4), AxisType.Explicit)
    ids, table, ct = make_inputs(
        np.random.default_rng(4), IDS_SHAPE, vocab_size=VOCAB_ROWS, padding_idx=None
    )
    ids_d, table_d = put(ids, mesh, P("data")), put(table, mesh, P("model", None))
    out, grad = jax.jit(
        lambda i, t: jax.value_and_grad(lambda t: jnp.sum(jaxembed.embedding(i, t) ** 2))(t)
    )(ids_d, table_d)
    ref_out, _ = dense_reference(ids, table, ct, VOCAB_ROWS, None)
    np.testing.assert_allclose(out, np.sum(ref_out**2), rtol=1e-5)
    assert jax.typeof(grad).sharding.spec == P("model", None)
    with jax.set_mesh(mesh):
        out = jax.jit(jaxembed.embedding)(ids_d, table_d)
    assert out.sharding.spec == P("data", None, None)
    np.testing.assert_array_equal(out, ref_out.astype(np.float32))


def test_vmap_over_the_ids_batch():
    mesh = make_mesh((2, 4), AxisType.Explicit)
    ids, table, ct = make_inputs(
        np.random.default_rng(5), IDS_SHAPE, vocab_size=VOCAB_ROWS, padding_idx=None
    )
    table_d = put(table, mesh, P("model", None))
    ids_d = put(ids, mesh, P(None, "data"))  # vmap over axis 0, which is not split

    def f(t):
        return jax.vmap(lambda i: jaxembed.embedding(i, t))(ids_d)

    out, grad = jax.jit(lambda t, ct: (f(t), jax.vjp(f, t)[1](ct)[0]))(table_d, ct)
    ref_out, ref_grad = dense_reference(ids, table, ct, VOCAB_ROWS, None)
    np.testing.assert_array_equal(out, ref_out.astype(np.float32))
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-5)


def test_single_device_without_a_mesh():
    ids, table, ct = make_inputs(np.random.default_rng(6), IDS_SHAPE, vocab_size=60, padding_idx=2)
    table_1 = jax.device_put(table, jax.devices()[0])
    f = jax.jit(lambda i, t: jaxembed.embedding(i, t, vocab_size=60, padding_idx=2))
    out, vjp = jax.vjp(lambda t: f(ids, t), table_1)
    ref_out, ref_grad = dense_reference(ids, table, ct, 60, 2)
    np.testing.assert_array_equal(out, ref_out.astype(np.float32))
    np.testing.assert_allclose(vjp(ct)[0], ref_grad, rtol=1e-5, atol=1e-6)


@settings(
    max_examples=int(os.environ.get("JAXEMBED_LAYOUT_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(data=st.data())
def test_random_layouts(data):
    """Random table, ids and output layouts on (2, 4): valid ones match the dense lookup."""
    names = ("data", "model")
    entry = st.sampled_from([None, "data", "model", ("data", "model")])
    w_spec = P(data.draw(entry, "rows"), data.draw(entry, "hidden"))
    x_spec = P(data.draw(entry, "ids0"), data.draw(entry, "ids1"))
    exchange = data.draw(st.sampled_from(["auto", "dense", "rows"]), "exchange")
    used = [a for e in w_spec.partitions if e for a in ((e,) if isinstance(e, str) else e)]
    x_used = [a for e in x_spec.partitions if e for a in ((e,) if isinstance(e, str) else e)]
    if len(set(used)) != len(used) or len(set(x_used)) != len(x_used):
        with pytest.raises(ValueError, match="used twice"):
            jaxembed.plan_embedding(
                jax.make_mesh((2, 4), names), IDS_SHAPE, (VOCAB_ROWS, HIDDEN),
                x_spec=x_spec, weight_spec=w_spec,
            )  # fmt: skip
        return
    mesh = make_mesh((2, 4), AxisType.Explicit)
    ids, table, ct = make_inputs(
        np.random.default_rng(7), IDS_SHAPE, vocab_size=VOCAB_ROWS - 3, padding_idx=5
    )
    plan, text, out, grad = run_lookup(
        mesh, ids, table, ct, x_spec=x_spec, weight_spec=w_spec, out_spec=None,
        vocab_size=VOCAB_ROWS - 3, padding_idx=5, gradient_exchange=exchange,
    )  # fmt: skip
    ref_out, ref_grad = dense_reference(ids, table, ct, VOCAB_ROWS - 3, 5)
    np.testing.assert_array_equal(np.asarray(out), ref_out.astype(np.float32))
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-5, atol=1e-5)
    assert grad.sharding.is_equivalent_to(NamedSharding(mesh, w_spec), 2)
    check_hlo_against_plan(plan, text, mesh)


# --- bad input ------------------------------------------------------------------------------


@pytest.fixture
def arrays():
    mesh = make_mesh((2, 4), AxisType.Explicit)
    table = put(np.ones((64, 16), np.float32), mesh, P("model", None))
    ids = put(np.zeros((8, 8), np.int32), mesh, P("data"))
    return mesh, ids, table


def test_float_ids_are_rejected(arrays):
    _, ids, table = arrays
    with pytest.raises(TypeError, match=r"ids must be integers, got float32"):
        jaxembed.embedding(ids.astype(jnp.float32), table)


def test_table_must_be_2d(arrays):
    _, ids, _ = arrays
    with pytest.raises(ValueError, match=r"2-D table \[vocab, hidden\], got shape \(4, 4, 4\)"):
        jaxembed.embedding(ids, jnp.ones((4, 4, 4)))


def test_unknown_mesh_axis(arrays):
    _, ids, table = arrays
    with pytest.raises(ValueError, match=r"names mesh axis 'seq', which is not one of"):
        jaxembed.embedding(ids, table, x_spec=P("seq"))


def test_spec_longer_than_rank(arrays):
    _, ids, table = arrays
    with pytest.raises(ValueError, match=r"has 3 entries but the tensor has rank 2"):
        jaxembed.embedding(ids, table, x_spec=P("data", None, None))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"padding_idx": 64}, r"padding_idx must be in \[0, 64\)"),
        ({"padding_idx": 10, "vocab_size": 10}, r"padding_idx must be in \[0, 10\)"),
        ({"vocab_size": 65}, r"vocab_size must be in \[1, 64\]"),
        ({"vocab_size": 0}, r"vocab_size must be in \[1, 64\]"),
        (
            {"gradient_exchange": "fast"},
            r"exchange must be one of \('auto', 'dense', 'rows', 'routed'\), got 'fast'",
        ),
    ],
)
def test_bad_scalars(arrays, kwargs, match):
    _, ids, table = arrays
    with pytest.raises(ValueError, match=match):
        jaxembed.embedding(ids, table, **kwargs)


def test_uneven_vocab_says_how_to_pad():
    mesh = make_mesh((2, 4), AxisType.Explicit)
    with pytest.raises(
        ValueError,
        match=r"vocab \(table rows\) 50257 does not divide mesh axis "
        r"'model' \(size 4\).*pad the table to 50260 rows and pass vocab_size=50257",
    ):
        jaxembed.plan_embedding(mesh, (8,), (50257, 16), weight_spec=P("model", None))


def test_out_of_range_concrete_ids_raise(arrays):
    mesh, _, table = arrays
    ids = put(np.array([[1, 2, 3, 70, 5, 6, 7, 8]] * 8, np.int32), mesh, P("data"))
    with pytest.raises(
        ValueError,
        match=r"id 70 at index \(0, 3\) is out of range for a "
        r"vocabulary of 64 rows",
    ):
        jaxembed.embedding(ids, table)
    with pytest.raises(ValueError, match=r"id 62 .* vocabulary of 60 rows"):
        jaxembed.embedding(jnp.array([62]), table, vocab_size=60)


def test_conflicting_table_layout_is_an_error(arrays):
    _, ids, table = arrays
    with pytest.raises(ValueError, match=r"weight is laid out as .*'model'.* but weight_spec="):
        jaxembed.embedding(ids, table, weight_spec=P(None, "model"))


def test_unreduced_needs_an_explicit_mesh_and_a_row_axis():
    auto = make_mesh((2, 4), AxisType.Auto)
    explicit = make_mesh((2, 4), AxisType.Explicit)
    with pytest.raises(
        ValueError, match=r"unreduced axes, which need a mesh whose axes are all AxisType.Explicit"
    ):
        jaxembed.plan_embedding(auto, (8,), (64, 16), weight_spec=P("model", None),
                                out_spec=P(None, None, unreduced={"model"}))  # fmt: skip
    with pytest.raises(ValueError, match=r"keeps \['data'\] unreduced"):
        jaxembed.plan_embedding(explicit, (8,), (64, 16), weight_spec=P("model", None),
                                out_spec=P(None, None, unreduced={"data"}))  # fmt: skip


def test_auto_mesh_without_weight_spec_under_jit_warns(fresh_warnings):
    mesh = make_mesh((2, 4), AxisType.Auto)
    table = put(np.ones((64, 16), np.float32), mesh, P("model", None))
    ids = put(np.zeros((8, 8), np.int32), mesh, P("data"))
    with pytest.warns(UserWarning, match=r"falls back to XLA's own partitioning.*pass weight_spec"):
        text = jax.jit(jaxembed.embedding).lower(ids, table).compile().as_text()
    for c in hlo.collectives(text):  # XLA's lookup, never a kernel that gathers the table
        assert (64, 16) not in c.result_shape, c


def test_plan_prints_a_table():
    mesh = make_mesh((2, 4), AxisType.Explicit)
    plan = jaxembed.plan_embedding(
        mesh, (16, 128), (65536, 128), x_spec=P("data"), weight_spec=P("model", None),
        out_spec=P("data", "model", None),
    )  # fmt: skip
    text = str(plan)
    for needle in ("psum_scatter", "all_gather", "exchange: rows", "wire bytes",
                   "memory per device", "P('model', None)"):  # fmt: skip
        assert needle in text, needle
    assert plan == jaxembed.plan_embedding(
        mesh, (16, 128), (65536, 128), x_spec=P("data"), weight_spec=P("model", None),
        out_spec=P("data", "model", None),
    )  # fmt: skip
    hash(plan)


def test_no_involuntary_rematerialization(capfd):
    """The kernels move the ids themselves: XLA never reshards them by replicating them
    ("Involuntary full rematerialization"), on any layout of the matrix, in either mesh type."""
    for layout, (mesh_shape, w_spec, x_spec, out_spec, ids_shape) in LAYOUTS.items():
        for axis_type in (AxisType.Explicit, AxisType.Auto):
            mesh = make_mesh(mesh_shape, axis_type)
            ids, table, ct = make_inputs(
                np.random.default_rng(0), ids_shape, vocab_size=VOCAB_ROWS, padding_idx=None
            )
            run_lookup(mesh, ids, table, ct, x_spec=x_spec, weight_spec=w_spec, out_spec=out_spec)
        err = capfd.readouterr().err
        assert "nvoluntary full rematerialization" not in err, (layout, err[-2000:])
