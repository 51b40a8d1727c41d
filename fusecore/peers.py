"""Node-to-node block reads of a distributed cache: a small authenticated HTTP protocol.

A node serves the blocks it holds to the other members (`PeerServer`, in the mount process, on the
node's own address) and asks a block's owner before the object store (`PeerClient`). A peer can make a
read slower, never make it fail or return other bytes: the client uses an answer only when it is the
exact block version asked (ETag), of exactly the block's length, with a matching SHA-256, and returns
None on anything else (refused, timed out, wrong answer), so the caller reads the store.

    GET <prefix>/v1/block?key=<object key>&etag=<etag>&index=<block>&start=<byte>&stop=<byte>&size=<object size>
    Authorization: Stoker-Peer <unix seconds> <hex HMAC-SHA256(cache key, "<seconds>\\n<path and query>")>

A request asks bytes [start, stop) of one object version, inside its block `index` (a block is owned as a
whole; a random reader's exact range asks the owner of the block it lies in); `size` is the object's size,
so an owner that reads through knows the object without a lookup. `&held=1` (an owner asking another
owner of the same block, R > 1) asks only for what is held: an owner never waits on another owner's
read-through, so two owners reading the same block at once cannot wait on each other.

The prefix is empty when a mount listens on its own address (`--peer-listen`), and `/c/<cache id>` when a
node's one peer port serves every distributed cache of the node (peer_router.py): the router reads the
request line, hands the connection to the mount of that cache (`PeerServer.receive`), and the mount
answers it as its own. The signature covers the whole target, prefix included.

The server answers 200 with the bytes (Content-Length, X-Stoker-ETag, X-Stoker-SHA256) when it holds that
exact version; when it does not but owns the block, it reads through: 200 at once with `X-Stoker-Through: 1`
and a chunked body that is a FETCHING byte every HEARTBEAT seconds while its own GET runs (shared with any
GET of that block on the node, whoever asked), then OK, the bytes and their raw SHA-256, or FAILED (its
GET failed or took over THROUGH_WAIT: the asker reads the store, the owner is not avoided). So the asker
tells "fetching" from "gone" by the beats: an owner that stops or hangs is silent for more than the
first-byte bound at any point of the answer, and the asker gives up on it then. 404 when it neither
holds nor owns the bytes, 503 when it already answers MAX_CLIENTS requests (the asker reads the store; a
busy peer is not avoided), 401 to a request that is not signed with the cache's key or whose time is
more than MAX_SKEW seconds away (nothing is served unauthenticated; a key per DatasetCache keeps one
tenant's nodes from another's blocks), 400 to a malformed one or one outside the node's dataset.
Traffic is not encrypted: see docs/security.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import http.client
import http.server
import logging
import os
import socket
import sys
import threading
import time
import urllib.parse
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from .cache import Buffer

log = logging.getLogger(__name__)

PATH = "/v1/block"
SCHEME = "Stoker-Peer"
MAX_SKEW = 60.0  # seconds a signed request stays valid (clocks of a cluster's nodes agree within that)
CHUNK = 256 * 1024
MAX_CLIENTS = 256  # requests a node answers at once; more are told 503 (threads and memory stay bounded); a
# read-through answer holds its thread while the owner's GET runs, and every member's read-ahead may ask at once
IDLE_TIMEOUT = 10.0  # seconds a peer connection may stay silent (or not take its answer) before it is closed
POOLED = 2  # idle connections an asker keeps to each peer (a connection and a server thread per block cost
# about as much CPU as the block's bytes: keep-alive halves the CPU of a 100 KB peer read)
POOL_IDLE = 5.0  # seconds an idle connection is kept; less than IDLE_TIMEOUT, so a peer rarely closes one first

AVOID = 5.0  # seconds a failed peer is not asked: a dead one then costs a connection refused (or one bound) per
# 5 s, and one that was only stopped or restarting serves again within seconds
HEARTBEAT = 0.1  # seconds between an owner's FETCHING beats while it reads through
THROUGH_WAIT = 3.0  # seconds an owner waits for its own GET for a peer before it answers FAILED
FETCHING, OK, FAILED = b".", b"+", b"-"  # the marks of a read-through body


@dataclass(frozen=True)
class BlockAsk:
    """Bytes [start, stop) of one version of an object of `size` bytes, inside its block `index`."""

    key: str
    etag: str
    index: int
    start: int
    stop: int
    size: int
    through: bool = True  # an owner that does not hold the bytes may read them through (not for another owner)

    @classmethod
    def block(cls, key: str, etag: str, index: int, length: int, block_size: int | None = None,
              size: int | None = None, through: bool = True) -> "BlockAsk":
        """The whole block `index` (`length` bytes; blocks of `block_size`, `length` by default)."""
        start = index * (block_size or length)
        return cls(key, etag, index, start, start + length, size if size is not None else start + length, through)

    @property
    def length(self) -> int:
        return self.stop - self.start

    def target(self, prefix: str = "") -> str:
        return f"{prefix}{PATH}?" + urllib.parse.urlencode(
            {"key": self.key, "etag": self.etag, "index": str(self.index), "start": str(self.start),
             "stop": str(self.stop), "size": str(self.size), **({} if self.through else {"held": "1"})})

    @classmethod
    def parse(cls, query: str) -> "BlockAsk":
        """From a request's query; ValueError when a field is missing or the bytes are not inside the object."""
        q = urllib.parse.parse_qs(query, strict_parsing=True)
        try:
            index, start, stop, size = (int(q[name][0]) for name in ("index", "start", "stop", "size"))
            ask = cls(q["key"][0], q["etag"][0], index, start, stop, size, through=q.get("held", ["0"])[0] != "1")
        except (KeyError, IndexError) as exc:
            raise ValueError(f"missing {exc}") from None
        if ask.index < 0 or not 0 <= ask.start < ask.stop <= ask.size:
            raise ValueError("the bytes asked are not inside the object")
        return ask


# A node's answer to an ask: the bytes it holds, a Future of the bytes it reads through for the asker
# (its block, owned here), or None (neither). ValueError: the ask does not fit this node's dataset or blocks.
Lookup = Callable[[BlockAsk], "Buffer | Future | None"]


def _mac(key: bytes, seconds: str, target: str) -> str:
    return hmac.new(key, f"{seconds}\n{target}".encode(), hashlib.sha256).hexdigest()


def sign(key: bytes, target: str, now: float) -> str:
    """The Authorization header of a request for `target` (path and query) at `now`."""
    seconds = str(int(now))
    return f"{SCHEME} {seconds} {_mac(key, seconds, target)}"


def verify(key: bytes, target: str, header: str | None, now: float) -> bool:
    try:
        scheme, seconds, mac = (header or "").split(" ")
        stamp = int(seconds)
    except ValueError:
        return False
    if scheme != SCHEME or abs(now - stamp) > MAX_SKEW:
        return False
    return hmac.compare_digest(_mac(key, seconds, target), mac)


def cache_prefix(cache_id: str) -> str:
    """The path prefix of one distributed cache's requests on a node's shared peer port."""
    return f"/c/{cache_id}"


class PeerServer:
    """Serves held blocks to the cache's other members: on `address` (host, port; port 0 picks one), or,
    with `address` None, on the connections a node's peer router hands over (`receive`)."""

    def __init__(self, address: tuple[str, int] | None, key: bytes, lookup: Lookup,
                 clock: Callable[[], float] = time.time, metrics=None, max_clients: int = MAX_CLIENTS,
                 prefix: str = "", idle_timeout: float = IDLE_TIMEOUT):
        if not key:
            raise ValueError("a peer key is required: nothing is served unauthenticated")
        self.key, self.lookup, self.clock, self.metrics = key, lookup, clock, metrics
        self.path = prefix + PATH
        self.served = self.refused = self.missed = self.busy = self.served_bytes = self.connections = 0
        self.through = self.through_failed = 0  # answers read through for a peer (its store GET), and failed ones
        self.through_wait = THROUGH_WAIT
        self.idle_timeout = idle_timeout
        self._slots = threading.BoundedSemaphore(max_clients)
        self._listening = address is not None
        self._server = _Server(address or ("127.0.0.1", 0), self._handler(), bind_and_activate=self._listening)
        self.address = self._server.server_address[:2]
        self._handoff: socket.socket | None = None
        self._thread = threading.Thread(target=self._server.serve_forever, name="peer-server", daemon=True)

    def start(self) -> "PeerServer":
        if self._listening:
            self._thread.start()
        return self

    def receive(self, path: str) -> "PeerServer":
        """Answer the connections a peer router sends to the unix socket `path` (one descriptor a datagram)."""
        if os.path.exists(path):
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        os.chmod(path, 0o600)
        self._handoff = sock
        threading.Thread(target=self._receive, args=(sock,), name="peer-handoff", daemon=True).start()
        return self

    def _receive(self, sock: socket.socket) -> None:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(sock, 16, 4)
            except OSError:
                return  # closed
            if not data and not fds:
                return  # shut down (close)
            for fd in fds:
                try:
                    conn = socket.socket(fileno=fd)
                    peer = conn.getpeername()
                except OSError:
                    os.close(fd)
                    continue
                self._server.process_request(conn, peer)  # a thread of its own, like an accepted connection

    def close(self) -> None:
        if self._listening:
            self._server.shutdown()
        handoff, self._handoff = self._handoff, None
        if handoff is not None:
            path = handoff.getsockname()
            with contextlib.suppress(OSError):
                handoff.shutdown(socket.SHUT_RDWR)  # wakes the receiving thread (a close alone would not)
            handoff.close()
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._server.server_close()

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: an asker sends its next requests on the same connection
            timeout = server.idle_timeout  # a connection that sends nothing for this long is closed

            def setup(self) -> None:
                server.connections += 1
                super().setup()
                # Headers and body are separate writes: without NODELAY, Nagle holds the body back until the
                # asker's delayed ACK of the headers (up to 40 ms) once a kept-alive connection left quick-ack.
                with contextlib.suppress(OSError):
                    self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
                log.debug("peer %s: " + format, self.client_address[0], *args)

            def do_GET(self) -> None:
                if not server._slots.acquire(blocking=False):
                    server.busy += 1
                    return _send(self, 503)
                try:
                    server.answer(self)
                finally:
                    server._slots.release()

        return Handler

    def answer(self, h: http.server.BaseHTTPRequestHandler) -> None:
        if not verify(self.key, h.path, h.headers.get("Authorization"), self.clock()):
            self.refused += 1
            return _send(h, 401)
        url = urllib.parse.urlsplit(h.path)
        try:
            if url.path != self.path:
                raise ValueError(f"no such path {url.path}")
            ask = BlockAsk.parse(url.query)
            found = self.lookup(ask)
        except ValueError as exc:
            log.debug("peer %s: bad request: %s", h.client_address[0], exc)
            return _send(h, 400)
        if found is None:
            self.missed += 1
            return _send(h, 404)
        if isinstance(found, Future):
            return self._read_through(h, ask, found)
        body = memoryview(found)
        h.send_response(200)
        h.send_header("Content-Length", str(len(body)))
        h.send_header("X-Stoker-ETag", ask.etag)
        h.send_header("X-Stoker-SHA256", hashlib.sha256(body).hexdigest())
        h.end_headers()
        self._count(len(body))  # before the body: a client may have it all before this thread goes on
        for start in range(0, len(body), CHUNK):
            h.wfile.write(body[start:start + CHUNK])

    def _count(self, nbytes: int) -> None:
        self.served += 1
        self.served_bytes += nbytes
        if self.metrics is not None:
            self.metrics.peer_served_bytes.inc(nbytes)

    def _read_through(self, h: http.server.BaseHTTPRequestHandler, ask: BlockAsk, pending: Future) -> None:
        """Say at once that the bytes are coming, beat while this node's GET runs, then send them (or FAILED)."""
        h.send_response(200)
        h.send_header("Transfer-Encoding", "chunked")
        h.send_header("X-Stoker-ETag", ask.etag)
        h.send_header("X-Stoker-Through", "1")
        h.end_headers()
        give_up = time.monotonic() + self.through_wait
        data = None
        while True:
            try:
                data = pending.result(timeout=HEARTBEAT)
                break
            except TimeoutError:
                if time.monotonic() >= give_up:
                    break
                h.wfile.write(b"1\r\n" + FETCHING + b"\r\n")
            except Exception:  # noqa: BLE001 - its GET failed (logged where it ran): the asker reads the store
                break
        if data is None or len(data) != ask.length:
            self.through_failed += 1
            if self.metrics is not None:
                self.metrics.peer_read_through.labels(outcome="failed").inc()
            h.wfile.write(b"1\r\n" + FAILED + b"\r\n0\r\n\r\n")
            return
        body = memoryview(data)
        digest = hashlib.sha256(body).digest()
        self.through += 1
        if self.metrics is not None:
            self.metrics.peer_read_through.labels(outcome="served").inc()
        self._count(len(body))
        h.wfile.write(f"{1 + len(body) + len(digest):x}\r\n".encode() + OK)
        for start in range(0, len(body), CHUNK):
            h.wfile.write(body[start:start + CHUNK])
        h.wfile.write(digest + b"\r\n0\r\n\r\n")


class _Server(http.server.ThreadingHTTPServer):
    # The listen backlog: with the default of 5, a burst of members' requests overflows it and the kernel
    # drops SYNs, which costs the asker a one-second retransmit (past its connect timeout).
    request_queue_size = 256
    daemon_threads = True
    # Closing does not wait for the connections' threads: a kept-alive connection idles up to IDLE_TIMEOUT,
    # and an unmount would wait that long (seconds after umount, under load 15 s) for nothing it needs.
    block_on_close = False

    def handle_error(self, request, client_address) -> None:
        """An asker that went away (closed a kept-alive connection, timed out) is no error worth a traceback."""
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            log.debug("peer %s: connection ended", client_address[0])
        else:
            log.warning("peer request from %s failed", client_address[0], exc_info=True)


def _send(h: http.server.BaseHTTPRequestHandler, status: int) -> None:
    h.send_response(status)
    h.send_header("Content-Length", "0")
    h.end_headers()


@dataclass
class PeerTimeouts:
    connect: float = 0.2  # seconds to connect to a peer
    first_byte: float = 0.3  # seconds from the request to the answer's status line, and between a read-through's beats
    body: float = 2.0  # seconds for the whole body of one block
    through: float = THROUGH_WAIT + 1.0  # seconds an owner's read-through may beat before its bytes come


class PeerClient:
    """Asks a peer for bytes of one block; None unless the answer is exactly those bytes. A peer that failed is
    avoided for `avoid` seconds, then asked again."""

    def __init__(self, key: bytes, timeouts: PeerTimeouts | None = None, avoid: float = AVOID,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 prefix: str = ""):
        self.key, self.timeouts, self.avoid, self.prefix = key, timeouts or PeerTimeouts(), avoid, prefix
        self.clock, self.wall = clock, wall
        self._avoid_until: dict[str, float] = {}
        self.failures: dict[str, int] = {}
        self._pool: dict[str, list[tuple[float, http.client.HTTPConnection]]] = {}  # idle connections by peer
        self._pool_lock = threading.Lock()

    def avoided(self, peer: str) -> bool:
        return self._avoid_until.get(peer, 0.0) > self.clock()

    def fetch(self, peer: str, want: BlockAsk) -> bytearray | None:
        """The bytes `want` from `peer` ("host:port"); None if it cannot (a 404 is no failure: the peer just
        does not hold them)."""
        return self.ask(peer, want)[1]

    def ask(self, peer: str, want: BlockAsk) -> tuple[str, bytearray | None]:
        """(outcome, bytes) of one request: "hit" (held) or "through" (the owner read them from the store for
        this asker) with the bytes; "miss" (neither held nor owned, busy, or the owner's own GET failed),
        "failed" (refused, timed out, silent, a wrong answer: the peer is avoided a while) or "avoided", with None."""
        if self.avoided(peer):
            return "avoided", None
        try:
            return self._get(peer, want)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self._failed(peer, f"{type(exc).__name__}: {exc}")
            return "failed", None
        except Exception as exc:  # noqa: BLE001 - whatever else goes wrong with a peer, the store answers the read
            log.warning("asking peer %s failed unexpectedly", peer, exc_info=True)
            self._failed(peer, f"unexpected {type(exc).__name__}")
            return "failed", None

    def _failed(self, peer: str, why: str) -> None:
        self.failures[peer] = self.failures.get(peer, 0) + 1
        self._avoid_until[peer] = self.clock() + self.avoid
        log.info("peer %s failed (%s); avoided for %gs", peer, why, self.avoid)

    def _get(self, peer: str, want: BlockAsk) -> tuple[str, bytearray | None]:
        conn = self._take(peer)
        if conn is not None:
            try:
                return self._exchange(peer, conn, want)
            except ConnectionError:
                pass  # the peer closed the idle connection meanwhile: ask again on a new one (no failure)
        host, _, port = peer.rpartition(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=self.timeouts.connect)
        conn.connect()
        assert conn.sock is not None
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # (see the server's setup)
        return self._exchange(peer, conn, want)

    def _exchange(self, peer: str, conn: http.client.HTTPConnection, want: BlockAsk) -> tuple[str, bytearray | None]:
        """One request on `conn`; the connection goes back to the pool after a complete answer, else is closed."""
        target = want.target(self.prefix)
        reusable = False
        try:
            assert conn.sock is not None
            conn.sock.settimeout(self.timeouts.first_byte)
            conn.request("GET", target, headers={"Authorization": sign(self.key, target, self.wall())})
            resp = conn.getresponse()
            if resp.status in (404, 503):  # not held, or busy: no failure, the store answers this one
                resp.read()
                reusable = True
                return "miss", None
            if resp.status != 200:
                raise ValueError(f"answered {resp.status}")
            if resp.getheader("X-Stoker-ETag") != want.etag:
                raise ValueError("answered another version")
            if resp.getheader("X-Stoker-Through"):
                outcome, body = self._through(conn, resp, want)
            else:
                if resp.getheader("Content-Length") != str(want.length):
                    raise ValueError("answered another length")
                digest = resp.getheader("X-Stoker-SHA256") or ""
                outcome, body = "hit", self._body(conn, resp, want.length)
                if not hmac.compare_digest(hashlib.sha256(body).hexdigest(), digest):
                    raise ValueError("checksum mismatch")
            reusable = resp.isclosed()  # the whole answer was read: the connection can carry the next request
            return outcome, body
        finally:
            # An answer that closes the connection (`Connection: close`, as the peer router's 404 and 503 do)
            # leaves http.client without a socket: such a connection is never pooled.
            if reusable and conn.sock is not None:
                self._give(peer, conn)
            else:
                conn.close()

    def _body(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse, size: int) -> bytearray:
        """`size` bytes of the answer, within the body bound."""
        assert conn.sock is not None
        started = self.clock()
        body = bytearray(size)
        view, got = memoryview(body), 0
        while got < size:
            left = self.timeouts.body - (self.clock() - started)
            if left <= 0:
                raise socket.timeout("the body took too long")
            conn.sock.settimeout(left)
            n = resp.readinto(view[got:])
            if not n:
                raise ValueError(f"short body ({got} of {size} bytes)")
            got += n
        return body

    def _through(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse,
                 want: BlockAsk) -> tuple[str, bytearray | None]:
        """A read-through answer: beats while the owner fetches (each within the first-byte bound: a silent owner
        is gone), then the bytes and their SHA-256, or FAILED (a miss: the owner's store did not answer it)."""
        assert conn.sock is not None
        conn.sock.settimeout(max(self.timeouts.first_byte, 3 * HEARTBEAT))
        give_up = self.clock() + self.timeouts.through
        mark = resp.read(1)
        while mark == FETCHING:
            if self.clock() > give_up:
                raise socket.timeout("the owner's read-through took too long")
            mark = resp.read(1)
        if mark == FAILED:
            resp.read()
            return "miss", None
        if mark != OK:
            raise ValueError(f"a read-through answer marked {mark!r}")
        body = self._body(conn, resp, want.length)
        digest = resp.read(32)
        if not hmac.compare_digest(hashlib.sha256(body).digest(), digest):
            raise ValueError("checksum mismatch")
        if resp.read():
            raise ValueError("a read-through answer longer than asked")
        return "through", body

    def _take(self, peer: str) -> http.client.HTTPConnection | None:
        """An idle connection to `peer` used less than POOL_IDLE seconds ago, if there is one."""
        now = self.clock()
        with self._pool_lock:
            idle = self._pool.get(peer) or []
            while idle:
                since, conn = idle.pop()
                if now - since < POOL_IDLE:
                    return conn
                conn.close()
        return None

    def _give(self, peer: str, conn: http.client.HTTPConnection) -> None:
        with self._pool_lock:
            idle = self._pool.setdefault(peer, [])
            if len(idle) < POOLED:
                idle.append((self.clock(), conn))
                return
        conn.close()

    def close(self) -> None:
        """Close the idle connections."""
        with self._pool_lock:
            pools, self._pool = self._pool, {}
        for idle in pools.values():
            for _, conn in idle:
                conn.close()
