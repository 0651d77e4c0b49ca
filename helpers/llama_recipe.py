"""The Llama recipe's steps that `llama_lora` shares with `llama_fsdp`: generated from `llama_fsdp`'s cells
marked `# @save` by ci/llama_recipe.py. Do not edit here: edit the notebook, then run that script
(tests/test_llama_helpers.py fails when the two differ). Each function's explanation is in the section of
`llama_fsdp` named above it.
"""

from __future__ import annotations

import ray.train
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import helpers

__all__ = [
    "pack",
    "shard_model",
    "save_sharded",
    "load_sharded",
    "my_micro_batches",
    "train_step",
    "evaluate",
    "save_checkpoint",
]


# llama_fsdp, 2. Packing
def pack(token_lists: list[list[int]], seq_len: int, eos_id: int) -> torch.Tensor:
    stream = [token for tokens in token_lists for token in [*tokens, eos_id]]
    num_sequences = len(stream) // seq_len
    return torch.tensor(stream[: num_sequences * seq_len], dtype=torch.int32).view(num_sequences, seq_len)


# llama_fsdp, 4. Sharding with FSDP2
def shard_model(skeleton, full_state_dict, device, gradient_checkpointing: bool, broadcast: bool):
    if gradient_checkpointing:
        skeleton.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    decoder = skeleton.get_decoder()  # the layers, under the LM head
    for unit in [*decoder.layers, skeleton.get_input_embeddings(), skeleton.get_output_embeddings()]:
        fully_shard(unit, mp_policy=mp_policy)  # one all-gather each, just before it runs
    fully_shard(skeleton, mp_policy=mp_policy)  # the rest: the final norm
    skeleton.to_empty(device=device)
    if broadcast:  # False after a restart: the checkpoint fills every shard instead
        set_model_state_dict(
            skeleton,
            full_state_dict or {},
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
    rotary = decoder.rotary_emb
    decoder.rotary_emb = type(rotary)(config=skeleton.config).to(device)
    return skeleton


# llama_fsdp, 5. Sharded checkpoints
def save_sharded(model, optimizer, trainer_state: dict, rank: int, fs, folder: str, options=None) -> None:
    """Every rank writes its shards straight to `folder` on the run's storage (`fs`, pyarrow). `options`
    (`StateDictOptions`): which state, e.g. only what trains (`llama_lora`); None: all of it."""
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    writer = helpers.storage.dcp_writer(fs, f"{folder}/sharded")
    dcp.save({"model": model_state, "optim": optim_state}, storage_writer=writer)
    if rank == 0:  # after dcp.save: every rank's shard and the .metadata index are written
        helpers.storage.write_json(fs, f"{folder}/trainer_state.json", trainer_state)


# llama_fsdp, 5. Sharded checkpoints
def load_sharded(model, optimizer, checkpoint: ray.train.Checkpoint, options=None) -> dict:
    """Read this rank's shards back from storage, in place; return the trainer state."""
    fs, folder = checkpoint.filesystem, checkpoint.path
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optim": optim_state}
    reader = helpers.storage.dcp_reader(fs, f"{folder}/sharded")  # one ranged read per tensor shard
    dcp.load(state, storage_reader=reader)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options
    )
    return helpers.storage.read_json(fs, f"{folder}/trainer_state.json")


# llama_fsdp, 6. The training function
def my_micro_batches(step: int, config: dict, num_rows: int) -> list[tuple[torch.Tensor, float]]:
    """This rank's rows of `packed` for step `step` (from 0), one tensor per micro-step, with its loss weight."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_step = config["global_batch"] // world  # BATCH_SIZE_PER_WORKER x GRADIENT_ACCUMULATION_STEPS
    epoch, index = divmod(step, num_rows // config["global_batch"])
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(config["seed"] + epoch))
    mine = order[rank::world][index * per_step : (index + 1) * per_step]  # every world-th row is this rank's
    micro_steps = mine.split(config["batch_size_per_worker"])
    return [(rows, 1 / len(micro_steps)) for rows in micro_steps]


# llama_fsdp, 6. The training function
def train_step(model, optimizer, scheduler, packed, micro_batches: list, device) -> torch.Tensor:
    """One optimizer step over this rank's `micro_batches` ((rows of `packed`, loss weight) each)."""
    step_loss = torch.zeros((), device=device)
    for rows, weight in micro_batches:
        input_ids = packed[rows].long().to(device)
        loss = model(input_ids=input_ids, labels=input_ids).loss * weight
        loss.backward()  # reduce-scatters: this rank adds its shard of the gradients to its shard
        step_loss += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return step_loss


# llama_fsdp, 6. The training function
def evaluate(model, eval_packed, device, batch_size: int) -> float:
    """The mean loss over the held-out sequences; each rank scores an equal share (FSDP gathers each layer
    in every rank's forward pass, so all run as many)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    scored = len(eval_packed) // world * world
    total = torch.zeros((), device=device)
    model.eval()
    with torch.no_grad():
        for rows in eval_packed[rank:scored:world].split(batch_size):
            input_ids = rows.long().to(device)
            total += model(input_ids=input_ids, labels=input_ids).loss * len(rows)
    model.train()
    dist.all_reduce(total)
    return total.item() / scored


# llama_fsdp, 6. The training function
def save_checkpoint(model, optimizer, scheduler, state: dict, options=None) -> None:
    """Write this rank's shards to storage and report the step."""
    rank, step = dist.get_rank(), state["step"]
    state["scheduler"] = scheduler.state_dict()
    storage = ray.train.get_context().get_storage()  # the run's folder on STORAGE_PATH
    fs, folder = storage.storage_filesystem, storage.build_checkpoint_path_from_name(f"checkpoint_{step:06d}")
    save_sharded(model, optimizer, state, rank, fs, folder, options)
    # Already in storage: rank 0 registers it, nothing is uploaded. report() waits for every rank.
    ray.train.report(
        {"step": step},
        checkpoint=ray.train.Checkpoint(folder, filesystem=fs) if rank == 0 else None,
        checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD,
    )
