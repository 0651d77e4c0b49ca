"""Run a notebook's first cells for many parameter sets in one interpreter: the parameters cell, the values
papermill would inject after it, and the Set up cell up to the point where it starts Ray.

Used by tests/test_bad_input.py for the refusals that happen in `helpers.check_parameters` (or before it): a
kernel per case costs an interpreter start and the imports (2-20 s each on 2 cores), this costs one. A few
cases per notebook still run in a real kernel through papermill, which proves the notebook stops there.

    python tests/set_up_cells.py CASES_JSON RESULTS_JSON

CASES_JSON: [{"notebook": ..., "case": ..., "parameters": {...}}, ...]. RESULTS_JSON gets, for each case,
{"ename": ..., "evalue": ..., "wall": seconds} (ename None: the Set up cell went past its checks).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
SETS_UP = ("helpers.check_parameters(",)  # the checks, before ray.init


class _RayWouldStart(Exception):
    """Raised in place of `helpers.ray_init_args`: the Set up cell went past its checks."""


def _stop_before_ray(*args, **kwargs):
    raise _RayWouldStart


def first_cells(notebook: str) -> tuple[str, str]:
    """The parameters cells' source, and the Set up cell's (the next code cell)."""
    from basics.notebook_files import parameter_cells

    parameters, after = parameter_cells(NOTEBOOKS / f"{notebook}.ipynb")
    set_up = after[0]
    assert any(call in set_up for call in SETS_UP), (
        f"{notebook}: the cell after the parameters checks nothing"
    )
    return parameters, set_up


def run_case(notebook: str, parameters: dict) -> dict:
    parameters_cell, set_up = first_cells(notebook)
    injected = "\n".join(f"{name} = {value!r}" for name, value in parameters.items())  # as papermill does
    environ = dict(os.environ)
    start = time.perf_counter()
    try:
        namespace: dict = {"__name__": "__main__"}
        with contextlib.redirect_stdout(io.StringIO()):
            for source in (parameters_cell, injected, set_up):
                exec(compile(source, notebook, "exec"), namespace)  # noqa: S102 - the notebook's own cells
        raise AssertionError(f"{notebook}: the Set up cell ended without starting Ray")
    except _RayWouldStart:
        ename, evalue = None, ""
    except Exception as exc:  # noqa: BLE001 - reported, as the kernel would
        ename, evalue = type(exc).__name__, str(exc)
    finally:
        os.environ.clear()  # a case's checks may set variables (the tracking URI): the next starts clean
        os.environ.update(environ)
    return {"ename": ename, "evalue": evalue, "wall": time.perf_counter() - start}


def main(cases_json: str, results_json: str) -> None:
    import helpers

    helpers.ray_init_args = _stop_before_ray  # what the Set up cell calls once its checks have passed
    cases = json.loads(Path(cases_json).read_text())
    results = {f"{c['notebook']}/{c['case']}": run_case(c["notebook"], c["parameters"]) for c in cases}
    Path(results_json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
