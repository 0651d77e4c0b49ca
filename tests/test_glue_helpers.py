"""GLUE fixture and the offline GLUE metric, checked against scikit-learn / SciPy and by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

import basics.metrics
import harness.fixtures
import helpers

# ---- the metric: same names and values as evaluate's "glue" module ---------------------------


def test_glue_metric_names_match_evaluate():
    expected = {
        "cola": {"matthews_correlation"},
        "stsb": {"pearson", "spearmanr"},
        "mrpc": {"accuracy", "f1"},
        "qqp": {"accuracy", "f1"},
    }
    rng = np.random.default_rng(0)
    for task in basics.metrics.GLUE_METRICS:
        refs = rng.uniform(0, 5, 20) if task == "stsb" else rng.integers(0, 2, 20)
        preds = refs + rng.normal(0, 1, 20) if task == "stsb" else rng.integers(0, 2, 20)
        out = helpers.GlueMetric(task).compute(predictions=preds, references=refs)
        assert set(out) == expected.get(task, {"accuracy"}), task
        assert all(isinstance(v, float) for v in out.values())


def test_glue_metric_values_by_hand():
    # A confusion matrix with TP=3, TN=4, FP=1, FN=2 (10 samples).
    refs = [1, 1, 1, 1, 1, 0, 0, 0, 0, 0]
    preds = [1, 1, 1, 0, 0, 0, 0, 0, 0, 1]
    tp, tn, fp, fn = 3, 4, 1, 2
    mcc = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert helpers.GlueMetric("cola").compute(predictions=preds, references=refs) == {
        "matthews_correlation": pytest.approx(mcc)
    }
    out = helpers.GlueMetric("mrpc").compute(predictions=preds, references=refs)
    assert out == {"accuracy": pytest.approx(0.7), "f1": pytest.approx(2 * tp / (2 * tp + fp + fn))}
    # STS-B: Pearson of a linear relation is 1; Spearman only looks at ranks.
    x = np.array([0.0, 1.0, 2.0, 3.0, 4.0])
    out = helpers.GlueMetric("stsb").compute(predictions=2 * x + 1, references=x)
    assert out == {"pearson": pytest.approx(1.0), "spearmanr": pytest.approx(1.0)}
    out = helpers.GlueMetric("stsb").compute(predictions=x**3, references=x)
    assert out["spearmanr"] == pytest.approx(1.0) and out["pearson"] < 0.99


def test_glue_metric_agrees_with_scikit_learn_and_scipy():
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

    rng = np.random.default_rng(1)
    refs, preds = rng.integers(0, 2, 200), rng.integers(0, 2, 200)
    assert helpers.GlueMetric("cola").compute(predictions=preds, references=refs)[
        "matthews_correlation"
    ] == pytest.approx(matthews_corrcoef(refs, preds))
    out = helpers.GlueMetric("qqp").compute(predictions=preds, references=refs)
    assert out["accuracy"] == pytest.approx(accuracy_score(refs, preds))
    assert out["f1"] == pytest.approx(f1_score(refs, preds))
    refs3, preds3 = rng.integers(0, 3, 200), rng.integers(0, 3, 200)
    assert helpers.GlueMetric("mnli-mm").compute(predictions=preds3, references=refs3)[
        "accuracy"
    ] == pytest.approx(np.mean(refs3 == preds3))
    scores, guesses = rng.uniform(0, 5, 200), rng.uniform(0, 5, 200)
    out = helpers.GlueMetric("stsb").compute(predictions=guesses, references=scores)
    assert out["pearson"] == pytest.approx(pearsonr(guesses, scores)[0])
    assert out["spearmanr"] == pytest.approx(spearmanr(guesses, scores)[0])


def test_glue_metric_rejects_unknown_tasks_and_shapes():
    with pytest.raises(ValueError, match="task='glue'"):
        helpers.GlueMetric("glue")
    with pytest.raises(ValueError, match="differ"):
        helpers.GlueMetric("sst2").compute(predictions=[1, 0], references=[1, 0, 1])


# ---- the fixture: shaped like nyu-mll/glue --------------------------------------------------


def _split(task: str, split: str):
    import pyarrow.parquet as pq
    from datasets import Features

    table = pq.read_table(f"{harness.fixtures.glue_fixture()}/{task}/{split}-00000-of-00001.parquet")
    return table, Features.from_arrow_schema(table.schema)


def test_glue_fixture_has_every_task_with_real_columns_labels_and_splits():
    from pathlib import Path

    root = Path(harness.fixtures.glue_fixture())
    assert sorted(p.name for p in root.iterdir()) == sorted(harness.fixtures.GLUE_SCHEMAS)
    for task, (columns, names) in harness.fixtures.GLUE_SCHEMAS.items():
        splits = sorted(p.name.split("-")[0] for p in (root / task).glob("*.parquet"))
        if task == "mnli":
            assert splits == sorted(
                ["train", "validation_matched", "validation_mismatched", "test_matched", "test_mismatched"]
            )
        else:
            assert splits == ["test", "train", "validation"], task
        table, features = _split(task, "train")
        assert table.column_names == [*columns, "label", "idx"], task
        if names == "float":
            assert features["label"].dtype == "float32"
            labels = table.column("label").to_pylist()
            assert 0.0 <= min(labels) and max(labels) <= 5.0 and len(set(labels)) > 50
        else:
            assert features["label"].names == names, task
            assert set(table.column("label").to_pylist()) == set(range(len(names))), task
        test, _ = _split(task, "test_matched" if task == "mnli" else "test")
        assert set(test.column("label").to_pylist()) == {-1}  # GLUE hides its test labels
        # 127 validation rows, a prime: split between 2 (smoke mode) or any number of workers, they do not
        # divide evenly, so the GLUE notebook's tests see any row dropped or counted twice.
        for split in [s for s in splits if s.startswith("validation")]:
            assert _split(task, split)[0].num_rows == 127, (task, split)


def test_glue_fixture_mismatched_split_uses_other_words():
    matched, _ = _split("mnli", "validation_matched")
    mismatched, _ = _split("mnli", "validation_mismatched")
    words = lambda t: {w for s in t.column("premise").to_pylist() for w in s.lower().split()}  # noqa: E731
    assert len(words(mismatched) - words(matched)) > 10
