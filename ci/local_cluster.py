"""A cluster-shaped Ray on one machine: two Ray nodes and an S3 bucket, on loopback only.

    python ci/local_cluster.py up      # `make cluster-up`: start it, write cluster.env
    python ci/local_cluster.py down    # `make cluster-down`: stop exactly what `up` started
    python ci/local_cluster.py status

What `up` starts, each as a child process whose id it records (in .cluster/state.json):

- an S3 API server (moto's standalone server, as in Ray's own storage tests) with one bucket;
- a Ray head node and a second Ray node (`ray start --block`, two raylets with an object store
  each), with Ray's token authentication on (the token is in .cluster/auth_token, never in
  ~/.ray) and the bucket's credentials in each node's environment, as instance credentials are
  on a real cluster.

`cluster.env` holds what a driver needs, set the way a user sets them for an S3-compatible bucket:
`RAY_ADDRESS`, the token variables, `STORAGE_PATH=s3://...`, `AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL`, `AWS_REGION`. `source cluster.env`, then run a notebook.

`down` signals the processes `up` recorded (checking each id's start time, so a reused id is never
hit), waits, and kills only what is left of them and their children. It never runs `ray stop`,
which stops every Ray process on the machine, a user's own cluster included.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv's `ray` and `moto_server`
BUCKET = "llm-notebooks"
PREFIX = "runs"
# moto accepts any credentials and checks that requests are signed; a real bucket's keys go here.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "llm-notebooks-key", "AWS_SECRET_ACCESS_KEY": "llm-notebooks-secret"}


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
    with open(log, "ab") as out:
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


def node_env(state_dir: Path, s3_port: int, base: dict | None = None) -> dict:
    """The environment of every Ray node (and of a driver): token auth, bucket credentials, quiet Ray."""
    sys.path.insert(0, str(ROOT))
    from helpers.cluster import LOCAL_RAY_ENV, RAY_ENV

    env = dict(os.environ if base is None else base)
    env.update(RAY_ENV)
    env.update(LOCAL_RAY_ENV)  # a laptop's cluster: no preemption watcher, one parquet footer reader
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(state_dir / "auth_token"),
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{s3_port}",
        AWS_REGION="us-east-1",
        **CREDENTIALS,
        # With usage stats disabled, `ray start` still sends one "disabled" report; keep it on loopback.
        RAY_USAGE_STATS_ENABLED="0",
        RAY_USAGE_STATS_REPORT_URL="http://127.0.0.1:9/",
    )
    env.pop("RAY_AUTH_TOKEN", None)
    env.pop("RAY_ADDRESS", None)
    return env


def up(
    state_dir: Path = ROOT / ".cluster",
    env_file: Path = ROOT / "cluster.env",
    nodes: int = 2,
    cpus_per_node: int = 2,
    object_store_mb: int = 400,
) -> dict:
    """Start the S3 server, the bucket and `nodes` Ray nodes; write `env_file`; return the driver's variables."""
    state_file = state_dir / "state.json"
    if state_file.exists():
        raise RuntimeError(f"a cluster is already up ({state_file}); stop it first: make cluster-down")
    state_dir.mkdir(parents=True, exist_ok=True)
    logs = state_dir / "logs"
    logs.mkdir(exist_ok=True)
    (state_dir / "auth_token").write_text(secrets.token_hex(32))
    (state_dir / "auth_token").chmod(0o600)
    # Ray's sockets live under its temp dir and Unix socket paths are short: keep it under /tmp.
    # One per node, as on separate machines: each node's log monitor then forwards only its own workers' logs.
    temp_dirs = [tempfile.mkdtemp(prefix=f"llmnb-ray{i}-") for i in range(nodes)]
    state: dict = {"processes": [], "temp_dirs": temp_dirs}

    def save() -> None:
        state_file.write_text(json.dumps(state, indent=2))

    started = time.perf_counter()
    try:
        s3_port = free_port()
        env = node_env(state_dir, s3_port)
        moto = _start([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(s3_port)], logs / "s3.log", env)
        state["processes"].append(_record(moto, "s3"))
        save()
        _wait_for_port(s3_port, moto, "the S3 server", logs / "s3.log")
        import pyarrow.fs as pafs

        s3 = pafs.S3FileSystem(
            access_key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            secret_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            endpoint_override=f"127.0.0.1:{s3_port}",
            scheme="http",
            region="us-east-1",
            allow_bucket_creation=True,
        )
        s3.create_dir(BUCKET)

        gcs_port = free_port()
        address = f"127.0.0.1:{gcs_port}"
        for index in range(nodes):
            head = index == 0
            cmd = [str(BIN / "ray"), "start", "--block", "--node-ip-address=127.0.0.1"]
            cmd += [f"--num-cpus={cpus_per_node}", f"--object-store-memory={object_store_mb * 1024**2}"]
            cmd += [f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}"]
            cmd += ["--disable-usage-stats", f"--temp-dir={temp_dirs[index]}"]
            if head:
                cmd += ["--head", f"--port={gcs_port}", "--include-dashboard=false"]
            else:
                cmd += [f"--address={address}"]
            name = "ray-head" if head else f"ray-node-{index}"
            proc = _start(cmd, logs / f"{name}.log", env)
            state["processes"].append(_record(proc, name))
            save()
            if head:
                _wait_for_port(gcs_port, proc, "the Ray head node", logs / f"{name}.log")
        deadline = time.monotonic() + 90
        while _alive_nodes(address, env) < nodes:
            for record in state["processes"]:
                if not _running(record):
                    raise RuntimeError(f"{record['name']} exited; see {logs / (record['name'] + '.log')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {nodes} Ray nodes alive after 90 s; logs in {logs}")
            time.sleep(1)
    except BaseException:
        down(state_dir, env_file, quiet=True)
        raise

    driver = {
        "RAY_ADDRESS": address,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": env["RAY_AUTH_TOKEN_PATH"],
        "STORAGE_PATH": f"s3://{BUCKET}/{PREFIX}",
        **CREDENTIALS,
        "AWS_ENDPOINT_URL": env["AWS_ENDPOINT_URL"],
        "AWS_REGION": env["AWS_REGION"],
    }
    state.update(driver=driver, seconds_to_start=round(time.perf_counter() - started, 1))
    save()
    lines = [
        "# Written by `make cluster-up` (ci/local_cluster.py). Source it, then run a notebook on the cluster:",
        '#   papermill notebooks/<nb>.ipynb out.ipynb -p SMOKE_TEST True -p STORAGE_PATH "$STORAGE_PATH"',
    ]
    lines += [f"export {k}={v}" for k, v in driver.items()]
    env_file.write_text("\n".join(lines) + "\n")
    return driver


def _running(record: dict) -> bool:
    import psutil

    try:
        proc = psutil.Process(record["pid"])
        return (
            abs(proc.create_time() - record["create_time"]) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE
        )
    except psutil.NoSuchProcess:
        return False


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
    ours = [psutil.Process(r["pid"]) for r in state["processes"] if _running(r)]
    # Every process below ours (raylets, GCS, Ray workers): kept by id and start time, to check at the end.
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
    for temp_dir in state.get("temp_dirs", []):
        shutil.rmtree(temp_dir, ignore_errors=True)
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
        print(f"{r['name']:>10}  pid {r['pid']:>7}  {'running' if _running(r) else 'NOT RUNNING'}")
    print(json.dumps({k: v for k, v in state["driver"].items() if "SECRET" not in k}, indent=2))
    return 0 if all(_running(r) for r in state["processes"]) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--cpus-per-node", type=int, default=2)
    args = parser.parse_args()
    if args.command == "up":
        start = time.perf_counter()
        driver = up(nodes=args.nodes, cpus_per_node=args.cpus_per_node)
        print(
            f"Cluster up in {time.perf_counter() - start:.0f} s: {args.nodes} Ray nodes at {driver['RAY_ADDRESS']}"
        )
        print(f"bucket {driver['STORAGE_PATH']} on {driver['AWS_ENDPOINT_URL']}; variables in cluster.env:")
        print("  source cluster.env   # then run a notebook; `make cluster-down` stops everything")
        return 0
    if args.command == "down":
        down()
        return 0
    return status()


if __name__ == "__main__":
    sys.exit(main())
