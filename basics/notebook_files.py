"""Reading this project's notebooks as files: every tool that looks into an `.ipynb` (`make plan`, the
Set up tests, the GPU runs, the `# @save` check, the docs' tables, papermill's parameters) reads its cells
here, the same way."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "NOTEBOOKS",
    "Cell",
    "notebook_path",
    "cells",
    "code_cells",
    "parameter_cells",
    "parameter_defaults",
    "title",
]

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@dataclass(frozen=True)
class Cell:
    index: int  # its place among all the notebook's cells
    kind: str  # "code", "markdown" or "raw"
    source: str
    tags: tuple[str, ...] = ()


def notebook_path(notebook: str | Path) -> Path:
    """A notebook's file: `notebook` is a name of `notebooks/` (`llama_fsdp`) or a path."""
    return notebook if isinstance(notebook, Path) else NOTEBOOKS / f"{notebook}.ipynb"


def cells(notebook: str | Path) -> list[Cell]:
    """Every cell of the notebook, in order."""
    with open(notebook_path(notebook), encoding="utf-8") as f:
        raw = json.load(f)["cells"]
    return [
        Cell(i, c["cell_type"], "".join(c["source"]), tuple(c.get("metadata", {}).get("tags", [])))
        for i, c in enumerate(raw)
    ]


def code_cells(notebook: str | Path) -> list[Cell]:
    return [c for c in cells(notebook) if c.kind == "code"]


def parameter_cells(notebook: str | Path) -> tuple[str, list[str]]:
    """The notebook's parameters, as papermill and `make plan` see them: the source of every code cell up to
    the one tagged `parameters` (the lesson's knobs, then the run settings), joined; and the sources of the
    code cells after it (the Set up cells first)."""
    code = code_cells(notebook)
    tagged = next(i for i, c in enumerate(code) if "parameters" in c.tags)
    return "\n\n".join(c.source for c in code[: tagged + 1]), [c.source for c in code[tagged + 1 :]]


def parameter_defaults(notebook: str | Path) -> dict:
    """The notebook's parameters cells, executed here: each upper-case name they assign, with its default (at
    full scale, unless the environment sets SMOKE_TEST; the paths as it sets them). `make plan`, the GPU
    measurements, the docs' tables and the tests start from them."""
    namespace: dict = {}
    exec(parameter_cells(notebook)[0], namespace)  # noqa: S102 - the project's own notebook
    return {name: value for name, value in namespace.items() if name.isupper()}


def title(notebook: str | Path) -> str:
    """The first line of the notebook's first cell, without its Markdown `#`."""
    return cells(notebook)[0].source.splitlines()[0].lstrip("#").strip()
