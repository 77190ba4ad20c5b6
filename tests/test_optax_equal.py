"""`jaxembed.optim.sgd` and `adagrad` are optax's `sgd` and `adagrad`, on every layout.

An optimizer named like optax's computes optax's formula at optax's defaults wherever the
row-sparse step can equal the dense one. For SGD and Adagrad it can: a row the batch does not
touch has a zero gradient, so optax's dense step leaves it, and its accumulator, where they
are. Each case runs N steps of jaxembed's row-sparse update (sharded, `impl="xla"` and
`impl="native"`) and N steps of optax on the dense gradient of the same lookup
(`jax.grad` through a plain `jnp.take` on one device), then compares the tables and the
accumulators (float32, rtol 1e-6), the initial state bitwise, and the untouched rows and
their state bitwise (optax's accumulator of an untouched row stays at its initial 0.1 too).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_embedding import make_mesh, put

import jaxembed
from jaxembed.kernels import native

ROWS, HIDDEN, STEPS = 64, 16, 4
LIVE = 48  # ids are drawn below LIVE: rows LIVE.. are never touched
ZERO_ROW = 50  # touched once, with a zero gradient (s stays 0 when it starts at 0)
SCHEDULE = optax.linear_schedule(init_value=0.3, end_value=0.05, transition_steps=3)

# name: (jaxembed's optimizer, optax's), built from the same arguments
CASES = {
    "sgd": lambda: (jaxembed.optim.sgd(0.1), optax.sgd(0.1)),
    "sgd_schedule": lambda: (jaxembed.optim.sgd(SCHEDULE), optax.sgd(SCHEDULE)),
    "adagrad": lambda: (jaxembed.optim.adagrad(0.1), optax.adagrad(0.1)),  # the defaults
    "adagrad_init0_eps": lambda: (
        jaxembed.optim.adagrad(0.5, initial_accumulator_value=0.0, eps=1e-3),
        optax.adagrad(0.5, initial_accumulator_value=0.0, eps=1e-3),
    ),
    "adagrad_schedule_eps0": lambda: (
        jaxembed.optim.adagrad(SCHEDULE, initial_accumulator_value=1.0, eps=0.0),
        optax.adagrad(SCHEDULE, initial_accumulator_value=1.0, eps=0.0),
    ),
}
# (mesh shape or None for one device, table spec, ids spec)
LAYOUTS = {
    "1-device": (None, None, None),
    "8-rows": ((8,), P("model", None), P("model")),
    "8-columns": ((8,), P(None, "model"), P()),
    "8-replicated": ((8,), P(), P("model")),
    "2x4-rows": ((2, 4), P("model", None), P("data")),
    "2x4-rows-over-data-model": ((2, 4), P(("data", "model"), None), P("data")),
    "2x4-columns": ((2, 4), P(None, "model"), P("data")),
    "2x4-rows-and-columns": ((2, 4), P("model", "data"), P()),
    "2x4-replicated": ((2, 4), P(), P("data")),
    "2x4-rows-and-ids-same-axis": ((2, 4), P("data", None), P("data")),
}
IMPLS = [
    "xla",
    pytest.param(
        "native",
        marks=pytest.mark.skipif(not native.available(), reason=f"{native.why_unavailable()}"),
    ),
]


def batches(seed):
    """STEPS (ids i32[8, 8], cotangent f32[8, 8, H]) pairs: duplicates, untouched rows."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(STEPS):
        ids = rng.integers(0, LIVE, size=(8, 8)).astype(np.int32)
        ids[:, :2] = 3  # a row every device touches, several times
        ct = rng.normal(size=(8, 8, HIDDEN)).astype(np.float32)
        if step == 0:
            ids[0, 0], ct[0, 0] = ZERO_ROW, 0.0
        out.append((ids, ct))
    return out


def optax_steps(dense, table, steps):
    """optax on the dense gradient of `sum(take(table, ids) * ct)`, on one device."""
    params = jnp.asarray(table)
    state = init = dense.init(params)

    @jax.jit
    def step(params, state, ids, ct):
        g = jax.grad(lambda t: jnp.sum(jnp.take(t, ids, axis=0) * ct))(params)
        updates, state = dense.update(g, state, params)
        return optax.apply_updates(params, updates), state

    for ids, ct in steps:
        params, state = step(params, state, ids, ct)
    return init, params, state


def jaxembed_steps(opt, table, steps, layout, impl):
    mesh_shape, w_spec, x_spec = LAYOUTS[layout]
    if mesh_shape is None:
        place = lambda x, spec: jnp.asarray(x)
    else:
        mesh = make_mesh(mesh_shape, AxisType.Explicit)
        place = lambda x, spec: put(x, mesh, spec)
    table_d = place(table, w_spec)
    state = init = opt.init(table_d)
    init = jax.tree.map(np.asarray, init)
    step = jax.jit(lambda t, s, ids, ct: opt.update(t, s, ids, ct, impl=impl),
                   donate_argnums=(0, 1))  # fmt: skip
    for ids, ct in steps:
        table_d, state = step(table_d, state, place(ids, x_spec), place(ct, x_spec))
    if mesh_shape is not None:
        assert table_d.sharding.is_equivalent_to(NamedSharding(mesh, w_spec), 2)
    return init, table_d, state


def accumulator(opt_state):
    """optax's sum of squares (adagrad), or None (sgd)."""
    rss = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "sum_of_squares"))
           if hasattr(s, "sum_of_squares")]  # fmt: skip
    return np.asarray(rss[0].sum_of_squares) if rss else None


def optax_cases():
    """Every case with both kernels on one device (the arguments are the formula's, the same
    on every layout); every other layout with optax's adagrad defaults on both kernels, and
    one of the other cases in turn, on the kernels in turn (so that each of them meets two or
    three more layouts, on both kernels)."""
    impls = {"xla": IMPLS[0], "native": IMPLS[1]}

    def param(case, layout, impl):
        marks = impls[impl].marks if impl == "native" else ()
        return pytest.param(case, layout, impl, marks=marks, id=f"{case}-{layout}-{impl}")

    full = ("1-device",)
    cases = [param(c, lay, i) for c in CASES for lay in full for i in impls]
    others = [c for c in CASES if c != "adagrad"]
    for n, lay in enumerate(lay for lay in LAYOUTS if lay not in full):
        cases += [param("adagrad", lay, i) for i in impls]
        turn = n + n // len(others)  # each of the others on both kernels over the layouts
        cases.append(param(others[n % len(others)], lay, ("xla", "native")[turn % 2]))
    return cases


@pytest.mark.parametrize(("case", "layout", "impl"), optax_cases())
def test_row_sparse_steps_equal_optax_dense_steps(case, layout, impl):
    opt, dense = CASES[case]()
    rng = np.random.default_rng(len(case) * 31 + len(layout))
    table = rng.normal(size=(ROWS, HIDDEN)).astype(np.float32)
    steps = batches(len(layout))
    theirs_init, theirs, theirs_state = optax_steps(dense, table, steps)
    ours_init, ours, ours_state = jaxembed_steps(opt, table, steps, layout, impl)

    ours, theirs = np.asarray(ours), np.asarray(theirs)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)
    assert int(ours_state.count) == STEPS
    touched = np.zeros(ROWS, bool)
    for ids, _ in steps:
        touched[ids.reshape(-1)] = True
    assert touched[ZERO_ROW] and not touched[LIVE:].all()
    np.testing.assert_array_equal(ours[~touched], table[~touched])
    np.testing.assert_array_equal(theirs[~touched], table[~touched])

    s0, s = accumulator(theirs_init), accumulator(theirs_state)
    if s is None:  # sgd: no state besides the count
        assert opt.formula.slots == () and ours_state.slots == {}
        return
    # the initial state is optax's, bitwise (0.1 by default, in the table's float32)
    assert ours_init.slots["accumulator"].dtype == s0.dtype == np.float32
    np.testing.assert_array_equal(ours_init.slots["accumulator"], s0)
    acc = np.asarray(ours_state.slots["accumulator"])
    np.testing.assert_allclose(acc, s, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(acc[~touched], s0[~touched])  # untouched: the initial value
    np.testing.assert_array_equal(s[~touched], s0[~touched])


def test_the_defaults_are_optax_defaults():
    """`adagrad(lr)`: optax's s0 = 0.1 and eps = 1e-7 (inside the root); FBGEMM's
    element-wise Adagrad, s0 = 0 and eps = 1e-8 outside the root, is `fbgemm_adagrad`."""
    ours = jaxembed.optim.adagrad(0.1).formula
    assert ours.slots[0].init == 0.1 and ours.hparams["eps"] == 1e-7
    fbgemm = jaxembed.optim.fbgemm_adagrad(0.1).formula
    assert fbgemm.name == "fbgemm_adagrad"
    assert fbgemm.slots[0].init == 0.0 and fbgemm.hparams["eps"] == 1e-8


def test_fbgemm_adagrad_trains_differently_from_optax_adagrad():
    """The issue's symptom, kept visible: the FBGEMM variant is not optax's at the defaults."""
    rng = np.random.default_rng(0)
    table = rng.normal(size=(ROWS, HIDDEN)).astype(np.float32)
    steps = batches(0)
    _, theirs, _ = optax_steps(optax.adagrad(0.1), table, steps)
    _, ours, _ = jaxembed_steps(jaxembed.optim.fbgemm_adagrad(0.1), table, steps, "1-device",
                                "xla")  # fmt: skip
    assert np.abs(np.asarray(ours) - np.asarray(theirs)).max() > 1e-2


@pytest.mark.parametrize("momentum", [0.9, 0.5])
def test_sgd_momentum_is_refused_with_the_fix(momentum):
    with pytest.raises(ValueError, match=rf"sgd: momentum={momentum} is not row-sparse.*optax"):
        jaxembed.optim.sgd(0.1, momentum=momentum)
    # momentum 0 (or None) is optax's plain SGD: accepted
    assert jaxembed.optim.sgd(0.1, momentum=0.0) == jaxembed.optim.sgd(0.1)
