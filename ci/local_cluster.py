"""A cluster-shaped Ray on one machine: two Ray nodes and an S3 bucket, on loopback only.

    python -m ci.local_cluster up      # `make cluster-up`: start it, write cluster.env
    python -m ci.local_cluster down    # `make cluster-down`: stop exactly what `up` started
    python -m ci.local_cluster status
    python -m ci.local_cluster kill-node | add-node | pause-storage --seconds 25   # failures, on purpose

What `up` starts, each as a child process whose id it records (in .cluster/state.json):

- an S3 API server (moto's, as in Ray's own storage tests, behind ci/s3_server.py's guard: loopback only,
  no requests from web pages, no moto API) with one bucket;
- an MLflow tracking server on loopback (`MLFLOW_TRACKING_URI`): runs in SQLite in the state folder,
  artifacts in the bucket;
- a Ray head node and a second Ray node (`ray start --block`, two raylets with an object store
  each), with Ray's token authentication on (the token is in .cluster/auth_token, never in
  ~/.ray) and the bucket's credentials in each node's environment, as instance credentials are
  on a real cluster.

`cluster.env` holds what a driver needs, set the way a user sets them for an S3-compatible bucket:
`RAY_ADDRESS`, the token variables, `STORAGE_PATH=s3://...`, `AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL`, `AWS_REGION`, `MLFLOW_TRACKING_URI`, `RAY_API_SERVER_ADDRESS`
(the head's dashboard, where Ray Jobs are submitted) and `LLM_NOTEBOOKS_JOB_PYTHON` (the nodes' Python).
`source cluster.env`, then run a notebook, or submit it as a Ray Job (`make job NOTEBOOK=...`).

`cluster.env`, `.cluster/state.json` and the token file are created readable by their owner only (0600).

One run per state folder: `up` refuses while the processes of another run's cluster in the same folder
are alive (`ClusterBusy`), and stops only what a run that is gone left behind: a run's state names the
process that holds it (`make run CLUSTER=1`, a test session), and a cluster started by hand (`make
cluster-up`) is held until `make cluster-down`.

`down` signals the processes `up` recorded (checking each id's start time, so a reused id is never
hit), waits, and kills only what is left of them and their children. It never runs `ray stop`,
which stops every Ray process on the machine, a user's own cluster included.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from harness.cluster import LOCAL_RAY_ENV, LOOPBACK_ONLY, RAY_ENV

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv's `ray`
BUCKET = "llm-notebooks"
PREFIX = "runs"


class ClusterBusy(RuntimeError):
    """Another live run holds the state folder's cluster."""


def _credentials() -> dict:
    """New secrets per cluster (one that shows up in a log or a results file is found by searching for it,
    as tests/conftest.py does): the bucket's key and secret, which ci/s3_server.py checks every request's
    signature against, and the tracking server's token, which ci/mlflow_server.py asks every client for."""
    return {
        "AWS_ACCESS_KEY_ID": "llm-notebooks-key",
        "AWS_SECRET_ACCESS_KEY": f"llm-notebooks-{secrets.token_hex(16)}",
        "MLFLOW_TRACKING_TOKEN": secrets.token_hex(32),
    }


# What the cluster's processes get of the caller's environment: the system's basics, Python's and the
# project's settings, offline switches, and proxies (the tests' tripwire); never a credential the shell holds
# (a GITHUB_TOKEN, a cloud key, HF_TOKEN: the notebooks hand the Hub token to their workers themselves).
_KEPT_NAMES = {
    *("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM", "VIRTUAL_ENV"),
    *("TORCH_EXTENSIONS_DIR", "XDG_CACHE_HOME", "CUDA_VISIBLE_DEVICES", "MPLBACKEND", "DO_NOT_TRACK"),
    *("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"),
    *("HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"),
    *("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy"),
    # exact names, never prefixes: a prefix lets any variable of that shape in (LC_PASSWD, PYTHONCANARY)
    *("LC_ALL", "LC_CTYPE", "LC_MESSAGES", "LC_NUMERIC", "LC_TIME", "LC_COLLATE", "LC_MONETARY"),
    *("PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", "PYTHONHASHSEED", "PYTHONWARNINGS"),
    *("LLM_NOTEBOOKS_CACHE", "LLM_NOTEBOOKS_OFFLINE_GUARD", "LLM_NOTEBOOKS_AUTOSCALING"),
}
_SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "KEY", "CREDENTIAL")
LOOPBACK = ("127.0.0.1", "localhost")


def kept_env(environ=os.environ) -> dict:
    """The caller's variables a cluster process may have (see _KEPT_NAMES); a proxy with a user in it is not.
    Loopback is never proxied (`no_proxy`): the cluster's servers are on it, and their tokens must not go to
    a proxy the shell names."""
    kept = {
        name: value
        for name, value in environ.items()
        if name in _KEPT_NAMES
        and not any(word in name.upper() for word in _SECRET_WORDS)
        and not ("PROXY" in name.upper() and "@" in value)
    }
    return {**kept, **no_proxy(environ)}


# One NO_PROXY entry: a host name or domain suffix (`.corp.example`, `*`), an address, a CIDR range, with an
# optional port. Anything else (`corp.example;touch pwned #`) is dropped, loopback always kept.
_NO_PROXY_ENTRY = re.compile(r"^(\*|\.?[A-Za-z0-9._-]+|\[?[0-9A-Fa-f:.]+\]?)(/\d{1,3})?(:\d{1,5})?$")


def no_proxy(environ=os.environ) -> dict:
    """`NO_PROXY` and `no_proxy` with loopback added to what `environ` has (clients read one or the other);
    an entry that is not a host, an address or a range is dropped."""
    given = [h.strip() for v in (environ.get("NO_PROXY"), environ.get("no_proxy")) if v for h in v.split(",")]
    hosts = ",".join(dict.fromkeys([*(h for h in given if _NO_PROXY_ENTRY.match(h)), *LOOPBACK]))
    return {"NO_PROXY": hosts, "no_proxy": hosts}


def env_file_text(header: list[str], variables: dict[str, str]) -> str:
    """`cluster.env`: the header's comment lines, then `export NAME=value` with every value shell-quoted,
    so that sourcing it sets exactly these values and runs nothing."""
    import shlex

    return "\n".join([*header, *(f"export {k}={shlex.quote(str(v))}" for k, v in variables.items())]) + "\n"


def read_env_file(path: Path) -> dict[str, str]:
    """The variables `env_file_text` wrote, unquoted as the shell reads them."""
    import shlex

    return {
        name: "".join(shlex.split(value))
        for name, value in (
            line.removeprefix("export ").split("=", 1)
            for line in path.read_text().splitlines()
            if line.startswith("export ")
        )
    }


def _write_private(path: Path, text: str) -> None:
    """Write `path` readable by its owner only, from the start (never world-readable for a moment), and
    atomically (a reader sees the old or the new file whole)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # an older file of that name kept its mode
        f.write(text)
    os.replace(tmp, path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, what: str, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{what} exited with code {proc.returncode}; see {log}:\n{log.read_text()[-2000:]}"
            )
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{what} did not open port {port} within {timeout:.0f} s; see {log}")


def _start(cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
    # A session of its own: the process outlives `make cluster-up`'s shell and no terminal signal reaches it.
    # Its log is its owner's alone, as the state folder is.
    with os.fdopen(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _record(proc: subprocess.Popen, name: str) -> dict:
    import psutil

    return {"name": name, "pid": proc.pid, "create_time": psutil.Process(proc.pid).create_time()}


def _alive_nodes(gcs_address: str, env: dict) -> int:
    code = (
        "from ray._raylet import GcsClient; import sys;"
        f"nodes = GcsClient(address={gcs_address!r}).get_all_node_info(timeout=10);"
        "print(sum(1 for n in nodes.values() if n.state == 0))"  # 0: ALIVE
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    return int(out.stdout.strip() or 0) if out.returncode == 0 else 0


def _wait_for_nodes(
    address: str, env: dict, count: int, proc: subprocess.Popen, failure: str, poll_s: float
) -> None:
    """Wait (at most 90 s) until `count` Ray nodes are alive at `address`; RuntimeError(`failure`) if `proc`,
    the node just started, exits first or they are not."""
    deadline = time.monotonic() + 90
    while _alive_nodes(address, env) < count:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(failure)
        time.sleep(poll_s)


# pyarrow's AWS SDK (and boto3) then sign each body's SHA-256 instead of streaming it with a checksum the
# signature does not cover: the bucket's server refuses streamed bodies (ci/s3_server.py).
SIGNED_BODIES = {"AWS_REQUEST_CHECKSUM_CALCULATION": "when_required"}


def node_env(
    state_dir: Path,
    s3_port: int | None,
    credentials: dict,
    base: dict | None = None,
    node_death_s: int | None = None,
) -> dict:
    """The environment of every Ray node: the caller's kept variables (`kept_env`), token auth, the bucket's
    and the tracking server's credentials (as instance credentials are on a real cluster), quiet Ray.
    `s3_port` None: a Ray without the bucket (`up_ray`)."""
    env = kept_env(os.environ if base is None else base)
    env.update(RAY_ENV)
    env.update(LOCAL_RAY_ENV)  # a laptop's cluster: no preemption watcher, one parquet footer reader
    if s3_port is not None:
        env.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{s3_port}", AWS_REGION="us-east-1", **SIGNED_BODIES)
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(state_dir / "auth_token"),
        **credentials,
        # With usage stats disabled, `ray start` still sends one "disabled" report; keep it on loopback.
        RAY_USAGE_STATS_ENABLED="0",
        RAY_USAGE_STATS_REPORT_URL="http://127.0.0.1:9/",
        # No metrics exporters: plain HTTP servers without a credential, which nothing here reads.
        RAY_enable_metrics_collection="0",
    )
    if node_death_s:  # the GCS checks each raylet every second and gives up after node_death_s misses
        env.update(
            RAY_health_check_period_ms="1000",
            RAY_health_check_timeout_ms="1000",
            RAY_health_check_failure_threshold=str(node_death_s),
        )
    env.update(LOOPBACK_ONLY)  # 127.0.0.1 stays 127.0.0.1: every node's servers on loopback (ci/ray_node.py)
    env.pop("RAY_AUTH_TOKEN", None)
    env.pop("RAY_ADDRESS", None)
    return env


def ray_temp_dir(prefix: str) -> str:
    """A node's `--temp-dir`: `ray` inside a new folder only this user can enter (0700). Ray opens its temp
    dir and the session folders in it to every user (0777, no sticky bit); inside a folder no one else can
    enter, no one else can reach them (a job's unpacked code, the raylet's sockets, the logs). Named `ray`,
    as under Ray's default `/tmp/ray`: a driver with `RAY_TMPDIR=<the folder>` finds the head there as it
    would find one that `ray start` runs with defaults. Under /tmp: Ray's socket paths must stay short."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))  # 0700
    (folder / "ray").mkdir(mode=0o700)
    return str(folder / "ray")


def _private_parent(temp_dir: str) -> str:
    """The 0700 folder `ray_temp_dir` made around `temp_dir` (a state of an earlier version: `temp_dir`)."""
    path = Path(temp_dir)
    return str(path.parent) if path.name == "ray" and path.parent.name.startswith("llmnb-ray") else temp_dir


def _head_ports() -> list[str]:
    """The head's Ray Client server on a free port (Ray's default: 10001, the same for every cluster)."""
    return [f"--ray-client-server-port={free_port()}"]


def _head_env(head: bool) -> dict:
    """The head's autoscaler and dashboard metrics exporters (plain HTTP, no credential) on free loopback
    ports, not Ray's fixed 44217 and 44227."""
    return (
        {"AUTOSCALER_METRIC_PORT": str(free_port()), "DASHBOARD_METRIC_PORT": str(free_port())}
        if head
        else {}
    )


def _node_command(temp_dir: str, cpus: int, object_store_mb: int) -> list[str]:
    """`ray start` through ci/ray_node.py: with `LOOPBACK_ONLY` (`node_env`), Ray keeps 127.0.0.1."""
    cmd = [
        str(BIN / "python"),
        str(ROOT / "ci" / "ray_node.py"),
        "start",
        "--block",
        "--node-ip-address=127.0.0.1",
    ]
    cmd += [f"--num-cpus={cpus}", f"--object-store-memory={object_store_mb * 1024**2}"]
    cmd += [f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}"]
    return cmd + ["--disable-usage-stats", f"--temp-dir={temp_dir}"]


def _mlflow_command(state_dir: Path, port: int) -> list[str]:
    """MLflow's server behind the cluster's guard (ci/mlflow_server.py): runs in SQLite in the state folder,
    artifacts in the bucket, which the server writes for its clients (its artifact proxy)."""
    database = state_dir.resolve() / "mlflow.db"
    # Kept across clusters (the UI shows earlier runs too), and its owner's alone.
    os.close(os.open(database, os.O_WRONLY | os.O_CREAT, 0o600))
    database.chmod(0o600)
    server = [sys.executable, str(ROOT / "ci" / "mlflow_server.py"), str(port)]
    return [*server, f"sqlite:///{database}", f"s3://{BUCKET}/mlflow"]


def _held(state: dict) -> str | None:
    """Who holds a recorded cluster, if anyone: the live run that owns it, or, for a cluster started by
    hand (no owner), its processes while any is alive. None: whatever started it is gone."""
    owner = state.get("owner")
    if owner and is_running(owner):
        return f"the run of process {owner['pid']} ({owner.get('command', '?')})"
    if not owner and any(is_running(r) for r in state.get("processes", [])):
        return "a cluster started by hand (make cluster-up)"
    return None


def _claim(state_dir: Path, env_file: Path, held_by_caller: bool) -> dict:
    """Take the state folder for a new cluster, or raise `ClusterBusy`; return the new state."""
    import fcntl

    import psutil

    state_file = state_dir / "state.json"
    with os.fdopen(os.open(state_dir / ".lock", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a") as lock:
        os.fchmod(lock.fileno(), 0o600)  # made by an earlier version
        fcntl.flock(lock, fcntl.LOCK_EX)  # one claim at a time: the check and the new state together
        if state_file.exists():
            try:
                old = json.loads(state_file.read_text())
            except ValueError:
                old = {}
            holder = _held(old)
            if holder:
                raise ClusterBusy(
                    f"the local cluster in {state_dir} is in use by {holder}, started "
                    f"{time.strftime('%H:%M:%S', time.localtime(old.get('started', 0)))}. Wait for it to "
                    f"finish, or stop it: python -m ci.local_cluster down --state {state_dir}"
                )
            down(state_dir, env_file, quiet=True)  # left by a run that is gone: only its own processes
        me = psutil.Process()
        owner = {"pid": me.pid, "create_time": me.create_time(), "command": " ".join(me.cmdline()[:3])}
        state: dict = {"owner": owner if held_by_caller else None, "started": time.time(), "processes": []}
        _write_private(state_file, json.dumps(state, indent=2))
    return state


def _private_logs(state_dir: Path) -> Path:
    """The cluster's log folder, and it and the state folder its owner's alone (made by an earlier version,
    or under another umask)."""
    logs = state_dir / "logs"
    logs.mkdir(mode=0o700, exist_ok=True)
    for private in (state_dir, logs):
        private.chmod(0o700)
    for old_log in logs.iterdir():
        old_log.chmod(0o600)
    return logs


def _start_bucket_and_tracking(
    state_dir: Path, state: dict, save, env: dict, credentials: dict, s3_port: int
):
    """The S3 server and its bucket, then the MLflow tracking server; returns (MLflow's port, its process)."""
    import pyarrow.fs as pafs

    logs = state_dir / "logs"
    bucket_keys = {k: credentials[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    server = [sys.executable, str(ROOT / "ci" / "s3_server.py"), str(s3_port)]
    moto = _start(server, logs / "s3.log", {**kept_env(), **bucket_keys})
    state["processes"].append(_record(moto, "s3"))
    save()
    _wait_for_port(s3_port, moto, "the S3 server", logs / "s3.log")
    s3 = pafs.S3FileSystem(
        access_key=credentials["AWS_ACCESS_KEY_ID"],
        secret_key=credentials["AWS_SECRET_ACCESS_KEY"],
        endpoint_override=f"127.0.0.1:{s3_port}",
        scheme="http",
        region="us-east-1",
        allow_bucket_creation=True,
    )
    s3.create_dir(BUCKET)
    # The MLflow tracking server, with the bucket's keys (its artifact proxy writes there) and its own
    # token; HOME is a folder of the cluster's, where MLflow keeps its per-user settings.
    mlflow_port = free_port()
    (state_dir / "mlflow-home").mkdir(mode=0o700, exist_ok=True)
    mlflow_env = {
        **kept_env(),
        **bucket_keys,
        "AWS_ENDPOINT_URL": env["AWS_ENDPOINT_URL"],
        "AWS_REGION": env["AWS_REGION"],
        "HOME": str((state_dir / "mlflow-home").resolve()),
        "LLM_NOTEBOOKS_MLFLOW_SERVER_TOKEN": credentials["MLFLOW_TRACKING_TOKEN"],
    }
    mlflow = _start(_mlflow_command(state_dir, mlflow_port), logs / "mlflow.log", mlflow_env)
    state["processes"].append(_record(mlflow, "mlflow"))
    save()
    return mlflow_port, mlflow


def _start_ray_nodes(state: dict, save, env: dict, logs: Path, nodes: int, dashboard_port: int) -> None:
    """The head (GCS, and the dashboard on loopback behind the same token, which serves Ray Jobs) and
    `nodes - 1` worker nodes, as `state["node_config"]` says; returns once all are alive (at most 90 s)."""
    config = state["node_config"]
    address = config["address"]
    gcs_port = int(address.rsplit(":", 1)[1])
    for index in range(nodes):
        head = index == 0
        cmd = _node_command(state["temp_dirs"][index], config["cpus_per_node"], config["object_store_mb"])
        if head:
            cmd += ["--head", f"--port={gcs_port}", "--include-dashboard=true"]
            cmd += ["--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}"]
        else:
            cmd += [f"--address={address}"]
        name = "ray-head" if head else f"ray-node-{index}"
        proc = _start(cmd + (_head_ports() if head else []), logs / f"{name}.log", {**env, **_head_env(head)})
        state["processes"].append(_record(proc, name))
        save()
        if head:
            _wait_for_port(gcs_port, proc, "the Ray head node", logs / f"{name}.log")
    deadline = time.monotonic() + 90
    while _alive_nodes(address, env) < nodes:
        for record in state["processes"]:
            if not is_running(record):
                raise RuntimeError(f"{record['name']} exited; see {logs / (record['name'] + '.log')}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {nodes} Ray nodes alive after 90 s; logs in {logs}")
        time.sleep(1)


def up(
    state_dir: Path = ROOT / ".cluster",
    env_file: Path = ROOT / "cluster.env",
    nodes: int = 2,
    cpus_per_node: int = 2,
    object_store_mb: int = 400,
    held_by_caller: bool = True,
    node_death_s: int | None = None,
) -> dict:
    """Start the S3 server, the bucket and `nodes` Ray nodes; write `env_file`; return the driver's variables.

    `held_by_caller`: the cluster belongs to this process's run, and a later `up` in the same folder may
    stop it once this process is gone; False (`make cluster-up`): only `down` stops it. `node_death_s`:
    the head declares a silent node dead after about this many seconds (Ray's default: 30-40 s).
    """
    state_file = state_dir / "state.json"
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    state = _claim(state_dir, env_file, held_by_caller)
    logs = _private_logs(state_dir)
    _write_private(state_dir / "auth_token", secrets.token_hex(32))
    # One per node, as on separate machines: each node's log monitor then forwards only its own workers' logs.
    state["temp_dirs"] = [ray_temp_dir(f"llmnb-ray{i}-") for i in range(nodes)]
    credentials = _credentials()

    def save() -> None:
        _write_private(state_file, json.dumps(state, indent=2))

    started = time.perf_counter()
    try:
        s3_port = free_port()
        env = node_env(state_dir, s3_port, credentials, node_death_s=node_death_s)
        mlflow_port, mlflow = _start_bucket_and_tracking(state_dir, state, save, env, credentials, s3_port)
        gcs_port, dashboard_port = free_port(), free_port()
        address = f"127.0.0.1:{gcs_port}"
        # What `add_node` needs to start another node like these (the secret stays in cluster.env).
        state["node_config"] = {
            "address": address,
            "s3_port": s3_port,
            "cpus_per_node": cpus_per_node,
            "object_store_mb": object_store_mb,
            "node_death_s": node_death_s,
        }
        _start_ray_nodes(state, save, env, logs, nodes, dashboard_port)
        _wait_for_port(mlflow_port, mlflow, "the MLflow tracking server", logs / "mlflow.log", timeout=90)
    except BaseException:
        down(state_dir, env_file, quiet=True)
        raise

    driver = {
        "RAY_ADDRESS": address,
        **LOOPBACK_ONLY,  # else Ray rewrites RAY_ADDRESS to this machine's routable address, where no node is
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": env["RAY_AUTH_TOKEN_PATH"],
        "STORAGE_PATH": f"s3://{BUCKET}/{PREFIX}",
        **credentials,
        "AWS_ENDPOINT_URL": env["AWS_ENDPOINT_URL"],
        "AWS_REGION": env["AWS_REGION"],
        **SIGNED_BODIES,
        "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{mlflow_port}",
        "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{dashboard_port}",  # `ray job submit` goes here
        # The Python a Ray Job's entry point runs on these nodes (ci/submit_job.py). Not by putting the
        # virtualenv first on the nodes' PATH: its ninja (1.13) and the system's (1.11) write each other's
        # build logs unreadably, and DeepSpeed's ops were rebuilt (15-30 s) whenever the other one ran.
        "LLM_NOTEBOOKS_JOB_PYTHON": str(BIN / "python"),
        # `make job` runs a notebook in smoke mode on this cluster only (ci/submit_job.py), at its full-scale
        # values on any other RAY_API_SERVER_ADDRESS.
        "LLM_NOTEBOOKS_LOCAL_CLUSTER": f"http://127.0.0.1:{dashboard_port}",
        **no_proxy(),  # a shell's HTTP(S)_PROXY never sees the tokens sent to these loopback servers
    }
    # The secrets stay in cluster.env alone (and in the nodes' environment).
    shown = {k: v for k, v in driver.items() if k not in ("AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_TOKEN")}
    state.update(driver=shown, seconds_to_start=round(time.perf_counter() - started, 1))
    save()
    header = [
        "# Written by `make cluster-up` (ci/local_cluster.py). Source it, then run a notebook on the cluster:",
        '#   papermill notebooks/<nb>.ipynb out.ipynb -p SMOKE_TEST True -p STORAGE_PATH "$STORAGE_PATH"',
        "# MLflow's UI: open $MLFLOW_TRACKING_URI in a browser; any user name, password $MLFLOW_TRACKING_TOKEN.",
    ]
    _write_private(env_file, env_file_text(header, driver))
    return driver


def up_ray(state_dir: Path, cpus: int, object_store_mb: int = 1024) -> dict:
    """One Ray node on this machine, with token auth, and nothing else (no bucket, no tracking server):
    what `make run` starts once for all its notebooks, each of which would otherwise start and stop a Ray
    of its own (about 5.5 s of ray.init and ray.shutdown each on 2 cores). Its environment is a notebook's
    local Ray's (`LOCAL_RAY_ENV`). Returns the driver's variables; `down(state_dir, ...)` stops it."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    state = _claim(state_dir, state_dir / "cluster.env", held_by_caller=True)
    log = state_dir / "ray-head.log"
    _write_private(state_dir / "auth_token", secrets.token_hex(32))
    temp_dir = ray_temp_dir("llmnb-ray-")
    state["temp_dirs"] = [temp_dir]
    env = node_env(state_dir, s3_port=None, credentials={})
    gcs_port = free_port()
    address = f"127.0.0.1:{gcs_port}"
    cmd = _node_command(temp_dir, cpus, object_store_mb)
    cmd += ["--head", f"--port={gcs_port}", "--include-dashboard=false", *_head_ports()]
    try:
        proc = _start(cmd, log, {**env, **_head_env(True)})
        state["processes"].append(_record(proc, "ray-head"))
        _write_private(state_dir / "state.json", json.dumps(state, indent=2))
        _wait_for_port(gcs_port, proc, "the Ray head node", log)
        _wait_for_nodes(address, env, 1, proc, f"the Ray node did not come up; see {log}", poll_s=0.5)
    except BaseException:
        down(state_dir, state_dir / "cluster.env", quiet=True)
        raise
    return {
        "RAY_ADDRESS": address,
        **LOOPBACK_ONLY,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": env["RAY_AUTH_TOKEN_PATH"],
    }


def cluster_processes(state_dir: Path) -> list:
    """Every live process the cluster in `state_dir` started, and their children (raylets, agents, Ray
    workers): what the tests look at."""
    import psutil

    records = json.loads((state_dir / "state.json").read_text())["processes"]
    found = {}
    for record in records:
        try:
            root = psutil.Process(record["pid"])
            found.update({p.pid: p for p in [root, *root.children(recursive=True)]})
        except psutil.NoSuchProcess:
            pass
    return list(found.values())


def is_running(record: dict) -> bool:
    import psutil

    try:
        proc = psutil.Process(record["pid"])
        return (
            abs(proc.create_time() - record["create_time"]) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE
        )
    except psutil.NoSuchProcess:
        return False


def _stop_family(ours: list) -> tuple[dict, list]:
    """SIGTERM `ours` (last started first) and wait; SIGKILL what is left of them and every process below
    them (raylets, GCS, Ray workers: kept by id and start time). Returns ({pid: process}, those killed)."""
    import psutil

    family = {p.pid: p for p in ours}
    for p in ours:
        try:
            family.update({c.pid: c for c in p.children(recursive=True)})
        except psutil.NoSuchProcess:
            pass
    # Worker nodes first, then the head, then the bucket: `ray start --block` stops its own processes on SIGTERM.
    for proc in reversed(ours):
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(list(family.values()), timeout=5)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    _, still = psutil.wait_procs(alive, timeout=10)
    if still:
        raise RuntimeError(f"could not stop {[(p.pid, p.name()) for p in still]}")
    return family, alive


def down(
    state_dir: Path = ROOT / ".cluster", env_file: Path = ROOT / "cluster.env", quiet: bool = False
) -> list:
    """Stop what `up` recorded, and their children; return the processes that had to be killed."""
    import psutil

    state_file = state_dir / "state.json"
    if not state_file.exists():
        if not quiet:
            print(f"No cluster recorded in {state_file}: nothing to stop.")
        return []
    state = json.loads(state_file.read_text())
    family, alive = _stop_family([psutil.Process(r["pid"]) for r in state["processes"] if is_running(r)])
    for temp_dir in state.get("temp_dirs", []):
        shutil.rmtree(_private_parent(temp_dir), ignore_errors=True)
    state_file.unlink()
    (state_dir / "auth_token").unlink(missing_ok=True)
    env_file.unlink(missing_ok=True)
    if not quiet:
        print(
            f"Stopped {len(family)} processes ({len(alive)} needed SIGKILL); nothing of the cluster is left."
        )
    return alive


def status(state_dir: Path = ROOT / ".cluster") -> int:
    state_file = state_dir / "state.json"
    if not state_file.exists():
        print("No cluster is up (make cluster-up starts one).")
        return 1
    state = json.loads(state_file.read_text())
    for r in state["processes"]:
        print(f"{r['name']:>10}  pid {r['pid']:>7}  {'running' if is_running(r) else 'NOT RUNNING'}")
    print(json.dumps(state.get("driver", {}), indent=2))
    return 0 if all(is_running(r) for r in state["processes"]) else 1


def kill_node(state_dir: Path = ROOT / ".cluster") -> str:
    """Kill the last worker node the way a reclaimed instance dies: SIGKILL to its `ray start` and every
    process below it (raylet and object store, agents, workers), all at once; nothing else. Return its name."""
    import psutil

    state_file = state_dir / "state.json"
    state = json.loads(state_file.read_text())
    alive = [r for r in state["processes"] if r["name"].startswith("ray-node-") and is_running(r)]
    if not alive:
        raise RuntimeError(f"no worker node of the cluster in {state_dir} is running")
    record = alive[-1]
    root = psutil.Process(record["pid"])
    family = [root, *root.children(recursive=True)]
    for proc in family:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=10)
    return record["name"]


def add_node(state_dir: Path = ROOT / ".cluster", env_file: Path = ROOT / "cluster.env") -> str:
    """Start one more worker node that joins the same head with the same credentials; return its name once
    the head counts it alive."""
    state_file = state_dir / "state.json"
    state = json.loads(state_file.read_text())
    config = state["node_config"]
    exported = read_env_file(env_file)
    credentials = {
        k: exported[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_TOKEN")
    }
    env = node_env(state_dir, config["s3_port"], credentials, node_death_s=config.get("node_death_s"))
    numbers = [
        int(r["name"].rsplit("-", 1)[1]) for r in state["processes"] if r["name"].startswith("ray-node-")
    ]
    name = f"ray-node-{max(numbers, default=0) + 1}"
    temp_dir = ray_temp_dir(f"llmnb-ray{name.rsplit('-', 1)[1]}-")
    state["temp_dirs"].append(temp_dir)
    cmd = _node_command(temp_dir, config["cpus_per_node"], config["object_store_mb"])
    proc = _start([*cmd, f"--address={config['address']}"], state_dir / "logs" / f"{name}.log", env)
    state["processes"].append(_record(proc, name))
    _write_private(state_file, json.dumps(state, indent=2))
    expected = sum(1 for r in state["processes"] if r["name"].startswith("ray-") and is_running(r))
    failure = f"{name} did not join; see {state_dir / 'logs' / (name + '.log')}"
    _wait_for_nodes(config["address"], env, expected, proc, failure, poll_s=1)
    return name


def pause_storage(
    state_dir: Path = ROOT / ".cluster", seconds: float = 25.0, until: Callable[[], bool] | None = None
) -> float:
    """Make the bucket stop answering for `seconds`, as a storage service that stalls does: SIGSTOP to the S3
    server `up` recorded (connections are still accepted, no request is answered), then SIGCONT, also if
    this is interrupted. With `until`, it answers again as soon as `until()` is true (checked every 0.5 s).
    Returns the seconds it was paused."""
    import psutil

    state = json.loads((state_dir / "state.json").read_text())
    record = next(r for r in state["processes"] if r["name"] == "s3")
    if not is_running(record):
        raise RuntimeError(f"the S3 server of the cluster in {state_dir} is not running")
    server = psutil.Process(record["pid"])
    start = time.monotonic()
    server.suspend()
    try:
        while time.monotonic() - start < seconds and not (until and until()):
            time.sleep(min(0.5, max(0.0, seconds - (time.monotonic() - start))))
    finally:
        server.resume()
    return time.monotonic() - start


# Where clusters are recorded: `make cluster-up`, `make run CLUSTER=1`, the test session.
STATE_DIRS = (
    ROOT / ".cluster",
    ROOT / ".cluster-run",
    ROOT / ".ray-run",
    ROOT / "test-artifacts" / "cluster",
)


def idle() -> int:
    """0 if no local cluster of this project is running (`make clean` asks first: a cluster's Python lives
    in .venv); else 1, naming it."""
    running = 0
    for state_dir in STATE_DIRS:
        state_file = state_dir / "state.json"
        if state_file.exists():
            state = json.loads(state_file.read_text())
            alive = [r for r in state.get("processes", []) if is_running(r)]
            if alive:
                running += 1
                pids = ", ".join(str(r["pid"]) for r in alive)
                print(
                    f"A local cluster is running (processes {pids}, recorded in {state_dir}). Stop it first: "
                    f"python -m ci.local_cluster down --state {state_dir}",
                    file=sys.stderr,
                )
    return 1 if running else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "command", choices=["up", "down", "status", "idle", "kill-node", "add-node", "pause-storage"]
    )
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--cpus-per-node", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=25.0, help="pause-storage: how long")
    parser.add_argument("--state", type=Path, default=ROOT / ".cluster", help="the cluster's state folder")
    args = parser.parse_args()
    env_file = ROOT / "cluster.env" if args.state == ROOT / ".cluster" else args.state / "cluster.env"
    if args.command == "up":
        start = time.perf_counter()
        try:
            driver = up(args.state, env_file, args.nodes, args.cpus_per_node, held_by_caller=False)
        except ClusterBusy as exc:
            print(f"Not started: {exc}", file=sys.stderr)
            return 1
        print(
            f"Cluster up in {time.perf_counter() - start:.0f} s: {args.nodes} Ray nodes at {driver['RAY_ADDRESS']}"
        )
        print(f"bucket {driver['STORAGE_PATH']} on {driver['AWS_ENDPOINT_URL']}; variables in cluster.env:")
        print("  source cluster.env   # then run a notebook; `make cluster-down` stops everything")
        print(
            f"MLflow: {driver['MLFLOW_TRACKING_URI']} (in a browser: any user name, the password is "
            "MLFLOW_TRACKING_TOKEN in cluster.env)"
        )
        return 0
    if args.command == "idle":
        return idle()
    if args.command == "kill-node":
        print(f"Killed {kill_node(args.state)} (SIGKILL to its raylet, object store, agents and workers).")
        return 0
    if args.command == "pause-storage":
        print(f"The bucket stalled for {pause_storage(args.state, args.seconds):.0f} s (S3 server paused).")
        return 0
    if args.command == "add-node":
        print(f"Started {add_node(args.state, env_file)}; it joined the head.")
        return 0
    if args.command == "down":
        down(args.state, env_file)
        return 0
    return status(args.state)


if __name__ == "__main__":
    sys.exit(main())
