"""Run by tests/test_multihost_dynamic.py under `python -m jaxembed.launch --processes 2`.

A dynamic table trained over two processes: six jitted steps of a sum-pooled bag over raw
64-bit ids (remap with admission and eviction, row resets, `adagrad` update, a dense head) on
a (data=2, model=4) mesh whose `data` axis spans the processes, the table split by rows and
the keys by batch, for each eviction policy and three layouts (the last with the batch split
over the rows' axes: each id routed to its owner across the processes). Each process runs the same
steps on one of its own devices as the reference and checks every shard it holds: the
identity and metadata arrays and the steps' counts bitwise, the table, optimizer state and
head to float32 rounding (the eight devices' pooled sums add the same rows in another order).
Prints `DYNAMIC OK <policy> <layout> process <i>`.
"""

import sys

from jaxembed.launch import initialize

initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxembed  # noqa: E402
from jaxembed.dynamic import DynamicTableConfig, as_keys  # noqa: E402
from jaxembed.optim import dynamic  # noqa: E402

LAYOUTS = {  # the table's layout, the batch's (over the rows' axes: each id routed to its owner)
    "rows-over-model": (P("model", None), P("data")),
    "rows-over-data-model": (P(("data", "model"), None), P("data")),
    "rows-over-data-model-routed": (P(("data", "model"), None), P(("data", "model"))),
}
POLICIES = ("lru", "lfu", "ttl")
HIDDEN, BATCH, WIDTH, STEPS = 8, 16, 4, 6


def stream():
    """The same raw ids (as numpy key pairs, made outside any mesh) and labels on every
    process: a Zipf stream that drifts each step."""
    rng, out = np.random.default_rng(0), []
    for t in range(STEPS):
        raw = (rng.zipf(1.3, (BATCH, WIDTH)) + 7 * t).astype(np.uint64)
        raw *= np.uint64(0x9E3779B97F4A7C15)  # spread over the 64-bit space
        out.append((np.asarray(as_keys(raw)), rng.integers(0, 2, BATCH).astype(np.float32)))
    return out


STREAM = stream()


def make_step(cfg, opt, spec):
    init = jax.nn.initializers.normal(0.01)

    def train_step(dyn, opt_state, head, keys, labels, t):
        rows, dyn, opt_state, stats = dynamic.prepare(
            cfg, dyn, opt_state, keys, t, initializer=init, key=jax.random.key(0),
            optimizer=opt, weight_spec=spec,
        )  # fmt: skip
        pooled = jaxembed.embedding_bag(rows, dyn.table, combiner="sum")  # f32[B, H]

        def loss_fn(head, pooled):
            return optax.sigmoid_binary_cross_entropy(pooled @ head, labels).mean()

        loss, (g_head, g_pooled) = jax.value_and_grad(loss_fn, (0, 1))(head, pooled)
        table, opt_state = opt.update(
            dyn.table, opt_state, rows, g_pooled, combiner="sum", after=pooled,
            weight_spec=spec,
        )  # fmt: skip
        return dyn._replace(table=table), opt_state, head - 0.1 * g_head, loss, stats

    return jax.jit(train_step)


def host(x):
    """A replicated or one-device array's value, from a shard this process holds."""
    return np.asarray(x.addressable_shards[0].data)


def check_shards(array, want, what, exact):
    for shard in array.addressable_shards:
        got = np.asarray(shard.data)
        if exact:
            np.testing.assert_array_equal(got, want[shard.index], err_msg=what)
        else:
            np.testing.assert_allclose(got, want[shard.index], rtol=1e-5, atol=1e-7,
                                       err_msg=what)  # fmt: skip


def run(policy, spec, mesh, batch_spec=None):
    """Six steps on `mesh` (or on this process's first device, mesh None): the final
    (table, state, optimizer state, head) and each step's counts."""
    ttl = {"ttl_steps": 2} if policy == "ttl" else {}
    cfg = DynamicTableConfig(capacity=64, bucket_size=8, admit_after=2, policy=policy, **ttl)
    opt = jaxembed.optim.adagrad(0.05)
    counts = []
    if mesh is None:
        with jax.default_device(jax.local_devices()[0]):
            step = make_step(cfg, opt, None)
            dyn = dynamic.init_table(cfg, HIDDEN)
            opt_state, head = opt.init(dyn.table), jnp.full((HIDDEN,), 0.1)
            for t, (keys, labels) in enumerate(STREAM):
                dyn, opt_state, head, _, stats = step(dyn, opt_state, head, keys, labels, t)
                counts.append([int(host(s)) for s in stats])
        return dyn, opt_state, head, counts
    batch = NamedSharding(mesh, batch_spec)
    with jax.set_mesh(mesh):
        step = make_step(cfg, opt, spec)
        dyn = dynamic.init_table(cfg, HIDDEN, weight_spec=spec)
        opt_state, head = opt.init(dyn.table), jnp.full((HIDDEN,), 0.1)
        for t, (keys, labels) in enumerate(STREAM):
            k = jax.make_array_from_callback(keys.shape, batch, lambda i, v=keys: v[i])
            y = jax.make_array_from_callback(labels.shape, batch, lambda i, v=labels: v[i])
            dyn, opt_state, head, _, stats = step(dyn, opt_state, head, k, y, t)
            counts.append([int(host(s)) for s in stats])
    return dyn, opt_state, head, counts


def main() -> int:
    assert jax.process_count() == 2, jax.process_count()
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(
        np.array(devices).reshape(2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2
    )
    for policy in POLICIES:
        want_dyn, want_opt, want_head, want_counts = run(policy, None, None)
        for name, (spec, batch_spec) in LAYOUTS.items():
            dyn, opt_state, head, counts = run(policy, spec, mesh, batch_spec)
            what = f"{policy} {name}"
            assert counts == want_counts, (what, counts, want_counts)
            assert sum(c[1] for c in counts) > 0, (what, counts)  # some ids were admitted
            assert dyn.table.sharding.is_equivalent_to(NamedSharding(mesh, spec), 2)
            for field, got in dyn.state._asdict().items():
                check_shards(got, host(getattr(want_dyn.state, field)), f"{what} {field}", True)
            check_shards(dyn.table, host(want_dyn.table), f"{what} table", False)
            for got, want in zip(jax.tree.leaves(opt_state), jax.tree.leaves(want_opt),
                                 strict=True):  # fmt: skip
                check_shards(got, host(want), f"{what} optimizer state", False)
            check_shards(head, host(want_head), f"{what} head", False)
            print(f"DYNAMIC OK {policy} {name} process {jax.process_index()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
