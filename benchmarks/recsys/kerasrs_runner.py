"""The keras-rs side of `jaxembed bench recsys`: `DistributedEmbedding` on the JAX backend.

Reads the inputs `jaxembed.workloads.save_inputs` wrote and times the benchmark's step
(see `jaxembed.workloads`) with `keras_rs.layers.DistributedEmbedding` (sum combiner, one
`TableConfig` per table, features sharing tables as in the workload): the forward alone, and
`jax.grad` of `sum(pooled * cotangent)` + `keras.optimizers.Adagrad.stateless_apply`, under one
`jax.jit` with the tables and optimizer state donated.

What this measures, precisely:

- Without SparseCore (any CPU or GPU), keras-rs resolves `placement="auto"` to
  `default_device`: each table is a `keras_rs.layers.EmbedReduce` (a `keras.layers.Embedding`,
  i.e. a gather, then a weighted sum over the bag axis). Ragged input on the JAX backend is
  dense padded ids `[B, max_ids]` with per-id weights (1 for an id, 0 for padding), which is
  what keras-rs itself turns ragged NumPy input into; this runner builds them before timing.
- The gradient of the gather is a dense table-shaped array, and keras has no row-wise
  Adagrad: its `Adagrad` is element-wise and dense (`s += g²`, `w -= lr g / sqrt(s + eps)`,
  eps inside the root, over every row of every table each step). The check therefore uses
  `reference_steps(..., optimizer="adagrad")`, not FBGEMM's row-wise formula; lr and eps are
  the inputs' and the initial accumulator is 0 (keras' default is 0.1).
- `jax-tpu-embedding` (the SparseCore path) is not installed and not needed: keras-rs only
  imports it when the platform has SparseCore. keras-rs 0.4 installs without TensorFlow.

    KERAS_BACKEND=jax python -m benchmarks.recsys.kerasrs_runner --inputs in.npz \\
        --out kerasrs.json --threads 2 --steps 10 --check-steps 2 --verify
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
import time
from typing import Any

import numpy as np

from benchmarks.common.reference import compare_tables, reference_pooled, reference_steps
from benchmarks.common.timing import summarize_times, time_calls
from benchmarks.recsys.files import (
    BenchInputs,
    load_inputs,
    runner_arguments,
    runner_main,
    save_tables,
)
from jaxembed import workloads as W

INSTALL_HINT = "install with: pip install keras-rs==0.4.0 (brings keras 3; no TensorFlow)"


def _setup(threads: int) -> None:
    """The JAX backend on one CPU device with `threads` cores, before jax's backend starts."""
    backend = os.environ.setdefault("KERAS_BACKEND", "jax")
    if backend != "jax":
        print(f"kerasrs_runner: error: KERAS_BACKEND={backend!r}; this runner measures the "
              "JAX backend: unset it or set KERAS_BACKEND=jax", file=sys.stderr)  # fmt: skip
        sys.exit(2)
    flags = os.environ.get("XLA_FLAGS", "").split()
    os.environ["XLA_FLAGS"] = " ".join(
        f for f in flags if not f.startswith("--xla_force_host_platform_device_count")
    )
    cpus = sorted(os.sched_getaffinity(0))
    if threads < len(cpus):  # XLA's CPU thread pool sizes itself to the cores it may use
        os.sched_setaffinity(0, cpus[:threads])
    try:
        for name in ("keras", "keras_rs"):
            importlib.import_module(name)
    except ImportError as err:
        name = getattr(err, "name", None) or str(err)
        print(f"kerasrs_runner: error: {name} is not installed ({err}); {INSTALL_HINT}",
              file=sys.stderr)  # fmt: skip
        sys.exit(3)


class _Model:
    """The layer, its optimizer and the jitted forward and step (stateless)."""

    def __init__(self, workload: W.Workload, lr: float, eps: float):
        import jax
        import jax.numpy as jnp
        import keras
        import keras_rs

        self.workload = workload
        b, used = workload.batch_size, {f.table for f in workload.features}
        tables = {t.name: keras_rs.layers.TableConfig(
            name=t.name, vocabulary_size=t.rows, embedding_dim=t.dim, combiner="sum",
            initializer="zeros", optimizer=keras.optimizers.Adagrad(learning_rate=lr),
        ) for t in workload.tables if t.name in used}  # fmt: skip
        features = {f.name: keras_rs.layers.FeatureConfig(
            name=f.name, table=tables[f.table], input_shape=(b, f.max_ids),
            output_shape=(b, workload.dim),
        ) for f in workload.features}  # fmt: skip
        self.layer = keras_rs.layers.DistributedEmbedding(features)
        self.layer.build({f.name: (b, f.max_ids) for f in workload.features})
        self.placements = sorted(self.layer._placement_to_path_to_feature_config)
        self.variables = list(self.layer.trainable_variables)
        self.names = [v.path.split("/")[-2] for v in self.variables]  # ".../<table>/embeddings"
        self.optimizer = keras.optimizers.Adagrad(
            learning_rate=lr, initial_accumulator_value=0.0, epsilon=eps
        )
        self.optimizer.build(self.variables)
        position = {id(v): i for i, v in enumerate(self.optimizer.variables)}
        self.acc_index = [position[id(a)] for a in self.optimizer._accumulators]
        names = [f.name for f in workload.features]
        layer = self.layer

        def pooled(tv, ids, weights):  # -> [B, F, dim]
            out, _ = layer.stateless_call(tv, [], ids, weights)
            return jnp.stack([out[n] for n in names], axis=1)

        def step(tv, opt, ids, weights, cot):
            grads = jax.grad(lambda tv: jnp.sum(pooled(tv, ids, weights) * cot))(tv)
            return self.optimizer.stateless_apply(opt, grads, tv)

        self.pooled = jax.jit(pooled)
        self.step = jax.jit(step, donate_argnums=(0, 1))

    def initial_state(self, tables: dict[str, np.ndarray]):
        import jax

        # Fresh copies: the step donates them (iteration 0, the learning rate, accumulators 0).
        tv = [jax.device_put(np.array(tables[n], copy=True)) for n in self.names]
        opt = [jax.device_put(np.array(v.value, copy=True)) for v in self.optimizer.variables]
        return tv, opt

    def read(self, tv, opt) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        tables = {n: np.asarray(x) for n, x in zip(self.names, tv, strict=True)}
        accs = {n: np.asarray(opt[i]) for n, i in zip(self.names, self.acc_index, strict=True)}
        return tables, accs

    def prepare(self, batch: W.Batch):
        """Dense padded ids [B, max_ids] (pad id 0) and weights (1 for an id, 0 for a pad)."""
        import jax

        ids, weights = {}, {}
        for f in self.workload.features:
            values, lengths = batch[f.name]
            mask = np.arange(f.max_ids)[None, :] < lengths[:, None]
            dense = np.zeros(mask.shape, np.int32)
            dense[mask] = values[: int(lengths.sum())]
            ids[f.name] = jax.device_put(dense)
            weights[f.name] = jax.device_put(mask.astype(np.float32))
        return ids, weights


def _versions() -> dict[str, str]:
    import jax
    import keras
    import keras_rs

    return {"keras": keras.__version__, "keras_rs": keras_rs.__version__,
            "jax": jax.__version__, "numpy": np.__version__,
            "python": platform.python_version()}  # fmt: skip


def _check(model: _Model, inputs: BenchInputs, steps: int, verify: bool, save: str | None):
    import jax

    batches = inputs.batches[:steps]
    tv, opt = model.initial_state(inputs.tables)
    cot = jax.device_put(inputs.cotangent)
    out: dict[str, Any] = {"steps": len(batches)}
    for s, batch in enumerate(batches):
        ids, weights = model.prepare(batch)
        if verify and s == 0:
            got = np.asarray(model.pooled(tv, ids, weights))
            ref = reference_pooled(inputs.workload, inputs.tables, batch)
            out["forward_max_abs_error"] = float(np.abs(got - ref).max())
        tv, opt = model.step(tv, opt, ids, weights, cot)
    tables, accs = model.read(tv, opt)
    if save:
        w = inputs.workload
        accs_all = {t.name: accs.get(t.name, np.zeros((t.rows, t.dim))) for t in w.tables}
        save_tables(save, w, {**inputs.tables, **tables}, accs_all)
        out["saved_tables"] = save
    if verify:
        ref_t, ref_s = reference_steps(
            inputs.workload, inputs.tables, batches, inputs.cotangent,
            inputs.learning_rate, inputs.eps, optimizer="adagrad",
        )  # fmt: skip
        out.update(compare_tables(tables, {n: ref_t[n] for n in tables}))
        acc = compare_tables(accs, {n: ref_s[n] for n in accs})
        out["accumulator_max_rel_error"] = acc["max_rel_error"]
        # Element-wise Adagrad is ill-conditioned where one step's |g| is near sqrt(eps): there
        # the float32 rounding dg of the gradient sum moves that step's update by up to
        # lr dg / sqrt(eps) (and at most by lr). Such entries are rare (measured: ~20 of 6-9M
        # touched entries in 2 steps of workload_a and of the DLRM workload, the worst 1.2% of
        # lr off), so the check allows one entry in 10^6 past rtol, and none past the formula's
        # bound, lr a step. Row-wise Adagrad, normalized by the row's mean g², has no such
        # entries: the TorchRec runner checks every entry.
        allowed, bound = max(1, out["num_entries"] // 10**6), inputs.learning_rate * len(batches)
        out["tolerance"] = {"rtol": 1e-4, "max_entries_over_rtol": allowed, "max_abs_error": bound}
        out["agrees_with_reference"] = (out["num_over_rtol"] <= allowed
                                        and acc["num_over_rtol"] <= allowed
                                        and out["max_abs_error"] <= bound)  # fmt: skip
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import jax

    t0 = time.perf_counter()
    inputs = load_inputs(args.inputs)
    w = inputs.workload
    model = _Model(w, inputs.learning_rate, inputs.eps)
    build_s = time.perf_counter() - t0
    result: dict[str, Any] = {
        "schema": "jaxembed.bench.recsys.runner/1", "framework": "keras-rs",
        "impl": "DistributedEmbedding[" + ",".join(model.placements) + "]",
        "versions": _versions(), "threads": len(os.sched_getaffinity(0)),
        "devices": [str(d) for d in jax.devices()], "workload": w.name,
        "batch_size": w.batch_size, "num_features": len(w.features), "num_tables": len(w.tables),
        "ids_per_step": [sum(int(n.sum()) for _, n in b.values()) for b in inputs.batches],
        "optimizer": {"name": "keras.optimizers.Adagrad (dense, element-wise)",
                      "formula": "s += g^2; w -= lr * g / sqrt(s + eps); s0 = 0",
                      "learning_rate": inputs.learning_rate, "eps": inputs.eps},
        "build_time_in_s": round(build_s, 3), "loadavg_before": list(os.getloadavg()),
    }  # fmt: skip
    if args.check_steps:
        result["check"] = _check(model, inputs, args.check_steps, args.verify, args.save_tables)
    prepared = [model.prepare(b) for b in inputs.batches]
    cot = jax.device_put(inputs.cotangent)
    tv, opt = model.initial_state(inputs.tables)
    n = len(prepared)
    t = time.perf_counter()
    tv, opt = jax.block_until_ready(model.step(tv, opt, *prepared[0], cot))
    jax.block_until_ready(model.pooled(tv, *prepared[0]))
    result["compile_and_first_step_in_s"] = round(time.perf_counter() - t, 3)
    for s in range(args.warmup):
        tv, opt = jax.block_until_ready(model.step(tv, opt, *prepared[s % n], cot))
    state = [tv, opt]

    def one_step(s):
        state[:] = jax.block_until_ready(model.step(*state, *prepared[s % n], cot))

    fwd = time_calls(lambda s: jax.block_until_ready(model.pooled(tv, *prepared[s % n])),
                       args.steps)  # fmt: skip
    step = time_calls(one_step, args.steps)
    result.update(steps=args.steps, warmup=args.warmup)
    result.update(summarize_times(*step, "step_time"))
    result.update(summarize_times(*fwd, "forward_time"))
    result["loadavg_after"] = list(os.getloadavg())
    return result


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.recsys.kerasrs_runner",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    runner_arguments(p, steps=10, warmup=2)
    p.add_argument("--threads", type=int, default=2,
                   help="CPU cores the process may use (sched_setaffinity; XLA sizes its "
                   "thread pool to them)")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return runner_main("kerasrs_runner", args, lambda: _setup(args.threads), run)


if __name__ == "__main__":
    sys.exit(main())
