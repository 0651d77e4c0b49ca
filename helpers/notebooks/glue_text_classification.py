"""glue_text_classification: the HF `Trainer` on Ray Train workers fed by Ray Data."""

from __future__ import annotations

from . import worker_dies


def results(ns: dict) -> dict:
    """The run's numbers, from the notebook's globals once "What the run showed" has run."""
    from ..storage import uri

    watch, eval_log, best = ns["watch"], ns["eval_log"], ns["best_checkpoint"]
    return {
        "losses": ns["losses"],
        "checkpoint_path": uri(best.filesystem, best.path),
        "task": ns["TASK"],
        "eval_split": ns["glue_task"].validation_split,
        "eval_metrics": ns["eval_metrics"],
        "evaluated_rows": ns["evaluated_rows"],  # equal to validation_rows: the metric is the whole split's
        "validation_rows": ns["validation_rows"],
        "eval_history": [{k: v for k, v in entry.items() if k.startswith("eval_")} for entry in eval_log],
        "num_workers": ns["NUM_WORKERS"],
        "worker_node_ids": [r["node_id"] for r in watch.ranks()],
        "attempts": watch.attempts(),
        "kill": None,
        "worker_dies": worker_dies(ns, "glue_text_classification"),
        "mlflow_run_id": watch.mlflow_run_id,
    }
