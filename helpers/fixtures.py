"""Small datasets written for this project, shaped like the real ones the notebooks use.

Smoke mode points `load_dataset` at these folders instead of a Hub id, so the notebook's
loading code is the same at both scales. Every fixture is generated from a fixed seed
(nothing is copied from the real datasets) and carries a signal a tiny model can learn.

- `ag_news_fixture`: `ag_news` (`text`, 4-class `label`; `train`/`test`), GPT-2 + DeepSpeed notebook.
- `play_script_fixture`: `tiny_shakespeare` (one `text` row per split, `SPEAKER:` lines), Dolly notebook.
- `chat_fixture`: `code-chat-assistant-v1` (`content` in the `<|system|>` chat format), Llama notebook.
"""

from __future__ import annotations

import random
from pathlib import Path

from .cache import build_once

__all__ = ["ag_news_fixture", "play_script_fixture", "chat_fixture", "AG_NEWS_LABELS"]

AG_NEWS_LABELS = ["World", "Sports", "Business", "Sci/Tech"]

# Each topic has its own words, so the class of a headline is learnable from its text.
_TOPICS = {
    "World": (
        ["The prime minister", "Rebel leaders", "The foreign office", "Peace envoys", "The parliament"],
        ["signed", "rejected", "debated", "announced", "postponed"],
        [
            "a ceasefire deal",
            "new border talks",
            "the election results",
            "a trade embargo",
            "the peace treaty",
        ],
        ["in the capital", "after weeks of unrest", "at the summit", "amid protests", "before the vote"],
    ),
    "Sports": (
        ["The home team", "The veteran striker", "The coach", "The champions", "The young goalkeeper"],
        ["won", "lost", "clinched", "drew", "celebrated"],
        ["the cup final", "a late penalty", "the league title", "the away match", "a record season"],
        ["in extra time", "before a full stadium", "on Sunday night", "after a long injury", "at the derby"],
    ),
    "Business": (
        ["Shares of the bank", "The retail chain", "Oil prices", "The central bank", "Investors"],
        ["rose", "fell", "reported", "forecast", "cut"],
        ["quarterly profits", "interest rates", "its annual revenue", "thousands of jobs", "the merger bid"],
        [
            "on Wall Street",
            "after the earnings call",
            "in early trading",
            "despite weak demand",
            "this quarter",
        ],
    ),
    "Sci/Tech": (
        ["Researchers", "The software maker", "Astronomers", "The chip designer", "A startup"],
        ["released", "discovered", "launched", "patched", "unveiled"],
        [
            "a faster processor",
            "a new exoplanet",
            "the open source browser",
            "a security flaw",
            "a robot arm",
        ],
        [
            "in a new paper",
            "at the developer conference",
            "using the telescope",
            "for mobile phones",
            "online",
        ],
    ),
}


def _headline(rng: random.Random, topic: str) -> str:
    subjects, verbs, objects, tails = _TOPICS[topic]
    return f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(tails)}."


def _write_parquet(rows: dict, path: Path, features=None) -> None:
    import datasets

    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(path))


def ag_news_fixture(num_train: int = 2000, num_test: int = 200) -> str:
    """A local folder that `load_dataset(path)` reads like `ag_news` (gpt2_deepspeed notebook).

    Columns `text` (a headline and a short lead) and `label` (`ClassLabel` with ag_news's four
    names); splits `train` and `test` as `train.parquet` / `test.parquet`.
    """

    def build(tmp: Path) -> None:
        import datasets

        features = datasets.Features(
            {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=AG_NEWS_LABELS)}
        )
        rng = random.Random(1234)
        for split, n in (("train", num_train), ("test", num_test)):
            labels = [rng.randrange(len(AG_NEWS_LABELS)) for _ in range(n)]
            texts = [
                _headline(rng, AG_NEWS_LABELS[y]) + " " + _headline(rng, AG_NEWS_LABELS[y]) for y in labels
            ]
            _write_parquet({"text": texts, "label": labels}, tmp / f"{split}.parquet", features)

    return str(build_once(f"fixtures/ag_news-{num_train}-{num_test}", build))


_SPEAKERS = ["FIRST CITIZEN", "MENENIUS", "CORIOLANUS", "VOLUMNIA", "SICINIUS", "BRUTUS"]
_PLAY_WORDS = (
    ["Good", "Noble", "Gentle", "Brave", "Sweet"],
    ["friends", "lord", "mother", "people", "sir"],
    ["we must", "you shall", "I will", "they do", "let us"],
    ["speak of bread", "hear the senate", "go to the capitol", "guard the gates", "praise the city"],
    ["this very night", "before the dawn", "with all our hearts", "upon my honour", "for Rome"],
)


def play_script_fixture(num_speeches: int = 400) -> str:
    """A local folder that `load_dataset(path)` reads like `tiny_shakespeare` (Dolly notebook).

    Splits `train`, `validation` and `test`, each a single row whose `text` is a play script:
    a `SPEAKER:` line, one or two lines of speech, a blank line, and so on.
    """

    def build(tmp: Path) -> None:
        rng = random.Random(4321)
        for split, n in (("train", num_speeches), ("validation", 40), ("test", 40)):
            speeches = []
            for _ in range(n):
                lines = [
                    f"{rng.choice(_PLAY_WORDS[0])} {rng.choice(_PLAY_WORDS[1])}, "
                    f"{rng.choice(_PLAY_WORDS[2])} {rng.choice(_PLAY_WORDS[3])} {rng.choice(_PLAY_WORDS[4])}."
                    for _ in range(rng.randint(1, 2))
                ]
                speeches.append(f"{rng.choice(_SPEAKERS)}:\n" + "\n".join(lines))
            _write_parquet({"text": ["\n\n".join(speeches) + "\n"]}, tmp / f"{split}.parquet")

    return str(build_once(f"fixtures/play_script-{num_speeches}", build))


_QUESTIONS = [
    ("How do I reverse a list in Python?", "Use slicing: my_list[::-1] returns a reversed copy."),
    ("How do I read a file line by line?", "Open it with a with block and loop: for line in f: print(line)."),
    ("What does a dictionary do?", "A dict maps keys to values: d['key'] = value stores one pair."),
    ("How do I sort a list of numbers?", "Call sorted(numbers) for a new list or numbers.sort() in place."),
    ("How do I join strings with commas?", "Use ', '.join(words) to put a comma between each word."),
    ("How do I count items in a list?", "len(items) gives the number of items in the list."),
]
_SYSTEM = "You are a helpful coding assistant."


def chat_fixture(num_train: int = 600, num_test: int = 60) -> str:
    """A local folder that `load_dataset(path)` reads like `smangrul/code-chat-assistant-v1` (Llama notebook).

    Column `content`: one conversation per row in the chat format
    `<|system|> ... <|endoftext|> <|prompter|> ... <|endoftext|> <|assistant|> ... <|endoftext|>`.
    """

    def build(tmp: Path) -> None:
        rng = random.Random(99)
        for split, n in (("train", num_train), ("test", num_test)):
            rows = []
            for _ in range(n):
                turns = [f"<|system|> {_SYSTEM} <|endoftext|>"]
                for q, a in rng.sample(_QUESTIONS, k=rng.randint(1, 2)):
                    turns += [f"<|prompter|> {q} <|endoftext|>", f"<|assistant|> {a} <|endoftext|>"]
                rows.append(" ".join(turns))
            _write_parquet({"content": rows}, tmp / f"{split}.parquet")

    return str(build_once(f"fixtures/chat-{num_train}-{num_test}", build))
