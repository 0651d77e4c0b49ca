"""Generate helpers/llama_recipe.py from the functions of notebooks/llama_fsdp.ipynb marked `# @save`.

d2l's way of keeping one copy: the notebook's cell is the source, and the module is generated from it, so
`llama_lora` imports what it shares with `llama_fsdp` instead of repeating it. After editing a marked
function in the notebook: `.venv/bin/python ci/llama_recipe.py`. tests/test_llama_helpers.py fails when the
module and the notebook differ (`render()` against the file).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "llama_fsdp.ipynb"
MODULE = ROOT / "helpers" / "llama_recipe.py"
MARK = "# @save"

HEADER = '''"""The Llama recipe's steps that `llama_lora` shares with `llama_fsdp`: generated from `llama_fsdp`'s cells
marked `# @save` by ci/llama_recipe.py. Do not edit here: edit the notebook, then run that script
(tests/test_llama_helpers.py fails when the two differ). Each function's explanation is in the section of
`llama_fsdp` named above it.
"""

from __future__ import annotations

import ray.train
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import helpers

'''


def marked_functions(notebook: Path = NOTEBOOK) -> list[tuple[str, str, str]]:
    """(name, source, the notebook section it is in) of every function whose `def` follows a `# @save` line."""
    from basics.notebook_files import cells

    found, section = [], ""
    for cell in cells(notebook):
        if cell.kind == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("## "):
                    section = line.removeprefix("## ").strip()
            continue
        lines = cell.source.splitlines()
        tree = ast.parse(cell.source)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and lines[node.lineno - 2].startswith(MARK):
                found.append((node.name, ast.get_source_segment(cell.source, node), section))
    return found


def render(notebook: Path = NOTEBOOK) -> str:
    """The module's text, from the notebook's marked functions."""
    functions = marked_functions(notebook)
    names = "".join(f'    "{name}",\n' for name, _, _ in functions)
    parts = [HEADER + f"__all__ = [\n{names}]\n"]
    for _, source, section in functions:
        parts.append(f"\n\n# llama_fsdp, {section}\n{source}\n")
    return "".join(parts)


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if MODULE.read_text() != text:
            print(f"{MODULE.relative_to(ROOT)} differs from the notebook: run ci/llama_recipe.py")
            return 1
        return 0
    MODULE.write_text(text)
    print(f"wrote {MODULE.relative_to(ROOT)}: {len(marked_functions())} functions")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
