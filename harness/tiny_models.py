"""Tiny random-weight checkpoints, built locally, loaded with `from_pretrained(path)` like a Hub id.

Smoke mode swaps `MODEL_NAME = "gpt2"` (or dolly, Llama, DistilBERT) for the folder returned
here; everything after that line is the full-scale code. Each checkpoint has the same
architecture class as the real model (`GPT2LMHeadModel`, `GPTNeoXForCausalLM` with its
`GPTNeoXLayer`, `LlamaForCausalLM`, `DistilBertForMaskedLM`) and a tokenizer
trained in about a second on the fixture text of the notebook that uses it. Used by every
notebook's "Smoke mode" cell.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .cache import build_once
from .fixtures import GLUE_SCHEMAS, ag_news_fixture, chat_fixture, glue_fixture, play_script_fixture

__all__ = ["tiny_model", "TINY_ARCHS"]


def _parquet_texts(folder: str, column: str, files: str = "*.parquet") -> list[str]:
    import pyarrow.parquet as pq

    texts: list[str] = []
    for file in sorted(Path(folder).glob(files)):
        texts += pq.read_table(file, columns=[column]).column(column).to_pylist()
    return texts


def _ag_news_corpus() -> list[str]:
    return _parquet_texts(ag_news_fixture(), "text")


def _play_corpus() -> list[str]:
    return [line for t in _parquet_texts(play_script_fixture(), "text") for line in t.splitlines()]


def _chat_corpus() -> list[str]:
    # The training split only: a tokenizer that had seen the held-out rows would change with them.
    return _parquet_texts(chat_fixture(), "content", "train.parquet")


def _glue_corpus() -> list[str]:
    root = Path(glue_fixture())
    return [
        text
        for task, (columns, _) in GLUE_SCHEMAS.items()
        for column in columns
        for text in _parquet_texts(str(root / task), column)
    ]


@dataclass(frozen=True)
class _Spec:
    config_class: str  # name in `transformers`
    config: dict
    corpus: Callable[[], list[str]]
    special_tokens: dict = field(default_factory=dict)  # role -> token; the first ones get ids 0, 1, ...
    vocab_size: int = 512
    encoder: bool = False  # WordPiece (BERT family) instead of byte-level BPE
    corpus_version: int = 1  # raise it when the corpus's fixture changes: the cached checkpoint is another


_EOT = "<|endoftext|>"

TINY_ARCHS: dict[str, _Spec] = {
    # GPT-2 (gpt2_deepspeed): a single <|endoftext|> token, no pad token, as in the real gpt2.
    "gpt2": _Spec(
        "GPT2Config",
        dict(n_layer=2, n_embd=64, n_head=4, n_positions=128),
        _ag_news_corpus,
        {"bos_token": _EOT, "eos_token": _EOT, "unk_token": _EOT},
    ),
    # GPT-NeoX (dolly_lightning_fsdp): dolly-v2 is a Pythia / GPT-NeoX model.
    "gpt_neox": _Spec(
        "GPTNeoXConfig",
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            intermediate_size=256,
            max_position_embeddings=256,
        ),
        _play_corpus,
        {"bos_token": _EOT, "eos_token": _EOT, "unk_token": _EOT},
    ),
    # Llama (llama_fsdp): Llama 2's <unk>, <s>, </s>.
    "llama": _Spec(
        "LlamaConfig",
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=176,
            max_position_embeddings=512,
        ),
        _chat_corpus,
        {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
        corpus_version=2,  # 2: the training split only (the test split's rows became held-out ones)
    ),
    # DistilBERT (glue_text_classification): the default MODEL_NAME's family.
    "distilbert": _Spec(
        "DistilBertConfig",
        dict(n_layers=2, dim=64, n_heads=4, hidden_dim=128, max_position_embeddings=128),
        _glue_corpus,
        {
            "pad_token": "[PAD]",
            "unk_token": "[UNK]",
            "cls_token": "[CLS]",
            "sep_token": "[SEP]",
            "mask_token": "[MASK]",
        },
        encoder=True,
        corpus_version=2,  # 2: the GLUE fixture's validation splits have 127 rows (were 128)
    ),
}


def _train_tokenizer(spec: _Spec, max_length: int):
    from tokenizers import ByteLevelBPETokenizer, processors
    from tokenizers.implementations import BertWordPieceTokenizer
    from transformers import PreTrainedTokenizerFast

    specials = list(dict.fromkeys(spec.special_tokens.values()))  # unique, in order
    corpus = spec.corpus()
    if spec.encoder:
        raw = BertWordPieceTokenizer(lowercase=True)
        raw.train_from_iterator(
            corpus, vocab_size=spec.vocab_size, special_tokens=specials, show_progress=False
        )
        # Without a post-processor the fast wrapper would add no [CLS] ... [SEP].
        raw.post_processor = processors.BertProcessing(
            ("[SEP]", raw.token_to_id("[SEP]")), ("[CLS]", raw.token_to_id("[CLS]"))
        )
    else:
        raw = ByteLevelBPETokenizer()
        raw.train_from_iterator(
            corpus, vocab_size=spec.vocab_size, special_tokens=specials, show_progress=False
        )
    # Wrapping the trained object keeps its vocabulary; reloading a bare vocab file through
    # a slow tokenizer class maps every word to [UNK] (../shared/FINDINGS.md).
    return PreTrainedTokenizerFast(
        tokenizer_object=raw._tokenizer, model_max_length=max_length, **spec.special_tokens
    )


def tiny_model(arch: str, **overrides) -> str:
    """Build (once) and return the folder of a tiny `arch` checkpoint with its tokenizer.

    `arch` is one of `TINY_ARCHS` ("gpt2", "gpt_neox", "llama", "distilbert"); `overrides`
    change config fields (e.g. `hidden_size=768` for a bigger Llama). Weights come from
    seed 0, so the same call gives the same checkpoint on every machine.
    """
    if arch not in TINY_ARCHS:
        raise ValueError(f"arch={arch!r} is not a tiny architecture; choose one of {sorted(TINY_ARCHS)}")
    spec = TINY_ARCHS[arch]
    config_kwargs = {**spec.config, **overrides}
    tag = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))

    def build(tmp: Path) -> None:
        import torch
        import transformers
        from transformers.utils import logging as hf_logging

        from harness.cluster import quiet_deepspeed_on_cpu

        # Built once, in the set-up cell: no "Writing model shards" bar (a widget in a notebook) and no
        # DeepSpeed line about choosing the CPU, which transformers' checkpoint code can trigger here.
        hf_logging.disable_progress_bar()
        quiet_deepspeed_on_cpu()

        config_class = getattr(transformers, spec.config_class)
        max_length = next(
            config_kwargs[k] for k in ("n_positions", "max_position_embeddings") if k in config_kwargs
        )
        tokenizer = _train_tokenizer(spec, max_length)
        ids = {
            f"{role}_id": tokenizer.convert_tokens_to_ids(tok) for role, tok in spec.special_tokens.items()
        }
        config = config_class(
            vocab_size=len(tokenizer),
            **{k: v for k, v in ids.items() if k != "unk_token_id"},
            **config_kwargs,
        )
        torch.manual_seed(0)
        if spec.encoder:
            # Like distilbert-base-uncased: a masked-LM checkpoint with no classification head, so
            # `AutoModelForSequenceClassification.from_pretrained(path, num_labels=n)` adds a fresh
            # head of any size (a saved 2-label head would refuse 1 or 3 labels).
            model = transformers.AutoModelForMaskedLM.from_config(config)
        else:
            model = transformers.AutoModelForCausalLM.from_config(config)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    # The corpus is in the name: a tokenizer trained on other text is another checkpoint.
    corpus = spec.corpus.__name__.strip("_") + (f"-v{spec.corpus_version}" if spec.corpus_version > 1 else "")
    name = f"models/tiny-{arch}-{corpus}{'-' + tag if tag else ''}"
    return str(build_once(name, build))
