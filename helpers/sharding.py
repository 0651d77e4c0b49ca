"""Proof that sharding really happened: the fraction of the model one rank holds.

A run that silently fell back to plain data parallelism trains fine, so losses alone cannot
tell. These numbers can: with 2 workers each rank holds about 0.5 of what is sharded,
and a fall-back shows 1.0. Used by the training function of gpt2_deepspeed (section 5, ZeRO) and read in its section 8.
"""

from __future__ import annotations

__all__ = ["zero_partition_fraction"]


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
