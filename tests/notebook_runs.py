"""Test plumbing: run a notebook and return what it wrote, read the test cluster's bucket, pinned losses.

The tests import what they need from here (`from notebook_runs import smoke_nbval, listing`); conftest.py
holds only pytest's hooks and fixtures (the offline guard, and the `ray_cluster` fixture, which starts the
test cluster with `start_cluster` and stops it with `stop_cluster`). Importing this module starts nothing
and writes nothing.

Pinned smoke losses live in tests/assets/losses/<notebook>.txt: a `#` header that says where and how they
were measured and their tolerance, then one `step loss` pair per line. After a change that moves them on
purpose, re-pin from a run's results JSON (the nbval tests copy theirs to test-artifacts/notebooks/
<notebook>-nbval.json, the JupyterLab runs to <notebook>-jupyterlab.json; `make run` writes
runs/<timestamp>/<notebook>.json):

    .venv/bin/python tests/notebook_runs.py repin llama_fsdp test-artifacts/notebooks/llama_fsdp-nbval.json
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.notebooks import NAMES, notebook

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
ARTIFACTS = ROOT / "test-artifacts"
GUARD_LOG = ARTIFACTS / "offline-guard.log"  # the offline guard's record (see conftest.py and ci/offline)
CLUSTER_DIR = ARTIFACTS / "cluster"
LOSSES = Path(__file__).resolve().parent / "assets" / "losses"
# Canaries: a Hub token (conftest sets it as the session's HF_TOKEN; the Hub is offline), the secret of
# a STORAGE_PATH that carries credentials (test_bad_input.py) and one below. No file the session writes may
# hold them.
CANARY_HF_TOKEN = f"hf_canary{uuid.uuid4().hex}"
CANARY_STORAGE_SECRET = f"canarysecret{uuid.uuid4().hex}"
# A credential in the shell that starts the cluster (conftest sets it): no cluster process may have it.
CANARY_SHELL_VAR = "GITHUB_TOKEN"
CANARY_SHELL_SECRET = f"ghp_canary{uuid.uuid4().hex}"


# ---- the test cluster ------------------------------------------------------------------------


def local_cluster_module():
    """ci/local_cluster.py, imported on first use."""
    from ci import local_cluster

    return local_cluster


def start_cluster() -> dict:
    """Start the test cluster every notebook runs on; return the driver's variables.

    The cluster `make cluster-up` starts (ci/local_cluster.py): two Ray nodes, each with its own raylet
    and object store, with token authentication on, and an S3 server with a bucket. The notebooks attach
    to it through `RAY_ADDRESS` and the token, and keep their checkpoints in the bucket (`STORAGE_PATH`).
    The `ray_cluster` fixture (conftest.py) calls this once per session, when a test first needs it.
    """
    # Stops what a session that was cut off left behind; refuses (ClusterBusy) while another live session
    # holds the cluster in CLUSTER_DIR.
    # The head declares a silent node dead after about 10 s (Ray's default: 30-40 s): a test that stops the
    # second node on purpose (`make cluster-kill-node`) is seen gone before Ray Train restarts its workers.
    return local_cluster_module().up(CLUSTER_DIR, CLUSTER_DIR / "cluster.env", node_death_s=10)


def stop_cluster() -> None:
    """Stop the test cluster by the process ids `start_cluster` recorded (never `ray stop`, which would
    stop every Ray on the machine)."""
    local_cluster_module().down(CLUSTER_DIR, CLUSTER_DIR / "cluster.env", quiet=True)


# What the cluster's cluster.env (readable by its owner only) is meant to hold: the bucket's secret and the
# tracking server's token.
CLUSTER_ENV_SECRETS = ("AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_TOKEN")


def secret_leaks(secrets: Mapping[str, str]) -> list[str]:
    """`path: name` for every file that holds one of `secrets` ({name: value}) under the test cluster's Ray
    session folders (every node's logs, the job's files), its own folder and test-artifacts/ (executed
    notebooks, results, JupyterLab's logs). The cluster's cluster.env, readable by its owner only, is the
    one file meant to hold CLUSTER_ENV_SECRETS; it is searched for the others."""
    state = json.loads((CLUSTER_DIR / "state.json").read_text())
    found = []
    for root in [*map(Path, state.get("temp_dirs", [])), ARTIFACTS]:
        for path in root.rglob("*"):
            if path.is_symlink() or not path.is_file():
                continue
            try:
                data = path.read_bytes()
            except OSError:
                continue
            for name, value in secrets.items():
                meant = path == CLUSTER_DIR / "cluster.env" and name in CLUSTER_ENV_SECRETS
                if value.encode() in data and not meant:
                    found.append(f"{path}: {name}")
    return found


def checkpoint_step(name: str) -> int:
    """The step in a checkpoint folder's name (Ray Train's `checkpoint_000018`: 18)."""
    return int(name.removeprefix("checkpoint_"))


def on_the_head_node() -> dict:
    """What a kernel on the test cluster's head node has, over `notebook_env`: no `RAY_ADDRESS`, and Ray's
    default temp dir (`RAY_TMPDIR`) the one the head's `ray start` wrote its address to, as a notebook on a
    real cluster's head node finds the cluster `ray start` runs there."""
    head = Path(json.loads((CLUSTER_DIR / "state.json").read_text())["temp_dirs"][0])
    assert head.name == "ray" and (head / "ray_current_cluster").exists(), head
    return {"RAY_ADDRESS": "", "RAY_TMPDIR": str(head.parent)}


def notebook_env(cluster: Mapping[str, str]) -> dict:
    """What a notebook's kernel gets: the cluster's variables, as after `source cluster.env`."""
    return {**os.environ, **cluster}


# ---- running notebooks -----------------------------------------------------------------------


KERNEL_START_FAILURES = ("Kernel died before replying to kernel_info", "Kernel didn't respond")


class RunTooSlow(TimeoutError):
    """A notebook run went past its time budget: the message names the notebook, the run and the cell."""


def _slowest_cells(executed: Path, count: int = 3) -> str:
    """`[index] first line (seconds)` of the cells that took longest, from papermill's per-cell record."""
    try:
        cells = json.loads(executed.read_text())["cells"]
    except (OSError, ValueError):
        return "(no executed notebook)"
    timed = []
    for index, cell in enumerate(cells):
        meta = cell.get("metadata", {}).get("papermill", {})
        if meta.get("status") == "running":  # the cell the budget ran out in
            return f"cell [{index}] {cell['source'].strip().splitlines()[0][:80]!r} was still running"
        if meta.get("duration") is not None:
            timed.append((meta["duration"], index, cell["source"].strip().splitlines()[0][:80]))
    slow = sorted(timed, reverse=True)[:count]
    return "slowest cells: " + ", ".join(f"[{i}] {first!r} {s:.0f} s" for s, i, first in slow)


def execute(
    name: str,
    parameters: dict,
    tag: str,
    *,
    cluster: Mapping[str, str],
    budget_s: float,
    env: Mapping[str, str] | None = None,
) -> tuple[dict | None, float, Exception | None]:
    """Run notebooks/<name>.ipynb with papermill on `cluster`; return (results JSON, wall seconds, error).

    The kernel's environment is this process's, the cluster's variables and `env`, given to the kernel
    alone: runs in several threads at once never see each other's variables. `budget_s`, the run's time
    budget (at least twice its time measured on a fresh clone, see docs/testing.md), is also each cell's
    papermill timeout; a run past it raises `RunTooSlow` naming the notebook, the run and the cell.
    """
    from ci.run_notebooks import run_papermill

    out_dir = ARTIFACTS / "notebooks"
    out_dir.mkdir(parents=True, exist_ok=True)
    executed = out_dir / f"{name}-{tag}.ipynb"
    results_path = out_dir / f"{name}-{tag}.json"
    results_path.unlink(missing_ok=True)
    start = time.perf_counter()
    error = None
    try:
        for attempt in (1, 2):
            try:
                run_papermill(
                    NOTEBOOKS / f"{name}.ipynb",
                    executed,
                    {"RESULTS_PATH": str(results_path), **parameters},
                    kernel_env={**notebook_env(cluster), **(env or {})},
                    timeout=budget_s,
                )
                break
            except RuntimeError as exc:
                # A kernel that died before it answered (seen once in 50 runs started three at a time, with
                # no output) never ran a cell: started again once, and said so.
                if attempt == 2 or not str(exc).startswith(KERNEL_START_FAILURES):
                    raise
                print(f"{name} ({tag}): {exc}; starting the kernel again", flush=True)
    except TimeoutError as exc:  # nbclient's CellTimeoutError: one cell alone used the whole budget
        raise RunTooSlow(
            f"{name} ({tag}): a cell ran past the run's {budget_s:.0f} s budget; {_slowest_cells(executed)}"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - returned to the test, which asserts on it
        error = exc
    wall = time.perf_counter() - start
    if wall > budget_s:
        raise RunTooSlow(
            f"{name} ({tag}) took {wall:.0f} s, budget {budget_s:.0f} s; {_slowest_cells(executed)}"
        )
    results = json.loads(results_path.read_text()) if results_path.exists() else None
    return results, wall, error


def run_as_job(
    name: str, parameters: dict, tag: str, *, cluster: Mapping[str, str], budget_s: float
) -> tuple[dict | None, float, str, str]:
    """Run notebooks/<name>.ipynb as a Ray Job on `cluster` with `make job` (ci/submit_job.py), from a shell
    that has the cluster's variables and no cluster.env to read (the project's, if any, is not read: the
    shell names the cluster); return
    (results JSON, wall seconds, the job's status, its id). The job writes its results JSON here: the
    cluster's nodes are this machine. Past `budget_s` (submission and the whole job): `RunTooSlow`."""
    results_path = ARTIFACTS / "notebooks" / f"{name}-{tag}.json"
    results_path.parent.mkdir(parents=True, exist_ok=True)
    results_path.unlink(missing_ok=True)
    args = [
        item for k, v in {**parameters, "RESULTS_PATH": results_path}.items() for item in ("-p", k, str(v))
    ]
    log = ARTIFACTS / "notebooks" / f"{name}-{tag}-submit.log"
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            ["make", "-s", "-C", str(ROOT), "job", f"NOTEBOOK={name}", f"ARGS={shlex.join(args)}"],
            env=notebook_env(cluster),
            capture_output=True,
            text=True,
            timeout=budget_s,
        )
    except subprocess.TimeoutExpired as exc:
        log.write_text(_text(exc.stdout) + _text(exc.stderr))
        raise RunTooSlow(
            f"{name} ({tag}) as a Ray Job: not done within its {budget_s:.0f} s budget; see {log}"
        ) from None
    log.write_text(proc.stdout + proc.stderr)
    match = re.search(r"Job (\S+): (\w+)\.", proc.stdout)
    assert match, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(results_path.read_text()) if results_path.exists() else None
    return results, time.perf_counter() - start, match.group(2), match.group(1)


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def job_logs(job_id: str, cluster: Mapping[str, str]) -> str:
    """What `ray job logs <id>` prints for the job, with the cluster's variables."""
    ray = Path(sys.executable).parent / "ray"
    proc = subprocess.run(
        [str(ray), "job", "logs", job_id],
        env=notebook_env(cluster),
        capture_output=True,
        text=True,
        timeout=60,  # measured: 2-3 s
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


# Each notebook's smoke run, as a learner runs it (nbval or JupyterLab, on the test cluster): its budget
# (its module's RULES.smoke_budget_s), at least twice the longest time measured in a fresh clone's `make test`:
# GPT-2 66-84 s, Dolly 78-93 s, GLUE through JupyterLab 57-78 s, Llama through JupyterLab 142 s
# (JUPYTERLAB_NOTEBOOKS=all only), on a CPU with bf16 instructions. A 2-core AVX2 machine (2026-11-28)
# is slower at everything, bf16 products aside (harness.cpu_bf16): `make run` there took GPT-2 168 s,
# Dolly 136 s, GLUE 129 s, Llama 128 s, LoRA 152 s; its fresh-clone `make test` with the held-out
# evaluations (f789ed2): the GPT-2 and Dolly nbval fixtures 197 s and 184 s.
SMOKE_BUDGET_S = {name: notebook(name).smoke_budget_s for name in NAMES}


def run_nbval(
    name: str, env: dict, cluster: Mapping[str, str], budget_s: float
) -> tuple[subprocess.CompletedProcess, float]:
    """Validate notebooks/<name>.ipynb cell by cell with nbval (lax: no stored outputs to compare). Past
    `budget_s` (each cell's timeout too): `RunTooSlow`, naming the last cell that had finished."""
    start = time.perf_counter()
    log = ARTIFACTS / "notebooks" / f"{name}-nbval.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pytest", "--nbval-lax", "-v", "-p", "no:cacheprovider"]
    # Each cell within the run's budget (nbval's own timeout), not the suite's default budget for a test's
    # body, which this pytest would read from the project's pyproject.toml too.
    command += [f"--nbval-cell-timeout={budget_s:.0f}", "-o", "timeout=0", "--rootdir", str(NOTEBOOKS)]
    try:
        proc = subprocess.run(
            [*command, str(NOTEBOOKS / f"{name}.ipynb")],
            env={**notebook_env(cluster), **env},
            cwd=str(NOTEBOOKS),
            capture_output=True,
            text=True,
            timeout=budget_s,
        )
    except subprocess.TimeoutExpired as exc:
        printed = _text(exc.stdout) + _text(exc.stderr)
        log.write_text(printed)
        done = re.findall(r"::Cell (\d+) PASSED", printed)
        where = f"after cell {done[-1]}" if done else "in its first cell"
        raise RunTooSlow(
            f"{name} (nbval): not done within its {budget_s:.0f} s budget, {where}; see {log}"
        ) from None
    log.write_text(proc.stdout + proc.stderr)
    return proc, time.perf_counter() - start


def smoke_nbval(name: str, results_dir: Path, cluster: Mapping[str, str]) -> tuple[dict, float]:
    """The notebook as a learner runs it (SMOKE_TEST=1 in the environment), validated cell by cell by nbval,
    within its SMOKE_BUDGET_S.

    Returns (its results JSON, wall seconds); fails the calling test (or fixture) if a cell failed. The
    results JSON is copied to test-artifacts/notebooks/<name>-nbval.json (what `repin` reads).
    """
    results = results_dir / "results.json"
    kept = ARTIFACTS / "notebooks" / f"{name}-nbval.json"
    kept.unlink(missing_ok=True)
    env = {"SMOKE_TEST": "1", "RESULTS_PATH": str(results)}
    with killed_in(name, cluster):
        proc, wall = run_nbval(name, env, cluster, SMOKE_BUDGET_S[name])
    if results.exists():
        shutil.copyfile(results, kept)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(results.read_text()), wall


# The lesson notebooks whose smoke run (JupyterLab's, or nbval's) has a worker killed from outside
# (tests/worker_kill.py): (the first step of the first attempt at which it may come, its checkpoints' interval
# in steps). GLUE: its second epoch (16 steps each, a checkpoint after each, a loss logged every 4 steps).
SMOKE_RUN_KILL = {
    "glue_text_classification": (20, 16),
    "gpt2_deepspeed": (14, 12),  # 2 epochs of 12 steps
    "dolly_lightning_fsdp": (23, 20),  # 2 epochs of 20 steps
    "llama_fsdp": (14, 12),  # 24 steps, a checkpoint every 12
    "llama_lora": (14, 12),  # as llama_fsdp's
}


def killed_in(name: str, cluster: Mapping[str, str]):
    """Around a notebook's smoke run: rank 1 killed from outside (tests/worker_kill.py) where
    `SMOKE_RUN_KILL` names the notebook; nothing otherwise."""
    from worker_kill import WorkerKill

    if name not in SMOKE_RUN_KILL:
        return contextlib.nullcontext()
    return WorkerKill(name, *SMOKE_RUN_KILL[name], cluster, timeout_s=SMOKE_BUDGET_S[name])


# ---- the bucket ------------------------------------------------------------------------------

# Ray Train reads checkpoints in 64 MB chunks too. With pyarrow's default of 1 MB, moto (which reads a whole
# object for every ranged GET) took 93 s for the Llama run's 620 MB of shards; 64 MB: a few seconds.
CHUNK = 64 * 1024 * 1024


def filesystem(uri: str, cluster: Mapping[str, str] | None = None):
    """(pyarrow filesystem, path) for a URI in the test cluster's bucket, or a local path.

    The bucket's endpoint and keys are the cluster's variables (as for any S3 client); they are passed to
    pyarrow, not set in this process's environment.
    """
    import pyarrow.fs as pafs

    if not uri.startswith("s3://"):
        return pafs.FileSystem.from_uri(uri if "://" in uri else str(Path(uri).absolute()))
    if cluster is None:
        raise ValueError(f"{uri}: reading the bucket needs the cluster's variables (the ray_cluster fixture)")
    scheme, _, endpoint = cluster["AWS_ENDPOINT_URL"].partition("://")
    fs = pafs.S3FileSystem(
        access_key=cluster["AWS_ACCESS_KEY_ID"],
        secret_key=cluster["AWS_SECRET_ACCESS_KEY"],
        region=cluster["AWS_REGION"],
        endpoint_override=endpoint.rstrip("/"),
        scheme=scheme,
    )
    return fs, uri.removeprefix("s3://").rstrip("/")


def fetch(uri: str, dest: Path, cluster: Mapping[str, str] | None = None) -> Path:
    """Copy a checkpoint folder (or file) from the bucket (or a local path) to `dest`; return `dest`."""
    import pyarrow.fs as pafs

    fs, path = filesystem(uri, cluster)
    is_file = fs.get_file_info(path).type == pafs.FileType.File
    (dest.parent if is_file else dest).mkdir(parents=True, exist_ok=True)
    pafs.copy_files(
        path, str(dest), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem(), chunk_size=CHUNK
    )
    return dest


def file_sizes(uri: str, cluster: Mapping[str, str] | None = None) -> dict[str, int]:
    """{object name relative to `uri`: size in bytes} for every object under `uri` (recursive)."""
    import pyarrow.fs as pafs

    fs, path = filesystem(uri, cluster)
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    return {i.path[len(path) :].lstrip("/"): i.size for i in infos if i.type == pafs.FileType.File}


def listing(uri: str, cluster: Mapping[str, str] | None = None) -> list[str]:
    """The object names under `uri`, relative to it (recursive)."""
    return sorted(file_sizes(uri, cluster))


# ---- checks every notebook test shares -------------------------------------------------------


def check_plan_matches_shards(results: dict, tolerance: float) -> None:
    """The notebook's "will it fit?" plan against what each rank's shards held after its first step."""
    plan = results["plan"]
    for held in results["state_bytes"]:
        assert held["param_bytes"] == pytest.approx(plan["param_bytes_per_rank"], rel=tolerance)
        assert held["optimizer_bytes"] == pytest.approx(plan["optimizer_bytes_per_rank"], rel=tolerance)
        if "grad_bytes" in held:  # the most gradient memory during a step, accumulation included
            assert held["grad_bytes"] == pytest.approx(plan["grad_bytes_per_rank"], rel=tolerance)


def check_held_out(results: dict, every: int, most_overhead: float | None = None) -> dict[int, float]:
    """The held-out losses (issue 57's `eval_losses`, `eval_rows`): one every `every` steps and one at the
    end, finite, over rows, the last below the first. With `most_overhead`: the evaluations' seconds, as a
    share of the steps' between two evaluations, at most that (the plain runs' steps only)."""
    import math

    held_out = {int(step): loss for step, loss in results["eval_losses"].items()}
    last = results["parameters"]["MAX_STEPS"]
    assert sorted(held_out) == sorted({*range(every, last + 1, every), last}), held_out
    assert results["eval_rows"] > 0 and all(math.isfinite(v) for v in held_out.values()), results["eval_rows"]
    assert held_out[last] < held_out[min(held_out)], held_out
    if most_overhead is not None:
        steps = [s for a in results["attempts"] for s in list(a["step_seconds"].values())[1:]]  # not warm-up
        evaluation = sum(results["eval_seconds"].values()) / len(results["eval_seconds"])
        overhead = evaluation / (every * sum(steps) / len(steps))
        print(f"held out: {held_out}; an evaluation {evaluation:.2f} s, {overhead:.1%} of {every} steps")
        assert overhead < most_overhead, (evaluation, steps)
    return held_out


def check_cluster_run(
    results: dict,
    cluster: Mapping[str, str],
    kill_at: int | None,
    resumed_from: int | None,
    tolerance: float,
    tracked: bool = True,
) -> None:
    """What every notebook must show on the cluster: two nodes, a bucket, one real restart that replays, and
    the run in the cluster's MLflow server (`check_tracked_run`)."""
    ids = results["worker_node_ids"]
    assert len(ids) == 2 and len(set(ids)) == 2, f"workers not on two Ray nodes: {ids}"
    assert results["checkpoint_path"].startswith("s3://"), results["checkpoint_path"]
    assert listing(results["checkpoint_path"], cluster), "the reported checkpoint is not in the bucket"
    if tracked:  # False: a run whose tracking server was stopped (`TrackingStopped`)
        check_tracked_run(results, cluster)
    if kill_at is None:
        assert results["kill"] is None
        return
    kill = results["kill"]
    assert kill["at_step"] == kill_at and kill["restarts"] == 1, kill
    assert kill["resumed_from_step"] == resumed_from, kill
    assert kill["replayed_steps"] and kill["replayed_max_abs_diff"] <= tolerance, kill


class TrackingStopped:
    """While a notebook trains on the test cluster, stop the cluster's MLflow server (SIGSTOP: it accepts
    connections and answers nothing) once the run's first loss point is in its database, until the block
    ends; then let it go on. `stopped` says whether it was stopped. The run is the first of `experiment`
    (the notebook's name) created after the block started."""

    def __init__(self, experiment: str):
        self.experiment, self.stopped = experiment, threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tracking-stopped", daemon=True)

    def _watch(self) -> None:
        import sqlite3

        import psutil

        records = json.loads((CLUSTER_DIR / "state.json").read_text())["processes"]
        server = psutil.Process(next(r for r in records if r["name"] == "mlflow")["pid"])
        query = (  # a loss point of a run of the experiment, started after this block began
            "SELECT count(*) FROM metrics m JOIN runs r ON r.run_uuid = m.run_uuid "
            "JOIN experiments e ON e.experiment_id = r.experiment_id "
            "WHERE e.name = ? AND r.start_time >= ? AND m.key = 'loss'"
        )
        since = int(time.time() * 1000)
        while not self._done.wait(0.2):
            with contextlib.suppress(sqlite3.OperationalError):  # the server is writing
                uri = f"file:{CLUSTER_DIR / 'mlflow.db'}?mode=ro"
                with contextlib.closing(sqlite3.connect(uri, uri=True)) as db:
                    if db.execute(query, (self.experiment, since)).fetchone()[0]:
                        server.suspend()
                        self.stopped.set()
                        self._server = server
                        return

    def __enter__(self) -> TrackingStopped:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        if self.stopped.is_set():
            self._server.resume()


def mlflow_get(cluster: Mapping[str, str], endpoint: str, **query) -> dict:
    """One GET of the cluster's MLflow tracking server's REST API (`/api/2.0/mlflow/<endpoint>`)."""
    import urllib.parse
    import urllib.request

    url = f"{cluster['MLFLOW_TRACKING_URI']}/api/2.0/mlflow/{endpoint}?{urllib.parse.urlencode(query)}"
    request = urllib.request.Request(
        url, headers={"Authorization": f"Bearer {cluster['MLFLOW_TRACKING_TOKEN']}"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def metric_history(cluster: Mapping[str, str], run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of each point of the run's metric `key`, in the order the server keeps them."""
    answer = mlflow_get(cluster, "metrics/get-history", run_id=run_id, metric_key=key, max_results=25000)
    return [(int(m.get("step", 0)), m["value"]) for m in answer.get("metrics", [])]


def check_tracked_run(results: dict, cluster: Mapping[str, str]) -> None:
    """The notebook's MLflow run, read back through the tracking server's REST API: finished; the notebook's
    parameters as the run used them; one loss point per logged step (none twice, though steps ran twice
    after a restart), equal to what the run log recorded; where it resumed; the checkpoint's URI, in the
    bucket; and `results.json`, stored in the bucket by the server."""
    run = mlflow_get(cluster, "runs/get", run_id=results["mlflow_run_id"])["run"]
    assert run["info"]["status"] == "FINISHED", run["info"]
    params = {p["key"]: p["value"] for p in run["data"].get("params", [])}
    tags = {t["key"]: t["value"] for t in run["data"].get("tags", [])}
    expected = {k: str(v) for k, v in results["parameters"].items()}
    assert {k: params.get(k) for k in expected} == expected
    points = metric_history(cluster, results["mlflow_run_id"], "loss")
    steps = [step for step, _ in points]
    assert len(steps) == len(set(steps)), f"steps logged twice: {sorted(steps)}"
    # Each step's loss as the first attempt that ran it logged it (a replay is not logged again).
    first: dict[int, float] = {}
    for attempt in results.get("attempts") or []:
        for step, loss in attempt["losses"].items():
            first.setdefault(int(step), loss)
    if not first:  # GPT-2 keeps no attempts: its losses by step (its replays repeat bit for bit)
        first = {i + 1: loss for i, loss in enumerate(results["losses"])}
    logged = dict(points)
    assert {s: logged.get(s) for s in first} == pytest.approx(first, rel=1e-3)
    # Nothing else, but GPT-2's further epoch (section 9), which continues the same run.
    assert all(s > max(first) for s in set(logged) - set(first)), sorted(set(logged) - set(first))
    assert tags["checkpoint_uri"] == results["checkpoint_path"]
    if results["kill"]:
        resumed = metric_history(cluster, results["mlflow_run_id"], "resumed_from_step")
        assert (results["kill"]["resumed_from_step"],) * 2 in [(s, int(v)) for s, v in resumed], resumed
        assert tags["killed_worker_at_step"] == str(results["kill"]["at_step"]), tags
    experiment = run["info"]["experiment_id"]
    stored = listing(f"s3://llm-notebooks/mlflow/{experiment}/{results['mlflow_run_id']}/artifacts", cluster)
    assert "results.json" in stored, stored


def last_checkpoint_before(step: int, every: int) -> int:
    """The step of the last checkpoint a run that saves every `every` steps wrote before `step` (0: none)."""
    return (step - 1) // every * every


# ---- pinned smoke losses ---------------------------------------------------------------------


@dataclass(frozen=True)
class PinnedLosses:
    """A notebook's pinned smoke losses: `losses[i]` is step `steps[i]`'s (steps count from 1)."""

    steps: list[int]
    losses: list[float]
    tolerance: float  # absolute, per step
    header: list[str]  # the file's `#` lines, as written


_TOLERANCE = re.compile(r"^#\s*tolerance:\s*([0-9.eE+-]+)")


def pinned_losses(name: str, folder: Path = LOSSES) -> PinnedLosses:
    """Read tests/assets/losses/<name>.txt: a `#` header with a `# tolerance: X` line, then `step loss`s."""
    path = folder / f"{name}.txt"
    header, steps, losses, tolerance = [], [], [], None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("#"):
            if steps:
                raise ValueError(f"{path}:{number}: a header line after the losses")
            header.append(line)
            if match := _TOLERANCE.match(line):
                tolerance = float(match.group(1))
        elif line.strip():
            fields = line.split()
            if len(fields) != 2:
                raise ValueError(f"{path}:{number}: expected `step loss`, got {line!r}")
            steps.append(int(fields[0]))
            losses.append(float(fields[1]))
    if tolerance is None:
        raise ValueError(f"{path}: no `# tolerance: X` line in the header")
    if not steps or steps != sorted(set(steps)) or steps[0] < 1:
        raise ValueError(f"{path}: steps must be increasing, from 1 up: {steps}")
    return PinnedLosses(steps, losses, tolerance, header)


def repin(name: str, results_path: Path, folder: Path = LOSSES) -> PinnedLosses:
    """Rewrite tests/assets/losses/<name>.txt from a smoke run's results JSON: same header, same steps."""
    old = pinned_losses(name, folder)
    results = json.loads(Path(results_path).read_text())
    if results.get("notebook") != name or results.get("smoke_test") is not True:
        raise ValueError(
            f"{results_path}: not a smoke run of {name} "
            f"(notebook={results.get('notebook')!r}, smoke_test={results.get('smoke_test')!r})"
        )
    losses = results["losses"]
    if len(losses) < old.steps[-1]:
        raise ValueError(f"{results_path}: {len(losses)} losses, the file pins step {old.steps[-1]}")
    lines = [*old.header, *(f"{step} {losses[step - 1]:.4f}" for step in old.steps)]
    (folder / f"{name}.txt").write_text("\n".join(lines) + "\n")
    return pinned_losses(name, folder)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("repin", help="rewrite a notebook's pinned losses from a results JSON")
    command.add_argument("notebook", help="e.g. llama_fsdp")
    command.add_argument("results", type=Path, help="e.g. test-artifacts/notebooks/llama_fsdp-nbval.json")
    command.add_argument("--folder", type=Path, default=LOSSES, help="default: tests/assets/losses")
    args = parser.parse_args(argv)
    try:
        old = pinned_losses(args.notebook, args.folder)
        new = repin(args.notebook, args.results, args.folder)
    except (OSError, ValueError, KeyError) as exc:
        parser.error(str(exc))  # exits with status 2, the file unchanged
    for step, before, after in zip(new.steps, old.losses, new.losses, strict=True):
        print(f"step {step}: {before} -> {after}")
    print(f"Wrote {args.folder / (args.notebook + '.txt')}; its header is unchanged: update the hardware and")
    print("versions it names if the run that wrote the results JSON differed.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
