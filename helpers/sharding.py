"""Proof that sharding really happened: the fraction of the model one rank holds.

A run that silently fell back to plain data parallelism trains fine, so losses alone cannot
tell. These numbers can: with 2 workers each rank holds about 0.5 of what is sharded,
and a fall-back shows 1.0. Used in the GPT-2 DeepSpeed notebook (ZeRO) and the FSDP notebooks.
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
