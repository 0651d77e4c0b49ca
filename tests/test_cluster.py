"""The test cluster itself (ci/local_cluster.py, `make cluster-up`): what the notebook runs rely on.

Token authentication is on and keeps out a client without the token; `helpers.start_ray` ships the
`helpers` package and the driver's Hugging Face settings to workers on every node.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from notebook_runs import ROOT, notebook_env


def _driver(code: str, env: dict, timeout: int = 120) -> subprocess.CompletedProcess:
    # From notebooks/, like the notebooks' kernels. (Ray also puts the driver's own folder on its workers'
    # sys.path, ahead of the job's modules: a driver run from the repository root would import the
    # project's helpers/ on workers of this machine, which a real cluster's other nodes do not have.)
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=str(ROOT / "notebooks"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_two_nodes_and_a_client_without_the_token_is_refused(tmp_path, ray_cluster):
    env = notebook_env(ray_cluster)
    nodes = _driver(
        "import ray; ray.init(logging_level='ERROR');print(sum(1 for n in ray.nodes() if n['Alive']))",
        env,
    )
    assert nodes.returncode == 0, nodes.stderr[-2000:]
    assert nodes.stdout.strip().splitlines()[-1] == "2"  # two raylets, each with its own object store

    # Without a token file, ray.init refuses before it even connects.
    no_token = _driver("import ray; ray.init()", {**env, "RAY_AUTH_TOKEN_PATH": str(tmp_path / "none")})
    assert no_token.returncode != 0 and "AuthenticationError" in no_token.stderr, no_token.stderr[-2000:]
    # With a wrong token, the cluster's GCS refuses every request.
    start = time.perf_counter()
    wrong = _driver(
        "from ray._raylet import GcsClient; import os;"
        "GcsClient(address=os.environ['RAY_ADDRESS']).get_all_node_info(timeout=5)",
        {**env, "RAY_AUTH_TOKEN": "not-the-token", "RAY_AUTH_TOKEN_PATH": ""},
    )
    assert wrong.returncode != 0 and "InvalidAuthToken" in wrong.stderr + wrong.stdout, wrong.stderr[-2000:]
    assert time.perf_counter() - start < 60


def test_workers_get_the_shipped_helpers_and_the_drivers_hub_settings(ray_cluster):
    """On each node, a worker imports `helpers` from the copy uploaded with the job, and sees HF_*."""
    hub = {"HF_TOKEN": "hf_test_token", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": "/tmp/hf-home-test"}
    code = """
import json, ray, helpers
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
helpers.start_ray()

@ray.remote(num_cpus=0)
def probe():
    import os, helpers
    return {"node": ray.get_runtime_context().get_node_id(), "helpers": helpers.__file__,
            "env": {k: os.environ.get(k) for k in ("HF_TOKEN", "HF_ENDPOINT", "HF_HOME")}}

nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
print(json.dumps(ray.get([probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote() for n in nodes])))
"""
    # The nodes were started without these variables: only the driver has them.
    assert not {k for k in hub if k in ray_cluster}
    proc = _driver(code, {**notebook_env(ray_cluster), **hub})
    assert proc.returncode == 0, proc.stderr[-3000:]
    workers = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len({w["node"] for w in workers}) == 2
    editable = str(ROOT / "helpers")
    for worker in workers:
        assert worker["env"] == hub, worker
        # The job's copy (runtime_resources/py_modules_files/...), not the project's editable install.
        assert "py_modules_files" in worker["helpers"] and not worker["helpers"].startswith(editable), worker
    assert os.environ.get("HF_TOKEN") != "hf_test_token"
