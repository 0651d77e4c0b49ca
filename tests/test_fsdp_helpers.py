"""`helpers.fsdp`: Lightning + Ray's FSDP strategy on 2 CPU workers really shards, trains and checkpoints."""

from __future__ import annotations

import pytest

import helpers


def _train_func(config: dict) -> None:
    import functools

    import lightning.pytorch as pl
    import ray.train
    import torch
    from ray.train.lightning import RayLightningEnvironment, RayTrainReportCallback, prepare_trainer
    from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers import AutoModelForCausalLM
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXLayer

    from helpers.fsdp import fsdp_strategy_class, param_shard_fraction

    class TinyLM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = AutoModelForCausalLM.from_pretrained(config["model"])
            self.losses = []

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch, labels=batch["input_ids"]).loss
            self.losses.append(loss.item())
            # Logged metrics reach Ray Train with each epoch's checkpoint (RayTrainReportCallback).
            self.log("train_loss", loss)
            self.log("first_loss", self.losses[0])
            self.log("shard_fraction", fractions[0])
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.trainer.model.parameters(), lr=3e-3)

    module = TinyLM()
    total = sum(p.numel() for p in module.parameters())
    strategy = fsdp_strategy_class()(
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        forward_prefetch=True,
        auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={GPTNeoXLayer}
        ),
        limit_all_gathers=True,
        activation_checkpointing_policy={GPTNeoXLayer},
    )
    fractions = []

    class ShardProbe(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            fractions.append(param_shard_fraction(trainer.model, total))

    gen = torch.Generator().manual_seed(ray.train.get_context().get_world_rank())
    ids = torch.randint(5, 200, (48, 24), generator=gen)
    rows = [{"input_ids": x, "attention_mask": torch.ones_like(x)} for x in ids]
    trainer = pl.Trainer(
        max_epochs=2,
        devices="auto",
        accelerator="auto",
        precision="bf16-mixed",
        strategy=strategy,
        plugins=[RayLightningEnvironment()],
        callbacks=[RayTrainReportCallback(), ShardProbe()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        logger=False,
    )
    trainer = prepare_trainer(trainer)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(rows, batch_size=8))


@pytest.mark.timeout(240)
def test_cpu_fsdp_strategy_shards_trains_and_checkpoints(tmp_path):
    import sys

    import ray
    from ray import cloudpickle
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    # Ship `_train_func` by value: the workers cannot import this test module by name.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    helpers.start_ray()
    try:
        seen = []
        result = TorchTrainer(
            _train_func,
            train_loop_config={"model": helpers.tiny_model("gpt_neox")},
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(storage_path=str(tmp_path), name="fsdp"),
        ).fit()
        seen = result.metrics
    finally:
        ray.shutdown()
    # FULL_SHARD over 2 workers: half the parameter elements each (a fall-back to DDP shows 1.0).
    assert seen["shard_fraction"] == pytest.approx(0.5, abs=0.02)
    assert seen["train_loss"] < seen["first_loss"]
    # The full state dict was gathered on CPU (this segfaulted with Lightning's default) and saved.
    ckpt = next(p for p in (tmp_path / "fsdp").rglob("checkpoint.ckpt"))
    import torch

    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(helpers.tiny_model("gpt_neox")).state_dict()
    assert {k.removeprefix("model.") for k in state} == set(full)
    assert all(state["model." + k].shape == v.shape for k, v in full.items())  # full tensors, not shards


def test_precision_list_matches_lightning():
    import typing

    from lightning.fabric.connector import _PRECISION_INPUT_STR

    from helpers.fsdp import LIGHTNING_PRECISIONS

    assert set(LIGHTNING_PRECISIONS) == set(typing.get_args(_PRECISION_INPUT_STR))
