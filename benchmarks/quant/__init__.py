"""Benchmarks of the row-wise quantized tables (`jaxembed.quant`).

`fbgemm` times the pooled lookups of jaxembed's native quantized kernels
(`jaxembed.kernels.quant_native`) and of the XLA path (`jaxembed.kernels.quant`) against
FBGEMM's `IntNBitTableBatchedEmbeddingBagsCodegen` on the CPU, on the same quantized bytes;
`fbgemm_runner` is its torch side (imported only when the benchmark runs).

    XLA_FLAGS=--xla_force_host_platform_device_count=1 python -m benchmarks.quant.fbgemm \\
        --json benchmarks/results/quant/fbgemm.json --markdown benchmarks/results/quant/fbgemm.md
"""
