"""What the lessons call: the Set up call, checkpoints in storage, FSDP and ZeRO pieces, the "Will it fit?"
planner (`plan`, `sizing`, `cost`), meters and plots.

The distributed ideas themselves (ZeRO configs, FSDP policies, training loops) stay in the notebooks. The
names below are the ones the notebooks call; everything else lives in its module (`helpers.storage`,
`helpers.plan`, ...). The run machinery behind them (the Set up cell's checks, starting Ray, storage
deadlines, the observers, MLflow tracking, results, smoke mode) is the `harness` package; the names the
notebooks call from it (`watch`, the observers, `show_run`, `write_results`, `drills`) are here too.
"""

from harness import drills
from harness.cache import local_storage
from harness.observe import Observer, lightning_observer, trainer_observer, watch
from harness.results import write_results
from harness.tracking import show_run

from . import (
    cluster,
    fsdp,
    plan,
    sizing,
    storage,
    zero_checkpoint,
)
from .cluster import gpus_for_one_task
from .cost import run_cost
from .glue import GLUE_TASKS
from .memory import PeakRSS
from .metrics import GlueMetric
from .notebook import (
    check_cluster,
    check_parameters,
    parameter_values,
    ray_init_args,
    ray_log_file,
    use_smoke_values,
)
from .plots import plot_losses
from .validate import ParameterError, check_packed, choose_attention
from .zero_checkpoint import fetch_zero_checkpoint


def tiny_model(arch: str, **overrides) -> str:
    """Smoke mode's model: a 2-layer `arch` ("distilbert", "gpt2", "gpt_neox", "llama") with its tokenizer,
    built locally once and kept in this project's cache; returns its folder (`harness.tiny_models`)."""
    from harness.tiny_models import tiny_model as build

    return build(arch, **overrides)


def glue_fixture() -> str:
    """Smoke mode's GLUE: parquet files in the Hub's layout, 512 training and 127 validation rows per task,
    labels that follow word cues; returns the folder (`harness.fixtures`)."""
    from harness.fixtures import glue_fixture as build

    return build()


def ag_news_fixture() -> str:
    """Smoke mode's `ag_news`: headlines from templates, train and test splits (`harness.fixtures`)."""
    from harness.fixtures import ag_news_fixture as build

    return build()


def play_script_fixture() -> str:
    """Smoke mode's `tiny_shakespeare`: a play's speeches, one text (`harness.fixtures`)."""
    from harness.fixtures import play_script_fixture as build

    return build()


def chat_fixture() -> str:
    """Smoke mode's code-chat dataset: short chats in the Llama recipe's format (`harness.fixtures`)."""
    from harness.fixtures import chat_fixture as build

    return build()


__all__ = [
    # modules: the notebooks name cluster, fsdp, plan, sizing and storage
    "cluster",
    "drills",
    "zero_checkpoint",
    # what the notebooks call
    "GLUE_TASKS",
    "GlueMetric",
    "Observer",
    "ParameterError",
    "PeakRSS",
    "check_packed",
    "choose_attention",
    "fsdp",
    "gpus_for_one_task",
    "lightning_observer",
    "plan",
    "sizing",
    "plot_losses",
    "run_cost",
    "use_smoke_values",
    "check_parameters",
    "check_cluster",
    "ray_init_args",
    "ray_log_file",
    "parameter_values",
    "local_storage",
    "tiny_model",
    "glue_fixture",
    "ag_news_fixture",
    "play_script_fixture",
    "chat_fixture",
    "show_run",
    "storage",
    "trainer_observer",
    "watch",
    "write_results",
    "fetch_zero_checkpoint",
]
