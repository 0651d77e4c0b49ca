"""`helpers` is layered: no module imports, at its top or inside a function, one that imports it back."""

from __future__ import annotations

import ast
from pathlib import Path

HELPERS = Path(__file__).resolve().parents[1] / "helpers"


def import_graph(package: Path = HELPERS) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, from every import statement in it (relative or
    `helpers.x`, at module level or in a function), read from the source without importing it."""
    modules = {p.stem for p in package.glob("*.py")} | {
        p.name for p in package.iterdir() if (p / "__init__.py").exists()
    }
    graph: dict[str, set[str]] = {}
    for path in package.glob("*.py"):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1 and node.module:  # from .x import y
                    found.add(node.module.split(".")[0])
                elif node.level == 1:  # from . import x, y
                    found.update(a.name for a in node.names)
                elif node.level == 0 and (node.module or "").startswith("helpers."):
                    found.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("helpers."))
        graph[path.stem] = (found & modules) - {path.stem}
    graph.pop("__init__", None)  # the package's front door imports everything; nothing imports it back
    return {name: deps - {"__init__"} for name, deps in graph.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle, each once, as the list of modules around it."""
    found, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            cycle = path[path.index(node) :]
            key = frozenset(cycle)
            if key not in done:
                done.add(key)
                found.append([*cycle, node])
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, [*path, node])

    for start in sorted(graph):
        visit(start, [])
    return found


def test_helpers_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_check_sees_a_cycle():
    # The circle the package had (cluster -> tracking -> smoke -> storage -> cluster), and a clean chain.
    circle = {"cluster": {"tracking"}, "tracking": {"smoke"}, "smoke": {"storage"}, "storage": {"cluster"}}
    assert cycles(circle) == [["cluster", "tracking", "smoke", "storage", "cluster"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_reads_imports_inside_functions(tmp_path):
    (tmp_path / "low.py").write_text("def f():\n    from .high import g\n")
    (tmp_path / "high.py").write_text("from .low import f\nimport helpers.low\n")
    assert import_graph(tmp_path) == {"low": {"high"}, "high": {"low"}}


def test_no_helpers_function_is_over_80_lines():
    """`helpers` stays thin: no function (or method) longer than 80 lines, its docstring left out."""
    long = []
    for path in HELPERS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                doc = node.body[0] if node.body else None
                if isinstance(doc, ast.Expr) and isinstance(getattr(doc, "value", None), ast.Constant):
                    lines -= doc.end_lineno - doc.lineno + 1
                if lines > 80:
                    long.append(f"{path.name}:{node.name} ({lines} lines)")
    assert long == [], long
