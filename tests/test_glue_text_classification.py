"""GLUE notebook in smoke mode: HF Trainer on 2 Ray workers (DDP over gloo) learns every task shape.

Floors are set from measured smoke runs on the 2-core machine (in brackets), well above chance.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import execute, smoke_nbval

NAME = "glue_text_classification"


def _check_common(results: dict, task: str) -> None:
    assert results["notebook"] == NAME and results["smoke_test"] is True
    assert results["task"] == task and results["num_workers"] == 2
    losses = results["losses"]
    assert len(losses) >= 10 and losses[-1] < losses[0] - 0.2, losses
    # Ray Train's checkpoint holds the Hugging Face checkpoint the Trainer saved.
    hf_checkpoint = Path(results["checkpoint_path"]) / "checkpoint"
    assert (hf_checkpoint / "trainer_state.json").is_file()
    assert (hf_checkpoint / "model.safetensors").is_file()
    assert len(results["eval_history"]) == 5  # one evaluation per epoch


@pytest.mark.notebook
@pytest.mark.timeout(300)
def test_cola_default_task_validated_cell_by_cell(tmp_path):
    results, wall = smoke_nbval(NAME, tmp_path)
    _check_common(results, "cola")
    assert set(results["eval_metrics"]) == {"matthews_correlation"}
    assert results["eval_metrics"]["matthews_correlation"] >= 0.8  # chance: 0 [1.0]
    print(f"cola: {results['eval_metrics']}, {wall:.0f} s")


@pytest.mark.notebook
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "task, floors, split",
    [
        ("sst2", {"accuracy": 0.9}, "validation"),  # chance 0.5 [1.0]
        ("stsb", {"pearson": 0.8, "spearmanr": 0.8}, "validation"),  # regression, chance 0 [0.96, 0.94]
        ("mnli-mm", {"accuracy": 0.5}, "validation_mismatched"),  # 3 classes, chance 0.33 [0.68]
    ],
)
def test_task_learns_above_its_floor(task, floors, split):
    results, wall, error = execute(NAME, {"SMOKE_TEST": True, "TASK": task}, tag=task)
    assert error is None, error
    _check_common(results, task)
    assert results["eval_split"] == split
    assert set(results["eval_metrics"]) == set(floors)
    for name, floor in floors.items():
        assert results["eval_metrics"][name] >= floor, (name, results["eval_metrics"])
    print(f"{task}: {results['eval_metrics']}, {wall:.0f} s")
