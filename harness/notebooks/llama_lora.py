"""llama_lora: the llama_fsdp recipe with LoRA adapters over a frozen base."""

from __future__ import annotations

from helpers.validate import check_choice, check_int, check_positive

from . import held_out_results, run_settings, section_run
from .llama_fsdp import check_llama, plan_recipe, smoke_common, tiny_llama

ELASTIC_REFUSED = None  # as llama_fsdp's
__all__ = ["check", "plan_recipe", "smoke", "results", "ELASTIC_REFUSED"]

# Its smoke run's time budget in the tests (nbval, JupyterLab): see tests/notebook_runs.py.
SMOKE_BUDGET_S = 450  # the LoRA papermill run's budget (tests/test_llama_lora.py)


def check(p: dict) -> None:
    """The parameters cell's values `p`, by this notebook's rules; a ParameterError names the first bad one."""
    check_int("LORA_RANK", p["LORA_RANK"], minimum=1)
    check_positive("LORA_ALPHA", p["LORA_ALPHA"])
    check_choice("LORA_MERGED", p["LORA_MERGED"], [True, False])
    # "When a worker dies" trains a run of its own, KILL_WORKER_AT_STEP + 1 steps: any step will do.
    check_llama(p, kill_steps=None)


def smoke(namespace: dict) -> dict:
    """Smoke mode's table: `{parameter: (the full-scale default, the laptop value)}`."""
    return {
        # llama_fsdp's 13M-parameter model: rank-4 adapters are about 1 % of it, as rank 16 is 0.3 % of 70B.
        "MODEL_NAME": ("meta-llama/Llama-2-70b-chat-hf", tiny_llama(512, 1408, 8)),
        **smoke_common(),
        "LORA_RANK": (16, 4),
        "MAX_STEPS": (500, 12),
        "SAVE_STEPS": (250, 4),
        "EVAL_STEPS": (100, 4),  # the held-out loss at steps 4, 8 and 12
        "NUM_WORKERS": (8, 2),
        "CPUS_PER_WORKER": (10, 1),
        **run_settings(7),  # after the checkpoint at step 4
    }


def results(ns: dict) -> dict:
    """The run's numbers, from the notebook's globals once "What the run showed" has run."""
    from harness.storage import uri

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
