"""gpt2_deepspeed: DeepSpeed ZeRO stages 1-3 in Ray Train workers, sharded checkpoints, resuming."""

from __future__ import annotations

from . import section_run


def results(ns: dict) -> dict:
    """The run's numbers, from the notebook's globals once "What the run showed" has run."""
    from helpers.storage import uri

    watch, result, resumed, losses = ns["watch"], ns["result"], ns["resumed"], ns["losses"]
    ranks = watch.ranks()  # what each worker measured at its first step
    history = result.metrics_dataframe.sort_values("epoch")  # a row per epoch: its step and held-out loss
    return {
        "losses": losses,
        "eval_losses": {int(s): float(v) for s, v in zip(history["step"], history["eval_loss"], strict=True)},
        "eval_rows": int(history["eval_rows"].iat[0]),
        "checkpoint_path": uri(result.checkpoint.filesystem, result.checkpoint.path),
        "final_loss": losses[-1],
        "zero_stage": ns["ZERO_STAGE"],
        "offload": ns["OFFLOAD"],
        "state_bytes": [r["state_bytes"] for r in ranks],
        "plan": ns["plan"].as_dict(),
        "partition_fraction": [r["partition_fraction"] for r in ranks],
        "resumed_start_epoch": ns["resumed_start_epoch"],
        "resumed_losses": ns["resumed_losses"],
        "resumed_checkpoint_path": uri(resumed.checkpoint.filesystem, resumed.checkpoint.path),
        "worker_node_ids": [r["node_id"] for r in ranks],
        "kill": None,
        "worker_dies": section_run(ns, "gpt2_deepspeed"),
        "mlflow_run_id": watch.mlflow_run_id,
    }
