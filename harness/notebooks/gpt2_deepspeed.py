"""gpt2_deepspeed: DeepSpeed ZeRO stages 1-3 in Ray Train workers, sharded checkpoints, resuming."""

from __future__ import annotations

import re

from helpers.plan import Recipe
from helpers.validate import ParameterError, check_choice, check_int

from . import check_common, run_settings, section_run

# "When a worker dies" trains 2 epochs of 4 steps (its cell's `kill_epochs, kill_steps_per_epoch`).
KILL_RUN_STEPS = 2 * 4

ELASTIC_REFUSED = (
    "DeepSpeed ZeRO checkpoints hold one partition per rank and load only at the world "
    "size that wrote them (DeepSpeed's universal checkpoint format, converted offline, would lift that)"
)

# Its smoke run's time budget in the tests (nbval, JupyterLab): see tests/notebook_runs.py.
SMOKE_BUDGET_S = 400


def check(p: dict) -> None:
    """The parameters cell's values `p`, by this notebook's rules; a ParameterError names the first bad one."""
    check_int("NUM_EPOCHS", p["NUM_EPOCHS"], minimum=1)
    check_int("MAX_STEPS_PER_EPOCH", p["MAX_STEPS_PER_EPOCH"], minimum=1)
    check_int("MAX_SEQ_LEN", p["MAX_SEQ_LEN"], minimum=8)
    check_choice("ZERO_STAGE", p["ZERO_STAGE"], [0, 1, 2, 3])
    check_choice("OFFLOAD", p["OFFLOAD"], ["none", "optimizer", "optimizer+params"])
    if p["OFFLOAD"] != "none" and p["ZERO_STAGE"] == 0:
        raise ParameterError(f"OFFLOAD={p['OFFLOAD']!r} needs ZERO_STAGE 1, 2 or 3: offload is part of ZeRO.")
    if p["OFFLOAD"] == "optimizer+params" and p["ZERO_STAGE"] != 3:
        raise ParameterError(
            f"OFFLOAD='optimizer+params' needs ZERO_STAGE=3 (only stage 3 partitions the parameters); "
            f"ZERO_STAGE={p['ZERO_STAGE']} can offload 'optimizer'."
        )
    check_choice("PRECISION", p["PRECISION"], ["bf16", "fp16", "fp32"])
    # It names the run's folder under STORAGE_PATH: a name, never a path out of it.
    if not isinstance(p["EXPERIMENT_PREFIX"], str) or not re.fullmatch(
        r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", p["EXPERIMENT_PREFIX"]
    ):
        raise ParameterError(
            f"EXPERIMENT_PREFIX={p['EXPERIMENT_PREFIX']!r}: must be a name of letters, digits, '_', '.' or '-' "
            "(at most 64, no '/'), e.g. 'deepspeed_sample'."
        )
    if p["PRECISION"] == "fp16" and not p["USE_GPU"]:
        # DeepSpeed's CPU accelerator supports fp16 only with special builds; bf16 works everywhere.
        raise ParameterError("PRECISION='fp16' needs USE_GPU=True; on CPU use PRECISION='bf16' or 'fp32'.")
    check_common(p, KILL_RUN_STEPS)  # KILL_WORKER_AT_STEP: a step of "When a worker dies"'s own run


def plan_recipe(p: dict) -> Recipe:
    """The recipe as `helpers.plan.plan_training` sees it, for the parameters `p`."""
    return Recipe(
        activation_checkpointing=False,
        sharding=f"zero{p['ZERO_STAGE']}",
        gather_bytes=2,
        offload=p["OFFLOAD"],
        loading="every rank",  # every worker calls from_pretrained
        checkpoint="staged",  # DeepSpeed writes each rank's shard locally, then Ray uploads it
        fixes={
            "gpu": "Raise ZERO_STAGE, set OFFLOAD, use more NUM_WORKERS, or lower BATCH_SIZE_PER_WORKER or MAX_SEQ_LEN.",
            "host": "Choose nodes with more RAM in CLUSTER, or OFFLOAD='none'.",
            "disk": "Choose nodes with more local disk in CLUSTER.",
        },
    )


def smoke(namespace: dict) -> dict:
    """Smoke mode's table: `{parameter: (the full-scale default, the laptop value)}`."""
    from harness.fixtures import ag_news_fixture
    from harness.tiny_models import tiny_model

    return {
        "MODEL_NAME": ("gpt2", tiny_model("gpt2")),  # 2 layers, random weights
        "DATASET_NAME": ("ag_news", ag_news_fixture()),  # ag_news-shaped parquet files
        "CPUS_PER_WORKER": (8, 1),
        "MAX_SEQ_LEN": (512, 64),  # the fixture's headlines are short
        "BATCH_SIZE_PER_WORKER": (1, 8),  # less noisy losses than 1 sample per step
        "NUM_EPOCHS": (1, 2),  # two checkpoints before the resume section adds a third epoch
        "MAX_STEPS_PER_EPOCH": (30, 12),
        "LEARNING_RATE": (1e-6, 2e-3),  # random weights need far bigger steps than fine-tuning
        # "When a worker dies" trains 2 epochs of 4 steps: step 7 comes after its step-4 checkpoint.
        **run_settings(7),
    }


def results(ns: dict) -> dict:
    """The run's numbers, from the notebook's globals once "What the run showed" has run."""
    from harness.storage import uri

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
