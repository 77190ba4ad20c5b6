"""The native CPU kernels (`jaxembed.kernels.native`) against their XLA twins and float64 numpy.

Every kernel runs on random slots with duplicate rows, invalid slots (whose rows are often out
of range), segments -1 and >= S, empty bags, M = 0 and bfloat16 tables; eagerly, under jit and
inside a `shard_map` over 8 devices. Results equal the XLA twin's (bitwise where the order of
additions is the same, else within float32 rounding); the updates leave untouched rows and
state bitwise unchanged and work in place.
"""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from optim_cases import formula_cases

from jaxembed.kernels import local as local_ops
from jaxembed.kernels import native, sparse
from jaxembed.optim import reference

pytestmark = pytest.mark.skipif(
    not native.available(), reason=f"native kernels unavailable: {native.why_unavailable()}"
)

R, H, S = 40, 8, 12
SCHEDULE = optax.exponential_decay(0.1, transition_steps=3, decay_rate=0.5)
FORMULAS = formula_cases(SCHEDULE)


def make_slots(seed, m, *, rows=R, segments=S, sorted_segments=False, dtype=jnp.float32, hidden=H,
               distinct=None):  # fmt: skip
    """A table and M slots: duplicate rows, ~25% invalid slots (their rows often out of range,
    negative or >= rows), segments -1 / >= S on some slots, and some bags left empty. With
    `distinct`, the valid rows are `distinct` rows scattered over the table."""
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(rows, hidden)).astype(np.float32)
    local = rng.integers(0, max(rows // 3, 1), m).astype(np.int32)  # many duplicates
    if distinct is not None:
        chosen = rng.choice(rows, distinct, replace=False).astype(np.int32)
        local = chosen[rng.integers(0, distinct, m)]
    valid = rng.random(m) < 0.75
    junk = rng.choice([-5, -1, rows, rows + 7], m).astype(np.int32)
    local = np.where(valid | (rng.random(m) < 0.5), local, junk)
    if sorted_segments:
        seg = np.sort(rng.integers(0, segments - 2, m)).astype(np.int32)  # bags S-2, S-1 empty
    else:
        seg = rng.integers(-1, segments + 2, m).astype(np.int32)
    scale = rng.uniform(-2, 2, m).astype(np.float32)
    return jnp.asarray(table, dtype), local, valid, seg, scale


def np_pool_sum(table, local, valid, seg, scale, s):
    out = np.zeros((s, table.shape[1]))
    for i in range(len(local)):
        if valid[i] and 0 <= seg[i] < s:
            out[seg[i]] += (
                scale[i] * np.asarray(table, np.float64)[np.clip(local[i], 0, len(table) - 1)]
            )
    return out


def bitwise(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


# --- gather, pool, scatter ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gather_rows_matches_xla(dtype):
    table, local, valid, _, _ = make_slots(0, 60, dtype=dtype)
    local, valid = local.reshape(5, 12), valid.reshape(5, 12)  # any leading shape
    got = native.gather_rows(table, local, valid)
    assert got.shape == (5, 12, H) and got.dtype == dtype
    assert bitwise(got, local_ops.gather_rows(table, local, valid))
    want = np.where(valid[..., None], np.asarray(table)[np.clip(local, 0, R - 1)], 0)
    assert bitwise(got, want.astype(dtype))
    assert bitwise(jax.jit(native.gather_rows)(table, local, valid), got)


@pytest.mark.parametrize("sorted_segments", [True, False], ids=["runs", "scattered"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pool_sum_matches_xla_and_float64(dtype, sorted_segments):
    table, local, valid, seg, scale = make_slots(
        1, 300, dtype=dtype, sorted_segments=sorted_segments
    )
    got = jax.jit(native.pool_sum, static_argnums=5)(table, local, valid, seg, scale, S)
    assert got.dtype == jnp.float32 and got.shape == (S, H)
    want = np_pool_sum(np.asarray(table.astype(jnp.float32)), local, valid, seg, scale, S)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    xla = local_ops.pool_sum(table, local, valid, seg, scale, S)
    np.testing.assert_allclose(got, xla, rtol=1e-5, atol=1e-6)
    if sorted_segments:
        assert np.all(np.asarray(got[-2:]) == 0)  # empty bags


@pytest.mark.parametrize("sorted_segments", [True, False], ids=["runs", "scattered"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pool_max_matches_xla(dtype, sorted_segments):
    # duplicates give ties (the earliest slot wins); bags S-2, S-1 of the sorted case are empty
    table, local, valid, seg, _ = make_slots(2, 200, dtype=dtype, sorted_segments=sorted_segments)
    maxima, winners = native.pool_max(table, local, valid, seg, S)
    want_max, want_win = local_ops.pool_max(table, local, valid, seg, S)
    assert bitwise(maxima, want_max) and bitwise(winners, want_win)
    assert np.isneginf(np.asarray(maxima)).any() or not sorted_segments
    live = valid & (seg >= 0) & (seg < S)
    rows = np.asarray(table.astype(jnp.float32))[np.clip(local, 0, R - 1)]
    for s in range(S):  # float64 check of the maxima
        here = rows[live & (seg == s)]
        expect = here.max(0) if len(here) else np.full(H, -np.inf)
        np.testing.assert_array_equal(np.asarray(maxima[s]), expect)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_scatter_add_matches_xla(dtype):
    _, local, valid, _, _ = make_slots(3, 120)
    # valid slots with a negative row count from the end, as XLA's scatter; >= R are dropped
    local = np.where(np.arange(120) % 17 == 0, -2, local).astype(np.int32)
    local = np.where(np.arange(120) % 19 == 0, R + 3, local).astype(np.int32)
    grads = jnp.asarray(np.random.default_rng(3).normal(size=(120, H)), dtype)
    got = jax.jit(native.scatter_add, static_argnums=0)((R, H), local, valid, grads)
    xla = local_ops.scatter_add((R, H), local, valid, grads)
    assert bitwise(got, xla)  # same adds in the same (slot) order
    want = np.zeros((R, H))
    for i in np.flatnonzero(valid):
        r = local[i] + R if local[i] < 0 else local[i]
        if 0 <= r < R:
            want[r] += np.asarray(grads[i], np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bag_scatter_add_matches_xla(dtype):
    _, local, valid, seg, scale = make_slots(4, 150)
    out_grad = jnp.asarray(np.random.default_rng(4).normal(size=(S, H)), dtype)
    got = native.bag_scatter_add((R, H), local, valid, seg, scale, out_grad)
    assert bitwise(got, local_ops.bag_scatter_add((R, H), local, valid, seg, scale, out_grad))
    og = np.asarray(out_grad.astype(jnp.float32), np.float64)
    want = np.zeros((R, H))
    for i in np.flatnonzero(valid & (seg >= 0) & (seg < S)):
        if 0 <= local[i] < R:
            want[local[i]] += scale[i] * og[seg[i]]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pool_sum_pieces_reads_the_pieces_in_place(dtype):
    """A table as n pieces f[C, H] (an all_to_all's results): the same sums as `pool_sum` of
    their concatenation, bitwise, and as float64; the slots' rows span every piece."""
    n, c = 5, 8  # R = 40 rows, row r in piece r // 8
    table, local, valid, seg, scale = make_slots(20, 200, dtype=dtype)
    local = np.where(valid, local * 3 + 1, local).astype(np.int32)  # rows in every piece
    pieces = [table[j * c : (j + 1) * c] for j in range(n)]
    got = jax.jit(native.pool_sum_pieces, static_argnums=5)(pieces, local, valid, seg, scale, S)
    assert bitwise(got, native.pool_sum(table, local, valid, seg, scale, S))
    assert bitwise(local_ops.pool_sum_pieces(pieces, local, valid, seg, scale, S),
                   local_ops.pool_sum(table, local, valid, seg, scale, S))  # fmt: skip
    want = np_pool_sum(np.asarray(table.astype(jnp.float32)), local, valid, seg, scale, S)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    read = np.clip(local[valid & (seg >= 0) & (seg < S)], 0, R - 1) // c
    assert set(read.tolist()) == set(range(n))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bag_scatter_add_pieces_writes_the_pieces_in_place(dtype):
    """`bag_scatter_add` into n pieces f32[C, H]: each piece the matching rows of the one
    f32[n·C, H] result, bitwise, natively and in the XLA twin, and the float64 sums."""
    n, c = 4, 10
    _, local, valid, seg, scale = make_slots(21, 150)
    out_grad = jnp.asarray(np.random.default_rng(21).normal(size=(S, H)), dtype)
    whole = native.bag_scatter_add((R, H), local, valid, seg, scale, out_grad)
    f = jax.jit(native.bag_scatter_add_pieces, static_argnums=(0, 1))
    got = f(n, (c, H), local, valid, seg, scale, out_grad)
    xla = local_ops.bag_scatter_add_pieces(n, (c, H), local, valid, seg, scale, out_grad)
    assert len(got) == len(xla) == n
    for j in range(n):
        assert bitwise(got[j], whole[j * c : (j + 1) * c]) and bitwise(got[j], xla[j])
    og = np.asarray(out_grad.astype(jnp.float32), np.float64)
    want = np.zeros((R, H))
    for i in np.flatnonzero(valid & (seg >= 0) & (seg < S)):
        if 0 <= local[i] < R:
            want[local[i]] += scale[i] * og[seg[i]]
    np.testing.assert_allclose(np.concatenate(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_scatter_add_pieces_reads_the_pieces_in_place(dtype):
    """`scatter_add` with the slots' gradients as n pieces f[C, H] (an all_to_all's results):
    bitwise the `scatter_add` of their concatenation, natively and in the XLA twin, and the
    float64 sums; negative rows count from the end, rows >= R are dropped, as XLA's."""
    n, c = 6, 20
    _, local, valid, _, _ = make_slots(23, n * c)
    local = np.where(np.arange(n * c) % 17 == 0, -2, local).astype(np.int32)
    grads = jnp.asarray(np.random.default_rng(23).normal(size=(n * c, H)), dtype)
    pieces = [grads[j * c : (j + 1) * c] for j in range(n)]
    got = jax.jit(native.scatter_add_pieces, static_argnums=0)((R, H), local, valid, pieces)
    assert bitwise(got, native.scatter_add((R, H), local, valid, grads))
    assert bitwise(local_ops.scatter_add_pieces((R, H), local, valid, pieces),
                   local_ops.scatter_add((R, H), local, valid, grads))  # fmt: skip
    want = np.zeros((R, H))
    g = np.asarray(grads.astype(jnp.float32), np.float64)
    for i in np.flatnonzero(valid):
        r = local[i] + R if local[i] < 0 else local[i]
        if 0 <= r < R:
            want[r] += g[i]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"piece 0 has shape \(20, 8\); 5 pieces for M=120"):
        native.scatter_add_pieces((R, H), local, valid, pieces[:5])
    call = jax.ffi.ffi_call("jaxembed_scatter_add_pieces",
                            jax.ShapeDtypeStruct((R, H), jnp.float32))  # fmt: skip
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"5 gradient pieces of 20 rows hold "
                       r"100 slots' gradients, but local has M=120"):  # fmt: skip
        jax.block_until_ready(call(local, valid, *pieces[:5], num_threads=np.int64(1)))


def test_pieces_errors_name_the_value():
    table, local, valid, seg, scale = make_slots(22, 10)
    with pytest.raises(ValueError, match=r"piece 1 is float32\[7, 8\], piece 0 float32\[8, 8\]"):
        native.pool_sum_pieces([table[:8], table[8:15]], local, valid, seg, scale, S)
    with pytest.raises(TypeError, match="piece 0 must be a 2-D float32 or bfloat16"):
        native.pool_sum_pieces([table.astype(jnp.int32)], local, valid, seg, scale, S)
    with pytest.raises(ValueError, match="num_pieces must be >= 1, got 0"):
        native.bag_scatter_add_pieces(0, (8, H), local, valid, seg, scale, jnp.ones((S, H)))
    # the kernel's own check, past the Python side: pieces of two shapes
    call = jax.ffi.ffi_call("jaxembed_pool_sum_pieces", jax.ShapeDtypeStruct((S, H), jnp.float32))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"table piece 1 has shape \[7, 8\]"):
        jax.block_until_ready(call(local, valid, seg, scale, table[:8], table[8:15],
                                   num_threads=np.int64(1)))  # fmt: skip


@pytest.mark.parametrize("hidden", [64, 100])  # 64-column register blocks, then 16, then a tail
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_wide_rows(hidden, dtype):
    for sorted_segments in (True, False):
        table, local, valid, seg, scale = make_slots(
            16, 120, dtype=dtype, hidden=hidden, sorted_segments=sorted_segments
        )
        got = native.pool_sum(table, local, valid, seg, scale, S)
        want = np_pool_sum(np.asarray(table.astype(jnp.float32)), local, valid, seg, scale, S)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            got, local_ops.pool_sum(table, local, valid, seg, scale, S), rtol=1e-5, atol=1e-6
        )
    f = FORMULAS["rowwise_adagrad"]
    state = f.init_state(R, hidden)
    out_grad = jnp.asarray(np.random.default_rng(16).normal(size=(S, hidden)), dtype)
    touched = np.zeros(R, bool)
    touched[local[valid & (local >= 0) & (local < R)]] = True
    args = (f, table, state, 1, local, valid, seg, scale, out_grad)
    assert_update_equal(
        native.bag_apply_rows(*args, hidden_size=hidden),
        sparse.bag_apply_rows(*args, hidden_size=hidden),
        (table, state),
        touched,
    )
    grads = jnp.asarray(np.random.default_rng(17).normal(size=(120, hidden)), dtype)
    args = (f, table, state, 1, local, valid, grads)
    want = sparse.apply_rows(*args, hidden_axes=(), hidden_size=hidden)
    assert_update_equal(native.apply_rows(*args, hidden_size=hidden), want, (table, state), touched)


def test_dedup_rows_bitwise_xla():
    _, local, valid, _, _ = make_slots(5, 500, rows=3000)
    got = jax.jit(native.dedup_rows, static_argnums=2)(local, valid, 3000)
    want = sparse.dedup_rows(jnp.asarray(local), jnp.asarray(valid), 3000)
    assert bitwise(got[0], want[0]) and bitwise(got[1], want[1])


def test_empty_slots():
    table = jnp.ones((R, H))
    empty_i, empty_b, empty_f = (np.zeros(0, d) for d in (np.int32, bool, np.float32))
    assert native.gather_rows(table, empty_i, empty_b).shape == (0, H)
    assert bitwise(
        native.pool_sum(table, empty_i, empty_b, empty_i, empty_f, S), np.zeros((S, H), np.float32)
    )
    maxima, winners = native.pool_max(table, empty_i, empty_b, empty_i, S)
    assert np.all(np.isneginf(maxima)) and np.all(np.asarray(winners) == 0)  # M = 0
    assert bitwise(
        native.scatter_add((R, H), empty_i, empty_b, np.zeros((0, H), np.float32)),
        np.zeros((R, H), np.float32),
    )
    assert native.dedup_rows(empty_i, empty_b, R)[0].shape == (0,)
    f = FORMULAS["adam"]
    state = f.init_state(R, H)
    new, new_state = native.apply_rows(
        f, table, state, 0, empty_i, empty_b, jnp.zeros((0, H)), hidden_size=H
    )
    assert bitwise(new, table) and all(bitwise(a, b) for a, b in zip(new_state, state, strict=True))
    assert native.pool_sum(table, empty_i, empty_b, empty_i, empty_f, 0).shape == (0, H)


def test_default_threads_divide_the_cores_by_the_meshs_devices(monkeypatch):
    """8 cores: a body over 8 devices gets 1 thread a call, over 2 devices 4, over 1 all 8;
    outside any mesh, the process's devices share them."""
    monkeypatch.delenv("JAXEMBED_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    seen = {}
    for n in (8, 2, 1):
        mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])

        def body(v, n=n):
            seen[n] = native.num_threads()
            return v

        f = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        jax.jit(f).lower(jax.ShapeDtypeStruct((8,), jnp.float32,
                                              sharding=NamedSharding(mesh, P("x"))))  # fmt: skip
    assert seen == {8: 1, 2: 4, 1: 8}
    assert native.num_threads() == max(1, 8 // jax.local_device_count())


def test_results_do_not_depend_on_thread_count(monkeypatch):
    """Big enough for 2 threads (>= 2^18 slots each): bitwise the 1-thread results."""
    table, local, valid, seg, scale = make_slots(6, 300_000, rows=5000, segments=3000)
    sorted_seg = np.sort(seg)
    og = jnp.asarray(np.random.default_rng(6).normal(size=(3000, H)), jnp.float32)
    f = FORMULAS["rowwise_adagrad"]
    # 72 columns over 200 rows: the dense update, whose threads split the columns (4 + 1 lines)
    wide = make_slots(7, 300_000, rows=200, segments=3000, hidden=72)
    wide_og = jnp.asarray(np.random.default_rng(7).normal(size=(3000, 72)), jnp.float32)
    # 500 distinct rows of 200k, each ~450 times: the compact block
    few = make_slots(8, 300_000, rows=200_000, segments=3000, hidden=72, distinct=500)
    runs = []
    for threads in ("1", "2"):
        monkeypatch.setenv("JAXEMBED_NUM_THREADS", threads)
        assert native.num_threads() == int(threads)
        runs.append((
            native.pool_sum(table, local, valid, seg, scale, 3000),
            native.pool_sum(table, local, valid, sorted_seg, scale, 3000),
            native.bag_scatter_add((5000, H), local, valid, seg, scale, og),
            native.dedup_rows(local, valid, 5000)[1],
            native.bag_apply_rows(f, table, f.init_state(5000, H), 0, local, valid, seg, scale, og, hidden_size=H)[0],
            native.bag_apply_rows(f, wide[0], f.init_state(200, 72), 0, *wide[1:], wide_og, hidden_size=72)[0],
            native.bag_apply_rows(f, few[0], f.init_state(200_000, 72), 0, *few[1:], wide_og, hidden_size=72)[0],
        ))  # fmt: skip
    for one, two in zip(*runs, strict=True):
        assert bitwise(one, two)


# --- the row-sparse updates -------------------------------------------------------------------


def random_state(formula, rng, rows):
    out = []
    for slot in formula.slots:
        shape = slot.shape(rows, H)
        lo, hi = (
            (0.05, 2.0)
            if slot.name == "accumulator"
            else (0.0, 0.5)
            if slot.name == "nu"
            else (-0.2, 0.2)
        )
        out.append(jnp.asarray(rng.uniform(lo, hi, shape), jnp.float32))
    return tuple(out)


def assert_update_equal(got, want, before, touched):
    """Within float32 rounding of the XLA update; bitwise unchanged where not touched."""
    (new_w, new_s), (want_w, want_s) = got, want
    untouched = ~touched
    for g, w, b in ((new_w, want_w, before[0]), *zip(new_s, want_s, before[1], strict=True)):
        assert g.dtype == w.dtype == b.dtype and g.shape == w.shape
        g, w, b = (np.asarray(x.astype(jnp.float32)) for x in (g, w, b))
        atol = 1e-6 if new_w.dtype == jnp.float32 else 1e-2
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=atol)
        assert g[untouched].tobytes() == b[untouched].tobytes()


# The update sums a row's gradients three ways: in a [R, H] block where the table is small and
# the batch touches it often (40 rows), over the slots sorted by row (4000 rows), or in a block
# of the batch's distinct rows where they are few and repeat (12 of 4000 rows): all must be
# XLA's bits.
PATHS = pytest.mark.parametrize(
    "rows, distinct", [(R, None), (4000, None), (4000, 12)], ids=["dense", "sorted", "compact"]
)


@PATHS
@pytest.mark.parametrize("name", FORMULAS)
def test_apply_rows_matches_xla_every_formula(name, rows, distinct):
    formula = FORMULAS[name]
    rng = np.random.default_rng(7)
    table, local, valid, _, _ = make_slots(7, 90, rows=rows, distinct=distinct)
    state = random_state(formula, rng, rows)
    grads = jnp.asarray(rng.normal(size=(90, H)), jnp.float32)
    touched = np.zeros(rows, bool)
    touched[local[valid & (local >= 0) & (local < rows)]] = True
    for count in (0, 4):
        got = jax.jit(native.apply_rows, static_argnums=0, static_argnames="hidden_size")(
            formula, table, state, jnp.int32(count), local, valid, grads, hidden_size=H
        )
        want = sparse.apply_rows(formula, table, state, jnp.int32(count), local, valid, grads,
                                 hidden_axes=(), hidden_size=H)  # fmt: skip
        assert_update_equal(got, want, (table, state), touched)
        ref_w, ref_s = reference.sparse_step(
            formula,
            np.asarray(table),
            state,
            np.where(valid, local, -1),
            np.asarray(grads),
            count=count,
            vocab_size=rows,
        )  # fmt: skip  (float64; invalid slots as id -1, which the reference skips)
        np.testing.assert_allclose(got[0], ref_w, rtol=2e-4, atol=2e-5)
        for g, w in zip(got[1], ref_s, strict=True):
            np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5)
        # the gradients as an all_to_all's 6 pieces of 15 slots, read in place: the same
        pieces = [grads[j * 15 : (j + 1) * 15] for j in range(6)]
        apart = jax.jit(native.apply_rows_pieces, static_argnums=0,
                        static_argnames="hidden_size")  # fmt: skip
        split = apart(formula, table, state, jnp.int32(count), local, valid, pieces, hidden_size=H)
        pairs = zip(jax.tree.leaves(split), jax.tree.leaves(got), strict=True)
        assert all(bitwise(a, b) for a, b in pairs)
    with pytest.raises(ValueError, match=r"piece 0 has shape \(16, 8\); 6 pieces for M=90"):
        native.apply_rows_pieces(formula, table, state, 0, local, valid,
                                 [grads[:16]] * 6, hidden_size=H)  # fmt: skip


@pytest.mark.parametrize(
    "name",
    [
        "sgd_wd",
        "adagrad",
        "fbgemm_adagrad",
        "rowwise_adagrad_decoupled",
        "adam_wd_b1_0",
        "partial_rowwise_adam",
        "ftrl_power",
    ],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@PATHS
def test_bag_apply_rows_matches_xla(name, dtype, rows, distinct):
    formula = FORMULAS[name]
    rng = np.random.default_rng(8)
    table, local, valid, seg, scale = make_slots(8, 110, dtype=dtype, rows=rows, distinct=distinct)
    state = random_state(formula, rng, rows)
    out_grad = jnp.asarray(rng.normal(size=(S, H)), dtype)
    touched = np.zeros(rows, bool)
    touched[local[valid & (local >= 0) & (local < rows)]] = True  # segment -1 / >= S: zero grad
    got = native.bag_apply_rows(
        formula, table, state, 3, local, valid, seg, scale, out_grad, hidden_size=H
    )
    want = sparse.bag_apply_rows(
        formula, table, state, 3, local, valid, seg, scale, out_grad, hidden_size=H
    )
    assert_update_equal(got, want, (table, state), touched)


def test_apply_rows_is_in_place_under_donation():
    f = FORMULAS["adam"]
    table, local, valid, _, _ = make_slots(9, 64, rows=1000)
    grads = jnp.ones((64, H))

    def step(table, state, count):
        return native.apply_rows(f, table, state, count, local, valid, grads, hidden_size=H)

    state = f.init_state(1000, H)
    jitted = jax.jit(step, donate_argnums=(0, 1))
    hlo = jitted.lower(table, state, jnp.int32(0)).compile().as_text()
    assert "custom-call" in hlo and "jaxembed_apply_rows" in hlo
    copies = [line for line in hlo.splitlines() if re.search(rf"f32\[1000,{H}\]\S* copy\(", line)]
    assert not copies, copies
    want = sparse.apply_rows(f, table, state, 0, local, valid, grads, hidden_axes=(), hidden_size=H)
    got = jitted(jnp.array(table), tuple(jnp.array(s) for s in state), jnp.int32(0))
    assert_update_equal(got, want, (table, state), np.isin(np.arange(1000), local[valid]))


def test_apply_rows_without_donation_leaves_its_inputs_alone():
    f = FORMULAS["rowwise_adagrad"]
    table, local, valid, _, _ = make_slots(10, 30)
    state = f.init_state(R, H)
    before = np.asarray(table).copy()
    native.apply_rows(f, table, state, 0, local, valid, jnp.ones((30, H)), hidden_size=H)
    assert np.asarray(table).tobytes() == before.tobytes()
    assert np.all(np.asarray(state[0]) == 0)


# --- inside shard_map, vmap --------------------------------------------------------------------


def test_kernels_inside_shard_map_on_8_devices(mesh_8):
    """Each device its own block of slots and its own table shard, native vs XLA."""
    n = 8
    table, local, valid, seg, scale = make_slots(11, 8 * 64, rows=n * R)
    local = local % R  # local rows of each device's shard
    out_grad = jnp.asarray(np.random.default_rng(11).normal(size=(n * S, H)), jnp.float32)
    f = FORMULAS["rowwise_adagrad"]
    state = random_state(f, np.random.default_rng(12), n * R)

    def body(impl_pool, impl_update):
        def run(table, local, valid, seg, scale, out_grad, acc):
            pooled = impl_pool(table, local, valid, seg, scale, S)
            new, (new_acc,) = impl_update(f, table, (acc,), 2, local, valid, seg, scale,
                                          out_grad, hidden_size=H)  # fmt: skip
            return pooled, new, new_acc

        spec = P("model")
        return jax.jit(jax.shard_map(run, mesh=mesh_8, in_specs=(spec,) * 7,
                                     out_specs=(spec, spec, spec)))  # fmt: skip

    put = lambda a: jax.device_put(jnp.asarray(a), NamedSharding(mesh_8, P("model")))
    args = [put(a) for a in (table, local, valid, seg, scale, out_grad, state[0])]
    got = body(native.pool_sum, native.bag_apply_rows)(*args)
    want = body(local_ops.pool_sum, sparse.bag_apply_rows)(*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert got[0].sharding.is_equivalent_to(NamedSharding(mesh_8, P("model")), 2)


def test_vmap_runs_sequentially():
    table, local, valid, seg, scale = make_slots(13, 40)
    tables = jnp.stack([table, 2 * table])
    got = jax.vmap(native.pool_sum, in_axes=(0, None, None, None, None, None))(
        tables, local, valid, seg, scale, S
    )
    for b in range(2):
        np.testing.assert_allclose(
            got[b], local_ops.pool_sum(tables[b], local, valid, seg, scale, S), rtol=1e-5, atol=1e-6
        )


# --- errors, fallback --------------------------------------------------------------------------


def test_python_side_errors():
    table, local, valid, _, _ = make_slots(14, 10)
    with pytest.raises(ValueError, match=r"valid has shape \(9,\) but local has \(10,\)"):
        native.gather_rows(table, local, valid[:9])
    with pytest.raises(TypeError, match="table must be a 2-D float32 or bfloat16"):
        native.gather_rows(table.astype(jnp.int32), local, valid)
    f = FORMULAS["adam"]
    with pytest.raises(ValueError, match=r"hidden_axes=.*split hidden axis"):
        native.apply_rows(
            f,
            table,
            f.init_state(R, H),
            0,
            local,
            valid,
            jnp.ones((10, H)),
            hidden_size=H,
            hidden_axes=("model",),
        )
    with pytest.raises(ValueError, match="takes 2 state arrays"):
        native.apply_rows(f, table, (), 0, local, valid, jnp.ones((10, H)), hidden_size=H)
    with pytest.raises(ValueError, match=r"grads has shape \(10, 3\), expected \(10, 8\)"):
        native.apply_rows(
            f, table, f.init_state(R, H), 0, local, valid, jnp.ones((10, 3)), hidden_size=H
        )


def test_kernel_errors_name_the_value(monkeypatch):
    """Shape checks inside the kernel return an ffi::Error (no abort)."""
    call = jax.ffi.ffi_call("jaxembed_pool_sum", jax.ShapeDtypeStruct((S, H + 1), jnp.float32))
    table, local, valid, seg, scale = make_slots(15, 10)
    with pytest.raises(
        jax.errors.JaxRuntimeError, match=r"pool_sum: out has shape \[12, 9\], expected \[S, 8\]"
    ):
        jax.block_until_ready(call(table, local, valid, seg, scale, num_threads=np.int64(1)))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"num_threads=0 must be in \[1, 1024\]"):
        call0 = jax.ffi.ffi_call("jaxembed_pool_sum", jax.ShapeDtypeStruct((S, H), jnp.float32))
        jax.block_until_ready(call0(table, local, valid, seg, scale, num_threads=np.int64(0)))
    monkeypatch.setenv("JAXEMBED_NUM_THREADS", "zero")
    with pytest.raises(ValueError, match="JAXEMBED_NUM_THREADS='zero' must be an integer"):
        native.pool_sum(table, local, valid, seg, scale, S)


def test_disabled_falls_back_with_one_warning():
    code = """
import warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    from jaxembed.kernels import native
    first, second = native.available(), native.available()
print(first, second, native.why_unavailable())
print(sum(issubclass(w.category, native.NativeKernelsUnavailable) for w in caught))
try:
    native.pool_sum(None, None, None, None, None, 1)
except RuntimeError as e:
    print("RuntimeError", "unavailable" in str(e))
"""
    env = dict(os.environ, JAXEMBED_NATIVE="0", JAX_PLATFORMS="cpu")
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "False False disabled by JAXEMBED_NATIVE=0",
        "1",
        "RuntimeError True",
    ]


@pytest.mark.parametrize("lead", [(), (3,), (2, 2)])
def test_segments_from_lengths_matches_ragged(lead):
    """Negative lengths, empty bags, totals past the capacity and short of it: the same
    segments as `ragged.segments_from_lengths`, eagerly and under jit."""
    from jaxembed import ragged

    rng = np.random.default_rng(11)
    lengths = jnp.asarray(rng.integers(-2, 6, (*lead, 7)), jnp.int32)
    # The reference jitted (eager, it compiles each of its ~60 ops per capacity: 15-26 s).
    reference = jax.jit(ragged.segments_from_lengths, static_argnums=1)
    jitted = jax.jit(native.segments_from_lengths, static_argnums=1)
    for capacity in (0, 1, 9, 20, 64):
        want = reference(lengths, capacity)
        got = jitted(lengths, capacity)
        assert got.dtype == jnp.int32 and got.shape == (*lead, capacity)
        np.testing.assert_array_equal(got, want)
    eager = native.segments_from_lengths(lengths, 9)  # one eager call: the same
    np.testing.assert_array_equal(eager, reference(lengths, 9))
    with jax.enable_x64(True):  # a length past int32 is clamped before the cast, never wrapped
        wide = jnp.asarray([[2**32 + 1, 3]], jnp.int64)
        np.testing.assert_array_equal(native.segments_from_lengths(wide, 4), [[0, 0, 0, 0]])
