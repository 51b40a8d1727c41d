"""An HTTP proxy in front of the S3 server that can answer 503 SlowDown, cut bodies short,
or stop answering, so the real client's error handling is exercised over real sockets."""

from __future__ import annotations

import http.client
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
            b'<Message>Please reduce your request rate.</Message></Error>')


class FaultProxy:
    def __init__(self, upstream: str):
        self.upstream = urlparse(upstream)
        self.mode = "pass"  # pass | slowdown | reset | blackhole
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
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOWDOWN)))
                    self.end_headers()
                    self.wfile.write(SLOWDOWN)
                    return
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
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
            if self.mode in ("slowdown", "reset") and method == "GET" and self.remaining > 0:
                self.remaining -= 1
                self.faults_served += 1
                return self.mode
        return None

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
