"""jaxembed's benchmarks: a top-level package of the checkout, not installed with jaxembed.

    python -m benchmarks --quick                 # the layouts benchmark (= `layouts --quick`)
    python -m benchmarks sparse --quick          # or bags, routed, recsys, planner
    python -m benchmarks planner-scaling         # the plans' strong scaling, no devices
    python -m benchmarks recsys-floor            # n devices' best case on these cores
    python -m benchmarks recsys-processes        # 2 processes x 1 device against 1 x 1
    python -m benchmarks routed-pieces           # the routed exchange's pieces against copies
    python -m benchmarks --calibrate             # the cost model's CPU constants
    python -m benchmarks grid                    # 1 device against FBGEMM's TBE, a grid of cells
    python -m benchmarks defaults                # the planner and 8 devices, as users write them
    python -m benchmarks planner-cells           # the planner without id_stats, the grid's cells
    python -m benchmarks quant-sweep             # quantized pooled lookups against FBGEMM, a sweep
    jaxembed bench ...                           # the same, from a checkout

One sub-package per capability, each with its own `bench.py` (`main` and a library function):
`layouts` (the lookup against `jnp.take`, Flax's `Embed` and a one-hot matmul on every layout,
with vocabulary, device and batch sweeps), `rowsparse` (row-sparse optimizer steps against
dense ones), `bags` (pooled lookups against XLA's take + sum), `routed` (the routed exchange
against the gather path), `recsys` (the recommender step against XLA, Flax, keras-rs and
TorchRec) and `planner` (the collection planner's layout against uniform placements;
`planner-scaling`, its `scaling` module: bytes and slots per device at 8 to 512 devices, from
the plans alone); `recsys-floor` (`recsys.floor`: n independent 1/n steps at once, the best
that n simulated devices can do on the cores they share).
`benchmarks.common` holds what they share: one timing loop (`timing`), one float64 check
(`reference`), one report writer (`report`). Results live in `benchmarks/results/<capability>/`
and `benchmarks/RESULTS.md` prints, beside each, the command that reproduces it.

Importing this package does not import jax (the benchmark chosen loads it).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

__all__ = ["SUBCOMMANDS", "main"]

SUBCOMMANDS = {
    "layouts": "benchmarks.layouts.bench",
    "sparse": "benchmarks.rowsparse.bench",
    "bags": "benchmarks.bags.bench",
    "routed": "benchmarks.routed.bench",
    "routed-pieces": "benchmarks.routed.pieces",
    "recsys": "benchmarks.recsys.bench",
    "planner": "benchmarks.planner.bench",
    "planner-scaling": "benchmarks.planner.scaling",
    "recsys-floor": "benchmarks.recsys.floor",
    "recsys-processes": "benchmarks.recsys.processes",
    "serving": "benchmarks.serving.latency",
    "serving-torchrec": "benchmarks.serving.torchrec_qebc",
    "serving-delta": "benchmarks.serving.delta",
    "dynamic-auc": "benchmarks.dynamic.auc",
    "dynamic-throughput": "benchmarks.dynamic.throughput",
    "dynamic-dlrm": "benchmarks.dynamic.dlrm_step",
    "dynamic-sharded": "benchmarks.dynamic.sharded",
    "quant-fbgemm": "benchmarks.quant.fbgemm",
    "quant-sweep": "benchmarks.quant.sweep",
    "grid": "benchmarks.grid.bench",
    "planner-cells": "benchmarks.grid.planner_cells",
    "defaults": "benchmarks.defaults",
    "llm-head": "benchmarks.llm_head",
    "tiered": "benchmarks.tiered",
}
"""`python -m benchmarks NAME ...` runs `main` of this module; no NAME runs `layouts`."""


def main(argv: Sequence[str]) -> int:
    """`python -m benchmarks [NAME] [flags]`: hands the flags to benchmark NAME's `main`.

    Args:
      argv: the arguments after `benchmarks` (or after `jaxembed bench`).

    Returns:
      The benchmark's exit status (2 for bad flags).
    """
    argv = list(argv)
    name = argv[0] if argv[:1] and argv[0] in SUBCOMMANDS else "layouts"
    rest = argv[1:] if argv[:1] == [name] else argv
    return importlib.import_module(SUBCOMMANDS[name]).main(rest)
