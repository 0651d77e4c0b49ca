"""llama_fsdp: the Hugging Face Llama 2 70B FSDP recipe on FSDP2 in Ray Train.

Its smoke values and its results are in the notebook itself (the Set up cell, the last cell)."""

from __future__ import annotations

from dataclasses import dataclass, field

from basics.parameters import Parameters
from basics.plan import Recipe
from basics.validate import ParameterError, check_choice, check_int

from . import NotebookRules, check_common

# Its checkpoint would load at any world size, but its loop deals each rank its rows for NUM_WORKERS ranks.
ELASTIC_REFUSED = (
    "its lesson's run has a fixed size: its loop deals each rank its rows for NUM_WORKERS workers. The "
    "operating_a_run notebook trains the same recipe elastically, with a batching that keeps the global "
    "batch at any number of workers"
)

# Its smoke run's time budget in the tests (nbval, JupyterLab): see tests/notebook_runs.py.
SMOKE_BUDGET_S = 330


@dataclass(frozen=True, kw_only=True)
class LlamaRecipeParameters(Parameters):
    """The Llama recipe's parameters, in llama_fsdp, llama_lora and operating_a_run."""

    GRADIENT_ACCUMULATION_STEPS: int = field()
    WEIGHT_DECAY: float
    WARMUP_RATIO: float
    USE_FLASH_ATTN: bool = field()
    USE_GRADIENT_CHECKPOINTING: bool | str = field()
    LOGGING_STEPS: int
    SAVE_STEPS: int
    COLLECTIVE_TIMEOUT_S: int
    LORA_RANK: int = 0  # llama_lora's: 0, full fine-tuning
    LORA_MERGED: bool = False


@dataclass(frozen=True, kw_only=True)
class LlamaParameters(LlamaRecipeParameters):
    MAX_STEPS: int
    EVAL_STEPS: int
    USE_COMPILE: bool = field()


def check(p: LlamaParameters) -> None:
    """The parameters cell's values `p`, by this notebook's rules; a ParameterError names the first bad one."""
    check_choice("USE_COMPILE", p.USE_COMPILE, [True, False])
    check_llama(p)


def check_recipe(p: LlamaRecipeParameters) -> None:
    """What every notebook of the Llama recipe checks: its numbers."""
    check_int("MAX_SEQ_LEN", p.MAX_SEQ_LEN, minimum=16)
    check_int("GRADIENT_ACCUMULATION_STEPS", p.GRADIENT_ACCUMULATION_STEPS, minimum=1)
    check_int("LOGGING_STEPS", p.LOGGING_STEPS, minimum=1)
    check_int("SAVE_STEPS", p.SAVE_STEPS, minimum=1)
    check_int("COLLECTIVE_TIMEOUT_S", p.COLLECTIVE_TIMEOUT_S, minimum=60, maximum=7 * 24 * 3600)
    check_choice("USE_FLASH_ATTN", p.USE_FLASH_ATTN, [True, False])
    check_choice("USE_GRADIENT_CHECKPOINTING", p.USE_GRADIENT_CHECKPOINTING, [True, False, "auto"])
    for name, value in (("WEIGHT_DECAY", p.WEIGHT_DECAY), ("WARMUP_RATIO", p.WARMUP_RATIO)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise ParameterError(f"{name}={value!r}: must be a number in [0, 1).")
    check_common(p)


def check_llama(p: LlamaParameters) -> None:
    """What both Llama lesson notebooks check: the recipe's numbers and its run's steps."""
    check_int("MAX_STEPS", p.MAX_STEPS, minimum=1)
    check_int("EVAL_STEPS", p.EVAL_STEPS, minimum=1)
    check_recipe(p)


def plan_recipe(p: LlamaRecipeParameters) -> Recipe:
    """The recipe as `basics.plan.plan_training` sees it, for the parameters `p`."""
    return Recipe(
        activation_checkpointing=p.USE_GRADIENT_CHECKPOINTING,
        sharding="fsdp",
        gather_bytes=2,  # MixedPrecisionPolicy(param_dtype=bfloat16)
        loading="rank 0",  # the other ranks build on `meta`
        checkpoint="streamed",  # each rank writes its shard straight to STORAGE_PATH
        export_bytes=2,  # the consolidated bf16/fp16 model rank 0 writes at the end
        num_to_keep=2,
        vocab_size=None,  # the 4 chat tokens add 4 rows: nothing the plan can see
        foreach_optimizer=False,  # the training function's AdamW(foreach=False)
        separate_embeddings=True,  # shard_model wraps the embeddings and the head as FSDP units of their own
        reduce_bytes=2,  # MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
        lora_rank=p.LORA_RANK,  # > 0: adapters over a frozen bf16 base (the llama_lora notebook)
        lora_token_rows=4,  # with LoRA, the chat tokens' rows of the embeddings and the head train too
        lora_merged=p.LORA_MERGED,  # and a merged model exported next to the adapter
        collective_timeout_s=p.COLLECTIVE_TIMEOUT_S,  # a checkpoint's save must end well within it
        fixes={
            "gpu": "Use more NUM_WORKERS (nodes in CLUSTER), or lower BATCH_SIZE_PER_WORKER or MAX_SEQ_LEN"
            + ("." if p.USE_GRADIENT_CHECKPOINTING else ", or set USE_GRADIENT_CHECKPOINTING=True."),
            "host": "Choose nodes with more RAM in CLUSTER.",
            "disk": "Choose nodes with more local disk in CLUSTER.",
        },
    )


RULES = NotebookRules(
    parameters=LlamaParameters,
    check=check,
    plan_recipe=plan_recipe,
    elastic_refused=ELASTIC_REFUSED,
    smoke_budget_s=SMOKE_BUDGET_S,
)
