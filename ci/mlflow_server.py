"""The local cluster's MLflow tracking server: MLflow's own app, on loopback, for the cluster's credential only.

    python ci/mlflow_server.py PORT BACKEND_STORE_URI ARTIFACTS_DESTINATION
    # the credential in LLM_NOTEBOOKS_MLFLOW_SERVER_TOKEN (taken out of the environment at start)

What `mlflow server --host 127.0.0.1 --workers 1 --serve-artifacts ...` serves (the tracking API, the artifact
proxy, the UI), behind a guard that answers nothing else:

- a `Host` other than 127.0.0.1 or localhost on this port: 403 (a page whose name was rebound to 127.0.0.1
  sends its own name; MLflow's own check takes any `10.*` name);
- an `Origin` other than the server's own, or a browser's cross-site fetch: 403 (MLflow's CORS trusts every
  `http://localhost:*` page);
- MLflow's routes that act rather than record: the AI assistant (which runs shell commands), the gateway and
  its secrets, jobs, scorers, MCP servers and webhooks (whose test calls out to any URL): 403;
- a request without the cluster's credential: 401. Clients send it as MLflow's own `MLFLOW_TRACKING_TOKEN`
  (`Authorization: Bearer ...`); a browser asks for it (any user name, the token as password).

MLflow keeps per-user settings in `~/.mlflow` (the assistant's among them): the server runs with HOME set to
the cluster's state folder (ci/local_cluster.py), never the user's.
"""

from __future__ import annotations

import base64
import hmac
import os
import posixpath
import re
import sys

# MLflow's routes that do things on the server's behalf (run a model's tool calls, call a model gateway with
# stored secrets, start jobs and scorers, register MCP servers, call a webhook's URL); nothing here records a
# training run.
REFUSED = re.compile(
    r"^(/(ajax-)?api/[23]\.0(/mlflow)?/(assistant|gateway|gateway-proxy|jobs|scorer|scorers|mcp-servers|webhooks)"
    r"|/gateway)(/|$)",
    re.IGNORECASE,
)
REALM = 'Basic realm="MLflow of the local cluster: the password is MLFLOW_TRACKING_TOKEN in cluster.env"'


def problem(path: str, headers: dict[str, str], port: int, token: str) -> tuple[int, str] | None:
    """(status, why) for a request to refuse; None for one to serve."""
    own = {f"127.0.0.1:{port}", f"localhost:{port}"}
    if headers.get("host") not in own:
        return 403, "unknown Host"
    origin = headers.get("origin")
    if origin is not None and origin not in {f"http://{host}" for host in own}:
        return 403, "requests from other web pages are refused"
    if headers.get("sec-fetch-site") in ("cross-site", "same-site"):
        return 403, "requests from other web pages are refused"
    if re.sub("/+", "/", path) != path or any(part in (".", "..") for part in path.split("/")):
        return 403, "unusual path"
    if REFUSED.match(posixpath.normpath(path)):
        return (
            403,
            "this server does not serve MLflow's assistant, gateway, jobs, scorers, MCP or webhook routes",
        )
    if not _authorized(headers.get("authorization", ""), token):
        return 401, "the cluster's MLFLOW_TRACKING_TOKEN is required"
    return None


def _authorized(header: str, token: str) -> bool:
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer":
        return hmac.compare_digest(value.strip().encode(), token.encode())
    if scheme.lower() == "basic":
        try:
            _, _, password = base64.b64decode(value.strip(), validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        return hmac.compare_digest(password.encode(), token.encode())
    return False


class Guard:
    """ASGI middleware: `problem()` for every HTTP request and WebSocket handshake, then MLflow's app."""

    def __init__(self, app, port: int, token: str):
        self.app, self.port, self.token = app, port, token

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):  # lifespan: the app's own start and stop
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refused = problem(scope["path"], headers, self.port, self.token)
        if refused is None:
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        status, why = refused
        extra = [(b"www-authenticate", REALM.encode())] if status == 401 else []
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"text/plain"), *extra],
            }
        )
        await send({"type": "http.response.body", "body": why.encode()})


def main() -> None:
    port, backend, destination = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    token = os.environ.pop("LLM_NOTEBOOKS_MLFLOW_SERVER_TOKEN")
    # What `mlflow server` sets before it starts its app: MLflow's own host and CORS checks narrowed to this
    # server's names too, the stores, the artifact proxy. No job runner (not started without the CLI).
    os.environ.update(
        MLFLOW_SERVER_ALLOWED_HOSTS=f"127.0.0.1:{port},localhost:{port}",
        MLFLOW_SERVER_CORS_ALLOWED_ORIGINS=f"http://127.0.0.1:{port},http://localhost:{port}",
        MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
        MLFLOW_DISABLE_TELEMETRY="true",
    )
    from mlflow.server.constants import (
        ARTIFACT_ROOT_ENV_VAR,
        ARTIFACTS_DESTINATION_ENV_VAR,
        BACKEND_STORE_URI_ENV_VAR,
        REGISTRY_STORE_URI_ENV_VAR,
        SERVE_ARTIFACTS_ENV_VAR,
    )

    artifact_root = "mlflow-artifacts:/"  # what --serve-artifacts gives runs: the proxy, not the bucket
    os.environ.update(
        {
            BACKEND_STORE_URI_ENV_VAR: backend,
            REGISTRY_STORE_URI_ENV_VAR: backend,
            ARTIFACT_ROOT_ENV_VAR: artifact_root,
            SERVE_ARTIFACTS_ENV_VAR: "true",
            ARTIFACTS_DESTINATION_ENV_VAR: destination,
        }
    )
    from mlflow.server.handlers import initialize_backend_stores

    initialize_backend_stores(backend, backend, artifact_root)
    import uvicorn
    from mlflow.server.fastapi_app import app

    uvicorn.run(Guard(app, port, token), host="127.0.0.1", port=port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
