"""Proof that sharding really happened, and what each rank holds: the meters the observers read
(`harness.observe`), and the precisions Lightning accepts.

A run that silently fell back to plain data parallelism trains fine, so losses alone cannot tell. These
numbers can: with 2 workers each rank holds about 0.5 of what is sharded (ZeRO's partitions, FSDP's
shards), and a fall-back shows 1.0. LoRA's frozen base is fingerprinted to show it never changed.
"""

from __future__ import annotations

__all__ = [
    "zero_partition_fraction",
    "param_shard_fraction",
    "gradient_bytes",
    "frozen_fingerprint",
    "frozen_tensors_changed",
    "LIGHTNING_PRECISIONS",
]


def zero_partition_fraction(engine) -> float:
    """Fraction of the ZeRO-partitioned state that this rank of a DeepSpeed `engine` holds.

    Stage 3 partitions the parameters themselves: local `ds_tensor` elements / all elements.
    Stages 1 and 2 partition the fp32 master weights the optimizer steps (and so its
    states): this rank's flat partitions / all trainable elements.
    """
    stage = engine.zero_optimization_stage()
    if stage == 3:
        params = [p for p in engine.module.parameters() if hasattr(p, "ds_tensor")]
        total = sum(p.ds_numel for p in params)
        local = sum(p.ds_tensor.numel() for p in params)
    elif stage in (1, 2):
        optimizer = engine.optimizer
        total = sum(p.numel() for group in optimizer.bit16_groups for p in group)
        local = sum(part.numel() for part in optimizer.single_partition_of_fp32_groups)
    else:
        return 1.0  # no ZeRO: every rank holds everything
    return local / total


def zero_state_bytes(engine) -> dict[str, int]:
    """Bytes of 16-bit weights and of optimizer state (fp32 master weights and AdamW moments) this rank
    of a DeepSpeed `engine` holds, after its first step: to compare with the GPT-2 notebook's plan.

    Stage 3 holds a partition of the 16-bit weights (`ds_tensor`); stages 1 and 2 all of them. The fp32
    partitions and their moments live in the ZeRO optimizer, offloaded to the CPU or not.
    """

    def size(t) -> int:
        return t.numel() * t.element_size()

    optimizer = engine.optimizer
    stage = engine.zero_optimization_stage()
    if stage == 3:
        weights = sum(size(p.ds_tensor) for p in engine.module.parameters())
        flats = optimizer.fp32_partitioned_groups_flat
    else:
        weights = sum(size(p) for p in engine.module.parameters())
        flats = optimizer.single_partition_of_fp32_groups
    moments = sum(
        size(v)
        for flat in flats
        for k, v in optimizer.optimizer.state[flat].items()
        if k in ("exp_avg", "exp_avg_sq")
    )
    return {"param_bytes": weights, "optimizer_bytes": sum(size(f) for f in flats) + moments}


def param_shard_fraction(wrapped_model, total_numel: int) -> float:
    """Parameter elements this rank holds locally after FSDP wrapped the model / all of the model's.

    About `1 / world_size` with FULL_SHARD; 1.0 means every rank holds a full copy (DDP). Works for
    FSDP1 (flat parameters hold the local shard) and FSDP2 (each parameter is a `DTensor`, whose
    `numel()` is the global size; its `to_local()` is what this rank holds).
    """
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in wrapped_model.parameters())
    return local / total_numel


def gradient_bytes(model) -> int:
    """Bytes of gradients this rank holds now: its gradient shards, plus any whole (unsharded) gradient
    FSDP2 keeps for a layer whose reduce-scatter was skipped.

    The observers read it after a step's micro-steps. With gradient sync off
    (`set_requires_gradient_sync(False)`, "no_sync") FSDP2 keeps each layer's full gradient, in
    `reduce_dtype`, until a micro-step with sync on reduce-scatters it: 4 bytes x every parameter at once
    for fp32, not `1 / world_size` of it. Those live in FSDP2's own state, not in `param.grad`
    (`torch/distributed/fsdp/_fully_shard/_fsdp_param.py`, `to_accumulated_grad_if_needed`).
    """

    def size(t) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    total = sum(size(p.grad) for p in model.parameters() if p.grad is not None)
    for module in model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        for group in getattr(state, "_fsdp_param_groups", []):
            for fsdp_param in group.fsdp_params:
                if fsdp_param.unsharded_accumulated_grad is not None:
                    total += size(fsdp_param.unsharded_accumulated_grad)
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None and unsharded.grad is not None:
                    total += size(unsharded.grad)
    return total


# The `precision=` strings Lightning accepts (`lightning.fabric.connector._PRECISION_INPUT_STR`), listed
# here so that checking a parameter does not import Lightning (seconds); a test keeps the two equal.
LIGHTNING_PRECISIONS = (
    "transformer-engine",
    "transformer-engine-float16",
    "16-true",
    "16-mixed",
    "bf16-true",
    "bf16-mixed",
    "32-true",
    "64-true",
)


def frozen_fingerprint(model) -> list[int]:
    """For each frozen parameter (LoRA's base), the sum of the bytes of this rank's shard: a change to any
    weight changes it. Cheap enough to take at 70B (one pass over the shards, no copy)."""
    import torch

    def local(p):
        return p.to_local() if hasattr(p, "to_local") else p

    return [
        int(local(p).detach().contiguous().view(torch.uint8).sum(dtype=torch.int64))
        for p in model.parameters()
        if not p.requires_grad
    ]


def frozen_tensors_changed(model, before: list[int]) -> int:
    """How many frozen tensors differ from `frozen_fingerprint`'s `before`, summed over all ranks."""
    import torch
    import torch.distributed as dist

    after = frozen_fingerprint(model)
    device = next(model.parameters()).device  # NCCL reduces only tensors on the GPU; gloo, on the CPU
    changed = sum(a != b for a, b in zip(before, after, strict=True))
    changed = torch.tensor(changed, dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.all_reduce(changed)  # gloo and NCCL both sum
    return int(changed)
