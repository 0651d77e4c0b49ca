"""What the GPU runs share: the notebooks' own lesson functions, and what a result records.

`lesson_namespace` executes the code cells of a notebook that only define things (imports, functions,
constants: no training, no tracking, no display), with the given parameters in scope, and returns the
namespace: the GPU runs train with the lesson's own `load_model`, `shard_model`, `train_step`, ... rather
than a copy of them.
"""

from __future__ import annotations

import ast
import datetime
import json
import os
import platform
import re
import time
from pathlib import Path

from basics.notebook_files import code_cells

ROOT = Path(__file__).resolve().parents[2]
_DEFINING = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef, ast.Assign)


def lesson_namespace(notebook: str, params: dict | None = None) -> dict:
    """The notebook's definitions (cells made only of imports, defs and assignments, at least one def)."""
    import math

    import ray
    import torch

    import helpers
    import helpers.fsdp

    namespace = {
        "__name__": f"lesson_{notebook}",
        "helpers": helpers,
        "torch": torch,
        "ray": ray,
        "math": math,
    }
    namespace.update(params or {})
    for cell in code_cells(notebook):
        body = ast.parse(cell.source).body
        if any(isinstance(n, ast.FunctionDef) for n in body) and all(isinstance(n, _DEFINING) for n in body):
            exec(compile(cell.source, f"{notebook}.ipynb[{cell.index}]", "exec"), namespace)
    return namespace


def outside_ray_train() -> None:
    """For a run under plain torch.distributed (torchrun, or one process): the notebook's
    `ray.train.collective.barrier()`, which only a Ray Train worker may call, is the process group's barrier."""
    import ray.train.collective
    import torch.distributed as dist

    ray.train.collective.barrier = dist.barrier


def lesson_cells(namespace: dict, notebook: str, names: tuple, skip: tuple = ()) -> dict:
    """Execute into `namespace` the defining statements (imports, defs, classes, assignments but to `skip`) of
    the cells defining one of `names`: cells `lesson_namespace` leaves out (a class alone, a def and a call)."""
    for cell in code_cells(notebook):
        body = ast.parse(cell.source).body
        if any(isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name in names for n in body):
            assigns = {n: {getattr(t, "id", 0) for t in n.targets} for n in body if isinstance(n, ast.Assign)}
            keep = [n for n in body if isinstance(n, _DEFINING) and not assigns.get(n, set()) & set(skip)]
            exec(compile(ast.Module(keep, []), f"{notebook}.ipynb[{cell.index}]", "exec"), namespace)
    return namespace


def environment() -> dict:
    """The GPU, the versions and the date, for a result's header."""
    import torch
    import transformers

    info = {
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        if torch.cuda.is_available()
        else None,
    }
    for name in ("ray", "deepspeed", "lightning", "accelerate", "peft"):
        try:
            info[name] = __import__(name).__version__
        except Exception:  # not installed there
            info[name] = None
    return info


def write_result(path: str | os.PathLike, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {path}", flush=True)


def slug(label: str) -> str:
    """A label as a file name's part: "16-mixed, CPU offload on" -> "16_mixed_cpu_offload_on"."""
    return "_".join(re.findall("[a-z0-9]+", label.lower()))


def live_at_peak(snapshot: dict, top: int = 15) -> dict:
    """From CUDA's allocator history (`torch.cuda.memory._snapshot()` after `_record_memory_history`, started
    before anything was allocated): the peak of allocated bytes, and the blocks alive then, summed by the
    two innermost frames outside torch (FSDP's own code counts as outside) that allocated them."""
    trace = [e for device in snapshot["device_traces"] for e in device]
    live, total, peak, at_peak = {}, 0, 0, {}
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
        if total > peak:
            peak, at_peak = total, dict(live)

    def where(event: dict) -> str:
        frames = event.get("frames", [])
        ours = [f for f in frames if "/torch/" not in f["filename"] or "/fsdp/" in f["filename"]]
        if not frames:
            return "(no Python frame: autograd's backward)"
        return " <- ".join(
            f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"
            for f in (ours or frames)[:2]
        )

    by_site: dict = {}
    for event in at_peak.values():
        site = where(event)
        count, size = by_site.get(site, (0, 0))
        by_site[site] = (count + 1, size + event["size"])
    ranked = sorted(by_site.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "peak_bytes": peak,
        "blocks_at_peak": len(at_peak),
        "at_peak_by_site": [{"site": s, "blocks": c, "bytes": b} for s, (c, b) in ranked],
    }


def now() -> float:
    return time.time()
