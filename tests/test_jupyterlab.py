"""The notebooks as their first users run them: in JupyterLab, top to bottom, through the page.

A real JupyterLab server from this virtualenv (on loopback, a random token, its own temporary settings, the
news and update checks off) serves notebooks/; headless Chromium opens a notebook, clicks Run > Run All
Cells, and waits until every cell has run (jupyterlab_runs.jupyterlab_run). The kernel gets the test's
environment: offline, the test cluster's variables, `SMOKE_TEST=1`, `RESULTS_PATH`. The page must then show
every code cell run, no traceback in any output (a planned worker kill included: the reader sees the run
recover, not Ray's stack traces), no widget that failed to render, and the loss plot; the news question
must never appear; and no Markdown may be typeset as a formula (two dollar amounts in a paragraph). A
screenshot of the whole notebook is kept in test-artifacts/jupyterlab/<notebook>.png, each cell's output
text in <notebook>.txt, the server's log in <notebook>-server.log; the results JSON in
test-artifacts/notebooks/<notebook>-jupyterlab.json.

By default the GLUE notebook (the fastest; its results JSON also serves
test_glue_text_classification.py, so `make test` runs it once); `JUPYTERLAB_NOTEBOOKS=all` (or a
comma-separated list of names) runs the others too. Without Chromium these tests are skipped with the
reason (failed under CI=true), as the docs' browser tests are.
"""

from __future__ import annotations

import re

import nbformat
import pytest
from browser import chromium_or_skip
from jupyterlab_runs import LAB_START_BUDGET_S, LabRun, jupyterlab_notebooks, jupyterlab_run
from notebook_runs import (
    ARTIFACTS,
    SMOKE_BUDGET_S,
)

RAN = re.compile(r"\[\d+\]:")


def problems_in(run: LabRun) -> list[str]:
    """Everything the page showed that a learner should not see, and anything that kept the run from
    finishing; empty when the notebook ran clean."""
    not_run = [f"code cell {i} {p}" for i, p in enumerate(run.prompts, 1) if not RAN.fullmatch(p)]
    flagged = [
        (run.news_prompt, 'JupyterLab asked "Would you like to get notified about official Jupyter news?"'),
        (run.dialogs, f"a dialog was open: {run.dialogs}"),
        (not run.finished and not any("budget" in p for p in run.problems), "the run did not finish"),
        (
            len(run.prompts) != run.code_cells,
            f"{len(run.prompts)} code cells in the page, {run.code_cells} in the notebook file",
        ),
        (not_run, f"cells that did not run: {not_run}"),
    ]
    found = [*run.problems, *(what for shown, what in flagged if shown)]
    found += [f"error output in {e}" for e in run.error_outputs]
    found += [f"traceback in {t}" for t in run.tracebacks]
    found += [f"widget not rendered: {w}" for w in run.widget_problems]
    flagged = [
        (run.images < 1, "no image in any output (the loss plot)"),
        (run.external_requests, f"the page requested beyond loopback: {run.external_requests[:5]}"),
        (run.page_errors, f"JavaScript errors: {run.page_errors[:5]}"),
        (run.saved_outputs, "the notebook file in notebooks/ has outputs now: the run saved into the source"),
        (not run.screenshot.is_file(), f"no screenshot at {run.screenshot}"),
    ]
    return found + [what for shown, what in flagged if shown]


def _lab_runs() -> list:
    """Each notebook's JupyterLab run, under its own budget: the run's and the server's and browser's start
    (the cluster it needs is a fixture, which guards its own start)."""
    return [
        pytest.param(name, marks=pytest.mark.timeout(SMOKE_BUDGET_S[name] + LAB_START_BUDGET_S + 30))
        for name in jupyterlab_notebooks()
    ]


@pytest.mark.notebook
@pytest.mark.parametrize("name", _lab_runs())
def test_notebook_runs_clean_in_jupyterlab(name, jupyterlab):
    chromium_or_skip()
    run = jupyterlab(name)  # prints its summary
    found = problems_in(run)
    assert not found, f"{run.summary()}\n\n" + "\n\n".join(found)
    assert run.results is not None, "the notebook wrote no results JSON (RESULTS_PATH)"
    assert run.results["notebook"] == name and run.results["smoke_test"] is True
    assert (ARTIFACTS / "notebooks" / f"{name}-jupyterlab.json").is_file()


@pytest.mark.notebook
@pytest.mark.parametrize("name", _lab_runs())  # the same run as above: nothing more if that one ran first
def test_markdown_shows_as_written_in_jupyterlab(name, jupyterlab):
    # JupyterLab reads two dollar signs in a paragraph as a formula: "about $0.01 of GPU time (1 T4, $0.526/h)"
    # shows as run-together italic letters. Escaping is not enough there (measured in JupyterLab 4.6):
    # "\$0.01 ... \$0.526/h" is still typeset when nothing but text lies between (the escape is gone by the
    # time MathJax reads the page), and so are "&#36;" and "<span>$</span>". "USD 0.526/h", or one dollar
    # sign per paragraph, reads the same everywhere. The notebooks have no formulas.
    chromium_or_skip()
    run = jupyterlab(name)
    assert not run.typeset_math, (
        "Markdown typeset as math (two $ in one paragraph; write amounts as USD 0.526/h or keep one $ per "
        "paragraph; cell i is the .ipynb's cells[i]):\n" + "\n".join(run.typeset_math)
    )


def _broken_notebook(path):
    """A notebook with what the checks must catch: a stderr warning (allowed), a plot, a progress-bar
    widget, a widget whose model the page never gets, a traceback printed to stderr (as Ray prints a dead
    worker's), an exception, and a cell after it that Run All never reaches."""
    code = [
        "import os, sys\nprint('smoke', os.environ['SMOKE_TEST'])\nprint('a warning', file=sys.stderr)",
        "import matplotlib.pyplot as plt\nfig, ax = plt.subplots(figsize=(3, 2))\nax.plot([3, 2, 1])\n"
        "display(fig)\nplt.close(fig)",
        "from tqdm.auto import tqdm\nfor _ in tqdm(range(3)):\n    pass",
        "display({'application/vnd.jupyter.widget-view+json': "
        "{'model_id': 'no-such-model', 'version_major': 2, 'version_minor': 0}}, raw=True)",
        "print('Traceback (most recent call last):\\n  File \"worker.py\", line 1\\nRuntimeError: gone', "
        "file=sys.stderr)",
        "1 / 0",
        "print('never reached')",
    ]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in code])
    # Two dollar amounts in a paragraph: JupyterLab typesets what lies between them as a formula.
    notebook.cells.insert(0, nbformat.v4.new_markdown_cell("Costs $0.01 on a T4 at $0.526/h."))
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, path)


@pytest.mark.timeout(180)
def test_the_checks_see_what_the_page_shows(tmp_path):
    """The checks themselves, on a small notebook that breaks every rule (about 20 s, no cluster)."""
    chromium_or_skip()
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    _broken_notebook(notebooks / "broken.ipynb")
    run = jupyterlab_run("broken", {}, tmp_path / "lab", notebooks=notebooks, timeout=60)
    print(run.summary())

    assert run.finished and not run.problems, run.problems
    assert run.prompts == ["[1]:", "[2]:", "[3]:", "[4]:", "[5]:", "[6]:", "[ ]:"]  # Run All stops at 1 / 0
    assert [t.split(" (")[0] for t in run.tracebacks] == ["code cell 5 [5]:", "code cell 6 [6]:"]
    assert len(run.error_outputs) == 1 and "ZeroDivisionError" in run.error_outputs[0]
    assert len(run.widget_problems) == 1 and run.widget_problems[0].startswith("code cell 4 [4]:")
    assert run.images == 1  # the plot; the progress bar rendered as a widget, not as a problem
    assert len(run.typeset_math) == 1 and run.typeset_math[0].startswith("cell 0: Costs"), run.typeset_math
    assert not run.news_prompt and not run.dialogs and not run.external_requests and not run.page_errors
    assert not run.saved_outputs  # the file on disk has no outputs: no autosave into the source
    assert run.screenshot.stat().st_size > 10_000
    assert run.results is None  # no RESULTS_PATH written by this one
    found = problems_in(run)
    assert len(found) == 1 + 1 + 2 + 1, found  # a cell not run, the error output, 2 tracebacks, the widget
