"""The local cluster's S3 API server: moto's, on loopback, answering S3 clients and nothing else.

    python ci/s3_server.py PORT

moto's own `moto_server` allows requests from any web origin (CORS on) and has an unauthenticated
`/moto-api/reset` endpoint, so that any web page the user opens could read or wipe the bucket's
checkpoints. This one serves the same moto application behind a guard that refuses (403):

- any request that carries an `Origin` header: browsers send one with every cross-origin request that
  could change or read something, S3 clients (pyarrow, boto3) never do;
- any `Host` other than 127.0.0.1 or localhost on this port (a page whose name was rebound to
  127.0.0.1 sends its own name);
- moto's own API and dashboard (`/moto-api/...`).

and moto's global CORS is off (`MOTO_DISABLE_GLOBAL_CORS`), so no answer carries an
`Access-Control-Allow-Origin` header.
"""

from __future__ import annotations

import os
import signal
import sys


def guard(app, port: int):
    allowed_hosts = {f"127.0.0.1:{port}", f"localhost:{port}"}

    def guarded(environ, start_response):
        refused = None
        if environ.get("HTTP_ORIGIN") is not None:
            refused = "requests from web pages are refused"
        elif environ.get("HTTP_HOST") not in allowed_hosts:
            refused = "unknown Host"
        elif environ.get("PATH_INFO", "").startswith("/moto-api"):
            refused = "moto's API is off"
        if refused:
            start_response("403 Forbidden", [("Content-Type", "text/plain")])
            return [refused.encode()]
        return app(environ, start_response)

    return guarded


def main() -> None:
    port = int(sys.argv[1])
    os.environ["MOTO_DISABLE_GLOBAL_CORS"] = "true"  # read when moto's settings are first imported
    os.environ["MOTO_PORT"] = str(port)
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import run_simple

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `down` stops it with SIGTERM
    app = DomainDispatcherApplication(create_backend_app)
    run_simple("127.0.0.1", port, guard(app, port), threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
