"""A DeepSpeed ZeRO checkpoint saved by another number of workers is refused, naming NUM_WORKERS, before
DeepSpeed fails inside the workers; the universal checkpoint the message offers loads on one rank.

Real ZeRO-3 checkpoints of the tiny GPT-2, written and read by 2 (or 1) gloo ranks in spawned
processes, without Ray (the GPT-2 notebook's test checks the same on the cluster, with the bucket)."""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import subprocess
import sys
import time

import pytest
from zero_rank import zero_checkpoint_rank

import harness.cluster
import harness.parameters
import harness.storage
import helpers
from harness.run_log import RunLog
from helpers.zero_checkpoint import zero_checkpoint_world_size

# Spawned ranks saving or loading the tiny model's checkpoint: 4-8 s each measured, DeepSpeed's ops built first
# (the deepspeed_ops fixture); twice that and a margin for the spawned interpreters' imports under load.
RANKS_BUDGET_S = 60


def _ranks(world_size: int, folder, mode: str) -> list[dict]:
    """Run `zero_checkpoint_rank` on `world_size` spawned ranks; what each saw, by rank."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    args = (world_size, port, results, str(folder), mode)
    procs = [ctx.Process(target=zero_checkpoint_rank, args=(r, *args)) for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict = {}
    deadline = time.monotonic() + RANKS_BUDGET_S
    while len(got) < world_size:  # fail as soon as a rank dies, not at the deadline
        assert time.monotonic() < deadline, f"{mode} on {world_size} ranks: no answer in {RANKS_BUDGET_S} s"
        assert all(p.exitcode in (None, 0) for p in procs), [p.exitcode for p in procs]
        with contextlib.suppress(queue.Empty):
            rank, saw = results.get(timeout=1)
            got[rank] = saw
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return [got[r] for r in range(world_size)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, deepspeed_ops):
    """A ZeRO-3 checkpoint saved by 2 ranks, and the loss of each rank's fixed batch after saving."""
    folder = tmp_path_factory.mktemp("zero3") / "ckpt"
    return folder, _ranks(2, folder, "save")


# That each rank fetches only its own shard to resume, and resumes where it was, is the GPT-2 notebook's test
# on the cluster, from the bucket (test_gpt2_deepspeed.py: test_each_worker_fetched_only_its_own_shard_to_resume
# and the replayed steps' losses).


@pytest.mark.timeout(2 * RANKS_BUDGET_S)
def test_another_world_size_is_refused_naming_num_workers(saved):
    folder, before = saved
    assert zero_checkpoint_world_size(folder / "checkpoint") == 2
    with pytest.raises(helpers.ParameterError) as refused:
        helpers.zero_checkpoint.check_zero_checkpoint_workers(folder, 1)
    message = str(refused.value)
    assert "NUM_WORKERS=1" in message and "saved by 2 workers" in message and "NUM_WORKERS=2" in message
    assert "ds_to_universal" in message and "load_universal" in message
    assert helpers.zero_checkpoint.check_zero_checkpoint_workers(folder, 2) == 2
    # The conversion the message offers: DeepSpeed's universal checkpoint, next to the original.
    tag = (folder / "checkpoint" / "latest").read_text().strip()
    subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal"]
        + ["--input_folder", str(folder / "checkpoint" / tag)]
        + ["--output_folder", str(folder / "checkpoint" / f"{tag}_universal")],
        check=True,
        capture_output=True,
    )
    try:
        (saw,) = _ranks(1, folder, "load")
    finally:  # the universal folder is not part of the checkpoint the other test reads
        import shutil

        shutil.rmtree(folder / "checkpoint" / f"{tag}_universal")
        (folder / "checkpoint" / "latest_universal").unlink()
    assert "NUM_WORKERS=1" in saw["refused"] and "saved by 2 workers" in saw["refused"]  # in the worker
    # Without the check, DeepSpeed fails in load_checkpoint, after the fetch, in every worker.
    assert saw["deepspeed_error"].startswith(
        "ZeRORuntimeException: The checkpoint being loaded used a DP world size of 2"
    )
    # The universal checkpoint loads on 1 worker, with the weights the 2 ranks saved.
    assert saw["universal_loss"] == pytest.approx(before[0]["loss"], abs=1e-6)


def test_zero_rank_files_keeps_the_shared_files_and_this_ranks_shards():
    wanted = helpers.zero_checkpoint.zero_rank_files(1)
    assert wanted("checkpoint/latest") and wanted("checkpoint/epoch.txt")
    assert wanted("checkpoint/global_step12/mp_rank_00_model_states.pt")  # ZeRO 0-2: every rank reads it
    assert wanted("checkpoint/global_step12/zero_pp_rank_1_mp_rank_00_model_states.pt")
    assert wanted("checkpoint/global_step12/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert not wanted("checkpoint/global_step12/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert not wanted("checkpoint/global_step12/zero_pp_rank_11_mp_rank_00_model_states.pt")


def test_several_tags_count_the_one_latest_names(tmp_path):
    for tag, ranks in (("global_step3", 4), ("global_step6", 2)):
        (tmp_path / tag).mkdir()
        for r in range(ranks):
            (tmp_path / tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"x")
    (tmp_path / "latest").write_text("global_step6")
    assert zero_checkpoint_world_size(tmp_path) == 2
    (tmp_path / "latest").write_text("global_step3")
    assert zero_checkpoint_world_size(tmp_path) == 4
    # ZeRO stage 0 writes no shards (one mp_rank_00_model_states.pt): it resumes on any number of workers.
    stage0 = tmp_path / "stage0" / "global_step3"
    stage0.mkdir(parents=True)
    (stage0 / "mp_rank_00_model_states.pt").write_bytes(b"x")
    assert helpers.zero_checkpoint.check_zero_checkpoint_workers(stage0.parent, 7) is None


def test_run_log_keeps_what_each_resuming_rank_fetched():
    log = RunLog()
    log.start_attempt(0)
    log.log(1, 5.0)
    assert log.claim_kill(2)
    log.rank_facts(1, {"resume_bytes": 600, "checkpoint_bytes": 1000})  # as each rank's observer says
    log.rank_facts(0, {"resume_bytes": 620, "checkpoint_bytes": 1000})
    log.start_attempt(1)
    summary = log.kill_summary()
    assert summary["resume_bytes_per_rank"] == [620, 600] and summary["checkpoint_bytes"] == 1000


def test_fetch_checkpoint_fetches_only_the_chosen_files_and_counts_them(tmp_path):
    import pyarrow.fs as pafs
    import ray.train

    (tmp_path / "ckpt" / "sub").mkdir(parents=True)
    (tmp_path / "ckpt" / "mine.pt").write_bytes(b"x" * 30)
    (tmp_path / "ckpt" / "sub" / "theirs.pt").write_bytes(b"x" * 70)
    mine = lambda path: path == "mine.pt"  # noqa: E731
    local = ray.train.Checkpoint(str(tmp_path / "ckpt"))
    with harness.storage.fetch_checkpoint(local, files=mine) as folder:
        assert folder == str(tmp_path / "ckpt")  # read where it is: nothing to copy
        assert (folder.bytes_fetched, folder.checkpoint_bytes) == (30, 100)
    bucket = ray.train.Checkpoint(
        "ckpt", filesystem=pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    )
    with harness.storage.fetch_checkpoint(bucket, files=mine) as folder:
        assert os.listdir(folder) == ["mine.pt"] and (folder.bytes_fetched, folder.checkpoint_bytes) == (
            30,
            100,
        )
    with harness.storage.fetch_checkpoint(bucket) as folder:  # no filter: all of it, as before
        assert sorted(os.listdir(folder)) == ["mine.pt", "sub"] and folder.bytes_fetched == 100
