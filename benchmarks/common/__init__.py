"""What the benchmarks share: one timing loop (`timing`), one float64 check (`reference`),
one report writer (`report`), the compiled-program facts (`compiled`, `hlo_bytes`), the
variant groups (`variants`) and the plots (`plots`)."""
