"""What the lessons call: the top floor of three, and the only one a notebook names.

- `helpers` (here): the Set up call (`check_parameters`, `ray_init_args`, `check_cluster`), the recipes'
  code that more than one notebook runs (`llama_recipe`, `fsdp`'s Lightning strategy, `zero_checkpoint`),
  plots, and the names the notebooks call from the floors below.
- `harness`, the run machinery: the checks behind Set up, starting and attaching to Ray, storage with
  deadlines (`storage`), the observers and the run log (`watch`), MLflow (`show_run`), results, smoke mode,
  the drills of `operating_a_run` (`drills`), the notebooks' rules and the "will it fit?" plans (`sizing`).
- `basics`, which imports nothing else of the project: parameter validation (`ParameterError`), the
  planner's arithmetic (`plan`, `run_cost`), the meters (`PeakRSS`, `GlueMetric`), the cluster's nodes
  (`cluster`).

Each floor imports only the floors below it (a test holds them to it). The distributed ideas themselves (ZeRO
configs, FSDP policies, training loops) stay in the notebooks.
"""

from basics import cluster, plan
from basics.cluster import gpus_for_one_task
from basics.cost import run_cost
from basics.glue import GLUE_TASKS
from basics.memory import PeakRSS
from basics.metrics import GlueMetric
from basics.parameters import check_packed
from basics.validate import ParameterError, choose_attention
from harness import drills, sizing, storage
from harness.cache import local_storage
from harness.observe import Observer, lightning_observer, trainer_observer, watch
from harness.results import write_results
from harness.tracking import show_run

from . import fsdp, zero_checkpoint
from .notebook import (
    check_cluster,
    check_parameters,
    elapsed,
    parameter_values,
    ray_init_args,
    ray_log_file,
    use_smoke_values,
)
from .plots import plot_losses
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
    "elapsed",
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
