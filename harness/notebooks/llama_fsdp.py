"""llama_fsdp: the Hugging Face Llama 2 70B FSDP recipe on FSDP2 in Ray Train."""

from __future__ import annotations

from helpers.plan import Recipe
from helpers.validate import ParameterError, check_choice, check_int

from . import check_common, held_out_results, run_settings, section_run

ELASTIC_REFUSED = None  # its checkpoint loads at any world size, and its loop keeps the global batch

# Its smoke run's time budget in the tests (nbval, JupyterLab): see tests/notebook_runs.py.
SMOKE_BUDGET_S = 330


def check(p: dict) -> None:
    """The parameters cell's values `p`, by this notebook's rules; a ParameterError names the first bad one."""
    check_int("RESIZE_CHECK_S", p["RESIZE_CHECK_S"], minimum=1, maximum=3600)
    check_int("SHORT_SAVE_STEPS", p["SHORT_SAVE_STEPS"], minimum=1)
    check_choice("USE_COMPILE", p["USE_COMPILE"], [True, False])
    check_llama(p)


def check_llama(p: dict, kill_steps: int | None = -1) -> None:
    """What both Llama notebooks check: the recipe's numbers. `kill_steps`: the steps of the run that
    KILL_WORKER_AT_STEP kills a worker in (-1: MAX_STEPS; None: unbounded)."""
    check_int("MAX_SEQ_LEN", p["MAX_SEQ_LEN"], minimum=16)
    check_int("MAX_STEPS", p["MAX_STEPS"], minimum=1)
    check_int("GRADIENT_ACCUMULATION_STEPS", p["GRADIENT_ACCUMULATION_STEPS"], minimum=1)
    check_int("LOGGING_STEPS", p["LOGGING_STEPS"], minimum=1)
    check_int("SAVE_STEPS", p["SAVE_STEPS"], minimum=1)
    check_int("EVAL_STEPS", p["EVAL_STEPS"], minimum=1)
    check_int("COLLECTIVE_TIMEOUT_S", p["COLLECTIVE_TIMEOUT_S"], minimum=60, maximum=7 * 24 * 3600)
    check_choice("USE_FLASH_ATTN", p["USE_FLASH_ATTN"], [True, False])
    check_choice("USE_GRADIENT_CHECKPOINTING", p["USE_GRADIENT_CHECKPOINTING"], [True, False, "auto"])
    for name in ("WEIGHT_DECAY", "WARMUP_RATIO"):
        value = p[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise ParameterError(f"{name}={value!r}: must be a number in [0, 1).")
    check_common(p, p["MAX_STEPS"] if kill_steps == -1 else kill_steps)


def plan_recipe(p: dict) -> Recipe:
    """The recipe as `helpers.plan.plan_training` sees it, for the parameters `p`."""
    return Recipe(
        activation_checkpointing=p["USE_GRADIENT_CHECKPOINTING"],
        sharding="fsdp",
        gather_bytes=2,  # MixedPrecisionPolicy(param_dtype=bfloat16)
        loading="rank 0",  # the other ranks build on `meta`
        checkpoint="streamed",  # each rank writes its shard straight to STORAGE_PATH
        export_bytes=2,  # the consolidated bf16/fp16 model rank 0 writes at the end
        num_to_keep=2,
        vocab_size=None,  # the 4 chat tokens add 4 rows: nothing the plan can see
        foreach_optimizer=False,  # the training function's AdamW(foreach=False)
        separate_embeddings=True,  # shard_model wraps the embeddings and the head as FSDP units of their own
        reduce_bytes=2,  # MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
        lora_rank=p.get("LORA_RANK", 0),  # > 0: adapters over a frozen bf16 base (the llama_lora notebook)
        lora_token_rows=4,  # with LoRA, the chat tokens' rows of the embeddings and the head train too
        lora_merged=p.get("LORA_MERGED", False),  # and a merged model exported next to the adapter
        collective_timeout_s=p.get("COLLECTIVE_TIMEOUT_S"),  # a checkpoint's save must end well within it
        fixes={
            "gpu": "Use more NUM_WORKERS (nodes in CLUSTER), or lower BATCH_SIZE_PER_WORKER or MAX_SEQ_LEN"
            + ("." if p["USE_GRADIENT_CHECKPOINTING"] else ", or set USE_GRADIENT_CHECKPOINTING=True."),
            "host": "Choose nodes with more RAM in CLUSTER.",
            "disk": "Choose nodes with more local disk in CLUSTER.",
        },
    )


def tiny_llama(width: int, intermediate: int, heads: int) -> str:
    """A 4-layer Llama 2 with random weights and a tokenizer trained on the chat fixture, stored in half
    precision like the Hub's Llama 2 checkpoints."""
    from harness.tiny_models import tiny_model

    return tiny_model(
        "llama",
        hidden_size=width,
        intermediate_size=intermediate,
        num_hidden_layers=4,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        dtype="bfloat16",
    )


def smoke_common() -> dict:
    from harness.fixtures import chat_fixture

    return {
        "DATASET_NAME": ("smangrul/code-chat-assistant-v1", chat_fixture()),
        "MAX_SEQ_LEN": (2048, 128),
        "LEARNING_RATE": (5e-5, 1e-3),  # random weights need far bigger steps than fine-tuning
        "WARMUP_RATIO": (0.03, 0.1),  # a gentler start for those big steps
        "LOGGING_STEPS": (25, 2),
        "USE_GRADIENT_CHECKPOINTING": ("auto", True),  # the recipe's recomputation, on CPU workers too
    }


def smoke(namespace: dict) -> dict:
    """Smoke mode's table: `{parameter: (the full-scale default, the laptop value)}`."""
    elastic = namespace.get("MIN_WORKERS") is not None
    return {
        "MODEL_NAME": ("meta-llama/Llama-2-70b-chat-hf", tiny_llama(512, 1408, 8)),  # 13M parameters
        **smoke_common(),
        "MAX_STEPS": (500, 24),
        "GRADIENT_ACCUMULATION_STEPS": (1, 2),  # 2 micro-steps of 1 sequence per worker and step
        "SAVE_STEPS": (250, 12),
        "EVAL_STEPS": (100, 8),  # the held-out loss at steps 8, 16 and 24
        "NUM_WORKERS": (16, 2),
        "CPUS_PER_WORKER": (10, 2 if elastic else 1),  # elastic: a worker per 2-CPU node
        "RESIZE_CHECK_S": (60, 5),
        "SHORT_SAVE_STEPS": (10, 2),  # the lone worker saves every other step: growing back repeats 1 or 2
        "USE_COMPILE": (True, False),  # compiling costs 2 CPU cores more than it saves in 24 steps
        # No planned kill: the first run is the post's; "when a worker or a node is lost" trains only on request.
        **{k: v for k, v in run_settings(0).items() if k != "KILL_WORKER_AT_STEP"},
    }


def results(ns: dict) -> dict:
    """The run's numbers, from the notebook's globals once "What the run showed" has run."""
    from harness.storage import uri

    watch, ranks, attempts, losses = ns["watch"], ns["ranks"], ns["attempts"], ns["losses"]
    fs, checkpoint_path = ns["fs"], ns["checkpoint_path"]
    return {
        "losses": losses,
        **held_out_results(ns),
        "checkpoint_path": uri(fs, checkpoint_path),
        "final_loss": losses[-1],
        "load_peak_rss_mb": [r["load"]["peak_growth_mb"] for r in ranks],
        "param_shard_fraction": [r["shard_fraction"] for r in ranks],
        "worker_node_ids": [r["node_id"] for r in ranks],
        "worker_threads": [r["threads"] for r in ranks],
        "sharded_checkpoint_path": uri(fs, f"{checkpoint_path}/sharded"),
        "consolidated_path": uri(fs, f"{checkpoint_path}/consolidated"),
        "num_params": ns["num_params"],
        "tokens_per_second": ns["tokens_per_second"],
        "mfu": ns["mfu"],
        "generated": ns["generated"],
        "attn_implementation": ranks[0]["attn"],
        "pretrained_loads": sum(a["ranks"][0]["pretrained"] for a in attempts if a["ranks"]),
        "state_bytes": [r["state_bytes"] for r in ranks],
        "plan": ns["plan"].as_dict(),
        "attempts": attempts,
        "kill": None,
        # "Going further: when a worker or a node is lost": its own run, where it trained (else None)
        "elastic": section_run(ns, "llama_fsdp", "elastic_watch", "elastic_run"),
        "train_seconds": ns["train_seconds"],
        "mlflow_run_id": watch.mlflow_run_id,
    }
