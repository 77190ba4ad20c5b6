"""The torch side of `benchmarks.quant.fbgemm`: FBGEMM's IntNBit TBE on the CPU.

`IntNBitTables` holds T tables of one precision in an `IntNBitTableBatchedEmbeddingBagsCodegen`
(`EmbeddingLocation.HOST`, sum pooling, float32 output), loads the fused rows jaxembed writes
(`jaxembed.quant.to_fbgemm_rows`) into its weights, hands them back for the check
(`jaxembed.quant.from_fbgemm_rows`), and runs the forward on flat indices and offsets.

FBGEMM 1.8's CPU forward (`int_nbit_split_embedding_codegen_forward_*_cpu`) pools the tables
one after the other on the calling thread with its JIT-generated `EmbeddingSpMDM` kernels
(`prefetch=16`); `torch.set_num_threads` is set to the benchmark's thread count all the same,
so that torch's own work (the output's allocation and zero fill) runs as it would. fp8 rows
take `GenerateEmbeddingSpMDMFP8WithStrides` instead, for which FBGEMM generates no JIT kernel
(a compiled loop; about 10x int8's time a row in `results/quant/fbgemm.md`). The TBE takes
fp8's format as `fp8_exponent_bits` and `fp8_exponent_bias` (default 4 and 7, jaxembed's).

Importing this module does not import torch: `require()` does, after setting
`OMP_WAIT_POLICY=PASSIVE` (idle OpenMP threads that spin take the cores of a shared machine).

As a child process of the sweep (`benchmarks.quant.sweep`), in a Python that has torch and
fbgemm_gpu but no jax, it times one table's cells (`benchmarks.quant.cells`) at each thread
count asked, with `OMP_WAIT_POLICY` set before torch loads (`default` leaves libgomp's, which
spins), reads its weights back to check they are the table's bytes, and saves each cell's
first output for the driver's checks:

    python -m benchmarks.quant.fbgemm_runner --group DIR --out fb.json --threads 1 2 \\
        --omp-wait-policy passive
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["INSTALL_HINT", "IntNBitTables", "main", "require", "run_group", "versions"]

INSTALL_HINT = (
    "install the CPU wheels of the repo's bench-torchrec extra: "
    "pip install torch==2.13.0 fbgemm-gpu-cpu==1.8.0 "
    "(add --index-url https://download.pytorch.org/whl/cpu if pip picks a CUDA torch)"
)

_SPARSE_TYPES = {"int8": "INT8", "int4": "INT4", "int2": "INT2", "fp8": "FP8"}


def require(omp_wait_policy: str = "passive") -> None:
    """Imports torch and fbgemm_gpu, or raises RuntimeError with the install command.

    Args:
      omp_wait_policy: `OMP_WAIT_POLICY` for torch's OpenMP ("passive", "active"), set before
        torch loads; "default" leaves it alone.
    """
    if omp_wait_policy != "default" and "torch" not in sys.modules:
        os.environ["OMP_WAIT_POLICY"] = omp_wait_policy.upper()
    try:
        for name in ("torch", "fbgemm_gpu"):
            importlib.import_module(name)
    except ImportError as err:
        raise RuntimeError(f"FBGEMM's side needs {err.name or err}: {INSTALL_HINT}") from err


def versions() -> dict[str, Any]:
    """torch's and fbgemm_gpu's versions and torch's thread count (after `require`)."""
    import fbgemm_gpu
    import torch

    return {
        "torch": torch.__version__,
        "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "unknown"),
        "torch_num_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
    }


class IntNBitTables:
    """T tables of `rows x dim` in one FBGEMM IntNBit TBE on the CPU.

    Args:
      precision: "int8", "int4", "int2" or "fp8" (FBGEMM's `SparseType` of that name).
      num_tables, rows, dim: T, V, D (every table alike).
      threads: `torch.set_num_threads`.
      fp8_exponent_bits, fp8_exponent_bias: fp8's format (FBGEMM's defaults 4, 7).
    """

    def __init__(
        self,
        precision: str,
        num_tables: int,
        rows: int,
        dim: int,
        *,
        threads: int = 1,
        fp8_exponent_bits: int = 4,
        fp8_exponent_bias: int = 7,
    ):
        require()
        import torch
        from fbgemm_gpu.split_embedding_configs import SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
            IntNBitTableBatchedEmbeddingBagsCodegen,
        )

        if precision not in _SPARSE_TYPES:
            raise ValueError(f"precision must be one of {list(_SPARSE_TYPES)}, got {precision!r}")
        torch.set_num_threads(int(threads))
        sparse_type = getattr(SparseType, _SPARSE_TYPES[precision])
        specs = [(f"t{t}", int(rows), int(dim), sparse_type, EmbeddingLocation.HOST)
                 for t in range(num_tables)]  # fmt: skip
        fp8 = {}
        if precision == "fp8":
            fp8 = {"fp8_exponent_bits": fp8_exponent_bits, "fp8_exponent_bias": fp8_exponent_bias}
        self.module = IntNBitTableBatchedEmbeddingBagsCodegen(
            specs, pooling_mode=PoolingMode.SUM, device="cpu",
            output_dtype=SparseType.FP32, **fp8,
        )  # fmt: skip
        self.module.initialize_weights()  # allocates the weights; `load` writes them
        self.precision, self.num_tables, self.rows, self.dim = precision, num_tables, rows, dim

    @property
    def row_alignment(self) -> int:
        """The bytes FBGEMM pads each row to (1 on the CPU)."""
        return int(self.module.row_alignment)

    def _weights(self) -> list[Any]:
        return [w for w, _ in self.module.split_embedding_weights(split_scale_shifts=False)]

    def load(self, fused_rows: Sequence[np.ndarray]) -> None:
        """Copies each table's fused rows (uint8 `[V, row_bytes]`) into the TBE's weights."""
        import torch

        for t, (dst, rows) in enumerate(zip(self._weights(), fused_rows, strict=True)):
            rows = np.array(rows, np.uint8, order="C")  # a writable copy, as torch wants
            if tuple(dst.shape) != rows.shape:
                raise ValueError(
                    f"table {t}: FBGEMM holds rows of shape {tuple(dst.shape)}, got {rows.shape}: "
                    f"write them with to_fbgemm_rows(..., row_alignment={self.row_alignment})"
                )
            dst.copy_(torch.from_numpy(rows))

    def weights(self) -> list[np.ndarray]:
        """Each table's fused rows as the TBE holds them (uint8 `[V, row_bytes]`)."""
        return [w.numpy().copy() for w in self._weights()]

    def inputs(self, ids: np.ndarray) -> tuple[Any, Any]:
        """`(indices, offsets)` for ids `[T, B, L]` (L ids a bag): int32 tensors, table-major."""
        import torch

        t, b, length = ids.shape
        indices = torch.from_numpy(np.ascontiguousarray(ids.reshape(-1), np.int32))
        offsets = torch.arange(0, t * b * length + 1, length, dtype=torch.int32)
        return indices, offsets

    def csr_inputs(self, values: np.ndarray, lengths: np.ndarray) -> tuple[Any, Any]:
        """`(indices, offsets)` for one table's bags in CSR form: ids `values [N]`, bag b the
        next `lengths[b]` of them (int32 tensors)."""
        import torch

        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)
        indices = np.ascontiguousarray(values, np.int32)
        return torch.from_numpy(indices), torch.from_numpy(offsets)

    def pooled(self, indices: Any, offsets: Any) -> np.ndarray:
        """The forward's float32 `[B, T*D]` (table t's bag b in `[b, t*D:(t+1)*D]`)."""
        import torch

        with torch.inference_mode():
            return self.module(indices, offsets).numpy()

    def runner(self, indices: Any, offsets: Any) -> Callable[[], Any]:
        """A zero-argument call of one forward (what the benchmark times)."""
        import torch

        module = self.module

        def run():
            with torch.inference_mode():
                return module(indices, offsets)

        return run


# --- the sweep's child process ----------------------------------------------------------------


def run_group(args: argparse.Namespace) -> dict[str, Any]:
    """Times every cell of one table group (`--group`: `cells.write_table`'s files and
    `cells.json`) at each `--threads`; the record (see the module docstring)."""
    require(args.omp_wait_policy)
    import torch

    from benchmarks.grid.runner import timed
    from benchmarks.quant import cells as C

    with open(os.path.join(args.group, "cells.json")) as f:
        group = json.load(f)
    data, scale, bias = C.read_table(args.group)
    table = IntNBitTables(group["precision"], 1, group["rows"], group["dim"])
    table.load([C.fused_rows(data, scale, bias)])
    back = table._weights()[0].numpy()  # the TBE's rows as it holds them (no copy)
    params = np.ascontiguousarray(back[:, :4]).view(np.uint16)  # [V, 2]
    same = (np.array_equal(back[:, 4:], data)
            and np.array_equal(params[:, 0], scale.view(np.uint16))
            and np.array_equal(params[:, 1], bias.view(np.uint16)))  # fmt: skip
    record: dict[str, Any] = {**versions(), "same_bytes": bool(same), "cells": {}}
    record.pop("torch_num_threads")
    for k, cell in enumerate(group["cells"]):
        inputs = [table.csr_inputs(v, n) for v, n in C.read_ids(cell["ids"])]
        out = table.pooled(*inputs[0])
        np.save(os.path.join(args.group, f"fbgemm-{args.omp_wait_policy}-{k}.npy"), out)
        by_threads = {}
        for threads in args.threads:
            torch.set_num_threads(threads)

            def step(i, inputs=inputs):
                with torch.inference_mode():
                    table.module(*inputs[i % len(inputs)])

            by_threads[str(threads)] = timed(step, args.steps, args.warmup)
        record["cells"][cell["name"]] = by_threads
    return record


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m benchmarks.quant.fbgemm_runner --group DIR --out PATH [...]`."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.quant.fbgemm_runner",
        description="FBGEMM's side of the quantized sweep (a child).",
    )
    p.add_argument("--group", required=True, help="a table group's directory")
    p.add_argument("--out", required=True, help="the JSON record to write")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--omp-wait-policy", default="default", choices=("default", "passive", "active"))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    args = p.parse_args(argv)
    try:
        record, status = run_group(args), 0
    except Exception as e:  # the driver records it and goes on
        record, status = {"error": f"{type(e).__name__}: {e}"}, 1
    record["loadavg"] = list(os.getloadavg())
    with open(args.out, "w") as f:
        json.dump(record, f)
    return status


if __name__ == "__main__":
    sys.exit(main())
