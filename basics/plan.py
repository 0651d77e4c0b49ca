"""Will it fit? A memory, disk and storage plan for a training run, before it spends any GPU time.

Used by `harness.checks.check_parameters` in the "Set up" cell of the GPT-2, Dolly and Llama notebooks (which
refuses a run that cannot fit before anything is downloaded), and by their sharding sections, which show
the table next to the explanation (`harness.sizing.compare_plans`: ZeRO stages, or 1 worker against many,
at full scale). From the model's architecture (its config; the parameters are counted on the `meta` device,
without weights) and the run's parameters it works out, per GPU, per node and in storage, what the
run needs, compares that with the cluster, prints one table and refuses where the run cannot fit,
naming the parameters to change.

A row fails when the need exceeds what the node has and warns above 85 %: these are estimates (about
10 % either way).

Where each figure comes from is in the notes below the imports.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from .checkpoints import COLLECTIVE_SHARE, STREAM_FILE_BYTES, STREAM_RATE, STREAMS
from .hardware import NODE_TYPES, NodeType, placement
from .validate import ParameterError

# ---- Where the figures come from --------------------------------------------------------------------------
#
# The real models' configs ship in `basics/architectures/` (a few KB of JSON, the Hub's `config.json`
# architecture fields), so the full-scale plan is computed offline, on a laptop.
#
# In bytes per parameter P, with N workers sharing the model:
#
# - Sharded model states, AdamW with fp32 master weights: 4 (weights) + 4 (gradients) + 8 (the two
#   moments) = 16 P / N per GPU for FSDP; for DeepSpeed ZeRO, DeepSpeed's own estimators
#   (`estimate_zero2/3_model_states_mem_needs`), which also count ZeRO's 16-bit copy of the weights.
#   `tests/test_plan.py` checks the FSDP figure against DeepSpeed's ZeRO-3 estimate.
# - While a layer runs FSDP holds its full weights: the largest layer, twice (the next one is prefetched),
#   in the dtype FSDP gathers in. In the backward pass it also holds the layer's full gradients in that
#   dtype and their copy in `reduce_dtype` for the reduce-scatter: 2 + 4 = 6 bytes per parameter of the
#   layer with bf16 compute and an fp32 reduction, 2 + 2 with a bf16 one (the Llama notebook's, and the
#   `accelerate` default the Hugging Face post ran). The root unit (embeddings, final norm, head) stays
#   gathered for the whole step, and its gradients stay whole until the end of the backward pass; where the
#   embeddings and the head are FSDP units of their own (`separate_embeddings`), only one of them is
#   gathered at a time and its gradients are reduce-scattered at once.
# - Activations per layer: b s h (34 + 5 a s / h) bytes in 16-bit (Korthikanti et al. 2022, "Reducing
#   activation recomputation in large transformer models"); without the attention-scores term for
#   sdpa/FlashAttention, which never store them. With activation checkpointing only each layer's
#   input (2 b s h bytes) is kept, plus one layer's activations during its recomputation, which comes
#   after the loss's backward pass has freed the logits' gradients: the larger of the two counts. GPT-2's
#   `gelu_new`, a chain of eager operations, keeps three more tensors of the MLP's width per layer. The
#   logits add b s V 12 bytes at the loss's backward: the fp32 log-probabilities it saved, their gradient
#   and the logits' gradient (CUDA's allocator history on an H100, for GPT-2 and for Llama with LoRA; the
#   16-bit logits and their fp32 copy are freed by then).
# - The optimizer step runs after the backward pass has freed the activations: torch's default
#   ("foreach") AdamW allocates a temporary the size of the weights it updates (4 P / N), the for-loop
#   one (`foreach=False`) only one tensor's worth. The per-GPU peak is the larger of the two phases.
# - DeepSpeed ZeRO-1/2 also allocates its gradient reduction buckets in the backward pass:
#   `reduce_bucket_size` elements in the 16-bit dtype, twice with `overlap_comm` (`stage_1_and_2.py`,
#   `setup_buckets`). The GPT-2 notebook's config asks for 5e7 (200 MB in all); DeepSpeed's default, 5e8,
#   would hold 2 GB whatever the model. ZeRO's step, on the GPU, holds the fp32 gradient partition
#   (4 P / N, which DeepSpeed's estimator counts throughout) and torch's default AdamW temporary
#   (4 P / N); ZeRO-3 keeps its 16-bit gradient partition (2 P / N) too. The peak is the larger of the
#   backward pass and the step (measured on an H200, and tensor by tensor with the profiler on CPU).
#   ZeRO-3 with the weights offloaded (`offload_param`) copies them to the GPU as layers run, and from the
#   second step on the copies stayed there through the backward pass: the whole 16-bit model, 2 P bytes
#   (CUDA's allocator history on an H100, GPT-2 124M on one GPU: 249 MB of 1.01 GB at the peak, which is
#   in the backward pass: the step runs on the CPU).
# - A CUDA context (1 GiB), NCCL's buffers (0.5 GiB), and 2 % of the rest for the caching allocator's
#   fragmentation (with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, which `harness.cluster.start_ray`
#   sets for every worker). GPU memory is what torch sees (`total_memory`), not the product name:
#   79.2 GiB on an "80 GB" A100 or H100.
#
# LoRA (`lora_rank` > 0, FSDP only): the base model is frozen and kept in bf16, 2 P / N per GPU, with no
# gradients, no moments and no fp32 master copy; the adapters (A, counted by `peft` on the `meta` model,
# new tokens' rows of the embeddings and the head included) are trained as the full model is, 16 A / N. A
# layer is gathered with its adapters; only the adapters have gradients to reduce-scatter; the activations
# are those of full fine-tuning (the frozen weights still pass gradients back to every layer's input).
# Rank 0 loads the base in bf16. A checkpoint holds the adapters and their moments, 12 A.

__all__ = [
    "NODE_TYPES",
    "Plan",
    "model_config",
    "model_size",
    "plan_training",
    "generation_memory_bytes",
    "state_bytes",
    "LORA_TARGETS",
]

GiB = 1024**3
ARCHITECTURES = Path(__file__).parent / "architectures"
# Hub id -> shipped config (the architecture only: Llama-2-70b-hf and -chat-hf are the same network).
SHIPPED = {
    "gpt2": "gpt2.json",
    "openai-community/gpt2": "gpt2.json",
    "databricks/dolly-v2-7b": "dolly-v2-7b.json",
    "meta-llama/Llama-2-7b-hf": "llama-2-7b.json",
    "meta-llama/Llama-2-7b-chat-hf": "llama-2-7b.json",
    "meta-llama/Llama-2-70b-hf": "llama-2-70b.json",
    "meta-llama/Llama-2-70b-chat-hf": "llama-2-70b.json",
}
FAIL_ABOVE, WARN_ABOVE = 1.0, 0.85
CUDA_OVERHEAD = 1 * GiB  # the CUDA context
NCCL_BUFFERS = GiB // 2
ALLOCATOR_RESERVE = 0.02  # fragmentation, with expandable segments
ZERO_REDUCE_BUCKET = 50_000_000  # elements: the GPT-2 notebook's reduce_bucket_size (a test keeps them equal)


def model_config(model_name: str):
    """The model's config: shipped for the notebooks' Hub models (offline), else read from its folder or the Hub."""
    from transformers import AutoConfig

    if model_name in SHIPPED:
        fields = json.loads((ARCHITECTURES / SHIPPED[model_name]).read_text())
        fields.pop("_source")
        return AutoConfig.for_model(**fields)
    return AutoConfig.from_pretrained(model_name)


@dataclass(frozen=True)
class _ModelSize:
    params: int  # all parameter elements (tied ones once)
    largest_layer: int  # the largest transformer block: the unit FSDP gathers at once
    root: int  # parameters outside the blocks (embeddings, final norm, head): FSDP's root unit
    largest_tensor: int
    num_layers: int
    hidden: int
    heads: int
    vocab: int
    mlp_extra: int = 0  # elements per token a layer's activation function keeps beyond its input


@functools.lru_cache(maxsize=16)
def _size_of(config_json: str) -> _ModelSize:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**json.loads(config_json))
    with torch.device("meta"):  # shapes only: no memory, no weights, under a second even for 70B
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    blocks = max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len)
    block_sizes = [sum(p.numel() for p in block.parameters()) for block in blocks]
    return _ModelSize(
        params=params,
        largest_layer=max(block_sizes),
        root=params - sum(block_sizes),
        largest_tensor=max(p.numel() for p in model.parameters()),
        num_layers=len(blocks),
        hidden=config.get_text_config().hidden_size,
        heads=config.get_text_config().num_attention_heads,
        vocab=config.get_text_config().vocab_size,
        mlp_extra=_mlp_extra(config.get_text_config()),
    )


def _mlp_extra(config) -> int:
    """GPT-2's `gelu_new` is a chain of eager torch operations (transformers' NewGELUActivation): its backward
    keeps four tensors of the MLP's width, not the one of a fused GELU (its input); three more per token.
    Measured on an H100 (ci/gpu/results/zero3_offload_h100.json: 48 tensors of 3.1 MB for 12 layers)."""
    act = getattr(config, "activation_function", None) or getattr(config, "hidden_act", None)
    if act != "gelu_new":
        return 0
    width = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
    return 3 * (width or 4 * config.hidden_size)


def model_size(config) -> _ModelSize:
    """Parameter counts of `config`'s causal LM, built on the `meta` device (no weights)."""
    return _size_of(config.to_json_string(use_diff=False))


# The projections LoRA adapts: attention and MLP, as the anyscale templates, torchtune and the PEFT
# docs do for Llama ("all linear layers" but the head).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class _LoraSize:
    params: int  # adapter elements (A and B of every targeted projection)
    largest_layer: int  # adapter elements of the largest transformer block
    largest_tensor: int


@functools.lru_cache(maxsize=16)
def _lora_size_of(config_json: str, rank: int, targets: tuple[str, ...], token_rows: int) -> _LoraSize:
    import warnings

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**json.loads(config_json))
    # New tokens' rows of the embeddings and the head, trained beside the adapters; which rows is not counted.
    rows = (
        {"embed_tokens": list(range(token_rows)), "lm_head": list(range(token_rows))} if token_rows else None
    )
    with torch.device("meta"), warnings.catch_warnings():
        # peft asks transformers 5 `is_gradient_checkpointing`, which warns that it is deprecated.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        model = get_peft_model(
            AutoModelForCausalLM.from_config(config),
            LoraConfig(
                r=rank, target_modules=list(targets), task_type="CAUSAL_LM", trainable_token_indices=rows
            ),
        )
    trainable = [p for p in model.parameters() if p.requires_grad]
    blocks = max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len)
    per_block = [sum(p.numel() for p in block.parameters() if p.requires_grad) for block in blocks]
    return _LoraSize(sum(p.numel() for p in trainable), max(per_block), max(p.numel() for p in trainable))


def _lora_size(config, rank: int, token_rows: int = 0, targets: tuple[str, ...] = LORA_TARGETS) -> _LoraSize:
    """Trained parameter counts of LoRA at `rank` on `config`'s causal LM, with `token_rows` rows of the
    embeddings and of the head (`trainable_token_indices`), as `peft` builds them on `meta`."""
    return _lora_size_of(config.to_json_string(use_diff=False), rank, tuple(targets), token_rows)


def generation_memory_bytes(model_name: str, dtype_bytes: int, on_gpu: bool) -> int:
    """Host RAM a generation task reserves: weights read tensor by tensor into a model on the GPU
    (the largest tensor in fp32, twice), or the whole half-precision model where it runs on the CPU;
    plus 2 GiB for Python, torch and the tokenizer."""
    size = model_size(model_config(model_name))
    model = 0 if on_gpu else size.params * dtype_bytes
    return model + 2 * size.largest_tensor * 4 + 2 * GiB


@dataclass
class _Row:
    what: str
    where: str  # "per GPU", "per node", "storage"
    need: int  # bytes
    have: int | None  # bytes; None: nothing to compare with
    fix: str = ""  # the parameters to change where it does not fit
    terms: str = ""  # what the figure is made of, for a person checking it

    @property
    def share(self) -> float | None:
        return None if not self.have else self.need / self.have

    @property
    def status(self) -> str:
        if self.share is None:
            return ""
        return "too big" if self.share > FAIL_ABOVE else "close" if self.share > WARN_ABOVE else "ok"


@dataclass
class Plan:
    title: str
    rows: list[_Row] = field(default_factory=list)
    details: dict[str, int] = field(default_factory=dict)  # the components of the per-GPU figure, bytes
    choices: dict[str, dict] = field(default_factory=dict)  # a parameter set to "auto": {"value", "why"}

    def table(self):
        import pandas as pd

        return pd.DataFrame(
            {
                "where": [r.where for r in self.rows],
                "needs (GB)": [round(r.need / 1e9, 3) for r in self.rows],
                "has (GB)": [None if r.have is None else round(r.have / 1e9, 1) for r in self.rows],
                "share": [None if r.share is None else f"{r.share:.0%}" for r in self.rows],
                "status": [r.status for r in self.rows],
                "main terms": [r.terms + (self._chosen() if i == 0 else "") for i, r in enumerate(self.rows)],
            },
            index=pd.Index(
                [r.what for r in self.rows], name=f"{self.title}: {self.details['params']:,} parameters"
            ),
        )

    def _chosen(self) -> str:
        """What each "auto" parameter became and why, after the training row's terms."""
        return "".join(f"; {name}='auto' -> {c['value']}: {c['why']}" for name, c in self.choices.items())

    def as_dict(self) -> dict:
        """The figures, for the results file: bytes per row and per component."""
        return {
            "rows": [
                {"what": r.what, "where": r.where, "need": r.need, "have": r.have, "status": r.status}
                for r in self.rows
            ],
            **self.details,
            "choices": self.choices,
        }

    def check(self) -> None:
        """Raise `ParameterError` naming what to change where a row does not fit; warn where it is close."""
        import warnings

        too_big = [r for r in self.rows if r.status == "too big"]
        if too_big:
            lines = [
                f"- {r.what} ({r.where}): needs {r.need / 1e9:.1f} GB of {r.have / 1e9:.1f} GB ({r.share:.0%}). {r.fix}"
                for r in too_big
            ]
            raise ParameterError(f"{self.title}: this run does not fit.\n" + "\n".join(lines))
        for r in self.rows:
            if r.status == "close":
                warnings.warn(
                    f"{self.title}: {r.what} ({r.where}) uses {r.share:.0%} of {r.have / 1e9:.1f} GB, close to "
                    f"the limit for an estimate. {r.fix}",
                    stacklevel=2,
                )
        seconds, limit = self.details.get("checkpoint_seconds"), self.details.get("checkpoint_limit_seconds")
        if limit and seconds > limit:
            warnings.warn(
                f"{self.title}: at the assumed rate a checkpoint takes {seconds / 60:.0f} min a rank, more than "
                f"the {limit / 60:.0f} min a save may take: raise COLLECTIVE_TIMEOUT_S, or use faster storage.",
                stacklevel=2,
            )
        compared = [r for r in self.rows if r.share is not None]
        print("It fits: " + "; ".join(f"{r.what} {r.share:.0%} ({r.status})" for r in compared))


def _activations(
    size: _ModelSize, batch: int, seq: int, act_bytes: int, checkpointing: bool
) -> tuple[int, int]:
    """(the activations the forward pass keeps, those of the one layer being recomputed), bytes."""
    per_layer = batch * seq * size.hidden * 34 * act_bytes // 2  # sdpa/flash: no stored attention scores
    per_layer += batch * seq * size.mlp_extra * act_bytes  # GPT-2's eager GELU: _mlp_extra
    if checkpointing:
        return size.num_layers * batch * seq * size.hidden * act_bytes, per_layer  # each layer's input
    return size.num_layers * per_layer, 0


def _zero_model_states(size: _ModelSize, stage: int, gpus_per_node: int, nodes: int, offload: str):
    """(per GPU, per node host RAM) bytes for ZeRO's model states, from DeepSpeed's own estimators."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    if stage == 3:
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            size.params,
            size.largest_layer,
            num_gpus_per_node=gpus_per_node,
            num_nodes=nodes,
            cpu_offload=offload != "none",
            cpu_offload_params=offload == "optimizer+params",
            zero_init=True,
            additional_buffer_factor=1.5,  # DeepSpeed's default: host buffers for the offloaded step
        )
    else:  # stages 1 and 2 share an estimator; stage 1 also keeps full 16-bit gradients
        cpu, gpu = estimate_zero2_model_states_mem_needs(
            size.params,
            num_gpus_per_node=gpus_per_node,
            num_nodes=nodes,
            cpu_offload=offload != "none",
            additional_buffer_factor=1.5,  # DeepSpeed's default: host buffers for the offloaded step
        )
        if stage == 1:
            gpu += 2 * size.params * (1 - 1 / (gpus_per_node * nodes))
    return int(gpu), int(cpu)


@dataclass(frozen=True)
class Recipe:
    """How a notebook trains, as the plan sees it: each notebook module's `plan_recipe` returns one.

    Args:
        activation_checkpointing: layers recompute their activations in the backward pass.
        sharding: "fsdp" or "zero0" ... "zero3".
        gather_bytes: bytes per element FSDP gathers the weights in (2 for 16-bit mixed precision:
            Lightning's "16-mixed" and "bf16-mixed", a bf16 `MixedPrecisionPolicy`; 4 for "32-true").
        fixes: what to suggest, per row kind: "gpu", "host", "disk".
        offload: "none", "optimizer" or "optimizer+params".
        loading: "every rank" loads the full fp32 model, "rank 0" only rank 0 (the others build on `meta`).
        checkpoint: "staged" (each rank writes a local folder that Ray uploads) or "streamed" (written
            straight to storage).
        export_bytes: bytes per element of a consolidated model rank 0 writes at the end (0: none).
        num_to_keep: checkpoints kept in storage.
        vocab_size: the vocabulary after new tokens are added (None: the config's).
        foreach_optimizer: AdamW's default implementation (see the notes at the top).
        separate_embeddings: FSDP wraps the embeddings and the head as units of their own.
        no_shard_alone: FSDP1, which runs a single worker as `NO_SHARD`: with CPU offload the whole
            model's 16-bit weights and gradients are then on its GPU at the peak (measured on an H200).
        reduce_bytes: bytes per element of the dtype FSDP reduce-scatters gradients in (4: float32).
        lora_rank: > 0 trains LoRA adapters of that rank on `LORA_TARGETS` over a frozen bf16 base (FSDP
            only; see the notes at the top).
        lora_token_rows: and that many rows of the embeddings and of the head (new tokens').
        lora_merged: it also exports the base with the adapters merged in.
        collective_timeout_s: the process group's timeout, within a share of which a streamed checkpoint
            must be written (`basics.checkpoints.COLLECTIVE_SHARE`).
    """

    activation_checkpointing: bool
    sharding: str
    gather_bytes: int
    fixes: dict[str, str]
    offload: str = "none"
    loading: str = "every rank"
    checkpoint: str = "staged"
    export_bytes: int = 0
    num_to_keep: int = 1
    vocab_size: int | None = None
    foreach_optimizer: bool = True
    separate_embeddings: bool = False
    no_shard_alone: bool = False
    reduce_bytes: int = 4
    lora_rank: int = 0
    lora_token_rows: int = 0
    lora_merged: bool = False
    collective_timeout_s: int | None = None


def plan_training(
    *, title: str, model_name: str, num_workers: int, cluster: dict[str, int] | None, batch_size: int, seq_len: int,
    recipe: Recipe,
) -> Plan:  # fmt: skip
    """Plan a run of `recipe` for `model_name` on `num_workers` workers of `batch_size` sequences of
    `seq_len` tokens. `cluster`: {node type: count} of `NODE_TYPES`, or None for this machine's CPU workers."""
    r = recipe
    config = model_config(model_name)
    size = model_size(config)
    if r.vocab_size:  # rows added for new tokens (Llama's chat tokens)
        extra = (r.vocab_size - size.vocab) * size.hidden * 2
        size = replace(size, params=size.params + extra, root=size.root + extra)
    lora = _lora_size(config, r.lora_rank, r.lora_token_rows) if r.lora_rank else None
    if lora and r.sharding != "fsdp":
        raise ValueError("lora_rank needs sharding='fsdp'")
    run = _Run(
        size=size, n=num_workers, lora=lora, stored=_stored_bytes(config), **placement(cluster, num_workers)
    )
    details: dict[str, int] = {"params": size.params, "largest_layer": size.largest_layer}
    if lora:
        details["lora_params"] = lora.params
    act_bytes = 2 if run.on_gpu else 4
    kept, recomputed = _activations(size, batch_size, seq_len, act_bytes, r.activation_checkpointing)
    activations = kept + recomputed
    logits = batch_size * seq_len * size.vocab * 12  # the loss's fp32 log-probabilities and two gradients
    # The loss's backward frees the logits' gradients before the first layer is recomputed.
    backward_peak = kept + max(recomputed, logits)
    if r.sharding == "fsdp":
        device, host, model_terms = _fsdp_device(run, backward_peak, r, details)
    else:
        device, host, model_terms = _zero_device(run, backward_peak, r, details)
    if run.on_gpu:
        reserve = int(device * ALLOCATOR_RESERVE) + CUDA_OVERHEAD + NCCL_BUFFERS
        device += reserve
        model_terms += f" + CUDA context, NCCL and allocator {_gb(reserve)}"
    details.update(activation_bytes=activations, logits_bytes=logits, device_bytes=device)
    if not run.on_gpu:  # the workers' devices are this machine's RAM too
        host += device * run.n
    rows = [
        _Row(
            f"training ({run.device_name})",
            run.where_device,
            device,
            run.device_have or None,
            r.fixes.get("gpu", ""),
            model_terms,
        ),  # fmt: skip
        *_host_and_disk_rows(run, host, r, details),
    ]
    if r.checkpoint == "streamed":  # the ranks' own writes, which the collective timeout bounds: their time
        rows[-1].terms += _checkpoint_time(run, r.collective_timeout_s, details)
    return Plan(title, rows, details)


def _checkpoint_time(run: _Run, collective_timeout_s: int | None, details: dict) -> str:
    """A streamed checkpoint's time: each rank's shard at `STREAMS` x `STREAM_RATE` (an assumption, stated),
    against the share of the collective timeout a save has (`harness.storage.dcp_writer`). A resume reads
    the same bytes back in as long."""

    rank_bytes = 12 * (run.lora.params if run.lora else run.size.params) // run.n
    seconds = rank_bytes / (STREAMS * STREAM_RATE)
    details.update(checkpoint_rank_bytes=rank_bytes, checkpoint_seconds=round(seconds))
    terms = (
        f"; each rank writes {_gb(rank_bytes)} (and reads it back to resume): {seconds / 60:,.1f} min at "
        f"{STREAMS} streams x {STREAM_RATE / 1e6:.0f} MB/s, an assumed rate"
    )
    if collective_timeout_s:
        limit = COLLECTIVE_SHARE * collective_timeout_s
        details["checkpoint_limit_seconds"] = round(limit)
        terms += (
            f", of the {limit / 60:,.0f} min a save may take ({COLLECTIVE_SHARE:.0%} of COLLECTIVE_TIMEOUT_S)"
        )
    return terms


@dataclass(frozen=True)
class _Run:
    """What every part of a plan reads: the model's sizes, the workers, the node that fits worst."""

    size: _ModelSize
    n: int  # workers
    lora: _LoraSize | None
    stored: int  # bytes per parameter of the checkpoint as stored (its pages, memory-mapped while loading)
    on_gpu: bool
    node: NodeType
    per_node: int  # workers on that node
    nodes: int
    device_have: int  # bytes of one worker's device (a GPU, or a CPU worker's share of RAM)
    device_name: str
    where_device: str


def _gb(b: float) -> str:
    return f"{b / 1e9:,.1f} GB"


def _stored_bytes(config) -> int:
    return {"float32": 4, "float64": 8}.get(str(config.dtype).removeprefix("torch."), 2)


def _fsdp_device(
    run: _Run, activations_and_logits: int, recipe: Recipe, details: dict
) -> tuple[int, int, str]:
    """FSDP's bytes per worker's device, the host RAM its offload takes per node, and the terms."""
    gather_bytes, reduce_bytes, offload = recipe.gather_bytes, recipe.reduce_bytes, recipe.offload
    foreach_optimizer, separate_embeddings = recipe.foreach_optimizer, recipe.separate_embeddings
    no_shard_alone = recipe.no_shard_alone
    size, lora, n, p = run.size, run.lora, run.n, run.size.params
    # What is trained: the whole model, or (LoRA) the adapters over a frozen bf16 base.
    trained, trained_layer = (lora.params, lora.largest_layer) if lora else (p, size.largest_layer)
    trained_tensor = lora.largest_tensor if lora else size.largest_tensor
    base = 2 * p if lora else 0  # the frozen base's bf16 shards
    details["param_bytes_per_rank"] = (base + 4 * trained) // n
    details["optimizer_bytes_per_rank"] = 8 * trained // n
    details["grad_bytes_per_rank"] = 4 * trained // n  # fp32, reduce-scattered every micro-step
    shards = (base + 16 * trained) // n  # fp32 weights, gradients and AdamW moments: this rank's share
    # Forward/backward: two layers gathered, and the root unit; one layer's gradients, whole, in the
    # gathered dtype and in fp32 for the reduce-scatter; the root's gradients, whole until the end.
    root = size.largest_tensor if separate_embeddings else size.root
    root_grads = 0 if separate_embeddings or lora else size.root * gather_bytes  # LoRA: frozen
    layer_grads = (gather_bytes + reduce_bytes) * trained_layer
    layer = size.largest_layer + (lora.largest_layer if lora else 0)
    working = (2 * layer + root) * gather_bytes + layer_grads + root_grads
    if lora and recipe.lora_token_rows:
        # peft's trainable token rows: each forward builds the whole table with the rows written in
        # (`index_copy`), and the backward gives it a full-vocabulary gradient before the rows' are picked;
        # the head's copy is kept for its backward: two vocabulary x hidden tensors at once.
        tokens = 2 * gather_bytes * (recipe.vocab_size or size.vocab) * size.hidden
        details["token_rows_bytes"] = tokens
        working += tokens
    # torch's default (foreach) AdamW step allocates a temporary the size of the weights it updates.
    step = 4 * trained // n if foreach_optimizer else 4 * trained_tensor // n
    details["optimizer_step_temporary_bytes"] = step
    if offload != "none":  # the shards and the step on the CPU
        what = "gathered layers"
        if no_shard_alone and n == 1:  # FSDP1's NO_SHARD keeps every unit's 16-bit copies through the step
            working, what = (
                max(working, 2 * gather_bytes * p),
                "the whole model's 16-bit weights and gradients",
            )
        terms = f"{what} {_gb(working)} + activations and logits {_gb(activations_and_logits)}"
        return working + activations_and_logits, (shards + step) * run.per_node, terms
    if lora and recipe.lora_token_rows:
        terms_tokens = (
            f" (with the token rows' merged head and its gradient {_gb(details['token_rows_bytes'])})"
        )
    else:
        terms_tokens = ""
    state = (
        f"(2 B x params frozen bf16 base + 16 B x {lora.params:,} adapter params) / {n} workers"
        if lora
        else f"16 B x params / {n} workers (fp32 weights, gradients, AdamW moments)"
    )
    terms = (
        f"{state} {_gb(shards)} + the larger of gathered layers{terms_tokens} and activations "
        f"{_gb(working + activations_and_logits)}, optimizer step {_gb(step)}"
    )
    return shards + max(working + activations_and_logits, step), 0, terms


def _zero_device(
    run: _Run, activations_and_logits: int, recipe: Recipe, details: dict
) -> tuple[int, int, str]:
    """DeepSpeed ZeRO's bytes per worker's device (its own estimator), the host RAM an offload takes, and
    the terms."""
    p, n = run.size.params, run.n
    stage, gather_bytes, offload = (
        int(recipe.sharding.removeprefix("zero")),
        recipe.gather_bytes,
        recipe.offload,
    )
    if stage == 0:  # plain data parallel: DeepSpeed's count, nothing partitioned
        states, cpu = 18 * p, 0
    else:
        states, cpu = _zero_model_states(run.size, stage, max(run.per_node, 1), run.nodes, offload)
    element = 2 if gather_bytes == 2 else 4  # the 16-bit weights and gradients, or fp32
    buckets, kept = 0, 0
    if stage == 3 and offload == "optimizer+params":  # the weights' GPU copies, kept through the backward
        kept = element * p
        details["gathered_weights_bytes"] = kept
    if stage in (1, 2):  # the gradient reduction buckets, two with overlap_comm (the notebook's): backward
        buckets = 2 * ZERO_REDUCE_BUCKET * element
    elif stage == 3:  # stage 3 allocates one (its "IPG" buffer, contiguous_gradients), offloaded or not
        states += ZERO_REDUCE_BUCKET * element
    details["param_bytes_per_rank"] = 2 * (p // n if stage == 3 else p)  # ZeRO's bf16/fp16 weights
    details["optimizer_bytes_per_rank"] = 12 * p // (n if stage else 1)  # fp32 master weights, 2 moments
    if stage and offload == "none":
        # The step runs on the GPU after the backward pass has freed the activations. The estimator's fp32
        # gradient partition (4 P / N) exists only then, beside torch's default (foreach) AdamW temporary
        # (4 P / N); stage 3 also keeps its 16-bit gradient partition (2 P / N) through the step.
        # ZeRO-1/2's reduction buckets live in the backward pass (measured on CPU and an H200: 22 P at the
        # step for one GPU, no buckets).
        fp32_grads, step = 4 * p // n, 4 * p // n
        states += -fp32_grads + (2 * p // n if stage == 3 else 0)
        details["optimizer_step_temporary_bytes"] = fp32_grads + step
        backward = buckets + activations_and_logits
        terms = (
            f"ZeRO-{stage} model states and buffers {_gb(states)} (DeepSpeed's estimator, its fp32 gradients "
            f"moved to the step) + the larger of the backward pass's activations, logits and buckets "
            f"{_gb(backward)} and the optimizer step's fp32 gradients and AdamW temporary {_gb(fp32_grads + step)}"
        )
        return states + max(backward, fp32_grads + step), 0, terms
    states += buckets
    terms = f"ZeRO-{stage} model states and buffers {_gb(states)} (DeepSpeed's estimator)"
    terms += f" + the weights' GPU copies {_gb(kept)}" if kept else ""
    terms += f" + activations and logits {_gb(activations_and_logits)}"
    return states + kept + activations_and_logits, cpu if offload != "none" else 0, terms


def _host_and_disk_bytes(run: _Run, recipe: Recipe) -> dict[str, int]:
    """The bytes of `_host_and_disk_rows`: per node while loading, at a checkpoint, to consolidate; on local
    disk; in storage per checkpoint."""
    sharding, loading, checkpoint = recipe.sharding, recipe.loading, recipe.checkpoint
    export_bytes, lora_merged = recipe.export_bytes, recipe.lora_merged

    size, lora, n, per_node, stored, p = run.size, run.lora, run.n, run.per_node, run.stored, run.size.params
    # Loading holds the fp32 model and, while converting, the checkpoint's pages in its stored dtype
    # (safetensors are memory-mapped: RSS counts them). Measured in the Llama smoke run: within 1 %.
    loaded = 2 if lora else 4  # LoRA: the frozen base in bf16, not fp32 master weights
    loads = (loaded + stored) * p * (per_node if loading == "every rank" else 1)
    saved = lora.params if lora else p  # a checkpoint holds what is trained, and its moments
    # LoRA: the fp32 adapter folder, and with `lora_merged` the merged model in the export dtype too.
    exported = 4 * lora.params + (export_bytes * p if lora_merged else 0) if lora else export_bytes * p
    checkpoint_bytes = 12 * saved + exported  # weights and moments in fp32 (+ the export)
    # Staged: every shard is copied to host RAM. Streamed: a rank holds a file's tensors until the file is
    # closed, and pyarrow queues that file's upload parts: twice the file size per file, STREAMS at once.
    streamed = 2 * min(STREAMS * STREAM_FILE_BYTES, 12 * saved // n) * per_node
    host_ckpt = 12 * saved // n * per_node if checkpoint == "staged" else streamed
    # Rank 0 gathers what it exports: the full fp32 model in place, or (LoRA) the fp32 adapters.
    consolidate = (
        (4 * saved + 4 * (lora.largest_tensor if lora else size.largest_tensor)) if export_bytes else 0
    )
    if lora and lora_merged:  # then it reads the base again to merge: the model and the file's pages
        consolidate = max(consolidate, (export_bytes + stored) * p)
    # Staged: each rank's shard is written locally before Ray uploads it. A resuming rank fetches only
    # its own shard (Dolly reads its byte ranges in place; GPT-2 copies its own files), so a sharded
    # run's node needs its ranks' shards; ZeRO-0 to 2 keep the full weights in rank 0's files, counted
    # whole.
    sharded_state = sharding in ("fsdp", "zero3")
    temp = (12 * p // n * per_node if sharded_state else 12 * p) if checkpoint == "staged" else 0
    temp += exported if export_bytes else 0  # rank 0 writes the export before it is uploaded
    download = stored * size.params  # the Hub download, in each node's Hugging Face cache
    return dict(
        loaded=loaded, loads=loads, load_rank0=(loaded + stored) * p, checkpoint=checkpoint_bytes,
        host_ckpt=host_ckpt, consolidate=consolidate, local_disk=temp + download, temp=temp, download=download,
    )  # fmt: skip


def _host_and_disk_terms(run: _Run, b: dict[str, int], recipe: Recipe) -> tuple[str, str, str]:
    """How `_host_and_disk_rows` arrives at its loading, checkpoint and disk figures, in words."""
    sharding, loading, checkpoint, export_bytes = (
        recipe.sharding,
        recipe.loading,
        recipe.checkpoint,
        recipe.export_bytes,
    )

    lora, n, per_node, stored = run.lora, run.n, run.per_node, run.stored
    loaded, sharded_state = b["loaded"], sharding in ("fsdp", "zero3")
    loaders = f"{per_node} ranks" if loading == "every rank" else "rank 0"
    load_terms = (
        f"{loaders} x ({'bf16' if lora else 'fp32'} model + the stored checkpoint's pages) = "
        f"{loaded + stored} B x params each"
    )
    ckpt_terms = (
        f"12 B x params / {n} x {per_node} ranks, copied to host"
        if checkpoint == "staged"
        else f"streamed in files of {STREAM_FILE_BYTES / GiB:.0f} GiB, {STREAMS} at once: "
        f"2 x {STREAMS} files' worth x {per_node} ranks"
    )
    staged = (
        (f"staged shards 12 B x params / {n} x {per_node} ranks + " if sharded_state else "staged checkpoint 12 B x params + ")
        if checkpoint == "staged"
        else ""
    )  # fmt: skip
    disk_terms = (
        staged
        + (f"export {export_bytes} B x params + " if export_bytes else "")
        + (f"Hub download {stored} B x params")
        + "; the Set up cell also checks the disks under HF_HOME and TMPDIR, where the files go, on every node"
    )
    return load_terms, ckpt_terms, disk_terms


def _host_and_disk_rows(run: _Run, host: int, recipe: Recipe, details: dict) -> list[_Row]:
    """The rows after the device's: host RAM while loading, at a checkpoint and to consolidate (per node),
    local disk, and the checkpoints in storage."""

    export_bytes, num_to_keep, lora_merged, fixes = (
        recipe.export_bytes, recipe.num_to_keep, recipe.lora_merged, recipe.fixes
    )  # fmt: skip
    b = _host_and_disk_bytes(run, recipe)
    details.update(
        load_bytes_rank0=b["load_rank0"],
        checkpoint_bytes=b["checkpoint"],
        local_disk_bytes=b["local_disk"],
        hub_download_bytes=b["download"],
        temp_file_bytes=b["temp"],
    )
    lora, stored, node = run.lora, run.stored, run.node
    load_terms, ckpt_terms, disk_terms = _host_and_disk_terms(run, b, recipe)
    host_fix = fixes.get("host", "")
    # What training already keeps in host RAM (offloaded shards and optimizer step, or CPU workers' all)
    # comes on top of each host row.
    held = f"training state already in host RAM {_gb(host)} + " if host else ""
    rows = [
        _Row(
            "host RAM while loading", "per node", host + b["loads"], node.memory, host_fix, held + load_terms
        ),
        _Row(
            "host RAM at a checkpoint",
            "per node",
            host + b["host_ckpt"],
            node.memory,
            host_fix,
            held + ckpt_terms,
        ),
    ]
    if export_bytes:
        if not lora:
            terms = "rank 0 gathers the fp32 model, 4 B x params, converting a tensor at a time"
        elif lora_merged:
            terms = f"rank 0 reads the base again to merge: {export_bytes + stored} B x params"
        else:
            terms = "rank 0 gathers the fp32 adapters, 4 B x adapter params"
        rows.append(_Row("host RAM to consolidate (rank 0)", "per node", host + b["consolidate"], node.memory,
                        host_fix, held + terms))  # fmt: skip
    stored_terms = (
        f"fp32 adapters and AdamW moments 12 B x {lora.params:,} adapter params + the adapter export"
        + (f" + the merged model {export_bytes} B x params" if lora_merged else "")
        if lora
        else f"fp32 weights and AdamW moments 12 B x params{f' + export {export_bytes} B' if export_bytes else ''}"
    )
    rows += [
        _Row(
            "local disk for checkpoints",
            "per node",
            b["local_disk"],
            node.disk,
            fixes.get("disk", ""),
            disk_terms,
        ),
        _Row(
            f"checkpoints in storage (x{num_to_keep} kept)",
            "storage",
            b["checkpoint"] * num_to_keep,
            None,
            terms=stored_terms,
        ),  # fmt: skip
    ]
    return rows


def state_bytes(model, optimizer) -> dict[str, int]:
    """Bytes of weights and of optimizer state this rank really holds (its shards), to compare with a plan.

    Called on the workers after the first optimizer step. FSDP2 parameters and their AdamW moments are
    `DTensor`s (`to_local()` is this rank's shard); FSDP1's (with `use_orig_params`) are views of this
    rank's flat shard. The optimizer's scalar `step` counters are left out.
    """
    import torch

    def local(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    optimizer = getattr(optimizer, "_optimizer", optimizer)  # Lightning's wrapper
    moments = [
        t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.ndim > 0
    ]
    return {
        "param_bytes": sum(local(p) for p in model.parameters()),
        "optimizer_bytes": sum(local(t) for t in moments),
    }
