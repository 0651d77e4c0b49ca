"""What the notebooks call: set-up, parameter checks, the observers that watch a run, storage for
checkpoints and results, the "Will it fit?" planner, plots and MLflow tracking.

The distributed ideas themselves (ZeRO configs, FSDP policies, training loops) stay in the
notebooks; this package holds only set-up a learner should not have to wade through. The names below
are the ones the notebooks call; everything else lives in its module (`helpers.storage`,
`helpers.plan`, ...). The run machinery behind them (smoke mode, the run log, the results contract) is
the `harness` package.
"""

from harness.results import save_results, write_results

from . import (
    checks,
    cluster,
    fsdp,
    observe,
    plan,
    storage,
    tracking,
    zero_checkpoint,
)
from .cluster import gpus_for_one_task
from .cost import run_cost
from .glue import GLUE_TASKS
from .memory import PeakRSS
from .metrics import GlueMetric
from .notebook import set_up
from .observe import Observer, lightning_observer, trainer_observer, watch
from .plots import plot_losses
from .smoke import parameter_values
from .validate import ParameterError, choose_attention
from .zero_checkpoint import zero_checkpoint_folder

__all__ = [
    # modules: the notebooks name checks, cluster, fsdp, plan, storage and tracking
    "cluster",
    "observe",
    "zero_checkpoint",
    # what the notebooks call
    "GLUE_TASKS",
    "GlueMetric",
    "Observer",
    "ParameterError",
    "PeakRSS",
    "checks",
    "choose_attention",
    "fsdp",
    "gpus_for_one_task",
    "lightning_observer",
    "parameter_values",
    "plan",
    "plot_losses",
    "run_cost",
    "save_results",
    "set_up",
    "storage",
    "tracking",
    "trainer_observer",
    "watch",
    "write_results",
    "zero_checkpoint_folder",
]
