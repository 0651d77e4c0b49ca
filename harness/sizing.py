"""Sizing a run: the "will it fit?" plan (`basics.plan`) of a notebook's parameters, plans side by side, and
the cheapest cluster shapes that fit.

Used by the notebooks' "Will it fit?" sections (`compare_plans`, `full_scale`, `cheapest_shapes`) and by the
Set up cell's checks (`plan_for`, through `harness.checks`). Each notebook's plan recipe is in its module of
`harness.notebooks`.
"""

from __future__ import annotations

import math

from basics.parameters import Parameters
from harness.notebooks import notebook as harness_notebook
from harness.notebooks import parameters_of

__all__ = [
    "plan_for",
    "choose_checkpointing",
    "compare_plans",
    "full_scale",
    "cheapest_shapes",
    "step_seconds",
    "POST_MFU",
]


def global_batch(p: Parameters) -> int:
    """Sequences per optimizer step: NUM_WORKERS x BATCH_SIZE_PER_WORKER x GRADIENT_ACCUMULATION_STEPS."""
    return p.NUM_WORKERS * p.BATCH_SIZE_PER_WORKER * p.GRADIENT_ACCUMULATION_STEPS


def sequences_per_gpu(p: Parameters, gpus: int) -> int:
    """Each GPU's sequences in one optimizer step of `p`'s global batch on `gpus` GPUs: whole micro-steps of
    BATCH_SIZE_PER_WORKER, the last ones padded with sequences of weight 0 where the GPUs do not divide the
    batch (llama_fsdp's `elastic_micro_batches`), so GPUs beyond the batch's sequences only wait."""
    batch = p.BATCH_SIZE_PER_WORKER
    return math.ceil(global_batch(p) / (gpus * batch)) * batch


def step_seconds(
    p: Parameters, params: int, peak: float, gpus: int, flops_per_token: int, mfu: float
) -> float:
    """One optimizer step's estimated time on `gpus` GPUs of dense bf16 `peak` FLOP/s each, at `mfu`:
    `flops_per_token` x params FLOPs for each token of each GPU's sequences."""
    tokens = sequences_per_gpu(p, gpus) * p.MAX_SEQ_LEN
    return flops_per_token * params * tokens / (peak * mfu)


def cluster_step_seconds(p: Parameters, workers: int | None = None) -> float | None:
    """`step_seconds` of `p`'s full fine-tuning on `workers` (default `NUM_WORKERS`) GPUs of its `CLUSTER`
    at `POST_MFU`; None without GPUs or a known bf16 peak (a CPU run)."""
    from basics.hardware import NODE_TYPES
    from basics.plan import model_config, model_size

    gpus = [NODE_TYPES[t].gpu for t in (p.CLUSTER or {}) if t in NODE_TYPES and NODE_TYPES[t].gpus]
    peak = _bf16_peak(gpus[0]) if gpus and p.USE_GPU else None
    if not peak:
        return None
    params = model_size(model_config(p.MODEL_NAME)).params
    return step_seconds(p, params, peak, workers or p.NUM_WORKERS, flops_per_token=6, mfu=POST_MFU)


def plan_for(notebook: str, p, title: str | None = None):
    """The "will it fit?" plan (`basics.plan.Plan`) of `notebook` with the parameters `p` (its `Parameters`,
    or a dict of them); None for a notebook without one (GLUE's models fit any GPU)."""
    from basics.hardware import check_node_counts
    from basics.plan import plan_training

    recipe = harness_notebook(notebook).plan_recipe
    if recipe is None:
        return None
    p = parameters_of(notebook, p)
    if p.USE_GPU:
        check_node_counts(p.CLUSTER)  # before the model's config is loaded: a wrong count is refused at once
    choices = {}
    if p.USE_GRADIENT_CHECKPOINTING == "auto":
        checkpointing, why = choose_checkpointing(notebook, p)
        p = p.replace(USE_GRADIENT_CHECKPOINTING=checkpointing)
        choices["USE_GRADIENT_CHECKPOINTING"] = {"value": checkpointing, "why": why}
    plan = plan_training(
        title=title or f"{p.MODEL_NAME.rstrip('/').split('/')[-1]} on {p.NUM_WORKERS} workers",
        model_name=p.MODEL_NAME,
        num_workers=p.NUM_WORKERS,
        cluster=p.CLUSTER if p.USE_GPU else None,  # None: this machine's CPU workers
        batch_size=p.BATCH_SIZE_PER_WORKER,
        seq_len=p.MAX_SEQ_LEN,
        recipe=recipe(p),
    )
    plan.choices.update(choices)
    return plan


def choose_checkpointing(notebook: str, p: Parameters) -> tuple[bool, str]:
    """`USE_GRADIENT_CHECKPOINTING="auto"`: False (nothing recomputed) where the training row fits without it
    within the plan's margin (at most 85 % of the GPU), else True (every layer recomputed in the backward
    pass, about a third more compute); and why, in numbers."""
    row = plan_for(notebook, p.replace(USE_GRADIENT_CHECKPOINTING=False)).rows[0]  # training, per GPU
    without = f"without recomputation training needs {row.need / 1e9:,.1f} GB per device"
    if row.share is None:
        return False, without
    without += f", {row.share:.0%} of {row.have / 1e9:,.1f} GB"
    if row.status == "ok":
        return False, f"{without}: no layer is recomputed"
    return True, f"{without} (more than 85 %): every layer is recomputed, about a third more compute"


def compare_plans(notebook: str, namespace: dict, variants: dict[str, dict]):
    """The full-scale run's plan (the parameters cell's defaults, even in smoke mode: `full_scale`) in
    variants side by side: one table, one column per variant (a label: the parameters it changes), rows as
    in the plan: "needs GB (share of what the node has, and "close" or "too big" where it is)". E.g. ZeRO
    stages 0-3, or 1 worker against `NUM_WORKERS`. A label may name a parameter in braces, filled with its
    full-scale value: `"{NUM_WORKERS} workers"`."""
    import pandas as pd

    p = full_scale(notebook, namespace)
    columns = {}
    for label, changes in variants.items():
        title = label.format(**p.as_dict())
        plan = plan_for(notebook, p.replace(**changes), title=title)
        columns[title] = {f"{r.what} ({r.where})": _cell(r) for r in plan.rows}
    return pd.DataFrame(columns)


def _cell(row) -> str:
    """One plan row as a table cell: "81.9 GB (95%, close)"; a row that does not fit says so in words."""
    if row.share is None:
        return f"{row.need / 1e9:,.1f} GB"
    status = "" if row.status == "ok" else f", {row.status}"
    return f"{row.need / 1e9:,.1f} GB ({row.share:.0%}{status})"


def full_scale(notebook: str, namespace: dict) -> Parameters:
    """The notebook's parameters (`namespace`: its globals) with the full-scale defaults smoke mode replaced
    put back: the parameters cell's values."""
    from collections import ChainMap

    from harness.parameters import full_scale_defaults

    return parameters_of(notebook, ChainMap(full_scale_defaults(namespace), namespace))


# Model FLOPs utilization for the time estimates: the only figure measured for this recipe is the Hugging
# Face post's own run, 500 steps of 16 x 2,048 tokens of Llama 2 70B on 16 A100-80GB (312 TFLOP/s dense
# bf16 each) in about 13.5 hours: 6 x 69.0e9 x 16.4e6 model FLOPs in 13.5 h. The post states "45.51% of
# peak performance", setting all 16 GPUs' FLOP/s against one A100's peak; against the 16 GPUs' peak the
# same numbers give 2.8 % per GPU, the MFU used here. Well-tuned FSDP
# runs of 70B models report 35-45 % (e.g. the Llama 3 paper, 38-43 % on H100s): every estimated time
# would then shrink by the same factor, and the order of the table would not change. (No GPU has run this
# notebook's full scale yet; `results["mfu"]` is where a measured figure will come from.)
POST_MFU = 6 * 68_976_648_192 * 500 * 16 * 2048 / (13.5 * 3600 * 16 * 312e12)


# The GPUs of the price table, as Lightning's FLOPs table names them (dense bf16 peak per GPU).
_FLOPS_NAMES = {"T4": "t4", "A10G": "a10g", "A100-40GB": "a100", "A100-80GB": "a100", "H100-80GB": "h100 sxm"}


def _bf16_peak(gpu: str) -> float | None:
    import torch
    from lightning.fabric.utilities.throughput import _CUDA_FLOPS

    return _CUDA_FLOPS.get(_FLOPS_NAMES.get(gpu, ""), {}).get(torch.bfloat16)


def cheapest_shapes(
    notebook: str,
    p: Parameters,
    lora_rank: int = 16,
    mfu: float = POST_MFU,
    max_nodes: int = 32,
    prices: dict[str, float] | None = None,
):
    """For each GPU instance type with a price (`prices`, {instance type: USD per hour}; by default
    `basics.cost.INSTANCE_PRICES`, AWS on demand in us-east-1, dated in the column's name): the fewest nodes on which
    `notebook`'s run with parameters `p` fits, for full fine-tuning and for LoRA at `lora_rank`, with the
    price per hour, and an estimated wall time and cost of `MAX_STEPS` steps; sorted by cost.

    The memory columns are the "will it fit?" plan's (the shard and gradient figures checked against real
    shards on CPU, `tests/test_plan.py` and the notebooks' tests). Time and cost are estimates: the same
    training as `p` (its global batch of NUM_WORKERS x BATCH_SIZE_PER_WORKER x GRADIENT_ACCUMULATION_STEPS
    sequences, MAX_STEPS times) at `mfu` (`POST_MFU`: the post's run) of the GPUs' dense bf16 peak
    (Lightning's table), counting 6 x params model FLOPs per token for full fine-tuning and 4 x params
    for LoRA (no weight gradients for the frozen base); a step takes as long as each GPU's share of the
    global batch, rounded up to whole micro-steps, so GPUs beyond the batch add cost and no speed.
    Instance types without bf16 (T4s) are left out.
    """
    import pandas as pd

    from basics.cost import INSTANCE_PRICES, PRICES_AS_OF
    from basics.hardware import NODE_TYPES
    from basics.plan import model_config, model_size

    hourly = f"USD per hour ({PRICES_AS_OF if prices is None else 'yours'})"
    prices = INSTANCE_PRICES if prices is None else prices

    params = model_size(model_config(p.MODEL_NAME)).params
    rows = []
    for name, node in NODE_TYPES.items():
        if not node.gpus or name not in prices or not node.bf16:
            continue  # no price to compare, or no bf16 (T4s): the recipe computes in bf16
        peak = _bf16_peak(node.gpu)
        for method, rank, flops_per_token in (("full", 0, 6), (f"LoRA r={lora_rank}", lora_rank, 4)):
            for count in range(1, max_nodes + 1):
                shape = p.replace(CLUSTER={name: count}, NUM_WORKERS=count * node.gpus, LORA_RANK=rank)
                plan = plan_for(notebook, shape)
                if all(r.status != "too big" for r in plan.rows):
                    break
            else:
                too_big = ", ".join(r.what for r in plan.rows if r.status == "too big")
                rows.append(
                    {"instance": name, "method": method, "nodes": f"> {max_nodes}", "too big": too_big}
                )
                continue
            gpus = count * node.gpus
            step_s = step_seconds(p, params, peak, gpus, flops_per_token, mfu) if peak else None
            hours = None if step_s is None else p.MAX_STEPS * step_s / 3600
            price = count * prices[name]
            rows.append(
                {
                    "instance": name,
                    "method": method,
                    "nodes": count,
                    "GPUs": f"{gpus} x {node.gpu}",
                    hourly: round(price, 2),
                    "hours (estimate)": None if hours is None else round(hours, 1),
                    "USD (estimate)": None if hours is None else round(hours * price),
                    "GPU memory (plan)": f"{plan.rows[0].share:.0%}",
                    "too big": "",
                }
            )
    table = pd.DataFrame(rows).sort_values("USD (estimate)", na_position="last", kind="stable")
    return table.set_index(["instance", "method"])
