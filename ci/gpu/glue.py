"""GLUE's Hugging Face `Trainer` path on one GPU through Ray Train: the notebook's own `train_func`.

Executed from `glue_text_classification.ipynb`, not copied: `read_split` (CoLA's parquet files into Ray
Data), `TokenizeCollateFn`, `make_training_args` (its `use_cpu=not use_gpu`), `make_compute_metrics` and
`train_func` itself (the `Trainer`, `RayTrainReportCallback`, `prepare_trainer`, an evaluation and a
checkpoint at the epoch's end), launched by a `TorchTrainer` set up as the notebook's launch cell does.
Stand-ins: the data is smoke mode's offline GLUE fixture (the Hub's layout, 512 CoLA training rows); the
run log's `Watch` is made without MLflow; `prepare_trainer` is wrapped to add a timing callback that
writes samples/s, `trainer.args.use_cpu`, the model's device and peak GPU memory; where scikit-learn is
missing, CoLA's Matthews correlation comes from numpy. The model: a random-weight DistilBERT with
distilbert-base-uncased's config (66M parameters, vocab 30522) and smoke mode's tokenizer.

    python -m ci.gpu.glue --out DIR            # on a CUDA GPU: DIR/glue_text_classification.json
    python -m ci.gpu.glue --smoke --out DIR    # on CPU: a 2-layer model, the same code paths
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from basics.notebook_files import parameter_defaults
from ci.gpu.common import ROOT, environment, lesson_cells, lesson_namespace, write_result
from ci.gpu.dolly import attempt, start_ray

NOTEBOOK = "glue_text_classification"
SMOKE = dict(n_layers=2, dim=64, n_heads=4, hidden_dim=128)  # the full run: DistilBertConfig's defaults


def build_model(folder: Path, sizes: dict) -> int:
    import torch
    import transformers

    import harness.tiny_models

    transformers.utils.logging.disable_progress_bar()
    tokenizer = transformers.AutoTokenizer.from_pretrained(harness.tiny_models.tiny_model("distilbert"))
    config = transformers.DistilBertConfig(pad_token_id=tokenizer.pad_token_id, **sizes)
    torch.manual_seed(0)  # a masked-LM checkpoint, like the Hub's: the notebook adds a fresh 2-label head
    model = transformers.DistilBertForMaskedLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def timed(prepare_trainer, result_file: str, batch_size: int):
    """The notebook's `prepare_trainer`, then a callback timing each step and recording where it trained."""

    def prepare_and_time(trainer):
        import torch
        from transformers import TrainerCallback

        cuda, seconds, facts = torch.cuda.is_available(), [], {}

        def now() -> float:
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        class Timing(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kwargs):
                facts.update(use_cpu=args.use_cpu, args_device=str(args.device), n_gpu=args.n_gpu)
                facts["model_device"] = next(model.parameters()).device.type
                self.last = now()

            def on_step_end(self, args, state, control, **kwargs):
                t = now()  # a step: from the last one's end, its batch's fetch and collate included
                seconds.append(t - self.last)
                self.last = t

            def on_train_end(self, args, state, control, **kwargs):
                steady = seconds[2:] or seconds[-1:]  # the first two steps warm up
                facts.update(
                    steps=len(seconds),
                    step_seconds=seconds,
                    samples_per_second=batch_size * len(steady) / sum(steady),
                )
                facts["log_history"] = (
                    state.log_history
                )  # the losses, the evaluation, the Trainer's own speed
                if cuda:
                    facts["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
                    facts["max_memory_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
                facts["imported"] = [
                    m for m in ("mlflow", "datasets", "papermill", "sklearn") if m in sys.modules
                ]
                Path(result_file).write_text(json.dumps(facts, default=str))

        trainer = prepare_trainer(trainer)
        trainer.add_callback(Timing())
        return trainer

    return prepare_and_time


def numpy_compute_metrics(task: str):
    """`make_compute_metrics` for CoLA without scikit-learn: the Matthews correlation, from numpy."""

    def compute_metrics(eval_pred):
        import numpy as np

        predictions, labels = eval_pred
        p, y = np.argmax(predictions, axis=1), np.asarray(labels)
        tp, tn = float(((p == 1) & (y == 1)).sum()), float(((p == 0) & (y == 0)).sum())
        fp, fn = float(((p == 1) & (y == 0)).sum()), float(((p == 0) & (y == 1)).sum())
        denominator = ((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn)) ** 0.5
        mcc = (tp * tn - fp * fn) / denominator if denominator else 0.0
        return {"matthews_correlation": mcc, "rows": len(y)}

    return compute_metrics


def summarise(entry: dict, cuda: bool) -> str:
    """The run's losses, evaluation and checks from the Trainer's log history, into `entry`; its line."""
    history = entry["log_history"]
    entry["losses"] = [h["loss"] for h in history if "loss" in h]
    entry["eval"] = next((h for h in history if "eval_loss" in h), None)
    entry["trainer_train_samples_per_second"] = next(
        (h["train_samples_per_second"] for h in history if "train_samples_per_second" in h), None
    )
    entry["checks"] = {
        "use_cpu_off": entry["use_cpu"] is False,
        "model_on_cuda": entry["model_device"] == "cuda",
    }
    line = (
        f"{entry['samples_per_second']:,.0f} samples/s ({entry['trainer_train_samples_per_second']} by the "
        f"Trainer), use_cpu={entry['use_cpu']}, model on {entry['model_device']}, peak "
        f"{entry.get('max_memory_allocated_gib', 0):.2f} GiB allocated, "
        f"{entry.get('max_memory_reserved_gib', 0):.2f} reserved, {entry['run_seconds']:.0f} s"
    )
    if cuda and not all(entry["checks"].values()):
        raise AssertionError(f"not on the GPU: {line}")
    return line


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    started = time.time()
    os.chdir(ROOT)  # Ray adds the driver's directory to its workers' path: `helpers` imports there
    import torch
    import transformers

    import harness.fixtures
    import harness.run_log
    import helpers

    cuda, work = torch.cuda.is_available(), Path(tempfile.mkdtemp(prefix="glue-gpu-"))
    start_ray(cuda)
    from ray.train import CheckpointConfig, DataConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    num_params = build_model(work / "model", SMOKE if args.smoke else {})
    p = {**parameter_defaults(NOTEBOOK), "USE_GPU": cuda, "MODEL_NAME": str(work / "model")}
    p.update(GLUE_PATH=harness.fixtures.glue_fixture(), glue_task=helpers.GLUE_TASKS[p["TASK"]])
    lesson = lesson_namespace(NOTEBOOK, p)  # make_training_args, make_compute_metrics, train_func
    lesson_cells(lesson, NOTEBOOK, ("read_split", "TokenizeCollateFn"), skip=("ray_datasets",))
    lesson.update(AutoTokenizer=transformers.AutoTokenizer, os=os)  # train_func has them from other cells
    metric = "helpers.GlueMetric" if importlib.util.find_spec("sklearn") else "numpy"
    if metric == "numpy":  # scikit-learn is missing: CoLA's metric from numpy
        lesson["make_compute_metrics"] = numpy_compute_metrics
    steps, batch, cpus = (6, 8, 1) if args.smoke else (20, p["BATCH_SIZE_PER_WORKER"], p["CPUS_PER_WORKER"])
    result_file = str(work / "result.json")
    lesson["prepare_trainer"] = timed(lesson["prepare_trainer"], result_file, batch)
    watch = harness.observe.Watch(harness.run_log.run_log(steps, max(1, steps // 4), 0, None), None, 0, steps)
    config = {"glue_task": p["glue_task"], "model_name": p["MODEL_NAME"], "batch_size_per_worker": batch}
    config.update(max_steps_per_epoch=steps, num_epochs=1, learning_rate=p["LEARNING_RATE"], seed=42)
    config.update(weight_decay=p["WEIGHT_DECAY"], use_gpu=cuda, watch=watch)
    header = {k: v for k, v in config.items() if k not in ("glue_task", "watch")}
    header.update(task=p["TASK"], num_params=num_params, cpus_per_worker=cpus, metric=metric, method=__doc__)
    header["model"] = SMOKE if args.smoke else transformers.DistilBertConfig().to_diff_dict()

    def train(entry: dict) -> str:
        t0 = time.time()
        TorchTrainer(
            lesson["train_func"],
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=1, use_gpu=cuda, resources_per_worker={"CPU": cpus}),
            datasets={
                "train": lesson["read_split"]("train"),
                "eval": lesson["read_split"](p["glue_task"].validation_split),
            },
            dataset_config=DataConfig(datasets_to_split=["train"]),
            run_config=RunConfig(
                name="glue-gpu",
                storage_path=str(work / "ray_results"),
                checkpoint_config=CheckpointConfig(
                    num_to_keep=1, checkpoint_score_attribute="eval_loss", checkpoint_score_order="min"
                ),
            ),
        ).fit()
        entry.update(json.loads(Path(result_file).read_text()), run_seconds=time.time() - t0)
        return summarise(entry, cuda)

    plan = harness.sizing.plan_for(NOTEBOOK, p)  # None: GLUE's notebook has no "will it fit?" plan
    runs = [attempt({"label": f"distilbert {p['TASK']}, {steps} steps", "plan": plan}, train)]
    header["total_seconds"] = time.time() - started
    write_result(
        Path(args.out) / f"{NOTEBOOK}.json", {"environment": environment(), "config": header, "runs": runs}
    )
    import ray

    ray.shutdown()
    shutil.rmtree(work, ignore_errors=True)  # the model and the run's files: the results are in --out


if __name__ == "__main__":
    main()
