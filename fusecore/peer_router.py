"""One peer port per node for every distributed cache a node serves (the CSI node plugin runs it).

A node may hold several distributed caches, each in its own mount process. Rather than a port per
mount, the router listens on the node's one peer address, reads a connection's request line without
consuming it (MSG_PEEK), and passes the connection itself (its descriptor, SCM_RIGHTS) to the mount
that serves the cache named in the path, `/c/<cache id>/...` (peers.cache_prefix). The mount reads the
request and answers as if it had accepted the connection; no byte of a block goes through the router.

The router holds no key and checks no signature: the mount does (the HMAC covers the whole target,
prefix included, so a request signed for one cache is refused by every other). An unknown cache is
answered 404, a mount that does not take the connection 503: both are a miss for the asker, which
then reads the store.
"""

from __future__ import annotations

import array
import logging
import re
import socket
import threading
import time

log = logging.getLogger(__name__)

REQUEST_LINE = re.compile(rb"^GET /c/([0-9a-f]{8,64})/\S* HTTP/1\.[01]\r?\n")
PEEK_LIMIT = 8192  # bytes of a request line read at most
PEEK_TIMEOUT = 1.0  # seconds a connection has to send its request line
MAX_WAITING = 64  # connections whose request line is awaited at once; more are told 503


class PeerRouter:
    """Listens on `address` (host, port; port 0 picks one) and hands each connection to its cache's mount."""

    def __init__(self, address: tuple[str, int], peek_timeout: float = PEEK_TIMEOUT,
                 max_waiting: int = MAX_WAITING):
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._listener = socket.create_server(address, family=family, backlog=256)
        self.address = self._listener.getsockname()[:2]
        self.peek_timeout = peek_timeout
        self._routes: dict[str, str] = {}  # cache id -> the mount's handoff socket
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_waiting)
        self._closed = threading.Event()
        self.handed = self.unknown = self.unreachable = self.malformed = self.busy = 0

    def route(self, cache_id: str, handoff: str) -> None:
        """Send the requests of `cache_id` to the mount receiving on the unix socket `handoff`."""
        with self._lock:
            self._routes[cache_id] = handoff

    def unroute(self, cache_id: str) -> None:
        with self._lock:
            self._routes.pop(cache_id, None)

    def routes(self) -> dict[str, str]:
        with self._lock:
            return dict(self._routes)

    def start(self) -> "PeerRouter":
        threading.Thread(target=self._accept, name="peer-router", daemon=True).start()
        return self

    def close(self) -> None:
        self._closed.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._closed.is_set():
                    return
                time.sleep(0.05)  # e.g. out of descriptors: do not spin
                continue
            if not self._slots.acquire(blocking=False):
                self.busy += 1
                _answer(conn, 503)
                continue
            threading.Thread(target=self._route, args=(conn,), name="peer-route", daemon=True).start()

    def _route(self, conn: socket.socket) -> None:
        try:
            cache = self._cache_of(conn)
            if cache is None:
                self.malformed += 1
                return _answer(conn, 400)
            with self._lock:
                handoff = self._routes.get(cache)
            if handoff is None:
                self.unknown += 1
                return _answer(conn, 404)
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as out:  # (socket.send_fds drops the address)
                    out.sendmsg([b"c"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [conn.fileno()]))],
                               0, handoff)
            except OSError as exc:
                log.info("peer request for cache %s: its mount does not take it (%s)", cache, exc.strerror)
                self.unreachable += 1
                return _answer(conn, 503)
            self.handed += 1
            conn.close()  # the mount holds its own copy of the connection now
        finally:
            self._slots.release()

    def _cache_of(self, conn: socket.socket) -> str | None:
        """The cache id of the request line, read without consuming it; None if it does not come or fit."""
        deadline = time.monotonic() + self.peek_timeout
        data = b""
        while b"\n" not in data and len(data) < PEEK_LIMIT:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            conn.settimeout(left)
            try:
                data = conn.recv(PEEK_LIMIT, socket.MSG_PEEK)
            except OSError:
                return None
            if not data:
                return None
            if b"\n" not in data:
                time.sleep(0.005)  # a peek returns at once while anything is buffered: wait for more
        conn.setblocking(True)  # the mount gets the descriptor in blocking mode and sets its own timeouts
        match = REQUEST_LINE.match(data)
        return match.group(1).decode() if match else None


def _answer(conn: socket.socket, status: int) -> None:
    reason = {400: "Bad Request", 404: "Not Found", 503: "Service Unavailable"}[status]
    try:
        conn.settimeout(1.0)
        conn.sendall(f"HTTP/1.1 {status} {reason}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())
    except OSError:
        pass
    finally:
        conn.close()
