"""`python -m benchmarks ...` from the checkout's root (see `benchmarks.main`)."""

import os
import sys

if "jax" not in sys.modules:  # 8 CPU devices, before jax starts
    flag = "--xla_force_host_platform_device_count=8"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    from jaxembed import host

    # XLA's per-step buffers kept for reuse (JAXEMBED_MALLOC=default: glibc's defaults)
    host.tune_malloc(warn=False)

from benchmarks import main

sys.exit(main(sys.argv[1:]))
