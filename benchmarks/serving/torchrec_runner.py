"""The torch side of `benchmarks.serving.torchrec_qebc`: the serving bench's ranker in TorchRec.

`float_ranker` builds `benchmarks.serving.latency`'s model from the float artifact's parameters
(`params.npz`): a float `torchrec.EmbeddingBagCollection` of F tables (`t{f}`, one feature
`f{f}` each, sum pooling) holding the same weights, then `relu(x @ w1 + b1) @ w2 + b2` and a
sigmoid as two `torch.nn.Linear`s. `quantized` turns it into the serving module with
TorchRec's inference quantization, `torchrec.inference.modules.quantize_embeddings` (which
swaps the EBC for `torchrec.quant.embedding_modules.EmbeddingBagCollection.from_float`: one
FBGEMM `IntNBitTableBatchedEmbeddingBagsCodegen` over the tables): `torch.float` gives FP32
rows, `torch.qint8` INT8, `torch.quint4x2` INT4. `with_rows` builds the same module on given
quantized rows instead (jaxembed's), to compare the lookups apart from the quantizers.

Importing this module does not import torch: `require()` does.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "INSTALL_HINT", "float_ranker", "inputs", "quantized", "require", "runner", "scores",
    "tbe_rows", "versions", "with_rows",
]  # fmt: skip

INSTALL_HINT = (
    "install the repo's bench-torchrec extra: pip install -e '.[bench-torchrec]' && "
    "pip install --no-deps torchrec==1.8.0 (torch 2.13.0+cpu, fbgemm-gpu-cpu 1.8.0)"
)

_DTYPES = {"float": "float", "int8": "qint8", "int4": "quint4x2"}
"""Each precision's `torch` dtype as `quantize_embeddings` takes it."""


def require(omp_wait_policy: str = "passive") -> None:
    """Imports torch, fbgemm_gpu and torchrec, or raises RuntimeError with the install command.

    Args:
      omp_wait_policy: `OMP_WAIT_POLICY` for torch's OpenMP, set before torch loads (idle
        threads that spin take the cores of a shared machine); "default" leaves it alone.
    """
    if omp_wait_policy != "default" and "torch" not in sys.modules:
        os.environ["OMP_WAIT_POLICY"] = omp_wait_policy.upper()
    try:
        for name in ("torch", "fbgemm_gpu", "torchrec"):
            importlib.import_module(name)
    except ImportError as err:
        raise RuntimeError(f"TorchRec's side needs {err.name or err}: {INSTALL_HINT}") from err


def versions() -> dict[str, Any]:
    """torch's, fbgemm_gpu's and torchrec's versions, torch's threads (after `require`)."""
    import fbgemm_gpu
    import torch
    import torchrec

    return {
        "torch": torch.__version__,
        "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "unknown"),
        "torchrec": getattr(torchrec, "__version__", "unknown"),
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
    }


def _ranker_class():
    import torch

    class Ranker(torch.nn.Module):
        """`sigmoid(relu([pooled f0..fF-1, dense] @ w1 + b1) @ w2 + b2)`: latency's `_ranker`."""

        def __init__(self, ebc, l1, l2):
            super().__init__()
            self.ebc, self.l1, self.l2 = ebc, l1, l2

        def forward(self, kjt, dense):
            pooled = self.ebc(kjt).values()  # f32[B, F·H], the tables in order
            x = torch.cat([pooled, dense], dim=1)  # f32[B, F·H + D]
            return torch.sigmoid(self.l2(torch.relu(self.l1(x))))

    return Ranker


def _configs(features: int, rows: int, dim: int, data_type: Any = None) -> list[Any]:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

    extra = {} if data_type is None else {"data_type": data_type}
    return [EmbeddingBagConfig(name=f"t{f}", embedding_dim=dim, num_embeddings=rows,
                               feature_names=[f"f{f}"], pooling=PoolingType.SUM, **extra)
            for f in range(features)]  # fmt: skip


def float_ranker(params: Mapping[str, np.ndarray], features: int) -> Any:
    """The float ranker on the float artifact's leaves (`"['tables'][f]"`, `"['w1']"`, ...)."""
    import torch
    from torchrec import EmbeddingBagCollection

    rows, dim = params["['tables'][0]"].shape
    ebc = EmbeddingBagCollection(tables=_configs(features, rows, dim), device=torch.device("cpu"))
    w1, w2 = params["['w1']"], params["['w2']"]
    l1, l2 = torch.nn.Linear(*w1.shape), torch.nn.Linear(*w2.shape)
    with torch.no_grad():
        for f in range(features):
            ebc.embedding_bags[f"t{f}"].weight.copy_(torch.from_numpy(params[f"['tables'][{f}]"]))
        for layer, w, b in ((l1, w1, "['b1']"), (l2, w2, "['b2']")):
            layer.weight.copy_(torch.from_numpy(np.ascontiguousarray(w.T)))
            layer.bias.copy_(torch.from_numpy(params[b]))
    return _ranker_class()(ebc, l1, l2).eval()


def quantized(ranker: Any, precision: str) -> Any:
    """A copy of `ranker` whose EBC TorchRec's `quantize_embeddings` turned into its
    quantized EBC (`precision`: "float" for FP32 rows, "int8", "int4")."""
    import torch
    from torchrec.inference.modules import quantize_embeddings

    dtype = getattr(torch, _DTYPES[precision])
    return quantize_embeddings(ranker, dtype=dtype, inplace=False).eval()


def with_rows(ranker: Any, precision: str, leaves: Mapping[str, np.ndarray]) -> Any:
    """The quantized ranker on given rows: `leaves` holds the jaxembed artifact's
    `"['tables'][f].data"`, `.scale`, `.bias` (uint8 `[V, B]`, float16 `[V]`)."""
    import torch
    from torchrec.modules.embedding_configs import DataType
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEBC

    configs = ranker.ebc.embedding_bag_configs()
    features, rows, dim = len(configs), configs[0].num_embeddings, configs[0].embedding_dim
    weights = {}
    for f in range(features):
        data, scale, bias = (leaves[f"['tables'][{f}].{a}"] for a in ("data", "scale", "bias"))
        # TBE's scale_shift a row: [scale f16, bias f16] as bytes (quantize_state_dict's split)
        shift = np.concatenate([np.ascontiguousarray(a, np.float16).view(np.uint8).reshape(-1, 2)
                                for a in (scale, bias)], axis=1)  # fmt: skip
        weights[f"t{f}"] = (torch.from_numpy(np.array(data)), torch.from_numpy(shift))
    ebc = QuantEBC(_configs(features, rows, dim, getattr(DataType, precision.upper())),
                   is_weighted=False, device=torch.device("cpu"),
                   table_name_to_quantized_weights=weights)  # fmt: skip
    return _ranker_class()(ebc, ranker.l1, ranker.l2).eval()


def tbe_rows(ranker: Any) -> list[tuple[np.ndarray, np.ndarray | None, np.ndarray | None]]:
    """Each table's rows as the quantized EBC's TBE holds them: (data uint8 `[V, bytes]`,
    scale float16 `[V]`, bias float16 `[V]`; None for FP32), alignment padding cut."""
    out = []
    for tbe in ranker.ebc._emb_modules:  # one TBE a pooling mode: here one for every table
        for data, scale, bias in tbe.split_embedding_weights_with_scale_bias(2):
            out.append((data.numpy().copy(),
                        None if scale is None else scale.numpy().reshape(-1).copy(),
                        None if bias is None else bias.numpy().reshape(-1).copy()))  # fmt: skip
    return out


def inputs(ids: np.ndarray, dense: np.ndarray) -> tuple[Any, Any]:
    """`(KeyedJaggedTensor, dense)` of ids int32 `[B, F, L]` (-1: an empty slot) and dense
    float32 `[B, D]`: keys `f0..`, feature-major, each bag its ids >= 0 in slot order."""
    import torch
    from torchrec import KeyedJaggedTensor

    by_feature = np.ascontiguousarray(ids.transpose(1, 0, 2))  # [F, B, L]
    keep = by_feature >= 0
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{f}" for f in range(ids.shape[1])],
        values=torch.from_numpy(by_feature[keep].astype(np.int64)),
        lengths=torch.from_numpy(keep.sum(axis=2).reshape(-1).astype(np.int32)),
    )
    return kjt, torch.from_numpy(np.ascontiguousarray(dense, np.float32))


def scores(ranker: Any, kjt: Any, dense: Any) -> np.ndarray:
    """The ranker's float32 `[B, 1]`."""
    import torch

    with torch.inference_mode():
        return ranker(kjt, dense).numpy().copy()


def runner(ranker: Any, sets: Sequence[tuple[Any, Any]]) -> Callable[[], Any]:
    """A zero-argument call of one forward, each call on the next input set."""
    import torch

    turns = iter(range(2**62))

    def call():
        kjt, dense = sets[next(turns) % len(sets)]
        with torch.inference_mode():
            return ranker(kjt, dense)

    return call
