"""An FSDP2 rank for the gradient-memory test, in its own module: a spawned child imports only this, not
the test module with its pytest imports."""

from __future__ import annotations


def gradient_bytes_rank(rank: int, port: int, results) -> None:
    """One of 2 gloo ranks: a 4-layer model under `fully_shard`, bf16 compute and an fp32 reduction.

    Puts (rank, gradient bytes after a backward with gradient sync off, after one with it on, parameter
    bytes in fp32) on `results`.
    """
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from basics.sharding import gradient_bytes

    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    x = torch.randn(8, 64)
    measured = []
    for sync in (False, True):
        model.set_requires_gradient_sync(sync)
        model(x).sum().backward()
        measured.append(gradient_bytes(model))
        model.zero_grad(set_to_none=True)
    results.put((rank, *measured, 4 * sum(p.numel() for p in model.parameters())))
    dist.destroy_process_group()
