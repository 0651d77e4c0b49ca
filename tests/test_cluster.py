"""The test cluster itself (ci/local_cluster.py, `make cluster-up`): what the notebook runs rely on.

Token authentication is on and keeps out a client without the token; `helpers.ray_init_args` ships the
`helpers` package and the driver's Hugging Face settings to workers on every node, the Hub token by a path
that no log or job table shows. The cluster keeps its secrets in owner-only files, its S3 server answers
no web page, a second run cannot take it over, and `make clean` touches nothing outside the project.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from notebook_runs import (
    CANARY_HF_TOKEN,
    CANARY_SHELL_SECRET,
    CLUSTER_DIR,
    ROOT,
    filesystem,
    notebook_env,
    secret_leaks,
)


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
    """On each node, a worker imports `helpers` and `harness` from the copies uploaded with the job, and sees
    HF_*."""
    hub = {"HF_TOKEN": "hf_test_token", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": "/tmp/hf-home-test"}
    code = """
import json, ray, helpers, harness.cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
harness.cluster.start_ray()

@ray.remote(num_cpus=0)
def probe():
    import os, helpers, harness
    return {"node": ray.get_runtime_context().get_node_id(), "helpers": helpers.__file__,
            "harness": harness.__file__,
            "env": {k: os.environ.get(k) for k in ("HF_TOKEN", "HF_ENDPOINT", "HF_HOME")},
            "shell": os.environ.get("GITHUB_TOKEN")}

nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
print(json.dumps(ray.get([probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote() for n in nodes])))
"""
    # The nodes were started without these variables: only the driver has them.
    assert not {k for k in hub if k in ray_cluster}
    code += """
from ray._private.state import state
jobs = state._connect_and_get_accessor().get_job_table(
    skip_submission_job_info_field=False, skip_is_running_tasks_field=True
)  # each: the JobTableData protobuf, the job's runtime environment included
import os  # the values from the environment: this code, the job's entrypoint, is in the table too
print(json.dumps({k: any(os.environ[v].encode() in job for job in jobs) for k, v in (("token", "HF_TOKEN"), ("endpoint", "HF_ENDPOINT"))}))
"""
    proc = _driver(code, {**notebook_env(ray_cluster), **hub})
    assert proc.returncode == 0, proc.stderr[-3000:]
    workers = json.loads(proc.stdout.strip().splitlines()[-2])
    assert len({w["node"] for w in workers}) == 2
    for worker in workers:
        assert worker["env"] == hub, worker
        assert worker["shell"] is None, worker  # the driver's shell credential (a canary) stays there
        # The job's copy (runtime_resources/py_modules_files/...), not the project's editable install.
        for package in ("helpers", "harness"):
            assert "py_modules_files" in worker[package] and not worker[package].startswith(str(ROOT)), worker
    assert os.environ.get("HF_TOKEN") != "hf_test_token"
    # Every worker had the token, and yet it is in no file of either node (Ray logs a job's runtime
    # environment, env_vars included, in runtime_env_agent.log) and not in the job table that the
    # dashboard and `ray list jobs --detail` show: it travelled in the job's worker setup hook.
    # (The job table does hold the job's environment variables: HF_ENDPOINT is there.)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"token": False, "endpoint": True}
    assert secret_leaks({"HF_TOKEN": "hf_test_token"}) == []


def test_secret_bearing_files_are_the_owners_alone(ray_cluster, tmp_path):
    from ci import local_cluster

    for name in ("cluster.env", "state.json", "auth_token", "mlflow.db", ".lock"):
        assert (CLUSTER_DIR / name).stat().st_mode & 0o777 == 0o600, name
    # The state folder, its logs and MLflow's home are its owner's alone, and so is every log file.
    for folder in (CLUSTER_DIR, CLUSTER_DIR / "logs", CLUSTER_DIR / "mlflow-home"):
        assert folder.stat().st_mode & 0o777 == 0o700, folder
    logs = list((CLUSTER_DIR / "logs").iterdir())
    assert logs and all(log.stat().st_mode & 0o777 == 0o600 for log in logs), [
        oct(f.stat().st_mode) for f in logs
    ]
    # The bucket's secret is in cluster.env only, not in the state file that `status` reads.
    assert ray_cluster["AWS_SECRET_ACCESS_KEY"] not in (CLUSTER_DIR / "state.json").read_text()
    # An older file of the same name, readable by all, is replaced by an owner-only one.
    old = tmp_path / "cluster.env"
    old.write_text("old")
    old.chmod(0o644)
    local_cluster._write_private(old, "new")
    assert old.read_text() == "new" and old.stat().st_mode & 0o777 == 0o600


def test_the_s3_server_answers_no_web_page(ray_cluster):
    import pyarrow.fs as pafs

    endpoint = ray_cluster["AWS_ENDPOINT_URL"]
    port = endpoint.rsplit(":", 1)[1]

    def status(method: str, path: str, headers: dict) -> tuple[int, dict]:
        code, answer_headers, _ = _http(endpoint + path, method, headers)
        return code, answer_headers

    # A page's preflight for a DELETE: refused, and no CORS header would let the page read an answer.
    code, headers = status(
        "OPTIONS",
        "/llm-notebooks",
        {"Origin": "http://evil.example", "Access-Control-Request-Method": "DELETE"},
    )
    assert code == 403 and not any(h.lower().startswith("access-control") for h in headers), headers
    # moto's reset endpoint (a form a page can post without a preflight), and a rebound host name.
    assert status("POST", "/moto-api/reset", {})[0] == 403
    assert status("GET", "/llm-notebooks", {"Host": f"evil.example:{port}"})[0] == 403
    # The bucket is still there, and an S3 client still reads it.
    fs, _ = filesystem(ray_cluster["STORAGE_PATH"], ray_cluster)
    assert fs.get_file_info("llm-notebooks").type == pafs.FileType.Directory


def test_a_second_run_is_refused_and_the_first_goes_on(ray_cluster):
    # This session holds the test cluster; another run (here a second process) that starts one in the same
    # folder is refused, naming the holder, instead of stopping this one's nodes and bucket.
    code = (
        "from ci import local_cluster;"
        f"local_cluster.up(local_cluster.Path({str(CLUSTER_DIR)!r}), local_cluster.Path({str(CLUSTER_DIR / 'cluster.env')!r}))"
    )
    second = subprocess.run(
        [sys.executable, "-c", code], cwd=str(ROOT), capture_output=True, text=True, timeout=60
    )
    assert second.returncode != 0 and "ClusterBusy" in second.stderr, second.stderr[-2000:]
    assert f"in use by the run of process {os.getpid()}" in second.stderr
    nodes = _driver(
        "import ray; ray.init(logging_level='ERROR');print(sum(1 for n in ray.nodes() if n['Alive']))",
        notebook_env(ray_cluster),
    )
    assert nodes.stdout.strip().splitlines()[-1] == "2", nodes.stderr[-2000:]


def test_make_clean_touches_only_the_project_and_waits_for_the_cluster(ray_cluster, tmp_path):
    # From another folder (here a fresh one), every path `make clean` would delete is the project's.
    dry = subprocess.run(
        ["make", "-n", "-f", str(ROOT / "Makefile"), "clean"], cwd=tmp_path, capture_output=True, text=True
    )
    removes = [line for line in dry.stdout.splitlines() if line.startswith("rm ")]
    assert len(removes) == 1, dry.stdout
    targets = [t.strip('"') for t in removes[0].split()[2:]]
    assert targets and all(t.startswith(str(ROOT) + "/") for t in targets), targets
    # While this session's cluster runs from .venv, `make clean` stops at its first line, naming it.
    idle = subprocess.run(
        [sys.executable, str(ROOT / "ci" / "local_cluster.py"), "idle"], capture_output=True, text=True
    )
    assert idle.returncode == 1 and str(CLUSTER_DIR) in idle.stderr, idle.stderr


def _stalls_when_moving_data(storage, seconds: float, stalls: list) -> None:
    """The test cluster's bucket stops answering for `seconds` (`make cluster-pause-storage`) as `storage`
    (a DCP writer or reader) starts on its data files: in the middle of a checkpoint's write or read, after
    DCP has planned it and read the index."""
    from ci import local_cluster

    method = "write_data" if hasattr(storage, "write_data") else "read_data"
    move_data = getattr(storage, method)

    def stalled(*args, **kwargs):
        pause = threading.Thread(target=local_cluster.pause_storage, args=(CLUSTER_DIR, seconds), daemon=True)
        pause.start()
        stalls.append(pause)
        time.sleep(0.2)
        return move_data(*args, **kwargs)

    setattr(storage, method, stalled)


def test_a_checkpoint_write_or_read_outlasts_a_stalled_bucket_or_fails_cleanly(ray_cluster):
    """harness.storage.dcp_writer and dcp_reader (the Llama notebook's sharded checkpoints) against the S3
    server paused (SIGSTOP): each try of a file's write or of a range's read has a deadline; a stall shorter
    than the tries' budget costs only time, and the checkpoint loads back equal; a longer one fails the save
    with `StorageStalled`, and the folder never gets DCP's index, so nothing can mistake it for a
    checkpoint."""
    import torch
    import torch.distributed.checkpoint as dcp

    import harness.storage

    fs, root = filesystem(ray_cluster["STORAGE_PATH"], ray_cluster)
    state = {"w": torch.randn(1024, 2048), "b": torch.arange(1000.0)}  # 8 MB: one file
    quick = {"stall_s": 1.0, "min_rate": 1e12}  # each try: 1 s (the notebook's: 60 s + size at 10 MB/s)

    pauses: list = []
    writer = harness.storage.dcp_writer(fs, f"{root}/stall-test/outlasted", tries=4, **quick)
    _stalls_when_moving_data(writer, 3.0, pauses)
    start = time.monotonic()
    dcp.save(state, storage_writer=writer)  # one process, no process group
    took = time.monotonic() - start
    pauses[0].join()
    # Try 1 gave up after 1 s, and after a backoff of 1 s try 2 (and, if it too ran out of time, try 3 after
    # 2 s more) wrote the file once the bucket answered again.
    assert [s["try"] for s in writer.stalls] in ([1], [1, 2]), writer.stalls
    assert all(s["problem"] == "not done in 1 s" for s in writer.stalls), writer.stalls
    assert 2.8 < took < 15, took
    # The same stall while the checkpoint is read back: the ranged read given up after 1 s is read again.
    loaded = {"w": torch.zeros(1024, 2048), "b": torch.zeros(1000)}
    reader = harness.storage.dcp_reader(fs, f"{root}/stall-test/outlasted", tries=4, **quick)
    _stalls_when_moving_data(reader, 3.0, pauses)
    dcp.load(loaded, storage_reader=reader)
    pauses[1].join()
    assert reader.stalls and all(s["problem"] == "not done in 1 s" for s in reader.stalls), reader.stalls
    assert all(torch.equal(loaded[k], state[k]) for k in state)

    writer = harness.storage.dcp_writer(fs, f"{root}/stall-test/failed", tries=2, **quick)
    _stalls_when_moving_data(writer, 5.0, pauses)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as failed:  # DCP reports each rank's failure
        dcp.save(state, storage_writer=writer)
    assert "StorageStalled" in str(failed.value) and "not written in 2 tries" in str(failed.value)
    pauses[2].join()
    time.sleep(1.0)  # the given-up tries' threads, answered at last, must not complete the checkpoint
    import pyarrow.fs as pafs

    names = [
        i.base_name
        for i in fs.get_file_info(pafs.FileSelector(f"{root}/stall-test/failed", allow_not_found=True))
    ]
    assert ".metadata" not in names, names


def _cluster_processes() -> list:
    """Every live process the test cluster started, and their children (raylets, agents, Ray workers)."""
    from ci.local_cluster import cluster_processes

    return cluster_processes(CLUSTER_DIR)


def test_no_cluster_process_gets_the_shells_credentials(ray_cluster):
    # The session's shell holds a GITHUB_TOKEN and an HF_TOKEN (canaries, set before the cluster started);
    # the cluster's processes get an allowlist of the caller's variables, and their own credentials.
    import psutil

    processes = _cluster_processes()
    names = {p.info["name"] for p in psutil.process_iter(["name"]) if p.pid in {q.pid for q in processes}}
    assert {"raylet", "gcs_server"} <= names, names
    read = 0
    for proc in processes:
        try:
            environ = proc.environ()
        except psutil.Error:  # gone meanwhile
            continue
        read += 1
        assert CANARY_SHELL_SECRET not in environ.values(), (proc.pid, proc.name())
        assert CANARY_HF_TOKEN not in environ.values(), (proc.pid, proc.name())
    assert read >= 8, read  # two nodes' raylets, GCS, agents, the S3 and MLflow servers


def _http(url: str, method: str = "GET", headers: dict | None = None, data: bytes | None = None):
    """(status, headers, body) of one request, straight to loopback (not through the tests' tripwire proxy)."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, method=method, headers=headers or {}, data=data)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=10) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, error.read()


def test_the_s3_server_takes_only_requests_signed_with_the_buckets_secret(ray_cluster):
    import time

    import boto3
    import botocore.exceptions

    endpoint = ray_cluster["AWS_ENDPOINT_URL"]
    bucket = "llm-notebooks"

    def client(key: str, secret: str):
        return boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=key,
            aws_secret_access_key=secret,
            region_name="us-east-1",
        )

    good = client(ray_cluster["AWS_ACCESS_KEY_ID"], ray_cluster["AWS_SECRET_ACCESS_KEY"])
    good.put_object(Bucket=bucket, Key="probe/kept.bin", Body=b"0123456789")
    # A wrong secret, and a key the server does not know: refused by boto3's own signed requests.
    for key, secret in ((ray_cluster["AWS_ACCESS_KEY_ID"], "wrong"), ("attacker", "anything")):
        with pytest.raises(botocore.exceptions.ClientError) as refused:
            client(key, secret).list_objects_v2(Bucket=bucket)
        assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    # A forged signature (the right key, signature 00...), then unsigned requests: a PUT, a listing, a
    # ranged GET (answered by the server itself, not moto) and a DELETE.
    now = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    forged = {
        "Authorization": f"AWS4-HMAC-SHA256 Credential={ray_cluster['AWS_ACCESS_KEY_ID']}/{now[:8]}/us-east-1/s3/"
        f"aws4_request, SignedHeaders=host;x-amz-content-sha256;x-amz-date, Signature={'0' * 64}",
        "x-amz-date": now,
        "x-amz-content-sha256": "UNSIGNED-PAYLOAD",
    }
    assert _http(f"{endpoint}/{bucket}/probe/kept.bin", "DELETE", forged)[0] == 403
    assert _http(f"{endpoint}/{bucket}/probe/new.bin", "PUT", data=b"x")[0] == 403
    assert _http(f"{endpoint}/{bucket}?list-type=2")[0] == 403
    assert _http(f"{endpoint}/{bucket}/probe/kept.bin", headers={"Range": "bytes=0-3"})[0] == 403
    assert _http(f"{endpoint}/{bucket}/probe/kept.bin", "DELETE")[0] == 403
    # Nothing changed; the right keys still read, a range too.
    ranged = good.get_object(Bucket=bucket, Key="probe/kept.bin", Range="bytes=2-5")["Body"].read()
    assert ranged == b"2345"
    assert [o["Key"] for o in good.list_objects_v2(Bucket=bucket, Prefix="probe/")["Contents"]] == [
        "probe/kept.bin"
    ]
    good.delete_object(Bucket=bucket, Key="probe/kept.bin")


def test_the_s3_server_checks_what_the_signature_covers(ray_cluster):
    # A signature is checked against the body and every header that changes what a request does: a captured
    # signed PUT replayed with another body, a copy source or a range added after signing, an unsigned
    # payload; a key with an escape in it is read once-decoded, and a backwards range is no range.
    import boto3
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    endpoint, bucket = ray_cluster["AWS_ENDPOINT_URL"], "llm-notebooks"
    credentials = Credentials(ray_cluster["AWS_ACCESS_KEY_ID"], ray_cluster["AWS_SECRET_ACCESS_KEY"])

    class UnsignedPayload(S3SigV4Auth):
        def payload(self, request):
            return "UNSIGNED-PAYLOAD"

    class StreamedPayload(S3SigV4Auth):  # what pyarrow's SDK signs by default
        def payload(self, request):
            return "STREAMING-UNSIGNED-PAYLOAD-TRAILER"

    def signed(
        method: str, key: str, body: bytes = b"", signed_payload: bool = True, typed: bool = True
    ) -> dict:
        # Typed: the Content-Type signed (urllib adds one to a request with a body where none is given).
        headers = {"Content-Type": "application/octet-stream"} if typed and body else {}
        request = AWSRequest(method=method, url=f"{endpoint}/{bucket}/{key}", data=body, headers=headers)
        (S3SigV4Auth if signed_payload else UnsignedPayload)(credentials, "s3", "us-east-1").add_auth(request)
        return dict(request.headers)

    put = signed("PUT", "probe/replayed.bin", b"good")
    assert _http(f"{endpoint}/{bucket}/probe/replayed.bin", "PUT", put, b"evil")[0] == 403
    assert _http(f"{endpoint}/{bucket}/probe/replayed.bin", "PUT", put, b"good")[0] == 200
    copy = {**signed("PUT", "probe/copied.bin"), "x-amz-copy-source": f"/{bucket}/probe/replayed.bin"}
    assert _http(f"{endpoint}/{bucket}/probe/copied.bin", "PUT", copy, b"")[0] == 403
    ranged = {**signed("GET", "probe/replayed.bin"), "Range": "bytes=0-1"}
    assert _http(f"{endpoint}/{bucket}/probe/replayed.bin", "GET", ranged)[0] == 403
    # What a later GET serves, or whether this one answers: a PUT signed without a Content-Type, replayed as a
    # web page (sent as it is: urllib would add a type of its own); a condition added to a signed GET.
    import http.client
    from urllib.parse import urlparse

    untyped = signed("PUT", "probe/page.bin", b"<script>", typed=False)
    address = urlparse(endpoint)
    for extra in ({}, {"Content-Type": "text/html", "Content-Disposition": "inline"}):
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=10)
        connection.request("PUT", f"/{bucket}/probe/page.bin", b"<script>", {**untyped, **extra})
        status = connection.getresponse().status
        connection.close()
        assert status == (403 if extra else 200), (extra, status)
    since = {**signed("GET", "probe/replayed.bin"), "If-Modified-Since": "Wed, 01 Jan 2020 00:00:00 GMT"}
    assert _http(f"{endpoint}/{bucket}/probe/replayed.bin", "GET", since)[0] == 403
    unsigned_body = signed("PUT", "probe/unsigned.bin", b"x", signed_payload=False)
    assert unsigned_body["X-Amz-Content-SHA256"] == "UNSIGNED-PAYLOAD"
    assert _http(f"{endpoint}/{bucket}/probe/unsigned.bin", "PUT", unsigned_body, b"x")[0] == 403
    # A streamed body's signature covers no byte of it: captured, it took any body for 15 minutes.
    request = AWSRequest(
        method="PUT",
        url=f"{endpoint}/{bucket}/probe/streamed.bin",
        data=b"any",
        headers={"Content-Type": "application/octet-stream"},
    )
    StreamedPayload(credentials, "s3", "us-east-1").add_auth(request)
    assert request.headers["X-Amz-Content-SHA256"] == "STREAMING-UNSIGNED-PAYLOAD-TRAILER"
    assert _http(f"{endpoint}/{bucket}/probe/streamed.bin", "PUT", dict(request.headers), b"any")[0] == 403
    good = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=credentials.access_key,
        aws_secret_access_key=credentials.secret_key,
        region_name="us-east-1",
    )
    good.put_object(Bucket=bucket, Key="probe/x%41", Body=b"percent")
    good.put_object(Bucket=bucket, Key="probe/xA", Body=b"letter")
    assert good.get_object(Bucket=bucket, Key="probe/x%41", Range="bytes=0-2")["Body"].read() == b"per"
    backwards = good.get_object(Bucket=bucket, Key="probe/xA", Range="bytes=5-2")
    assert backwards["ResponseMetadata"]["HTTPStatusCode"] != 206, backwards["ResponseMetadata"]
    for key in ("probe/x%41", "probe/xA", "probe/replayed.bin"):
        good.delete_object(Bucket=bucket, Key=key)


def test_the_tracking_server_serves_only_the_clusters_credential_and_no_assistant(ray_cluster):
    import base64

    uri = ray_cluster["MLFLOW_TRACKING_URI"]
    port = uri.rsplit(":", 1)[1]
    token = ray_cluster["MLFLOW_TRACKING_TOKEN"]
    bearer = {"Authorization": f"Bearer {token}"}
    search = f"{uri}/api/2.0/mlflow/experiments/search?max_results=5"
    # The cluster's credential: as MLflow's client sends it, and as a browser does (any user, the token).
    assert _http(search, headers=bearer)[0] == 200
    browser = {"Authorization": "Basic " + base64.b64encode(f"me:{token}".encode()).decode()}
    status, _, page = _http(f"{uri}/", headers=browser)
    assert status == 200 and b"<html" in page.lower()
    # No credential, or a wrong one: 401, and the browser is asked for it.
    status, headers, _ = _http(search)
    assert status == 401 and headers.get("www-authenticate", "").startswith("Basic "), headers
    assert _http(search, headers={"Authorization": "Bearer wrong"})[0] == 401
    assert _http(f"{uri}/health")[0] == 401
    # Another Host (a rebound name, MLflow's own check takes 10.*), another page's Origin: refused.
    assert _http(search, headers={**bearer, "Host": f"10.0.0.1.attacker.example:{port}"})[0] == 403
    assert _http(search, headers={**bearer, "Host": f"10.0.0.1:{port}"})[0] == 403
    assert _http(search, headers={**bearer, "Origin": f"http://localhost:{int(port) + 1}"})[0] == 403
    assert _http(search, headers={**bearer, "Sec-Fetch-Site": "cross-site"})[0] == 403
    assert _http(search, headers={**bearer, "Origin": f"http://127.0.0.1:{port}"})[0] == 200  # the UI's own
    # The routes that act for the caller: refused even with the credential, whatever the spelling.
    config = json.dumps({"providers": {"x": {"model": "m", "base_url": "http://127.0.0.1:9"}}}).encode()
    for method, path in [
        ("PUT", "/ajax-api/3.0/mlflow/assistant/config"),
        ("POST", "/ajax-api/3.0/mlflow/assistant/message"),
        ("GET", "/ajax-api/3.0/mlflow/assistant/config"),
        ("GET", "//ajax-api/3.0/mlflow/assistant/config"),
        ("GET", "/ajax-api/3.0/mlflow/./assistant/config"),
        ("GET", "/ajax-api/3.0/mlflow/assist%61nt/config"),
        ("GET", "/ajax-api/3.0/jobs/search"),
        ("GET", "/gateway/x/mlflow/invocations"),
        ("POST", "/ajax-api/2.0/mlflow/gateway-proxy"),
        ("GET", "/ajax-api/3.0/mlflow/gateway/secrets/config"),
        ("POST", "/ajax-api/3.0/mlflow/scorer/invoke"),
        ("GET", "/ajax-api/3.0/mlflow/mcp-servers"),
        ("GET", "/api/3.0/mlflow/mcp-servers"),
        ("GET", "/api/2.0/mlflow/webhooks"),
        ("POST", "/ajax-api/2.0/mlflow/webhooks"),
        ("POST", "/api/2.0/mlflow/webhooks/w1/test"),
    ]:
        status, _, body = _http(
            f"{uri}{path}", method, {**bearer, "Content-Type": "application/json"}, config
        )
        assert status == 403, (method, path, status, body[:200])
    # MLflow keeps its settings (the assistant's among them) in the cluster's folder, not the user's home.
    import psutil

    record = next(
        r for r in json.loads((CLUSTER_DIR / "state.json").read_text())["processes"] if r["name"] == "mlflow"
    )
    assert psutil.Process(record["pid"]).environ()["HOME"] == str((CLUSTER_DIR / "mlflow-home").resolve())


def test_a_person_opens_the_tracking_ui_with_the_token_from_cluster_env(ray_cluster, tmp_path):
    # In Chromium, with any user name and the token as the password (what a person types into the browser's
    # prompt; the prompt itself is test_the_tracking_server_...'s 401 with `WWW-Authenticate: Basic`), MLflow's
    # UI loads and lists an experiment from its API.
    from browser import CHROMIUM_FLAGS, chromium_or_skip
    from playwright.sync_api import sync_playwright

    chromium = chromium_or_skip()
    uri = ray_cluster["MLFLOW_TRACKING_URI"]
    token = ray_cluster["MLFLOW_TRACKING_TOKEN"]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_context(http_credentials={"username": "me", "password": token}).new_page()
            answers = []
            page.on(
                "response", lambda r: answers.append((r.status, r.url)) if "/ajax-api/" in r.url else None
            )
            assert page.goto(f"{uri}/#/experiments").status == 200
            page.get_by_text("Default", exact=True).first.wait_for(
                timeout=30_000
            )  # MLflow's first experiment
            page.screenshot(path=str(tmp_path / "mlflow-ui.png"))
        finally:
            browser.close()
    # Every call of the page carried the credential (no 401); the experiments came from the API; the page's
    # calls to the assistant were refused, and it went on without it.
    assert answers and not [a for a in answers if a[0] == 401], answers
    assert any(status == 200 and "experiments/search" in url for status, url in answers), answers
    assert {status for status, url in answers if "/assistant/" in url} <= {403}, answers


def test_no_metrics_exporter_listens(ray_cluster):
    # Ray's metrics exporters are plain HTTP without a credential; the local cluster turns them off: none of
    # the nodes' --metrics-export-port ports is open.
    import socket

    import psutil

    ports = []
    for proc in _cluster_processes():
        try:
            ports += [
                int(a.split("=", 1)[1]) for a in proc.cmdline() if a.startswith("--metrics-export-port=")
            ]
        except psutil.Error:  # gone meanwhile
            pass
    assert len(ports) >= 2, ports  # one per node
    for port in ports:
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"metrics exporter on port {port}"
    # Every socket a cluster process listens on: loopback only, and none on Ray's fixed ports (the autoscaler's
    # and the dashboard's metrics exporters, 44217 and 44227, plain HTTP; the Ray Client server, 10001).
    pids = {p.pid for p in _cluster_processes()}
    listening = [
        c.laddr
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.pid in pids
    ]
    assert len(listening) >= 8, listening
    assert all(a.ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for a in listening), listening
    assert not {a.port for a in listening} & {44217, 44227, 10001}, sorted(a.port for a in listening)


# TEST-NET-1 (RFC 5737): an address no machine on the internet has, on the namespace's own loopback device.
ROUTABLE = "192.0.2.77"


def _probe_with_a_routable_address(*args: str) -> dict:
    """tests/loopback_probe.py's findings, from a network namespace of its own that has a routable address
    (`ROUTABLE`) and a default route, as a laptop or a cluster node has: `make test`'s namespace has only
    loopback, where Ray keeps 127.0.0.1 whatever it is told. Nothing is sent to that address."""
    routable = f"ip addr add {ROUTABLE}/24 dev lo && ip route add default via {ROUTABLE} dev lo"
    probe = f"env PYTHONPATH={ROOT} {sys.executable} tests/loopback_probe.py {' '.join(args)}"
    done = subprocess.run(
        ["unshare", "-n", "sh", "-c", f"ip link set lo up && {routable} && exec {probe}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _off_loopback(listening: list[dict]) -> list[dict]:
    return [s for s in listening if s["ip"] not in ("127.0.0.1", "::ffff:127.0.0.1", "::1")]


@pytest.mark.timeout(300)
def test_on_a_machine_with_a_routable_address_the_cluster_listens_on_loopback_only(tmp_path):
    # Ray would put the routable address in 127.0.0.1's place, and then listen on it and on every interface.
    # The cluster of `make cluster-up`: every socket its processes listen on, and a driver that attaches as
    # `source cluster.env` does.
    found = _probe_with_a_routable_address("cluster", str(tmp_path / "cluster"))
    assert len(found["listening"]) >= 8, found  # GCS, 2 raylets, their agents, the bucket, MLflow, ...
    assert _off_loopback(found["listening"]) == [], found["listening"]
    assert found["driver_nodes"] == ["2"], found["driver_error"]


@pytest.mark.timeout(300)
def test_the_operations_notebooks_own_nodes_listen_on_loopback_and_ask_for_a_token():
    # operating_a_run's nodes on a laptop (harness.drills.LaptopCluster), with a routable address: loopback
    # only, and a driver without the cluster's token is refused; the notebook's own attaches to all 3 nodes.
    found = _probe_with_a_routable_address("laptop")
    assert len(found["listening"]) >= 6, found
    assert _off_loopback(found["listening"]) == [], found["listening"]
    assert found["driver_nodes"] == ["3"] and found["stranger_rc"] != 0, found


def test_no_other_user_can_enter_a_ray_session_folder(ray_cluster):
    # Ray opens its temp dir and session folders to every user (0777, no sticky bit): another local user
    # could swap a job's unpacked code. Each node's temp dir sits in a folder only its owner can enter.
    from pathlib import Path

    temp_dirs = json.loads((CLUSTER_DIR / "state.json").read_text())["temp_dirs"]
    assert len(temp_dirs) >= 2, temp_dirs
    for temp_dir in map(Path, temp_dirs):
        assert any(temp_dir.glob("session_*")), temp_dir  # Ray's sessions are in it
        assert temp_dir.parent.stat().st_mode & 0o077 == 0, (
            temp_dir.parent,
            oct(temp_dir.parent.stat().st_mode),
        )
        assert temp_dir.parent.stat().st_uid == os.getuid()


def test_a_proxy_in_the_shell_never_gets_the_clusters_tokens(ray_cluster):
    # A shell with HTTP(S)_PROXY and no NO_PROXY sources cluster.env: MLflow's bearer token, the Ray job
    # server's token and the bucket's signed requests must reach the loopback servers, not the proxy.
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.5)
    proxy = f"http://127.0.0.1:{listener.getsockname()[1]}"
    shell = {k: v for k, v in os.environ.items() if k.lower() != "no_proxy"}
    shell.update({var: proxy for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")})
    sourced = subprocess.run(
        ["bash", "-c", f'. "{CLUSTER_DIR / "cluster.env"}" && env -0'],
        env=shell,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    env = dict(line.split("=", 1) for line in sourced.split("\0") if "=" in line)
    code = (
        "import os, boto3\n"
        "from mlflow.tracking import MlflowClient\n"
        "from ray.job_submission import JobSubmissionClient\n"
        "print(len(MlflowClient().search_experiments()))\n"
        "print(len(JobSubmissionClient().list_jobs()))\n"
        "bucket = os.environ['STORAGE_PATH'].split('/')[2]\n"
        "print(boto3.client('s3').list_objects_v2(Bucket=bucket, MaxKeys=1)['ResponseMetadata']['HTTPStatusCode'])\n"
    )
    try:
        proc = _driver(
            code, env, timeout=40
        )  # a request sent to the proxy waits for an answer that never comes
    except subprocess.TimeoutExpired:
        proc = None
    try:
        connection, _ = listener.accept()
        connection.close()
        reached = True
    except TimeoutError:
        reached = False
    finally:
        listener.close()
    assert not reached, "a request to the cluster went to the shell's proxy"
    assert proc is not None and proc.returncode == 0, proc and proc.stderr[-3000:]


def test_a_tracking_credential_the_server_refuses_fails_in_the_first_cells(ray_cluster, monkeypatch):
    # `/health` answers 401 to anyone: a server being up said nothing of the notebook's credential, which
    # then failed at the first `start_run`, in the training cell.
    from harness import tracking
    from helpers import ParameterError

    monkeypatch.setenv("MLFLOW_TRACKING_URI", ray_cluster["MLFLOW_TRACKING_URI"])
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", ray_cluster["MLFLOW_TRACKING_TOKEN"])
    assert tracking.check_tracking() == ray_cluster["MLFLOW_TRACKING_URI"]
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "not-the-token")
    with pytest.raises(ParameterError, match=r"refuses this notebook's credential \(HTTP 40[13]\)"):
        tracking.check_tracking()


def test_a_head_started_as_a_user_starts_it_is_attached_with_its_token_and_a_stale_one_named(tmp_path):
    """`ray start --head` with nothing set, on a machine where a local `ray.init()` once left
    `~/.ray/auth_token`: Ray 2.60 turns token authentication on for the head. The notebooks' `ray.init(
    **ray_init_args())` attaches as a plain `ray.init()` would, token included; once the head is gone
    without `ray stop`, it says so in one line within seconds (not Ray's minute of retries)."""
    import shutil
    import socket
    import tempfile
    from pathlib import Path

    home = tmp_path / "home"
    home.mkdir()
    tmp = Path(tempfile.mkdtemp(prefix="ray-u-", dir="/tmp"))  # short: Ray's socket paths live under it
    env = {k: v for k, v in notebook_env({}).items() if not k.startswith("RAY_")}
    # Usage stats off, and its one "disabled" report kept on loopback, as for the test cluster.
    env.update(HOME=str(home), TMPDIR=str(tmp), RAY_USAGE_STATS_ENABLED="0")
    env["RAY_USAGE_STATS_REPORT_URL"] = "http://127.0.0.1:9/"
    ray_cli = str(ROOT / ".venv" / "bin" / "ray")
    subprocess.run([ray_cli, "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
    with socket.socket() as s:  # a free port: this machine may run another Ray on 6379
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    head = subprocess.Popen(  # --block: the head's processes stop with it (SIGTERM), and only they
        [ray_cli, "start", "--head", "--block", f"--port={port}", "--include-dashboard=false"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    attach = (
        "import ray; from harness.cluster import ray_init_args; ray.init(**ray_init_args());"
        "print('nodes', len(ray.nodes()))"
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not list(tmp.glob("ray/ray_current_cluster")):
            time.sleep(0.5)
        time.sleep(2)  # the head's GCS up
        attached = _driver(attach, env)
        assert attached.returncode == 0 and "nodes 1" in attached.stdout, attached.stderr[-2000:]
    finally:
        head.terminate()
        head.wait(timeout=60)
    log = head.stdout.read()
    assert "Token authentication is enabled" in log, log[-2000:]  # as a user's head runs it
    start = time.perf_counter()
    stale = _driver(attach, env)
    assert stale.returncode != 0 and f"names 127.0.0.1:{port}" in stale.stderr, stale.stderr[-2000:]
    assert "`ray stop`" in stale.stderr and time.perf_counter() - start < 30
    shutil.rmtree(tmp, ignore_errors=True)


def test_a_local_ray_leaves_its_token_file_owner_only(tmp_path):
    """A notebook's local Ray (no cluster found) turns Ray's token authentication on; the token file Ray
    would write with the default permissions (0644) is owner-only, and one left readable is tightened."""
    import shutil
    import stat
    import tempfile
    from pathlib import Path

    code = "import ray; from harness.cluster import ray_init_args; ray.init(**ray_init_args()); print('up')"
    for left_before in (None, 0o644):
        home = tmp_path / f"home-{left_before}"
        (home / ".ray").mkdir(parents=True)
        token = home / ".ray" / "auth_token"
        if left_before:
            token.write_text("an-earlier-token")
            token.chmod(left_before)
        tmp = Path(tempfile.mkdtemp(prefix="ray-t-", dir="/tmp"))  # short socket paths, no cluster to find
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(HOME=str(home), TMPDIR=str(tmp), RAY_USAGE_STATS_ENABLED="0")
        started = _driver(code, env)
        shutil.rmtree(tmp, ignore_errors=True)
        assert started.returncode == 0 and "up" in started.stdout, started.stderr[-2000:]
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
