"""`make run`'s report: summary.html (ci/run_summary.py) and the progress it prints while it works
(ci/run_notebooks.py's `Progress`), from synthetic results and real captured output lines. None of the
four notebooks runs: one tiny notebook goes through papermill and a real kernel (a few seconds) to check
the wiring (parameters injected, progress, the unfiltered log, the executed notebook on a failure).

summary.html is opened in headless Chromium (Debian's `chromium`, as in test_docs.py; skipped with a
reason where it is missing, unless CI=true): every notebook's section is shown, the loss curves decode,
nothing overflows at 1280 px. A screenshot is kept in test-artifacts/run-summary/summary.png.
"""

from __future__ import annotations

import base64
import functools
import json
import re
import sys
from pathlib import Path

import pytest
from browser import CHROMIUM_FLAGS, chromium_or_skip

from ci import run_notebooks, run_summary

ROOT = Path(__file__).resolve().parents[1]

SCREENSHOT = ROOT / "test-artifacts" / "run-summary" / "summary.png"


def _plan(need: int) -> dict:
    return {
        "rows": [
            {"what": "training (CPU worker's share of RAM)", "where": "per CPU worker", "need": need,
             "have": 12_638_251_008, "status": "ok"},
            {"what": "host RAM while loading", "where": "per node", "need": 2 * need, "have": 25_276_502_016,
             "status": "ok"},
            {"what": "checkpoints in storage (x1 kept)", "where": "storage", "need": need, "have": None,
             "status": ""},
        ],
        "device_bytes": need,
    }  # fmt: skip


def _attempts(losses: list[float], killed_at: int, resumed_from: int) -> list[dict]:
    first = {str(s): losses[s - 1] + 0.01 for s in range(1, killed_at)}
    second = {str(s): losses[s - 1] for s in range(resumed_from + 1, len(losses) + 1)}
    return [{"resumed_from_step": 0, "losses": first}, {"resumed_from_step": resumed_from, "losses": second}]


LLAMA_LOSSES = [6.4 - 0.22 * s for s in range(24)]
RESULTS = {  # the shape of the results each notebook writes (runs/*/NAME.json of a real run)
    "dolly_lightning_fsdp": {
        "notebook": "dolly_lightning_fsdp",
        "smoke_test": True,
        "losses": [6.13 * 0.975**s for s in range(78)],
        "final_loss": 0.6666,
        "param_shard_fraction": [0.5, 0.5],
        "param_dtypes": ["torch.float32"],
        "state_bytes": [{"param_bytes": 311808, "optimizer_bytes": 623616}] * 2,
        "plan": _plan(4_120_320),
        "kill": {
            "at_step": 60,
            "resumed_from_step": 39,
            "restarts": 1,
            "replayed_steps": list(range(40, 60)),
            "replayed_max_abs_diff": 0.0,
        },
        "generated": ["This isBrave sir, I will go to the capitol with all our hearts."],
        "cost_usd": 0.2750409666666666,
    },  # fmt: skip
    "glue_text_classification": {
        "notebook": "glue_text_classification",
        "smoke_test": True,
        "losses": [0.70, 0.69, 0.64, 0.44, 0.18, 0.04, 0.01, 0.004],
        "task": "cola",
        "eval_split": "validation",
        "metrics": {"matthews_correlation": 0.8765},
        "eval_history": [
            {"eval_loss": 0.6728, "eval_matthews_correlation": 0.0, "eval_runtime": 0.81},
            {"eval_loss": 0.0025, "eval_matthews_correlation": 0.8765, "eval_runtime": 0.17},
        ],
        "kill": {
            "at_step": 44,
            "resumed_from_step": 32,
            "restarts": 1,
            "replayed_steps": [36, 40],
            "replayed_max_abs_diff": 0.002869516611099243,
        },
    },  # fmt: skip
    "gpt2_deepspeed": {
        "notebook": "gpt2_deepspeed",
        "smoke_test": True,
        "losses": [6.25 - 0.08 * s for s in range(24)],
        "final_loss": 4.4135,
        "zero_stage": 3,
        "offload": "none",
        "partition_fraction": [0.5, 0.5],
        "plan": _plan(8_547_328),
        "resumed_start_epoch": 2,
        "resumed_losses": [4.3806, 4.2, 4.0, 3.8085],
        "kill": {
            "at_step": 18,
            "resumed_from_step": 12,
            "restarts": 1,
            "replayed_steps": [13, 14, 15, 16, 17],
            "replayed_max_abs_diff": 0.0,
        },
    },  # fmt: skip
    "llama_fsdp": {
        "notebook": "llama_fsdp",
        "smoke_test": True,
        "losses": LLAMA_LOSSES,
        "final_loss": LLAMA_LOSSES[-1],
        "load_peak_rss_mb": [301.6, 5.1],
        "param_shard_fraction": [0.5000195392641513, 0.4999804607358487],
        "tokens_per_second": 331.80083773745974,
        "mfu": None,
        "plan": _plan(547_273_216),
        "kill": {
            "at_step": 16,
            "resumed_from_step": 12,
            "restarts": 1,
            "replayed_steps": [13, 14, 15],
            "replayed_max_abs_diff": 0.0,
        },
        "attempts": _attempts(LLAMA_LOSSES, killed_at=16, resumed_from=12),
        "resumed_from_step": 12,
        "replayed_losses": {"first attempt": [3.1031, 2.7590], "after resuming": [3.1031, 2.7590]},
        "generated": [" Open it with a helpful coding assistant. " + "x" * 300],  # a long line wraps
        "checkpoint_path": "s3://llm-notebooks/runs/llama-2-fsdp_f73edaf0/" + "checkpoint_000024" * 8,
        "mlflow_run_id": "5f0c6a1e2b3d4c5e8f9a0b1c2d3e4f50",
        "mlflow": {
            "tracking_uri": "http://127.0.0.1:5000",
            "experiment_id": "3",
            "run_url": "http://127.0.0.1:5000/#/experiments/3/runs/5f0c6a1e2b3d4c5e8f9a0b1c2d3e4f50",
        },
    },  # fmt: skip
}
FAILED = "gpt2_deepspeed"  # stopped before its last cell: no results file
ERROR = "PapermillExecutionError: ParameterError: NUM_WORKERS must be at least 1"
ROWS = [
    {"notebook": name, "status": "ok", "wall_seconds": wall, "error": "", "title": f"The {name} lesson"}
    for name, wall in [
        ("dolly_lightning_fsdp", 59.2),
        ("glue_text_classification", 52.2),
        ("llama_fsdp", 117.2),
    ]
] + [{"notebook": FAILED, "status": "failed", "wall_seconds": 63.1, "error": ERROR}]
ROWS.sort(key=lambda row: row["notebook"])
for _row in ROWS:
    _row["final"] = run_summary.final_number(RESULTS[_row["notebook"]]) if _row["status"] == "ok" else "-"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run folder as ci/run_notebooks.py leaves it: results JSON per notebook (none for a failed one
    that stopped before its last cell), then the summaries."""
    folder = tmp_path_factory.mktemp("run")
    for name, results in RESULTS.items():
        if name != FAILED:
            (folder / f"{name}.json").write_text(json.dumps(results))
    run_summary.write_summaries(folder, ROWS, title="20261124-000000")
    return folder


def test_summary_html_has_each_notebooks_numbers(run_dir):
    page = (run_dir / "summary.html").read_text()
    assert json.loads((run_dir / "summary.json").read_text()) == ROWS
    assert f"| {FAILED} | failed | 63.1 | - |" in (run_dir / "summary.md").read_text()
    text = re.sub(r"<[^>]+>", "", page).replace("&middot;", "·").replace("&rarr;", "→")
    for expected in [
        "3 of 4 notebook(s) ok",
        "The dolly_lightning_fsdp lesson",
        "50.0% / 50.0%",  # parameters held per worker
        "torch.float32",
        "$0.28",  # cost at the tutorial's prices
        "worker killed at step 60; resumed from step 39; 1 restart(s); steps 40-59 run twice",
        "matthews_correlation 0.8765",  # the metric (overview and section)
        "Eval metric (cola, validation)",
        "killed at 44, resumed from 32, replay diff 0.0029",  # overview
        "rank 0 301.6 MB, rank 1 5.1 MB",  # llama: only rank 0 loads the weights
        "needs 521.9 MiB of 11.8 GiB (4%)",  # the plan's verdict per CPU worker
        "332 tokens/s",
        "not available on CPU",  # MFU
        "steps 13-15 run twice",
        "first attempt: 3.1031, 2.7590",
        ERROR,
        "No results file",
        "MLflow run5f0c6a1e2b3d4c5e8f9a0b1c2d3e4f50 in http://127.0.0.1:5000",  # llama's run, linked
    ]:
        assert expected in text, expected
    assert "href='http://127.0.0.1:5000/#/experiments/3/runs/5f0c6a1e2b3d4c5e8f9a0b1c2d3e4f50'" in page
    assert "ZeRO" not in text  # GPT-2 failed without results: none of its numbers are made up
    # one embedded PNG per notebook with losses (3), no external resource of any kind
    images = re.findall(r"src='data:image/png;base64,([^']+)'", page)
    assert len(images) == 3
    assert all(base64.b64decode(b).startswith(b"\x89PNG\r\n\x1a\n") for b in images)
    assert not re.search(r"src=['\"]?(https?:)?//", page)  # nothing loaded from anywhere
    links = re.findall(r"href=['\"]?((?:https?:)?//[^'\" >]+)", page)
    assert links == [RESULTS["llama_fsdp"]["mlflow"]["run_url"]], links  # the one link: the MLflow run
    assert "<script" not in page


def test_summary_of_gpt2_results_and_robust_to_odd_ones():
    row = {"notebook": FAILED, "status": "ok", "wall_seconds": 63.1, "final": "loss 4.4135", "error": ""}
    page = run_summary.render_html([row], {FAILED: RESULTS[FAILED]})
    text = re.sub(r"<[^>]+>", "", page).replace("&rarr;", "→")
    for expected in [
        "ZeRO stage 3, offload none: 50.0% / 50.0% of the partitioned state per worker",
        "at epoch 2: loss 4.3806 → 3.8085 over 4 steps",  # resumed from the final checkpoint
        "needs 8.2 MiB of 11.8 GiB (0.07%)",
    ]:
        assert expected in text, expected
    assert page.count("data:image/png;base64,") == 1
    # results from another version of a notebook: wrong types lose their line, never the page
    odd = {"losses": "n/a", "kill": [1], "plan": {"rows": "x"}, "param_shard_fraction": 0.5, "mfu": "?"}
    page = run_summary.render_html([{**ROWS[0], "notebook": "odd"}], {"odd": odd})
    assert "<section class='nb ok' id='odd'>" in page
    assert run_summary.loss_chart_png({"losses": []}) is None


def test_summary_html_in_chromium(run_dir):
    chromium = chromium_or_skip()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            requests: list[str] = []
            page.on("request", lambda r: requests.append(r.url))
            page.goto((run_dir / "summary.html").as_uri())
            for name in RESULTS:
                assert page.locator(f"section#{name} h2").is_visible(), name
                assert name in page.locator(f"section#{name} h2").inner_text()
            widths = page.eval_on_selector_all("img", "imgs => imgs.map(i => i.complete && i.naturalWidth)")
            assert len(widths) == 3 and all(w and w > 0 for w in widths), widths
            overflowing = page.evaluate(
                """() => [...document.querySelectorAll('body *')]
                    .filter(e => e.getBoundingClientRect().right > document.documentElement.clientWidth + 0.5
                                 || e.scrollWidth > e.clientWidth + 1 && getComputedStyle(e).overflowX !== 'visible')
                    .map(e => e.tagName + '.' + e.className + ': ' + e.textContent.slice(0, 60))"""
            )
            assert not overflowing, overflowing
            assert page.evaluate("document.documentElement.scrollWidth") <= 1280
            assert [u for u in requests if not u.startswith(("file:", "data:"))] == []
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
        finally:
            browser.close()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# Real lines, as the kernel streamed them in a `make run CLUSTER=1` (runs/20261123-222703-cluster).
W = "\x1b[36m(RayTrainWorker pid=11428)\x1b[0m "
C = "\x1b[36m(TrainController pid=11382)\x1b[0m "
NOISE = [
    "[I 2026-11-23 22:30:01.123 IPKernelApp] WARNING | Kernel is running over TCP without encryption. All "
    "communication (including code and outputs) is sent in plain text and is susceptible to eavesdropping.\n",
    "\n\n\n",
    "[2026-11-23 22:30:03,477 W 11165 11165] network_util.cc:330: Failed to determine local IP via external "
    "connectivity to: 8.8.8.8:53, [2001:4860:4860::8888]:53, falling back to hostname resolution\n",
    f"{C}Requesting resources: {{'CPU': 1}} * 2\n",
    f"{W}Setting up process group for: env:// [rank=0, world_size=2]\n",
    f"{W}[W1123 22:30:17.423809718 socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved.\n",
    f"{W}/tmp/ipykernel_11165/3518563375.py:32: UserWarning: USE_FLASH_ATTN=True, but USE_GPU=False\n",
    f"{W}FullyShardedDataParallel(\n{W}  (_fsdp_wrapped_module): DollyV2Model(\n{W}    (model): GPTNeoXForCausalLM(\n",
    f"{W}\rTraining: |          | 0/? [00:00<?, ?it/s]\rEpoch 0:   0%|          | 0/39 [00:00<?, ?it/s]\n",
    f"{W}\rEpoch 0: 100%|██████████| 39/39 [00:02<00:00, 15.17it/s, train_loss=0.969]\rEpoch 1:   0%|          | 0/39 "
    "[00:00<?, ?it/s, train_loss=0.969]\n",  # a new epoch's bar at 0 still shows the last epoch's loss
    "Map: 100%|██████████| 600/600 [00:00<00:00, 9137.21 examples/s]\r",
    f'{W}Traceback (most recent call last):\n{W}  File "/tmp/ipykernel_11165/3518563375.py", line 98\n',
    f"{W}{{'eval_runtime': '0.8123', 'eval_samples_per_second': '78.79'}}\n",
    f"{C}Traceback (most recent call last):\x1b[32m [repeated 3x across cluster] (Ray deduplicates logs by "
    "default. Set RAY_DEDUP_LOGS=0 to disable log deduplication)\x1b[0m\n",
]


def _progress(clock: Clock) -> tuple[run_notebooks.Progress, list[str]]:
    out: list[str] = []
    return run_notebooks.Progress("llama_fsdp", write=out.append, clock=clock), out


def test_progress_drops_noise_and_keeps_sections_steps_and_the_kill():
    clock = Clock()
    progress, out = _progress(clock)
    progress.start()
    for text in NOISE:
        progress.feed(text, "stderr")
    assert out == ["[llama_fsdp 0:00] started"], out

    clock.now = 42
    progress.cell({"cell_type": "markdown", "source": "## 6. The training function\n\nText with `code`."})
    progress.cell({"cell_type": "code", "source": "def train_func(config): ..."})
    progress.cell(
        {"cell_type": "markdown", "source": "## 7. Fine-tune with a `TorchTrainer` and `collate_fn`"}
    )
    progress.cell({"cell_type": "code", "source": "trainer.fit()"})
    assert out[1:] == [
        "[llama_fsdp 0:42] § 6. The training function",
        "[llama_fsdp 0:42] § 7. Fine-tune with a TorchTrainer and collate_fn",
    ]
    del out[:]
    progress.feed(f"{W}step 1/24  loss 6.4472  lr 3.33e-04  1.91 s/step\n", "stdout")
    clock.now += 0.5  # within 2 s of the last step line: held back, the latest one kept
    progress.feed(f"{W}step 2/24  loss 6.3990  lr 6.67e-04  1.64 s/step\n", "stdout")
    progress.feed(f"{W}step 4/24  loss 6.9539", "stdout")  # half a line: waits for the rest
    progress.feed("  lr 9.94e-04  1.50 s/step\n", "stdout")
    assert out == ["    step 1/24 loss 6.4472 lr 3.33e-04 1.91 s/step"]
    progress.feed(
        "\x1b[36m(RayTrainWorker pid=11483)\x1b[0m rank 1: killing my own process (SIGKILL) at step 16\n"
        "\x1b[33m(raylet)\x1b[0m A worker died or was killed while executing a task by an unexpected system "
        "error. To troubleshoot the problem, check the logs for the dead worker. Lease ID: 4000\n",
        "stdout",
    )
    progress.feed(f"{C}[FailurePolicy] RETRY\n{C}  Source: worker group\n", "stderr")
    progress.feed(
        "\x1b[36m(RayTrainWorker pid=11738)\x1b[0m Resumed from the sharded checkpoint at step 12\n"
    )
    assert out[1:] == [
        "    step 4/24 loss 6.9539 lr 9.94e-04 1.50 s/step",  # the held-back step, before what came after it
        "  ! rank 1: killing my own process (SIGKILL) at step 16",
        "  ! A worker died or was killed while executing a task by an unexpected system error.",
        "  ! [FailurePolicy] RETRY",
        "    Resumed from the sharded checkpoint at step 12",
    ]
    del out[:]
    clock.now += 3
    progress.feed(f"{W}step 13/24  loss 3.1031  lr 5.37e-04  1.74 s/step\n")
    clock.now += 1
    progress.feed(f"{W}step 24/24  loss 1.1144  lr 0.00e+00  1.40 s/step\n")
    progress.cell_done()  # the end of a cell shows the last step line held back
    assert out == [
        "    step 13/24 loss 3.1031 lr 5.37e-04 1.74 s/step",
        "    step 24/24 loss 1.1144 lr 0.00e+00 1.40 s/step",
    ]


def test_progress_reads_each_trainers_lines():
    clock = Clock()
    progress, out = _progress(clock)
    lines = [
        f"{W}epoch 0 step 1/12 loss 6.2499\n",  # GPT-2
        f"{W}{{'loss': '0.7005', 'grad_norm': '0.5204', 'learning_rate': '0.001925', 'epoch': '0.05'}}\n",  # HF
        f"{W}{{'eval_loss': '0.344', 'eval_matthews_correlation': '1', 'eval_runtime': '0.1766', 'epoch': '1.2'}}\n",
        f"{W}{{'train_runtime': '3.634', 'train_samples_per_second': '422.6', 'train_loss': '0.05678', "
        "'epoch': '3.2'}\n",
        # Lightning's bar, as Ray forwards it: carriage returns, the loss in the postfix
        f"{W}\rEpoch 1:  92%|█████████▏| 36/39 [00:02<00:00, 17.13it/s, train_loss=1.040]\rEpoch 1:  92%|█████████▏"
        "| 36/39 [00:02<00:00, 17.13it/s, train_loss=0.950]\n",
        f"{W}INFO: Restored all states from the checkpoint at /tmp/checkpoint_tmp_27d7/checkpoint.ckpt\n"
        f"{W}Restored all states from the checkpoint at /tmp/checkpoint_tmp_27d7/checkpoint.ckpt\n",
        "Finished deepspeed_sample_d7ddce77: loss 4.6844, checkpoint llm-notebooks/runs/deepspeed_sample\n",
        "Killed at step 18; 1 restart, resumed from step 12\n",
        # the run log's lines, which the notebooks print themselves (harness.run_log.show_progress)
        "rank 1 kills its own process (SIGKILL) at step 44: the worker group fails\n",
        "Ray Train started a new worker group (attempt 2); it resumes from the checkpoint at step 32\n",
        "evaluated at step 48: matthews_correlation 1.000\n",
        "Done in 66 s; checkpoints in llm-notebooks/runs/glue-cola_943fa855\n",
    ]
    for line in lines:
        clock.now += 5  # far apart: no step line is held back
        progress.feed(line)
    assert out == [
        "    epoch 0 step 1/12 loss 6.2499",
        "    epoch 0.05 loss 0.7005 lr 0.001925",
        "    eval (epoch 1.2): loss 0.344, matthews_correlation 1",
        "    trained: train_loss 0.05678 in 3.634 s",
        "    epoch 1 step 36/39 train_loss 0.950",
        "    Restored all states from the checkpoint at /tmp/checkpoint_tmp_27d7/checkpoint.ckpt",
        "    Finished deepspeed_sample_d7ddce77: loss 4.6844, checkpoint llm-notebooks/runs/deepspeed_sample",
        "  ! Killed at step 18; 1 restart, resumed from step 12",
        "  ! rank 1 kills its own process (SIGKILL) at step 44: the worker group fails",
        "  ! Ray Train started a new worker group (attempt 2); it resumes from the checkpoint at step 32",
        "    evaluated at step 48: matthews_correlation 1.000",
        "    Done in 66 s; checkpoints in llm-notebooks/runs/glue-cola_943fa855",
    ]


def test_notebook_option_selects_and_rejects_names(capsys):
    names = [p.stem for p in sorted((ROOT / "notebooks").glob("*.ipynb"))]
    assert run_notebooks.select_notebooks(None) == [ROOT / "notebooks" / f"{n}.ipynb" for n in names]
    assert [p.stem for p in run_notebooks.select_notebooks("llama_fsdp, notebooks/gpt2_deepspeed.ipynb")] == [
        "llama_fsdp",
        "gpt2_deepspeed",
    ]
    with pytest.raises(SystemExit) as exc:
        run_notebooks.main(["--notebook", "llama"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown notebook 'llama'" in err and all(n in err for n in names), err


def test_execute_streams_progress_and_keeps_everything(tmp_path, capfd):
    """ci/run_notebooks.execute on a tiny notebook through papermill and a real kernel (about 3 s):
    parameters injected, progress printed, the rest only in NAME.log, the executed notebook written
    also when a cell fails."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

    train = (
        "import json, sys, warnings\n"
        "warnings.warn('nothing a reader can act on')\n"
        "print('\\n\\n')\n"
        "for s in range(1, 41):\n"
        "    print(f'\\x1b[36m(RayTrainWorker pid=7, ip=10.0.0.2)\\x1b[0m step {s}/40  loss {8 / s:.4f}', flush=True)\n"
        "print('Resumed from checkpoint: starting at epoch 1', file=sys.stderr)\n"
        "json.dump({'losses': [8 / s for s in range(1, 41)]}, open(RESULTS_PATH, 'w'))"
    )
    nb = new_notebook(
        cells=[
            new_markdown_cell("# A tiny lesson"),
            new_code_cell("SMOKE_TEST = False\nRESULTS_PATH = None", metadata={"tags": ["parameters"]}),
            new_markdown_cell("## 1. Train\n\nSome text."),
            new_code_cell(train),
            new_markdown_cell("## 2. A cell that fails"),
            new_code_cell("raise ValueError('on purpose')"),
        ],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
    )
    nbformat.write(nb, tmp_path / "tiny.ipynb")
    out = tmp_path / "run"
    out.mkdir()
    lines: list[str] = []
    progress = run_notebooks.Progress("tiny", write=lines.append)
    status, error = run_notebooks.execute(tmp_path / "tiny.ipynb", out, progress)

    assert (status, error) == ("failed", "PapermillExecutionError: ValueError: on purpose")
    assert re.fullmatch(r"\[tiny \d+:\d\d\] § 1\. Train", lines[0]), lines
    assert lines[1] == "    step 1/40 loss 8.0000"  # then at most one every 2 s, and always the last
    assert "    step 40/40 loss 0.2000" in lines and len(lines) < 10, lines
    assert "    Resumed from checkpoint: starting at epoch 1" in lines
    assert lines[-1].endswith("§ 2. A cell that fails"), lines
    assert capfd.readouterr() == ("", "")  # nothing else reached the console, not even the kernel's own
    log = (out / "tiny.log").read_text()
    assert "nothing a reader can act on" in log and "(RayTrainWorker pid=7, ip=10.0.0.2)" in log
    assert all(f"step {s}/40" in log for s in range(1, 41))
    assert "ValueError: on purpose" in log
    executed = nbformat.read(out / "tiny.ipynb", as_version=4)
    injected = [c for c in executed.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert "SMOKE_TEST = True" in injected[0].source and str(out / "tiny.json") in injected[0].source
    assert executed.cells[-1].outputs[0]["ename"] == "ValueError"
    assert json.loads((out / "tiny.json").read_text())["losses"][-1] == 0.2


def test_make_run_says_which_cluster_and_storage_it_uses(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("STORAGE_PATH", raising=False)
    assert run_notebooks.where_it_runs() == (
        "Cluster: a local Ray per notebook. Checkpoints: each notebook's local folder (no STORAGE_PATH set)."
    )
    # `make run`'s own Ray, which every notebook attaches to (run_on_one_ray).
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:40000")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(ROOT / ".ray-run" / "auth_token"))
    assert run_notebooks.where_it_runs().startswith(
        "Cluster: one local Ray for all of them, at 127.0.0.1:40000."
    )
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH")
    # A shell that still has an old cluster's variables: said plainly, the URI's credentials masked.
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    monkeypatch.setenv("STORAGE_PATH", "s3://KEY:SECRET@team-bucket/runs")
    assert run_notebooks.where_it_runs() == (
        "Cluster: the Ray cluster at RAY_ADDRESS=10.0.0.5:6379. Checkpoints: STORAGE_PATH=s3://***@team-bucket/runs."
    )


def test_make_runs_one_ray_lets_in_only_a_driver_with_its_token_and_leaves_nothing(tmp_path):
    """`make run`'s one Ray for all notebooks (local_cluster.up_ray): a notebook's driver attaches with the
    token, one without it is refused, and `down` stops every process of it (about 12 s)."""
    import os
    import subprocess

    import psutil

    from ci import local_cluster

    state = tmp_path / "ray-run"
    driver = local_cluster.up_ray(state, cpus=2, object_store_mb=100)
    try:
        recorded = json.loads((state / "state.json").read_text())
        head = psutil.Process(recorded["processes"][0]["pid"])
        family = [head, *head.children(recursive=True)]
        env = {**os.environ, **driver}
        code = "import ray; ray.init(logging_level='ERROR'); print(ray.cluster_resources()['CPU'])"
        run = functools.partial(subprocess.run, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        attached = run([sys.executable, "-c", code], env=env)
        assert attached.returncode == 0 and attached.stdout.split()[-1] == "2.0", attached.stderr[-2000:]
        refused = run(
            [sys.executable, "-c", code], env={**env, "RAY_AUTH_TOKEN_PATH": str(tmp_path / "none")}
        )
        assert refused.returncode != 0 and "AuthenticationError" in refused.stderr, refused.stderr[-2000:]
        assert (state / "auth_token").stat().st_mode & 0o077 == 0
    finally:
        local_cluster.down(state, state / "cluster.env", quiet=True)
    assert not [p.pid for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not any(Path(d).exists() for d in recorded["temp_dirs"]) and not (state / "auth_token").exists()
