"""One module per notebook: what the suite must know of it beyond its `.ipynb`.

Each module holds:

- `check(p)`: its parameter rules (the Set up cell's `harness.checks.check_parameters`, `make plan`);
- `plan_recipe(p)`: its recipe as the "Will it fit?" planner sees it, or None (`helpers.sizing.plan_for`);
- `ELASTIC_REFUSED`: why it cannot go on with fewer workers (`MIN_WORKERS`), or None where it can;
- `smoke(namespace)`: smoke mode's table, `{parameter: (full-scale default, smoke value)}`;
- `results(ns)`: the numbers its run reports, from its globals once it has run (`helpers.save_results`).

What they share is here. A sixth notebook adds its `.ipynb`, a module here (`NAMES` lists the modules), and
its test.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from helpers.validate import ParameterError, check_choice, check_int, check_positive

__all__ = [
    "NAMES",
    "notebook",
    "smoke_table",
    "check_common",
    "check_cpus_per_worker",
    "collect",
    "section_run",
    "held_out_results",
]

# One module per notebook, named as its .ipynb: the modules of this package are the notebooks.
NAMES = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__)))
PLACEMENTS = ["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


def notebook(name: str) -> ModuleType:
    """The module of the notebook `name` (e.g. `harness.notebooks.llama_fsdp`)."""
    if name not in NAMES:
        raise ValueError(f"unknown notebook {name!r}; known: {sorted(NAMES)}")
    return importlib.import_module(f"{__name__}.{name}")


def smoke_table(name: str, namespace: dict) -> dict[str, tuple]:
    """The notebook's smoke table for its parameters as they are in `namespace` (its globals): builds the
    tiny model and the fixtures (cached after the first time). `harness.parameters.smoke_overrides` replaces
    only parameters still at their full-scale default, and prints what it replaced."""
    return notebook(name).smoke(namespace)


def run_settings(kill_at_step: int) -> dict:
    """Every notebook's smoke values: a CPU worker per Ray node where there are two, the planned kill,
    local storage."""
    from harness.cache import local_storage

    return {
        "USE_GPU": (True, False),
        "PLACEMENT_STRATEGY": ("PACK", "SPREAD"),  # one worker per Ray node (a no-op on a one-node Ray)
        "KILL_WORKER_AT_STEP": (0, kill_at_step),  # see the notebook's "When a worker dies"
        "STORAGE_PATH": ("/mnt/cluster_storage/", local_storage()),
    }


def check_common(p: dict, total_steps: int | None = None) -> None:
    """What every notebook checks: workers, batch, learning rate, placement, the planned kill (a step of a
    run of `total_steps`, None: unbounded), restarts, storage and CPUs per worker."""
    from harness.run_log import check_kill_step
    from harness.storage import check_storage_path

    check_int("NUM_WORKERS", p["NUM_WORKERS"], minimum=1)
    check_int("BATCH_SIZE_PER_WORKER", p["BATCH_SIZE_PER_WORKER"], minimum=1)
    check_positive("LEARNING_RATE", p["LEARNING_RATE"])
    check_choice("USE_GPU", p["USE_GPU"], [True, False])
    check_choice("PLACEMENT_STRATEGY", p["PLACEMENT_STRATEGY"], PLACEMENTS)
    kill_at = p.get("KILL_WORKER_AT_STEP", 0)  # a lesson notebook has none: its tests kill from outside
    check_kill_step("KILL_WORKER_AT_STEP", kill_at, p["NUM_WORKERS"], total_steps)
    if "MAX_FAILURES" in p:
        check_int("MAX_FAILURES", p["MAX_FAILURES"], minimum=-1)
        if p["MAX_FAILURES"] == 0 and kill_at:
            raise ParameterError(
                f"MAX_FAILURES=0 with KILL_WORKER_AT_STEP={p['KILL_WORKER_AT_STEP']}: the planned kill would end "
                "the run, with no restart to show. Use MAX_FAILURES >= 1 (or -1: no limit), or "
                "KILL_WORKER_AT_STEP=0."
            )
    check_storage_path("STORAGE_PATH", p["STORAGE_PATH"])
    if "CPUS_PER_WORKER" in p:
        check_cpus_per_worker(p)


def check_cpus_per_worker(p: dict) -> None:
    """Each worker reserves CPUS_PER_WORKER CPUs, and Ray gives it as many threads (OMP_NUM_THREADS):
    without a reservation a GPU worker gets one thread, for the CPU work it does (an offloaded optimizer
    step, rank 0's load). A node of `CLUSTER` must have room for its GPUs' workers."""
    from helpers.plan import NODE_TYPES

    value = p["CPUS_PER_WORKER"]
    check_int("CPUS_PER_WORKER", value, minimum=1)
    for name in (p.get("CLUSTER") or {}) if p["USE_GPU"] else ():
        node = NODE_TYPES.get(name)
        if node and node.gpus and node.cpus and value * node.gpus > node.cpus:
            raise ParameterError(
                f"CPUS_PER_WORKER={value}: a {name} has {node.cpus} vCPUs for its {node.gpus} GPUs' workers, "
                f"{node.cpus // node.gpus} each at most (leave some for Ray and its data tasks)."
            )


def collect(name: str, ns: dict) -> dict:
    """The notebook `name`'s results from its globals: the keys every notebook promises, then its own."""
    from harness.parameters import parameter_values

    return {
        "notebook": name,
        "smoke_test": bool(ns["SMOKE_TEST"]),
        "parameters": parameter_values(ns),
        **notebook(name).results(ns),
    }


def held_out_results(ns: dict) -> dict:
    """The Llama notebooks' held-out evaluations, from their watch: the loss and the seconds by step, and
    how many packed sequences each scored (an equal share per worker: the rest wait)."""
    evaluations = ns["watch"].evaluations()  # step -> eval_loss, eval_seconds
    return {
        "eval_losses": {step: e["eval_loss"] for step, e in evaluations.items()},
        "eval_seconds": {step: e["eval_seconds"] for step, e in evaluations.items()},
        "eval_rows": len(ns["eval_packed"]) // ns["NUM_WORKERS"] * ns["NUM_WORKERS"],
    }


def section_run(
    ns: dict, notebook: str, watch: str = "kill_watch", result: str = "killed_run"
) -> dict | None:
    """A "going further" section's own run, from its watch and its `Result` (the notebook's globals named
    `watch` and `result`: "When a worker dies"'s by default), as results; None where the section did not
    train. Its losses, worker groups, the kill and where it resumed, its checkpoint and MLflow run: the keys
    of a notebook's results, so the same checks read both."""
    from harness.parameters import parameter_values
    from harness.storage import uri

    if watch not in ns or result not in ns:
        return None
    section_watch, run = ns[watch], ns[result]
    ranks = section_watch.ranks()
    return {
        "notebook": notebook,
        "smoke_test": bool(ns["SMOKE_TEST"]),
        "parameters": parameter_values(ns),
        "losses": section_watch.losses(),
        "attempts": section_watch.attempts(),
        "kill": section_watch.kill_summary(),
        "checkpoint_path": uri(run.checkpoint.filesystem, run.checkpoint.path),
        "worker_node_ids": [r["node_id"] for r in ranks],
        "train_seconds": section_watch.seconds,
        "mlflow_run_id": section_watch.mlflow_run_id,
    }
