"""One peer port per node for every distributed cache a node serves (the CSI node plugin runs it).

A node may hold several distributed caches, each in its own mount process. Rather than a port per
mount, the router listens on the node's one peer address, reads a connection's request line without
consuming it (MSG_PEEK), and passes the connection itself (its descriptor, SCM_RIGHTS) to the mount
that serves the cache named in the path, `/c/<cache id>/...` (peers.cache_prefix). The mount reads the
request and answers as if it had accepted the connection; no byte of a block goes through the router.

The router holds no key and opens nothing: the mount does (its keys are derived with its own cache's key and
id, so an ask sealed for one cache opens for no other). An unknown cache is
answered 404, a mount that does not take the connection 503: both are a miss for the asker, which
then reads the store. A connection that sends no request line within peek_timeout, or something that
is not one, is answered 400.

Anyone who reaches the port may open connections and send nothing, so waiting costs the router no
thread: one thread runs a selector over the listener and every connection whose request line is
awaited (non-blocking; a request line that came with its connection is routed at accept). At
most `max_per_source` connections of one source (an address; an IPv6 one's /64) and `max_waiting` in
all are held at once. Past a bound the router sheds a connection it already holds rather than refuse
the newcomer, which may be an asker that sends its request line at once: the oldest waiting one of the
newcomer's source, else the oldest waiting one of all (503, a miss if it was an asker after all). So a
flood of silent connections from a few sources costs their own oldest connections, never an asker
that sends promptly; and since connections are held by the one thread, not a thread each, the
router's descriptors stay within the bounds (max_waiting is also kept to half the process's limit).

The hand-off is a non-blocking send to the mount's unix socket. A mount that is gone is answered 503
at once; one whose socket is full (it is busy taking others) is tried again for HANDOFF_WAIT, then
answered 503. Out of descriptors, the router stops accepting for ACCEPT_BACKOFF, then tries again
(the connections meanwhile wait in the listen backlog).
"""

from __future__ import annotations

import array
import errno
import logging
import re
import resource
import selectors
import socket
import threading
import time

from .sources import BySource, source_of

log = logging.getLogger(__name__)

REQUEST_LINE = re.compile(rb"^GET /c/([0-9a-f]{8,64})/\S* HTTP/1\.[01]\r?\n")
PEEK_LIMIT = 8192  # bytes of a request line read at most
PEEK_TIMEOUT = 1.0  # seconds a connection has to send its request line
MAX_WAITING = 1024  # connections held at once (awaiting their request line or their mount); past it the oldest is shed
MAX_PER_SOURCE = 32  # connections of one source awaiting their request line; past it that source's oldest is shed
HANDOFF_WAIT = 0.5  # seconds a connection waits for a mount whose socket is full, then it is told 503
HANDOFF_RETRY = 0.005  # seconds between tries to hand a connection to a mount whose socket is full
ACCEPT_BACKOFF = 0.1  # seconds the router stops accepting when out of descriptors (or memory)
ACCEPT_BATCH = 16  # connections accepted at most before the waiting ones are looked at again
PARK = 0.02  # seconds a connection reported readable with nothing new is not watched (no busy loop)
SHED_LOG_EVERY = 60.0  # seconds between warnings that connections are being shed

_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_LISTENER, _WAKER = "listener", "waker"


class _Waiting:
    """A connection whose request line is awaited."""

    __slots__ = ("conn", "source", "deadline", "seen", "watched")

    def __init__(self, conn: socket.socket, source: str, deadline: float):
        self.conn, self.source, self.deadline = conn, source, deadline
        self.seen = 0  # bytes of it peeked so far
        self.watched = False  # registered with the selector (not while parked)


class _Stalled:
    """A routed connection whose mount's socket was full."""

    __slots__ = ("cache", "handoff", "deadline")

    def __init__(self, cache: str, handoff: str, deadline: float):
        self.cache, self.handoff, self.deadline = cache, handoff, deadline


class PeerRouter:
    """Listens on `address` (host, port; port 0 picks one) and hands each connection to its cache's mount.

    Counters: handed (to a mount), unknown (404: no such cache here), unreachable (503: its mount is gone),
    malformed (400: not a request line, or closed before one), expired (400: no request line in peek_timeout),
    shed (503: dropped, still silent, to make room under a bound), busy (503: the mount's socket stayed full, or
    the router is full of connections waiting for their mounts)."""

    def __init__(self, address: tuple[str, int], peek_timeout: float = PEEK_TIMEOUT,
                 max_waiting: int = MAX_WAITING, max_per_source: int = MAX_PER_SOURCE):
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._listener = socket.create_server(address, family=family, backlog=256)
        self._listener.setblocking(False)
        self.address = self._listener.getsockname()[:2]
        self.peek_timeout = peek_timeout
        self.max_waiting = max(1, min(max_waiting, _descriptor_share()))
        self.max_per_source = max(1, max_per_source)
        self._routes: dict[str, str] = {}  # cache id -> the mount's handoff socket
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # unbound: sends to each mount by path
        self._out.setblocking(False)
        # Connections awaiting their request line, oldest first (each has the same peek_timeout, so this is also
        # the order of their deadlines), and the same by source; those parked a while, by when they are watched again.
        self._waiting: dict[socket.socket, _Waiting] = {}
        self._sources: BySource[socket.socket] = BySource()  # the waiting connections by source, oldest first
        self._parked: dict[socket.socket, float] = {}
        self._stalled: dict[socket.socket, _Stalled] = {}  # routed, its mount's socket full: tried again, oldest first
        self._accept_again: float | None = None  # when the router accepts again (out of descriptors meanwhile)
        self._shed_logged = float("-inf")
        self.handed = self.unknown = self.unreachable = self.malformed = self.busy = 0
        self.shed = self.expired = 0

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
        if self._thread is None and not self._closed.is_set():
            self._thread = threading.Thread(target=self._run, name="peer-router", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop routing and close the listener and every connection not handed over yet."""
        self._closed.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5)
        if thread is None or not thread.is_alive():
            self._release()

    # The router's thread.

    def _run(self) -> None:
        sel = self._selector
        try:
            sel.register(self._wake_r, selectors.EVENT_READ, _WAKER)
            sel.register(self._listener, selectors.EVENT_READ, _LISTENER)
            while not self._closed.is_set():
                events = sel.select(self._until_due())
                accept = False
                for key, _ in events:  # the waiting connections first, then the newcomers
                    if key.data is _LISTENER:
                        accept = True
                    elif key.data is _WAKER:
                        self._drain_waker()
                    elif isinstance(key.data, _Waiting) and key.data.conn in self._waiting:
                        self._settled(key.data)
                if self._closed.is_set():
                    break
                if accept:
                    self._accept()
                self._on_time(time.monotonic())
        except Exception:  # noqa: BLE001 - a bug here must not leave the node's peer port silently dead
            log.exception("peer router stopped")
        finally:
            self._release()

    def _until_due(self) -> float | None:
        """Seconds until the next deadline, retry or resumption; None if nothing is due."""
        due: list[float] = []
        if self._waiting:
            due.append(next(iter(self._waiting.values())).deadline)
        if self._parked:
            due.append(next(iter(self._parked.values())))
        if self._stalled:
            due.append(time.monotonic() + HANDOFF_RETRY)
        if self._accept_again is not None:
            due.append(self._accept_again)
        return max(0.0, min(due) - time.monotonic()) if due else None

    def _on_time(self, now: float) -> None:
        while self._waiting:
            first = next(iter(self._waiting.values()))
            if first.deadline > now:
                break
            self._forget(first)
            self.expired += 1
            answer_status(first.conn, 400)
        while self._parked:
            conn, when = next(iter(self._parked.items()))
            if when > now:
                break
            del self._parked[conn]
            self._watch(self._waiting[conn])
        if self._stalled:
            self._retry_stalled(now)
        if self._accept_again is not None and self._accept_again <= now:
            self._accept_again = None
            self._selector.register(self._listener, selectors.EVENT_READ, _LISTENER)

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, peer = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:  # do not spin: the connections wait in the backlog meanwhile
                    log.warning("peer router: cannot accept a connection (%s); again in %gs", exc.strerror,
                                ACCEPT_BACKOFF)
                    self._selector.unregister(self._listener)
                    self._accept_again = time.monotonic() + ACCEPT_BACKOFF
                    return
                continue  # that connection is gone already (reset before it was accepted)
            try:
                conn.setblocking(False)
                source = source_of(peer[0])
            except (OSError, ValueError):
                conn.close()
                continue
            self._admit(_Waiting(conn, source, time.monotonic() + self.peek_timeout))

    def _admit(self, new: _Waiting) -> None:
        """A newcomer: routed at once if its request line came with it, else held (making room for it if need be)."""
        if self._settled(new):
            return
        if self._sources.count(new.source) >= self.max_per_source:
            self._shed(self._waiting[next(self._sources.of(new.source))])
        elif self._held() >= self.max_waiting and self._waiting:
            self._shed(next(iter(self._waiting.values())))
        if self._held() >= self.max_waiting:  # all held are routed, waiting for their mounts: no silent one to shed
            self.busy += 1
            return answer_status(new.conn, 503)
        self._waiting[new.conn] = new
        self._sources.add(new.source, new.conn)
        self._watch(new)  # (a first look finds something new or nothing: it never parks)

    def _settled(self, waiting: _Waiting) -> bool:
        """Peek at what the connection sent: True once it is handed over or answered (or waits for its mount), False
        while its line is awaited."""
        conn = waiting.conn
        try:
            data = conn.recv(PEEK_LIMIT, socket.MSG_PEEK)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if b"\n" not in data and 0 < len(data) < PEEK_LIMIT:  # part of a line: wait for the rest
            if len(data) > waiting.seen:
                waiting.seen = len(data)
                try:  # readable again once more has come (poll honours it), not while this part is all there is
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, len(data) + 1)
                except OSError:
                    pass
            else:  # readable with nothing new (a half-close, memory pressure, no SO_RCVLOWAT): look again later
                self._park(waiting)
            return False
        # No longer watched, before it is closed: a descriptor handed over keeps its connection open, and the selector
        # (epoll) would report it for ever, under a number this process no longer has.
        self._forget(waiting)
        match = REQUEST_LINE.match(data)
        if match is None:
            self.malformed += 1
            answer_status(conn, 400)
            return True
        cache = match.group(1).decode()
        with self._lock:
            handoff = self._routes.get(cache)
        if handoff is None:
            self.unknown += 1
            answer_status(conn, 404)
            return True
        try:  # the mount gets the descriptor as accepted: blocking, reading from the first byte, no low mark
            if waiting.seen:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            conn.setblocking(True)
        except OSError:
            self.malformed += 1
            answer_status(conn, 400)
            return True
        if self._hand(conn, cache, handoff) is None:  # its mount's socket is full: held, and tried again
            if self._held() >= self.max_waiting and self._waiting:
                self._shed(next(iter(self._waiting.values())))
            if self._held() >= self.max_waiting:
                self.busy += 1
                answer_status(conn, 503)
            else:
                self._stalled[conn] = _Stalled(cache, handoff, time.monotonic() + HANDOFF_WAIT)
        return True

    def _hand(self, conn: socket.socket, cache: str, handoff: str) -> bool | None:
        """Pass the connection to its mount: True if done or answered 503, None if the mount's socket is full."""
        self.handed += 1  # before the send: counted by the time the mount has it
        try:
            self._out.sendmsg([b"c"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [conn.fileno()]))],
                              0, handoff)
        except BlockingIOError:
            self.handed -= 1
            return None
        except OSError as exc:
            self.handed -= 1
            log.info("peer request for cache %s: its mount does not take it (%s)", cache, exc.strerror)
            self.unreachable += 1
            answer_status(conn, 503)
            return True
        conn.close()  # the mount holds its own copy of the connection now
        return True

    def _retry_stalled(self, now: float) -> None:
        full: set[str] = set()  # mounts whose socket is still full this round: their later connections wait
        for conn, stalled in list(self._stalled.items()):
            if stalled.handoff in full:
                continue
            if self._hand(conn, stalled.cache, stalled.handoff) is None:
                if stalled.deadline > now:
                    full.add(stalled.handoff)
                    continue
                log.info("peer request for cache %s: its mount takes no connection (%gs)", stalled.cache, HANDOFF_WAIT)
                self.busy += 1
                answer_status(conn, 503)
            del self._stalled[conn]

    def _shed(self, waiting: _Waiting) -> None:
        self._forget(waiting)
        self.shed += 1
        now = time.monotonic()
        if now - self._shed_logged >= SHED_LOG_EVERY:
            self._shed_logged = now
            log.warning("peer router: shedding connections that send no request line (the oldest of %s; %d others "
                        "waiting, %d shed so far)", waiting.source, len(self._waiting), self.shed)
        answer_status(waiting.conn, 503)

    def _held(self) -> int:
        return len(self._waiting) + len(self._stalled)

    def _watch(self, waiting: _Waiting) -> None:
        self._selector.register(waiting.conn, selectors.EVENT_READ, waiting)
        waiting.watched = True

    def _park(self, waiting: _Waiting) -> None:
        if waiting.watched:
            self._selector.unregister(waiting.conn)
            waiting.watched = False
        self._parked[waiting.conn] = time.monotonic() + PARK

    def _forget(self, waiting: _Waiting) -> None:
        """No longer awaited nor watched (the caller closes or hands over the connection; a newcomer: nothing to do)."""
        conn = waiting.conn
        self._waiting.pop(conn, None)
        self._sources.discard(conn)
        self._parked.pop(conn, None)
        if waiting.watched:
            self._selector.unregister(conn)
            waiting.watched = False

    def _drain_waker(self) -> None:
        try:
            self._wake_r.recv(64)
        except OSError:
            pass

    def _release(self) -> None:
        for conn in [*self._waiting, *self._stalled]:
            conn.close()
        self._waiting.clear()
        self._sources.clear()
        self._parked.clear()
        self._stalled.clear()
        self._selector.close()
        for sock in (self._listener, self._wake_r, self._wake_w, self._out):
            sock.close()


def _descriptor_share() -> int:
    """Half the descriptors the process may open: the most connections the router holds at once, whatever asked."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        soft = resource.RLIM_INFINITY
    return 1 << 30 if soft == resource.RLIM_INFINITY else soft // 2


def answer_status(conn: socket.socket, status: int) -> None:
    """Answer and close without ever blocking the router (or a mount's hub: process/peerfanout.py) (the answer fits an accepted connection's empty buffer)."""
    reason = {400: "Bad Request", 404: "Not Found", 503: "Service Unavailable"}[status]
    try:
        conn.recv(65536, socket.MSG_DONTWAIT)  # what the asker sent: closed unread, it would reset the answer
    except OSError:
        pass
    try:
        conn.send(f"HTTP/1.1 {status} {reason}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode(),
                  socket.MSG_DONTWAIT)
    except OSError:
        pass
    finally:
        conn.close()
