"""operating_a_run: a long run's hazards (a worker dies, a spot notice, a node lost), each a short run of the
Llama recipe on a small model, and the records that find every run again.

Its smoke values and its results are in the notebook itself (the Set up cell, the last cell)."""

from __future__ import annotations

from dataclasses import dataclass, field

from basics.validate import ParameterError, check_int

from . import NotebookRules
from .llama_fsdp import LlamaRecipeParameters, check_recipe, plan_recipe

__all__ = ["OperatingParameters", "check", "plan_recipe", "ELASTIC_REFUSED", "SMOKE_BUDGET_S"]

ELASTIC_REFUSED = None  # its third section is an elastic run: MIN_WORKERS is its parameter

# Its smoke run's time budget in the tests (nbval, JupyterLab): see tests/notebook_runs.py.
SMOKE_BUDGET_S = 900


@dataclass(frozen=True, kw_only=True)
class OperatingParameters(LlamaRecipeParameters):
    STEPS_PER_SECTION: int
    SHORT_SAVE_STEPS: int
    RESIZE_CHECK_S: int
    MAX_PREEMPTION_FAILURES: int
    KILL_WORKER_AT_STEP: int
    NOTICE_AT_STEP: int
    NOTICE_DEADLINE_S: int
    MIN_WORKERS: int | None = field()


def check(p: OperatingParameters) -> None:
    """The parameters cells' values `p`, by this notebook's rules; a ParameterError names the first bad one."""
    steps = check_int("STEPS_PER_SECTION", p.STEPS_PER_SECTION, minimum=2)
    check_int("SAVE_STEPS", p.SAVE_STEPS, minimum=1, maximum=steps - 1)
    check_int("SHORT_SAVE_STEPS", p.SHORT_SAVE_STEPS, minimum=1)
    check_int("RESIZE_CHECK_S", p.RESIZE_CHECK_S, minimum=1, maximum=3600)
    check_int("MAX_PREEMPTION_FAILURES", p.MAX_PREEMPTION_FAILURES, minimum=-1)
    check_int("NOTICE_DEADLINE_S", p.NOTICE_DEADLINE_S, minimum=5, maximum=3600)
    # After the first checkpoint, so that the restart resumes from one; before the section's end.
    check_int("KILL_WORKER_AT_STEP", p.KILL_WORKER_AT_STEP, minimum=p.SAVE_STEPS + 1, maximum=steps - 1)
    check_int("NOTICE_AT_STEP", p.NOTICE_AT_STEP, minimum=p.SAVE_STEPS + 1, maximum=steps - 1)
    if p.NUM_WORKERS < 2:
        raise ParameterError(
            f"NUM_WORKERS={p.NUM_WORKERS}: this notebook kills, drains and loses the node of rank 1; it "
            "needs at least 2 workers, on at least 2 nodes."
        )
    if p.MAX_FAILURES == 0:
        raise ParameterError(
            "MAX_FAILURES=0: the first section's killed worker would end its run, with no restart to show. "
            "Use MAX_FAILURES >= 1 (or -1: no limit)."
        )
    check_recipe(p)


RULES = NotebookRules(
    parameters=OperatingParameters,
    check=check,
    plan_recipe=plan_recipe,
    elastic_refused=ELASTIC_REFUSED,
    smoke_budget_s=SMOKE_BUDGET_S,
)
