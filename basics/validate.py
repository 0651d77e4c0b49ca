"""Parameter checks for the first cells of each notebook: fail at once, naming the parameter.

Every check raises `ParameterError` (a `ValueError`) with the parameter's name, the value
given and what is allowed, instead of letting a bad value surface minutes later as a
shape error inside a Ray worker. Used by `harness.checks.check_parameters` (the "Set up" cell of every notebook; and
`choose_attention` by section 6 of llama_fsdp).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "ParameterError",
    "check_int",
    "check_positive",
    "check_choice",
    "check_max_positions",
    "check_source_available",
    "choose_attention",
]


class ParameterError(ValueError):
    """A notebook parameter has a value the notebook cannot run with."""


def check_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """`value` must be an int (not a bool) within [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParameterError(f"{name}={value!r}: must be an integer.")
    if minimum is not None and value < minimum:
        raise ParameterError(f"{name}={value!r}: must be at least {minimum}.")
    if maximum is not None and value > maximum:
        raise ParameterError(f"{name}={value!r}: must be at most {maximum}.")
    return value


def check_positive(name: str, value: Any) -> float:
    """`value` must be a finite number greater than 0 (learning rates, epsilons)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ParameterError(f"{name}={value!r}: must be a finite number greater than 0.")
    return value


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    """`value` must be one of `choices`."""
    choices = list(choices)
    if value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ParameterError(f"{name}={value!r}: must be one of {allowed}.")
    return value


def hub_offline() -> bool:
    """True when the Hugging Face libraries are told to stay offline (`HF_HUB_OFFLINE=1` and friends)."""
    return any(os.environ.get(v, "0") not in ("", "0") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def check_source_available(name: str, value: str, kind: str) -> str:
    """A model or dataset (`kind` "model" / "dataset") must be a local folder, or reachable.

    Offline (`HF_HUB_OFFLINE=1`), a Hub id must already be in the local Hugging Face cache;
    otherwise it could never load, and the error would come from deep inside a worker.
    """
    if Path(value).expanduser().is_dir():
        return value
    if not hub_offline():
        return value  # online: the Hub answers for itself when the notebook loads it
    from huggingface_hub import constants

    cache = Path(constants.HF_HUB_CACHE) / f"{kind}s--{value.replace('/', '--')}"
    if cache.is_dir():
        return value
    raise ParameterError(
        f"{name}={value!r}: no such local folder, and the Hugging Face Hub is offline "
        f"(HF_HUB_OFFLINE=1) with no cached copy of this {kind}. Pass a local folder, "
        "go online, or run the small version with SMOKE_TEST=True."
    )


def _model_max_positions(model_name: str) -> int | None:
    """The longest sequence the model's position embeddings allow (None if it has no limit)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_name)
    for key in ("n_positions", "max_position_embeddings"):
        if getattr(config, key, None):
            return int(getattr(config, key))
    return None


def check_max_positions(name: str, value: int, model_name: str) -> int:
    """A sequence length must fit the model's position embeddings."""
    limit = _model_max_positions(model_name)
    if limit is not None and value > limit:
        raise ParameterError(
            f"{name}={value}: the model {model_name!r} has {limit} positions; use {name} <= {limit}."
        )
    return value


def choose_attention(use_flash_attn: bool, use_gpu: bool) -> str:
    """The `attn_implementation` to load the model with: `flash_attention_2` where it can run, else `sdpa`.

    FlashAttention 2 needs CUDA GPUs and the `flash-attn` package. Where either is missing, asking for
    it falls back to PyTorch's scaled-dot-product attention (`sdpa`, which picks a fused kernel of
    its own where it can) with a warning that names `USE_FLASH_ATTN` and the fallback, instead of
    an error from inside every worker.
    """
    import importlib.util
    import warnings

    if not use_flash_attn:
        return "sdpa"
    reason = None
    if not use_gpu:
        reason = "USE_GPU=False, and flash-attn runs only on CUDA GPUs"
    elif importlib.util.find_spec("flash_attn") is None:
        reason = "the flash-attn package is not installed (`pip install flash-attn --no-build-isolation`)"
    if reason:
        warnings.warn(
            f"USE_FLASH_ATTN=True, but {reason}: falling back to attn_implementation='sdpa' "
            "(PyTorch's scaled dot-product attention).",
            stacklevel=2,
        )
        return "sdpa"
    return "flash_attention_2"
