"""Starting Ray so a notebook never hangs, and failing fast on requests it can never meet.

Used by the "Set up" cell of every notebook (`ray_init_args` and `ray_log_file` around its `ray.init`;
`check_resources` through `harness.checks.check_cluster`; the checks on every node are `harness.nodes`); `start_ray` does both
at once, for scripts.

Two traps this module exists for (both seen on a 2-core laptop; docs/cluster.md, "A local Ray that never hangs"):

- Ray Data + 2 training workers deadlock when the workers hold every CPU slot: the read
  operator waits, "backpressured", forever. A local Ray here advertises more logical CPUs
  than cores (`num_cpus`), so Ray Data always has slots left; the OS shares the cores.
- `trainer.fit()` waits forever (no error) for resources the cluster does not have,
  e.g. 16 GPUs on a laptop. `check_resources` raises before `fit()` instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import warnings
from pathlib import Path

from basics.cluster import ResourceRequestError

__all__ = [
    "ray_init_args",
    "ray_log_file",
    "cluster_ray_finds",
    "start_ray",
    "check_resources",
    "LOG_NOISE",
    "RAY_ENV",
    "LOCAL_RAY_ENV",
    "HUB_ENV_VARS",
    "job_runtime_env",
]

# Lines that drown the lesson and tell a learner nothing they can act on.
LOG_NOISE = [
    re.compile(r"Failed to query Ray Train Controller actor state"),
    re.compile(r"State API may be temporarily unavailable"),
    re.compile(r"Setting accelerator to CPU"),  # DeepSpeed on CPU workers, harmless
    re.compile(r"Reporting training result \d+: TrainingReport"),  # echoes every metric again
    re.compile(r"Checkpoint successfully created at"),  # the notebook prints result.checkpoint
    re.compile(r"has constructor arguments in the object store and max_restarts"),  # Ray-internal
    re.compile(r"`torch.distributed.all_gather_into_tensor` is deprecated"),  # inside DeepSpeed
    re.compile(r"`torch.distributed.reduce_scatter_tensor` is deprecated"),  # inside DeepSpeed
    re.compile(r"`loss_type=None` was set in the config but it is unrecognized"),  # transformers 5
    re.compile(r"^\s*return func\(\*args, \*\*kwargs\)\s*$"),  # ... and its source line
    # Ray Data's per-epoch bookkeeping from the actors that split datasets between workers.
    re.compile(r"(Starting execution of|Execution plan of) Dataset"),
    re.compile(r"Dataset \S+ execution finished in"),
    re.compile(r"A new progress UI is available"),
    re.compile(r"`ExecutionOptions.exclude_resources` is deprecated"),  # Ray-internal caller
    re.compile(r"^\s*self.exclude_resources = exclude_resources\s*$"),
    re.compile(r"PYTHON worker processes have been started on node"),  # raylet, expected on a laptop
    re.compile(r"Failed to kill actor .* Socket closed"),  # gcs, an actor that already exited
    # Lightning + FSDP on CPU workers, once per step or per worker. On CPU, Lightning's FSDP precision plugin
    # skips `torch.autocast("cuda")`, but FSDP's MixedPrecision still computes in bf16.
    re.compile(r"CUDA is not available or torch_xla is imported. Disabling autocast"),
    re.compile(r"torch.distributed.nn.functional.all_gather is deprecated"),  # inside Lightning
    re.compile(r"isinstance\(treespec, LeafSpec\)` is deprecated"),  # inside Lightning
    re.compile(r"is not supported by the model summary"),  # Lightning estimates sizes in fp32
    re.compile(r"Tip: For seamless cloud logging"),  # Lightning advertising a logger
]

# Set in the driver before Ray starts (a local Ray's processes inherit them).
RAY_ENV = {
    "RAY_DEDUP_LOGS": "1",
    # Ray Data logs every dataset execution at INFO (and, outside a terminal, its progress as more
    # INFO lines): a screenful per `count()`.
    "RAY_DATA_LOG_LEVEL": "WARNING",
    # Ray Train v2 tees every worker print() into its logger *and* stdout: each line shows twice.
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    # Ray Data's progress bars: in a kernel they are Jupyter widgets, frozen or "Error displaying widget"
    # in a saved notebook; the training cell shows the run log's lines instead.
    "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
}
# ... and for a Ray on this machine only (no RAY_ADDRESS): a laptop is never preempted, so the watcher
# actor only costs start-up time; Ray Data's parquet reader starts 32 footer-reading actors per
# `read_parquet`, sized for a cluster reading thousands of remote files, where one is enough on
# 2 cores (reading a small split took 8-10 s with 32 and 2-3 s with 1, measured here).
# Ray Train's controller collects the workers' reports (and checkpoints) when it polls them, every 2 s by
# default: a worker killed within that time of a report loses that checkpoint. Smoke runs are seconds
# long, so a laptop's Ray polls every 0.5 s.
LOCAL_RAY_ENV = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_METRICS_ENABLED": "0",
    "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS": "1",
}

# Ray's switch that keeps 127.0.0.1 from being rewritten to the machine's routable address (its default on
# macOS and Windows): a node's servers then listen on loopback only. The nodes this project starts run with
# it (ci/local_cluster.py through ci/ray_node.py, harness.drills.LaptopCluster), and so do their drivers.
LOOPBACK_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}

# Set on every Ray worker: 16 workers' progress bars for the same small load are noise.
WORKER_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
    # GPU workers: the caching allocator grows segments instead of leaving holes between fixed ones, the
    # 2 % fragmentation the "will it fit?" plans count. The driver's own setting, if any, wins.
    "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
}

# Ray does not pass the driver's environment to workers on other nodes. These Hugging Face settings,
# where the driver has them, go to every worker with the job's environment variables: where the cache
# lives, a mirror, and the offline switches.
HUB_ENV_VARS = (
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_ENDPOINT",
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "TRANSFORMERS_OFFLINE",
)


# The Hub token (gated models: meta-llama) goes to every worker too, but never as an environment variable of
# the job: Ray logs a job's runtime environment in full (runtime_env_agent.log, a world-readable file on
# every node) and keeps it in the job table that the dashboard and `ray list jobs --detail` show. It
# travels instead inside the job's worker setup hook (`_worker_setup_hook`), a function Ray stores with the
# job's other functions and runs in each worker process before any task.
HUB_TOKEN_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


# A cluster, storage and credentials that a shell can carry in (an old `source cluster.env`, an Anyscale
# workspace's variables): the test suite and the docs build start without any of them, so that they never
# write to a user's storage, attach to a user's cluster, or print either into a page.
OUTSIDE_ENV_VARS = (
    "RAY_ADDRESS",
    "STORAGE_PATH",
    "MLFLOW_TRACKING_URI",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_RUN_ID",
    "DATABRICKS_HOST",
    "DATABRICKS_TOKEN",
    "RAY_AUTH_MODE",
    "RAY_AUTH_TOKEN",
    "RAY_AUTH_TOKEN_PATH",
    "GOOGLE_APPLICATION_CREDENTIALS",
    *HUB_TOKEN_VARS,
)
OUTSIDE_ENV_PREFIXES = ("AWS_",)


def forget_outside_cluster(environ=os.environ) -> list[str]:
    """Remove `OUTSIDE_ENV_VARS` and every `AWS_*` variable from `environ`; return their names."""
    names = [k for k in environ if k in OUTSIDE_ENV_VARS or k.startswith(OUTSIDE_ENV_PREFIXES)]
    for name in names:
        del environ[name]
    return names


# Python's cyclic garbage collector, as `helpers.check_parameters` and every worker of the job set it: a young
# generation of 10,000 objects instead of 700. Each Ray worker is a new process that imports torch, Ray Train
# and the framework (millions of objects, none of them garbage) and the default collector spent about a
# fifth of that import tracing them: torch + transformers + Lightning + Ray Train in 5.6-6.1 s, 4.9 s with
# this (measured here). Training loops allocate few Python objects; the tensors are freed by refcount.
GC_THRESHOLD = (10_000, 10, 10)


def _worker_setup_hook(secrets: dict[str, str]):
    """The job's `worker_process_setup_hook`, run in each worker process before any task: the collector's
    `GC_THRESHOLD`, `secrets` (the Hub token, a tracking server's token) in the worker's environment, and
    fast bf16 matrix products on a CPU without bf16 instructions (`harness.cpu_bf16`)."""

    def set_up_worker() -> None:
        import gc
        import os

        from harness import cpu_bf16

        gc.set_threshold(*GC_THRESHOLD)
        os.environ.update(secrets)
        cpu_bf16.install_after_torch()

    return set_up_worker


def quiet_deepspeed_on_cpu() -> None:
    """On a machine without a GPU, tell DeepSpeed so (`DS_ACCELERATOR=cpu`) before it is first imported.

    Otherwise its import logs "Setting accelerator to CPU ..." as a warning, in whichever cell first
    imports it (transformers' checkpoint code and the "will it fit?" plan do). Local Ray workers inherit the
    variable, which names what DeepSpeed would choose on this machine anyway; a GPU machine is left alone.
    """
    if "deepspeed" in sys.modules or "DS_ACCELERATOR" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


# Collective-communication settings a cluster user tunes in the notebook (NCCL, and libfabric for AWS EFA):
# forwarded to every worker with the job, as the Hugging Face settings are.
COMMUNICATION_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "FI_")


_worker_log: dict = {}  # "path": where forwarded worker output goes, "file": the open file


def _route_worker_logs(path, show: bool) -> None:
    """Send what Ray forwards to this process to the file `path`: the workers' stdout and stderr (Ray
    Train's controller, Lightning, DeepSpeed, transformers), and the raylets' error messages. Show it here
    as well only if `show`; noise a learner cannot act on (`LOG_NOISE`) is never shown. A raylet's report
    of a task killed for memory is always shown: that one needs acting on."""
    try:
        from ray._private import ray_constants
        from ray._private import worker as ray_worker
    except ImportError:  # a future Ray without these modules: everything stays in the notebook
        return
    dispatcher = getattr(ray_worker, "global_worker_stdstream_dispatcher", None)
    printer = _worker_log.get("printer") or getattr(ray_worker, "print_to_stdstream", None)
    if dispatcher is None or printer is None:
        return
    magic = getattr(ray_constants, "RAY_TQDM_MAGIC", "__ray_tqdm_magic_token__")
    if _worker_log.get("file"):
        _worker_log["file"].close()
    log = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - open for the session
    _worker_log.update(path=str(path), file=log, printer=printer)

    def routed(data, ignore_prefix=False):
        who = data.get("actor_name") or data.get("task_name") or ""
        prefix = f"({who + ' ' if who else ''}pid={data.get('pid')}, ip={data.get('ip')}) "
        shown = []
        for line in data.get("lines", []):
            if magic in line:  # a progress bar's state, not a line
                continue
            with contextlib.suppress(ValueError):  # closed: a later start_ray opened another file
                log.write(prefix + line + "\n")
            memory = data.get("pid") == "raylet" and "low on memory" in line  # Ray's memory monitor
            if memory or (show and not any(p.search(line) for p in LOG_NOISE)):
                shown.append(line)
        if shown:
            printer({**data, "lines": shown}, ignore_prefix=ignore_prefix)

    ignore_prefix = ray_worker._should_ignore_worker_log_prefix(ray_worker.global_worker)
    try:
        dispatcher.remove_handler("ray_print_logs")
        dispatcher.add_handler("ray_print_logs", lambda data: routed(data, ignore_prefix))
        # The raylets' error messages (e.g. "A worker died or was killed ...") reach the driver through
        # this module-level function, not through the dispatcher.
        ray_worker.print_to_stdstream = routed
    except Exception:  # noqa: BLE001 - private API; noise is better than a crash
        pass


@contextlib.contextmanager
def _stderr_to(path):
    """Send this process's file descriptor 2 to `path` for the block: Ray's C++ start-up messages (e.g.
    that a machine without internet cannot find its IP address by asking 8.8.8.8) are not for the notebook."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "a", encoding="utf-8") as log:
            os.dup2(log.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _worker_log_path() -> str | None:
    """The file `start_ray` sends the workers' output to (None before it ran, or when it shows it here)."""
    return _worker_log.get("path")


def job_runtime_env(attach: bool) -> dict:
    """The Ray runtime environment of a notebook's job: what every worker, on every node, gets.

    - `env_vars`: `WORKER_ENV` (quiet progress bars, the GPU allocator's setting), the driver's Hugging Face
      settings (`HUB_ENV_VARS`), and its collective communication settings (`NCCL_*`, `TORCH_NCCL_*`, and
      libfabric's `FI_*` for EFA instances), and `TORCHINDUCTOR_COMPILE_THREADS` (`harness.checks.compile_threads`):
      set in the notebook, they would otherwise reach no worker on another node.
    - MLflow's: where runs are tracked (`MLFLOW_TRACKING_URI`, `harness.tracking`) and its telemetry off.
    - `worker_process_setup_hook`: the collector's `GC_THRESHOLD` in each worker process and, where the
      driver has a Hub token (`HF_TOKEN`) or a tracking server's credentials (`MLFLOW_TRACKING_TOKEN`, ...),
      those, so that they are in no log and no job table (see `HUB_TOKEN_VARS`).
    - `py_modules` (when attaching to a cluster): the `basics`, `harness` and `helpers` packages, uploaded with the
      job, so that training functions can import them on nodes where the project is not installed.
    """
    import basics
    import harness
    from harness.tracking import OFFLINE_ENV, TRACKING_ENV_VARS, TRACKING_SECRET_VARS

    passed = (*HUB_ENV_VARS, *TRACKING_ENV_VARS, "TORCHINDUCTOR_COMPILE_THREADS")
    env_vars = {**WORKER_ENV, **OFFLINE_ENV, **{v: os.environ[v] for v in passed if v in os.environ}}
    env_vars.update({k: v for k, v in os.environ.items() if k.startswith(COMMUNICATION_ENV_PREFIXES)})
    runtime_env: dict = {"env_vars": env_vars}
    hub_token = next((v for v in HUB_TOKEN_VARS if os.environ.get(v)), None)  # the first one set
    secrets = {v: os.environ[v] for v in TRACKING_SECRET_VARS if os.environ.get(v)}
    if hub_token:
        secrets[hub_token] = os.environ[hub_token]
    runtime_env["worker_process_setup_hook"] = _worker_setup_hook(secrets)
    job = _job_runtime_env()
    if job is not None:  # in a Ray Job: what it sets reaches every worker already, and Ray refuses twice
        for key in job.get("env_vars") or {}:
            env_vars.pop(key, None)
        for field in set(job) & {"worker_process_setup_hook", "py_modules"}:
            runtime_env.pop(field, None)
    if attach and not (job or {}).get("working_dir"):  # a job's working_dir ships both already
        runtime_env["py_modules"] = [basics, harness, _package_folder("helpers")]
    return runtime_env


def _package_folder(name: str) -> str:
    """The folder of the project's package `name`, found without importing it (`helpers`, the layer above
    this one, imports `harness`)."""
    import importlib.util

    return importlib.util.find_spec(name).submodule_search_locations[0]


def _job_runtime_env() -> dict | None:
    """In the driver of a submitted Ray Job (`ray job submit`): the job's runtime environment (e.g. its
    `working_dir`, which holds this project's packages, and its `env_vars`); None outside a job. Ray
    merges it with the one `ray.init` is given and raises on a field, or a variable, set in both."""
    import json

    config = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    return (json.loads(config).get("runtime_env") or {}) if config else None


def ray_init_args(num_cpus: int | None = None, **init_kwargs) -> dict:
    """The arguments of `ray.init` here: the cluster at `RAY_ADDRESS` (Anyscale, `ray start`) or the one
    `ray start` runs on this machine (a head node) to attach to, or else a local Ray's CPUs; and the
    runtime environment every worker gets (`job_runtime_env`). Sets what the driver needs first: Ray's quiet
    settings (`RAY_ENV`) and where MLflow records runs (`harness.tracking.configure`).

    - A local Ray gets `num_cpus` logical CPUs, by default `max(4, 2 * cores)`: enough slots for the
      training workers *and* Ray Data's tasks (the anti-deadlock setting above).
    """
    from harness.tracking import configure as configure_tracking

    found = None if os.environ.get("RAY_ADDRESS") else cluster_ray_finds()
    if found:  # from here on (checks, jobs) the cluster it is, as with RAY_ADDRESS
        _check_answers(found)
        _token_as_ray_init_would()
        os.environ["RAY_ADDRESS"] = found
    _worker_log["found"] = found
    for var, value in {**RAY_ENV, **({} if os.environ.get("RAY_ADDRESS") else LOCAL_RAY_ENV)}.items():
        os.environ.setdefault(var, value)
    logging.getLogger("ray.data").setLevel(os.environ["RAY_DATA_LOG_LEVEL"])  # if already imported
    # Ray Train v2 prints a deprecation hint per call for this; the notebooks use the v2 API.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"ray\..*")
    attach = bool(os.environ.get("RAY_ADDRESS"))
    configure_tracking()  # MLFLOW_TRACKING_URI set (or the embedded store) before the workers start
    kwargs = dict(include_dashboard=False, logging_level=logging.WARNING, configure_logging=True)
    kwargs.update(init_kwargs)
    job, given = job_runtime_env(attach), kwargs.get("runtime_env", {})
    kwargs["runtime_env"] = {**job, **given, "env_vars": {**job["env_vars"], **given.get("env_vars", {})}}
    if not attach:
        kwargs["num_cpus"] = num_cpus or max(4, 2 * (os.cpu_count() or 1))
        _owner_only_token()
    return kwargs


def _owner_only_token() -> None:
    """A Ray that `ray.init()` starts turns token authentication on and, where there is none, writes
    `~/.ray/auth_token` with the process's default permissions (0644: every user of the machine reads it).
    Write it first, owner-only (0600), as Ray would write it otherwise; tighten one an earlier run left."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled" or any(
        os.environ.get(v) for v in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
    ):
        return
    try:
        from ray._private.authentication.authentication_token_generator import (
            generate_new_authentication_token,
        )
    except ImportError:  # a Ray without token authentication
        return
    path = Path.home() / ".ray" / "auth_token"
    path.parent.mkdir(mode=0o700, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_mode & 0o077:
            path.chmod(0o600)
        return
    with os.fdopen(fd, "w") as f:
        f.write(generate_new_authentication_token())


@contextlib.contextmanager
def ray_log_file(notebook: str = "notebook", show_worker_logs: bool = False):
    """Around `ray.init`: Ray's start-up messages, then what the workers print (Ray Train's controller,
    Lightning, DeepSpeed, transformers, your own prints in a training function), go to a log file,
    `<cache>/logs/<notebook>-<time>.log`; the line printed at the end names it and the cluster. The
    training cell shows the run's progress lines instead. `show_worker_logs=True` shows the workers'
    output here as well."""
    import datetime

    from harness.cache import cache_dir

    logs = cache_dir() / "logs"
    logs.mkdir(exist_ok=True)
    path = logs / f"{notebook}-{datetime.datetime.now():%Y%m%d-%H%M%S}.log"
    with _stderr_to(path):
        yield path
    _route_worker_logs(path, show_worker_logs)
    # Ray Data says once, as a warning, that its progress bars are off: they are, on purpose (RAY_ENV).
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    _say_where()


def _say_where() -> None:
    """One line: the cluster this notebook started or attached to, and where the workers' output goes."""
    import ray

    from harness.storage import shown

    resources = ray.cluster_resources()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    gpus = f", {resources.get('GPU', 0):g} GPUs" if resources.get("GPU") else ", no GPU"
    found = _worker_log.get("found")
    how = (
        "started"
        if not os.environ.get("RAY_ADDRESS")
        else f"attached to the cluster `ray start` runs here ({found}):"
        if found
        else "attached to"
    )
    print(
        f"Ray: {how} {len(nodes)} node(s), {resources.get('CPU', 0):g} CPUs{gpus}. "
        f"Workers' output: {shown(str(_worker_log_path())) if _worker_log_path() else 'shown here'}"
    )


def start_ray(
    notebook: str = "notebook", show_worker_logs: bool = False, num_cpus: int | None = None, **init_kwargs
):
    """`ray.init(**ray_init_args(...))` inside `ray_log_file`, unless Ray is up already; return
    `ray.cluster_resources()`."""
    import ray

    if not ray.is_initialized():
        kwargs = ray_init_args(num_cpus, **init_kwargs)
        with ray_log_file(notebook, show_worker_logs):
            ray.init(**kwargs)
    else:
        _say_where()
    return ray.cluster_resources()


def _check_answers(address: str, timeout_s: float = 3.0) -> None:
    """A found cluster's GCS must accept a connection; else Ray's record of it is stale (its head stopped
    without `ray stop`), and `ray.init` would retry for a minute before a long error. One line instead."""
    import socket

    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError):
        raise ConnectionError(
            f"Ray's record of a cluster on this machine names {address}, where no Ray answers: its head node "
            "stopped without `ray stop`. Run `ray stop` to clear the record (or `ray start --head` to start "
            "one), or set RAY_ADDRESS to a running cluster."
        ) from None


def _token_as_ray_init_would() -> None:
    """A plain `ray.init()` that finds a local cluster turns token authentication on where a token exists
    (`~/.ray/auth_token`, or RAY_AUTH_TOKEN/RAY_AUTH_TOKEN_PATH) and RAY_AUTH_MODE is unset, as `ray start
    --head` did for the cluster; an explicit address (the RAY_ADDRESS set here) never does. Do the same."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def cluster_ray_finds() -> str | None:
    """The address of the cluster `ray.init()` would attach to without `RAY_ADDRESS`: the last one
    `ray start` started on this machine (Ray's `<temp dir>/ray/ray_current_cluster`, under `RAY_TMPDIR`,
    `TMPDIR` or /tmp). None where there is none: then a local Ray starts. On a head node a notebook must
    attach, not start a Ray of its own (`ray.init(num_cpus=...)` refuses there)."""
    try:
        from ray._private.services import get_ray_address_from_environment  # what ray.init() consults

        return get_ray_address_from_environment(None, None)
    except Exception:  # noqa: BLE001 - a Ray without it: start a local one, as before
        return None


def _autoscaling() -> bool:
    # Ray cannot tell a driver whether an autoscaler will add nodes; clusters that do
    # (Anyscale, KubeRay with autoscaling) say so through this variable.
    return os.environ.get("LLM_NOTEBOOKS_AUTOSCALING", "0") == "1"


def resource_shortfall(
    nodes: list[dict],
    num_workers: int,
    use_gpu: bool,
    cpus_per_worker: float = 1.0,
    name: str = "NUM_WORKERS",
) -> str | None:
    """What `check_resources` says where `num_workers` workers can never run on Ray nodes with these
    resources (`ray.nodes()`'s "Resources"); None where they can."""
    gpus_per_worker = 1.0 if use_gpu else 0.0
    total_cpu = sum(n.get("CPU", 0) for n in nodes)
    total_gpu = sum(n.get("GPU", 0) for n in nodes)
    fits_one_node = any(
        n.get("CPU", 0) >= cpus_per_worker and n.get("GPU", 0) >= gpus_per_worker for n in nodes
    )
    problems = []
    if use_gpu and num_workers * gpus_per_worker > total_gpu:
        problems.append(
            f"{name}={num_workers} with USE_GPU=True needs {num_workers * gpus_per_worker:g} GPUs, "
            f"but this Ray cluster has {total_gpu:g}"
        )
    if num_workers * cpus_per_worker > total_cpu:
        problems.append(
            f"{name}={num_workers}"
            + (f" with CPUS_PER_WORKER={cpus_per_worker:g}" if cpus_per_worker != 1 else "")
            + f" needs {num_workers * cpus_per_worker:g} CPUs, "
            f"but this Ray cluster has {total_cpu:g}"
        )
    if not problems and not fits_one_node:
        problems.append(
            f"no single node has {cpus_per_worker:g} CPU and {gpus_per_worker:g} GPU free for one worker"
        )
    if not problems:
        return None
    return (
        "; ".join(problems)
        + f". trainer.fit() would wait forever. Lower {name}, set USE_GPU=False, or run the "
        "small version with SMOKE_TEST=True (papermill: -p SMOKE_TEST True)."
    )


def check_resources(
    num_workers: int, use_gpu: bool, cpus_per_worker: float = 1.0, name: str = "NUM_WORKERS"
) -> None:
    """Raise `ResourceRequestError` if `num_workers` workers (1 GPU each if `use_gpu`) can never run;
    `name` is the parameter that asked for them (`MIN_WORKERS` for an elastic run).

    Checks the whole cluster and that one worker's bundle fits on some node. On a cluster
    that autoscales (`LLM_NOTEBOOKS_AUTOSCALING=1`) a shortfall is only a warning.
    """
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    message = resource_shortfall(nodes, num_workers, use_gpu, cpus_per_worker, name)
    if message is None:
        return
    if _autoscaling():
        warnings.warn(message + " (LLM_NOTEBOOKS_AUTOSCALING=1: waiting for the autoscaler.)", stacklevel=2)
        return
    raise ResourceRequestError(message)
