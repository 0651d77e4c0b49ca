"""Where a ZeRO step's peak tensor memory sits, by phase, on CPU: the GPT-2 notebook's own DeepSpeed engine.

    python ci/gpu/zero_memory.py STAGE        # 1, 2 or 3; GPT-2 124M (random weights), 512 tokens, bf16

`torch.profiler`'s memory events (`profile_memory=True`) record every tensor allocation and free, so their
running sum is the memory tensors hold; the peak is printed per phase (engine set-up, forward, backward,
optimizer step) of two steps. The optimizer is the notebook's torch AdamW, set to its GPU behaviour
(`foreach`: on CPU torch would pick the for-loop). On 2026-11-26 these peaks matched the H200's
`max_memory_allocated` (ci/gpu/results/gpt2_deepspeed.json) within 2.5 %, at the step, and gave the plan's
ZeRO terms (helpers/plan.py).
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "ci" / "gpu")]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


def main(stage: int) -> None:
    import torch
    from common import lesson_cells, lesson_namespace
    from torch.profiler import ProfilerActivity, profile, record_function
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tempfile.mkdtemp(prefix="zero-memory-")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config()).save_pretrained(folder)
    ns = lesson_namespace("gpt2_deepspeed", {})
    make_ds_config = lesson_cells(ns, "gpt2_deepspeed", ("make_ds_config",), skip=("ds_config",))[
        "make_ds_config"
    ]
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    ids = torch.randint(0, 50257, (1, 512))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("set-up"):
            engine = ns["setup_model_and_optimizer"](folder, 1e-6, make_ds_config(stage, "bf16", 1, "none"))
            for group in engine.optimizer.optimizer.param_groups:
                group["foreach"] = True  # what torch picks on a GPU
        for i in range(2):
            with record_function(f"forward {i}"):
                loss = engine(input_ids=ids, labels=ids).loss
            with record_function(f"backward {i}"):
                engine.backward(loss)
            with record_function(f"step {i}"):
                engine.step()
            del loss
    shutil.rmtree(folder, ignore_errors=True)
    events = prof.profiler.kineto_results.events()
    phases = sorted(
        (
            (e.start_ns(), e.end_ns(), e.name())
            for e in events
            if e.name().startswith(("set-up", "forward", "backward", "step"))
        ),
    )
    total, peak, end = 0, {}, {}
    for t, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        total += nbytes
        for start, stop, name in phases:
            if start <= t <= stop:
                peak[name] = max(peak.get(name, 0), total)
            if t <= stop:
                end[name] = total
    print(f"ZeRO-{stage}, GPT-2 124M, 512 tokens, bf16: tensor memory in GB")
    for _, _, name in phases:
        print(f"  {name:11} peak {peak.get(name, 0) / 1e9:6.3f}   at its end {end.get(name, 0) / 1e9:6.3f}")


if __name__ == "__main__":
    main(int(sys.argv[1]))
