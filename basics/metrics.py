"""Evaluation metrics computed offline with scikit-learn and SciPy.

`evaluate.load("glue", task)` downloads the metric's code from the Hugging Face Hub when it is
called, so it fails offline (and in smoke mode). `GlueMetric` returns the same names and values
as that metric, from the same library calls it makes. Used by the "The training function" section of
glue_text_classification (`make_compute_metrics`).
"""

from __future__ import annotations

import numpy as np

from .glue import GLUE_TASKS

__all__ = ["GLUE_METRICS", "GlueMetric"]

# The metrics `evaluate`'s GLUE module reports for each task, by name (from the one task table).
GLUE_METRICS = {name: task.metrics for name, task in GLUE_TASKS.items()}


class GlueMetric:
    """`GlueMetric("cola").compute(predictions=..., references=...)`, like `evaluate.load("glue", "cola")`.

    Classification tasks take predicted class ids; stsb takes predicted similarity scores.
    """

    def __init__(self, task: str) -> None:
        if task not in GLUE_METRICS:
            raise ValueError(f"task={task!r}: must be one of {', '.join(GLUE_METRICS)}")
        self.task = task
        self.names = GLUE_METRICS[task]

    def compute(self, *, predictions, references) -> dict[str, float]:
        predictions, references = np.asarray(predictions), np.asarray(references)
        if predictions.shape != references.shape:
            raise ValueError(f"{predictions.shape=} and {references.shape=} differ")
        if self.task == "stsb":
            from scipy.stats import pearsonr, spearmanr

            return {
                "pearson": float(pearsonr(predictions, references)[0]),
                "spearmanr": float(spearmanr(predictions, references)[0]),
            }
        from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

        if self.task == "cola":
            return {"matthews_correlation": float(matthews_corrcoef(references, predictions))}
        out = {"accuracy": float(accuracy_score(references, predictions))}
        if "f1" in self.names:
            out["f1"] = float(f1_score(y_true=references, y_pred=predictions))
        return out
