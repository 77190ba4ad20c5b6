"""`python -m benchmarks llm-head`: a small decoder with a tied head on FSDP x tensor parallel.

The same NNX model twice, 8 devices (mesh fsdp=2 x tensor=4, Auto axes), its table laid out
as Gemma's program lays it out (`("tensor", "fsdp")`: rows over tensor, hidden over fsdp),
tokens over fsdp:

* **xla**: `flax.nnx.Embed`, `embed.attend(h)` and `optax.softmax_cross_entropy_with_integer_labels`
  on the logits, XLA's partitioning;
* **jaxembed**: `jaxembed.nnx.Embed` and the same `__call__` ending in `attend`, trained
  under `jaxembed.nnx.deferred_logits()` with `jaxembed.nnx.cross_entropy`: no other flag.

Each: `embed -> 2 x (Dense + relu, residual) -> attend`, a train step of `value_and_grad` and
SGD under `jax.jit` (parameters donated). Both run in one process, their steps interleaved
(`--separate`: each in its own process, one after the other), so that the load of a shared
machine falls on both alike. Reported per vocabulary and dtype: the step's minimum and median
time, its compiled temp memory (`memory_analysis()`), its collective bytes (read from the
compiled HLO, loops counted), and jaxembed's ratios to XLA's.

    python -m benchmarks llm-head --json benchmarks/results/llm/llm_head.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.common.report import write_outputs

__all__ = ["main"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _build(impl: str, vocab: int, dtype: str, width: int, batch: int, seq: int):
    """The decoder's jitted train step for `impl`, compiled: `(jitted, params, tokens, mesh,
    text, memory)`."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxembed.nnx

    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    param_dtype = jnp.dtype(dtype)
    embed_cls = jaxembed.nnx.Embed if impl == "jaxembed" else nnx.Embed

    class Decoder(nnx.Module):
        def __init__(self, rngs):
            init = nnx.with_partitioning(nnx.initializers.normal(0.02), ("tensor", "fsdp"))
            self.embed = embed_cls(vocab, width, embedding_init=init, param_dtype=param_dtype,
                                   dtype=param_dtype, rngs=rngs)  # fmt: skip
            dense = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("fsdp", "tensor"))
            self.layers = nnx.List([nnx.Linear(width, width, kernel_init=dense,
                                               param_dtype=param_dtype, dtype=param_dtype,
                                               rngs=rngs) for _ in range(2)])  # fmt: skip

        def __call__(self, tokens):
            h = self.embed(tokens)
            for layer in self.layers:
                h = h + jax.nn.relu(layer(h))
            h = jax.lax.with_sharding_constraint(h, P("fsdp", None, "tensor"))
            return self.embed.attend(h)

    rng = np.random.default_rng(0)
    with jax.set_mesh(mesh):
        model = Decoder(nnx.Rngs(0))
        tokens = jax.device_put(rng.integers(0, vocab, (batch, seq + 1)).astype(np.int32),
                                NamedSharding(mesh, P("fsdp")))  # fmt: skip
        graphdef, params = nnx.split(model)

        def loss_fn(params, tokens):
            m = nnx.merge(graphdef, params)
            inputs, labels = tokens[:, :-1], tokens[:, 1:]
            if impl == "jaxembed":
                with jaxembed.nnx.deferred_logits():
                    logits = m(inputs)
                return jaxembed.nnx.cross_entropy(logits, labels, reduction="mean")
            logits = m(inputs).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        def step(params, tokens):
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
            return loss, jax.tree.map(lambda p, g: p - 0.01 * g.astype(p.dtype), params, grads)

        jitted = jax.jit(step, donate_argnums=(0,))
        compiled = jitted.lower(params, tokens).compile()
    return jitted, params, tokens, mesh, compiled.as_text(), compiled.memory_analysis()


def _row(impl, vocab, dtype, loss, times, text, memory, where) -> dict[str, Any]:
    import numpy as np

    from jaxembed import hlo

    return {"impl": impl, "vocab": vocab, "dtype": dtype, "loss": float(loss), "profile": where,
            "step_min_in_ms": float(np.min(times)),
            "step_median_in_ms": float(np.median(times)),
            "step_q25_in_ms": float(np.percentile(times, 25)),
            "temp_bytes": int(memory.temp_size_in_bytes),
            "wire_bytes": float(hlo.total_wire_bytes(text))}  # fmt: skip


def _profile(jitted, params, tokens, text):
    """Op spans by category (benchmarks.recsys.hlo_profile), 3 steps: `(where, params)`."""
    import jax

    from benchmarks.recsys.hlo_profile import breakdown

    box = [params]

    def one(_):
        _, box[0] = jitted(box[0], tokens)
        jax.block_until_ready(box[0])

    return breakdown(one, 3, text, top=12), box[0]


def worker(impl: str, vocab: int, dtype: str, width: int, batch: int, seq: int,
           steps: int, profile: bool = False) -> dict[str, Any]:  # fmt: skip
    """One implementation alone in this process (`--separate`)."""
    import jax

    jitted, params, tokens, mesh, text, memory = _build(impl, vocab, dtype, width, batch, seq)
    with jax.set_mesh(mesh):
        loss, params = jitted(params, tokens)
        jax.block_until_ready(params)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            loss, params = jitted(params, tokens)
            jax.block_until_ready(params)
            times.append((time.perf_counter() - t0) * 1e3)
        where = _profile(jitted, params, tokens, text)[0] if profile else None
    return _row(impl, vocab, dtype, loss, times, text, memory, where)


def pair_worker(vocab: int, dtype: str, width: int, batch: int, seq: int, steps: int,
                profile: bool = False) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Both implementations in this process, their steps interleaved (xla, jaxembed, xla,
    ...), so that a shared machine's load falls on both alike."""
    import jax

    built = {impl: _build(impl, vocab, dtype, width, batch, seq) for impl in IMPLS}
    state = {impl: b[1] for impl, b in built.items()}
    times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    losses = {}
    with jax.set_mesh(built["xla"][3]):
        for impl in IMPLS:  # compile under jit's own cache, and warm up: two steps each
            for _ in range(2):
                losses[impl], state[impl] = built[impl][0](state[impl], built[impl][2])
                jax.block_until_ready(state[impl])
        for _ in range(steps):
            for impl in IMPLS:
                jitted, _, tokens = built[impl][:3]
                t0 = time.perf_counter()
                losses[impl], state[impl] = jitted(state[impl], tokens)
                jax.block_until_ready(state[impl])
                times[impl].append((time.perf_counter() - t0) * 1e3)
        rows = {}
        for impl in IMPLS:
            jitted, _, tokens, _, text, memory = built[impl]
            where = None
            if profile:
                where, state[impl] = _profile(jitted, state[impl], tokens, text)
            rows[impl] = _row(impl, vocab, dtype, losses[impl], times[impl], text, memory, where)
    return rows


IMPLS = ("xla", "jaxembed")


def _env() -> dict[str, str]:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


def _call(code: str, opts) -> tuple[Any, str]:
    done = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                          text=True, timeout=opts.timeout)  # fmt: skip
    if done.returncode:
        return None, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), ""


def _run(impl, vocab, dtype, opts) -> dict[str, Any]:
    code = (f"import json; from benchmarks import llm_head as b; print(json.dumps(b.worker("
            f"{impl!r}, {vocab}, {dtype!r}, {opts.width}, {opts.batch}, {opts.seq}, "
            f"{opts.steps}, {opts.profile})))")  # fmt: skip
    row, error = _call(code, opts)
    if row is None:
        return {"impl": impl, "vocab": vocab, "dtype": dtype, "error": error}
    return row


def _run_pair(vocab, dtype, opts) -> dict[str, dict[str, Any]]:
    if opts.separate:
        return {impl: _run(impl, vocab, dtype, opts) for impl in IMPLS}
    code = (f"import json; from benchmarks import llm_head as b; print(json.dumps(b.pair_worker("
            f"{vocab}, {dtype!r}, {opts.width}, {opts.batch}, {opts.seq}, {opts.steps}, "
            f"{opts.profile})))")  # fmt: skip
    rows, error = _call(code, opts)
    if rows is None:
        return {impl: {"impl": impl, "vocab": vocab, "dtype": dtype, "error": error}
                for impl in IMPLS}  # fmt: skip
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks llm-head",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--vocabs", default="32768,131072,262144")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument(
        "--profile",
        action="store_true",
        help="record where each step's time goes (jax.profiler op spans)",
    )
    p.add_argument(
        "--separate",
        action="store_true",
        help="run each implementation in its own process, one after the other (default: both "
        "in one process, their steps interleaved)",
    )
    p.add_argument("--json")
    opts = p.parse_args(argv)
    rows = []
    for vocab in (int(v) for v in opts.vocabs.split(",")):
        for dtype in opts.dtypes.split(","):
            pair = _run_pair(vocab, dtype, opts)
            row = {"vocab": vocab, "dtype": dtype, **{k: v for k, v in pair.items()}}
            x, j = pair["xla"], pair["jaxembed"]
            if "error" not in x and "error" not in j:
                row["ratios"] = {k: j[k] / x[k] for k in ("step_min_in_ms", "step_median_in_ms",
                                                         "temp_bytes", "wire_bytes")}  # fmt: skip
                print(f"V={vocab} {dtype}: step median {j['step_median_in_ms']:.2f} vs "
                      f"{x['step_median_in_ms']:.2f} ms (min {j['step_min_in_ms']:.2f} vs "
                      f"{x['step_min_in_ms']:.2f}), temp {j['temp_bytes'] / 2**20:.1f} vs "
                      f"{x['temp_bytes'] / 2**20:.1f} MiB, wire {j['wire_bytes'] / 2**20:.1f} vs "
                      f"{x['wire_bytes'] / 2**20:.1f} MiB, loss {j['loss']:.5f} vs "
                      f"{x['loss']:.5f}", flush=True)  # fmt: skip
            else:
                print(f"V={vocab} {dtype}: error", x.get("error", "")[-800:],
                      j.get("error", "")[-800:], flush=True)  # fmt: skip
            rows.append(row)
    write_outputs({"rows": rows, "options": vars(opts)}, json_path=opts.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
