"""The GPU results next to the plan: `python -m ci.gpu.summary [results folder]` prints one row per run.

The plan is computed again with today's `basics.plan` for each run's configuration (the model's
architecture rebuilt from the recorded sizes), so a correction of the plan shows against the old runs.
The plan's per-GPU figure is D x (1 + ALLOCATOR_RESERVE) + the CUDA context + NCCL's buffers, where D is
what it expects torch's allocator to hold at the peak. torch's counters see only the allocator, so D is
compared with `max_memory_allocated` and D x (1 + ALLOCATOR_RESERVE) with `max_memory_reserved`.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import harness.sizing
from basics.plan import ALLOCATOR_RESERVE, CUDA_OVERHEAD, NCCL_BUFFERS

GiB = 2**30
NOTEBOOKS = ("llama_fsdp", "dolly_lightning_fsdp", "gpt2_deepspeed", "glue_text_classification")


def _model_folder(notebook: str, result: dict, folder: str) -> str:
    import transformers

    if notebook == "llama_fsdp":
        config = transformers.LlamaConfig(vocab_size=32000, max_position_embeddings=4096, **result["model"])
    elif notebook == "dolly_lightning_fsdp":
        model = result["config"]["model"]
        config = transformers.GPTNeoXConfig(vocab_size=50280, max_position_embeddings=2048, **model)
    else:
        config = transformers.GPT2Config()  # gpt2.py's: the real GPT-2's defaults
    config.save_pretrained(folder)
    return folder


def replan(notebook: str, result: dict, run: dict, folder: str) -> dict:
    """The plan today's code makes for the configuration `run` recorded."""
    from basics.notebook_files import parameter_defaults

    one_gpu = {"NUM_WORKERS": 1, "USE_GPU": True, "CLUSTER": {"p5.48xlarge": 1}, "MODEL_NAME": folder}
    if notebook == "llama_fsdp":
        p = {
            **parameter_defaults(run["notebook"]),  # llama_fsdp's, or llama_lora's
            **one_gpu,
            "LORA_RANK": run["lora_rank"],
            "LORA_MERGED": False,
        }
        p.update(BATCH_SIZE_PER_WORKER=run["batch_size_per_worker"], MAX_SEQ_LEN=run["seq_len"])
        p["USE_GRADIENT_CHECKPOINTING"] = run["gradient_checkpointing"]
        return harness.sizing.plan_for(run["notebook"], p).as_dict()
    if notebook == "dolly_lightning_fsdp":
        config = result["config"]
        p = {**parameter_defaults(notebook), **one_gpu, **run["parameters"]}
        p.update(BATCH_SIZE_PER_WORKER=config["batch_size_per_worker"], MAX_SEQ_LEN=config["seq_len"])
        return harness.sizing.plan_for(notebook, p).as_dict()
    p = {
        **parameter_defaults(notebook),
        **result["config"]["parameters"],
        **one_gpu,
        "ZERO_STAGE": run["zero_stage"],
        "OFFLOAD": run["offload"],
    }
    return harness.sizing.plan_for(notebook, p).as_dict()


def _zero_memory_as_run(result: dict) -> dict:
    """zero_memory.py's result as gpt2.py's: the peaks after the engine's set-up (gpt2.py resets them there)."""
    from basics.notebook_files import parameter_defaults

    zero = result["ds_config"]["zero_optimization"]
    offload = "none"
    if "offload_optimizer" in zero:
        offload = "optimizer+params" if "offload_param" in zero else "optimizer"
    steps = [v for k, v in result["phases"].items() if k != "set-up"]
    run = {
        "zero_stage": zero["stage"],
        "offload": offload,
        "plan": result["plan"],
        "max_memory_allocated_gib": max(v["peak_allocated"] for v in steps) / GiB,
        "max_memory_reserved_gib": max(v["peak_reserved"] for v in steps) / GiB,
    }
    parameters = {**parameter_defaults("gpt2_deepspeed"), "MAX_SEQ_LEN": 512, "BATCH_SIZE_PER_WORKER": 1}
    return {"config": {"parameters": parameters}, "runs": [run]}


def plan_rows(folder: Path) -> list[dict]:
    rows = []
    for path in sorted(folder.glob("*.json")):
        result = json.loads(path.read_text())
        if "phases" in result:  # zero_memory.py on a GPU: one engine in one process, its phases' peaks
            result = _zero_memory_as_run(result)
        runs = [r for r in result.get("runs", []) if "max_memory_reserved_gib" in r and r.get("plan")]
        if not runs:  # llama_step*.json: variants of one step, no plan
            continue
        # <notebook>[_<gpu>].json; llama_lora_h100.json is the Llama notebook's LoRA run
        stem = "gpt2" if path.stem.startswith("zero") else path.stem  # zero_memory.py's: the GPT-2 engine
        kind = next(k for k in NOTEBOOKS if stem.startswith(k.split("_")[0]))
        with tempfile.TemporaryDirectory(prefix="gpu-plan-") as model:
            plans = [replan(kind, result, run, _model_folder(kind, result, model)) for run in runs]
        for run, plan in zip(runs, plans, strict=True):
            allocator = (plan["device_bytes"] - CUDA_OVERHEAD - NCCL_BUFFERS) / (1 + ALLOCATOR_RESERVE)
            label = run.get("label") or f"ZeRO-{run['zero_stage']} offload={run['offload']}"
            rows.append(
                {
                    "notebook": path.stem,
                    "run": label,
                    "plan_gib": plan["device_bytes"] / GiB,
                    "plan_allocated_gib": allocator / GiB,
                    "allocated_gib": run["max_memory_allocated_gib"],
                    "plan_reserved_gib": allocator * (1 + ALLOCATOR_RESERVE) / GiB,
                    "reserved_gib": run["max_memory_reserved_gib"],
                }
            )
    for row in rows:
        row["allocated_error"] = row["plan_allocated_gib"] / row["allocated_gib"] - 1
        row["reserved_error"] = row["plan_reserved_gib"] / row["reserved_gib"] - 1
    return rows


if __name__ == "__main__":
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "results")
    print(
        f"{'notebook':26} {'run':34} {'plan':>6} {'plan-alloc':>10} {'alloc':>6} {'err':>6} {'resv':>6} {'err':>6}"
    )
    for r in plan_rows(folder):
        print(
            f"{r['notebook']:26} {r['run'][:34]:34} {r['plan_gib']:6.2f} {r['plan_allocated_gib']:10.2f} "
            f"{r['allocated_gib']:6.2f} {r['allocated_error']:+6.1%} {r['reserved_gib']:6.2f} {r['reserved_error']:+6.1%}"
        )
