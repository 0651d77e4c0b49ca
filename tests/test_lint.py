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
PATHS = ["helpers", "tests", "ci", "notebooks", "docs/conf.py"]
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
