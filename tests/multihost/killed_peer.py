"""Run under the launcher: process 1 is killed (SIGKILL) in the middle of training steps.

Process 0 must not hang: the runtime notices the lost peer (a failed collective, then the
coordination service's heartbeat timeout) and stops it with a non-zero exit.
"""

import os
import signal
import time

from jaxembed.launch import initialize

initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxembed  # noqa: E402

devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
mesh = jax.sharding.Mesh(
    np.array(devices).reshape(2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2
)
table = jax.make_array_from_callback(
    (64, 16), NamedSharding(mesh, P("model", None)), lambda i: np.ones((64, 16), np.float32)[i]
)
ids = jax.make_array_from_callback(
    (8, 8), NamedSharding(mesh, P("data")), lambda i: np.arange(64, dtype=np.int32).reshape(8, 8)[i]
)


@jax.jit
def step(table, ids):
    loss, grad = jax.value_and_grad(lambda t: jnp.sum(jaxembed.embedding(ids, t) ** 2))(table)
    return table - 0.01 * grad, loss


for i in range(10_000):
    if i == 5 and jax.process_index() == 1:
        print(f"killing myself at step {i} at {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    table, loss = step(table, ids)
    print(f"step {i} loss {float(loss):.3f}", flush=True)
    time.sleep(0.1)
