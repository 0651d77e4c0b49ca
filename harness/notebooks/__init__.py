"""One module per notebook: what the suite must know of it beyond its `.ipynb`.

Today each module holds `results(ns)`: the numbers its run reports for batch jobs, `make run` and the tests,
read from the notebook's globals (`ns`) once it has run. `helpers.save_results` calls it.
"""

from __future__ import annotations

import importlib

__all__ = ["collect", "section_run", "held_out_results"]


def collect(notebook: str, ns: dict) -> dict:
    """`notebook`'s results from its globals: the keys every notebook promises, then its own."""
    from helpers.smoke import parameter_values

    module = importlib.import_module(f"{__name__}.{notebook}")
    return {
        "notebook": notebook,
        "smoke_test": bool(ns["SMOKE_TEST"]),
        "parameters": parameter_values(ns),
        **module.results(ns),
    }


def held_out_results(ns: dict) -> dict:
    """The Llama notebooks' held-out evaluations, from their watch: the loss and the seconds by step, and
    how many packed sequences each scored (an equal share per worker: the rest wait)."""
    evaluations = ns["watch"].evaluations()  # step -> eval_loss, eval_seconds
    return {
        "eval_losses": {step: e["eval_loss"] for step, e in evaluations.items()},
        "eval_seconds": {step: e["eval_seconds"] for step, e in evaluations.items()},
        "eval_rows": len(ns["eval_packed"]) // ns["NUM_WORKERS"] * ns["NUM_WORKERS"],
    }


def section_run(
    ns: dict, notebook: str, watch: str = "kill_watch", result: str = "killed_run"
) -> dict | None:
    """A "going further" section's own run, from its watch and its `Result` (the notebook's globals named
    `watch` and `result`: "When a worker dies"'s by default), as results; None where the section did not
    train. Its losses, worker groups, the kill and where it resumed, its checkpoint and MLflow run: the keys
    of a notebook's results, so the same checks read both."""
    from helpers.smoke import parameter_values
    from helpers.storage import uri

    if watch not in ns or result not in ns:
        return None
    section_watch, run = ns[watch], ns[result]
    ranks = section_watch.ranks()
    return {
        "notebook": notebook,
        "smoke_test": bool(ns["SMOKE_TEST"]),
        "parameters": parameter_values(ns),
        "losses": section_watch.losses(),
        "attempts": section_watch.attempts(),
        "kill": section_watch.kill_summary(),
        "checkpoint_path": uri(run.checkpoint.filesystem, run.checkpoint.path),
        "worker_node_ids": [r["node_id"] for r in ranks],
        "train_seconds": section_watch.seconds,
        "mlflow_run_id": section_watch.mlflow_run_id,
    }
