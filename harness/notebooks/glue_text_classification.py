"""glue_text_classification: the HF `Trainer` on Ray Train workers fed by Ray Data.

Its smoke values and its results are in the notebook itself (the Set up cell, the last cell)."""

from __future__ import annotations

import math

from basics.validate import ParameterError, check_choice, check_int

from . import NotebookRules, check_common

# These two checkpoints would load at any world size (DDP's is whole; Dolly's sharded one goes through DCP);
# what ties them to NUM_WORKERS is how the data is fed.
ELASTIC_REFUSED = (
    "its checkpoint would load on any number of workers, but the Trainer's steps "
    "per epoch are counted for NUM_WORKERS workers (a Ray Data shard has no length), and after a resume the "
    "Trainer finds its place by skipping batches of its own shard: on fewer workers the global batch and "
    "that place would change. The Llama notebook shows a loop that keeps both"
)
plan_recipe = None  # the models fit any GPU

# Its smoke run's time budget in the tests (nbval, JupyterLab): see tests/notebook_runs.py.
SMOKE_BUDGET_S = 400  # 298 s beside other work on the AVX2 machine


def check(p: dict) -> None:
    """The parameters cell's values `p`, by this notebook's rules; a ParameterError names the first bad one."""
    from basics.glue import GLUE_TASKS

    check_choice("TASK", p["TASK"], GLUE_TASKS)
    check_int("NUM_EPOCHS", p["NUM_EPOCHS"], minimum=1)
    value = p["WEIGHT_DECAY"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ParameterError(f"WEIGHT_DECAY={value!r}: must be a finite number >= 0.")
    check_common(p)


RULES = NotebookRules(
    check=check, plan_recipe=plan_recipe, elastic_refused=ELASTIC_REFUSED, smoke_budget_s=SMOKE_BUDGET_S
)
