"""Test harness: offline by construction, and notebook runners that return what a run wrote.

Offline, three ways: Hugging Face / Ray offline variables; a socket guard (ci/offline) that
every Python process started from here loads at start-up and that records any attempt to
reach a non-loopback address (a test fails if the record is not empty); and `make test`
runs the suite in a network namespace with only loopback, where no connection can succeed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
ARTIFACTS = ROOT / "test-artifacts"
ARTIFACTS.mkdir(exist_ok=True)
GUARD_LOG = ARTIFACTS / "offline-guard.log"
GUARD_LOG.write_text("")

os.environ.update(
    HF_HUB_OFFLINE="1",
    HF_DATASETS_OFFLINE="1",
    TRANSFORMERS_OFFLINE="1",
    HF_HUB_DISABLE_TELEMETRY="1",
    DO_NOT_TRACK="1",
    RAY_USAGE_STATS_ENABLED="0",
    MPLBACKEND="Agg",
    LLM_NOTEBOOKS_OFFLINE_GUARD=str(GUARD_LOG),
    PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "ci" / "offline"), os.environ.get("PYTHONPATH")])),
)
os.environ.setdefault("LLM_NOTEBOOKS_CACHE", str(ROOT / ".cache" / "test"))
for _var in ("RAY_ADDRESS", "STORAGE_PATH", "AWS_ENDPOINT_URL", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
    os.environ.pop(_var, None)  # never a cluster or bucket from outside: the test cluster below, or none
os.environ.pop("SMOKE_TEST", None)  # each test says which mode it runs

sys.path.insert(0, str(ROOT / "ci" / "offline"))
from llm_notebooks_offline_guard import install, start_tripwire_proxy  # noqa: E402

install(str(GUARD_LOG))
# HTTP clients that honour proxy variables send every request to a loopback tripwire that
# refuses it and records its target (see ci/offline); Ray's dashboard probes cloud metadata
# services at start-up, and this keeps those probes on the machine too.
_proxy = f"http://127.0.0.1:{start_tripwire_proxy(str(GUARD_LOG))}"
for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
    os.environ[var] = _proxy
for var in ("NO_PROXY", "no_proxy"):
    os.environ[var] = "localhost,127.0.0.1,::1"


@pytest.fixture(autouse=True)
def no_outbound_connections():
    """Fail the test during which any process tried to reach a non-loopback address."""
    before = GUARD_LOG.stat().st_size
    yield
    with open(GUARD_LOG, encoding="utf-8") as f:
        f.seek(before)
        attempts = f.read()
    assert not attempts, f"outbound connection attempted (offline guard log):\n{attempts[:3000]}"


sys.path.insert(0, str(ROOT / "ci"))
import local_cluster  # noqa: E402

CLUSTER_DIR = ARTIFACTS / "cluster"
_cluster: dict | None = None


def cluster() -> dict:
    """Start (once per session) the test cluster every notebook runs on; return the driver's variables.

    The cluster `make cluster-up` starts (ci/local_cluster.py): two Ray nodes, each with its own raylet
    and object store, with token authentication on, and an S3 server with a bucket. The notebooks attach
    to it through `RAY_ADDRESS` and the token, and keep their checkpoints in the bucket (`STORAGE_PATH`).
    It is stopped at the end of the session by the process ids it recorded (never `ray stop`, which
    would stop every Ray on the machine).
    """
    global _cluster
    if _cluster is None:
        local_cluster.down(CLUSTER_DIR, CLUSTER_DIR / "cluster.env", quiet=True)  # a session that was cut off
        _cluster = local_cluster.up(CLUSTER_DIR, CLUSTER_DIR / "cluster.env")
    return _cluster


def _bucket_env() -> None:
    """The tests read the bucket too (listing, fetch): its endpoint and keys, as for any S3 client."""
    os.environ.update({k: v for k, v in cluster().items() if k.startswith("AWS_")})


def pytest_sessionfinish(session, exitstatus):
    if _cluster is not None:
        local_cluster.down(CLUSTER_DIR, CLUSTER_DIR / "cluster.env", quiet=True)


def notebook_env() -> dict:
    """What a notebook's kernel gets: the cluster's variables, as after `source cluster.env`."""
    return {**os.environ, **cluster()}


def execute(
    name: str, parameters: dict, tag: str, timeout: int = 600, set_env: bool = True
) -> tuple[dict | None, float, Exception | None]:
    """Run notebooks/<name>.ipynb with papermill; return (results JSON, wall seconds, error).

    `set_env=False`: the caller has set the cluster's variables in `os.environ` already (and runs
    several of these at once, which must not change the environment under each other).
    """
    import papermill

    out_dir = ARTIFACTS / "notebooks"
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = out_dir / f"{name}-{tag}.json"
    results_path.unlink(missing_ok=True)
    driver = cluster()
    saved = dict(os.environ)
    if set_env:
        os.environ.update(driver)  # the kernel inherits them
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


def run_nbval(name: str, env: dict, timeout: int = 600) -> tuple[subprocess.CompletedProcess, float]:
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
        env={**notebook_env(), **env},
        cwd=str(NOTEBOOKS),
        capture_output=True,
        text=True,
        timeout=timeout + 60,
    )
    (ARTIFACTS / "notebooks").mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "notebooks" / f"{name}-nbval.log").write_text(proc.stdout + proc.stderr)
    return proc, time.perf_counter() - start


def smoke_nbval(name: str, results_dir: Path) -> tuple[dict, float]:
    """The notebook as a learner runs it (SMOKE_TEST=1 in the environment), validated cell by cell by nbval.

    Returns (its results JSON, wall seconds); fails the calling test (or fixture) if a cell failed.
    """
    results = results_dir / "results.json"
    proc, wall = run_nbval(name, {"SMOKE_TEST": "1", "RESULTS_PATH": str(results)})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(results.read_text()), wall


# Ray Train reads checkpoints in 64 MB chunks too. With pyarrow's default of 1 MB, moto (which reads a whole
# object for every ranged GET) took 93 s for the Llama run's 620 MB of shards; 64 MB: a few seconds.
CHUNK = 64 * 1024 * 1024


def _filesystem(uri: str):
    """(pyarrow filesystem, path) for a URI in the test bucket or a local path."""
    import pyarrow.fs as pafs

    _bucket_env()
    return pafs.FileSystem.from_uri(uri if "://" in uri else str(Path(uri).absolute()))


def fetch(uri: str, dest: Path) -> Path:
    """Copy a checkpoint folder (or file) from the bucket (or a local path) to `dest`; return `dest`."""
    import pyarrow.fs as pafs

    fs, path = _filesystem(uri)
    is_file = fs.get_file_info(path).type == pafs.FileType.File
    (dest.parent if is_file else dest).mkdir(parents=True, exist_ok=True)
    pafs.copy_files(
        path, str(dest), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem(), chunk_size=CHUNK
    )
    return dest


def listing(uri: str) -> list[str]:
    """The object names under `uri`, relative to it (recursive)."""
    import pyarrow.fs as pafs

    fs, path = _filesystem(uri)
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    return sorted(i.path[len(path) :].lstrip("/") for i in infos if i.type == pafs.FileType.File)


def check_plan_matches_shards(results: dict, tolerance: float) -> None:
    """The notebook's "will it fit?" plan against what each rank's shards held after its first step."""
    plan = results["plan"]
    for held in results["state_bytes"]:
        assert held["param_bytes"] == pytest.approx(plan["param_bytes_per_rank"], rel=tolerance)
        assert held["optimizer_bytes"] == pytest.approx(plan["optimizer_bytes_per_rank"], rel=tolerance)


def check_cluster_run(results: dict, kill_at: int | None, resumed_from: int | None, tolerance: float) -> None:
    """What every notebook must show on the cluster: two nodes, a bucket, one real restart that replays."""
    ids = results["worker_node_ids"]
    assert len(ids) == 2 and len(set(ids)) == 2, f"workers not on two Ray nodes: {ids}"
    assert results["checkpoint_path"].startswith("s3://"), results["checkpoint_path"]
    assert listing(results["checkpoint_path"]), "the reported checkpoint is not in the bucket"
    if kill_at is None:
        assert results["kill"] is None
        return
    kill = results["kill"]
    assert kill["at_step"] == kill_at and kill["restarts"] == 1, kill
    assert kill["resumed_from_step"] == resumed_from, kill
    assert kill["replayed_steps"] and kill["replayed_max_abs_diff"] <= tolerance, kill
