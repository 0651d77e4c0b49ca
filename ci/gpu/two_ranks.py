"""Can two NCCL ranks share one GPU? (The GPU-only checks of a two-rank run would need it on a one-GPU machine.)

    python -m torch.distributed.run --standalone --nproc-per-node 2 ci/gpu/two_ranks.py

Both ranks take device 0 and all-reduce a tensor on it; each prints what happened.
"""

import torch
import torch.distributed as dist

dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(0)
try:
    tensor = torch.ones(4, device="cuda:0") * (rank + 1)
    dist.all_reduce(tensor)
    torch.cuda.synchronize()
    print(f"rank {rank}: all-reduce on cuda:0 gave {tensor.tolist()}", flush=True)
except Exception as error:
    print(f"rank {rank}: {type(error).__name__}: {str(error)[:600]}", flush=True)
dist.destroy_process_group()
