"""llama_lora: the llama_fsdp recipe with LoRA adapters over a frozen base.

Its smoke values and its results are in the notebook itself (the Set up cell, the last cell)."""

from __future__ import annotations

from dataclasses import dataclass, field

from basics.validate import check_choice, check_int, check_positive

from . import NotebookRules
from .llama_fsdp import ELASTIC_REFUSED, LlamaParameters, check_llama, plan_recipe

__all__ = ["LoraParameters", "check", "plan_recipe", "ELASTIC_REFUSED"]

# Its smoke run's time budget in the tests (nbval, JupyterLab): see tests/notebook_runs.py.
SMOKE_BUDGET_S = 450  # the LoRA papermill run's budget (tests/test_llama_lora.py)


@dataclass(frozen=True, kw_only=True)
class LoraParameters(LlamaParameters):
    LORA_RANK: int = field()
    LORA_ALPHA: float
    LORA_MERGED: bool = field()
    USE_COMPILE: bool = False  # llama_fsdp's: this notebook trains eagerly


def check(p: LoraParameters) -> None:
    """The parameters cell's values `p`, by this notebook's rules; a ParameterError names the first bad one."""
    check_int("LORA_RANK", p.LORA_RANK, minimum=1)
    check_positive("LORA_ALPHA", p.LORA_ALPHA)
    check_choice("LORA_MERGED", p.LORA_MERGED, [True, False])
    check_llama(p)


RULES = NotebookRules(
    parameters=LoraParameters,
    check=check,
    plan_recipe=plan_recipe,
    elastic_refused=ELASTIC_REFUSED,
    smoke_budget_s=SMOKE_BUDGET_S,
)
