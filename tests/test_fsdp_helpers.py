"""`helpers.fsdp`: the parts not exercised by the Dolly notebook's own smoke run.

The strategy itself (FULL_SHARD on 2 Ray CPU workers: half the parameters each, the loss falls, the
checkpoint holds full tensors) is tested through the notebook in `test_dolly_lightning_fsdp.py`.
"""

from __future__ import annotations


def test_precision_list_matches_lightning():
    import typing

    from lightning.fabric.connector import _PRECISION_INPUT_STR

    from basics.sharding import LIGHTNING_PRECISIONS

    assert set(LIGHTNING_PRECISIONS) == set(typing.get_args(_PRECISION_INPUT_STR))


def test_param_shard_fraction_counts_local_elements():
    import torch

    from basics.sharding import param_shard_fraction

    half = torch.nn.Linear(4, 4, bias=False)  # 16 elements held, of a 32-element model
    assert param_shard_fraction(half, 32) == 0.5


def test_gradient_bytes_sees_what_skipping_the_reduce_scatter_keeps():
    """With gradient sync off FSDP2 keeps every layer's whole fp32 gradient: why the Llama notebook's
    gradient accumulation reduce-scatters on every micro-step, and what its smoke run measures."""
    import multiprocessing as mp
    import socket

    from fsdp_rank import gradient_bytes_rank

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=gradient_bytes_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    measured = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for _rank, no_sync, synced, fp32_params in measured:
        assert no_sync == fp32_params  # every layer's whole gradient, in fp32
        assert synced == fp32_params // 2  # this rank's shard of it
