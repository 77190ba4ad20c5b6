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

A cached library is loaded only once it is verified: beside it the build writes a record
(`libjaxembed_native.json`: its sha256 and size, written atomically after the library), and
before `ctypes.CDLL` maps it the size and the hash are checked against that record. A library
that does not match (truncated, torn, empty, overwritten) or has no record is deleted and
rebuilt under the lock: mapping a truncated library would kill the process with SIGBUS.

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
import json
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from pathlib import Path

__all__ = [
    "TARGETS",
    "NativeKernelsUnavailable",
    "cache_dir",
    "compile_flags",
    "ensure",
    "load",
    "rebuild_reason",
    "record_path",
    "verify",
]

SOURCE_DIR = Path(__file__).resolve().parent
LIBRARY_NAME = "libjaxembed_native.so"
RECORD_NAME = "libjaxembed_native.json"  # the library's sha256 and size, from its build

TARGETS = {
    # FFI target name -> exported handler symbol in embedding_kernels.cc
    "jaxembed_gather_rows": "JaxembedGatherRows",
    "jaxembed_pool_sum": "JaxembedPoolSum",
    "jaxembed_pool_sum_pieces": "JaxembedPoolSumPieces",
    "jaxembed_pool_max": "JaxembedPoolMax",
    "jaxembed_segments_from_lengths": "JaxembedSegmentsFromLengths",
    "jaxembed_scatter_add": "JaxembedScatterAdd",
    "jaxembed_bag_scatter_add": "JaxembedBagScatterAdd",
    "jaxembed_bag_scatter_add_pieces": "JaxembedBagScatterAddPieces",
    "jaxembed_scatter_add_pieces": "JaxembedScatterAddPieces",
    "jaxembed_dedup_rows": "JaxembedDedupRows",
    "jaxembed_bucket_ids": "JaxembedBucketIds",
    "jaxembed_apply_rows": "JaxembedApplyRows",
    "jaxembed_apply_rows_pieces": "JaxembedApplyRowsPieces",
    "jaxembed_bag_apply_rows": "JaxembedBagApplyRows",
    # ... and in remap_kernels.cc (the dynamic table's remap)
    "jaxembed_remap_lookup": "JaxembedRemapLookup",
    "jaxembed_remap_step": "JaxembedRemapStep",
    # ... and in quant_kernels.cc (lookups on row-wise quantized tables)
    "jaxembed_quant_gather_rows": "JaxembedQuantGatherRows",
    "jaxembed_quant_pool_sum": "JaxembedQuantPoolSum",
    "jaxembed_quant_pool_max": "JaxembedQuantPoolMax",
    "jaxembed_quant_pool_bags": "JaxembedQuantPoolBags",
}
UNITS = ("embedding_kernels.cc", "remap_kernels.cc", "quant_kernels.cc")  # one library

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
    # The units compiled and the targets registered: a library built before a new unit or
    # target was listed must not be taken for one that has them ("undefined symbol").
    for part in (*flags, include_dir, _compiler_version(cxx), _cpu_signature(), *UNITS, *TARGETS):
        h.update(part.encode() + b"\0")
    return f"{jaxlib.__version__}-{h.hexdigest()[:16]}"


def _compile(cxx: str, include_dir: str, flags: list[str], target: Path) -> str | None:
    """Compiles into `target` and records its hash (both atomically); None, or why it failed."""
    units = [str(SOURCE_DIR / name) for name in UNITS]
    for pattern in (".build-*", ".record-*"):  # a killed build's (we hold the key's lock)
        for stale in target.parent.glob(pattern):
            stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cxx, *flags, "-isystem", include_dir, f"-I{SOURCE_DIR}", *units, "-o", tmp]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        Path(tmp).unlink(missing_ok=True)
        return f"running {cxx} failed: {e}"
    if run.returncode != 0 or os.path.getsize(tmp) == 0:
        Path(tmp).unlink(missing_ok=True)
        log = target.parent / "build.log"
        log.write_text(" ".join(cmd) + "\n\n" + run.stdout + run.stderr)
        if run.returncode == 0:
            return f"{cxx} exited with 0 but wrote an empty library (full log: {log})"
        tail = (run.stderr or run.stdout).strip().splitlines()[-5:]
        return f"{cxx} exited with {run.returncode} (full log: {log}): " + " | ".join(tail)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())  # on disk before it is named: a crash must not leave a 0-byte .so
    digest, size = _digest(Path(tmp))
    os.chmod(tmp, 0o755)  # mkstemp made it private; a shared JAXEMBED_NATIVE_CACHE needs reads
    os.replace(tmp, target)
    _write_record(target, digest, size)  # after the library: a crash between leaves no record
    return None


def record_path(library: Path) -> Path:
    """The build record beside `library`: `{"library", "sha256", "size_bytes"}` as JSON."""
    return library.with_name(RECORD_NAME)


def _digest(path: Path) -> tuple[str, int]:
    """The sha256 (hex) and the size in bytes of the file at `path`."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def _write_record(library: Path, digest: str, size: int) -> None:
    record = {"library": library.name, "sha256": digest, "size_bytes": size}
    fd, tmp = tempfile.mkstemp(prefix=".record-", suffix=".json", dir=library.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, record_path(library))
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def verify(library: Path) -> str | None:
    """None when `library` has the size and sha256 its build recorded, else why not.

    Reads the whole file (about 1 MB, a few ms); never maps it.
    """
    record_file = record_path(library)
    if not library.exists():
        return "no library is cached yet"
    try:
        record = json.loads(record_file.read_text())
    except FileNotFoundError:
        return f"it has no build record ({record_file.name} is missing)"
    except (OSError, ValueError) as e:
        return f"its build record {record_file.name} is unreadable ({e})"
    want_hash = record.get("sha256") if isinstance(record, dict) else None
    want_size = record.get("size_bytes") if isinstance(record, dict) else None
    if not isinstance(want_hash, str) or type(want_size) is not int:
        return f"its build record {record_file.name} is malformed: {record!r:.80}"
    digest, size = _digest(library)
    if size != want_size:
        return f"it is {size} bytes but was built with {want_size} (truncated or torn)"
    if digest != want_hash:
        return f"its sha256 {digest[:16]}... is not the build's {want_hash[:16]}... (overwritten)"
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
    """Builds (once per cache key, under a file lock), verifies and loads the library.

    A cached library that fails `verify` (no build record, another size or sha256) is deleted
    and rebuilt before anything maps it.

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
    library = None
    try:
        key_dir = cache_dir() / _cache_key(cxx, include_dir, flags)
        key_dir.mkdir(parents=True, exist_ok=True)
        library = key_dir / LIBRARY_NAME
        # Verified and mapped under the lock: no other process replaces it in between.
        with _file_lock(key_dir.parent / f"{key_dir.name}.lock"):
            unverified = verify(library)
            if unverified is not None:
                _STATE["rebuild_reason"] = unverified
                cached = library.exists()
                library.unlink(missing_ok=True)  # never mapped: a truncated one would SIGBUS
                record_path(library).unlink(missing_ok=True)
                error = _compile(cxx, include_dir, flags, library)
                if error and cached:
                    error = f"the cached {library} was deleted ({unverified}); rebuilding: {error}"
                if error:
                    return None, error, library
                unverified = verify(library)
                if unverified is not None:  # pragma: no cover - only if the cache changes under us
                    return None, f"{library}, just built, does not verify: {unverified}", library
            try:
                return ctypes.CDLL(str(library)), None, library
            except OSError as e:
                hint = ""
                if sanitizer():
                    hint = " (an ASan build needs LD_PRELOAD=$(c++ -print-file-name=libasan.so))"
                return None, f"loading {library} failed: {e}{hint}", library
    except OSError as e:
        return None, f"cannot write the kernel cache ({e}): set JAXEMBED_NATIVE_CACHE", library


class NativeKernelsUnavailable(RuntimeWarning):
    """Warned once per process when the native kernels cannot be used (the XLA path runs)."""


_LOCK = threading.Lock()
_STATE: dict = {
    "done": False,
    "why": None,
    "library": None,
    "path": None,
    "build_s": None,
    "rebuild_reason": None,
}


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


def rebuild_reason() -> str | None:
    """Why this process compiled the library (none cached yet, or the cached one failed
    `verify`), after `ensure()`; None when the cached library verified and was loaded."""
    return _STATE["rebuild_reason"]
