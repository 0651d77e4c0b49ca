"""MLflow tracking (harness.tracking) without a cluster: the embedded store, one run across restarts, the
first-cell checks. Each notebook's run on the cluster is read back from the cluster's tracking server by
notebook_runs.check_tracked_run; the unreachable server is test_bad_input.py's, a notebook as a Ray Job
test_glue_text_classification.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import harness.cluster
import harness.parameters
import harness.storage
import helpers
from basics.validate import ParameterError
from harness import tracking
from harness.run_log import RunLog


@pytest.fixture
def embedded(tmp_path, monkeypatch):
    """No MLFLOW_TRACKING_URI; the project's cache in a temporary folder."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("LLM_NOTEBOOKS_CACHE", str(tmp_path))
    names = ["LEARNING_RATE", "SMOKE_TEST", "STORAGE_PATH"]  # the parameters cell's
    monkeypatch.setattr(harness.parameters, "_parameters_cell_names", lambda: names)
    return tmp_path


def test_without_a_tracking_uri_one_run_across_restarts_lands_in_the_local_store(embedded, monkeypatch):
    import mlflow

    uri = tracking.configure()
    assert uri == f"sqlite:///{embedded}/v1/mlflow/mlflow.db" == tracking.tracking_uri()
    assert tracking.check_tracking() == uri
    namespace = {"LEARNING_RATE": 0.002, "SMOKE_TEST": True, "STORAGE_PATH": "/tmp/x"}
    run_id = tracking.start_run("unit", namespace)
    # What the observers send the run's RunLog actor, which logs it to MLflow from a thread of its own. The
    # first attempt (2 workers) logs steps 1-4 and dies; the second (1 worker) resumed from step 2 runs 3-6:
    # 3 and 4 are replays, not logged again.
    log = RunLog(6, mlflow_run_id=run_id)
    log.start_attempt(0, world_size=2)
    for step in range(1, 5):
        log.log(step, 1.0 / step)
    log.start_attempt(2, world_size=1)
    for step in range(3, 7):
        log.log(step, 10.0 + step, lr=0.1)
    assert log.flush_tracking(timeout=30) == 0
    assert not any(line.startswith("warning") for line in log.lines)
    results = {
        "losses": [1.0, 0.5, 13.0, 14.0, 15.0, 16.0],
        "checkpoint_path": "/tmp/x/checkpoint_000006",
        "kill": {"at_step": 5, "resumed_from_step": 2, "restarts": 1},
        "eval_metrics": {"accuracy": 0.75},
        "wall_seconds": 12.5,
    }
    tracking.finish_run(run_id, results)

    client = mlflow.MlflowClient(tracking_uri=uri)  # read back with MLflow itself
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"LEARNING_RATE": "0.002", "SMOKE_TEST": "True", "STORAGE_PATH": "/tmp/x"}
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))
    assert history == [(1, 1.0), (2, 0.5), (3, 1 / 3), (4, 0.25), (5, 15.0), (6, 16.0)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "resumed_from_step")] == [(2, 2.0)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "lr")] == [(5, 0.1), (6, 0.1)]
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "world_size")) == [
        (0, 2.0),
        (2, 1.0),
    ]
    assert run.data.metrics["final.eval_metrics.accuracy"] == 0.75
    assert run.data.tags["checkpoint_uri"] == "/tmp/x/checkpoint_000006"
    assert run.data.tags["killed_worker_at_step"] == "5"
    stored = Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="results.json"))
    assert json.loads(stored.read_text())["kill"]["resumed_from_step"] == 2
    assert str(embedded) in stored.as_posix() or stored.exists()  # the artifacts live in the cache
    assert tracking.ui_command() == f"mlflow ui --backend-store-uri {uri}"
    assert not (Path.cwd() / "mlruns").exists()  # nothing beside the notebook


def test_credentials_in_the_tracking_uri_are_refused_without_repeating_them(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://someone:canary-secret@mlflow.example.com")
    with pytest.raises(ParameterError) as error:
        tracking.check_tracking()
    assert "MLFLOW_TRACKING_URI='https://***@mlflow.example.com'" in str(error.value)
    assert "canary-secret" not in str(error.value) and "MLFLOW_TRACKING_TOKEN" in str(error.value)


def test_the_tracking_settings_reach_the_workers_and_its_secrets_only_through_the_setup_hook(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.internal:5000")
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "canary-token")
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    env = harness.cluster.job_runtime_env(attach=True)
    assert env["env_vars"]["MLFLOW_TRACKING_URI"] == "http://mlflow.internal:5000"
    assert env["env_vars"]["MLFLOW_DISABLE_TELEMETRY"] == "true"
    assert "canary-token" not in json.dumps(env["env_vars"]) and "py_modules" in env
    hook = env["worker_process_setup_hook"]
    monkeypatch.delenv("MLFLOW_TRACKING_TOKEN")
    hook()
    import os

    assert os.environ.pop("MLFLOW_TRACKING_TOKEN") == "canary-token"
    # In a Ray Job: its working_dir ships helpers, and what the job sets is left to it (Ray refuses a field
    # or a variable set twice).
    job = {"runtime_env": {"working_dir": "gcs://pkg.zip", "env_vars": {"MLFLOW_TRACKING_URI": "http://x"}}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(job))
    env = harness.cluster.job_runtime_env(attach=True)
    assert "py_modules" not in env and "MLFLOW_TRACKING_URI" not in env["env_vars"]


def test_a_tracking_server_gone_at_the_end_costs_the_summary_not_the_results(
    embedded, tmp_path, monkeypatch, capsys
):
    # The run started while the server answered; at the end nothing listens there. The results file is
    # written first, whole, and one line says that MLflow did not get the summary, within seconds.
    import socket
    import time

    run_id = tracking.start_run(
        "unit", {"LEARNING_RATE": 0.002, "SMOKE_TEST": True, "STORAGE_PATH": "/tmp/x"}
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", closed)
    checkpoint = tmp_path / "checkpoint_000002"
    checkpoint.mkdir()
    path = tmp_path / "results.json"
    start = time.perf_counter()
    written = helpers.write_results(
        str(path),
        notebook="unit",
        smoke_test=True,
        wall_seconds=1.0,
        losses=[1.0, 0.5],
        checkpoint_path=str(checkpoint),
        mlflow_run_id=run_id,
    )
    assert time.perf_counter() - start < 30
    assert json.loads(path.read_text())["losses"] == [1.0, 0.5] and "mlflow" not in written
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and printed[0].startswith(
        f"MLflow: the run's summary was not recorded at {closed}"
    )


def test_a_cell_that_fails_after_the_run_started_marks_it_failed(embedded):
    # In a notebook's kernel: the run stays RUNNING while cells succeed, and a failing cell marks it FAILED.
    import mlflow
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        run_id = tracking.start_run(
            "unit", {"LEARNING_RATE": 0.002, "SMOKE_TEST": True, "STORAGE_PATH": "/tmp/x"}
        )
        client = mlflow.MlflowClient(tracking_uri=tracking.tracking_uri())
        shell.run_cell("x = 1")
        assert client.get_run(run_id).info.status == "RUNNING"
        shell.run_cell("raise RuntimeError('the training failed')")
        assert client.get_run(run_id).info.status == "FAILED"
    finally:
        InteractiveShell.clear_instance()


def test_a_hosted_store_named_without_a_scheme_is_not_a_folder(tmp_path, monkeypatch):
    # MLFLOW_TRACKING_URI=databricks (MLflow's name for a Databricks workspace): no folder "databricks" here.
    from harness import tracking

    monkeypatch.chdir(tmp_path)
    for uri in ("databricks", "databricks://profile", "databricks-uc"):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        tracking.check_tracking()
        assert not tracking._is_local(uri)
    assert list(tmp_path.iterdir()) == []
    assert tracking._is_local("sqlite:///x/mlflow.db") and tracking._is_local("./mlruns")
