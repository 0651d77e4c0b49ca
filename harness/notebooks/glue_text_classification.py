"""glue_text_classification: the HF `Trainer` on Ray Train workers fed by Ray Data.

Its smoke values and its results are in the notebook itself (the Set up cell, the last cell)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from basics.parameters import Parameters
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


@dataclass(frozen=True, kw_only=True)
class GlueParameters(Parameters):
    TASK: str
    NUM_EPOCHS: int
    WEIGHT_DECAY: float
    GLUE_PATH: str  # a local copy of GLUE, or hf://datasets/nyu-mll/glue
    CLUSTER: dict = field(default_factory=dict)  # no plan: its models fit any GPU
    MAX_SEQ_LEN: int | None = None  # the tokenizer's own
    DATASET_NAME: str = ""  # GLUE_PATH instead


def check(p: GlueParameters) -> None:
    """The parameters cell's values `p`, by this notebook's rules; a ParameterError names the first bad one."""
    from basics.glue import GLUE_TASKS

    check_choice("TASK", p.TASK, GLUE_TASKS)
    check_int("NUM_EPOCHS", p.NUM_EPOCHS, minimum=1)
    value = p.WEIGHT_DECAY
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ParameterError(f"WEIGHT_DECAY={value!r}: must be a finite number >= 0.")
    check_common(p)


def check_data(p: GlueParameters) -> None:
    """GLUE can be reached: a local copy, or the Hub where it is online."""
    from basics.validate import check_source_available, hub_offline

    if not p.GLUE_PATH.startswith("hf://"):
        check_source_available("GLUE_PATH", p.GLUE_PATH, "dataset")
    elif hub_offline():
        raise ParameterError(
            f"GLUE_PATH={p.GLUE_PATH!r}: the Hugging Face Hub is offline (HF_HUB_OFFLINE=1). Pass a "
            "local copy with the same layout, go online, or run the small version with SMOKE_TEST=True."
        )


RULES = NotebookRules(
    parameters=GlueParameters,
    check=check,
    check_data=check_data,  # GLUE_PATH, where the others check DATASET_NAME
    plan_recipe=plan_recipe,
    elastic_refused=ELASTIC_REFUSED,
    smoke_budget_s=SMOKE_BUDGET_S,
)
