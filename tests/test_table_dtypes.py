"""Tables of every float dtype under impl="auto": lookups, bags and updates against float64.

The native kernels take float32 and bfloat16 tables; `impl="auto"` used to pick them for
float16 (and float64) tables too, and `embedding_bag` and `opt.update` then failed inside the
kernel with a TypeError. Now "auto" runs XLA's kernels for those, the plan says so, and the
compiled program holds a native custom call exactly when the plan says "native".

Each case runs on one device and on an 8-device mesh with the table's rows split (and the
ids' batch), against a float64 numpy reference, within a tolerance of the table's dtype:
the kernels compute in float32 and round the result to the table's dtype (float64 tables
too, so their tolerance is float32's, even for the max combiner: it pools in float32).
float64 runs in a subprocess with JAX_ENABLE_X64=1.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bag_reference import embedding_bag_reference
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed
from jaxembed.kernels import native
from jaxembed.optim import reference

ROWS, HIDDEN, BATCH, LENGTH = 64, 8, 8, 4
# |got - want| <= tol + tol·|want|: a few roundings in the table's dtype (float32 arithmetic).
TOLERANCE = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 1e-5, "float64": 1e-5}
DTYPES = ("float16", "bfloat16", "float32")  # float64: test_float64_tables_under_x64
LAYOUTS = ("one-device", "mesh8-rows")
OPTIMIZERS = {
    "sgd": lambda: jaxembed.optim.sgd(0.1),
    "rowwise_adagrad": lambda: jaxembed.optim.rowwise_adagrad(0.1),
}
UPDATES = (("sgd", None), ("rowwise_adagrad", None), ("rowwise_adagrad", "sum"))


def make_case(dtype: str, seed: int):
    """A table stored in `dtype`, dense bags of ids (empty slots, repeats, an empty bag), and
    a gradient for each slot and each bag, stored in `dtype` too."""
    rng = np.random.default_rng(seed)
    table = np.asarray(jnp.asarray(rng.standard_normal((ROWS, HIDDEN)), dtype))
    ids = rng.integers(0, ROWS, size=(BATCH, LENGTH)).astype(np.int32)
    ids[rng.random(ids.shape) < 0.25] = -1
    ids[0, :] = -1  # an empty bag
    ids[1, :] = [5, 5, 5, 9]  # a row read (and updated) several times
    ids[2:, 0] = 3  # a row every device's ids read
    slot_grad = np.asarray(jnp.asarray(rng.standard_normal((BATCH, LENGTH, HIDDEN)), dtype))
    bag_grad = np.asarray(jnp.asarray(rng.standard_normal((BATCH, HIDDEN)), dtype))
    return table, ids, slot_grad, bag_grad


def place(layout: str, table, ids, *grads):
    """The operands as the layout puts them: plain arrays, or rows (and the batch) split."""
    if layout == "one-device":
        return (jnp.asarray(table), jnp.asarray(ids), *(jnp.asarray(g) for g in grads))
    mesh = jax.make_mesh((8,), ("model",), axis_types=(AxisType.Explicit,))
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    rows_split = put(table, P("model", None))
    return (rows_split, put(ids, P("model")), *(put(g, P("model")) for g in grads))


def assert_close(got, want, dtype: str) -> None:
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)


def expected_impl(dtype: str) -> str:
    return "native" if native.supports_dtype(dtype) and native.available() else "xla"


def check_runs_what_the_plan_says(f, *args, dtype: str) -> None:
    """A native custom call is in the program exactly when the plan reports impl="native"."""
    text = jax.jit(f).lower(*args).as_text()
    assert ("jaxembed_" in text) == (expected_impl(dtype) == "native"), expected_impl(dtype)


def check_embedding(dtype: str, layout: str) -> None:
    table, ids, _, _ = make_case(dtype, 0)
    safe = np.maximum(ids, 0)
    t, x = place(layout, table, safe)
    out = jaxembed.embedding(x, t, impl="auto")
    assert out.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(out, np.float64), table.astype(np.float64)[safe])


def check_embedding_bag(dtype: str, layout: str, combiner: str) -> None:
    table, ids, _, _ = make_case(dtype, 1)
    t, x = place(layout, table, ids)
    f = lambda x, t: jaxembed.embedding_bag(x, t, combiner=combiner, impl="auto")
    out = f(x, t)
    assert out.dtype == jnp.dtype(dtype)
    want = embedding_bag_reference(table.astype(np.float64), ids, combiner=combiner)
    if combiner == "max" and dtype != "float64":  # a maximum of stored values: exact
        np.testing.assert_array_equal(np.asarray(out, np.float64), want)
    else:
        assert_close(out, want, dtype)
    check_runs_what_the_plan_says(f, x, t, dtype=dtype)


def check_update(dtype: str, layout: str, name: str, combiner: str | None) -> None:
    table, ids, slot_grad, bag_grad = make_case(dtype, 2)
    opt = OPTIMIZERS[name]()
    if combiner is None:  # a plain lookup's update: ids must be rows here
        ids = np.maximum(ids, 0)
        grad, slots = slot_grad, slot_grad
    else:  # a bag's: every slot of bag b gets bag_grad[b]
        grad = bag_grad
        slots = np.broadcast_to(bag_grad[:, None, :], (*ids.shape, HIDDEN))
    t, x, g = place(layout, table, ids, grad)
    kw = {} if combiner is None else {"combiner": combiner}
    f = lambda t, s, x, g: opt.update(t, s, x, g, impl="auto", **kw)
    state = opt.init(t)
    new, new_state = f(t, state, x, g)
    assert new.dtype == jnp.dtype(dtype)
    want, want_slots = reference.sparse_step(
        opt.formula, table.astype(np.float64), reference.init_states(opt.formula, ROWS, HIDDEN),
        ids, slots.astype(np.float64), count=0,
    )  # fmt: skip
    assert_close(new, want, dtype)
    for slot, ref in zip(opt.formula.slots, want_slots, strict=True):
        assert_close(new_state.slots[slot.name], ref, "float32")  # state is float32
    untouched = np.setdiff1d(np.arange(ROWS), ids[ids >= 0])
    np.testing.assert_array_equal(np.asarray(new)[untouched], table[untouched])
    check_runs_what_the_plan_says(f, t, opt.init(t), x, g, dtype=dtype)


def check_all(dtype: str) -> None:
    """Every case of this file for `dtype` (the float64 subprocess runs this)."""
    for layout in LAYOUTS:
        check_embedding(dtype, layout)
        for combiner in ("sum", "mean", "max"):
            check_embedding_bag(dtype, layout, combiner)
        for name, combiner in UPDATES:
            check_update(dtype, layout, name, combiner)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding(dtype, layout):
    check_embedding(dtype, layout)


@pytest.mark.parametrize("combiner", ["sum", "mean", "max"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_bag(dtype, layout, combiner):
    check_embedding_bag(dtype, layout, combiner)


@pytest.mark.parametrize(
    ("name", "combiner"), UPDATES, ids=["sgd", "rowwise_adagrad", "rowwise_adagrad-bag-sum"]
)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_update(dtype, layout, name, combiner):
    check_update(dtype, layout, name, combiner)


@pytest.mark.parametrize("dtype", [*DTYPES, "float64"])
def test_plan_reports_the_kernels_for_the_dtype(dtype):
    mesh = jax.sharding.AbstractMesh((8,), ("model",))
    plan = jaxembed.plan_embedding_bag(
        mesh, (BATCH, LENGTH), (ROWS, HIDDEN), combiner="sum", x_spec=P("model"),
        weight_spec=P("model", None), dtype=dtype, backend="cpu",
    )  # fmt: skip
    assert plan.impl == expected_impl(dtype)


@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_native_impl_refuses_other_dtypes(dtype):
    match = rf"impl='native' takes float32 or bfloat16 tables, this table is {dtype}: use impl='xla' or 'auto'"
    mesh = jax.sharding.AbstractMesh((8,), ("model",))
    with pytest.raises(ValueError, match=match):
        jaxembed.plan_embedding(
            mesh, (BATCH, LENGTH), (ROWS, HIDDEN), x_spec=P("model"),
            weight_spec=P("model", None), dtype=dtype, backend="cpu", impl="native",
        )  # fmt: skip
    table, ids, _, bag_grad = make_case("float16", 3)
    if dtype == "float16":  # the public calls say the same
        with pytest.raises(ValueError, match=match):
            jaxembed.embedding_bag(jnp.asarray(ids), jnp.asarray(table), impl="native")
        opt = jaxembed.optim.sgd(0.1)
        t, x, g = place("mesh8-rows", table, ids, bag_grad)
        with pytest.raises(ValueError, match=match):
            opt.update(t, opt.init(t), x, g, combiner="sum", impl="native")


def test_float32_table_takes_gradients_of_other_dtypes():
    """A float16 gradient of a float32 table: the native update reads it as float32."""
    table, ids, slot_grad, _ = make_case("float32", 4)
    ids = np.maximum(ids, 0)
    grad16 = np.asarray(jnp.asarray(slot_grad, jnp.float16))
    t, x, g = place("mesh8-rows", table, ids, grad16)
    opt = OPTIMIZERS["rowwise_adagrad"]()
    new, _ = opt.update(t, opt.init(t), x, g, impl="auto")
    want, _ = reference.sparse_step(
        opt.formula, table.astype(np.float64), reference.init_states(opt.formula, ROWS, HIDDEN),
        ids, grad16.astype(np.float64), count=0,
    )  # fmt: skip
    assert_close(new, want, "float32")


def test_float64_tables_under_x64():
    """float64 tables (x64 on: a fresh process) run XLA's kernels under impl="auto"."""
    code = textwrap.dedent(
        f"""
        import sys, warnings
        warnings.filterwarnings("error", module="jaxembed")  # as pyproject's filterwarnings
        warnings.filterwarnings("ignore", message="jaxembed's native CPU kernels are unavailable")
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import jax
        assert jax.config.jax_enable_x64 and len(jax.devices()) == 8
        import test_table_dtypes as t
        t.check_all("float64")
        print("ok")
        """
    )
    env = dict(os.environ, JAX_ENABLE_X64="1")  # XLA_FLAGS (8 devices) as this process's
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr
