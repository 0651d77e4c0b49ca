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
os.environ.pop("RAY_ADDRESS", None)  # never a cluster from outside: the shared one below, or none
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


RAY_CLI = str(Path(sys.executable).parent / "ray")  # the venv's `ray` command
_shared_ray_address: str | None = None


def shared_ray() -> str:
    """Start (once per session) the local Ray cluster that every notebook run attaches to.

    A notebook that starts its own Ray pays for it every run: Ray's processes, then Ray Train's
    system actors (about 10 s a run on 2 cores, measured here). Attached through `RAY_ADDRESS`,
    as on a workspace's cluster, the runs share one. It is set up like `helpers.start_ray`'s local
    Ray: the same logical CPUs (the Ray Data anti-deadlock setting) and environment.
    """
    global _shared_ray_address
    if _shared_ray_address is None:
        import socket

        from helpers.cluster import LOCAL_RAY_ENV, RAY_ENV

        for var, value in {**RAY_ENV, **LOCAL_RAY_ENV}.items():
            os.environ.setdefault(var, value)
        # `ray start` turns on token authentication, and every client would need the token; a cluster
        # on loopback inside the test's network namespace has nobody to keep out.
        os.environ["RAY_AUTH_MODE"] = "disabled"
        # With usage stats disabled, a cluster started by `ray start` (not `ray.init`) still sends one
        # "disabled" report to usage-stats.ray.io; the offline guard caught it. Send it to loopback.
        os.environ["RAY_USAGE_STATS_REPORT_URL"] = "http://127.0.0.1:9/"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        subprocess.run(
            [RAY_CLI, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1"]
            + [f"--num-cpus={max(4, 2 * (os.cpu_count() or 1))}", "--include-dashboard=false"]
            + ["--disable-usage-stats"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        _shared_ray_address = f"127.0.0.1:{port}"
    return _shared_ray_address


def pytest_sessionfinish(session, exitstatus):
    if _shared_ray_address is not None:
        subprocess.run([RAY_CLI, "stop", "--force"], capture_output=True, timeout=120)


def execute(
    name: str, parameters: dict, tag: str, timeout: int = 600
) -> tuple[dict | None, float, Exception | None]:
    """Run notebooks/<name>.ipynb with papermill; return (results JSON, wall seconds, error)."""
    import papermill

    out_dir = ARTIFACTS / "notebooks"
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = out_dir / f"{name}-{tag}.json"
    results_path.unlink(missing_ok=True)
    os.environ["RAY_ADDRESS"] = shared_ray()  # the kernel inherits it
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
        os.environ.pop("RAY_ADDRESS", None)
    wall = time.perf_counter() - start
    results = json.loads(results_path.read_text()) if results_path.exists() else None
    return results, wall, error


def run_nbval(name: str, env: dict, timeout: int = 600) -> tuple[subprocess.CompletedProcess, float]:
    """Validate notebooks/<name>.ipynb cell by cell with nbval (lax: no stored outputs to compare)."""
    address = shared_ray()
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
        env={**os.environ, "RAY_ADDRESS": address, **env},
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
