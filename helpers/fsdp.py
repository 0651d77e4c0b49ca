"""Lightning + FSDP on CPU workers: a `RayFSDPStrategy` that also runs where there is no GPU.

Used by the Dolly notebook. On GPU workers it *is* Ray's `RayFSDPStrategy`: every method below
defers to it unless the worker's device is the CPU. On CPU workers (smoke mode) it changes the
two things that break there, and nothing else, so FSDP really shards (each of 2 workers holds
half the parameters) instead of falling back to something simpler:

- Lightning passes `device_id=root_device.index` to FSDP, which is `None` on a CPU, and PyTorch
  then refuses: "FSDP needs a non-CPU accelerator device". PyTorch FSDP itself runs on CPU/gloo
  when given `device_id=torch.device("cpu")`.
- Lightning gathers the full state dict for a checkpoint with `offload_to_cpu=True`. With the
  parameters already on the CPU, FSDP frees the gathered tensors the state dict still points to,
  and saving the checkpoint crashed with a segmentation fault (seen here). Gathering without
  the offload and copying the tensors is correct on a CPU.
- The same goes for the optimizer state: gathered with `offload_to_cpu=True` on CPU workers, the
  AdamW moments saved in the checkpoint were not the ones in use. A run resumed from it repeated
  the first step after the checkpoint exactly (weights and data were right) and then drifted by up
  to 0.045 in loss over the next four steps (seen here, with a worker killed at step 45). Gathered
  without the offload and copied, the resumed steps repeat the interrupted run's losses.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LIGHTNING_PRECISIONS", "fsdp_strategy_class", "param_shard_fraction"]


def fsdp_strategy_class():
    """Return `CPUCapableRayFSDPStrategy`, a subclass of `ray.train.lightning.RayFSDPStrategy`.

    A function, so that importing `helpers` does not import Lightning.
    """
    import torch
    from ray.train.lightning import RayFSDPStrategy

    class CPUCapableRayFSDPStrategy(RayFSDPStrategy):
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

        def lightning_module_state_dict(self) -> dict[str, Any]:
            if self.root_device.type != "cpu" or self._state_dict_type != "full":
                return super().lightning_module_state_dict()
            from torch.distributed.fsdp import FullStateDictConfig, StateDictType
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            config = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
            with FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT, config):
                return {name: tensor.clone() for name, tensor in self.model.state_dict().items()}

        def optimizer_state(self, optimizer) -> dict[str, Any]:
            if self.root_device.type != "cpu" or self._state_dict_type != "full":
                return super().optimizer_state(optimizer)
            from lightning.pytorch.core.optimizer import LightningOptimizer
            from torch.distributed.fsdp import FullOptimStateDictConfig, OptimStateKeyType, StateDictType
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.utils._pytree import tree_map

            if isinstance(optimizer, LightningOptimizer):
                optimizer = optimizer._optimizer
            config = FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True)
            with FSDP.state_dict_type(
                self.model, StateDictType.FULL_STATE_DICT, optim_state_dict_config=config
            ):
                state = FSDP.optim_state_dict(self.model, optimizer)
                state = tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, state)
            if self.global_rank == 0:  # Lightning's standard format: keyed by parameter id
                state = FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model)
            return state

    return CPUCapableRayFSDPStrategy


def param_shard_fraction(wrapped_model, total_numel: int) -> float:
    """Parameter elements this rank holds locally after FSDP wrapped the model / all of the model's.

    About `1 / world_size` with FULL_SHARD; 1.0 means every rank holds a full copy (DDP). Works for
    FSDP1 (flat parameters hold the local shard) and FSDP2 (each parameter is a `DTensor`, whose
    `numel()` is the global size; its `to_local()` is what this rank holds).
    """
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in wrapped_model.parameters())
    return local / total_numel


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
