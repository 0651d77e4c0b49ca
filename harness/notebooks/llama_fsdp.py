"""llama_fsdp: the Hugging Face Llama 2 70B FSDP recipe on FSDP2 in Ray Train."""

from __future__ import annotations

from . import held_out_results, section_run


def results(ns: dict) -> dict:
    """The run's numbers, from the notebook's globals once "What the run showed" has run."""
    from helpers.storage import uri

    watch, ranks, attempts, losses = ns["watch"], ns["ranks"], ns["attempts"], ns["losses"]
    fs, checkpoint_path = ns["fs"], ns["checkpoint_path"]
    return {
        "losses": losses,
        **held_out_results(ns),
        "checkpoint_path": uri(fs, checkpoint_path),
        "final_loss": losses[-1],
        "load_peak_rss_mb": [r["load"]["peak_growth_mb"] for r in ranks],
        "param_shard_fraction": [r["shard_fraction"] for r in ranks],
        "worker_node_ids": [r["node_id"] for r in ranks],
        "worker_threads": [r["threads"] for r in ranks],
        "sharded_checkpoint_path": uri(fs, f"{checkpoint_path}/sharded"),
        "consolidated_path": uri(fs, f"{checkpoint_path}/consolidated"),
        "num_params": ns["num_params"],
        "tokens_per_second": ns["tokens_per_second"],
        "mfu": ns["mfu"],
        "generated": ns["generated"],
        "attn_implementation": ranks[0]["attn"],
        "pretrained_loads": sum(a["ranks"][0]["pretrained"] for a in attempts if a["ranks"]),
        "state_bytes": [r["state_bytes"] for r in ranks],
        "plan": ns["plan"].as_dict(),
        "attempts": attempts,
        "kill": None,
        # "Going further: when a worker or a node is lost": its own run, where it trained (else None)
        "elastic": section_run(ns, "llama_fsdp", "elastic_watch", "elastic_run"),
        "train_seconds": ns["train_seconds"],
        "mlflow_run_id": watch.mlflow_run_id,
    }
