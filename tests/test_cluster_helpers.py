"""harness.parameters.smoke_overrides, harness.run_log.RunLog and the storage checks, without a cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

import harness.cluster
import harness.parameters
import harness.results
import harness.sizing
import harness.storage
import helpers
from harness.run_log import RunLog


def test_smoke_mode_replaces_defaults_and_keeps_what_was_passed(capsys):
    namespace = {
        "STORAGE_PATH": "s3://my-bucket/runs",
        "NUM_WORKERS": 16,
        "USE_GPU": True,
        "LEARNING_RATE": 1,
    }
    table = {
        "STORAGE_PATH": ("/mnt/cluster_storage/", "/tmp/local"),  # passed by the user: kept
        "NUM_WORKERS": (16, 2),  # still the default: replaced
        "USE_GPU": (True, False),
        "LEARNING_RATE": (1.0, 3e-3),  # 1 == 1.0 but an int was passed: kept, never silently re-typed
    }
    assert harness.parameters.smoke_overrides(namespace, table) == {"NUM_WORKERS": 2, "USE_GPU": False}
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows["NUM_WORKERS"] == ["16", "2"]  # parameter, full scale, smoke run
    assert rows["STORAGE_PATH"] == ["'/mnt/cluster_storage/'", "'s3://my-bucket/runs'", "(yours,", "kept)"]
    assert rows["LEARNING_RATE"][-2:] == ["(yours,", "kept)"]


def test_smoke_mode_keeps_a_default_value_that_papermill_passed(monkeypatch):
    # `-p KILL_WORKER_AT_STEP 0` equals the full-scale default, and still means "no kill, please".
    monkeypatch.setattr(harness.parameters, "papermill_parameters", lambda: {"KILL_WORKER_AT_STEP"})
    namespace = {"KILL_WORKER_AT_STEP": 0, "NUM_WORKERS": 16}
    table = {"KILL_WORKER_AT_STEP": (0, 40), "NUM_WORKERS": (16, 2)}
    assert harness.parameters.smoke_overrides(namespace, table) == {"NUM_WORKERS": 2}


PARAMETERS_CELL = (
    'BATCH_SIZE_PER_WORKER = 1  # per worker\nMAX_STEPS = 500\nSMOKE_TEST = False\nRESULTS_PATH = ""\n'
)


def test_a_name_papermill_passed_that_the_notebook_lacks_fails(monkeypatch):
    # IPython's `In`: the parameters cell, then the cell papermill injects after it.
    injected = "# Parameters\nBATCH_SIZE = 4\nMAX_STEP = 8\nLORA_RANK = 8\nSMOKE_TEST = True\n"
    monkeypatch.setattr(harness.parameters, "_history", lambda: ["", PARAMETERS_CELL, injected])
    with pytest.raises(helpers.ParameterError) as error:
        harness.parameters.check_parameter_names({})
    message = str(error.value)
    assert "BATCH_SIZE (did you mean BATCH_SIZE_PER_WORKER?)" in message  # a renamed parameter
    assert "MAX_STEP (did you mean MAX_STEPS?)" in message  # a misspelt one
    assert "LORA_RANK (LoRA has its own notebook, llama_lora)" in message  # one that moved
    assert "Its parameters are: BATCH_SIZE_PER_WORKER, MAX_STEPS, SMOKE_TEST, RESULTS_PATH." in message


def test_known_names_pass_and_the_results_get_every_parameter(monkeypatch):
    injected = "# Parameters\nMAX_STEPS = 8\nSMOKE_TEST = True\n"
    monkeypatch.setattr(harness.parameters, "_history", lambda: ["", PARAMETERS_CELL, injected, "x = 1"])
    namespace = {"BATCH_SIZE_PER_WORKER": 8, "MAX_STEPS": 8, "SMOKE_TEST": True, "RESULTS_PATH": "", "x": 1}
    names = ["BATCH_SIZE_PER_WORKER", "MAX_STEPS", "SMOKE_TEST", "RESULTS_PATH"]
    assert harness.parameters.check_parameter_names(namespace) == names
    assert harness.parameters.parameter_values(namespace) == {
        "BATCH_SIZE_PER_WORKER": 8,
        "MAX_STEPS": 8,
        "SMOKE_TEST": True,
        "RESULTS_PATH": "",
    }


def test_without_a_cell_history_the_parameters_are_the_upper_case_names_so_far(monkeypatch):
    # nbval runs cells without IPython's history: the first cell after the parameters sees only them.
    monkeypatch.setattr(harness.parameters, "_history", lambda: [])
    namespace = {
        "os": object(),
        "In": [],
        "MODEL_NAME": "tiny",
        "NUM_WORKERS": 2,
        "_": None,
        "SMOKE_TEST": True,
    }
    assert harness.parameters.check_parameter_names(namespace) == ["MODEL_NAME", "NUM_WORKERS", "SMOKE_TEST"]
    namespace.update(NUM_WORKERS=4, later=1)
    assert harness.parameters.parameter_values(namespace) == {
        "MODEL_NAME": "tiny",
        "NUM_WORKERS": 4,
        "SMOKE_TEST": True,
    }


def test_each_notebook_keeps_its_own_run_record(monkeypatch):
    # Two notebooks set up in one process (as these tests do): each one's parameters, smoke replacements
    # and clock are in its own globals (`__run__`), none in a module another notebook's Set up rewrites.
    monkeypatch.setattr(harness.parameters, "_history", lambda: [])
    monkeypatch.setattr(harness.parameters, "papermill_parameters", lambda: set())
    first = {"MODEL_NAME": "gpt2", "NUM_WORKERS": 16, "SMOKE_TEST": True}
    second = {"TASK": "cola", "NUM_WORKERS": 1, "SMOKE_TEST": False}
    harness.parameters.smoke_overrides(first, {"NUM_WORKERS": (16, 2)})
    first["NUM_WORKERS"] = 2  # what helpers.use_smoke_values writes
    harness.results.start_clock(first, "first")
    harness.parameters.check_parameter_names(first)
    harness.results.start_clock(second, "second")
    harness.parameters.check_parameter_names(second)
    assert harness.parameters.parameter_values(first) == {
        "MODEL_NAME": "gpt2",
        "NUM_WORKERS": 2,
        "SMOKE_TEST": True,
    }
    assert list(harness.parameters.parameter_values(second)) == ["TASK", "NUM_WORKERS", "SMOKE_TEST"]
    assert harness.parameters.full_scale_defaults(first) == {"NUM_WORKERS": 16}
    assert harness.parameters.full_scale_defaults(second) == {}
    assert first["__run__"].notebook == "first" and second["__run__"].notebook == "second"
    assert 0 <= harness.results.elapsed(first) < 60 and harness.results.elapsed({}) == 0.0
    first["NUM_WORKERS"] = 16  # the parameters cell run again, not in smoke mode: nothing replaced
    assert harness.parameters.full_scale_defaults(first) == {}


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


def test_run_log_prints_a_line_per_interval_and_the_restart():
    # What the training cell shows (harness.run_log.show_progress prints these lines from the driver).
    log = RunLog(total_steps=10, print_every=4)
    log.start_attempt(0)
    for step in range(1, 7):
        log.log(step, 7.0 - step, lr=1e-3)
    assert log.claim_kill(7)
    log.start_attempt(4)
    for step in range(5, 11):
        log.log(step, 7.0 - step)
    assert log.lines == [
        "step 4/10  loss 3.0000  lr 1.00e-03",
        "a worker's process is killed (SIGKILL) at step 7: the worker group fails",
        "Ray Train started a new worker group (attempt 2); it resumes from the checkpoint at step 4",
        "step 5/10  loss 2.0000  (attempt 2)",  # the first step after a restart, to show where it picked up
        "step 8/10  loss -1.0000  (attempt 2)",
        "step 10/10  loss -3.0000  (attempt 2)",  # the last step, always
    ]
    assert log.lines_since(4) == log.lines[4:]


def test_run_log_keeps_each_attempts_world_size_and_says_when_it_changes():
    # An elastic run (the Llama notebook's MIN_WORKERS): 2 workers, 1 after a node is lost, 2 again.
    log = RunLog(total_steps=9, print_every=3)
    log.start_attempt(0, world_size=2, micro_steps=2)
    log.log(1, 6.0, _seconds=1.5)
    log.start_attempt(0, world_size=1, micro_steps=4)
    log.log(1, 6.0)
    log.start_attempt(6, world_size=2, micro_steps=2)
    for rank in (1, 0):  # what each rank read to resume, as its observer says (in no particular order)
        log.rank_facts(rank, {"node_id": f"n{rank}", "resume_bytes": 5, "checkpoint_bytes": 9})
    assert (
        log.lines[0]
        == "Ray Train started a new worker group of 1 worker (was 2) (attempt 2); it resumes from the start: no checkpoint had been reported yet"
    )
    assert (
        log.lines[-1]
        == "Ray Train started a new worker group of 2 workers (was 1) (attempt 3); it resumes from the checkpoint at step 6"
    )
    attempts = log.attempt_losses()
    assert [(a["world_size"], a["resumed_from_step"], a["micro_steps"]) for a in attempts] == [
        (2, 0, 2),
        (1, 0, 4),
        (2, 6, 2),
    ]
    assert attempts[0]["losses"] == {"1": 6.0} and attempts[0]["step_seconds"] == {"1": 1.5}
    assert attempts[2]["resume_bytes_per_rank"] == [5, 5] and attempts[2]["checkpoint_bytes"] == 9
    assert [r["node_id"] for r in attempts[2]["ranks"]] == ["n0", "n1"] and attempts[0]["ranks"] == []


def test_show_progress_prints_every_line_once_in_order(capsys):
    import ray

    from harness.run_log import show_progress

    class Remote:  # the actor's handle, as show_progress uses it: method.remote(...) -> ray.get(...)
        def __init__(self, log):
            self.lines_since = type("M", (), {"remote": staticmethod(log.lines_since)})

    log = RunLog(total_steps=3)
    log.start_attempt(0)
    real_get = ray.get
    ray.get = lambda value: value  # the "object refs" here are the values themselves
    try:
        with show_progress(Remote(log), poll_seconds=0.01):
            for step in (1, 2, 3):
                log.log(step, 1.0 / step)
    finally:
        ray.get = real_get
    assert capsys.readouterr().out.splitlines() == [
        "step 1/3  loss 1.0000",
        "step 2/3  loss 0.5000",
        "step 3/3  loss 0.3333",
    ]


def test_storage_path_checks(tmp_path):
    assert harness.storage.check_storage_path("STORAGE_PATH", str(tmp_path / "new" / "runs")) == str(
        tmp_path / "new" / "runs"
    )
    with pytest.raises(helpers.ParameterError, match="unsupported storage"):
        harness.storage.check_storage_path("STORAGE_PATH", "ftp://example.org/runs")
    with pytest.raises(helpers.ParameterError, match="cannot reach the bucket's endpoint at 127.0.0.1:9"):
        harness.storage.check_storage_path(
            "STORAGE_PATH", "s3://b/runs?endpoint_override=127.0.0.1:9&scheme=http"
        )
    from pyarrow.fs import LocalFileSystem

    assert harness.storage.uri(LocalFileSystem(), "/x/y") == "/x/y"


def test_a_fetched_checkpoint_is_private_to_each_reader(tmp_path):
    # A filesystem that is not pyarrow's LocalFileSystem stands for a bucket: each reader gets its own copy.
    import pyarrow.fs as pafs
    import ray.train

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "trainer_state.json").write_text('{"step": 32}')
    local = ray.train.Checkpoint(str(tmp_path / "ckpt"))
    with harness.storage.fetch_checkpoint(local) as folder:
        assert folder == str(tmp_path / "ckpt")  # a local (or NFS) checkpoint is read where it is
    remote = ray.train.Checkpoint(
        "ckpt", filesystem=pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    )
    with (
        harness.storage.fetch_checkpoint(remote) as first,
        harness.storage.fetch_checkpoint(remote) as second,
    ):
        assert first != second and str(tmp_path) not in first
        for folder in (first, second):
            assert (Path(folder) / "trainer_state.json").read_text() == '{"step": 32}'
    assert not Path(first).exists() and not Path(second).exists()  # deleted after the block


def test_nccl_and_efa_settings_reach_the_workers(monkeypatch):
    # Set in the notebook, NCCL_* / FI_* would reach no worker on another node: the job carries them (issue 21,
    # item 9), next to the Hugging Face settings; other variables stay behind.
    import harness.cluster

    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ens5")
    monkeypatch.setenv("FI_EFA_USE_DEVICE_RDMA", "1")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    monkeypatch.setenv("SOME_OTHER_SETTING", "x")
    env_vars = harness.cluster.job_runtime_env(attach=False)["env_vars"]
    assert env_vars["NCCL_SOCKET_IFNAME"] == "ens5" and env_vars["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert env_vars["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and "SOME_OTHER_SETTING" not in env_vars


def test_compiling_workers_use_the_cores_they_reserved(monkeypatch):
    # Inductor's default is min(32, the node's cores) compile processes per rank: 256 on an 8-GPU node. With
    # USE_COMPILE, Set up sets CPUS_PER_WORKER and the job carries it to every worker; a shell's own value wins.
    import harness.cluster
    from harness.checks import compiled_attention
    from harness.notebooks import defaults

    p = defaults("llama_fsdp").replace(USE_FLASH_ATTN=False, CPUS_PER_WORKER=10)
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    compiled_attention(p.replace(USE_COMPILE=False))
    assert "TORCHINDUCTOR_COMPILE_THREADS" not in harness.cluster.job_runtime_env(attach=False)["env_vars"]
    compiled_attention(p.replace(USE_COMPILE=True))
    assert harness.cluster.job_runtime_env(attach=False)["env_vars"]["TORCHINDUCTOR_COMPILE_THREADS"] == "10"
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "4")
    compiled_attention(p.replace(USE_COMPILE=True))
    assert harness.cluster.job_runtime_env(attach=False)["env_vars"]["TORCHINDUCTOR_COMPILE_THREADS"] == "4"


def test_local_disk_is_checked_where_the_hub_cache_and_temp_folder_are(tmp_path, monkeypatch):
    import tempfile

    from huggingface_hub import constants

    from harness.nodes import local_disk_shortfall

    hub, temp = tmp_path / "hf" / "hub", tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))  # not there yet: its parent's disk counts
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    huge = 10**18  # more than any disk
    short = local_disk_shortfall({"hub cache": huge, "temp": 1}, "meta-llama/Llama-2-70b-chat-hf")
    # One filesystem under both: one line naming both folders, their needs added up.
    assert len(short) == 1 and f"hub cache {hub}" in short[0] and f"temp {temp}" in short[0], short
    assert "1000000000.0 GB" in short[0]
    # A model in a local folder downloads nothing; a little room is found.
    assert local_disk_shortfall({"hub cache": huge, "temp": 1}, str(tmp_path)) == []
    assert local_disk_shortfall({"hub cache": 1, "temp": 1}, "meta-llama/Llama-2-70b-chat-hf") == []


def test_a_small_json_next_to_a_checkpoint_has_the_checkpoints_deadline(tmp_path):
    import threading

    import pyarrow.fs as pafs

    from harness.storage import StorageStalled, read_json, write_json

    local = pafs.LocalFileSystem()
    write_json(local, str(tmp_path / "trainer_state.json"), {"step": 12})
    assert read_json(local, str(tmp_path / "trainer_state.json")) == {"step": 12}

    release = threading.Event()

    class Stalled:  # a bucket that never answers
        def open_output_stream(self, path):
            release.wait(30)
            raise OSError("released")

    try:
        with pytest.raises(StorageStalled, match="not written in 2 tries"):
            write_json(Stalled(), "bucket/trainer_state.json", {"step": 12}, stall_s=0.2, tries=2)
    finally:
        release.set()


def test_an_export_upload_has_a_deadline(tmp_path, monkeypatch):
    # The 138 GB export and LoRA's adapter folder go up with pafs.copy_files: a stalled bucket must fail the
    # attempt (Ray Train's next one exports again), not hold the run for ever.
    import threading

    import pyarrow.fs as pafs

    from harness.storage import StorageStalled, upload_folder

    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "model.safetensors").write_bytes(b"x" * 1000)
    upload_folder(str(tmp_path / "export"), pafs.LocalFileSystem(), str(tmp_path / "bucket" / "consolidated"))
    assert (tmp_path / "bucket" / "consolidated" / "model.safetensors").read_bytes() == b"x" * 1000

    release = threading.Event()
    monkeypatch.setattr(pafs, "copy_files", lambda *args, **kwargs: release.wait(30))  # a bucket that stalls
    try:
        with pytest.raises(StorageStalled, match="not written in 1 tries"):
            upload_folder(
                str(tmp_path / "export"), pafs.LocalFileSystem(), str(tmp_path / "stalled"), stall_s=0.2
            )
    finally:
        release.set()


def test_a_local_storage_path_must_be_one_folder_on_every_node(tmp_path, monkeypatch):
    # /mnt/cluster_storage/ passes wherever /mnt is writable; each node keeping its own shards would fail the
    # first resume, after hours. The notebook writes a marker, and every node must read it back.
    from harness import nodes

    seen = {}

    def every_node(check, *args, use_gpu=False):
        seen["here"] = check(*args)  # this machine sees what it wrote
        return {"10.0.0.1 head": seen["here"], "10.0.0.2 worker": check(str(tmp_path / "elsewhere"), args[1])}

    monkeypatch.setattr(nodes, "_on_every_node", every_node)
    with pytest.raises(
        helpers.ParameterError, match=r"STORAGE_PATH=.*1 of 2 Ray nodes do not see .*10.0.0.2"
    ):
        nodes.check_storage_from_nodes("STORAGE_PATH", str(tmp_path / "runs"))
    assert seen["here"] is True and list((tmp_path / "runs").iterdir()) == []  # the marker is gone
    monkeypatch.setattr(
        nodes, "_on_every_node", lambda check, *args, **kw: {"a": check(*args), "b": check(*args)}
    )
    assert nodes.check_storage_from_nodes("STORAGE_PATH", f"file://{tmp_path / 'runs'}") == 2


def test_a_storage_path_under_home_is_checked_where_ray_writes(tmp_path, monkeypatch):
    # Ray Train (pyarrow) expands `~`: the marker goes under the home folder too, never into a folder named
    # `~` beside the notebook, and every node reads it at that path.
    from harness import nodes

    home, cwd = tmp_path / "home", tmp_path / "notebooks"
    home.mkdir(), cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    read = []

    def every_node(check, path, token, use_gpu=False):
        read.append(path)
        return {"a": check(path, token), "b": check(path, token)}

    monkeypatch.setattr(nodes, "_on_every_node", every_node)
    assert nodes.check_storage_from_nodes("STORAGE_PATH", "~/ray_results") == 2
    assert read[0].startswith(f"{home}/ray_results/") and (home / "ray_results").is_dir()
    assert list(cwd.iterdir()) == []  # no folder named `~`


def test_a_cluster_whose_gpus_are_smaller_than_the_plans_is_refused(monkeypatch):
    # Sixteen A100-40GB under the default {"p4de.24xlarge": 2}: the plan's 98 % of 80 GB passed, and the run
    # failed after the 138 GB download. Each GPU node says what its GPUs have (nvidia-smi, in a task there).
    from harness import nodes
    from harness.notebooks import defaults

    p = defaults("llama_fsdp").replace(USE_GPU=True, CLUSTER={"p4de.24xlarge": 2})
    monkeypatch.setattr(nodes, "_on_every_node", lambda check, **kw: {"a": 40 * 2**30, "b": 40 * 2**30})
    with pytest.raises(helpers.ParameterError, match=r"CLUSTER=.*A100-80GB.*2 of this cluster's 2 GPU node"):
        nodes.check_gpus_match_cluster(p)
    monkeypatch.setattr(nodes, "_on_every_node", lambda check, **kw: {"a": 80 * 2**30, "b": None})
    assert nodes.check_gpus_match_cluster(p) == 2  # 80 GiB as nvidia-smi counts; a node that cannot tell
    assert nodes.check_gpus_match_cluster(p.replace(USE_GPU=False)) == 0


def test_measuring_a_resume_lists_the_bucket_with_a_deadline(monkeypatch):
    # The observer's first step after a resume reports what the rank read of the checkpoint and the
    # checkpoint's size, from a LIST of the bucket: a stalled bucket must cost that step seconds, not hours.
    import threading
    import time

    from harness import storage

    release = threading.Event()

    class Reader:
        bytes_read = 123

    monkeypatch.setattr(storage, "LAST_FETCH", [])  # nothing fetched in this process (other tests share it)
    monkeypatch.setattr(storage, "LIST_S", 0.2)
    monkeypatch.setattr(storage, "_file_sizes", lambda fs, path: release.wait(30) and {})
    storage.LAST_READ[:] = [Reader(), None, "bucket/checkpoint_000004/sharded"]
    start = time.monotonic()
    try:
        assert storage.take_last_fetch() == (123, None)
    finally:
        release.set()
    assert time.monotonic() - start < 5


def test_cluster_passed_as_text_is_read_as_the_mapping_it_writes(capsys):
    # papermill's -p passes `{"p4d.24xlarge": 2}` as text: `make plan` read it, Set up refused it.
    from harness.checks import cluster_from_text
    from harness.notebooks import defaults

    p = defaults("llama_fsdp")
    assert cluster_from_text(p.replace(CLUSTER='{"p4d.24xlarge": 2}')).CLUSTER == {"p4d.24xlarge": 2}
    assert "given as text" in capsys.readouterr().out
    for bad in ("p4d.24xlarge", '{"p4d.24xlarge": "two"}', "{1: 2}"):
        with pytest.raises(helpers.ParameterError, match=r"CLUSTER=.*an instance type and a count"):
            cluster_from_text(p.replace(CLUSTER=bad))


def test_cluster_env_sets_its_values_and_runs_nothing_when_sourced(tmp_path):
    # NO_PROXY='corp.example;touch pwned #' make cluster-up wrote a line that ran `touch` when sourced, and
    # dropped loopback from NO_PROXY.
    import subprocess

    from ci.local_cluster import env_file_text, no_proxy, read_env_file

    proxy = no_proxy({"NO_PROXY": "corp.example;touch pwned #,.internal.example,10.0.0.0/8,[::1]:8080"})
    assert proxy["NO_PROXY"].split(",")[:3] == [".internal.example", "10.0.0.0/8", "[::1]:8080"]
    assert "127.0.0.1" in proxy["NO_PROXY"] and "pwned" not in proxy["NO_PROXY"]
    hostile = {"STORAGE_PATH": "s3://b/x'; touch pwned; '", "ODD": 'a b $(touch pwned) `id` \\ "q"', **proxy}
    env_file = tmp_path / "cluster.env"
    env_file.write_text(env_file_text(["# header"], hostile))
    shown = subprocess.run(
        ["bash", "-c", f'. "{env_file}" && printf "%s\\n" "$STORAGE_PATH" "$ODD" "$NO_PROXY"'],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert shown == [hostile["STORAGE_PATH"], hostile["ODD"], proxy["NO_PROXY"]]
    assert not (tmp_path / "pwned").exists()
    assert read_env_file(env_file) == hostile


def test_the_bucket_is_probed_from_the_nodes_that_run_workers_and_the_driver(monkeypatch):
    # A cluster's CPU-only node group without the bucket's credentials refused a GPU run that never uses it.
    from harness import nodes

    asked = {}

    def every_node(check, *args, use_gpu=False):
        asked["use_gpu"] = use_gpu
        return {"10.0.0.2 gpu-node": None}

    monkeypatch.setattr(nodes, "_on_every_node", every_node)
    monkeypatch.setattr(nodes, "_probe_storage", lambda uri: None)  # this driver writes there
    assert nodes.check_storage_from_nodes("STORAGE_PATH", "s3://bucket/runs", use_gpu=True) == 1
    assert asked["use_gpu"] is True  # the GPU nodes (and this driver)


def test_a_resume_lists_and_reads_the_checkpoint_with_a_deadline(monkeypatch, tmp_path):
    # Dolly's checkpoint_in_place and GPT-2's ZeRO checks listed the bucket (and read DeepSpeed's `latest`)
    # without a deadline: a stalled bucket held the resume for as long as it stalled.
    import threading
    import time
    import types

    import pyarrow.fs as pafs

    from harness import storage
    from helpers.zero_checkpoint import zero_checkpoint_world_size

    release = threading.Event()
    monkeypatch.setattr(storage, "STALL_S", 0.3)
    monkeypatch.setattr(storage, "WRITE_TRIES", 1)
    monkeypatch.setattr(storage, "_file_sizes", lambda fs, path: release.wait(30) and {})
    checkpoint = types.SimpleNamespace(filesystem=pafs.LocalFileSystem(), path=str(tmp_path))
    try:
        for resume in (
            lambda: storage.checkpoint_in_place(checkpoint),
            lambda: zero_checkpoint_world_size(checkpoint),
        ):
            start = time.monotonic()
            with pytest.raises(storage.StorageStalled):
                resume()
            assert time.monotonic() - start < 5
    finally:
        release.set()


def test_compiling_uses_sdpa_rather_than_flash_attention(capsys):
    # flash-attn's packed-sequence check breaks the compiled graph at every layer (the compile speed-up was
    # measured with sdpa).
    from harness.checks import compiled_attention
    from harness.notebooks import defaults

    both = defaults("llama_fsdp").replace(USE_COMPILE=True, USE_FLASH_ATTN=True)
    assert compiled_attention(both).USE_FLASH_ATTN is False and "sdpa" in capsys.readouterr().out
    assert compiled_attention(both.replace(USE_COMPILE=False)).USE_FLASH_ATTN is True


def test_compiling_on_gpu_nodes_that_cannot_build_kernels_falls_back_to_eager(monkeypatch):
    # USE_COMPILE=True, the full-scale default, first tried at the first step after the 70B load: on an image
    # without a C compiler every attempt failed there.
    from harness import checks, nodes
    from harness.notebooks import defaults

    monkeypatch.setattr(
        nodes, "_on_every_node", lambda check, use_gpu=False: {"10.0.0.2 gpu": "a C compiler"}
    )
    p = defaults("llama_fsdp").replace(USE_COMPILE=True)
    with pytest.warns(UserWarning, match=r"USE_COMPILE=True -> False: 1 GPU node.*lacks a C compiler"):
        eager, said = checks.compile_or_eager(p)
    assert "eager" in said and eager.USE_COMPILE is False
    monkeypatch.setattr(nodes, "_on_every_node", lambda check, use_gpu=False: {"10.0.0.2 gpu": check()})
    monkeypatch.setattr(nodes, "_compile_prerequisites", lambda: None)
    compiled, said = checks.compile_or_eager(p)
    assert "can build" in said and compiled.USE_COMPILE is True


def test_storage_too_slow_for_a_checkpoint_within_the_timeout_is_refused_before_training(tmp_path):
    # The storage probe wrote 2 bytes; a 70B rank's 51.7 GB at 30 MB/s takes 29 min, more than the 24 min a
    # save may take at COLLECTIVE_TIMEOUT_S=1800: every checkpoint would fail, hours in (issue 71, item 6).
    import warnings

    from harness.checks import check_storage_rate
    from harness.nodes import storage_rate

    rate = storage_rate(str(tmp_path), 8 << 20)  # this node, 8 MiB in the rank's 4 streams
    assert isinstance(rate, float) and rate > 0 and not list(tmp_path.iterdir())  # measured, then deleted
    plan = {"checkpoint_rank_bytes": 51.7e9, "checkpoint_limit_seconds": 1440}
    with pytest.raises(
        helpers.ParameterError, match=r"30 MB/s .* 28.7 min, more than the 24 min .* COLLECTIVE"
    ):
        check_storage_rate("s3://bucket/runs", plan, {"10.0.0.2 gpu-node": 30e6, "10.0.0.3 gpu-node": 900e6})
    with pytest.warns(UserWarning, match=r"120 MB/s .* 7.2 min, slower than the plan's 4 x 50 MB/s"):
        assert check_storage_rate("s3://bucket/runs", plan, {"10.0.0.2 gpu-node": 120e6}).startswith(
            "; storage 120"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_storage_rate(
            "s3://bucket/runs", plan, {"10.0.0.2 gpu-node": 900e6, "10.0.0.3 x": "OSError: no"}
        )
