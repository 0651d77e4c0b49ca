"""Small datasets written for this project, shaped like the real ones the notebooks use.

Smoke mode points `load_dataset` at these folders instead of a Hub id, so the notebook's
loading code is the same at both scales. Every fixture is generated from a fixed seed
(nothing is copied from the real datasets) and carries a signal a tiny model can learn. Used by every notebook's "Set up" cell, in smoke mode.

- `ag_news_fixture`: `ag_news` (`text`, 4-class `label`; `train`/`test`), GPT-2 + DeepSpeed notebook.
- `play_script_fixture`: `tiny_shakespeare` (one `text` row per split, `SPEAKER:` lines), Dolly notebook.
- `chat_fixture`: `code-chat-assistant-v1` (`content` in the `<|system|>` chat format), Llama notebook.
- `glue_fixture`: `nyu-mll/glue` (all nine configs, real columns, label types and splits), GLUE notebook.
"""

from __future__ import annotations

import random
from pathlib import Path

from basics.glue import GLUE_TASKS

from .cache import build_once

__all__ = [
    "ag_news_fixture",
    "play_script_fixture",
    "chat_fixture",
    "glue_fixture",
    "AG_NEWS_LABELS",
    "GLUE_SCHEMAS",
]

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

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # a bar per file is noise in a notebook's first cells
    try:
        datasets.Dataset.from_dict(rows, features=features).to_parquet(str(path))
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


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


def chat_fixture(num_train: int = 600, num_test: int = 8) -> str:
    """A local folder that `load_dataset(path)` reads like `smangrul/code-chat-assistant-v1` (Llama notebook).

    Column `content`: one conversation per row in the chat format
    `<|system|> ... <|endoftext|> <|prompter|> ... <|endoftext|> <|assistant|> ... <|endoftext|>`. A
    training conversation asks 1 or 2 of the questions, a test one 3: no test row is a training row, yet
    what they ask is what training taught (a tiny model trained for seconds learns nothing more general).
    """

    def build(tmp: Path) -> None:
        rng = random.Random(99)
        for split, n, questions in (("train", num_train, (1, 2)), ("test", num_test, (3, 3))):
            rows = []
            for _ in range(n):
                turns = [f"<|system|> {_SYSTEM} <|endoftext|>"]
                for q, a in rng.sample(_QUESTIONS, k=rng.randint(*questions)):
                    turns += [f"<|prompter|> {q} <|endoftext|>", f"<|assistant|> {a} <|endoftext|>"]
                rows.append(" ".join(turns))
            _write_parquet({"content": rows}, tmp / f"{split}.parquet")

    return str(build_once(f"fixtures/chat-{num_train}-{num_test}-three-questions", build))


# ---- GLUE: every task, in the layout of the Hub's `nyu-mll/glue` parquet files --------------

# Per data folder: the text columns and the label names ("float": a regression), from the one task table.
GLUE_SCHEMAS = {
    task.folder: (list(task.text_columns), list(task.labels) if task.labels else "float")
    for task in GLUE_TASKS.values()
}

_GLUE_WORDS = {  # two "genres", like MNLI's matched and mismatched validation sets
    "news": (
        ["the minister", "the council", "a reporter", "the mayor", "the union", "the court"],
        ["reviewed", "approved", "questioned", "described", "published", "opposed"],
        ["the budget", "the new law", "the report", "the plan", "the contract", "the results"],
    ),
    "fiction": (
        ["the old sailor", "a young witch", "the tired knight", "my cousin", "the stranger", "the child"],
        ["found", "painted", "lost", "carried", "hid", "followed"],
        ["the lantern", "a silver key", "the map", "the letter", "a small boat", "the garden gate"],
    ),
}
# Label cues. Real GLUE has artifacts of this kind (negation words predict MNLI contradiction);
# here they are the whole signal, so a tiny model learns each task in seconds.
_AGREE = ["indeed", "certainly", "clearly", "truly"]
_UNSURE = ["perhaps", "maybe", "possibly", "probably"]
_DENY = ["never", "not once", "hardly", "no longer"]
_CUES = {
    "cola": (["runned", "goed", "eated", "swimmed"], ["ran", "went", "ate", "swam"]),
    "sst2": (["dull", "tedious", "awful", "clumsy"], ["wonderful", "moving", "brilliant", "charming"]),
    "mnli": (_AGREE, _UNSURE, _DENY),
}


def _glue_label_cues(task: str, names: list[str]) -> tuple[list[str], ...]:
    if task in _CUES:
        return _CUES[task]
    # Binary pair tasks: the positive relation (entailment, equivalent, duplicate) agrees.
    positive = {"entailment", "equivalent", "duplicate"}
    return tuple(_AGREE if name in positive else _DENY for name in names)


def _glue_rows(task: str, n: int, rng: random.Random, genre: str, labelled: bool) -> dict:
    columns, names = GLUE_SCHEMAS[task]
    subjects, verbs, objects = _GLUE_WORDS[genre]
    rows: dict[str, list] = {c: [] for c in columns} | {"label": [], "idx": []}

    def clause() -> str:
        return f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}"

    for i in range(n):
        if names == "float":  # stsb: the score is how many of 4 words echo "similar"
            k = rng.randint(0, 4)
            words = rng.sample(_AGREE, k) + rng.sample(_DENY, 4 - k)
            rng.shuffle(words)
            texts = [clause() + ".", f"{clause()}, {' '.join(words)}."]
            label = round(min(5.0, max(0.0, 1.25 * k + rng.uniform(-0.25, 0.25))), 3)
        else:
            y = rng.randrange(len(names))
            cue = rng.choice(_glue_label_cues(task, names)[y])
            if task == "cola":
                texts = [f"{rng.choice(subjects).capitalize()} {cue} to {rng.choice(objects)}."]
            elif task == "sst2":
                film = rng.choice(["the film", "the plot", "the acting", "the ending", "the score"])
                texts = [f"{film} was {cue}, and {clause()}."]
            else:
                first = clause().capitalize() + "."
                if columns[0] in ("question", "question1"):
                    first = f"Is it true that {clause()}?"
                texts = [first, f"{rng.choice(subjects).capitalize()} {cue} {rng.choice(verbs)} it."]
            label = y
        for column, text in zip(columns, texts, strict=True):
            rows[column].append(text)
        rows["label"].append(label if labelled else (-1.0 if names == "float" else -1))
        rows["idx"].append(i)
    return rows


def _glue_features(task: str):
    import datasets

    columns, names = GLUE_SCHEMAS[task]
    label = datasets.Value("float32") if names == "float" else datasets.ClassLabel(names=names)
    return datasets.Features(
        {c: datasets.Value("string") for c in columns} | {"label": label, "idx": datasets.Value("int32")}
    )


def glue_fixture(num_train: int = 512, num_eval: int = 127, num_test: int = 64) -> str:
    """A local folder laid out like the Hub's `nyu-mll/glue` (GLUE notebook).

    `<task>/<split>-00000-of-00001.parquet` for the nine GLUE configs, with the real columns
    (`sentence` or a sentence pair, `label`, `idx`), label types (`ClassLabel` with GLUE's
    names; `float32` scores for stsb) and splits (`train`, `validation`, `test`; mnli has
    `validation_matched` / `validation_mismatched` and `test_matched` / `test_mismatched`, the
    mismatched ones from another "genre" of sentences). Test labels are -1, as in GLUE.
    The validation splits have 127 rows, a prime: no number of workers divides them evenly, so a
    run that drops or repeats validation rows (to give each worker as many) shows it in its count.
    """

    def build(tmp: Path) -> None:
        for seed, task in enumerate(GLUE_SCHEMAS):
            rng = random.Random(2024 + seed)
            folder = tmp / task
            folder.mkdir()
            splits = [("train", num_train, "news", True)]
            if task == "mnli":
                splits += [
                    ("validation_matched", num_eval, "news", True),
                    ("validation_mismatched", num_eval, "fiction", True),
                    ("test_matched", num_test, "news", False),
                    ("test_mismatched", num_test, "fiction", False),
                ]
            else:
                splits += [("validation", num_eval, "news", True), ("test", num_test, "news", False)]
            for split, n, genre, labelled in splits:
                rows = _glue_rows(task, n, rng, genre, labelled)
                _write_parquet(rows, folder / f"{split}-00000-of-00001.parquet", _glue_features(task))

    return str(build_once(f"fixtures/glue-{num_train}-{num_eval}-{num_test}", build))
