"""Run by tests/test_multihost.py under `python -m jaxembed.launch --processes 2`.

Every table layout of the kernel tests on a (data=2, model=4) mesh whose `data` axis spans
the two processes: each process checks the output and gradient shards it holds against the
dense reference. Prints `OK <layout>` per layout; exits non-zero on any mismatch.
"""

import sys

from jaxembed.launch import initialize

initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxembed  # noqa: E402

LAYOUTS = {
    "rows": (P("model", None), P("data"), None),
    "rows-seq-split-out": (P("model", None), P("data"), P("data", "model", None)),
    "rows-over-data-model": (P(("data", "model"), None), P("data"), None),
    "hidden": (P(None, "model"), P("data"), None),
    "replicated-table": (P(), P("data"), None),
    "rows-and-hidden": (P("model", "data"), P(), None),
}


def global_array(value, mesh, spec):
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def check_shards(array, reference, what):
    for shard in array.addressable_shards:
        np.testing.assert_allclose(
            np.asarray(shard.data), reference[shard.index], rtol=1e-5, atol=1e-5, err_msg=what
        )


def main() -> int:
    assert jax.process_count() == 2, jax.process_count()
    # `data` spans the processes: each row of the device grid is one process's devices.
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    for axis_type in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.sharding.Mesh(
            np.array(devices).reshape(2, 4), ("data", "model"), axis_types=(axis_type,) * 2
        )
        check_layouts(mesh, axis_type)
    return 0


def check_layouts(mesh, axis_type):
    rng = np.random.default_rng(0)  # the same global arrays on every process
    vocab, hidden, vocab_size, padding_idx = 64, 16, 61, 5
    table = rng.normal(size=(vocab, hidden)).astype(np.float32)
    ids = rng.integers(0, vocab_size, size=(8, 8)).astype(np.int32)
    ids[0, :3] = [-1, vocab_size, padding_idx]
    ct = rng.normal(size=(8, 8, hidden)).astype(np.float32)
    valid = (ids >= 0) & (ids < vocab_size) & (ids != padding_idx)
    ref_out = np.where(valid[..., None], table[np.where(valid, ids, 0)], 0)
    ref_grad = np.zeros_like(table, dtype=np.float64)
    np.add.at(ref_grad, ids[valid], ct[valid])

    for name, (w_spec, x_spec, out_spec) in LAYOUTS.items():
        for exchange in ("dense", "rows"):
            plan = jaxembed.plan_embedding(
                mesh, ids.shape, table.shape, x_spec=x_spec, weight_spec=w_spec,
                out_spec=out_spec, vocab_size=vocab_size, padding_idx=padding_idx,
            )  # fmt: skip

            def step(i, t, c, x_spec=x_spec, w_spec=w_spec, out_spec=out_spec, exchange=exchange):
                out, vjp = jax.vjp(
                    lambda t: jaxembed.embedding(
                        i,
                        t,
                        x_spec=x_spec,
                        weight_spec=w_spec,
                        out_spec=out_spec,
                        vocab_size=vocab_size,
                        padding_idx=padding_idx,
                        gradient_exchange=exchange,
                    ),
                    t,
                )
                return out, vjp(c)[0]

            out, grad = jax.jit(step)(
                global_array(ids, mesh, x_spec),
                global_array(table, mesh, w_spec),
                global_array(ct, mesh, plan.out_spec),
            )
            check_shards(out, ref_out, f"{name} out")
            check_shards(grad, ref_grad, f"{name} grad")
            assert grad.sharding.is_equivalent_to(NamedSharding(mesh, plan.weight_spec), 2), (
                grad.sharding
            )
            print(
                f"OK {name} {exchange}-{axis_type.name} process {jax.process_index()}", flush=True
            )


if __name__ == "__main__":
    sys.exit(main())
