"""An HTTP proxy in front of the S3 server that can answer 503 SlowDown (for a count of GETs or for a
while, with Retry-After), cut bodies short, stop answering, or tamper with ranged GETs the way a
non-conforming store or proxy does (move the range, or ignore it and send the whole object), so the
real client's error handling is exercised over real sockets."""

from __future__ import annotations

import http.client
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
            b'<Message>Please reduce your request rate.</Message></Error>')


class FaultProxy:
    def __init__(self, upstream: str):
        self.upstream = urlparse(upstream)
        self.mode = "pass"  # pass | slowdown | reset | blackhole | shift-range | ignore-range
        self.slowdown_until = 0.0  # every GET answers 503 SlowDown until this time.monotonic()
        self.slowdown_methods: tuple[str, ...] = ("GET",)  # ... or every request of these methods
        self.retry_after: str | None = None  # Retry-After sent with a 503
        self.remaining = 0  # how many GETs the fault applies to (slowdown, reset)
        self.gets = 0
        self.faults_served = 0
        self._release = threading.Event()
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep test output quiet
                pass

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                fault = proxy._take_fault(self.command)
                if fault == "blackhole":
                    proxy._release.wait(timeout=120)
                    self.close_connection = True
                    return
                if fault == "slowdown":
                    self.send_response(503)
                    if proxy.retry_after is not None:
                        self.send_header("Retry-After", proxy.retry_after)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOWDOWN)))
                    self.end_headers()
                    self.wfile.write(SLOWDOWN)
                    return
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                if fault in ("shift-range", "ignore-range"):
                    headers = _tampered(headers, fault)
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                        self.send_header(k, v)
                # a HEAD answer declares the object's length without a body: pass it on as sent
                self.send_header("Content-Length", resp.getheader("Content-Length", "0") if self.command == "HEAD"
                                 else str(len(data)))
                self.end_headers()
                if fault == "reset" and len(data) > 1:
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _take_fault(self, method: str) -> str | None:
        with self._lock:
            if method == "GET":
                self.gets += 1
            if self.mode == "blackhole":
                return "blackhole"
            if method in self.slowdown_methods and time.monotonic() < self.slowdown_until:
                self.faults_served += 1
                return "slowdown"
            if self.mode in ("slowdown", "reset", "shift-range", "ignore-range") and method == "GET" \
                    and self.remaining > 0:
                self.remaining -= 1
                self.faults_served += 1
                return self.mode
        return None

    def slow_down_for(self, seconds: float, retry_after: str | None = None, methods: tuple[str, ...] = ("GET",)) -> None:
        """Answer every GET (or every request of `methods`: PUT and POST for uploads) with 503 SlowDown for `seconds`
        from now."""
        with self._lock:
            self.slowdown_until = time.monotonic() + seconds
            self.retry_after = retry_after
            self.slowdown_methods = methods

    def set(self, mode: str, count: int = 0) -> None:
        with self._lock:
            self.mode, self.remaining = mode, count
            if mode != "blackhole":
                self._release.set()
                self._release = threading.Event()

    def __enter__(self) -> "FaultProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._release.set()
        self.server.shutdown()
        self.server.server_close()


def _tampered(headers: dict[str, str], fault: str) -> dict[str, str]:
    """Move a ranged GET one byte on (the answer is a 206 for other bytes, of the same length), or drop
    the range (the answer is a 200 with the whole object)."""
    key = next((k for k in headers if k.lower() == "range"), None)
    if key is None:
        return headers
    out = {k: v for k, v in headers.items() if k != key}
    match = re.match(r"bytes=(\d+)-(\d+)", headers[key])
    if fault == "shift-range" and match:
        out[key] = f"bytes={int(match.group(1)) + 1}-{int(match.group(2)) + 1}"
    return out
