"""The socket patch behind `sitecustomize.py`; importable on its own for the tests."""

from __future__ import annotations

import ipaddress
import os
import socket
import traceback

_ORIGINAL = {}


def is_allowed(family: int, address) -> bool:
    """Loopback and local (AF_UNIX) sockets are allowed; every other address is not."""
    if family not in (socket.AF_INET, socket.AF_INET6):
        return True
    host = address[0] if isinstance(address, tuple) else address
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False  # a host name: resolving it already means going out


def _record(log_path: str, what: str, address) -> None:
    with open(log_path, "a", encoding="utf-8") as f:
        f.write(f"pid {os.getpid()} {what} {address!r}\n{''.join(traceback.format_stack(limit=12))}\n")


def install(log_path: str) -> None:
    if _ORIGINAL:
        return
    _ORIGINAL.update(
        connect=socket.socket.connect, connect_ex=socket.socket.connect_ex, sendto=socket.socket.sendto
    )

    def connect(self, address):
        # A UDP "connect" only picks a route (Ray does it to find its IP); it sends nothing.
        if self.type != socket.SOCK_DGRAM and not is_allowed(self.family, address):
            _record(log_path, "connect", address)
            raise OSError(101, f"offline guard: outbound connection to {address!r} blocked in tests")
        return _ORIGINAL["connect"](self, address)

    def connect_ex(self, address):
        if self.type != socket.SOCK_DGRAM and not is_allowed(self.family, address):
            _record(log_path, "connect_ex", address)
            return 101
        return _ORIGINAL["connect_ex"](self, address)

    def sendto(self, data, *args):
        address = args[-1]
        if not is_allowed(self.family, address):
            _record(log_path, "sendto", address)
            raise OSError(101, f"offline guard: datagram to {address!r} blocked in tests")
        return _ORIGINAL["sendto"](self, data, *args)

    socket.socket.connect = connect
    socket.socket.connect_ex = connect_ex
    socket.socket.sendto = sendto


def installed() -> bool:
    return bool(_ORIGINAL) and socket.socket.connect is not _ORIGINAL["connect"]


# ---- tripwire proxy --------------------------------------------------------------------------
# The tests point HTTP(S)_PROXY at this loopback server, so an HTTP client that honours proxy
# variables never opens a connection off the machine; the server answers 403 and records the
# request's target. Ray's dashboard probes cloud metadata services at every start (even with
# usage stats off); those targets are expected and only listed. Any other target is recorded
# in the guard log, which fails the test.

CLOUD_METADATA_HOSTS = ("169.254.169.254", "metadata.google.internal")


def start_tripwire_proxy(log_path: str) -> int:
    """Serve the tripwire on 127.0.0.1 in a daemon thread; return its port."""
    import socketserver
    import threading

    class Handler(socketserver.StreamRequestHandler):
        def handle(self):
            line = self.rfile.readline(4096).decode("latin-1").strip()  # "GET http://host/... HTTP/1.1"
            parts = line.split()
            target = parts[1] if len(parts) > 1 else line
            host = target.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]
            if host not in CLOUD_METADATA_HOSTS:
                with open(log_path, "a", encoding="utf-8") as f:
                    f.write(f"proxied request {line!r}\n\n")
            self.wfile.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server.server_address[1]
