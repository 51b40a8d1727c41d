"""NativeHttp (awscrt connections) against a real HTTP server on a real socket: exact bodies, error
answers, refused answers, a store that goes silent mid-body, connection reuse, and an endpoint that
refuses connections. (A silent store and a cancelled GET awaited on the loop: test_loop_http.py, for both clients.)"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import trio

from fusecore.store.native_http import NativeHttp
from fusecore.store.objects import Progress
from fusecore.store.errors import PreconditionFailed, TransientError, Unavailable

BODY = bytes(range(256)) * 400  # 102,400 bytes, more than one 16 KiB piece from awscrt


class Server:
    """Answers GET /<mode>: "ok" (the body), "error" (503 SlowDown), "stall" (half the body, then silence),
    "long" (a Content-Length longer than asked for), "chunked" (403 AccessDenied in chunks), "chunked-ok" and
    "chunked-long" (the body, or a longer one, in chunks), "once" (the body, then the connection closed unannounced) — and counts connections and requests."""

    def __init__(self):
        self.connections = 0
        self.requests: list[dict[str, str]] = []
        self.release = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()
                server.connections += 1

            def log_message(self, *args):
                pass

            def do_GET(self):
                server.requests.append(dict(self.headers.items()))
                mode = self.path.split("?")[0].strip("/")
                if mode == "error":
                    body = b"<Error><Code>SlowDown</Code></Error>"
                    self.send_response(503)
                    self.send_header("Retry-After", "2")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if mode == "chunked":  # an error answer whose body comes in chunks
                    self.send_response(403)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for part in (b"<Error><Code>Access", b"Denied</Code></Error>"):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                    self.wfile.write(b"0\r\n\r\n")
                    return
                if mode in ("chunked-ok", "chunked-long"):  # a body in chunks, without a Content-Length
                    self.send_response(200)
                    self.send_header("ETag", '"v1"')
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    body = BODY + b"extra" if mode == "chunked-long" else BODY
                    for at in range(0, len(body), 40_000):
                        part = body[at:at + 40_000]
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                    self.wfile.write(b"0\r\n\r\n")
                    return
                body = BODY + b"extra" if mode == "long" else BODY
                self.send_response(200)
                self.send_header("ETag", '"v1"')
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if mode == "stall":
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    server.release.wait(30)
                    self.close_connection = True
                    return
                self.wfile.write(body)
                if mode == "once":  # closed after the answer without saying so (a store's idle timeout, early)
                    self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda request, address: None  # refused handshakes, closed connections: expected
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


def client(**kw) -> NativeHttp:
    return NativeHttp(**{"connect_timeout": 2.0, "request_timeout": 1.0, "ca_file": None, "max_idle": 4, **kw})


def accept_all(status, headers):
    return None


def test_bodies_arrive_exactly_on_one_reused_connection(server):
    http = client()
    for _ in range(3):
        buf = bytearray(len(BODY))
        progress = Progress()
        answer = http.get_into(f"{server.url}/ok?X-Amz-Signature=abc", {"Range": "bytes=0-102399"}, memoryview(buf),
                               progress, accept_all, "get 'ok'")
        assert answer.status == 200 and answer.headers["etag"] == '"v1"'
        assert bytes(buf) == BODY and progress.received == len(BODY)
    assert server.connections == 1 and len(server.requests) == 3
    assert server.requests[0]["Range"] == "bytes=0-102399"
    assert server.requests[0]["Host"] == server.url.removeprefix("http://")


def test_an_error_answer_comes_back_with_its_body_and_nothing_is_written(server):
    buf = bytearray(len(BODY))
    answer = client().get_into(f"{server.url}/error", {}, memoryview(buf), Progress(), accept_all, "get 'e'")
    assert answer.status == 503 and b"<Code>SlowDown</Code>" in answer.body
    assert answer.headers["retry-after"] == "2"
    assert buf == bytearray(len(BODY))


def test_an_answer_the_caller_refuses_is_not_taken(server):
    def refuse(status, headers):
        raise PreconditionFailed("get 'ok': object changed since it was listed")

    buf = bytearray(len(BODY))
    progress = Progress()
    with pytest.raises(PreconditionFailed):
        client().get_into(f"{server.url}/ok", {}, memoryview(buf), progress, refuse, "get 'ok'")
    assert progress.received == 0 and buf == bytearray(len(BODY))


def test_a_longer_body_than_asked_for_is_refused_without_writing_past_the_buffer(server):
    buf = bytearray(len(BODY) + 64)
    view = memoryview(buf)[: len(BODY)]
    with pytest.raises(TransientError):
        client().get_into(f"{server.url}/long", {}, view, Progress(), accept_all, "get 'long'")
    assert buf[len(BODY):] == bytearray(64)


def test_a_store_silent_mid_body_fails_in_bounded_time_and_writes_nothing_after(server):
    buf = bytearray(len(BODY))
    progress = Progress()
    started = time.monotonic()
    with pytest.raises(Unavailable, match="stopped sending"):
        client(request_timeout=0.5).get_into(f"{server.url}/stall", {}, memoryview(buf), progress, accept_all,
                                             "get 'stall'")
    assert time.monotonic() - started < 5
    received = progress.received
    assert 0 < received < len(BODY) and bytes(buf[:received]) == BODY[:received]
    server.release.set()
    time.sleep(0.3)
    assert progress.received == received and buf[received:] == bytearray(len(BODY) - received)


def test_an_endpoint_that_refuses_connections_is_unavailable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        with pytest.raises(Unavailable, match="cannot reach the endpoint"):
            client().get_into(f"http://127.0.0.1:{port}/ok", {}, memoryview(bytearray(10)), Progress(), accept_all,
                              "get 'ok'")


def _certificates(where) -> tuple[str, str, str]:
    """A test CA and a server certificate for localhost signed by it (openssl, as on any Debian machine)."""
    def run(*args):
        subprocess.run(["openssl", *args], cwd=where, check=True, capture_output=True)

    (where / "san.cnf").write_text("subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\n")
    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "ca.key",
        "-out", "ca.pem", "-days", "2", "-subj", "/CN=stoker-test-ca")
    run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "srv.key",
        "-out", "srv.csr", "-subj", "/CN=localhost")
    run("x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", "srv.pem",
        "-days", "2", "-extfile", "san.cnf")
    return str(where / "ca.pem"), str(where / "srv.pem"), str(where / "srv.key")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is needed to make test certificates")
def test_https_verifies_the_store_against_the_ca_bundle_given(server, tmp_path):
    """Over TLS the store's certificate is checked against the CA bundle (the one urllib3 uses too) and
    the name in the URL: a store the bundle does not vouch for is refused."""
    ca, cert, key = _certificates(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    # the handshake in each request's thread: a refused one must not hold up the server's accept loop
    server.httpd.socket = context.wrap_socket(server.httpd.socket, server_side=True, do_handshake_on_connect=False)
    url = server.url.replace("http://127.0.0.1", "https://localhost") + "/ok"
    buf = bytearray(len(BODY))
    answer = client(ca_file=ca).get_into(url, {}, memoryview(buf), Progress(), accept_all, "get 'ok'")
    assert answer.status == 200 and bytes(buf) == BODY
    other = tmp_path / "other"
    other.mkdir()
    other_ca, _, _ = _certificates(other)
    started = time.monotonic()
    with pytest.raises(Unavailable, match="TLS handshake failed|cannot reach the endpoint"):
        client(ca_file=other_ca, connect_timeout=1.0).get_into(url, {}, memoryview(bytearray(len(BODY))), Progress(),
                                                               accept_all, "get 'ok'")
    assert time.monotonic() - started < 10


def test_a_whole_answer_comes_back_with_its_body_and_one_too_large_is_refused(server):
    """`get` (listing pages): the whole body of any answer; a success larger than the limit is refused."""
    http = client()
    answer = http.get(f"{server.url}/ok", "list 'ok'", limit=len(BODY))
    assert answer.status == 200 and answer.body == BODY
    assert http.get(f"{server.url}/error", "list 'e'", limit=10).status == 503
    with pytest.raises(TransientError, match="larger than"):
        http.get(f"{server.url}/ok", "list 'ok'", limit=len(BODY) - 1)
    assert http.get(f"{server.url}/ok", "list 'ok'", limit=len(BODY)).body == BODY


# ---- the same GETs awaited on a trio event loop (get_into_async: no worker thread waits) ------------------------

def on_loop(http: NativeHttp, path: str, buf: bytearray, progress: Progress, accept=accept_all, limit: float = 10):
    async def main():
        with trio.fail_after(limit):
            return await http.get_into_async(path, {"Range": "bytes=0-102399"}, memoryview(buf), progress, accept,
                                             "get 'x'")
    return trio.run(main)


def test_on_the_loop_bodies_arrive_exactly_on_one_reused_connection_with_the_thread_path(server):
    http = client()
    for _ in range(2):
        buf, progress = bytearray(len(BODY)), Progress()
        answer = on_loop(http, f"{server.url}/ok", buf, progress)
        assert answer.status == 200 and bytes(buf) == BODY and progress.received == len(BODY)
    buf = bytearray(len(BODY))
    http.get_into(f"{server.url}/ok", {}, memoryview(buf), Progress(), accept_all, "get 'ok'")
    assert bytes(buf) == BODY
    assert server.connections == 1 and len(server.requests) == 3


def test_on_the_loop_errors_refusals_and_long_bodies_are_as_on_a_thread(server):
    buf = bytearray(len(BODY) + 64)
    answer = on_loop(client(), f"{server.url}/error", buf, Progress())
    assert answer.status == 503 and b"SlowDown" in answer.body and buf == bytearray(len(BODY) + 64)

    def refuse(status, headers):
        raise PreconditionFailed("changed")

    progress = Progress()
    with pytest.raises(PreconditionFailed):
        on_loop(client(), f"{server.url}/ok", buf, progress, accept=refuse)
    assert progress.received == 0 and buf == bytearray(len(BODY) + 64)
    with pytest.raises(TransientError):
        async def long():
            return await client().get_into_async(f"{server.url}/long", {}, memoryview(buf)[:len(BODY)], Progress(),
                                                 accept_all, "get 'long'")
        trio.run(long)
    assert buf[len(BODY):] == bytearray(64)


_THREAD_STATE_PROBE = r"""
import os, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from fusecore.store import native_http
from fusecore.store.objects import Progress

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args):
        pass
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()
        self.wfile.write(bytes(1000))

httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
threading.Thread(target=httpd.serve_forever, daemon=True).start()
if sys.argv[1] == "hold":
    native_http.hold_thread_states()
mine = threading.local()  # a thread state's own: what one call back leaves here, the next sees only if it is kept
seen = []
def accept(status, headers):
    seen.append(getattr(mine, "calls", 0))
    mine.calls = len(seen)
http = native_http.NativeHttp(connect_timeout=2.0, request_timeout=2.0, ca_file=None, max_idle=4)
for _ in range(3):
    http.get_into(f"http://127.0.0.1:{httpd.server_address[1]}/x", {}, memoryview(bytearray(1000)), Progress(),
                  accept, "get")
print(seen, flush=True)
os._exit(0)  # as the mount's process ends: never finalized with thread states kept
"""


@pytest.mark.parametrize("mode,expected", [("hold", "[0, 1, 2]"), ("default", "[0, 0, 0]")])
def test_a_mount_keeps_the_thread_state_of_awscrts_thread_between_call_backs(mode, expected):
    """The mount's process (and only it: it never finalizes) keeps one thread state for awscrt's thread instead of
    CPython making and freeing one around each call back; by default each call back starts afresh."""
    done = subprocess.run([sys.executable, "-c", _THREAD_STATE_PROBE, mode], capture_output=True, text=True,
                          timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected
