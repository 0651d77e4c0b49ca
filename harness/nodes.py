"""The checks that run on every node before `fit()`, as Ray tasks pinned to each: can it write to
`STORAGE_PATH` (and, on GPUs, how fast), is a local folder one folder on every node, can `torch.compile`
build its kernels there, do the GPUs match `CLUSTER`, is there local disk for the files the plan puts there,
and the model's weights fetched ahead. Used through `harness.checks.check_cluster`.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

from basics.cluster import alive_nodes, fetch_model

__all__ = [
    "check_storage_from_nodes",
    "compile_missing_on_nodes",
    "storage_rate",
    "storage_rates_on_nodes",
    "check_gpus_match_cluster",
    "local_disk_shortfall",
    "check_local_disk_on_nodes",
    "prefetch_model_on_nodes",
]


def _on_every_node(check, *args, use_gpu: bool = False, one_at_a_time: bool = False) -> dict[str, object]:
    """Run the function `check(*args)` once on every alive node that can run a worker (with a GPU if
    `use_gpu`, else with a CPU), as a Ray task pinned to the node; return {"address node-id": its result}.
    `one_at_a_time`: each node's task after the last one's ended (a measurement the nodes would share).

    Used by the node-by-node checks before `fit()`: `prefetch_model_on_nodes` and
    `check_storage_from_nodes`. On a Ray this notebook started on this machine (no `RAY_ADDRESS`), the one
    node is this process's and its workers inherit this environment: the check runs here, without starting
    a worker process for it (about 1 s of both cores on a laptop).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = alive_nodes(use_gpu)
    if not nodes:  # an autoscaling cluster before its first node of that kind
        return {}
    labels = [n["NodeManagerAddress"] + " " + n["NodeID"][:8] for n in nodes]
    here = ray.get_runtime_context().get_node_id()
    if not os.environ.get("RAY_ADDRESS") and [n["NodeID"] for n in nodes] == [here]:
        return {labels[0]: check(*args)}
    task = ray.remote(num_cpus=0)(check)

    def on(node: dict):
        return task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
        ).remote(*args)

    if one_at_a_time:
        return {label: ray.get(on(n)) for label, n in zip(labels, nodes, strict=True)}
    return dict(zip(labels, ray.get([on(n) for n in nodes]), strict=True))


def check_storage_from_nodes(name: str, value: str, use_gpu: bool = False) -> int:
    """Write and delete a test object in `value` from every node that runs a worker (those with a GPU where
    `use_gpu`: a cluster's CPU-only node groups need not mount it) and from this driver's; return how many nodes.

    Checkpoints are written by the workers, not by the notebook, and Ray does not send the driver's
    environment to them: a node without the bucket's credentials (instance credentials on a real
    cluster, the AWS_* variables here) fails only when its first checkpoint is uploaded, minutes or
    hours in. This finds it before `fit()`. A local folder must be one folder on every node
    (`_check_shared_folder`).
    """
    from basics.validate import ParameterError
    from harness.storage import is_uri

    if not is_uri(value) or value.startswith("file://"):
        # `~` as Ray Train's pyarrow expands it: the home folder, not a folder named `~` here.
        return _check_shared_folder(name, os.path.expanduser(value.removeprefix("file://")), use_gpu)

    nodes = _on_every_node(_probe_storage, value, use_gpu=use_gpu)
    answers = {"this notebook's machine": _probe_storage(value), **{f"node {k}": v for k, v in nodes.items()}}
    failed = {node: error for node, error in answers.items() if error}
    if failed:
        lines = "; ".join(f"{node}: {error}" for node, error in failed.items())
        raise ParameterError(
            f"{name}={value!r}: {len(failed)} of {len(answers)} (Ray nodes and this notebook's machine) cannot "
            f"write there ({lines}). "
            "Workers write the checkpoints, so every node needs the bucket's credentials: instance "
            "credentials, or the AWS_* variables in each node's environment when it was started."
        )
    return len(nodes)


def _compile_prerequisites() -> str | None:
    """What `torch.compile` on a GPU needs and this node lacks (None: nothing): Triton builds each kernel's
    launcher with a C compiler and Python's headers when it first runs it."""
    import importlib.util
    import shutil
    import sysconfig

    missing = []
    compiler = (os.environ.get("CC") or "").split()
    if not (shutil.which(compiler[0]) if compiler else any(shutil.which(c) for c in ("cc", "gcc", "clang"))):
        missing.append("a C compiler (cc, gcc or clang, or $CC)")
    include = sysconfig.get_paths().get("include", "")
    if not os.path.exists(os.path.join(include, "Python.h")):
        missing.append(f"Python's headers ({include}/Python.h)")
    if importlib.util.find_spec("triton") is None:
        missing.append("the triton package")
    return ", ".join(missing) or None


def compile_missing_on_nodes(use_gpu: bool = True) -> dict[str, str]:
    """{node: what it lacks} for `torch.compile`, on the nodes that run workers; empty where all have it."""
    return {
        node: lacks
        for node, lacks in _on_every_node(_compile_prerequisites, use_gpu=use_gpu).items()
        if lacks
    }


def _probe_storage(uri: str) -> str | None:
    """Write, read back and delete a small object at `uri` (on the node this runs on); why not, or None."""
    import pyarrow.fs as pafs

    from harness.storage import write_probe

    try:
        fs, path = pafs.FileSystem.from_uri(uri)
        write_probe(fs, path)
    except Exception as exc:  # noqa: BLE001 - reported to the driver with the node's address
        return f"{type(exc).__name__}: {exc}"
    return None


# What a node writes to measure the storage's rate: about a checkpoint file's size, far from a 70B one, so an
# upper bound (a node's cache and a bucket's first bytes are the fastest).
RATE_PROBE_BYTES = 1 << 30


def write_rate(fs, path: str, total_bytes: int, streams: int) -> float:
    """Write `total_bytes` under `path` in `streams` files at once, as a rank writes a checkpoint's files,
    then delete them; the bytes per second. Random bytes, so that no store compresses them away."""
    from concurrent.futures import ThreadPoolExecutor

    folder = f"{path.rstrip('/')}/.write-rate-{uuid.uuid4().hex[:8]}"
    fs.create_dir(folder, recursive=True)
    chunk = os.urandom(min(8 << 20, max(1, total_bytes // streams)))
    per_stream = total_bytes // streams

    def write(i: int) -> None:
        with fs.open_output_stream(f"{folder}/{i}") as f:
            for start in range(0, per_stream, len(chunk)):
                f.write(chunk[: per_stream - start])

    began = time.monotonic()
    try:
        with ThreadPoolExecutor(streams) as pool:
            list(pool.map(write, range(streams)))
        return per_stream * streams / (time.monotonic() - began)
    finally:
        fs.delete_dir(folder)


def storage_rate(uri: str, total_bytes: int) -> float | str:
    """Bytes per second this node writes to `uri` in a rank's `STREAMS` streams (`write_rate`),
    or why it could not."""
    import pyarrow.fs as pafs

    from basics.checkpoints import STREAMS
    from harness.storage import is_uri

    try:
        if is_uri(uri) and not uri.startswith("file://"):
            fs, path = pafs.FileSystem.from_uri(uri)
        else:
            fs, path = pafs.LocalFileSystem(), os.path.expanduser(uri.removeprefix("file://"))
        return write_rate(fs, path, total_bytes, STREAMS)
    except Exception as exc:  # noqa: BLE001 - reported to the driver with the node's address
        return f"{type(exc).__name__}: {exc}"


def storage_rates_on_nodes(uri: str, use_gpu: bool, total_bytes: int = RATE_PROBE_BYTES) -> dict[str, object]:
    """{node: bytes per second (or why not)} each node that runs workers writes to `uri`, one node at a time
    (nodes sharing a link or an NFS server would otherwise measure each other)."""
    return _on_every_node(storage_rate, uri, total_bytes, use_gpu=use_gpu, one_at_a_time=True)


def _read_marker(path: str, token: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read() == token
    except OSError:
        return False


def _check_shared_folder(name: str, folder: str, use_gpu: bool = False) -> int:
    """A local `STORAGE_PATH` is one folder on every node (NFS, Anyscale's /mnt/cluster_storage), or each
    node keeps its own checkpoint shards and the first resume fails, hours in (Ray does not check a folder
    the workers write themselves). This notebook writes a marker there and every node must read it back;
    return how many nodes did."""
    import uuid

    from basics.validate import ParameterError

    token = uuid.uuid4().hex
    marker = os.path.join(folder, f".llm-notebooks-shared-{token}")
    os.makedirs(folder, exist_ok=True)
    with open(marker, "w", encoding="utf-8") as f:
        f.write(token)
    try:
        answers = _on_every_node(_read_marker, marker, token, use_gpu=use_gpu)
    finally:
        os.remove(marker)
    missing = sorted(node for node, seen in answers.items() if not seen)
    if missing:
        raise ParameterError(
            f"{name}={folder!r}: {len(missing)} of {len(answers)} Ray nodes do not see this folder's files "
            f"({', '.join(missing)}): each would keep its own checkpoints, and resuming would fail. Use a folder "
            "every node shares (NFS; /mnt/cluster_storage on Anyscale) or a bucket (s3://...)."
        )
    return len(answers)


def _gpu_memory_bytes() -> int | None:
    """The smallest GPU's memory on this node, as its driver reports it (`nvidia-smi`); None without one."""
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        return min(int(line) for line in out.split()) * 2**20
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def check_gpus_match_cluster(p) -> int:
    """The plan counted the GPUs of `CLUSTER` (`p`: the notebook's `Parameters`); the nodes have what they have. Fail, naming `CLUSTER`, where a
    GPU node's GPUs have less memory than the plan's (16 A100-40GB planned as the default's A100-80GB would
    fail after the weights' download). Returns how many GPU nodes were checked."""
    from basics.hardware import NODE_TYPES
    from basics.validate import ParameterError

    types = [NODE_TYPES[t] for t in (p.CLUSTER or {}) if t in NODE_TYPES and NODE_TYPES[t].gpus]
    if not p.USE_GPU or not types:
        return 0
    planned = min(types, key=lambda t: t.gpu_memory)
    answers = _on_every_node(_gpu_memory_bytes, use_gpu=True)
    # nvidia-smi counts a little more than torch (80 GiB against 79.2 on an A100-80GB): 5 % of room
    short = {node: have for node, have in answers.items() if have and have < 0.95 * planned.gpu_memory}
    if short:
        found = ", ".join(f"{node}: {have / 2**30:.0f} GiB" for node, have in sorted(short.items()))
        raise ParameterError(
            f"CLUSTER={p.CLUSTER!r}: the plan counts {planned.gpu} GPUs of {planned.gpu_memory / 2**30:.1f} "
            f"GiB, but {len(short)} of this cluster's {len(answers)} GPU node(s) have less ({found}). Set CLUSTER "
            "to the node type you have, so that the plan counts its GPUs."
        )
    return len(answers)


def local_disk_shortfall(needs: dict[str, int], model_name: str = "") -> list[str]:
    """On this node: where the run's local files go and whether the disk under each has room for them.

    `needs`: bytes per destination, "hub cache" (the Hub download: nothing if `model_name` is a folder or
    already cached here) and "temp" (staged checkpoints and the export, in `tempfile.gettempdir()`). Two
    destinations on one filesystem add up. Returns one line per filesystem that is short, else [].
    """
    import tempfile

    from huggingface_hub import constants, try_to_load_from_cache

    need = dict(needs)
    if (
        not model_name
        or os.path.isdir(model_name)
        or isinstance(try_to_load_from_cache(model_name, "config.json"), str)
    ):
        need["hub cache"] = 0  # a folder, or already in this node's cache
    folders = {"hub cache": constants.HF_HUB_CACHE, "temp": tempfile.gettempdir()}
    by_disk: dict[int, list] = {}
    for what, folder in folders.items():
        existing = next(p for p in [Path(folder), *Path(folder).parents] if p.exists())
        entry = by_disk.setdefault(os.stat(existing).st_dev, [existing, 0, []])
        entry[1] += need.get(what, 0)
        entry[2].append(f"{what} {folder}")
    short = []
    for existing, bytes_needed, names in by_disk.values():
        free = shutil.disk_usage(existing).free
        if bytes_needed > free:
            short.append(
                f"{' and '.join(names)}: needs {bytes_needed / 1e9:.1f} GB, {free / 1e9:.1f} GB free"
            )
    return short


def check_local_disk_on_nodes(needs: dict[str, int], model_name: str, use_gpu: bool) -> int:
    """Refuse a run whose local files would not fit where they are written, on any node that can run a
    worker (`local_disk_shortfall` there); return how many nodes were checked.

    The plan's disk row compares with an instance type's local disk, but the files go to the Hugging Face
    cache (`HF_HOME`) and the temp folder (`TMPDIR`), often a small root volume or a container's overlay:
    an ENOSPC after hours of training. This finds it before the download starts.
    """
    from basics.validate import ParameterError

    answers = _on_every_node(local_disk_shortfall, needs, model_name, use_gpu=use_gpu)
    short = {node: lines for node, lines in answers.items() if lines}
    if short:
        lines = "; ".join(f"node {node}: {', '.join(found)}" for node, found in short.items())
        raise ParameterError(
            f"Not enough local disk for the run's files ({lines}). Point HF_HOME and TMPDIR at a larger disk "
            "on every node (the instance's NVMe, e.g. /mnt/local_storage) before Ray starts, or free space."
        )
    return len(answers)


def prefetch_model_on_nodes(name: str, model_name: str, use_gpu: bool) -> dict[str, float]:
    """Put `model_name`'s files on every node that can run a worker, before `fit()`; return seconds per node.

    Rank 0 loads the pretrained weights while every other rank waits in the first collective. If that
    load starts with a 138 GB download, the wait can outlast the collective timeout (Ray Train's
    `TorchConfig(timeout_s=1800)`). Downloading here, in parallel on each node and with no timeout
    running, leaves rank 0 only the read from the node's Hugging Face cache. A local folder is checked
    instead: every node must see it (a folder on the head node only is a mistake found here, not in
    a worker). Used by `harness.checks.check_cluster` for the Llama notebook.
    """
    from basics.validate import ParameterError

    def fetch(model: str) -> tuple[float, str | None]:
        try:
            return fetch_model(model), None
        except Exception as exc:  # noqa: BLE001 - reported to the driver with the node's address
            return 0.0, f"{type(exc).__name__}: {exc}"

    answers = _on_every_node(fetch, model_name, use_gpu=use_gpu)
    failed = {node: error for node, (_, error) in answers.items() if error}
    if failed:
        lines = "; ".join(f"node {node}: {error}" for node, error in failed.items())
        raise ParameterError(
            f"{name}={model_name!r}: {len(failed)} of {len(answers)} nodes cannot get it ({lines})."
        )
    return {node: seconds for node, (seconds, _) in answers.items()}
