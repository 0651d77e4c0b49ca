"""CI enforces the same ruff checks as `make lint` (notebooks included)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["helpers", "tests", "ci", "notebooks"]


def test_ruff_check_and_format():
    ruff = [sys.executable, "-m", "ruff"]
    check = subprocess.run([*ruff, "check", *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
    fmt = subprocess.run([*ruff, "format", "--check", *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert fmt.returncode == 0, fmt.stdout
