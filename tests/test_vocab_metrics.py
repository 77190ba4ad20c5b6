"""The vocab-parallel metrics `argmax`, `top_k` and `accuracy` against float64 dense logits.

The reference ranks the float64 logits `hidden @ table[:vocab].T` (capped when asked) with
numpy's stable sort, so equal logits come in id order, as `jax.lax.top_k` and `jnp.argmax`
break ties. The table holds one row four times (rows 3, 5 and 40, on different chunks and
shards, and padding row 62, which must never win), with a large norm so that it ties at the
top for many tokens. Every layout of `test_loss_options` runs, float32 and bfloat16, chunked
(chunks smaller than k) and not; one compiled program per case computes all three metrics.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_loss_options import IGNORE, LAYOUTS, ROWS, TOKENS, VOCAB, _mesh

from jaxembed import hlo
from jaxembed.losses import accuracy, argmax, top_k

HIDDEN = 16
K = 3
CAP = 20.0
TIED = [3, 5, 40, ROWS - 2]  # one row four times; the last is padding (>= VOCAB)


def make_inputs(seed, dtype):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(*TOKENS, HIDDEN)).astype(np.float32)
    t = (rng.normal(size=(ROWS, HIDDEN)) / 2).astype(np.float32)
    t[TIED] = 1.5 * rng.normal(size=HIDDEN)  # an exact tie wherever it leads
    h, t = (np.asarray(jnp.asarray(a, dtype).astype(jnp.float32)) for a in (h, t))
    return h, t


def reference(h, t, k, *, vocab=VOCAB, softcap=None):
    """float64 values and ids of the k largest logits, ties to the lowest id."""
    z = np.asarray(h, np.float64).reshape(-1, HIDDEN) @ np.asarray(t, np.float64)[:vocab].T
    if softcap is not None:
        z = softcap * np.tanh(z / softcap)
    ids = np.argsort(-z, axis=-1, kind="stable")[:, :k]
    values = np.take_along_axis(z, ids, -1)
    return values.reshape(*TOKENS, k), ids.reshape(*TOKENS, k)


def labels_and_weights(ref_ids, seed):
    """Labels that are right (top-1), in the top 3, or wrong; ignored and out of range too."""
    rng = np.random.default_rng(seed)
    flat = ref_ids.reshape(-1, ref_ids.shape[-1])
    pick = rng.integers(0, 3, size=flat.shape[0])
    labels = np.where(pick == 0, flat[:, 0], np.where(pick == 1, flat[:, 2], rng.integers(0, VOCAB, size=flat.shape[0])))  # fmt: skip
    labels[:4] = [IGNORE, VOCAB, ROWS - 2, -1]  # ignored; padding; the padding twin; < 0
    weights = rng.uniform(0.0, 2.0, size=flat.shape[0]).astype(np.float32)
    return labels.reshape(TOKENS).astype(np.int32), weights.reshape(TOKENS)


def reference_accuracy(ref_ids, labels, weights, k, reduction="mean"):
    correct = (ref_ids[..., :k] == labels[..., None]).any(-1) & (labels >= 0) & (labels < VOCAB)
    kept = (labels != IGNORE) * weights
    if reduction == "none":
        return correct * kept
    return (correct * kept).sum() / kept.sum()


@functools.cache
def _program(layout, chunk, softcap):
    """All metrics of one case in one compiled program."""
    kw = dict(vocab_size=VOCAB, vocab_chunk_size=chunk, softcap=softcap)

    def metrics(h, t, labels, weights):
        values, ids = top_k(h, t, K, **kw)
        acc = dict(ignore_index=IGNORE, weights=weights, **kw)
        return (values, ids, argmax(h, t, **kw), accuracy(h, t, labels, **acc),
                accuracy(h, t, labels, k=K, reduction="none", **acc))  # fmt: skip

    return jax.jit(metrics)


def _put(layout, h, t, labels, weights, dtype):
    h, t = jnp.asarray(h, dtype), jnp.asarray(t, dtype)
    if LAYOUTS[layout] is None:
        return h, t, jnp.asarray(labels), jnp.asarray(weights)
    _, _, h_spec, w_spec = LAYOUTS[layout]
    mesh = _mesh(layout)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    tok = P(*h_spec[:1])
    return put(h, h_spec), put(t, w_spec), put(labels, tok), put(weights, tok)


CASES = [
    (layout, dtype, chunk, cap)
    for layout in LAYOUTS
    for dtype, chunk, cap in [(jnp.float32, None, None), (jnp.float32, 2, CAP), (jnp.bfloat16, 4, CAP)]
    if dtype == jnp.float32 or layout in ("fsdp2xtensor4-table-tensor-fsdp", "tensor8", "one-device")
]  # fmt: skip


@pytest.mark.parametrize(
    ("layout", "dtype", "chunk", "softcap"), CASES,
    ids=[f"{c[0]}-{jnp.dtype(c[1]).name}-{'chunked-capped' if c[2] else 'whole'}" for c in CASES],
)  # fmt: skip
def test_metrics_match_float64(layout, dtype, chunk, softcap):
    h, t = make_inputs(len(layout), dtype)
    ref_values, ref_ids = reference(h, t, K, softcap=softcap)
    labels, weights = labels_and_weights(ref_ids, len(layout))
    args = _put(layout, h, t, labels, weights, dtype)
    values, ids, top1, acc1, acc3 = _program(layout, chunk, softcap)(*args)
    assert values.dtype == jnp.float32 and ids.dtype == top1.dtype == jnp.int32
    assert ids.shape == values.shape == (*TOKENS, K) and top1.shape == TOKENS
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(top1, ref_ids[..., 0])
    np.testing.assert_allclose(values, ref_values, rtol=1e-5, atol=1e-5)
    tied = (ref_ids == np.array(TIED[:3])).all(-1)  # rows 3, 5, 40 in id order, never 62
    assert tied.sum() >= 4, "the inputs should tie at the top for several tokens"
    np.testing.assert_allclose(acc1, reference_accuracy(ref_ids, labels, weights, 1), rtol=1e-6)
    np.testing.assert_allclose(  # per token: top-3, weighted, 0 where ignored
        acc3, reference_accuracy(ref_ids, labels, weights, K, "none"), rtol=1e-6
    )
    if LAYOUTS[layout] is not None:  # laid out like hidden's tokens
        h_spec = LAYOUTS[layout][2]
        sharding = NamedSharding(_mesh(layout), P(*h_spec[:1]))
        assert top1.sharding.is_equivalent_to(sharding, 2)


def test_k_up_to_the_vocabulary_never_returns_padding():
    layout = "fsdp2xtensor4-table-tensor-fsdp"
    h, t = make_inputs(1, jnp.float32)
    args = _put(layout, h, t, np.zeros(TOKENS, np.int32), np.ones(TOKENS, np.float32), jnp.float32)
    values, ids = jax.jit(lambda h, t: top_k(h, t, VOCAB, vocab_size=VOCAB, vocab_chunk_size=4))(
        *args[:2]
    )
    ref_values, ref_ids = reference(h, t, VOCAB)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(values, ref_values, rtol=1e-5, atol=1e-5)
    assert (np.sort(np.asarray(ids), -1) == np.arange(VOCAB)).all()  # every real row once


def test_auto_mesh_under_jit_with_specs():
    """In an Auto mesh a traced array carries no layout: the specs say it, as for the loss."""
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    h, t = make_inputs(3, jnp.float32)
    specs = dict(hidden_spec=P("fsdp"), weight_spec=P("tensor", "fsdp"))
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    f = jax.jit(lambda h, t: top_k(h, t, K, vocab_size=VOCAB, vocab_chunk_size=4, **specs))
    values, ids = f(put(h, specs["hidden_spec"]), put(t, specs["weight_spec"]))
    ref_values, ref_ids = reference(h, t, K)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(values, ref_values, rtol=1e-5, atol=1e-5)


def largest_buffer(text):
    """Elements of the largest array any instruction of the per-device program names."""
    shapes = re.findall(r"\b(?:pred|[suf]\d+|bf16)\[([\d,]*)\]", text)
    return max(int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes)


def test_one_gather_of_candidates_and_no_vocab_logits():
    """A (fsdp=2, tensor=4) mesh, the table P("tensor", "fsdp"): each chunk's logits are
    psummed over fsdp (K), and the candidates [R, T, k] travel once, over tensor (R)."""
    mesh = _mesh("fsdp2xtensor4-table-tensor-fsdp")
    (tokens, vocab, hidden), k, chunk = ((4, 32), 4096, 32), 4, 256
    args = [
        jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, p))
        for s, p in (((*tokens, hidden), P("fsdp")), ((vocab, hidden), P("tensor", "fsdp")))
    ]
    f = lambda h, t: top_k(h, t, k, vocab_chunk_size=chunk)
    text = jax.jit(f).lower(*args).compile().as_text()
    local_tokens = 4 * 32  # the tokens are gathered over fsdp, which splits the hidden axis
    assert largest_buffer(text) < local_tokens * vocab // 4  # not even this device's rows
    found = [(c.kind, hlo.mesh_axes(c, mesh), c.trips) for c in hlo.collectives(text)]
    gathers = [c for c in hlo.collectives(text) if c.kind == "all-gather"]
    assert {axes for kind, axes, _ in found if kind == "all-gather"} == {("tensor",)}, found
    assert sum(c.result_bytes for c in gathers) == 4 * local_tokens * k * (4 + 4)  # f32 + i32
    assert {axes for kind, axes, _ in found if kind == "all-reduce"} == {("fsdp",)}, found
    assert all(c.trips == 1 for c in gathers)  # once, after the chunks


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda h, t, y: top_k(h, t, 0), ValueError, r"k=0 must be in \[1, vocab_size=64\]"),
        (lambda h, t, y: top_k(h, t, 62, vocab_size=61), ValueError,
         r"k=62 must be in \[1, vocab_size=61\]: ask for at most 61"),
        (lambda h, t, y: top_k(h, t, 1.5), TypeError, r"k must be a Python int, got 1.5"),
        (lambda h, t, y: argmax(h, t, softcap=-1.0), ValueError, r"softcap must be a positive"),
        (lambda h, t, y: accuracy(h, t, y, weights=y), TypeError,
         r"weights must be floating point .*got int32"),
        (lambda h, t, y: accuracy(h, t, y, reduction="max"), ValueError,
         r"reduction must be 'none', 'sum' or 'mean', got 'max'"),
        (lambda h, t, y: accuracy(h, t, y.astype(jnp.float32)), TypeError,
         r"labels must be integers"),
        (lambda h, t, y: top_k(h[..., :8], t, 2), ValueError,
         r"expected hidden \[\*tokens, 16\] for a table \(64, 16\); got hidden \(8, 4, 8\)"),
    ],
)  # fmt: skip
def test_bad_input(call, error, match):
    h, t = make_inputs(2, jnp.float32)
    with pytest.raises(error, match=match):
        call(jnp.asarray(h), jnp.asarray(t), jnp.zeros(TOKENS, jnp.int32))
