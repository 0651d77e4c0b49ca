"""Model FLOPs utilization (MFU): how much of the hardware's dense peak a training run turned into model math.

MFU = 6 * parameters * tokens per second / (devices * dense peak FLOP/s per device). The 6 counts a
multiply and an add for each parameter and token in the forward pass (2) and twice that in the
backward pass (4); recomputation from activation checkpointing is not model math, so it does not
count (that would be hardware FLOPs utilization). The llama_fsdp notebook writes this formula out in its
"Challenge 3, speed" cell, with the peak its workers measured (`dense_peak_flops`, through the observer);
`model_flops_utilization` is the same formula for ci/gpu and the tests.

Peaks come from Lightning's table (`lightning.fabric.utilities.throughput.get_available_flops`),
except where that table gives NVIDIA's *with-sparsity* figure, which is twice the dense peak
(2:4 structured sparsity, which training does not use): those are overridden below. On a device
with no known peak (a CPU) there is no MFU, and the functions return None rather than a guess.
"""

from __future__ import annotations

__all__ = ["dense_peak_flops", "model_flops_utilization"]

# Dense bf16/fp16 tensor-core peaks, per GPU, from NVIDIA's datasheets (their tables print twice these
# numbers, "with sparsity"). Lightning 2.6 lists the with-sparsity figure for these chips.
_DENSE_BF16_OVERRIDES = {
    "h100 nvl": 835.5e12,  # datasheet: 1,671 TFLOPS with sparsity (Lightning: 1978.8e12)
    "h200 sxm": 989.5e12,  # datasheet: 1,979 TFLOPS with sparsity (Lightning "h200 sxm1": 2.0e15)
    "h200 nvl": 835.5e12,  # datasheet: 1,671 TFLOPS with sparsity (Lightning "h200 nvl1": 1.7e15)
    # Lightning reads any "l4..." name but a Tesla one as an L4 (121e12): an L40S is 3x that, an L40 1.5x.
    "l40s": 362.05e12,  # datasheet: 733 TFLOPS with sparsity
    "l40": 181.05e12,  # datasheet: 362.1 TFLOPS with sparsity
}


def _chip(device_name: str) -> str | None:
    name = device_name.lower()
    if "h200" in name:
        return "h200 nvl" if "nvl" in name else "h200 sxm"
    if "h100" in name and "nvl" in name:
        return "h100 nvl"
    if "l40" in name:
        return "l40s" if "l40s" in name else "l40"
    return None


def dense_peak_flops(device, dtype) -> float | None:
    """Dense peak FLOP/s of one `device` (a `torch.device`) computing in `dtype`; None if unknown (CPUs)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    chip = _chip(torch.cuda.get_device_name(device))
    if chip in _DENSE_BF16_OVERRIDES and dtype in (torch.bfloat16, torch.float16):
        return _DENSE_BF16_OVERRIDES[chip]
    from lightning.fabric.utilities.throughput import get_available_flops

    peak = get_available_flops(device, dtype)
    return float(peak) if peak else None


def model_flops_utilization(
    num_params: float, tokens: float, seconds: float, num_devices: int, peak_flops_per_device: float | None
) -> float | None:
    """MFU of a run that trained `tokens` tokens of a `num_params` model in `seconds` on `num_devices`."""
    if not peak_flops_per_device:
        return None
    return 6 * num_params * tokens / (seconds * num_devices * peak_flops_per_device)
