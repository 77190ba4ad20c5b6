"""Compile the native kernels on first use, cache the library, load it, register the targets.

`pip install -e .` stays a pure-Python install: the C++ sources beside this file are compiled
the first time a process asks for a native kernel, with the machine's C++ compiler, against
the FFI headers of the installed jaxlib (`jax.ffi.include_dir()`):

    c++ -O3 -std=c++17 -fPIC -shared -march=native -ffp-contract=off -fno-math-errno -pthread

The library is cached under `~/.cache/jaxembed/native/<jaxlib>-<hash>/` (`JAXEMBED_NATIVE_CACHE`
overrides the root), the hash covering the sources, the flags, the compiler's version and, as
`-march=native` is used, the CPU's model and flags. A file lock serializes concurrent
processes (a test run and a 2-process launch), so each cache key is compiled once; the
library is written to a temporary name and renamed into place.

`JAXEMBED_NATIVE_SANITIZE=address` builds an AddressSanitizer variant under its own key
(python is not instrumented: run it with `LD_PRELOAD=$(c++ -print-file-name=libasan.so)` and
`ASAN_OPTIONS=detect_leaks=0`).

Nothing here raises: `ensure()` builds, loads and registers once per process and returns None,
or the reason the native path is unavailable (`JAXEMBED_NATIVE=0`, no compiler, a failed
compile), warning once.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from pathlib import Path

__all__ = ["TARGETS", "NativeKernelsUnavailable", "cache_dir", "compile_flags", "ensure", "load"]

SOURCE_DIR = Path(__file__).resolve().parent
LIBRARY_NAME = "libjaxembed_native.so"

TARGETS = {
    # FFI target name -> exported handler symbol in embedding_kernels.cc
    "jaxembed_gather_rows": "JaxembedGatherRows",
    "jaxembed_pool_sum": "JaxembedPoolSum",
    "jaxembed_pool_max": "JaxembedPoolMax",
    "jaxembed_scatter_add": "JaxembedScatterAdd",
    "jaxembed_bag_scatter_add": "JaxembedBagScatterAdd",
    "jaxembed_dedup_rows": "JaxembedDedupRows",
    "jaxembed_apply_rows": "JaxembedApplyRows",
    "jaxembed_bag_apply_rows": "JaxembedBagApplyRows",
}

_BASE_FLAGS = (
    "-O3",
    "-std=c++17",
    "-fPIC",
    "-shared",
    "-march=native",
    "-ffp-contract=off",  # jnp rounds a·b + c twice: so must we
    "-fno-math-errno",  # lets sqrt vectorize; results unchanged
    "-pthread",
)
_COMPILE_TIMEOUT_S = 600


def compiler() -> str | None:
    """The C++ compiler: `$CXX`, else `c++`, else `g++` (None if there is none)."""
    for name in (os.environ.get("CXX"), "c++", "g++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def sanitizer() -> str | None:
    """`JAXEMBED_NATIVE_SANITIZE` ("address"), or None."""
    value = os.environ.get("JAXEMBED_NATIVE_SANITIZE", "").strip()
    return value or None


def compile_flags() -> list[str]:
    """The compiler flags of this process's build (the sanitizer variant changes them)."""
    flags = list(_BASE_FLAGS)
    if sanitizer():
        flags = [f for f in flags if f != "-O3"]
        flags += ["-O1", "-g", "-fno-omit-frame-pointer", f"-fsanitize={sanitizer()}"]
    return flags


def _sources() -> list[Path]:
    return sorted(p for p in SOURCE_DIR.iterdir() if p.suffix in (".cc", ".h"))


def _cpu_signature() -> str:
    """The CPU's model and feature flags (-march=native depends on them)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _compiler_version(cxx: str) -> str:
    try:
        run = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
        return run.stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"


def cache_dir() -> Path:
    """The cache root: `$JAXEMBED_NATIVE_CACHE`, else `~/.cache/jaxembed/native`."""
    root = os.environ.get("JAXEMBED_NATIVE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "jaxembed" / "native"


def _cache_key(cxx: str, include_dir: str, flags: list[str]) -> str:
    import jaxlib

    h = hashlib.sha256()
    for src in _sources():
        h.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    for part in (*flags, include_dir, _compiler_version(cxx), _cpu_signature()):
        h.update(part.encode() + b"\0")
    return f"{jaxlib.__version__}-{h.hexdigest()[:16]}"


def _compile(cxx: str, include_dir: str, flags: list[str], target: Path) -> str | None:
    """Compiles into `target` (atomically); returns None, or why it failed."""
    main = SOURCE_DIR / "embedding_kernels.cc"
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cxx, *flags, "-isystem", include_dir, f"-I{SOURCE_DIR}", str(main), "-o", tmp]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        Path(tmp).unlink(missing_ok=True)
        return f"running {cxx} failed: {e}"
    if run.returncode != 0:
        Path(tmp).unlink(missing_ok=True)
        log = target.parent / "build.log"
        log.write_text(" ".join(cmd) + "\n\n" + run.stdout + run.stderr)
        tail = (run.stderr or run.stdout).strip().splitlines()[-5:]
        return f"{cxx} exited with {run.returncode} (full log: {log}): " + " | ".join(tail)
    os.chmod(tmp, 0o755)  # mkstemp made it private; a shared JAXEMBED_NATIVE_CACHE needs reads
    os.replace(tmp, target)
    return None


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive lock on `path` across processes (a no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def load() -> tuple[ctypes.CDLL | None, str | None, Path | None]:
    """Builds (once per cache key, under a file lock) and loads the library.

    Returns:
      `(library, None, path)` on success, `(None, reason, path_or_None)` otherwise.
    """
    try:
        import jax
    except Exception as e:  # pragma: no cover - jax is a dependency
        return None, f"jax cannot be imported: {e}", None
    cxx = compiler()
    if cxx is None:
        return None, "no C++ compiler found (looked for $CXX, c++, g++)", None
    try:
        include_dir = jax.ffi.include_dir()
    except Exception as e:
        return None, f"jax.ffi.include_dir() failed: {e}", None
    flags = compile_flags()
    try:
        key_dir = cache_dir() / _cache_key(cxx, include_dir, flags)
        key_dir.mkdir(parents=True, exist_ok=True)
        library = key_dir / LIBRARY_NAME
        with _file_lock(key_dir.parent / f"{key_dir.name}.lock"):
            if not library.exists():
                error = _compile(cxx, include_dir, flags, library)
                if error:
                    return None, error, library
    except OSError as e:
        return None, f"cannot write the kernel cache ({e}): set JAXEMBED_NATIVE_CACHE", None
    try:
        return ctypes.CDLL(str(library)), None, library
    except OSError as e:
        hint = ""
        if sanitizer():
            hint = " (an ASan build needs LD_PRELOAD=$(c++ -print-file-name=libasan.so))"
        return None, f"loading {library} failed: {e}{hint}", library


class NativeKernelsUnavailable(RuntimeWarning):
    """Warned once per process when the native kernels cannot be used (the XLA path runs)."""


_LOCK = threading.Lock()
_STATE: dict = {"done": False, "why": None, "library": None, "path": None, "build_s": None}


def ensure() -> str | None:
    """Builds, loads and registers the kernels once per process.

    Returns:
      None when the FFI targets are registered, else why not (also warned, once).
    """
    with _LOCK:
        if not _STATE["done"]:
            _STATE["done"] = True
            start = time.perf_counter()
            _STATE["why"] = _ensure()
            _STATE["build_s"] = time.perf_counter() - start
            if _STATE["why"] is not None:
                warnings.warn(
                    f"jaxembed's native CPU kernels are unavailable: {_STATE['why']}. The XLA "
                    "kernels run instead (slower on CPU). Install a C++17 compiler (g++ or "
                    "clang++) or set CXX, or set JAXEMBED_NATIVE=0 to choose the XLA path.",
                    NativeKernelsUnavailable,
                    stacklevel=4,
                )
    return _STATE["why"]


def _ensure() -> str | None:
    if os.environ.get("JAXEMBED_NATIVE", "").strip() == "0":
        return "disabled by JAXEMBED_NATIVE=0"
    library, why, path = load()
    _STATE["path"] = path
    if library is None:
        return why
    try:
        import jax

        for target, symbol in TARGETS.items():
            handler = getattr(library, symbol)
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    except Exception as e:
        return f"registering the FFI targets from {path} failed: {e}"
    _STATE["library"] = library
    return None


def library_path() -> Path | None:
    """The loaded (or attempted) library's path, after `ensure()`."""
    return _STATE["path"]


def build_seconds() -> float | None:
    """How long `ensure()` took in this process (compile or cache hit, load, register)."""
    return _STATE["build_s"]
