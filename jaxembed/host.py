"""The host's memory allocator: XLA:CPU's step buffers kept for reuse, not faulted in anew.

On the CPU backend every execution of a compiled program allocates its temporary buffers as
one block per device (`compiled.memory_analysis().temp_size_in_bytes`) and frees it at the
end; its outputs are fresh blocks too. glibc's malloc serves a block that big from a fresh
`mmap` (over 32 MiB; from a device thread's own arena, over its 64 MiB heap) and returns it
with `munmap`, so each step faults every page it touches in again and the kernel zeroes it.
On the DLRM bench tables, 8 simulated devices on 2 cores with 69 MiB of temp a device, that
was 63 k page faults and about 125 ms of system time a step against 110 ms of user time
(`benchmarks/RESULTS.md`, "Scale-out").

`tune_malloc()` asks glibc to keep freed memory for reuse: one arena (`M_ARENA_MAX` 1), no
`mmap` for big blocks (`M_MMAP_MAX` 0), and no trimming of less than 64 GiB free
(`M_TRIM_THRESHOLD`; 2 GiB through `mallopt`, which takes a C int). It must run before JAX
starts its CPU backend, since a device thread keeps the arena it first allocates from; after
that it warns and returns False. `host_env()` gives a process about to start the same
settings as `GLIBC_TUNABLES`. The `jaxembed` command (`demo`, `bench`), `python -m
benchmarks` and `jaxembed.launch` use them for what they run; set `JAXEMBED_MALLOC=default`
to keep glibc's defaults there (both functions then change nothing).

Once the heap has grown to what a step holds at once (a few steps: a call's block can still
be held while the next call allocates), a step faults nothing. The cost: the process keeps
its peak memory instead of handing it back to the system, and its threads share one arena's
lock (XLA allocates a few blocks a step). Other allocators (jemalloc, tcmalloc by
`LD_PRELOAD`) also reuse big blocks; this module speaks only to glibc's and does nothing
elsewhere.

Examples:
  >>> env = host_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"})
  >>> env["GLIBC_TUNABLES"]   # a setting already there is kept
  'glibc.malloc.arena_max=4:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736'
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import warnings
from collections.abc import Mapping
from typing import Any

__all__ = ["ENV_MALLOC", "TUNABLES", "host_env", "malloc_settings", "tune_malloc"]

TUNABLES = {
    "glibc.malloc.arena_max": 1,
    "glibc.malloc.mmap_max": 0,
    "glibc.malloc.trim_threshold": 1 << 36,
}
"""glibc's malloc settings that keep XLA:CPU's per-step blocks for reuse (module docstring)."""

ENV_MALLOC = "JAXEMBED_MALLOC"
"""Set to `default` to keep glibc's defaults: `tune_malloc` and `host_env` then change nothing."""

_MALLOPT = {"glibc.malloc.arena_max": -8, "glibc.malloc.mmap_max": -4,
            "glibc.malloc.trim_threshold": -1}  # fmt: skip  # malloc.h's M_* numbers
_INT_MAX = (1 << 31) - 1
_tuned = False


def _glibc() -> bool:
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def _declined(env: Mapping[str, str]) -> bool:
    value = env.get(ENV_MALLOC, "tuned").strip().lower()
    if value not in ("tuned", "default"):
        raise ValueError(f"{ENV_MALLOC}={value!r} must be 'tuned' or 'default'")
    return value == "default"


def host_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of `env` (default `os.environ`) whose `GLIBC_TUNABLES` holds `TUNABLES`.

    Settings the environment already names are kept as they are; with
    `JAXEMBED_MALLOC=default` in `env`, nothing is added.

    Raises:
      ValueError: `JAXEMBED_MALLOC` is neither `tuned` nor `default`.

    Examples:
      >>> host_env({})["GLIBC_TUNABLES"].split(":")[0]
      'glibc.malloc.arena_max=1'
    """
    out = dict(os.environ if env is None else env)
    if _declined(out):
        return out
    given = [t for t in out.get("GLIBC_TUNABLES", "").split(":") if t]
    named = {t.partition("=")[0] for t in given}
    given += [f"{k}={v}" for k, v in TUNABLES.items() if k not in named]
    out["GLIBC_TUNABLES"] = ":".join(given)
    return out


def _backend_started() -> bool:
    bridge = sys.modules.get("jax._src.xla_bridge")
    started = getattr(bridge, "backends_are_initialized", None)
    return bool(started and started())


def tune_malloc(*, warn: bool = True) -> bool:
    """Sets `TUNABLES` in this process with `mallopt`, before JAX's backend starts.

    Args:
      warn: warn when it is too late (JAX's backend has started). The `jaxembed` command
        passes False: run in a process that has already computed (a test), it changes nothing.

    Returns:
      True when set (now or by an earlier call); False with `JAXEMBED_MALLOC=default`, where
      the C library is not glibc, or when JAX's backend has already started (with a warning:
      its device threads keep their arenas, so set `GLIBC_TUNABLES` from `host_env()` before
      the process starts instead).

    Raises:
      ValueError: `JAXEMBED_MALLOC` is neither `tuned` nor `default`.
    """
    global _tuned
    if _tuned:
        return True
    if _declined(os.environ) or not _glibc():
        return False
    if _backend_started():
        if not warn:
            return False
        warnings.warn(
            "jaxembed.host.tune_malloc: JAX's backend has already started, so its device "
            "threads keep their malloc arenas; call tune_malloc() before the first JAX "
            "computation, or start the process with GLIBC_TUNABLES from jaxembed.host.host_env()",
            stacklevel=2,
        )
        return False
    libc = ctypes.CDLL(None)
    # mallopt takes a C int: the trim threshold is held at 2 GiB - 1 there
    _tuned = all(libc.mallopt(_MALLOPT[k], min(v, _INT_MAX)) == 1 for k, v in TUNABLES.items())
    return _tuned


def malloc_settings() -> dict[str, Any]:
    """What this process runs with, for a benchmark's record: the C library, its
    `GLIBC_TUNABLES`, and whether `tune_malloc()` set `TUNABLES` here."""
    libc = " ".join(platform.libc_ver()).strip() or "unknown"
    return {"libc": libc, "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
            "tuned_in_process": _tuned}  # fmt: skip
