"""The lookup on LLM layouts as they are written: FSDP x tensor parallel (issue 44).

On an 8-device `fsdp=2 x tensor=4` mesh, the table `P("tensor", "fsdp")` (its hidden axis over
the data-parallel axis, FSDP's), `P("tensor", None)` or `P(("fsdp", "tensor"), None)`, the ids
over fsdp, in float32 and bfloat16: the output and the table's gradient against a float64
dense numpy reference, the gradient born in the table's own layout, and the plan's wire bytes
against the compiled program's (`jaxembed.hlo.total_wire_bytes`). Where the output's batch is
split over fsdp (the activations' layout of an FSDP program), the plan all-gathers the table's
shard over fsdp and reduce-scatters its gradient (the weight gather) when that sends fewer
bytes than moving the ids and the output. Compiled programs are cached per case.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed
from jaxembed import hlo
from jaxembed.plan.cost import ring_wire_bytes

ROWS, VOCAB, HIDDEN = 256, 250, 32  # a padded table: 6 rows past the vocabulary
IDS = (8, 16)
PADDING = 7

# name: (table spec, ids spec, out spec, the move "auto" takes) on fsdp=2 x tensor=4
LAYOUTS = {
    "fsdp-tensor": (P("tensor", "fsdp"), P("fsdp", None), P("fsdp", None, None), "gather"),
    # the activations of docs/llm.md's decoder: the hidden axis over tensor (a free slice)
    "fsdp-tensor-activations": (
        P("tensor", "fsdp"), P("fsdp", None), P("fsdp", None, "tensor"), "gather"),
    # every device holds every id: the body slices them over fsdp for free
    "fsdp-tensor-replicated-ids": (P("tensor", "fsdp"), P(), P("fsdp", None, None), "gather"),
    # no out_spec: the output keeps its default, P(None, None, "fsdp"); nothing to gather for
    "fsdp-tensor-default-out": (P("tensor", "fsdp"), P("fsdp", None), None, "none"),
    "rows-tensor": (P("tensor", None), P("fsdp", None), None, "none"),
    "rows-both": (P(("fsdp", "tensor"), None), P("fsdp", None), None, "none"),
}  # fmt: skip


@functools.cache
def mesh():
    return jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 2)


def make_inputs(seed, dtype):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=IDS).astype(np.int32)
    ids.reshape(-1)[:4] = [-1, VOCAB, ROWS - 1, PADDING]  # out of range, padding row, padding_idx
    table = rng.normal(size=(ROWS, HIDDEN)).astype(np.float32)
    ct = rng.normal(size=(*IDS, HIDDEN)).astype(np.float32)
    # the reference sees the very values the program sees
    table = np.asarray(jnp.asarray(table, dtype).astype(jnp.float32))
    ct = np.asarray(jnp.asarray(ct, dtype).astype(jnp.float32))
    return ids, table, ct


def reference(ids, table, ct):
    """float64 output and table gradient for the cotangent ct, in numpy."""
    valid = (ids >= 0) & (ids < VOCAB) & (ids != PADDING)
    safe = np.where(valid, ids, 0)
    out = np.where(valid[..., None], table.astype(np.float64)[safe], 0.0)
    grad = np.zeros((ROWS, HIDDEN))
    np.add.at(grad, safe[valid], ct.astype(np.float64)[valid])
    return out, grad


def plan_of(layout, dtype=jnp.float32, move="auto", shape=IDS, table=(ROWS, HIDDEN)):
    w_spec, x_spec, out_spec, _ = LAYOUTS[layout]
    return jaxembed.plan_embedding(
        mesh(), shape, table, x_spec=x_spec, weight_spec=w_spec, out_spec=out_spec,
        vocab_size=VOCAB, padding_idx=PADDING, dtype=dtype, table_move=move,
    )  # fmt: skip


@functools.cache
def program(layout, dtype, move="auto"):
    """(compiled step, the inputs' specs): the output and the table's gradient for ct."""
    w_spec, x_spec, out_spec, _ = LAYOUTS[layout]
    plan = plan_of(layout, dtype, move)

    def step(ids, table, ct):
        f = lambda t: jaxembed.embedding(
            ids, t, vocab_size=VOCAB, padding_idx=PADDING, out_spec=out_spec, table_move=move
        )
        out, vjp = jax.vjp(f, table)
        return out, vjp(ct)[0]

    specs = (x_spec, w_spec, plan.out_spec)
    shapes = (IDS, (ROWS, HIDDEN), (*IDS, HIDDEN))
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh(), p))
            for s, d, p in zip(shapes, (jnp.int32, dtype, dtype), specs, strict=True)]  # fmt: skip
    return jax.jit(step).lower(*args).compile(), specs


def run(layout, dtype, move="auto", seed=0):
    compiled, specs = program(layout, dtype, move)
    ids, table, ct = make_inputs(seed, dtype)
    args = [jax.device_put(jnp.asarray(a, d), NamedSharding(mesh(), s))
            for a, d, s in zip((ids, table, ct), (jnp.int32, dtype, dtype), specs, strict=True)]  # fmt: skip
    out, grad = compiled(*args)
    return (ids, table, ct), (out, grad), compiled


def check(layout, dtype, move="auto", seed=0):
    """Output and gradient against float64, in their layouts; the compiled bytes are the
    plan's (the CPU backend carries bfloat16 collectives as float32: priced in float32)."""
    (ids, table, ct), (out, grad), compiled = run(layout, dtype, move, seed)
    ref_out, ref_grad = reference(ids, table, ct)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_array_equal(np.asarray(out, np.float32), ref_out.astype(np.float32))
    np.testing.assert_allclose(np.asarray(grad, np.float32), ref_grad, **tol)
    assert not np.asarray(grad, np.float32)[VOCAB:].any()  # padding rows: exactly zero
    assert not np.asarray(grad, np.float32)[PADDING].any()
    plan = plan_of(layout, dtype, move)
    assert out.dtype == dtype and grad.dtype == dtype
    assert out.sharding.is_equivalent_to(NamedSharding(mesh(), plan.out_spec), 3)
    w_spec = LAYOUTS[layout][0]
    assert grad.sharding.is_equivalent_to(NamedSharding(mesh(), w_spec), 2)  # the table's own
    on_cpu = plan_of(layout, jnp.float32, move)
    text = compiled.as_text()
    assert hlo.total_wire_bytes(text) == on_cpu.wire_bytes, str(on_cpu)
    kinds = {"psum": "all-reduce", "psum_scatter": "reduce-scatter", "all_gather": "all-gather"}
    planned = sorted((kinds[c.op], c.axes) for c in (*plan.forward, *plan.backward))
    actual = sorted((c.kind, hlo.mesh_axes(c, mesh())) for c in hlo.collectives(text))
    assert actual == planned, str(plan)
    return plan, compiled


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_float64_and_the_plans_bytes(layout, dtype):
    plan, _ = check(layout, dtype, seed=len(layout))
    assert plan.table_move == LAYOUTS[layout][3], str(plan)
    if plan.table_move == "gather":
        assert plan.gathered_axes == ("fsdp",) and plan.weight_spec == P("tensor", "fsdp")
        assert plan.body_table_shard_shape == (ROWS // 4, HIDDEN)
        if dtype == jnp.bfloat16:  # the table travels in its own dtype, the gradient in f32
            table = next(c for c in plan.forward if c.operand == "table")
            assert table.dtype == "bfloat16"


@pytest.mark.parametrize("move", ["gather", "none"])
def test_forced_moves_match_float64(move):
    check("fsdp-tensor", jnp.float32, move, seed=3)


def test_the_weight_gather_sends_fewer_bytes_than_moving_ids_and_output():
    """FSDP's case (table P(tensor, fsdp), ids and output over fsdp): the compiled program
    with the weight gather sends less than the one that moves ids and activations, by the
    plan's own figures, and "auto" takes it."""
    gather, none = plan_of("fsdp-tensor", move="gather"), plan_of("fsdp-tensor", move="none")
    g, n = (hlo.total_wire_bytes(program("fsdp-tensor", jnp.float32, m)[0].as_text())
            for m in ("gather", "none"))  # fmt: skip
    assert (g, n) == (gather.wire_bytes, none.wire_bytes)
    assert g < n
    table = ROWS // 4 * HIDDEN * 4  # f32[V/4, H]: the shard whole over fsdp
    assert [(c.phase, c.op, c.axes, c.operand, c.wire_bytes) for c in gather.forward + gather.backward] == [
        ("forward", "all_gather", ("fsdp",), "table", ring_wire_bytes("all-gather", 2, table)),
        ("forward", "psum", ("tensor",), "out", ring_wire_bytes("all-reduce", 4, 4 * 16 * HIDDEN * 4)),
        ("backward", "psum_scatter", ("fsdp",), "weight_grad",
         ring_wire_bytes("reduce-scatter", 2, table // 2)),
    ]  # fmt: skip
    auto = plan_of("fsdp-tensor")
    assert auto.table_move == "gather" and auto.wire_bytes == g
    assert dict((m, w) for m, w, _ in auto.move_alternatives) == {"none": n, "gather": g}
    assert auto.memory.gathered_table == table and auto.memory.peak_bytes > none.memory.peak_bytes
    text = str(auto)
    for needle in ("table move: gather over ('fsdp',)", "fewest bytes", "psum_scatter",
                   "weight_grad", "gathered table"):  # fmt: skip
        assert needle in text, text


def test_a_large_table_keeps_its_place():
    """Few tokens against a large shard: moving the ids and the output is cheaper, and "auto"
    prices the gather beside it and keeps the table where it is."""
    plan = plan_of("fsdp-tensor", shape=(2, 8), table=(65536, HIDDEN))
    moves = dict((m, w) for m, w, _ in plan.move_alternatives)
    assert plan.table_move == "none" and moves["none"] < moves["gather"]
    assert not plan.gathered_axes and all(c.operand != "table" for c in plan.forward)


def test_gather_needs_the_output_split_over_the_hidden_axes():
    plan = plan_of("fsdp-tensor-default-out")
    assert plan.out_spec == P(None, None, "fsdp") and plan.table_move == "none"
    assert "does not split its batch over the table's hidden axes" in plan.move_reason
    with pytest.raises(ValueError, match=r"table_move='gather' needs .* pass an out_spec"):
        plan_of("fsdp-tensor-default-out", move="gather")
    with pytest.raises(ValueError, match="table_move must be 'auto', 'gather' or 'none'"):
        plan_of("fsdp-tensor", move="fsdp")
    assert not plan_of("rows-tensor").move_reason  # no hidden split: nothing weighed, printed
    with pytest.raises(ValueError, match="nothing to gather"):
        plan_of("rows-tensor", move="gather")


def test_auto_mesh_with_stated_layouts_gathers_too():
    """An Auto mesh (MaxText's): the layouts stated, the same plan and the same values."""
    auto_mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    w_spec, x_spec, out_spec, _ = LAYOUTS["fsdp-tensor"]
    ids, table, ct = make_inputs(5, jnp.float32)
    put = lambda a, spec: jax.device_put(a, NamedSharding(auto_mesh, spec))

    @jax.jit
    def step(ids, table, ct):
        f = lambda t: jaxembed.embedding(
            ids, t, vocab_size=VOCAB, padding_idx=PADDING, mesh=auto_mesh, x_spec=x_spec,
            weight_spec=w_spec, out_spec=out_spec,
        )  # fmt: skip
        out, vjp = jax.vjp(f, table)
        return out, vjp(ct)[0]

    args = (put(ids, x_spec), put(table, w_spec), put(ct, out_spec))
    out, grad = step(*args)
    ref_out, ref_grad = reference(ids, table, ct)
    np.testing.assert_array_equal(np.asarray(out), ref_out.astype(np.float32))
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-6, atol=1e-6)
    assert grad.sharding.is_equivalent_to(NamedSharding(auto_mesh, w_spec), 2)
    text = step.lower(*args).compile().as_text()
    assert hlo.total_wire_bytes(text) == plan_of("fsdp-tensor").wire_bytes
