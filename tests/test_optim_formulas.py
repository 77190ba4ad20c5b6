"""The row-sparse optimizer formulas against their float64 reference, optax and torch's math.

`formulas.RowFormula.apply` (float32, jnp) is checked against `reference.update_rows`
(float64 numpy, written independently) on random rows, eagerly, under `jax.jit` and with the
hidden axis split into shards whose `row_sum` is a `psum`. `reference.sparse_step` is checked
against optax's dense `sgd` and `adagrad` (which `sgd` and `adagrad` are, at optax's defaults
too; `fbgemm_adagrad` only at eps = 0), and against dense `adam` where it deliberately does
not agree (lazy Adam leaves untouched rows alone). tests/test_optax_equal.py runs the same
comparison through the sharded update, on every layout.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optim_cases import formula_cases

from jaxembed.optim import formulas, reference
from jaxembed.optim.formulas import RowFormula

U, H = 13, 8
COUNTS = (0, 3, 1000)
SCHEDULE = optax.linear_schedule(init_value=0.1, end_value=0.01, transition_steps=10)

FORMULAS = formula_cases(SCHEDULE)


def random_state(formula, rng, num_rows, hidden):
    """Valid random state: accumulators > 0, second moments >= 0, the rest any sign."""
    out = []
    for slot in formula.slots:
        shape = slot.shape(num_rows, hidden)
        if slot.name == "accumulator":
            out.append(rng.uniform(0.05, 2.0, shape))
        elif slot.name == "nu":
            out.append(rng.uniform(0.0, 0.5, shape))
        else:
            out.append(0.1 * rng.normal(size=shape))
    return tuple(s.astype(np.float32) for s in out)


def random_rows(formula, seed, num_rows=U, hidden=H):
    rng = np.random.default_rng(seed)
    rows = rng.normal(size=(num_rows, hidden)).astype(np.float32)
    grads = rng.normal(size=(num_rows, hidden)).astype(np.float32)
    states = random_state(formula, rng, num_rows, hidden)
    if formula.name == "ftrl":  # FTRL's weights are a function of its state, as after a step
        rows = ftrl_weights(formula, *states, count=seed).astype(np.float32)
    return rows, grads, states


def ftrl_weights(formula, n, z, *, count):
    h = formula.hparams
    lr = h["learning_rate"](count) if callable(h["learning_rate"]) else h["learning_rate"]
    quadratic = n ** -h["learning_rate_power"] / lr + 2 * h["l2"] + h["beta"] / lr
    return (np.clip(z, -h["l1"], h["l1"]) - z) / quadratic


def row_sum(x):
    return jnp.sum(x, -1)


def assert_update_matches(formula, got, rows, grads, states, count):
    want_rows, want_states = reference.update_rows(formula, rows, grads, states, count=count)
    np.testing.assert_allclose(got[0], want_rows, rtol=1e-5, atol=1e-6)
    assert len(got[1]) == len(want_states) == len(formula.slots)
    for slot, g, w in zip(formula.slots, got[1], want_states, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=slot.name)


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("name", FORMULAS)
def test_apply_matches_float64_reference(name, count):
    formula = FORMULAS[name]
    rows, grads, states = random_rows(formula, seed=count)
    got = formula.apply(rows, grads, states, count, row_sum=row_sum, hidden_size=H)
    assert got[0].dtype == jnp.float32 and all(s.dtype == jnp.float32 for s in got[1])
    assert_update_matches(formula, got, rows, grads, states, count)

    jitted = jax.jit(lambda r, g, s, c: formula.apply(r, g, s, c, row_sum=row_sum, hidden_size=H))
    got_jit = jitted(rows, grads, states, jnp.int32(count))
    assert_update_matches(formula, got_jit, rows, grads, states, count)


@pytest.mark.parametrize("shards", [2, 4])
@pytest.mark.parametrize("name", FORMULAS)
def test_hidden_split_matches_whole_row(name, shards):
    """Each shard sees H/shards columns; `row_sum` is a psum of the shards' sums (a vmap
    with a named axis stands in for the shard_map)."""
    formula = FORMULAS[name]
    rows, grads, states = random_rows(formula, seed=7)
    whole_rows, whole_states = formula.apply(rows, grads, states, 5, row_sum=row_sum, hidden_size=H)

    def split(x):  # f32[U, H] -> f32[shards, U, H/shards]
        return x.reshape(U, shards, H // shards).transpose(1, 0, 2)

    def unsplit(x):
        return x.transpose(1, 0, 2).reshape(U, H)

    def shard_body(r, g, s):
        return formula.apply(
            r, g, s, 5, row_sum=lambda x: jax.lax.psum(jnp.sum(x, -1), "hidden"), hidden_size=H
        )

    state_axes = tuple(None if slot.per_row else 0 for slot in formula.slots)
    split_states = tuple(
        s if slot.per_row else split(s) for slot, s in zip(formula.slots, states, strict=True)
    )
    new_rows, new_states = jax.vmap(shard_body, in_axes=(0, 0, state_axes), axis_name="hidden")(
        split(rows), split(grads), split_states
    )
    np.testing.assert_allclose(unsplit(new_rows), whole_rows, rtol=1e-6, atol=1e-7)
    for slot, got, want in zip(formula.slots, new_states, whole_states, strict=True):
        if slot.per_row:  # every shard holds, and computed, the same per-row value
            for shard in range(shards):
                np.testing.assert_allclose(got[shard], want, rtol=1e-6, err_msg=slot.name)
        else:
            np.testing.assert_allclose(unsplit(got), want, rtol=1e-6, atol=1e-7, err_msg=slot.name)


# --- whole steps: dedup, padding, out-of-range ids -------------------------------------------

ROWS, VOCAB, PAD = 12, 10, 2  # rows 10 and 11 pad the table past the vocabulary


def step_inputs(step, hidden=4):
    """ids [3, 5] with duplicates, the padding id, negatives and ids past the vocabulary."""
    rng = np.random.default_rng(100 + step)
    ids = rng.integers(-2, ROWS + 3, size=(3, 5))
    ids[0, :3] = [5, 5, PAD]  # a duplicate and the padding id, every step
    ids[1, 0] = VOCAB  # a padding row of the table
    grads = rng.normal(size=(3, 5, hidden)).astype(np.float32)
    return ids, grads


def dense_grad(ids, grads):
    """The dense gradient of the lookup: scatter-add of the valid ids' gradients."""
    valid = (ids >= 0) & (ids < VOCAB) & (ids != PAD)
    out = np.zeros((ROWS, grads.shape[-1]), np.float32)
    np.add.at(out, ids[valid], grads[valid])
    return out


def formula_sparse_step(formula, table, states, ids, grads, count):
    """The row-sparse step built from `apply`, on one device (what the kernel does)."""
    rows, summed = reference.dedup_grads(ids, grads, vocab_size=VOCAB, padding_idx=PAD)
    gathered = tuple(s[rows] for s in states)
    new_rows, new_states = formula.apply(
        table[rows],
        jnp.asarray(summed, jnp.float32),
        gathered,
        count,
        row_sum=row_sum,
        hidden_size=table.shape[1],
    )
    return table.at[rows].set(new_rows), tuple(
        s.at[rows].set(n) for s, n in zip(states, new_states, strict=True)
    )


@pytest.mark.parametrize("name", FORMULAS)
def test_sparse_steps_from_apply_match_reference(name):
    formula = FORMULAS[name]
    table = np.random.default_rng(0).normal(size=(ROWS, 4)).astype(np.float32)
    ref_table, ref_states = table.astype(np.float64), reference.init_states(formula, ROWS, 4)
    table, states = jnp.asarray(table), formula.init_state(ROWS, 4)
    for count in range(4):
        ids, grads = step_inputs(count)
        table, states = formula_sparse_step(formula, table, states, ids, grads, count)
        ref_table, ref_states = reference.sparse_step(
            formula,
            ref_table,
            ref_states,
            ids,
            grads,
            count=count,
            vocab_size=VOCAB,
            padding_idx=PAD,
        )
        np.testing.assert_allclose(table, ref_table, rtol=1e-5, atol=1e-6)
        for got, want in zip(states, ref_states, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_reference_sums_duplicates_and_skips_invalid_ids():
    formula = formulas.adam(0.1)
    rng = np.random.default_rng(3)
    table = rng.normal(size=(ROWS, 4))
    states = random_state(formula, rng, ROWS, 4)
    ids = np.array([[4, 4, 4, PAD], [-1, VOCAB, ROWS + 5, 7]])
    grads = rng.normal(size=(2, 4, 4))
    new_table, new_states = reference.sparse_step(
        formula, table, states, ids, grads, count=2, vocab_size=VOCAB, padding_idx=PAD
    )
    # Row 4 gets exactly one update, with the sum of its three gradients.
    once, once_states = reference.sparse_step(
        formula,
        table,
        states,
        np.array([4, 7]),
        np.stack([grads[0, :3].sum(0), grads[1, 3]]),
        count=2,
    )
    np.testing.assert_array_equal(new_table, once)
    touched = np.isin(np.arange(ROWS), [4, 7])
    np.testing.assert_array_equal(new_table[~touched], table[~touched])  # PAD, VOCAB, 11 too
    assert np.all(new_table[touched] != table[touched])
    for s, new, o in zip(states, new_states, once_states, strict=True):
        np.testing.assert_array_equal(new[~touched], s[~touched])
        np.testing.assert_array_equal(new, o)


# --- against optax's dense optimizers ------------------------------------------------------


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (formulas.sgd(0.1), optax.sgd(0.1)),
        (formulas.sgd(0.1, momentum=0.0), optax.sgd(0.1, momentum=0.0)),
        (formulas.adagrad(0.1), optax.adagrad(0.1)),  # the defaults: s from 0.1, eps 1e-7
        (
            formulas.adagrad(0.3, initial_accumulator_value=0.0, eps=1e-3),
            optax.adagrad(0.3, initial_accumulator_value=0.0, eps=1e-3),
        ),
        (formulas.adagrad(SCHEDULE, eps=0.0), optax.adagrad(SCHEDULE, eps=0.0)),
        # FBGEMM divides by sqrt(s) + eps, optax by sqrt(s + eps): equal only at eps = 0.
        (
            formulas.fbgemm_adagrad(0.1, initial_accumulator_value=0.1, eps=0.0),
            optax.adagrad(0.1, initial_accumulator_value=0.1, eps=0.0),
        ),
    ],
    ids=["sgd", "sgd_momentum_0", "adagrad", "adagrad_init0_eps", "adagrad_schedule",
         "fbgemm_adagrad_eps0"],
)  # fmt: skip
def test_sparse_step_equals_optax_dense_update(ours, theirs):
    """SGD and Adagrad are exactly lazy: a zero gradient moves neither the row nor its state,
    so the row-sparse step equals the dense update of the scatter-added gradient."""
    params = jnp.asarray(np.random.default_rng(1).normal(size=(ROWS, 4)), jnp.float32)
    opt_state = theirs.init(params)
    table, states = np.asarray(params, np.float64), reference.init_states(ours, ROWS, 4)
    for count in range(5):
        ids, grads = step_inputs(count)
        updates, opt_state = theirs.update(jnp.asarray(dense_grad(ids, grads)), opt_state, params)
        params = optax.apply_updates(params, updates)
        table, states = reference.sparse_step(
            ours, table, states, ids, grads, count=count, vocab_size=VOCAB, padding_idx=PAD
        )
        np.testing.assert_allclose(params, table, rtol=1e-5, atol=1e-6)
    if ours.slots:
        np.testing.assert_allclose(opt_state[0].sum_of_squares, states[0], rtol=1e-5)


def test_fbgemm_adagrad_is_not_optax_adagrad_at_the_defaults():
    """Issue 23: FBGEMM's defaults (s from 0, eps outside the root) train differently from
    optax's; `adagrad` is optax's, `fbgemm_adagrad` keeps FBGEMM's."""
    rng = np.random.default_rng(3)
    rows, grads = rng.normal(size=(4, 3)), 0.1 * rng.normal(size=(4, 3))
    states = {n: reference.init_states(f, 4, 3) for n, f in
              [("optax", formulas.adagrad(0.1)), ("fbgemm", formulas.fbgemm_adagrad(0.1))]}  # fmt: skip
    assert states["optax"][0][0, 0] == 0.1 and states["fbgemm"][0][0, 0] == 0.0
    new = {}
    for n, f in [("optax", formulas.adagrad(0.1)), ("fbgemm", formulas.fbgemm_adagrad(0.1))]:
        new[n], _ = reference.update_rows(f, rows, grads, states[n], count=0)
    # optax's first step is lr·g/√(0.1 + g² + eps); FBGEMM's lr·sign(g) (s = g²)
    np.testing.assert_allclose(new["fbgemm"], rows - 0.1 * np.sign(grads), rtol=1e-6)
    np.testing.assert_allclose(new["optax"], rows - 0.1 * grads / np.sqrt(0.1 + grads**2 + 1e-7))
    assert np.abs(new["optax"] - new["fbgemm"]).max() > 0.05


@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_lazy_adam_differs_from_dense_adam_on_untouched_rows(wd):
    """Row 0 is touched at step 1 only, row 1 at steps 1 and 2, rows 2-3 never.

    Dense Adam (optax.adam, or optax.adamw for wd > 0) decays row 0's moments at step 2 and,
    its m being non-zero, moves the row again by lr·m̂/(√v̂ + eps) with m = b1·m₁, v = b2·v₁;
    lazy Adam leaves row 0 and its moments as step 1 left them. Rows touched at every step
    agree. Rows never touched agree without weight decay (m = 0: a zero move); with it,
    dense AdamW shrinks them by (1 - lr·wd) a step and lazy Adam leaves them alone.
    """
    lr, b1, b2, eps = 0.1, 0.9, 0.999, 1e-8
    ours = formulas.adam(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd)
    dense = (
        optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd)
        if wd
        else optax.adam(lr, b1=b1, b2=b2, eps=eps)
    )
    rng = np.random.default_rng(5)
    params = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)
    g1, g2 = rng.normal(size=(2, 3)), rng.normal(size=(1, 3))
    steps = [(np.array([0, 1]), g1), (np.array([1]), g2)]

    opt_state, table, states = (
        dense.init(params),
        np.asarray(params, np.float64),
        reference.init_states(ours, 4, 3),
    )
    initial, history = table.copy(), []
    for count, (ids, grads) in enumerate(steps):
        dense_g = np.zeros((4, 3), np.float32)
        dense_g[ids] = grads
        updates, opt_state = dense.update(jnp.asarray(dense_g), opt_state, params)
        params = optax.apply_updates(params, updates)
        table, states = reference.sparse_step(ours, table, states, ids, grads, count=count)
        history.append(table.copy())

    np.testing.assert_allclose(params[1], table[1], rtol=1e-5)  # touched at both steps
    np.testing.assert_array_equal(table[2:], initial[2:])  # lazy: never touched, never moved
    np.testing.assert_allclose(params[2:], initial[2:] * (1 - lr * wd) ** 2, rtol=1e-6)
    np.testing.assert_array_equal(table[0], history[0][0])  # lazy: row 0 frozen at step 2
    m1, v1 = (1 - b1) * g1[0], (1 - b2) * g1[0] ** 2
    np.testing.assert_array_equal(states[0][0], m1)
    np.testing.assert_array_equal(states[1][0], v1)
    m, v = b1 * m1, b2 * v1  # dense Adam's row-0 moments after step 2
    w1 = history[0][0]
    dense_row0 = w1 - lr * (m / (1 - b1**2) / (np.sqrt(v / (1 - b2**2)) + eps) + wd * w1)
    np.testing.assert_allclose(params[0], dense_row0, rtol=1e-5)
    assert np.all(np.abs(params[0] - table[0]) > 0.01)  # a visible difference: lr·0.3-0.7


@pytest.mark.parametrize("count", [0, 5, 999])
def test_torch_sparse_adam_is_lazy_adam_with_a_rescaled_eps(count):
    """torch.optim.SparseAdam: step_size = lr·√(1-b2^t)/(1-b1^t), w -= step_size·m/(√v + eps)
    (its documented formula, written out here; torch is not a dependency). That is ours with
    eps' = eps/√(1-b2^t), and the same as ours at eps = 0."""
    lr, b1, b2, eps, t = 0.05, 0.9, 0.999, 1e-3, count + 1
    rng = np.random.default_rng(count)
    w, g = rng.normal(size=(U, H)), rng.normal(size=(U, H))
    m0, v0 = 0.1 * rng.normal(size=(U, H)), rng.uniform(0, 0.1, (U, H))

    m, v = b1 * m0 + (1 - b1) * g, b2 * v0 + (1 - b2) * g**2
    step_size = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
    torch_rows = w - step_size * m / (np.sqrt(v) + eps)

    rescaled = formulas.adam(lr, b1=b1, b2=b2, eps=eps / math.sqrt(1 - b2**t))
    np.testing.assert_allclose(
        reference.update_rows(rescaled, w, g, (m0, v0), count=count)[0], torch_rows, rtol=1e-12
    )
    same_eps = reference.update_rows(
        formulas.adam(lr, b1=b1, b2=b2, eps=eps), w, g, (m0, v0), count=count
    )[0]
    assert not np.allclose(same_eps, torch_rows, rtol=1e-9, atol=0)


# --- schedules, state, dtypes, errors ------------------------------------------------------


@pytest.mark.parametrize("count", [0, 4, 10, 20])
def test_schedule_is_evaluated_at_count(count):
    schedule = optax.linear_schedule(init_value=0.1, end_value=0.0, transition_steps=10)
    lr = 0.1 * max(0.0, 1 - count / 10)
    rows, grads = np.ones((2, 3), np.float32), np.full((2, 3), 2.0, np.float32)
    formula = formulas.sgd(schedule)
    apply = lambda c: formula.apply(rows, grads, (), c, row_sum=row_sum, hidden_size=3)[0]
    np.testing.assert_allclose(apply(count), 1 - 2 * lr, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(apply)(jnp.int32(count)), 1 - 2 * lr, rtol=1e-6)
    new, _ = reference.sparse_step(formula, rows, (), np.array([0, 1]), grads, count=count)
    np.testing.assert_allclose(new, 1 - 2 * lr, rtol=1e-6)


@pytest.mark.parametrize("name", FORMULAS)
def test_init_state_matches_reference(name):
    formula = FORMULAS[name]
    got, want = formula.init_state(6, 5), reference.init_states(formula, 6, 5)
    assert [s.shape for s in got] == [s.shape for s in want]
    assert [s.shape for s in got] == [(6,) if slot.per_row else (6, 5) for slot in formula.slots]
    for g, w in zip(got, want, strict=True):
        assert g.dtype == jnp.float32 and w.dtype == np.float64
        np.testing.assert_array_equal(g, w.astype(np.float32))


def test_formula_is_hashable_plain_data():
    a, b = (
        formulas.rowwise_adagrad(0.1, weight_decay=0.01),
        formulas.rowwise_adagrad(0.1, weight_decay=0.01),
    )
    assert a == b and hash(a) == hash(b) and a != formulas.rowwise_adagrad(0.2)
    assert a.hparams["weight_decay_mode"] == "l2"
    assert [s.name for s in formulas.ftrl(0.1).slots] == ["accumulator", "linear"]


def test_apply_keeps_the_rows_dtype():
    rows = jnp.ones((2, 4), jnp.bfloat16)
    new, (s,) = formulas.rowwise_adagrad(0.5).apply(
        rows, jnp.ones((2, 4)), (jnp.zeros(2),), 0, row_sum=row_sum, hidden_size=4
    )
    assert new.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    np.testing.assert_array_equal(new.astype(jnp.float32), 0.5)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: formulas.sgd(-0.1), r"sgd: learning_rate=-0.1 must be a finite float >= 0"),
        (lambda: formulas.sgd(float("nan")), r"learning_rate=nan"),
        (
            lambda: formulas.sgd(0.1, weight_decay=-1.0),
            r"weight_decay=-1.0 is outside the valid range \[0.0, inf\)",
        ),
        (lambda: formulas.adagrad(0.1, eps=-1e-8), r"adagrad: eps=-1e-08 is outside"),
        (lambda: formulas.fbgemm_adagrad(0.1, eps=-1e-8), r"fbgemm_adagrad: eps=-1e-08 is"),
        (
            lambda: formulas.fbgemm_adagrad(0.1, initial_accumulator_value=-1.0),
            r"fbgemm_adagrad: initial_accumulator_value=-1.0",
        ),
        (
            lambda: formulas.sgd(0.1, momentum=0.9),
            r"sgd: momentum=0.9 is not row-sparse: .* Use jaxembed.optim.sgd\(learning_rate\)",
        ),
        (lambda: formulas.sgd(0.1, nesterov=1), r"sgd: nesterov=1 must be a bool"),
        (
            lambda: formulas.adagrad(0.1, initial_accumulator_value=-0.1),
            r"initial_accumulator_value=-0.1",
        ),
        (
            lambda: formulas.rowwise_adagrad(0.1, weight_decay_mode="adamw"),
            r"weight_decay_mode='adamw' is not one of \('l2', 'decoupled'\)",
        ),
        (lambda: formulas.rowwise_adagrad(0.1, eps=-1.0), r"rowwise_adagrad: eps=-1.0"),
        (
            lambda: formulas.adam(0.1, b1=1.0),
            r"adam: b1=1.0 is outside the valid range \[0.0, 1.0\)",
        ),
        (lambda: formulas.adam(0.1, b2=-0.1), r"b2=-0.1 is outside the valid range \[0.0, 1.0\)"),
        (lambda: formulas.partial_rowwise_adam(0.1, b2=1.5), r"partial_rowwise_adam: b2=1.5"),
        (lambda: formulas.partial_rowwise_adam(0.1, weight_decay=-0.1), r"weight_decay=-0.1"),
        (lambda: formulas.ftrl(0.0), r"ftrl: learning_rate=0.0 must be a finite float > 0"),
        (
            lambda: formulas.ftrl(0.1, learning_rate_power=0.5),
            r"learning_rate_power=0.5 is outside the valid range \[-inf, 0.0\]",
        ),
        (lambda: formulas.ftrl(0.1, l1=-1.0), r"ftrl: l1=-1.0"),
        (lambda: formulas.ftrl(0.1, l2=-1.0), r"ftrl: l2=-1.0"),
        (lambda: formulas.ftrl(0.1, beta=-1.0), r"ftrl: beta=-1.0"),
        (lambda: RowFormula("lamb", (), ()), r"unknown optimizer 'lamb'"),
    ],
)
def test_bad_hyperparameters_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_learning_rate_type_and_bad_shapes_raise():
    with pytest.raises(
        TypeError, match=r"learning_rate='fast' must be a float or an optax schedule"
    ):
        formulas.sgd("fast")
    rows = jnp.ones((3, 4))
    with pytest.raises(ValueError, match=r"got 0 state arrays, expected 2 \(mu, nu\)"):
        formulas.adam(0.1).apply(rows, rows, (), 0, row_sum=row_sum, hidden_size=4)
    with pytest.raises(ValueError, match=r"state 'accumulator' is \(3, 4\), expected \(3,\)"):
        formulas.rowwise_adagrad(0.1).apply(rows, rows, (rows,), 0, row_sum=row_sum, hidden_size=4)
    with pytest.raises(ValueError, match=r"hidden_size=2 must be the global H"):
        formulas.sgd(0.1).apply(rows, rows, (), 0, row_sum=row_sum, hidden_size=2)
    with pytest.raises(ValueError, match=r"vocab_size=20 must be in \[0, 3\]"):
        reference.sparse_step(
            formulas.sgd(0.1), rows, (), np.array([0]), np.ones((1, 4)), count=0, vocab_size=20
        )
