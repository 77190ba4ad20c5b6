"""The loss on LLM layouts as they are written: FSDP x tensor parallel (issue 44).

On an 8-device `fsdp=2 x tensor=4` mesh, with the table `P("tensor", "fsdp")` (its hidden
axis over the data-parallel axis, FSDP's), rows over `tensor` or over both axes, and
sequence-parallel activations, in float32 and bfloat16: the loss and its gradients (hidden
and table) against a float64 dense numpy reference, and the plan's wire bytes against the
compiled program's (`jaxembed.hlo.total_wire_bytes`, loops counted). On the Gemma layout the
plan all-gathers the table's shard over fsdp and reduce-scatters its gradient (the
weight-gathering move) rather than psum every logits block over fsdp. "auto" chunks fit the
memory target; a user's int wins. Compiled programs are cached per case.
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
from jaxembed.plan.cost import ring_wire_bytes

ROWS, VOCAB, HIDDEN = 256, 250, 32  # a padded table: 6 rows past the vocabulary
TOKENS = (4, 8)

# name: (hidden spec, table spec) on fsdp=2 x tensor=4
LAYOUTS = {
    "gemma": (P("fsdp", None, "tensor"), P("tensor", "fsdp")),
    "fsdp-tokens": (P("fsdp"), P("tensor", "fsdp")),
    "sequence-parallel": (P("fsdp", "tensor"), P("tensor", "fsdp")),
    "rows-tensor": (P("fsdp"), P("tensor", None)),
    "rows-both": (P("fsdp"), P(("fsdp", "tensor"), None)),
    # every device holds every token: the plan slices them over fsdp and gathers the table
    "replicated-tokens": (P(), P("tensor", "fsdp")),
}
# hidden given in the layout the logits-psum move runs it in: no reshard before the loss
ALL_LAYOUTS = {**LAYOUTS, "kernel-layout": (P(None, None, "fsdp"), P("tensor", "fsdp"))}


@functools.cache
def mesh():
    return jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 2)


def make_inputs(seed, dtype):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(*TOKENS, HIDDEN)).astype(np.float32)
    t = (rng.normal(size=(ROWS, HIDDEN)) / 3).astype(np.float32)
    labels = rng.integers(0, VOCAB, size=TOKENS).astype(np.int32)
    ct = rng.normal(size=TOKENS).astype(np.float32)
    # the reference sees the very values the program sees
    h = np.asarray(jnp.asarray(h, dtype).astype(jnp.float32))
    t = np.asarray(jnp.asarray(t, dtype).astype(jnp.float32))
    return h, t, labels, ct


def reference(h, t, labels, ct):
    """float64 loss, hidden and table gradients for the cotangent ct, in numpy."""
    h, t = h.astype(np.float64), t.astype(np.float64)
    logits = h @ t[:VOCAB].T  # [*tokens, V]
    m = logits.max(-1, keepdims=True)
    e = np.exp(logits - m)
    lse = m[..., 0] + np.log(e.sum(-1))
    loss = lse - np.take_along_axis(logits, labels[..., None], -1)[..., 0]
    dz = e / e.sum(-1, keepdims=True)
    np.put_along_axis(dz, labels[..., None], np.take_along_axis(dz, labels[..., None], -1) - 1, -1)
    dz *= ct[..., None]
    dt = np.zeros_like(t)
    dt[:VOCAB] = np.einsum("bsv,bsh->vh", dz, h)
    return loss, dz @ t[:VOCAB], dt


@functools.cache
def program(layout, dtype, move="auto", chunk="auto", memory_target=None):
    """(compiled step, inputs' shardings): loss and both gradients for a cotangent."""
    h_spec, w_spec = ALL_LAYOUTS[layout]

    def step(h, t, labels, ct):
        f = lambda h, t: vocab_parallel_cross_entropy(
            h, t, labels, vocab_size=VOCAB, table_move=move, vocab_chunk_size=chunk,
            memory_target=memory_target,
        )  # fmt: skip
        loss, vjp = jax.vjp(f, h, t)
        return (loss, *vjp(ct))

    tok = P(*h_spec[:2])
    specs = (h_spec, w_spec, tok, tok)
    shapes = ((*TOKENS, HIDDEN), (ROWS, HIDDEN), TOKENS, TOKENS)
    dtypes = (dtype, dtype, jnp.int32, jnp.float32)
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh(), p))
            for s, d, p in zip(shapes, dtypes, specs, strict=True)]  # fmt: skip
    return jax.jit(step).lower(*args).compile(), specs


def plan_of(layout, dtype=jnp.float32, **kwargs):
    h_spec, w_spec = ALL_LAYOUTS[layout]
    return plan_cross_entropy(mesh(), (*TOKENS, HIDDEN), (ROWS, HIDDEN), hidden_spec=h_spec,
                              weight_spec=w_spec, vocab_size=VOCAB, dtype=dtype, **kwargs)  # fmt: skip


def run(layout, dtype, seed=0, **kwargs):
    compiled, specs = program(layout, dtype, **kwargs)
    h, t, labels, ct = make_inputs(seed, dtype)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh(), spec))
    args = [put(jnp.asarray(a, d), s) for a, d, s in
            zip((h, t, labels, ct), (dtype, dtype, jnp.int32, jnp.float32), specs, strict=True)]  # fmt: skip
    loss, dh, dt = compiled(*args)
    return (h, t, labels, ct), (loss, dh, dt), compiled


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_float64_and_the_plans_bytes(layout, dtype):
    (h, t, labels, ct), (loss, dh, dt), compiled = run(layout, dtype, seed=len(layout))
    ref_loss, ref_dh, ref_dt = reference(h, t, labels, ct)
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-5, atol=2e-5)  # float32 in both
    np.testing.assert_allclose(np.asarray(dh, np.float32), ref_dh, **tol)
    np.testing.assert_allclose(np.asarray(dt, np.float32), ref_dt, **tol)
    assert not np.asarray(dt, np.float32)[VOCAB:].any()  # padding rows: exactly zero
    h_spec, w_spec = LAYOUTS[layout]
    assert dt.sharding.is_equivalent_to(NamedSharding(mesh(), w_spec), 2)  # the table's own
    assert dh.sharding.is_equivalent_to(NamedSharding(mesh(), h_spec), 3)
    plan = plan_of(layout, dtype)
    assert plan.table_move == ("none" if w_spec[1] is None else "gather"), plan
    # The CPU backend carries bfloat16 collectives as float32: price the plan there in float32.
    on_cpu = plan_of(layout, jnp.float32)
    assert hlo.total_wire_bytes(compiled.as_text()) == on_cpu.wire_bytes, str(on_cpu)
    if dtype == jnp.bfloat16 and plan.gathered_axes:  # the table travels in its own dtype
        assert plan.wire_bytes < on_cpu.wire_bytes


def test_gemma_layout_gathers_the_table():
    """V=32768, H=512, 8 x 512 tokens: the plan all-gathers the table's fsdp shards (8 MiB
    each way) where the logits-psum plan sends each [2048 x 2, 8192] logits block over fsdp."""
    h_spec, w_spec = LAYOUTS["gemma"]
    kw = dict(hidden_spec=h_spec, weight_spec=w_spec)
    auto = plan_cross_entropy(mesh(), (8, 512, 512), (32768, 512), **kw)
    none = plan_cross_entropy(mesh(), (8, 512, 512), (32768, 512), table_move="none", **kw)
    assert (auto.table_move, auto.gathered_axes, auto.hidden_spec) == (
        "gather", ("fsdp",), P("fsdp", None, None))  # fmt: skip
    assert auto.collectives == (
        ("forward", "all_gather", ("tensor",), "hidden"),
        ("forward", "all_gather", ("fsdp",), "table shard"),
        ("forward", "all_gather", ("tensor",), "softmax statistics"),
        ("backward", "psum", ("tensor",), "hidden_grad"),
        ("backward", "psum_scatter", ("fsdp",), "table_grad"),
    )
    mib = 2**20
    table = ring_wire_bytes("all-gather", 2, 8192 * 512 * 4)  # f32[V/4, H] gathered over fsdp
    assert table == 8 * mib and auto.wire_bytes == 25.09375 * mib
    logits = ring_wire_bytes("all-reduce", 2, 4096 * 4096 * 4)  # f32[T, C] psummed over fsdp
    assert none.num_chunks == 2 and logits == 64 * mib  # auto chunks: 64 MiB blocks
    assert none.wire_bytes > 4 * logits > 10 * auto.wire_bytes
    assert dict((m, w) for m, w, _ in auto.alternatives) == {
        "none": none.wire_bytes, "gather": auto.wire_bytes}  # fmt: skip
    text = str(auto)
    assert "fewest bytes" in text and "psum_scatter" in text and "25.09 MiB" in text


def test_gathered_bytes_below_the_logits_psum_in_the_compiled_program():
    """Both moves forced on the Gemma layout, compiled: the weight gather sends less."""
    gather = program("gemma", jnp.float32, move="gather")[0]
    none = program("gemma", jnp.float32, move="none", chunk=None)[0]
    g, n = (hlo.total_wire_bytes(c.as_text()) for c in (gather, none))
    assert g < n, (g, n)
    kinds = {c.kind for c in hlo.collectives(gather.as_text())}
    assert "reduce-scatter" in kinds  # the table's gradient, back over fsdp


def test_forced_moves_match_float64():
    for move, chunk in (("none", "auto"), ("none", 16), ("gather", 16)):
        (h, t, labels, ct), (loss, dh, dt), _ = run("fsdp-tokens", jnp.float32, move=move,
                                                     chunk=chunk)  # fmt: skip
        ref_loss, ref_dh, ref_dt = reference(h, t, labels, ct)
        np.testing.assert_allclose(loss, ref_loss, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(dh, ref_dh, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(dt, ref_dt, rtol=2e-5, atol=2e-5)


def test_auto_chunks_fit_the_memory_target_and_an_int_wins():
    target = 16 * 24 * 4  # f32[16 tokens, 24 rows]: the largest divisor of 64 that fits is 16
    plan = plan_of("gemma", memory_target=target)
    assert (plan.local_tokens, plan.rows_per_shard, plan.chunk_rows) == (16, 64, 16)
    assert plan.logits_block_bytes <= target < plan.local_tokens * 32 * 4
    assert "largest divisor" in plan.chunk_reason
    assert plan_of("gemma").chunk_rows == 64  # 64 MiB by default: all rows
    assert plan_of("gemma", memory_target=target, vocab_chunk_size=32).chunk_rows == 32
    assert plan_of("gemma", memory_target=target, vocab_chunk_size=None).chunk_rows == 64
    assert plan_of("gemma", memory_target=1).chunk_rows == 1  # nothing fits: one row
    # run chunked: the same values, and the bytes of the loop counted per trip
    (h, t, labels, ct), (loss, dh, dt), compiled = run("gemma", jnp.float32,
                                                       memory_target=target)  # fmt: skip
    for got, want in zip((loss, dh, dt), reference(h, t, labels, ct), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert hlo.total_wire_bytes(compiled.as_text()) == plan.wire_bytes


def test_chunked_logits_psum_counts_every_chunk():
    """Forced to psum logits (hidden given in the kernel's layout: no reshard), chunked: the
    plan's bytes count each chunk's psum twice (forward, backward), as the HLO's loops do."""
    plan = plan_of("kernel-layout", table_move="none", vocab_chunk_size=16)
    assert plan.num_chunks == 4 and not plan.saves_logits
    chunk = ring_wire_bytes("all-reduce", 2, 32 * 16 * 4)  # f32[32 tokens, 16 rows]
    psums = [c for c in plan.priced_collectives if c[3] == "logits chunk"]
    assert [c[4] for c in psums] == [4 * chunk, 4 * chunk]
    compiled = program("kernel-layout", jnp.float32, move="none", chunk=16)[0]
    assert hlo.total_wire_bytes(compiled.as_text()) == plan.wire_bytes
    # hidden's hidden dim takes fsdp here: its tokens cannot split over it, no weight gather
    assert [m for m, _, _ in plan_of("kernel-layout").alternatives] == ["none"]
