"""Smoke mode: swap the full-scale defaults for a laptop's, and keep whatever the user passed.

Used by the "Smoke mode" cell of every notebook.
"""

from __future__ import annotations

import ast

__all__ = ["smoke_overrides", "papermill_parameters"]


def papermill_parameters() -> set[str]:
    """The names papermill passed (`-p NAME VALUE`) to the notebook running in this kernel.

    papermill injects its values as a cell that starts with `# Parameters`, right after the parameters
    cell; IPython keeps every executed cell's source in `In`. Outside IPython, or without papermill: none.
    """
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        return set()
    names: set[str] = set()
    for source in shell.user_ns.get("In", []) if shell else []:
        if source.lstrip().startswith("# Parameters"):
            tree = ast.parse(source)
            names |= {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets}
    return names


def smoke_overrides(namespace: dict, table: dict[str, tuple]) -> dict:
    """Return the smoke values for the parameters in `table` that are still at their full-scale default.

    `table` maps a parameter's name to `(full-scale default, smoke value)`. A parameter that papermill
    passed (even with the default's value, such as `-p KILL_WORKER_AT_STEP 0`), or whose value in
    `namespace` (the notebook's globals) differs from its default (edited, or set by an environment
    variable such as `STORAGE_PATH`), is kept. Prints what was replaced and what was kept.
    """
    replaced, kept = {}, {}
    passed = papermill_parameters()
    for name, (default, smoke) in table.items():
        current = namespace[name]
        if name not in passed and current == default and type(current) is type(default):
            replaced[name] = smoke
        else:
            kept[name] = current
    width = max(map(len, table), default=0)
    print("Smoke mode replaced the full-scale defaults:")
    for name, value in replaced.items():
        print(f"  {name:<{width}}  {table[name][0]!r} -> {value!r}")
    if kept:
        print("and kept what you passed:")
        for name, value in kept.items():
            print(f"  {name:<{width}}  {value!r}")
    return replaced
