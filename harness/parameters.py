"""The notebook's parameters: names papermill may pass, smoke mode's replacements, the values a run used.

Used by the "Set up" cell of every notebook (`smoke_overrides`, through `helpers.use_smoke_values` and the
cell's own table; `check_parameter_names` through `harness.checks.check_parameters`), by the results cell
(`parameter_values`). `make plan` and the tests read a notebook's parameters cells with
`basics.notebook_files.parameter_cells`.

What the Set up cell learns of its run (the parameters' names, the full-scale defaults smoke mode replaced,
when it started) is the notebook's own: a `RunRecord` in its globals (`record`), never this module's, so two
notebooks set up in one process (the tests do) each keep theirs.
"""

from __future__ import annotations

import ast
import difflib
import json
import time
from dataclasses import dataclass, field

from basics.validate import ParameterError
from harness.storage import redact

__all__ = [
    "RunRecord",
    "record",
    "found_record",
    "check_parameter_names",
    "parameter_values",
    "smoke_overrides",
    "papermill_parameters",
    "RENAMED",
]

# Names these notebooks (or the tutorials they come from) used before the suite agreed on one name per
# idea; a batch job that still passes one is told the new name.
RENAMED = {
    "BATCH_SIZE": "BATCH_SIZE_PER_WORKER",
    "SEQ_LENGTH": "MAX_SEQ_LEN",
    "MAX_LENGTH": "MAX_SEQ_LEN",
    "LR": "LEARNING_RATE",
    "MODEL_CHECKPOINT": "MODEL_NAME",
    "TUTORIAL_STEPS": "MAX_STEPS_PER_EPOCH",
}


RUN_RECORD = "__run__"  # its name in the notebook's globals


@dataclass
class RunRecord:
    """What a notebook's Set up cell learned of its run, kept in the notebook's globals as `__run__`."""

    notebook: str = ""
    started: float = field(default_factory=time.perf_counter)  # the run's clock: `seconds()`
    parameters: list[str] = field(default_factory=list)  # as `check_parameter_names` found them
    # parameter: its full-scale default, where smoke mode replaced it
    full_scale: dict = field(default_factory=dict)

    def seconds(self) -> float:
        """Wall-clock seconds since the Set up cell started the clock."""
        return round(time.perf_counter() - self.started, 2)


def found_record(namespace: dict) -> RunRecord | None:
    """The run record in `namespace` (a notebook's globals); None where Set up made none (a plain dict of
    parameters, as `make plan` passes)."""
    found = namespace.get(RUN_RECORD)
    return found if isinstance(found, RunRecord) else None


def record(namespace: dict) -> RunRecord:
    """The run record in `namespace` (a notebook's globals), made on first use."""
    found = found_record(namespace)
    if found is None:
        found = namespace[RUN_RECORD] = RunRecord()
    return found


def _history() -> list[str]:
    """The sources of the cells this kernel has executed, oldest first (IPython's `In`); [] outside IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return []
    shell = get_ipython()
    return list(shell.user_ns.get("In", [])) if shell else []


def _assigned(source: str) -> list[str]:
    tree = ast.parse(source)
    return [
        t.id
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    ]


def _is_injected(source: str) -> bool:
    return source.lstrip().startswith("# Parameters")  # the cell papermill adds after the parameters cell


def papermill_parameters() -> set[str]:
    """The names papermill passed (`-p NAME VALUE`) to the notebook running in this kernel.

    papermill injects its values as a cell that starts with `# Parameters`, right after the parameters
    cell; IPython keeps every executed cell's source in `In`. Outside IPython, or without papermill: none.
    """
    return {name for source in _history() if _is_injected(source) for name in _assigned(source)}


def _parameters_cell_names() -> list[str]:
    """The names the notebook's parameters cells assign: the last executed cell (not papermill's) that
    sets both SMOKE_TEST and RESULTS_PATH, which every notebook's run settings end with, and, where the
    lesson's knobs are a cell of their own before it (it starts with `# ---- The lesson`), that cell's."""
    found: dict[str, list[str]] = {}
    for source in reversed(_history()):
        if _is_injected(source):
            continue
        kind = "lesson" if source.lstrip().startswith("# ---- The lesson") else "settings"
        if kind in found or (kind == "settings" and "SMOKE_TEST" not in source):
            continue
        try:
            names = _assigned(source)
        except SyntaxError:
            continue
        if kind == "lesson" or {"SMOKE_TEST", "RESULTS_PATH"} <= set(names):
            found[kind] = names
        if len(found) == 2:
            break
    if "settings" not in found:
        return []
    return [*found.get("lesson", []), *[n for n in found["settings"] if n not in found.get("lesson", [])]]


# Parameters of another notebook that a notebook without them refuses with its own reason, not as unknown
# (`harness.checks`: MIN_WORKERS, for the notebooks that cannot continue on fewer workers).
REFUSED_WITH_A_REASON = {"MIN_WORKERS"}
# Parameters that belong to another notebook now: the hint an unknown-name error gives instead of a guess.
ELSEWHERE = {
    **{name: "LoRA has its own notebook, llama_lora" for name in ("LORA_RANK", "LORA_ALPHA", "LORA_MERGED")},
    **{
        name: "a killed worker and a lost node are the operating_a_run notebook's"
        for name in ("KILL_WORKER_AT_STEP", "RESIZE_CHECK_S", "SHORT_SAVE_STEPS")
    },
}


def check_parameter_names(namespace: dict) -> list[str]:
    """Fail on a name that papermill passed and the parameters cell does not define; return the parameters.

    papermill only warns about such a name and runs with the default, so `-p BATCH_SIZE 4` on a notebook
    whose parameter is `BATCH_SIZE_PER_WORKER` would train with the default batch size without a word.
    Called right after the parameters cell, with the notebook's globals: where the kernel keeps no history
    of its cells (nbval runs them without it), the parameters are the upper-case names defined so far.
    """
    known = _parameters_cell_names()
    unknown = sorted(papermill_parameters() - set(known) - REFUSED_WITH_A_REASON) if known else []
    names = known or [name for name in namespace if name.isupper() and not name.startswith("_")]
    record(namespace).parameters = names
    if unknown:
        hints = []
        for name in unknown:
            guess = RENAMED.get(name) if RENAMED.get(name) in known else None
            guess = guess or next(iter(difflib.get_close_matches(name, known, n=1)), None)
            if name in ELSEWHERE:
                hints.append(f"{name} ({ELSEWHERE[name]})")
            else:
                hints.append(f"{name} (did you mean {guess}?)" if guess else name)
        raise ParameterError(
            f"Unknown parameter{'s' if len(unknown) > 1 else ''} passed to this notebook: {', '.join(hints)}. "
            f"Its parameters are: {', '.join(known)}."
        )
    return list(names)


def parameter_values(namespace: dict) -> dict:
    """Every parameter's value as the run used it (after smoke mode), for the results file."""
    values = {}
    found = found_record(namespace)
    for name in (found.parameters if found else None) or _parameters_cell_names():
        value = namespace.get(name)
        try:
            json.dumps(value)
        except TypeError:
            value = str(value)
        values[name] = redact(value)  # a URI's credentials never reach a results file
    return values


def full_scale_defaults(namespace: dict) -> dict:
    """The full-scale defaults of the parameters `smoke_overrides` replaced in `namespace` ({} outside smoke
    mode, and for a plain dict of parameters): the "will it fit?" tables show the full-scale run next to
    the laptop's."""
    found = found_record(namespace)
    replaced = found.full_scale if found else {}
    # A parameter back at its default (the parameters cell run again, not in smoke mode) was not replaced.
    return {name: default for name, default in replaced.items() if namespace.get(name) != default}


def smoke_overrides(namespace: dict, table: dict[str, tuple]) -> dict:
    """Return the smoke values for the parameters in `table` that are still at their full-scale default.

    `table` maps a parameter's name to `(full-scale default, smoke value)`. A parameter that papermill
    passed (even with the default's value, such as `-p KILL_WORKER_AT_STEP 0`), or whose value in
    `namespace` (the notebook's globals) differs from its default (edited, or set by an environment
    variable such as `STORAGE_PATH`), is kept. Prints a table of what was replaced and what was kept.
    """
    replaced, kept = {}, {}
    passed = papermill_parameters()
    for name, (default, smoke) in table.items():
        current = namespace[name]
        if name not in passed and current == default and type(current) is type(default):
            replaced[name] = smoke
        else:
            kept[name] = current
    record(namespace).full_scale = {name: table[name][0] for name in replaced}

    def short(value) -> str:
        text = repr(redact(value))
        return text if len(text) <= 40 else "..." + text[-37:]

    width = max(map(len, table), default=0)
    full = max([len("full scale"), *(len(short(default)) for default, _ in table.values())])
    plural = "" if len(kept) == 1 else "s"
    print(f"Smoke mode: {len(replaced)} full-scale defaults replaced, {len(kept)} value{plural} you set kept")
    print(f"  {'parameter':<{width}}  {'full scale':<{full}}  smoke run")
    for name in table:
        value = replaced.get(name, kept.get(name))
        note = "" if name in replaced else "   (yours, kept)"
        print(f"  {name:<{width}}  {short(table[name][0]):<{full}}  {short(value)}{note}")
    return replaced
