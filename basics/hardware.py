"""The machines a plan is made for: AWS GPU instance types (`NODE_TYPES`), this machine as a CPU node, and
where a run's workers land on the nodes of `CLUSTER` (`placement`)."""

from __future__ import annotations

import math
import shutil
import tempfile
from dataclasses import dataclass

from .validate import ParameterError

__all__ = ["NodeType", "NODE_TYPES", "local_node", "MAX_NODES", "check_node_counts", "placement"]

GiB = 1024**3


@dataclass(frozen=True)
class NodeType:
    gpus: int
    gpu: str
    gpu_memory: int  # bytes per GPU, as the driver reports it
    memory: int  # host RAM, bytes
    disk: int  # local instance storage (NVMe), bytes
    bf16: bool = True  # the GPU computes in bf16
    cpus: int = 0  # vCPUs


# AWS instance types (public spec sheets). GPU memory as torch reports it (`torch.cuda.
# get_device_properties(0).total_memory`), a little under the product's figure: 14.6 GiB on a "16 GB" T4,
# 22.0 on an A10G, 39.4 / 79.2 on the 40 / 80 GB A100, 79.2 on an H100-80GB (not measured here: no GPU).
NODE_TYPES = {
    "g4dn.4xlarge": NodeType(1, "T4", int(14.6 * GiB), 64 * GiB, 225 * 10**9, bf16=False, cpus=16),
    "g4dn.8xlarge": NodeType(1, "T4", int(14.6 * GiB), 128 * GiB, 900 * 10**9, bf16=False, cpus=32),
    "g4dn.12xlarge": NodeType(4, "T4", int(14.6 * GiB), 192 * GiB, 900 * 10**9, bf16=False, cpus=48),
    "g5.12xlarge": NodeType(4, "A10G", 22 * GiB, 192 * GiB, 3800 * 10**9, cpus=48),
    "p4d.24xlarge": NodeType(8, "A100-40GB", int(39.4 * GiB), 1152 * GiB, 8000 * 10**9, cpus=96),
    "p4de.24xlarge": NodeType(8, "A100-80GB", int(79.2 * GiB), 1152 * GiB, 8000 * 10**9, cpus=96),
    "p5.48xlarge": NodeType(8, "H100-80GB", int(79.2 * GiB), 2048 * GiB, 30400 * 10**9, cpus=192),
}


def local_node() -> NodeType:
    """This machine as a node with no GPU: its RAM and the free space of its temp folder."""
    import psutil

    disk = shutil.disk_usage(tempfile.gettempdir()).free
    return NodeType(0, "none (CPU workers)", 0, psutil.virtual_memory().total, disk)


MAX_NODES = 10_000  # of one type in CLUSTER: more than any cluster has, few enough to plan at once


def check_node_counts(cluster) -> None:
    """`CLUSTER`: {node type: count}, known types, whole counts from 1 to MAX_NODES (a count of 10**22, or
    1e999, is an error in one line, not a plan that never ends)."""
    if not isinstance(cluster, dict) or not cluster:
        raise ParameterError(f"CLUSTER={cluster!r}: give {{node type: count}}, e.g. {{'p4de.24xlarge': 2}}.")
    unknown = sorted(str(t) for t in set(cluster) - set(NODE_TYPES))
    if unknown:
        raise ParameterError(f"CLUSTER: unknown node type(s) {unknown}; known: {sorted(NODE_TYPES)}.")
    for name, count in cluster.items():
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_NODES:
            shown = repr(count) if len(repr(count)) <= 24 else f"{repr(count)[:20]}..."
            raise ParameterError(
                f"CLUSTER: {name!r}: {shown} nodes; give a whole number from 1 to {MAX_NODES}."
            )


def placement(cluster: dict[str, int] | None, n: int) -> dict:
    """The node that fits worst (the least host RAM per GPU: rank 0 can land on any GPU node), how many
    workers it holds, and what one worker's device has; on CPU, this machine shared by the workers."""
    if cluster is None:
        node = local_node()
        return dict(on_gpu=False, node=node, per_node=n, nodes=1, device_have=node.memory // n,
                    device_name="CPU worker's share of RAM", where_device="per CPU worker")  # fmt: skip
    check_node_counts(cluster)
    gpu_nodes = [NODE_TYPES[t] for t in cluster if NODE_TYPES[t].gpus]
    gpus = sum(NODE_TYPES[t].gpus * count for t, count in cluster.items())
    if gpus < n:
        raise ParameterError(
            f"NUM_WORKERS={n} needs {n} GPUs; CLUSTER={cluster} has {gpus}. "
            "Lower NUM_WORKERS or add nodes to CLUSTER."
        )
    node = min(gpu_nodes, key=lambda t: (t.memory / t.gpus, t.disk / t.gpus))
    return dict(on_gpu=True, node=node, per_node=min(node.gpus, n), nodes=math.ceil(n / node.gpus),
                device_have=node.gpu_memory, device_name=f"{node.gpu} GPU", where_device="per GPU")  # fmt: skip
