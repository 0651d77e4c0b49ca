"""`make job` (ci/submit_job.py) before it submits: what it ships and what it refuses, without a cluster."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from notebook_runs import ROOT


def test_credentials_in_a_jobs_values_are_refused_before_anything_records_them():
    def submit(args: list[str], env: dict) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "ci.submit_job", "glue_text_classification", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    # The job server's address is a closed port: a submission that got that far would fail differently.
    secret = "s3cr3tvalue"
    cases = [
        ({"STORAGE_PATH": f"s3://key:{secret}@bucket/runs"}, []),
        ({"MLFLOW_TRACKING_URI": f"https://user:{secret}@mlflow.example"}, []),
        ({}, ["-p", "STORAGE_PATH", f"s3://key:{secret}@bucket/runs"]),
        ({}, ["-p", "MODEL_NAME", f"mirror https://user:{secret}@hub.example/m"]),  # not at the start
        ({}, ["-p", "HF_TOKEN", f"hf_{secret}"]),
    ]
    for env, args in cases:
        full = {
            **os.environ,
            "STORAGE_PATH": "s3://bucket/runs",
            "MLFLOW_TRACKING_URI": "http://127.0.0.1:9",
            "RAY_API_SERVER_ADDRESS": "http://127.0.0.1:9",
            **env,
        }
        proc = submit(args, full)
        assert proc.returncode != 0 and "Not submitted: credentials written into" in proc.stderr, proc.stderr[
            -2000:
        ]
        assert secret not in proc.stdout + proc.stderr and "***" in proc.stderr
    # papermill's YAML, base64 and file parameters would carry values unread: refused, whatever they hold.
    for option in (["-y", f"STORAGE_PATH: s3://key:{secret}@b/r"], ["-b", "e30="], ["-f", "params.yaml"]):
        proc = submit(option, full)
        assert proc.returncode != 0 and "-p NAME VALUE only" in proc.stderr, proc.stderr[-2000:]
        assert secret not in proc.stdout + proc.stderr


def test_a_job_ships_the_notebooks_and_helpers_only(tmp_path, monkeypatch):
    # A checkout with executed notebooks at its root and in notebooks/, untracked, some with names a
    # gitignore pattern reads otherwise ("[", "\\", a trailing space): only what git tracks under SHIPPED goes.
    from ci import submit_job

    for path in ("helpers/__init__.py", "harness/x.py", "notebooks/a.ipynb", "tests/t.py", "README.md"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("x")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "add", "."], check=True)
    odd = ["out.ipynb", "notebooks/out.ipynb", "notebooks/my run.ipynb", "notebooks/résumé.ipynb"]
    odd += ["notebooks/a[1].ipynb", "helpers/*.py", "helpers/x ", "[x]", "a\\b", "results.json "]
    for name in odd:
        (tmp_path / name).write_text("executed")
    monkeypatch.setattr(submit_job, "ROOT", tmp_path)
    with submit_job.shipped_copy() as folder:
        shipped = sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*") if p.is_file())
    assert shipped == ["harness/x.py", "helpers/__init__.py", "notebooks/a.ipynb"]
    assert not Path(folder).exists()


def test_make_job_reads_the_projects_cluster_env_from_any_folder(tmp_path):
    # `make -f <project>/Makefile job` from another folder: the project's cluster.env and Python, not ./
    proc = subprocess.run(
        ["make", "-s", "-n", "-f", str(ROOT / "Makefile"), "job", "NOTEBOOK=glue_text_classification"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert f'. "{ROOT}/cluster.env"' in proc.stdout and f'"{ROOT}/.venv/bin/python"' in proc.stdout, (
        proc.stdout
    )
    # What the caller typed reaches the script through the environment, not the shell line.
    submit = proc.stdout.strip().splitlines()[-1]
    assert submit.endswith("-m ci.submit_job --from-environment"), proc.stdout


def test_make_job_runs_on_the_cluster_the_shell_names_at_full_scale():
    from ci.submit_job import with_mode

    local = {
        "RAY_API_SERVER_ADDRESS": "http://127.0.0.1:8265",
        "LLM_NOTEBOOKS_LOCAL_CLUSTER": "http://127.0.0.1:8265",
    }
    args, line = with_mode(["-p", "TASK", "stsb"], local)
    assert args == ["-p", "SMOKE_TEST", "True", "-p", "TASK", "stsb"] and "smoke mode" in line, line
    # Another cluster in the shell (a stale local cluster.env sourced before, or none): full scale.
    remote = {**local, "RAY_API_SERVER_ADDRESS": "https://ray.example.com"}
    args, line = with_mode(["-p", "TASK", "stsb"], remote)
    assert args == ["-p", "TASK", "stsb"] and "full-scale" in line and "ray.example.com" in line, line
    args, line = with_mode(["-p", "SMOKE_TEST", "True"], remote)
    assert args == ["-p", "SMOKE_TEST", "True"] and "SMOKE_TEST=True as ARGS says" in line, line
    # Only RAY_ADDRESS, as `ray.init` and Ray's job client read it: that cluster, at full scale; the line
    # names the storage and the tracking store too.
    only = {"RAY_ADDRESS": "10.0.0.5:6379", "STORAGE_PATH": "s3://bucket/runs"}
    args, line = with_mode(
        ["-p", "TASK", "stsb"], {**only, "LLM_NOTEBOOKS_LOCAL_CLUSTER": "http://127.0.0.1:8265"}
    )
    assert args == ["-p", "TASK", "stsb"] and "10.0.0.5:6379 (your cluster)" in line and "full-scale" in line
    assert "s3://bucket/runs" in line and "MLflow: a SQLite file on the head node" in line, line


def test_make_job_with_ray_address_in_the_shell_leaves_a_local_cluster_env_alone(tmp_path):
    # A `cluster.env` of `make cluster-up` lies in the project; the shell names another cluster: that one.
    env = {**os.environ, "RAY_ADDRESS": "10.0.0.5:6379"}
    env.pop("RAY_API_SERVER_ADDRESS", None)
    proc = subprocess.run(
        ["make", "-s", "-n", "-f", str(ROOT / "Makefile"), "job", "NOTEBOOK=glue_text_classification"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    script = proc.stdout
    assert 'if [ -z "$RAY_API_SERVER_ADDRESS$RAY_ADDRESS" ]' in script, script


def test_a_job_names_a_notebook_never_a_path():
    proc = subprocess.run(
        [sys.executable, "-m", "ci.submit_job", "../notebooks/glue_text_classification"],
        cwd=ROOT,
        env={
            **os.environ,
            "RAY_API_SERVER_ADDRESS": "http://127.0.0.1:1",
            "STORAGE_PATH": "/tmp/x",
            "MLFLOW_TRACKING_URI": "file:/tmp/x",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "not a notebook of this project" in proc.stderr, proc.stderr[-2000:]


def test_a_job_gets_the_hub_and_network_settings_of_the_shell_and_no_secret():
    # Only STORAGE_PATH and MLFLOW_TRACKING_URI reached a job before: HF_HOME and NCCL_* had to be on the head
    # node already. The Hub token never goes into a job's variables (Ray's job table keeps them).
    from ci.submit_job import job_env

    shell = {
        "STORAGE_PATH": "s3://bucket/runs",
        "MLFLOW_TRACKING_URI": "http://head:5000",
        "HF_HOME": "/mnt/local_nvme/hf",
        "HF_HUB_OFFLINE": "1",
        "NCCL_SOCKET_IFNAME": "ens5",
        "FI_PROVIDER": "efa",
        "HF_TOKEN": "hf_secret",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "HOME": "/home/me",
    }
    assert job_env(shell) == {
        k: shell[k]
        for k in (
            "STORAGE_PATH",
            "MLFLOW_TRACKING_URI",
            "HF_HOME",
            "HF_HUB_OFFLINE",
            "NCCL_SOCKET_IFNAME",
            "FI_PROVIDER",
        )
    }


def test_make_job_waits_for_a_long_job_to_end(monkeypatch):
    # A 13-hour run: `make job` waited 30 minutes and then gave up while the job ran on.
    import ray.job_submission

    from ci import submit_job

    statuses = iter([ray.job_submission.JobStatus.RUNNING] * 30 + [ray.job_submission.JobStatus.SUCCEEDED])
    clock = iter(range(0, 10**9, 3600))  # an hour passes between two looks

    class Client:
        def __init__(self, address=None):
            pass

        def get_job_status(self, job_id):
            return next(statuses)

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", Client)
    monkeypatch.setattr(submit_job.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(submit_job.time, "sleep", lambda s: None)
    assert submit_job.wait("a-long-job") == "SUCCEEDED"


def test_cluster_processes_get_named_variables_never_a_prefix():
    # LC_PASSWD, PYTHONCANARY and LLM_NOTEBOOKS_CANARY reached 16 of 27 cluster processes through the
    # prefixes the allowlist took (LC_, PYTHON, LLM_NOTEBOOKS_); loopback is never proxied.
    from ci.local_cluster import kept_env

    shell = {
        "LC_ALL": "C.UTF-8",
        "PYTHONPATH": "/x",
        "LLM_NOTEBOOKS_CACHE": "/c",
        "HTTP_PROXY": "http://p:3128",
    }
    canaries = {"LC_PASSWD": "c1", "PYTHONCANARY": "c2", "LLM_NOTEBOOKS_CANARY": "c3", "GITHUB_TOKEN": "c4"}
    kept = kept_env({**shell, **canaries})
    assert {k: kept.get(k) for k in shell} == shell and not set(canaries) & set(kept), kept
    assert {"127.0.0.1", "localhost"} <= set(kept["NO_PROXY"].split(",")) and kept["no_proxy"] == kept[
        "NO_PROXY"
    ]


def test_make_job_never_echoes_the_values_it_refuses():
    # The recipe line was echoed before the script refused it, credentials and all.
    env = {
        **os.environ,
        "RAY_API_SERVER_ADDRESS": "http://127.0.0.1:9",
        "STORAGE_PATH": "/tmp/runs",
        "MLFLOW_TRACKING_URI": "file:/tmp/mlruns",
    }
    proc = subprocess.run(
        [
            "make",
            "-s",
            "job",
            "NOTEBOOK=glue_text_classification",
            "ARGS=-p STORAGE_PATH s3://KEY:canarysecret@b/x",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "Not submitted: credentials written into" in proc.stderr, proc.stderr
    assert "canarysecret" not in proc.stdout + proc.stderr
