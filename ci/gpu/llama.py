"""The Llama recipe on one GPU: the notebooks' own lesson functions, through Ray Train and under torchrun.

`llama_fsdp`'s `load_and_shard` (rank-0 loading, FSDP2, bf16 mixed precision, activation checkpointing,
sdpa or FlashAttention 2), `make_optimizer` and `train_step`, and for LoRA `llama_lora`'s `load_model` and
`shard_model`, train a random-weight model of the Llama 2 architecture on random tokens (no Hub there).
Each run reports steady-state seconds per step (the first step is a warm-up), tokens/s, MFU against the
GPU's dense bf16 peak, peak GPU memory, the step's FLOPs counted by `torch.utils.flop_counter`, and the
notebook's "will it fit?" plan for the same configuration.

    python -m ci.gpu.llama --out DIR                 # on a CUDA GPU: the runs below, DIR/llama_fsdp.json
    python -m ci.gpu.llama --smoke --out DIR         # on CPU: a tiny model, the same code paths
    python -m ci.gpu.llama --only LoRA --memory-history --out DIR   # 3 steps; the tensors alive at the peak

Runs: through Ray Train with and without activation checkpointing; the same training function under
`torchrun` (what Ray costs: seconds per step and launch-to-first-step); LoRA r=16 through Ray Train.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import basics.flops
import harness.sizing
from ci.gpu.common import (
    ROOT,
    environment,
    lesson_namespace,
    live_at_peak,
    outside_ray_train,
    slug,
    write_result,
)

# A Llama 2 architecture at 3.4B (head_dim 128 as in Llama 2): 16 bytes per parameter fit an 80 GB GPU.
FULL = dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24)
SMOKE = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4)


def build_model(folder: Path, sizes: dict, device: str) -> None:
    """A random-weight Llama 2 architecture model, stored in half precision (bf16) as the Hub's are (fp16)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5, dtype="bfloat16", **sizes
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the workers need the GPU's memory, not this process's cache


def lesson_parameters(config: dict) -> dict:
    """What the notebook's defining cells read from cells this run does not execute: LoRA's rank and alpha,
    and, for llama_lora's `trainable_token_indices`, its chat tokens as rows at the vocabulary's end (where
    `add_tokens` puts them) from a stand-in for the tokenizer, which a random-weight model has none of."""
    import types

    chat_tokens = ["<|system|>", "<|prompter|>", "<|assistant|>", "<|endoftext|>"]
    vocab = config["vocab_size"]
    tokenizer = types.SimpleNamespace(
        convert_tokens_to_ids=lambda tokens: list(range(vocab - len(tokens), vocab))
    )
    params = {"LORA_RANK": config["lora_rank"], "LORA_ALPHA": config["lora_rank"]}
    return {**params, "CHAT_TOKENS": chat_tokens, "tokenizer": tokenizer}


def _device():
    """Join the process group (under torchrun; Ray Train has set it up already); (cuda, this rank's device)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if not torch.cuda.is_available():
        return False, torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    return True, device


def _load(lesson: dict, config: dict, rank: int, device, cuda: bool):
    """The notebook's loading and sharding: (model, attention implementation)."""
    if config["notebook"] == "llama_fsdp":
        model, loading = lesson["load_and_shard"](config, rank, device, pretrained=True)
        return model, loading["attn"]
    # llama_lora: its load_model and shard_model, with the notebook's `lora` config (its load_and_shard reads
    # that config from Ray's object store, and fetches the model onto the node first)
    attn = lesson["helpers"].choose_attention(config["use_flash_attn"], use_gpu=cuda)
    skeleton, full = lesson["load_model"](
        config["model_name"], config["vocab_size"], rank, attn, True, lesson["lora"]
    )
    return lesson["shard_model"](skeleton, full, device, config["use_gradient_checkpointing"], True), attn


def _timed_steps(lesson: dict, model, optimizer, scheduler, packed, config: dict, device, cuda: bool):
    """The notebook's steps, each timed to the loss's arrival: (seconds, losses, when the first ended)."""
    import torch

    seconds, losses, first_step_at = [], [], None
    for step in range(config["max_steps"]):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        batches = lesson["my_micro_batches"](step, config, len(packed))  # this rank's rows, per micro-step
        loss = lesson["train_step"](model, optimizer, scheduler, packed, batches, device)
        losses.append(loss.item())  # waits for the step
        seconds.append(time.perf_counter() - t0)
        first_step_at = first_step_at or time.time()
    return seconds, losses, first_step_at


def _peak_memory(cuda: bool, device, history) -> dict:
    """The GPU's peaks, and with `history` the tensors alive at the peak (the history itself into that file)."""
    import torch

    if not cuda:
        return {}
    peak = {
        "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "max_memory_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "device_total_gib": torch.cuda.get_device_properties(device).total_memory / 2**30,
    }
    if history:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        with gzip.open(history, "wb") as f:
            pickle.dump(snapshot, f)
        peak["memory_at_peak"] = live_at_peak(snapshot)
    return peak


def _counted_flops(model, optimizer, packed, config: dict, device):
    """The FLOPs of one micro-step (forward and backward, the recomputed forward included) as torch counts
    them; the error as text where it cannot (the figure is a cross-check, the run stands without it)."""
    try:
        from torch.utils.flop_counter import FlopCounterMode

        batch = packed[: config["batch_size_per_worker"]].long().to(device)
        with FlopCounterMode(display=False) as counter:
            model(input_ids=batch, labels=batch).loss.backward()
        optimizer.zero_grad(set_to_none=True)
        return counter.get_total_flops()
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"


def _checks_after(
    lesson: dict, model, optimizer, config: dict, rank: int, cuda: bool, frozen, steps: int
) -> dict:
    """LoRA's frozen base unchanged (an all-reduce of a GPU tensor: a CPU one fails under NCCL), and the
    notebook's save_sharded under NCCL (its writer threads and collectives), timed, with `save_to`."""
    import torch

    saved = {}
    if frozen is not None:
        from basics.sharding import frozen_tensors_changed

        saved["frozen_tensors_changed"] = frozen_tensors_changed(model, frozen)
    if not config.get("save_to"):
        return saved
    import pyarrow.fs as pafs

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    t0 = time.perf_counter()
    lesson["save_sharded"](model, optimizer, {"step": steps}, rank, pafs.LocalFileSystem(), config["save_to"])
    files = list(Path(config["save_to"]).rglob("*"))
    return saved | {
        "save_seconds": time.perf_counter() - t0,
        "save_bytes": sum(f.stat().st_size for f in files if f.is_file()),
        "save_files": sorted(f.name for f in files),
        "save_gpu_peak_over_before_gib": (torch.cuda.max_memory_allocated() - before) / 2**30
        if cuda
        else None,
    }


def train(config: dict) -> dict:
    """One worker's run: the notebook's loading, optimizer and steps, timed; rank 0 writes the result."""
    import torch
    import torch.distributed as dist

    cuda, device = _device()
    rank = dist.get_rank()
    history = cuda and config.get("memory_history")  # CUDA's allocator history, from before the loading
    if history:
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    lesson = lesson_namespace(config["notebook"], lesson_parameters(config))
    import helpers.llama_recipe

    for name in ("shard_model", "my_micro_batches", "train_step", "save_sharded"):  # what llama_lora imports
        lesson.setdefault(name, getattr(helpers.llama_recipe, name))  # from llama_fsdp, as the notebook does
    started = time.time()
    model, attn = _load(lesson, config, rank, device, cuda)
    loaded = time.time()
    optimizer, scheduler = lesson["make_optimizer"](model, config)
    num_params = sum(p.numel() for p in model.parameters())  # the DTensors' global sizes
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    generator = torch.Generator().manual_seed(0)
    rows = config["global_batch"] * (config["max_steps"] + 1)
    packed = torch.randint(0, 32000, (rows, config["seq_len"]), dtype=torch.int32, generator=generator)
    frozen = None
    if config["lora_rank"]:  # the notebook's last-step check that the base stayed frozen, under NCCL
        from basics.sharding import frozen_fingerprint

        frozen = frozen_fingerprint(model)
    model.train()
    seconds, losses, first_step_at = _timed_steps(
        lesson, model, optimizer, scheduler, packed, config, device, cuda
    )
    peak = _peak_memory(cuda, device, history)
    counted = _counted_flops(model, optimizer, packed, config, device)
    saved = _checks_after(lesson, model, optimizer, config, rank, cuda, frozen, len(seconds))
    steady = seconds[1:]
    step_s = sum(steady) / len(steady)
    tokens_per_step = config["global_batch"] * config["seq_len"]
    peak_flops = basics.flops.dense_peak_flops(device, torch.bfloat16)
    result = {
        "runner": config["runner"],
        "notebook": config["notebook"],
        "attn_implementation": attn,
        "gradient_checkpointing": config["use_gradient_checkpointing"],
        "lora_rank": config["lora_rank"],
        "num_params": num_params,
        "trainable_params": trainable,
        "batch_size_per_worker": config["batch_size_per_worker"],
        "gradient_accumulation_steps": config["global_batch"] // config["batch_size_per_worker"],
        "seq_len": config["seq_len"],
        "steps": config["max_steps"],
        "step_seconds": seconds,
        "steady_step_seconds": step_s,
        "tokens_per_second": tokens_per_step / step_s,
        "peak_flops_per_gpu": peak_flops,
        "mfu": basics.flops.model_flops_utilization(num_params, tokens_per_step, step_s, 1, peak_flops),
        "flops_per_token_6n": 6 * num_params,
        "flops_per_token_counted": counted / (config["batch_size_per_worker"] * config["seq_len"])
        if isinstance(counted, int)
        else counted,
        "losses": losses,
        "load_seconds": loaded - started,
        "launch_to_first_step_seconds": first_step_at - config["launched_at"],
        **peak,
        **saved,
    }
    if isinstance(counted, int) and peak_flops:
        result["hfu_counted"] = result["flops_per_token_counted"] * tokens_per_step / step_s / peak_flops
    if rank == 0:
        Path(config["result_file"]).write_text(json.dumps(result))
    dist.barrier()
    return result


def plan_figures(notebook: str, config: dict) -> dict:

    p = {
        "MODEL_NAME": config["model_name"],
        "NUM_WORKERS": 1,
        "CLUSTER": {"p5.48xlarge": 1},  # one H100-80GB's worth, as the notebook would plan it
        "USE_GPU": True,
        "BATCH_SIZE_PER_WORKER": config["batch_size_per_worker"],
        "MAX_SEQ_LEN": config["seq_len"],
        "USE_GRADIENT_CHECKPOINTING": config["use_gradient_checkpointing"],
        "LORA_RANK": config["lora_rank"],
        "LORA_MERGED": False,
    }
    return harness.sizing.plan_for(notebook, p).as_dict()


def run_ray(config: dict, cpus: int) -> None:
    import ray.train
    from ray.train.torch import TorchTrainer

    config = {**config, "launched_at": time.time()}
    trainer = TorchTrainer(
        train,
        train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(
            num_workers=1, use_gpu=config["use_gpu"], resources_per_worker={"CPU": cpus}
        ),
        run_config=ray.train.RunConfig(storage_path=config["storage"], name=f"llama-gpu-{time.time_ns()}"),
    )
    trainer.fit()


def run_torchrun(config: dict) -> None:
    config = {**config, "launched_at": time.time()}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    command += [__file__, "--worker", json.dumps(config)]
    subprocess.run(command, check=True, cwd=ROOT)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=False)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--worker")  # torchrun's process: the config as JSON
    parser.add_argument("--only", help="run only the runs whose label contains this, e.g. LoRA")
    parser.add_argument(
        "--memory-history", action="store_true", help="3 steps, CUDA's allocator history: OUT/<run>.pickle.gz"
    )
    args = parser.parse_args()
    if args.worker:
        outside_ray_train()  # torchrun's process
        train(json.loads(args.worker))
        return
    import ray
    import torch

    out, work = Path(args.out), Path(tempfile.mkdtemp(prefix="llama-gpu-"))
    cuda = torch.cuda.is_available()
    model_dir = work / "model"
    t0 = time.time()
    build_model(model_dir, SMOKE if args.smoke else FULL, "cuda" if cuda else "cpu")
    build_seconds = time.time() - t0
    base = {
        "model_name": str(model_dir),
        "vocab_size": 32000,
        "use_flash_attn": True,  # the notebook's default: sdpa, with a warning, where flash-attn is missing
        "use_compile": False,  # eager, as the runs committed before USE_COMPILE (2026-11-28) measured
        "use_gpu": cuda,
        "seq_len": 64 if args.smoke else 2048,
        "batch_size_per_worker": 1 if args.smoke else 2,
        "global_batch": 2 if args.smoke else 16,  # 8 micro-steps of 2 sequences on one GPU
        "learning_rate": 5e-5,
        "weight_decay": 0.01,
        "warmup_ratio": 0.03,
        "max_steps": 3 if args.smoke else 8,
        "seed": 42,
        "storage": str(work / "ray_results"),
    }
    runs = [  # (label, runner, notebook, changes)
        ("ray, activation checkpointing", "ray", "llama_fsdp", {"use_gradient_checkpointing": True}),
        (
            "torchrun, activation checkpointing",
            "torchrun",
            "llama_fsdp",
            {"use_gradient_checkpointing": True},
        ),
        ("ray, no activation checkpointing", "ray", "llama_fsdp", {"use_gradient_checkpointing": False}),
        (  # the notebook's full-scale defaults on a GPU: layers compiled, AdamW fused
            "ray, compiled, activation checkpointing",
            "ray",
            "llama_fsdp",
            {"use_gradient_checkpointing": True, "use_compile": True},
        ),
        (
            "ray, LoRA r=16",
            "ray",
            "llama_lora",
            {"use_gradient_checkpointing": True, "lora_rank": 16, "save": True},
        ),
    ]
    runs = [run for run in runs if args.only is None or args.only in run[0]]
    cpus = 2 if args.smoke else 12
    t0 = time.time()
    ray.init(num_cpus=cpus + 1, include_dashboard=False, logging_level="WARNING")
    ray_init_seconds = time.time() - t0
    results = []
    for label, runner, notebook, changes in runs:
        config = {**base, "lora_rank": 0, **changes, "notebook": notebook, "runner": runner}
        config["result_file"] = str(work / f"result-{len(results)}.json")
        if config.pop("save", False):
            config["save_to"] = str(work / f"checkpoint-{len(results)}")
        if args.memory_history:
            config.update(max_steps=3, memory_history=str(out.resolve() / f"memory_{slug(label)}.pickle.gz"))
        entry = {"label": label}
        try:
            entry["plan"] = plan_figures(notebook, config)
            (run_ray(config, cpus) if runner == "ray" else run_torchrun(config))
            entry.update(json.loads(Path(config["result_file"]).read_text()))
            print(
                f"{label}: {entry['steady_step_seconds']:.3f} s/step, {entry['tokens_per_second']:,.0f} tokens/s, "
                f"MFU {entry['mfu'] if entry['mfu'] is None else round(entry['mfu'], 3)}, "
                f"peak {entry.get('max_memory_allocated_gib', 0):.1f} GiB allocated, "
                f"{entry.get('max_memory_reserved_gib', 0):.1f} reserved, "
                f"first step {entry['launch_to_first_step_seconds']:.1f} s after launch",
                flush=True,
            )
        except Exception:
            entry["error"] = traceback.format_exc()[-3000:]
            print(f"{label}: FAILED\n{entry['error']}", flush=True)
        results.append(entry)
        write_result(
            out / "llama_fsdp.json",
            {
                "environment": environment(),
                "model": SMOKE if args.smoke else FULL,
                "build_model_seconds": build_seconds,
                "ray_init_seconds": ray_init_seconds,
                "method": __doc__,
                "runs": results,
            },
        )
    ray.shutdown()
    shutil.rmtree(work, ignore_errors=True)  # the model and checkpoints: the results are in `out`


if __name__ == "__main__":
    main()
