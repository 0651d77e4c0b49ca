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
from collections.abc import Callable, Iterator, Mapping
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


def _local_cluster():
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
    # The head declares a silent node dead after about 10 s (Ray's default: 30-40 s): the Llama run loses
    # its second node on purpose (`NodeLoss`) and must see it gone before Ray Train restarts its workers.
    return _local_cluster().up(CLUSTER_DIR, CLUSTER_DIR / "cluster.env", node_death_s=10)


def stop_cluster() -> None:
    """Stop the test cluster by the process ids `start_cluster` recorded (never `ray stop`, which would
    stop every Ray on the machine)."""
    _local_cluster().down(CLUSTER_DIR, CLUSTER_DIR / "cluster.env", quiet=True)


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


class NodeLoss:
    """While a notebook trains on the test cluster, lose its second Ray node and get a new one, as a spot
    instance is reclaimed and replaced: `make cluster-kill-node` once the run's first checkpoint is
    registered, `make cluster-add-node` once a checkpoint written after the loss is in the bucket.

    A thread watches the bucket for the run's folder (the first new one whose name starts with `run_prefix`)
    and its `checkpoint_*/trainer_state.json` (written by rank 0 after every shard). A checkpoint counts as
    registered once Ray Train's `checkpoint_manager_snapshot.json` there names it (`_settled`), not
    after a guessed delay: on a loaded machine the controller can take longer to register it, and a pause
    of the bucket in the middle of its snapshot write would stall the controller. `events` records what it
    did, with the checkpoint step it followed.

    Ray Train sizes a worker group from the reservations of Ray Data's autoscaling coordinator, which looks
    at the cluster every 20 s (`TICK_INTERVAL_S` in ray.data's `default_autoscaling_coordinator.py`); the
    resize monitor looks every `RESIZE_CHECK_S` after that. So after each change of nodes the coordinator is
    told to look at once (`_refresh_when`): as a real cluster's runs would, only sooner. And once the node is
    back (and the lone worker's checkpoint registered), the bucket is held (the S3 server paused, `make
    cluster-pause-storage`'s way) until the resize has stopped the lone worker, at most `hold_s`: its next
    checkpoint write waits, so the resize always comes before the run ends, and that checkpoint is never
    registered.

    With `stall_at_checkpoint`, the bucket then stalls for `stall_s` in the middle of that checkpoint's write
    (as soon as one of its shard files is being uploaded). If the run ends before the node came back, a node
    is added on exit, so that the next tests have two nodes.
    """

    def __init__(
        self,
        cluster: Mapping[str, str],
        run_prefix: str,
        stall_at_checkpoint: int | None = None,
        stall_s: float = 25.0,
        hold_s: float = 50.0,
    ):
        self.cluster, self.run_prefix = cluster, run_prefix
        self._run: str | None = None  # the run's folder in the bucket, once there
        self.stall_at_checkpoint, self.stall_s, self.hold_s = stall_at_checkpoint, stall_s, hold_s
        self.events: list[tuple[str, int, float]] = []  # (what, after the checkpoint of this step, seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="node-loss", daemon=True)
        self.error: BaseException | None = None
        self._refreshes: list[threading.Thread] = []

    def _listing(self, fs, root: str, known: set[str]) -> tuple[list[int], list[int]]:
        """One listing of the run's folder: the steps of the checkpoints rank 0 finished (`trainer_state.json`
        there), and of every checkpoint folder holding a file (one being written or deleted too)."""
        import pyarrow.fs as pafs

        if self._run is None:
            runs = [
                i.path
                for i in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
                if i.base_name.startswith(self.run_prefix) and i.path not in known
            ]
            if not runs:
                return [], []
            self._run = runs[0]
        files = fs.get_file_info(pafs.FileSelector(self._run, recursive=True))
        parts = [f.path.removeprefix(self._run + "/").split("/") for f in files if f.is_file]
        parts = [p for p in parts if len(p) > 1 and p[0].startswith("checkpoint_")]
        finished = {checkpoint_step(p[0]) for p in parts if p[-1] == "trainer_state.json"}
        return sorted(finished), sorted({checkpoint_step(p[0]) for p in parts})

    def _settled(self, fs, root: str, known: set[str]) -> int | None:
        """The step of the newest finished checkpoint once Ray Train's controller has registered it and is
        done with the bucket for it; None before. Done means: the checkpoint manager's snapshot, which the
        controller writes to the run's folder (blocking its loop) when it registers a report, names it the
        latest, and every older folder it dropped (`num_to_keep`) is deleted. Pausing the bucket before
        then would stall the controller, and with it every decision it makes, the resize included. (The
        listing comes first and the pause right after the snapshot's read: a checkpoint finished in those
        few milliseconds is the one case left where a pause stalls the controller.)"""
        finished, folders = self._listing(fs, root, known)
        try:
            with fs.open_input_stream(f"{self._run}/checkpoint_manager_snapshot.json") as snapshot:
                state = json.loads(snapshot.read())
        except (FileNotFoundError, OSError, ValueError):  # not there yet
            return None
        latest = (state.get("latest_checkpoint_result") or {}).get("checkpoint_dir_name", "")
        kept = {checkpoint_step(r["checkpoint_dir_name"]) for r in state["checkpoint_results"]}
        if not finished or not latest.startswith("checkpoint_") or checkpoint_step(latest) != finished[-1]:
            return None
        return finished[-1] if all(s in kept for s in folders if s <= finished[-1]) else None

    def _wait_settled(self, fs, root: str, known: set[str]) -> int | None:
        """Wait until the newest finished checkpoint is registered (`_settled`); its step, None: the run
        ended first."""
        while not self._stop.wait(0.2):
            if (settled := self._settled(fs, root, known)) is not None:
                return settled
        return None

    def _watch(self) -> None:
        import pyarrow.fs as pafs

        try:
            cluster = _local_cluster()
            fs, root = filesystem(self.cluster["STORAGE_PATH"], self.cluster)
            known = {i.path for i in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))}
            start = time.monotonic()
            killed_after = added_after = None
            while not self._stop.wait(0.5):
                steps, _ = self._listing(fs, root, known)
                if killed_after is None and steps:
                    killed_after = self._wait_settled(fs, root, known)
                    if killed_after is None:
                        return
                    self._kill_node(cluster)
                    self._refresh_when(alive=1)
                    self.events.append(("node killed", killed_after, time.monotonic() - start))
                elif killed_after is not None and steps and steps[-1] > killed_after:
                    cluster.add_node(CLUSTER_DIR, CLUSTER_DIR / "cluster.env")
                    self._refresh_when(alive=2)
                    added_after = steps[-1]
                    self.events.append(("node added", added_after, time.monotonic() - start))
                    break
            if added_after is None:
                return
            uploads = self._s3_client()
            # Once the lone worker's latest checkpoint is registered, its next write waits in the bucket.
            held = self._hold_until_resized(cluster, lambda: self._wait_settled(fs, root, known))
            if held is None:  # Ray Train saw the node early: the new worker group is there already
                self.events.append(("grown back before the hold", added_after, 0.0))
            elif held[0] is None:
                self.events.append(("the run ended before the hold", added_after, 0.0))
            else:
                self.events.append(("storage held until the resize", *held))
            if self.stall_at_checkpoint is not None:
                if self._when_uploading(uploads, lambda step: step == self.stall_at_checkpoint) is not None:
                    cluster.pause_storage(CLUSTER_DIR, self.stall_s)
                    self.events.append(
                        ("storage stalled", self.stall_at_checkpoint, time.monotonic() - start)
                    )
        except BaseException as exc:  # noqa: BLE001 - reported by __exit__
            self.error = exc

    def _refresh_when(self, alive: int) -> None:
        """In a thread: once the head counts `alive` nodes, have Ray Data's autoscaling coordinator look at
        the cluster now instead of at its next 20 s tick (`get_reserved_resources(recompute=True)`, the call
        Ray makes before pinning work to nodes). Ray Train sizes a worker group from the coordinator's
        reservations: the restart after the loss then asks for the one worker that can start instead of
        waiting out a group that cannot, and the resize comes `RESIZE_CHECK_S` after the node is back."""
        code = (
            "import ray, time\n"
            "ray.init(logging_level='ERROR')\n"
            f"while sum(1 for n in ray.nodes() if n['Alive']) != {alive}:\n"
            "    time.sleep(0.2)\n"
            "coordinator = ray.get_actor('AutoscalingCoordinator', namespace='AutoscalingCoordinator')\n"
            "ray.get(coordinator.get_reserved_resources.remote('node-loss', recompute=True), timeout=30)\n"
        )

        def refresh() -> None:
            try:
                done = subprocess.run(
                    [sys.executable, "-c", code],
                    env=notebook_env(self.cluster),
                    cwd=str(ROOT / "notebooks"),
                    capture_output=True,
                    text=True,
                    timeout=90,
                )
                assert done.returncode == 0, f"the coordinator's refresh failed: {done.stderr[-1500:]}"
            except BaseException as exc:  # noqa: BLE001 - reported by __exit__
                self.error = self.error or exc

        thread = threading.Thread(target=refresh, name=f"refresh-{alive}", daemon=True)
        thread.start()
        self._refreshes.append(thread)

    def _when_uploading(self, uploads, wanted) -> int | None:
        """Wait until a shard of a checkpoint whose step `wanted` accepts is being uploaded; return its step
        (None: the run ended first)."""
        bucket, _, prefix = self.cluster["STORAGE_PATH"].removeprefix("s3://").partition("/")
        while not self._stop.wait(0.2):
            for upload in uploads.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []):
                folders = [p for p in upload["Key"].split("/") if p.startswith("checkpoint_")]
                if (
                    upload["Key"].endswith(".distcp") and folders
                ):  # .../checkpoint_000018/sharded/__0_0.distcp
                    step = checkpoint_step(folders[-1])
                    if wanted(step):
                        return step
        return None

    def _hold_until_resized(
        self, cluster, settled: Callable[[], int | None]
    ) -> tuple[int | None, float] | None:
        """Once `settled()` returns (the step of the lone worker's latest checkpoint, registered), pause the
        bucket while the lone training worker writes its next one; resume it once that worker process is
        gone (the resize stopped it) or after `hold_s`. Returns that step and the seconds held ((None, 0.0)
        if the run ended first); None, without a hold, where there is no lone worker (the resize came
        first: the new group's workers are there)."""
        import psutil

        records = json.loads((CLUSTER_DIR / "state.json").read_text())["processes"]
        nodes = [
            psutil.Process(r["pid"])
            for r in records
            if r["name"].startswith("ray-") and cluster.is_running(r)
        ]

        def train_workers() -> set[int]:  # the worker processes, not processes they forked (same title)
            found = {}
            for node in nodes:
                for p in node.children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        if "RayTrainWorker" in " ".join(p.cmdline()):
                            found[p.pid] = p.ppid()
            return {pid for pid, parent in found.items() if parent not in found}

        lone = train_workers()
        if len(lone) != 1:
            return None

        def resized() -> bool:  # the lone worker's process is gone (or the run is over)
            return self._stop.is_set() or not any(psutil.pid_exists(pid) for pid in lone)

        step = settled()
        if step is None:
            return None, 0.0
        return step, cluster.pause_storage(CLUSTER_DIR, self.hold_s, until=resized)

    @staticmethod
    def _kill_node(cluster) -> None:
        """`make cluster-kill-node`, checked: every process of the node is gone, the head untouched."""
        import psutil

        records = json.loads((CLUSTER_DIR / "state.json").read_text())["processes"]
        head = next(r for r in records if r["name"] == "ray-head")
        node = [r for r in records if r["name"].startswith("ray-node-") and cluster.is_running(r)][-1]
        root = psutil.Process(node["pid"])
        doomed = [root, *root.children(recursive=True)]  # its raylet (with the object store), agents, workers
        assert cluster.kill_node(CLUSTER_DIR) == node["name"]
        alive = [p.pid for p in doomed if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"processes of {node['name']} still running: {alive}"
        assert cluster.is_running(head), "the head node was touched"

    def _s3_client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.cluster["AWS_ENDPOINT_URL"],
            aws_access_key_id=self.cluster["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.cluster["AWS_SECRET_ACCESS_KEY"],
            region_name=self.cluster["AWS_REGION"],
        )

    def __enter__(self) -> NodeLoss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        for refresh in self._refreshes:
            refresh.join(timeout=90)
        happened = [e[0] for e in self.events]
        if "node killed" in happened and "node added" not in happened:
            _local_cluster().add_node(CLUSTER_DIR, CLUSTER_DIR / "cluster.env")
        if self.error is not None:
            raise self.error


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
# (its module's SMOKE_BUDGET_S), at least twice the longest time measured in a fresh clone's `make test`:
# GPT-2 66-84 s, Dolly 78-93 s, GLUE through JupyterLab 57-78 s, Llama through JupyterLab 142 s
# (JUPYTERLAB_NOTEBOOKS=all only), on a CPU with bf16 instructions. A 2-core AVX2 machine (2026-11-28)
# is slower at everything, bf16 products aside (harness.cpu_bf16): `make run` there took GPT-2 168 s,
# Dolly 136 s, GLUE 129 s, Llama 128 s, LoRA 152 s; its fresh-clone `make test` with the held-out
# evaluations (f789ed2): the GPT-2 and Dolly nbval fixtures 197 s and 184 s.
SMOKE_BUDGET_S = {name: notebook(name).SMOKE_BUDGET_S for name in NAMES}


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


# ---- JupyterLab: the notebook as its first user runs it -------------------------------------------

ALL_NOTEBOOKS = NAMES
LAB_ARTIFACTS = ARTIFACTS / "jupyterlab"  # <notebook>.png (the page), .txt (each cell's outputs), -server.log
# The time from "Run All Cells" to the last cell is bounded by the notebook's SMOKE_BUDGET_S; the server's and
# Chromium's start (measured: 5-10 s) and the kernel's (2-4 s) come on top of it.
LAB_START_BUDGET_S = 60
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
    LAB_ARTIFACTS.mkdir(parents=True, exist_ok=True)
    screenshot = LAB_ARTIFACTS / f"{name}.png"
    screenshot.unlink(missing_ok=True)
    results_path = work_dir / "results.json"
    kept = ARTIFACTS / "notebooks" / f"{name}-jupyterlab.json"
    kept.unlink(missing_ok=True)
    env = {**notebook_env(cluster), "SMOKE_TEST": "1", "RESULTS_PATH": str(results_path)}
    notebook_file = notebooks / f"{name}.ipynb"
    code_cells = sum(c["cell_type"] == "code" for c in json.loads(notebook_file.read_text())["cells"])
    hidden_cells = sum(
        c.get("metadata", {}).get("jupyter", {}).get("source_hidden", False)
        for c in json.loads(notebook_file.read_text())["cells"]
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
            base, _, query = url.partition("?")
            try:
                page.goto(f"{base}/lab/tree/{name}.ipynb?{query}", wait_until="load")
                page.wait_for_selector(".jp-NotebookPanel .jp-CodeCell", timeout=LAB_START_BUDGET_S * 1000)
                _wait_for_kernel(page, timeout=LAB_START_BUDGET_S)
                dialogs = page.locator(".jp-Dialog").all_inner_texts()
                if dialogs:
                    problems.append(f"a dialog before Run All: {dialogs}")

                # The run settings' cell opens collapsed (its input hidden, as the notebook file says); the
                # prompts this test reads are in the inputs: View > Expand All Code shows them all.
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
                wall = time.perf_counter() - start
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
        for c in json.loads(notebook_file.read_text())["cells"]
        if c["cell_type"] == "code"
    )
    results = None
    if results_path.exists():
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(results_path, kept)
        results = json.loads(results_path.read_text())

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
