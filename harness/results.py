"""The JSON a notebook writes at its end when `RESULTS_PATH` is set; `make run` and the tests read it.

Used by the results cell (the last) of every notebook.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from harness.parameters import found_record, record

__all__ = ["REQUIRED_KEYS", "start_clock", "elapsed", "write_results"]

REQUIRED_KEYS = ("notebook", "smoke_test", "wall_seconds", "losses", "checkpoint_path", "mlflow_run_id")


def start_clock(namespace: dict, notebook: str = "") -> None:
    """Start the run's wall clock (the Set up cell does), in the notebook's run record (`namespace`, its
    globals; `harness.parameters.record`)."""
    run = record(namespace)
    run.started, run.notebook = time.perf_counter(), notebook or run.notebook


def elapsed(namespace: dict) -> float:
    """Seconds since the Set up cell started the run's clock in `namespace` (0.0 where it did not)."""
    found = found_record(namespace)
    return found.seconds() if found else 0.0


def _is_folder(path: str) -> bool:
    from harness.storage import is_uri

    if not is_uri(path):
        return Path(path).is_dir()
    import pyarrow.fs as pafs

    fs, fs_path = pafs.FileSystem.from_uri(path)
    return fs.get_file_info(pafs.FileSelector(fs_path, allow_not_found=True)) != []


def write_results(path: str, **results) -> dict | None:
    """Write `results` as JSON to `path` (nothing when `path` is empty); return what was written.

    `wall_seconds`: the seconds since the Set up cell (`elapsed(globals())`). Checks the keys every
    notebook promises (`REQUIRED_KEYS`), that the losses are finite
    numbers and that `checkpoint_path` (a folder, or a URI such as `s3://bucket/...`) exists, so a
    broken run cannot write a results file that looks fine.

    With `mlflow_run_id`, it then ends that MLflow run, path or not: the results' numbers, the checkpoint's
    URI and the kill go into the run, and the run is marked finished (`harness.tracking.finish_run`); the
    results then say where the run is (`mlflow`: tracking URI, experiment, the run's page on a server).
    The file is written first: a tracking server that does not answer (within about 20 s) costs the run
    its summary in MLflow, with one line saying so, never its results.
    """
    written = _write(path, results) if path else None
    if results.get("mlflow_run_id"):
        ended = _end_mlflow_run(results, path)
        if "mlflow" not in ended:
            return written
        results = ended
        if path:
            _dump(path, results)
    return results if path else None


def _end_mlflow_run(results: dict, path: str) -> dict:
    """`results` with `mlflow` (where the run is) once its MLflow run is ended with them; as they were, with
    one line printed, where the tracking server does not answer in time."""
    from harness.tracking import best_effort, finish_run

    where = best_effort(
        lambda: finish_run(results["mlflow_run_id"], results),
        lambda uri, error: (
            f"MLflow: the run's summary was not recorded at {uri} ({error}); "
            f"the results are in {path or 'this notebook'}."
        ),
    )
    return results if where is None else {**results, "mlflow": where}


def _write(path: str, results: dict) -> dict:
    """Check the results (see `write_results`) and write them to `path`."""
    missing = [k for k in REQUIRED_KEYS if k not in results]
    if missing:
        raise KeyError(f"results are missing {missing}")
    losses = [float(x) for x in results["losses"]]
    if not losses or not all(math.isfinite(x) for x in losses):
        raise ValueError(f"losses must be a non-empty list of finite numbers, got {losses[:5]}...")
    if not _is_folder(results["checkpoint_path"]):
        raise FileNotFoundError(f"checkpoint_path {results['checkpoint_path']!r} is not a folder")
    return _dump(path, results)


def _dump(path: str, results: dict) -> dict:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2, default=float)
    return results
