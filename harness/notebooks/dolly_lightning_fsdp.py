"""dolly_lightning_fsdp: Lightning's FSDP strategy on Ray Train, and what a 7B run costs."""

from __future__ import annotations

from dataclasses import dataclass

from basics.parameters import Parameters
from basics.plan import Recipe
from basics.validate import ParameterError, check_choice, check_int, check_positive

from . import NotebookRules, check_common

ELASTIC_REFUSED = (
    "its sharded checkpoint would load on any number of workers (through DCP), but "
    "each epoch's steps are counted for NUM_WORKERS shards of Ray Data, and Lightning's batch is per worker: "
    "on fewer workers the global batch and the place in the data after a resume would change. The Llama "
    "notebook shows a loop that keeps both"
)

# Its smoke run's time budget in the tests (nbval, JupyterLab): see tests/notebook_runs.py.
SMOKE_BUDGET_S = 380


@dataclass(frozen=True, kw_only=True)
class DollyParameters(Parameters):
    NUM_EPOCHS: int
    EPS: float  # AdamW's epsilon, as the original sets it
    PRECISION: str  # Lightning's precision string
    CPU_OFFLOAD: bool  # FSDP1's: the weights, gradients and optimizer step on the CPU


def check(p: DollyParameters) -> None:
    """The parameters cell's values `p`, by this notebook's rules; a ParameterError names the first bad one."""
    from basics.sharding import LIGHTNING_PRECISIONS

    check_int("MAX_SEQ_LEN", p.MAX_SEQ_LEN, minimum=8)
    check_int("NUM_EPOCHS", p.NUM_EPOCHS, minimum=1)
    check_positive("EPS", p.EPS)
    check_choice("PRECISION", p.PRECISION, LIGHTNING_PRECISIONS)
    check_choice("CPU_OFFLOAD", p.CPU_OFFLOAD, [True, False])
    if p.PRECISION in ("16-mixed", "16-true") and not p.USE_GPU:
        raise ParameterError(
            f"PRECISION={p.PRECISION!r} needs USE_GPU=True; on CPU use 'bf16-mixed' or '32-true'."
        )
    if p.CPU_OFFLOAD and not p.USE_GPU:
        raise ParameterError(
            "CPU_OFFLOAD=True needs USE_GPU=True: on CPU workers the model is in CPU memory."
        )
    check_common(p)


def plan_recipe(p: DollyParameters) -> Recipe:
    """The recipe as `basics.plan.plan_training` sees it, for the parameters `p`."""
    compute_bytes = 4 if p.PRECISION in ("32-true", "64-true") else 2  # mixed precision: 16-bit
    return Recipe(
        activation_checkpointing=True,  # the strategy's activation_checkpointing_policy
        sharding="fsdp",
        gather_bytes=compute_bytes,  # FSDP gathers the weights in the compute dtype
        reduce_bytes=compute_bytes,  # and Lightning reduces the gradients in it too
        offload="optimizer+params" if p.CPU_OFFLOAD else "none",  # FSDP1 offloads weights, grads, the step
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


RULES = NotebookRules(
    parameters=DollyParameters,
    check=check,
    plan_recipe=plan_recipe,
    elastic_refused=ELASTIC_REFUSED,
    smoke_budget_s=SMOKE_BUDGET_S,
)
