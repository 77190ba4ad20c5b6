"""`jaxembed demo`: five layouts on a (data=2, model=4) mesh of CPU devices, checked.

For each layout it prints the plan, runs the forward and the backward under `jit`, checks
both against the dense single-device lookup, and prints the wire bytes of the compiled
program next to those of XLA's own partitioning of `jnp.take` with the same layouts.

Run it with `jaxembed demo` (which asks XLA for 8 CPU devices before jax starts) or
`python -m jaxembed.demo`.
"""

from __future__ import annotations

import functools
import os
import sys
import time

if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxembed import hlo
from jaxembed.kernels.lookup import embedding
from jaxembed.plan import format_bytes, plan_embedding

__all__ = ["LAYOUTS", "run"]

VOCAB, HIDDEN, IDS_SHAPE = 65536, 128, (16, 128)

# name -> (table spec, ids spec, out spec)
LAYOUTS = {
    "rows on model (vocab parallel)": (P("model", None), P("data", None), None),
    "rows on model, sequence-split output": (
        P("model", None), P("data", None), P("data", "model", None),
    ),
    "rows over (data, model)": (P(("data", "model"), None), P("data", None), None),
    "hidden on model": (P(None, "model"), P("data", None), None),
    "replicated table (data parallel)": (P(), P("data", None), None),
}  # fmt: skip


def _step(lookup):
    """Forward and table gradient for a given cotangent: what a training step runs."""

    def step(ids, table, cotangent):
        out, vjp = jax.vjp(lambda t: lookup(ids, t), table)
        return out, vjp(cotangent)[0]

    return step


def run(vocab: int = VOCAB, hidden: int = HIDDEN, ids_shape=IDS_SHAPE) -> int:
    """Runs the demo; returns 0 when every layout matches the dense reference.

    For each of the five `LAYOUTS` on a (data=2, model=4) mesh: a random table
    `f32[vocab, hidden]`, ids `i32[*ids_shape]` split on `data`, and an output gradient
    `f32[*ids_shape, hidden]`. It prints the plan, compiles the forward and the table
    gradient under `jit`, checks both against the dense lookup, and prints the compiled
    program's wire bytes next to those of XLA's partitioning of `jnp.take`.

    Args:
      vocab: the table's rows; a multiple of 8, so that every layout's split divides.
      hidden: the table's hidden size; a multiple of 4 (the `model` axis).
      ids_shape: the ids' shape `(B, S)`: `B` a multiple of 2 (the `data` axis), `S` a
        multiple of 4 (the `model` axis, for the sequence-split output).

    Returns:
      0 when every layout matches, 1 when one does not, 2 with fewer than 8 devices.

    Examples:
      It compiles ten programs, which takes seconds, so it is shown here, not run:

      ```python
      from jaxembed import demo  # with 8 CPU devices, as `jaxembed demo` sets up

      exit_code = demo.run()  # prints each plan, then the summary below; returns 0
      ```

      ```text
      layout                                     check      jaxembed      XLA take   ratio
      rows on model (vocab parallel)                ok       1.3 MiB       8.8 MiB    0.14
      rows on model, sequence-split output          ok       1.3 MiB       9.4 MiB    0.13
      rows over (data, model)                       ok       1.8 MiB       2.3 MiB    0.78
      hidden on model                               ok     132.0 KiB       8.0 MiB    0.02
      replicated table (data parallel)              ok     516.0 KiB      32.0 MiB    0.02
      ```
    """
    if len(jax.devices()) < 8:
        print(
            f"jaxembed demo needs 8 devices, found {len(jax.devices())}: run it as `jaxembed "
            "demo`, which sets XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax "
            "starts",
            file=sys.stderr,
        )
        return 2
    start = time.perf_counter()
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    auto_mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(0)
    table = rng.normal(size=(vocab, hidden)).astype(np.float32)
    ids = rng.integers(0, vocab, size=ids_shape).astype(np.int32)
    cotangent = rng.normal(size=(*ids_shape, hidden)).astype(np.float32)
    ref_out = table[ids]
    ref_grad = np.zeros_like(table)
    np.add.at(ref_grad, ids, cotangent)

    print(
        f"jaxembed demo: table {vocab} x {hidden} float32, ids {ids_shape}, mesh {dict(mesh.shape)}"
    )
    print(f"devices: {len(jax.devices())} x {jax.devices()[0].platform}\n")
    rows, failures = [], 0
    for name, (w_spec, x_spec, out_spec) in LAYOUTS.items():
        plan = plan_embedding(
            mesh, ids.shape, table.shape, x_spec=x_spec, weight_spec=w_spec, out_spec=out_spec
        )
        args = (
            jax.device_put(ids, NamedSharding(mesh, x_spec)),
            jax.device_put(table, NamedSharding(mesh, w_spec)),
            jax.device_put(cotangent, NamedSharding(mesh, plan.out_spec)),
        )
        lookup = functools.partial(embedding, out_spec=out_spec)
        ours = jax.jit(_step(lookup)).lower(*args).compile()

        # XLA's own partitioning of jnp.take: the same layouts in an Auto mesh, where the
        # partitioner chooses the collectives (an Explicit mesh rejects this gather).
        auto_args = [jax.device_put(a, NamedSharding(auto_mesh, a.sharding.spec)) for a in args]
        theirs = jax.jit(
            _step(lambda i, t: jnp.take(t, i, axis=0, mode="clip")),
            out_shardings=(
                NamedSharding(auto_mesh, plan.out_spec), NamedSharding(auto_mesh, w_spec),
            ),
        ).lower(*auto_args).compile()  # fmt: skip
        out, grad = ours(*args)
        ok = np.array_equal(np.asarray(out), ref_out) and np.allclose(
            np.asarray(grad), ref_grad, rtol=1e-5, atol=1e-5
        )
        x_out, x_grad = theirs(*auto_args)
        xla_ok = np.array_equal(np.asarray(x_out), ref_out) and np.allclose(
            np.asarray(x_grad), ref_grad, rtol=1e-5, atol=1e-5
        )
        failures += not ok
        print(f"== {name}")
        print(plan)
        ours_bytes = hlo.total_wire_bytes(ours.as_text())
        xla_bytes = hlo.total_wire_bytes(theirs.as_text())
        print(
            f"  check vs dense lookup: {'ok' if ok else 'MISMATCH'}; compiled wire bytes "
            f"{format_bytes(ours_bytes)} (XLA jnp.take: {format_bytes(xla_bytes)}"
            f"{'' if xla_ok else ', wrong values'})\n"
        )
        rows.append((name, ok, ours_bytes, xla_bytes))

    print(f"{'layout':<40}{'check':>8}{'jaxembed':>14}{'XLA take':>14}{'ratio':>8}")
    for name, ok, ours_bytes, xla_bytes in rows:
        ratio = f"{ours_bytes / xla_bytes:.2f}" if xla_bytes else "-"
        print(
            f"{name:<40}{'ok' if ok else 'FAIL':>8}{format_bytes(ours_bytes):>14}"
            f"{format_bytes(xla_bytes):>14}{ratio:>8}"
        )
    print(f"\nwire bytes per device per training step (forward + backward), "
          f"read from the compiled HLO; {time.perf_counter() - start:.1f} s")  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(run())
