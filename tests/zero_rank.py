"""A DeepSpeed rank for the ZeRO-1/2 test, in its own module: a spawned child imports only this, not the
test module with its pytest imports."""

from __future__ import annotations


def zero_rank(rank: int, world_size: int, port: int, stage: int, results, offload: str = "none") -> None:
    """One of 2 gloo ranks: a DeepSpeed engine at `stage` over the tiny GPT-2, three training steps.

    `offload` as the GPT-2 notebook's OFFLOAD: "optimizer+params" puts the optimizer state, its step
    (DeepSpeed's CPU Adam, compiled on first use) and the stage-3 parameters in CPU memory.
    """
    import os

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2"
    )
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM

    import helpers

    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(helpers.tiny_model("gpt2"))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True},
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
    }
    if offload == "optimizer+params":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
        optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-3)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(rank))
    losses = []
    for _ in range(3):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    offloaded = bool(getattr(engine.optimizer, "offload_optimizer", False))
    results.put((rank, helpers.zero_partition_fraction(engine), losses, offloaded))
    torch.distributed.destroy_process_group()
