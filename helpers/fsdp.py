"""Lightning + FSDP on Ray: `RayFSDPStrategy` with sharded checkpoints that work across nodes, on GPUs and CPUs.

Used by the Dolly notebook (section 3). `fsdp_strategy_class(RayFSDPStrategy)` returns a subclass of Ray's
`RayFSDPStrategy` that changes three things and nothing else, so FSDP really shards (each of 2
workers holds half the parameters) on CPU workers as on GPUs:

- **Sharded checkpoints, each rank in its own folder.** With `state_dict_type="sharded"` every rank
  writes only its shard of the weights and the optimizer state (torch's distributed checkpoint).
  With Lightning's default, "full", rank 0 gathers the whole model and the whole optimizer state into
  its host memory at every checkpoint: about 82 GB for dolly-v2-7b in fp32, more than a 64 GiB
  g4dn.4xlarge has. But Lightning's `save_checkpoint` and `load_checkpoint` broadcast rank 0's path
  and every rank writes there: Ray's `RayTrainReportCallback` gives each rank its own temporary
  folder, so a rank on another node would write its shard into a folder nobody uploads, and the
  checkpoint in storage would lack that shard. Here each rank keeps its own path; Ray Train uploads
  every rank's folder into the same checkpoint directory, which then holds all the shards.
- **Resuming reads each rank's shards where they are stored.** Given a `harness.storage.checkpoint_in_place`
  as `ckpt_path`, `load_checkpoint` loads as Lightning's does (the model's sharded state dict, then
  each optimizer's) but through `harness.storage.dcp_reader`, which fetches only the byte ranges this
  rank's shards need, straight from the bucket. Lightning's own load needs a local folder, so each
  rank would first download the whole checkpoint: for dolly-v2-7b, 82 GB of weights and AdamW state
  per rank, 1.3 TB from the bucket for 16 ranks, to use 5 GB each.
- **CPU workers**: Lightning passes `device_id=root_device.index` to FSDP, which is `None` on a CPU,
  and PyTorch then refuses: "FSDP needs a non-CPU accelerator device". PyTorch FSDP itself runs on
  CPU/gloo when given `device_id=torch.device("cpu")`.
- (History: with "full" checkpoints on CPU workers, Lightning's `offload_to_cpu=True` gather saved
  AdamW moments that were not the ones in use, and a resumed run drifted by up to 0.045 in loss.
  Sharded checkpoints gather nothing; the smoke run's resumed steps repeat the losses exactly.)
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

__all__ = ["fsdp_strategy_class"]


def fsdp_strategy_class(base):
    """Return `ShardedRayFSDPStrategy`, a subclass of `base` (`ray.train.lightning.RayFSDPStrategy`, which
    the Dolly notebook passes) in which each rank saves and loads its own shard of a sharded checkpoint in its
    own folder, and which also runs on CPU workers (FSDP with `device_id=cpu`).

    A function, so that importing `helpers` does not import Lightning. Pass the usual
    `FSDPStrategy` arguments; `state_dict_type` defaults to "sharded".
    """
    import torch

    from harness.storage import StoredFolder

    class ShardedRayFSDPStrategy(base):
        def __init__(self, *args, state_dict_type: str = "sharded", **kwargs):
            super().__init__(*args, state_dict_type=state_dict_type, **kwargs)
            self._own_paths = False

        def broadcast(self, obj, src: int = 0):
            # Inside save/load_checkpoint: every rank keeps its own checkpoint path (see the module doc).
            return obj if self._own_paths else super().broadcast(obj, src)

        @contextlib.contextmanager
        def _each_rank_its_own_path(self):
            self._own_paths = self._state_dict_type == "sharded"
            try:
                yield
            finally:
                self._own_paths = False

        def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options=None) -> None:
            with self._each_rank_its_own_path():
                super().save_checkpoint(checkpoint, filepath, storage_options)

        def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict[str, Any]:
            if isinstance(checkpoint_path, StoredFolder) and self._state_dict_type == "sharded":
                return self._load_where_stored(checkpoint_path, weights_only)
            with self._each_rank_its_own_path():
                return super().load_checkpoint(checkpoint_path, weights_only)

        def _load_where_stored(self, folder: StoredFolder, weights_only) -> dict[str, Any]:
            return _load_sharded_in_place(self, folder, weights_only)

        def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
            if self.root_device.type != "cpu":
                return super()._setup_model(model)
            from lightning.pytorch.strategies.fsdp import _setup_activation_checkpointing
            from torch.distributed.fsdp import FullyShardedDataParallel

            model = FullyShardedDataParallel(
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=torch.device("cpu"),
                **self.kwargs,
            )
            _setup_activation_checkpointing(model, self._activation_checkpointing_kwargs)
            return model

    return ShardedRayFSDPStrategy


def _load_sharded_in_place(self, folder, weights_only) -> dict[str, Any]:
    """`ShardedRayFSDPStrategy.load_checkpoint` of a `StoredFolder`: each rank reads its byte ranges where
    the checkpoint is stored."""
    import torch

    # Lightning's sharded branch of `FSDPStrategy.load_checkpoint`, with `dcp_reader` for its
    # local FileSystemReader.
    from lightning.fabric.strategies.fsdp import _get_sharded_state_dict_context
    from lightning.pytorch.trainer.states import TrainerFn
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from harness.storage import dcp_reader

    reader = dcp_reader(folder.filesystem, folder.path)
    with _get_sharded_state_dict_context(self.model):
        module_state = {"model": self.model.state_dict()}
        load(module_state, storage_reader=reader)
        self.model.load_state_dict(module_state["model"], strict=self.lightning_module.strict_loading)
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            for idx, optimizer in enumerate(self.optimizers):
                key = f"optimizer_{idx}"
                state = load_sharded_optimizer_state_dict(
                    model_state_dict=module_state["model"], optimizer_key=key, storage_reader=reader
                )
                flat = FSDP.optim_state_dict_to_load(
                    optim_state_dict=state[key], model=self.model, optim=optimizer
                )
                optimizer.load_state_dict(flat)
    # The rest of the trainer's state (loops, callbacks, hyperparameters): Lightning's `meta.pt`.
    with folder.filesystem.open_input_file(f"{folder.path}/meta.pt") as f:
        meta = f.read()
    folder.bytes_read = reader.bytes_read + len(meta)
    return torch.load(io.BytesIO(meta), weights_only=weights_only)
