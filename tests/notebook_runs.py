"""Test plumbing: run a notebook and return what it wrote, read the test cluster's bucket, pinned losses.

The tests import what they need from here (`from notebook_runs import smoke_nbval, listing`); conftest.py
holds only pytest's hooks and fixtures (the offline guard, and the `ray_cluster` fixture, which starts the
test cluster with `start_cluster` and stops it with `stop_cluster`). Importing this module starts nothing
and writes nothing.

Pinned smoke losses live in tests/assets/losses/<notebook>.txt: a `#` header that says where and how they
were measured and their tolerance, then one `step loss` pair per line. After a change that moves them on
purpose, re-pin from a run's results JSON (the nbval tests copy theirs to test-artifacts/notebooks/
<notebook>-nbval.json; `make run` writes runs/<timestamp>/<notebook>.json):

    .venv/bin/python tests/notebook_runs.py repin llama_fsdp test-artifacts/notebooks/llama_fsdp-nbval.json
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
ARTIFACTS = ROOT / "test-artifacts"
GUARD_LOG = ARTIFACTS / "offline-guard.log"  # the offline guard's record (see conftest.py and ci/offline)
CLUSTER_DIR = ARTIFACTS / "cluster"
LOSSES = Path(__file__).resolve().parent / "assets" / "losses"


# ---- the test cluster ------------------------------------------------------------------------


def _local_cluster():
    """ci/local_cluster.py, imported on first use (conftest puts ci/ on sys.path for the tests too)."""
    if str(ROOT / "ci") not in sys.path:
        sys.path.insert(0, str(ROOT / "ci"))
    import local_cluster

    return local_cluster


def start_cluster() -> dict:
    """Start the test cluster every notebook runs on; return the driver's variables.

    The cluster `make cluster-up` starts (ci/local_cluster.py): two Ray nodes, each with its own raylet
    and object store, with token authentication on, and an S3 server with a bucket. The notebooks attach
    to it through `RAY_ADDRESS` and the token, and keep their checkpoints in the bucket (`STORAGE_PATH`).
    The `ray_cluster` fixture (conftest.py) calls this once per session, when a test first needs it.
    """
    local_cluster = _local_cluster()
    local_cluster.down(CLUSTER_DIR, CLUSTER_DIR / "cluster.env", quiet=True)  # a session that was cut off
    return local_cluster.up(CLUSTER_DIR, CLUSTER_DIR / "cluster.env")


def stop_cluster() -> None:
    """Stop the test cluster by the process ids `start_cluster` recorded (never `ray stop`, which would
    stop every Ray on the machine)."""
    _local_cluster().down(CLUSTER_DIR, CLUSTER_DIR / "cluster.env", quiet=True)


def notebook_env(cluster: Mapping[str, str]) -> dict:
    """What a notebook's kernel gets: the cluster's variables, as after `source cluster.env`."""
    return {**os.environ, **cluster}


# ---- running notebooks -----------------------------------------------------------------------


def execute(
    name: str,
    parameters: dict,
    tag: str,
    *,
    cluster: Mapping[str, str],
    timeout: int = 600,
    set_env: bool = True,
) -> tuple[dict | None, float, Exception | None]:
    """Run notebooks/<name>.ipynb with papermill on `cluster`; return (results JSON, wall seconds, error).

    `set_env=False`: the caller has set the cluster's variables in `os.environ` already (and runs
    several of these at once, which must not change the environment under each other).
    """
    import papermill

    out_dir = ARTIFACTS / "notebooks"
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = out_dir / f"{name}-{tag}.json"
    results_path.unlink(missing_ok=True)
    if not set_env:
        assert os.environ.get("RAY_ADDRESS") == cluster["RAY_ADDRESS"], "set the cluster's variables first"
    saved = dict(os.environ)
    if set_env:
        os.environ.update(cluster)  # the kernel inherits them
    start = time.perf_counter()
    error = None
    try:
        papermill.execute_notebook(
            str(NOTEBOOKS / f"{name}.ipynb"),
            str(out_dir / f"{name}-{tag}.ipynb"),
            parameters={"RESULTS_PATH": str(results_path), **parameters},
            kernel_name="python3",
            cwd=str(NOTEBOOKS),
            execution_timeout=timeout,
            progress_bar=False,
        )
    except Exception as exc:  # noqa: BLE001 - returned to the test, which asserts on it
        error = exc
    finally:
        if set_env:
            os.environ.clear()
            os.environ.update(saved)
    wall = time.perf_counter() - start
    results = json.loads(results_path.read_text()) if results_path.exists() else None
    return results, wall, error


def run_nbval(
    name: str, env: dict, cluster: Mapping[str, str], timeout: int = 600
) -> tuple[subprocess.CompletedProcess, float]:
    """Validate notebooks/<name>.ipynb cell by cell with nbval (lax: no stored outputs to compare)."""
    start = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--nbval-lax",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--nbval-cell-timeout={timeout}",
            "--rootdir",
            str(NOTEBOOKS),
            str(NOTEBOOKS / f"{name}.ipynb"),
        ],
        env={**notebook_env(cluster), **env},
        cwd=str(NOTEBOOKS),
        capture_output=True,
        text=True,
        timeout=timeout + 60,
    )
    (ARTIFACTS / "notebooks").mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "notebooks" / f"{name}-nbval.log").write_text(proc.stdout + proc.stderr)
    return proc, time.perf_counter() - start


def smoke_nbval(name: str, results_dir: Path, cluster: Mapping[str, str]) -> tuple[dict, float]:
    """The notebook as a learner runs it (SMOKE_TEST=1 in the environment), validated cell by cell by nbval.

    Returns (its results JSON, wall seconds); fails the calling test (or fixture) if a cell failed. The
    results JSON is copied to test-artifacts/notebooks/<name>-nbval.json (what `repin` reads).
    """
    results = results_dir / "results.json"
    kept = ARTIFACTS / "notebooks" / f"{name}-nbval.json"
    kept.unlink(missing_ok=True)
    proc, wall = run_nbval(name, {"SMOKE_TEST": "1", "RESULTS_PATH": str(results)}, cluster)
    if results.exists():
        shutil.copyfile(results, kept)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(results.read_text()), wall


# ---- the bucket ------------------------------------------------------------------------------

# Ray Train reads checkpoints in 64 MB chunks too. With pyarrow's default of 1 MB, moto (which reads a whole
# object for every ranged GET) took 93 s for the Llama run's 620 MB of shards; 64 MB: a few seconds.
CHUNK = 64 * 1024 * 1024


def filesystem(uri: str, cluster: Mapping[str, str] | None = None):
    """(pyarrow filesystem, path) for a URI in the test cluster's bucket, or a local path.

    The bucket's endpoint and keys are the cluster's variables (as for any S3 client); they are passed to
    pyarrow, not set in this process's environment.
    """
    import pyarrow.fs as pafs

    if not uri.startswith("s3://"):
        return pafs.FileSystem.from_uri(uri if "://" in uri else str(Path(uri).absolute()))
    if cluster is None:
        raise ValueError(f"{uri}: reading the bucket needs the cluster's variables (the ray_cluster fixture)")
    scheme, _, endpoint = cluster["AWS_ENDPOINT_URL"].partition("://")
    fs = pafs.S3FileSystem(
        access_key=cluster["AWS_ACCESS_KEY_ID"],
        secret_key=cluster["AWS_SECRET_ACCESS_KEY"],
        region=cluster["AWS_REGION"],
        endpoint_override=endpoint.rstrip("/"),
        scheme=scheme,
    )
    return fs, uri.removeprefix("s3://").rstrip("/")


def fetch(uri: str, dest: Path, cluster: Mapping[str, str] | None = None) -> Path:
    """Copy a checkpoint folder (or file) from the bucket (or a local path) to `dest`; return `dest`."""
    import pyarrow.fs as pafs

    fs, path = filesystem(uri, cluster)
    is_file = fs.get_file_info(path).type == pafs.FileType.File
    (dest.parent if is_file else dest).mkdir(parents=True, exist_ok=True)
    pafs.copy_files(
        path, str(dest), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem(), chunk_size=CHUNK
    )
    return dest


def listing(uri: str, cluster: Mapping[str, str] | None = None) -> list[str]:
    """The object names under `uri`, relative to it (recursive)."""
    import pyarrow.fs as pafs

    fs, path = filesystem(uri, cluster)
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    return sorted(i.path[len(path) :].lstrip("/") for i in infos if i.type == pafs.FileType.File)


# ---- checks every notebook test shares -------------------------------------------------------


def check_plan_matches_shards(results: dict, tolerance: float) -> None:
    """The notebook's "will it fit?" plan against what each rank's shards held after its first step."""
    plan = results["plan"]
    for held in results["state_bytes"]:
        assert held["param_bytes"] == pytest.approx(plan["param_bytes_per_rank"], rel=tolerance)
        assert held["optimizer_bytes"] == pytest.approx(plan["optimizer_bytes_per_rank"], rel=tolerance)


def check_cluster_run(
    results: dict,
    cluster: Mapping[str, str],
    kill_at: int | None,
    resumed_from: int | None,
    tolerance: float,
) -> None:
    """What every notebook must show on the cluster: two nodes, a bucket, one real restart that replays."""
    ids = results["worker_node_ids"]
    assert len(ids) == 2 and len(set(ids)) == 2, f"workers not on two Ray nodes: {ids}"
    assert results["checkpoint_path"].startswith("s3://"), results["checkpoint_path"]
    assert listing(results["checkpoint_path"], cluster), "the reported checkpoint is not in the bucket"
    if kill_at is None:
        assert results["kill"] is None
        return
    kill = results["kill"]
    assert kill["at_step"] == kill_at and kill["restarts"] == 1, kill
    assert kill["resumed_from_step"] == resumed_from, kill
    assert kill["replayed_steps"] and kill["replayed_max_abs_diff"] <= tolerance, kill


def last_checkpoint_before(step: int, every: int) -> int:
    """The step of the last checkpoint a run that saves every `every` steps wrote before `step` (0: none)."""
    return (step - 1) // every * every


# ---- pinned smoke losses ---------------------------------------------------------------------


@dataclass(frozen=True)
class PinnedLosses:
    """A notebook's pinned smoke losses: `losses[i]` is step `steps[i]`'s (steps count from 1)."""

    steps: list[int]
    losses: list[float]
    tolerance: float  # absolute, per step
    header: list[str]  # the file's `#` lines, as written


_TOLERANCE = re.compile(r"^#\s*tolerance:\s*([0-9.eE+-]+)")


def pinned_losses(name: str, folder: Path = LOSSES) -> PinnedLosses:
    """Read tests/assets/losses/<name>.txt: a `#` header with a `# tolerance: X` line, then `step loss`s."""
    path = folder / f"{name}.txt"
    header, steps, losses, tolerance = [], [], [], None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("#"):
            if steps:
                raise ValueError(f"{path}:{number}: a header line after the losses")
            header.append(line)
            if match := _TOLERANCE.match(line):
                tolerance = float(match.group(1))
        elif line.strip():
            fields = line.split()
            if len(fields) != 2:
                raise ValueError(f"{path}:{number}: expected `step loss`, got {line!r}")
            steps.append(int(fields[0]))
            losses.append(float(fields[1]))
    if tolerance is None:
        raise ValueError(f"{path}: no `# tolerance: X` line in the header")
    if not steps or steps != sorted(set(steps)) or steps[0] < 1:
        raise ValueError(f"{path}: steps must be increasing, from 1 up: {steps}")
    return PinnedLosses(steps, losses, tolerance, header)


def repin(name: str, results_path: Path, folder: Path = LOSSES) -> PinnedLosses:
    """Rewrite tests/assets/losses/<name>.txt from a smoke run's results JSON: same header, same steps."""
    old = pinned_losses(name, folder)
    results = json.loads(Path(results_path).read_text())
    if results.get("notebook") != name or results.get("smoke_test") is not True:
        raise ValueError(
            f"{results_path}: not a smoke run of {name} "
            f"(notebook={results.get('notebook')!r}, smoke_test={results.get('smoke_test')!r})"
        )
    losses = results["losses"]
    if len(losses) < old.steps[-1]:
        raise ValueError(f"{results_path}: {len(losses)} losses, the file pins step {old.steps[-1]}")
    lines = [*old.header, *(f"{step} {losses[step - 1]:.4f}" for step in old.steps)]
    (folder / f"{name}.txt").write_text("\n".join(lines) + "\n")
    return pinned_losses(name, folder)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("repin", help="rewrite a notebook's pinned losses from a results JSON")
    command.add_argument("notebook", help="e.g. llama_fsdp")
    command.add_argument("results", type=Path, help="e.g. test-artifacts/notebooks/llama_fsdp-nbval.json")
    command.add_argument("--folder", type=Path, default=LOSSES, help="default: tests/assets/losses")
    args = parser.parse_args(argv)
    try:
        old = pinned_losses(args.notebook, args.folder)
        new = repin(args.notebook, args.results, args.folder)
    except (OSError, ValueError, KeyError) as exc:
        parser.error(str(exc))  # exits with status 2, the file unchanged
    for step, before, after in zip(new.steps, old.losses, new.losses, strict=True):
        print(f"step {step}: {before} -> {after}")
    print(f"Wrote {args.folder / (args.notebook + '.txt')}; its header is unchanged: update the hardware and")
    print("versions it names if the run that wrote the results JSON differed.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
