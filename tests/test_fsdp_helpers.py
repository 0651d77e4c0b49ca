"""`helpers.fsdp`: the parts not exercised by the Dolly notebook's own smoke run.

The strategy itself (FULL_SHARD on 2 Ray CPU workers: half the parameters each, the loss falls, the
checkpoint holds full tensors) is tested through the notebook in `test_dolly_lightning_fsdp.py`.
"""

from __future__ import annotations


def test_precision_list_matches_lightning():
    import typing

    from lightning.fabric.connector import _PRECISION_INPUT_STR

    from helpers.fsdp import LIGHTNING_PRECISIONS

    assert set(LIGHTNING_PRECISIONS) == set(typing.get_args(_PRECISION_INPUT_STR))


def test_param_shard_fraction_counts_local_elements():
    import torch

    from helpers.fsdp import param_shard_fraction

    half = torch.nn.Linear(4, 4, bias=False)  # 16 elements held, of a 32-element model
    assert param_shard_fraction(half, 32) == 0.5
