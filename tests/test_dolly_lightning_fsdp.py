"""Dolly + Lightning + FSDP notebook, in smoke mode: real FSDP on 2 CPU workers, checked by its numbers."""

from __future__ import annotations

import math

import pytest
from notebook_runs import (
    SMOKE_RUN_KILL,
    check_cluster_run,
    check_plan_matches_shards,
    file_sizes,
    filesystem,
    last_checkpoint_before,
    listing,
    pinned_losses,
    smoke_nbval,
)

import harness.storage
import helpers

NAME = "dolly_lightning_fsdp"
# The pinned first losses (how measured, tolerance): tests/assets/losses/dolly_lightning_fsdp.txt
# The smoke settings are the run's own, from results["parameters"]; the comments quote today's smoke values.
# The play-script fixture's training lines (harness.fixtures.play_script_fixture(), after the notebook's split_text).
FIXTURE_LINES = 610
# Its validation lines that are not training lines too: the held-out lines (53 lines, 12 also in training).
FIXTURE_HELD_OUT_LINES = 41
# The lesson's run (2 epochs, a checkpoint after each) has rank 1 killed from outside in its second epoch, at
# SMOKE_RUN_KILL's step or just after. The steps between the checkpoint and the kill run twice and repeat their
# losses bit for bit (measured: 0.0,
# once the CPU strategy gathers the optimizer state without offload; with Lightning's offloaded gather they
# drifted by up to 0.045).
REPLAY_TOLERANCE = 1e-4


def steps_per_epoch(params: dict) -> int:
    """As the notebook counts them: Ray Train splits the lines evenly, each worker's last batch may be
    partial (610 lines, 305 per worker, batches of 16: 20 steps)."""
    return math.ceil(FIXTURE_LINES // params["NUM_WORKERS"] / params["BATCH_SIZE_PER_WORKER"])


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, ray_cluster):
    return smoke_nbval(NAME, tmp_path_factory.mktemp("nbval"), ray_cluster)


@pytest.mark.notebook
def test_trains_within_the_time_budget(smoke_run):  # SMOKE_BUDGET_S, which smoke_nbval enforces
    results, wall = smoke_run
    assert results["notebook"] == NAME and results["smoke_test"] is True
    losses = results["losses"]
    params = results["parameters"]
    assert len(losses) == params["NUM_EPOCHS"] * steps_per_epoch(params)
    pinned = pinned_losses(NAME)
    assert [losses[s - 1] for s in pinned.steps] == pytest.approx(pinned.losses, abs=pinned.tolerance)
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, f"{losses[:5]} ... {losses[-5:]}"
    # Three evaluations an epoch (every 6 steps: 6, 12, 18, then 26, 32, 38) on the held-out lines, each
    # worker its even share of the 41 (FIXTURE_HELD_OUT_LINES): 40 in all. The held-out loss falls too.
    held_out = {int(step): loss for step, loss in results["eval_losses"].items()}
    per_epoch, every = steps_per_epoch(params), steps_per_epoch(params) // 3
    expected = [e * per_epoch + k * every for e in range(params["NUM_EPOCHS"]) for k in (1, 2, 3)]
    assert sorted(held_out) == expected, held_out
    assert results["eval_rows"] == FIXTURE_HELD_OUT_LINES // 2 * 2
    assert all(math.isfinite(v) for v in held_out.values()) and held_out[expected[-1]] < held_out[every], (
        held_out
    )
    print(f"nbval run: {wall:.0f} s wall, notebook clock {results['wall_seconds']:.0f} s")


@pytest.mark.notebook
def test_fsdp_really_shards(smoke_run):
    results, _ = smoke_run
    # FULL_SHARD over 2 workers: each holds half the parameter elements. A silent fall-back to DDP
    # (every worker a full copy) would show 1.0.
    assert results["param_shard_fraction"] == pytest.approx([0.5, 0.5], abs=0.02)


@pytest.mark.notebook
def test_plan_matches_what_the_shards_hold(smoke_run):
    results, _ = smoke_run
    # After the first step each rank's FSDP shard of the fp32 weights and its AdamW moments, against the
    # "will it fit?" plan's 4 and 8 bytes per parameter over 2 workers (measured: equal, to the byte).
    check_plan_matches_shards(results, tolerance=0.02)


@pytest.mark.notebook
def test_on_two_nodes_with_a_killed_worker_resumed_from_the_bucket(smoke_run, ray_cluster):
    results, _ = smoke_run
    params = results["parameters"]
    # The lesson's run, on two nodes, its checkpoints in the bucket, in MLflow; rank 1 killed from outside in
    # the second epoch, after the first epoch's checkpoint.
    per_epoch = steps_per_epoch(params)
    kill_at = results["kill"]["at_step"]
    resumed_from = last_checkpoint_before(kill_at, per_epoch)
    assert SMOKE_RUN_KILL[NAME][0] <= kill_at and 0 < resumed_from < kill_at  # a resume, not a restart
    check_cluster_run(results, ray_cluster, kill_at, resumed_from, REPLAY_TOLERANCE)
    assert [a["resumed_from_step"] for a in results["attempts"]] == [0, resumed_from]
    first = [int(s) for s in results["attempts"][0]["losses"]]  # the killed group's steps
    assert results["kill"]["replayed_steps"] == list(range(resumed_from + 1, max(first) + 1))
    assert (
        len(results["losses"]) == params["NUM_EPOCHS"] * per_epoch
    )  # the planned steps, despite the restart


@pytest.mark.notebook
def test_each_rank_read_only_its_own_shards_to_resume(smoke_run, ray_cluster):
    import pickle

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    results, _ = smoke_run
    demo = results  # the lesson's run, which resumed from its first epoch's checkpoint
    kill = demo["kill"]
    read, whole = kill["resume_bytes_per_rank"], kill["checkpoint_bytes"]
    # The final checkpoint's files stand for the resumed one's: the same tensors, a few bytes of loop state
    # apart. Each rank read its own half of the sharded tensors (the weights' and AdamW moments' shards), the
    # entries every rank loads (AdamW's step counts, the parameter groups: stored once, by one rank), the
    # `.metadata` index (once: the reader keeps it for the optimizer's load) and Lightning's `meta.pt`.
    # Measured: 1,196,006 bytes each of a 2,263,130-byte checkpoint (0.53; the shared entries weigh more
    # in the tiny model than at 7B, where the fraction is 1/16 plus a few MB).
    fs, root = filesystem(demo["checkpoint_path"], ray_cluster)
    sizes = file_sizes(f"{demo['checkpoint_path']}/checkpoint.ckpt", ray_cluster)
    assert whole == pytest.approx(sum(sizes.values()), rel=0.001)
    with fs.open_input_file(f"{root}/checkpoint.ckpt/.metadata") as f:
        metadata = pickle.loads(f.read())
    sharded = {
        fqn
        for fqn, m in metadata.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata) and len(m.chunks) > 1
    }
    shared = sum(info.length for index, info in metadata.storage_data.items() if index.fqn not in sharded)
    shards = sum(size for name, size in sizes.items() if name.endswith(".distcp")) - shared
    expected = shards / 2 + shared + sizes[".metadata"] + sizes["meta.pt"]
    assert read == pytest.approx([expected] * 2, rel=0.005), (read, expected, whole)
    assert all(r < 0.6 * whole for r in read)


@pytest.mark.notebook
def test_trains_fp32_master_weights_from_a_half_precision_checkpoint(smoke_run):
    import torch
    from transformers import AutoConfig

    results, _ = smoke_run
    # The tiny model is stored in bf16, like the Hub's dolly-v2-7b; without `dtype=torch.float32`
    # transformers 5 would load it as bf16 ("auto") and FSDP would train bf16 master weights.
    assert AutoConfig.from_pretrained(results["parameters"]["MODEL_NAME"]).dtype == torch.bfloat16
    assert results["param_dtypes"] == ["torch.float32"]


@pytest.mark.notebook
def test_checkpoint_is_sharded_with_every_ranks_shard_in_the_bucket(smoke_run, ray_cluster):
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    results, _ = smoke_run
    checkpoint = results["checkpoint_path"] + "/checkpoint.ckpt"
    # One file per rank, written on two nodes and merged by Ray's upload; no full copy on rank 0.
    assert listing(checkpoint, ray_cluster) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    fs, path = filesystem(checkpoint, ray_cluster)
    model_name = results["parameters"]["MODEL_NAME"]  # the 2-layer GPT-NeoX, stored in bf16
    initial = AutoModelForCausalLM.from_pretrained(model_name, dtype=torch.float32)
    trained = {"model": {f"model.{k}": torch.empty_like(v) for k, v in initial.state_dict().items()}}
    dcp.load(
        trained, storage_reader=harness.storage.dcp_reader(fs, path)
    )  # every tensor whole, from 2 shards
    changed = [
        k for k, v in initial.state_dict().items() if not torch.equal(trained["model"][f"model.{k}"], v)
    ]
    assert len(changed) > 0.9 * len(initial.state_dict()), "the checkpoint holds the initial weights"
    with fs.open_input_file(f"{path}/meta.pt") as f:
        meta = torch.load(f, weights_only=True)
    assert meta["hyper_parameters"]["model_name"] == model_name


@pytest.mark.notebook
def test_generates_from_the_checkpoint(smoke_run):
    results, _ = smoke_run
    # Ray Data batch inference: the copy read only the weights from the bucket, in half precision, and
    # continued the original's three prompts, then two held-out lines' first words.
    prompts = ["This is", "I am", "Once more"]
    assert len(results["generated"]) == len(prompts) + 2
    for prompt, text in zip(prompts, results["generated"][:3], strict=True):
        assert text.startswith(prompt) and len(text) > len(prompt) + 10, (prompt, text)
    assert results["cost_usd"] == pytest.approx(
        helpers.run_cost(results["train_seconds"], {"g4dn.8xlarge": 1, "g4dn.4xlarge": 15})
    )


def test_run_cost_reproduces_the_original():
    # The original: 15 g4dn.4xlarge + 1 g4dn.8xlarge for 2877 s = $16.17.
    assert helpers.run_cost(2877, {"g4dn.4xlarge": 15, "g4dn.8xlarge": 1}) == pytest.approx(16.17, abs=0.005)
    assert helpers.run_cost(3600, {"x": 2}, prices={"x": 1.5}) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="no price for p9.huge"):
        helpers.run_cost(1, {"p9.huge": 1})
