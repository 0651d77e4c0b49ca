"""`helpers.plan` ("Will it fit?"): the real architectures, offline, and the formulas against DeepSpeed's.

What the plan says against what the smoke runs' shards really hold is tested with each notebook
(`test_plan_matches_what_the_shards_hold`); the notebooks' refusals in `test_bad_input.py`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

import basics.plan as hp
from basics.checkpoints import STREAMS

GB = 1e9
FIXES = {"gpu": "GPU-FIX", "host": "HOST-FIX", "disk": "DISK-FIX"}


@pytest.mark.parametrize(
    ("model_name", "params"),
    [
        ("gpt2", 124_439_808),  # the count GPT-2's model card and every GPT-2 paper reproduction give
        ("databricks/dolly-v2-7b", 6_856_056_832),  # Pythia-6.9B with Dolly's 50,280-token vocabulary
        ("meta-llama/Llama-2-70b-chat-hf", 68_976_648_192),  # Llama 2 70B (GQA: 8 key/value heads)
    ],
)
def test_parameter_counts_of_the_real_architectures_offline(model_name, params):
    size = hp.model_size(hp.model_config(model_name))  # shipped config, meta device: no Hub, no weights
    assert size.params == params
    assert size.root + size.num_layers * size.largest_layer == params  # blocks are alike


def test_fsdp_model_states_agree_with_deepspeeds_zero3_estimate():
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    size = hp.model_size(hp.model_config("meta-llama/Llama-2-70b-chat-hf"))
    _, ds_gpu, _ = estimate_zero3_model_states_mem_needs(
        size.params,
        size.largest_layer,
        num_gpus_per_node=8,
        num_nodes=2,
        cpu_offload=False,
        cpu_offload_params=False,
        additional_buffer_factor=1.0,
    )
    # FSDP: 16 bytes per parameter over 16 GPUs plus one layer's fp32 gradients (4 L); DeepSpeed's ZeRO-3:
    # 18 (it also keeps a 16-bit copy of each shard) plus 4 L. So ours is 16/18 of its, within 1 %.
    ours = 16 * size.params // 16 + 4 * size.largest_layer
    assert ours / ds_gpu == pytest.approx(16 / 18, rel=0.01)


# The notebooks' full-scale plans, as their "Will it fit?" cells call plan_training.
DOLLY = dict(
    title="dolly",
    model_name="databricks/dolly-v2-7b",
    num_workers=16,
    cluster={"g4dn.8xlarge": 1, "g4dn.4xlarge": 15},
    batch_size=5,
    seq_len=256,
    activation_checkpointing=True,
    sharding="fsdp",
    gather_bytes=2,
    reduce_bytes=2,  # Lightning's 16-mixed reduces in fp16
    offload="optimizer+params",
)
LLAMA = dict(
    title="llama",
    model_name="meta-llama/Llama-2-70b-chat-hf",
    num_workers=16,
    cluster={"p4de.24xlarge": 2},
    batch_size=1,
    seq_len=2048,
    activation_checkpointing=True,
    sharding="fsdp",
    gather_bytes=2,
    loading="rank 0",
    checkpoint="streamed",
    export_bytes=2,
    num_to_keep=2,
    foreach_optimizer=False,
    separate_embeddings=True,
    reduce_bytes=2,
)


def _plan(**kwargs):
    """plan_training with a run's shape and its recipe's fields as keywords, the recipe's made a Recipe."""
    fields = {f.name for f in dataclasses.fields(hp.Recipe)}
    recipe = hp.Recipe(**{k: v for k, v in kwargs.items() if k in fields})
    return hp.plan_training(**{k: v for k, v in kwargs.items() if k not in fields}, recipe=recipe)


def _dolly(**overrides):
    return _plan(**{**DOLLY, "fixes": FIXES, **overrides})


def _llama(**overrides):
    return _plan(**{**LLAMA, "fixes": FIXES, **overrides})


def _row(plan, what):
    return next(r for r in plan.rows if r.what.startswith(what))


def test_full_scale_dolly_fits_and_without_offload_is_closer():
    offloaded, on_gpu = _dolly(), _dolly(offload="none")
    offloaded.check()
    assert _row(offloaded, "training").share == pytest.approx(0.39, abs=0.02)
    # Without offload the shards (16 x 6.86e9 / 16 = 6.9 GB) go on the T4: about 83 % by this estimate.
    assert _row(on_gpu, "training").share == pytest.approx(0.83, abs=0.03)
    # Rank 0 can land on a 64 GiB g4dn.4xlarge: loading the fp32 model there is 27 GB.
    assert _row(offloaded, "host RAM while loading").have == 64 * 2**30


def test_dolly_alone_with_offload_holds_the_whole_16_bit_model_as_measured_on_a_gpu():
    # FSDP1 runs one worker as NO_SHARD: with CPU offload an H200 held 5.72 GiB at the peak for a 1.41B
    # GPT-NeoX (ci/gpu/results), 4 bytes per parameter, where the gathered layers alone would be 0.4 GiB.
    one = dict(num_workers=1, cluster={"p5.48xlarge": 1}, no_shard_alone=True)
    alone, two = _dolly(**one), _dolly(**{**one, "num_workers": 2})
    params = alone.details["params"]
    assert _row(alone, "training").need > 4 * params
    assert _row(two, "training").need < 0.25 * 4 * params  # two workers shard: gathered layers only
    assert "whole model" in _row(alone, "training").terms


def test_dolly_host_ram_at_a_checkpoint_is_the_offloaded_state_plus_the_staged_shard():
    # 13.7 GB per node, not 12 B x params / 16 = 5.1 GB: with CPU offload the node already holds its
    # shard of weights, gradients and moments (16 B x params / 16) and the optimizer step's temporary.
    plan = _dolly()
    row, params = _row(plan, "host RAM at a checkpoint"), plan.details["params"]
    offloaded = 16 * params // 16 + plan.details["optimizer_step_temporary_bytes"]
    assert row.need == pytest.approx(offloaded + 12 * params / 16, rel=1e-6)
    assert row.terms.startswith("training state already in host RAM")
    assert not _row(_dolly(offload="none"), "host RAM at a checkpoint").terms.startswith("training state")


def test_dolly_without_offload_on_four_t4s_is_refused_naming_the_fix():
    plan = _dolly(offload="none", num_workers=4, cluster={"g4dn.4xlarge": 4})
    with pytest.raises(hp.ParameterError, match=r"does not fit(.|\n)*training \(T4 GPU\)(.|\n)*GPU-FIX"):
        plan.check()


def test_llama_fits_only_with_the_for_loop_adamw():
    plan = _llama()
    with pytest.warns(UserWarning, match="close|%"):  # about 98 %: it warns, it does not refuse
        plan.check()
    assert 0.9 < _row(plan, "training").share < 1.0
    # Of the 79.2 GiB torch sees on an A100-80GB, not 80.
    assert _row(plan, "training").have == int(79.2 * 2**30)
    # Averaging gradients in fp32 (a layer's gradients held in bf16 and fp32 at once), or the embeddings
    # and head left in the root unit (gathered, and their gradients whole, all step), each take the last
    # 1.5 GB of the 2 GB to spare: over 99 %, nothing left for an estimate's error.
    for edge in (_llama(reduce_bytes=4), _llama(separate_embeddings=False)):
        assert 0.99 < _row(edge, "training").share <= 1.0
    # torch's default foreach AdamW adds a 4 P / N temporary at the optimizer step: 17 GB more.
    foreach = _llama(foreach_optimizer=True)
    assert foreach.details["optimizer_step_temporary_bytes"] == pytest.approx(4 * 68.98e9 / 16, rel=0.01)
    with pytest.raises(hp.ParameterError, match="does not fit"):
        foreach.check()
    # Rank 0 holds the fp32 model and the mapped fp16 checkpoint to load it, the fp32 model to consolidate.
    assert _row(plan, "host RAM while loading").need == pytest.approx(6 * 68.98e9, rel=0.01)
    assert _row(plan, "host RAM to consolidate").need < 1.01 * 4 * 68.98e9


def test_requests_the_cluster_cannot_meet_fail_fast():
    with pytest.raises(hp.ParameterError, match="NUM_WORKERS=16 needs 16 GPUs"):
        _llama(cluster={"p4de.24xlarge": 1})
    with pytest.raises(hp.ParameterError, match="unknown node type"):
        _llama(cluster={"p9.huge": 2})


def test_dcp_writer_and_reader_over_a_pyarrow_filesystem(tmp_path):
    import pyarrow.fs as pafs
    import torch
    import torch.distributed.checkpoint as dcp

    from harness.storage import dcp_reader, dcp_writer

    fs = pafs.LocalFileSystem()
    w, m1, m2 = torch.randn(256, 256), torch.randn(256, 256), torch.randn(256, 256)  # 256 KiB each
    saved = {"model": {"w": w}, "optim": {"m1": m1, "m2": m2}}
    dcp.save(saved, storage_writer=dcp_writer(fs, f"{tmp_path}/ck", file_bytes=300_000))
    # At most 300 kB of tensors per file: one tensor each, so a rank holds one at a time while writing.
    assert sorted(p.name for p in (tmp_path / "ck").glob("*.distcp")) == [f"__0_{i}.distcp" for i in range(3)]
    # Only the model, and cast to bf16 on the way in: the optimizer state is never read, and the one
    # ranged read fetches the weight's bytes (plus torch.save's few hundred bytes of framing), no more.
    loaded = {"model": {"w": torch.zeros(256, 256, dtype=torch.bfloat16)}}
    reader = dcp_reader(fs, f"{tmp_path}/ck")
    dcp.load(loaded, storage_reader=reader)
    assert torch.equal(loaded["model"]["w"], w.to(torch.bfloat16))
    assert w.nbytes <= reader.bytes_read <= w.nbytes + 4096


def test_one_task_asks_for_no_more_gpus_than_the_largest_node(monkeypatch):
    import basics.cluster as hc

    monkeypatch.setattr(hc, "alive_nodes", lambda use_gpu: [{"Resources": {"GPU": 4.0}}] * 4)
    with pytest.warns(UserWarning, match="largest node has 4 GPUs"):
        assert hc.gpus_for_one_task("The chat task", 8) == 4
    monkeypatch.setattr(hc, "alive_nodes", lambda use_gpu: [])
    with pytest.raises(hc.ResourceRequestError, match="no node"):
        hc.gpus_for_one_task("The chat task", 8)


# The Llama recipe's parameters at full scale on 16 A100-80GB, as the plan reads them: a notebook's own
# parameters (its parameters cells' defaults) with these, which the figures below are pinned to.
LLAMA_FULL_SCALE = dict(
    MODEL_NAME="meta-llama/Llama-2-70b-chat-hf",
    NUM_WORKERS=16,
    USE_GPU=True,
    CLUSTER={"p4de.24xlarge": 2},
    BATCH_SIZE_PER_WORKER=1,
    GRADIENT_ACCUMULATION_STEPS=1,
    MAX_SEQ_LEN=2048,
    USE_GRADIENT_CHECKPOINTING=True,
)


def full_scale(notebook: str = "llama_fsdp", **changes):
    """`notebook`'s parameters (`harness.notebooks.defaults`) with LLAMA_FULL_SCALE, then `changes`."""
    import harness.notebooks

    return harness.notebooks.defaults(notebook).replace(**{**LLAMA_FULL_SCALE, **changes})


def test_compare_plans_sets_full_scale_variants_side_by_side(monkeypatch):
    # The sharding sections' tables: the full-scale run (the parameters cell's defaults, even after smoke
    # mode replaced them) for 1 worker against 16; a variant that does not fit says so in words.
    import harness.checks
    import harness.notebooks
    import harness.parameters
    import harness.sizing

    smoke = {**full_scale().as_dict(), "MODEL_NAME": "/tmp/tiny-llama"}
    harness.parameters.record(smoke).full_scale = {"MODEL_NAME": "meta-llama/Llama-2-70b-chat-hf"}
    full = harness.sizing.full_scale("llama_fsdp", smoke)
    assert full.MODEL_NAME == "meta-llama/Llama-2-70b-chat-hf" and smoke["MODEL_NAME"] == "/tmp/tiny-llama"
    table = harness.sizing.compare_plans(
        "llama_fsdp", smoke, {"1 worker": {"NUM_WORKERS": 1}, "{NUM_WORKERS} workers": {}}
    )
    gpu = table.loc["training (A100-80GB GPU) (per GPU)"]
    assert gpu["1 worker"].endswith("too big)") and gpu["16 workers"] == "83.0 GB (98%, close)"
    # not a smoke run: a plain dict of parameters, no run record
    zero = harness.sizing.compare_plans(
        "gpt2_deepspeed",
        harness.notebooks.defaults("gpt2_deepspeed")
        .replace(
            MODEL_NAME="gpt2",
            NUM_WORKERS=2,
            USE_GPU=True,
            CLUSTER={"g5.12xlarge": 1},
            BATCH_SIZE_PER_WORKER=1,
            MAX_SEQ_LEN=512,
            OFFLOAD="none",
        )
        .as_dict(),
        {f"ZeRO-{s}": {"ZERO_STAGE": s} for s in (0, 1, 2, 3)},
    )
    per_gpu = [float(cell.split()[0]) for cell in zero.iloc[0]]
    # Each stage partitions more, as section 3's figure shows: ZeRO-1 and 2 hold the notebook's two reduce
    # buckets of 5e7 elements (200 MB), not DeepSpeed's default 5e8 (2 GB, more than they would save).
    assert per_gpu[3] < per_gpu[2] <= per_gpu[1] < per_gpu[0], per_gpu


def test_the_plan_table_shows_the_parameter_count_and_each_rows_terms():
    # A person checking a plan needs the model's size and what each figure is made of (issue 21, item 5).
    import harness.sizing

    table = harness.sizing.plan_for("llama_fsdp", full_scale()).table()
    assert table.index.name == "Llama-2-70b-chat-hf on 16 workers: 68,976,648,192 parameters"
    terms = table["main terms"]
    assert terms.iloc[0].startswith(
        "16 B x params / 16 workers (fp32 weights, gradients, AdamW moments) 69.0 GB"
    )
    # Streamed checkpoints hold a 1 GiB file's tensors and its queued upload per file, 4 files at once per
    # rank (issue 21, item 3; issue 55, item 7).
    assert (
        terms.loc["host RAM at a checkpoint"]
        == "streamed in files of 1 GiB, 4 at once: 2 x 4 files' worth x 8 ranks"
    )
    assert table.loc["host RAM at a checkpoint", "needs (GB)"] == round(64 * 2**30 / 1e9, 3)
    # The checkpoint's time at the stated rate: 70B / 16 ranks x 12 B = 51.7 GB a rank, 4.3 min at 200 MB/s.
    assert (
        "each rank writes 51.7 GB (and reads it back to resume): 4.3 min at 4 streams x 50 MB/s"
        in (terms.loc["checkpoints in storage (x2 kept)"])
    )
    assert all(terms), terms


def test_llama_70b_lora_fits_one_node_where_full_fine_tuning_does_not():
    one_node = dict(num_workers=8, cluster={"p4de.24xlarge": 1})
    full, lora = _llama(**one_node), _llama(**one_node, lora_rank=16)
    # Full fine-tuning on 8 A100-80GB: 16 B x 69e9 / 8 = 138 GB of shards per GPU alone.
    with pytest.raises(hp.ParameterError, match=r"does not fit(.|\n)*training \(A100-80GB GPU\)"):
        full.check()
    lora.check()
    # peft's count on the meta model: rank x (in + out) for q, k, v, o (GQA: k and v project to 1,024),
    # gate, up and down, in each of the 80 layers.
    per_layer = 2 * (8192 + 8192) + 2 * (8192 + 1024) + 3 * (8192 + 28672)
    assert lora.details["lora_params"] == 16 * 80 * per_layer == 207_093_760
    # The frozen bf16 base, 2 B x 69e9 / 8 = 17.2 GB, is most of the 27.2 GB per GPU (32 % of 79.2 GiB).
    assert lora.details["param_bytes_per_rank"] == (2 * lora.details["params"] + 4 * 207_093_760) // 8
    assert _row(lora, "training").share == pytest.approx(0.33, abs=0.02)
    # Rank 0 loads the base in bf16 (and the mapped bf16 checkpoint): 4 B x params, not 6.
    assert _row(lora, "host RAM while loading").need == pytest.approx(4 * 68.98e9, rel=0.01)
    # A checkpoint holds the adapters and their moments (12 B x A), plus the fp32 adapter export: 3.3 GB.
    assert _row(lora, "checkpoints in storage").need == 2 * 16 * 207_093_760


def test_lora_token_rows_count_their_whole_table_copy_and_its_gradient():
    # peft's trainable token rows write the rows into a copy of the whole embedding table (and of the head)
    # each forward, and get a full-vocabulary gradient in the backward (issue 71, item 12): 2 x 2 B x 32,000
    # x 8,192 = 1.05 GB per GPU on top of the adapters, which the plan had left out.
    one_node = dict(num_workers=8, cluster={"p4de.24xlarge": 1}, lora_rank=16)
    without, with_rows = _llama(**one_node), _llama(**one_node, lora_token_rows=4)
    assert with_rows.details["token_rows_bytes"] == 2 * 2 * 32_000 * 8192
    grown = _row(with_rows, "training").need - _row(without, "training").need
    assert grown >= with_rows.details["token_rows_bytes"]
    assert "the token rows' merged head and its gradient 1.0 GB" in _row(with_rows, "training").terms


def test_the_cheapest_shape_for_llama_70b_is_lora_on_one_node():
    import harness.sizing

    p = full_scale(MAX_STEPS=500, LORA_RANK=0)
    table = harness.sizing.cheapest_shapes("llama_fsdp", p)
    assert list(table.index[:6]) == [
        ("p5.48xlarge", "LoRA r=16"),
        ("p4d.24xlarge", "LoRA r=16"),
        ("p5.48xlarge", "full"),
        ("p4de.24xlarge", "LoRA r=16"),
        ("p4de.24xlarge", "full"),
        ("p4d.24xlarge", "full"),
    ]
    # The prices' date and source in the column's name (AWS on demand after the June 2025 cut for P4/P5).
    assert "USD per hour (AWS on demand, us-east-1, 2025-06)" in table.columns
    # The post's shape, at the MFU its own run implies: its 13.5 h by construction, USD 741 at today's price.
    post = table.loc[("p4de.24xlarge", "full")]
    assert post["nodes"] == 2 and post["hours (estimate)"] == 13.5 and post["USD (estimate)"] == 741
    # LoRA on one node: 2/3 of the model FLOPs on half the GPUs, 18 h for USD 494.
    assert table.loc[("p4de.24xlarge", "LoRA r=16")]["hours (estimate)"] == 18.0
    # Full fine-tuning fits on 5 p4d (40 GPUs), but the post's global batch is 16 sequences: each GPU still
    # trains one a step, so 2.5x the post's GPUs take its 13.5 h, at 2 x its price per hour.
    assert table.loc[("p4d.24xlarge", "full")]["nodes"] == 5
    assert table.loc[("p4d.24xlarge", "full")]["hours (estimate)"] == 13.5
    # H100s (989 TFLOP/s dense bf16 against the A100's 312) at the same MFU: 13.5 h x 312 / 989.
    assert table.loc[("p5.48xlarge", "full")]["hours (estimate)"] == 4.3
    # Rank 0 loads the whole model: a 192 GiB g5.12xlarge cannot, however many there are.
    assert table.loc[("g5.12xlarge", "LoRA r=16")]["too big"] == "host RAM while loading"
    # Your prices and your MFU: the post's 2023 price gives its USD 1,106; a tuned 40 % MFU, 14x less time.
    yours = harness.sizing.cheapest_shapes("llama_fsdp", p, prices={"p4de.24xlarge": 40.97}, mfu=0.40)
    assert set(yours.index.get_level_values(0)) == {"p4de.24xlarge"} and "USD per hour (yours)" in yours
    assert yours.loc[("p4de.24xlarge", "full")]["hours (estimate)"] == pytest.approx(
        13.5 * harness.sizing.POST_MFU / 0.40, abs=0.05
    )
    then = harness.sizing.cheapest_shapes("llama_fsdp", p, prices={"p4de.24xlarge": 40.97})
    assert then.loc[("p4de.24xlarge", "full")]["USD (estimate)"] == 1106


def test_an_elastic_run_that_would_repeat_hours_at_a_resize_or_pad_its_steps_is_warned_about():
    # Each resize of an elastic run restarts from the last checkpoint: losing a node with the post's
    # SAVE_STEPS=250, up to 250 steps of about 97 s (the post's speed: 13.5 h for 500 steps) run again. Three
    # p4de nodes, going on with two (16 workers: the fewest on which full fine-tuning of 70B fits) after losing
    # one. Growing back repeats the short group's steps since its last checkpoint (every SHORT_SAVE_STEPS),
    # each of 2 sequences per GPU (below): twice the full group's 97 s.
    import warnings

    import harness.checks

    elastic = full_scale(
        "operating_a_run",
        CLUSTER={"p4de.24xlarge": 3},
        NUM_WORKERS=24,
        MIN_WORKERS=16,
        SAVE_STEPS=250,
        SHORT_SAVE_STEPS=10,
    )
    # It fits on 16. On 16 to 23 workers the global batch of 24 sequences takes 2 micro-steps of one
    # sequence per worker, padded with weight-0 sequences: 32 to 46 sequences' compute for 24.
    with pytest.warns(UserWarning, match=r"up to 1\.92x the compute .* \(on 23 workers; on 16: 1\.33x\)"):
        harness.checks.check_min_workers("operating_a_run", elastic.replace(SAVE_STEPS=37))
    with pytest.warns(
        UserWarning,
        match=r"SAVE_STEPS=250 with MIN_WORKERS=16: losing a node .* 6\.8 h of 24 GPUs .*SAVE_STEPS=37 or fewer",
    ):
        harness.checks.check_elastic_save_interval(elastic)
    with pytest.warns(
        UserWarning,
        match=r"SHORT_SAVE_STEPS=30 with MIN_WORKERS=16: growing back .* 1\.6 h of 16 GPUs .*\(194 s a step\)"
        r".*SHORT_SAVE_STEPS=18 or fewer",
    ):
        harness.checks.check_elastic_save_interval(elastic.replace(SAVE_STEPS=37, SHORT_SAVE_STEPS=30))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        harness.checks.check_elastic_save_interval(elastic.replace(SAVE_STEPS=37))  # the bound it names
        harness.checks.check_elastic_save_interval(elastic.replace(SAVE_STEPS=37, SHORT_SAVE_STEPS=18))
        harness.checks.check_elastic_save_interval(elastic.replace(USE_GPU=False))  # CPU: no estimate


def test_make_plan_prints_a_notebooks_full_scale_plan_and_refuses_what_cannot_fit(capsys):
    # `make plan NOTEBOOK=llama_fsdp [ARGS=...]` (ci/plan.py): the notebook's "Will it fit?" table for the
    # values of its parameters cell, offline, without running it; papermill's -p values over them.
    from ci import plan

    assert plan.main(["llama_fsdp"]) == 0
    out = capsys.readouterr().out
    assert "68,976,648,192 parameters" in out and "A100-80GB" in out and "It fits:" in out
    # USE_GRADIENT_CHECKPOINTING="auto": 70B on two p4de recomputes every layer (149 % of a GPU without),
    # and the advice does not suggest what is already on.
    assert "USE_GRADIENT_CHECKPOINTING='auto' -> True: without recomputation training needs 126.8 GB" in out
    assert "set USE_GRADIENT_CHECKPOINTING=True" not in out
    # 7B on one p5 (8 H100) needs no recomputation: 27.4 GB of 85.0 without it.
    seven_b = ["-p", "MODEL_NAME", "meta-llama/Llama-2-7b-hf", "-p", "NUM_WORKERS", "8"]
    assert plan.main(["llama_fsdp", *seven_b, "-p", "CLUSTER", "{'p5.48xlarge': 1}"]) == 0
    out = capsys.readouterr().out
    assert "USE_GRADIENT_CHECKPOINTING='auto' -> False: without recomputation training needs 27.4 GB" in out
    # One p4de for full fine-tuning of 70B: the GPU row is too big, and the refusal says what to change.
    assert plan.main(["llama_fsdp", "-p", "NUM_WORKERS", "8", "-p", "CLUSTER", "{'p4de.24xlarge': 1}"]) == 2
    assert "Does not fit" in capsys.readouterr().err
    assert plan.main(["llama_fsdp", "-p", "NUM_WORKER", "8"]) == 2
    assert "llama_fsdp has no parameter NUM_WORKER" in capsys.readouterr().err


@pytest.mark.parametrize(
    "notebook, args",
    [
        ("llama_fsdp", "-p CLUSTER \"{'p4de.24xlarge': 10000000000000000000000}\""),  # hung, memory growing
        ("llama_fsdp", "-p CLUSTER \"{'p4de.24xlarge': 1e999}\""),  # a 23-line traceback
        ("llama_fsdp", "-p MODEL_NAME no-such/model"),  # a Hub request
        ("llama_fsdp", "-p MODEL_NAME ../../../../etc/hostname"),  # read
        ("../notebooks/llama_fsdp", ""),  # its parameters cell would run
        ("llama_fsdp;touch {canary}", ""),  # pasted into the recipe's shell line
        ("llama_fsdp", "-p MODEL_NAME x;touch {canary}"),
        ("llama_fsdp", "-p FOO 1"),  # exited 1
        ("llama_fsdp", "-p MODEL_NAME https://user:s3cr3t@hub.example/m"),  # printed the token back
        ("llama_fsdp", "-p MODEL_NAME {huge}"),  # a local config of 2,000,000 layers: killed at 120 s, 2 GB
        ("llama_lora", "-p LORA_RANK 100000000000000"),  # a RuntimeError traceback
    ],
)
def test_make_plan_refuses_what_it_cannot_plan_in_one_line_offline(notebook, args, tmp_path):
    import signal
    import subprocess
    import time

    canary = tmp_path / "touched"
    huge = tmp_path / "huge"
    huge.mkdir()
    (huge / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2000000}')
    args = args.replace("{huge}", str(huge))
    env = {**os.environ, "HF_HUB_OFFLINE": "0"}  # it must go offline by itself
    started = time.perf_counter()
    # A session of its own: past the limit, make and the planner it started are stopped together (a plan
    # that builds a list of 10**22 nodes would otherwise go on eating memory after make is gone).
    proc = subprocess.Popen(
        [
            "make",
            "-s",
            "plan",
            "NOTEBOOK=" + notebook.replace("{canary}", str(canary)),
            "ARGS=" + args.replace("{canary}", str(canary)),
        ],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    proc = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert time.perf_counter() - started < 10
    assert proc.returncode == 2 and not canary.exists(), (proc.returncode, proc.stdout, proc.stderr)
    refusals = [line for line in proc.stderr.splitlines() if not line.startswith("make")]
    assert len(refusals) == 1 and refusals[0].startswith(("Not planned:", "Does not fit")), proc.stderr
    assert "s3cr3t" not in proc.stdout + proc.stderr


def test_the_plan_agrees_with_the_peaks_measured_on_gpus():
    # ci/gpu/results: torch's max_memory_allocated on an H200 and an H100, one worker each. The plan is made
    # again for each run's configuration with today's code (ci/gpu/summary.py), so a change to a term that
    # the GPUs contradict fails here, on CPU: ZeRO-3 with the optimizer and weights offloaded too, since the
    # plan counts the weights' GPU copies, GPT-2's eager GELU and the loss's backward (allocator histories).
    from ci.gpu.summary import plan_rows

    gpu = Path(__file__).resolve().parents[1] / "ci" / "gpu"

    rows = plan_rows(gpu / "results")
    assert len(rows) >= 14 and any("offload=optimizer+params" in r["run"] for r in rows)
    worst = max(rows, key=lambda r: abs(r["allocated_error"]))
    assert abs(worst["allocated_error"]) < 0.10, worst  # 6.8 % (Dolly with CPU offload)


def test_a_checkpoint_moves_in_streams_and_ends_within_the_collective_timeout(tmp_path, monkeypatch):
    # The plan warns where, at its stated rate, a checkpoint would outlast its share of the timeout.
    with pytest.warns(
        UserWarning, match="a checkpoint takes 4 min a rank, more than the 1 min a save may take"
    ):
        _llama(checkpoint="streamed", collective_timeout_s=90).check()
    import threading
    import time

    import pyarrow.fs as pafs
    import torch
    import torch.distributed.checkpoint as dcp

    from harness import storage

    # A rank writes STREAMS files at once and reads STREAMS ranges at once (70B: 52 GB a rank, 17 min
    # at 50 MB/s one file after another).
    running, most, lock = [0], [0], threading.Lock()
    real = storage.with_deadline

    def counted(*args, **kwargs):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            time.sleep(0.1)
            return real(*args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(storage, "with_deadline", counted)
    fs, path = pafs.LocalFileSystem(), f"{tmp_path}/ck"
    state = {f"w{i}": torch.randn(256, 256) for i in range(8)}  # 256 KiB each: 8 files of one tensor
    dcp.save(state, storage_writer=storage.dcp_writer(fs, path, file_bytes=300_000))
    assert len(list((tmp_path / "ck").glob("*.distcp"))) == 8 and most[0] == STREAMS == 4
    most[0] = 0
    loaded = {k: torch.zeros(256, 256) for k in state}
    dcp.load(loaded, storage_reader=storage.dcp_reader(fs, path))
    assert most[0] == 4 and all(torch.equal(loaded[k], state[k]) for k in state)
    # A save has its share of the process group's timeout, in which the other ranks wait for it: past
    # that, it fails with a reason, before the watchdog kills them.
    start = time.monotonic()
    with pytest.raises(storage.StorageStalled, match="COLLECTIVE_TIMEOUT_S"):
        real("f", 0, lambda: time.sleep(5), stall_s=60, min_rate=1, tries=5, stalls=[], until=start + 0.5)
    assert time.monotonic() - start < 2
