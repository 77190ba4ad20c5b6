"""The import direction of the kernels, the native build and the optimizers.

`jaxembed._native` (floor 0) imports no other jaxembed module; the kernels never import
`jaxembed.optim` (which imports them); no circle among `jaxembed.kernels.*`,
`jaxembed._native.*` and `jaxembed.optim.*`; no private name crosses their modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp")

PACKAGE = Path(__file__).resolve().parents[1] / "jaxembed"
SCOPE = ("jaxembed.kernels", "jaxembed._native", "jaxembed.optim")


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph("jaxembed", cache_dir=None)


def imports_of(graph, prefix: str) -> set[tuple[str, str]]:
    return {
        (m, i)
        for m in graph.modules
        if m == prefix or m.startswith(prefix + ".")
        for i in graph.find_modules_directly_imported_by(m)
    }


def test_native_build_imports_no_other_jaxembed_module(graph):
    outside = {
        (m, i)
        for m, i in imports_of(graph, "jaxembed._native")
        if i.startswith("jaxembed") and not i.startswith("jaxembed._native")
    }
    assert not outside


def test_kernels_import_no_optimizer_and_no_flax_module(graph):
    up = {
        (m, i)
        for m, i in imports_of(graph, "jaxembed.kernels")
        if i.startswith(("jaxembed.optim", "jaxembed.nn", "jaxembed.nnx", "jaxembed.flax"))
    }
    assert not up


def test_no_circle_among_kernels_native_and_optim(graph):
    for a in sorted(m for m in graph.modules if m.startswith(SCOPE)):
        for b in graph.find_modules_directly_imported_by(a):
            if b.startswith(SCOPE) and b != a:
                assert not graph.chain_exists(importer=b, imported=a), f"{a} <-> {b}"


def test_no_private_name_crosses_modules():
    crossing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("").as_posix().replace("/", ".")
        if not rel.startswith(SCOPE):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxembed"):
                crossing += [f"{rel}: {node.module}.{a.name}" for a in node.names
                             if a.name.startswith("_")]  # fmt: skip
    assert not crossing
