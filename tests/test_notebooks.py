"""The notebooks in `examples/` run top to bottom, and their committed form is sound.

Each notebook is executed in a fresh `python3` kernel with `JAXEMBED_NOTEBOOK_SMALL=1`, which
the notebooks read to shrink their shapes, and with this checkout first on `PYTHONPATH`. The
kernel inherits the test process's environment, so it starts with the 8 CPU devices of the
root `conftest.py` (and its strict rank promotion). Any cell that raises fails the test with
the cell's source and traceback.

The committed files are checked without running anything: every notebook is listed below,
holds the outputs of a run, and has a jupytext Markdown twin with the same cells.

To add a notebook, write it as a jupytext Markdown file `examples/NAME.md` (or pair an existing
notebook: `jupytext --set-formats ipynb,md examples/NAME.ipynb`), add `NAME.ipynb` to
`NOTEBOOKS`, and write its outputs from a full-size run with

    python tests/test_notebooks.py examples/NAME.md

which executes the Markdown file in a fresh kernel and writes `examples/NAME.ipynb`.
"""

import hashlib
import os
import pathlib

import ipykernel  # noqa: F401  (the notebooks run in an ipykernel `python3` kernel)
import jupytext
import nbclient
import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

NOTEBOOKS = [
    "01_sharding_rules.ipynb",
    "02_shard_map_embedding.ipynb",
    "03_flax_training.ipynb",
    "04_recsys.ipynb",
]

CELL_TIMEOUT_S = 180  # per cell; a whole small run takes seconds
MAX_NOTEBOOK_BYTES = 300 * 1024


def _read(name: str):
    return nbformat.read(EXAMPLES / name, as_version=4)


def _execute(nb, timeout_s: int) -> None:
    """Runs every cell in a fresh kernel started in examples/ with this checkout importable."""
    pythonpath = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + pythonpath if pythonpath else "")}
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=timeout_s,
        record_timing=False,  # no timestamps in the saved notebook
        resources={"metadata": {"path": str(EXAMPLES)}},  # the kernel's working directory
    )
    client.execute(env=env)  # raises CellExecutionError, with the failing cell, on any error


# The shortest notebook runs by default; the others (~10, ~35 and ~55 s; what they call is
# tested directly, e.g. examples/train_lm.py by tests/test_train_lm.py and the NNX collections
# by tests/test_collection.py) with `-m slow`. Every notebook's committed form, outputs and
# Markdown twin are checked by default (below).
SLOW_NOTEBOOKS = {"02_shard_map_embedding.ipynb", "03_flax_training.ipynb", "04_recsys.ipynb"}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_NOTEBOOKS else n for n in NOTEBOOKS],
)
def test_notebook_runs(name, monkeypatch):
    monkeypatch.setenv("JAXEMBED_NOTEBOOK_SMALL", "1")
    _execute(_read(name), CELL_TIMEOUT_S)


def test_every_notebook_is_listed():
    found = sorted(p.name for p in EXAMPLES.glob("*.ipynb"))
    assert found == sorted(NOTEBOOKS), (
        f"examples/ holds {found} but NOTEBOOKS lists {sorted(NOTEBOOKS)}: add the new "
        "notebook's name to NOTEBOOKS in tests/test_notebooks.py"
    )


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_committed_with_outputs(name):
    path = EXAMPLES / name
    size = path.stat().st_size
    assert size < MAX_NOTEBOOK_BYTES, (
        f"{name} is {size / 1024:.0f} KiB (limit {MAX_NOTEBOOK_BYTES // 1024} KiB): lower the "
        "figures' dpi or print less"
    )
    code = [cell for cell in _read(name).cells if cell.cell_type == "code"]
    unrun = [i for i, cell in enumerate(code) if cell.execution_count is None]
    assert not unrun, f"{name}: code cells {unrun} have no outputs: run it top to bottom, save"
    errors = [
        i for i, cell in enumerate(code) for output in cell.outputs if output.output_type == "error"
    ]
    assert not errors, f"{name}: code cells {errors} were saved with an error"
    counts = [cell.execution_count for cell in code]
    assert counts == list(range(1, len(code) + 1)), (
        f"{name}: execution counts {counts} are not 1, 2, ...: restart the kernel and run all"
    )


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_matches_its_markdown_twin(name):
    twin = EXAMPLES / pathlib.Path(name).with_suffix(".md").name
    assert twin.exists(), f"{name} has no jupytext pair: jupytext --set-formats ipynb,md {name}"

    def cells(nb):
        return [(cell.cell_type, cell.source.strip()) for cell in nb.cells]

    assert cells(jupytext.read(twin)) == cells(_read(name)), (
        f"{name} and {twin.name} differ: jupytext --sync examples/{name}"
    )


def regenerate(markdown: str) -> None:
    """Executes a notebook's Markdown twin at full size and writes the `.ipynb` with outputs."""
    import jupytext

    md = pathlib.Path(markdown).resolve()
    nb = jupytext.read(md)
    seen: dict[str, int] = {}
    for cell in nb.cells:  # ids from the content, so that an unchanged cell keeps its id
        digest = hashlib.sha1(f"{cell.cell_type}:{cell.source}".encode()).hexdigest()[:8]
        seen[digest] = seen.get(digest, 0) + 1
        cell.id = digest if seen[digest] == 1 else f"{digest}-{seen[digest]}"
    os.environ.pop("JAXEMBED_NOTEBOOK_SMALL", None)  # full size
    _execute(nb, timeout_s=600)
    nbformat.validate(nb)
    jupytext.write(nb, md.with_suffix(".ipynb"))
    print(f"wrote {md.with_suffix('.ipynb')}")


if __name__ == "__main__":
    import sys

    for arg in sys.argv[1:]:
        regenerate(arg)
