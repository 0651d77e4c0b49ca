"""The notebooks' GPU paths (ci/gpu), on a machine with one CUDA GPU: `pytest -m gpu` (about 10 minutes).

Skipped where torch sees no CUDA device, as on CI. What the runs measured on an H200 is committed in
ci/gpu/results and shown in docs/gpu.md.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (ci/gpu/README.md)"),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu")
    env = {**os.environ, "OUT": str(out), "STATE": str(out / "state"), "PYTHON": sys.executable}
    subprocess.run(["bash", "ci/gpu/run.sh", "900"], cwd=ROOT, env=env, check=True, timeout=960)
    return out


def _runs(results, notebook):
    return json.loads((results / f"{notebook}.json").read_text())["runs"]


@pytest.mark.timeout(60)
def test_llama_trains_on_the_gpu_and_ray_costs_little(results):
    runs = {r["label"]: r for r in _runs(results, "llama_fsdp")}
    for run in runs.values():
        assert "error" not in run, run.get("error")
        assert run["attn_implementation"] in ("sdpa", "flash_attention_2")
    ray_s = runs["ray, activation checkpointing"]["steady_step_seconds"]
    torchrun_s = runs["torchrun, activation checkpointing"]["steady_step_seconds"]
    assert ray_s < 1.05 * torchrun_s  # the same function; Ray Train only starts it
    assert runs["ray, activation checkpointing"]["mfu"] > 0.2


@pytest.mark.timeout(120)
def test_the_plan_is_within_10_percent_of_what_torch_allocated(results):
    from ci.gpu.summary import plan_rows

    rows = [
        r
        for r in plan_rows(results)
        if r["notebook"] in ("llama_fsdp", "dolly_lightning_fsdp", "gpt2_deepspeed")
    ]
    assert any("offload=optimizer+params" in r["run"] for r in rows)  # ZeRO-3 with offload too
    for row in rows:
        assert abs(row["allocated_error"]) < 0.10, row


@pytest.mark.timeout(60)
def test_glue_and_dolly_run_on_cuda(results):
    (glue,) = _runs(results, "glue_text_classification")
    assert glue["checks"] == {"use_cpu_off": True, "model_on_cuda": True}
    dolly = _runs(results, "dolly_lightning_fsdp")
    assert any(r.get("device") == "cuda:0" and "error" not in r for r in dolly)
    assert any(r["label"] == "generation" and "error" not in r for r in dolly)


@pytest.mark.timeout(420)
def test_compiled_layers_beat_the_notebooks_eager_step_and_the_profile_adds_up(tmp_path):
    command = [sys.executable, "-m", "ci.gpu.llama_step", "--out", str(tmp_path), "--budget", "250"]
    # The script puts ci/gpu and the repo on its own path.
    subprocess.run(command, cwd=ROOT, check=True, timeout=400)
    variants = json.loads((tmp_path / "llama_step.json").read_text())["variants"]
    notebook, compiled = variants[0], variants[1]
    assert "error" not in notebook and "error" not in compiled, (notebook, compiled)
    # On an H100: 2.74 s eager against 2.07 s with each decoder layer compiled.
    assert compiled["steady_step_seconds"] < 0.9 * notebook["steady_step_seconds"]
    profile = notebook["profile"]
    assert 0 < profile["gpu_busy_seconds"] <= profile["step_seconds"]
    assert profile["kernel_share_by_kind"]["matrix products"] > 0.25  # 0.39 on an H100
