"""Unit tests for `helpers`: tiny models, fixtures, checks, resources, results, log filter, offline guard."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys

import pytest

import basics.cluster
import basics.validate
import harness.checks
import harness.fixtures
import harness.nodes
import harness.notebooks
import harness.storage
import harness.tiny_models
import helpers
from harness import cluster

# ---- tiny models: what each tokenizer really produces --------------------------------------

SAMPLES = {
    "gpt2": "The home team won the cup final in extra time.",
    "gpt_neox": "MENENIUS:\nGood friends, we must hear the senate for Rome.",
    "llama": "<|prompter|> How do I sort a list of numbers? <|endoftext|>",
    "distilbert": "The council approved the budget, indeed.",
}


@pytest.mark.parametrize("arch", sorted(harness.tiny_models.TINY_ARCHS))
def test_tiny_model_loads_like_a_hub_id(arch):
    from transformers import AutoConfig, AutoTokenizer

    path = harness.tiny_models.tiny_model(arch)
    assert harness.tiny_models.tiny_model(arch) == path  # cached, built once
    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert config.vocab_size == len(tokenizer)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        token_id = getattr(config, key, None)
        if token_id is not None:
            assert 0 <= token_id < len(tokenizer), (key, token_id)


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "llama"])
def test_causal_tokenizers_round_trip_without_unknowns(arch):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(harness.tiny_models.tiny_model(arch))
    ids = tokenizer(SAMPLES[arch])["input_ids"]
    assert tokenizer.unk_token_id not in ids or tokenizer.unk_token == tokenizer.eos_token
    assert tokenizer.decode(ids) == SAMPLES[arch]
    assert len(ids) < len(SAMPLES[arch])  # merges were learned: fewer tokens than characters


def test_distilbert_tokenizer_adds_cls_sep_and_knows_the_words():
    # The trap in ../shared/FINDINGS.md: a reloaded vocabulary that maps every word to [UNK].
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(harness.tiny_models.tiny_model("distilbert"))
    tokens = tokenizer.convert_ids_to_tokens(tokenizer(SAMPLES["distilbert"])["input_ids"])
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]"
    assert "[UNK]" not in tokens
    assert tokens[1:5] == ["the", "council", "approved", "the"]
    pair = tokenizer("first one", "second one")
    assert pair["input_ids"].count(tokenizer.sep_token_id) == 2


def test_tiny_gpt2_is_a_real_gpt2_and_starts_near_uniform():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = harness.tiny_models.tiny_model("gpt2")
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == "GPT2LMHeadModel"
    batch = tokenizer([SAMPLES["gpt2"]], return_tensors="pt")
    with torch.no_grad():
        loss = model(**batch, labels=batch["input_ids"]).loss.item()
    assert abs(loss - math.log(len(tokenizer))) < 0.5  # random weights: about ln(vocab)


# ---- fixtures: shaped like the real datasets ------------------------------------------------


def test_ag_news_fixture_has_real_columns_and_labels():
    from datasets import load_dataset

    ds = load_dataset(harness.fixtures.ag_news_fixture())
    assert set(ds) == {"train", "test"}
    assert ds["train"].column_names == ["text", "label"]
    assert ds["train"].features["label"].names == ["World", "Sports", "Business", "Sci/Tech"]
    assert len(set(ds["train"]["label"])) == 4
    assert len(ds["train"]) == 2000 and len(ds["test"]) == 200
    # The GPT-2 notebook's held-out rows (test[:64] in smoke mode) are none of the training rows.
    assert not set(ds["test"]["text"]) & set(ds["train"]["text"])


def test_play_script_and_chat_fixtures():
    from datasets import load_dataset

    play = load_dataset(harness.fixtures.play_script_fixture())
    assert set(play) == {"train", "validation", "test"} and play["train"].num_rows == 1
    # The Dolly notebook holds out the validation split's lines that are not training lines: 41 of 53.
    spoken = {
        split: [
            line.strip() for line in play[split][0]["text"].splitlines() if line and not line.endswith(":")
        ]
        for split in ("train", "validation")
    }
    train_lines, validation = set(spoken["train"]), spoken["validation"]
    assert len(validation) == 53 and len([line for line in validation if line not in train_lines]) == 41
    text = play["train"][0]["text"]
    assert text.splitlines()[0].endswith(":") and "\n\n" in text
    chat = load_dataset(harness.fixtures.chat_fixture())
    row = chat["train"][0]["content"]
    assert row.startswith("<|system|>") and "<|prompter|>" in row and "<|assistant|>" in row
    # The Llama notebooks' held-out rows (the test split) are none of the training rows.
    assert chat["test"].num_rows == 8 and not set(chat["test"]["content"]) & set(chat["train"]["content"])


# ---- parameter checks ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: basics.validate.check_int("NUM_WORKERS", 0, minimum=1), ["NUM_WORKERS=0", "at least 1"]),
        (
            lambda: basics.validate.check_int("BATCH_SIZE_PER_WORKER", 2.5, minimum=1),
            ["BATCH_SIZE_PER_WORKER=2.5", "integer"],
        ),
        (lambda: basics.validate.check_int("NUM_WORKERS", True, minimum=1), ["NUM_WORKERS=True", "integer"]),
        (
            lambda: basics.validate.check_choice("ZERO_STAGE", 4, [0, 1, 2, 3]),
            ["ZERO_STAGE=4", "0, 1, 2, 3"],
        ),
        (lambda: basics.validate.check_positive("LEARNING_RATE", 0), ["LEARNING_RATE=0", "greater than 0"]),
        # `-p LEARNING_RATE inf` trained to NaN; NaN is no number to train with either.
        (
            lambda: basics.validate.check_positive("LEARNING_RATE", float("inf")),
            ["LEARNING_RATE=inf", "finite"],
        ),
        (
            lambda: basics.validate.check_positive("LEARNING_RATE", float("nan")),
            ["LEARNING_RATE=nan", "finite"],
        ),
        (
            lambda: basics.validate.check_max_positions(
                "MAX_SEQ_LEN", 129, harness.tiny_models.tiny_model("gpt2")
            ),
            ["MAX_SEQ_LEN=129", "<= 128"],
        ),
        (
            lambda: basics.validate.check_source_available("MODEL_NAME", "no/such-model", "model"),
            ["MODEL_NAME='no/such-model'", "offline"],
        ),
    ],
)
def test_checks_name_the_parameter(call, words):
    with pytest.raises(helpers.ParameterError) as info:
        call()
    for word in words:
        assert word in str(info.value)


def test_checks_accept_good_values():
    assert basics.validate.check_int("NUM_WORKERS", 2, minimum=1) == 2
    assert (
        basics.validate.check_max_positions("MAX_SEQ_LEN", 128, harness.tiny_models.tiny_model("gpt2")) == 128
    )
    assert basics.validate.check_source_available(
        "DATASET_NAME", harness.fixtures.ag_news_fixture(), "dataset"
    )


# ---- resources: fail fast instead of waiting forever ----------------------------------------


def _fake_cluster(monkeypatch, nodes):
    import ray

    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": n} for n in nodes])


def test_gpu_request_on_a_cpu_cluster_fails_fast(monkeypatch):
    _fake_cluster(monkeypatch, [{"CPU": 4.0}])
    monkeypatch.delenv("LLM_NOTEBOOKS_AUTOSCALING", raising=False)
    with pytest.raises(harness.cluster.ResourceRequestError) as info:
        harness.cluster.check_resources(16, use_gpu=True)
    message = str(info.value)
    for word in ["NUM_WORKERS=16", "USE_GPU=True", "16 GPUs", "has 0", "SMOKE_TEST=True"]:
        assert word in message


def test_too_many_cpu_workers_fail_and_fitting_requests_pass(monkeypatch):
    _fake_cluster(monkeypatch, [{"CPU": 4.0}, {"CPU": 8.0, "GPU": 2.0}])
    with pytest.raises(harness.cluster.ResourceRequestError, match="NUM_WORKERS=13 needs 13 CPUs"):
        harness.cluster.check_resources(13, use_gpu=False)
    harness.cluster.check_resources(12, use_gpu=False)
    harness.cluster.check_resources(2, use_gpu=True)


def test_autoscaling_cluster_only_warns(monkeypatch):
    _fake_cluster(monkeypatch, [{"CPU": 4.0}])
    monkeypatch.setenv("LLM_NOTEBOOKS_AUTOSCALING", "1")
    with pytest.warns(UserWarning, match="autoscaler"):
        harness.cluster.check_resources(16, use_gpu=True)


def test_llama_on_an_autoscaling_cluster_with_no_gpu_node_yet(monkeypatch, capsys, tmp_path):
    """No GPU node to fetch the weights on before `fit()`: the check says rank 0 will download them (in
    `train_func`, before the first collective) instead of failing on an empty cluster."""
    from basics.plan import Plan

    _fake_cluster(monkeypatch, [{"CPU": 4.0}])  # the head node only
    monkeypatch.setenv("LLM_NOTEBOOKS_AUTOSCALING", "1")
    monkeypatch.setattr(
        harness.nodes, "_check_shared_folder", lambda name, folder, use_gpu=False: 1
    )  # one machine
    namespace = (
        harness.notebooks.defaults("llama_fsdp")
        .replace(
            NUM_WORKERS=16,
            USE_GPU=True,
            STORAGE_PATH=str(tmp_path),
            MODEL_NAME="meta-llama/x",
            USE_COMPILE=False,
        )
        .as_dict()
    )
    plan = Plan("70B", [], {"hub_download_bytes": 138e9, "temp_file_bytes": 138e9})
    with pytest.warns(UserWarning, match="autoscaler"):
        harness.checks.check_cluster("llama_fsdp", namespace, plan)
    out = capsys.readouterr().out
    assert "rank 0 will download them itself" in out
    assert "no node's local disk to check yet: rank 0 checks its own before it downloads" in out


def test_a_download_that_would_not_fit_is_refused_before_it_starts(monkeypatch, tmp_path):
    # Rank 0 on a node the autoscaler added after the Set up cell: the Hub's sizes against the free disk.
    import huggingface_hub
    from huggingface_hub import DryRunFileInfo
    from huggingface_hub.errors import DryRunError

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    asked = []

    def snapshot_download(repo_id, allow_patterns, dry_run=False):
        asked.append(dry_run)
        size = 10**18  # an exabyte: no disk has room
        return [DryRunFileInfo("c0", size, "model.safetensors", "", is_cached=False, will_download=True)]

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(OSError, match=r"needs 1000000000.0 GB in the Hugging Face cache .*HF_HOME"):
        basics.cluster.fetch_model("meta-llama/x")
    assert asked == [True]  # nothing downloaded

    # Offline (HF_HUB_OFFLINE), the dry run cannot ask the Hub: no check, and the cached copy is used.
    def offline(repo_id, allow_patterns, dry_run=False):
        asked.append(dry_run)
        if dry_run:
            raise DryRunError("Dry run cannot be performed as the repository cannot be accessed.")
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    basics.cluster.fetch_model("meta-llama/x")
    assert asked == [True, True, False]


def test_log_noise_patterns_drop_noise_and_keep_progress():
    noise = [
        "Failed to query Ray Train Controller actor state. State API may be temporarily unavailable.",
        "Reporting training result 3: TrainingReport(checkpoint=...)",
        "[transformers] `loss_type=None` was set in the config but it is unrecognized.",
    ]
    keep = ["epoch 0 step 1/12 loss 6.2499", "Setting up process group for: env:// [rank=0, world_size=2]"]
    assert all(any(p.search(line) for p in cluster.LOG_NOISE) for line in noise)
    assert not any(p.search(line) for p in cluster.LOG_NOISE for line in keep)


# ---- results files ---------------------------------------------------------------------------


def test_write_results_requires_the_promised_keys(tmp_path):
    path = tmp_path / "r.json"
    good = dict(
        notebook="x",
        smoke_test=True,
        wall_seconds=1.0,
        losses=[2.0, 1.0],
        checkpoint_path=str(tmp_path),
        mlflow_run_id=None,  # no run to end (tests/test_tracking.py ends one)
    )
    assert helpers.write_results("", **good) is None and not path.exists()
    helpers.write_results(str(path), **good, extra=[0.5])
    assert json.loads(path.read_text())["extra"] == [0.5]
    with pytest.raises(KeyError):
        helpers.write_results(str(path), **{k: v for k, v in good.items() if k != "losses"})
    with pytest.raises(ValueError):
        helpers.write_results(str(path), **{**good, "losses": [1.0, float("nan")]})
    with pytest.raises(FileNotFoundError):
        helpers.write_results(str(path), **{**good, "checkpoint_path": str(tmp_path / "missing")})


def test_plot_losses_draws_a_curve_per_run():
    fig = helpers.plot_losses({"a": [3.0, 2.0], "b": [1.5]}, "t", start={"b": 2})
    lines = fig.axes[0].get_lines()
    assert [list(line.get_xdata()) for line in lines] == [[0, 1], [2]]


# ---- offline guard ---------------------------------------------------------------------------


def test_offline_guard_is_installed_here_and_in_child_processes():
    from llm_notebooks_offline_guard import installed, is_allowed

    assert installed()
    assert is_allowed(socket.AF_INET, ("127.0.0.1", 80)) and is_allowed(socket.AF_INET6, ("::1", 80, 0, 0))
    assert not is_allowed(socket.AF_INET, ("8.8.8.8", 443))
    assert not is_allowed(socket.AF_INET, ("huggingface.co", 443))
    assert is_allowed(socket.AF_UNIX, "/tmp/sock")
    # Kernels and Ray workers are child processes: they load the guard through sitecustomize.
    code = "import socket, llm_notebooks_offline_guard as g; print(g.installed())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"


def test_offline_guard_allows_loopback_traffic():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.create_connection(server.getsockname(), timeout=5)
    client.close()
    server.close()


def test_tripwire_proxy_records_hub_requests_and_answers_403(tmp_path):
    import requests
    from llm_notebooks_offline_guard import start_tripwire_proxy

    log = tmp_path / "guard.log"
    log.write_text("")
    proxy = f"http://127.0.0.1:{start_tripwire_proxy(str(log))}"
    proxies = {"http": proxy}
    # Plain-HTTP requests through the proxy: the tripwire sees the target, nothing leaves loopback.
    assert (
        requests.get("http://huggingface.co/api/models/gpt2", proxies=proxies, timeout=5).status_code == 403
    )
    assert "huggingface.co" in log.read_text()
    log.write_text("")
    assert requests.get("http://169.254.169.254/latest/", proxies=proxies, timeout=5).status_code == 403
    assert log.read_text() == ""  # Ray's cloud-metadata probe: expected, not a failure


# That a worker runs as many threads as the CPUs it reserved (Ray sets OMP_NUM_THREADS) is checked on the test
# cluster, in Llama's elastic run (test_llama_fsdp.py: `worker_threads`, 2 CPUs per worker).


def test_cpus_per_worker_must_fit_the_nodes_of_the_cluster():
    import harness.checks
    import harness.sizing

    p = harness.notebooks.defaults("llama_fsdp").replace(USE_GPU=True, CLUSTER={"p4de.24xlarge": 2})
    with pytest.raises(
        helpers.ParameterError, match=r"CPUS_PER_WORKER=13: a p4de.24xlarge has 96 vCPUs .* 12 each"
    ):
        harness.notebooks.check_cpus_per_worker(p.replace(CPUS_PER_WORKER=13))
    harness.notebooks.check_cpus_per_worker(p.replace(CPUS_PER_WORKER=10))
    with pytest.raises(helpers.ParameterError, match="CPUS_PER_WORKER=0"):
        harness.notebooks.check_cpus_per_worker(p.replace(CPUS_PER_WORKER=0))


def test_redact_masks_a_uris_credentials_and_keeps_the_bucket():
    from harness.storage import redact

    assert redact("s3://AKIA:se/cr+et@bucket/prefix") == "s3://***@bucket/prefix"
    assert redact("s3://AKIA@bucket") == "s3://***@bucket"
    assert redact("hdfs://user:pw@namenode:8020/runs") == "hdfs://***@namenode:8020/runs"
    for unchanged in ("s3://bucket/prefix", "s3://bucket/run@2026/x", "/mnt/cluster_storage/", 4):
        assert redact(unchanged) == unchanged
    with pytest.raises(helpers.ParameterError) as refused:
        harness.storage.check_storage_path("STORAGE_PATH", "s3://AKIA:se/cr+et@bucket/prefix")
    assert "STORAGE_PATH='s3://***@bucket/prefix'" in str(refused.value) and "cr+et" not in str(refused.value)


def test_the_watch_sets_what_each_worker_held_against_the_plan(monkeypatch):
    # The results cells' table: a row per rank (its node, its share, its megabytes) and the plan's row, with
    # only the columns the ranks measured (Lightning's observer measures no gradients: no plan column either).
    import types

    from harness.observe import Watch

    held = {"param_bytes": 2e6, "optimizer_bytes": 4e6, "grad_bytes": None}
    facts = [{"node_id": "0123456789abcdef", "shard_fraction": 0.5, "state_bytes": held}] * 2
    monkeypatch.setattr(Watch, "ranks", lambda self: facts)
    planned = {"param_bytes_per_rank": 2e6, "optimizer_bytes_per_rank": 4e6, "grad_bytes_per_rank": 2e6}
    table = Watch(run_log=None, mlflow_run_id=None).workers(types.SimpleNamespace(as_dict=lambda: planned))
    assert list(table.index) == ["rank 0", "rank 1", "plan"]
    assert table.loc["rank 1", "Ray node"] == "01234567"
    assert table.loc["rank 0", "share of the parameters"] == 0.5
    assert table.loc["plan", "weights (MB)"] == table.loc["rank 0", "weights (MB)"] == 2.0
    assert table.loc["plan", "optimizer state (MB)"] == 4.0
    assert "gradients (MB)" not in table.columns


def test_check_cluster_gets_the_plan(monkeypatch):
    """The node-by-node disk check needs the plan's byte counts: the Set up cell hands `check_parameters`'s
    plan to `check_cluster`."""
    from harness import checks

    plan, seen = object(), {}
    monkeypatch.setattr(checks, "check_cluster", lambda name, namespace, plan: seen.update(plan=plan))
    helpers.check_cluster("glue_text_classification", {"SMOKE_TEST": False}, plan)
    assert seen["plan"] is plan


@pytest.mark.parametrize(
    ("device_name", "expected"),
    [("NVIDIA L40S", 362.05e12), ("NVIDIA L40", 181.05e12), ("NVIDIA L4", 121e12)],
)
def test_an_l40s_is_not_read_as_an_l4(monkeypatch, device_name, expected):
    # Lightning's table maps every "l4..." name to the L4: an L40S's MFU came out about 3x too high.
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name)
    from basics.flops import dense_peak_flops

    assert dense_peak_flops(torch.device("cuda", 0), torch.bfloat16) == pytest.approx(expected)


CPU_BF16_CHECK = """
import torch
from harness import cpu_bf16

torch.manual_seed(0)
bf16 = torch.bfloat16
a, b, c = torch.randn(3, 16, 32), torch.randn(3, 32, 24), torch.randn(3, 16, 24)
native_fp32 = [a[0] @ b[0], torch.addmm(c[0], a[0], b[0], beta=0.5, alpha=2), a @ b, torch.baddbmm(c, a, b)]
x = a[0].to(bf16).requires_grad_()
w = torch.randn(24, 32, dtype=bf16, requires_grad=True)
assert cpu_bf16.install(force=True) and cpu_bf16.install()  # once per process
# fp32: torch's own kernels, bit for bit.
fp32 = [a[0] @ b[0], torch.addmm(c[0], a[0], b[0], beta=0.5, alpha=2), a @ b, torch.baddbmm(c, a, b)]
assert all(torch.equal(n, f) for n, f in zip(native_fp32, fp32))
# bf16: the fp32 product of the bf16 inputs, rounded once; so are the gradients autograd computes with mm.
ab, bb, cb = a.to(bf16), b.to(bf16), c.to(bf16)
exact = lambda t: t.to(bf16)
assert torch.equal(ab[0] @ bb[0], exact(ab[0].float() @ bb[0].float()))
assert torch.equal(ab @ bb, exact(ab.float() @ bb.float()))
assert torch.equal(torch.baddbmm(cb, ab, bb), exact(torch.baddbmm(cb.float(), ab.float(), bb.float())))
y = torch.nn.functional.linear(x, w)
assert y.dtype == bf16
y.float().sum().backward()
assert torch.equal(x.grad, exact(torch.ones(16, 24) @ w.float()))
print("ok")
"""


def test_cpu_bf16_products_are_the_rounded_fp32_products():
    # In a process of its own: the kernels replace torch's for the rest of a process's life.
    done = subprocess.run([sys.executable, "-c", CPU_BF16_CHECK], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]


AFTER_TORCH_CHECK = """
import importlib.util, sys
from harness import cpu_bf16

cpu_bf16.needed = lambda: {needed}  # the CPU check, forced: the mechanism is tested on every CPU
cpu_bf16.install_after_torch()  # what a Ray worker's setup hook does
importlib.util.find_spec("torch")  # transformers looks before it imports (is_torch_available)
import torch
print(cpu_bf16._library is not None)
"""


@pytest.mark.parametrize("needed", [True, False], ids=["cpu_without_bf16", "cpu_with_bf16"])
def test_cpu_bf16_installs_when_torch_is_looked_up_before_it_is_imported(needed):
    # The Ray Data chat actor imports transformers first: its bf16 generation ran 4x slower without this.
    # Forced either way: a CPU with bf16 instructions keeps torch's own kernels (nothing registered).
    done = subprocess.run(
        [sys.executable, "-c", AFTER_TORCH_CHECK.format(needed=needed)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.strip() == str(needed), done.stderr[-2000:]


def test_cpu_bf16_follows_this_cpus_own_check():
    # Unforced: kernels only where this CPU lacks bf16 instructions (oneDNN's own check), none where it has them.
    check = "from harness import cpu_bf16; print(cpu_bf16.install() == cpu_bf16.needed(), cpu_bf16.needed())"
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert done.stdout.split()[:1] == ["True"], done.stderr[-2000:]


def test_packing_that_leaves_a_worker_no_held_out_sequence_is_refused():
    # evaluate() gives each worker len(eval_packed) // NUM_WORKERS sequences: with fewer held-out sequences
    # than workers the held-out loss divided by zero at the first evaluation, hours in; now refused at packing.
    import torch

    from basics.parameters import Parameters

    p = Parameters(
        MODEL_NAME="meta-llama/Llama-2-70b-hf", NUM_WORKERS=16, BATCH_SIZE_PER_WORKER=1, LEARNING_RATE=5e-5,
        USE_GPU=True, CPUS_PER_WORKER=8, STORAGE_PATH="/mnt/cluster_storage", PLACEMENT_STRATEGY="PACK",
        MAX_FAILURES=1, MAX_SEQ_LEN=2048, CLUSTER={"p4de.24xlarge": 2}, DATASET_NAME="smangrul/code-chat",
    )  # fmt: skip
    train, held_out = torch.zeros(16, 4), torch.zeros(15, 4)
    with pytest.raises(helpers.ParameterError, match=r"15 held-out sequences .* fewer than NUM_WORKERS=16"):
        helpers.check_packed(train, held_out, p)
    with pytest.raises(helpers.ParameterError, match=r"15 packed sequences are fewer than one global batch"):
        helpers.check_packed(held_out, train, p)
    helpers.check_packed(train, torch.zeros(16, 4), p)
