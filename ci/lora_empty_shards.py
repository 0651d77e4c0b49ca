"""Check, without Ray (never run by CI: 8 processes, about 45 s on 2 cores), that llama_lora's trainable token
rows survive FSDP2 shards that are empty on some ranks: 4 rows over 8 ranks leave ranks 4-7 none.

8 gloo ranks on this machine's CPU shard a small Llama with LoRA adapters and 4 trainable token rows of the
embeddings and of the head exactly as the notebook does (`helpers.llama_recipe.shard_model`), train 3 steps
with AdamW (`--fused`: torch's fused kernel, on the CPU here; on a GPU the notebook uses CUDA's), write what
trains with DCP (`save_sharded`, `ignore_frozen_params`) and read it into a fresh model (`load_sharded`).
Prints, for ranks 0 and 7, the rows each holds, how far the rows moved, whether the restored state equals the
trained one, and whether one more step from each is equal too; exits 1 where something differs.

    .venv/bin/python -m ci.lora_empty_shards [--fused]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, VOCAB, ROWS = 8, 68, [64, 65, 66, 67]  # the 4 new tokens' rows, as the chat tokens are


def _build(lora):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip
    with torch.device("meta"):
        skeleton = get_peft_model(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16), lora)
    return config, skeleton


def _rank(rank: int, folder: str, fused: bool, port: int, failed) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    import ray.train
    from peft import LoraConfig, get_peft_model
    from pyarrow import fs as pafs
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from transformers import AutoModelForCausalLM

    from helpers.llama_recipe import load_sharded, save_sharded, shard_model

    trained_only = StateDictOptions(ignore_frozen_params=True, strict=False)  # the notebook's TRAINED
    lora = LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
        trainable_token_indices={"embed_tokens": ROWS, "lm_head": ROWS},
    )  # fmt: skip

    def sharded():
        config, skeleton = _build(lora)
        full = None
        if rank == 0:  # rank 0 reads the weights, the others build on meta (the notebook's load_model)
            torch.manual_seed(1)
            full = get_peft_model(
                AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16), lora
            ).state_dict()
        model = shard_model(skeleton, full, torch.device("cpu"), False, broadcast=True)
        trained = [p for p in model.parameters() if p.requires_grad]
        return model, torch.optim.AdamW(trained, lr=1e-2, foreach=False, fused=fused)

    def step(model, optimizer, rows):
        model(input_ids=rows, labels=rows).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    model, optimizer = sharded()
    deltas = {n.split(".")[-4]: p for n, p in model.named_parameters() if "trainable_tokens_delta" in n}
    held = sorted({p.to_local().shape[0] for p in deltas.values()})
    data = torch.randint(0, VOCAB, (2 * WORLD, 16), generator=torch.Generator().manual_seed(3))
    data[:, ::4] = torch.tensor(ROWS).repeat(2 * WORLD, 1)  # every sequence uses the new tokens
    mine = data[rank::WORLD]
    before = {n: p.full_tensor().clone() for n, p in deltas.items()}
    for _ in range(3):
        step(model, optimizer, mine)
    moved = {n: round((p.full_tensor() - before[n]).abs().sum().item(), 4) for n, p in deltas.items()}
    fs = pafs.LocalFileSystem()
    save_sharded(model, optimizer, {"step": 3}, rank, fs, folder, options=trained_only)
    restored, restored_optimizer = sharded()
    load_sharded(
        restored, restored_optimizer, ray.train.Checkpoint(folder, filesystem=fs), options=trained_only
    )

    def equal():
        pairs = zip(model.parameters(), restored.parameters(), strict=True)
        return all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in pairs if a.requires_grad)

    same = equal()
    step(model, optimizer, mine)
    step(restored, restored_optimizer, mine)
    same_after = equal()
    if rank in (0, WORLD - 1):
        print(
            f"rank {rank}: token rows held {held}, rows moved {moved}, restored equal: {same}, "
            f"the next step equal: {same_after}",
            flush=True,
        )
    if not (same and same_after and all(moved.values())):
        failed.value = 1
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fused", action="store_true", help="torch's fused AdamW (the notebook's on a GPU)")
    parser.add_argument("--port", type=int, default=29517, help="the process group's port on 127.0.0.1")
    args = parser.parse_args()
    failed = mp.get_context("spawn").Value("i", 0)
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_rank, args=(folder, args.fused, args.port, failed), nprocs=WORLD)
    print("OK" if not failed.value else "FAILED: a restored or stepped state differs, or a row did not move")
    return failed.value


if __name__ == "__main__":
    raise SystemExit(main())
