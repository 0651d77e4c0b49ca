"""The GLUE tasks: one table that the GLUE notebook, its metric and its smoke-mode fixture all read.

Used by "The tasks" section of glue_text_classification (and by `GlueMetric` and `glue_fixture`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GlueTask", "GLUE_TASKS"]


@dataclass(frozen=True)
class GlueTask:
    """One GLUE task, as its parquet files on the Hub (`nyu-mll/glue/<folder>/<split>-*.parquet`) lay it out."""

    name: str
    folder: str  # the data's folder: mnli-mm trains on MNLI's files
    text_columns: tuple[str, ...]  # one sentence, or a pair encoded together
    labels: tuple[str, ...] | None  # class names; None: a regression (a similarity score)
    metrics: tuple[str, ...]  # what `evaluate.load("glue", task)` reports; the first is the headline
    validation_split: str = "validation"
    test_split: str = "test"

    @property
    def num_labels(self) -> int:
        return len(self.labels) if self.labels else 1

    @property
    def metric(self) -> str:
        return self.metrics[0]


_NLI = ("entailment", "neutral", "contradiction")
# In the order the smoke fixture was first generated in (its seeds follow it).
GLUE_TASKS = {
    task.name: task
    for task in [
        GlueTask("cola", "cola", ("sentence",), ("unacceptable", "acceptable"), ("matthews_correlation",)),
        GlueTask("sst2", "sst2", ("sentence",), ("negative", "positive"), ("accuracy",)),
        GlueTask(
            "mrpc", "mrpc", ("sentence1", "sentence2"), ("not_equivalent", "equivalent"), ("accuracy", "f1")
        ),
        GlueTask(
            "qqp", "qqp", ("question1", "question2"), ("not_duplicate", "duplicate"), ("accuracy", "f1")
        ),
        GlueTask("stsb", "stsb", ("sentence1", "sentence2"), None, ("pearson", "spearmanr")),
        GlueTask(
            "mnli",
            "mnli",
            ("premise", "hypothesis"),
            _NLI,
            ("accuracy",),
            "validation_matched",
            "test_matched",
        ),
        GlueTask(
            "mnli-mm",
            "mnli",
            ("premise", "hypothesis"),
            _NLI,
            ("accuracy",),
            "validation_mismatched",
            "test_mismatched",
        ),
        GlueTask("qnli", "qnli", ("question", "sentence"), ("entailment", "not_entailment"), ("accuracy",)),
        GlueTask("rte", "rte", ("sentence1", "sentence2"), ("entailment", "not_entailment"), ("accuracy",)),
        GlueTask("wnli", "wnli", ("sentence1", "sentence2"), ("not_entailment", "entailment"), ("accuracy",)),
    ]
}
