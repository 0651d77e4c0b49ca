"""glue_text_classification: the HF `Trainer` on Ray Train workers fed by Ray Data."""

from __future__ import annotations

import json

from . import section_run


def results(ns: dict) -> dict:
    """The run's numbers, from the notebook's globals once "What the run showed" has run."""
    from helpers.storage import uri

    watch, eval_log, best = ns["watch"], ns["eval_log"], ns["best_checkpoint"]
    metric = f"eval_{ns['glue_task'].metric}"
    return {
        "losses": ns["losses"],
        "checkpoint_path": uri(best.filesystem, best.path),  # the kept one: the best by the task's metric
        "best_step": ns["best_metrics"]["step"],
        "task": ns["TASK"],
        "eval_split": ns["glue_task"].validation_split,
        "metrics": ns["metrics"],  # the kept checkpoint's, every metric of the task
        "eval_metrics": {e["step"]: e[metric] for e in eval_log},  # the task's metric at each evaluation
        "eval_rows": ns["evaluated_rows"],
        "evaluated_rows": ns["evaluated_rows"],  # equal to validation_rows: the metric is the whole split's
        "validation_rows": ns["validation_rows"],
        "eval_history": _eval_history(eval_log),
        "num_workers": ns["NUM_WORKERS"],
        "worker_node_ids": [r["node_id"] for r in watch.ranks()],
        "attempts": watch.attempts(),
        "kill": None,
        "worker_dies": _worker_dies(ns),
        "mlflow_run_id": watch.mlflow_run_id,
    }


def _eval_history(log_history: list[dict]) -> list[dict]:
    """Each evaluation's `eval_*` numbers, from a `trainer_state.json`'s `log_history`."""
    return [{k: v for k, v in e.items() if k.startswith("eval_")} for e in log_history if "eval_loss" in e]


def _worker_dies(ns: dict) -> dict | None:
    """ "When a worker dies"'s run, with its epochs and its evaluations (read from its latest checkpoint's
    `trainer_state.json`: the restored epoch is evaluated again)."""
    run = section_run(ns, "glue_text_classification")
    if run is None:
        return None
    checkpoint = ns["killed_run"].checkpoint
    with checkpoint.filesystem.open_input_stream(f"{checkpoint.path}/checkpoint/trainer_state.json") as f:
        log_history = json.loads(f.read())["log_history"]
    return {**run, "num_epochs": ns["DEMO_EPOCHS"], "eval_history": _eval_history(log_history)}
