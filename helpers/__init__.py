"""Shared plumbing for the notebooks: tiny local models, fixtures, a Ray that never hangs,
parameter checks, the observers that watch a run, results files, plots and MLflow tracking.

The distributed ideas themselves (ZeRO configs, FSDP policies, training loops) stay in the
notebooks; this package holds only set-up a learner should not have to wade through. The names below
are the ones the notebooks call; everything else lives in its module (`helpers.storage`,
`helpers.plan`, ...), and what no notebook calls is private to `helpers`.
"""

from . import checks, cluster, failures, fsdp, plan, storage, tracking  # the notebooks name these modules
from .cache import cache_dir
from .checks import check_cluster, check_parameters
from .cluster import gpus_for_one_task, start_ray
from .cost import run_cost
from .fixtures import ag_news_fixture, chat_fixture, glue_fixture, play_script_fixture
from .flops import model_flops_utilization
from .glue import GLUE_TASKS
from .memory import PeakRSS
from .metrics import GlueMetric
from .observe import Observer, Watch, lightning_observer, trainer_observer, watch
from .plots import plot_losses
from .results import Stopwatch, write_results
from .smoke import parameter_values, smoke_overrides
from .tiny_models import tiny_model
from .validate import ParameterError, choose_attention
from .zero_checkpoint import check_zero_checkpoint_workers, zero_rank_files

__all__ = [
    "GLUE_TASKS",
    "GlueMetric",
    "Observer",
    "ParameterError",
    "PeakRSS",
    "Stopwatch",
    "Watch",
    "ag_news_fixture",
    "cache_dir",
    "chat_fixture",
    "check_cluster",
    "check_parameters",
    "check_zero_checkpoint_workers",
    "checks",
    "choose_attention",
    "cluster",
    "failures",
    "fsdp",
    "glue_fixture",
    "gpus_for_one_task",
    "lightning_observer",
    "model_flops_utilization",
    "parameter_values",
    "plan",
    "play_script_fixture",
    "plot_losses",
    "run_cost",
    "smoke_overrides",
    "start_ray",
    "storage",
    "tiny_model",
    "tracking",
    "trainer_observer",
    "watch",
    "write_results",
    "zero_rank_files",
]
