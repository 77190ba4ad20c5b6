"""Which shard-local kernels a plan runs: XLA's, or jaxembed's native CPU kernels.

`impl="auto"` picks the native kernels (`jaxembed.kernels.native`: C++ through `jax.ffi`) on
CPU when they are available, and XLA everywhere else; `"native"` insists (an error where they
cannot run); `"xla"` never uses them. The collectives are the same either way: only the
gather, pooling, dedup and update loops change.
"""

from __future__ import annotations

__all__ = ["IMPLS", "resolve_impl"]

IMPLS = ("auto", "xla", "native")


def resolve_impl(impl: str, backend: str) -> str:
    """`"xla"` or `"native"` for a requested `impl` on `backend`.

    Raises:
      ValueError: an unknown impl, or `"native"` off CPU or where the kernels cannot be built.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "xla":
        return "xla"
    if backend != "cpu":
        if impl == "native":
            raise ValueError(
                f"impl='native' runs on CPU only, this plan is for {backend!r}: use impl='xla' "
                "or 'auto'"
            )
        return "xla"
    # The one place below the kernels that looks at them: whether the library can load (it is
    # compiled on the first call, then cached; see jaxembed.kernels.native.build).
    from jaxembed.kernels.native import build

    why = build.ensure()
    if why is not None:
        if impl == "native":
            raise ValueError(f"impl='native' but the native kernels are unavailable: {why}")
        return "xla"
    return "native"
