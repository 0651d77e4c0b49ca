"""The local cluster's S3 API server: moto's, on loopback, answering S3 clients and nothing else.

    python ci/s3_server.py PORT      # the bucket's keys in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY

moto's own `moto_server` allows requests from any web origin (CORS on), has an unauthenticated
`/moto-api/reset` endpoint, and checks no request's signature (unless told to check them against its own
IAM users): any local process or web page could read, replace or wipe the bucket's checkpoints, which are
pickles the workers load. This one serves the same moto application behind a guard that refuses (403):

- any request that carries an `Origin` header: browsers send one with every cross-origin request that
  could change or read something, S3 clients (pyarrow, boto3) never do;
- any `Host` other than 127.0.0.1 or localhost on this port (a page whose name was rebound to
  127.0.0.1 sends its own name);
- moto's own API and dashboard (`/moto-api/...`);
- any request not signed (AWS Signature Version 4, in the `Authorization` header) with the bucket's key
  and secret, or signed more than 15 minutes ago: the guard computes the signature again with the secret
  (botocore's signer) and compares.

and moto's global CORS is off (`MOTO_DISABLE_GLOBAL_CORS`), so no answer carries an
`Access-Control-Allow-Origin` header.
"""

from __future__ import annotations

import hmac
import os
import re
import signal
import sys
import time
from datetime import UTC, datetime

_AUTHORIZATION = re.compile(
    r"AWS4-HMAC-SHA256 Credential=(?P<key>[^/]+)/(?P<date>\d{8})/(?P<region>[^/]+)/s3/aws4_request,\s*"
    r"SignedHeaders=(?P<signed>[a-z0-9;-]+),\s*Signature=(?P<signature>[0-9a-f]{64})$"
)
MAX_SKEW_S = 15 * 60  # as S3: a signature older (or newer) than this is refused
# pyarrow's AWS SDK streams a body in aws-chunked encoding with a checksum after it, which the signature
# does not cover: such a signature, captured, takes any body for as long as it is fresh. With
# AWS_REQUEST_CHECKSUM_CALCULATION=when_required (cluster.env and the nodes set it) pyarrow signs the body's
# SHA-256 (X-Amz-Content-SHA256), as boto3 does, which `_body_problem` checks; every other payload
# (streamed, UNSIGNED-PAYLOAD, signed chunks) is refused.
STREAMED_WITH_CHECKSUM = "STREAMING-UNSIGNED-PAYLOAD-TRAILER"
# Headers that change what a request does or what a later GET returns (a replayed PUT stored as `text/html`):
# refused unless the signature covers them (as every x-amz-*).
SIGNED_IF_SENT = {
    "range",
    "content-md5",
    "if-match",
    "if-none-match",
    "if-modified-since",
    "if-unmodified-since",
    "content-type",
    "content-disposition",
    "content-encoding",
    "cache-control",
    "expires",
}


def _header(environ, name: str) -> str | None:
    if name in ("content-type", "content-length"):
        return environ.get(name.upper().replace("-", "_"))
    return environ.get("HTTP_" + name.upper().replace("-", "_"))


def _canonical_query(query: str) -> str:
    """S3's canonical query string: each name and value decoded and encoded again, sorted."""
    from urllib.parse import quote, unquote

    pairs = []
    for part in filter(None, query.split("&")):
        key, _, value = part.partition("=")
        pairs.append((quote(unquote(key), safe="-_.~"), quote(unquote(value), safe="-_.~")))
    return "&".join(f"{k}={v}" for k, v in sorted(pairs))


def signature_problem(environ, key_id: str, secret: str) -> str | None:
    """Why the request is not signed with `key_id` and `secret` (SigV4, `Authorization` header); None if it is."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    match = _AUTHORIZATION.match(environ.get("HTTP_AUTHORIZATION", ""))
    if not match:
        return "unsigned request"
    if not hmac.compare_digest(match["key"], key_id):
        return "unknown access key"
    stamp = _header(environ, "x-amz-date") or ""
    try:
        signed_at = datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return "no X-Amz-Date"
    if not stamp.startswith(match["date"]) or abs(time.time() - signed_at) > MAX_SKEW_S:
        return "signature expired"
    names = match["signed"].split(";")
    if "host" not in names or "x-amz-content-sha256" not in names:
        return "Host and X-Amz-Content-SHA256 must be signed"
    present = {k[5:].lower().replace("_", "-") for k in environ if k.startswith("HTTP_")}
    present |= {"content-type"} if environ.get("CONTENT_TYPE") else set()  # WSGI's, without HTTP_
    unsigned = sorted(h for h in present - set(names) if h.startswith("x-amz-") or h in SIGNED_IF_SENT)
    if unsigned:  # a copy source, a range, a checksum the signature does not cover could be swapped
        return f"unsigned header(s) {', '.join(unsigned)}"
    payload = _header(environ, "x-amz-content-sha256") or ""
    if not re.fullmatch(r"[0-9a-f]{64}", payload):
        return (
            f"payload {payload!r} not accepted: only the body's SHA-256 (for pyarrow, set "
            "AWS_REQUEST_CHECKSUM_CALCULATION=when_required, as cluster.env does)"
        )
    # The canonical request from the headers the client says it signed, the path as it sent it (S3 does
    # not normalise paths) and the query in canonical form; then botocore's string to sign and signature.
    signer = S3SigV4Auth(Credentials(key_id, secret), "s3", match["region"])
    headers = {name: " ".join((_header(environ, name) or "").split()) for name in names}
    path, _, query = environ.get("RAW_URI", environ.get("PATH_INFO", "/")).partition("?")
    canonical = "\n".join(
        [
            environ["REQUEST_METHOD"],
            path,
            _canonical_query(query),
            "".join(f"{name}:{headers[name]}\n" for name in names),
            match["signed"],
            headers["x-amz-content-sha256"],
        ]
    )
    request = AWSRequest(method=environ["REQUEST_METHOD"], url=f"http://{headers['host']}{path}")
    request.context["timestamp"] = stamp
    expected = signer.signature(signer.string_to_sign(request, canonical), request)
    return None if hmac.compare_digest(expected, match["signature"]) else "signature does not match"


def guard(app, port: int, key_id: str, secret: str):
    allowed_hosts = {f"127.0.0.1:{port}", f"localhost:{port}"}

    def guarded(environ, start_response):
        refused = None
        if environ.get("HTTP_ORIGIN") is not None:
            refused = "requests from web pages are refused"
        elif environ.get("HTTP_HOST") not in allowed_hosts:
            refused = "unknown Host"
        elif environ.get("PATH_INFO", "").startswith("/moto-api"):
            refused = "moto's API is off"
        else:
            refused = signature_problem(environ, key_id, secret) or _body_problem(environ)
        if refused:
            start_response("403 Forbidden", [("Content-Type", "text/plain")])
            return [refused.encode()]
        if environ.get("REQUEST_METHOD") == "GET" and (served := _ranged_get(environ, start_response)):
            return served
        return app(environ, start_response)

    return guarded


def _body_problem(environ) -> str | None:
    """Why the body is not the one signed (its SHA-256 against the signed X-Amz-Content-SHA256); None if it
    is. Read here in full and handed on: a replayed request's signature with another body is refused."""
    import hashlib
    import io

    length = int(environ.get("CONTENT_LENGTH") or 0)
    body = environ["wsgi.input"].read(length) if length else b""
    environ["wsgi.input"] = io.BytesIO(body)
    digest = hashlib.sha256(body).hexdigest()
    return (
        None
        if hmac.compare_digest(digest, _header(environ, "x-amz-content-sha256"))
        else "body does not match"
    )


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
    from moto.core.models import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    bucket, key_name = path.encode("latin-1").decode("utf-8").split("/", 1)  # WSGI: decoded once already
    begin, end = int(match.group(1)), int(match.group(2))
    if begin > end:  # not a range S3 serves: moto answers
        return None
    try:
        key = s3_backends[DEFAULT_ACCOUNT_ID]["aws"].get_object(bucket, key_name)
    except Exception:  # noqa: BLE001 - no such bucket or key: moto answers with its own error
        return None
    if key is None:
        return None
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
    key_id, secret = os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]
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
    run_simple(
        "127.0.0.1", port, guard(app, port, key_id, secret), threaded=True, request_handler=MotoRequestHandler
    )


if __name__ == "__main__":
    main()
