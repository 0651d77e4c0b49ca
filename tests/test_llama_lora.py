"""The LoRA notebook (`llama_lora`), in smoke mode on the test cluster: adapters over a frozen bf16 base,
the FSDP2 recipe of `llama_fsdp` (imported from helpers/llama_recipe.py), adapter checkpoints that resume
(rank 1 killed from outside), and a PEFT adapter folder as the export.
"""

from __future__ import annotations

import pytest
from notebook_runs import (
    ARTIFACTS,
    SMOKE_RUN_KILL,
    TrackingStopped,
    check_cluster_run,
    check_held_out,
    check_plan_matches_shards,
    execute,
    fetch,
    filesystem,
    killed_in,
    last_checkpoint_before,
)

NAME = "llama_lora"
RANK = 4  # smoke mode's LORA_RANK
# Smoke mode's run (section 7): 24 steps of 2 micro-steps of 1 sequence per worker, a checkpoint every 12
# steps; rank 1 killed from outside after the step-12 checkpoint (SMOKE_RUN_KILL), the steps since replayed.
# Before (2026-11-28, two fits: 12 steps, then a demonstration's 8 with a kill), on the two-node cluster with
# the tracking server stopped: 95 s on a CPU with bf16 instructions, 216 s on a 2-core AVX2 one. Its budget:
REPLAY_TOLERANCE = 1e-4
LORA_BUDGET_S = 450
# A request to the stopped server waits 10 s when bounded (harness.tracking.BOUNDED_HTTP), 120 s or more
# when not: neither a step nor the cells around the fits may take that long.
LORA_STEP_S = 20  # measured: at most 2.7 s a step
LORA_OUTSIDE_FITS_S = 130  # measured: 64 s


@pytest.fixture(scope="module")
def lora_run(ray_cluster):
    """The LoRA run, with the cluster's tracking server stopped from its first logged step to its end: no
    worker calls MLflow, so training must not notice (the other notebook runs check what MLflow records)."""
    parameters = {"SMOKE_TEST": True, "LORA_MERGED": True}
    with TrackingStopped(NAME) as tracking, killed_in(NAME, ray_cluster):
        results, wall, error = execute(
            NAME, parameters, "tracking_stopped", cluster=ray_cluster, budget_s=LORA_BUDGET_S
        )
    assert tracking.stopped.is_set(), "the run logged no loss to MLflow: the server was never stopped"
    assert error is None, error
    return results, wall


@pytest.mark.notebook
def test_lora_trains_only_the_adapters(lora_run):
    from transformers import AutoConfig

    results, wall = lora_run
    config = AutoConfig.from_pretrained(results["parameters"]["MODEL_NAME"])
    h, m, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    # rank x (in + out) for q, k, v, o, gate, up and down in every layer: the fraction follows from the rank;
    # and the 4 chat tokens' rows of the embeddings and of the head.
    adapters = RANK * layers * (2 * (h + h) + 2 * (h + kv) + 3 * (h + m))
    assert results["trainable_params"] == adapters + 2 * 4 * h
    assert results["trainable_params"] / results["num_params"] < 0.02
    assert results["frozen_tensors_changed"] == 0  # every base weight bit-identical after training
    losses = results["losses"]
    # Measured: the last 4 steps' mean 0.81 of the first 4's over 12 steps (adapters start as a no-op).
    assert sum(losses[-4:]) / 4 < 0.9 * sum(losses[:4]) / 4, f"{losses[:4]} ... {losses[-4:]}"
    check_held_out(results, results["parameters"]["EVAL_STEPS"])  # llama_fsdp's held-out rows, every 4 steps
    # The plan's LoRA shards against what each rank held: the bf16 base and fp32 adapters, their moments,
    # and the most gradient memory during a step of two accumulated micro-steps, each reduce-scattered
    # (measured: exact; with sync skipped, FSDP2 would hold whole gradients: test_fsdp_helpers.py).
    assert results["parameters"]["GRADIENT_ACCUMULATION_STEPS"] == 2
    assert results["parameters"]["LORA_RANK"] == RANK
    assert results["plan"]["lora_params"] == results["trainable_params"]
    check_plan_matches_shards(results, tolerance=0.02)
    print(f"LoRA run: {wall:.0f} s wall, notebook clock {results['wall_seconds']:.0f} s")


@pytest.mark.notebook
def test_lora_keeps_rank_0_loading(lora_run):
    results, _ = lora_run
    rank0, rank1 = results["load_peak_rss_mb"]
    base_mb = 2 * results["num_params"] / 1e6  # the bf16 base: 27 MB
    # Rank 0 reads the base (measured: 31.6 MB), rank 1 builds it on the meta device (measured: 7.7 MB).
    assert rank0 >= 0.9 * base_mb and rank1 <= 0.4 * base_mb, (base_mb, results["load_peak_rss_mb"])


@pytest.mark.notebook
def test_lora_resumes_from_the_adapter_checkpoint(lora_run, ray_cluster):
    import pickle
    from math import prod

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    results, _ = lora_run
    params, demo = results["parameters"], results  # the lesson's run, rank 1 killed from outside
    kill_at = results["kill"]["at_step"]
    resumed_from = last_checkpoint_before(kill_at, params["SAVE_STEPS"])
    assert SMOKE_RUN_KILL[NAME][0] <= kill_at and 0 < resumed_from < kill_at
    check_cluster_run(demo, ray_cluster, kill_at, resumed_from, REPLAY_TOLERANCE, tracked=False)
    assert len(demo["losses"]) == params["MAX_STEPS"]
    # The base is read again after the restart (it is not in the checkpoint); the adapters come from it.
    assert sum(1 for a in demo["attempts"] if a["ranks"]) == 2 == results["pretrained_loads"]
    # The checkpoint in the bucket holds the adapters and their two moments: 12 bytes per adapter parameter,
    # as the plan counts it (measured: 1,892,352 bytes of tensors for 157,696 parameters; the rest are
    # AdamW's step counts). DCP frames each rank's piece of each stored item (about 1.6 kB) and adds its
    # index: the files are 2.7 MB here, a framing that a 70B model's 3 GB of adapters does not notice.
    fs, root = filesystem(results["checkpoint_path"], ray_cluster)
    with fs.open_input_file(f"{root}/sharded/.metadata") as f:
        metadata = pickle.loads(f.read())
    tensors = sum(
        prod(m.size) * m.properties.dtype.itemsize
        for m in metadata.state_dict_metadata.values()
        if isinstance(m, TensorStorageMetadata)
    )
    assert tensors == pytest.approx(12 * results["trainable_params"], rel=0.02)
    framing = 2_000 * len(metadata.state_dict_metadata) * params["NUM_WORKERS"]
    assert demo["kill"]["checkpoint_bytes"] < tensors + framing, (tensors, framing)


@pytest.mark.notebook
def test_lora_adapter_folder_loads_with_peft_and_learned(lora_run, ray_cluster, tmp_path):
    import torch
    from datasets import load_dataset
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    results, _ = lora_run
    path = fetch(results["consolidated_path"], tmp_path / "adapter", ray_cluster)
    assert results["consolidated_path"].endswith("/adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in path.iterdir()}
    tokenizer = AutoTokenizer.from_pretrained(path)
    # The chat tokens' rows, trained (`trainable_token_indices`): they started equal, at the mean of the
    # other rows; now they differ from it and from each other, in the embeddings and in the head. The
    # adapter holds those rows only, not the whole embeddings.
    base_weights = AutoModelForCausalLM.from_pretrained(results["parameters"]["MODEL_NAME"]).state_dict()
    saved = load_file(path / "adapter_model.safetensors")
    assert not any(k.endswith(("embed_tokens.weight", "lm_head.weight")) for k in saved), sorted(saved)
    for layer, base_weight in (("embed_tokens", "model.embed_tokens.weight"), ("lm_head", "lm_head.weight")):
        (rows,) = [
            v.float() for k, v in saved.items() if k.endswith(f"{layer}.token_adapter.trainable_tokens_delta")
        ]
        start = base_weights[base_weight].float().mean(dim=0)
        assert rows.shape == (4, start.numel())
        # Measured (the head's): 0.092-0.093 from the start and 0.011-0.037 apart; at the start they are
        # 7e-6 from the mean and 0 apart (bf16 rounds the resize's noise away).
        moved, apart = (rows - start).norm(dim=1), torch.pdist(rows)
        assert moved.min() > 0.03 and apart.min() > 0.005, (layer, moved, apart)

    def base():
        model = AutoModelForCausalLM.from_pretrained(results["parameters"]["MODEL_NAME"], dtype=torch.float32)
        model.resize_token_embeddings(len(tokenizer))
        return model

    # One process, no FSDP: PEFT loads the adapters (and the embeddings with the chat tokens' rows).
    trained = PeftModel.from_pretrained(base(), path)
    tokenizer.pad_token = tokenizer.eos_token
    chats = load_dataset(results["parameters"]["DATASET_NAME"])  # the chat fixture
    batch = tokenizer(
        list(chats["test"]["content"][:8]), add_special_tokens=False, return_tensors="pt", padding=True
    )
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)

    def loss(model):
        with torch.no_grad():
            return model(**batch, labels=labels).loss.item()

    # On held-out conversations: below the same model with its adapters switched off (the base, with the
    # saved embeddings).
    with trained.disable_adapter():
        untrained = loss(trained)
    # Measured: 4.97 against 6.38.
    assert loss(trained) < untrained - 0.5, (loss(trained), untrained)
    # LORA_MERGED: the base with the adapters merged in, an ordinary Hugging Face folder, computes the same
    # model (in the checkpoint's bf16, so to within bf16's rounding of the merged weights).
    merged = AutoModelForCausalLM.from_pretrained(
        fetch(results["merged_path"], tmp_path / "merged", ray_cluster), dtype=torch.float32
    )
    assert loss(merged) == pytest.approx(loss(trained), abs=0.05)


@pytest.mark.notebook
def test_a_stopped_tracking_server_costs_no_training_step(lora_run, ray_cluster):
    """The tracking server stopped answering after the run's first step (`lora_run`): training finished all
    the same, no step and no cell waiting on it, wrote its results, and said so once, naming the server."""
    import json

    results, wall = lora_run
    assert len(results["losses"]) == results["parameters"]["MAX_STEPS"]
    assert results["kill"]["restarts"] == 1
    steps = [s for a in results["attempts"] for s in a["step_seconds"].values()]
    assert max(steps) < LORA_STEP_S, steps
    outside = wall - results["train_seconds"]
    assert outside < LORA_OUTSIDE_FITS_S, f"{outside:.0f} s outside the fits with the tracking server stopped"
    executed = json.loads((ARTIFACTS / "notebooks" / f"{NAME}-tracking_stopped.ipynb").read_text())
    printed = "".join("".join(o.get("text", "")) for c in executed["cells"] for o in c.get("outputs", []))
    warnings = [line for line in printed.splitlines() if line.startswith("warning: MLflow")]
    assert len(warnings) == 1 and ray_cluster["MLFLOW_TRACKING_URI"] in warnings[0], warnings
    assert "MLflow: the run's summary was not recorded" in printed  # write_results: the file, not the run
    print(f"LoRA run with the tracking server stopped: {wall:.0f} s; {warnings[0]}")
