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
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["INSTALL_HINT", "IntNBitTables", "require", "versions"]

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
        self.module.fill_random_weights()  # allocates the weights; `load` overwrites them
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
