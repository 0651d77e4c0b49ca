"""What smoke mode changes in each notebook: its laptop-sized model, data and run.

Used by `helpers.set_up` (the Set up cell). Each table maps a parameter to `(the full-scale default in the
notebook's parameters cell, the smoke value)`; `helpers.smoke.smoke_overrides` replaces only parameters
still at that default, and prints what it replaced. The models are built on this machine, with random
weights; the data are fixtures shaped like the Hub's datasets.
"""

from __future__ import annotations

__all__ = ["smoke_table"]


def _run_settings(kill_at_step: int) -> dict:
    """Every notebook's: a CPU worker per Ray node where there are two, the planned kill, local storage."""
    from .cache import cache_dir

    return {
        "USE_GPU": (True, False),
        "PLACEMENT_STRATEGY": ("PACK", "SPREAD"),  # one worker per Ray node (a no-op on a one-node Ray)
        "KILL_WORKER_AT_STEP": (0, kill_at_step),  # see the notebook's "When a worker dies"
        "STORAGE_PATH": ("/mnt/cluster_storage/", str(cache_dir() / "ray_results")),
    }


def _dolly(namespace: dict) -> dict:
    from .fixtures import play_script_fixture
    from .tiny_models import tiny_model

    return {
        # 2 layers, random weights, stored in bf16 like the Hub's dolly-v2-7b
        "MODEL_NAME": ("databricks/dolly-v2-7b", tiny_model("gpt_neox", dtype="bfloat16")),
        "DATASET_NAME": ("karpathy/tiny_shakespeare", play_script_fixture()),
        "NUM_WORKERS": (16, 2),
        "CPUS_PER_WORKER": (8, 1),
        "PRECISION": ("16-mixed", "bf16-mixed"),  # CPUs have no fp16 autocast
        "CPU_OFFLOAD": (True, False),
        "MAX_SEQ_LEN": (256, 32),  # the fixture's lines are short
        "BATCH_SIZE_PER_WORKER": (5, 8),
        "LEARNING_RATE": (2e-5, 3e-3),  # random weights need far bigger steps than fine-tuning
        **_run_settings(7),  # "When a worker dies": its run's step 7 of 8, after the step-4 checkpoint
    }


def _gpt2(namespace: dict) -> dict:
    from .fixtures import ag_news_fixture
    from .tiny_models import tiny_model

    return {
        "MODEL_NAME": ("gpt2", tiny_model("gpt2")),  # 2 layers, random weights
        "DATASET_NAME": ("ag_news", ag_news_fixture()),  # ag_news-shaped parquet files
        "CPUS_PER_WORKER": (8, 1),
        "MAX_SEQ_LEN": (512, 64),  # the fixture's headlines are short
        "BATCH_SIZE_PER_WORKER": (1, 8),  # less noisy losses than 1 sample per step
        "NUM_EPOCHS": (1, 2),  # two checkpoints before the resume section adds a third epoch
        "MAX_STEPS_PER_EPOCH": (30, 12),
        "LEARNING_RATE": (1e-6, 2e-3),  # random weights need far bigger steps than fine-tuning
        # "When a worker dies" trains 2 epochs of 4 steps: step 7 comes after its step-4 checkpoint.
        **_run_settings(7),
    }


def _glue(namespace: dict) -> dict:
    from .fixtures import glue_fixture
    from .tiny_models import tiny_model

    return {
        "MODEL_NAME": ("distilbert-base-uncased", tiny_model("distilbert")),  # 2 layers
        "GLUE_PATH": ("hf://datasets/nyu-mll/glue", glue_fixture()),  # the Hub's layout
        "NUM_WORKERS": (1, 2),
        "CPUS_PER_WORKER": (2, 1),
        "NUM_EPOCHS": (2, 5),  # 16 steps each
        "LEARNING_RATE": (2e-5, 2e-3),  # random weights need far bigger steps than fine-tuning
        **_run_settings(21),  # "When a worker dies": its second epoch, after the step-16 checkpoint
    }


def _tiny_llama(width: int, intermediate: int, heads: int) -> str:
    """A 4-layer Llama 2 with random weights and a tokenizer trained on the chat fixture, stored in half
    precision like the Hub's Llama 2 checkpoints."""
    from .tiny_models import tiny_model

    return tiny_model(
        "llama",
        hidden_size=width,
        intermediate_size=intermediate,
        num_hidden_layers=4,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        dtype="bfloat16",
    )


def _llama_common() -> dict:
    from .fixtures import chat_fixture

    return {
        "DATASET_NAME": ("smangrul/code-chat-assistant-v1", chat_fixture()),
        "MAX_SEQ_LEN": (2048, 128),
        "LEARNING_RATE": (5e-5, 1e-3),  # random weights need far bigger steps than fine-tuning
        "WARMUP_RATIO": (0.03, 0.1),  # a gentler start for those big steps
        "LOGGING_STEPS": (25, 2),
        "USE_GRADIENT_CHECKPOINTING": ("auto", True),  # the recipe's recomputation, on CPU workers too
    }


def _llama_fsdp(namespace: dict) -> dict:
    elastic = namespace.get("MIN_WORKERS") is not None
    return {
        "MODEL_NAME": ("meta-llama/Llama-2-70b-chat-hf", _tiny_llama(512, 1408, 8)),  # 13M parameters
        **_llama_common(),
        "MAX_STEPS": (500, 24),
        "GRADIENT_ACCUMULATION_STEPS": (1, 2),  # 2 micro-steps of 1 sequence per worker and step
        "SAVE_STEPS": (250, 12),
        "EVAL_STEPS": (100, 8),  # the held-out loss at steps 8, 16 and 24
        "NUM_WORKERS": (16, 2),
        "CPUS_PER_WORKER": (10, 2 if elastic else 1),  # elastic: a worker per 2-CPU node
        "RESIZE_CHECK_S": (60, 5),
        # No planned kill: the first run is the post's; "when a worker or a node is lost" trains only on request.
        **{k: v for k, v in _run_settings(0).items() if k != "KILL_WORKER_AT_STEP"},
    }


def _llama_lora(namespace: dict) -> dict:
    return {
        # llama_fsdp's 13M-parameter model: rank-4 adapters are about 1 % of it, as rank 16 is 0.3 % of 70B.
        "MODEL_NAME": ("meta-llama/Llama-2-70b-chat-hf", _tiny_llama(512, 1408, 8)),
        **_llama_common(),
        "LORA_RANK": (16, 4),
        "MAX_STEPS": (500, 12),
        "SAVE_STEPS": (250, 4),
        "EVAL_STEPS": (100, 4),  # the held-out loss at steps 4, 8 and 12
        "NUM_WORKERS": (8, 2),
        "CPUS_PER_WORKER": (10, 1),
        **_run_settings(7),  # after the checkpoint at step 4
    }


_TABLES = {
    "dolly_lightning_fsdp": _dolly,
    "gpt2_deepspeed": _gpt2,
    "glue_text_classification": _glue,
    "llama_fsdp": _llama_fsdp,
    "llama_lora": _llama_lora,
}


def smoke_table(notebook: str, namespace: dict) -> dict[str, tuple]:
    """`notebook`'s smoke table for its parameters as they are in `namespace` (its globals): builds the
    tiny model and the fixtures (cached after the first time)."""
    return _TABLES[notebook](namespace)
