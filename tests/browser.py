"""Headless Chromium for the browser tests (the docs site, make run's summary.html): which one, and how.

Debian's `chromium` (`make test` installs it where it can), driven by Playwright, which never downloads a
browser of its own. Where there is none, the browser tests are skipped with the reason, except in CI.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-proxy-server",  # the tests point proxy variables at a tripwire; a page's own requests stay here
]


def chromium_or_skip() -> str:
    """The Chromium to drive (`CHROMIUM`, default Debian's); without one, skip the test, or fail it in CI."""
    chromium = os.environ.get("CHROMIUM", "/usr/bin/chromium")
    if Path(chromium).exists():
        return chromium
    reason = (
        f"no Chromium at {chromium}: `make test` installs Debian's chromium where it can (as root or with "
        "sudo that asks no password); elsewhere install Chromium and set CHROMIUM=/path/to/it"
    )
    if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
        pytest.fail(f"{reason} (CI={os.environ['CI']}: the browser tests must run)", pytrace=False)
    pytest.skip(reason)
