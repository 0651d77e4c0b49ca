"""The test plumbing itself (tests/notebook_runs.py): pinned-loss files, re-pinning, and an import that
starts nothing and writes nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from notebook_runs import (
    LOSSES,
    ROOT,
    fetch,
    filesystem,
    last_checkpoint_before,
    listing,
    main,
    pinned_losses,
    repin,
)

PINNED = ["dolly_lightning_fsdp", "gpt2_deepspeed", "llama_fsdp"]


@pytest.mark.parametrize("name", PINNED)
def test_each_pinned_file_says_how_it_was_measured(name):
    pinned = pinned_losses(name)
    # The first three steps; Llama's whole uninterrupted curve, which its elastic run is held to.
    steps = list(range(1, 25)) if name == "llama_fsdp" else [1, 2, 3]
    assert pinned.steps == steps and len(pinned.losses) == len(steps)
    assert all(1.0 < loss < 10.0 for loss in pinned.losses[:3]), pinned.losses  # about ln(vocab) at the start
    assert 0 < pinned.tolerance <= 0.05
    header = "\n".join(pinned.header)
    for words in ("Hardware: 2-core", "no GPU", "torch 2.13.0+cpu", "ray 2.60.0", "seed 42", "tolerance:"):
        assert words in header, words
    assert f"tests/notebook_runs.py repin {name}" in header
    where = (
        f"runs/<timestamp>/{name}.json"
        if name == "llama_fsdp"
        else f"test-artifacts/notebooks/{name}-nbval.json"
    )
    assert where in header


def _results(name: str, losses: list[float], **extra) -> dict:
    return {"notebook": name, "smoke_test": True, "losses": losses, **extra}


def test_repin_rewrites_the_losses_and_keeps_the_header(tmp_path):
    shutil.copy(LOSSES / "gpt2_deepspeed.txt", tmp_path)
    before = pinned_losses("gpt2_deepspeed", tmp_path)
    results = tmp_path / "results.json"
    results.write_text(json.dumps(_results("gpt2_deepspeed", [6.123456, 5.5, 5.25, 4.0, 3.0])))

    after = repin("gpt2_deepspeed", results, tmp_path)

    assert after.header == before.header and after.tolerance == before.tolerance
    assert after.steps == before.steps
    assert after.losses == [6.1235, 5.5, 5.25]  # steps 1-3 of the run, to 4 decimals
    text = (tmp_path / "gpt2_deepspeed.txt").read_text()
    assert text.endswith("1 6.1235\n2 5.5000\n3 5.2500\n")
    assert text.startswith("\n".join(before.header) + "\n")
    # Re-pinning from the same run again changes nothing.
    repin("gpt2_deepspeed", results, tmp_path)
    assert (tmp_path / "gpt2_deepspeed.txt").read_text() == text


def test_repin_command_line(tmp_path, capsys):
    for name in ("gpt2_deepspeed", "llama_fsdp"):
        shutil.copy(LOSSES / f"{name}.txt", tmp_path)
    results = tmp_path / "gpt2.json"
    results.write_text(json.dumps(_results("gpt2_deepspeed", [6.25, 6.11, 5.97, 5.8], parameters={})))
    assert main(["repin", "gpt2_deepspeed", str(results), "--folder", str(tmp_path)]) == 0
    assert "step 1: 6.2499 -> 6.25" in capsys.readouterr().out
    assert pinned_losses("gpt2_deepspeed", tmp_path).losses == [6.25, 6.11, 5.97]
    with pytest.raises(SystemExit) as exit_info:  # another notebook's results: refused, nothing written
        main(["repin", "llama_fsdp", str(results), "--folder", str(tmp_path)])
    assert exit_info.value.code == 2 and "not a smoke run of llama_fsdp" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("results", "message"),
    [
        (_results("gpt2_deepspeed", [6.0, 5.0, 4.0]), "not a smoke run of llama_fsdp"),
        ({**_results("llama_fsdp", [6.0, 5.0, 4.0]), "smoke_test": False}, "not a smoke run"),
        (_results("llama_fsdp", [6.0, 5.0]), "2 losses, the file pins step 24"),
    ],
)
def test_repin_refuses_a_run_that_does_not_fit(tmp_path, results, message):
    shutil.copy(LOSSES / "llama_fsdp.txt", tmp_path)
    original = (tmp_path / "llama_fsdp.txt").read_text()
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    with pytest.raises(ValueError, match=message):
        repin("llama_fsdp", path, tmp_path)
    assert (tmp_path / "llama_fsdp.txt").read_text() == original


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("# no tolerance here\n1 6.0\n", "no `# tolerance: X` line"),
        ("# tolerance: 0.05\n1 6.0 5.0\n", "expected `step loss`"),
        ("# tolerance: 0.05\n2 6.0\n1 5.0\n", "steps must be increasing"),
        ("# tolerance: 0.05\n1 6.0\n# late header\n", "a header line after the losses"),
    ],
)
def test_a_malformed_loss_file_is_refused(tmp_path, text, message):
    (tmp_path / "x.txt").write_text(text)
    with pytest.raises(ValueError, match=message):
        pinned_losses("x", tmp_path)


def test_last_checkpoint_before():
    # (kill step, checkpoint every): the notebooks' smoke runs, then the edges.
    assert last_checkpoint_before(16, 12) == 12  # Llama: SAVE_STEPS 12
    assert last_checkpoint_before(60, 39) == 39  # Dolly: one checkpoint per epoch of 39 steps
    assert last_checkpoint_before(18, 12) == 12  # GPT-2: epochs of 12 steps
    assert last_checkpoint_before(44, 16) == 32  # GLUE cola: epochs of 16 steps
    assert last_checkpoint_before(12, 12) == 0  # killed before step 12 ran: no checkpoint yet
    assert last_checkpoint_before(13, 12) == 12


def test_local_paths_need_no_cluster_and_bucket_uris_do(tmp_path):
    (tmp_path / "ckpt" / "sub").mkdir(parents=True)
    (tmp_path / "ckpt" / "a.txt").write_text("a")
    (tmp_path / "ckpt" / "sub" / "b.txt").write_text("b")
    assert listing(str(tmp_path / "ckpt")) == ["a.txt", "sub/b.txt"]
    copy = fetch(str(tmp_path / "ckpt"), tmp_path / "copy")
    assert (copy / "sub" / "b.txt").read_text() == "b"
    with pytest.raises(ValueError, match="the ray_cluster fixture"):
        filesystem("s3://llm-notebooks/runs/x")


# Run in a fresh interpreter with an audit hook: any file opened for writing, folder made, process
# started, socket connected or bound, environment variable changed, thread started, or the cluster module
# or the offline guard imported while importing the plumbing and conftest fails it.
_IMPORT_CHECK = """
import os, sys, threading
events = []
WRITING = ("os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.truncate", "shutil.rmtree",
           "shutil.copyfile",
           "subprocess.Popen", "os.system", "os.posix_spawn", "os.fork", "socket.connect", "socket.bind")

def hook(event, args):
    if event == "open" and (
        (isinstance(args[1], str) and set(args[1]) & set("wax+"))
        or (args[1] is None and args[2] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
    ):
        events.append((event, args[0]))
    elif event in WRITING:
        events.append((event, args[:1]))

environ, path, threads, modules = dict(os.environ), list(sys.path), threading.active_count(), set(sys.modules)
sys.addaudithook(hook)
import notebook_runs, conftest  # from tests/, on PYTHONPATH as pytest puts it on sys.path
assert not events, events
assert dict(os.environ) == environ, set(os.environ.items()) ^ set(environ.items())
assert sys.path == path, sys.path
assert threading.active_count() == threads
assert not {"ci.local_cluster", "llm_notebooks_offline_guard"} & (set(sys.modules) - modules)  # (the guard:
# already there when the tests' sitecustomize.py loaded it at start-up, as in every process they start)
print("no side effects")
"""


def test_importing_the_plumbing_and_conftest_has_no_side_effects():
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_CHECK], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "no side effects" in proc.stdout, proc.stdout + proc.stderr


def test_pytest_configure_made_the_session_offline():
    # conftest.py's pytest_configure has run before any test: every process started from here inherits this.
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["LLM_NOTEBOOKS_OFFLINE_GUARD"]
    assert str(ROOT / "ci" / "offline") in os.environ["PYTHONPATH"].split(os.pathsep)
    assert os.environ["HTTPS_PROXY"].startswith("http://127.0.0.1:")
    assert "RAY_ADDRESS" not in os.environ and "SMOKE_TEST" not in os.environ
    from llm_notebooks_offline_guard import installed

    assert installed()
