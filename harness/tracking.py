"""Runs you can find again: every notebook's run in MLflow, one MLflow run per training run.

Used by each notebook's watch (`helpers.watch`: `start_run`, and `BackgroundLogger` in the run's `RunLog`
actor, which logs what the observers send it), its
section "Going further: tracking" (`ui_command`, `_metric_steps`), and its last cell, where
`helpers.write_results` ends the run with the run's summary (`finish_run`). The set-up checks
(`check_tracking`, `check_tracking_from_nodes`) fail in the first cells.

Where runs go:

- `MLFLOW_TRACKING_URI` when it is set (a team's tracking server, Databricks, the local cluster's server
  that `make cluster-up` starts). It reaches every worker with the job's environment; its credentials
  (`MLFLOW_TRACKING_TOKEN`, `MLFLOW_TRACKING_PASSWORD`, `DATABRICKS_TOKEN`) do too, but never as
  environment variables of the job, which Ray logs (see `harness.cluster.job_runtime_env`).
- Otherwise a SQLite file in this project's cache (`_default_uri`): no server. Every worker must be able to
  open that file, so it serves a Ray on this machine (or the local two-node cluster), not workers on other
  machines; `check_tracking_from_nodes` says so in the first cells.

One MLflow run per training run: the driver creates the run before `fit()` and hands its id to the
workers in the training config. Every attempt's rank 0 logs into that run, so a restarted worker group
continues the same curves. Steps a resumed attempt runs again (those after its checkpoint that the
killed attempt had already logged) are not logged twice: each attempt starts by reading how far each of
the run's metrics got, and logs a metric only at the steps after that. Where an attempt resumed shows as a
point of the metric `resumed_from_step` (and `world_size`, the workers of that attempt).

MLflow's telemetry is switched off (`MLFLOW_DISABLE_TELEMETRY`): nothing here talks to any address but
the tracking URI.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

__all__ = [
    "TRACKING_ENV_VARS",
    "TRACKING_SECRET_VARS",
    "tracking_uri",
    "configure",
    "check_tracking",
    "best_effort",
    "start_run",
    "BackgroundLogger",
    "finish_run",
    "show_run",
    "ui_command",
]

# Passed to every worker with the job (not secret): where the runs go and how to reach it.
TRACKING_ENV_VARS = (
    "MLFLOW_TRACKING_URI",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_INSECURE_TLS",
    "MLFLOW_TRACKING_SERVER_CERT_PATH",
    "MLFLOW_TRACKING_CLIENT_CERT_PATH",
    "DATABRICKS_HOST",
    "DATABRICKS_CLIENT_ID",
)
# Secrets: set in each worker process by the job's setup hook, never in a log or the job table.
TRACKING_SECRET_VARS = (
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_TRACKING_PASSWORD",
    "DATABRICKS_TOKEN",
    "DATABRICKS_CLIENT_SECRET",
)
# Set in the driver and every worker: nothing leaves for MLflow's own servers.
OFFLINE_ENV = {"MLFLOW_DISABLE_TELEMETRY": "true"}
URI = "MLFLOW_TRACKING_URI"
RESUMED = "resumed_from_step"  # the metric that marks where an attempt resumed
_LOCAL_SCHEMES = ("sqlite", "file", "")
# MLflow's own names for hosted stores, written without "://": not folders.
_HOSTED_NAMES = ("databricks", "databricks-uc", "uc")


def _is_local(uri: str) -> bool:
    """Whether MLflow keeps the runs at `uri` in a file or folder of this machine (sqlite:, file:, a path)."""
    if uri.split(":", 1)[0] in _HOSTED_NAMES:
        return False
    return urlparse(uri).scheme in _LOCAL_SCHEMES


# MLflow's client retries a request 7 times with backoff, 120 s each (minutes in all) before it raises. Where
# a tracking call must not hold the run (its summary, marking it failed), it gets one retry of 10 s.
BOUNDED_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


@contextlib.contextmanager
def _bounded():
    """MLflow's HTTP requests inside the block: BOUNDED_HTTP (MLflow reads these at each request)."""
    saved = {k: os.environ.get(k) for k in BOUNDED_HTTP}
    os.environ.update(BOUNDED_HTTP)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def best_effort(call, failed, default=None):
    """`call()` with MLflow's requests bounded (BOUNDED_HTTP). Where it raises: `default`, and one printed line,
    `failed(uri, error)` (the tracking URI with credentials masked, the exception's class): tracking is a
    record of the run, never a reason to fail or hold it."""
    try:
        with _bounded():
            return call()
    except Exception as exc:  # noqa: BLE001 - tracking is a record of the run, not the run
        print(failed(_shown(tracking_uri()), exc.__class__.__name__))
        return default


def _default_uri() -> str:
    """The embedded store: `sqlite:///<cache>/mlflow/mlflow.db` (`harness.cache.cache_dir`)."""
    from harness.cache import cache_dir

    folder = cache_dir() / "mlflow"
    folder.mkdir(exist_ok=True)
    return f"sqlite:///{folder / 'mlflow.db'}"


def _artifact_root() -> str:
    from harness.cache import cache_dir

    return (cache_dir() / "mlflow" / "artifacts").as_uri()


def tracking_uri() -> str:
    """`MLFLOW_TRACKING_URI`, or the embedded store (`_default_uri`)."""
    return os.environ.get(URI) or _default_uri()


def _shown(uri: str) -> str:
    from harness.storage import redact

    return redact(uri)


def configure() -> str:
    """In the driver, before Ray starts: the tracking URI in this process's environment (so that a local
    Ray's workers inherit it and a cluster's get it with the job) and MLflow's telemetry off. Returns it."""
    for var, value in OFFLINE_ENV.items():
        os.environ.setdefault(var, value)
    os.environ.setdefault(URI, _default_uri())
    return os.environ[URI]


def check_tracking() -> str:
    """Fail now, naming `MLFLOW_TRACKING_URI`, if runs could not be tracked: credentials written into the
    URI, or a tracking server that does not answer within 5 s. Returns the URI (credentials masked)."""
    from basics.validate import ParameterError

    uri = tracking_uri()
    shown = _shown(uri)
    if shown != uri:
        raise ParameterError(
            f"{URI}={shown!r}: credentials in the URI are not accepted (they would be repeated in logs). "
            "Set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN, instead."
        )
    scheme = urlparse(uri).scheme
    if scheme in ("http", "https"):
        if reason := _no_answer(uri, timeout=5):
            raise ParameterError(
                f"{URI}={shown!r}: no tracking server answers there ({reason}). Start it, correct the "
                f"address, or unset {URI} to keep runs in this machine's store ({_default_uri()})."
            )
        if reason := _credential_refused(uri, timeout=5):
            raise ParameterError(
                f"{URI}={shown!r}: the tracking server refuses this notebook's credential ({reason}). Set "
                "MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, to one it takes."
            )
    elif _is_local(uri):
        path = Path(urlparse(uri).path if scheme else uri)
        folder = path.parent if scheme == "sqlite" else path
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK):
            raise ParameterError(f"{URI}={shown!r}: cannot write to {folder}.")
    return shown


def _no_answer(uri: str, timeout: float) -> str | None:
    """Why no tracking server answers at `uri` within `timeout` s (None: one answers, or the store is a
    local file). Any HTTP answer, even 401, means a server is there; MLflow's own retries take minutes."""
    if urlparse(uri).scheme not in ("http", "https"):
        return None
    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout).close()
    except urllib.error.HTTPError:
        return None
    except (OSError, ValueError) as exc:
        return str(getattr(exc, "reason", exc))
    return None


def _credential_refused(uri: str, timeout: float) -> str | None:
    """Why the server at `uri` refuses the credential MLflow's client would send (None: it takes it), from
    one authenticated request bounded by `timeout` (`/health` needs none: a 401 there says nothing)."""
    import base64

    request = urllib.request.Request(
        uri.rstrip("/") + "/api/2.0/mlflow/experiments/get-by-name?experiment_name=Default"
    )
    if token := os.environ.get("MLFLOW_TRACKING_TOKEN"):
        request.add_header("Authorization", f"Bearer {token}")
    elif user := os.environ.get("MLFLOW_TRACKING_USERNAME"):
        pair = f"{user}:{os.environ.get('MLFLOW_TRACKING_PASSWORD', '')}".encode()
        request.add_header("Authorization", f"Basic {base64.b64encode(pair).decode()}")
    try:
        urllib.request.urlopen(request, timeout=timeout).close()
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}" if exc.code in (401, 403) else None
    except (OSError, ValueError) as exc:
        return str(getattr(exc, "reason", exc))
    return None


def check_tracking_from_nodes() -> None:
    """Right after Ray starts: a store on this machine's disk (the embedded default) serves this notebook
    and the run log, which lives on the head node (no worker writes to MLflow): fine where this notebook
    runs on the head node. Fail, naming `MLFLOW_TRACKING_URI`, where it does not."""
    import ray

    from basics.validate import ParameterError

    uri = tracking_uri()
    if not _is_local(uri):
        return
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    head = [n for n in nodes if "node:__internal_head__" in n.get("Resources", {})]
    here = ray.get_runtime_context().get_node_id()
    if head and head[0]["NodeID"] != here:
        raise ParameterError(
            f"{URI} is {'not set' if URI not in os.environ else repr(_shown(uri))}: runs would go to a file on "
            f"this machine ({uri}), but the run log that writes them lives on the head node "
            f"({head[0].get('NodeManagerAddress')}). Set {URI} to a tracking server the head node reaches, "
            "or run this notebook on the head node."
        )


def _client():
    for var, value in OFFLINE_ENV.items():
        os.environ.setdefault(var, value)
    import logging

    from mlflow.tracking import MlflowClient

    # "Creating initial MLflow database tables...": once per store, nothing to act on
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
    return MlflowClient(tracking_uri=tracking_uri())


def start_run(notebook: str, namespace: dict) -> str:
    """In the driver, before `fit()`: a new MLflow run in the experiment named after `notebook`, with the
    notebook's parameters as the run uses them (`harness.parameters.parameter_values`); return its id."""
    from mlflow.entities import Param

    from harness.parameters import parameter_values

    client = _client()
    experiment = client.get_experiment_by_name(notebook)
    if experiment is None:
        local = _is_local(tracking_uri())
        # A server chooses where artifacts go; the embedded store would choose ./mlruns, beside the notebook.
        with contextlib.suppress(Exception):  # another run created it first
            client.create_experiment(notebook, artifact_location=_artifact_root() if local else None)
        experiment = client.get_experiment_by_name(notebook)
    values = parameter_values(namespace)
    storage = values.get("STORAGE_PATH", "")
    run = client.create_run(
        experiment.experiment_id,
        tags={
            "notebook": notebook,
            "smoke_test": str(values.get("SMOKE_TEST")),
            "storage_path": storage,
            "helpers_path": str(Path(__file__).resolve().parent),  # which copy ran: a Ray Job ships its own
        },
    )
    params = [Param(k, str(v)) for k, v in values.items()]
    for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters per call
        client.log_batch(run.info.run_id, params=params[i : i + 100])
    _fail_run_on_error(run.info.run_id)
    return run.info.run_id


_FAILURE_HOOKS: dict[str, object] = {}  # run id: the IPython hook that marks it FAILED


def _fail_run_on_error(run_id: str) -> None:
    """In a notebook: the first cell that raises after the run started marks the run FAILED (it would stay
    RUNNING for ever otherwise). The mark is best-effort and bounded (BOUNDED_HTTP); `finish_run` removes it."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return

    def after_cell(result) -> None:
        if result.error_in_exec is None:
            return
        _forget_failure_hook(run_id)
        best_effort(  # the cell's own error is what the reader must see
            lambda: _client().set_terminated(run_id, "FAILED"),
            lambda uri, error: f"MLflow: could not mark run {run_id} FAILED at {uri} ({error})",
        )

    _FAILURE_HOOKS[run_id] = (shell, after_cell)
    shell.events.register("post_run_cell", after_cell)


def _forget_failure_hook(run_id: str) -> None:
    shell, hook = _FAILURE_HOOKS.pop(run_id, (None, None))
    if shell is not None:
        with contextlib.suppress(ValueError):
            shell.events.unregister("post_run_cell", hook)


def _last_steps(client, run_id: str) -> dict[str, int]:
    """For each metric of the run (markers apart), the highest step logged so far ({} for a new run)."""
    run = client.get_run(run_id)
    return {
        key: max(m.step for m in client.get_metric_history(run_id, key))
        for key in run.data.metrics
        if key not in (RESUMED, "world_size")
    }


class _StepLogger:
    """Log step metrics into the run `run_id`, but a metric at a step that an earlier logger of the run
    already reached (a resumed `fit()` that continues the run starts where the run's metrics got to)."""

    def __init__(self, run_id: str) -> None:
        self.client, self.run_id = _client(), run_id
        self.logged_until = _last_steps(self.client, run_id)  # per metric: steps up to here are replays

    def new(self, step: int, metrics: dict) -> dict:
        """The `metrics` that no earlier attempt logged at `step` or later."""
        return {k: v for k, v in metrics.items() if step > self.logged_until.get(k, 0)}

    def log(self, step: int, **metrics) -> bool:
        """Log `metrics` (name=number) at `step`, but those an earlier attempt logged; True if any was logged."""
        fresh = self.new(step, {k: v for k, v in metrics.items() if isinstance(v, int | float)})
        self.log_all(step, fresh)
        return bool(fresh)

    def log_all(self, step: int, metrics: dict) -> None:
        """Log `metrics` at `step`, whatever was logged before (the markers of a new attempt)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, int(step)) for k, v in metrics.items()]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)


class BackgroundLogger:
    """Log a run's step metrics into MLflow from a thread of its own, so that no caller ever waits for the
    server: `RunLog`, the actor that outlives the workers, uses it, and the training code never calls MLflow.

    Each request is bounded (BOUNDED_HTTP: one retry, 10 s). A server that is down, paused or refuses the
    credential costs the metrics it misses, never a training step: the first failure calls `warn` once with a
    line naming the server, and the thread goes on with the next metrics (a server back later gets them).
    """

    def __init__(self, run_id: str, warn) -> None:
        import queue

        self.run_id, self.warn, self.queue = run_id, warn, queue.Queue()
        self.warned = False
        self.thread = threading.Thread(target=self._run, name="mlflow-logger", daemon=True)
        self.thread.start()

    def log(self, step: int, metrics: dict) -> None:
        self.queue.put(("log", step, metrics))

    def mark(self, step: int, metrics: dict) -> None:
        """Markers (`resumed_from_step`, `world_size`): logged whatever an earlier attempt logged."""
        self.queue.put(("mark", step, metrics))

    def flush(self, timeout: float) -> int:
        """Wait at most `timeout` seconds for what was queued (not at all once a request failed: the server
        is known not to answer); return how many entries are still waiting, warning once if any are."""
        waiting = self.queue.unfinished_tasks and not self.warned
        if waiting and (reason := _no_answer(tracking_uri(), timeout=2)):  # no server: no point in waiting
            self._warn_once(f"does not answer ({reason})")
        deadline = time.monotonic() + (0 if self.warned else timeout)
        while self.queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.1)
        left = self.queue.unfinished_tasks
        if left:
            self._warn_once(f"did not take {left} metric update(s) within {timeout:.0f} s")

        return left

    def _warn_once(self, what: str) -> None:
        if not self.warned:
            self.warned = True
            self.warn(
                f"warning: MLflow at {_shown(tracking_uri())} {what}; training goes on, and the run there "
                "misses what it does not get"
            )

    def _run(self) -> None:
        os.environ.update(BOUNDED_HTTP)  # this process only logs from here
        steps = None
        while True:
            kind, step, metrics = self.queue.get()
            try:
                if steps is None:  # what earlier attempts of the run logged: their steps are not logged again
                    steps = _StepLogger(self.run_id)
                if kind == "mark":
                    steps.log_all(step, metrics)
                else:
                    steps.log(step, **metrics)
            except Exception as exc:  # noqa: BLE001 - reported once; the run goes on
                self._warn_once(f"did not take step {step}'s metrics ({exc.__class__.__name__})")
            finally:
                self.queue.task_done()


def _flat(results: dict) -> tuple[dict, dict]:
    """The results' numbers as metrics (one level of dicts flattened, `a.b`) and a few facts as tags."""
    metrics: dict[str, float] = {}
    for key, value in results.items():
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, v in items:
            if isinstance(v, bool) or not isinstance(v, int | float):
                continue
            metrics[f"{key}.{sub}" if sub else key] = float(v)
    tags = {"checkpoint_uri": str(results.get("checkpoint_path", ""))}
    kill = results.get("kill") or {}
    if kill:
        tags.update(
            killed_worker_at_step=str(kill.get("at_step")),
            resumed_from_step=str(kill.get("resumed_from_step")),
        )
    rows = (results.get("plan") or {}).get("rows") or []
    if rows:  # the "will it fit?" plan's verdict: its fullest row
        row = max(rows, key=lambda r: r["need"] / r["have"] if r["have"] else 0)
        share = row["need"] / row["have"] if row["have"] else 0
        tags["plan_verdict"] = f"{row['status']}: {row['what']} ({row['where']}) {share:.0%}"
    return metrics, tags


def finish_run(run_id: str, results: dict) -> dict:
    """In the driver, at the end: the run's summary (its numbers, the checkpoint's URI, the kill and the
    step it resumed from, the plan's verdict) into the run, `results.json` as an artifact, status FINISHED.
    Returns where to find it: `tracking_uri` (credentials masked), `experiment_id`, and `run_url` (a
    server's page for the run; None for the embedded store)."""
    import json

    from mlflow.entities import Metric, RunTag

    _forget_failure_hook(run_id)
    if reason := _no_answer(tracking_uri(), timeout=3):
        raise ConnectionError(reason)
    client = _client()
    metrics, tags = _flat({k: v for k, v in results.items() if k not in ("losses", "parameters")})
    last = max(0, len(results.get("losses") or []))
    now = int(time.time() * 1000)
    client.log_batch(
        run_id,
        metrics=[Metric(f"final.{k}", v, now, last) for k, v in metrics.items()],
        tags=[RunTag(k, v) for k, v in tags.items()],
    )
    client.log_text(run_id, json.dumps(results, indent=2, default=float), "results.json")
    client.set_terminated(run_id, "FINISHED")
    uri, experiment = _shown(tracking_uri()), client.get_run(run_id).info.experiment_id
    page = f"{uri.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}"
    return {
        "tracking_uri": uri,
        "experiment_id": experiment,
        "run_url": page if urlparse(uri).scheme in ("http", "https") else None,
    }


def _metric_steps(run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of every point of the run's metric `key`, in order of step."""
    if reason := _no_answer(tracking_uri(), timeout=3):
        raise ConnectionError(reason)
    with _bounded():
        history = _client().get_metric_history(run_id, key)
    return sorted((m.step, m.value) for m in history)


def show_run(run_id: str, key: str = "loss") -> None:
    """Print what the MLflow run `run_id` holds of the metric `key` (its steps, each once), where new worker
    groups resumed, and how to open MLflow's UI on it; one line instead where the server does not answer."""
    try:
        points = _metric_steps(run_id, key)
        resumed_at = [int(step) for step, _ in _metric_steps(run_id, RESUMED)]
    except Exception as exc:  # noqa: BLE001 - a record of the run, not the run
        print(
            f"MLflow at {_shown(tracking_uri())} did not answer ({exc.__class__.__name__}): nothing to read back"
        )
        return
    steps = [step for step, _ in points]
    if steps:
        once = "each once" if len(steps) == len(set(steps)) else "some twice"
        print(f"MLflow run {run_id}: {len(steps)} {key} points, steps {steps[0]} to {steps[-1]}, {once}")
    else:
        print(f"MLflow run {run_id}: no {key} points")
    print(f"a new worker group resumed at step(s) {resumed_at}" if resumed_at else "no restart")
    print("To look at it:", ui_command())


def ui_command() -> str:
    """How to look at the runs: the MLflow UI on the embedded store, or the server's address."""
    uri = tracking_uri()
    if urlparse(uri).scheme in ("http", "https"):
        return f"open {_shown(uri)} in a browser"
    from harness.storage import shown

    return f"mlflow ui --backend-store-uri {shown(uri, shell=True)}"
