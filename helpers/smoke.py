"""Smoke mode: swap the full-scale defaults for a laptop's, and keep whatever the user passed.

Used by the "Smoke mode" cell of every notebook.
"""

from __future__ import annotations

__all__ = ["smoke_overrides"]


def smoke_overrides(namespace: dict, table: dict[str, tuple]) -> dict:
    """Return the smoke values for the parameters in `table` that are still at their full-scale default.

    `table` maps a parameter's name to `(full-scale default, smoke value)`. A parameter whose value in
    `namespace` (the notebook's globals) differs from its default was passed by the user (papermill
    `-p`, or an environment variable such as `STORAGE_PATH`) and is kept. Prints what was replaced
    and what was kept, as a short table.
    """
    replaced, kept = {}, {}
    for name, (default, smoke) in table.items():
        current = namespace[name]
        if current == default and type(current) is type(default):
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
