"""Every committed notebook: valid nbformat, no outputs, a `parameters` cell with the shared switches."""

from __future__ import annotations

import ast
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_valid_and_output_free(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    for cell in nb.cells:
        assert cell.get("id"), "every cell has an id"
        if cell.cell_type == "code":
            assert cell.outputs == [], f"committed with outputs: {cell.source[:60]!r}"
            assert cell.execution_count is None, f"committed with an execution count: {cell.source[:60]!r}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_first_code_cell_is_the_parameters_cell(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "parameters" in code[0].metadata.get("tags", [])
    assert not any("parameters" in c.metadata.get("tags", []) for c in code[1:])
    tree = ast.parse(code[0].source)
    names = [t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets]
    assert {"SMOKE_TEST", "RESULTS_PATH", "NUM_WORKERS", "USE_GPU", "STORAGE_PATH"} <= set(names)
    assert all(name.isupper() for name in names), names
    lines = code[0].source.splitlines()
    for name in names:
        line = next(ln for ln in lines if ln.startswith(f"{name} ="))
        assert "#" in line, f"{name} needs a comment on its trade-off"
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
    assert any("if SMOKE_TEST:" in c.source for c in code), "smoke mode is one visible cell"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_papermill_sees_every_parameter(path):
    # papermill skips lines it cannot parse (e.g. a second "=") and then calls `-p SMOKE_TEST True`
    # an "unknown parameter": a batch-job author would think the switch did nothing.
    import papermill

    nb = nbformat.read(path, as_version=4)
    tree = ast.parse(next(c for c in nb.cells if c.cell_type == "code").source)
    names = [t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets]
    assert list(papermill.inspect_notebook(str(path))) == names
