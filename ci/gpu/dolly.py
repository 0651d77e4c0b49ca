"""Dolly's Lightning + FSDP recipe on one GPU through Ray Train: the notebook's module, strategy, generation.

Executed from `dolly_lightning_fsdp.ipynb`, not copied: `DollyV2Model` (the LightningModule),
`make_fsdp_strategy` (`ShardedRayFSDPStrategy`: FULL_SHARD, GPTNeoXLayer wrapping and activation
checkpointing, CPU offload or not) and the generation cell's `generate` Ray task (fp16 on the GPU, weights
read from the checkpoint through DCP). `train_func` below is the notebook's without its MLflow observer and
per-epoch full checkpoint: the same module, strategy, `RayLightningEnvironment`, `prepare_trainer` and Ray
Data shard (random tokens), a fixed number of steps, timed. The first run that succeeds saves a weights-only
sharded checkpoint for `generate`. The model: a random-weight GPT-NeoX of pythia-1.4b's shape (dolly-v2's
family), vocab 50280, stored in bf16, with smoke mode's offline tokenizer (512 tokens: higher ids decode to
nothing, so the generated texts are short). On one GPU FSDP runs as NO_SHARD (world size 1).

    python -m ci.gpu.dolly --out DIR            # on a CUDA GPU: DIR/dolly_lightning_fsdp.json
    python -m ci.gpu.dolly --smoke --out DIR    # on CPU: a 2-layer model, the same code paths
    python -m ci.gpu.dolly --only "16-mixed, CPU offload on" --out DIR  # that run alone, no generation:
                                                # DIR/dolly_lightning_fsdp_16_mixed_cpu_offload_on.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import harness.cluster
import harness.sizing
import harness.tiny_models
from basics.notebook_files import parameter_defaults
from ci.gpu.common import (
    ROOT,
    environment,
    lesson_cells,
    lesson_namespace,
    slug,
    write_result,
)

NOTEBOOK = "dolly_lightning_fsdp"
FULL = dict(num_hidden_layers=24, hidden_size=2048, num_attention_heads=16, intermediate_size=8192)
SMOKE = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=256)
PROMPTS = ["This is", "I am", "Once more"]  # the notebook's


def start_ray(cuda: bool) -> None:
    """A local Ray with the notebooks' settings (`harness.cluster.ray_init_args`'s, without MLflow): quiet Ray Data, and
    the workers' `expandable_segments` allocator, which the plans' fragmentation figure assumes."""
    import harness.cluster

    for var, value in {**harness.cluster.RAY_ENV, **harness.cluster.LOCAL_RAY_ENV}.items():
        os.environ.setdefault(var, value)
    import ray

    env = {"env_vars": dict(harness.cluster.WORKER_ENV)}
    ray.init(num_cpus=16 if cuda else 3, include_dashboard=False, logging_level="WARNING", runtime_env=env)


def build_model(folder: Path, sizes: dict, cuda: bool) -> int:
    import torch
    from transformers import AutoTokenizer, GPTNeoXConfig, GPTNeoXForCausalLM
    from transformers.utils import logging

    import harness.tiny_models

    logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(harness.tiny_models.tiny_model("gpt_neox"))
    config = GPTNeoXConfig(vocab_size=50280, max_position_embeddings=2048, rotary_pct=0.25, **sizes)
    config.bos_token_id = config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):
        model = GPTNeoXForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    num_params = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()  # the driver keeps only its CUDA context
    return num_params


def train_func(config: dict) -> None:
    """One worker: the notebook's DollyV2Model and strategy for `steps` steps, timed; its peak GPU memory."""
    import lightning.pytorch as pl
    import ray.train
    import torch
    from ray.train.lightning import RayLightningEnvironment, prepare_trainer

    DollyV2Model, make_fsdp_strategy = config["lesson"]
    cuda, seconds, losses, peak = torch.cuda.is_available(), [], [], {}

    class Timer(pl.Callback):
        def now(self) -> float:
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_start(self, trainer, module) -> None:
            self.start = self.last = self.now()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            now = self.now()  # a step: from the last one's end, its batch's fetch included
            seconds.append(now - self.last)
            self.last = now
            losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))
            if now - self.start > config["time_cap"] and len(seconds) >= 4:
                trainer.should_stop = True  # the time guard: fewer steps rather than no result

        def on_train_end(self, trainer, module) -> None:
            if cuda:
                peak["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
                peak["max_memory_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30

    t0 = time.perf_counter()
    pl.seed_everything(42, verbose=False)
    model = DollyV2Model(config["model_name"], lr=config["learning_rate"], eps=config["eps"])
    num_params, load_seconds = sum(p.numel() for p in model.parameters()), time.perf_counter() - t0
    shard = ray.train.get_dataset_shard("train")
    batches = shard.iter_torch_batches(batch_size=config["batch_size_per_worker"])
    # The notebook's Trainer, with max_steps and the timer for its MLflow observer and RayTrainReportCallback.
    trainer = pl.Trainer(
        max_epochs=1,
        max_steps=config["steps"],
        precision=config["precision"],
        strategy=make_fsdp_strategy(config["cpu_offload"]),
        plugins=[RayLightningEnvironment()],
        callbacks=[Timer()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    trainer = prepare_trainer(trainer)
    trainer.fit(model, train_dataloaders=batches)
    steady = seconds[2:] or seconds[-1:]  # the first two steps warm up the allocator and the kernels
    step_s = sum(steady) / len(steady)
    metrics = dict(num_params=num_params, device=str(trainer.strategy.root_device), load_seconds=load_seconds)
    metrics["param_dtypes"] = sorted({str(p.dtype) for p in trainer.model.parameters()})
    metrics.update(steps=len(seconds), step_seconds=seconds, steady_step_seconds=step_s, losses=losses)
    metrics.update(peak)
    metrics["tokens_per_second"] = config["batch_size_per_worker"] * config["seq_len"] / step_s
    metrics["imported"] = [m for m in ("mlflow", "datasets", "papermill") if m in sys.modules]
    # Ray Train v2 keeps the metrics of checkpoints only: the driver reads this file.
    Path(config["result_file"]).write_text(json.dumps(metrics))
    if config["save"]:  # as RayTrainReportCallback does, without the optimizer state (17 GB at 1.4B)
        with tempfile.TemporaryDirectory() as tmp:
            trainer.save_checkpoint(os.path.join(tmp, "checkpoint.ckpt"), weights_only=True)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def attempt(entry: dict, run) -> dict:
    """`run(entry)` fills `entry` in and returns its line; an exception is recorded, the next run goes on."""
    try:
        print(f"{entry['label']}: {run(entry)}", flush=True)
    except Exception as error:
        entry["error"] = traceback.format_exc()[-3000:]
        print(f"{entry['label']}: FAILED {type(error).__name__}: {str(error)[-300:]}", flush=True)
    return entry


def train_one(ctx: dict, entry: dict) -> str:
    """One precision and offload setting: its plan, then the notebook's strategy on one GPU worker."""
    from ray.train import DataConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    p, runs, checkpoints, work = ctx["p"], ctx["runs"], ctx["checkpoints"], ctx["work"]
    entry["plan"] = harness.sizing.plan_for(NOTEBOOK, {**p, **entry["parameters"]}).as_dict()
    per_gpu = [r["need"] for r in entry["plan"]["rows"] if r["where"] == "per GPU"]
    entry["plan_per_gpu_gib"] = sum(per_gpu) / 2**30
    if (left := ctx["started"] + ctx["budget"] - time.time()) < 35:
        raise TimeoutError(f"skipped: {left:.0f} s of the time budget left")
    config = {**ctx["base"], "precision": entry["precision"], "cpu_offload": entry["cpu_offload"]}
    config.update(save=not checkpoints, result_file=str(work / f"{len(runs)}.json"))
    config.update(time_cap=max(10.0, min(45.0, left - 35)), lesson=ctx["lesson_parts"])
    t0 = time.time()
    result = TorchTrainer(
        train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(
            num_workers=1, use_gpu=ctx["cuda"], resources_per_worker={"CPU": ctx["cpus"]}
        ),
        run_config=RunConfig(name=f"dolly-gpu-{len(runs)}", storage_path=str(work / "ray_results")),
        datasets={"train": ctx["train_ds"]},
        dataset_config=DataConfig(enable_shard_locality=False),
    ).fit()
    entry.update(json.loads(Path(config["result_file"]).read_text()), run_seconds=time.time() - t0)
    checkpoints.extend([result.checkpoint] if result.checkpoint else [])
    allocated, reserved = (entry.get(f"max_memory_{k}_gib", 0) for k in ("allocated", "reserved"))
    return (
        f"{entry['steady_step_seconds']:.3f} s/step, {entry['tokens_per_second']:,.0f} tokens/s, peak "
        f"{allocated:.1f} GiB allocated, {reserved:.1f} reserved (plan {entry['plan_per_gpu_gib']:.1f} per "
        f"GPU), loss {entry['losses'][0]:.3f} -> {entry['losses'][-1]:.3f}, {entry['run_seconds']:.0f} s"
    )


def generate_once(ctx: dict, entry: dict) -> str:
    """The notebook's generation cell: a Ray task with a GPU, from the first run's checkpoint."""
    import ray

    if (left := ctx["started"] + ctx["budget"] - time.time()) < 20:
        raise TimeoutError(f"skipped: {left:.0f} s of the time budget left")
    lesson = ctx["lesson"]
    ref, t0 = lesson["generate"].remote(ctx["checkpoints"][0], ctx["p"]["MODEL_NAME"], PROMPTS), time.time()
    try:
        texts = ray.get(ref, timeout=min(90.0, left))
    except Exception:
        # A task still holding the GPU would starve the runs after it.
        with contextlib.suppress(Exception):
            ray.cancel(ref, force=True)
        raise
    entry.update(texts=texts, dtype=str(lesson["HALF"]), seconds=time.time() - t0)
    return f"{entry['seconds']:.1f} s, {entry['dtype']}, {entry['texts']!r}"[:300]


def run_configs(args, parser, cuda: bool) -> list[tuple[str, bool]]:
    """The (precision, CPU offload) settings to run: four on a GPU, two on a CPU, or `--only` one."""
    configs = [("bf16-mixed", False), ("16-mixed", False), ("bf16-mixed", True), ("16-mixed", True)]
    if not cuda:  # no fp16 autocast on CPUs here, and FSDP's CPU offload pins memory: it needs an accelerator
        configs = [("bf16-mixed", False), ("32-true", False)]
    if args.only:
        configs = [c for c in configs if f"{c[0]}, CPU offload {'on' if c[1] else 'off'}" == args.only]
        if not configs:
            parser.error(f"--only {args.only!r}: no such run")
    return configs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--budget", type=float, default=190.0, help="seconds: later runs are cut or skipped")
    parser.add_argument("--only", help='one run, by its label ("16-mixed, CPU offload on"); no generation')
    args = parser.parse_args()
    started = time.time()
    os.chdir(ROOT)  # Ray adds the driver's directory to its workers' path: `helpers` imports there
    import numpy as np
    import torch
    import transformers

    cuda, work = torch.cuda.is_available(), Path(tempfile.mkdtemp(prefix="dolly-gpu-"))
    start_ray(cuda)
    import ray

    num_params = build_model(work / "model", SMOKE if args.smoke else FULL, cuda)
    seq, batch, steps, cpus = (32, 2, 4, 1) if args.smoke else (256, 5, 8, 8)  # the notebook's defaults
    configs = run_configs(args, parser, cuda)
    stem = NOTEBOOK + (f"_{slug(args.only)}" if args.only else "")
    p = {**parameter_defaults(NOTEBOOK), "NUM_WORKERS": 1, "USE_GPU": True, "CLUSTER": {"p5.48xlarge": 1}}
    p.update(MODEL_NAME=str(work / "model"), MAX_SEQ_LEN=seq, BATCH_SIZE_PER_WORKER=batch)
    lesson = lesson_namespace(NOTEBOOK, {**p, "USE_GPU": cuda})  # make_fsdp_strategy (train_func: unused)
    lesson["AutoTokenizer"] = transformers.AutoTokenizer  # `generate` has it from cell 7 (not executed)
    lesson_cells(lesson, NOTEBOOK, ("DollyV2Model", "generate"), skip=("generated",))
    ids = np.random.default_rng(0).integers(0, 50280, ((steps + 1) * batch, seq), dtype=np.int64)
    train_ds = ray.data.from_items([{"input_ids": r, "attention_mask": r * 0 + 1, "labels": r} for r in ids])
    base = dict(model_name=p["MODEL_NAME"], learning_rate=p["LEARNING_RATE"], eps=p["EPS"], steps=steps)
    base.update(batch_size_per_worker=batch, seq_len=seq, cpus_per_worker=cpus)
    header = {**base, "num_params": num_params, "model": SMOKE if args.smoke else FULL, "method": __doc__}
    runs, checkpoints, lesson_parts = [], [], (lesson["DollyV2Model"], lesson["make_fsdp_strategy"])

    ctx = dict(p=p, started=started, budget=args.budget, base=base, checkpoints=checkpoints, runs=runs)
    ctx.update(work=work, lesson=lesson, lesson_parts=lesson_parts, cpus=cpus, cuda=cuda, train_ds=train_ds)
    train, generate = functools.partial(train_one, ctx), functools.partial(generate_once, ctx)

    for precision, offload in configs:
        label = f"{precision}, CPU offload {'on' if offload else 'off'}"
        parameters = {"PRECISION": precision, "CPU_OFFLOAD": offload}  # the notebook's, for its plan
        runs.append(
            attempt(dict(label=label, precision=precision, cpu_offload=offload, parameters=parameters), train)
        )
        if checkpoints and not args.only and not any(r["label"] == "generation" for r in runs):
            runs.append(attempt({"label": "generation", "prompts": PROMPTS, "num_gpus": int(cuda)}, generate))
        header["total_seconds"] = time.time() - started
        write_result(
            Path(args.out) / f"{stem}.json", dict(environment=environment(), config=header, runs=runs)
        )
    ray.shutdown()
    shutil.rmtree(work, ignore_errors=True)  # the model and the run's files: the results are in --out


if __name__ == "__main__":
    main()
