"""A notebook's "will it fit?" plan, offline, without running it: `make plan NOTEBOOK=llama_fsdp [ARGS=...]`.

    python -m ci.plan NOTEBOOK [-p NAME VALUE ...]

The plan the notebook's Set up cell works out (`helpers.check_parameters`), for the values of its parameters
cell (the full-scale run) with papermill's `-p NAME VALUE` arguments over them: GPU memory, host RAM and
disk per node, from the model's architecture alone (nothing downloaded; the notebooks' Hub models have
their configs in `basics/architectures/`). It prints the table that the notebook's "Will it fit?" section
shows, checks the values as the notebook would (a run on `MIN_WORKERS` must fit too; the storage, the model
and the data belong to the cluster and are not checked), and exits 2 where the run would not fit, naming
what to change.
"""

from __future__ import annotations

import argparse
import ast
import os
import shlex
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parameters(notebook: str, overrides: list[tuple[str, str]]) -> dict:
    """The notebook's parameters cell, run here (SMOKE_TEST as the environment says: unset, False), with
    `overrides` (papermill's `-p` values: a Python literal, or else the string) over it."""
    known = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    if notebook not in known:  # a name, never a path: a notebook's parameters cell is run here
        raise Refused(f"NOTEBOOK={notebook!r}: not a notebook of this project; one of {known}")
    from basics.notebook_files import parameter_defaults

    values = parameter_defaults(notebook)
    for name, text in overrides:
        if name not in values:
            raise Refused(f"-p {name}: {notebook} has no parameter {name}")
        try:
            values[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            values[name] = text
    return values


class Refused(Exception):
    """A value `make plan` does not take: one line, exit status 2."""


def _offline_model(p: dict) -> None:
    """`make plan` reads no network: MODEL_NAME is a model whose config ships with `helpers`, or a local
    folder with a `config.json`."""
    from basics.plan import SHIPPED

    name = p.get("MODEL_NAME")
    if name is None or name in SHIPPED:
        return
    if (Path(str(name)) / "config.json").is_file():
        _bounded_config(Path(str(name)) / "config.json")
        return
    raise Refused(
        f"MODEL_NAME={str(name)[:80]!r}: `make plan` is offline; it knows {sorted(SHIPPED)}, "
        "or give a local folder with the model's config.json."
    )


# A local config's sizes, before a model is built from it on `meta` (2,000,000 layers: minutes and GBs).
# Far above any model a notebook here fine-tunes (Llama 2 70B: 80 layers, width 8,192, 32,000 tokens).
CONFIG_BOUNDS = {
    "num_hidden_layers": 1_000,
    "n_layer": 1_000,
    "hidden_size": 65_536,
    "n_embd": 65_536,
    "intermediate_size": 1_048_576,
    "num_attention_heads": 1_024,
    "num_key_value_heads": 1_024,
    "vocab_size": 4_194_304,
    "max_position_embeddings": 10_485_760,
}


def _bounded_config(path: Path) -> None:
    import json

    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise Refused(f"MODEL_NAME: {path} is not a readable JSON config ({type(exc).__name__})") from None
    for field, most in CONFIG_BOUNDS.items():
        value = config.get(field) if isinstance(config, dict) else None
        if value is not None and not (type(value) is int and 0 < value <= most):
            raise Refused(
                f"MODEL_NAME: {path} has {field}={str(value)[:40]}; `make plan` takes 1 to {most:,}"
            )


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and status 2, as every refusal here
        raise Refused(message)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebook", nargs="?", help="e.g. llama_fsdp")
    parser.add_argument("-p", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"))
    parser.add_argument(
        "--from-environment", action="store_true", help="`make plan`: NOTEBOOK and ARGS from the environment"
    )
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[var] = "1"  # nothing here reaches the network
    try:
        args = parser.parse_args(argv)
        if args.from_environment:  # as a shell would split ARGS, never run by one
            args = parser.parse_args(
                [os.environ.get("NOTEBOOK", ""), *shlex.split(os.environ.get("ARGS", ""))]
            )
        if not args.notebook:
            raise Refused("NOTEBOOK=<name> is required, e.g. make plan NOTEBOOK=llama_fsdp")
        p = parameters(args.notebook, args.p)
        _offline_model(p)
    except (Refused, ValueError) as exc:
        print(f"Not planned: {_redacted(exc)}", file=sys.stderr)
        return 2
    import pandas as pd

    pd.set_option("display.width", 200)
    with tempfile.TemporaryDirectory(prefix="plan-") as storage:
        p["STORAGE_PATH"] = storage  # the cluster's storage is not checked from here
        return _plan(args.notebook, p)


def _plan(notebook: str, p: dict) -> int:
    from basics.validate import ParameterError
    from harness import checks, sizing
    from harness.notebooks import notebook as notebook_module
    from harness.notebooks import parameters_of

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *_: print(f"Warning: {message}\n")
        try:
            p = parameters_of(notebook, p)
            notebook_module(notebook).check(p)
            checks.check_min_workers(notebook, p)
            plan = sizing.plan_for(notebook, p)
            if plan is None:
                print(f"{notebook} has no memory plan.")
                return 0
            table = plan.table()
            print(table.drop(columns="main terms").to_string() + "\n")
            print("\n".join(f"{what}: {terms}" for what, terms in table["main terms"].items()) + "\n")
            plan.check()
        except ParameterError as exc:
            print(f"Does not fit, or not allowed: {_redacted(exc)}", file=sys.stderr)
            return 2
        except (RuntimeError, OverflowError, MemoryError) as exc:  # e.g. a size torch cannot allocate on meta
            print(f"Not planned: {type(exc).__name__}: {_redacted(exc)}"[:500], file=sys.stderr)
            return 2
    return 0


def _redacted(exc: BaseException) -> str:
    """The refusal's message, with any credentials written into a value masked (`https://***@host`)."""
    from harness.storage import redact_all

    return redact_all(str(exc))


if __name__ == "__main__":
    sys.exit(main())
