"""llama_lora: the llama_fsdp recipe with LoRA adapters over a frozen base."""

from __future__ import annotations

from . import held_out_results, section_run


def results(ns: dict) -> dict:
    """The run's numbers, from the notebook's globals once "What the run showed" has run."""
    from helpers.storage import uri

    watch, ranks, attempts, losses = ns["watch"], ns["ranks"], ns["attempts"], ns["losses"]
    fs, checkpoint_path = ns["fs"], ns["checkpoint_path"]
    merged = uri(fs, f"{checkpoint_path}/consolidated") if ns["LORA_MERGED"] else None
    return {
        "losses": losses,
        **held_out_results(ns),
        "final_loss": losses[-1],
        "checkpoint_path": uri(fs, checkpoint_path),
        "consolidated_path": uri(fs, f"{checkpoint_path}/adapter"),  # the adapter folder
        "merged_path": merged,
        "load_peak_rss_mb": [r["load"]["peak_growth_mb"] for r in ranks],
        "worker_node_ids": [r["node_id"] for r in ranks],
        "num_params": ns["num_params"],
        "trainable_params": ns["trainable"],
        "frozen_tensors_changed": ns["last"].get("frozen_tensors_changed"),
        "pretrained_loads": sum(1 for a in attempts if a["ranks"]),  # every attempt reads the base
        "state_bytes": [r["state_bytes"] for r in ranks],
        "plan": ns["plan"].as_dict(),
        "generated": ns["generated"],
        "attempts": attempts,
        "kill": None,
        "worker_dies": section_run(ns, "llama_lora"),
        "train_seconds": ns["train_seconds"],
        "mlflow_run_id": watch.mlflow_run_id,
    }
