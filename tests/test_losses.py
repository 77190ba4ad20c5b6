"""The vocab-parallel cross-entropy against optax on dense logits, and its rule.

Every case checks the per-token loss and the gradients for `hidden` and the table (for a
random cotangent) against `optax.softmax_cross_entropy` on `hidden @ table[:vocab].T` with
smoothed one-hot targets, plus the z-loss term, with ignored tokens zeroed. The compiled
programs are read for their collectives and their largest buffer: no device holds a
`[tokens, V]` block.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxembed import hlo
from jaxembed.losses import plan_cross_entropy, vocab_parallel_cross_entropy
from jaxembed.plan.cost import ring_wire_bytes
from jaxembed.rules import DistSpec, ShardingConflictError
from jaxembed.rules.cross_entropy import cross_entropy_forward, cross_entropy_grad

ROWS, VOCAB, HIDDEN = 64, 61, 16  # a padded table: 3 rows past the vocabulary
TOKENS = (4, 8)
IGNORE = -100


def optax_reference(hidden, table, labels, *, vocab, eps=0.0, z=0.0, ignore=None):
    """Per-token loss on the dense logits, by optax."""
    logits = hidden @ table[:vocab].T
    targets = optax.smooth_labels(jax.nn.one_hot(labels, vocab), eps)
    loss = optax.softmax_cross_entropy(logits, targets)
    loss = loss + z * jax.nn.logsumexp(logits, axis=-1) ** 2
    if ignore is not None:
        loss = jnp.where(labels == ignore, 0.0, loss)
    return loss


def make_inputs(seed, tokens=TOKENS, rows=ROWS, hidden=HIDDEN, vocab=VOCAB):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(*tokens, hidden)).astype(np.float32)
    t = rng.normal(size=(rows, hidden)).astype(np.float32)
    labels = rng.integers(0, vocab, size=tokens).astype(np.int32)
    flat = labels.reshape(-1)  # ignored, past the vocabulary, a padding row, negative
    flat[:4] = [IGNORE, vocab, rows - 1, -3]
    ct = rng.normal(size=tokens).astype(np.float32)
    return h, t, labels, ct


def dense_value_and_grads(h, t, labels, ct, **options):
    loss, vjp = jax.vjp(lambda h, t: optax_reference(h, t, labels, **options), h, t)
    return (loss, *vjp(ct))


def make_mesh(shape, axis_type):
    names = ("data", "model") if len(shape) == 2 else ("model",)
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


def run_loss(mesh, h, t, labels, ct, *, hidden_spec, weight_spec, **kwargs):
    """One compiled program: the loss and both gradients for cotangent ct."""
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    tok_spec = P(*hidden_spec[: len(labels.shape)])
    args = (put(h, hidden_spec), put(t, weight_spec), put(labels, tok_spec), put(ct, tok_spec))

    def step(h, t, labels, ct):
        f = lambda h, t: vocab_parallel_cross_entropy(
            h, t, labels, hidden_spec=hidden_spec, weight_spec=weight_spec, **kwargs
        )
        loss, vjp = jax.vjp(f, h, t)
        return (loss, *vjp(ct))

    compiled = jax.jit(step).lower(*args).compile()
    loss, dh, dt = compiled(*args)
    return compiled, (loss, dh, dt)


# (mesh shape, hidden spec, table spec)
LAYOUTS = {
    "rows": ((2, 4), P("data"), P("model", None)),
    "hidden": ((2, 4), P("data"), P(None, "model")),
    "rows-over-data-model": ((2, 4), P("data"), P(("data", "model"), None)),
    "rows-and-hidden": ((2, 4), P(None, None, None), P("model", "data")),
    "tokens-on-the-rows-axis": ((2, 4), P("model"), P("model", None)),
    "replicated": ((2, 4), P("data"), P()),
    "1d-rows": ((8,), P(), P("model", None)),
}
FULL = dict(vocab_size=VOCAB, label_smoothing=0.1, z_loss=1e-3, ignore_index=IGNORE)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_matches_optax_on_dense_logits(layout, axis_type):
    mesh_shape, h_spec, w_spec = LAYOUTS[layout]
    mesh = make_mesh(mesh_shape, axis_type)
    h, t, labels, ct = make_inputs(len(layout))
    _, (loss, dh, dt) = run_loss(
        mesh, h, t, labels, ct, hidden_spec=h_spec, weight_spec=w_spec, vocab_chunk_size=4,
        **FULL,
    )  # fmt: skip
    ref_loss, ref_dh, ref_dt = dense_value_and_grads(
        h, t, labels, ct, vocab=VOCAB, eps=0.1, z=1e-3, ignore=IGNORE
    )
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dh, ref_dh, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dt)[:VOCAB], ref_dt[:VOCAB], rtol=1e-5, atol=1e-5)
    assert not np.asarray(dt)[VOCAB:].any()  # padding rows: exactly zero
    assert np.asarray(loss)[0, 0] == 0 and not np.asarray(dh)[0, 0].any()  # the ignored token
    # The contracts: the loss in hidden's token layout, the table's gradient in its own.
    assert dt.sharding.is_equivalent_to(NamedSharding(mesh, w_spec), 2)
    assert loss.sharding.is_equivalent_to(NamedSharding(mesh, P(*h_spec[:2])), 2)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"label_smoothing": 0.2},
        {"z_loss": 1e-2},
        {"ignore_index": IGNORE},
        {"vocab_size": VOCAB},
        {"vocab_size": VOCAB, "vocab_chunk_size": 8},
    ],
    ids=["plain", "label-smoothing", "z-loss", "ignore-index", "padded-vocab", "chunked"],
)
def test_each_option_matches_optax(options):
    mesh = make_mesh((2, 4), AxisType.Explicit)
    h, t, labels, ct = make_inputs(1)
    if "ignore_index" not in options:
        labels[labels == IGNORE] = 5
    vocab = options.get("vocab_size", ROWS)
    _, (loss, dh, dt) = run_loss(
        mesh, h, t, labels, ct, hidden_spec=P("data"), weight_spec=P("model", None), **options
    )
    ref_loss, ref_dh, ref_dt = dense_value_and_grads(
        h, t, labels, ct, vocab=vocab, eps=options.get("label_smoothing", 0.0),
        z=options.get("z_loss", 0.0), ignore=options.get("ignore_index"),
    )  # fmt: skip
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dh, ref_dh, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dt)[:vocab], ref_dt[:vocab], rtol=1e-5, atol=1e-5)


def test_one_device_without_a_mesh():
    h, t, labels, ct = make_inputs(2)
    f = jax.jit(lambda h, t: vocab_parallel_cross_entropy(h, t, labels, **FULL))
    loss, vjp = jax.vjp(f, h, t)
    ref_loss, ref_dh, ref_dt = dense_value_and_grads(
        h, t, labels, ct, vocab=VOCAB, eps=0.1, z=1e-3, ignore=IGNORE
    )
    dh, dt = vjp(ct)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dh, ref_dh, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dt)[:VOCAB], ref_dt[:VOCAB], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_reductions(reduction):
    mesh = make_mesh((2, 4), AxisType.Explicit)
    h, t, labels, _ = make_inputs(3)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    hd, td, ld = put(h, P("data")), put(t, P("model", None)), put(labels, P("data"))
    f = lambda h, t: vocab_parallel_cross_entropy(
        h, t, ld, reduction=reduction, vocab_size=VOCAB, ignore_index=IGNORE
    )
    value, (dh, dt) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(hd, td)

    def ref(h, t):
        loss = optax_reference(h, t, labels, vocab=VOCAB, ignore=IGNORE)
        return loss.sum() / (labels != IGNORE).sum() if reduction == "mean" else loss.sum()

    ref_value, (ref_dh, ref_dt) = jax.value_and_grad(ref, argnums=(0, 1))(h, t)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    np.testing.assert_allclose(dh, ref_dh, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dt)[:VOCAB], ref_dt[:VOCAB], rtol=1e-5, atol=1e-6)


def test_bfloat16_inputs_accumulate_in_float32():
    mesh = make_mesh((2, 4), AxisType.Explicit)
    h, t, labels, ct = make_inputs(4)
    labels[labels == IGNORE] = 5
    hb, tb = h.astype(jnp.bfloat16), t.astype(jnp.bfloat16)
    _, (loss, dh, dt) = run_loss(
        mesh, hb, tb, labels, ct, hidden_spec=P("data"), weight_spec=P("model", None)
    )
    assert loss.dtype == jnp.float32 and dh.dtype == dt.dtype == jnp.bfloat16
    h32, t32 = np.asarray(hb, np.float32), np.asarray(tb, np.float32)
    ref_loss, _, _ = dense_value_and_grads(h32, t32, labels, ct, vocab=ROWS)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)


# --- what the compiled program holds and sends --------------------------------------------


def largest_buffer(text):
    """Elements of the largest array any instruction of the per-device program names."""
    shapes = re.findall(r"\b(?:pred|[suf]\d+|bf16)\[([\d,]*)\]", text)
    return max(int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes)


def abstract_inputs(mesh, hidden_shape, table_shape, labels_shape):
    """hidden on data, the table's rows on model, labels on data: shapes for `lower`."""
    specs = (P("data"), P("model", None), P("data"))
    shapes = (hidden_shape, table_shape, labels_shape)
    dtypes = (jnp.float32, jnp.float32, jnp.int32)
    return [
        jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, p))
        for s, d, p in zip(shapes, dtypes, specs, strict=True)
    ]


def dense_program(mesh, hidden_shape, table_shape, labels_shape):
    """The same loss with the full logits (jnp + optax): the baseline."""
    abstract = abstract_inputs(mesh, hidden_shape, table_shape, labels_shape)

    def f(h, t, y):
        logits = jnp.einsum("bsh,vh->bsv", h, t, out_sharding=P("data", None, None))
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    with jax.set_mesh(mesh):
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(*abstract).compile()


def vocab_parallel_program(mesh, hidden_shape, table_shape, labels_shape, chunk=None):
    abstract = abstract_inputs(mesh, hidden_shape, table_shape, labels_shape)

    def f(h, t, y):
        return vocab_parallel_cross_entropy(h, t, y, reduction="mean", vocab_chunk_size=chunk)

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(*abstract).compile()


def test_no_device_holds_tokens_by_vocab_logits():
    mesh = make_mesh((2, 4), AxisType.Explicit)
    shapes = ((4, 32, 32), (4096, 32), (4, 32))  # 64 tokens per device, V = 4096
    local_tokens, vocab = 2 * 32, 4096
    dense = dense_program(mesh, *shapes)
    assert largest_buffer(dense.as_text()) >= local_tokens * vocab  # the checker sees it
    whole = vocab_parallel_program(mesh, *shapes)
    chunked = vocab_parallel_program(mesh, *shapes, chunk=128)
    for compiled in (whole, chunked):
        assert largest_buffer(compiled.as_text()) < local_tokens * vocab
    # Unchunked, the largest block is this device's [tokens, V/4]; chunked, the table shard.
    assert largest_buffer(whole.as_text()) == local_tokens * vocab // 4
    assert largest_buffer(chunked.as_text()) == 1024 * 32
    temp = {name: c.memory_analysis().temp_size_in_bytes
            for name, c in (("dense", dense), ("whole", whole), ("chunked", chunked))}  # fmt: skip
    assert temp["chunked"] < temp["whole"] < temp["dense"], temp
    assert temp["dense"] >= local_tokens * vocab * 4


def test_collectives_follow_the_plan():
    """Forward: one all-gather of the statistics over the vocab axis. Backward: an
    all-reduce of the hidden gradient over it, and of the table's over the tokens' axis."""
    mesh = make_mesh((2, 4), AxisType.Explicit)
    shapes = ((4, 32, 32), (4096, 32), (4, 32))
    text = vocab_parallel_program(mesh, *shapes, chunk=256).as_text()
    found = []
    for c in hlo.collectives(text):  # leave out scalars: the mean's sum, maybe combined
        arrays = tuple(s for s in c.result_shape if s != ())
        if arrays:
            found.append((c.kind, hlo.mesh_axes(c, mesh), arrays))
    assert sorted(found) == sorted([
        ("all-gather", ("model",), ((4, 4, 64),)),  # [R, stats, tokens]: forward, once
        ("all-reduce", ("model",), ((64, 32),)),  # hidden_grad [tokens, H]
        ("all-reduce", ("data",), ((32, 1024),)),  # table_grad, the table's shard transposed
    ]), found  # fmt: skip
    plan = plan_cross_entropy(
        mesh, shapes[0], shapes[1], hidden_spec=P("data"), weight_spec=P("model", None),
        vocab_chunk_size=256,
    )  # fmt: skip
    assert [(op, axes) for _, op, axes, _ in plan.collectives] == [
        ("all_gather", ("model",)), ("psum", ("model",)), ("psum", ("data",)),
    ]  # fmt: skip
    assert plan.num_chunks == 4 and plan.local_tokens == 64
    assert "all_gather" in str(plan) and "softmax statistics" in str(plan)


def test_chunked_loss_bytes_count_every_chunk():
    """With the table's hidden axis split, each logits chunk is psummed over it, in the
    forward's scan and again in the backward's: the compiled bytes count every chunk."""
    mesh = make_mesh((2, 4), AxisType.Explicit)
    tokens, (vocab, hidden) = (4, 32), (4096, 32)
    specs = (P(None, None, "data"), P("model", "data"), P(None, None))  # the kernel's layouts

    def program(chunk):
        shapes = ((*tokens, hidden), (vocab, hidden), tokens)
        args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, p)) for s, d, p in
                zip(shapes, (jnp.float32, jnp.float32, jnp.int32), specs, strict=True)]  # fmt: skip
        f = lambda h, t, y: vocab_parallel_cross_entropy(
            h, t, y, reduction="sum", vocab_chunk_size=chunk
        )
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(*args).compile().as_text()

    plan = plan_cross_entropy(mesh, (*tokens, hidden), (vocab, hidden), hidden_spec=specs[0],
                              weight_spec=specs[1], vocab_chunk_size=256)  # fmt: skip
    assert (plan.hidden_axes, plan.row_axes, plan.batch_axes) == (("data",), ("model",), ())
    assert [(phase, op, operand) for phase, op, _, operand in plan.collectives] == [
        ("forward", "psum", "logits chunk"), ("forward", "psum", "label logit and logit sum"),
        ("forward", "all_gather", "softmax statistics"), ("backward", "psum", "logits chunk"),
        ("backward", "psum", "hidden_grad"),
    ]  # fmt: skip
    T, C, chunks, f32 = 4 * 32, 256, 4096 // 4 // 256, 4  # every token on every device
    k, r, h_k = 2, 4, hidden // 2  # hidden split over data (K), rows over model (R)
    assert (plan.local_tokens, plan.chunk_rows, plan.num_chunks) == (T, C, chunks)
    logits_chunk = ring_wire_bytes("all-reduce", k, T * C * f32)  # f32[T, C], per chunk
    rest = (
        ring_wire_bytes("all-reduce", k, 2 * T * f32)  # label logit and logit sum, f32[T] each
        + ring_wire_bytes("all-gather", r, r * 4 * T * f32)  # statistics f32[R, 4, T]
        + ring_wire_bytes("all-reduce", r, T * h_k * f32)  # hidden_grad f32[T, H/K]
    )
    chunked = hlo.total_wire_bytes(program(256))
    assert chunked == 2 * chunks * logits_chunk + rest  # forward and backward, every chunk
    assert chunked == 1_068_032
    # Unchunked, the forward's psummed f32[T, V/R] logits block serves the backward (the
    # plan saves it): one pass, whatever XLA's common-subexpression pass would merge (it did
    # in float32 but not in bfloat16, which then sent twice the bytes).
    unchunked = hlo.total_wire_bytes(program(None))
    assert unchunked == chunks * logits_chunk + rest
    assert unchunked < chunked  # chunking bounds the logits block at the price of a psum
    whole = plan_cross_entropy(mesh, (*tokens, hidden), (vocab, hidden), hidden_spec=specs[0],
                               weight_spec=specs[1])  # fmt: skip
    assert whole.saves_logits and not plan.saves_logits
    assert ("backward", "psum", ("data",), "logits chunk") not in whole.collectives


# --- the rule -------------------------------------------------------------------------------


def test_rule_keeps_the_table_and_moves_the_tokens():
    hidden = DistSpec((8, 16, 64), (0, -1, -1))
    table = DistSpec((1024, 64), ((0, 1), -1))  # rows over both mesh axes
    info = cross_entropy_forward(hidden, table)
    hidden_k, table_k, labels_k = info.inputs
    assert table_k == table
    assert hidden_k.dims_mapping == (-1, -1, -1)  # mesh axis 0 splits the rows: gathered
    loss, logits = info.outputs
    assert logits.dims_mapping == (-1, -1, (0, 1)) and not logits.partial_dims
    assert loss.dims_mapping == labels_k.dims_mapping == (-1, -1)
    grad = cross_entropy_grad(hidden, table)
    assert [g.partial_dims for g in grad.outputs] == [frozenset({0, 1}), frozenset()]


def test_rule_hidden_split_is_partial_over_it():
    hidden = DistSpec((8, 64), (1, -1))
    table = DistSpec((1024, 64), (-1, 0))
    loss, logits = cross_entropy_forward(hidden, table).outputs
    assert loss.dims_mapping == (1,) and not loss.partial_dims
    assert logits.dims_mapping == (1, -1) and logits.partial_dims == frozenset({0})
    assert cross_entropy_forward(hidden, table).inputs[0].dims_mapping == (1, 0)
    hidden_grad, table_grad = cross_entropy_grad(hidden, table).outputs
    assert hidden_grad.dims_mapping == (1, 0) and not hidden_grad.partial_dims
    assert table_grad.dims_mapping == (-1, 0) and table_grad.partial_dims == frozenset({1})


def test_rule_errors():
    with pytest.raises(
        ValueError, match=r"hidden \(8, 32\) must end in the table's hidden size 64"
    ):
        cross_entropy_forward(DistSpec((8, 32), (-1, -1)), DistSpec((1024, 64), (0, -1)))
    with pytest.raises(ValueError, match=r"labels \(4,\) must have the shape of hidden's tokens"):
        cross_entropy_forward(
            DistSpec((8, 64), (-1, -1)), DistSpec((1024, 64), (0, -1)), DistSpec((4,), (-1,))
        )
    assert issubclass(ShardingConflictError, ValueError)


# --- bad input ------------------------------------------------------------------------------


@pytest.fixture
def arrays():
    mesh = make_mesh((2, 4), AxisType.Explicit)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    h, t, labels, _ = make_inputs(5)
    return put(h, P("data")), put(t, P("model", None)), put(labels, P("data"))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"vocab_chunk_size": 5}, ValueError,
         r"vocab_chunk_size=5 does not divide the 16 table rows each device holds .*such as 4 or 8"),
        ({"vocab_chunk_size": "big"}, ValueError,
         r"vocab_chunk_size must be 'auto', None or an int, got 'big'"),
        ({"table_move": "scatter"}, ValueError,
         r"table_move must be 'auto', 'gather' or 'none', got 'scatter'"),
        ({"table_move": "gather"}, ValueError,
         r"table_move='gather' needs .*the table's hidden axis is not split.*table_move='none'"),
        ({"memory_target": 0}, ValueError, r"memory_target must be a positive number of bytes"),
        ({"label_smoothing": 1.0}, ValueError, r"label_smoothing must be in \[0, 1\), got 1.0"),
        ({"z_loss": -1.0}, ValueError, r"z_loss must be >= 0, got -1.0"),
        ({"vocab_size": 65}, ValueError, r"vocab_size must be in \[1, 64\]"),
        ({"reduction": "max"}, ValueError, r"'none', 'sum' or 'mean', got 'max'"),
        ({"ignore_index": 1.5}, TypeError, r"ignore_index must be an int or None, got 1.5"),
        ({"weight_spec": P(None, "model")}, ValueError,
         r"table is laid out as .*'model'.* but weight_spec="),
    ],
)  # fmt: skip
def test_bad_options(arrays, kwargs, error, match):
    h, t, labels = arrays
    with pytest.raises(error, match=match):
        vocab_parallel_cross_entropy(h, t, labels, **kwargs)


def test_bad_inputs(arrays):
    h, t, labels = arrays
    with pytest.raises(TypeError, match=r"labels must be integers, got float32"):
        vocab_parallel_cross_entropy(h, t, labels.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"expected hidden \[\*tokens, 16\] and labels"):
        vocab_parallel_cross_entropy(h[..., :8], t, labels)
    with pytest.raises(
        ValueError,
        match=r"vocab \(table rows\) 62 does not divide mesh axes "
        r"\('model',\).*pad the table to 64 rows and pass vocab_size=61",
    ):
        plan_cross_entropy(jax.make_mesh((2, 4), ("data", "model")), (8, 16), (62, 16),
                           weight_spec=P("model", None), vocab_size=61)  # fmt: skip


def test_auto_mesh_without_specs_under_jit_warns():
    mesh = make_mesh((2, 4), AxisType.Auto)
    h, t, labels, _ = make_inputs(6)
    t_d = jax.device_put(t, NamedSharding(mesh, P("model", None)))
    with pytest.warns(UserWarning, match=r"Pass hidden_spec=PartitionSpec"):
        jax.jit(
            lambda h, t: vocab_parallel_cross_entropy(h, t, labels, weight_spec=P("model", None))
        ).lower(h, t_d)
