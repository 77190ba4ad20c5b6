"""The routed exchange's bucketing by owner, natively (`native.bucket_ids`) and in XLA.

`local.bucket_ids` sorts the slots by (owner, id); its native twin counts the slots into their
buckets, dedups each bucket with a hash and sorts only the distinct ids. Both must give the
same `send`, `pos` and `overflow` bit for bit on any input: random buckets, capacity 1, every
id on one owner, every slot reading no row (bucket n, whose slots are ranked too), many
duplicates, empty buckets, ids up to 2**31 - 1, M = 0; eagerly, under jit and inside a
`shard_map`. Then whole routed lookups and bag lookups with `impl="native"` and `impl="xla"`
on 8 devices: the same values, gradients and `routed_fallback`, equal to the float64 reference,
through the fallback too, with the plan's collectives in the compiled program.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bag_reference import embedding_bag_grad_reference, embedding_bag_reference
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_embedding import dense_reference, make_inputs, make_mesh, put
from test_routed import LAYOUTS, PAD, VOCAB, check_program

import jaxembed
from jaxembed.kernels import local as local_ops
from jaxembed.kernels import native
from jaxembed.kernels.select import kernels_for
from jaxembed.optim import reference

pytestmark = pytest.mark.skipif(
    not native.available(), reason=f"native kernels unavailable: {native.why_unavailable()}"
)

BIG = 2**31 - 1


def make_buckets(seed, m, n, *, owners="random", ids="pool"):
    """dest i32[M] in [0, n] and key i32[M] as `routed.bucketize` makes them (key 0 where
    dest = n), unless `ids="any"`, which gives bucket n's slots ids of their own too."""
    rng = np.random.default_rng(seed)
    dest = {
        "random": lambda: rng.integers(0, n + 1, m),
        "one": lambda: np.where(rng.random(m) < 0.9, int(rng.integers(0, n)), n),
        "none": lambda: np.full(m, n),
        "sparse": lambda: rng.choice([0, n - 1, n], m),  # the buckets in between stay empty
    }[owners]().astype(np.int32)
    key = {
        "pool": lambda: rng.integers(0, 12, m),  # many duplicates
        "wide": lambda: np.where(  # up to 2**31 - 1, the extremes repeated
            rng.random(m) < 0.3, rng.choice([0, 1, BIG - 1, BIG], m), rng.integers(0, BIG, m)
        ),
        "any": lambda: rng.integers(-BIG - 1, BIG, m, endpoint=True),
        "slots": lambda: np.arange(m),  # the owner-pooled exchange's: each slot its index
        "rising": lambda: np.cumsum(rng.integers(0, 3, m)),  # sorted, with a few repeats
    }[ids]().astype(np.int32)
    if ids != "any":
        key = np.where(dest == n, 0, key).astype(np.int32)
    return dest, key


def assert_bitwise(got, want):
    for name, g, w in zip(("send", "pos", "overflow"), got, want, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, g.shape, w.dtype, w.shape)
        np.testing.assert_array_equal(g, w, err_msg=name)


def np_bucket_ids(dest, key, n, c):
    """The definition, in numpy: each bucket's sorted distinct ids, each slot's rank."""
    send = np.full((n, c), -1, np.int32)
    pos = np.zeros(len(dest), np.int32)
    over = False
    for b in range(n + 1):
        here = dest == b
        distinct = np.unique(key[here])
        pos[here] = np.searchsorted(distinct, key[here])
        if b < n:
            send[b, : min(c, len(distinct))] = distinct[:c]
            over |= len(distinct) > c
    return send, pos, np.bool_(over)


# --- the kernel alone ------------------------------------------------------------------------


def check_native_equals_xla(m, n, c, owners, ids, seed):
    dest, key = make_buckets(seed, m, n, owners=owners, ids=ids)
    want = local_ops.bucket_ids(jnp.asarray(dest), jnp.asarray(key), n, c)
    assert_bitwise(native.bucket_ids(jnp.asarray(dest), jnp.asarray(key), n, c), want)
    assert_bitwise(want, np_bucket_ids(dest, key, n, c))


def test_native_equals_xla_bitwise_on_the_edges():
    """The module docstring's edges, on three shapes (each new shape compiles XLA's ops
    again): every owner pattern, every kind of ids, capacity 1 overflowing, M = 0."""
    owners = ["random", "one", "none", "sparse"]
    for i, ids in enumerate(["pool", "wide", "any", "slots"]):
        check_native_equals_xla(257, 8, 5, owners[i], ids, seed=i)
    check_native_equals_xla(257, 8, 5, "sparse", "rising", seed=4)
    check_native_equals_xla(257, 8, 1, "one", "rising", seed=5)  # capacity 1: overflows
    check_native_equals_xla(257, 8, 1, "random", "any", seed=6)
    check_native_equals_xla(0, 1, 1, "none", "pool", seed=7)  # M = 0


# Random shapes and draws beyond the edges above (which run every time): a few are enough.
@settings(max_examples=15, deadline=None)
@given(
    m=st.sampled_from([0, 1, 2, 7, 64, 257]),
    n=st.sampled_from([1, 2, 3, 8]),
    c=st.sampled_from([1, 2, 5, 64]),
    owners=st.sampled_from(["random", "one", "none", "sparse"]),
    ids=st.sampled_from(["pool", "wide", "any", "slots", "rising"]),
    seed=st.integers(0, 2**16),
)
def test_native_equals_xla_bitwise(m, n, c, owners, ids, seed):
    check_native_equals_xla(m, n, c, owners, ids, seed)


@pytest.mark.parametrize("owners", ["random", "one"])
def test_realistic_size_under_jit_and_threads(owners, monkeypatch):
    """65536 slots over 8 owners (a radix-sorted bucket of thousands of distinct ids), at the
    plan's capacity and at a capacity that overflows; 1 or 3 threads give the same bits."""
    dest, _ = make_buckets(1, 65536, 8, owners=owners)
    key = np.random.default_rng(1).integers(0, 1 << 20, 65536)  # a 1M vocabulary
    key = np.where(dest < 8, key, 0).astype(np.int32)
    for c in (8500, 300):
        want = jax.jit(local_ops.bucket_ids, static_argnums=(2, 3))(dest, key, 8, c)
        assert bool(want[2]) == (owners == "one" or c == 300)
        for threads in ("1", "3"):
            monkeypatch.setenv("JAXEMBED_NUM_THREADS", threads)
            got = jax.jit(native.bucket_ids, static_argnums=(2, 3))(dest, key, 8, c)
            assert_bitwise(got, want)


def test_inside_shard_map_on_8_devices(mesh_8):
    """Each device buckets its own block of slots; the results vary over the mesh axis."""
    dest, key = make_buckets(2, 8 * 96, 8, owners="random")

    def run(impl):
        body = lambda d, k: tuple(r[None] for r in impl.bucket_ids(d, k, 8, 5))
        spec = P("model")
        return jax.jit(jax.shard_map(body, mesh=mesh_8, in_specs=(spec, spec),
                                     out_specs=(spec, spec, spec)))  # fmt: skip

    args = [jax.device_put(jnp.asarray(a), NamedSharding(mesh_8, P("model"))) for a in (dest, key)]
    got, want = run(native)(*args), run(local_ops)(*args)
    assert_bitwise(got, want)
    assert got[0].shape == (8, 8, 5) and got[2].shape == (8,)


def test_errors_name_the_value():
    dest, key = make_buckets(3, 10, 4)
    with pytest.raises(ValueError, match=r"dest \(10,\) and key \(9,\) must be one 1-D shape"):
        native.bucket_ids(jnp.asarray(dest), jnp.asarray(key[:9]), 4, 2)
    with pytest.raises(ValueError, match="capacity=0 must be positive"):
        native.bucket_ids(jnp.asarray(dest), jnp.asarray(key), 4, 0)
    dest[6] = 5  # neither an owner (< 4) nor "reads no row" (4)
    with pytest.raises(Exception, match=r"dest\[6\]=5 is outside \[0, num_buckets=4\]"):
        jax.block_until_ready(native.bucket_ids(jnp.asarray(dest), jnp.asarray(key), 4, 2))


def test_the_plan_selects_the_bucketing():
    mesh = jax.sharding.AbstractMesh((8,), ("model",))
    kw = dict(x_spec=P("model"), weight_spec=P("model", None), exchange="routed")
    for impl, module in (("native", native), ("xla", local_ops)):
        plan = jaxembed.plan_embedding(mesh, (64, 16), (1024, 8), impl=impl, **kw)
        assert kernels_for(plan).bucket_ids is module.bucket_ids


# --- whole routed lookups, native against XLA --------------------------------------------------


def no_cotangent(stats):
    """The integer stats' cotangent (float0 zeros, whatever counters `LookupStats` holds)."""
    return jax.tree.map(lambda s: np.zeros(s.shape, jax.dtypes.float0), stats)


def _compare(results):
    """The native and XLA runs agree bitwise: values, gradients, fallback."""
    for a, b in zip(results["native"], results["xla"], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("capacity", [None, 1])
@pytest.mark.parametrize("layout", ["1d-fully-sharded", "rows-over-data-model"])
def test_lookup_native_equals_xla(layout, capacity):
    mesh_shape, w_spec, x_spec = LAYOUTS[layout]
    mesh = make_mesh(mesh_shape, AxisType.Explicit)
    ids, table, ct = make_inputs(np.random.default_rng(5), (16, 8), vocab_size=VOCAB,
                                 padding_idx=PAD)  # fmt: skip
    results = {}
    for impl in ("native", "xla"):
        kw = dict(vocab_size=VOCAB, padding_idx=PAD, exchange="routed", capacity=capacity,
                  impl=impl)  # fmt: skip
        plan = jaxembed.plan_embedding(mesh, ids.shape, table.shape, x_spec=x_spec,
                                       weight_spec=w_spec, **kw)  # fmt: skip
        assert plan.exchange == "routed" and plan.impl == impl

        def step(ids, t, ct, kw=kw):
            (out, stats), vjp = jax.vjp(lambda t: jaxembed.embedding(ids, t, return_stats=True,
                                                                     **kw), t)  # fmt: skip
            return out, stats.routed_fallback, vjp((ct, no_cotangent(stats)))[0]

        args = put(ids, mesh, x_spec), put(table, mesh, w_spec), put(ct, mesh, plan.out_spec)
        compiled = jax.jit(step).lower(*args).compile()
        text = compiled.as_text()
        assert ("jaxembed_bucket_ids" in text) == (impl == "native")
        check_program(plan, text, mesh)
        results[impl] = [np.asarray(a) for a in compiled(*args)]
    _compare(results)
    out, fallback, grad = results["native"]
    ref_out, ref_grad = dense_reference(ids, table, ct, VOCAB, PAD)
    np.testing.assert_array_equal(out, ref_out.astype(np.float32))
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-5)
    assert int(fallback) == (1 if capacity == 1 else 0)


@pytest.mark.parametrize("case", ["default", "capacity-1", "one-owner"])
@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_bag_native_equals_xla(combiner, case):
    """Bags on (8,): the default capacity routes; a capacity of 1, or every id on shard 0 with
    a capacity factor that leaves too little room, falls back, exactly."""
    mesh = make_mesh((8,), AxisType.Explicit)
    rng = np.random.default_rng(9)
    rows, vocab = (1024, 1024) if case == "one-owner" else (64, VOCAB)
    table = rng.normal(size=(rows, 8)).astype(np.float32)
    high = 128 if case == "one-owner" else vocab  # shard 0 holds ids < 128
    x = rng.integers(0, high, size=(64, 6)).astype(np.int32)
    x[rng.random(x.shape) < 0.3] = -1
    x[0] = -1  # an empty bag
    x[2, :3] = [4, 4, 9]  # duplicates
    ct = rng.normal(size=(64, 8)).astype(np.float32)
    extra = {"capacity": 1} if case == "capacity-1" else {}
    if case == "one-owner":
        extra = {"capacity_factor": 0.25}
    results = {}
    for impl in ("native", "xla"):
        kw = dict(vocab_size=vocab, combiner=combiner, exchange="routed", impl=impl,
                  x_spec=P("model"), weight_spec=P("model", None), **extra)  # fmt: skip

        def step(x, t, ct, kw=kw):
            (out, stats), vjp = jax.vjp(lambda t: jaxembed.embedding_bag(x, t, return_stats=True,
                                                                         **kw), t)  # fmt: skip
            return out, stats.routed_fallback, vjp((ct, no_cotangent(stats)))[0]

        args = put(x, mesh, P("model")), put(table, mesh, P("model", None)), put(ct, mesh,
                                                                                  P("model"))  # fmt: skip
        results[impl] = [np.asarray(a) for a in jax.jit(step)(*args)]
    _compare(results)
    out, fallback, grad = results["native"]
    assert int(fallback) == (0 if case == "default" else 1)
    ref = embedding_bag_reference(table, x, combiner=combiner, vocab_size=vocab)
    ref_grad = embedding_bag_grad_reference(table, x, combiner=combiner, vocab_size=vocab,
                                            out_grad=ct)  # fmt: skip
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-5)


def test_adversarial_skew_falls_back_exactly_natively():
    """Every id on shard 0 (block rows) overflows the default capacity: both impls fall back
    and equal `table[ids]`; in mod order neither does."""
    mesh = make_mesh((8,), AxisType.Explicit)
    rng = np.random.default_rng(3)
    table = rng.normal(size=(1024, 8)).astype(np.float32)
    ids = rng.integers(0, 128, size=(64, 16)).astype(np.int32)
    x = put(ids, mesh, P("model"))
    for row_sharding, stored, fell in (
        ("block", table, 1),
        ("mod", np.asarray(jaxembed.to_mod_order(table, 8)), 0),
    ):
        t = put(stored, mesh, P("model", None))
        outs = []
        for impl in ("native", "xla"):
            f = jax.jit(lambda x, t, impl=impl, rs=row_sharding: jaxembed.embedding(
                x, t, exchange="routed", row_sharding=rs, impl=impl, return_stats=True))  # fmt: skip
            out, stats = f(x, t)
            np.testing.assert_array_equal(np.asarray(out), table[ids])
            assert int(stats.routed_fallback) == fell, (row_sharding, impl)
            outs.append(np.asarray(out))
        np.testing.assert_array_equal(*outs)


def _all_to_all_copies(hlo: str) -> tuple[int, int]:
    """In a compiled program: `(sliced, joined)`, the float `all_to_all`s' operands that
    XLA made by slicing (anything but a custom call's result, or a bitcast of one), and the instructions other than
    custom calls that take two or more results of one float `all_to_all` (a concatenation,
    fused or not)."""
    lines = {}
    for m in re.finditer(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.*)$", hlo, re.M):
        lines[m.group(1)] = m.group(2)

    def operands(rest):
        call = re.search(r"[a-z\-]+\((.*?)\)(?:,|$)", rest.split(" metadata=")[0])
        return re.findall(r"%([\w.\-]+)", call.group(1)) if call else []

    def custom(name):
        rest = lines.get(name, "")
        if "get-tuple-element(" in rest or " bitcast(" in rest:  # no copy: follow it
            return custom(operands(rest)[0])
        return "custom-call(" in rest

    floats = {n for n, r in lines.items() if "all-to-all(" in r and r.lstrip("(").startswith("f")}
    sliced = sum(not custom(o) for n in floats for o in operands(lines[n]))
    of = {n: operands(r)[0] for n, r in lines.items() if "get-tuple-element(" in r}
    joined = 0
    for _n, rest in lines.items():
        if "custom-call(" in rest or "all-to-all(" in rest:
            continue
        sources = [of.get(o) for o in operands(rest) if of.get(o) in floats]
        joined += any(sources.count(a) > 1 for a in set(sources))
    return sliced, joined


def test_bag_rows_cross_the_all_to_all_in_pieces():
    """XLA:CPU runs an `all_to_all` on n separate buffers, slicing its operand and
    concatenating its results. The native routed bag gathers each owner's rows as one buffer,
    pools the received pieces in place (`pool_sum_pieces`) and sums the gradients into pieces
    (`bag_scatter_add_pieces`), and the owner scatters the gradient pieces it receives into the
    table's gradient where they lie (`scatter_add_pieces`): no float all_to_all operand is
    sliced and none of its results is joined. XLA's kernels slice and join both."""
    mesh = make_mesh((8,), AxisType.Explicit)
    rng = np.random.default_rng(3)
    table = rng.normal(size=(64, 8)).astype(np.float32)  # VOCAB rows, padded to split
    x = rng.integers(0, VOCAB, size=(64, 6)).astype(np.int32)
    ct = rng.normal(size=(64, 8)).astype(np.float32)
    copies = {}
    for impl in ("native", "xla"):
        kw = dict(vocab_size=VOCAB, exchange="routed", routed_pool="source", impl=impl,
                  x_spec=P("model"), weight_spec=P("model", None))  # fmt: skip

        def step(x, t, ct, kw=kw):
            out, vjp = jax.vjp(lambda t: jaxembed.embedding_bag(x, t, **kw), t)
            return out, vjp(ct)[0]

        args = put(x, mesh, P("model")), put(table, mesh, P("model", None)), put(ct, mesh,
                                                                                  P("model"))  # fmt: skip
        compiled = jax.jit(step).lower(*args).compile()
        copies[impl] = _all_to_all_copies(compiled.as_text())
        out, grad = (np.asarray(a) for a in compiled(*args))
        np.testing.assert_allclose(out, embedding_bag_reference(table, x, vocab_size=VOCAB),
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
        ref_grad = embedding_bag_grad_reference(table, x, vocab_size=VOCAB, out_grad=ct)
        np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-5)
    assert copies["native"] == (0, 0), copies
    assert copies["xla"][0] >= 16 and copies["xla"][1] >= 2, copies


def _routed_update(opt, mesh, table, x, ct, kw):
    """One routed row-sparse update on `mesh` (table by rows over "model", ids and `ct` by
    batch), compiled: `(copies, table, state slots)`, `copies` as `_all_to_all_copies` counts
    them; no step falls back."""
    t = put(table, mesh, P("model", None))
    args = (t, opt.init(t), put(x, mesh, P("model")), put(ct, mesh, P("model")))
    update = jax.jit(lambda t, s, x, g: opt.update(t, s, x, g, **kw))
    compiled = update.lower(*args).compile()
    new_t, new_state = compiled(*args)
    assert int(new_state.routed_fallbacks) == 0
    slots = [a for a in jax.tree.leaves(new_state) if a.shape[:1] == table.shape[:1]]
    return _all_to_all_copies(compiled.as_text()), new_t, slots


def test_update_reads_the_gradient_pieces_in_place():
    """The routed bag's row-sparse update: the sources sum their gradients into pieces, the
    owners update from the pieces they receive (`apply_rows_pieces`): no float all_to_all
    operand sliced, none of its results joined; XLA's kernels do both. Both equal the float64
    reference (table and accumulator)."""
    mesh = make_mesh((8,), AxisType.Explicit)
    rng = np.random.default_rng(4)
    table = rng.normal(size=(64, 8)).astype(np.float32)
    x = rng.integers(0, VOCAB, size=(64, 6)).astype(np.int32)
    x[rng.random(x.shape) < 0.25] = -1
    ct = rng.normal(size=(64, 8)).astype(np.float32)
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    copies = {}
    for impl in ("native", "xla"):
        kw = dict(vocab_size=VOCAB, combiner="sum", exchange="routed", routed_pool="source",
                  impl=impl, x_spec=P("model"), weight_spec=P("model", None))  # fmt: skip
        copies[impl], new_t, slots = _routed_update(opt, mesh, table, x, ct, kw)
        ids = np.concatenate([b[b >= 0] for b in x])
        grads = np.concatenate([np.repeat(ct[b][None], (x[b] >= 0).sum(), 0)
                                for b in range(64)]).astype(np.float64)  # fmt: skip
        ref_t, ref_s = reference.sparse_step(
            opt.formula, table[:VOCAB].astype(np.float64),
            reference.init_states(opt.formula, VOCAB, 8), ids, grads, count=0,
        )  # fmt: skip
        np.testing.assert_allclose(np.asarray(new_t)[:VOCAB], ref_t, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(slots[0])[:VOCAB], ref_s[0], rtol=1e-5,
                                   atol=1e-6)  # fmt: skip
    assert copies["native"] == (0, 0), copies
    assert copies["xla"][0] >= 8 and copies["xla"][1] >= 1, copies


def test_lookup_rows_cross_the_all_to_all_in_pieces():
    """The routed lookup (no bags) as the bag: the native kernels read each slot's row from the
    received pieces (a bag of one, `pool_sum_pieces`), sum its gradient into the pieces sent
    back (`bag_scatter_add_pieces`) and scatter the received pieces into the table's gradient
    (`scatter_add_pieces`): no float all_to_all operand sliced, none of its results joined.
    XLA's kernels slice and join both. Both equal the float64 reference."""
    mesh = make_mesh((8,), AxisType.Explicit)
    ids, table, ct = make_inputs(np.random.default_rng(6), (64, 4), vocab_size=VOCAB,
                                 padding_idx=PAD)  # fmt: skip
    copies = {}
    for impl in ("native", "xla"):
        kw = dict(vocab_size=VOCAB, padding_idx=PAD, exchange="routed", impl=impl,
                  x_spec=P("model"), weight_spec=P("model", None))  # fmt: skip

        def step(ids, t, ct, kw=kw):
            out, vjp = jax.vjp(lambda t: jaxembed.embedding(ids, t, **kw), t)
            return out, vjp(ct)[0]

        args = put(ids, mesh, P("model")), put(table, mesh, P("model", None)), put(
            ct, mesh, P("model"))  # fmt: skip
        compiled = jax.jit(step).lower(*args).compile()
        copies[impl] = _all_to_all_copies(compiled.as_text())
        out, grad = (np.asarray(a) for a in compiled(*args))
        ref_out, ref_grad = dense_reference(ids, table, ct, VOCAB, PAD)
        np.testing.assert_array_equal(out, ref_out.astype(np.float32))
        np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-5)
    assert copies["native"] == (0, 0), copies
    assert copies["xla"][0] >= 16 and copies["xla"][1] >= 2, copies


def test_lookup_update_reads_the_gradient_pieces_in_place():
    """The routed lookup's row-sparse update (no bags): no float all_to_all operand sliced,
    none of its results joined with the native kernels; XLA's kernels do both. Both equal the
    float64 reference (table and accumulator)."""
    mesh = make_mesh((8,), AxisType.Explicit)
    ids, table, ct = make_inputs(np.random.default_rng(7), (64, 4), vocab_size=VOCAB,
                                 padding_idx=PAD)  # fmt: skip
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < VOCAB) & (flat != PAD)
    copies = {}
    for impl in ("native", "xla"):
        kw = dict(vocab_size=VOCAB, padding_idx=PAD, exchange="routed", impl=impl,
                  x_spec=P("model"), weight_spec=P("model", None))  # fmt: skip
        copies[impl], new_t, slots = _routed_update(opt, mesh, table, ids, ct, kw)
        ref_t, ref_s = reference.sparse_step(
            opt.formula, table.astype(np.float64),
            reference.init_states(opt.formula, table.shape[0], table.shape[1]), flat[valid],
            ct.reshape(-1, table.shape[1])[valid].astype(np.float64), count=0,
        )  # fmt: skip
        np.testing.assert_allclose(np.asarray(new_t), ref_t, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(slots[0]), ref_s[0], rtol=1e-5, atol=1e-6)
    assert copies["native"] == (0, 0), copies
    assert copies["xla"][0] >= 8 and copies["xla"][1] >= 1, copies
