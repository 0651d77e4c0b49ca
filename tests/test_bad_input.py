"""Invalid parameters fail in the first cells, fast, naming the parameter and what is allowed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from notebook_runs import ARTIFACTS, CANARY_STORAGE_SECRET, execute
from set_up_cells import SETS_UP

import harness.fixtures
import harness.tiny_models


def _tiny_gpt2():
    return harness.tiny_models.tiny_model("gpt2")


def _batch_size_cases(a_parameter: str) -> dict:
    """A bad batch size passed in smoke mode is checked (smoke mode keeps a value passed), and the old name
    `BATCH_SIZE` fails, listing the parameters (`a_parameter` is one of them), where papermill alone would
    warn and train with the default."""
    return {
        "batch_size_0": (
            {"SMOKE_TEST": True, "BATCH_SIZE_PER_WORKER": 0},
            "ParameterError",
            ["BATCH_SIZE_PER_WORKER=0", "at least 1"],
        ),
        "old_name_batch_size": (
            {"SMOKE_TEST": True, "BATCH_SIZE": 4},
            "ParameterError",
            ["Unknown parameter", "BATCH_SIZE (did you mean BATCH_SIZE_PER_WORKER?)", a_parameter],
        ),
    }


# (parameters, expected exception name, words the message must contain)
CASES = {
    "zero_stage_4": ({"SMOKE_TEST": True, "ZERO_STAGE": 4}, "ParameterError", ["ZERO_STAGE=4", "0, 1, 2, 3"]),
    # NUM_WORKERS=0 is refused by the check every notebook shares (harness.notebooks.check_common): run here only.
    "no_workers": ({"SMOKE_TEST": True, "NUM_WORKERS": 0}, "ParameterError", ["NUM_WORKERS=0", "at least 1"]),
    # It names the run's folder in the bucket: "../x" would put the run outside STORAGE_PATH.
    "experiment_prefix_path": (
        {"SMOKE_TEST": True, "EXPERIMENT_PREFIX": "../x"},
        "ParameterError",
        ["EXPERIMENT_PREFIX='../x'", "no '/'"],
    ),
    # A node lost, the run to go on with fewer workers: ZeRO's per-rank checkpoint files cannot.
    "min_workers_refused": (
        {"SMOKE_TEST": True, "MIN_WORKERS": 1},
        "ParameterError",
        ["MIN_WORKERS=1", "cannot continue on fewer workers", "world size"],
    ),
    **_batch_size_cases("MAX_STEPS_PER_EPOCH"),
    "unknown_offload": (
        {"SMOKE_TEST": True, "OFFLOAD": "gpu"},
        "ParameterError",
        ["OFFLOAD='gpu'", "'none'", "'optimizer+params'"],
    ),
    "offload_params_needs_stage_3": (
        {"SMOKE_TEST": True, "ZERO_STAGE": 2, "OFFLOAD": "optimizer+params"},
        "ParameterError",
        ["OFFLOAD='optimizer+params' needs ZERO_STAGE=3", "ZERO_STAGE=2"],
    ),
    "fp16_on_cpu": (
        {"SMOKE_TEST": True, "PRECISION": "fp16"},
        "ParameterError",
        ["PRECISION='fp16'", "USE_GPU"],
    ),
    "max_seq_len_too_long": (
        {"MAX_SEQ_LEN": 4096, "MODEL_NAME": _tiny_gpt2, "USE_GPU": False},
        "ParameterError",
        ["MAX_SEQ_LEN=4096", "128 positions"],
    ),
    "unknown_dataset_offline": (
        {
            "DATASET_NAME": "no-such-org/no-such-dataset",
            "MODEL_NAME": _tiny_gpt2,
            "MAX_SEQ_LEN": 64,
            "USE_GPU": False,
        },
        "ParameterError",
        ["DATASET_NAME='no-such-org/no-such-dataset'", "offline"],
    ),
    "unsupported_storage": (
        {"SMOKE_TEST": True, "STORAGE_PATH": "ftp://example.org/runs"},
        "ParameterError",
        ["STORAGE_PATH='ftp://example.org/runs'", "s3://", "unsupported"],
    ),
    "missing_bucket": (
        {"SMOKE_TEST": True, "STORAGE_PATH": "s3://no-such-bucket/runs"},
        "ParameterError",
        ["STORAGE_PATH='s3://no-such-bucket/runs'", "does not exist", "AWS_ENDPOINT_URL"],
    ),
    "gpus_that_do_not_exist": (
        {
            "NUM_WORKERS": 16,
            "USE_GPU": True,
            "CLUSTER": {"g5.12xlarge": 4},  # the plan passes; the Ray cluster here has no GPU
            "MODEL_NAME": _tiny_gpt2,
            "MAX_SEQ_LEN": 64,
            "DATASET_NAME": harness.fixtures.ag_news_fixture,
        },
        "ResourceRequestError",
        ["NUM_WORKERS=16", "USE_GPU=True", "16 GPUs", "SMOKE_TEST"],
    ),
}


# GLUE and Dolly refuse an elastic run: their checkpoints would load, but the global batch and the place in
# the data after a resume would change with the world size.
_MIN_WORKERS_REFUSED = (
    {"SMOKE_TEST": True, "MIN_WORKERS": 1},
    "ParameterError",
    ["MIN_WORKERS=1", "cannot continue on fewer workers", "global batch", "NUM_WORKERS=2"],
)

GLUE_CASES = {
    "unknown_task": ({"SMOKE_TEST": True, "TASK": "squad"}, "ParameterError", ["TASK='squad'", "'mnli-mm'"]),
    "min_workers_refused": _MIN_WORKERS_REFUSED,
    "missing_checkpoint_offline": (
        {"MODEL_NAME": "no-such-org/no-such-bert", "USE_GPU": False},
        "ParameterError",
        ["MODEL_NAME='no-such-org/no-such-bert'", "offline"],
    ),
    "hub_data_offline": (
        {"MODEL_NAME": lambda: harness.tiny_models.tiny_model("distilbert"), "USE_GPU": False},
        "ParameterError",
        ["GLUE_PATH='hf://datasets/nyu-mll/glue'", "offline"],
    ),
}


def _tiny_neox():
    return harness.tiny_models.tiny_model("gpt_neox")


# Explicit CPU settings, so that each case fails on the one parameter it names.
_DOLLY_CPU = {"MODEL_NAME": _tiny_neox, "USE_GPU": False, "PRECISION": "bf16-mixed", "CPU_OFFLOAD": False}
# The checks every notebook shares (a batch size, a misspelt or old name, GPUs the cluster does not have)
# run once, for GPT-2 above; each notebook's cases are its own checks.
DOLLY_CASES = {
    "min_workers_refused": _MIN_WORKERS_REFUSED,
    "unknown_precision": (
        {"SMOKE_TEST": True, "PRECISION": "fp8"},
        "ParameterError",
        ["PRECISION='fp8'", "'bf16-mixed'", "'16-mixed'"],
    ),
    "max_seq_len_too_long": (
        {**_DOLLY_CPU, "MAX_SEQ_LEN": 4096},
        "ParameterError",
        ["MAX_SEQ_LEN=4096", "256 positions"],
    ),
    "fp16_on_cpu": (
        {**_DOLLY_CPU, "PRECISION": "16-mixed"},
        "ParameterError",
        ["PRECISION='16-mixed'", "USE_GPU"],
    ),
    # The real dolly-v2-7b, planned offline from its shipped config: 7B over 4 T4s without offload needs
    # 16 bytes x 6.86e9 / 4 = 27 GB of shards per 16 GB GPU.
    "plan_refuses_7b_on_4_t4s": (
        {"CPU_OFFLOAD": False, "NUM_WORKERS": 4, "CLUSTER": {"g4dn.4xlarge": 4}},
        "ParameterError",
        ["does not fit", "training (T4 GPU)", "CPU_OFFLOAD=True", "NUM_WORKERS"],
    ),
    # The full-scale defaults: the plan prints (and passes), then the first cell that needs the Hub stops.
    "full_scale_plans_then_needs_the_hub": (
        {},
        "ParameterError",
        ["MODEL_NAME='databricks/dolly-v2-7b'", "offline"],
    ),
}


# A bad parameter is refused in the Set up cell, within REJECTED_WITHIN_S (measured on a fresh clone, three runs
# at a time: at most 28 s; 64-75 s on a 2-core AVX2 machine beside other work, 2026-11-28; docs/testing.md,
# "Time budgets"). Each run, and each test's wait for its own run, has that budget twice over.
REJECTED_WITHIN_S = 150
RUN_BUDGET_S = 2 * REJECTED_WITHIN_S


def _storage_credentials_case():
    # Given as a user sets it, in the environment: a bucket URI with keys in it (the secret has a "/", as
    # AWS secret keys can).
    return {"STORAGE_PATH": f"s3://canarykey:{CANARY_STORAGE_SECRET}/x@llm-notebooks/runs"}


def _closed_tracking_port():
    # A port nothing listens on.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{s.getsockname()[1]}"}


# Cases given through the kernel's environment, not parameters: (notebook, parameters, environment).
ENV_CASES = {
    "storage_credentials": ("gpt2_deepspeed", {"SMOKE_TEST": True}, _storage_credentials_case),
    "tracking_uri": ("glue_text_classification", {"SMOKE_TEST": True}, _closed_tracking_port),
}


# The cases that run in a real kernel, through papermill: one refusal per notebook, which proves that its Set
# up cell stops the run; the names papermill injects (only a kernel's history has them); the refusals that
# come after the Set up cell (the Hub, offline) or from the Ray cluster; and the cases whose executed notebook a
# test reads. Every other case runs the notebook's parameters and Set up cells in one shared interpreter
# (tests/set_up_cells.py): a kernel each cost about 60 s of the suite's wall time.
IN_A_KERNEL = {
    ("gpt2_deepspeed", "zero_stage_4"),
    ("gpt2_deepspeed", "old_name_batch_size"),
    ("gpt2_deepspeed", "unknown_dataset_offline"),
    ("gpt2_deepspeed", "gpus_that_do_not_exist"),
    ("glue_text_classification", "unknown_task"),
    ("glue_text_classification", "missing_checkpoint_offline"),
    ("glue_text_classification", "hub_data_offline"),
    ("dolly_lightning_fsdp", "unknown_precision"),
    ("dolly_lightning_fsdp", "full_scale_plans_then_needs_the_hub"),
    ("llama_fsdp", "misspelt_name"),
    ("llama_fsdp", "full_scale_plans_then_needs_the_hub"),
    ("llama_lora", "lora_rank_0"),
    ("operating_a_run", "one_worker"),
    ("gpt2_deepspeed", "kill_in_a_lesson_notebook"),  # an unknown name: only a kernel's history has it
}


@dataclass
class SetUpError:
    """A refusal seen by tests/set_up_cells.py, shaped as papermill's error: its exception's name and text."""

    ename: str
    evalue: str


def _set_up_cells(cases: list, cluster) -> dict:
    """Run `cases` [(notebook, case, parameters)] through tests/set_up_cells.py in one interpreter, with a
    kernel's environment and working folder; {(notebook, case): execute()'s (None, wall, error)}."""
    import json
    import subprocess
    import sys
    import tempfile

    from notebook_runs import NOTEBOOKS, notebook_env

    with tempfile.TemporaryDirectory(prefix="set-up-cells-") as tmp:
        given, got = f"{tmp}/cases.json", f"{tmp}/results.json"
        Path(given).write_text(json.dumps([{"notebook": n, "case": c, "parameters": p} for n, c, p in cases]))
        subprocess.run(
            [sys.executable, str(Path(__file__).with_name("set_up_cells.py")), given, got],
            cwd=NOTEBOOKS,
            env=notebook_env(cluster),
            check=True,
            timeout=RUN_BUDGET_S,
        )
        results = json.loads(Path(got).read_text())
    return {
        (n, c): (None, r["wall"], SetUpError(r["ename"], r["evalue"]) if r["ename"] else None)
        for (n, c), r in ((tuple(key.split("/")), r) for key, r in results.items())
    }


@pytest.fixture(scope="module")
def rejections(ray_cluster):
    """Start every case and hand the tests {(notebook, case): future}; each test waits for its own run only,
    under its own budget, while the next ones run.

    The cases in IN_A_KERNEL and ENV_CASES run three kernels at a time (each mostly a kernel starting and
    importing, 2-20 s; three keep both cores busy). Each kernel gets the cluster's variables (and its case's)
    as its own environment: the runs never change this process's. The other cases run first, in one
    interpreter.
    """
    from concurrent.futures import ThreadPoolExecutor

    runs = [
        (notebook, case, {k: v() if callable(v) else v for k, v in params.items()}, {})
        for notebook, table in (
            ("gpt2_deepspeed", CASES),
            ("glue_text_classification", GLUE_CASES),
            ("dolly_lightning_fsdp", DOLLY_CASES),
            ("llama_fsdp", LLAMA_CASES),
            ("llama_lora", LORA_CASES),
            ("operating_a_run", {k: v for k, v in OPS_CASES.items() if k != "kill_in_a_lesson_notebook"}),
            ("gpt2_deepspeed", {"kill_in_a_lesson_notebook": OPS_CASES["kill_in_a_lesson_notebook"]}),
        )
        for case, (params, _, _) in table.items()
    ]
    in_process = [(n, c, p) for n, c, p, _ in runs if (n, c) not in IN_A_KERNEL]
    runs = [r for r in runs if (r[0], r[1]) in IN_A_KERNEL]
    runs += [(notebook, case, params, env()) for case, (notebook, params, env) in ENV_CASES.items()]
    pool = ThreadPoolExecutor(max_workers=3)
    batch = pool.submit(_set_up_cells, in_process, ray_cluster)
    futures = {
        (notebook, case): pool.submit(
            execute, notebook, params, f"bad-{case}", cluster=ray_cluster, budget_s=RUN_BUDGET_S, env=env
        )
        for notebook, case, params, env in runs
    }
    yield Rejections(futures, batch, {case: env for _, case, _, env in runs if env})
    pool.shutdown(wait=True, cancel_futures=True)  # what a failed test left running ends within its budget
    # Each run's own time, for the budgets above (docs/testing.md, "Time budgets").
    walls = sorted(
        (future.result()[1], notebook, f"{case} (kernel)")
        for (notebook, case), future in futures.items()
        if future.done() and not future.cancelled() and future.exception() is None
    )
    if batch.done() and batch.exception() is None:
        walls += [(wall, notebook, case) for (notebook, case), (_, wall, _) in batch.result().items()]
    lines = [f"{wall:.1f}\t{notebook}\t{case}" for wall, notebook, case in sorted(walls, reverse=True)]
    (ARTIFACTS / "bad-input-walls.tsv").write_text("\n".join(lines) + "\n")


@dataclass
class Rejections:
    futures: dict  # (notebook, case): the future of execute()'s (results, wall, error)
    batch: object  # the future of _set_up_cells()'s {(notebook, case): (None, wall, error)}
    env: dict  # case: the variables its kernel got (ENV_CASES)

    def result(self, notebook: str, case: str) -> tuple:
        """The case's run, waited for under the calling test's own budget (RUN_BUDGET_S and a margin): the
        runs start in the tests' order, three at a time, so a test waits for no run but its own."""
        if (notebook, case) in self.futures:
            return self.futures[(notebook, case)].result()
        return self.batch.result()[(notebook, case)]


def _check_rejected(rejections, notebook, case, params, ename, words):
    results, wall, error = rejections.result(notebook, case)
    assert error is not None and results is None, f"{notebook}: {case} was not refused in the Set up cell"
    assert getattr(error, "ename", None) == ename, error
    for word in words:
        assert word in error.evalue, (word, error.evalue)
    assert wall < REJECTED_WITHIN_S, (
        f"{notebook} took {wall:.0f} s to reject {case} ({REJECTED_WITHIN_S} s allowed)"
    )


# The operations notebook: each section's hazard must be one it can show.
OPS_CASES = {
    # The killed worker with no restart allowed would end its run instead of showing the resume.
    "kill_without_restarts": (
        {"SMOKE_TEST": True, "MAX_FAILURES": 0},
        "ParameterError",
        ["MAX_FAILURES=0", "no restart to show"],
    ),
    "one_worker": ({"SMOKE_TEST": True, "NUM_WORKERS": 1}, "ParameterError", ["NUM_WORKERS=1", "at least 2"]),
    # Before the first checkpoint (smoke SAVE_STEPS 4): a restart from the start would show no resume.
    "notice_before_the_first_checkpoint": (
        {"SMOKE_TEST": True, "NOTICE_AT_STEP": 3},
        "ParameterError",
        ["NOTICE_AT_STEP=3", "at least 5"],
    ),
    # Elastic at full scale: after losing workers, 7B on one A100-40GB does not fit.
    "min_workers_that_cannot_fit": (
        {"MIN_WORKERS": 1},
        "ParameterError",
        ["MIN_WORKERS=1", "does not fit", "training (A100-40GB GPU)", "Raise MIN_WORKERS"],
    ),
    "resize_check_0": (
        {"SMOKE_TEST": True, "RESIZE_CHECK_S": 0},
        "ParameterError",
        ["RESIZE_CHECK_S=0", "at least 1"],
    ),
    "short_save_steps_0": (
        {"SMOKE_TEST": True, "SHORT_SAVE_STEPS": 0},
        "ParameterError",
        ["SHORT_SAVE_STEPS=0", "at least 1"],
    ),
    # The lesson notebooks have no planned kill any more: a batch job that still passes one is told so.
    "kill_in_a_lesson_notebook": (
        {"SMOKE_TEST": True, "KILL_WORKER_AT_STEP": 5},
        "ParameterError",
        ["Unknown parameter", "KILL_WORKER_AT_STEP (a killed worker", "operating_a_run"],
    ),
}


@pytest.mark.timeout(RUN_BUDGET_S + 10)
@pytest.mark.parametrize("case", list(OPS_CASES))
def test_operating_a_run_rejects(case, rejections):
    notebook = "gpt2_deepspeed" if case == "kill_in_a_lesson_notebook" else "operating_a_run"
    _check_rejected(rejections, notebook, case, *OPS_CASES[case])


@pytest.mark.timeout(RUN_BUDGET_S + 10)
@pytest.mark.parametrize("case", list(CASES))
def test_gpt2_deepspeed_rejects(case, rejections):
    _check_rejected(rejections, "gpt2_deepspeed", case, *CASES[case])


@pytest.mark.timeout(RUN_BUDGET_S + 10)
@pytest.mark.parametrize("case", list(GLUE_CASES))
def test_glue_rejects(case, rejections):
    _check_rejected(rejections, "glue_text_classification", case, *GLUE_CASES[case])


@pytest.mark.timeout(RUN_BUDGET_S + 10)
@pytest.mark.parametrize("case", list(DOLLY_CASES))
def test_dolly_rejects(case, rejections):
    _check_rejected(rejections, "dolly_lightning_fsdp", case, *DOLLY_CASES[case])


def _tiny_llama():
    return harness.tiny_models.tiny_model("llama")


_LLAMA_CPU = {"MODEL_NAME": _tiny_llama, "USE_GPU": False, "USE_FLASH_ATTN": False}
LLAMA_CASES = {
    "save_steps_0": ({"SMOKE_TEST": True, "SAVE_STEPS": 0}, "ParameterError", ["SAVE_STEPS=0", "at least 1"]),
    "misspelt_name": (
        {"SMOKE_TEST": True, "MAX_STEP": 8},
        "ParameterError",
        ["Unknown parameter", "MAX_STEP (did you mean MAX_STEPS?)"],
    ),
    "unreachable_bucket": (
        # The bucket's endpoint is a closed port: the check names what it tried, within seconds.
        {
            "SMOKE_TEST": True,
            "STORAGE_PATH": "s3://llm-notebooks/runs?endpoint_override=127.0.0.1:9&scheme=http",
        },
        "ParameterError",
        ["STORAGE_PATH='s3://llm-notebooks/runs?endpoint_override=127.0.0.1:9", "cannot reach"],
    ),
    "max_seq_len_too_long": (
        {**_LLAMA_CPU, "MAX_SEQ_LEN": 4096},
        "ParameterError",
        ["MAX_SEQ_LEN=4096", "512 positions"],
    ),
    # A timeout past a week overflowed in every worker; the elastic check's interval was never checked.
    "collective_timeout_overflow": (
        {"SMOKE_TEST": True, "COLLECTIVE_TIMEOUT_S": 10**14},
        "ParameterError",
        ["COLLECTIVE_TIMEOUT_S=100000000000000", "at most 604800"],
    ),
    "warmup_ratio_1": (
        {"SMOKE_TEST": True, "WARMUP_RATIO": 1.0},
        "ParameterError",
        ["WARMUP_RATIO=1.0", "[0, 1)"],
    ),
    # Llama 2 70B planned offline: on one node of 8 A100-80GB the shards alone are 138 GB per GPU.
    "plan_refuses_70b_on_one_node": (
        {"NUM_WORKERS": 8, "CLUSTER": {"p4de.24xlarge": 1}},
        "ParameterError",
        ["does not fit", "training (A100-80GB GPU)", "NUM_WORKERS"],
    ),
    "full_scale_plans_then_needs_the_hub": (
        {},
        "ParameterError",
        ["MODEL_NAME='meta-llama/Llama-2-70b-chat-hf'", "offline"],
    ),
    # Its lesson's run has a fixed size: the elastic one is the operations notebook's.
    "min_workers_refused": (
        {"MIN_WORKERS": 8},
        "ParameterError",
        ["MIN_WORKERS=8", "cannot continue on fewer workers", "operating_a_run"],
    ),
}


@pytest.mark.timeout(RUN_BUDGET_S + 10)
@pytest.mark.parametrize("case", list(LLAMA_CASES))
def test_llama_rejects(case, rejections):
    _check_rejected(rejections, "llama_fsdp", case, *LLAMA_CASES[case])


# The LoRA notebook: rank 0 would be full fine-tuning, which is the other notebook's.
LORA_CASES = {
    "lora_rank_0": ({"SMOKE_TEST": True, "LORA_RANK": 0}, "ParameterError", ["LORA_RANK=0", "at least 1"]),
}


@pytest.mark.timeout(RUN_BUDGET_S + 10)
@pytest.mark.parametrize("case", list(LORA_CASES))
def test_llama_lora_rejects(case, rejections):
    _check_rejected(rejections, "llama_lora", case, *LORA_CASES[case])


# What each full-scale plan printed before the notebook stopped at the Hub: its GPU row and status.
FULL_SCALE_PLANS = {
    "dolly_lightning_fsdp": "training (T4 GPU) 39% (ok)",  # with CPU_OFFLOAD
    "llama_fsdp": "training (A100-80GB GPU) 98% (close)",  # it warns, it does not refuse
}


@pytest.mark.timeout(RUN_BUDGET_S + 10)
@pytest.mark.parametrize("notebook", list(FULL_SCALE_PLANS))
def test_full_scale_defaults_pass_the_plan_offline(notebook, rejections):
    import json

    rejections.result(notebook, "full_scale_plans_then_needs_the_hub")
    executed = (
        ARTIFACTS / "notebooks" / f"{notebook}-bad-full_scale_plans_then_needs_the_hub.ipynb"
    ).read_text()
    printed = "".join(  # the set-up cell, where helpers.check_parameters prints the plan's verdict
        "".join(o.get("text", ""))
        for cell in json.loads(executed)["cells"]
        for o in cell.get("outputs", [])
        if o["output_type"] == "stream"
    )
    assert "It fits: " + FULL_SCALE_PLANS[notebook] in printed, printed


@pytest.mark.timeout(RUN_BUDGET_S + 10)
def test_credentials_in_storage_path_are_refused_without_repeating_them(rejections):
    # Refused, naming STORAGE_PATH with the bucket and prefix readable and the credentials masked: in the
    # error, the smoke-mode table and the executed notebook.
    _, wall, error = rejections.result("gpt2_deepspeed", "storage_credentials")
    assert getattr(error, "ename", None) == "ParameterError", error
    assert "STORAGE_PATH='s3://***@llm-notebooks/runs'" in error.evalue, error.evalue
    assert "credentials in the URI" in error.evalue and "AWS_SECRET_ACCESS_KEY" in error.evalue
    executed = (ARTIFACTS / "notebooks" / "gpt2_deepspeed-bad-storage_credentials.ipynb").read_text()
    assert "s3://***@llm-notebooks/runs" in executed  # the smoke-mode table: "yours, kept"
    assert CANARY_STORAGE_SECRET not in executed and "canarykey" not in executed
    assert wall < REJECTED_WITHIN_S


@pytest.mark.timeout(RUN_BUDGET_S + 10)
def test_a_tracking_server_that_cannot_be_reached_fails_in_the_first_cells(rejections):
    # Refused in the Set up cell, naming MLFLOW_TRACKING_URI, before any training.
    import nbformat

    closed = rejections.env["tracking_uri"]["MLFLOW_TRACKING_URI"]
    _, wall, error = rejections.result("glue_text_classification", "tracking_uri")
    assert getattr(error, "ename", None) == "ParameterError", error
    assert f"MLFLOW_TRACKING_URI='{closed}': no tracking server answers there" in error.evalue, error.evalue
    executed = nbformat.read(ARTIFACTS / "notebooks" / "glue_text_classification-bad-tracking_uri.ipynb", 4)
    failed = [c for c in executed.cells if any(o.get("output_type") == "error" for o in c.get("outputs", []))]
    assert len(failed) == 1 and any(call in failed[0].source for call in SETS_UP)  # the Set up cell
    assert wall < REJECTED_WITHIN_S
