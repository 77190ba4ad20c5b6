"""Run by tests/test_multihost.py under `python -m jaxembed.launch --processes 2`.

Bags across two processes: a sum-pooled `embedding_bag` and its row-sparse
`rowwise_adagrad` update, for each table layout that splits rows, each exchange and each
kernel implementation, on a (data=2, model=4) mesh whose `data` axis spans the processes.
Each process checks the pooled output, the updated table and the optimizer state shards it
holds against the float64 reference. Prints `OK <layout> <exchange> <impl> process <i>`.
"""

import sys

from jaxembed.launch import initialize

initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxembed  # noqa: E402
from jaxembed.kernels import native  # noqa: E402
from jaxembed.optim import reference  # noqa: E402

# name: (table, ids and output gradient, exchanges)
LAYOUTS = {
    "rows": (P("model", None), P("data"), ("rows",)),
    "rows-over-data-model": (P(("data", "model"), None), P("data"), ("rows", "routed")),
    "fully-sharded": (P(("data", "model"), None), P(("data", "model")), ("rows", "routed")),
    "replicated-table": (P(), P("data"), ("rows",)),
}


def global_array(value, mesh, spec):
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def check_shards(array, want, what):
    for shard in array.addressable_shards:
        np.testing.assert_allclose(
            np.asarray(shard.data), want[shard.index], rtol=1e-5, atol=1e-6, err_msg=what
        )


def main() -> int:
    assert jax.process_count() == 2, jax.process_count()
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(
        np.array(devices).reshape(2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2
    )
    rng = np.random.default_rng(0)  # the same global arrays on every process
    vocab, hidden, batch, slots = 64, 8, 16, 6
    table = rng.normal(size=(vocab, hidden)).astype(np.float32)
    ids = rng.integers(0, vocab, size=(batch, slots)).astype(np.int32)
    ids[rng.random(ids.shape) < 0.3] = -1  # empty slots
    ids[:, 0] = 7  # a duplicate in every bag
    ct = rng.normal(size=(batch, hidden)).astype(np.float32)
    valid = ids >= 0
    ref_out = (np.where(valid[..., None], table[np.where(valid, ids, 0)], 0)).sum(1)
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    state0 = tuple(
        np.asarray(s, np.float64) for s in reference.init_states(opt.formula, vocab, hidden)
    )
    slot_grads = np.broadcast_to(ct[:, None, :], (*ids.shape, hidden))  # sum pooling
    ref_table, ref_states = reference.sparse_step(
        opt.formula, table, state0, ids, slot_grads, count=0
    )
    impls = ("xla", "native") if native.available() else ("xla",)
    for name, (w_spec, x_spec, exchanges) in LAYOUTS.items():
        for exchange in exchanges:
            for impl in impls:
                kw = dict(combiner="sum", exchange=exchange, impl=impl, mesh=mesh)

                def step(t, s, i, c, kw=kw):
                    out = jaxembed.embedding_bag(i, t, **kw)
                    t, s = opt.update(t, s, i, c, **kw)
                    return out, t, s

                t = global_array(table, mesh, w_spec)
                s = opt.init(t)
                i = global_array(ids, mesh, x_spec)
                c = global_array(ct, mesh, x_spec)
                out, new, state = jax.jit(step, donate_argnums=(0, 1))(t, s, i, c)
                what = f"{name} {exchange} {impl}"
                check_shards(out, ref_out, f"{what} out")
                check_shards(new, ref_table, f"{what} table")
                (accumulator,) = state.slots.values()
                check_shards(accumulator, ref_states[0], f"{what} state")
                assert new.sharding.is_equivalent_to(NamedSharding(mesh, w_spec), 2), new.sharding
                print(f"OK {name} {exchange} {impl} process {jax.process_index()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
