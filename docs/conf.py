"""The docs site: every notebook in `notebooks/` rendered as a page (Sphinx + MyST-NB, as Ray's docs are built).

`make docs` builds it into `docs/_build/html`. Two modes, chosen by `DOCS_EXECUTE`:

- unset or `0` (the default, seconds): the committed notebooks as they are, code without outputs. Under
  its title each notebook page gets a "What you should see" box: what a smoke run prints and what
  success looks like, from the notebook's cell tagged `what-you-should-see` (a notebook without one fails
  the build);
- `1` (minutes): MyST-NB executes every notebook in smoke mode (`SMOKE_TEST=1`: tiny local models,
  fixture data, 2 CPU workers, offline) and renders its outputs (plots, tables, logs). Each page then
  says, under its title, that its outputs come from that CPU smoke run, with the date and versions.

Warnings are errors (`sphinx-build -W`): a broken link between pages, an unknown code language or a
notebook that is not valid JSON fails the build.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import pkgutil
import platform
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))  # `helpers`, for autodoc, also where it is not installed
EXECUTE = os.environ.get("DOCS_EXECUTE", "0").lower() not in ("", "0", "false", "no")

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
    from helpers.cluster import forget_outside_cluster

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
    "header_links_before_dropdown": 6,
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


def what_you_should_see(expected: str) -> str:
    """Above a notebook shown without outputs: the box that says what running it shows (`expected`, the
    text of the notebook's own cell tagged EXPECTED_TAG, after its first line)."""
    return (
        ":::{admonition} What you should see\n"
        ":class: tip what-you-should-see\n"
        "This page shows the notebook without outputs. Run it in smoke mode (`SMOKE_TEST=1`: a tiny model, "
        "fixture data, 2 CPU workers; a few minutes on a laptop, see "
        "{ref}`how to run the notebooks <run-the-notebooks>`) and you should see:\n\n"
        f"{expected.strip()}\n"
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
    if EXECUTE:
        note = EXECUTED_NOTE
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
        first.source = f"{title}\n\n{note}\n{rest}"
        source[0] = nbformat.writes(nb)


def _helpers_reference(app, docname: str, source: list[str]) -> None:
    """Append one autodoc section per `helpers` module to api.md, so a new module is never left out."""
    if docname != "api":
        return
    import helpers

    for module in sorted(m.name for m in pkgutil.iter_modules(helpers.__path__)):
        # autodoc writes reStructuredText, which MyST hands over only inside `eval-rst`
        source[0] += (
            f"\n## `helpers.{module}`\n\n```{{eval-rst}}\n.. automodule:: helpers.{module}\n   :members:\n```\n"
        )


def setup(app):
    app.connect("source-read", _check_and_label_notebook)
    app.connect("source-read", _helpers_reference)
    return {"parallel_read_safe": True}
