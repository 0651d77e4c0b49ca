"""The first cells' checks, one call each: the parameters (and "will it fit?"), then the cluster.

Used by the "Set up" cell of every notebook:

- `check_parameters(notebook, globals())` fails at once, naming the parameter and what is allowed, on
  a name the notebook does not have (a misspelt `papermill -p`), a bad value, storage that cannot be
  written, a model or dataset that cannot be reached, a sequence longer than the model's positions, or
  a run the "will it fit?" plan (`helpers.plan`) says does not fit. It returns that plan. Nothing is
  downloaded and no GPU is requested before it has passed.
- `check_cluster(notebook, globals())`, after `helpers.cluster.start_ray`: the Ray cluster can run the workers
  at all (`fit()` would otherwise wait forever), every node can write to `STORAGE_PATH` (the workers
  write the checkpoints), every worker can reach the MLflow store (`harness.tracking`), and, for Llama,
  every node has the weights before the first collective's timeout starts.

Each notebook's own rules are in its module of `harness.notebooks`, not in the notebook, so that the
lesson starts on the first screen; the parameters cell's comments say what each parameter allows.
"""

from __future__ import annotations

import math

from .storage import redact, shown
from .validate import ParameterError, check_int

__all__ = [
    "check_parameters",
    "check_cluster",
    "plan_for",
    "compare_plans",
    "full_scale",
    "cheapest_shapes",
    "POST_MFU",
]


def _notebook(name: str):
    """The notebook's module of `harness.notebooks`: its rules, plan recipe and smoke values. Imported when
    called, as `harness.notebooks` imports `helpers`."""
    from harness.notebooks import notebook

    return notebook(name)


def _min_workers(p: dict) -> int:
    """`MIN_WORKERS`, or `NUM_WORKERS` where it is not set (None: a fixed-size run)."""
    value = p.get("MIN_WORKERS")
    return p["NUM_WORKERS"] if value is None else value


def check_min_workers(notebook: str, p: dict) -> None:
    """`MIN_WORKERS`: None or 1..NUM_WORKERS; fewer than NUM_WORKERS makes the run elastic, which needs a
    checkpoint that loads at another world size, and a plan that fits on MIN_WORKERS workers."""
    value = p.get("MIN_WORKERS")
    if value is None or value == p["NUM_WORKERS"]:
        return
    check_int("MIN_WORKERS", value, minimum=1)
    if value > p["NUM_WORKERS"]:
        raise ParameterError(
            f"MIN_WORKERS={value}: more than NUM_WORKERS={p['NUM_WORKERS']}; use None (a fixed size) "
            f"or 1..{p['NUM_WORKERS']}."
        )
    refused = _notebook(notebook).ELASTIC_REFUSED
    if refused:
        raise ParameterError(
            f"MIN_WORKERS={value}: this notebook cannot continue on fewer workers: "
            f"{refused}. It has no MIN_WORKERS parameter: a failed worker is restarted at "
            f"NUM_WORKERS={p['NUM_WORKERS']}."
        )
    plan = plan_for(
        notebook, {**p, "NUM_WORKERS": value}, title=f"the same run on MIN_WORKERS={value} workers"
    )
    if plan is not None:
        too_big = [r for r in plan.rows if r.status == "too big"]
        if too_big:
            lora = (
                " Or train LoRA adapters (the llama_lora notebook): a frozen base takes 2 bytes per "
                "parameter, not 16."
                if notebook == "llama_fsdp"
                else ""
            )
            rows = "; ".join(
                f"{r.what} ({r.where}) {r.need / 1e9:.1f} GB of {r.have / 1e9:.1f}" for r in too_big
            )
            raise ParameterError(
                f"MIN_WORKERS={value}: after losing workers the run would continue on {value}, where it does "
                f"not fit: {rows}. Raise MIN_WORKERS: fewer workers hold bigger shards." + lora
            )
    check_elastic_save_interval(p)
    _check_elastic_padding(p)


# An elastic run restarts from its last checkpoint at every resize (a node lost, or one back): up to
# SAVE_STEPS - 1 steps run again each time. Above this many hours of them (at the post's speed), Set up warns.
ELASTIC_REWIND_WARN_H = 1.0


def _global_batch(p: dict) -> int:
    """Sequences per optimizer step: NUM_WORKERS x BATCH_SIZE_PER_WORKER x GRADIENT_ACCUMULATION_STEPS."""
    return p["NUM_WORKERS"] * p["BATCH_SIZE_PER_WORKER"] * p.get("GRADIENT_ACCUMULATION_STEPS", 1)


def _sequences_per_gpu(p: dict, gpus: int) -> int:
    """Each GPU's sequences in one optimizer step of `p`'s global batch on `gpus` GPUs: whole micro-steps of
    BATCH_SIZE_PER_WORKER, the last ones padded with sequences of weight 0 where the GPUs do not divide the
    batch (llama_fsdp's `elastic_micro_batches`), so GPUs beyond the batch's sequences only wait."""
    batch = p["BATCH_SIZE_PER_WORKER"]
    return math.ceil(_global_batch(p) / (gpus * batch)) * batch


def _step_seconds(p: dict, params: int, peak: float, gpus: int, flops_per_token: int, mfu: float) -> float:
    """One optimizer step's estimated time on `gpus` GPUs of dense bf16 `peak` FLOP/s each, at `mfu`:
    `flops_per_token` x params FLOPs for each token of each GPU's sequences."""
    tokens = _sequences_per_gpu(p, gpus) * p["MAX_SEQ_LEN"]
    return flops_per_token * params * tokens / (peak * mfu)


def _cluster_step_seconds(p: dict) -> float | None:
    """`_step_seconds` of `p`'s full fine-tuning on the GPUs of its `CLUSTER` at `POST_MFU`; None
    without GPUs or a known bf16 peak (a CPU run)."""
    from .plan import NODE_TYPES, model_config, model_size

    gpus = [NODE_TYPES[t].gpu for t in p.get("CLUSTER", {}) if t in NODE_TYPES and NODE_TYPES[t].gpus]
    peak = _bf16_peak(gpus[0]) if gpus and p.get("USE_GPU") else None
    if not peak:
        return None
    params = model_size(model_config(p["MODEL_NAME"])).params
    return _step_seconds(p, params, peak, p["NUM_WORKERS"], flops_per_token=6, mfu=POST_MFU)


def check_elastic_save_interval(p: dict) -> None:
    """Warn where a resize of an elastic run would repeat more than `ELASTIC_REWIND_WARN_H` of training."""
    import warnings

    step_s = _cluster_step_seconds(p)
    if step_s is None or (p["SAVE_STEPS"] - 1) * step_s <= ELASTIC_REWIND_WARN_H * 3600:
        return
    bound = max(1, int(ELASTIC_REWIND_WARN_H * 3600 // step_s) + 1)
    warnings.warn(
        f"SAVE_STEPS={p['SAVE_STEPS']} with MIN_WORKERS={p['MIN_WORKERS']}: every resize (a node lost, or one "
        f"back) restarts from the last checkpoint, so up to {p['SAVE_STEPS'] - 1} steps run again, about "
        f"{(p['SAVE_STEPS'] - 1) * step_s / 3600:.1f} h of {p['NUM_WORKERS']} GPUs at the post's speed "
        f"({step_s:.0f} s a step), and a spot node that keeps coming and going can stop the run's progress. "
        f"SAVE_STEPS={bound} or fewer keeps that under {ELASTIC_REWIND_WARN_H:g} h, for a checkpoint write "
        f"every {bound} steps.",
        stacklevel=2,
    )


def _check_elastic_padding(p: dict) -> None:
    """Warn where a world size the elastic run may go on with does not divide the global batch: each rank
    then runs ceil(global / (world x batch)) micro-steps, the last ones short or empty (weight 0), so a step
    takes up to that many micro-steps' time for the same sequences."""
    import warnings

    batch, sequences, fewest = p["BATCH_SIZE_PER_WORKER"], _global_batch(p), _min_workers(p)
    cost = {w: _sequences_per_gpu(p, w) * w / sequences for w in range(fewest, p["NUM_WORKERS"])}
    worst = max(cost, key=cost.get, default=None)
    if worst is None or cost[worst] < 1.25:
        return
    warnings.warn(
        f"MIN_WORKERS={fewest}: on {fewest} to {p['NUM_WORKERS'] - 1} workers, a world size that does not divide "
        f"the global batch of {sequences} sequences pads each step with sequences of weight 0 (micro-steps of "
        f"world x {batch}): up to {cost[worst]:.2f}x the compute the step needs (on {worst} workers; on "
        f"{fewest}: {cost[fewest]:.2f}x). Until the run grows back, its steps are that much slower than the "
        "sequences they train on.",
        stacklevel=2,
    )


def plan_for(notebook: str, p: dict, title: str | None = None):
    """The "will it fit?" plan (`helpers.plan.Plan`) of `notebook` with the parameters `p`; None for a
    notebook without one (GLUE's models fit any GPU)."""
    from .plan import check_cluster, plan_training

    recipe = _notebook(notebook).plan_recipe
    if recipe is None:
        return None
    if p["USE_GPU"]:
        check_cluster(p["CLUSTER"])  # before the model's config is loaded: a wrong count is refused at once
    choices = {}
    if p.get("USE_GRADIENT_CHECKPOINTING") == "auto":
        checkpointing, why = choose_checkpointing(notebook, p)
        p = {**p, "USE_GRADIENT_CHECKPOINTING": checkpointing}
        choices["USE_GRADIENT_CHECKPOINTING"] = {"value": checkpointing, "why": why}
    plan = plan_training(
        title=title or f"{p['MODEL_NAME'].rstrip('/').split('/')[-1]} on {p['NUM_WORKERS']} workers",
        model_name=p["MODEL_NAME"],
        num_workers=p["NUM_WORKERS"],
        cluster=p["CLUSTER"] if p["USE_GPU"] else None,  # None: this machine's CPU workers
        batch_size=p["BATCH_SIZE_PER_WORKER"],
        seq_len=p["MAX_SEQ_LEN"],
        recipe=recipe(p),
    )
    plan.choices.update(choices)
    return plan


def choose_checkpointing(notebook: str, p: dict) -> tuple[bool, str]:
    """`USE_GRADIENT_CHECKPOINTING="auto"`: False (nothing recomputed) where the training row fits without it
    within the plan's margin (at most 85 % of the GPU), else True (every layer recomputed in the backward
    pass, about a third more compute); and why, in numbers."""
    row = plan_for(notebook, {**p, "USE_GRADIENT_CHECKPOINTING": False}).rows[0]  # training, per GPU
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

    p = full_scale(namespace)
    columns = {}
    for label, changes in variants.items():
        title = label.format(**{k: v for k, v in p.items() if isinstance(k, str) and k.isupper()})
        plan = plan_for(notebook, {**p, **changes}, title=title)
        columns[title] = {f"{r.what} ({r.where})": _cell(r) for r in plan.rows}
    return pd.DataFrame(columns)


def _cell(row) -> str:
    """One plan row as a table cell: "81.9 GB (95%, close)"; a row that does not fit says so in words."""
    if row.share is None:
        return f"{row.need / 1e9:,.1f} GB"
    status = "" if row.status == "ok" else f", {row.status}"
    return f"{row.need / 1e9:,.1f} GB ({row.share:.0%}{status})"


def full_scale(p: dict) -> dict:
    """`p` with the full-scale defaults smoke mode replaced put back (the parameters cell's values)."""
    from .parameters import full_scale_defaults

    return {**p, **full_scale_defaults()}


def check_parameters(notebook: str, namespace: dict):
    """Check every parameter of `notebook` (its globals, after smoke mode); return its "will it fit?" plan.

    In order, each failing with a `ParameterError` that names the parameter and what is allowed: names
    papermill passed that the notebook does not have; each value; `STORAGE_PATH` (a small object is
    written and deleted there); the plan, from the model's architecture only (`helpers.plan`: counted
    on PyTorch's `meta` device, nothing downloaded; a row that does not fit stops here, one above 85 %
    warns); then whether the model and the data can be reached and the sequence fits the model; and
    last, that MLflow can track the run (`MLFLOW_TRACKING_URI`: a server answers, no credentials in it).
    """
    from .cluster import quiet_deepspeed_on_cpu
    from .parameters import check_parameter_names
    from .validate import check_max_positions, check_source_available, hub_offline

    check_parameter_names(namespace)
    _notebook(notebook).check(namespace)
    # Only now: it imports torch (1.3 s), and a misspelt name or a bad value is reported without waiting.
    quiet_deepspeed_on_cpu()  # before the plan's ZeRO estimators import DeepSpeed
    check_min_workers(notebook, namespace)
    plan = plan_for(notebook, namespace)
    if plan is not None:
        for name, choice in plan.choices.items():  # "auto" -> the plan's choice, for the run
            namespace[name] = choice["value"]
            print(f"{name}='auto' -> {choice['value']}: {choice['why']}")
        plan.check()
    p = namespace
    check_source_available("MODEL_NAME", p["MODEL_NAME"], "model")
    if "GLUE_PATH" in p:
        if not p["GLUE_PATH"].startswith("hf://"):
            check_source_available("GLUE_PATH", p["GLUE_PATH"], "dataset")
        elif hub_offline():
            raise ParameterError(
                f"GLUE_PATH={p['GLUE_PATH']!r}: the Hugging Face Hub is offline (HF_HUB_OFFLINE=1). Pass a "
                "local copy with the same layout, go online, or run the small version with SMOKE_TEST=True."
            )
    else:
        check_max_positions("MAX_SEQ_LEN", p["MAX_SEQ_LEN"], p["MODEL_NAME"])
        check_source_available("DATASET_NAME", p["DATASET_NAME"], "dataset")
    from harness.tracking import check_tracking

    check_tracking()  # last: the checks above need no MLflow
    model = p["MODEL_NAME"].rstrip("/").split("/")[-1]
    print(
        f"Parameters OK: {model} on {p['NUM_WORKERS']} workers, checkpoints in {shown(redact(p['STORAGE_PATH']))}"
    )
    return plan


def check_cluster(notebook: str, namespace: dict) -> None:
    """After `helpers.cluster.start_ray`: can this Ray cluster ever run the workers, can every node write the
    checkpoints, and (with the Set up cell's `plan` in `namespace`) does every node have the local disk
    for the files the plan puts there? For Llama, each node also fetches the weights now
    (`prefetch_model_on_nodes`)."""
    from harness.tracking import check_tracking_from_nodes, tracking_uri

    from .cluster import (
        check_gpus_match_cluster,
        check_local_disk_on_nodes,
        check_resources,
        check_storage_from_nodes,
        prefetch_model_on_nodes,
    )
    from .plan import Plan

    _notebook(notebook)  # a known notebook
    p = namespace
    check_tracking_from_nodes()  # first: before the weights' download below
    fewest = _min_workers(p)  # an elastic run starts with as many as it gets, at least MIN_WORKERS
    check_resources(
        fewest,
        p["USE_GPU"],
        p.get("CPUS_PER_WORKER", 1),
        name="MIN_WORKERS" if fewest < p["NUM_WORKERS"] else "NUM_WORKERS",
    )
    nodes = check_storage_from_nodes("STORAGE_PATH", p["STORAGE_PATH"])
    where = f"; every node ({nodes}) reaches STORAGE_PATH" if nodes else ""
    if gpu_nodes := check_gpus_match_cluster(p):
        where += f"; the GPUs of {gpu_nodes} node(s) are CLUSTER's"
    plan = p.get("plan")  # the Set up cell's, from check_parameters
    if isinstance(plan, Plan):  # before the Llama prefetch below: its download is what may not fit
        needs = {"hub cache": plan.details["hub_download_bytes"], "temp": plan.details["temp_file_bytes"]}
        checked = check_local_disk_on_nodes(needs, p["MODEL_NAME"], p["USE_GPU"])
        if checked:
            where += f"; local disk checked on {checked} node(s)"
        else:  # an autoscaling cluster with no GPU node up yet (check_resources only warned)
            where += "; no node's local disk to check yet" + (
                ": rank 0 checks its own before it downloads (fetch_model)"
                if notebook.startswith("llama")
                else ""
            )
    if notebook in ("llama_fsdp", "llama_lora"):
        seconds = prefetch_model_on_nodes("MODEL_NAME", p["MODEL_NAME"], p["USE_GPU"])
        if seconds:
            where += f"; the weights are on {len(seconds)} node(s), slowest {max(seconds.values()):.0f} s"
        else:  # an autoscaling cluster with no GPU node up yet (check_resources only warned)
            where += "; no node to fetch the weights on yet: rank 0 will download them itself"
    room = (
        f"{p['NUM_WORKERS']} workers"
        if fewest == p["NUM_WORKERS"]
        else f"{fewest} to {p['NUM_WORKERS']} workers"
    )
    print(f"Cluster OK: room for {room}{where}; runs tracked in MLflow at {shown(redact(tracking_uri()))}")


# ---- the cheapest cluster that fits: each instance type, full fine-tuning against LoRA ------------------

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
    p: dict,
    lora_rank: int = 16,
    mfu: float = POST_MFU,
    max_nodes: int = 32,
    prices: dict[str, float] | None = None,
):
    """For each GPU instance type with a price (`prices`, {instance type: USD per hour}; by default
    `helpers.cost.INSTANCE_PRICES`, AWS on demand in us-east-1, dated in the column's name): the fewest nodes on which
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

    from .cost import INSTANCE_PRICES, PRICES_AS_OF
    from .plan import NODE_TYPES, model_config, model_size

    hourly = f"USD per hour ({PRICES_AS_OF if prices is None else 'yours'})"
    prices = INSTANCE_PRICES if prices is None else prices

    params = model_size(model_config(p["MODEL_NAME"])).params
    rows = []
    for name, node in NODE_TYPES.items():
        if not node.gpus or name not in prices or not node.bf16:
            continue  # no price to compare, or no bf16 (T4s): the recipe computes in bf16
        peak = _bf16_peak(node.gpu)
        for method, rank, flops_per_token in (("full", 0, 6), (f"LoRA r={lora_rank}", lora_rank, 4)):
            for count in range(1, max_nodes + 1):
                shape = {**p, "CLUSTER": {name: count}, "NUM_WORKERS": count * node.gpus, "LORA_RANK": rank}
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
            step_s = _step_seconds(p, params, peak, gpus, flops_per_token, mfu) if peak else None
            hours = None if step_s is None else p["MAX_STEPS"] * step_s / 3600
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
