"""The Set up cell: one call between a notebook's parameters and its lesson.

`set_up(notebook, globals())` starts the run's clock, applies smoke mode (the notebook's `smoke` table in `harness.notebooks`), checks
the parameters and plans the run (`harness.checks.check_parameters`), starts Ray or joins the cluster in
`RAY_ADDRESS` (`harness.cluster.start_ray`), and checks that the cluster can hold the run (`harness.checks.check_cluster`).
"""

from __future__ import annotations

import gc

__all__ = ["set_up"]


def set_up(notebook: str, namespace: dict):
    """Set up `notebook`'s run from its globals (`namespace`, updated in place); return its "will it fit?"
    plan (None for a notebook without one).

    1. With `SMOKE_TEST`: the laptop-sized model, fixtures and run of the notebook's smoke table
       (`harness.notebooks`), for every parameter still at its full-scale default; a value you passed or
       edited stays. Prints what changed.
    2. `harness.checks.check_parameters`: a misspelt name, a bad value, unwritable storage, a model or data out of
       reach, or a run that will not fit fails here, naming the parameter and what is allowed.
    3. `harness.cluster.start_ray`: a local Ray, or the cluster in `RAY_ADDRESS`; the workers' output goes to a log.
    4. `harness.checks.check_cluster`: room for the workers, storage every node can write, the weights on every node.
    """
    from harness import checks, cluster, cpu_bf16, parameters, results  # here: harness imports helpers
    from harness.notebooks import smoke_table

    results.start_clock(notebook)
    gc.set_threshold(*cluster.GC_THRESHOLD)  # the imports to come: about a fifth faster (see there)
    if namespace.get("SMOKE_TEST"):
        namespace.update(parameters.smoke_overrides(namespace, smoke_table(notebook, namespace)))
        if cpu_bf16.install():  # and in each Ray worker, by the job's setup hook
            print("  This CPU has no bf16 instructions: bf16 matrix products run in fp32, rounded to bf16.")
    plan = checks.check_parameters(notebook, namespace)
    cluster.start_ray(notebook)
    checks.check_cluster(notebook, {**namespace, "plan": plan})  # the plan: the local disk it needs
    return plan
