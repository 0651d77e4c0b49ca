"""The Llama notebook's helpers: MFU the way the post computes it, dense peaks, the RAM tracker, attention."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch

import basics.flops
import helpers


def test_mfu_reproduces_the_posts_arithmetic():
    # The post: 70e9 parameters, 500 steps of 16 GPUs x 2048 tokens, 13.5 h, A100s at 312 TFLOP/s dense bf16.
    tokens = 2048 * 16 * 500
    seconds = 13.5 * 3600
    per_gpu = basics.flops.model_flops_utilization(70e9, tokens, seconds, 16, 312e12)
    assert per_gpu == pytest.approx(6 * 70e9 * tokens / seconds / (16 * 312e12))
    assert per_gpu == pytest.approx(0.02836, abs=1e-4)
    assert basics.flops.model_flops_utilization(70e9, tokens, seconds, 16, None) is None


@pytest.mark.parametrize(
    ("device_name", "expected"),
    [
        ("NVIDIA A100-SXM4-80GB", 312e12),  # Lightning's table
        ("NVIDIA H100 80GB HBM3", 989.4e12),  # Lightning's table: H100 SXM, dense
        ("NVIDIA H100 NVL", 835.5e12),  # Lightning lists 1978.8e12, the with-sparsity figure
        ("NVIDIA H200", 989.5e12),  # Lightning maps only "h200 sxm1"/"h200 nvl1", both with sparsity
    ],
)
def test_dense_peak_flops_never_with_sparsity(monkeypatch, device_name, expected):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name)
    assert basics.flops.dense_peak_flops(torch.device("cuda", 0), torch.bfloat16) == pytest.approx(
        expected, rel=1e-3
    )


def test_no_peak_and_no_mfu_on_cpu():
    assert basics.flops.dense_peak_flops(torch.device("cpu"), torch.bfloat16) is None


# Run in a fresh interpreter: the test process carries over a gigabyte of earlier tests' state (mapped
# model files, allocator caches, threads), and its RSS can fall by 100+ MB while the block runs (CI saw
# peak growth 78 MB, end growth -122 MB for a 200 MB block). The tracker measures the whole process.
_PEAK_RSS_SCRIPT = """
import json, mmap, time
import torch
import helpers

# Fresh pages from the kernel: a malloc'd block (torch.ones) can reuse heap pages freed earlier but kept
# resident by glibc, and then RSS does not move at all (CI once saw 0.0 MB growth that way).
size = 200 * 2**20
with helpers.PeakRSS() as mem:
    block = mmap.mmap(-1, size)
    view = torch.frombuffer(block, dtype=torch.uint8)
    view.fill_(1)  # touched: now resident
    time.sleep(0.1)  # held for a moment (the sampler is a Python thread: it needs the GIL to look)
    del view
    block.close()  # unmapped: gone from RSS
print(json.dumps(mem.as_dict()))
"""


def test_peak_rss_sees_a_peak_that_is_gone_at_the_end():
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS_SCRIPT], capture_output=True, text=True, timeout=120, check=True
    )
    mem = json.loads(proc.stdout.splitlines()[-1])
    assert mem["peak_growth_mb"] > 150, mem
    assert mem["end_growth_mb"] < 50, mem
    assert set(mem) == {"before_mb", "end_growth_mb", "peak_growth_mb"}


def test_flash_attention_falls_back_with_a_warning_naming_the_parameter():
    with pytest.warns(UserWarning, match=r"USE_FLASH_ATTN=True.*USE_GPU=False.*'sdpa'"):
        assert helpers.choose_attention(True, use_gpu=False) == "sdpa"
    with pytest.warns(UserWarning, match=r"USE_FLASH_ATTN=True.*flash-attn package is not installed"):
        assert helpers.choose_attention(True, use_gpu=True) == "sdpa"  # no flash-attn on this machine
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert helpers.choose_attention(False, use_gpu=True) == "sdpa"


def test_llama_recipe_is_generated_from_the_llama_fsdp_notebook():
    """helpers/llama_recipe.py, which llama_lora imports, holds llama_fsdp's functions marked `# @save`,
    verbatim (ci/llama_recipe.py writes it); and llama_lora defines none of them again."""
    import ast

    import nbformat

    from ci import llama_recipe

    assert llama_recipe.MODULE.read_text() == llama_recipe.render(), (
        "run: .venv/bin/python ci/llama_recipe.py"
    )
    shared = {name for name, _, _ in llama_recipe.marked_functions()}
    assert {"pack", "shard_model", "my_micro_batches", "train_step", "save_checkpoint"} <= shared
    lora = nbformat.read(llama_recipe.ROOT / "notebooks" / "llama_lora.ipynb", as_version=4)
    defined = {
        node.name
        for cell in lora.cells
        if cell.cell_type == "code"
        for node in ast.walk(ast.parse(cell.source))
        if isinstance(node, ast.FunctionDef)
    }
    assert not defined & shared, (
        f"llama_lora repeats {sorted(defined & shared)}: import them from helpers.llama_recipe"
    )


def test_compiling_the_layers_is_a_lesson_knob_the_parameters_check():
    """`USE_COMPILE`: on at full scale (measured faster on a GPU, docs/gpu.md), a bool or refused by name."""
    from basics.validate import ParameterError
    from ci.plan import parameters
    from harness.notebooks import notebook, parameters_of

    p = parameters_of("llama_fsdp", parameters("llama_fsdp", []))
    assert p.USE_COMPILE is True
    notebook("llama_fsdp").check(p)
    with pytest.raises(ParameterError, match="USE_COMPILE"):
        notebook("llama_fsdp").check(p.replace(USE_COMPILE="yes"))
