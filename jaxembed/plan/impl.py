"""Which shard-local kernels a plan runs: XLA's, or jaxembed's native CPU kernels.

`impl="auto"` picks the native kernels (`jaxembed.kernels.native`: C++ through `jax.ffi`) on
CPU when they are available and take the table's dtype (float32, bfloat16), and XLA
everywhere else (float16 and float64 tables, GPU, TPU); `"native"` insists (an error where
they cannot run); `"xla"` never uses them. The collectives are the same either way: only the
gather, pooling, dedup and update loops change.

`default_impl(impl)` is a context in which `"auto"` means `impl`: `export_inference` traces
under `default_impl("xla")`, so a model whose lookups take the default (a collection, a Flax
module) exports without custom calls.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["IMPLS", "default_impl", "resolve_impl"]

IMPLS = ("auto", "xla", "native")

_AUTO: contextvars.ContextVar[str] = contextvars.ContextVar("jaxembed_default_impl", default="auto")


@contextlib.contextmanager
def default_impl(impl: str) -> Iterator[None]:
    """Within the block, every lookup, update and remap asked for `impl="auto"` (the default)
    resolves as if asked for `impl`; explicit `"xla"` and `"native"` keep their meaning.

    The choice is made when a function is traced: a `jax.jit` function already traced outside
    the block keeps its kernels until it traces again (`export_inference` then names any
    native call it finds).

    Args:
      impl: `"xla"`, `"native"` or `"auto"`.

    Examples:
      >>> import numpy as np
      >>> with default_impl("xla"):
      ...     resolve_impl("auto", "cpu", np.float32)
      'xla'
    """
    if impl not in IMPLS:
        raise ValueError(f"default_impl takes one of {IMPLS}, got {impl!r}")
    token = _AUTO.set(impl)
    try:
        yield
    finally:
        _AUTO.reset(token)


def auto_means() -> str:
    """What `impl="auto"` asks for here: `"auto"`, or the innermost `default_impl`'s."""
    return _AUTO.get()


def resolve_impl(impl: str, backend: str, dtype: Any) -> str:
    """`"xla"` or `"native"` for a requested `impl` on `backend`, for a table of `dtype`.

    Args:
      impl: `"auto"`, `"xla"` or `"native"`.
      backend: the plan's platform (`"cpu"`, `"gpu"`, `"tpu"`).
      dtype: the table's element type: the native kernels take float32 and bfloat16 only.

    Returns:
      The kernels that run, as the plan reports them.

    Raises:
      ValueError: an unknown impl, or `"native"` off CPU, for a table dtype the native kernels
        do not take, or where they cannot be built.

    Examples:
      >>> import numpy as np
      >>> resolve_impl("auto", "cpu", np.float16)  # float16 tables: XLA's kernels
      'xla'
      >>> resolve_impl("auto", "gpu", np.float32)
      'xla'
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = _AUTO.get()
        if impl == "native":  # a default, not a demand: where they cannot run, XLA's
            impl = "auto"
    if impl == "xla":
        return "xla"
    if backend != "cpu":
        if impl == "native":
            raise ValueError(
                f"impl='native' runs on CPU only, this plan is for {backend!r}: use impl='xla' "
                "or 'auto'"
            )
        return "xla"
    # The one place below the kernels that looks at them: which dtypes they take, and whether
    # the library can load (it is compiled on the first call, then cached; see
    # jaxembed._native.build).
    from jaxembed import _native as native

    if not native.supports_dtype(dtype):
        if impl == "native":
            try:
                name = np.dtype(dtype).name
            except TypeError:
                name = repr(dtype)
            raise ValueError(
                f"impl='native' takes {' or '.join(native.TABLE_DTYPES)} tables, this table is "
                f"{name}: use impl='xla' or 'auto' (both run XLA's kernels for {name}), or "
                "cast the table to float32"
            )
        return "xla"
    why = native.why_unavailable()
    if why is not None:
        if impl == "native":
            raise ValueError(f"impl='native' but the native kernels are unavailable: {why}")
        return "xla"
    return "native"
