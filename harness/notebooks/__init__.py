"""One module per notebook: what the suite must know of it beyond its `.ipynb`, declared as its `RULES`, a
`NotebookRules` (a module that leaves a field out fails when it is imported):

- `parameters`: its parameters as the packages read them, a `basics.parameters.Parameters` subclass
  (`parameters_of(name, globals())` builds it);
- `check(p)`: its parameter rules (the Set up cell's `harness.checks.check_parameters`, `make plan`);
- `plan_recipe(p)`: its recipe as the "Will it fit?" planner sees it, or None (`harness.sizing.plan_for`);
- `elastic_refused`: why it cannot go on with fewer workers (`MIN_WORKERS`), or None where it can;
- `smoke_budget_s`: its smoke run's time budget in the tests.

Its smoke values and its results are the notebook's own (its Set up cell, its last cell).

What they share is here. A sixth notebook adds its `.ipynb`, a module here (`NAMES` lists the modules), and
its test.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

from basics.parameters import Parameters
from basics.validate import ParameterError, check_choice, check_int, check_positive

__all__ = [
    "NAMES",
    "NotebookRules",
    "notebook",
    "parameters_of",
    "defaults",
    "check_common",
    "check_cpus_per_worker",
]

# One module per notebook, named as its .ipynb: the modules of this package are the notebooks.
NAMES = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__)))
PLACEMENTS = ["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


@dataclass(frozen=True)
class NotebookRules:
    """What the suite knows of one notebook beyond its `.ipynb` (each module's `RULES`)."""

    parameters: type[Parameters]  # what its checks and its plan read of its parameters
    check: Callable[[Parameters], None]  # its parameter rules: a ParameterError names the first bad value
    plan_recipe: Callable | None  # p -> its `basics.plan.Recipe`; None: no "will it fit?" plan
    elastic_refused: str | None  # why it cannot go on with fewer workers; None: it can (MIN_WORKERS)
    smoke_budget_s: int  # its smoke run's time budget in the tests
    # its data's own check, after the model's (GLUE's GLUE_PATH); None: DATASET_NAME and MAX_SEQ_LEN's
    check_data: Callable[[Parameters], None] | None = None


def notebook(name: str) -> NotebookRules:
    """The rules of the notebook `name`, from its module (e.g. `harness.notebooks.llama_fsdp.RULES`)."""
    if name not in NAMES:
        raise ValueError(f"unknown notebook {name!r}; known: {sorted(NAMES)}")
    return importlib.import_module(f"{__name__}.{name}").RULES


def parameters_of(name: str, values) -> Parameters:
    """The notebook `name`'s parameters among `values` (its globals, or a dict of parameters: `make plan`'s,
    a test's), as its module declares them; `values` itself where it is one already."""
    if isinstance(values, Parameters):
        return values
    return notebook(name).parameters.of(values)


def defaults(name: str) -> Parameters:
    """The notebook `name`'s parameters as its parameters cells set them, at full scale (SMOKE_TEST as the
    environment says: unset, False): the docs' tables start from them."""
    from basics.notebook_files import parameter_defaults

    return parameters_of(name, parameter_defaults(name))


def check_common(p: Parameters) -> None:
    """What every notebook checks: workers, batch, learning rate, placement, restarts, storage and CPUs per
    worker."""
    from harness.storage import check_storage_path

    check_int("NUM_WORKERS", p.NUM_WORKERS, minimum=1)
    check_int("BATCH_SIZE_PER_WORKER", p.BATCH_SIZE_PER_WORKER, minimum=1)
    check_positive("LEARNING_RATE", p.LEARNING_RATE)
    check_choice("USE_GPU", p.USE_GPU, [True, False])
    check_choice("PLACEMENT_STRATEGY", p.PLACEMENT_STRATEGY, PLACEMENTS)
    check_int("MAX_FAILURES", p.MAX_FAILURES, minimum=-1)
    check_storage_path("STORAGE_PATH", p.STORAGE_PATH)
    check_cpus_per_worker(p)


def check_cpus_per_worker(p: Parameters) -> None:
    """Each worker reserves CPUS_PER_WORKER CPUs, and Ray gives it as many threads (OMP_NUM_THREADS):
    without a reservation a GPU worker gets one thread, for the CPU work it does (an offloaded optimizer
    step, rank 0's load). A node of `CLUSTER` must have room for its GPUs' workers."""
    from basics.hardware import NODE_TYPES

    value = p.CPUS_PER_WORKER
    check_int("CPUS_PER_WORKER", value, minimum=1)
    for name in (p.CLUSTER or {}) if p.USE_GPU else ():
        node = NODE_TYPES.get(name)
        if node and node.gpus and node.cpus and value * node.gpus > node.cpus:
            raise ParameterError(
                f"CPUS_PER_WORKER={value}: a {name} has {node.cpus} vCPUs for its {node.gpus} GPUs' workers, "
                f"{node.cpus // node.gpus} each at most (leave some for Ray and its data tasks)."
            )
