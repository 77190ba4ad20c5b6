"""FBGEMM's side of the grid: its CPU TBE on the very same ids, at the settings asked.

`SplitTableBatchedEmbeddingBagsCodegen` (one table a cell table, `EmbeddingLocation.HOST`,
`ComputeDevice.CPU`, sum pooling, `EXACT_ROWWISE_ADAGRAD`, which updates the rows inside the
backward) fed the cell's CSR ids as FBGEMM takes them (int64 indices and offsets, every
table's bags one after the other); a step is `out = tbe(indices, offsets); out.backward(cot)`.
`--threads` is `torch.set_num_threads`; `--omp-wait-policy` is set before torch loads
(`default` leaves libgomp's, which spins: the peer's best on a quiet machine).

    python -m benchmarks.grid.fbgemm_runner --cell cell.npz --out fb.json --threads 2
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.grid import cells as C
from benchmarks.grid import runner

__all__ = ["main", "run"]


def run(args: Any) -> dict[str, Any]:
    if args.omp_wait_policy != "default":
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
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

    torch.set_num_threads(args.threads)
    cell = C.read_cell(args.cell)
    dim, batch = cell["dim"], cell["batch"]

    def fresh():
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(r, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for r in cell["rows"]],
            pooling_mode=PoolingMode.SUM, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            learning_rate=C.LEARNING_RATE, eps=C.EPS, device=torch.device("cpu"),
        )  # fmt: skip
        with torch.no_grad():
            for w in tbe.split_embedding_weights():
                w.fill_(C.TABLE_VALUE)
        return tbe

    inputs = []
    for step in cell["steps"]:
        values = np.concatenate([v for v, _ in step]).astype(np.int64)
        lengths = np.concatenate([n for _, n in step]).astype(np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        inputs.append((torch.from_numpy(values), torch.from_numpy(offsets)))
    cot = torch.from_numpy(np.ascontiguousarray(cell["cotangent"].reshape(batch, -1)))
    record: dict[str, Any] = {"threads": torch.get_num_threads(),
                              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
                              "torch": torch.__version__}  # fmt: skip
    if args.check:
        tbe = fresh()
        for s in range(args.check):
            tbe(*inputs[s % len(inputs)]).backward(cot)
        weights = [w.detach().numpy() for w in tbe.split_embedding_weights()]
        states = [s[0].detach().numpy() for s in tbe.split_optimizer_states()]
        record["check"] = runner.check_tables(
            cell, args.check, lambda i, rows: (weights[i][rows], states[i][rows])
        )
    tbe = fresh()

    def one(i):
        tbe(*inputs[i % len(inputs)]).backward(cot)

    record.update(runner.timed(one, args.steps, args.warmup))
    return record


def main(argv: Sequence[str] | None = None) -> int:
    def extra(p):
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--omp-wait-policy", default="default",
                       choices=("default", "passive", "active"))  # fmt: skip

    return runner.run_main("fbgemm_runner", argv, __doc__, run, extra)


if __name__ == "__main__":
    sys.exit(main())
