"""The TorchRec + FBGEMM side of `jaxembed bench recsys`, run as a subprocess by the driver.

Reads the inputs `jaxembed.workloads.save_inputs` wrote, builds the tables with FBGEMM's
fused `EXACT_ROWWISE_ADAGRAD` on the CPU, and times the benchmark's step (see
`jaxembed.workloads`): the forward alone, and forward + backward with the fixed
cotangent + the fused update (FBGEMM updates the rows inside the backward: there is no
separate optimizer step). Two implementations (`--impl`):

- `fused-ebc` (default): TorchRec's `FusedEmbeddingBagCollection` fed `KeyedJaggedTensor`s,
  the TorchRec module that runs on the CPU without a process group; it groups the tables
  into one FBGEMM `SplitTableBatchedEmbeddingBagsCodegen` (TBE) and adds TorchRec's input
  handling (`KeyedJaggedTensor.to_dict`, per-table concatenation, offsets).
- `tbe`: that FBGEMM module directly (EmbeddingLocation.HOST, ComputeDevice.CPU) with flat
  indices and offsets: FBGEMM's kernels without TorchRec's overhead.

Before timing, `--check-steps` steps run from the initial tables; their final tables and
row-wise accumulators go to `--save-tables`, and `--verify` compares them with the float64
`reference_steps` here. The timed steps then continue on the same module.

    python -m benchmarks.recsys.torchrec_runner --inputs in.npz --out torchrec.json \\
        --threads 2 --steps 20 --check-steps 2 --verify --profile
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

INSTALL_HINT = (
    "install into a venv: pip install torch==2.13.0 fbgemm-gpu-cpu==1.8.0 tensordict "
    "torchmetrics==1.0.3 tqdm pyre-extensions && pip install --no-deps torchrec==1.8.0"
)


def _require_framework(omp_wait_policy: str) -> None:
    # torch's CPU kernels run on OpenMP, whose idle threads spin by default: on a machine
    # whose cores other processes also use, a parallel region then waits for a thread that
    # is not scheduled (measured here on 2 shared cores: 300-470 ms a step instead of ~70).
    # PASSIVE waiting must be set before libgomp loads, so before torch is imported.
    if omp_wait_policy != "default":
        os.environ["OMP_WAIT_POLICY"] = omp_wait_policy.upper()
    try:
        for name in ("torch", "fbgemm_gpu", "torchrec"):  # in dependency order
            importlib.import_module(name)
    except ImportError as err:
        name = getattr(err, "name", None) or str(err)
        print(f"torchrec_runner: error: {name} is not installed ({err}); {INSTALL_HINT}",
              file=sys.stderr)  # fmt: skip
        sys.exit(3)


class _Impl:
    """A built module: `forward(inputs) -> [B, F*dim]` in `order` (workload feature indices)."""

    def __init__(self, kind: str, workload: W.Workload, lr: float, eps: float):
        import torch
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        self.kind, self.workload = kind, workload
        used = [t for t in workload.tables if any(f.table == t.name for f in workload.features)]
        self.tables = used
        if kind == "fused-ebc":
            from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
            from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
            from torchrec.optim import RowWiseAdagrad

            configs = [EmbeddingBagConfig(
                name=t.name, embedding_dim=t.dim, num_embeddings=t.rows, pooling=PoolingType.SUM,
                feature_names=[f.name for f in workload.features if f.table == t.name],
            ) for t in used]  # fmt: skip
            self.module = FusedEmbeddingBagCollection(
                tables=configs, optimizer_type=RowWiseAdagrad,
                optimizer_kwargs={"lr": lr, "eps": eps}, device=torch.device("cpu"),
            )  # fmt: skip
            (group,) = self.module._emb_modules  # one TBE: every table is sum-pooled float32
            self.tbe = group._emb_module
            names = list(self.module._embedding_names)  # its output order: by table
        elif kind == "tbe":
            # Features grouped by table, as TorchRec orders them: FBGEMM's CPU backward fails
            # ("num of rows processed by adagrad ... does not match") when the features of one
            # table are not adjacent in feature_table_map.
            index = {t.name: i for i, t in enumerate(used)}
            names = [f.name for t in used for f in workload.features if f.table == t.name]
            table_of = {f.name: index[f.table] for f in workload.features}
            self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
                [(t.rows, t.dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for t in used],
                feature_table_map=[table_of[n] for n in names],
                pooling_mode=PoolingMode.SUM, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                learning_rate=lr, eps=eps, device=torch.device("cpu"),
            )  # fmt: skip
            self.module = self.tbe
        else:
            raise ValueError(f"--impl must be 'fused-ebc' or 'tbe', got {kind!r}")
        position = {f.name: i for i, f in enumerate(workload.features)}
        self.order = [position[n] for n in names]

    def set_tables(self, tables: dict[str, np.ndarray]) -> None:
        import torch

        with torch.no_grad():
            for t, w in zip(self.tables, self.tbe.split_embedding_weights(), strict=True):
                w.copy_(torch.from_numpy(np.ascontiguousarray(tables[t.name])))

    def get_tables(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        names = [t.name for t in self.tables]
        weights = [w.detach().numpy().copy() for w in self.tbe.split_embedding_weights()]
        # split_optimizer_states: per table, [momentum1 [rows]] (the row-wise accumulator)
        states = [s[0].detach().numpy().copy() for s in self.tbe.split_optimizer_states()]
        return dict(zip(names, weights, strict=True)), dict(zip(names, states, strict=True))

    def prepare(self, batch: W.Batch) -> Any:
        """Framework inputs of one batch (built before timing)."""
        import torch

        feats = self.workload.features
        if self.kind == "tbe":
            feats = [feats[i] for i in self.order]
        lengths = [torch.from_numpy(batch[f.name][1]) for f in feats]
        values = [torch.from_numpy(batch[f.name][0][: int(batch[f.name][1].sum())])
                  for f in feats]  # fmt: skip
        if self.kind == "fused-ebc":  # keys in the workload's order: TorchRec regroups them
            from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

            return KeyedJaggedTensor(keys=[f.name for f in feats], values=torch.cat(values),
                                     lengths=torch.cat(lengths))  # fmt: skip
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(torch.cat(lengths))
        return torch.cat(values), offsets  # int32, as TorchRec passes them

    def forward(self, inputs: Any):
        if self.kind == "fused-ebc":
            return self.module(inputs).values()
        indices, offsets = inputs
        return self.module(indices=indices, offsets=offsets)

    def cotangent(self, cot: np.ndarray):
        """The cotangent in the module's output layout: `[B, F*dim]`, features in `order`."""
        import torch

        b = cot.shape[0]
        return torch.from_numpy(np.ascontiguousarray(cot[:, self.order].reshape(b, -1)))


def _versions() -> dict[str, str]:
    import fbgemm_gpu
    import torch
    import torchrec

    return {"torch": torch.__version__, "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "?"),
            "torchrec": getattr(torchrec, "__version__", "?"), "numpy": np.__version__,
            "python": platform.python_version()}  # fmt: skip


def _check(impl: _Impl, inputs: BenchInputs, steps: int, verify: bool, save: str | None):
    """Runs `steps` steps from the initial tables; saves and/or verifies the result."""
    batches = inputs.batches[:steps]
    cot = impl.cotangent(inputs.cotangent)
    out: dict[str, Any] = {"steps": len(batches)}
    for s, batch in enumerate(batches):
        pooled = impl.forward(impl.prepare(batch))
        if verify and s == 0:
            got = pooled.detach().numpy().reshape(cot.shape[0], len(impl.order), -1)
            ref = reference_pooled(inputs.workload, inputs.tables, batch)[:, impl.order]
            out["forward_max_abs_error"] = float(np.abs(got - ref).max())
        pooled.backward(cot)
    tables, accs = impl.get_tables()
    if save:
        full = {**inputs.tables, **tables}
        save_tables(save, inputs.workload, full, {t.name: accs.get(t.name, np.zeros(t.rows))
                                                    for t in inputs.workload.tables})  # fmt: skip
        out["saved_tables"] = save
    if verify:
        ref_t, ref_s = reference_steps(
            inputs.workload, inputs.tables, batches, inputs.cotangent,
            inputs.learning_rate, inputs.eps,
        )  # fmt: skip
        out.update(compare_tables(tables, {n: ref_t[n] for n in tables}))
        acc = compare_tables(accs, {n: ref_s[n] for n in accs})
        out["accumulator_max_rel_error"] = acc["max_rel_error"]
        out["tolerance"] = {"rtol": 1e-4, "max_entries_over_rtol": 0}
        out["agrees_with_reference"] = out["num_over_rtol"] == 0 and acc["num_over_rtol"] == 0
    return out


def _profile(impl: _Impl, prepared: list, cot, steps: int) -> dict[str, Any]:
    """Where a step's time goes, from torch.profiler (CPU ops), per step."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for s in range(steps):
            with record_function("forward"):
                pooled = impl.forward(prepared[s % len(prepared)])
            with record_function("backward+update"):
                pooled.backward(cot)
    events = prof.key_averages()
    by_name = {e.key: e for e in events}
    out = {f"{k.replace('+', '_')}_in_ms": round(by_name[k].cpu_time_total / 1e3 / steps, 4)
           for k in ("forward", "backward+update") if k in by_name}  # fmt: skip
    top = sorted((e for e in events if e.key not in ("forward", "backward+update")),
                 key=lambda e: e.self_cpu_time_total, reverse=True)[:8]  # fmt: skip
    out["top_ops_self_in_ms"] = {e.key: round(e.self_cpu_time_total / 1e3 / steps, 4) for e in top}
    out["profiled_steps"] = steps
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    inputs = load_inputs(args.inputs)
    w = inputs.workload
    impl = _Impl(args.impl, w, inputs.learning_rate, inputs.eps)
    impl.set_tables(inputs.tables)
    build_s = time.perf_counter() - t0
    result: dict[str, Any] = {
        "schema": "jaxembed.bench.recsys.runner/1", "framework": "torchrec", "impl": args.impl,
        "versions": _versions(), "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"), "workload": w.name,
        "batch_size": w.batch_size, "num_features": len(w.features), "num_tables": len(w.tables),
        "ids_per_step": [sum(int(n.sum()) for _, n in b.values()) for b in inputs.batches],
        "optimizer": {"name": "EXACT_ROWWISE_ADAGRAD", "learning_rate": inputs.learning_rate,
                      "eps": inputs.eps},
        "build_time_in_s": round(build_s, 3), "loadavg_before": list(os.getloadavg()),
    }  # fmt: skip
    if args.check_steps:
        result["check"] = _check(impl, inputs, args.check_steps, args.verify, args.save_tables)
    prepared = [impl.prepare(b) for b in inputs.batches]
    cot = impl.cotangent(inputs.cotangent)
    n = len(prepared)
    for s in range(args.warmup):
        impl.forward(prepared[s % n]).backward(cot)
    fwd = time_calls(lambda s: impl.forward(prepared[s % n]), args.steps)
    step = time_calls(lambda s: impl.forward(prepared[s % n]).backward(cot), args.steps)
    result.update(steps=args.steps, warmup=args.warmup)
    result.update(summarize_times(*step, "step_time"))
    result.update(summarize_times(*fwd, "forward_time"))
    result["forward_note"] = "training forward (autograd on), output discarded"
    if args.profile:
        result["profile"] = _profile(impl, prepared, cot, args.profile)
    result["loadavg_after"] = list(os.getloadavg())
    return result


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.recsys.torchrec_runner",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    runner_arguments(p, steps=20, warmup=3)
    p.add_argument("--impl", default="fused-ebc", choices=("fused-ebc", "tbe"))
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--omp-wait-policy", default="passive", choices=("passive", "active", "default"),
                   help="OMP_WAIT_POLICY for torch's threads (default passive: the machine is "
                   "shared; 'default' leaves the environment as it is)")  # fmt: skip
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile N more steps with torch.profiler")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return runner_main("torchrec_runner", args,
                         lambda: _require_framework(args.omp_wait_policy), run)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
