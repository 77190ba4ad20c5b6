"""jaxembed.optim: row-sparse updates against the float64 reference, on every table layout.

Each case runs several steps with duplicate ids, a padding_idx, out-of-range ids and a
padded vocabulary, and checks the table and every state slot against
`jaxembed.optim.reference.sparse_step` (1e-5 relative), that untouched rows and their state
are bitwise unchanged, and that the compiled update holds no table-sized buffer besides the
donated table and state.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from bag_reference import iter_bags
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_embedding import check_hlo_against_plan, make_inputs, make_mesh, put

import jaxembed
from jaxembed.optim import reference

ROWS, HIDDEN, VOCAB, PAD = 64, 16, 59, 7
OPTIMIZERS = {
    "sgd": lambda: jaxembed.optim.sgd(0.1),
    "adagrad": lambda: jaxembed.optim.adagrad(0.1),  # optax's: s from 0.1, eps 1e-7 in the root
    "fbgemm_adagrad": lambda: jaxembed.optim.fbgemm_adagrad(0.1),
    "rowwise_adagrad": lambda: jaxembed.optim.rowwise_adagrad(0.1),
    "rowwise_adagrad_decoupled": lambda: jaxembed.optim.rowwise_adagrad(
        optax.linear_schedule(0.1, 0.01, 5), weight_decay=0.01, weight_decay_mode="decoupled"
    ),
    "adam": lambda: jaxembed.optim.adam(0.01, weight_decay=0.01),
    "partial_rowwise_adam": lambda: jaxembed.optim.partial_rowwise_adam(0.01),
    "ftrl": lambda: jaxembed.optim.ftrl(0.1, l1=0.001, l2=0.01),
}
# (mesh shape, table spec, ids spec)
LAYOUTS = {
    "rows": ((2, 4), P("model", None), P("data")),
    "rows-over-data-model": ((2, 4), P(("data", "model"), None), P("data")),
    "hidden": ((2, 4), P(None, "model"), P("data")),
    "rows-and-hidden": ((2, 4), P("model", "data"), P()),
    "replicated": ((2, 4), P(), P("data")),
    "rows-and-ids-same-axis": ((2, 4), P("data", None), P("data")),
    "1d-rows-ids-split": ((8,), P("model", None), P("model")),
}


def slots_of(opt, state):
    return tuple(np.asarray(state.slots[s.name]) for s in opt.formula.slots)


def run_steps(opt, mesh, w_spec, x_spec, table, batches, **kw):
    table_d = put(table, mesh, w_spec)
    state = opt.init(table_d)
    step = jax.jit(opt.update, donate_argnums=(0, 1), static_argnames=tuple(kw))
    for ids, grad, _ in batches:
        table_d, state = step(table_d, state, put(ids, mesh, x_spec), put(grad, mesh, x_spec), **kw)
    return table_d, state


def check_against_reference(opt, table, batches, table_d, state):
    """The trained table and state against `reference.sparse_step` in float64, step by step;
    returns the rows any batch touched."""
    ref_table = table.astype(np.float64)
    ref_states = reference.init_states(opt.formula, ROWS, HIDDEN)
    for count, (ids, grad, _) in enumerate(batches):
        ref_table, ref_states = reference.sparse_step(
            opt.formula, ref_table, ref_states, ids, grad, count=count, vocab_size=VOCAB,
            padding_idx=PAD,
        )  # fmt: skip
    np.testing.assert_allclose(np.asarray(table_d), ref_table, rtol=1e-5, atol=1e-6)
    for got, want in zip(slots_of(opt, state), ref_states, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    touched = np.zeros(ROWS, bool)
    for ids, _, _ in batches:
        ok = (ids >= 0) & (ids < VOCAB) & (ids != PAD)
        touched[ids[ok]] = True
    return touched


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_float64_reference(layout, name):
    mesh_shape, w_spec, x_spec = LAYOUTS[layout]
    mesh = make_mesh(mesh_shape, AxisType.Explicit)
    opt = OPTIMIZERS[name]()
    rng = np.random.default_rng(len(layout) * 7 + len(name))
    table = None
    batches = []
    for _ in range(3):
        ids, t, grad = make_inputs(rng, (8, 8), vocab_size=VOCAB, padding_idx=PAD)
        table = t if table is None else table
        ids[:, :2] = 3  # a row every device touches, several times
        batches.append((ids, grad, None))
    table_d, state = run_steps(
        opt, mesh, w_spec, x_spec, table, batches, vocab_size=VOCAB, padding_idx=PAD
    )
    touched = check_against_reference(opt, table, batches, table_d, state)
    assert int(state.count) == 3
    # Untouched rows (padding rows, padding_idx, rows no batch read) and their state: bitwise.
    np.testing.assert_array_equal(np.asarray(table_d)[~touched], table[~touched])
    init = reference.init_states(opt.formula, ROWS, HIDDEN)
    for got, want in zip(slots_of(opt, state), init, strict=True):
        np.testing.assert_array_equal(got[~touched], want[~touched].astype(np.float32))
    # The contracts: table and state keep their layouts.
    assert table_d.sharding.is_equivalent_to(NamedSharding(mesh, w_spec), 2)


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_equals_optax_dense_update_where_the_math_agrees(name):
    """sgd and adagrad, at optax's defaults, on the dense gradient: an untouched row's update
    is 0 (tests/test_optax_equal.py: every layout, both impls, the state too)."""
    mesh = make_mesh((2, 4), AxisType.Explicit)
    opt = getattr(jaxembed.optim, name)(0.1)
    dense = getattr(optax, name)(0.1)
    rng = np.random.default_rng(0)
    ids, table, grad = make_inputs(rng, (8, 8), vocab_size=VOCAB, padding_idx=PAD)
    table_d, _ = run_steps(
        opt, mesh, P("model", None), P("data"), table, [(ids, grad, None)] * 2,
        vocab_size=VOCAB, padding_idx=PAD,
    )  # fmt: skip
    g = np.zeros_like(table)
    ok = (ids >= 0) & (ids < VOCAB) & (ids != PAD)
    np.add.at(g, ids[ok], grad[ok])
    params, opt_state = jnp.asarray(table), dense.init(jnp.asarray(table))
    for _ in range(2):
        updates, opt_state = dense.update(jnp.asarray(g), opt_state, params)
        params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(np.asarray(table_d), np.asarray(params), rtol=1e-5, atol=1e-6)


def per_slot_grads(x, ct, combiner, table, weights=None, lengths=None):
    """Each slot's gradient of a pooled bag (float64), for the reference's sparse_step."""
    x = np.asarray(x)
    grads = np.zeros((*x.shape, table.shape[1]))
    for out_idx, slots in iter_bags(x, lengths=lengths):
        ok = [s for s in slots if 0 <= x[s] < VOCAB and x[s] != PAD]
        if not ok:
            continue
        w = np.array([1.0 if weights is None else weights[s] for s in ok])
        g = ct[out_idx]
        if combiner == "max":
            rows = np.array([table[x[s]] for s in ok])
            win = np.argmax(rows, axis=0)  # the earliest slot of the max
            for k, s in enumerate(ok):
                grads[s] = np.where(win == k, g, 0.0)
            continue
        scale = {"sum": w, "mean": w / w.sum(), "sqrtn": w / np.sqrt((w * w).sum())}[combiner]
        for k, s in enumerate(ok):
            grads[s] = scale[k] * g
    return grads


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn", "max"])
@pytest.mark.parametrize("layout", ["rows", "rows-over-data-model", "hidden", "1d-rows-ids-split"])
def test_bag_updates_match_reference(layout, combiner):
    mesh_shape, w_spec, x_spec = LAYOUTS[layout]
    mesh = make_mesh(mesh_shape, AxisType.Explicit)
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    rng = np.random.default_rng(len(layout) + len(combiner))
    table = rng.normal(size=(ROWS, HIDDEN)).astype(np.float32)
    x = rng.integers(0, VOCAB, size=(16, 6)).astype(np.int32)
    x[rng.random(x.shape) < 0.3] = -1
    x[0] = -1
    x[1, :3] = [PAD, VOCAB + 1, 4]
    x[2, :3] = [4, 4, 9]
    ct = rng.normal(size=(16, HIDDEN)).astype(np.float32)
    table_d = put(table, mesh, w_spec)
    state = opt.init(table_d)
    step = jax.jit(opt.update, donate_argnums=(0, 1), static_argnames=("combiner", "vocab_size",
                                                                      "padding_idx"))  # fmt: skip
    table_d, state = step(
        table_d, state, put(x, mesh, x_spec), put(ct, mesh, x_spec), combiner=combiner,
        vocab_size=VOCAB, padding_idx=PAD,
    )  # fmt: skip
    grads = per_slot_grads(x, ct, combiner, table.astype(np.float64))
    ids = np.where((x >= 0), x, -1)
    ref_table, ref_states = reference.sparse_step(
        opt.formula, table, reference.init_states(opt.formula, ROWS, HIDDEN), ids, grads,
        count=0, vocab_size=VOCAB, padding_idx=PAD,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(table_d), ref_table, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(slots_of(opt, state)[0], ref_states[0], rtol=1e-5, atol=1e-6)


def test_flat_weighted_bag_update():
    mesh = make_mesh((2, 4), AxisType.Explicit)
    opt = jaxembed.optim.adagrad(0.1)
    rng = np.random.default_rng(9)
    table = rng.normal(size=(ROWS, HIDDEN)).astype(np.float32)
    lengths = np.array([[2, 0, 3, 1]] * 8, np.int32)
    values = rng.integers(0, VOCAB, size=(8, 8)).astype(np.int32)
    values[:, 1] = values[:, 0]  # duplicates within a bag
    weights = rng.uniform(0.5, 2, size=values.shape).astype(np.float32)
    ct = rng.normal(size=(8, 4, HIDDEN)).astype(np.float32)
    table_d = put(table, mesh, P("model", None))
    state = opt.init(table_d)
    table_d, state = jax.jit(opt.update, static_argnames=("combiner", "vocab_size", "padding_idx"))(
        table_d, state, put(values, mesh, P("data")), put(ct, mesh, P("data")),
        lengths=put(lengths, mesh, P("data")), per_id_weights=put(weights, mesh, P("data")),
        combiner="mean", vocab_size=VOCAB, padding_idx=PAD,
    )  # fmt: skip
    grads = per_slot_grads(values, ct, "mean", table, weights=weights, lengths=lengths)
    live = np.zeros(values.shape, bool)
    for _, slots in iter_bags(values, lengths=lengths):
        for s in slots:
            live[s] = True
    ids = np.where(live, values, -1)
    ref_table, _ = reference.sparse_step(
        opt.formula, table, reference.init_states(opt.formula, ROWS, HIDDEN), ids, grads,
        count=0, vocab_size=VOCAB, padding_idx=PAD,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(table_d), ref_table, rtol=1e-5, atol=1e-6)


def test_no_table_sized_buffer_and_no_copy():
    """In place: besides the donated table and state, nothing of a shard's size exists."""
    mesh = make_mesh((2, 4), AxisType.Explicit)
    rows = 1 << 16
    table = put(np.zeros((rows, 32), np.float32), mesh, P("model", None))
    ids = put(np.zeros((8, 16), np.int32), mesh, P("data"))
    g = put(np.zeros((8, 16, 32), np.float32), mesh, P("data"))
    for opt in (jaxembed.optim.rowwise_adagrad(0.1), jaxembed.optim.adam(0.1)):
        state = opt.init(table)
        compiled = jax.jit(opt.update, donate_argnums=(0, 1)).lower(table, state, ids, g).compile()
        shard = (rows // 4) * 32 * 4
        temp = compiled.memory_analysis().temp_size_in_bytes
        assert temp < shard / 4, f"{opt.name}: temp {temp} B vs table shard {shard} B"
        text = compiled.as_text()
        for line in text.splitlines():
            if " copy(" in line or "copy-start" in line:
                assert f"[{rows // 4},32]" not in line, f"the table is copied: {line.strip()}"


def test_update_plan_collectives_are_the_compiled_ones():
    mesh = make_mesh((2, 4), AxisType.Explicit)
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    table = put(np.zeros((ROWS, HIDDEN), np.float32), mesh, P("model", None))
    ids = put(np.zeros((8, 8), np.int32), mesh, P("data"))
    g = put(np.zeros((8, 8, HIDDEN), np.float32), mesh, P("data"))
    state = opt.init(table)
    rows = lambda t, s, i, g: opt.update(t, s, i, g, exchange="rows")
    text = jax.jit(rows).lower(table, state, ids, g).compile().as_text()
    plan = opt.plan(mesh, (8, 8), (ROWS, HIDDEN), x_spec=P("data"), weight_spec=P("model", None),
                    exchange="rows")  # fmt: skip
    assert plan.exchange == "rows" and plan.for_update
    update_only = dataclasses.replace(plan, forward=())  # the update runs no forward collective
    check_hlo_against_plan(update_only, text, mesh)


@pytest.mark.parametrize(
    ("w_spec", "x_spec", "combiner"),
    [
        (P(None, "model"), P("data"), None),  # a one-per-row state: row sums over `model`
        (P("model", None), P(None, "data"), None),  # the ids move into the update's body
        (P("model", None), P("data"), "max"),  # the winners are recomputed
        (P("model", None), P("model"), None),  # routed
        (P(), P("data"), "sum"),  # dense: the gradient shard and the row counts summed
    ],
)
def test_update_plans_list_every_collective(w_spec, x_spec, combiner):
    mesh = make_mesh((2, 4), AxisType.Explicit)
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    table = put(np.zeros((ROWS, HIDDEN), np.float32), mesh, w_spec)
    ids = put(np.zeros((8, 8), np.int32), mesh, x_spec)
    kw = {"combiner": combiner} if combiner else {}
    plan = opt.plan(mesh, (8, 8), (ROWS, HIDDEN), x_spec=x_spec, weight_spec=w_spec, **kw)
    g = put(np.zeros((8, HIDDEN) if combiner else (8, 8, HIDDEN), np.float32), mesh,
            plan.out_spec)  # fmt: skip
    state = opt.init(table)
    f = lambda t, s, i, g: opt.update(t, s, i, g, **kw)
    text = jax.jit(f).lower(table, state, ids, g).compile().as_text()
    check_hlo_against_plan(dataclasses.replace(plan, forward=()), text, mesh,
                           extra_kinds={"pmax": "all-reduce", "pmin": "all-reduce"})  # fmt: skip


@pytest.mark.parametrize("name", ["rowwise_adagrad", "adam", "ftrl"])
@pytest.mark.parametrize("layout", ["replicated", "rows", "hidden"])
def test_the_dense_exchange_of_an_update_matches_float64_reference(layout, name):
    """`exchange="dense"`: each device's gradient shard and row counts summed over the batch
    axes, then the rows any batch read updated everywhere: table, state and untouched rows
    as the float64 reference (optimizers with moments too: a row read with a zero gradient
    is still a row read)."""
    mesh_shape, w_spec, x_spec = LAYOUTS[layout]
    mesh = make_mesh(mesh_shape, AxisType.Explicit)
    opt = OPTIMIZERS[name]()
    rng = np.random.default_rng(len(layout) * 3 + len(name))
    batches, table = [], None
    for _ in range(2):
        ids, t, grad = make_inputs(rng, (8, 8), vocab_size=VOCAB, padding_idx=PAD)
        table = t if table is None else table
        ids[:, :2] = 3
        grad[0, 0] = 0.0  # a row read with a zero gradient
        batches.append((ids, grad, None))
    plan = opt.plan(mesh, (8, 8), (ROWS, HIDDEN), x_spec=x_spec, weight_spec=w_spec,
                    exchange="dense", vocab_size=VOCAB, padding_idx=PAD)  # fmt: skip
    assert plan.exchange == "dense"
    table_d, state = run_steps(opt, mesh, w_spec, x_spec, table, batches, vocab_size=VOCAB,
                               padding_idx=PAD, exchange="dense")  # fmt: skip
    touched = check_against_reference(opt, table, batches, table_d, state)
    np.testing.assert_array_equal(np.asarray(table_d)[~touched], table[~touched])
    assert table_d.sharding.is_equivalent_to(NamedSharding(mesh, w_spec), 2)


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_the_dense_exchange_of_a_bag_update_matches_reference(combiner):
    mesh = make_mesh((8,), AxisType.Explicit)
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    rng = np.random.default_rng(11 + len(combiner))
    table = rng.normal(size=(ROWS, HIDDEN)).astype(np.float32)
    x = rng.integers(0, VOCAB, size=(16, 6)).astype(np.int32)
    x[rng.random(x.shape) < 0.3] = -1
    x[2, :3] = [4, 4, 9]
    ct = rng.normal(size=(16, HIDDEN)).astype(np.float32)
    table_d = put(table, mesh, P())
    kw = dict(combiner=combiner, vocab_size=VOCAB, padding_idx=PAD, exchange="dense")
    table_d, state = jax.jit(lambda t, s, i, g: opt.update(t, s, i, g, **kw))(
        table_d, opt.init(table_d), put(x, mesh, P("model")), put(ct, mesh, P("model")))
    grads = per_slot_grads(x, ct, combiner, table.astype(np.float64))
    ref_table, ref_states = reference.sparse_step(
        opt.formula, table, reference.init_states(opt.formula, ROWS, HIDDEN),
        np.where(x >= 0, x, -1), grads, count=0, vocab_size=VOCAB, padding_idx=PAD,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(table_d), ref_table, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(slots_of(opt, state)[0], ref_states[0], rtol=1e-5, atol=1e-6)


def test_the_dense_exchange_of_a_max_bag_update_is_refused():
    mesh = make_mesh((2, 4), AxisType.Explicit)
    opt = jaxembed.optim.sgd(0.1)
    table = put(np.zeros((ROWS, HIDDEN), np.float32), mesh, P("model", None))
    ids = put(np.zeros((8, 8), np.int32), mesh, P("data"))
    with pytest.raises(ValueError, match="exchange='dense' in a row-sparse update of max"):
        opt.update(table, opt.init(table), ids, jnp.zeros((8, HIDDEN)), exchange="dense",
                   combiner="max")  # fmt: skip


def test_out_grad_of_the_wrong_shape_is_refused():
    mesh = make_mesh((2, 4), AxisType.Explicit)
    opt = jaxembed.optim.sgd(0.1)
    table = put(np.zeros((ROWS, HIDDEN), np.float32), mesh, P("model", None))
    ids = put(np.zeros((8, 8), np.int32), mesh, P("data"))
    state = opt.init(table)
    pooled = jnp.zeros((8, HIDDEN))  # a bag's gradient, without the bag's arguments
    with pytest.raises(ValueError, match=r"out_grad has shape \(8, 16\), but the lookup's "
                       r"output has shape \(8, 8, 16\).*needs the bag's arguments"):  # fmt: skip
        opt.update(table, state, ids, pooled)
    with pytest.raises(ValueError, match=r"out_grad has shape \(8, 8, 16\), but .* \(8, 16\)"):
        opt.update(table, state, ids, jnp.zeros((8, 8, HIDDEN)), combiner="sum")
    with pytest.raises(ValueError, match=r"out_grad has shape \(3, 16\)"):  # one device
        opt.update(jnp.zeros((ROWS, HIDDEN)), opt.init(jnp.zeros((ROWS, HIDDEN))),
                   np.zeros((2, 3), np.int32), jnp.zeros((3, HIDDEN)))  # fmt: skip


def test_one_device():
    opt = jaxembed.optim.adam(0.1)
    rng = np.random.default_rng(1)
    ids, table, grad = make_inputs(rng, (4, 5), vocab_size=VOCAB, padding_idx=PAD)
    ids = np.where(ids >= VOCAB, 0, np.maximum(ids, 0))
    state = opt.init(jnp.asarray(table))
    new, state = jax.jit(opt.update)(jnp.asarray(table), state, ids, grad)
    ref, _ = reference.sparse_step(
        opt.formula, table, reference.init_states(opt.formula, ROWS, HIDDEN), ids, grad, count=0
    )
    np.testing.assert_allclose(np.asarray(new), ref, rtol=1e-5, atol=1e-6)
