"""Benchmarks of the row-wise quantized tables (`jaxembed.quant`).

`fbgemm` times the pooled lookups of jaxembed's native quantized kernels
(`jaxembed.kernels.quant_native`) and of the XLA path (`jaxembed.kernels.quant`) against
FBGEMM's `IntNBitTableBatchedEmbeddingBagsCodegen` on the CPU, on the same quantized bytes;
`fbgemm_runner` is its torch side (imported only when the benchmark runs). `sweep`
(`python -m benchmarks quant-sweep`) times the public path a user writes, `jax.jit(embedding_bag)`
on a `QuantizedTable`, against the same TBE in a child process (`fbgemm_runner`, in a Python with
torch and no jax) over a sweep of tables, batches and id distributions (`cells`; jaxembed's
child: `sweep_jaxembed`).

    XLA_FLAGS=--xla_force_host_platform_device_count=1 python -m benchmarks.quant.fbgemm \\
        --json benchmarks/results/quant/fbgemm.json --markdown benchmarks/results/quant/fbgemm.md
    python -m benchmarks quant-sweep --torch-python /path/to/torch/python \\
        --json benchmarks/results/quant/sweep.json --markdown benchmarks/results/quant/sweep.md
"""
