"""dolly_lightning_fsdp: Lightning's FSDP strategy on Ray Train, and what a 7B run costs."""

from __future__ import annotations

from helpers.plan import Recipe
from helpers.validate import ParameterError, check_choice, check_int, check_positive

from . import check_common, run_settings, section_run

ELASTIC_REFUSED = (
    "its sharded checkpoint would load on any number of workers (through DCP), but "
    "each epoch's steps are counted for NUM_WORKERS shards of Ray Data, and Lightning's batch is per worker: "
    "on fewer workers the global batch and the place in the data after a resume would change. The Llama "
    "notebook shows a loop that keeps both"
)

# Its smoke run's time budget in the tests (nbval, JupyterLab): see tests/notebook_runs.py.
SMOKE_BUDGET_S = 380


def check(p: dict) -> None:
    """The parameters cell's values `p`, by this notebook's rules; a ParameterError names the first bad one."""
    from helpers.fsdp import LIGHTNING_PRECISIONS

    check_int("MAX_SEQ_LEN", p["MAX_SEQ_LEN"], minimum=8)
    check_int("NUM_EPOCHS", p["NUM_EPOCHS"], minimum=1)
    check_positive("EPS", p["EPS"])
    check_choice("PRECISION", p["PRECISION"], LIGHTNING_PRECISIONS)
    check_choice("CPU_OFFLOAD", p["CPU_OFFLOAD"], [True, False])
    if p["PRECISION"] in ("16-mixed", "16-true") and not p["USE_GPU"]:
        raise ParameterError(
            f"PRECISION={p['PRECISION']!r} needs USE_GPU=True; on CPU use 'bf16-mixed' or '32-true'."
        )
    if p["CPU_OFFLOAD"] and not p["USE_GPU"]:
        raise ParameterError(
            "CPU_OFFLOAD=True needs USE_GPU=True: on CPU workers the model is in CPU memory."
        )
    check_common(p, 2 * 4)  # the kill is a step of "When a worker dies"'s own run: 2 epochs of 4 steps


def plan_recipe(p: dict) -> Recipe:
    """The recipe as `helpers.plan.plan_training` sees it, for the parameters `p`."""
    compute_bytes = 4 if p["PRECISION"] in ("32-true", "64-true") else 2  # mixed precision: 16-bit
    return Recipe(
        activation_checkpointing=True,  # the strategy's activation_checkpointing_policy
        sharding="fsdp",
        gather_bytes=compute_bytes,  # FSDP gathers the weights in the compute dtype
        reduce_bytes=compute_bytes,  # and Lightning reduces the gradients in it too
        offload="optimizer+params" if p["CPU_OFFLOAD"] else "none",  # FSDP1 offloads weights, grads, the step
        no_shard_alone=True,  # FSDP1: one worker runs as NO_SHARD
        loading="every rank",  # every worker's DollyV2Model loads the fp32 model before FSDP shards it
        checkpoint="staged",  # each rank writes its shard locally, then Ray uploads it
        num_to_keep=1,
        fixes={
            "gpu": "Set CPU_OFFLOAD=True, more NUM_WORKERS, or lower BATCH_SIZE_PER_WORKER or MAX_SEQ_LEN.",
            "host": "Choose nodes with more RAM per GPU in CLUSTER, or set CPU_OFFLOAD=False.",
            "disk": "Choose nodes with more local disk in CLUSTER.",
        },
    )


def smoke(namespace: dict) -> dict:
    """Smoke mode's table: `{parameter: (the full-scale default, the laptop value)}`."""
    from harness.fixtures import play_script_fixture
    from harness.tiny_models import tiny_model

    return {
        # 2 layers, random weights, stored in bf16 like the Hub's dolly-v2-7b
        "MODEL_NAME": ("databricks/dolly-v2-7b", tiny_model("gpt_neox", dtype="bfloat16")),
        "DATASET_NAME": ("karpathy/tiny_shakespeare", play_script_fixture()),
        "NUM_WORKERS": (16, 2),
        "CPUS_PER_WORKER": (8, 1),
        "PRECISION": ("16-mixed", "bf16-mixed"),  # CPUs have no fp16 autocast
        "CPU_OFFLOAD": (True, False),
        "MAX_SEQ_LEN": (256, 32),  # the fixture's lines are short
        "BATCH_SIZE_PER_WORKER": (5, 8),
        "LEARNING_RATE": (2e-5, 3e-3),  # random weights need far bigger steps than fine-tuning
        **run_settings(7),  # "When a worker dies": its run's step 7 of 8, after the step-4 checkpoint
    }


def results(ns: dict) -> dict:
    """The run's numbers, from the notebook's globals once "What the run showed" has run."""
    from harness.storage import uri

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
