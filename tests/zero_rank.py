"""A DeepSpeed rank for the ZeRO-1/2 test, in its own module: a spawned child imports only this, not the
test module with its pytest imports."""

from __future__ import annotations


def zero_rank(rank: int, world_size: int, port: int, settings: list, results) -> None:
    """One of 2 gloo ranks: for each (stage, offload) of `settings`, a DeepSpeed engine at that ZeRO stage
    over the tiny GPT-2 and three training steps, one engine after another in the same process group.

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

    import basics.sharding
    import harness.tiny_models

    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    for stage, offload in settings:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(harness.tiny_models.tiny_model("gpt2"))
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
        results.put(
            ((stage, offload), rank, basics.sharding.zero_partition_fraction(engine), losses, offloaded)
        )
        engine.destroy()
    torch.distributed.destroy_process_group()


def _join(rank: int, world_size: int, port: int) -> None:
    """Join the gloo process group, with the variables DeepSpeed reads set as a launcher sets them."""
    import os

    import torch

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)


def zero_checkpoint_rank(rank: int, world_size: int, port: int, results, folder: str, mode: str) -> None:
    """One of `world_size` gloo ranks with a ZeRO-3 engine over the tiny GPT-2, for the resume tests.

    "save": three training steps, then `save_checkpoint` into `folder`/checkpoint. "load": resume from
    it as the GPT-2 notebook does, through a filesystem that is not pyarrow's LocalFileSystem (as a
    bucket is), so `fetch_checkpoint` copies; at another world size, the check's refusal and
    DeepSpeed's own error, then DeepSpeed's universal checkpoint (converted by the test). Each rank puts
    `(rank, what it saw)` on `results`; the loss of a fixed batch compares the saved and loaded weights.
    """
    import os

    _join(rank, world_size, port)
    import deepspeed
    import pyarrow.fs as pafs
    import ray.train
    import torch
    from transformers import AutoModelForCausalLM

    import harness.tiny_models
    import helpers

    def engine(**extra):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(harness.tiny_models.tiny_model("gpt2"))
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 3},
            "bf16": {"enabled": True},
        }
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return deepspeed.initialize(model=model, optimizer=optimizer, config={**config, **extra})[0]

    def batch_loss(ds_engine) -> float:
        ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(rank))
        ds_engine.eval()  # no dropout: the loss depends on the weights only
        with torch.no_grad():
            return ds_engine(input_ids=ids, labels=ids).loss.item()

    saw: dict = {}
    if mode == "save":
        ds_engine = engine()
        for _ in range(3):
            ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(rank))
            loss = ds_engine(input_ids=ids, labels=ids).loss
            ds_engine.backward(loss)
            ds_engine.step()
        ds_engine.save_checkpoint(os.path.join(folder, "checkpoint"))
        saw["loss"] = batch_loss(ds_engine)
    else:
        parent, name = os.path.split(folder)
        ckpt = ray.train.Checkpoint(name, filesystem=pafs.SubTreeFileSystem(parent, pafs.LocalFileSystem()))
        ds_engine = engine()
        try:
            saw["world_size"] = helpers.zero_checkpoint.check_zero_checkpoint_workers(ckpt, world_size)
        except helpers.ParameterError as exc:
            saw["refused"] = str(exc)
        with harness.storage.fetch_checkpoint(
            ckpt, files=helpers.zero_checkpoint.zero_rank_files(rank)
        ) as local:
            saw["bytes_fetched"], saw["checkpoint_bytes"] = local.bytes_fetched, local.checkpoint_bytes
            saw["files"] = sorted(
                os.path.relpath(os.path.join(d, f), local) for d, _, fs in os.walk(local) for f in fs
            )
            try:
                ds_engine.load_checkpoint(os.path.join(local, "checkpoint"))
                saw["loss"] = batch_loss(ds_engine)
            except Exception as exc:  # noqa: BLE001 - DeepSpeed's own error, for the test to read
                saw["deepspeed_error"] = f"{type(exc).__name__}: {exc}"
        if "refused" in saw and os.path.exists(os.path.join(folder, "checkpoint", "latest_universal")):
            universal = engine(checkpoint={"load_universal": True})
            universal.load_checkpoint(os.path.join(folder, "checkpoint"))
            saw["universal_loss"] = batch_loss(universal)
    results.put((rank, saw))
    torch.distributed.destroy_process_group()
