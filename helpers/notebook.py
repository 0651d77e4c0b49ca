"""The calls of a notebook's Set up cell, in its order: smoke mode's values (`use_smoke_values`), the checks
of the parameters and the "will it fit?" plan (`check_parameters`), `ray.init`'s arguments and its log file
(`ray_init_args`, `ray_log_file`), the checks of the cluster (`check_cluster`); and, for its results cell, the
parameters as the run used them and the seconds since Set up (`parameter_values`, `elapsed`). Each is a thin
door into `harness`. What Set up learns of the run is kept in the notebook's own globals
(`harness.parameters.RunRecord`), not here.
"""

from __future__ import annotations

import gc

from harness import checks, cluster, cpu_bf16, parameters, results

__all__ = [
    "use_smoke_values",
    "check_parameters",
    "ray_init_args",
    "ray_log_file",
    "check_cluster",
    "parameter_values",
    "elapsed",
]


def use_smoke_values(namespace: dict, table: dict[str, tuple]) -> None:
    """Smoke mode, as a notebook's Set up cell spells it out: `table` maps each parameter to `(full-scale
    default, laptop value)`; a parameter still at its default takes the laptop value, one you set or passed
    with papermill's `-p` stays (a table of both is printed). On a CPU without bf16 instructions, bf16 matrix
    products then run in fp32, rounded to bf16 (`harness.cpu_bf16`)."""
    namespace.update(parameters.smoke_overrides(namespace, table))
    if cpu_bf16.install():  # and in each Ray worker, by the job's setup hook
        print("  This CPU has no bf16 instructions: bf16 matrix products run in fp32, rounded to bf16.")


def check_parameters(notebook: str, namespace: dict):
    """Before Ray starts: a misspelt name, a bad value, unwritable storage, a model or data out of reach, or
    a run that will not fit fails here, naming the parameter and what is allowed
    (`harness.checks.check_parameters`). Starts the run's clock; returns the "will it fit?" plan (None for
    a notebook without one)."""
    results.start_clock(namespace, notebook)
    gc.set_threshold(*cluster.GC_THRESHOLD)  # the imports to come: about a fifth faster (see there)
    return checks.check_parameters(notebook, namespace)


def check_cluster(notebook: str, namespace: dict, plan=None) -> None:
    """After `ray.init`: room for the workers, storage every node can write, the weights on every node
    (`harness.checks.check_cluster`)."""

    checks.check_cluster(notebook, namespace, plan)


def ray_init_args(**init_kwargs) -> dict:
    """The arguments of the Set up cell's `ray.init`: the cluster to attach to (`RAY_ADDRESS`, or the one
    `ray start` runs on this machine) or a local Ray's CPUs, and every worker's runtime environment
    (`harness.cluster.ray_init_args`)."""

    return cluster.ray_init_args(**init_kwargs)


def ray_log_file(notebook: str):
    """Around the Set up cell's `ray.init`: Ray's start-up messages and the workers' output go to a log file,
    which the line printed after it names (`harness.cluster.ray_log_file`)."""

    return cluster.ray_log_file(notebook)


def parameter_values(namespace: dict) -> dict:
    """Every parameter's value as the run used it (after smoke mode), credentials redacted: for the results
    file (`harness.parameters.parameter_values`)."""

    return parameters.parameter_values(namespace)


def elapsed(namespace: dict) -> float:
    """Seconds since this notebook's Set up cell (`namespace`, its globals): the results' `wall_seconds`."""

    return results.elapsed(namespace)
