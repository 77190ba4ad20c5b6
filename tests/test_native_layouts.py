"""The native kernels against the XLA ones inside the sharded programs, every layout.

`tests/test_native.py` checks each native kernel alone; here whole lookups, bag lookups and
row-sparse updates run with `impl="native"` and `impl="xla"` on the layouts and exchanges of
the other suites (rows, rows over two axes, hidden split, replicated, routed), with
duplicates, empty bags, padding and out-of-range ids: outputs, gradients, updated tables and
state must agree within float32 rounding, untouched rows bitwise; and both must match the
float64 reference.
"""

import jax
import numpy as np
import pytest
from bag_reference import embedding_bag_grad_reference, embedding_bag_reference
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from test_embedding import make_inputs, make_mesh, put

import jaxembed
from jaxembed.kernels import native
from jaxembed.optim import reference

pytestmark = pytest.mark.skipif(not native.available(), reason=f"{native.why_unavailable()}")

ROWS, VOCAB, PAD = 64, 59, 7
# (mesh, table spec, ids spec, exchange)
LAYOUTS = {
    "rows-dense": ((2, 4), P("model", None), P("data"), "dense"),
    "rows-rows": ((2, 4), P("model", None), P("data"), "rows"),
    "rows-over-data-model": ((2, 4), P(("data", "model"), None), P("data"), "auto"),
    "hidden": ((2, 4), P(None, "model"), P("data"), "rows"),
    "replicated": ((2, 4), P(), P("data"), "rows"),
    "routed": ((8,), P("model", None), P("model"), "routed"),
}


def bags(rng, batch=16, length=6):
    x = rng.integers(0, VOCAB, size=(batch, length)).astype(np.int32)
    x[rng.random(x.shape) < 0.3] = -1
    x[0] = -1  # an empty bag
    x[1, :3] = [PAD, VOCAB + 1, 4]  # padding, out of range
    x[2, :3] = [4, 4, 9]  # duplicates
    return x


# Every combiner on rows-rows (the native bag kernels' own paths); the routed exchange every
# combiner it routes (a max has no partial sums to route: the plan never routes it); each
# other layout two combiners, so that each meets a sum-like and a scaled or max bag and every
# combiner runs on at least three layouts.
BAG_CASES = {
    "rows-dense": ("sum", "max"),
    "rows-rows": ("sum", "mean", "sqrtn", "max"),
    "rows-over-data-model": ("mean", "sqrtn"),
    "hidden": ("sum", "max"),
    "replicated": ("sqrtn", "max"),
    "routed": ("sum", "mean", "sqrtn"),
}


@pytest.mark.parametrize(
    ("layout", "combiner"), [(lay, c) for lay, cs in BAG_CASES.items() for c in cs]
)
def test_bag_lookup_and_gradient(layout, combiner):
    mesh_shape, w_spec, x_spec, exchange = LAYOUTS[layout]
    mesh = make_mesh(mesh_shape, AxisType.Explicit)
    rng = np.random.default_rng(len(layout) + len(combiner))
    table = rng.normal(size=(ROWS, 16)).astype(np.float32)
    x = bags(rng)
    ct = rng.normal(size=(16, 16)).astype(np.float32)
    results = {}
    for impl in ("xla", "native"):
        kw = dict(combiner=combiner, vocab_size=VOCAB, padding_idx=PAD, exchange=exchange,
                  impl=impl)  # fmt: skip

        def step(x, t, ct, kw=kw):
            out, vjp = jax.vjp(lambda t: jaxembed.embedding_bag(x, t, **kw), t)
            return out, vjp(ct)[0]

        out_spec = jaxembed.plan_embedding_bag(mesh, x.shape, table.shape, x_spec=x_spec,
                                               weight_spec=w_spec, **kw).out_spec  # fmt: skip
        args = put(x, mesh, x_spec), put(table, mesh, w_spec), put(ct, mesh, out_spec)
        results[impl] = [np.asarray(a) for a in jax.jit(step)(*args)]
    for a, b in zip(results["native"], results["xla"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    ref = embedding_bag_reference(table, x, combiner=combiner, vocab_size=VOCAB, padding_idx=PAD)
    ref_grad = embedding_bag_grad_reference(
        table, x, combiner=combiner, vocab_size=VOCAB, padding_idx=PAD, out_grad=ct
    )
    np.testing.assert_allclose(results["native"][0], ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(results["native"][1], ref_grad, rtol=1e-5, atol=1e-5)


OPTIMIZERS = {
    "sgd": lambda: jaxembed.optim.sgd(0.1),
    "adagrad": lambda: jaxembed.optim.adagrad(0.1, initial_accumulator_value=0.1),
    "rowwise_adagrad": lambda: jaxembed.optim.rowwise_adagrad(
        0.1, weight_decay=0.01, weight_decay_mode="decoupled"
    ),
    "adam": lambda: jaxembed.optim.adam(0.01, weight_decay=0.01),
    "partial_rowwise_adam": lambda: jaxembed.optim.partial_rowwise_adam(0.01),
    "ftrl": lambda: jaxembed.optim.ftrl(0.1, l1=0.001, l2=0.01),
}


# Every optimizer on rows-rows (the native update kernels run each formula there). The other
# layouts change the exchange, not the formula: each runs a rowwise and a per-element state,
# and the hidden split (where a rowwise state sums over the hidden shards) both rowwise ones.
UPDATE_CASES = {
    "rows-rows": tuple(OPTIMIZERS),
    "rows-over-data-model": ("adagrad", "partial_rowwise_adam"),
    "routed": ("rowwise_adagrad", "ftrl"),
    "hidden": ("rowwise_adagrad", "partial_rowwise_adam", "adam"),
}


@pytest.mark.parametrize("form", ["lookup", "bag"])
@pytest.mark.parametrize(
    ("layout", "name"), [(lay, n) for lay, names in UPDATE_CASES.items() for n in names]
)
def test_updates(layout, name, form):
    mesh_shape, w_spec, x_spec, exchange = LAYOUTS[layout]
    mesh = make_mesh(mesh_shape, AxisType.Explicit)
    opt = OPTIMIZERS[name]()
    rng = np.random.default_rng(len(layout) * 3 + len(name))
    ids, table, grad = make_inputs(rng, (16, 8), vocab_size=VOCAB, padding_idx=PAD)
    bag_kw = {}
    if form == "bag":
        ids = bags(rng, 16, 8)
        grad = rng.normal(size=(16, table.shape[1])).astype(np.float32)
        bag_kw = {"combiner": "mean"}
    results = {}
    for impl in ("xla", "native"):
        t = put(table, mesh, w_spec)
        state = opt.init(t)
        update = jax.jit(
            lambda t, s, x, g, impl=impl: opt.update(
                t, s, x, g, vocab_size=VOCAB, padding_idx=PAD, exchange=exchange, impl=impl,
                **bag_kw,
            ),
            donate_argnums=(0, 1),
        )  # fmt: skip
        plan = opt.plan(mesh, ids.shape, table.shape, x_spec=x_spec, weight_spec=w_spec,
                        vocab_size=VOCAB, exchange=exchange, **bag_kw)  # fmt: skip
        for _ in range(2):
            t, state = update(t, state, put(ids, mesh, x_spec), put(grad, mesh, plan.out_spec))
        results[impl] = (np.asarray(t), {k: np.asarray(v) for k, v in state.slots.items()})
    np.testing.assert_allclose(results["native"][0], results["xla"][0], rtol=1e-5, atol=1e-6)
    for k in results["xla"][1]:
        np.testing.assert_allclose(results["native"][1][k], results["xla"][1][k], rtol=1e-5,
                                   atol=1e-6)  # fmt: skip
    # Untouched rows: bitwise the table's, in both.
    touched = np.zeros(ROWS, bool)
    ok = (ids >= 0) & (ids < VOCAB) & (ids != PAD)
    touched[ids[ok]] = True
    for impl in ("xla", "native"):
        np.testing.assert_array_equal(results[impl][0][~touched], table[~touched])
    if form == "lookup":
        ref_t = table.astype(np.float64)
        ref_s = reference.init_states(opt.formula, *table.shape)
        for count in range(2):
            ref_t, ref_s = reference.sparse_step(opt.formula, ref_t, ref_s, ids, grad, count=count,
                                                 vocab_size=VOCAB, padding_idx=PAD)  # fmt: skip
        np.testing.assert_allclose(results["native"][0], ref_t, rtol=1e-5, atol=1e-6)


def test_the_plan_names_the_kernels():
    mesh = make_mesh((2, 4), AxisType.Explicit)
    kw = dict(x_spec=P("data"), weight_spec=P("model", None))
    assert jaxembed.plan_embedding(mesh, (8, 8), (64, 8), impl="xla", **kw).impl == "xla"
    assert jaxembed.plan_embedding(mesh, (8, 8), (64, 8), **kw).impl == "native"
    with pytest.raises(ValueError, match="impl must be one of"):
        jaxembed.plan_embedding(mesh, (8, 8), (64, 8), impl="fast", **kw)
    with pytest.raises(ValueError, match="runs on CPU only"):
        jaxembed.plan_embedding(mesh, (8, 8), (64, 8), impl="native", backend="gpu", **kw)


FALLBACK = """
import os, warnings
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxembed
mesh = jax.make_mesh((2, 4), ("data", "model"))
table = np.arange(64 * 4, dtype=np.float32).reshape(64, 4)
x = np.array([[1, 2, -1], [3, 3, 3]] * 4, np.int32)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    t = jax.device_put(table, NamedSharding(mesh, P("model", None)))
    i = jax.device_put(x, NamedSharding(mesh, P("data")))
    out = jaxembed.embedding_bag(i, t, combiner="mean")
    out = jaxembed.embedding_bag(i, t, combiner="sum")
plan = jaxembed.plan_embedding_bag(mesh, x.shape, table.shape, x_spec=P("data"),
                                   weight_spec=P("model", None))
assert plan.impl == "xla", plan.impl
want = np.where((x >= 0)[..., None], table[np.maximum(x, 0)], 0).sum(1)
np.testing.assert_array_equal(np.asarray(out), want)
ours = [w for w in caught if "native" in str(w.message).lower()]
assert len(ours) == 1, [str(w.message) for w in caught]
print("ok", ours[0].message)
"""


def test_without_the_native_library_the_xla_kernels_run():
    import os
    import subprocess
    import sys

    env = {**os.environ, "JAXEMBED_NATIVE": "0"}
    done = subprocess.run([sys.executable, "-c", FALLBACK], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok") and "JAXEMBED_NATIVE" in done.stdout, done.stdout
