"""Why a Llama step is below the 45 % MFU bar, and what closes the gap: one profiled step, then variants.

One GPU, one process (a process group of one under NCCL), the notebook's own `load_and_shard`,
`make_optimizer` and `train_step` on llama.py's 3.4B Llama 2 architecture model, `MAX_SEQ_LEN=2048`, 16
sequences per step. The model and its optimizer are loaded once; the variants change only how the layers
run, between steps:

- activation checkpointing on every layer, on every second layer (transformers' `every_n_layers`), or off;
- eager, or each decoder layer compiled (`nn.Module.compile`, after FSDP2 has sharded it);
- 2 or 4 sequences per micro-step (8 or 4 micro-steps per step).

Each variant's first step is a warm-up (it compiles, where the variant does); the mean of the next ones is
its step time. One step of the notebook's variant and one of the fastest are profiled (`torch.profiler`):
GPU time by kind of kernel, the optimizer's share (CUDA events around `optimizer.step`), and how much of the
step the GPU had no kernel running.

    python -m ci.gpu.llama_step --out DIR              # on a CUDA GPU: DIR/llama_step.json, DIR/llama_step_*.txt
    python -m ci.gpu.llama_step --variants further ... # toward the bar: DIR/llama_step_further.json
    python -m ci.gpu.llama_step --variants fused ...   # the optimizer fused: DIR/llama_step_fused.json
    python -m ci.gpu.llama_step --variants bar ...     # the fastest, fused, from a fresh process: DIR/llama_step_bar.json
    python -m ci.gpu.llama_step --smoke --out DIR      # on CPU: a tiny model, the same code paths
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import NamedTuple

import basics.flops
from ci.gpu.common import environment, lesson_namespace, outside_ray_train, write_result
from ci.gpu.llama import FULL, SMOKE, build_model


class Variant(NamedTuple):
    label: str
    every_n: int  # activation checkpointing on every n-th layer (0: none)
    compiled: bool  # each decoder layer compiled
    micro: int  # sequences per micro-step
    fused: bool = False  # AdamW as one fused kernel instead of the notebook's for-loop


VARIANTS = [
    Variant("notebook: checkpointing every layer, eager, 2 per micro-step", 1, False, 2),
    Variant("checkpointing every layer, compiled", 1, True, 2),
    Variant("checkpointing every 2nd layer, compiled", 2, True, 2),
    Variant("no checkpointing, compiled", 0, True, 2),
    Variant("no checkpointing, eager", 0, False, 2),
    Variant("checkpointing every 2nd layer, compiled, 4 per micro-step", 2, True, 4),
]
FURTHER = [  # `--variants further`: toward the bar, the notebook's variant again as the baseline
    VARIANTS[0],
    Variant("checkpointing every layer, compiled, 8 per micro-step (2 micro-steps)", 1, True, 8),
    Variant("checkpointing every 4th layer, compiled, 4 per micro-step", 4, True, 4),
    Variant("no checkpointing, compiled, 4 per micro-step", 0, True, 4),
    Variant("checkpointing every 2nd layer, compiled, 8 per micro-step (2 micro-steps)", 2, True, 8),
]
FUSED = [  # `--variants fused`: the optimizer as one fused kernel (AdamW(fused=True)) instead of a for-loop
    FURTHER[3],
    *(v._replace(label=v.label + ", fused AdamW", fused=True) for v in (FURTHER[3], VARIANTS[0])),
]
BAR = [  # `--variants bar`: the notebook's, then the fastest with AdamW fused from its first step (run it with
    # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: without, it ran out of memory in a fresh process with
    # 5.6 GiB reserved but unused), then a variant that leaves more memory free
    VARIANTS[0],
    FUSED[1],
    FURTHER[2]._replace(label=FURTHER[2].label + ", fused AdamW", fused=True),
]
SETS = {"study": VARIANTS, "further": FURTHER, "fused": FUSED, "bar": BAR}
KINDS = [  # kernel name -> kind, first match wins
    ("attention", r"flash|fmha|attention|sdpa|cudnn"),
    ("matrix products", r"gemm|cutlass|xmma|nvjet|cublas|matmul|sm90_|sm80_|wgmma"),
    ("collectives (NCCL)", r"nccl"),
    ("copies", r"memcpy|memset|copy|chunk_cat|split_with_sizes|cat_"),
    ("fused by compile (triton)", r"^triton_"),
]


def kernel_kind(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other elementwise and reductions"


def profile_summary(prof, wall_seconds: float) -> dict:
    """GPU time by kind of kernel, and the share of the step with no kernel running."""
    from torch.autograd import DeviceType

    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    by_kind: dict[str, float] = {}
    spans = []
    for e in kernels:
        by_kind[kernel_kind(e.name)] = by_kind.get(kernel_kind(e.name), 0.0) + e.time_range.elapsed_us() / 1e6
        spans.append((e.time_range.start, e.time_range.end))
    busy, end = 0.0, None
    for start, stop in sorted(spans):  # the union of the kernels' intervals
        if end is None or start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    busy /= 1e6
    total = sum(by_kind.values())
    return {
        "step_seconds": wall_seconds,
        "gpu_busy_seconds": busy,
        "gpu_idle_share": 1 - busy / wall_seconds if kernels else None,
        "kernel_seconds_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "kernel_share_by_kind": {k: v / total for k, v in by_kind.items()} if total else {},
        "kernels": len(kernels),
    }


class StepStudy:
    """The notebook's model, optimizer and step on one device, re-set per variant (checkpointing, compiling,
    micro-batch, fused AdamW) and timed; each variant's figures in `results`."""

    def __init__(self, args, work: Path) -> None:
        import torch

        self.args, self.out, self.cuda = args, Path(args.out), torch.cuda.is_available()
        self.stem = "llama_step" if args.variants == "study" else f"llama_step_{args.variants}"
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        if self.cuda:
            torch.cuda.set_device(self.device)
        torch.distributed.init_process_group(
            "nccl" if self.cuda else "gloo", init_method=f"file://{work}/rendezvous", rank=0, world_size=1
        )
        outside_ray_train()  # one process, no Ray: the notebook's barrier is the process group's
        torch._dynamo.config.cache_size_limit = 64  # the layers share one compiled graph; room for recompiles
        build_model(work / "model", SMOKE if args.smoke else FULL, "cuda" if self.cuda else "cpu")
        self.config = {
            "model_name": str(work / "model"),
            "vocab_size": 32000,
            "use_flash_attn": True,
            "use_gradient_checkpointing": True,
            "use_compile": False,  # each variant compiles the layers itself (run_layers_as)
            "seq_len": 64 if args.smoke else 2048,
            "batch_size_per_worker": 2,
            "global_batch": 4 if args.smoke else 16,
            "learning_rate": 5e-5,
            "weight_decay": 0.01,
            "warmup_ratio": 0.03,
            "max_steps": 1000,
            "seed": 42,
        }
        self.lesson = lesson_namespace("llama_fsdp", {})
        self.model, loading = self.lesson["load_and_shard"](self.config, 0, self.device, pretrained=True)
        self.optimizer, self.scheduler = self.lesson["make_optimizer"](self.model, self.config)
        self.num_params = sum(p.numel() for p in self.model.parameters())
        self.peak_flops = basics.flops.dense_peak_flops(self.device, torch.bfloat16)
        self.tokens_per_step = self.config["global_batch"] * self.config["seq_len"]
        rows = (self.config["global_batch"] * 64, self.config["seq_len"])
        self.packed = torch.randint(0, 32000, rows, generator=torch.Generator().manual_seed(0)).to(
            torch.int32
        )
        self.layers, self.step, self.optimizer_seconds = list(self.model.get_decoder().layers), 0, []
        self._time_the_optimizer()
        self.results = {
            "environment": environment(),
            "model": SMOKE if args.smoke else FULL,
            "num_params": self.num_params,
            "attn_implementation": loading["attn"],
            "seq_len": self.config["seq_len"],
            "global_batch": self.config["global_batch"],
            "peak_flops_per_gpu": self.peak_flops,
            "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            "method": __doc__,
            "variants": [],
        }

    def _time_the_optimizer(self) -> None:
        """CUDA events around the optimizer's step: no synchronisation added."""
        import torch

        step_of_optimizer = self.optimizer.step

        def timed_optimizer_step(*a, **k):
            if not self.cuda:
                return step_of_optimizer(*a, **k)
            begin, finish = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            result = step_of_optimizer(*a, **k)
            finish.record()
            self.optimizer_seconds.append((begin, finish))
            return result

        self.optimizer.step = timed_optimizer_step

    def run_layers_as(self, every_n: int, compiled: bool, micro: int) -> None:
        """Checkpoint every n-th layer (0: none), compile each layer or not, `micro` sequences per micro-step."""
        if every_n:
            self.model.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=every_n)
        else:
            self.model.activation_checkpointing_disable()
        for layer in self.layers:
            if compiled:
                layer.compile()
            else:
                layer._compiled_call_impl = None  # what nn.Module.compile set
        self.config["batch_size_per_worker"] = micro

    def one_step(self) -> float:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        batches = self.lesson["my_micro_batches"](self.step, self.config, len(self.packed))
        self.lesson["train_step"](
            self.model, self.optimizer, self.scheduler, self.packed, batches, self.device
        ).item()
        self.step += 1
        return time.perf_counter() - t0

    def profiled_step(self, name: str) -> dict:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        del self.optimizer_seconds[:]
        with profile(activities=activities) as prof:
            wall = self.one_step()
        summary = profile_summary(prof, wall)
        if self.cuda and self.optimizer_seconds:
            begin, finish = self.optimizer_seconds[0]
            summary["optimizer_seconds"] = begin.elapsed_time(finish) / 1e3
        sort = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        (self.out / f"{self.stem}_{name}.txt").write_text(
            prof.key_averages().table(sort_by=sort, row_limit=40)
        )
        return summary

    def measure(self, variant: Variant, steps: int) -> dict:
        """One variant: its first step (which compiles, where compiled), then `steps` steps timed."""
        import torch

        entry = self.described(variant)
        torch._dynamo.reset()
        self.run_layers_as(variant.every_n, variant.compiled, variant.micro)
        if variant.fused and not self.optimizer.param_groups[0]["fused"]:
            self.optimizer.state.clear()  # fused keeps its step counts on the GPU: new state, the old freed
            for group in self.optimizer.param_groups:
                group.update(foreach=False, fused=True)
        entry["fused_optimizer"] = bool(self.optimizer.param_groups[0]["fused"])
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        entry["first_step_seconds"] = self.one_step()
        seconds = [self.one_step() for _ in range(steps)]
        step_s = sum(seconds) / len(seconds)
        mfu = basics.flops.model_flops_utilization(
            self.num_params, self.tokens_per_step, step_s, 1, self.peak_flops
        )
        entry |= {
            "step_seconds": seconds,
            "steady_step_seconds": step_s,
            "tokens_per_second": self.tokens_per_step / step_s,
            "mfu": mfu,
        }
        if self.cuda:
            entry["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            entry["max_memory_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        if variant.every_n == 1 and not variant.compiled:
            entry["profile"] = self.profiled_step("notebook")
        print(
            f"{variant.label}: {step_s:.3f} s/step, MFU {mfu if mfu is None else round(mfu, 3)}, "
            f"first step {entry['first_step_seconds']:.1f} s, peak {entry.get('max_memory_allocated_gib', 0):.1f} GiB",
            flush=True,
        )
        return entry

    @staticmethod
    def described(variant: Variant) -> dict:
        return {
            "label": variant.label,
            "checkpoint_every_n_layers": variant.every_n,
            "compiled": variant.compiled,
            "micro_batch": variant.micro,
        }

    def failed(self, variant: Variant) -> dict:
        """A variant that raised: its traceback, and the memory it held given back."""
        import torch

        label = variant.label
        entry = {**self.described(variant), "error": traceback.format_exc()[-2000:]}
        print(f"{label}: FAILED\n{entry['error']}", flush=True)
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
        return entry


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--variants", choices=tuple(SETS), default="study")
    parser.add_argument("--budget", type=float, default=400, help="seconds; no variant starts after it")
    args = parser.parse_args()
    started = time.time()
    import torch.distributed as dist

    Path(args.out).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="llama-step-"))
    study = StepStudy(args, work)
    result_file = study.out / f"{study.stem}.json"
    fastest = None
    for variant in SETS[args.variants]:
        if time.time() - started > args.budget:
            study.results["variants"].append({"label": variant.label, "skipped": "out of time"})
            continue
        try:
            entry = study.measure(variant, 2 if args.smoke else 5)
            if fastest is None or entry["steady_step_seconds"] < fastest[0]["steady_step_seconds"]:
                fastest = (entry, variant)
        except Exception:  # noqa: BLE001 - recorded; the next variant goes on
            entry = study.failed(variant)
        study.results["variants"].append(entry)
        write_result(result_file, study.results)
    if fastest is not None and fastest[0].get("profile") is None and time.time() - started < args.budget + 60:
        entry, variant = fastest
        try:
            study.run_layers_as(variant.every_n, variant.compiled, variant.micro)
            study.one_step()  # a recompile, if any, stays out of the profile
            entry["profile"] = study.profiled_step("fastest")
        except Exception:  # noqa: BLE001
            entry["profile_error"] = traceback.format_exc()[-2000:]
        write_result(result_file, study.results)
    dist.destroy_process_group()
    shutil.rmtree(work, ignore_errors=True)
    print(f"llama_step: {time.time() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
