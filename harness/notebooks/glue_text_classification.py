"""glue_text_classification: the HF `Trainer` on Ray Train workers fed by Ray Data."""

from __future__ import annotations

import json
import math

from helpers.validate import ParameterError, check_choice, check_int

from . import check_common, run_settings, section_run

# These two checkpoints would load at any world size (DDP's is whole; Dolly's sharded one goes through DCP);
# what ties them to NUM_WORKERS is how the data is fed.
ELASTIC_REFUSED = (
    "its checkpoint would load on any number of workers, but the Trainer's steps "
    "per epoch are counted for NUM_WORKERS workers (a Ray Data shard has no length), and after a resume the "
    "Trainer finds its place by skipping batches of its own shard: on fewer workers the global batch and "
    "that place would change. The Llama notebook shows a loop that keeps both"
)
plan_recipe = None  # the models fit any GPU

# Its smoke run's time budget in the tests (nbval, JupyterLab): see tests/notebook_runs.py.
SMOKE_BUDGET_S = 400  # 298 s beside other work on the AVX2 machine


def check(p: dict) -> None:
    """The parameters cell's values `p`, by this notebook's rules; a ParameterError names the first bad one."""
    from helpers.glue import GLUE_TASKS

    check_choice("TASK", p["TASK"], GLUE_TASKS)
    check_int("NUM_EPOCHS", p["NUM_EPOCHS"], minimum=1)
    value = p["WEIGHT_DECAY"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ParameterError(f"WEIGHT_DECAY={value!r}: must be a finite number >= 0.")
    check_common(p)


def smoke(namespace: dict) -> dict:
    """Smoke mode's table: `{parameter: (the full-scale default, the laptop value)}`."""
    from harness.fixtures import glue_fixture
    from harness.tiny_models import tiny_model

    return {
        "MODEL_NAME": ("distilbert-base-uncased", tiny_model("distilbert")),  # 2 layers
        "GLUE_PATH": ("hf://datasets/nyu-mll/glue", glue_fixture()),  # the Hub's layout
        "NUM_WORKERS": (1, 2),
        "CPUS_PER_WORKER": (2, 1),
        "NUM_EPOCHS": (2, 5),  # 16 steps each
        "LEARNING_RATE": (2e-5, 2e-3),  # random weights need far bigger steps than fine-tuning
        **run_settings(21),  # "When a worker dies": its second epoch, after the step-16 checkpoint
    }


def results(ns: dict) -> dict:
    """The run's numbers, from the notebook's globals once "What the run showed" has run."""
    from harness.storage import uri

    watch, eval_log, best = ns["watch"], ns["eval_log"], ns["best_checkpoint"]
    metric = f"eval_{ns['glue_task'].metric}"
    return {
        "losses": ns["losses"],
        "checkpoint_path": uri(best.filesystem, best.path),  # the kept one: the best by the task's metric
        "best_step": ns["best_metrics"]["step"],
        "task": ns["TASK"],
        "eval_split": ns["glue_task"].validation_split,
        "metrics": ns["metrics"],  # the kept checkpoint's, every metric of the task
        "eval_metrics": {e["step"]: e[metric] for e in eval_log},  # the task's metric at each evaluation
        "eval_rows": ns["evaluated_rows"],
        "evaluated_rows": ns["evaluated_rows"],  # equal to validation_rows: the metric is the whole split's
        "validation_rows": ns["validation_rows"],
        "eval_history": _eval_history(eval_log),
        "num_workers": ns["NUM_WORKERS"],
        "worker_node_ids": [r["node_id"] for r in watch.ranks()],
        "attempts": watch.attempts(),
        "kill": None,
        "worker_dies": _worker_dies(ns),
        "mlflow_run_id": watch.mlflow_run_id,
    }


def _eval_history(log_history: list[dict]) -> list[dict]:
    """Each evaluation's `eval_*` numbers, from a `trainer_state.json`'s `log_history`."""
    return [{k: v for k, v in e.items() if k.startswith("eval_")} for e in log_history if "eval_loss" in e]


def _worker_dies(ns: dict) -> dict | None:
    """ "When a worker dies"'s run, with its epochs and its evaluations (read from its latest checkpoint's
    `trainer_state.json`: the restored epoch is evaluated again)."""
    run = section_run(ns, "glue_text_classification")
    if run is None:
        return None
    checkpoint = ns["killed_run"].checkpoint
    with checkpoint.filesystem.open_input_stream(f"{checkpoint.path}/checkpoint/trainer_state.json") as f:
        log_history = json.loads(f.read())["log_history"]
    return {**run, "num_epochs": ns["DEMO_EPOCHS"], "eval_history": _eval_history(log_history)}
