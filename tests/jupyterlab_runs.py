"""Test plumbing for JupyterLab: a notebook as its first user runs it, in a real JupyterLab server and a
headless browser (`jupyterlab_run`), with the page's cells, math and widgets read back (`LabRun`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from notebook_runs import ARTIFACTS, NOTEBOOKS, SMOKE_BUDGET_S, killed_in, notebook_env

from harness.notebooks import NAMES

# ---- JupyterLab: the notebook as its first user runs it -------------------------------------------

ALL_NOTEBOOKS = NAMES
LAB_ARTIFACTS = ARTIFACTS / "jupyterlab"  # <notebook>.png (the page), .txt (each cell's outputs), -server.log
# The time from "Run All Cells" to the last cell is bounded by the notebook's SMOKE_BUDGET_S; the server's and
# Chromium's start (measured: 5-10 s) and the kernel's (2-4 s) come on top of it.
LAB_START_BUDGET_S = 60
# JupyterLab's settings for these runs (the server's own settings folder is a temporary one, see
# jupyterlab_run). Nothing fetched from the internet: the announcements plugin, which asks "Would you like
# to get notified about official Jupyter news?" on a first start and then fetches the news feed, is
# disabled, and news and update checks are off in its settings too. Every cell in the page (windowing
# "none": cells out of view are in the DOM, for the checks and the screenshot), and every output (no
# "Show more outputs" cut). No autosave: the run must never write its outputs into notebooks/.
LAB_PAGE_CONFIG = {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension:tracker": {"windowingMode": "none", "maxNumberOutputs": 100000},
    "@jupyterlab/docmanager-extension:plugin": {"autosave": False},
}
# Text that means a widget did not render (no widget manager, a model the page never got, a view left
# loading), or the plain-text stand-in a kernel sends for a progress-bar widget.
WIDGET_PROBLEMS = (
    "Error displaying widget",
    "Loading widget",
    "IProgress not found",
    "HBox(children=",
    "FloatProgress(value=",
)


def jupyterlab_notebooks(value: str | None = None) -> list[str]:
    """The notebooks test_jupyterlab.py runs: `JUPYTERLAB_NOTEBOOKS` (`all`, or names separated by commas);
    by default the GLUE notebook alone (the fastest), as in CI."""
    value = os.environ.get("JUPYTERLAB_NOTEBOOKS", "") if value is None else value
    if value.strip().lower() == "all":
        return list(ALL_NOTEBOOKS)
    names = [name.strip().removesuffix(".ipynb") for name in value.split(",") if name.strip()]
    unknown = sorted(set(names) - set(ALL_NOTEBOOKS))
    if unknown:
        raise ValueError(
            f"JUPYTERLAB_NOTEBOOKS={value!r}: unknown {unknown}; `all` or some of {ALL_NOTEBOOKS}"
        )
    return names or ["glue_text_classification"]


@dataclass
class LabRun:
    """What a run through JupyterLab showed (`jupyterlab_run`); test_jupyterlab.py asserts on it."""

    name: str
    results: dict | None  # the JSON the notebook wrote to RESULTS_PATH (None: it wrote none)
    wall: float  # seconds from "Run All Cells" until every cell had run and the kernel was idle
    finished: (
        bool  # False: its budget (SMOKE_BUDGET_S) passed first (or the run never started; see `problems`)
    )
    code_cells: int  # in the notebook file, as the page opened it
    prompts: list[str]  # each code cell's prompt in the page, in order: "[12]:" ran, "[ ]:" / "[*]:" did not
    tracebacks: list[str]  # "cell N [k]: first lines" for every code cell with "Traceback" in an output
    error_outputs: list[str]  # the same for outputs JupyterLab rendered as a Python error
    widget_problems: list[str]  # outputs where a widget did not render
    images: int  # <img> elements in output areas (the plots)
    typeset_math: list[str]  # "cell i: text" for markdown typeset as math (i: index in the .ipynb's cells)
    news_prompt: bool  # the "official Jupyter news" question was on the page
    dialogs: list[str]  # the text of any dialog left open
    page_errors: list[str]  # uncaught JavaScript errors
    external_requests: list[str]  # what the page tried to load from beyond loopback (blocked)
    saved_outputs: bool  # the notebook file in notebooks/ had outputs afterwards (it must stay stripped)
    screenshot: Path
    problems: list[str]  # what went wrong in the driving itself (a timeout, a dialog in the way)

    def summary(self) -> str:
        ran = sum(bool(re.fullmatch(r"\[\d+\]:", p)) for p in self.prompts)
        return (
            f"{self.name} in JupyterLab: {ran}/{self.code_cells} code cells ran in {self.wall:.0f} s"
            f"{'' if self.finished else ' (did not finish)'}; {len(self.tracebacks)} with a traceback, "
            f"{len(self.error_outputs)} error outputs, {len(self.widget_problems)} widget problems, "
            f"{self.images} images; results JSON {'written' if self.results else 'MISSING'}; "
            f"screenshot {self.screenshot}"
        )


# Per code cell: its prompt and each output's mime type, text and images (all cells are in the DOM).
_CELLS_JS = """() => Array.from(document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-CodeCell')).map(
  cell => ({
    prompt: (cell.querySelector('.jp-InputArea-prompt') || {}).textContent || '',
    outputs: Array.from(cell.querySelectorAll('.jp-OutputArea-child')).map(child => {
      const out = child.querySelector('.jp-OutputArea-output') || child;
      return {
        mime: out.getAttribute('data-mime-type') || '',
        text: out.innerText || '',
        images: out.querySelectorAll('img').length,
      };
    }),
  }))"""
# Markdown that JupyterLab typeset as math (MathJax's <mjx-container>): where, as text. The notebooks hold
# no formulas; an unescaped pair of dollar signs ("$0.01 ... $0.526/h") is read as one.
_MATH_JS = """() => Array.from(document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-Cell')).flatMap(
  (cell, index) => cell.classList.contains('jp-MarkdownCell')
    ? Array.from(cell.querySelectorAll('mjx-container')).map(math => ({
        index, text: (math.closest('td, li, p, h1, h2, h3') || math.parentElement).innerText.slice(0, 300) }))
    : [])"""
_STATUS_JS = """() => {
  const indicator = document.querySelector(
    '.jp-NotebookPanel [data-jp-item-name="executionProgress"] .jp-Notebook-ExecutionIndicator');
  return {
    status: indicator ? indicator.getAttribute('data-status') : null,
    // "Python 3 (ray-llm-notebooks) | Idle" once the kernel is connected
    statusbar: Array.from(document.querySelectorAll('.jp-StatusBar-TextItem')).map(item => item.textContent),
    prompts: Array.from(document.querySelectorAll('.jp-NotebookPanel .jp-CodeCell .jp-InputArea-prompt'))
      .map(p => p.textContent),
  };
}"""


def _first_lines(text: str, marker: str, lines: int = 6) -> str:
    rows = text.splitlines()
    at = next((i for i, row in enumerate(rows) if marker in row), 0)
    return "\n".join(rows[max(0, at - 1) : at + lines])


def _stop(proc: subprocess.Popen) -> None:
    """Stop the server (SIGTERM: it shuts its kernels down), then whatever it started that is left."""
    import psutil

    try:
        children = psutil.Process(proc.pid).children(recursive=True)  # the kernel, by id and start time
    except psutil.NoSuchProcess:
        children = []
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=10)
    for child in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


@contextlib.contextmanager
def jupyterlab_server(root: Path, work_dir: Path, env: dict, log: Path) -> Iterator[str]:
    """`jupyter lab` from this virtualenv on a free loopback port, serving `root`; yields its URL with token.

    Its configuration, data, runtime, settings and workspace folders are under `work_dir` (the user's own
    settings and extensions stay out), holding LAB_PAGE_CONFIG and LAB_SETTINGS. The server (and so the
    kernel) gets `env`. Stopped at the end of the block, also on failure, by its process id.
    """
    import secrets
    import socket
    import urllib.request

    dirs = {
        name: work_dir / name
        for name in ("config", "data", "runtime", "settings", "workspaces", "app", "ipython")
    }
    for folder in dirs.values():
        folder.mkdir(parents=True, exist_ok=True)
    (dirs["config"] / "labconfig").mkdir(exist_ok=True)
    (dirs["config"] / "labconfig" / "page_config.json").write_text(json.dumps(LAB_PAGE_CONFIG, indent=1))
    (dirs["app"] / "overrides.json").write_text(json.dumps(LAB_SETTINGS, indent=1))
    # Not the user's Jupyter paths; and not the tests' MPLBACKEND=Agg: with it the kernel keeps Agg and a
    # plot shows as "<Figure size ...>" text, where a user's kernel draws it (ipykernel sets its inline
    # backend only when MPLBACKEND is unset).
    dropped = ("JUPYTER_PATH", "JUPYTER_CONFIG_PATH", "JUPYTERLAB_DIR", "MPLBACKEND")
    env = {
        **{k: v for k, v in env.items() if k not in dropped},
        "JUPYTER_CONFIG_DIR": str(dirs["config"]),
        "JUPYTER_DATA_DIR": str(dirs["data"]),
        "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]),
        "JUPYTERLAB_SETTINGS_DIR": str(dirs["settings"]),
        "JUPYTERLAB_WORKSPACES_DIR": str(dirs["workspaces"]),
        "IPYTHONDIR": str(dirs["ipython"]),  # no profile or start-up file of the user's in the kernel
    }
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = secrets.token_hex(24)
    command = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
        "--port-retries=0",
        "--allow-root",  # containers run as root; harmless otherwise
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        f"--LabApp.app_settings_dir={dirs['app']}",  # overrides.json: LAB_SETTINGS
        "--LabApp.news_url=None",  # no news feed, whatever the page asks
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",  # no PyPI queries
        f"--FileCheckpoints.root_dir={work_dir / 'checkpoints'}",  # no .ipynb_checkpoints in notebooks/
    ]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, never the tripwire
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"jupyter lab exited with code {proc.returncode}:\n{log.read_text()[-3000:]}"
                )
            try:
                opener.open(f"{url}/api/status?token={token}", timeout=5).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"jupyter lab did not answer in 120 s:\n{log.read_text()[-3000:]}"
                    ) from None
                time.sleep(0.5)
        yield f"{url}?token={token}"
    finally:
        _stop(proc)


def jupyterlab_run(
    name: str,
    cluster: Mapping[str, str],
    work_dir: Path,
    *,
    notebooks: Path = NOTEBOOKS,
    timeout: float | None = None,
) -> LabRun:
    """Run notebooks/<name>.ipynb in smoke mode the way its first user does: in JupyterLab, in Chromium.

    A JupyterLab server (`jupyterlab_server`) serves notebooks/ with the test's environment, the cluster's
    variables (`notebook_env`), `SMOKE_TEST=1` and `RESULTS_PATH`, which the kernel inherits and the
    notebook's parameters cell reads. Headless Chromium (tests/browser.py; skipped without one, failed in
    CI) opens the notebook, waits for the kernel, clicks Run > Run All Cells, and waits until the kernel is
    idle with no cell queued or running (at most `timeout` seconds; by default its SMOKE_BUDGET_S). Then it reads each cell's prompt and
    outputs from the page and keeps a screenshot of the whole notebook (LAB_ARTIFACTS/<name>.png) and each
    cell's output text (<name>.txt). The results JSON is copied to test-artifacts/notebooks/
    <name>-jupyterlab.json. Returns what it saw; the caller asserts.
    """
    from browser import CHROMIUM_FLAGS, chromium_or_skip
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    chromium = chromium_or_skip()
    timeout = SMOKE_BUDGET_S[name] if timeout is None else timeout
    screenshot, kept = _fresh_artifacts(name)
    results_path = work_dir / "results.json"
    env = {**notebook_env(cluster), "SMOKE_TEST": "1", "RESULTS_PATH": str(results_path)}
    notebook_file = notebooks / f"{name}.ipynb"
    file_cells = json.loads(notebook_file.read_text())["cells"]
    code_cells = sum(c["cell_type"] == "code" for c in file_cells)
    hidden_cells = sum(
        c.get("metadata", {}).get("jupyter", {}).get("source_hidden", False) for c in file_cells
    )

    problems: list[str] = []
    page_errors: list[str] = []
    external: list[str] = []
    cells: list[dict] = []
    math: list[dict] = []
    finished, wall, news_prompt, dialogs = False, 0.0, False, []
    server = jupyterlab_server(notebooks, work_dir, env, LAB_ARTIFACTS / f"{name}-server.log")
    with killed_in(name, cluster), server as url:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch_persistent_context(
                str(work_dir / "chromium-profile"),
                executable_path=chromium,
                headless=True,
                args=CHROMIUM_FLAGS,
                viewport={"width": 1280, "height": 1000},
            )

            def keep_local(route):
                if route.request.url.startswith("http://127.0.0.1:"):
                    route.continue_()
                else:
                    external.append(route.request.url)
                    route.abort()

            browser.route("**/*", keep_local)
            page = browser.new_page()
            page.on("pageerror", lambda exc: page_errors.append(str(exc)))
            try:
                finished, wall, dialogs = _run_all_in_page(page, name, url, timeout, hidden_cells, problems)
            except (PlaywrightError, TimeoutError) as exc:  # reported with what the page shows
                problems.append(f"driving the page failed: {str(exc)[:2000]}")
            try:
                news_prompt = page.get_by_text("official Jupyter news").count() > 0
                dialogs = page.locator(".jp-Dialog").all_inner_texts() or dialogs
                cells = page.evaluate(_CELLS_JS)
                math = page.evaluate(_MATH_JS)
                _screenshot(page, screenshot)
            except PlaywrightError as exc:
                problems.append(f"reading the page failed: {str(exc)[:2000]}")
            browser.close()

    saved_outputs = any(
        c.get("outputs") or c.get("execution_count")
        for c in json.loads(notebook_file.read_text())["cells"]  # read again: the run must not have saved
        if c["cell_type"] == "code"
    )
    results = _keep_results(results_path, kept)

    tracebacks, error_outputs, widget_problems, images, dump = _read_outputs(cells)
    (LAB_ARTIFACTS / f"{name}.txt").write_text("\n".join(dump) + "\n")
    return LabRun(
        name=name,
        results=results,
        wall=wall,
        finished=finished,
        code_cells=code_cells,
        prompts=[cell["prompt"].strip() for cell in cells],
        tracebacks=tracebacks,
        error_outputs=error_outputs,
        widget_problems=widget_problems,
        images=images,
        typeset_math=[f"cell {m['index']}: {' '.join(m['text'].split())}" for m in math],
        news_prompt=news_prompt,
        dialogs=dialogs,
        page_errors=page_errors,
        external_requests=external,
        saved_outputs=saved_outputs,
        screenshot=screenshot,
        problems=problems,
    )


def _fresh_artifacts(name: str) -> tuple[Path, Path]:
    """Where the run's screenshot and its results' copy go, with an earlier run's removed."""
    LAB_ARTIFACTS.mkdir(parents=True, exist_ok=True)
    screenshot = LAB_ARTIFACTS / f"{name}.png"
    kept = ARTIFACTS / "notebooks" / f"{name}-jupyterlab.json"
    for path in (screenshot, kept):
        path.unlink(missing_ok=True)
    return screenshot, kept


def _keep_results(results_path: Path, kept: Path) -> dict | None:
    """The run's results JSON (None if it wrote none), a copy kept among the test artifacts."""
    if not results_path.exists():
        return None
    kept.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(results_path, kept)
    return json.loads(results_path.read_text())


def _run_all_in_page(page, name: str, url: str, timeout: float, hidden_cells: int, problems: list[str]):
    """Open the notebook, wait for its kernel, expand the collapsed cells, click Run > Run All Cells and wait
    until it has run (at most `timeout` s); returns (finished, seconds, the dialogs shown before Run All)."""
    base, _, query = url.partition("?")
    page.goto(f"{base}/lab/tree/{name}.ipynb?{query}", wait_until="load")
    page.wait_for_selector(".jp-NotebookPanel .jp-CodeCell", timeout=LAB_START_BUDGET_S * 1000)
    _wait_for_kernel(page, timeout=LAB_START_BUDGET_S)
    dialogs = page.locator(".jp-Dialog").all_inner_texts()
    if dialogs:
        problems.append(f"a dialog before Run All: {dialogs}")
    # The run settings' cell opens collapsed (its input hidden, as the notebook file says); the prompts this
    # test reads are in the inputs: View > Expand All Code shows them all.
    if hidden_cells and page.locator(".jp-InputPlaceholder").count() < hidden_cells:
        problems.append(f"{hidden_cells} collapsed cell(s) in the file, not shown collapsed")
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^View$")).click()
    page.get_by_role("menuitem", name="Expand All Code", exact=True).click()

    def run_all():  # as a user does: the Run menu, "Run All Cells"
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        page.get_by_role("menuitem", name="Run All Cells", exact=True).click()

    run_all()
    start = time.perf_counter()
    finished = _wait_until_run(page, start, timeout, problems, run_all)
    return finished, time.perf_counter() - start, dialogs


def _read_outputs(cells: list[dict]) -> tuple[list[str], list[str], list[str], int, list[str]]:
    """From the page's cells: the tracebacks, the error outputs, the widgets' problems, how many images,
    and each cell's outputs as text."""
    tracebacks, error_outputs, widget_problems, images, dump = [], [], [], 0, []
    for number, cell in enumerate(cells, 1):
        where = f"code cell {number} {cell['prompt'].strip()}"
        dump.append(f"==== {where}")
        for out in cell["outputs"]:
            text = out["text"]
            dump.append(f"---- {out['mime']}\n{text}")
            images += out["images"]
            if "Traceback" in text:
                tracebacks.append(f"{where} ({out['mime']}):\n{_first_lines(text, 'Traceback')}")
            if re.search(r"^\w*(Error|Exception)\s+Traceback \(most recent call last\)", text, re.M):
                error_outputs.append(f"{where}:\n{_first_lines(text, 'Traceback')}")
            for marker in WIDGET_PROBLEMS:
                if marker in text:
                    widget_problems.append(f"{where}: {marker!r}: {_first_lines(text, marker, 2)}")
    return tracebacks, error_outputs, widget_problems, images, dump


def _wait_for_kernel(page, timeout: float) -> None:
    """Wait until the notebook's kernel is connected and idle: the execution indicator says idle and the
    status bar "<kernel> | Idle", in three checks in a row 0.5 s apart. (The indicator alone says idle for a
    moment before the kernel connects; a Run All clicked then is lost.)"""
    deadline, ready, state = time.monotonic() + timeout, 0, {}
    while time.monotonic() < deadline:
        state = page.evaluate(_STATUS_JS)
        idle = state["status"] == "idle" and any(t.strip().endswith("| Idle") for t in state["statusbar"])
        ready = ready + 1 if idle else 0
        if ready >= 3:
            return
        time.sleep(0.5)
    raise TimeoutError(f"the kernel was not idle after {timeout:.0f} s: {state}")


def _wait_until_run(page, start: float, timeout: float, problems: list[str], run_all) -> bool:
    """After Run All: wait until the kernel is idle and no cell is queued or running ([*]), twice in a row
    2 s apart (the kernel is idle for a moment between cells). If no cell has started after 15 s, Run All is
    clicked once more (noted in `problems` if that was needed and still failed). Prints progress every 30 s."""
    started, retried, quiet, last_print, prompts = False, False, 0, start, []
    while time.perf_counter() - start < timeout:
        state = page.evaluate(_STATUS_JS)
        prompts = [p.strip() for p in state["prompts"]]
        running = sum(p == "[*]:" for p in prompts)
        started = started or running > 0 or (prompts and all(re.fullmatch(r"\[\d+\]:", p) for p in prompts))
        if started and not running and state["status"] == "idle":
            quiet += 1
            if quiet >= 2:
                return True
        else:
            quiet = 0
        if not started and time.perf_counter() - start > 15 and not retried:
            print("  JupyterLab: no cell started 15 s after Run All Cells; clicking it again", flush=True)
            retried = True
            run_all()
        if not started and time.perf_counter() - start > 45:
            problems.append(
                f"Run All Cells (clicked twice) started no cell in 45 s (prompts: {prompts[:5]}...)"
            )
            return False
        if time.perf_counter() - last_print > 30:
            last_print = time.perf_counter()
            done = sum(bool(re.fullmatch(r"\[\d+\]:", p)) for p in prompts)
            print(
                f"  JupyterLab: {done}/{len(prompts)} cells run, kernel {state['status']}, {last_print - start:.0f} s",
                flush=True,
            )
        time.sleep(2)
    running = [f"code cell {i}" for i, p in enumerate(prompts, 1) if p == "[*]:"]
    problems.append(
        f"the run did not finish within its {timeout:.0f} s budget (running then: {', '.join(running) or 'none'})"
    )
    return False


def _screenshot(page, path: Path) -> None:
    """The whole notebook in one image: from its top, in a window tall enough for every cell (at most
    30000 px). JupyterLab leaves the notebook scrolled to the last cell run, and pads its end with a
    window's height ("scroll past end"): the height is measured to the last cell's bottom, at the top."""
    js = """() => {
      const outer = document.querySelector('.jp-NotebookPanel .jp-WindowedPanel-outer');
      const cells = document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-Cell');
      if (!outer || !cells.length) return 0;
      outer.scrollTop = 0;
      const bottom = cells[cells.length - 1].getBoundingClientRect().bottom;
      return Math.ceil(bottom - outer.getBoundingClientRect().top - outer.clientHeight);
    }"""
    hidden = page.evaluate(js)  # how much of the notebook is below the window
    if hidden > 0:
        size = page.viewport_size or {"width": 1280, "height": 1000}
        page.set_viewport_size({"width": size["width"], "height": min(size["height"] + hidden + 40, 30000)})
        page.wait_for_timeout(1000)  # layout
        page.evaluate(js)  # back to the top after the resize
    page.wait_for_timeout(500)
    page.screenshot(path=str(path), full_page=True)
