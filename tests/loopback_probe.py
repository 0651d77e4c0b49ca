"""Start `make cluster-up`'s cluster (`cluster`), or the operating_a_run notebook's own nodes (`laptop`:
`harness.drills.LaptopCluster`), on a machine with a routable address, list what it listens on, attach a
driver the way the notebooks do and one without the token, stop it; print the findings as JSON.

Run by tests/test_cluster.py inside a network namespace of its own that has a routable address (192.0.2.77,
TEST-NET-1, on its loopback device, with a default route), as a laptop or a cluster node has one: Ray
rewrites 127.0.0.1 to such an address, which `make test`'s namespace (loopback only) never has.

    PYTHONPATH=. python tests/loopback_probe.py cluster STATE_DIR
    PYTHONPATH=. python tests/loopback_probe.py laptop
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ci import local_cluster  # the repository root on PYTHONPATH (the test passes it)


def _listening(processes: list) -> list[dict]:
    """Every listening TCP socket of `processes`, with the process name."""
    import psutil

    procs = {p.pid: p for p in processes}
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
        listening = _listening(local_cluster.cluster_processes(state_dir))
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


def laptop() -> None:
    import psutil
    import ray

    from harness.drills import LaptopCluster

    cluster = LaptopCluster(nodes=2, cpus=1)
    try:
        listening = _listening(psutil.Process().children(recursive=True))
        ray.init(address=cluster.address)  # as the notebook's Set up does, after it
        nodes = len([n for n in ray.nodes() if n["Alive"]])
        ray.shutdown()
        tokenless = {k: v for k, v in local_cluster.kept_env().items() if not k.startswith("RAY_AUTH")}
        stranger = subprocess.run(
            [sys.executable, "-c", "import ray; ray.init()"],
            # on loopback as the nodes are (else it looks for them at the routable address), and no token
            env={
                **tokenless,
                **local_cluster.LOOPBACK_ONLY,
                "RAY_ADDRESS": cluster.address,
                "HOME": str(Path(cluster.temp_dir) / "elsewhere"),
            },
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        cluster.shutdown()
    print(
        json.dumps({"listening": listening, "driver_nodes": [str(nodes)], "stranger_rc": stranger.returncode})
    )


if __name__ == "__main__":
    if sys.argv[1] == "laptop":
        laptop()
    else:
        main(Path(sys.argv[2]))
