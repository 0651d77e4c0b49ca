"""Every committed notebook: valid nbformat, no outputs, a `parameters` cell with the shared switches."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_valid_and_output_free(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    for cell in nb.cells:
        assert cell.get("id"), "every cell has an id"
        if cell.cell_type == "code":
            assert cell.outputs == [], f"committed with outputs: {cell.source[:60]!r}"
            assert cell.execution_count is None, f"committed with an execution count: {cell.source[:60]!r}"


def _parameter_cells(nb) -> list:
    """The code cells up to the one tagged `parameters`: the lesson's knobs, then the run settings (or one
    cell with both)."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    tagged = next(i for i, c in enumerate(code) if "parameters" in c.metadata.get("tags", []))
    return code[: tagged + 1]


def _assigned(source: str) -> list[str]:
    return [t.id for node in ast.parse(source).body if isinstance(node, ast.Assign) for t in node.targets]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_first_code_cells_are_the_parameters(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    cells = _parameter_cells(nb)
    assert len(cells) <= 2 and not any("parameters" in c.metadata.get("tags", []) for c in code[len(cells) :])
    if len(cells) == 2:  # the lesson's knobs (at most 12), then the run settings, shown collapsed
        assert len(_assigned(cells[0].source)) <= 12, _assigned(cells[0].source)
        assert cells[1].metadata.get("jupyter", {}).get("source_hidden") is True
    names = [n for c in cells for n in _assigned(c.source)]
    assert {"SMOKE_TEST", "RESULTS_PATH", "NUM_WORKERS", "USE_GPU", "STORAGE_PATH"} <= set(names)
    assert all(name.isupper() for name in names), names
    lines = [ln for c in cells for ln in c.source.splitlines()]
    for name in names:
        line = next(ln for ln in lines if ln.startswith(f"{name} ="))
        assert "#" in line, f"{name} needs a comment on its trade-off"
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")


def _smoke_table_in_notebook(source: str) -> dict:
    """The table of a Set up cell's `helpers.use_smoke_values(globals(), {...})`, its full-scale defaults
    evaluated (they are literals), the laptop values left as their source."""
    call = next(
        n
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "use_smoke_values"
    )
    table = call.args[1]
    return {
        ast.literal_eval(k): (ast.literal_eval(v.elts[0]), ast.unparse(v.elts[1]))
        for k, v in zip(table.keys, table.values, strict=True)
    }


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_set_up_and_smoke_mode_replaces_the_defaults(path, monkeypatch):
    # Smoke mode's table, in the Set up cell, names parameters of this notebook with the very defaults of its
    # parameters cells: a default changed in one place alone would leave smoke mode silently running the
    # full-scale value.
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    cells = _parameter_cells(nb)
    set_up = code[len(cells)].source
    defaults: dict = {"os": __import__("os")}
    monkeypatch.delenv("STORAGE_PATH", raising=False)
    for cell in cells:
        exec(compile(cell.source, path.name, "exec"), defaults)  # noqa: S102 - the parameters cells
    assert "if SMOKE_TEST:" in set_up and f'helpers.check_parameters("{path.stem}", globals())' in set_up
    assert "ray.init(" in set_up and f'helpers.check_cluster("{path.stem}", globals()' in set_up
    table = _smoke_table_in_notebook(set_up)
    for name, (full_scale, _) in table.items():
        assert name in defaults, f"smoke mode sets {name}, which {path.stem} has no parameter for"
        assert defaults[name] == full_scale, (
            f"{name}: parameters cell {defaults[name]!r}, smoke table {full_scale!r}"
        )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_papermill_sees_every_parameter(path):
    # papermill skips lines it cannot parse (e.g. a second "=") and then calls `-p SMOKE_TEST True`
    # an "unknown parameter": a batch-job author would think the switch did nothing.
    import papermill

    # papermill reads the cell tagged `parameters` (the run settings, where the lesson's knobs are a cell of
    # their own before it); it passes the knobs too, with a warning that it does not know them.
    nb = nbformat.read(path, as_version=4)
    assert list(papermill.inspect_notebook(str(path))) == _assigned(_parameter_cells(nb)[-1].source)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_its_module_declares_what_the_packages_read_of_its_parameters(path):
    # The checks and the plan read a notebook's parameters as attributes of its module's `Parameters`
    # (harness.notebooks), built in its Set up cell. A field without a default is a parameter the notebook
    # must define; a default stands only for one it does not have. So a parameter renamed in the notebook
    # fails here, and in the Set up cell, never as a silent default or at the last cell of a run.
    import dataclasses

    from harness.notebooks import notebook

    names = {n for c in _parameter_cells(nbformat.read(path, as_version=4)) for n in _assigned(c.source)}
    fields = dataclasses.fields(notebook(path.stem).parameters)
    missing = dataclasses.MISSING
    required = {f.name for f in fields if f.default is missing and f.default_factory is missing}
    defaulted = {f.name for f in fields} - required
    assert required <= names, f"the notebook does not define {sorted(required - names)}"
    assert not defaulted & names, (
        f"declare {sorted(defaulted & names)} without a default: the notebook has them"
    )


# ---- the lesson's shape: what a learner finds, in order ------------------------------------------

# The first lesson code: the first cell that loads data or a model (the tutorial's own first step).
LESSON_CODE = re.compile(
    r"load_dataset\(|ray\.data\.\w+\(|from_pretrained\(|read_parquet\(|url_to_fs\(|read_table\("
)
SECTIONS = [  # headings every notebook has, in this order
    "## Set up",
    "## Going further: when a worker",  # dies; Llama: "or a node dies"
    "## Going further: tracking runs with MLflow",
    "## What the run showed",
    "## Next steps",
    "## Exercises",
    "## What changed from the original",
]
# The full-scale cost each header states, from helpers.run_cost and the original's wall time.
HEADER_COSTS = {
    "dolly_lightning_fsdp": (2877, {"g4dn.4xlarge": 15, "g4dn.8xlarge": 1}),  # 48 min on 16 T4s
    "llama_fsdp": (13.5 * 3600, {"p4de.24xlarge": 2}),  # 13.5 h on 16 A100-80GB
    "glue_text_classification": (67, {"g4dn.xlarge": 1}),  # 67 s of training on one T4
    "llama_lora": (18 * 3600, {"p4de.24xlarge": 1}),  # the estimated 18 h on 8 A100-80GB
}
# The headers that state no total: the original names no run time (GPT-2: the rate per hour), or each section's
# cost is printed by the Set up cell from the plan (operating_a_run).
HEADER_RATE_ONLY = {"gpt2_deepspeed", "operating_a_run"}


def test_every_notebook_header_is_held_to_its_cost():
    from harness.notebooks import NAMES

    assert sorted({*HEADER_COSTS, *HEADER_RATE_ONLY}) == sorted(NAMES)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_lesson_starts_on_the_first_screens(path):
    nb = nbformat.read(path, as_version=4)
    header = nb.cells[0].source
    for words in ("What you will learn", "Prerequisites", "Full scale", "On a laptop", "SMOKE_TEST"):
        assert words in header, words
    code = [c for c in nb.cells if c.cell_type == "code"]
    first = next(
        i for i, c in enumerate(code) if LESSON_CODE.search(c.source) and "if SMOKE_TEST" not in c.source
    )
    between = code[len(_parameter_cells(nb)) : first]  # after the parameters, before the first lesson code
    assert len(between) <= 2, [c.source[:60] for c in between]
    assert sum(len(re.findall(r"\bhelpers\.\w", c.source)) for c in between) <= 10
    headings = [line for c in nb.cells if c.cell_type == "markdown" for line in c.source.splitlines()]
    # A lesson-only notebook (its Set up spelt out) has no "Going further" sections: operating a run is not
    # its lesson.
    sections = [s for s in SECTIONS if not s.startswith("## Going further")]
    if path.stem == "operating_a_run":  # no original; its runs, in the plural
        sections = [s.replace("## What the run showed", "## What the runs showed") for s in sections[:-1]]
    assert not [h for h in headings if h.startswith("## Going further")], headings
    positions = [next((i for i, h in enumerate(headings) if h.startswith(s)), None) for s in sections]
    assert None not in positions and positions == sorted(positions), dict(
        zip(sections, positions, strict=True)
    )
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "What changed:" not in text, "the notes on what changed are in their one section"
    for stale in ("Seen here", "measured here", "the tests", "smoke runs here"):
        assert stale not in text, stale
    assert not re.search(r"\$\d", text), "amounts in USD: two dollar signs in a paragraph typeset as math"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_one_local_diagram_that_renders_offline(path):
    nb = nbformat.read(path, as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    images = re.findall(r"!\[[^\]]+\]\(([^)]+)\)", text)
    assert images and not any("://" in image for image in images), images  # nothing from the web
    for image in images:
        svg = (path.parent / image).read_text()
        assert "<title" in svg and "http" not in svg.replace("http://www.w3.org", ""), image


@pytest.mark.parametrize("name", list(HEADER_COSTS))
def test_the_header_states_the_full_scale_cost(name):
    import helpers

    nb = nbformat.read(Path(NOTEBOOKS[0]).parent / f"{name}.ipynb", as_version=4)
    seconds, instances = HEADER_COSTS[name]
    cost = helpers.run_cost(seconds, instances)
    # "USD", not "$": JupyterLab and MyST read two dollar signs in one paragraph as a formula
    shown = f"USD {cost:,.0f}" if cost >= 100 else f"USD {cost:.2f}"
    assert shown in nb.cells[0].source, (shown, nb.cells[0].source)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_restarts_are_a_run_setting_and_starts_are_retried_without_limit(path):
    """`FailureConfig(max_failures=MAX_FAILURES)`: a cluster user sets how many worker failures a long run
    survives; no `controller_failure_limit`, which would end a run whose worker group waits for nodes an
    autoscaler is still provisioning (Ray's default: retried without limit)."""
    nb = nbformat.read(path, as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert any("MAX_FAILURES = " in c.source for c in _parameter_cells(nb))
    assert re.search(r"FailureConfig\(\s*max_failures=MAX_FAILURES", code)
    assert "controller_failure_limit" not in code


def test_the_plan_counts_the_zero_buckets_the_gpt2_config_asks_for():
    # The bucket size is typed in the notebook's DeepSpeed config, where a learner reads and changes it; the
    # plan keeps its own copy (it plans before that cell runs): this keeps them equal.
    from basics.plan import ZERO_REDUCE_BUCKET

    path = next(p for p in NOTEBOOKS if p.stem == "gpt2_deepspeed")
    source = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
    (size,) = re.findall(r'"reduce_bucket_size":\s*([0-9_.e]+)', source)
    assert float(size.replace("_", "")) == ZERO_REDUCE_BUCKET


# ---- lessons only: what a lesson notebook may not carry --------------------------------------------

LESSONS = [p for p in NOTEBOOKS if p.stem != "operating_a_run"]  # the sixth teaches operating a run
FITS = {"gpt2_deepspeed": 2}  # the lesson's run, and the original's resume; every other lesson: one


def _train_function(source: str, tree: ast.Module) -> ast.FunctionDef:
    """The function a `TorchTrainer(...)` in `source` runs (its first argument, or train_loop_per_worker=)."""
    call = next(
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "TorchTrainer"
    )
    arg = (
        call.args[0]
        if call.args
        else next(k.value for k in call.keywords if k.arg == "train_loop_per_worker")
    )
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == arg.id)


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_a_lesson_notebook_is_its_lesson_only(path):
    nb = nbformat.read(path, as_version=4)
    code = "\n\n".join(c.source for c in nb.cells if c.cell_type == "code")
    tree = ast.parse(code)
    # One fit() of Ray Train's, the original's run (GPT-2: and its resume); Lightning's own `trainer.fit(model,
    # ...)` inside the training function is not one.
    assert len(re.findall(r"\b\w*trainer\.fit\(\)", code)) == FITS.get(path.stem, 1)
    # Nothing kills, drains or shrinks (the results cell records a kill a test made from outside, if any).
    operations = ("KILL_WORKER_AT_STEP", "MIN_WORKERS", "elastic", "get_preemption_info", "drain", "SIGKILL")
    for operation in operations:
        assert operation not in code, operation
    # The training function is the tutorial's: at most one name of this suite's packages in it.
    function = ast.get_source_segment(code, _train_function(code, tree))
    assert len(re.findall(r"\b(?:helpers|harness)\.\w+", function)) <= 1, function
    assert len(_assigned(_parameter_cells(nb)[0].source)) <= 12
    assert "ray.init(" in code and "if SMOKE_TEST:" in code


def test_every_notebook_is_on_the_learning_path_and_in_the_docs():
    # A new notebook must be on the docs' learning path (docs/tables.py), in the tutorials' table of
    # contents, the docs' index and the README, or no reader finds it.
    import importlib.util

    from harness.notebooks import NAMES

    root = Path(NOTEBOOKS[0]).parents[1]
    spec = importlib.util.spec_from_file_location("docs_tables", root / "docs" / "tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    assert sorted(name for name, _ in tables.LEARNING_PATH) == sorted(NAMES)
    for page in ("docs/tutorials.md", "docs/index.md", "README.md"):
        text = (root / page).read_text()
        assert [n for n in NAMES if f"notebooks/{n}" not in text] == [], page
