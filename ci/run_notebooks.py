"""`make run`: execute the notebooks in notebooks/ in smoke mode with papermill, then summarise.

Writes runs/<timestamp>/ with, per notebook, the executed notebook (all of its outputs; written also when
a cell fails), its results JSON and NAME.log (everything it printed, unfiltered: the cells' stdout and
stderr as they came, the kernel's own messages, papermill's log); then summary.md, summary.json and
summary.html (ci/run_summary.py: per notebook the status, wall time, the numbers the lesson is about and
the loss curve). Only SMOKE_TEST and RESULTS_PATH are passed to the notebooks. Smoke mode needs no
network, so the Hugging Face libraries are told to stay offline.

While it works it prints what a person can follow (`Progress`): the notebook and the section (the
Markdown heading) being executed, the training lines (step and loss, at most one every 2 s per
notebook, always the last), evaluations, the killed worker and the resume; not the rest (Ray's
prefixes and colours, warnings, progress bars, module dumps, blank lines), which is in NAME.log.

The notebooks run on one local Ray (`local_cluster.up_ray`: one node with token auth), started before the
first and stopped after the last by its process ids, which each attaches to as to a cluster; on the
cluster at `RAY_ADDRESS` where the shell has one.

`--notebook NAME[,NAME...]` (`make run NOTEBOOK=llama_fsdp`): only those notebooks.
`--cluster` (`make run CLUSTER=1`): start the local cluster first (ci/local_cluster.py: two Ray nodes,
an S3 bucket), run the notebooks on it with `STORAGE_PATH` in the bucket, and stop it at the end,
also when a notebook fails or the run is interrupted.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import logging
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

from ci.run_summary import final_number, load_results, write_summaries

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"

# ------------------------------------------------------------------------------------------- progress

ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
# Ray's prefix of a line forwarded from a worker: "(RayTrainWorker pid=11428, ip=10.0.0.2) ", "(raylet) "
RAY_PREFIX = re.compile(r"^\((?:[^()]|\([^()]*\))*?(?:\bpid=\d+|\braylet\b|\bautoscaler\b)[^()]*\)\s?")
RAY_REPEATED = re.compile(r"\s*\[repeated \d+x across cluster\].*$")
TQDM = re.compile(
    r"^(?P<desc>[^|]*?):?\s*(?:\d+%)?\|[^|]*\|\s*(?P<n>\d+)/(?P<total>\d+|\?)\s*\[(?P<info>[^\]]*)\]"
)
TQDM_LOSS = re.compile(r"(\w*loss\w*)=([-+\d.eE]+|nan|inf)")
STEP_LOSS = re.compile(r"\bstep\s+\d+(?:/\d+)?\b.*\bloss\b", re.IGNORECASE)
# The notebooks' own lines (the run log's, printed by harness.run_log.show_progress) and, where a notebook shows
# its workers' output (harness.cluster.ray_log_file(show_worker_logs=True)), Ray's and the frameworks' lines.
ALERTS = re.compile(
    r"killing my own process|kills its own process|^Ray Train started a new worker group|^rank 1 died at step"
    r"|^A worker died or was killed|^\[FailurePolicy\]|^Killed at step"
)
NOTES = re.compile(
    r"^(?:Finished\b|Resumed\b|Restored all states|Started training worker group|It fits:|evaluated at step"
    r"|Done in\b)"
)
MAX_LINE = 160
print_now = functools.partial(print, flush=True)


def _shorten(text: str) -> str:
    """A long line down to its first sentence, or to MAX_LINE characters."""
    if len(text) <= MAX_LINE:
        return text
    end = text.find(". ", 40)
    return text[: end + 1] if 0 < end < MAX_LINE else text[: MAX_LINE - 1] + "…"


def _hf_log(text: str) -> tuple[str, str] | None:
    """The Hugging Face Trainer's log dicts: {'loss': ..., 'epoch': ...}, the eval dict, the final one."""
    try:
        logs = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    if not isinstance(logs, dict):
        return None
    epoch = f"epoch {logs['epoch']} " if "epoch" in logs else ""
    if "loss" in logs:
        lr = f" lr {logs['learning_rate']}" if "learning_rate" in logs else ""
        return "step", f"{epoch}loss {logs['loss']}{lr}"
    evals = {
        k.removeprefix("eval_"): v
        for k, v in logs.items()
        if k.startswith("eval_") and k != "eval_runtime" and "per_second" not in k
    }
    if evals:
        where = f" ({epoch.strip()})" if epoch else ""
        return "note", f"eval{where}: " + ", ".join(f"{k} {v}" for k, v in evals.items())
    if "train_loss" in logs:
        runtime = f" in {logs['train_runtime']} s" if "train_runtime" in logs else ""
        return "note", f"trained: train_loss {logs['train_loss']}{runtime}"
    return None


def classify(line: str) -> tuple[str, str] | None:
    """One line of a cell's output -> ("step" | "note" | "alert", text to show), or None: not shown.

    `line` is one line as the kernel sent it (ANSI colours, Ray's prefix, carriage returns of a
    progress bar and all); the text shown is without them."""
    segments = [s for s in ANSI.sub("", line).split("\r") if s.strip()]
    if not segments:
        return None
    text = RAY_PREFIX.sub("", segments[-1])  # a progress bar's last state; Ray's prefix is on the first
    text = RAY_REPEATED.sub("", text).strip()
    text = text.removeprefix("INFO: ").strip()  # Lightning logs each message twice, once with INFO:
    if not text:
        return None
    bar = TQDM.match(text)
    if bar:  # a progress bar: shown only where it carries a loss (Lightning's train_loss=...)
        losses = TQDM_LOSS.findall(bar["info"])
        if not losses or bar["n"] == "0":  # at 0: the loss is the previous epoch's
            return None
        desc = bar["desc"].strip().lower()
        return "step", f"{desc} step {bar['n']}/{bar['total']} " + " ".join(f"{k} {v}" for k, v in losses)
    if text.startswith("{") and text.endswith("}"):
        return _hf_log(text)
    if ALERTS.search(text):
        return "alert", _shorten(text.rstrip(":"))
    if NOTES.search(text):
        return "note", _shorten(text.rstrip(":"))
    if STEP_LOSS.search(text):
        return "step", _shorten(" ".join(text.split()))
    return None


def _heading(markdown: str) -> str | None:
    """The last `##`-or-deeper heading of a Markdown cell, without its #s and inline markup."""
    found = None
    for line in markdown.splitlines():
        match = re.match(r"^#{2,6}\s+(.+?)\s*#*\s*$", line)
        if match:
            found = re.sub(r"`|\*\*|__", "", match.group(1)).strip()
    return found


class Progress:
    """What `make run` prints about one notebook while it runs (see the module docstring).

    `cell(cell)` for every cell as it starts (nbclient's on_cell_start), `feed(text, stream)` for the
    cells' output as it comes (any chunks: lines are put back together), `cell_done()` at the end of
    a cell. `write` prints one line; `clock` gives seconds (a fake one in the tests).
    """

    def __init__(
        self,
        name: str,
        write: Callable[[str], None] = print_now,
        clock: Callable[[], float] = time.monotonic,
        min_interval: float = 2.0,
    ) -> None:
        self.name, self.write, self.clock, self.min_interval = name, write, clock, min_interval
        self.started = clock()
        self.heading: str | None = None
        self._shown_heading: str | None = None
        self._buffers: dict[str, str] = {}
        self._pending: str | None = None  # the latest step line held back
        self._last_step: float | None = None
        self._last_line: str | None = None

    def stamp(self) -> str:
        seconds = int(self.clock() - self.started)
        return f"[{self.name} {seconds // 60}:{seconds % 60:02d}]"

    def start(self, detail: str = "") -> None:
        self.started = self.clock()
        self.write(f"{self.stamp()} started{detail}")

    def cell(self, cell) -> None:
        source = cell.get("source") or ""
        if cell.get("cell_type") == "markdown":
            self.heading = _heading(source) or self.heading
        elif cell.get("cell_type") == "code" and source.strip():
            self.cell_done()
            if self.heading and self.heading != self._shown_heading:
                self._shown_heading = self.heading
                self.write(f"{self.stamp()} § {self.heading}")

    def feed(self, text: str, stream: str = "stdout") -> None:
        buffer = self._buffers.get(stream, "") + text
        *lines, rest = buffer.split("\n")
        if len(rest) > 10_000 and "\r" in rest:  # a progress bar redrawn in place for a long time
            rest = "\r" + rest.rsplit("\r", 1)[-1]
        self._buffers[stream] = rest
        for line in lines:
            self._line(line)

    def cell_done(self) -> None:
        for stream, rest in list(self._buffers.items()):
            self._buffers[stream] = ""
            self._line(rest)
        self._flush()

    def alert(self, text: str) -> None:
        self._show("alert", text)

    def _line(self, line: str) -> None:
        shown = classify(line)
        if shown:
            self._show(*shown)

    def _show(self, kind: str, text: str) -> None:
        if kind == "step":
            now = self.clock()
            if self._last_step is not None and now - self._last_step < self.min_interval:
                self._pending = text
                return
            self._pending = None
            self._last_step = now
        else:
            self._flush()  # the step line held back comes first: it happened before this one
        if text == self._last_line:
            return
        self._last_line = text
        self.write(("  ! " if kind == "alert" else "    ") + text)

    def _flush(self) -> None:
        if self._pending:
            text, self._pending = self._pending, None
            self._last_step = self.clock()
            self._show_now(text)

    def _show_now(self, text: str) -> None:
        if text != self._last_line:
            self._last_line = text
            self.write("    " + text)


# ------------------------------------------------------------------------------------------- running


def select_notebooks(spec: str | None) -> list[Path]:
    """The notebooks `--notebook` names (comma-separated stems, file names or paths), in that order;
    all of them, sorted, without it. ValueError for a name that is not one of them."""
    available = sorted(NOTEBOOKS.glob("*.ipynb"))
    if not spec or not spec.strip():
        return available
    by_name = {p.stem: p for p in available}
    chosen = []
    for name in (n.strip() for n in spec.split(",")):
        stem = Path(name).name.removesuffix(".ipynb") if name else ""
        if stem not in by_name:
            raise ValueError(f"unknown notebook {name!r}; the notebooks are: {', '.join(by_name)}")
        if by_name[stem] not in chosen:
            chosen.append(by_name[stem])
    return chosen


def _notebook_title(path: Path) -> str:
    from basics.notebook_files import title

    try:
        return re.sub(r"[`*]", "", title(path))
    except Exception:  # noqa: BLE001 - the title is decoration
        return ""


class _Stream:
    """What papermill writes a cell's stdout or stderr to: the log, and `Progress`."""

    def __init__(self, name: str, log, progress: Progress) -> None:
        self.name, self.log, self.progress = name, log, progress

    def write(self, text: str) -> None:
        self.log.write(text)
        self.progress.feed(text, self.name)

    def flush(self) -> None:
        self.log.flush()


class _LogHandler(logging.Handler):
    """papermill's (and nbclient's) log: all of it into the log, warnings and errors shown too."""

    def __init__(self, log, progress: Progress) -> None:
        super().__init__(logging.INFO)
        self.log, self.progress = log, progress

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.log.write(f"[papermill {record.levelname}] {message}\n")
        if record.levelno >= logging.WARNING:
            self.progress.alert(_shorten(f"papermill: {message.strip().splitlines()[0]}"))


class FinishedRun:
    """Whether papermill ran a notebook's last cell without error, and a kernel manager that then ends the
    kernel at once (`on_cell_executed` goes to papermill, `kernel_manager(base)` as its manager class).

    After the last cell (the notebook's `ray.shutdown()`, every result written) the kernel's graceful exit has
    nothing left to do but Python's last garbage collection over torch, transformers and Ray: 2.5-3 s per
    notebook, measured. A run that failed keeps it: its atexit hooks stop a local Ray it left running.
    """

    def __init__(self, notebook: Path) -> None:
        from basics.notebook_files import cells

        # papermill adds one cell (the injected parameters): the last one it runs has this index
        self.last_cell = len(cells(notebook))
        self.done = False

    def on_cell_executed(self, cell, cell_index: int, execute_reply) -> None:
        if cell_index == self.last_cell and execute_reply.get("content", {}).get("status") == "ok":
            self.done = True

    def kernel_manager(self, base: type) -> type:
        run = self

        class EndsFinishedKernels(base):
            async def shutdown_kernel(self, now: bool = False, restart: bool = False):
                return await super().shutdown_kernel(now=now or run.done, restart=restart)

        return EndsFinishedKernels


def run_papermill(
    notebook: Path,
    output: Path,
    parameters: dict,
    *,
    kernel_env: Mapping[str, str] | None = None,
    kernel_output=None,
    timeout: float | None = None,
    on_cell_start: Callable | None = None,
    on_cell_executed: Callable | None = None,
    **streams,
) -> None:
    """Execute `notebook` into `output` with papermill, as `make run` and the tests both run it: in the
    notebook's folder, no progress bar, each cell within `timeout` seconds, and a kernel ended at once after
    a last cell that succeeded (`FinishedRun`).

    Args:
        kernel_env: the kernel's whole environment, so that runs in threads side by side never change this
            process's; None: this process's.
        kernel_output: a file for the kernel's own messages (e.g. "running over TCP without encryption").
        on_cell_start, on_cell_executed: papermill's hooks.
        streams: papermill's `stdout_file` and `stderr_file`.
    """
    import papermill
    from jupyter_client.manager import AsyncKernelManager

    finished = FinishedRun(notebook)

    class KernelManager(finished.kernel_manager(AsyncKernelManager)):
        async def start_kernel(self, **kw):
            if kernel_env is not None:
                kw["env"] = dict(kernel_env)
            if kernel_output is not None:
                kw.setdefault("stdout", kernel_output)
                kw.setdefault("stderr", kernel_output)
            return await super().start_kernel(**kw)

    def executed(cell, cell_index: int, execute_reply) -> None:
        finished.on_cell_executed(cell, cell_index, execute_reply)
        if on_cell_executed is not None:
            on_cell_executed(cell, cell_index, execute_reply)

    papermill.execute_notebook(
        str(notebook),
        str(output),
        parameters=parameters,
        kernel_name="python3",
        cwd=str(notebook.parent),
        execution_timeout=timeout,
        progress_bar=False,
        kernel_manager_class=KernelManager,
        on_cell_start=on_cell_start,
        on_cell_executed=executed,
        **streams,
    )


def execute(notebook: Path, run_dir: Path, progress: Progress) -> tuple[str, str]:
    """Run one notebook with papermill into `run_dir` (executed notebook, NAME.log, the results JSON the
    notebook writes); return (status, error)."""
    name = notebook.stem
    results_path = run_dir / f"{name}.json"
    with open(run_dir / f"{name}.log", "a", buffering=1, encoding="utf-8", errors="replace") as log:

        def on_cell_executed(cell, cell_index: int, execute_reply) -> None:
            progress.cell_done()

        def on_cell_start(cell, cell_index: int) -> None:
            progress.cell(cell)
            if cell.cell_type == "code" and cell.source.strip():
                where = f" - § {progress.heading}" if progress.heading else ""
                log.write(f"\n----- cell {cell_index}{where} -----\n")

        def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
            log.write(warnings.formatwarning(message, category, filename, lineno, line))

        logger = logging.getLogger("papermill")
        handler, level, propagate = _LogHandler(log, progress), logger.level, logger.propagate
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        status, error = "ok", ""
        try:
            with warnings.catch_warnings():
                warnings.showwarning = show_warning  # this process's warnings: into the log too
                run_papermill(
                    notebook,
                    run_dir / f"{name}.ipynb",
                    {"SMOKE_TEST": True, "RESULTS_PATH": str(results_path)},
                    kernel_output=log,
                    on_cell_start=on_cell_start,
                    on_cell_executed=on_cell_executed,
                    stdout_file=_Stream("stdout", log, progress),
                    stderr_file=_Stream("stderr", log, progress),
                )
        except Exception as exc:  # noqa: BLE001 - recorded in the summary, the run goes on
            status, error = "failed", f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"
            log.write(f"\n----- failed: {exc}\n")
        finally:
            progress.cell_done()
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate
    if status == "ok" and not results_path.exists():
        status, error = "failed", "no results file written"
    return status, error


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def where_it_runs() -> str:
    """Which cluster and storage the notebooks will use, from this shell's environment (an old
    `source cluster.env` or a workspace's variables count), the credentials in a URI masked."""
    from harness.storage import redact

    ray_address = os.environ.get("RAY_ADDRESS")
    storage = os.environ.get("STORAGE_PATH")
    cluster = f"the Ray cluster at RAY_ADDRESS={ray_address}" if ray_address else "a local Ray per notebook"
    if os.environ.get("RAY_AUTH_TOKEN_PATH", "").startswith(str(ROOT / ".ray-run")):
        cluster = f"one local Ray for all of them, at {ray_address}"
    where = (
        f"STORAGE_PATH={redact(storage)}" if storage else "each notebook's local folder (no STORAGE_PATH set)"
    )
    return f"Cluster: {cluster}. Checkpoints: {where}."


def environment() -> dict:
    """Where the run ran: the docs site's pages quote it under outputs taken from this run."""
    import importlib.metadata
    import platform

    names = ("torch", "ray", "transformers", "deepspeed", "lightning")
    versions = ", ".join(f"{n} {importlib.metadata.version(n)}" for n in names)
    return {"python": platform.python_version(), "cores": os.cpu_count(), "versions": versions}


def run(notebooks: list[Path], tag: str = "") -> int:
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.pop("MPLBACKEND", None)  # the kernel's inline backend: plots are kept as outputs (docs pages)
    os.environ.setdefault("JUPYTER_PLATFORM_DIRS", "1")  # no "Jupyter is migrating its paths" warning
    run_dir = ROOT / "runs" / (time.strftime("%Y%m%d-%H%M%S") + (f"-{tag}" if tag else ""))
    run_dir.mkdir(parents=True)
    (run_dir / "environment.json").write_text(json.dumps(environment()))  # for the docs pages' notes
    print(
        f"{len(notebooks)} notebook(s) in smoke mode: {', '.join(p.stem for p in notebooks)}\n"
        f"{where_it_runs()}\n"
        f"Run folder: {_rel(run_dir)} (NAME.log there: everything a notebook printed)",
        flush=True,
    )
    rows = []
    for notebook in notebooks:
        name = notebook.stem
        progress = Progress(name)
        progress.start()
        start = time.perf_counter()
        status, error = execute(notebook, run_dir, progress)
        wall = time.perf_counter() - start
        results = load_results(run_dir / f"{name}.json")
        rows.append(
            {
                "notebook": name,
                "status": status,
                "wall_seconds": round(wall, 1),
                "final": final_number(results) if results else "-",
                "error": error,
                "title": _notebook_title(notebook),
            }
        )
        print(f"{progress.stamp()} {status} in {wall:.0f} s: {rows[-1]['final']}", flush=True)
        if error:
            print(f"  ! {error}\n    see {_rel(run_dir / f'{name}.log')} and {name}.ipynb there", flush=True)

    markdown = write_summaries(run_dir, rows, title=run_dir.name)
    print("\n" + markdown.rstrip())
    print(f"\nRun folder: {_rel(run_dir)}\nSummary:    {_rel(run_dir / 'summary.html')}")
    return 1 if any(r["status"] != "ok" for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cluster", action="store_true", help="on the local two-node cluster with S3 storage"
    )
    parser.add_argument(
        "--notebook",
        metavar="NAME[,NAME...]",
        help="only these notebooks (names in notebooks/, without .ipynb); default: all",
    )
    args = parser.parse_args(argv)
    try:
        notebooks = select_notebooks(args.notebook)
    except ValueError as exc:
        parser.error(str(exc))
    if args.cluster:
        from ci import local_cluster

        state, env_file = ROOT / ".cluster-run", ROOT / ".cluster-run" / "cluster.env"
        start = time.perf_counter()
        try:  # stops what an interrupted run left, never another live run's cluster
            driver = local_cluster.up(state, env_file)
        except local_cluster.ClusterBusy as exc:
            print(f"Not started: {exc}", file=sys.stderr)
            return 1
        print(
            f"Cluster up in {time.perf_counter() - start:.0f} s: 2 Ray nodes, bucket {driver['STORAGE_PATH']}"
        )
        os.environ.update(driver)
        try:
            return run(notebooks, tag="cluster")
        finally:
            local_cluster.down(state, env_file)
    if os.environ.get("RAY_ADDRESS"):  # a cluster of the user's: every notebook attaches to it
        return run(notebooks)
    return run_on_one_ray(notebooks)


def run_on_one_ray(notebooks: list[Path]) -> int:
    """Run the notebooks on one local Ray, started here and stopped after them, each attaching to it as to
    a cluster: a notebook's own `ray.init` and `ray.shutdown` cost 5-6 s of 2 cores each time."""
    from ci import local_cluster

    state = ROOT / ".ray-run"
    start = time.perf_counter()
    try:
        driver = local_cluster.up_ray(state, cpus=max(4, 2 * (os.cpu_count() or 1)))
    except local_cluster.ClusterBusy as exc:
        print(f"Not started: {exc}", file=sys.stderr)
        return 1
    print(f"Ray up in {time.perf_counter() - start:.0f} s: one local node, shared by the notebooks")
    from harness.cluster import LOCAL_RAY_ENV

    driver = {**LOCAL_RAY_ENV, **driver}  # the drivers' settings for a Ray on this machine, as their own
    os.environ.update(driver)
    try:
        return run(notebooks)
    finally:
        for var in driver:
            os.environ.pop(var, None)
        local_cluster.down(state, state / "cluster.env", quiet=True)


if __name__ == "__main__":
    sys.exit(main())
