"""The Set up cell's checks, one call each: the parameters (and "will it fit?"), then the cluster.

Used by the "Set up" cell of every notebook (`helpers.check_parameters`, `helpers.check_cluster`):

- `check_parameters(notebook, globals())` fails at once, naming the parameter and what is allowed, on
  a name the notebook does not have (a misspelt `papermill -p`), a bad value, storage that cannot be
  written, a model or dataset that cannot be reached, a sequence longer than the model's positions, or
  a run the "will it fit?" plan (`harness.sizing.plan_for`) says does not fit. It returns that plan.
  Nothing is downloaded and no GPU is requested before it has passed.
- `check_cluster(notebook, globals())`, after the Set up cell's `ray.init`: the Ray cluster can run the
  workers at all (`fit()` would otherwise wait forever), every node can write to `STORAGE_PATH`, every
  worker can reach the MLflow store (`harness.tracking`), and, for Llama, every node has the weights
  before the first collective's timeout starts.

Each notebook's own rules are in its module of `harness.notebooks`.
"""

from __future__ import annotations

import os

from basics.parameters import Parameters
from basics.validate import ParameterError, check_int
from harness.notebooks import notebook as _notebook
from harness.notebooks import parameters_of
from harness.sizing import cluster_step_seconds, global_batch, plan_for, sequences_per_gpu
from harness.storage import redact, shown

__all__ = ["check_parameters", "check_cluster", "check_min_workers", "check_elastic_save_interval"]


def _min_workers(p: Parameters) -> int:
    """`MIN_WORKERS`, or `NUM_WORKERS` where it is not set (None: a fixed-size run)."""
    return p.NUM_WORKERS if p.MIN_WORKERS is None else p.MIN_WORKERS


def check_min_workers(notebook: str, p: Parameters) -> None:
    """`MIN_WORKERS`: None or 1..NUM_WORKERS; fewer than NUM_WORKERS makes the run elastic, which needs a
    checkpoint that loads at another world size, and a plan that fits on MIN_WORKERS workers."""
    value = p.MIN_WORKERS
    if value is None or value == p.NUM_WORKERS:
        return
    check_int("MIN_WORKERS", value, minimum=1)
    if value > p.NUM_WORKERS:
        raise ParameterError(
            f"MIN_WORKERS={value}: more than NUM_WORKERS={p.NUM_WORKERS}; use None (a fixed size) "
            f"or 1..{p.NUM_WORKERS}."
        )
    refused = _notebook(notebook).elastic_refused
    if refused:
        raise ParameterError(
            f"MIN_WORKERS={value}: this notebook cannot continue on fewer workers: "
            f"{refused}. It has no MIN_WORKERS parameter: a failed worker is restarted at "
            f"NUM_WORKERS={p.NUM_WORKERS}."
        )
    plan = plan_for(
        notebook, p.replace(NUM_WORKERS=value), title=f"the same run on MIN_WORKERS={value} workers"
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


# An elastic run restarts from its latest checkpoint at every resize: losing a node repeats the steps since the
# last of every SAVE_STEPS, growing back those since the last of every SHORT_SAVE_STEPS (the group saves that
# often while short of workers); up to that many, the step being saved included where the resize comes during
# a write. Above this many hours of them (at the post's speed), Set up warns.
ELASTIC_REWIND_WARN_H = 1.0


def check_elastic_save_interval(p: Parameters) -> None:
    """Warn where a resize of an elastic run would repeat more than `ELASTIC_REWIND_WARN_H` of training: losing
    a node, the full group's steps; growing back, those of a group of MIN_WORKERS (the same global batch on
    fewer GPUs, padded where their number does not divide it)."""
    import warnings

    step_s = cluster_step_seconds(p)
    if step_s is None:
        return
    fewest = _min_workers(p)
    rewinds = [
        ("SAVE_STEPS", p.SAVE_STEPS, "losing a node", p.SAVE_STEPS, p.NUM_WORKERS, step_s),
        # A short group saves at least every SAVE_STEPS too.
        ("SHORT_SAVE_STEPS", p.SHORT_SAVE_STEPS, "growing back", min(p.SHORT_SAVE_STEPS, p.SAVE_STEPS), fewest,
         cluster_step_seconds(p, fewest)),
    ]  # fmt: skip
    for name, value, resize, every, gpus, seconds in rewinds:
        if every * seconds <= ELASTIC_REWIND_WARN_H * 3600:
            continue
        bound = max(1, int(ELASTIC_REWIND_WARN_H * 3600 // seconds))
        warnings.warn(
            f"{name}={value} with MIN_WORKERS={fewest}: {resize} restarts from the last checkpoint, so up to "
            f"{every} steps run again, about {every * seconds / 3600:.1f} h of {gpus} GPUs at the post's speed "
            f"({seconds:.0f} s a step), and a spot node that keeps coming and going can stop the run's "
            f"progress. {name}={bound} or fewer keeps that under {ELASTIC_REWIND_WARN_H:g} h, for a "
            f"checkpoint write every {bound} steps.",
            stacklevel=2,
        )


def _check_elastic_padding(p: Parameters) -> None:
    """Warn where a world size the elastic run may go on with does not divide the global batch: each rank
    then runs ceil(global / (world x batch)) micro-steps, the last ones short or empty (weight 0), so a step
    takes up to that many micro-steps' time for the same sequences."""
    import warnings

    batch, sequences, fewest = p.BATCH_SIZE_PER_WORKER, global_batch(p), _min_workers(p)
    cost = {w: sequences_per_gpu(p, w) * w / sequences for w in range(fewest, p.NUM_WORKERS)}
    worst = max(cost, key=cost.get, default=None)
    if worst is None or cost[worst] < 1.25:
        return
    warnings.warn(
        f"MIN_WORKERS={fewest}: on {fewest} to {p.NUM_WORKERS - 1} workers, a world size that does not divide "
        f"the global batch of {sequences} sequences pads each step with sequences of weight 0 (micro-steps of "
        f"world x {batch}): up to {cost[worst]:.2f}x the compute the step needs (on {worst} workers; on "
        f"{fewest}: {cost[fewest]:.2f}x). Until the run grows back, its steps are that much slower than the "
        "sequences they train on.",
        stacklevel=2,
    )


def compile_or_eager(p: Parameters) -> tuple[Parameters, str]:
    """`USE_COMPILE` on GPU nodes that cannot build Triton's kernels (no C compiler, no Python headers):
    every attempt would fail at its first step, after the model's load. Eager instead, with a warning that
    says what to install; returns the parameters the run goes on with, and the Set up line's words."""
    import warnings

    from harness.nodes import compile_missing_on_nodes

    missing = compile_missing_on_nodes(use_gpu=True)
    if not missing:
        return p, "; torch.compile can build its kernels there"
    node, lacks = next(iter(missing.items()))
    warnings.warn(
        f"USE_COMPILE=True -> False: {len(missing)} GPU node(s) cannot build Triton's kernels (node {node} "
        f"lacks {lacks}); compiled, every attempt would fail at its first step, after loading. The run trains "
        "eagerly. To compile, install them on the nodes' image (e.g. build-essential and python3-dev).",
        stacklevel=2,
    )
    return p.replace(USE_COMPILE=False), "; eager: torch.compile cannot build its kernels there"


def compiled_attention(p: Parameters) -> Parameters:
    """`USE_COMPILE` with `USE_FLASH_ATTN`: sdpa instead, and a line says so. In every flash-attn call
    transformers checks whether the batch holds packed sequences, a data-dependent branch that breaks the
    compiled graph at each layer (each layer then syncs the GPU); compiled, sdpa runs a flash kernel of its
    own on A100 and H100, and the plan counts the same memory for both. Returns the parameters the run goes
    on with."""
    if p.USE_COMPILE is True and p.USE_FLASH_ATTN is True:
        p = p.replace(USE_FLASH_ATTN=False)
        print("USE_FLASH_ATTN=True with USE_COMPILE=True -> False: compiled, sdpa runs its own flash kernel")
    compile_threads(p)
    return p


def compile_threads(p: Parameters) -> None:
    """`USE_COMPILE`: Inductor compiles with `min(32, the node's cores)` processes per rank, since a Ray
    worker sees every core of its node (8 ranks on a 96-core node: 256). `TORCHINDUCTOR_COMPILE_THREADS`
    = `CPUS_PER_WORKER` instead, the cores the worker reserved, for every worker (`job_runtime_env` passes
    it on); one the shell set is left as it is."""
    if p.USE_COMPILE is True:
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, int(p.CPUS_PER_WORKER))))


def cluster_from_text(p: Parameters) -> Parameters:
    """`CLUSTER` as papermill's `-p` passes it, text (`-p CLUSTER '{"p4d.24xlarge": 2}'`), read as the
    mapping it writes (as `make plan` reads it); a line says so. Anything else is left to the checks."""
    import ast

    text = p.CLUSTER
    if not isinstance(text, str):
        return p
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and type(n) is int for k, n in value.items()
    ):
        raise ParameterError(
            f"CLUSTER={text!r}: an instance type and a count per node group, e.g. "
            "-p CLUSTER '{\"p4d.24xlarge\": 2}' (or -y 'CLUSTER: {p4d.24xlarge: 2}')."
        )
    print(f"CLUSTER, given as text -> {value}")
    return p.replace(CLUSTER=value)


def keep(namespace: dict, p: Parameters) -> None:
    """The values the checks settled on (CLUSTER read from text, an "auto" the plan chose, a setting given up
    with a line that says so), in the notebook's variables: its code trains with what was checked."""
    for name, value in p.as_dict().items():
        if name in namespace and namespace[name] != value:
            namespace[name] = value


def check_parameters(notebook: str, namespace: dict):
    """Check every parameter of `notebook` (its globals, after smoke mode); return its "will it fit?" plan.

    In order, each failing with a `ParameterError` that names the parameter and what is allowed: names
    papermill passed that the notebook does not have; each value; `STORAGE_PATH` (a small object is
    written and deleted there); the plan, from the model's architecture only (`basics.plan`: counted
    on PyTorch's `meta` device, nothing downloaded; a row that does not fit stops here, one above 85 %
    warns); then whether the model and the data can be reached and the sequence fits the model; and
    last, that MLflow can track the run (`MLFLOW_TRACKING_URI`: a server answers, no credentials in it).
    The notebook's module declares what is read of its parameters (`harness.notebooks`).
    """
    from basics.validate import check_max_positions, check_source_available
    from harness.cluster import quiet_deepspeed_on_cpu
    from harness.parameters import check_parameter_names

    check_parameter_names(namespace)
    rules = _notebook(notebook)
    p = cluster_from_text(rules.parameters.of(namespace))
    rules.check(p)
    # Only now: it imports torch (1.3 s), and a misspelt name or a bad value is reported without waiting.
    quiet_deepspeed_on_cpu()  # before the plan's ZeRO estimators import DeepSpeed
    check_min_workers(notebook, p)
    p = compiled_attention(p)
    plan = plan_for(notebook, p)
    if plan is not None:
        for name, choice in plan.choices.items():  # "auto" -> the plan's choice, for the run
            p = p.replace(**{name: choice["value"]})
            print(f"{name}='auto' -> {choice['value']}: {choice['why']}")
    keep(namespace, p)
    if plan is not None:
        plan.check()
    check_source_available("MODEL_NAME", p.MODEL_NAME, "model")
    if rules.check_data is not None:
        rules.check_data(p)
    else:
        check_max_positions("MAX_SEQ_LEN", p.MAX_SEQ_LEN, p.MODEL_NAME)
        check_source_available("DATASET_NAME", p.DATASET_NAME, "dataset")
    from harness.tracking import check_tracking

    check_tracking()  # last: the checks above need no MLflow
    model = p.MODEL_NAME.rstrip("/").split("/")[-1]
    print(
        f"Parameters OK: {model} on {p.NUM_WORKERS} workers, checkpoints in {shown(redact(p.STORAGE_PATH))}"
    )
    return plan


def check_storage_rate(storage_path: str, details: dict, rates: dict | None = None) -> str:
    """The rate each GPU node writes to `storage_path` in a rank's streams (`storage_rates_on_nodes`, about
    1 GiB each) against a streamed checkpoint's share per rank (`details`: the plan's). Where a rank's share
    would take longer than a save may (`COLLECTIVE_SHARE` of `COLLECTIVE_TIMEOUT_S`), every save would fail:
    a `ParameterError` now, not after hours. Slower than the plan assumed: a warning with the time. The
    measure is an upper bound (the node's ranks share its link). Returns the Set up line's words."""
    import warnings

    from basics.checkpoints import STREAM_RATE, STREAMS
    from harness.nodes import storage_rates_on_nodes

    if rates is None:
        rates = storage_rates_on_nodes(storage_path, use_gpu=True)
    measured = {node: rate for node, rate in rates.items() if isinstance(rate, float)}
    if not measured:  # no GPU node up yet, or none could write (check_storage_from_nodes says why)
        return ""
    node, slowest = min(measured.items(), key=lambda item: item[1])
    rank_bytes, limit = details["checkpoint_rank_bytes"], details.get("checkpoint_limit_seconds")
    seconds = rank_bytes / slowest
    said = (
        f"node {node} writes {slowest / 1e6:,.0f} MB/s to STORAGE_PATH in {STREAMS} streams: a rank's "
        f"{rank_bytes / 1e9:,.1f} GB of each checkpoint in at least {seconds / 60:,.1f} min"
    )
    if limit and seconds > limit:
        raise ParameterError(
            f"STORAGE_PATH={shown(redact(storage_path))}: {said}, more than the {limit / 60:,.0f} min a save may "
            "take (its share of COLLECTIVE_TIMEOUT_S): every checkpoint would fail. Faster storage, a larger "
            "COLLECTIVE_TIMEOUT_S, or more workers (smaller shards)."
        )
    if slowest < STREAMS * STREAM_RATE:
        warnings.warn(
            f"{said}, slower than the plan's {STREAMS} x {STREAM_RATE / 1e6:.0f} MB/s.", stacklevel=2
        )
    return f"; storage {slowest / 1e6:,.0f} MB/s from the slowest GPU node"


def check_cluster(notebook: str, namespace: dict, plan=None) -> None:
    """After the Set up cell's `ray.init`: can this Ray cluster ever run the workers, can every node write the
    checkpoints (on GPUs, fast enough for a streamed one: `check_storage_rate`), and (given the Set up cell's `plan`) does every node have the local disk
    for the files the plan puts there? For Llama, each node also fetches the weights now
    (`prefetch_model_on_nodes`)."""
    from basics.plan import Plan
    from harness.cluster import check_resources
    from harness.nodes import (
        check_gpus_match_cluster,
        check_local_disk_on_nodes,
        check_storage_from_nodes,
        prefetch_model_on_nodes,
    )
    from harness.tracking import check_tracking_from_nodes, tracking_uri

    p = parameters_of(notebook, namespace)
    check_tracking_from_nodes()  # first: before the weights' download below
    # NUM_WORKERS, even where MIN_WORKERS is set: every notebook trains at least one run of a fixed size,
    # which on a cluster with room for fewer would wait for ever.
    check_resources(p.NUM_WORKERS, p.USE_GPU, p.CPUS_PER_WORKER, name="NUM_WORKERS")
    nodes = check_storage_from_nodes("STORAGE_PATH", p.STORAGE_PATH, p.USE_GPU)
    where = f"; every node ({nodes}) reaches STORAGE_PATH" if nodes else ""
    if p.USE_GPU and isinstance(plan, Plan) and "checkpoint_rank_bytes" in plan.details:
        where += check_storage_rate(p.STORAGE_PATH, plan.details)
    if gpu_nodes := check_gpus_match_cluster(p):
        where += f"; the GPUs of {gpu_nodes} node(s) are CLUSTER's"
    if isinstance(plan, Plan):  # before the Llama prefetch below: its download is what may not fit
        needs = {"hub cache": plan.details["hub_download_bytes"], "temp": plan.details["temp_file_bytes"]}
        checked = check_local_disk_on_nodes(needs, p.MODEL_NAME, p.USE_GPU)
        if checked:
            where += f"; local disk checked on {checked} node(s)"
        else:  # an autoscaling cluster with no GPU node up yet (check_resources only warned)
            where += "; no node's local disk to check yet" + (
                ": rank 0 checks its own before it downloads (fetch_model)"
                if notebook.startswith("llama")
                else ""
            )
    if notebook in ("llama_fsdp", "llama_lora", "operating_a_run"):
        seconds = prefetch_model_on_nodes("MODEL_NAME", p.MODEL_NAME, p.USE_GPU)
        if seconds:
            where += f"; the weights are on {len(seconds)} node(s), slowest {max(seconds.values()):.0f} s"
        else:  # an autoscaling cluster with no GPU node up yet (check_resources only warned)
            where += "; no node to fetch the weights on yet: rank 0 will download them itself"
    if p.USE_COMPILE is True and p.USE_GPU:
        p, words = compile_or_eager(p)
        keep(namespace, p)
        where += words
    room = f"{p.NUM_WORKERS} workers"
    print(f"Cluster OK: room for {room}{where}; runs tracked in MLflow at {shown(redact(tracking_uri()))}")
