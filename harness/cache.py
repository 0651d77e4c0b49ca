"""Where smoke mode keeps what it builds locally: tiny models, fixture data, Ray results.

Used by every notebook's "Set up" cell, in smoke mode (through `harness.tiny_models` and `harness.fixtures`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from filelock import FileLock

__all__ = ["cache_dir", "local_storage"]

# Bump when a generator changes, so stale builds are never reused.
CACHE_VERSION = "v1"


def cache_dir() -> Path:
    """The suite's cache folder: `$LLM_NOTEBOOKS_CACHE`, else `~/.cache/ray-llm-notebooks`."""
    root = os.environ.get("LLM_NOTEBOOKS_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "ray-llm-notebooks"
    )
    path = Path(root) / CACHE_VERSION
    path.mkdir(parents=True, exist_ok=True)
    return path


def local_storage() -> str:
    """Smoke mode's `STORAGE_PATH`: a folder in this cache, where Ray Train writes the checkpoints."""
    return str(cache_dir() / "ray_results")


@contextlib.contextmanager
def _lock(target: Path) -> Iterator[None]:
    with FileLock(str(target) + ".lock"):
        yield


def build_once(name: str, build: Callable[[Path], None]) -> Path:
    """Return `cache_dir()/name`, calling `build(tmp_dir)` first if it does not exist yet.

    The folder appears atomically (built in a temporary folder, then renamed), so an
    interrupted build never leaves a half-written model or fixture behind, and two
    processes asking at once build it only once.
    """
    target = cache_dir() / name
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _lock(target):
        if target.is_dir():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            build(tmp)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
