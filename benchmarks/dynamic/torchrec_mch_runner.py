"""The TorchRec side of `benchmarks.dynamic.dlrm_step`: a child process that steps on request.

It reads the inputs the driver wrote (`dlrm_step.save_inputs`: the batches, the raw ids of the
dynamic tables, the MLP's initial parameters), makes the initial tables as the driver does
(`dlrm_step.initial_table`, numpy only), builds each requested variant with every batch's
`KeyedJaggedTensor`s made before anything is timed, writes `{"ready": ...}` and serves, one
JSON line each way on the stdout it was started with (anything else printed goes to stderr):

* `{"op": "step", "variant": name}`: one training step of that variant on its next batch,
  timed here (`perf_counter` and process CPU time around forward, backward and optimizer
  steps, the loss read back); answers `{"wall_s", "cpu_s", "loss"}`;
* `{"op": "finish"}`: answers `{"record": ...}` (versions, threads, each variant's losses and
  its managed-collision modules' open slots) and exits.

The variants (the DLRM model of `dlrm_step`: the same MLP, mean-pooled bags, the logistic
loss, `torch.optim.Adam` on the MLP; FBGEMM's EXACT_ROWWISE_ADAGRAD on the tables):

* `torchrec_static`: two `FusedEmbeddingBagCollection`s (the dynamic tables' static twins,
  and the others) on the static ids: FBGEMM updates the rows inside the backward.
* `torchrec_mch`: a `ManagedCollisionCollection` of `MCHManagedCollisionModule`s (zch_size =
  the table's rows, `LRU_EvictionPolicy`, `eviction_interval=1`) remaps the raw ids of the two
  dynamic tables' features, then the same fused collections.
* `torchrec_mch[interval=10]`: the same with `eviction_interval=10`.
* `torchrec_mcebc`: TorchRec's `ManagedCollisionEmbeddingBagCollection`, which wraps a plain
  `EmbeddingBagCollection` (it refuses a fused one: the record keeps the error), so the two
  dynamic tables get dense gradients and `torchrec.optim.RowWiseAdagrad`; the others fused.

    python -m benchmarks.dynamic.torchrec_mch_runner --inputs in.npz --threads 2 \\
        --variants torchrec_mch torchrec_static --steps 3     # no serving: run, print JSON

Never imports jax (the record's `jax_imported` says so).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
from typing import Any

import numpy as np

VARIANTS = {
    "torchrec_static": ("static", 1),
    "torchrec_mch": ("mcc", 1),
    "torchrec_mch[interval=10]": ("mcc", 10),
    "torchrec_mcebc": ("mcebc", 1),
}
"""name -> (how the dynamic tables are built, the MCH modules' eviction_interval)."""

INSTALL_HINT = (
    "install: pip install torch==2.13.0 fbgemm-gpu-cpu==1.8.0 tensordict torchmetrics==1.0.3 "
    "tqdm pyre-extensions && pip install --no-deps torchrec==1.8.0"
)


def _require(omp_wait_policy: str) -> None:
    # On shared cores OpenMP's spinning idle threads wait for threads that are not scheduled
    # (benchmarks/recsys/torchrec_runner.py measured it): passive waiting, set before libgomp.
    if omp_wait_policy != "default":
        os.environ["OMP_WAIT_POLICY"] = omp_wait_policy.upper()
    try:
        for name in ("torch", "fbgemm_gpu", "torchrec"):
            importlib.import_module(name)
    except ImportError as err:
        print(f"torchrec_mch_runner: error: {getattr(err, 'name', None) or err} is not "
              f"installed ({err}); {INSTALL_HINT}", file=sys.stderr)  # fmt: skip
        sys.exit(3)


def _dense_arch(params: dict[str, np.ndarray], names: list[str]):
    """DLRM's dense part, `dlrm_step.dense_logits` in torch, from the same parameters."""
    import torch
    from torch import nn

    def linears(prefix: str) -> nn.ModuleList:
        layers = nn.ModuleList()
        for i in range(sum(k.startswith(f"{prefix}_w") for k in params)):
            w, b = params[f"{prefix}_w{i}"], params[f"{prefix}_b{i}"]  # w: [in, out]
            layer = nn.Linear(*w.shape)
            with torch.no_grad():
                layer.weight.copy_(torch.from_numpy(w.T.copy()))
                layer.bias.copy_(torch.from_numpy(b))
            layers.append(layer)
        return layers

    class DenseArch(nn.Module):
        def __init__(self):
            super().__init__()
            self.bottom, self.top = linears("bottom"), linears("top")
            n = len(names) + 1
            self.register_buffer("upper", torch.from_numpy(
                np.flatnonzero(np.triu(np.ones((n, n), bool), k=1))))  # fmt: skip

        def forward(self, dense, pooled: dict[str, Any]):
            x = dense
            for layer in self.bottom:
                x = torch.relu(layer(x))
            z = torch.stack([x, *(pooled[f] for f in names)], dim=1)  # [B, F+1, d]
            dots = torch.bmm(z, z.transpose(1, 2)).flatten(1)[:, self.upper]
            y = torch.cat([x, dots], dim=1)
            for i, layer in enumerate(self.top):
                y = layer(y)
                if i + 1 < len(self.top):
                    y = torch.relu(y)
            return y[:, 0]

    return DenseArch()


class _Variant:
    """One TorchRec model, its optimizers and its inputs; `step()` trains on the next batch."""

    def __init__(self, name: str, inputs: Any, lr: dict[str, float]):
        import torch
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
        from torchrec.modules.embedding_modules import EmbeddingBagCollection
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
        from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
        from torchrec.modules.mc_modules import (
            LRU_EvictionPolicy,
            ManagedCollisionCollection,
            MCHManagedCollisionModule,
        )
        from torchrec.optim import RowWiseAdagrad

        self.name, (self.kind, interval) = name, VARIANTS[name]
        w = inputs.workload
        cpu = torch.device("cpu")
        self.dynamic = list(w.dynamic)
        self.others = [t for t, _ in w.tables if t not in w.dynamic]
        config = lambda t: EmbeddingBagConfig(
            name=t, embedding_dim=w.dim, num_embeddings=w.rows(t),
            feature_names=w.features_of(t), pooling=PoolingType.MEAN,
        )  # fmt: skip
        fused = lambda names: FusedEmbeddingBagCollection(
            tables=[config(t) for t in names], optimizer_type=RowWiseAdagrad,
            optimizer_kwargs={"lr": lr["table"], "eps": lr["eps"]}, device=cpu,
        )  # fmt: skip
        self.other = fused(self.others) if self.others else None
        self.sparse_opt = self.mcc = self.mcebc = None
        if self.kind == "mcebc":
            configs = [config(t) for t in self.dynamic]
            self.big = EmbeddingBagCollection(tables=configs, device=cpu)
            mch = self._mch(w, interval, MCHManagedCollisionModule, LRU_EvictionPolicy)
            self.mcc = ManagedCollisionCollection(mch, configs)
            self.mcebc = ManagedCollisionEmbeddingBagCollection(self.big, self.mcc)
            self.sparse_opt = RowWiseAdagrad(self.big.parameters(), lr=lr["table"], eps=lr["eps"])
        else:
            self.big = fused(self.dynamic)
            if self.kind == "mcc":
                self.mcc = ManagedCollisionCollection(
                    self._mch(w, interval, MCHManagedCollisionModule, LRU_EvictionPolicy),
                    [config(t) for t in self.dynamic],
                )  # fmt: skip
        with torch.no_grad():  # the driver's initial tables (the fused weights are TBE views)
            for ebc, names in ((self.big, self.dynamic), (self.other, self.others)):
                for t in names:
                    ebc.embedding_bags[t].weight.copy_(torch.from_numpy(inputs.table(t)))
        self.dense = _dense_arch(inputs.dense_params, list(w.feature_names))
        self.opt = torch.optim.Adam(self.dense.parameters(), lr=lr["dense"], eps=1e-8)
        raw = self.kind != "static"
        self.inputs = [self._prepare(inputs, b, raw) for b in inputs.batches]
        self.calls, self.losses = 0, []

    @staticmethod
    def _mch(w, interval, module, policy) -> dict[str, Any]:
        import torch

        return {t: module(zch_size=w.rows(t), device=torch.device("cpu"), eviction_policy=policy(),
                          eviction_interval=interval, name=t)
                for t in w.dynamic}  # fmt: skip

    def _prepare(self, inputs, batch: dict[str, np.ndarray], raw: bool):
        import torch
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        w = inputs.workload

        def kjt(tables: list[str], use_raw: bool):
            if not tables:
                return None
            keys, values, lengths = [], [], []
            for t in tables:
                ids = batch[f"raw_{t}" if use_raw else f"ids_{t}"]  # [F_t * B, L], -1: empty
                for i, f in enumerate(w.features_of(t)):
                    x = ids[i * w.batch : (i + 1) * w.batch]
                    keys.append(f)
                    values.append(x[x != -1].astype(np.int64))
                    lengths.append((x != -1).sum(axis=1).astype(np.int64))
            return KeyedJaggedTensor(keys=keys, values=torch.from_numpy(np.concatenate(values)),
                                     lengths=torch.from_numpy(np.concatenate(lengths)))  # fmt: skip

        return (kjt(self.dynamic, raw), kjt(self.others, False),
                torch.from_numpy(batch["dense"]), torch.from_numpy(batch["labels"]))  # fmt: skip

    def step(self) -> dict[str, float]:
        import torch.nn.functional as F

        big, other, dense, labels = self.inputs[self.calls % len(self.inputs)]
        self.calls += 1
        start, start_cpu = time.perf_counter(), time.process_time()
        if self.kind == "mcebc":
            pooled = dict(self.mcebc(big)[0].to_dict())
        elif self.kind == "mcc":
            pooled = dict(self.big(self.mcc(big)).to_dict())
        else:
            pooled = dict(self.big(big).to_dict())
        if other is not None:
            pooled.update(self.other(other).to_dict())
        loss = F.binary_cross_entropy_with_logits(self.dense(dense, pooled), labels)
        self.opt.zero_grad()
        if self.sparse_opt is not None:
            self.sparse_opt.zero_grad()
        loss.backward()  # the fused tables update here
        self.opt.step()
        if self.sparse_opt is not None:
            self.sparse_opt.step()
        value = float(loss.item())
        out = {"wall_s": time.perf_counter() - start, "cpu_s": time.process_time() - start_cpu,
               "loss": value}  # fmt: skip
        self.losses.append(value)
        return out

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "calls": self.calls, "losses": self.losses}
        if self.mcc is not None:
            out["open_slots"] = {t: int(v) for t, v in self.mcc.open_slots().items()}
            out["eviction_interval"] = VARIANTS[self.name][1]
        out["table_optimizer"] = (
            "torchrec.optim.RowWiseAdagrad on dense gradients (the plain EBC that "
            "ManagedCollisionEmbeddingBagCollection wraps)" if self.kind == "mcebc" else
            "FBGEMM EXACT_ROWWISE_ADAGRAD fused into the backward (FusedEmbeddingBagCollection)"
        )  # fmt: skip
        return out


def _fused_refusal() -> str | None:
    """What ManagedCollisionEmbeddingBagCollection says to a fused EBC (tiny tables)."""
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import (
        LRU_EvictionPolicy,
        ManagedCollisionCollection,
        MCHManagedCollisionModule,
    )
    from torchrec.optim import RowWiseAdagrad

    cfg = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"])]
    cpu = torch.device("cpu")
    ebc = FusedEmbeddingBagCollection(tables=cfg, optimizer_type=RowWiseAdagrad,
                                      optimizer_kwargs={"lr": 0.1}, device=cpu)  # fmt: skip
    mch = {"t": MCHManagedCollisionModule(zch_size=64, device=cpu, eviction_interval=1,
                                          eviction_policy=LRU_EvictionPolicy())}  # fmt: skip
    try:
        ManagedCollisionEmbeddingBagCollection(ebc, ManagedCollisionCollection(mch, cfg))
    except Exception as err:  # what it raises is what we record
        return f"{type(err).__name__}: {err}"
    return None


def _versions() -> dict[str, str]:
    import fbgemm_gpu
    import torch
    import torchrec

    return {"torch": torch.__version__, "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "?"),
            "torchrec": getattr(torchrec, "__version__", "?"), "numpy": np.__version__,
            "python": platform.python_version()}  # fmt: skip


def _build(args) -> tuple[dict[str, _Variant], dict[str, Any]]:
    import torch

    from benchmarks.dynamic.dlrm_step import load_inputs

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    inputs = load_inputs(args.inputs)
    lr = inputs.hyper
    variants = {name: _Variant(name, inputs, lr) for name in args.variants}
    info = {
        "versions": _versions(), "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
        "build_time_in_s": round(time.perf_counter() - start, 2),
        "batches": len(inputs.batches),
        "mcebc_refuses_fused_ebc": _fused_refusal() if "torchrec_mcebc" in variants else None,
        "miss_row": "an id without a slot reads (and trains) row zch_size - 1, shared by all "
        "misses (TorchRec's MCH); the unsharded MC-EBC's evict() resets nothing (a TODO in "
        "torchrec 1.8.0), so an evicted slot's row and its optimizer state pass to the new id",
    }  # fmt: skip
    return variants, info


def _serve(variants: dict[str, _Variant], info: dict[str, Any], out) -> None:
    send = lambda obj: (out.write(json.dumps(obj) + "\n"), out.flush())
    send({"ready": True, **info})
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "step":
            send(variants[msg["variant"]].step())
        elif msg["op"] == "finish":
            record = {**info, "variants": {n: v.summary() for n, v in variants.items()},
                      "jax_imported": "jax" in sys.modules,
                      "loadavg_end": list(os.getloadavg())}  # fmt: skip
            send({"record": record})
            return
        else:
            raise ValueError(f"unknown op {msg['op']!r}: 'step' or 'finish'")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dynamic.torchrec_mch_runner",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--inputs", required=True, help="the .npz of dlrm_step.save_inputs")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--omp-wait-policy", default="passive", choices=("passive", "active", "default"))
    p.add_argument(
        "--steps",
        type=int,
        default=0,
        help="run each variant this many steps and print the record (no serving)",
    )
    args = p.parse_args(argv)
    out = os.fdopen(os.dup(1), "w")  # the protocol's stdout; anything printed goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _require(args.omp_wait_policy)
    variants, info = _build(args)
    if args.steps:
        steps = {n: [v.step() for _ in range(args.steps)] for n, v in variants.items()}
        out.write(json.dumps({**info, "steps": steps, "jax_imported": "jax" in sys.modules}) + "\n")
        out.flush()
        return 0
    _serve(variants, info, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
