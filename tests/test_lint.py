"""CI enforces what the pre-commit hooks check (.pre-commit-config.yaml), with the same tools and versions.

pre-commit itself fetches its hooks from GitHub, which CI cannot reach; the tools are installed from
requirements.txt instead, and a test keeps the config's revs equal to the installed versions.
"""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["helpers", "harness", "tests", "ci", "notebooks", "docs/conf.py"]
BIN = Path(sys.executable).parent


def _hooks() -> dict[str, dict]:
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    return {hook["id"]: {**hook, "rev": repo["rev"]} for repo in config["repos"] for hook in repo["hooks"]}


def _project_files() -> list[str]:
    """Committed files and new ones git does not ignore: what a commit could add."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return [f for f in out.stdout.splitlines() if (ROOT / f).is_file() and not (ROOT / f).is_symlink()]


def test_pre_commit_hooks_pin_the_versions_ci_runs():
    hooks = _hooks()
    assert {
        "ruff-check",
        "ruff-format",
        "nbstripout",
        "check-added-large-files",
        "detect-private-key",
    } <= set(hooks)
    assert hooks["ruff-check"]["rev"] == f"v{importlib.metadata.version('ruff')}"
    assert "jupyter" in hooks["ruff-check"]["types_or"] and "jupyter" in hooks["ruff-format"]["types_or"]
    assert hooks["nbstripout"]["rev"] == importlib.metadata.version("nbstripout")
    assert hooks["detect-private-key"]["rev"] == f"v{importlib.metadata.version('pre-commit-hooks')}"


def test_ruff_check_and_format():
    ruff = [sys.executable, "-m", "ruff"]
    check = subprocess.run([*ruff, "check", *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
    fmt = subprocess.run([*ruff, "format", "--check", *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert fmt.returncode == 0, fmt.stdout


def test_notebooks_are_stripped_as_the_hook_would():
    notebooks = sorted(str(p) for p in (ROOT / "notebooks").glob("*.ipynb"))
    proc = subprocess.run(
        [str(BIN / "nbstripout"), *_hooks()["nbstripout"]["args"], "--verify", *notebooks],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_large_files_and_no_private_keys():
    files = _project_files()
    assert "helpers/__init__.py" in files and "Makefile" in files
    large = subprocess.run(
        [str(BIN / "check-added-large-files"), "--enforce-all", *_hooks()["check-added-large-files"]["args"]]
        + files,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert large.returncode == 0, large.stdout + large.stderr
    keys = subprocess.run([str(BIN / "detect-private-key"), *files], cwd=ROOT, capture_output=True, text=True)
    assert keys.returncode == 0, keys.stdout + keys.stderr


def _listed(requirements: Path) -> list[str]:
    """The requirement lines of a requirements file, with those of the files it includes (`-r`)."""
    lines = [line.split("#")[0].strip() for line in requirements.read_text().splitlines()]
    return [
        req
        for line in lines
        if line
        for req in (_listed(requirements.parent / line[3:].strip()) if line.startswith("-r ") else [line])
    ]


def _installs(requirements: Path) -> set[str]:
    """The distributions `pip install -r requirements` brings, read from the installed packages' own
    metadata (their requirements and extras, for this Python and platform). One the Makefile uninstalls
    again (rfc3987-syntax) counts, without its own requirements."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    todo = [Requirement(line) for line in _listed(requirements)]
    seen: dict[str, set[str]] = {}
    while todo:
        req = todo.pop()
        name, extras = canonicalize_name(req.name), set(req.extras)
        if name in seen and extras <= seen[name]:
            continue
        seen[name] = seen.get(name, set()) | extras
        try:
            requires = importlib.metadata.requires(req.name) or []
        except importlib.metadata.PackageNotFoundError:
            requires = []
        for dep in map(Requirement, requires):
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in seen[name] | {""}):
                todo.append(dep)
    return set(seen)


def test_the_notebooks_requirements_bring_no_test_docs_or_lint_tools():
    # A learner's `pip install -r requirements.txt` (a workspace, a cluster's nodes) gets what the notebooks
    # run on; the local cluster's S3 server, the tests, the lint tools and the docs site are layers above it.
    notebooks = _installs(ROOT / "requirements.txt")
    assert {"ray", "torch", "deepspeed", "lightning", "peft", "mlflow", "papermill", "boto3"} <= notebooks
    tools = {"sphinx", "playwright", "moto", "ruff", "pre-commit", "pytest", "nbval", "myst-nb"}
    assert not notebooks & tools, notebooks & tools
    assert tools - {"sphinx", "myst-nb"} <= _installs(ROOT / "requirements-dev.txt")
    assert {"sphinx", "myst-nb"} <= _installs(ROOT / "requirements-docs.txt")


def test_no_code_edits_sys_path():
    # Packages import as packages (`helpers`, `harness` installed; `ci` run with `python -m ci.<name>` from
    # the root); a file that edits sys.path to reach another one hides where its code comes from.
    import ast

    def edits(tree) -> list[int]:
        found = []
        for node in ast.walk(tree):
            target = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                target = node.func.value  # sys.path.insert(...), .append, .remove, ...
            elif isinstance(node, ast.Assign | ast.AugAssign):
                target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                target = target.value if isinstance(target, ast.Subscript) else target  # sys.path[:0] = ...
            if isinstance(target, ast.Attribute) and target.attr == "path":
                if isinstance(target.value, ast.Name) and target.value.id == "sys":
                    found.append(node.lineno)
        return sorted(found)

    assert edits(ast.parse("import sys\nsys.path.insert(0, 'x')\nsys.path[:0] = ['y']\n")) == [2, 3]
    code = [f for f in _project_files() if f.endswith(".py")]
    found = {f: lines for f in code if (lines := edits(ast.parse((ROOT / f).read_text())))}
    assert found == {}, found


def test_the_contributors_page_is_short_and_the_measurements_are_data():
    # docs/testing.md is what a contributor reads; what was measured, when and where is a data file.
    import csv

    words = len((ROOT / "docs" / "testing.md").read_text().split())
    assert words <= 1500, words
    with open(ROOT / "docs" / "measured_times.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["what", "measured", "notes"] and len(rows) > 40
    assert all(len(row) == 3 and row[0] and row[1] for row in rows[1:])
