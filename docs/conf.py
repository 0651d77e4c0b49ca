"""The docs site: every notebook in `notebooks/` rendered as a page (Sphinx + MyST-NB, as Ray's docs are built).

`make docs` builds it into `docs/_build/html`. Two modes, chosen by `DOCS_EXECUTE`:

- unset or `0` (the default, seconds): each notebook page shows the outputs of the last `make run` in
  this checkout (`runs/<time>/<notebook>.ipynb`, or the folder in `DOCS_RUNS`), without executing
  anything, when that run's code cells are the committed notebook's and it ran to the end. A notebook
  without such a run is shown without outputs, under a "What you should see" box: what a smoke run
  prints and what success looks like, from the notebook's cell tagged `what-you-should-see` (a notebook
  without one fails the build), and how to get the outputs;
- `1` (minutes): MyST-NB executes every notebook in smoke mode (`SMOKE_TEST=1`: tiny local models,
  fixture data, 2 CPU workers, offline) and renders its outputs (plots, tables, logs). Each page then
  says, under its title, that its outputs come from that CPU smoke run, with the date and versions.

Warnings are errors (`sphinx-build -W`): a broken link between pages, an unknown code language or a
notebook that is not valid JSON fails the build.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import pkgutil
import platform
from pathlib import Path

DOCS = Path(__file__).resolve().parent
EXECUTE = os.environ.get("DOCS_EXECUTE", "0").lower() not in ("", "0", "false", "no")
RUNS = Path(os.environ.get("DOCS_RUNS") or DOCS.parent / "runs")  # `make run` writes runs/<time>/

project = "Distributed LLM fine-tuning on Ray"
author = "the ray-llm-notebooks authors"
copyright = f"2026, {author}"

extensions = ["myst_nb", "sphinx.ext.autodoc"]
# `notebooks` is a link to ../notebooks: the pages are the committed notebooks themselves, and an executed
# notebook runs in notebooks/, its usual working directory.
exclude_patterns = ["_build", "**/.ipynb_checkpoints", "Thumbs.db", ".DS_Store"]

# ---- Markdown (MyST) ----
# `alert`: GitHub-style notes (`> [!NOTE]`), which read as a plain quote in JupyterLab and render as
# admonitions here; `colon_fence`: `:::{note}` blocks; `dollarmath`: `$...$` formulas.
myst_enable_extensions = ["alert", "colon_fence", "dollarmath"]
myst_heading_anchors = 3

# ---- Notebooks (MyST-NB) ----
nb_execution_mode = "force" if EXECUTE else "off"
nb_execution_timeout = 900  # per cell: a smoke run's training cell takes 1-3 minutes on 2 cores
nb_execution_raise_on_error = True  # a failing notebook fails the build instead of rendering a traceback
nb_execution_show_tb = True
nb_merge_streams = True  # one block of log lines per cell, in order, instead of stdout and stderr apart

if EXECUTE:
    # The kernels inherit the build's environment: smoke mode, and nothing fetched from a hub.
    os.environ["SMOKE_TEST"] = "1"
    # A local Ray and each notebook's own storage: never a cluster, bucket or credentials from the shell,
    # whose paths the pages would print.
    from harness.cluster import forget_outside_cluster

    forget_outside_cluster()
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray Data's progress bars are Jupyter widgets in a kernel: on a static page they would show only if
    # the page loaded the widget renderer from a CDN, and then as a bar frozen at the build's last frame.
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    os.environ.pop("MPLBACKEND", None)  # the kernel's inline backend, so plots become page images

# ---- Python reference (autodoc) ----
# The helpers' docstrings are written with single backquotes for code, as in Markdown.
default_role = "literal"
autodoc_member_order = "bysource"
autodoc_typehints = "description"

# ---- HTML ----
html_theme = "pydata_sphinx_theme"
html_title = project
html_static_path = ["_static"]
html_css_files = ["site.css"]
html_sidebars = {
    "index": [],  # pages with no siblings: no empty "Section Navigation"
    "cluster": [],
    "gpu": [],
    "techniques": [],
    "troubleshooting": [],
    "testing": [],
    "changes": [],
    "api": [],
    # Notebook pages give the left column to their code (lines up to ~120 characters; see _static/site.css):
    # the other tutorials stay one click away in the header bar and the previous/next links.
    "notebooks/*": [],
}
html_theme_options = {
    "logo": {"text": "LLM fine-tuning on Ray"},
    "navigation_with_keys": False,
    # every page of the root toctree in the header bar, none behind a "More" menu (the theme's default: 5)
    "header_links_before_dropdown": 9,
    "show_toc_level": 2,
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
}
html_show_sourcelink = False


KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}


def _versions() -> str:
    names = ("torch", "ray", "transformers", "deepspeed", "lightning")
    return ", ".join(f"{name} {importlib.metadata.version(name)}" for name in names)


EXPECTED_TAG = "what-you-should-see"  # the notebook's Markdown cell that says what a smoke run shows

if EXECUTE:
    # Above an executed notebook's outputs: where they come from.
    EXECUTED_NOTE = (
        "> [!NOTE]\n"
        "> **Outputs from a CPU smoke run.** The outputs on this page were produced when this site was built, "
        f"on {datetime.date.today().isoformat()}, by running the notebook with `SMOKE_TEST=1`: a tiny "
        "random-weight model of the same architecture, fixture data written for this project and "
        f"2 CPU workers ({os.cpu_count()} cores, {platform.python_version()}, {_versions()}). "
        "Losses, speeds and generated text are that smoke run's, not the full-scale run's.\n"
    )


def _code_cells(nb) -> list:
    """The notebook's code cells, without the one papermill adds for the values it was given."""
    return [
        c
        for c in nb.cells
        if c.cell_type == "code" and "injected-parameters" not in c.metadata.get("tags", [])
    ]


def last_run(name: str, committed) -> tuple | None:
    """(the executed notebook, what the run recorded) of the newest run under RUNS that executed notebook
    `name` to the end with the committed notebook's code; None if there is none."""
    import nbformat

    for folder in sorted((p for p in RUNS.glob("*") if p.is_dir()), reverse=True):  # names are times
        path = folder / f"{name}.ipynb"
        try:
            executed = nbformat.read(path, as_version=4)
        except (OSError, ValueError):
            continue
        papermill = executed.metadata.get("papermill", {})
        if papermill.get("exception") or not papermill.get("end_time"):
            continue
        if [c.source for c in _code_cells(executed)] != [c.source for c in _code_cells(committed)]:
            continue  # the notebook changed since: its outputs would not match the code shown
        env_file = folder / "environment.json"
        env = json.loads(env_file.read_text()) if env_file.is_file() else {}
        return executed, {"folder": folder.name, **papermill, **env}
    return None


def with_outputs(committed, executed) -> None:
    """Give the committed notebook's code cells the executed copy's outputs (its Markdown stays as
    committed: prose edited since the run shows as it is now)."""
    for cell, done in zip(_code_cells(committed), _code_cells(executed), strict=True):
        cell.outputs, cell.execution_count = done.outputs, done.execution_count


def reading_minutes(nb) -> int:
    """Minutes to read the page: its prose at 200 words a minute, its code at 20 lines a minute."""
    words = sum(len(c.source.split()) for c in nb.cells if c.cell_type == "markdown")
    lines = sum(len(c.source.splitlines()) for c in nb.cells if c.cell_type == "code")
    return max(1, math.ceil(words / 200 + lines / 20))


def run_note(run: dict) -> str:
    """Above outputs that come from a `make run` of this checkout: which run, when, how long, on what."""
    when = run["end_time"][:10]
    on = f"{run['cores']} cores, Python {run['python']}, {run['versions']}" if "versions" in run else ""
    return (
        "> [!NOTE]\n"
        f"> **Outputs from a CPU smoke run** (`make run`, {when}): `SMOKE_TEST=1`, a tiny random-weight model of "
        "the same architecture, fixture data and 2 CPU workers. Losses, speeds and generated text are that "
        f"run's, not the full-scale run's (the table above says what that gives).{f' On {on}.' if on else ''}\n"
    )


def page_facts(name: str, nb, run: dict | None) -> str:
    """Under a notebook page's title: the laptop run, reading time, last verified, download and opening."""
    if EXECUTE:
        laptop = "executed for this page when the site was built"
        verified = f"{datetime.date.today().isoformat()}, by that build"
    elif run:
        laptop = f"{run['duration']:.0f} s on the last `make run` in this checkout ({run['end_time'][:10]})"
        verified = f"{run['end_time'][:10]}, by that run"
    else:
        laptop = "a minute or two on 2 cores (not run in this checkout yet: `make run`, then `make docs`)"
        verified = "not in this checkout; `make test` runs every notebook"
    return (
        ":::{admonition} This notebook\n"
        ":class: page-facts\n"
        f"- **Laptop run:** {laptop}. Full-scale hardware, time and cost: the table below.\n"
        f"- **Reading time:** about {reading_minutes(nb)} minutes.\n"
        f"- **Last verified:** {verified}.\n"
        f"- **Get it:** {{download}}`{name}.ipynb <{name}.ipynb>`; open it in JupyterLab (`make lab` in a "
        "clone of the project, or on an Anyscale workspace after `pip install -r requirements.txt && pip "
        "install -e .`) and run all cells; see {ref}`how to run the notebooks <run-the-notebooks>`.\n"
        ":::\n"
    )


def what_you_should_see(expected: str) -> str:
    """Above a notebook shown without outputs: the box that says what running it shows (`expected`, the
    text of the notebook's own cell tagged EXPECTED_TAG, after its first line)."""
    return (
        ":::{admonition} What you should see\n"
        ":class: tip what-you-should-see\n"
        "This page shows the notebook without outputs. Run it in smoke mode (`SMOKE_TEST=1`: a tiny model, "
        "fixture data, 2 CPU workers; a few minutes on a laptop, see "
        "{ref}`how to run the notebooks <run-the-notebooks>`) and you should see:\n\n"
        f"{expected.strip()}\n\n"
        "`make run`, then `make docs`, shows this page with that run's outputs.\n"
        ":::\n"
    )


def _check_and_label_notebook(app, docname: str, source: list[str]) -> None:
    """Fail on an invalid notebook with a clear warning; put a note under each notebook page's title.

    A notebook that is not JSON, or not valid against the nbformat schema, would otherwise crash
    MyST-NB with a long traceback (and stop `--keep-going` from reporting the other problems). The
    note is EXECUTED_NOTE on an executed site, else the page's "What you should see" box; it goes into
    the page only: the notebook files are untouched.
    """
    import nbformat
    from sphinx.util import logging

    if Path(app.env.doc2path(docname)).suffix != ".ipynb":
        return
    try:
        nb = nbformat.reads(source[0], as_version=4)
        nbformat.validate(nb)
    except Exception as exc:  # noqa: BLE001 - any reason a notebook cannot be read is reported the same way
        reason = str(exc).strip().splitlines()[0][:300]
        logging.getLogger(__name__).warning(
            f"invalid notebook ({type(exc).__name__}): {reason}", location=docname, type="notebook"
        )
        # An empty page in its place, so the build goes on to report every other problem.
        source[0] = nbformat.writes(nbformat.v4.new_notebook(metadata={"kernelspec": KERNELSPEC}))
        return
    first = nb.cells[0] if nb.cells else None
    if not (docname.startswith("notebooks/") and first and first.cell_type == "markdown"):
        return
    name = docname.removeprefix("notebooks/")
    run = None if EXECUTE else last_run(name, nb)
    if EXECUTE:
        note = EXECUTED_NOTE
    elif run:
        executed, run = run
        with_outputs(nb, executed)
        note = run_note(run)
    else:
        tagged = [
            c for c in nb.cells if c.cell_type == "markdown" and EXPECTED_TAG in c.metadata.get("tags", [])
        ]
        if len(tagged) != 1:
            logging.getLogger(__name__).warning(
                f'no "What you should see" box: tag one Markdown cell (after the training cell) {EXPECTED_TAG}'
                f" ({len(tagged)} tagged)",
                location=docname,
                type="notebook",
            )
            return
        note = what_you_should_see(tagged[0].source.partition("\n")[2])
    title, _, rest = first.source.partition("\n")
    if title.startswith("# "):
        first.source = f"{title}\n\n{page_facts(name, nb, run)}\n{note}\n{rest}"
        source[0] = nbformat.writes(nb)


def _module(path: Path):
    """The Python file `path` as a module, imported by its path (docs/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"docs_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _generated_tables(app, docname: str, source: list[str]) -> None:
    """Replace each `<!-- table: NAME -->` line of a Markdown page by the table docs/tables.py makes."""
    if "<!-- table: " in source[0]:
        source[0] = _module(DOCS / "tables.py").fill(source[0])


def _helpers_reference(app, docname: str, source: list[str]) -> None:
    """Append one autodoc section per module of `helpers`, then of `harness` and `basics` (the floors below
    it), to api.md, so a new module is never left out."""
    if docname != "api":
        return
    import basics
    import harness
    import helpers

    for package in (helpers, harness, basics):
        if package is not helpers:
            summary = package.__doc__.split("\n\n")[0]
            source[0] += f"\n## The `{package.__name__}` package\n\n{summary}\n"
        for module in sorted(m.name for m in pkgutil.iter_modules(package.__path__)):
            name = f"{package.__name__}.{module}"
            # autodoc writes reStructuredText, which MyST hands over only inside `eval-rst`
            level = "##" if package is helpers else "###"
            source[0] += f"\n{level} `{name}`\n\n```{{eval-rst}}\n.. automodule:: {name}\n   :members:\n```\n"


def setup(app):
    app.connect("source-read", _check_and_label_notebook)
    app.connect("source-read", _helpers_reference)
    app.connect("source-read", _generated_tables)
    return {"parallel_read_safe": True}
