"""dolly_lightning_fsdp: Lightning's FSDP strategy on Ray Train, and what a 7B run costs."""

from __future__ import annotations

from . import section_run


def results(ns: dict) -> dict:
    """The run's numbers, from the notebook's globals once "What the run showed" has run."""
    from helpers.storage import uri

    watch, result, losses = ns["watch"], ns["result"], ns["losses"]
    ranks = watch.ranks()
    workers = ns["NUM_WORKERS"]
    return {
        "losses": losses,
        "eval_losses": ns["held_out"],  # step -> the held-out lines' mean loss
        "eval_rows": ns["eval_lines"] // workers * workers,  # Ray Train splits them evenly: the rest wait
        "checkpoint_path": uri(result.checkpoint.filesystem, result.checkpoint.path),
        "final_loss": losses[-1],
        "param_shard_fraction": [r["param_shard_fraction"] for r in ranks],
        "param_dtypes": ranks[0]["param_dtypes"],
        "state_bytes": [r["state_bytes"] for r in ranks],
        "plan": ns["plan"].as_dict(),
        "worker_node_ids": [r["node_id"] for r in ranks],
        "attempts": watch.attempts(),
        "kill": None,
        "worker_dies": section_run(ns, "dolly_lightning_fsdp"),
        "generated": ns["generated"],
        "train_seconds": ns["train_seconds"],
        "cost_usd": ns["this_cost"],
        "mlflow_run_id": watch.mlflow_run_id,
    }
