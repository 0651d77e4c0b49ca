"""Where a ZeRO step's peak tensor memory sits, by phase: the GPT-2 notebook's own DeepSpeed engine.

    python -m ci.gpu.zero_memory STAGE [--offload OFFLOAD] [--out DIR] [--zero KEY=INT ...]
    torchrun --nproc-per-node 2 ci/gpu/zero_memory.py 3    # two ranks (on CPU: gloo)

GPT-2 124M (random weights), 512 tokens, bf16. `--zero` sets `zero_optimization` keys over the notebook's
config (`stage3_prefetch_bucket_size=0`, ...). The forward pass keeps transformers' default `use_cache`
(the notebook turns it off): its KV cache was 19 MB of the 1.01 GB peak on the H100.

On CPU, `torch.profiler`'s memory events (`profile_memory=True`) record every tensor allocation and free, so
their running sum is the memory tensors hold; the peak is printed per phase (engine set-up, forward,
backward, optimizer step) of two steps. The optimizer is the notebook's torch AdamW, set to its GPU
behaviour (`foreach`: on CPU torch would pick the for-loop). On 2026-11-26 these peaks matched the H200's
`max_memory_allocated` (ci/gpu/results/gpt2_deepspeed.json) within 2.5 %, at the step, and gave the plan's
ZeRO terms (basics/plan.py).

On a CUDA GPU (NCCL, one rank) the phases' peaks are CUDA's own (`max_memory_allocated`, reset before each
phase) over three steps, which is how an offloaded run is seen: its optimizer step runs on the CPU, so the
CPU profile cannot show what stays on the GPU. With `--out` the allocator's history
(`torch.cuda.memory._record_memory_history`, Python stacks) is saved as DIR/zero<STAGE>_<offload>.pickle.gz
beside DIR/zero<STAGE>_<offload>.json (the phases, and the notebook's plan for the same parameters), and
the tensors alive at the peak are listed by where they were allocated.
"""

import argparse
import gzip
import os
import pickle
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for var, value in dict(
    MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
).items():
    os.environ.setdefault(var, value)  # one rank, unless torchrun started this


def main(stage: int, offload: str, out: str | None, zero: dict | None = None) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from ci.gpu.common import lesson_cells, lesson_namespace, slug

    cuda = torch.cuda.is_available()
    folder = tempfile.mkdtemp(prefix="zero-memory-")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config()).save_pretrained(folder)
    ns = lesson_namespace("gpt2_deepspeed", {})
    make_ds_config = lesson_cells(ns, "gpt2_deepspeed", ("make_ds_config",), skip=("ds_config",))[
        "make_ds_config"
    ]
    import deepspeed

    if cuda:
        torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    ids = torch.randint(0, 50257, (1, 512), device="cuda" if cuda else "cpu")
    ds_config = make_ds_config(stage, "bf16", 1, offload)
    ds_config["zero_optimization"].update(zero or {})  # e.g. stage3_prefetch_bucket_size=0
    name = f"zero{stage}_{slug(offload)}"
    print(f"ZeRO-{stage}, offload {offload}, GPT-2 124M, 512 tokens, bf16: tensor memory in GB", flush=True)
    setup = ns["setup_model_and_optimizer"]
    if cuda:
        on_gpu(setup, folder, ds_config, ids, out, name, stage, offload)
    else:
        on_cpu(setup, folder, ds_config, ids)
    shutil.rmtree(folder, ignore_errors=True)


def on_gpu(
    setup, folder: str, ds_config: dict, ids, out: str | None, name: str, stage: int, offload: str
) -> None:
    """Each phase's peak and remaining allocated memory, from CUDA's allocator; with `out`, its history at
    the peak by allocation site, and the plan beside it."""
    import torch

    import harness.sizing
    from basics.notebook_files import parameter_defaults
    from ci.gpu.common import environment, live_at_peak, write_result

    if out:
        torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    phases = {}

    def phase(label, fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        result = fn()
        torch.cuda.synchronize()
        phases[label] = {
            "peak_allocated": torch.cuda.max_memory_allocated(),
            "allocated_at_end": torch.cuda.memory_allocated(),
            "peak_reserved": torch.cuda.max_memory_reserved(),
        }
        print(f"  {label:11} peak {phases[label]['peak_allocated'] / 1e9:6.3f}   "
              f"at its end {phases[label]['allocated_at_end'] / 1e9:6.3f}", flush=True)  # fmt: skip
        return result

    engine = phase("set-up", lambda: setup(folder, 1e-6, ds_config))
    for i in range(3):
        loss = phase(f"forward {i}", lambda: engine(input_ids=ids, labels=ids).loss)
        phase(f"backward {i}", lambda loss=loss: engine.backward(loss))
        phase(f"step {i}", engine.step)
        del loss
    if not out:
        return
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    Path(out).mkdir(parents=True, exist_ok=True)
    with gzip.open(Path(out) / f"{name}.pickle.gz", "wb") as f:
        pickle.dump(snapshot, f)
    p = {**parameter_defaults("gpt2_deepspeed"), "NUM_WORKERS": 1, "USE_GPU": True}
    p.update(ZERO_STAGE=stage, OFFLOAD=offload, CLUSTER={"p5.48xlarge": 1}, BATCH_SIZE_PER_WORKER=1)
    p.update(MODEL_NAME=folder, MAX_SEQ_LEN=512, PRECISION="bf16")
    plan = harness.sizing.plan_for("gpt2_deepspeed", p).as_dict()
    result = dict(environment=environment(), ds_config=ds_config, phases=phases, plan=plan)
    result.update(live_at_peak(snapshot), method=__doc__)
    write_result(Path(out) / f"{name}.json", result)
    for row in result["at_peak_by_site"]:
        print(f"  {row['bytes'] / 1e6:8.1f} MB in {row['blocks']:4} blocks: {row['site']}")


def on_cpu(setup, folder: str, ds_config: dict, ids) -> None:
    """Each phase's peak and remaining tensor memory, from torch's profiler (no CUDA allocator here)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("set-up"):
            engine = setup(folder, 1e-6, ds_config)
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
    for _, _, name in phases:
        print(f"  {name:11} peak {peak.get(name, 0) / 1e9:6.3f}   at its end {end.get(name, 0) / 1e9:6.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("stage", type=int, choices=(1, 2, 3))
    parser.add_argument("--offload", default="none", choices=("none", "optimizer", "optimizer+params"))
    parser.add_argument("--out", help="on a GPU: where the allocator's history and the phases go")
    parser.add_argument(
        "--zero", nargs="*", default=[], help="KEY=INT: zero_optimization settings over the notebook's"
    )
    args = parser.parse_args()
    main(args.stage, args.offload, args.out, {k: int(v) for k, v in (kv.split("=") for kv in args.zero)})
