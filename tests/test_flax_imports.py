"""The import direction of the collections, the Flax modules and the training.

Floors, each importing only those below it: the collection's plain data
(`jaxembed.collection`: configs, layout, checks) -> ... -> the kernels (with
`jaxembed.kernels.collection`, the collection's lookup and update) -> the Flax modules
(`jaxembed.nn`) -> the training helpers (`jaxembed.training`) -> the faces (`jaxembed.nnx`,
`jaxembed.flax`), which only re-export. No circle among them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp")

REPO_ROOT = Path(__file__).resolve().parents[1]
FLOORS = (
    ("jaxembed.collection",),
    ("jaxembed.kernels",),
    ("jaxembed.nn",),
    ("jaxembed.training",),
    ("jaxembed.nnx", "jaxembed.flax"),
)


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph("jaxembed", cache_dir=None)


def floor_of(module: str) -> int | None:
    for index, prefixes in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return None


def test_imports_go_down_the_floors(graph):
    up = sorted(
        (m, i)
        for m in graph.modules
        if floor_of(m) is not None
        for i in graph.find_modules_directly_imported_by(m)
        if floor_of(i) is not None and floor_of(i) > floor_of(m)
    )
    assert not up


def test_no_circle_among_collections_flax_modules_and_training(graph):
    scope = [m for m in sorted(graph.modules) if floor_of(m) is not None and floor_of(m) != 1]
    for a in scope:
        for b in graph.find_modules_directly_imported_by(a):
            if b in scope and b != a:
                assert not graph.chain_exists(importer=b, imported=a), f"{a} <-> {b}"


def test_the_faces_only_re_export(graph):
    for face in ("jaxembed.nnx", "jaxembed.flax"):
        imported = graph.find_modules_directly_imported_by(face)
        assert imported and all(floor_of(i) in (2, 3) for i in imported), (face, imported)


def test_the_collection_loads_no_kernel_and_no_flax_module():
    script = textwrap.dedent(
        """
        import sys
        import jaxembed.collection, jaxembed.collection.checks
        loaded = sorted(m for m in sys.modules
                        if m.startswith(("flax", "jaxembed.kernels", "jaxembed.nn")))
        assert not loaded, loaded
        assert jaxembed.collection.collection_update.__module__ == "jaxembed.kernels.collection"
        print("ok")
        """
    )
    path = os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    result = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_warnings_skip_flax_frames_whatever_was_imported_first():
    """The kernels' warnings point past jaxembed, jax, flax and optax frames at the user's
    line; which of those a process imported before the kernels must not change that (a test
    order that loaded the kernels before flax once attributed warnings to flax's module.py)."""
    script = textwrap.dedent(
        """
        import sys
        from jaxembed.kernels import arrays
        assert "flax" not in sys.modules
        import flax, optax
        dirs = arrays._library_dirs()
        for m in (flax, optax):
            assert any(m.__file__.startswith(d) for d in dirs), (m.__file__, dirs)
        print("ok")
        """
    )
    path = os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    result = subprocess.run(
        [sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": path},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
