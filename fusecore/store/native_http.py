"""GETs of presigned URLs on the AWS Common Runtime's HTTP/1.1 connections (awscrt, what Mountpoint
and s3torchconnector build on): the request is written and the answer's headers parsed in C, which
costs ~0.35 ms less CPU per request than urllib3 and http.client (whose header parsing goes through
the email package). Only for small bodies: awscrt hands a body to Python 16 KiB at a time, which
costs more per GiB than urllib3's readinto on large ones (`stoker bench --engines`, bench/README).
Listing pages come this way; a small range GET awaited on the event loop goes on the loop's own sockets
(loop_http: ~0.1 ms less CPU), and here only where STOKER_LOOP_HTTP=0.

The URLs come signed (signing.py); this module only moves bytes.
Errors here carry no URL: a presigned URL holds the credential and any session token."""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Callable, Mapping

import trio

from .idle import IdlePool
from .objects import Progress
from .errors import StoreError, TransientError, Unavailable

from awscrt.http import HttpClientConnection, HttpHeaders, HttpRequest
from awscrt.io import ClientBootstrap, ClientTlsContext, DefaultHostResolver, EventLoopGroup, SocketOptions
from awscrt.io import TlsConnectionOptions, TlsContextOptions

MAX_BODY = 512 * 1024  # larger ranges go through urllib3 (cheaper per byte from here on, measured)
_ERROR_BODY = 64 * 1024  # of an error answer, enough for its code


def native_gets_possible() -> bool:
    """Small GETs go on awscrt connections unless STOKER_NATIVE_HTTP=0 keeps every GET on urllib3."""
    return os.environ.get("STOKER_NATIVE_HTTP", "1") != "0"


@dataclass
class Answer:
    status: int
    headers: Mapping[str, str]  # read with names in lower case
    body: bytes = b""  # a whole answer's body, or an error answer's first 64 KiB (`get_into` fills a buffer)


Accept = Callable[[int, Mapping[str, str]], None]
Endpoint = tuple[str, str, int]  # scheme, host, port: connections are pooled by it

_held = threading.local()  # a thread state's own: set once this awscrt thread keeps its thread state
_holding = False


def hold_thread_states() -> None:
    """Keep a Python thread state on each awscrt thread that calls back, from its first answer on.

    awscrt calls Python from its own event-loop thread, and CPython makes a thread state for each such call
    and frees it after (with the fresh 16 KiB frame stack each new state maps and unmaps): about nine calls
    per small GET (headers, a body chunk per 16 KiB, completion), measured as 17% of a cold small file's
    CPU at the mount's ceiling. A second PyGILState_Ensure, never released, keeps the state between calls.
    Only for a process that never finalizes (the mount's, fusecore/__main__.py, ends in os._exit):
    finalization frees every thread state, and an awscrt thread calling back after it would use a freed one."""
    global _holding
    _holding = True


def _hold_thread_state() -> None:
    if _holding and not getattr(_held, "state", False):
        ctypes.pythonapi.PyGILState_Ensure()  # the GIL is held: this only counts one more user of the state
        _held.state = True


@dataclass(eq=False)
class _Exchange:
    """One request's answer as the event-loop thread's callbacks fill it in."""

    into: memoryview | None  # None: keep the whole body in `body`, up to `limit` bytes
    progress: Progress
    accept: Accept
    limit: int = _ERROR_BODY
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    received: int = 0
    error: StoreError | None = None
    body: bytearray = field(default_factory=bytearray)
    last: float = field(default_factory=time.monotonic)  # when anything last arrived
    abandoned: bool = False  # the waiting thread gave up: no byte may reach `into` any more
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def ok(self) -> bool:
        return self.status in (200, 206)

    def on_response(self, http_stream, status_code: int, headers, **kwargs) -> None:
        _hold_thread_state()
        self.last = time.monotonic()
        self.status = status_code
        self.headers = {name.lower(): value for name, value in headers}
        if self.ok:
            try:
                self.accept(status_code, self.headers)
            except StoreError as exc:
                self._refuse(http_stream, exc)

    def on_body(self, http_stream, chunk: bytes, **kwargs) -> None:
        self.last = time.monotonic()
        if self.error is not None:
            return
        if not self.ok:
            self.body += chunk[:max(0, _ERROR_BODY - len(self.body))]  # enough to read its error code
            return
        if self.into is None:
            if len(self.body) + len(chunk) > self.limit:
                self._refuse(http_stream, TransientError(f"an answer larger than {self.limit} bytes"))
                return
            self.body += chunk
            return
        pos, n = self.received, len(chunk)
        with self.lock:
            if self.abandoned:
                return
            if pos + n > len(self.into):
                self._refuse(http_stream, TransientError(f"a body longer than the {len(self.into)} bytes asked for"))
                return
            self.into[pos:pos + n] = chunk
        self.received = pos + n
        self.progress.advance(n)

    def _refuse(self, http_stream, error: StoreError) -> None:
        """Take no more of this answer: close its connection (raising here would print a traceback)."""
        self.error = error
        http_stream.connection.close()


class NativeHttp:
    """A pool of awscrt HTTP/1.1 connections per endpoint; `get_into` blocks the calling thread."""

    def __init__(self, *, connect_timeout: float, request_timeout: float, ca_file: str | None, max_idle: int):
        self._connect_timeout = connect_timeout
        self._request_timeout = request_timeout  # the longest silence while an answer is due
        self._ca_file = ca_file
        self._idle: IdlePool[Endpoint, HttpClientConnection] = IdlePool(
            max_idle, HttpClientConnection.close, usable=HttpClientConnection.is_open)
        self._lock = threading.Lock()
        self._bootstrap: ClientBootstrap | None = None  # made at first use, in the process that sends
        self._tls: ClientTlsContext | None = None

    def get_into(self, url: str, headers: Mapping[str, str], into: memoryview, progress: Progress,
                 accept: Accept, what: str) -> Answer:
        """GET `url`. A 200 or 206 answer's headers go to `accept` (which raises a StoreError to refuse
        it), then its body fills `into` exactly, advancing `progress`; any other answer is returned
        with the start of its body. Connection failures and a silent store raise StoreErrors."""
        return self._exchange(url, headers, _Exchange(into, progress, accept), what)

    def get(self, url: str, what: str, limit: int) -> Answer:
        """GET `url` whole (a listing page, say): any answer with its body; a 200 or 206 larger than `limit`
        bytes is refused as a TransientError."""
        return self._exchange(url, {}, _Exchange(None, Progress(), _accept_any, limit), what)

    async def get_into_async(self, url: str, headers: Mapping[str, str], into: memoryview, progress: Progress,
                             accept: Accept, what: str) -> Answer:
        """`get_into` for a caller on a trio event loop: the request is written and its answer received on awscrt's
        own thread, and the loop is woken once when it is complete (no worker thread waits for it: a thread
        hand-off per GET was ~10% of a cold small file's Python time). Cancelled, the answer is abandoned and its
        connection closed, so no byte reaches `into` afterwards."""
        exchange = _Exchange(into, progress, accept)
        endpoint, conn = await self._connection_async(url, what)
        stream = self._send(conn, url, headers, exchange, what)
        try:
            await self._settled(stream.completion_future, exchange, what)
        except BaseException:
            self._abandon(conn, exchange)
            raise
        return self._finish(endpoint, conn, exchange, what)

    def _exchange(self, url: str, headers: Mapping[str, str], exchange: _Exchange, what: str) -> Answer:
        """Send the GET and wait for its whole answer (in this thread)."""
        endpoint = _endpoint(url)
        conn = self._connection(endpoint, what)
        stream = self._send(conn, url, headers, exchange, what)
        self._wait(conn, stream.completion_future, exchange, what)
        return self._finish(endpoint, conn, exchange, what)

    def _send(self, conn: HttpClientConnection, url: str, headers: Mapping[str, str], exchange: _Exchange, what: str):
        parts = urllib.parse.urlsplit(url)
        request = HttpRequest("GET", f"{parts.path}?{parts.query}" if parts.query else parts.path,
                              HttpHeaders([("Host", parts.netloc), *headers.items()]))
        try:
            stream = conn.request(request, exchange.on_response, exchange.on_body)
            stream.activate()
        except Exception as exc:  # noqa: BLE001 - AwsCrtError: the pooled connection closed just now
            conn.close()
            raise TransientError(f"{what}: connection failed ({getattr(exc, 'name', type(exc).__name__)})") from None
        return stream

    def _finish(self, endpoint: Endpoint, conn: HttpClientConnection, exchange: _Exchange,
                what: str) -> Answer:
        """The answer is complete: the connection goes back to the pool only after a complete answer whose body
        was taken whole (a 200 or 206 that filled less than its buffer is a TransientError)."""
        if exchange.ok and exchange.into is not None and exchange.received != len(exchange.into):
            conn.close()
            raise TransientError(f"{what}: short body ({exchange.received} of {len(exchange.into)} bytes)")
        self._idle.give(endpoint, conn)
        return Answer(exchange.status, exchange.headers, bytes(exchange.body))

    @staticmethod
    def _abandon(conn: HttpClientConnection, exchange: _Exchange) -> None:
        with exchange.lock:
            exchange.abandoned = True
        conn.close()

    async def _settled(self, done: concurrent.futures.Future, exchange: _Exchange, what: str) -> None:
        """Until the answer is complete, on the event loop; a store silent for request-timeout fails it."""
        complete = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def wake(_: concurrent.futures.Future) -> None:
            try:
                token.run_sync_soon(complete.set)
            except trio.RunFinishedError:
                pass

        done.add_done_callback(wake)
        while not complete.is_set():
            with trio.move_on_after(max(0.05, exchange.last + self._request_timeout - time.monotonic())):
                await complete.wait()
            if not complete.is_set() and time.monotonic() - exchange.last >= self._request_timeout:
                raise Unavailable(f"{what}: store stopped sending")
        _outcome(done, exchange, what)

    async def _connection_async(self, url: str, what: str) -> tuple[Endpoint, HttpClientConnection]:
        """An idle pooled connection at once, else a new one made in a worker thread (rare once the pool is warm)."""
        endpoint = _endpoint(url)
        conn = self._idle.take(endpoint)
        if conn is None:
            conn = await trio.to_thread.run_sync(self._connection, endpoint, what)
        return endpoint, conn

    def _wait(self, conn: HttpClientConnection, done: concurrent.futures.Future, exchange: _Exchange, what: str) -> None:
        """Until the answer is complete; a store silent for request-timeout fails it (closing the connection)."""
        while True:
            try:
                done.result(timeout=max(0.05, exchange.last + self._request_timeout - time.monotonic()))
                break
            except concurrent.futures.TimeoutError:
                if time.monotonic() - exchange.last < self._request_timeout:
                    continue
                self._abandon(conn, exchange)
                raise Unavailable(f"{what}: store stopped sending") from None
            except Exception:  # noqa: BLE001 - awscrt's AwsCrtError: mapped by _outcome
                break
        _outcome(done, exchange, what)

    def _connection(self, endpoint: Endpoint, what: str) -> HttpClientConnection:
        conn = self._idle.take(endpoint)
        if conn is not None:
            return conn
        scheme, host, port = endpoint
        future = HttpClientConnection.new(host_name=host, port=port, bootstrap=self._bootstrap_once(),
                                          socket_options=self._socket_options(),
                                          tls_connection_options=self._tls_options(host) if scheme == "https" else None)
        # awscrt's own timeout ends a TCP connect; a refused TLS handshake may end only after s2n's
        # 10-30 s of blinding, so the wait is bounded here too.
        try:
            return future.result(timeout=self._connect_timeout + 2)
        except concurrent.futures.TimeoutError:
            future.add_done_callback(_close_quietly)
            raise Unavailable(f"{what}: no connection within {self._connect_timeout + 2:g}s (the endpoint is "
                              "unreachable or its TLS handshake failed)") from None
        except Exception as exc:  # noqa: BLE001 - AwsCrtError: refused, unresolvable, TLS failed
            name = getattr(exc, "name", type(exc).__name__)
            if "TIMEOUT" in name:
                raise Unavailable(f"{what}: could not connect in time") from None
            raise Unavailable(f"{what}: cannot reach the endpoint ({name})") from None

    def _bootstrap_once(self) -> ClientBootstrap:
        with self._lock:
            if self._bootstrap is None:
                loops = EventLoopGroup(1)
                self._bootstrap = ClientBootstrap(loops, DefaultHostResolver(loops))
            return self._bootstrap

    def _socket_options(self) -> SocketOptions:
        options = SocketOptions()
        options.connect_timeout_ms = int(self._connect_timeout * 1000)
        return options

    def _tls_options(self, host: str) -> TlsConnectionOptions:
        with self._lock:
            if self._tls is None:
                options = TlsContextOptions()
                if self._ca_file:
                    options.override_default_trust_store_from_path(ca_filepath=self._ca_file)
                self._tls = ClientTlsContext(options)
            tls = self._tls
        options = tls.new_connection_options()
        options.set_server_name(host)
        return options


def _endpoint(url: str) -> Endpoint:
    return endpoint_of(urllib.parse.urlsplit(url))


def endpoint_of(parts: urllib.parse.SplitResult) -> Endpoint:
    """Where a URL's connections go: its scheme, host and port (the scheme's own if it names none)."""
    return parts.scheme, parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


def _outcome(done: concurrent.futures.Future, exchange: _Exchange, what: str) -> None:
    """A completed request: the error a callback recorded, a broken connection as a TransientError, else nothing."""
    failure = done.exception()
    if exchange.error is not None:
        raise exchange.error
    if failure is not None:  # awscrt's AwsCrtError: the connection broke or was refused
        raise TransientError(f"{what}: connection failed ({getattr(failure, 'name', type(failure).__name__)})")


def _accept_any(status: int, headers: Mapping[str, str]) -> None:
    """A whole answer is checked by its reader (a listing's parser), not here."""


def _close_quietly(future: concurrent.futures.Future) -> None:
    """A connection that came after its caller gave up waiting."""
    if not future.cancelled() and future.exception() is None:
        future.result().close()
