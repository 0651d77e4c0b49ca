"""helpers.smoke_overrides, helpers.failures.RunLog and the storage checks, without a cluster."""

from __future__ import annotations

import pytest

import helpers
from helpers.failures import RunLog, check_kill_step


def test_smoke_mode_replaces_defaults_and_keeps_what_was_passed(capsys):
    namespace = {"STORAGE_PATH": "s3://my-bucket/runs", "NUM_WORKERS": 16, "USE_GPU": True, "LR": 1}
    table = {
        "STORAGE_PATH": ("/mnt/cluster_storage/", "/tmp/local"),  # passed by the user: kept
        "NUM_WORKERS": (16, 2),  # still the default: replaced
        "USE_GPU": (True, False),
        "LR": (1.0, 3e-3),  # 1 == 1.0 but an int was passed: kept, never silently re-typed
    }
    assert helpers.smoke_overrides(namespace, table) == {"NUM_WORKERS": 2, "USE_GPU": False}
    out = capsys.readouterr().out
    assert "NUM_WORKERS" in out and "16 -> 2" in out and "kept what you passed" in out
    assert "'s3://my-bucket/runs'" in out


def test_smoke_mode_keeps_a_default_value_that_papermill_passed(monkeypatch):
    # `-p KILL_WORKER_AT_STEP 0` equals the full-scale default, and still means "no kill, please".
    monkeypatch.setattr(helpers.smoke, "papermill_parameters", lambda: {"KILL_WORKER_AT_STEP"})
    namespace = {"KILL_WORKER_AT_STEP": 0, "NUM_WORKERS": 16}
    table = {"KILL_WORKER_AT_STEP": (0, 40), "NUM_WORKERS": (16, 2)}
    assert helpers.smoke_overrides(namespace, table) == {"NUM_WORKERS": 2}


def test_run_log_summarises_a_kill_and_its_replay():
    log = RunLog()
    log.start_attempt(0)
    for step, loss in [(1, 5.0), (2, 4.0), (3, 3.5), (4, 3.2)]:
        log.log(step, loss)
    assert log.claim_kill(5) and not log.claim_kill(5)  # once per run, not again after the restart
    log.start_attempt(2)
    for step, loss in [(3, 3.5), (4, 3.25), (5, 3.0)]:
        log.log(step, loss)
    summary = log.kill_summary()
    assert summary == {
        "at_step": 5,
        "resumed_from_step": 2,
        "restarts": 1,
        "replayed_steps": [3, 4],
        "replayed_max_abs_diff": pytest.approx(0.05),
    }
    assert log.losses() == [5.0, 4.0, 3.5, 3.25, 3.0]  # a replayed step counts once, with its last value
    assert RunLog().kill_summary() is None


def test_kill_step_needs_a_rank_1_and_a_step_of_the_run():
    assert check_kill_step("KILL_WORKER_AT_STEP", 0, 1, 10) == 0
    with pytest.raises(helpers.ParameterError, match="NUM_WORKERS >= 2"):
        check_kill_step("KILL_WORKER_AT_STEP", 3, 1, 10)
    with pytest.raises(helpers.ParameterError, match="only 10 steps"):
        check_kill_step("KILL_WORKER_AT_STEP", 11, 2, 10)


def test_storage_path_checks(tmp_path):
    assert helpers.check_storage_path("STORAGE_PATH", str(tmp_path / "new" / "runs")) == str(
        tmp_path / "new" / "runs"
    )
    with pytest.raises(helpers.ParameterError, match="unsupported storage"):
        helpers.check_storage_path("STORAGE_PATH", "ftp://example.org/runs")
    with pytest.raises(helpers.ParameterError, match="cannot reach the bucket's endpoint at 127.0.0.1:9"):
        helpers.check_storage_path("STORAGE_PATH", "s3://b/runs?endpoint_override=127.0.0.1:9&scheme=http")
    from pyarrow.fs import LocalFileSystem

    assert helpers.storage.uri(LocalFileSystem(), "/x/y") == "/x/y"
