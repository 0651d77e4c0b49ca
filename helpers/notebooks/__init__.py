"""One module per notebook: what the suite must know of it beyond its `.ipynb`.

Today each module holds `results(ns)`: the numbers its run reports for batch jobs, `make run` and the tests,
read from the notebook's globals (`ns`) once it has run. `helpers.save_results` calls it.
"""

from __future__ import annotations

import importlib

__all__ = ["collect", "worker_dies"]


def collect(notebook: str, ns: dict) -> dict:
    """`notebook`'s results from its globals: the keys every notebook promises, then its own."""
    from ..smoke import parameter_values

    module = importlib.import_module(f"{__name__}.{notebook}")
    return {
        "notebook": notebook,
        "smoke_test": bool(ns["SMOKE_TEST"]),
        "parameters": parameter_values(ns),
        **module.results(ns),
    }


def worker_dies(
    ns: dict, notebook: str, watch: str = "kill_watch", result: str = "killed_run"
) -> dict | None:
    """The "When a worker dies" section's own run, as results (None where the section did not train: its
    `KILL_WORKER_AT_STEP` was 0): its losses, worker groups, the kill and where it resumed, its checkpoint and
    MLflow run. The keys are those of a notebook's results, so the same checks read both."""
    from ..smoke import parameter_values
    from ..storage import uri

    if watch not in ns or result not in ns:
        return None
    kill_watch, run = ns[watch], ns[result]
    ranks = kill_watch.ranks()
    return {
        "notebook": notebook,
        "smoke_test": bool(ns["SMOKE_TEST"]),
        "parameters": parameter_values(ns),
        "losses": kill_watch.losses(),
        "attempts": kill_watch.attempts(),
        "kill": kill_watch.kill_summary(),
        "checkpoint_path": uri(run.checkpoint.filesystem, run.checkpoint.path),
        "worker_node_ids": [r["node_id"] for r in ranks],
        "train_seconds": kill_watch.seconds,
        "mlflow_run_id": kill_watch.mlflow_run_id,
    }
