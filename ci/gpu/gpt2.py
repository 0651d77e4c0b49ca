"""GPT-2 + DeepSpeed (`gpt2_deepspeed`) on one GPU: samples/s and peak memory per ZeRO stage.

    PYTHONPATH=. python -m ci.gpu.gpt2 --out DIR          # GPT-2 124M (random weights), 512 tokens, a GPU
    PYTHONPATH=. python -m ci.gpu.gpt2 --smoke --out DIR  # 2-layer GPT-2, 64 tokens, a CPU worker (a test)

ZeRO-1, 2, 3 and ZeRO-3 with OFFLOAD="optimizer+params", each its own Ray Train `TorchTrainer.fit()` (one
worker, `use_gpu`), with the notebook's parameters (its parameters cell) and its own lesson functions:
`make_ds_config` (the DeepSpeed config), `setup_model_and_optimizer` (`from_pretrained`, torch AdamW, or
DeepSpeed's CPU Adam with offload, then `deepspeed.initialize`) and `train_epoch` (forward, `backward`,
`step`). Its `train_loop` is not used: its dataloader needs `datasets` and a tokenizer, and its observer
an MLflow watch. Here the batches are random tokens and the observer (`train_epoch`'s last argument)
times each step after `torch.cuda.synchronize`; steps after the first `--skip` give s/step, samples/s and
tokens/s. The worker records peak GPU memory (allocated, reserved; reset once the engine is built) and
peak host RSS; each run also records the notebook's "will it fit?" plan for the same parameters
(`harness.sizing.plan_for`). DeepSpeed's CPU Adam (offload) is compiled in the background from the start.
A failing run records its error and the others go on; `--budget` seconds bound the whole script (a run
still going then is interrupted). DIR/gpt2_deepspeed.json is written after every run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness.cluster
import harness.sizing
from basics.notebook_files import parameter_defaults
from ci.gpu.common import environment, lesson_cells, lesson_namespace, write_result

ROOT = Path(__file__).resolve().parents[2]


NOTEBOOK = "gpt2_deepspeed"
RUNS = [(1, "none"), (2, "none"), (3, "none"), (3, "optimizer+params")]  # offload last: CPU Adam builds
GiB = 2**30
EXPIRED: list = []  # the --budget alarm went off
BUILD = (  # CPU Adam, as DeepSpeedCPUAdam loads it, into torch's extension cache that the workers share
    "import time; t = time.time(); from deepspeed.accelerator import get_accelerator as a; "
    "a().create_op_builder('CPUAdamBuilder').load(); print(f'cpu_adam ready after {time.time() - t:.0f} s')"
)


def notebook_parameters() -> dict:
    """The parameters cell's defaults (SMOKE_TEST and the paths left out)."""
    skip = ("SMOKE_TEST", "STORAGE_PATH", "RESULTS_PATH")
    return {k: v for k, v in parameter_defaults(NOTEBOOK).items() if k not in skip}


def train_worker(config: dict) -> None:
    """A Ray Train worker: the notebook's engine and `train_epoch`, timed; rank 0 writes what it measured."""
    import resource

    import ray.train
    import torch

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    start = time.perf_counter()
    engine = config["setup"](config["model_name"], config["learning_rate"], config["ds_config"])
    sync()
    out = {
        "setup_s": round(time.perf_counter() - start, 2),
        "engine_zero_stage": engine.zero_optimization_stage(),
    }
    if cuda:
        out["setup_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
        out["allocated_after_setup_gib"] = torch.cuda.memory_allocated() / GiB
        torch.cuda.reset_peak_memory_stats()
    shape = (config["steps"], config["batch_size"], config["seq_len"])
    ids = torch.randint(0, config["vocab_size"], shape, generator=torch.Generator().manual_seed(0))
    loader = [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x} for x in ids]

    class Timer:  # in the notebook's observer slot: called once after each step
        def __init__(self):
            self.times, self.losses, self.last = [], [], time.perf_counter()

        def step(self, step, loss, lr=None):
            value = loss.item()
            sync()
            now = time.perf_counter()
            self.times.append(now - self.last)
            self.losses.append(value)
            self.last = now
            return value

    engine.train()
    sync()
    timer = Timer()
    config["train_epoch"](engine, loader, 0, config["steps"], timer)
    steady = timer.times[config["skip"] :] or timer.times
    s_per_step = sum(steady) / len(steady)
    out.update(
        step_times_s=[round(t, 4) for t in timer.times],
        s_per_step=s_per_step,
        samples_per_s=config["batch_size"] / s_per_step,
        tokens_per_s=config["batch_size"] * config["seq_len"] / s_per_step,
        loss_first=timer.losses[0],
        loss_last=timer.losses[-1],
        host_peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB,
    )
    if cuda:
        out["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
        out["max_memory_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
        free, total = torch.cuda.mem_get_info()  # as nvidia-smi: CUDA contexts and every process included
        out["device_used_at_end_gib"] = (total - free) / GiB
    if ray.train.get_context().get_world_rank() == 0:
        Path(config["result_file"]).write_text(json.dumps(out))


def on_alarm(signum, frame):
    EXPIRED.append(True)  # Ray's blocking get passes on only SystemExit and KeyboardInterrupt, without text
    raise SystemExit(1)


def summary(run: dict) -> str:
    head = f"ZeRO-{run['zero_stage']} offload={run['offload']}:"
    if "error" in run:
        return f"{head} FAILED after {run.get('fit_s', 0)} s: {run['error'][-400:]}"
    plan = run.get("plan", {}).get("device_bytes")
    return (
        f"{head} {run['s_per_step']:.4f} s/step, {run['samples_per_s']:.2f} samples/s, "
        f"{run['tokens_per_s']:.0f} tokens/s, peak allocated {run.get('max_memory_allocated_gib', 0):.2f} GiB, "
        f"reserved {run.get('max_memory_reserved_gib', 0):.2f} GiB (plan: {(plan or 0) / GiB:.2f} GiB/device), "
        f"host RSS {run['host_peak_rss_gib']:.2f} GiB, loss {run['loss_first']:.3f} -> {run['loss_last']:.3f}, "
        f"fit {run['fit_s']} s"
    )


def arguments():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for gpt2_deepspeed.json")
    parser.add_argument("--smoke", action="store_true", help="tiny GPT-2 on a CPU worker")
    parser.add_argument("--steps", type=int, help="steps per run (10; smoke: 3)")
    parser.add_argument("--skip", type=int, help="first steps left out of the timings (2; smoke: 1)")
    parser.add_argument("--budget", type=float, default=150.0, help="seconds for the whole script")
    return parser.parse_args()


def start_build(log_path: Path) -> subprocess.Popen:
    """DeepSpeed's CPU Adam (offload), compiled in the background from the start, behind the runs' own CPU work."""
    with open(log_path, "w") as log:
        nice = ["nice", "-n", "10"] if shutil.which("nice") else []
        return subprocess.Popen([*nice, sys.executable, "-c", BUILD], stdout=log, stderr=subprocess.STDOUT)


def start_local_ray(num_cpus: int) -> None:
    """A local Ray with a notebook's settings, and its workers' (the GPU allocator's)."""
    import ray

    from harness.cluster import LOCAL_RAY_ENV, RAY_ENV, WORKER_ENV

    for var, value in {**RAY_ENV, **LOCAL_RAY_ENV}.items():
        os.environ.setdefault(var, value)
    ray.init(include_dashboard=False, num_cpus=num_cpus, runtime_env={"env_vars": dict(WORKER_ENV)})


def plan_of(p: dict, stage: int, offload: str) -> dict:
    """{"plan": the notebook's plan for this stage and offload}, or {"plan_error": why not}."""
    try:
        return {
            "plan": harness.sizing.plan_for(
                NOTEBOOK, {**p, "ZERO_STAGE": stage, "OFFLOAD": offload}
            ).as_dict()
        }
    except Exception as e:  # noqa: BLE001 - the measurement matters more
        return {"plan_error": repr(e)}


def random_model(folder: str, smoke: bool) -> dict:
    """GPT-2 124M (GPT2Config's defaults), or a 2-layer one with `smoke`, with random weights, saved in
    `folder`; its sizes and parameter count."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    small = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, bos_token_id=0, eos_token_id=0)
    model_config = GPT2Config(**(small if smoke else {}))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(model_config)
    model.save_pretrained(folder)
    info = {k: getattr(model_config, k) for k in ("n_layer", "n_embd", "n_head", "vocab_size")}
    return {**info, "parameters": sum(t.numel() for t in model.parameters())}


def fit_within(trainer, run: dict, result_file: Path, left: float) -> str | None:
    """`trainer.fit()` within `left` seconds (an alarm), its worker's results into `run`; a reason to run no
    more (the budget ran out, SIGTERM, Ctrl-C), else None. An error of the run is recorded, and the next goes on."""
    stop = None
    started = time.monotonic()
    signal.alarm(max(1, int(left)))
    try:
        trainer.fit()
        run.update(json.loads(result_file.read_text()))
    except Exception as e:  # noqa: BLE001 - recorded; the next stage goes on
        run["error"] = f"{type(e).__name__}: {e}"[-4000:]
    except BaseException as e:  # the budget's alarm, SIGTERM or Ctrl-C: no more runs
        why = "the time budget (--budget) ran out" if EXPIRED else f"{type(e).__name__} {e}"
        run["error"] = stop = f"interrupted: {why}"
    finally:
        signal.alarm(0)
    run["fit_s"] = round(time.monotonic() - started, 1)
    return stop


def finish_build(build: subprocess.Popen, log: Path) -> dict:
    """Stop DeepSpeed's CPU Adam build if it still runs; its return code and the end of its log."""
    if build.poll() is None:  # SIGINT: torch's build releases its lock on the way out (SIGTERM would not)
        build.send_signal(signal.SIGINT)
    try:
        outcome = {"returncode": build.wait(timeout=30)}
    except subprocess.TimeoutExpired:
        outcome = {"returncode": "still running"}
    return {**outcome, "log_tail": log.read_text()[-1500:]}


def main() -> int:
    args = arguments()
    clock = time.monotonic()
    steps = args.steps or (3 if args.smoke else 10)
    skip = args.skip if args.skip is not None else (1 if args.smoke else 2)
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault(
            "DS_ACCELERATOR", "cpu"
        )  # before DeepSpeed's import, as harness.cluster.ray_init_args does
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    tmp = Path(tempfile.mkdtemp(prefix="gpt2_gpu_"))
    build = start_build(tmp / "cpu_adam.log")
    p = {**notebook_parameters(), "NUM_WORKERS": 1, "USE_GPU": not args.smoke, "CLUSTER": {"p5.48xlarge": 1}}
    if args.smoke:
        p.update(MAX_SEQ_LEN=64, CPUS_PER_WORKER=1)
    p["MODEL_NAME"] = str(tmp / "gpt2-random")
    model_info = random_model(p["MODEL_NAME"], args.smoke)
    ns = lesson_namespace(NOTEBOOK, p)
    # its cell also builds and shows the default config: only the definition is taken
    make_ds_config = lesson_cells(ns, NOTEBOOK, ("make_ds_config",), skip=("ds_config",))["make_ds_config"]
    config = {"parameters": p, "model": model_info, "steps": steps, "skip": skip, "smoke": args.smoke}
    result = {"environment": environment(), "config": config, "runs": []}
    out = Path(args.out) / f"{NOTEBOOK}.json"
    start_local_ray(2 if args.smoke else max(os.cpu_count() or 1, p["CPUS_PER_WORKER"] + 1))
    common = dict(
        setup=ns["setup_model_and_optimizer"], train_epoch=ns["train_epoch"], model_name=p["MODEL_NAME"]
    )
    common.update(
        learning_rate=p["LEARNING_RATE"], batch_size=p["BATCH_SIZE_PER_WORKER"], seq_len=p["MAX_SEQ_LEN"]
    )
    common.update(steps=steps, skip=skip, vocab_size=model_info["vocab_size"])
    signal.signal(signal.SIGALRM, on_alarm)
    stop = None
    for stage, offload in RUNS:
        run = {"zero_stage": stage, "offload": offload}
        result["runs"].append(run)
        run.update(plan_of(p, stage, offload))
        left = args.budget - (time.monotonic() - clock)
        if stop or left < 20:
            run["error"] = f"not run: {stop or f'{left:.0f} s of the budget left'}"
            print(summary(run), flush=True)
            continue
        ds_config = make_ds_config(stage, p["PRECISION"], p["BATCH_SIZE_PER_WORKER"], offload)
        run["ds_config"] = ds_config
        result_file = tmp / f"zero{stage}-{offload}.json"
        trainer = TorchTrainer(
            train_worker,
            train_loop_config={**common, "ds_config": ds_config, "result_file": str(result_file)},
            scaling_config=ScalingConfig(
                num_workers=1, use_gpu=p["USE_GPU"], resources_per_worker={"CPU": p["CPUS_PER_WORKER"]}
            ),
            run_config=RunConfig(
                storage_path=str(tmp / "ray_results"),
                name=f"zero{stage}-{offload}",
                failure_config=FailureConfig(max_failures=0),
            ),
        )
        stop = fit_within(trainer, run, result_file, left)
        print(summary(run), flush=True)
        write_result(out, result)
    config["cpu_adam_build"] = finish_build(build, tmp / "cpu_adam.log")
    config["wall_s"] = round(time.monotonic() - clock, 1)
    write_result(out, result)
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)
    return 0 if all("error" not in r for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
