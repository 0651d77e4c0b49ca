"""Llama + FSDP2 notebook, in smoke mode: rank-0 loading, real sharding, sharded checkpoints that resume,
a consolidated export, checked by the numbers the lesson claims."""

from __future__ import annotations

import re

import pytest
from notebook_runs import (
    NodeLoss,
    check_cluster_run,
    check_held_out,
    check_plan_matches_shards,
    execute,
    fetch,
    last_checkpoint_before,
    listing,
    metric_history,
    pinned_losses,
)

NAME = "llama_fsdp"
# The smoke settings (MAX_STEPS, SAVE_STEPS, the smoke cell's model, ...) are the run's own, from
# results["parameters"]; the comments quote today's values (24 steps, a checkpoint every 6).
# The pinned losses (tests/assets/losses/llama_fsdp.txt) are an uninterrupted run's, every step, within
# 0.05: this run's, after losing a node and growing back, were within 0.021 of them (how measured: there).
# The "will it fit?" plan against what the smoke run measured: per-rank shards (measured: exact, 0 %),
# and rank 0's peak RSS growth while loading (measured 75.8 MB against a planned 76.4 MB: the fp32 model
# plus the memory-mapped bf16 checkpoint).
PLAN_TOLERANCE = 0.02
LOAD_TOLERANCE = 0.15
# Beside the weights, rank 0's RSS grows by what from_pretrained's loading threads and lazily imported code
# touch: +12 MB over the plan once on a fresh clone (88.4 against 76.4 MB). At 13M parameters that is
# 16 %, so the check allows twice it in MB; a missing or doubled term of the plan (26 or 52 MB) still fails.
LOAD_SLACK_MB = 24


# The run the tests check: smoke mode, a checkpoint every SAVE_STEPS steps, with MIN_WORKERS=1 (one 2-CPU
# node per worker): section 7's fit, the post's run, then "Going further: when a worker or a node is lost"
# trains its own elastic run (results["elastic"]), no planned worker kill (llama_lora and the other notebooks
# test that). `NodeLoss` kills the cluster's second node after that run's first checkpoint and starts a new
# one after the next: 2, 1, 2 workers.
ELASTIC = {"SMOKE_TEST": True, "MIN_WORKERS": 1, "SAVE_STEPS": 6, "KILL_WORKER_AT_STEP": 0}
# A worker group Ray Train cannot start (the first try after the loss still counts the lost node) is given
# up after this many seconds, and tried again (Ray's default: 60 s). The head declares the node dead after
# 10 s without an answer (tests/notebook_runs.py, start_cluster): the next try sees one node.
START_TIMEOUT = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "12"}
# With the node lost and back (three attempts, a 12 s wait for workers that could not start) and the bucket's
# stall (20 s then): measured 185-217 s on fresh clones, 291 s once in a busy one, with the 52M-parameter model of
# 2026-11-24; 126 s with today's 13M (the lone worker's steps after its last registered checkpoint run again;
# how many varies); 150 s in a fresh clone once the grow-back always happened (the hold), 144 s here with the
# coordinator's refresh (2026-11-26). Since section 7's plain run comes first (2026-11-28): the notebook
# 153 s in all, 47 s of it section 7's training and 92 s the elastic run's. The budget covers both fits:
ELASTIC_BUDGET_S = 900  # on the 2-core AVX2 machine: 335-428 s in fresh clones, 301-364 s in a checkout


@pytest.fixture(scope="module")
def smoke_run(ray_cluster):
    # Once the node is back, the bucket holds the lone worker's next checkpoint write until the resize stops
    # it; and, back on two workers, it stalls for 5 s in the middle of the last checkpoint's write (any stall
    # shorter than a write's 60 s deadline costs only its time).
    with NodeLoss(
        ray_cluster, run_prefix="llama-2-fsdp-elastic_", stall_at_checkpoint=24, stall_s=5
    ) as chaos:
        results, wall, error = execute(
            NAME, ELASTIC, "elastic", cluster=ray_cluster, budget_s=ELASTIC_BUDGET_S, env=START_TIMEOUT
        )
    print(f"node loss: {chaos.events}")
    assert error is None, error
    results["node_events"] = chaos.events
    return results, wall


@pytest.mark.notebook
def test_trains_within_the_time_budget(smoke_run):  # ELASTIC_BUDGET_S, which execute() enforces
    results, wall = smoke_run
    assert results["notebook"] == NAME and results["smoke_test"] is True
    losses = results["losses"]
    assert len(losses) == results["parameters"]["MAX_STEPS"]
    pinned = pinned_losses(NAME)
    assert [losses[s - 1] for s in pinned.steps] == pytest.approx(pinned.losses, abs=pinned.tolerance)
    assert sum(losses[-4:]) / 4 < 0.6 * sum(losses[:4]) / 4, f"{losses[:4]} ... {losses[-4:]}"
    # The post's evaluation, restored: the held-out loss every EVAL_STEPS (8) and at the end, on the test
    # split's conversations (none a training one: tests/test_helpers.py), an evaluation costing under 10 %
    # of the steps between two.
    check_held_out(results, results["parameters"]["EVAL_STEPS"], most_overhead=0.10)
    print(f"nbval run: {wall:.0f} s wall, notebook clock {results['wall_seconds']:.0f} s")


@pytest.mark.notebook
def test_only_rank_0_reads_the_weights(smoke_run):
    results, _ = smoke_run
    rank0, *others = results["load_peak_rss_mb"]
    assert len(others) == 1
    # The 13M-parameter checkpoint, 53 MB in fp32: rank 0 reads it, rank 1 builds it on the meta device.
    assert rank0 >= 50, results["load_peak_rss_mb"]
    assert all(mb <= 0.25 * rank0 for mb in others), results["load_peak_rss_mb"]


@pytest.mark.notebook
def test_fsdp2_really_shards(smoke_run, ray_cluster):
    results, _ = smoke_run
    # fully_shard over 2 workers: each holds half the parameter elements; DDP would show 1.0.
    assert results["param_shard_fraction"] == pytest.approx([0.5, 0.5], abs=0.02)
    # Each worker runs as many threads as the CPUs it reserved (resources_per_worker, OMP_NUM_THREADS).
    assert results["worker_threads"] == [results["parameters"]["CPUS_PER_WORKER"]] * 2
    # Section 7's run: the post's, one worker group on the two nodes, no kill, its MLflow run finished.
    assert len(results["attempts"]) == 1
    check_cluster_run(results, ray_cluster, None, None, 0)


@pytest.mark.notebook
def test_loses_a_node_goes_on_with_one_worker_and_grows_back(smoke_run, ray_cluster):
    results, _ = smoke_run
    elastic = results["elastic"]  # the going-further section's own run
    params, attempts = results["parameters"], elastic["attempts"]
    every, max_steps = params["SAVE_STEPS"], params["MAX_STEPS"]
    events = results["node_events"]
    (killed, killed_after, _), (added, added_after, _), (held, _, held_s), (stalled, _, _) = events
    assert (killed, added, stalled) == ("node killed", "node added", "storage stalled")
    # The resize came while the bucket held the lone worker's write, before the hold's 50 s ran out (or
    # before the hold began: Ray Train can see the new node at once, or 25 s later).
    assert held in ("storage held until the resize", "grown back before the hold"), results["node_events"]
    assert held_s < 50, results["node_events"]
    # Two workers, one on each node; one on the head node after the loss; two again once a node is back.
    # The bucket's stall during the last checkpoint cost no attempt: the write waited it out.
    assert [a["world_size"] for a in attempts] == [2, 1, 2]
    check_cluster_run(elastic, ray_cluster, None, None, 0)  # two nodes, its own MLflow run, finished
    # The same global batch of 4 sequences in every attempt: the lone worker ran twice the micro-steps
    # (counted by the observer's forward hook), gradient accumulation making up for the missing worker.
    assert [a["micro_steps"] for a in attempts] == [2, 4, 2]
    steps = [sorted(int(s) for s in a["losses"]) for a in attempts]
    # Each attempt resumed from the latest checkpoint registered before it started: none lost. The node
    # died after the first checkpoint (every SAVE_STEPS); the lone worker, short of a worker, also saved
    # every SHORT_SAVE_STEPS, and the resize stopped it after one of those (or while it wrote the next,
    # which was then never registered): growing back repeated at most SHORT_SAVE_STEPS steps, not SAVE_STEPS.
    short = params["SHORT_SAVE_STEPS"]
    assert every % short == 0 and short < every  # the lone worker's checkpoints: every `short` steps
    # The node came back once the lone worker had written a checkpoint: one only the short rule writes.
    assert added_after % short == 0 and added_after % every != 0, results["node_events"]
    assert attempts[0]["resumed_from_step"] == 0 and attempts[1]["resumed_from_step"] == killed_after == every
    for before, after, saved_every in zip(steps[:-1], attempts[1:], (every, short), strict=True):
        done = before[-1]
        assert after["resumed_from_step"] in {
            last_checkpoint_before(done + 1, saved_every),
            last_checkpoint_before(done, saved_every),
        }
    assert steps[1][-1] - attempts[2]["resumed_from_step"] <= short
    ran = [(a["world_size"], a["resumed_from_step"], s[-1]) for a, s in zip(attempts, steps, strict=True)]
    print(f"attempts (workers, resumed from, last step): {ran}")
    assert (
        attempts[2]["resumed_from_step"] > attempts[1]["resumed_from_step"]
    )  # the lone worker made progress
    for a, s in zip(attempts, steps, strict=True):
        assert s == list(range(a["resumed_from_step"] + 1, s[-1] + 1))  # no step skipped
    assert steps[-1][-1] == max_steps
    # MLflow shows it: each attempt's workers and where it resumed, at that step, in the one run.
    starts = [a["resumed_from_step"] for a in attempts]
    tracked = metric_history(ray_cluster, elastic["mlflow_run_id"], "world_size")
    assert sorted(tracked) == [(s, float(a["world_size"])) for s, a in zip(starts, attempts, strict=True)]
    assert sorted(metric_history(ray_cluster, elastic["mlflow_run_id"], "resumed_from_step")) == [
        (s, float(s)) for s in starts[1:]
    ]
    # After each resize, the losses stay within the pinned tolerance of an uninterrupted run's.
    pinned = pinned_losses(NAME)
    for a in attempts:
        got = {int(s): loss for s, loss in a["losses"].items()}
        assert [got[s] for s in got] == pytest.approx(
            [pinned.losses[s - 1] for s in got], abs=pinned.tolerance
        )
    # Every checkpoint the run kept is in the bucket and complete: DCP's index and the trainer state.
    run_folder = elastic["checkpoint_path"].rsplit("/", 1)[0]
    kept = {name.split("/")[0] for name in listing(run_folder, ray_cluster)}
    assert f"checkpoint_{max_steps:06d}" in kept
    for folder in sorted(k for k in kept if re.fullmatch(r"checkpoint_\d{6}", k)):
        files = listing(f"{run_folder}/{folder}", ray_cluster)
        assert {"sharded/.metadata", "trainer_state.json"} <= set(files), (folder, files)


@pytest.mark.notebook
def test_sharded_checkpoint_holds_the_consolidated_weights(smoke_run, ray_cluster, tmp_path):
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    results, _ = smoke_run
    # One file per rank, written in parallel, and the index; in the bucket only.
    sharded_uri = results["sharded_checkpoint_path"]
    assert listing(sharded_uri, ray_cluster) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    sharded = fetch(sharded_uri, tmp_path / "sharded", ray_cluster)
    dcp_to_torch_save(sharded, tmp_path / "full.pt")  # reassembled in one process, no process group
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert set(full) == {"model", "optim"}
    consolidated = load_file(
        fetch(results["consolidated_path"], tmp_path / "consolidated", ray_cluster) / "model.safetensors"
    )
    assert set(full["model"]) == set(consolidated)
    for key, tensor in consolidated.items():  # exported in the checkpoint's own dtype (bf16)
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(full["model"][key].to(torch.bfloat16), tensor), key


@pytest.mark.notebook
def test_consolidated_model_loads_and_learned(smoke_run, ray_cluster, tmp_path):
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    results, _ = smoke_run
    path = fetch(results["consolidated_path"], tmp_path / "consolidated", ray_cluster)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert {"<|system|>", "<|prompter|>", "<|assistant|>", "<|endoftext|>"} <= set(
        tokenizer.get_added_vocab()
    )
    # One process, no FSDP: a standard Hugging Face folder.
    trained = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # The smoke cell's Llama of 13M parameters (4 layers of width 512), with its random weights.
    initial = AutoModelForCausalLM.from_pretrained(results["parameters"]["MODEL_NAME"], dtype=torch.float32)
    initial.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    tokenizer.pad_token = tokenizer.eos_token
    chats = load_dataset(results["parameters"]["DATASET_NAME"])  # the chat fixture
    texts = list(chats["test"]["content"][:8])
    batch = tokenizer(texts, add_special_tokens=False, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)

    def loss(model):
        with torch.no_grad():
            return model(**batch, labels=labels).loss.item()

    # On held-out conversations: well below the random-weight model (about ln(vocab) = 6.25).
    assert loss(trained) < loss(initial) - 2.0, (loss(trained), loss(initial))


@pytest.mark.notebook
def test_speed_generation_and_attention(smoke_run):
    results, _ = smoke_run
    assert results["tokens_per_second"] > 0
    assert results["mfu"] is None  # a CPU has no known dense peak: not available, not a made-up number
    assert results["attn_implementation"] == "sdpa"  # USE_FLASH_ATTN=True fell back on CPU
    # Ray Data batch inference: the post's question and two held-out ones, answered in that order.
    assert len(results["generated"]) == 3 and results["generated"][0].strip()


@pytest.mark.notebook
def test_restarts_skip_the_pretrained_load_and_reshard_the_checkpoint(smoke_run):
    results, _ = smoke_run
    attempts = results["elastic"]["attempts"]  # the elastic run's
    # Three attempts, one read of the pretrained weights: the others took them from a checkpoint.
    pretrained_loads = sum(a["ranks"][0]["pretrained"] for a in attempts if a["ranks"])
    assert len(attempts) == 3 and pretrained_loads == 1
    assert results["pretrained_loads"] == 1  # section 7's run: one worker group, one read
    # DCP reshards on load. The lone worker read the whole of the two workers' checkpoint (both halves, and
    # the index). The two new workers each read the whole of the lone worker's: each tensor was saved whole,
    # and a saved piece is read whole by every rank whose shard it overlaps (measured: 160.6 MB each).
    lone, regrown = attempts[1], attempts[2]
    assert lone["resume_bytes_per_rank"] == [pytest.approx(lone["checkpoint_bytes"], rel=0.01)]
    assert len(regrown["resume_bytes_per_rank"]) == 2
    for read in regrown["resume_bytes_per_rank"]:
        assert read == pytest.approx(regrown["checkpoint_bytes"], rel=0.01)


@pytest.mark.notebook
def test_plan_matches_what_the_shards_hold(smoke_run):
    results, _ = smoke_run
    # Measured after the first step of each rank: fp32 shards and AdamW moments, half the model each;
    # and the gradients, half of them in fp32 through both micro-steps of gradient accumulation.
    assert results["parameters"]["GRADIENT_ACCUMULATION_STEPS"] == 2
    check_plan_matches_shards(results, PLAN_TOLERANCE)
    # Rank 0's RSS growth while it loaded the pretrained model: the plan's fp32 model (4 bytes/param)
    # plus the memory-mapped bf16 checkpoint (2 bytes/param).
    planned_mb = results["plan"]["load_bytes_rank0"] / 2**20
    assert results["load_peak_rss_mb"][0] == pytest.approx(
        planned_mb, rel=LOAD_TOLERANCE, abs=LOAD_SLACK_MB
    ), planned_mb
