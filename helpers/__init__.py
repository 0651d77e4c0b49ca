"""Shared plumbing for the notebooks: tiny local models, fixtures, a Ray that never hangs,
parameter checks, sharding proofs, results files, plots and MLflow tracking.

The distributed ideas themselves (ZeRO configs, FSDP policies, training loops) stay in the
notebooks; this package holds only set-up a learner should not have to wade through.
"""

from . import tracking  # helpers.tracking: MLflow runs (start_run, StepLogger, ...)
from .cache import cache_dir
from .checks import check_cluster, check_parameters
from .cluster import (
    LOG_NOISE,
    ResourceRequestError,
    check_resources,
    check_storage_from_nodes,
    gpus_for_one_task,
    prefetch_model_on_nodes,
    start_ray,
    worker_log_path,
)
from .cost import INSTANCE_PRICES, run_cost
from .failures import kill_if_due, run_log, show_progress
from .fixtures import (
    AG_NEWS_LABELS,
    GLUE_SCHEMAS,
    ag_news_fixture,
    chat_fixture,
    glue_fixture,
    play_script_fixture,
)
from .flops import dense_peak_flops, model_flops_utilization
from .glue import GLUE_TASKS, GlueTask
from .memory import PeakRSS
from .metrics import GLUE_METRICS, GlueMetric
from .observe import Observer, Watch, lightning_observer, trainer_observer, watch
from .plots import plot_losses
from .results import REQUIRED_KEYS, Stopwatch, write_results
from .sharding import zero_partition_fraction, zero_state_bytes
from .smoke import check_parameter_names, parameter_values, smoke_overrides
from .storage import check_storage_path
from .tiny_models import TINY_ARCHS, tiny_model
from .validate import (
    ParameterError,
    check_choice,
    check_int,
    check_max_positions,
    check_positive,
    check_source_available,
    choose_attention,
    hub_offline,
    model_max_positions,
)
from .zero_checkpoint import check_zero_checkpoint_workers, zero_rank_files

__all__ = [
    "AG_NEWS_LABELS",
    "GLUE_METRICS",
    "GLUE_SCHEMAS",
    "GLUE_TASKS",
    "GlueTask",
    "GlueMetric",
    "Observer",
    "Watch",
    "watch",
    "lightning_observer",
    "trainer_observer",
    "PeakRSS",
    "INSTANCE_PRICES",
    "LOG_NOISE",
    "REQUIRED_KEYS",
    "TINY_ARCHS",
    "ParameterError",
    "ResourceRequestError",
    "Stopwatch",
    "ag_news_fixture",
    "cache_dir",
    "chat_fixture",
    "choose_attention",
    "dense_peak_flops",
    "glue_fixture",
    "hub_offline",
    "check_choice",
    "check_cluster",
    "check_parameters",
    "kill_if_due",
    "run_log",
    "show_progress",
    "worker_log_path",
    "check_parameter_names",
    "check_int",
    "check_max_positions",
    "check_positive",
    "check_resources",
    "gpus_for_one_task",
    "prefetch_model_on_nodes",
    "check_storage_from_nodes",
    "check_storage_path",
    "check_source_available",
    "model_max_positions",
    "model_flops_utilization",
    "parameter_values",
    "play_script_fixture",
    "plot_losses",
    "run_cost",
    "smoke_overrides",
    "start_ray",
    "tiny_model",
    "tracking",
    "write_results",
    "zero_partition_fraction",
    "zero_state_bytes",
    "check_zero_checkpoint_workers",
    "zero_rank_files",
]
