"""Node-to-node block reads of a distributed cache: a small authenticated HTTP protocol.

A node serves the blocks it holds to the other members (`PeerServer`, in the mount process, on the
node's own address) and asks a block's owner before the object store (`PeerClient`). A peer can make a
read slower, never make it fail or return other bytes: the client uses an answer only when it is the
exact block version asked (ETag), of exactly the block's length, with a matching SHA-256, and returns
None on anything else (refused, timed out, wrong answer), so the caller reads the store.

    GET <prefix>/v1/block?key=<object key>&etag=<etag>&index=<block index>
    Authorization: Stoker-Peer <unix seconds> <hex HMAC-SHA256(cache key, "<seconds>\\n<path and query>")>

The prefix is empty when a mount listens on its own address (`--peer-listen`), and `/c/<cache id>` when a
node's one peer port serves every distributed cache of the node (peer_router.py): the router reads the
request line, hands the connection to the mount of that cache (`PeerServer.receive`), and the mount
answers it as its own. The signature covers the whole target, prefix included.

The server answers 200 with the block (Content-Length, X-Stoker-ETag, X-Stoker-SHA256) when it holds that
exact version, 404 when it does not (it never fetches from the store for a peer), 503 when it already
answers MAX_CLIENTS requests (the asker reads the store; a busy peer is not avoided), 401 to a request that
is not signed with the cache's key or whose time is more than MAX_SKEW seconds away (nothing is served
unauthenticated; a key per DatasetCache keeps one tenant's nodes from another's blocks), 400 to a
malformed one. Traffic is not encrypted: see docs/security.md.
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
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)

PATH = "/v1/block"
SCHEME = "Stoker-Peer"
MAX_SKEW = 60.0  # seconds a signed request stays valid (clocks of a cluster's nodes agree within that)
CHUNK = 256 * 1024
MAX_CLIENTS = 64  # requests a node answers at once; more are told 503 (threads and memory stay bounded)
IDLE_TIMEOUT = 10.0  # seconds a peer connection may stay silent (or not take its answer) before it is closed
POOLED = 2  # idle connections an asker keeps to each peer (a connection and a server thread per block cost
# about as much CPU as the block's bytes: keep-alive halves the CPU of a 100 KB peer read)
POOL_IDLE = 5.0  # seconds an idle connection is kept; less than IDLE_TIMEOUT, so a peer rarely closes one first

Lookup = Callable[[str, str, int], "bytes | memoryview | None"]  # (key, etag, index) -> the block, if held


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


def block_target(key: str, etag: str, index: int, prefix: str = "") -> str:
    return f"{prefix}{PATH}?" + urllib.parse.urlencode({"key": key, "etag": etag, "index": str(index)})


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
        query = urllib.parse.parse_qs(url.query)
        try:
            key, etag, index = query["key"][0], query["etag"][0], int(query["index"][0])
        except (KeyError, ValueError, IndexError):
            return _send(h, 400)
        if url.path != self.path or index < 0:
            return _send(h, 400)
        data = self.lookup(key, etag, index)
        if data is None:
            self.missed += 1
            return _send(h, 404)
        body = memoryview(data)
        h.send_response(200)
        h.send_header("Content-Length", str(len(body)))
        h.send_header("X-Stoker-ETag", etag)
        h.send_header("X-Stoker-SHA256", hashlib.sha256(body).hexdigest())
        h.end_headers()
        self.served += 1  # counted before the body: a client may have it all before this thread goes on
        self.served_bytes += len(body)
        if self.metrics is not None:
            self.metrics.peer_served_bytes.inc(len(body))
        for start in range(0, len(body), CHUNK):
            h.wfile.write(body[start:start + CHUNK])


class _Server(http.server.ThreadingHTTPServer):
    # The listen backlog: with the default of 5, a burst of members' requests overflows it and the kernel
    # drops SYNs, which costs the asker a one-second retransmit (past its connect timeout).
    request_queue_size = 256
    daemon_threads = True

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
    first_byte: float = 0.3  # seconds from the request to the answer's status line
    body: float = 2.0  # seconds for the whole body of one block


class PeerClient:
    """Asks a peer for one block; None unless the answer is exactly that block. A peer that failed is
    avoided for `avoid` seconds, then asked again."""

    def __init__(self, key: bytes, timeouts: PeerTimeouts | None = None, avoid: float = 30.0,
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

    def fetch(self, peer: str, key: str, etag: str, index: int, size: int) -> bytearray | None:
        """The block `index` of (`key`, `etag`), `size` bytes, from `peer` ("host:port"); None if it cannot
        (a 404 is no failure: the peer just does not hold it)."""
        return self.ask(peer, key, etag, index, size)[1]

    def ask(self, peer: str, key: str, etag: str, index: int, size: int) -> tuple[str, bytearray | None]:
        """(outcome, block) of one request: "hit" with the block; "miss" (not held, or busy), "failed"
        (refused, timed out, a wrong answer: the peer is avoided a while) or "avoided", with None."""
        if self.avoided(peer):
            return "avoided", None
        try:
            data = self._get(peer, key, etag, index, size)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self._failed(peer, f"{type(exc).__name__}: {exc}")
            return "failed", None
        except Exception as exc:  # noqa: BLE001 - whatever else goes wrong with a peer, the store answers the read
            log.warning("asking peer %s failed unexpectedly", peer, exc_info=True)
            self._failed(peer, f"unexpected {type(exc).__name__}")
            return "failed", None
        return ("miss", None) if data is None else ("hit", data)

    def _failed(self, peer: str, why: str) -> None:
        self.failures[peer] = self.failures.get(peer, 0) + 1
        self._avoid_until[peer] = self.clock() + self.avoid
        log.info("peer %s failed (%s); avoided for %gs", peer, why, self.avoid)

    def _get(self, peer: str, key: str, etag: str, index: int, size: int) -> bytearray | None:
        conn = self._take(peer)
        if conn is not None:
            try:
                return self._exchange(peer, conn, key, etag, index, size)
            except ConnectionError:
                pass  # the peer closed the idle connection meanwhile: ask again on a new one (no failure)
        host, _, port = peer.rpartition(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=self.timeouts.connect)
        conn.connect()
        assert conn.sock is not None
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # (see the server's setup)
        return self._exchange(peer, conn, key, etag, index, size)

    def _exchange(self, peer: str, conn: http.client.HTTPConnection, key: str, etag: str, index: int,
                  size: int) -> bytearray | None:
        """One request on `conn`; the connection goes back to the pool after a complete answer, else is closed."""
        target = block_target(key, etag, index, self.prefix)
        started = self.clock()
        reusable = False
        try:
            assert conn.sock is not None
            conn.sock.settimeout(self.timeouts.first_byte)
            conn.request("GET", target, headers={"Authorization": sign(self.key, target, self.wall())})
            resp = conn.getresponse()
            if resp.status in (404, 503):  # not held, or busy: no failure, the store answers this one
                resp.read()
                reusable = True
                return None
            if resp.status != 200:
                raise ValueError(f"answered {resp.status}")
            if resp.getheader("X-Stoker-ETag") != etag or resp.getheader("Content-Length") != str(size):
                raise ValueError("answered another version or length")
            digest = resp.getheader("X-Stoker-SHA256") or ""
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
            if not hmac.compare_digest(hashlib.sha256(body).hexdigest(), digest):
                raise ValueError("checksum mismatch")
            reusable = resp.isclosed()  # the whole answer was read: the connection can carry the next request
            return body
        finally:
            # An answer that closes the connection (`Connection: close`, as the peer router's 404 and 503 do)
            # leaves http.client without a socket: such a connection is never pooled.
            if reusable and conn.sock is not None:
                self._give(peer, conn)
            else:
                conn.close()

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
