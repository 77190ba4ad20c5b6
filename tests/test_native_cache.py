"""The native library cache: a cached library is verified before it is loaded, else rebuilt.

A truncated cached library used to kill every process that mapped it with SIGBUS, and an
empty or overwritten one was never rebuilt. Each case here corrupts a copy of one library
built into a temporary cache (`JAXEMBED_NATIVE_CACHE`, never the user's), then runs a fresh
python that must exit 0 and compute native lookups equal to numpy's.

Compiles are slow (tens of seconds), so only one case runs the real compiler, and only with
`pytest -m slow`: the suite's own processes already built (or verified) the library from the
same sources. The cases run a stand-in compiler (`$CXX`) that answers `--version` as the real
one does, so the cache key is the same, and "compiles" by copying that good library (logging
each call: exactly one rebuild), or fails; the build all the cases copy is one such.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from jaxembed._native import build

# A fresh process: native lookups (a gather and a one-device bag) against numpy, as JSON.
USE_NATIVE = textwrap.dedent(
    """
    import json, warnings
    import jax
    import jax.numpy as jnp
    import numpy as np
    import jaxembed
    from jaxembed.kernels import native
    from jaxembed._native import build

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = native.available()
    rng = np.random.default_rng(0)
    table = rng.standard_normal((16, 8)).astype(np.float32)
    ids = np.array([[1, 2, 3], [4, 4, -1], [-1, -1, -1]], np.int32)
    want = np.stack([table[[i for i in row if i >= 0]].sum(0) for row in ids])
    report = dict(
        available=ok, why=native.why_unavailable(), rebuild=build.rebuild_reason(),
        path=str(build.library_path()), warnings=[str(w.message) for w in caught],
    )
    if ok:
        valid = jnp.asarray(ids >= 0)
        rows = native.gather_rows(jnp.asarray(table), jnp.asarray(np.maximum(ids, 0)), valid)
        want_rows = np.where((ids >= 0)[..., None], table[np.maximum(ids, 0)], 0)
        report["gather_err"] = float(np.abs(np.asarray(rows) - want_rows).max())
    out = jaxembed.embedding_bag(ids, jnp.asarray(table), combiner="sum", impl="auto")
    report["bag_err"] = float(np.abs(np.asarray(out) - want).max())
    report["bag_impl"] = jaxembed.plan_embedding_bag(
        jax.sharding.AbstractMesh((1,), ("_",)), ids.shape, table.shape, combiner="sum"
    ).impl
    print(json.dumps(report))
    """
)

BUILD_ONLY = "from jaxembed._native import build\nimport json\n" + (
    "why = build.ensure()\n"
    "print(json.dumps(dict(why=why, path=str(build.library_path()), "
    "rebuild=build.rebuild_reason())))\n"
)


def run_python(code: str, cache: Path, cxx: str | None = None, timeout: int = 900) -> dict:
    """Runs `code` in a fresh python on `cache`; returns its last stdout line, parsed."""
    env = dict(os.environ, JAXEMBED_NATIVE_CACHE=str(cache))
    env.pop("JAXEMBED_NATIVE", None)
    if cxx is not None:
        env["CXX"] = cxx
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert run.returncode == 0, (
        f"the process exited with {run.returncode} (-7 is SIGBUS)\n{run.stdout}\n{run.stderr}"
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


def stand_in_compiler(tmp_path: Path, good: Path | None) -> tuple[str, Path]:
    """A `$CXX` that answers `--version` as the real compiler and copies `good` to `-o`'s
    path (or fails when `good` is None); every other call is logged."""
    real, log = build.compiler(), tmp_path / "cxx.log"
    action = f'cp "{good}" "$out"' if good else 'echo "stand-in: no compiler here" >&2; exit 1'
    script = tmp_path / "cxx"
    script.write_text(
        textwrap.dedent(
            f"""\
            #!/bin/sh
            if [ "$1" = "--version" ]; then exec "{real}" "$@"; fi
            echo "$@" >> "{log}"
            out=""; prev=""
            for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
            {action}
            """
        )
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script), log


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One build into a temporary cache: (its key directory, the first process's report).

    Its compiler is the stand-in, copying the library this process built or loaded (a real
    build of the same sources, flags and compiler, verified): the build's own steps (the
    temporary file, its hash, the rename, the record) run as they do after the real compiler,
    without a second compile of tens of seconds. `test_a_real_build_into_an_empty_cache`
    (slow) runs the real compiler in a fresh cache; where this process has no verified
    library, the fixture does too.
    """
    if build.compiler() is None:
        pytest.skip("no C++ compiler: the native kernels (and their cache) are not built")
    tmp = tmp_path_factory.mktemp("native-cache")
    own = build.library_path() if build.ensure() is None else None
    if own is None or build.verify(own) is not None:
        report = run_python(BUILD_ONLY, tmp / "cache")  # the real compiler
    else:
        shutil.copy(own, tmp / "good.so")
        cxx, log = stand_in_compiler(tmp, tmp / "good.so")
        report = run_python(BUILD_ONLY, tmp / "cache", cxx)
        assert len(log.read_text().splitlines()) == 1, "expected exactly one build"
    assert report["why"] is None, report
    return Path(report["path"]).parent, report


def copy_cache(built_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A fresh cache holding a copy of the built key directory: (cache root, its library)."""
    cache = tmp_path / "cache"
    shutil.copytree(built_dir, cache / built_dir.name)
    return cache, cache / built_dir.name / build.LIBRARY_NAME


def check_native_ran(report: dict, library: Path) -> None:
    assert report["available"], report
    assert report["path"] == str(library), "the process used another cache key"
    assert report["gather_err"] == 0.0
    assert report["bag_err"] < 1e-5
    assert report["bag_impl"] == "native"
    assert not report["warnings"], report["warnings"]
    assert build.verify(library) is None


def test_record_is_written_at_build_time(built):
    key_dir, report = built
    library = key_dir / build.LIBRARY_NAME
    record = json.loads(build.record_path(library).read_text())
    data = library.read_bytes()
    assert record == {
        "library": build.LIBRARY_NAME,
        "sha256": hashlib.sha256(data).hexdigest(),
        "size_bytes": len(data),
    }
    assert report["rebuild"] == "no library is cached yet"
    leftovers = [p.name for p in key_dir.iterdir() if p.name.startswith((".build-", ".record-"))]
    assert not leftovers, "temporary files of the build were left behind"
    assert build.verify(library) is None


@pytest.mark.slow  # a real compile, tens of seconds
def test_a_real_build_into_an_empty_cache(tmp_path):
    if build.compiler() is None:
        pytest.skip("no C++ compiler: the native kernels (and their cache) are not built")
    report = run_python(BUILD_ONLY, tmp_path / "cache")
    assert report["why"] is None, report
    assert report["rebuild"] == "no library is cached yet"
    library = Path(report["path"])
    assert build.verify(library) is None
    leftovers = [p.name for p in library.parent.iterdir()
                 if p.name.startswith((".build-", ".record-"))]  # fmt: skip
    assert not leftovers, "temporary files of the build were left behind"


def test_verified_library_is_loaded_without_a_rebuild(built, tmp_path):
    cache, library = copy_cache(built[0], tmp_path)
    cxx, log = stand_in_compiler(tmp_path, good=None)  # any compile would fail the run
    report = run_python(USE_NATIVE, cache, cxx)
    check_native_ran(report, library)
    assert report["rebuild"] is None
    assert not log.exists()


def _truncated(library: Path) -> None:
    """Before the fix: the process died with SIGBUS (exit -7) on mapping the library."""
    with open(library, "r+b") as f:
        f.truncate(library.stat().st_size // 2)


def _empty(library: Path) -> None:
    library.write_bytes(b"")


def _garbage(library: Path) -> None:
    size = library.stat().st_size
    library.write_bytes(np.random.default_rng(1).bytes(size))  # same size: only the hash tells


def _unrecorded(library: Path) -> None:
    build.record_path(library).unlink()  # a good library, but nothing vouches for it


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        (_truncated, "truncated"),
        (_empty, "0 bytes"),
        (_garbage, "sha256"),
        (_unrecorded, "no build record"),
    ],
    ids=["truncated", "empty", "garbage", "no-record"],
)
def test_unverified_library_is_rebuilt(built, tmp_path, corrupt, reason):
    cache, library = copy_cache(built[0], tmp_path)
    good = tmp_path / "good.so"
    shutil.copy(built[0] / build.LIBRARY_NAME, good)
    corrupt(library)
    cxx, log = stand_in_compiler(tmp_path, good)
    report = run_python(USE_NATIVE, cache, cxx)
    check_native_ran(report, library)
    assert reason in report["rebuild"]
    assert len(log.read_text().splitlines()) == 1, "expected exactly one rebuild"


def test_failed_rebuild_warns_and_runs_xla(built, tmp_path):
    cache, library = copy_cache(built[0], tmp_path)
    with open(library, "r+b") as f:
        f.truncate(library.stat().st_size // 2)
    cxx, _ = stand_in_compiler(tmp_path, good=None)
    report = run_python(USE_NATIVE, cache, cxx)
    assert not report["available"]
    assert "truncated" in report["why"] and "stand-in: no compiler here" in report["why"]
    assert len(report["warnings"]) == 1 and "XLA kernels run instead" in report["warnings"][0]
    assert report["bag_impl"] == "xla"
    assert report["bag_err"] < 1e-5
    assert not library.exists(), "the truncated library must be deleted, never loaded"
