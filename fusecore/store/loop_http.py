"""Small GETs of presigned URLs sent and received on the event loop itself, on kept-alive non-blocking sockets
(plain, or TLS through Python's ssl), parsed as wire.Wire steps.

Through awscrt (native_http) the body of a small GET reaches Python in one call back per 16 KiB on awscrt's own
thread, each taking the GIL from the event loop, and the loop is woken from that thread at the end: ~0.21 ms of
the mount's CPU per 110 KB GET against ~0.12 here, where one or two recv_into calls put the body into its buffer
(measured with 8 GETs in flight against the bench's store). Connections are made in a worker thread (name
resolution and the TLS handshake block), once per pooled connection.

The same checks as every GET path: the caller's `accept` sees a 200 or 206's headers first (version, range,
length), the body must fill its buffer exactly, and an answer's error code comes back with the start of its
body. A store silent for request-timeout fails the GET (Unavailable); a broken connection is a TransientError
(retried by the fetcher). A cancelled GET closes its connection, and nothing reaches the buffer afterwards:
only this task writes into it. Errors carry no URL: a presigned URL holds the credential."""

from __future__ import annotations

import os
import socket
import ssl
import time
import urllib.parse
from typing import Mapping

import trio

from .idle import IdlePool
from .native_http import Accept, Answer, Endpoint, endpoint_of
from .objects import Progress
from .errors import StoreError, TransientError, Unavailable
from .wire import Malformed, SendAll, Steps, Wire, parse_answer, run_on_loop

ERROR_BODY = 64 * 1024  # bytes of an error answer's body kept, enough for its code
WAKE_BYTES = 64 * 1024  # bytes of a body the loop is woken for at once, at least (or the rest of it)


def loop_gets_possible() -> bool:
    """Small GETs go on the loop's own sockets unless STOKER_LOOP_HTTP=0 keeps them on awscrt's connections."""
    return os.environ.get("STOKER_LOOP_HTTP", "1") != "0"


class _Connection:
    __slots__ = ("sock", "wire", "used", "heard", "lowat")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.wire = Wire()
        self.used = False  # it carried a whole answer before (kept alive: the store may have closed it since)
        self.heard = False  # the head of the answer now due came
        self.lowat = 1

    def awaiting(self, due: int) -> None:
        """Be woken for a body only once WAKE_BYTES of it (or all that is still due) arrived: a store that sends at
        its per-connection rate would otherwise wake the loop for each few KiB (SO_RCVLOWAT; the socket reads
        whatever is there whenever it is asked). Not over TLS: there the bytes still to come on the socket may be
        fewer than those due (ssl holds part of a record already), and a mark above them would wait for the
        request timeout."""
        if isinstance(self.sock, ssl.SSLSocket):
            return
        lowat = max(1, min(due, WAKE_BYTES))
        if lowat != self.lowat:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
            self.lowat = lowat


class LoopHttp:
    """Kept-alive connections per endpoint; `get_into` is awaited on a trio event loop."""

    def __init__(self, *, connect_timeout: float, request_timeout: float, ca_file: str | None, max_idle: int):
        self._connect_timeout = connect_timeout
        self._request_timeout = request_timeout  # the longest silence while an answer is due
        self._ca_file = ca_file
        self._idle: IdlePool[Endpoint, _Connection] = IdlePool(max_idle, lambda conn: conn.sock.close())
        self._tls: ssl.SSLContext | None = None

    async def get_into(self, url: str, headers: Mapping[str, str], into: memoryview, progress: Progress,
                       accept: Accept, what: str) -> Answer:
        """GET `url`. A 200 or 206 answer's headers go to `accept` (which raises a StoreError to refuse it), then its
        body fills `into` exactly, advancing `progress`; any other answer is returned with the start of its body."""
        endpoint, netloc, target = _parts(url)
        request = _request(target, netloc, headers)
        conn = self._idle.take(endpoint)
        if conn is not None:  # a kept-alive connection the store closed meanwhile fails before any byte: once more
            try:
                return await self._exchange(endpoint, conn, request, into, progress, accept, what)
            except _Stale:
                pass
        conn = await self._connect(endpoint, what)
        try:
            return await self._exchange(endpoint, conn, request, into, progress, accept, what)
        except _Stale:
            raise TransientError(f"{what}: the store closed the connection") from None

    async def _exchange(self, endpoint: Endpoint, conn: _Connection, request: bytes, into: memoryview,
                        progress: Progress, accept: Accept, what: str) -> Answer:
        try:
            answer, reusable = await run_on_loop(conn.sock, self._steps(conn, request, into, progress, accept, what))
        except _Stale:
            conn.sock.close()
            raise
        except BaseException as exc:  # failed, refused or cancelled: the connection is in an unknown state
            conn.sock.close()
            if isinstance(exc, StoreError) or not isinstance(exc, (OSError, Malformed)):
                raise
            if conn.used and not conn.heard and isinstance(exc, ConnectionError):
                raise _Stale("a kept-alive connection closed by the store") from None  # reset before an answer
            if isinstance(exc, socket.timeout):
                raise Unavailable(f"{what}: store stopped sending") from None
            if isinstance(exc, Malformed):
                raise TransientError(f"{what}: {exc}") from None
            raise TransientError(f"{what}: connection failed ({type(exc).__name__})") from None
        if reusable:
            conn.used = True
            self._idle.give(endpoint, conn)
        else:
            conn.sock.close()
        return answer

    def _steps(self, conn: _Connection, request: bytes, into: memoryview, progress: Progress, accept: Accept,
               what: str) -> Steps[tuple[Answer, bool]]:
        timeout = self._request_timeout
        wire = conn.wire
        conn.heard = False
        yield SendAll(request, time.monotonic() + timeout)
        lines = yield from wire.head(time.monotonic() + timeout)
        if lines is None:  # the connection ended before any byte of an answer
            if conn.used:
                raise _Stale("a kept-alive connection closed by the store")
            raise TransientError(f"{what}: the store closed the connection without an answer")
        conn.heard = True
        status, headers = parse_answer(lines)
        keep = headers.get("connection", "").lower() != "close"
        if status in (200, 206):
            accept(status, headers)  # the version, range and length asked for, or a StoreError
            if "content-length" in headers:
                length = _length(headers["content-length"], what)
                if length > len(into):
                    raise TransientError(f"{what}: a body longer than the {len(into)} bytes asked for")
                try:
                    got = yield from wire.into(into[:length], timeout, progress.advance, conn.awaiting)
                finally:
                    conn.awaiting(1)  # the next answer's head is woken for at its first byte
            elif headers.get("transfer-encoding", "").lower() == "chunked":
                got = yield from wire.chunked_into(into, timeout, progress.advance)
            else:
                raise TransientError(f"{what}: an answer without a length")
            if got < len(into):
                raise TransientError(f"{what}: short body ({got} of {len(into)} bytes)")
            return Answer(status, headers), keep and wire.drained()
        if "content-length" in headers:
            length = _length(headers["content-length"], what)
            some = yield from wire.exactly(min(length, ERROR_BODY), time.monotonic() + timeout)
            return Answer(status, headers, bytes(some)), keep and length <= ERROR_BODY and wire.drained()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            kept = bytearray(ERROR_BODY)
            got = yield from wire.chunked_into(memoryview(kept), timeout, lambda n: None)
            return Answer(status, headers, bytes(kept[:got])), keep and wire.drained()
        return Answer(status, headers), False  # a body up to the connection's end: not read, not reused

    async def _connect(self, endpoint: Endpoint, what: str) -> _Connection:
        """A new connection, made in a worker thread (name resolution and a TLS handshake block)."""
        return _Connection(await trio.to_thread.run_sync(self._connect_blocking, endpoint, what))

    def _connect_blocking(self, endpoint: Endpoint, what: str) -> socket.socket:
        scheme, host, port = endpoint
        try:
            sock = socket.create_connection((host, port), timeout=self._connect_timeout)
        except socket.timeout:
            raise Unavailable(f"{what}: could not connect in time") from None
        except OSError as exc:
            raise Unavailable(f"{what}: cannot reach the endpoint ({type(exc).__name__})") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if scheme == "https":
            try:
                sock = self._tls_context().wrap_socket(sock, server_hostname=host)
            except (OSError, ssl.SSLError) as exc:
                sock.close()
                raise Unavailable(f"{what}: TLS with the endpoint failed ({type(exc).__name__})") from None
        sock.setblocking(False)
        return sock

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context(cafile=self._ca_file)
        return self._tls


class _Stale(TransientError):
    """A kept-alive connection that the store had closed: nothing of an answer came (sent again at once on a new
    connection, never seen past get_into)."""


def _parts(url: str) -> tuple[Endpoint, str, str]:
    parts = urllib.parse.urlsplit(url)
    target = f"{parts.path}?{parts.query}" if parts.query else parts.path
    return endpoint_of(parts), parts.netloc, target


def _request(target: str, netloc: str, headers: Mapping[str, str]) -> bytes:
    lines = [f"GET {target} HTTP/1.1", f"Host: {netloc}", *(f"{name}: {value}" for name, value in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _length(value: str, what: str) -> int:
    if not value.isdigit():
        raise TransientError(f"{what}: malformed Content-Length")
    return int(value)
