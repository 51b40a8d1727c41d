"""Node-to-node block reads of a distributed cache: a small authenticated HTTP protocol.

A node serves the blocks it holds to the other members (`PeerServer`, in the mount process, on the
node's own address) and asks a block's owner before the object store (`PeerClient`). A peer can make a
read slower, never make it fail or return other bytes: the client uses an answer only when it is the
exact block version asked (ETag), of exactly the block's length, with a matching checksum, and returns
None on anything else (refused, timed out, wrong answer), so the caller reads the store.

    GET <prefix>/v1/block?key=<object key>&etag=<etag>&index=<block>&start=<byte>&stop=<byte>&size=<object size>&sum=crc64nvme
    Authorization: Stoker-Peer <unix seconds> <hex HMAC-SHA256(cache key, "<seconds>\\n<path and query>")>

A request asks bytes [start, stop) of one object version, inside its block `index` (a block is owned as a
whole; a random reader's exact range asks the owner of the block it lies in); `size` is the object's size,
so an owner that reads through knows the object without a lookup. `&held=1` (an owner asking another
owner of the same block, R > 1) asks only for what is held: an owner never waits on another owner's
read-through, so two owners reading the same block at once cannot wait on each other. `sum` names the
checksum of the answer (CHECKSUMS: crc64nvme; an ask without it, from an older member, gets sha256).

The prefix is empty when a mount listens on its own address (`--peer-listen`), and `/c/<cache id>` when a
node's one peer port serves every distributed cache of the node (peer_router.py): the router reads the
request line, hands the connection to the mount of that cache (`PeerServer.receive`), and the mount
answers it as its own. The signature covers the whole target, prefix included.

The server answers 200 with the bytes (Content-Length, X-Stoker-ETag, X-Stoker-CRC64NVME or X-Stoker-SHA256 in hex)
when it holds that
exact version; when it does not but owns the block, it reads through: 200 with `X-Stoker-Through: 1` and a
chunked body that is a FETCHING byte every HEARTBEAT seconds while its own GET runs (shared with any GET of
that block on the node, whoever asked), then OK, the bytes and their raw checksum, or FAILED (its GET failed
or took over THROUGH_WAIT: the asker reads the store, the owner is not avoided). The head goes at the first
beat, or with the bytes when they come before it (most do: one write, one wake of the asker). So the asker
tells "fetching" from "gone" by the beats: an owner that stops or hangs is silent for more than the
first-byte bound (or three beats, where that is longer) at any point of the answer, head included, and the
asker gives up on it then. 404 when it neither
holds nor owns the bytes, 503 when it already answers MAX_CLIENTS requests (the asker reads the store; a
busy peer is not avoided), 401 to a request that is not signed with the cache's key or whose time is
more than MAX_SKEW seconds away (nothing is served unauthenticated; a key per DatasetCache keeps one
tenant's nodes from another's blocks), 400 to a malformed one or one outside the node's dataset.
Traffic is not encrypted: see docs/security.md.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import logging
import os
import re
import socket
import threading
import time
import urllib.parse
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import trio

from .cache import Buffer
from .idle import IdlePool
from .sums import CHECKSUMS
from .wire import Malformed, Request, SendAll, Steps, Wire, left, run_on_loop

log = logging.getLogger(__name__)

PATH = "/v1/block"
SCHEME = "Stoker-Peer"
MAX_SKEW = 60.0  # seconds a signed request stays valid (clocks of a cluster's nodes agree within that)
MAX_CLIENTS = 256  # requests a node answers at once; more are told 503 (memory stays bounded); a read-through
# answer is one of them while the owner's GET runs, and every member's read-ahead may ask at once
IDLE_TIMEOUT = 10.0  # seconds a peer connection may stay silent (or not take its answer) before it is closed
POOLED = 32  # idle connections an asker keeps to each peer (a connection per block cost about as much CPU as the
# block's bytes: keep-alive halves the CPU of a 100 KB peer read). As many as the asks a node's walk and read-ahead
# have in flight to one peer: with 2, two asks in three opened a connection (and the owner accepted it)
POOL_IDLE = 5.0  # seconds an idle connection is kept; less than IDLE_TIMEOUT, so a peer rarely closes one first

AVOID = 5.0  # seconds a failed peer is not asked: a dead one then costs a connection refused (or one bound) per
# 5 s, and one that was only stopped or restarting serves again within seconds
HEARTBEAT = 0.1  # seconds between an owner's FETCHING beats while it reads through
THROUGH_WAIT = 3.0  # seconds an owner waits for its own GET for a peer before it answers FAILED
FETCHING, OK, FAILED = b".", b"+", b"-"  # the marks of a read-through body

# How an answer's bytes are checked, by the name an ask gives (`sum`, one of sums.CHECKSUMS): CRC64-NVME costs a tenth
# of SHA-256 (0.35 against 2.7 ms for a 4 MiB block, at each end); an asker that names none (an older member) gets
# SHA-256. Neither is a signature: answers are not authenticated (docs/security.md).
CHECKSUM = "crc64nvme"  # what this version asks for


@dataclass(frozen=True, slots=True)
class BlockAsk:
    """Bytes [start, stop) of one version of an object of `size` bytes, inside its block `index`."""

    key: str
    etag: str
    index: int
    start: int
    stop: int
    size: int
    through: bool = True  # an owner that does not hold the bytes may read them through (not for another owner)
    checksum: str = CHECKSUM  # how the answer's bytes are checked (CHECKSUMS)

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
        """The request's path and query (what urllib's urlencode makes of these fields, built for a few µs)."""
        return (f"{prefix}{PATH}?key={_quote(self.key)}&etag={_quote(self.etag)}&index={self.index}"
                f"&start={self.start}&stop={self.stop}&size={self.size}{'' if self.through else '&held=1'}"
                f"&sum={_quote(self.checksum)}")

    @classmethod
    def parse(cls, query: str) -> "BlockAsk":
        """From a request's query; ValueError when a field is missing or the bytes are not inside the object."""
        fields: dict[str, str] = {}
        for part in query.split("&"):
            name, sep, value = part.partition("=")
            if not sep:
                raise ValueError("a field without a value")
            fields.setdefault(name, value)
        try:
            index, start, stop, size = (int(fields[name]) for name in ("index", "start", "stop", "size"))
            ask = cls(_unquote(fields["key"]), _unquote(fields["etag"]), index, start, stop, size,
                      through=fields.get("held", "0") != "1", checksum=_unquote(fields.get("sum", "sha256")))
        except KeyError as exc:
            raise ValueError(f"missing {exc}") from None
        if ask.index < 0 or not 0 <= ask.start < ask.stop <= ask.size:
            raise ValueError("the bytes asked are not inside the object")
        if not ask.etag.isprintable():  # it is sent back in a header
            raise ValueError("an ETag with control characters")
        if ask.checksum not in CHECKSUMS:
            raise ValueError(f"no checksum named {ask.checksum[:20]!r}")
        return ask


# A node's answer to an ask: the bytes it holds, a Future of the bytes it reads through for the asker
# (its block, owned here), or None (neither). ValueError: the ask does not fit this node's dataset or blocks.
# Called on the server's event loop (the mount's own): it must answer at once, never block.
Lookup = Callable[[BlockAsk], "Buffer | Future | None"]


_PLAIN = re.compile(r'[A-Za-z0-9_.~/"-]*')  # what most keys and ETags are made of: quoted without urllib's loop


def _quote(value: str) -> str:
    """A query value as urllib's quote_plus(value, safe="/") makes it (a few µs less for the usual key)."""
    if _PLAIN.fullmatch(value):
        return value.replace('"', "%22")
    return urllib.parse.quote_plus(value, safe="/")


_QUOTED_PLAIN = re.compile(r'(?:[A-Za-z0-9_.~/-]|%22)*')


def _unquote(value: str) -> str:
    """urllib's unquote_plus, without its loops for what _quote left plain."""
    if _QUOTED_PLAIN.fullmatch(value):
        return value.replace("%22", '"')
    return urllib.parse.unquote_plus(value)


def _mac(key: bytes, seconds: str, target: str) -> str:
    return hmac.digest(key, f"{seconds}\n{target}".encode(), "sha256").hex()


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


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 503: "Service Unavailable"}


def _head(status: int, headers: list[tuple[str, object]], keep_alive: bool) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS[status]}", *(f"{name}: {value}" for name, value in headers)]
    if not keep_alive:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _send(sock: socket.socket, *parts: bytes | memoryview, timeout: float = IDLE_TIMEOUT) -> None:
    """All of `parts` in as few system calls as the socket takes (a head and its block in one sendmsg), from the event
    loop; socket.timeout if the asker takes nothing for `timeout` seconds."""
    views = [memoryview(part).cast("B") for part in parts if len(part)]
    until = time.monotonic() + timeout
    while views:
        try:
            sent = sock.sendmsg(views)
        except BlockingIOError:
            with trio.move_on_after(left(until)) as bound:
                await trio.lowlevel.wait_writable(sock)
            if bound.cancelled_caught:
                raise socket.timeout("the asker took nothing") from None
            until = time.monotonic() + timeout
            continue
        while sent and views:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0] = views[0][sent:]
                sent = 0


# a read-through answer's checksum, by its length (they differ: 8 and 32 bytes)
_SUM_BY_LENGTH = {len(digest(b"")): name for name, digest in CHECKSUMS.items()}


def _named_sum(headers: dict[str, str]) -> tuple[str, str]:
    """The checksum an answer carries (X-Stoker-CRC64NVME, or X-Stoker-SHA256 from an older owner) and its hex."""
    for name in CHECKSUMS:
        if f"x-stoker-{name}" in headers:
            return name, headers[f"x-stoker-{name}"]
    raise ValueError("an answer without a checksum")


class PeerServer:
    """Serves held blocks to the cache's other members from a trio event loop: the mount's (`start(nursery)`: a lookup
    is then a plain call on the loop that owns the cache, no hand-off between threads per request), or one of its
    own in a thread (`start()`). On `address` (host, port; port 0 picks one), or, with `address` None, on the
    connections a node's peer router hands over (`receive`, before `start`)."""

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
        self.max_clients = max_clients
        self.answering = 0  # requests being answered now
        self._listener: socket.socket | None = None
        self.address: tuple[str, int] = ("127.0.0.1", 0)
        if address is not None:
            # The listen backlog: with a small one, a burst of members' requests overflows it and the kernel drops
            # SYNs, which costs the asker a one-second retransmit (past its connect timeout).
            self._listener = socket.create_server(address, backlog=256)
            self._listener.setblocking(False)
            self.address = self._listener.getsockname()[:2]
        self._handoff: socket.socket | None = None
        self._handoff_path: str | None = None
        self._scope: trio.CancelScope | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def receive(self, path: str) -> "PeerServer":
        """Answer the connections a peer router sends to the unix socket `path` (one descriptor a datagram)."""
        if os.path.exists(path):
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.setblocking(False)
        self._handoff, self._handoff_path = sock, path
        return self

    def start(self, nursery: trio.Nursery | None = None) -> "PeerServer":
        """Serve from `nursery`'s event loop (called on it), or from a loop of this server's own in a thread."""
        if nursery is not None:
            self._token = trio.lowlevel.current_trio_token()
            nursery.start_soon(self._serve)
            return self
        started = threading.Event()
        self._thread = threading.Thread(target=trio.run, args=(self._serve, started), name="peer-server", daemon=True)
        self._thread.start()
        started.wait(10)
        return self

    def close(self) -> None:
        """Stop serving (from any thread; the mount's loop may have ended already) and close the sockets."""
        self._closed = True
        scope, token = self._scope, self._token
        if scope is not None and token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(scope.cancel)
        if self._thread is not None:
            self._thread.join(5)
        if self._scope is None:
            self._close_sockets()  # never served: nothing waits on them (else the serving task closes them)
        if self._handoff_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._handoff_path)

    def _close_sockets(self) -> None:
        for sock in (self._listener, self._handoff):
            if sock is not None:
                sock.close()

    async def _serve(self, started: threading.Event | None = None) -> None:
        self._token = trio.lowlevel.current_trio_token()
        try:
            with trio.CancelScope() as scope:
                self._scope = scope
                if started is not None:
                    started.set()
                if self._closed:
                    return
                async with trio.open_nursery() as nursery:
                    if self._listener is not None:
                        nursery.start_soon(self._accept, self._listener, nursery)
                    if self._handoff is not None:
                        nursery.start_soon(self._take_handed, self._handoff, nursery)
        finally:
            self._close_sockets()

    async def _accept(self, listener: socket.socket, nursery: trio.Nursery) -> None:
        while True:
            await trio.lowlevel.wait_readable(listener)
            while True:
                try:
                    conn, _ = listener.accept()
                except BlockingIOError:
                    break
                except OSError as exc:  # out of descriptors, say: the asker reads the store meanwhile
                    log.warning("peer server: cannot accept a connection: %s", exc)
                    await trio.sleep(0.1)
                    break
                nursery.start_soon(self._connection, conn)

    async def _take_handed(self, handoff: socket.socket, nursery: trio.Nursery) -> None:
        while True:
            await trio.lowlevel.wait_readable(handoff)
            try:
                data, fds, _, _ = socket.recv_fds(handoff, 16, 4)
            except BlockingIOError:
                continue
            except OSError:
                return  # closed
            for fd in fds:
                try:
                    conn = socket.socket(fileno=fd)
                    conn.getpeername()
                except OSError:
                    os.close(fd)
                    continue
                nursery.start_soon(self._connection, conn)

    async def _connection(self, sock: socket.socket) -> None:
        """One asker's connection: its requests answered in turn (keep-alive) until it closes, sends something that is
        not a request, stays silent for idle_timeout, or takes no answer for as long."""
        self.connections += 1
        name = _name(sock)
        try:
            sock.setblocking(False)
            # A head and its body go in one sendmsg, but beats are small writes: without NODELAY, Nagle would hold
            # one back until the asker's delayed ACK (up to 40 ms).
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            wire = Wire()
            while True:
                try:
                    request = await run_on_loop(sock, wire.request(time.monotonic() + self.idle_timeout))
                except Malformed as exc:
                    log.debug("peer %s: malformed request: %s", name, exc)
                    return await _send(sock, _head(400, [("Content-Length", 0)], False), timeout=self.idle_timeout)
                if request is None:
                    return
                if self.answering >= self.max_clients:
                    self.busy += 1
                    await _send(sock, _head(503, [("Content-Length", 0)], request.keep_alive), timeout=self.idle_timeout)
                else:
                    self.answering += 1
                    try:
                        await self.answer(sock, request)
                    finally:
                        self.answering -= 1
                if not request.keep_alive:
                    return
        except (ConnectionError, TimeoutError):
            log.debug("peer %s: connection ended", name)  # idle past the bound, gone, or gone mid-answer
        except OSError as exc:
            log.debug("peer %s: connection failed: %s", name, exc)
        except Exception:  # noqa: BLE001 - one connection never ends the server
            log.warning("peer request from %s failed", name, exc_info=True)
        finally:
            sock.close()

    async def answer(self, sock: socket.socket, request: Request) -> None:
        send = functools.partial(_send, sock, timeout=self.idle_timeout)
        if not verify(self.key, request.target, request.authorization, self.clock()):
            self.refused += 1
            return await send(_head(401, [("Content-Length", 0)], request.keep_alive))
        url = urllib.parse.urlsplit(request.target)
        try:
            if url.path != self.path:
                raise ValueError(f"no such path {url.path}")
            ask = BlockAsk.parse(url.query)
            found = self.lookup(ask)
        except ValueError as exc:
            log.debug("peer %s: bad request: %s", _name(sock), exc)
            return await send(_head(400, [("Content-Length", 0)], request.keep_alive))
        if found is None:
            self.missed += 1
            return await send(_head(404, [("Content-Length", 0)], request.keep_alive))
        if isinstance(found, Future):
            return await self._read_through(sock, ask, found, request.keep_alive)
        body = memoryview(found)
        head = _head(200, [("Content-Length", len(body)), ("X-Stoker-ETag", ask.etag),
                           (f"X-Stoker-{ask.checksum.upper()}", CHECKSUMS[ask.checksum](body).hex())], request.keep_alive)
        self._count(len(body))  # before the body: a client may have it all before this task goes on
        await send(head, body)

    def _count(self, nbytes: int) -> None:
        self.served += 1
        self.served_bytes += nbytes
        if self.metrics is not None:
            self.metrics.peer_served_bytes.inc(nbytes)

    async def _read_through(self, sock: socket.socket, ask: BlockAsk, pending: Future, keep_alive: bool) -> None:
        """The bytes this node reads through for the asker: sent with their head in one write when they come within
        a beat (as most do), else the head at the first beat and a FETCHING byte each beat until they come (or
        FAILED)."""
        send = functools.partial(_send, sock, timeout=self.idle_timeout)
        head = _head(200, [("Transfer-Encoding", "chunked"), ("X-Stoker-ETag", ask.etag), ("X-Stoker-Through", 1)],
                     keep_alive)
        done = trio.Event()
        if not pending.done():
            token, loop = trio.lowlevel.current_trio_token(), threading.get_ident()

            def wake(_: Future) -> None:  # (on whichever thread completes it: the loop's own, in a mount)
                if threading.get_ident() == loop:
                    done.set()
                else:
                    with contextlib.suppress(trio.RunFinishedError):
                        token.run_sync_soon(done.set)

            pending.add_done_callback(wake)
        give_up = time.monotonic() + self.through_wait
        while not pending.done() and time.monotonic() < give_up:
            with trio.move_on_after(HEARTBEAT):
                await done.wait()
            if not pending.done() and time.monotonic() < give_up:
                await send(head, b"1\r\n" + FETCHING + b"\r\n")
                head = b""
        data = pending.result() if pending.done() and not pending.cancelled() and pending.exception() is None else None
        # (a GET that failed was logged where it ran: the asker reads the store)
        if data is None or len(data) != ask.length:
            self.through_failed += 1
            if self.metrics is not None:
                self.metrics.peer_read_through.labels(outcome="failed").inc()
            return await send(head, b"1\r\n" + FAILED + b"\r\n0\r\n\r\n")
        body = memoryview(data)
        digest = CHECKSUMS[ask.checksum](body)
        self.through += 1
        if self.metrics is not None:
            self.metrics.peer_read_through.labels(outcome="served").inc()
        self._count(len(body))
        await send(head, f"{1 + len(body) + len(digest):x}\r\n".encode() + OK, body, digest + b"\r\n0\r\n\r\n")


def _name(sock: socket.socket) -> str:
    try:
        return str(sock.getpeername()[0])
    except OSError:
        return "?"


@dataclass
class PeerTimeouts:
    connect: float = 0.2  # seconds to connect to a peer
    first_byte: float = 0.3  # seconds from the request to the answer's status line, and between a read-through's beats
    body: float = 2.0  # seconds for the whole body of one block
    through: float = THROUGH_WAIT + 1.0  # seconds an owner's read-through may beat before its bytes come


class PeerClient:
    """Asks a peer for bytes of one block, from the event loop; None unless the answer is exactly those bytes. A
    peer that failed is avoided for `avoid` seconds, then asked again."""

    def __init__(self, key: bytes, timeouts: PeerTimeouts | None = None, avoid: float = AVOID,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 prefix: str = ""):
        self.key, self.timeouts, self.avoid, self.prefix = key, timeouts or PeerTimeouts(), avoid, prefix
        self.clock, self.wall = clock, wall
        self._avoid_until: dict[str, float] = {}
        self.failures: dict[str, int] = {}
        # idle connections by peer, as plain sockets (wrapped for the loop per ask; closed from anywhere)
        self._idle: IdlePool[str, socket.socket] = IdlePool(POOLED, socket.socket.close, max_age=POOL_IDLE,
                                                             clock=clock)

    def avoided(self, peer: str) -> bool:
        return self._avoid_until.get(peer, 0.0) > self.clock()

    async def fetch(self, peer: str, want: BlockAsk) -> bytearray | None:
        """The bytes `want` from `peer` ("host:port"); None if it cannot (a 404 is no failure: the peer just
        does not hold them)."""
        return (await self.ask(peer, want))[1]

    async def ask(self, peer: str, want: BlockAsk) -> tuple[str, bytearray | None]:
        """(outcome, bytes) of one request: "hit" (held) or "through" (the owner read them from the store for
        this asker) with the bytes; "miss" (neither held nor owned, busy, or the owner's own GET failed),
        "failed" (refused, timed out, silent, a wrong answer: the peer is avoided a while) or "avoided", with None."""
        if self.avoided(peer):
            return "avoided", None
        try:
            return await self._get(peer, want)
        except (OSError, ValueError) as exc:
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

    async def _get(self, peer: str, want: BlockAsk) -> tuple[str, bytearray | None]:
        sock = self._idle.take(peer)
        if sock is not None:
            try:
                return await self._exchange(peer, sock, want)
            except ConnectionError:
                pass  # the peer closed the idle connection meanwhile: ask again on a new one (no failure)
        host, _, port = peer.rpartition(":")
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            with trio.move_on_after(self.timeouts.connect) as bound:
                await trio.socket.from_stdlib_socket(sock).connect((host.strip("[]"), int(port)))  # (non-blocking now)
            if bound.cancelled_caught:
                raise socket.timeout(f"no connection within {self.timeouts.connect:g}s")
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # (see the server's serve)
        except BaseException:
            sock.close()
            raise
        return await self._exchange(peer, sock, want)

    async def _exchange(self, peer: str, sock: socket.socket, want: BlockAsk) -> tuple[str, bytearray | None]:
        """One request on `sock`; the connection goes back to the pool after a complete answer, else is closed."""
        reusable = False
        try:
            outcome, body, reusable = await run_on_loop(sock, self._answer(peer, want))
            return outcome, body
        finally:
            if reusable:
                self._idle.give(peer, sock)
            else:
                sock.close()  # (no task waits on it any more: the ask ended)

    def _answer(self, peer: str, want: BlockAsk) -> Steps[tuple[str, bytearray | None, bool]]:
        """One ask and its answer, checked: (outcome, bytes, whether the connection can carry the next ask)."""
        target = want.target(self.prefix)
        yield SendAll(f"GET {target} HTTP/1.1\r\nHost: {peer}\r\nAuthorization: "
                       f"{sign(self.key, target, self.wall())}\r\n\r\n".encode(),
                       time.monotonic() + self.timeouts.first_byte)
        wire = Wire()
        status, headers = yield from wire.answer_head(time.monotonic() + self._beat())
        keep = headers.get("connection", "").lower() != "close"
        if status in (404, 503):  # not held, or busy: no failure, the store answers this one
            if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
                raise Malformed(f"a {status} with a body")
            return "miss", None, keep and wire.drained()
        if status != 200:
            raise ValueError(f"answered {status}")
        if headers.get("x-stoker-etag") != want.etag:
            raise ValueError("answered another version")
        if headers.get("x-stoker-through"):
            if headers.get("transfer-encoding", "").lower() != "chunked":
                raise Malformed("a read-through answer that is not chunked")
            outcome, body = yield from self._through(wire, want)
        else:
            if headers.get("content-length") != str(want.length) or "transfer-encoding" in headers:
                raise ValueError("answered another length")
            name, digest = _named_sum(headers)
            outcome, body = "hit", (yield from wire.exactly(want.length, time.monotonic() + self.timeouts.body))
            if not hmac.compare_digest(CHECKSUMS[name](body).hex(), digest):
                raise ValueError("checksum mismatch")
        return outcome, body, keep and wire.drained()  # the whole answer was read: the connection carries the next

    def _beat(self) -> float:
        """The longest silence of a live owner: the first-byte bound, or three beats where that is shorter."""
        return max(self.timeouts.first_byte, 3 * HEARTBEAT)

    def _through(self, wire: Wire, want: BlockAsk) -> Steps[tuple[str, bytearray | None]]:
        """A read-through answer: beats while the owner fetches (each within the first-byte bound: a silent owner
        is gone), then the bytes and their checksum, or FAILED (a miss: the owner's store did not answer it)."""
        beat = self._beat()
        give_up = self.clock() + self.timeouts.through
        while True:
            size = int((yield from wire.line(time.monotonic() + beat)).split(b";")[0], 16)
            mark = bytes((yield from wire.exactly(1, time.monotonic() + beat))) if size else b""
            if mark == FETCHING and size == 1:
                yield from wire.crlf(time.monotonic() + beat)
                if self.clock() > give_up:
                    raise socket.timeout("the owner's read-through took too long")
                continue
            if mark == FAILED and size == 1:
                yield from wire.crlf(time.monotonic() + beat)
                if (yield from wire.line(time.monotonic() + beat)) != b"0":
                    raise Malformed("a FAILED read-through answer that goes on")
                yield from wire.crlf(time.monotonic() + beat)
                return "miss", None
            if mark != OK:
                raise ValueError(f"a read-through answer marked {mark!r}")
            name = _SUM_BY_LENGTH.get(size - 1 - want.length)  # an older owner answers SHA-256 whatever is asked
            if name is None:
                raise ValueError("a read-through answer of another length")
            until = time.monotonic() + self.timeouts.body  # for the bytes, their checksum and the answer's end
            body = yield from wire.exactly(want.length, until)
            digest = bytes((yield from wire.exactly(size - 1 - want.length, until)))
            yield from wire.crlf(until)
            if (yield from wire.line(until)) != b"0":
                raise ValueError("a read-through answer longer than asked")
            yield from wire.crlf(until)
            if not hmac.compare_digest(CHECKSUMS[name](body), digest):
                raise ValueError("checksum mismatch")
            return "through", body

    def close(self) -> None:
        """Close the idle connections."""
        self._idle.close()
