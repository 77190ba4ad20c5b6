"""The native CPU kernels' C++ sources and their build and loader (floor 0: no jaxembed import).

`embedding_kernels.cc` (with `common.h`, `ffi_checks.h`, `formulas.h`) holds the shard-local
kernels as XLA FFI handlers, `remap_kernels.cc` the dynamic table's remap
(`jaxembed.kernels.remap_native`), `quant_kernels.cc` the lookups on row-wise quantized tables
(`jaxembed.kernels.quant_native`);
`build` compiles them on first use, keeps a verified cache and registers the FFI targets.
The Python twins that call them are in `jaxembed.kernels.native`; the plan asks here whether
they can run (`available`, `supports_dtype`) without importing any kernel.

Examples:
  >>> import numpy as np
  >>> from jaxembed import _native
  >>> _native.supports_dtype(np.float32), _native.supports_dtype(np.float16)
  (True, False)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxembed._native import build
from jaxembed._native.build import NativeKernelsUnavailable

__all__ = [
    "TABLE_DTYPES",
    "NativeKernelsUnavailable",
    "available",
    "build",
    "supports_dtype",
    "why_unavailable",
]

TABLE_DTYPES = ("float32", "bfloat16")  # what embedding_kernels.cc's IsTableType accepts


def supports_dtype(dtype: Any) -> bool:
    """Whether the native kernels take tables of `dtype` (float32 and bfloat16 only).

    Examples:
      >>> import jax.numpy as jnp
      >>> [supports_dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16)]
      [True, True, False]
    """
    try:
        return np.dtype(dtype).name in TABLE_DTYPES
    except TypeError:
        return False


def available() -> bool:
    """Whether the native kernels can run (compiles and registers them on the first call)."""
    return build.ensure() is None


def why_unavailable() -> str | None:
    """Why the native kernels cannot run, or None when they can."""
    return build.ensure()
