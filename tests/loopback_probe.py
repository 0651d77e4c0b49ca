"""Start `make cluster-up`'s cluster on a machine with a routable address, list what it listens on, attach a
driver the way `source cluster.env` does, stop it; print the findings as JSON.

Run by tests/test_cluster.py inside a network namespace of its own that has a routable address (192.0.2.77,
TEST-NET-1, on its loopback device, with a default route), as a laptop or a cluster node has one: Ray
rewrites 127.0.0.1 to such an address, which `make test`'s namespace (loopback only) never has.

    PYTHONPATH=. python tests/loopback_probe.py STATE_DIR
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ci import local_cluster  # the repository root on PYTHONPATH (the test passes it)


def _listening(state_dir: Path) -> list[dict]:
    """Every listening TCP socket of the cluster's processes and their children, with the process name."""
    import psutil

    procs = {p.pid: p for p in local_cluster.cluster_processes(state_dir)}
    found = []
    for conn in psutil.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in procs:
            try:
                name = procs[conn.pid].name()
            except psutil.Error:
                name = "?"
            found.append({"ip": conn.laddr.ip, "port": conn.laddr.port, "process": name})
    return found


def main(state_dir: Path) -> None:
    env_file = state_dir / "cluster.env"
    driver = local_cluster.up(state_dir, env_file, nodes=2, cpus_per_node=1, object_store_mb=100)
    try:
        listening = _listening(state_dir)
        attach = subprocess.run(
            [
                sys.executable,
                "-c",
                "import ray; ray.init(); print(len([n for n in ray.nodes() if n['Alive']]))",
            ],
            env={**local_cluster.kept_env(), **driver},
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        local_cluster.down(state_dir, env_file, quiet=True)
    print(
        json.dumps(
            {
                "listening": listening,
                "driver_nodes": attach.stdout.strip().splitlines()[-1:] or [""],
                "driver_error": attach.stderr[-2000:] if attach.returncode else "",
            }
        )
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
