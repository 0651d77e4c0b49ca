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
import re
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
        if environ.get("REQUEST_METHOD") == "GET" and (served := _ranged_get(environ, start_response)):
            return served
        return app(environ, start_response)

    return guarded


_RANGE = re.compile(r"bytes=(\d+)-(\d+)$")


def _ranged_get(environ, start_response):
    """A ranged GET of one object (`Range: bytes=a-b`), answered with those bytes only; None: moto's turn.

    moto answers a ranged GET by reading the whole object and then slicing it, so every resume that reads
    its shards tensor by tensor (one ranged read each) read the whole checkpoint file over and over: a
    reshard after a node loss, where each rank reads a 629 MB file, took minutes. S3 reads only the range.
    """
    match = _RANGE.match(environ.get("HTTP_RANGE", ""))
    path = environ.get("PATH_INFO", "").lstrip("/")
    if not match or "/" not in path or environ.get("QUERY_STRING"):
        return None
    from urllib.parse import unquote

    from moto.core.models import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    bucket, key_name = path.split("/", 1)
    try:
        key = s3_backends[DEFAULT_ACCOUNT_ID]["aws"].get_object(bucket, unquote(key_name))
    except Exception:  # noqa: BLE001 - no such bucket or key: moto answers with its own error
        return None
    if key is None:
        return None
    begin, end = int(match.group(1)), int(match.group(2))
    size = key.size
    if begin >= size:
        return None
    end = min(end, size - 1)
    with key.lock:
        key._value_buffer.seek(begin)
        body = key._value_buffer.read(end - begin + 1)
    start_response(
        "206 Partial Content",
        [
            ("Content-Type", key.metadata.get("Content-Type", "binary/octet-stream")),
            ("Content-Length", str(len(body))),
            ("Content-Range", f"bytes {begin}-{end}/{size}"),
            ("ETag", key.etag),
            ("Last-Modified", key.last_modified_RFC1123),
            ("Accept-Ranges", "bytes"),
        ],
    )
    return [body]


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
