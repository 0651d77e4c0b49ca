"""pytest's hooks and fixtures: the suite offline by construction, and the test cluster as a fixture.

Offline, three ways: Hugging Face / Ray offline variables; a socket guard (ci/offline) that
every Python process started from here loads at start-up and that records any attempt to
reach a non-loopback address (a test fails if the record is not empty); and `make test`
runs the suite in a network namespace with only loopback, where no connection can succeed.
All of it is set up in `pytest_configure`, not at import. The notebook runners, bucket readers and
shared checks the tests use are in notebook_runs.py.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from types import MappingProxyType

import pytest
from jupyterlab_runs import LabRun, jupyterlab_run
from notebook_runs import (
    ARTIFACTS,
    CANARY_HF_TOKEN,
    CANARY_SHELL_SECRET,
    CANARY_SHELL_VAR,
    CANARY_STORAGE_SECRET,
    GUARD_LOG,
    ROOT,
    secret_leaks,
    smoke_nbval,
    start_cluster,
    stop_cluster,
)

_GUARD_CHECKED = pytest.StashKey[int]()  # how far the offline guard's log has been checked


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """Offline before anything else runs: before collection imports a test module, and in every process
    started from here (kernels, Ray nodes and workers, nbval's pytest inherit this environment)."""
    ARTIFACTS.mkdir(exist_ok=True)
    GUARD_LOG.write_text("")
    config.stash[_GUARD_CHECKED] = 0
    offline = str(ROOT / "ci" / "offline")  # the guard, and the sitecustomize.py that loads it
    os.environ.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        DO_NOT_TRACK="1",
        RAY_USAGE_STATS_ENABLED="0",
        MPLBACKEND="Agg",
        LLM_NOTEBOOKS_OFFLINE_GUARD=str(GUARD_LOG),
        PYTHONPATH=os.pathsep.join(filter(None, [offline, os.environ.get("PYTHONPATH")])),
    )
    os.environ.setdefault("LLM_NOTEBOOKS_CACHE", str(ROOT / ".cache" / "test"))
    # DeepSpeed's ops where `make install` built them (the Makefile exports this): a pytest started by hand
    # would otherwise compile the shared-memory op into ~/.cache/torch_extensions inside the first GPT-2 run
    # (33 s of a JupyterLab Run All measured 93 s instead of 56 s, 2026-11-26).
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    # Never a cluster, bucket or credentials from outside: the ray_cluster fixture's, or none. The Hub
    # token is a canary instead (the Hub is offline): no file the session writes may contain it.
    from harness.cluster import forget_outside_cluster

    forget_outside_cluster()
    from ci.local_cluster import SIGNED_BODIES

    os.environ.update(SIGNED_BODIES)  # as cluster.env sets it: the tests' own bucket writes sign their bodies
    os.environ["HF_TOKEN"] = CANARY_HF_TOKEN
    # A credential the user's shell holds for something else: no process of the cluster may get it.
    os.environ[CANARY_SHELL_VAR] = CANARY_SHELL_SECRET
    os.environ.pop("SMOKE_TEST", None)  # each test says which mode it runs

    guard = _offline_guard(offline)
    guard.install(str(GUARD_LOG))
    # HTTP clients that honour proxy variables send every request to a loopback tripwire that
    # refuses it and records its target (see ci/offline); Ray's dashboard probes cloud metadata
    # services at start-up, and this keeps those probes on the machine too.
    proxy = f"http://127.0.0.1:{guard.start_tripwire_proxy(str(GUARD_LOG))}"
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        os.environ[var] = proxy
    for var in ("NO_PROXY", "no_proxy"):
        os.environ[var] = "localhost,127.0.0.1,::1"


def _offline_guard(folder: str):
    """The guard's module, by the name every process the tests start imports it under (their
    sitecustomize.py does, from `folder` on PYTHONPATH): one copy of it in this process too."""
    import importlib.util

    name = "llm_notebooks_offline_guard"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(folder, f"{name}.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


@pytest.fixture(autouse=True)
def no_outbound_connections(request):
    """Fail the test during which any process tried to reach a non-loopback address.

    The check covers everything since the previous test's: the test itself, and the set-up of the module
    and session fixtures it was the first to need (a notebook run, the cluster's start).
    """
    yield
    with open(GUARD_LOG, "rb") as f:
        f.seek(request.config.stash[_GUARD_CHECKED])
        attempts = f.read().decode("utf-8", errors="replace")
        request.config.stash[_GUARD_CHECKED] = f.tell()
    assert not attempts, f"outbound connection attempted (offline guard log):\n{attempts[:3000]}"


# The tests whose runs start DeepSpeed (which then compiles its CPU ops, if not built yet).
_DEEPSPEED_TESTS = {"test_gpt2_deepspeed.py", "test_zero_checkpoint.py"}
# The build of DeepSpeed's CPU ops in a new virtualenv: 75 s of both cores on an idle machine; its budget.
DEEPSPEED_OPS_BUDGET_S = 300


@pytest.fixture(scope="session", autouse=True)
def deepspeed_ops_in_spare_time(request):
    """In a new virtualenv DeepSpeed compiles its CPU ops on first use: 75 s of both cores, in the GPT-2 tests
    (ci/build_deepspeed_ops.py). When the session includes those, the ops are built from its start, at the
    lowest CPU priority, in the time the other tests leave idle (waits for processes, nodes, a bucket); the
    `deepspeed_ops` fixture raises it to normal priority and waits for it when a test needs the ops. At the
    end, a build still going is interrupted (the lock released), and a new run builds what is missing.
    Yields the build's process (None: no build in this session)."""
    if not any(item.path.name in _DEEPSPEED_TESTS for item in request.session.items):
        yield None
        return
    import shutil
    import signal
    import subprocess

    # SCHED_IDLE: the CPU only when nothing else wants it (`nice -n 19` slowed the tests beside it)
    idle = ["chrt", "--idle", "0"] if shutil.which("chrt") else ["nice", "-n", "19"]
    with open(ARTIFACTS / "deepspeed-ops.log", "w") as log:
        build = subprocess.Popen(
            [*idle, sys.executable, str(ROOT / "ci" / "build_deepspeed_ops.py")],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the compilers stop with it
        )
        yield build
        if build.poll() is None:  # Ctrl-C to the group: ninja stops its compilers, torch frees its lock
            os.killpg(build.pid, signal.SIGINT)
        build.wait(timeout=60)


def _normal_priority(pid: int) -> None:
    """The process and its children (ninja, the compilers; those started later inherit it) back from idle
    priority to normal: on a machine that is never idle, an idle-priority build would wait for ever."""
    import psutil

    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(OSError):
                os.sched_setscheduler(proc.pid, os.SCHED_OTHER, os.sched_param(0))
                os.setpriority(os.PRIO_PROCESS, proc.pid, 0)


@pytest.fixture(scope="session")
def deepspeed_ops(deepspeed_ops_in_spare_time):
    """For the tests that start DeepSpeed: its CPU ops built before the test's own time starts (a build still
    going gets normal priority and DEEPSPEED_OPS_BUDGET_S), so the test's budget guards the test alone."""
    import subprocess

    build = deepspeed_ops_in_spare_time
    if build is None or build.poll() is not None:
        return
    _normal_priority(build.pid)
    try:
        build.wait(timeout=DEEPSPEED_OPS_BUDGET_S)
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"DeepSpeed's CPU ops were not built within {DEEPSPEED_OPS_BUDGET_S} s "
            f"(ci/build_deepspeed_ops.py; its log: {ARTIFACTS / 'deepspeed-ops.log'})"
        )


@pytest.fixture(scope="session")
def ray_cluster():
    """The test cluster every notebook runs on (notebook_runs.start_cluster), started when a test first
    needs it: the driver's variables (`RAY_ADDRESS`, the token, `STORAGE_PATH`, the bucket's `AWS_*`).

    Stopped at the end of the session, also when tests failed or the run was interrupted, by the process
    ids it recorded (never `ray stop`, which would stop every Ray on the machine).
    """
    driver = start_cluster()
    secrets = {
        "HF_TOKEN": CANARY_HF_TOKEN,
        "AWS_SECRET_ACCESS_KEY": driver["AWS_SECRET_ACCESS_KEY"],  # a new one per cluster
        "MLFLOW_TRACKING_TOKEN": driver["MLFLOW_TRACKING_TOKEN"],  # the tracking server's, new per cluster
        "a credential of the shell's": CANARY_SHELL_SECRET,
        "STORAGE_PATH's secret": CANARY_STORAGE_SECRET,
    }
    try:
        yield MappingProxyType(driver)  # read-only: one cluster for every test
        # Every log of both nodes, before they go: no secret the session had may be in any file it wrote.
        leaks = secret_leaks(secrets)
    finally:
        stop_cluster()
    assert not leaks, "secrets written to files:\n" + "\n".join(leaks)


@pytest.fixture(scope="session")
def jupyterlab(ray_cluster, tmp_path_factory) -> Callable[[str], LabRun]:
    """`jupyterlab(name)`: notebooks/<name>.ipynb run in smoke mode through JupyterLab in Chromium on the test
    cluster (jupyterlab_runs.jupyterlab_run), once a session per notebook: test_jupyterlab.py checks the page,
    the notebook's own tests take its results JSON. Skipped without a Chromium (failed in CI)."""
    runs: dict[str, LabRun] = {}

    def run(name: str) -> LabRun:
        if name not in runs:
            runs[name] = jupyterlab_run(name, ray_cluster, tmp_path_factory.mktemp(f"jupyterlab-{name}"))
            print(runs[name].summary())
        return runs[name]

    return run


@pytest.fixture(scope="session")
def smoke_run(jupyterlab, ray_cluster, tmp_path_factory) -> Callable[[str], tuple[dict, float]]:
    """`smoke_run(name)`: (results JSON, wall seconds) of the notebook's smoke run as a learner runs it, in
    JupyterLab (the `jupyterlab` fixture's run; one run serves both) or, where there is no Chromium to drive
    (outside CI), validated cell by cell by nbval (notebook_runs.smoke_nbval). Fails if no results JSON."""
    from browser import chromium_or_skip

    def run(name: str) -> tuple[dict, float]:
        try:
            chromium_or_skip()
        except pytest.skip.Exception as why:
            print(f"{name}: through nbval, not JupyterLab ({why})")
            return smoke_nbval(name, tmp_path_factory.mktemp(f"nbval-{name}"), ray_cluster)
        lab = jupyterlab(name)
        assert lab.results is not None, f"the notebook wrote no results JSON: {lab.summary()}\n{lab.problems}"
        return lab.results, lab.wall

    return run
