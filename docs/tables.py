"""The docs pages' tables that come from code: a page line `<!-- table: NAME -->` becomes TABLES[NAME]().

- `techniques`: per-GPU memory of each sharding technique for Llama 2 7B and 70B on 8 A100-80GB, by the
  suite's own "will it fit?" plan (`basics.plan.plan_training`) with each notebook's recipe;
- `learning-path`: the notebooks in the order to take them, their full-scale hardware and laptop time read
  from each notebook's header table;
- `troubleshooting`: the messages the suite's checks print, made by calling those checks.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _techniques() -> list[tuple[str, str, dict]]:
    """(label, the notebook that teaches it, its plan_training recipe: the notebook's own, from
    its module of `harness.notebooks`), with activation checkpointing on for all, as the page says."""
    from harness.notebooks import defaults, dolly_lightning_fsdp, gpt2_deepspeed, llama_fsdp

    def zero(stage: int, offload: str = "none") -> dict:
        return gpt2_deepspeed.plan_recipe(
            defaults("gpt2_deepspeed").replace(ZERO_STAGE=stage, OFFLOAD=offload)
        )

    def llama(lora_rank: int) -> dict:
        full = defaults("llama_fsdp")
        return llama_fsdp.plan_recipe(full.replace(USE_GRADIENT_CHECKPOINTING=True, LORA_RANK=lora_rank))

    return [
        ("DDP (every GPU holds everything)", "glue_text_classification", zero(0)),
        ("ZeRO-1 (optimizer states sharded)", "gpt2_deepspeed", zero(1)),
        ("ZeRO-2 (and gradients)", "gpt2_deepspeed", zero(2)),
        ("ZeRO-3 (and weights)", "gpt2_deepspeed", zero(3)),
        ("ZeRO-3, optimizer and weights offloaded to CPU", "gpt2_deepspeed", zero(3, "optimizer+params")),
        (
            "FSDP (Lightning's FSDPStrategy)",
            "dolly_lightning_fsdp",
            dolly_lightning_fsdp.plan_recipe(
                defaults("dolly_lightning_fsdp").replace(PRECISION="bf16-mixed", CPU_OFFLOAD=False)
            ),
        ),
        ("FSDP2 (`fully_shard`, the Llama recipe)", "llama_fsdp", llama(0)),
        ("LoRA r=16 over FSDP2", "llama_lora", llama(16)),
    ]


MODELS = {"Llama 2 7B": "meta-llama/Llama-2-7b-hf", "Llama 2 70B": "meta-llama/Llama-2-70b-hf"}
CLUSTER = {"p4de.24xlarge": 1}  # 8 A100-80GB


def techniques() -> str:
    from dataclasses import replace

    from basics.plan import plan_training

    header = "| technique | " + " | ".join(MODELS) + " | taught in |\n|---|" + "---|" * len(MODELS) + "---|\n"
    rows = []
    for label, notebook, recipe in _techniques():
        cells = []
        for model in MODELS.values():
            plan = plan_training(
                title=label,
                model_name=model,
                num_workers=8,
                cluster=CLUSTER,
                batch_size=1,
                seq_len=2048,
                recipe=replace(recipe, activation_checkpointing=True),
            )
            row = next(r for r in plan.rows if r.where == "per GPU")
            verdict = {"ok": "fits", "close": "fits, close", "too big": "**too big**"}[row.status]
            cell = f"{row.need / 1e9:,.0f} GB ({row.share:.0%}): {verdict}"
            host = max((r for r in plan.rows if r.what.startswith("host RAM")), key=lambda r: r.need)
            if host.status != "ok":  # offloading moves the problem to the node's RAM
                host_verdict = {"close": "close", "too big": "**too big**"}[host.status]
                cell += f"; host RAM {host.need / 1e9:,.0f} GB ({host.share:.0%}): {host_verdict}"
            cells.append(cell)
        rows.append(f"| {label} | " + " | ".join(cells) + f" | [{notebook}](notebooks/{notebook}) |")
    return header + "\n".join(rows) + "\n"


LEARNING_PATH = [
    ("glue_text_classification", "data parallelism: a copy of the model per worker, Ray Data feeding them"),
    ("gpt2_deepspeed", "sharding the training state with ZeRO stages 1-3, sharded checkpoints, resuming"),
    ("dolly_lightning_fsdp", "FSDP from Lightning, CPU offload, a 7B model on 16 GB GPUs"),
    ("llama_fsdp", "FSDP2 by hand at 70B: rank-0 loading, DCP checkpoints, MFU"),
    ("llama_lora", "LoRA adapters: 70B on one node, what is trained and what is frozen"),
    (
        "operating_a_run",
        "a long run's hazards: a worker killed, a spot notice, a lost node; MLflow, batch jobs",
    ),
]


def _header(notebook: str) -> tuple[str, dict[str, tuple[str, str]]]:
    """The notebook's title, and its header table: {row: (full scale, on a laptop)}. A missing row is a
    KeyError naming it."""
    from basics.notebook_files import cells, title

    first = cells(notebook)[0].source
    rows = {}
    for line in first.splitlines():
        columns = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(columns) == 3:
            rows[columns[0]] = (columns[1], columns[2])
    return title(notebook), rows


def learning_path() -> str:
    lines = [
        "| step | notebook | what it adds | full-scale hardware | on a laptop |",
        "|---|---|---|---|---|",
    ]
    for step, (notebook, adds) in enumerate(LEARNING_PATH, 1):
        title, rows = _header(notebook)
        hardware, laptop = rows["hardware"][0], rows["time"][1]
        lines.append(f"| {step} | [{title}](notebooks/{notebook}) | {adds} | {hardware} | {laptop} |")
    return "\n".join(lines) + "\n"


def _message(call) -> str:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the message is what the page shows
        return str(error)
    raise AssertionError("the check did not refuse")


def troubleshooting() -> str:
    """One section per failure: the message the suite prints (made here by its own checks), and what to do."""
    import helpers
    from basics.plan import Recipe, plan_training
    from harness.cluster import resource_shortfall
    from harness.storage import check_storage_path

    oom = _message(
        lambda: plan_training(
            title="databricks/dolly-v2-7b on 4 workers",
            model_name="databricks/dolly-v2-7b",
            num_workers=4,
            cluster={"g4dn.4xlarge": 4},
            batch_size=5,
            seq_len=256,
            recipe=Recipe(
                activation_checkpointing=True,
                sharding="fsdp",
                gather_bytes=2,
                reduce_bytes=2,
                fixes=dict(
                    gpu="Set CPU_OFFLOAD=True, more NUM_WORKERS, or lower BATCH_SIZE_PER_WORKER or MAX_SEQ_LEN."
                ),
            ),
        ).check()
    )
    waiting = resource_shortfall([{"CPU": 96.0, "GPU": 8.0}], 16, True, 10)
    with tempfile.TemporaryDirectory() as folder:
        not_a_folder = Path(folder) / "cluster_storage"  # e.g. a mount that failed: a file, not a folder
        not_a_folder.touch()
        storage = _message(lambda: check_storage_path("STORAGE_PATH", str(not_a_folder / "runs")))
        storage = storage.replace(str(folder), "/mnt")
        zero = Path(folder) / "checkpoint" / "global_step100"
        zero.mkdir(parents=True)
        for rank in range(2):
            (zero / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").touch()
        world = _message(lambda: helpers.zero_checkpoint.check_zero_checkpoint_workers(str(zero.parent), 4))
        world = world.replace(str(zero.parent), "s3://bucket/runs/gpt2/checkpoint_000002")
    sections = [
        (
            "CUDA out of memory",
            oom,
            "Before any GPU is used, the Set up cell plans the run's memory for the `CLUSTER` you name and "
            "refuses a run that would not fit, with the row and the fix. If the run still fails with "
            "`torch.OutOfMemoryError`, the plan missed a term: lower `BATCH_SIZE_PER_WORKER` or "
            "`MAX_SEQ_LEN`, keep activation checkpointing on, or add workers; `make plan NOTEBOOK=...` "
            "shows the table offline.",
        ),
        (
            "`trainer.fit()` waits for resources",
            waiting,
            "Ray Train waits for every worker's bundle (one GPU and `CPUS_PER_WORKER` cores); the Set up cell "
            "refuses a request the cluster can never meet. On a cluster that adds nodes, set "
            "`LLM_NOTEBOOKS_AUTOSCALING=1` and it only warns.",
        ),
        (
            "An NCCL timeout",
            "torch.distributed.DistBackendError: [Rank 1] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=1, OpType=BROADCAST, ..., Timeout(ms)=1800000) ran for 1800034 milliseconds",
            "One rank waited `COLLECTIVE_TIMEOUT_S` for the others in a collective: most often rank 0 still "
            "loading a large model, a rank that died, or nodes that cannot reach each other on NCCL's "
            "interface. Raise `COLLECTIVE_TIMEOUT_S` for slow loads; set `NCCL_SOCKET_IFNAME` (forwarded to "
            "the workers) and `NCCL_DEBUG=INFO` to see which interface and peer.",
        ),
        (
            "Storage that cannot be written",
            storage,
            "Every node writes the checkpoints, so `STORAGE_PATH` must be shared storage (NFS, `s3://`, "
            "`gs://`) every node can write; the Set up cell checks from each node before training.",
        ),
        (
            "A Hub download that fails",
            "MODEL_NAME='meta-llama/Llama-2-70b-chat-hf': 1 of 2 nodes cannot get it (node 10.0.1.7: "
            "GatedRepoError: 401 Client Error ... Access to model meta-llama/Llama-2-70b-chat-hf is restricted)",
            "The Set up cell has every node fetch the model before training and names the nodes that "
            "cannot. Gated models need the license accepted on the Hub and `HF_TOKEN` on every node (a "
            "platform secret: Anyscale's, or a Kubernetes Secret). Offline clusters: put the model in a "
            "folder every node can read and set `MODEL_NAME` to it, with `HF_HUB_OFFLINE=1`.",
        ),
        (
            "A checkpoint from another world size",
            world,
            "DeepSpeed ZeRO cannot resume on a different number of workers. FSDP2's DCP checkpoints can "
            "(the Llama notebook's elastic runs reshard them).",
        ),
    ]
    out = []
    for title, message, what in sections:
        out.append(f"## {title}\n\n```text\n{_wrap(message)}\n```\n\n{what}\n")
    return "\n".join(out)


def _wrap(text: str, width: int = 110) -> str:
    import textwrap

    return "\n".join(textwrap.fill(line, width) for line in text.splitlines())


TABLES = {"techniques": techniques, "learning-path": learning_path, "troubleshooting": troubleshooting}
PLACEHOLDER = re.compile(r"^<!-- table: ([a-z-]+) -->$", re.MULTILINE)


def fill(text: str) -> str:
    return PLACEHOLDER.sub(lambda m: TABLES[m.group(1)](), text)
