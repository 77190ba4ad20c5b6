"""The loss's Gemma-style options, `softcap` and per-token `weights`, against float64.

Every case checks the per-token (or reduced) loss and the gradients for `hidden` and the
table against a float64 dense reference written from the definition (capped logits, smoothed
one-hot targets, z-loss, ignored tokens, weights) and differentiated by JAX, on the layouts of
an 8-device mesh the issue names (`fsdp=2 x tensor=4` with the table `P("tensor", "fsdp")`,
rows over `tensor` or over both axes, tensor only, fsdp only) and on one device, in float32
and bfloat16. The compiled programs are cached per case (`_program`), and the bfloat16
program's collective bytes are read from its HLO against the float32 program's.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxembed import hlo
from jaxembed.losses import plan_cross_entropy, vocab_parallel_cross_entropy

ROWS, VOCAB, HIDDEN = 64, 61, 16  # a padded table: 3 rows past the vocabulary
TOKENS = (8, 4)
IGNORE = -100
CAP = 2.0  # small against the logits (|z| ~ 4), so the tanh bends them

# name: (mesh shape, mesh axes, hidden spec, table spec); None: one device, no mesh
LAYOUTS = {
    "fsdp2xtensor4-table-tensor-fsdp": ((2, 4), ("fsdp", "tensor"), P("fsdp"), P("tensor", "fsdp")),
    "fsdp2xtensor4-rows-tensor": ((2, 4), ("fsdp", "tensor"), P("fsdp"), P("tensor", None)),
    "fsdp2xtensor4-rows-both": ((2, 4), ("fsdp", "tensor"), P("fsdp"), P(("fsdp", "tensor"), None)),
    "tensor8": ((8,), ("tensor",), P(), P("tensor", None)),
    "fsdp8-hidden": ((8,), ("fsdp",), P("fsdp"), P(None, "fsdp")),
    "one-device": None,
}
COMBINED = dict(
    vocab_size=VOCAB, label_smoothing=0.1, z_loss=1e-3, softcap=CAP, ignore_index=IGNORE
)


def make_inputs(seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(*TOKENS, HIDDEN)).astype(np.float32)
    t = (rng.normal(size=(ROWS, HIDDEN)) / 2).astype(np.float32)
    labels = rng.integers(0, VOCAB, size=TOKENS).astype(np.int32)
    labels.reshape(-1)[:4] = [IGNORE, VOCAB, ROWS - 1, -3]  # ignored, padding, past V, < 0
    weights = rng.uniform(0.0, 2.0, size=TOKENS).astype(np.float32)
    weights.reshape(-1)[4:8] = 0.0  # a loss mask's zeros
    ct = rng.normal(size=TOKENS).astype(np.float32)
    if dtype != np.float32:  # the reference sees the very values the program sees
        h = np.asarray(jnp.asarray(h, dtype).astype(jnp.float32))
        t = np.asarray(jnp.asarray(t, dtype).astype(jnp.float32))
    return h, t, labels, weights, ct


def reference_loss(h, t, labels, *, vocab=ROWS, label_smoothing=0.0, z_loss=0.0,
                   softcap=None, ignore_index=None, weights=None, reduction="none", **_):  # fmt: skip
    """The loss from its definition, on dense logits (run under float64)."""
    logits = h @ t[:vocab].T
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    lse = jax.nn.logsumexp(logits, axis=-1)
    targets = (1 - label_smoothing) * jax.nn.one_hot(labels, vocab, dtype=logits.dtype)
    targets = targets + label_smoothing / vocab  # a label outside [0, vocab): eps / vocab only
    loss = -(targets * (logits - lse[..., None])).sum(-1) + z_loss * lse**2
    kept = jnp.ones_like(loss) if ignore_index is None else (labels != ignore_index) * 1.0
    loss = loss * kept
    w = jnp.ones_like(loss) if weights is None else weights
    if reduction == "sum":
        return (w * loss).sum()
    if reduction == "mean":
        return (w * loss).sum() / (w * kept).sum()
    return w * loss


def reference(h, t, labels, weights, ct, options):
    """float64 value and gradients (hidden, table) of `reference_loss` for the cotangent ct."""
    with jax.enable_x64(True):
        f64 = lambda a: None if a is None else jnp.asarray(a, jnp.float64)
        out = _reference_program(tuple(sorted(options.items())), weights is not None)(
            f64(h), f64(t), jnp.asarray(labels), f64(weights), f64(ct)
        )
        return [np.asarray(a) for a in out]


@functools.cache
def _reference_program(options, with_weights):
    options = dict(options)
    options["vocab"] = options.pop("vocab_size", ROWS)
    reduced = options.get("reduction", "none") != "none"

    def value_and_grads(h, t, labels, weights, ct):
        f = lambda h, t: reference_loss(h, t, labels, weights=weights, **options)
        value, vjp = jax.vjp(f, h, t)
        return (value, *vjp(jnp.ones((), ct.dtype) if reduced else ct))

    return jax.jit(value_and_grads)


@functools.cache
def _mesh(layout):
    if LAYOUTS[layout] is None:
        return None
    shape, names, _, _ = LAYOUTS[layout]
    return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape))


def _put(layout, h, t, labels, weights, ct, dtype):
    """The inputs, laid out (hidden in its layout, tokens like hidden's, the table split)."""
    h, t = jnp.asarray(h, dtype), jnp.asarray(t, dtype)
    if LAYOUTS[layout] is None:
        return h, t, jnp.asarray(labels), jnp.asarray(weights), jnp.asarray(ct)
    _, _, h_spec, w_spec = LAYOUTS[layout]
    mesh = _mesh(layout)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    tok = P(*h_spec[:1])
    return put(h, h_spec), put(t, w_spec), put(labels, tok), put(weights, tok), put(ct, tok)


@functools.cache
def _program(layout, dtype, options):
    """jit of (loss, hidden_grad, table_grad) for the cotangent ct: one compile per case."""
    options = dict(options)
    with_weights = options.pop("with_weights", False)
    reduction = options.get("reduction", "none")

    def step(h, t, labels, weights, ct):
        f = lambda h, t: vocab_parallel_cross_entropy(
            h, t, labels, weights=weights if with_weights else None, **options
        )
        loss, vjp = jax.vjp(f, h, t)
        return (loss, *vjp(ct if reduction == "none" else jnp.ones((), jnp.float32)))

    return jax.jit(step)


def check(layout, dtype, options, seed=0):
    h, t, labels, weights, ct = make_inputs(seed, dtype)
    if "ignore_index" not in options:
        labels[labels == IGNORE] = 7
    args = _put(layout, h, t, labels, weights, ct, dtype)
    loss, dh, dt = _program(layout, dtype, tuple(sorted(options.items())))(*args)
    plan_only = ("vocab_chunk_size", "table_move")
    ref_options = {k: v for k, v in options.items() if k not in plan_only}
    with_weights = ref_options.pop("with_weights", False)
    ref_loss, ref_dh, ref_dt = reference(h, t, labels, weights if with_weights else None, ct,
                                         ref_options)  # fmt: skip
    vocab = options.get("vocab_size", ROWS)
    # float32: float32 rounding only. bfloat16: the gradients are rounded to bfloat16 (8 bits).
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    assert loss.dtype == jnp.float32 and dh.dtype == dt.dtype == dtype
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-5, atol=2e-5)  # float32 in both
    np.testing.assert_allclose(np.asarray(dh, np.float32), ref_dh, **tol)
    np.testing.assert_allclose(np.asarray(dt, np.float32)[:vocab], ref_dt[:vocab], **tol)
    assert not np.asarray(dt, np.float32)[vocab:].any()  # padding rows: exactly zero
    if LAYOUTS[layout] is not None:  # the table's gradient is born in the table's layout
        w_spec = LAYOUTS[layout][3]
        assert dt.sharding.is_equivalent_to(NamedSharding(_mesh(layout), w_spec), 2)
    return loss, dh, dt


# --- every layout, both dtypes: all options together, chunked -------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_all_options_together_match_float64(layout, dtype):
    loss, _, _ = check(
        layout, dtype, dict(COMBINED, with_weights=True, vocab_chunk_size=4), seed=len(layout)
    )
    assert np.asarray(loss).reshape(-1)[0] == 0  # the ignored token
    assert not np.asarray(loss).reshape(-1)[4:8].any()  # weight 0


# --- each option alone, chunked and not, on the layout of the issue -------------------------

ISSUE_LAYOUT = "fsdp2xtensor4-table-tensor-fsdp"


@pytest.mark.parametrize(
    ("options", "chunk"),
    [
        ({"softcap": CAP}, 4),
        # the forward's logits block serves the backward (the logits-psum move, forced)
        ({"softcap": CAP, "table_move": "none"}, None),
        ({"softcap": CAP, "label_smoothing": 0.2, "table_move": "none"}, 4),  # per chunk
        ({"softcap": CAP, "label_smoothing": 0.2, "table_move": "gather"}, 4),
        ({"with_weights": True, "reduction": "mean"}, None),
        ({"with_weights": True, "reduction": "mean", "ignore_index": IGNORE}, 4),
    ],
    ids=["softcap", "softcap-whole", "softcap-smoothing", "softcap-smoothing-gather",
         "weights-mean-whole", "weights-mean-ignore"],
)  # fmt: skip
def test_each_option_alone_matches_float64(options, chunk):
    check(ISSUE_LAYOUT, jnp.float32, dict(options, vocab_chunk_size=chunk))


@pytest.mark.parametrize(
    ("layout", "dtype", "move"),
    [(ISSUE_LAYOUT, jnp.float32, "none"), (ISSUE_LAYOUT, jnp.bfloat16, "gather"),
     ("fsdp8-hidden", jnp.bfloat16, "none")],
)  # fmt: skip
def test_all_options_together_unchunked(layout, dtype, move):
    """Unchunked with the hidden axis split, the backward reuses the forward's logits (the
    logits-psum move), or the forward's gathered table (the weight-gathering move)."""
    check(layout, dtype, dict(COMBINED, with_weights=True, vocab_chunk_size=None, table_move=move))


def test_weights_of_ones_change_nothing_and_mean_is_weighted():
    """weights=1 is the unweighted loss; a 0/1 mask's mean is the mean over the kept tokens;
    a mask of zeros has mean 0, not NaN."""
    h, t, labels, _, _ = make_inputs(3)
    labels[labels == IGNORE] = 7
    mask = np.zeros(TOKENS, np.float32)
    mask[:, :2] = 1.0

    @jax.jit
    def losses(h, t, mask):
        f = functools.partial(vocab_parallel_cross_entropy, h, t, labels)
        return (f(), f(weights=jnp.ones(TOKENS)), f(weights=mask, reduction="mean"),
                f(weights=0 * mask, reduction="mean"))  # fmt: skip

    plain, ones, mean, zero = losses(h, t, mask)
    np.testing.assert_array_equal(ones, plain)
    np.testing.assert_allclose(mean, np.asarray(plain)[:, :2].mean(), rtol=1e-6)
    assert float(zero) == 0.0


def test_weights_get_their_gradient():
    """weights is an input like any other: d loss / d w is the per-token loss."""
    h, t, labels, weights, _ = make_inputs(4)
    labels[labels == IGNORE] = 7
    f = lambda w: vocab_parallel_cross_entropy(h, t, labels, weights=w, reduction="sum")
    loss = lambda: vocab_parallel_cross_entropy(h, t, labels)
    grad, plain = jax.jit(lambda w: (jax.grad(f)(w), loss()))(weights)
    np.testing.assert_allclose(grad, plain, rtol=1e-6)


def test_softcap_plan_collectives():
    """With the hidden axis split (K), a capped loss psums the label logit alone over K: the
    capped logits' sum comes whole from each chunk."""
    mesh = _mesh(ISSUE_LAYOUT)
    plan = plan_cross_entropy(mesh, (*TOKENS, HIDDEN), (ROWS, HIDDEN), hidden_spec=P("fsdp"),
                              weight_spec=P("tensor", "fsdp"), softcap=30.0,
                              table_move="none")  # fmt: skip
    assert plan.softcap == 30.0 and (plan.row_axes, plan.hidden_axes) == (("tensor",), ("fsdp",))
    assert ("forward", "psum", ("fsdp",), "label logit") in plan.collectives


# --- bfloat16 never sends more than float32 -------------------------------------------------


def wire_bytes(dtype, chunk, mesh, shapes=((4, 64, 64), (2048, 64))):
    """Collective bytes of the compiled value_and_grad (hidden and table), per device."""
    (h_shape, t_shape), specs = shapes, (P("fsdp"), P("tensor", "fsdp"), P("fsdp"))
    args = [
        jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, p))
        for s, d, p in zip((h_shape, t_shape, h_shape[:-1]), (dtype, dtype, jnp.int32), specs,
                           strict=True)
    ]  # fmt: skip
    f = lambda h, t, y: vocab_parallel_cross_entropy(
        h, t, y, reduction="mean", vocab_chunk_size=chunk, softcap=30.0, table_move="none"
    )
    text = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(*args).compile().as_text()
    return hlo.total_wire_bytes(text), hlo.collectives(text)


def test_bfloat16_sends_no_more_bytes_than_float32():
    """The issue's layout: fsdp=2 x tensor=4, the table P("tensor", "fsdp"), unchunked. The
    logits are float32 in both programs and psummed over fsdp once (the backward reuses the
    forward's block); hidden and its gradient travel in their own dtype (float32 on CPU, which
    carries bfloat16 collectives as float32). The issue measured bfloat16 at twice float32:
    XLA had merged the forward's and the backward's psum in float32 only. The logits-psum
    move is forced (`table_move="none"`): it is the one that psums logits."""
    mesh = _mesh(ISSUE_LAYOUT)
    f32, f32_ops = wire_bytes(jnp.float32, None, mesh)
    bf16, bf16_ops = wire_bytes(jnp.bfloat16, None, mesh)
    assert bf16 <= f32, (bf16, f32, bf16_ops, f32_ops)
    logits = [c for c in bf16_ops if c.kind == "all-reduce" and (256, 512) in c.result_shape]
    assert len(logits) == 1 and logits[0].result_shape.count((256, 512)) == 1, bf16_ops


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"softcap": 0.0}, ValueError, r"softcap must be a positive, finite float or None, got 0.0"),
        ({"softcap": -30.0}, ValueError, r"got -30.0: .*softcap=None for no cap"),
        ({"softcap": float("inf")}, ValueError, r"softcap must be a positive, finite float"),
        ({"softcap": "30"}, TypeError, r"softcap must be a positive float or None, got '30' \(str\)"),
        ({"weights": np.ones((8, 4), bool)}, TypeError,
         r"weights must be floating point .* got bool: pass weights=mask.astype\(jnp.float32\)"),
        ({"weights": np.ones((8, 4, 1), np.float32)}, ValueError,
         r"weights must have the labels' shape \(8, 4\) .*got \(8, 4, 1\): drop its last axis"),
        ({"weights": np.ones((4,), np.float32)}, ValueError,
         r"weights must have the labels' shape \(8, 4\) \(one weight per token\), got \(4,\)$"),
    ],
)  # fmt: skip
def test_bad_options(kwargs, error, match):
    h, t, labels, _, _ = make_inputs(5)
    with pytest.raises(error, match=match):
        vocab_parallel_cross_entropy(h, t, labels, **kwargs)
