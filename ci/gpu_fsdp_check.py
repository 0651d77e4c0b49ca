"""GPU check of the Dolly notebook's Lightning + FSDP settings, without Ray (never run by CI).

Runs the notebook's strategy settings (FULL_SHARD, BACKWARD_PRE, forward prefetch, GPTNeoXLayer
auto-wrap, limit_all_gathers, activation checkpointing of GPTNeoXLayer, optional CPU offload) with
Lightning's `FSDPStrategy` (which `RayFSDPStrategy` subclasses) on one CUDA GPU, with a randomly
initialised GPT-NeoX of a given size, and prints step time, tokens/s and peak GPU memory as JSON.

    python ci/gpu_fsdp_check.py --layers 24 --hidden 2048 --precision 16-mixed --cpu-offload
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, ShardingStrategy
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers import AutoModelForCausalLM, GPTNeoXConfig
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXLayer


class Model(pl.LightningModule):
    def __init__(self, config: GPTNeoXConfig, lr: float):
        super().__init__()
        self.model = AutoModelForCausalLM.from_config(config)
        self.model.config.use_cache = False  # required with activation checkpointing (ray issue 50145)
        self.lr = lr
        self.losses: list[float] = []
        self.step_times: list[float] = []
        self._t = None

    def training_step(self, batch, batch_idx):
        loss = self.model(batch, labels=batch).loss
        self.losses.append(loss.item())
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        torch.cuda.synchronize()
        self._t = time.perf_counter()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        torch.cuda.synchronize()
        self.step_times.append(time.perf_counter() - self._t)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.trainer.model.parameters(), lr=self.lr, eps=1e-8)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--precision", default="16-mixed")
    parser.add_argument("--cpu-offload", action="store_true")
    args = parser.parse_args()

    config = GPTNeoXConfig(
        vocab_size=50280,  # dolly-v2's
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 128,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model = Model(config, lr=1e-4)
    num_params = sum(p.numel() for p in model.parameters())
    # One fixed batch, repeated: the loss must fall (the model memorises it) if training works.
    batch = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    loader = torch.utils.data.DataLoader([batch] * args.steps, batch_size=None)
    strategy = FSDPStrategy(
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        forward_prefetch=True,
        auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={GPTNeoXLayer}
        ),
        limit_all_gathers=True,
        activation_checkpointing_policy={GPTNeoXLayer},
        cpu_offload=CPUOffload(offload_params=args.cpu_offload),
    )
    trainer = pl.Trainer(
        max_epochs=1,
        devices=1,
        accelerator="gpu",
        precision=args.precision,
        strategy=strategy,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.cuda.reset_peak_memory_stats()
    trainer.fit(model, train_dataloaders=loader)
    steady = model.step_times[2:]  # the first steps include allocator and kernel warm-up
    step_s = sum(steady) / len(steady)
    print(
        json.dumps(
            {
                "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "lightning": pl.__version__,
                "params_billion": round(num_params / 1e9, 3),
                "precision": args.precision,
                "cpu_offload": args.cpu_offload,
                "batch": args.batch,
                "seq": args.seq,
                "step_seconds": round(step_s, 3),
                "tokens_per_second": round(args.batch * args.seq / step_s),
                "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                "first_losses": [round(x, 3) for x in model.losses[:3]],
                "last_losses": [round(x, 3) for x in model.losses[-3:]],
            }
        )
    )


if __name__ == "__main__":
    main()
