"""Run a notebook as a Ray Job on a cluster: `make job NOTEBOOK=glue_text_classification [ARGS="-p TASK stsb"]`.

    python -m ci.submit_job NOTEBOOK [papermill arguments ...]

What it does, with Ray's job SDK (as `ray job submit --working-dir . -- papermill ...` would):

- ships what the notebooks need of this project (`basics/`, `harness/`, `helpers/` and `notebooks/`, the files git tracks
  there, copied to a temporary folder: an allow-list) as the job's `working_dir`: nothing else of the
  checkout, no executed notebook, no local state; the notebook's
  `import helpers` takes the shipped copy, on the head node and in every worker, never one installed on the
  cluster;
- runs `python -m papermill notebooks/<NOTEBOOK>.ipynb <STORAGE_PATH>/jobs/<job id>/<NOTEBOOK>.ipynb` there,
  with `--log-output`, so `ray job logs <job id>` shows the notebook's printed lines (`python`: the head
  node's, or `LLM_NOTEBOOKS_JOB_PYTHON`, which the local cluster's `cluster.env` sets);
- passes `STORAGE_PATH` and `MLFLOW_TRACKING_URI` from this shell in the job's `env_vars`, and where this
  shell sets them the settings a run on GPU nodes needs that the head node may not have: the Hugging Face
  cache, mirror and offline switches (`HF_HOME`, ...: `harness.cluster.HUB_ENV_VARS`) and the collective
  communication settings (`NCCL_*`, `TORCH_NCCL_*`, libfabric's `FI_*`). Never a secret: Ray keeps a job's
  variables in its job table (the Hub token goes from the notebook's own `ray_init_args` to its workers, and the
  nodes' own credentials reach the bucket). A value with credentials written into it
  (`s3://KEY:SECRET@bucket/...`), there or in a papermill argument, is refused before anything records it:
  the job table, Ray's logs and the executed notebook would all keep it;
- waits for the job as long as it runs (Ctrl-C stops the waiting, not the job, and says how to follow or
  stop it) and prints its status, where its executed notebook is, and its log command. A `gs://` output
  needs `gcsfs` on the head node (papermill writes through it); `s3://` needs `boto3`, which the requirements install.

The cluster is `RAY_API_SERVER_ADDRESS` (its dashboard; `cluster.env` of `make cluster-up` sets it) or else
`RAY_ADDRESS`, as Ray's job client reads them, with Ray's token when the cluster uses one (`make job` reads
`cluster.env` only where neither is set). Without `MLFLOW_TRACKING_URI` the job's runs go to a SQLite file on
the head node. On the local cluster of `make cluster-up` the notebook runs in smoke
mode; on any other cluster at its full-scale values; `-p SMOKE_TEST ...` among the arguments decides instead.
Which cluster and which mode are printed before anything is submitted, then the job id, so a closed terminal
loses nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PASSED_VARS = ("STORAGE_PATH", "MLFLOW_TRACKING_URI")


def cluster_address(environ) -> str:
    """The cluster a job goes to, as Ray's job client reads it: `RAY_API_SERVER_ADDRESS` (a dashboard's
    URL), else `RAY_ADDRESS` (the address `ray.init` takes; the client finds the dashboard through it)."""
    return environ.get("RAY_API_SERVER_ADDRESS") or environ.get("RAY_ADDRESS", "")


def with_mode(papermill_args: list[str], environ) -> tuple[list[str], str]:
    """The papermill arguments the job runs with, and one line saying where and how: smoke mode on the
    local cluster (`LLM_NOTEBOOKS_LOCAL_CLUSTER`, which its `cluster.env` sets, names the cluster
    `RAY_API_SERVER_ADDRESS` names), the full-scale values anywhere else; `-p SMOKE_TEST ...` decides where
    it is given."""
    from harness.storage import redact

    address = cluster_address(environ)
    local = bool(address) and address == environ.get("LLM_NOTEBOOKS_LOCAL_CLUSTER")
    where = f"{redact(address)} ({'the local cluster of make cluster-up' if local else 'your cluster'})"
    where += f"; checkpoints and the executed notebook in {redact(environ.get('STORAGE_PATH', '(not set)'))}"
    tracking = environ.get("MLFLOW_TRACKING_URI")
    where += f"; MLflow: {redact(tracking)}" if tracking else "; MLflow: a SQLite file on the head node"
    pairs = zip(papermill_args, papermill_args[1:], papermill_args[2:], strict=False)
    given = [value for flag, name, value in pairs if flag in ("-p", "--parameters") and name == "SMOKE_TEST"]
    if given:
        return papermill_args, f"Cluster: {where}; SMOKE_TEST={given[-1]} as ARGS says."
    if local:
        return [
            "-p",
            "SMOKE_TEST",
            "True",
            *papermill_args,
        ], f"Cluster: {where}; smoke mode (SMOKE_TEST=True)."
    return papermill_args, f"Cluster: {where}; the notebook's full-scale values (ARGS changes them)."


def submit(notebook: str, papermill_args: list[str], submission_id: str | None = None) -> tuple[str, str]:
    """Submit `notebook` as a Ray Job; return (job id, where its executed notebook goes)."""
    from ray.job_submission import JobSubmissionClient

    names = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    if notebook not in names:  # a name, never a path (`../other/nb`)
        raise SystemExit(f"NOTEBOOK={notebook!r}: not a notebook of this project ({', '.join(names)})")
    missing = [] if os.environ.get("STORAGE_PATH") else ["STORAGE_PATH"]
    missing += [] if cluster_address(os.environ) else ["RAY_ADDRESS (or RAY_API_SERVER_ADDRESS)"]
    if missing:
        raise SystemExit(
            f"{', '.join(missing)} not set: set them for your cluster, or `source cluster.env` (make cluster-up)."
        )
    _refuse_credentials(job_env(os.environ), papermill_args)
    job_id = submission_id or f"{notebook}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    output = f"{os.environ['STORAGE_PATH'].rstrip('/')}/jobs/{job_id}/{notebook}.ipynb"
    python = os.environ.get("LLM_NOTEBOOKS_JOB_PYTHON", "python")  # the nodes' Python
    papermill = [python, "-m", "papermill", "--log-output", f"notebooks/{notebook}.ipynb", output]
    entrypoint = " ".join(map(_quote, [*papermill, *papermill_args]))
    client = JobSubmissionClient(cluster_address(os.environ) or None)  # with the token where needed
    with shipped_copy() as working_dir:  # Ray packs and uploads it in submit_job
        client.submit_job(
            entrypoint=entrypoint,
            submission_id=job_id,
            runtime_env={"working_dir": working_dir, "env_vars": job_env(os.environ)},
        )
    return job_id, output


SHIPPED = ("basics", "harness", "helpers", "notebooks")  # what a notebook run needs of the project


@contextlib.contextmanager
def shipped_copy():
    """A temporary folder with the files git tracks under SHIPPED, and nothing else: an allow-list, so that
    no executed notebook, results file or local state is shipped, whatever its name (`[`, `\\`, a trailing
    space). Removed on leaving."""
    import shutil
    import subprocess
    import tempfile

    tracked = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--", *SHIPPED],  # -z: names as they are
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    with tempfile.TemporaryDirectory(prefix="job-") as folder:
        for path in filter(None, tracked):
            source = ROOT / path
            if source.is_file() and not source.is_symlink():  # a deleted, not yet committed file is not
                target = Path(folder) / path
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target)
        yield folder


def job_env(environ) -> dict[str, str]:
    """The job's variables: `PASSED_VARS`, and the Hub and communication settings set in `environ`."""
    from harness.cluster import COMMUNICATION_ENV_PREFIXES, HUB_ENV_VARS

    passed = {v: environ[v] for v in (*PASSED_VARS, *HUB_ENV_VARS) if v in environ}
    return passed | {k: v for k, v in environ.items() if k.startswith(COMMUNICATION_ENV_PREFIXES)}


# papermill options whose values a job would carry unread (YAML, base64, a file): only -p NAME VALUE is
# checked, so only -p is passed.
UNCHECKED_OPTIONS = ("-y", "--parameters_yaml", "-b", "--parameters_base64", "-f", "--parameters_file")
_SECRET_NAME = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "ACCESS_KEY")


def _refuse_credentials(variables: dict[str, str], papermill_args: list[str]) -> None:
    """Exit, naming where, if a value carries credentials (a URI's user part anywhere in it, a parameter
    named like a secret), or an argument is a papermill option whose values are not checked."""
    from harness.storage import redact_all

    unchecked = [a for a in papermill_args if a.split("=", 1)[0] in UNCHECKED_OPTIONS]
    if unchecked:
        raise SystemExit(
            f"Not submitted: {', '.join(unchecked)}: a job takes its parameters as -p NAME VALUE only, each "
            "checked for credentials before Ray's job table, its logs and the executed notebook keep it."
        )
    found = [
        f"{name}={redact_all(value)!r}" for name, value in variables.items() if redact_all(value) != value
    ]
    found += [f"argument {redact_all(arg)!r}" for arg in papermill_args if redact_all(arg) != arg]
    pairs = zip(papermill_args, papermill_args[1:], strict=False)
    found += [
        f"-p {name} ***"
        for flag, name in pairs
        if flag in ("-p", "--parameters") and any(word in name.upper() for word in _SECRET_NAME)
    ]
    if found:
        raise SystemExit(
            f"Not submitted: credentials written into {', '.join(found)}. A job's variables, its entry point "
            "and its notebook are recorded (Ray's job table and logs, the executed notebook): give the "
            "cluster's nodes the credentials instead (instance credentials, or AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY in their environment)."
        )


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def wait(job_id: str, timeout_s: float | None = None) -> str:
    """Wait for the job to end (at most `timeout_s`; None: for as long as it runs, a 13-hour run included);
    return its status (SUCCEEDED, FAILED, STOPPED)."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(cluster_address(os.environ) or None)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while deadline is None or time.monotonic() < deadline:
        status = client.get_job_status(job_id)
        if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            return str(status.value)
        time.sleep(2)
    raise TimeoutError(f"job {job_id} still running after {timeout_s:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("notebook", nargs="?")
    parser.add_argument("papermill_args", nargs=argparse.REMAINDER)
    parser.add_argument(
        "--from-environment",
        action="store_true",
        help="`make job`: the notebook and papermill arguments from NOTEBOOK and ARGS (split as a shell would)",
    )
    args = parser.parse_args()
    if args.from_environment:
        import shlex

        try:
            args.notebook, args.papermill_args = (
                os.environ["NOTEBOOK"],
                shlex.split(os.environ.get("ARGS", "")),
            )
        except ValueError as exc:
            raise SystemExit(f"ARGS: {exc}") from None
    if not args.notebook:
        parser.error("NOTEBOOK is required")
    papermill_args, mode = with_mode(args.papermill_args, os.environ)
    print(mode, flush=True)
    if any(os.environ.get(v) for v in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")):
        print(
            "HF_TOKEN stays here: Ray keeps a job's variables in its job table. The nodes that load a gated "
            "model need their own (HF_TOKEN in their environment, or `hf auth login` on each).",
            flush=True,
        )
    job_id, output = submit(args.notebook, papermill_args)
    print(f"Submitted Ray Job {job_id}; its logs: ray job logs --follow {job_id}", flush=True)
    try:
        status = wait(job_id)
    except KeyboardInterrupt:
        print(
            f"\nStopped waiting; the job goes on. Follow it: ray job logs --follow {job_id}; "
            f"stop it: ray job stop {job_id}. Its executed notebook will be at {output}"
        )
        return 130
    print(f"Job {job_id}: {status}. Executed notebook: {output}")
    return 0 if status == "SUCCEEDED" else 1


if __name__ == "__main__":
    sys.exit(main())
