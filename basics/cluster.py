"""What a notebook asks of its Ray cluster itself: one task's GPUs, the model's files on a node.

Used by the Llama notebooks: `gpus_for_one_task` by the chat task ("Talk to the fine-tuned model"),
`fetch_model` by rank 0 at the start of `train_func`. Starting Ray and the checks before `fit()` are the
harness's (`harness.cluster`).
"""

from __future__ import annotations

import shutil
import socket
import warnings
from pathlib import Path

__all__ = ["gpus_for_one_task", "fetch_model", "alive_nodes", "ResourceRequestError"]


class ResourceRequestError(RuntimeError):
    """Raised before `fit()` when the cluster can never run the requested workers."""


def alive_nodes(use_gpu: bool) -> list[dict]:
    """The alive nodes of the Ray cluster that can run a worker: with a GPU if `use_gpu`, else with a CPU."""
    import ray

    key = "GPU" if use_gpu else "CPU"
    return [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get(key, 0) > 0]


def gpus_for_one_task(name: str, wanted: int) -> int:
    """GPUs to request for one task, which runs on one node: `wanted`, or as many as the largest node has.

    Asking one task for more GPUs than any node has never fails: it waits for ever (e.g. 8 GPUs on a
    cluster of 4-GPU nodes). Used by the Llama notebook's chat task ("9. Talk to the fine-tuned model").
    """
    most = int(max((n["Resources"].get("GPU", 0) for n in alive_nodes(use_gpu=True)), default=0))
    if most == 0:
        raise ResourceRequestError(f"{name} needs a GPU, and no node of this Ray cluster has one.")
    if most < wanted:
        warnings.warn(
            f"{name}: the largest node has {most} GPUs, not {wanted}: asking for {most}.", stacklevel=2
        )
    return min(wanted, most)


def fetch_model(model_name: str) -> float:
    """Put `model_name`'s weights, config and tokenizer in this node's Hugging Face cache; return seconds.

    A local folder is only checked (it must hold a `config.json`). Used on every node by
    `prefetch_model_on_nodes`, and by the Llama notebook's rank 0 at the start of `train_func`, before
    the first collective, for nodes that joined after the Set up cell (an autoscaling cluster, where the
    Set up cell found no node to check the disks of). A download that would not fit on the disk under
    `HF_HOME` is refused before it starts (the Hub's file sizes, `snapshot_download(dry_run=True)`).
    """
    import os
    import time

    start = time.perf_counter()
    if not os.path.isdir(model_name):
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import DryRunError

        patterns = ["*.json", "*.safetensors", "*.model", "tokenizer*"]
        try:
            files = snapshot_download(model_name, allow_patterns=patterns, dry_run=True)
        except DryRunError:  # the Hub out of reach (HF_HUB_OFFLINE): the cached copy, or the download's error
            files = []
        need = sum(f.file_size or 0 for f in files if f.will_download)
        cache = Path(constants.HF_HUB_CACHE)
        free = shutil.disk_usage(next(p for p in [cache, *cache.parents] if p.exists())).free
        if need > free:
            raise OSError(
                f"{model_name}: the download needs {need / 1e9:.1f} GB in the Hugging Face cache {cache}, "
                f"{free / 1e9:.1f} GB free on node {socket.gethostname()}. Point HF_HOME at a larger disk "
                "on every node (the instance's NVMe, e.g. /mnt/local_storage) before Ray starts."
            )
        snapshot_download(model_name, allow_patterns=patterns)
    elif not os.path.exists(os.path.join(model_name, "config.json")):
        raise FileNotFoundError(f"no config.json in the folder {model_name}")
    return time.perf_counter() - start
