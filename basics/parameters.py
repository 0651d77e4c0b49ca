"""A notebook's parameters as the packages read them: a frozen dataclass, one field per parameter.

`Parameters` holds what every notebook has; each notebook's module of `harness.notebooks` declares its own
subclass with the parameters its checks and its plan read (`harness.notebooks.parameters_of`). The Set up
cell's checks build it once from the notebook's globals (`of`), and then read attributes: a parameter the
notebook renamed fails there, in the Set up cell, naming it, not at the last cell of a run.

A notebook's own code keeps its parameters as variables: this object is the packages' view of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from basics.validate import ParameterError

__all__ = ["Parameters", "check_packed"]


@dataclass(frozen=True, kw_only=True)
class Parameters:
    """The parameters every notebook has; a notebook's subclass adds its own. A default is what a notebook
    without that parameter does: a subclass whose notebook has it declares it again with `= field()`, no
    default, so that the notebook must define it (`tests/test_notebook_files.py` holds both to the cells)."""

    MODEL_NAME: str
    NUM_WORKERS: int
    BATCH_SIZE_PER_WORKER: int
    LEARNING_RATE: float
    USE_GPU: bool
    CPUS_PER_WORKER: int
    STORAGE_PATH: str
    PLACEMENT_STRATEGY: str
    MAX_FAILURES: int
    CLUSTER: Any  # {instance type: count}, or papermill's text of one (`harness.checks.cluster_from_text`)
    MAX_SEQ_LEN: int | None
    DATASET_NAME: str
    GRADIENT_ACCUMULATION_STEPS: int = 1
    # Only operating_a_run has it; papermill may pass it to any notebook, which refuses it with a reason.
    MIN_WORKERS: int | None = None
    USE_COMPILE: bool = False  # llama_fsdp's
    USE_FLASH_ATTN: bool = False  # the Llama recipe's
    USE_GRADIENT_CHECKPOINTING: Any = False  # True, False or "auto" (the plan chooses)

    @classmethod
    def of(cls, values: Mapping):
        """The parameters among `values` (a notebook's globals, or a dict of parameters) this class
        declares; a `ParameterError` names the ones it must have and `values` lacks."""
        declared = dataclasses.fields(cls)
        required = (
            f.name
            for f in declared
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        missing = [name for name in required if name not in values]
        if missing:
            raise ParameterError(
                f"{cls.__qualname__} reads {', '.join(missing)}, which the notebook's parameters cells do "
                "not define: a parameter renamed in the notebook is renamed in its module of "
                "harness.notebooks too."
            )
        return cls(**{f.name: values[f.name] for f in declared if f.name in values})

    def replace(self, **changes):
        """A copy with `changes` (parameter=value), e.g. the same run on fewer workers."""
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_packed(packed, eval_packed, namespace) -> None:
    """After packing, before any worker starts: at least one global batch of training sequences, and at least
    one held-out sequence per worker (each scores an equal share; fewer, and a worker's share is empty and
    the held-out loss divides by zero at the first evaluation). `namespace`: the notebook's globals (or its
    `Parameters`)."""
    p = namespace if isinstance(namespace, Parameters) else Parameters.of(namespace)
    batch = p.NUM_WORKERS * p.BATCH_SIZE_PER_WORKER * p.GRADIENT_ACCUMULATION_STEPS
    if len(packed) < batch:
        raise ParameterError(
            f"{len(packed)} packed sequences are fewer than one global batch (NUM_WORKERS x BATCH_SIZE_PER_WORKER "
            f"x GRADIENT_ACCUMULATION_STEPS = {batch}): fewer workers, a smaller batch, or a shorter MAX_SEQ_LEN."
        )
    if len(eval_packed) < p.NUM_WORKERS:
        raise ParameterError(
            f"{len(eval_packed)} held-out sequences of MAX_SEQ_LEN={p.MAX_SEQ_LEN} tokens are fewer than "
            f"NUM_WORKERS={p.NUM_WORKERS}: a worker would score none. Fewer workers, a shorter MAX_SEQ_LEN, "
            "or a bigger test split."
        )
