"""A training worker killed from outside the notebook, as Ray's chaos tests kill workers
(`ray._private.test_utils.WorkerKillerActor`): the notebook's code has no line about it.

`WorkerKill(notebook, at_step, every, cluster, timeout_s)` wraps a notebook's run on the test cluster. A
process of its own attaches to the cluster as a second driver and finds the run's `RunLog` actor by its name
(`harness.run_log.run_log`) and the run's folder in `STORAGE_PATH` (the first new one). Once the run's first
attempt has logged `at_step` and Ray Train has registered the checkpoint before the latest step (its
`checkpoint_manager_snapshot.json` there names it; one every `every` steps), it records the kill
(`RunLog.claim_kill`: the results' `kill` says where it came) and sends SIGKILL to rank 1's process (every
node of the test cluster is on this machine). What follows is Ray Train's: the group fails, restarts, and
resumes from that checkpoint.

    python tests/worker_kill.py NOTEBOOK AT_STEP EVERY TIMEOUT_S   # prints {"step": ..., "pid": ...}
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class WorkerKill:
    """Kill rank 1 of `notebook`'s next run at `at_step` of its first attempt; `killed` once it is over:
    `{"step", "pid"}`, or None where the run never reached the step (the output says why)."""

    def __init__(
        self, notebook: str, at_step: int, every: int, cluster: Mapping[str, str], timeout_s: float
    ) -> None:
        self.args = [notebook, str(at_step), str(every), str(timeout_s)]
        self.env = {**os.environ, **cluster}
        self.killed: dict | None = None
        self.output = ""

    def __enter__(self) -> WorkerKill:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, *self.args],
            env=self.env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:  # the run ended first
            self.proc.terminate()
        self.output, _ = self.proc.communicate(timeout=60)
        lines = [line for line in self.output.splitlines() if line.startswith('{"step"')]
        self.killed = json.loads(lines[-1]) if lines else None
        print(f"worker_kill: {self.output.strip()[-2000:]}")


def _run_log(notebook: str, known: set[str]):
    """The `RunLog` actor of `notebook`'s run started after this process (names not in `known`), or None."""
    import ray

    from harness.run_log import RUN_LOG_NAMESPACE

    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if entry["namespace"] == RUN_LOG_NAMESPACE and name.startswith(f"run_log:{notebook}:"):
            if name not in known:
                return ray.get_actor(name, namespace=RUN_LOG_NAMESPACE)
    return None


def _registered_step(fs, root: str, known: set[str]) -> int | None:
    """The step of the checkpoint Ray Train's controller registered last, from the snapshot it writes to
    the run's folder (the first folder under `root` not in `known`); None before there is one."""
    import pyarrow.fs as pafs

    runs = [
        i.path
        for i in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
        if i.type == pafs.FileType.Directory and i.path not in known
    ]
    for run in runs:
        try:
            with fs.open_input_stream(f"{run}/checkpoint_manager_snapshot.json") as snapshot:
                state = json.loads(snapshot.read())
        except (FileNotFoundError, OSError, ValueError):  # not there yet
            continue
        metrics = (state.get("latest_checkpoint_result") or {}).get("metrics") or {}
        step = metrics.get("step", metrics.get("global_step"))
        if step is not None:
            return int(step)
    return None


def main(notebook: str, at_step: int, every: int, timeout_s: float) -> int:
    import logging

    import pyarrow.fs as pafs
    import ray
    from notebook_runs import filesystem

    from harness.run_log import RUN_LOG_NAMESPACE

    deadline = time.monotonic() + timeout_s
    fs, root = filesystem(os.environ["STORAGE_PATH"], os.environ)
    known_runs = {i.path for i in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))}
    ray.init(namespace=RUN_LOG_NAMESPACE, logging_level=logging.WARNING, log_to_driver=False)
    known = {
        e["name"] for e in ray.util.list_named_actors(all_namespaces=True) if e["name"].startswith("run_log:")
    }
    run_log, progress, registered = None, {}, None
    while time.monotonic() < deadline:
        run_log = run_log or _run_log(notebook, known)
        if run_log is not None:
            progress = ray.get(run_log.progress.remote(), timeout=30)
            if progress["attempts"] > 1:
                print(f"the run restarted before step {at_step}: nothing killed", flush=True)
                return 1
            last = progress["last_step"]
            if progress["attempts"] == 1 and last >= at_step and len(progress["ranks"]) > 1:
                registered = _registered_step(fs, root, known_runs)
                if registered is not None and registered == last // every * every and last % every:
                    break
        time.sleep(0.1)
    else:
        print(f"{notebook}: no run reached step {at_step} within {timeout_s:.0f} s: {progress}", flush=True)
        return 1
    step = progress["last_step"]
    ray.get(run_log.claim_kill.remote(step, "a test outside the notebook kills the rank-1 worker"))
    pid = int(progress["ranks"][1]["pid"])
    os.kill(pid, signal.SIGKILL)
    print(json.dumps({"step": step, "pid": pid, "registered": registered}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])))
