"""The project's three packages are floors: `basics` at the bottom, `harness` on it, `helpers` on top. No module
imports, at its top or inside a function, a module of a floor above its own, nor one that imports it back
(package front doors, `__init__.py`, included); and no module imports another's private (underscore) names."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("basics", "harness", "helpers")  # the floors, from the bottom up


def _module_name(path: Path, root: Path) -> str:
    """`harness.storage` for harness/storage.py, `harness.notebooks` for harness/notebooks/__init__.py."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, root: Path):
    """(module imported, names imported from it) for each import statement of `path`, relative ones made
    absolute."""
    package = path.relative_to(root).parts[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            for alias in node.names:  # `from . import x` names a module or a name of the package
                yield module, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None


def import_graph(root: Path = ROOT, packages=PACKAGES) -> dict[str, set[str]]:
    """{module: the packages' modules it imports}, from every import statement in them (relative or
    absolute, at module level or in a function), read from the source without importing it. A package's
    front door (`__init__.py`) is a module like any other: importing `helpers.x` runs `helpers/__init__.py`
    first, so a module that imports `helpers.x` imports the front door too."""
    paths = [p for package in packages for p in (root / package).rglob("*.py")]
    modules = {_module_name(p, root) for p in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        name = _module_name(path, root)
        found = set()
        for module, imported in _imports(path, root):
            target = f"{module}.{imported}" if f"{module}.{imported}" in modules else module
            parts = target.split(".")
            found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}  # the front doors on the way
        graph[name] = (found & modules) - {name, *_packages_of(name)}
    return graph


def _packages_of(name: str) -> set[str]:
    """The packages a module sits in (`harness` and `harness.notebooks` for `harness.notebooks.llama_fsdp`):
    a module's own front doors, which Python has run before it."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def upward_imports(graph: dict[str, set[str]], floors=PACKAGES) -> list[str]:
    """`module -> module` for each import of a module on a higher floor than the importer's."""
    floor = {package: i for i, package in enumerate(floors)}
    return [
        f"{name} -> {target}"
        for name, targets in sorted(graph.items())
        for target in sorted(targets)
        if floor[target.split(".")[0]] > floor[name.split(".")[0]]
    ]


def private_imports(root: Path = ROOT, packages=PACKAGES) -> list[str]:
    """`path: module.name` for each underscore name one module imports from another of the packages."""
    found = []
    for folder in (*packages, "tests", "ci", "docs"):
        for path in (root / folder).rglob("*.py"):
            for module, imported in _imports(path, root):
                if module.split(".")[0] in packages and imported and imported.startswith("_"):
                    if not imported.startswith("__"):
                        found.append(f"{path.relative_to(root)}: {module}.{imported}")
    return found


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


def test_the_floors_import_downward_only_and_no_module_imports_itself_back():
    graph = import_graph()
    assert {"basics.validate", "harness.run_log", "harness.notebooks.llama_fsdp", "helpers"} <= set(graph)
    assert "harness.tracking" in graph["harness.run_log"] and "basics.validate" in graph["harness.checks"]
    assert "harness" in graph["harness.checks"] or "harness.cluster" in graph["harness.checks"]
    assert upward_imports(graph) == []
    assert cycles(graph) == []


def test_the_check_sees_an_import_running_up_a_floor(tmp_path):
    for package in ("basics", "helpers"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "basics" / "low.py").write_text("def f():\n    from helpers.top import g\n")
    (tmp_path / "helpers" / "top.py").write_text("from basics.low import f\n")
    graph = import_graph(tmp_path, ("basics", "helpers"))
    assert upward_imports(graph, ("basics", "helpers")) == [
        "basics.low -> helpers",
        "basics.low -> helpers.top",
    ]
    assert cycles(graph)  # and, through the function's import, a circle


def test_every_module_imports_first_in_a_fresh_interpreter():
    # Importing each module first, in a fresh interpreter, finds what the source cannot show: a module
    # half-initialised through an import made at run time.
    import subprocess
    import sys

    names = sorted(import_graph())
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        f"    for loaded in [m for m in sys.modules if m.split('.')[0] in {PACKAGES!r}]:\n"
        "        del sys.modules[loaded]\n"
        "    importlib.import_module(name)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_no_module_imports_another_ones_private_names(tmp_path):
    assert private_imports() == []
    (tmp_path / "helpers").mkdir()
    (tmp_path / "helpers" / "low.py").write_text("def _f():\n    pass\n")
    (tmp_path / "helpers" / "high.py").write_text("from .low import _f\n")
    assert private_imports(tmp_path, ("helpers",)) == ["helpers/high.py: helpers.low._f"]


def test_the_check_sees_a_cycle():
    # The circle the package had (cluster -> tracking -> smoke -> storage -> cluster), and a clean chain.
    circle = {"cluster": {"tracking"}, "tracking": {"smoke"}, "smoke": {"storage"}, "storage": {"cluster"}}
    assert cycles(circle) == [["cluster", "tracking", "smoke", "storage", "cluster"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_reads_imports_inside_functions(tmp_path):
    (tmp_path / "helpers").mkdir()
    (tmp_path / "helpers" / "low.py").write_text("def f():\n    from .high import g\n")
    (tmp_path / "helpers" / "high.py").write_text("from .low import f\nimport helpers.low\n")
    assert import_graph(tmp_path, ("helpers",)) == {
        "helpers.low": {"helpers.high"},
        "helpers.high": {"helpers.low"},
    }
    # A front door that imports its own modules is one more module in the graph.
    (tmp_path / "helpers" / "__init__.py").write_text("from .high import f\n")
    assert import_graph(tmp_path, ("helpers",))["helpers"] == {"helpers.high"}


def test_no_function_is_over_80_lines():
    """No function (or method) of `helpers` or `harness` longer than 80 lines, its docstring left out."""
    long = []
    for path in [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                doc = node.body[0] if node.body else None
                if isinstance(doc, ast.Expr) and isinstance(getattr(doc, "value", None), ast.Constant):
                    lines -= doc.end_lineno - doc.lineno + 1
                if lines > 80:
                    long.append(f"{path.name}:{node.name} ({lines} lines)")
    assert long == [], long


def test_the_layout_file_names_every_folder_and_module():
    """LAYOUT.md says where everything lives: each top-level folder git tracks, each module of `helpers`
    and `harness`, and each notebook module, named there; and each name it gives for them exists."""
    import re
    import subprocess

    layout = (ROOT / "LAYOUT.md").read_text()
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    folders = {path.split("/")[0] for path in tracked.splitlines() if "/" in path}
    assert {"helpers", "harness", "notebooks", "tests", "ci", "docs"} <= folders
    assert [f for f in sorted(folders) if f"`{f}/" not in layout] == []
    modules = [p.stem for package in PACKAGES for p in (ROOT / package).glob("*.py") if p.stem != "__init__"]
    assert [m for m in modules if f"`{m}`" not in layout] == []
    for module in re.findall(r"\(`(\w+)`[,)]|, `(\w+)`", layout):
        name = next(m for m in module if m)
        assert name in modules or (ROOT / "ci" / f"{name}.py").exists(), name
    assert "`harness/notebooks/<name>.py`" in layout and "`NAMES`" in layout
    from harness.notebooks import NAMES  # the notebooks' modules: one for each .ipynb, and no other

    assert NAMES == tuple(sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb")))
