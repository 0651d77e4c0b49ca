"""gpt2_deepspeed: DeepSpeed ZeRO stages 1-3 in Ray Train workers, sharded checkpoints, resuming.

Its smoke values and its results are in the notebook itself (the Set up cell, the last cell)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from basics.parameters import Parameters
from basics.plan import Recipe
from basics.validate import ParameterError, check_choice, check_int

from . import NotebookRules, check_common

ELASTIC_REFUSED = (
    "DeepSpeed ZeRO checkpoints hold one partition per rank and load only at the world "
    "size that wrote them (DeepSpeed's universal checkpoint format, converted offline, would lift that)"
)

# Its smoke run's time budget in the tests (nbval, JupyterLab): see tests/notebook_runs.py.
SMOKE_BUDGET_S = 400


@dataclass(frozen=True, kw_only=True)
class Gpt2Parameters(Parameters):
    NUM_EPOCHS: int
    MAX_STEPS_PER_EPOCH: int
    ZERO_STAGE: int  # 0 (DDP) to 3
    OFFLOAD: str  # "none", "optimizer" or "optimizer+params"
    PRECISION: str
    EXPERIMENT_PREFIX: str  # the run's folder under STORAGE_PATH


def check(p: Gpt2Parameters) -> None:
    """The parameters cell's values `p`, by this notebook's rules; a ParameterError names the first bad one."""
    check_int("NUM_EPOCHS", p.NUM_EPOCHS, minimum=1)
    check_int("MAX_STEPS_PER_EPOCH", p.MAX_STEPS_PER_EPOCH, minimum=1)
    check_int("MAX_SEQ_LEN", p.MAX_SEQ_LEN, minimum=8)
    check_choice("ZERO_STAGE", p.ZERO_STAGE, [0, 1, 2, 3])
    check_choice("OFFLOAD", p.OFFLOAD, ["none", "optimizer", "optimizer+params"])
    if p.OFFLOAD != "none" and p.ZERO_STAGE == 0:
        raise ParameterError(f"OFFLOAD={p.OFFLOAD!r} needs ZERO_STAGE 1, 2 or 3: offload is part of ZeRO.")
    if p.OFFLOAD == "optimizer+params" and p.ZERO_STAGE != 3:
        raise ParameterError(
            f"OFFLOAD='optimizer+params' needs ZERO_STAGE=3 (only stage 3 partitions the parameters); "
            f"ZERO_STAGE={p.ZERO_STAGE} can offload 'optimizer'."
        )
    check_choice("PRECISION", p.PRECISION, ["bf16", "fp16", "fp32"])
    # It names the run's folder under STORAGE_PATH: a name, never a path out of it.
    if not isinstance(p.EXPERIMENT_PREFIX, str) or not re.fullmatch(
        r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", p.EXPERIMENT_PREFIX
    ):
        raise ParameterError(
            f"EXPERIMENT_PREFIX={p.EXPERIMENT_PREFIX!r}: must be a name of letters, digits, '_', '.' or '-' "
            "(at most 64, no '/'), e.g. 'deepspeed_sample'."
        )
    if p.PRECISION == "fp16" and not p.USE_GPU:
        # DeepSpeed's CPU accelerator supports fp16 only with special builds; bf16 works everywhere.
        raise ParameterError("PRECISION='fp16' needs USE_GPU=True; on CPU use PRECISION='bf16' or 'fp32'.")
    check_common(p)


def plan_recipe(p: Gpt2Parameters) -> Recipe:
    """The recipe as `basics.plan.plan_training` sees it, for the parameters `p`."""
    return Recipe(
        activation_checkpointing=False,
        sharding=f"zero{p.ZERO_STAGE}",
        gather_bytes=2,
        offload=p.OFFLOAD,
        loading="every rank",  # every worker calls from_pretrained
        checkpoint="staged",  # DeepSpeed writes each rank's shard locally, then Ray uploads it
        fixes={
            "gpu": "Raise ZERO_STAGE, set OFFLOAD, use more NUM_WORKERS, or lower BATCH_SIZE_PER_WORKER or MAX_SEQ_LEN.",
            "host": "Choose nodes with more RAM in CLUSTER, or OFFLOAD='none'.",
            "disk": "Choose nodes with more local disk in CLUSTER.",
        },
    )


RULES = NotebookRules(
    parameters=Gpt2Parameters,
    check=check,
    plan_recipe=plan_recipe,
    elastic_refused=ELASTIC_REFUSED,
    smoke_budget_s=SMOKE_BUDGET_S,
)
