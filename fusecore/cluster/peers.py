"""Node-to-node block reads of a distributed cache: a small sealed protocol over HTTP/1.1.

A node serves the blocks it holds to the other members (`PeerServer`, in the mount process, on the
node's own address) and asks a block's owner before the object store (`PeerClient`). A peer can make a
read slower, never make it fail or return other bytes: every ask and answer is sealed with the cache's key
(seal.py: AES-256-GCM, keys per connection and direction, counted nonces), and the client uses an answer only
when it opens and is exactly the block's length; anything else (refused, timed out, forged, wrong) is None, so
the caller reads the store.

A connection opens with an exchange of randoms (the routing line is the only plain thing an asker sends):

    GET <prefix>/v2/hello?r=<asker's 16 random bytes, hex> HTTP/1.1
    -> 200, X-Stoker-Hello: <owner's 16 random bytes, hex>

then carries asks, each sealed under the connection's ask key:

    GET <prefix>/v2/ask/<urlsafe base64 of seal(query)> HTTP/1.1
    query: key=<object key>&etag=<etag>&index=<block>&start=<byte>&stop=<byte>&size=<object size>[&held=1]

A request asks bytes [start, stop) of one object version, inside its block `index` (a block is owned as a
whole; a random reader's exact range asks the owner of the block it lies in); `size` is the asker's view of
the object's size: an owner checks it against its own listing before it reads anything through, and never
keeps bytes on an asker's word. `&held=1` (an owner asking another owner of the same block, R > 1) asks only
for what is held: an owner never waits on another owner's read-through, so two owners reading the same block
at once cannot wait on each other.

An answer is `200` with a chunked body of sealed frames, each a chunk: one kind byte in the clear, then the
payload sealed under the connection's answer key with the kind authenticated beside it. HELD (the bytes it
holds), MISS (neither held nor owned), BUSY (it already answers MAX_CLIENTS asks): one frame. When it does not
hold the bytes but owns the block it reads through: a FETCHING frame every HEARTBEAT seconds while its own GET
runs (shared with any GET of that block on the node, whoever asked), then OK with the bytes, or FAILED (its GET
failed, took over THROUGH_WAIT, or the ask disagreed with its listing: the asker reads the store, the owner is
not avoided). An owner's ask of a block the asked node holds on its disk is answered the same way, HELD or MISS
after the beats of its disk read (HAND_OVER_WAIT at most). The first frame goes with the head, or with the bytes
when they come within a beat (most do: one write, one wake of the asker). So the asker tells "fetching" from "gone" by the beats: an owner that stops or
hangs is silent for more than the first-byte bound (or three beats, where that is longer) at any point of the
answer, head included, and the asker gives up on it then.

In the clear, and then the connection is closed: 401 to an ask that does not open (another key, a replay, an
altered byte) and to a request of the older, unsealed protocol (`/v1/block`: an older member is refused, never
served in clear), 400 to a malformed request or an ask outside the node's dataset or blocks. A node bounds the
connections it keeps, per source and in all; past a bound it sheds silent connections that never opened an
ask first, then idle ones, and refuses a newcomer only when every kept connection is busy answering.

The prefix is empty when a mount listens on its own address (`--peer-listen`), and `/c/<cache id>` when a
node's one peer port serves every distributed cache of the node (router.py): the router reads the
hello's request line, hands the connection to the mount of that cache (`PeerServer.receive`), and the mount
answers it as its own. Keys are derived with the prefix, so an ask sealed for one cache opens for no other.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import logging
import os
import re
import socket
import threading
import time
import urllib.parse
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Iterator

import trio

from .intake import accepted, handed
from ..cache.memory import Buffer
from ..store.idle import IdlePool
from .sources import BySource, source_of
from .seal import RANDOM, TAG, Forged, Scratch, Session, fresh_random
from ..store.wire import Malformed, SendAll, Steps, Wire, left, run_on_loop

log = logging.getLogger(__name__)

HELLO, ASK, OLD = "/v2/hello", "/v2/ask/", "/v1/block"
MAX_CLIENTS = 256  # asks a node answers at once; more are told BUSY (memory stays bounded); a read-through
# answer is one of them while the owner's GET runs, and every member's read-ahead may ask at once
MAX_CONNECTIONS = 2048  # connections a node keeps from all askers (each asker pools POOLED and asks ~64 at once)
MAX_PER_SOURCE = 160  # connections a node keeps from one address: an asker's pool and its asks in flight, with room
IDLE_TIMEOUT = 10.0  # seconds a peer connection may stay silent (or not take its answer) before it is closed
OPENING_TIMEOUT = 2.0  # seconds a connection has to say hello and open its first ask (an asker sends its hello with
# its connect, and its first ask one round trip later)
SHED_PEEKS = 32  # connections never heard from that shedding looks at for one that sent nothing at all
POOLED = 32  # idle connections an asker keeps to each peer (a connection per block cost about as much CPU as the
# block's bytes: keep-alive halves the CPU of a 100 KB peer read). As many as the asks a node's walk and read-ahead
# have in flight to one peer: with 2, two asks in three opened a connection (and the owner accepted it)
POOL_IDLE = 5.0  # seconds an idle connection is kept; less than IDLE_TIMEOUT, so a peer rarely closes one first

AVOID = 5.0  # seconds a failed peer is not asked: a dead one then costs a connection refused (or one bound) per
# 5 s, and one that was only stopped or restarting serves again within seconds
HEARTBEAT = 0.1  # seconds between an owner's FETCHING beats while it reads through
THROUGH_WAIT = 3.0  # seconds an owner waits for its own GET for a peer before it answers FAILED
# The kinds of an answer's frames (one byte in the clear, authenticated with the frame)
HELD, MISS, BUSY, FETCHING, OK, FAILED = b"H", b"0", b"B", b".", b"+", b"-"
_FINAL_EMPTY = {MISS: "miss", BUSY: "miss", FAILED: "miss"}  # frames without bytes that end an answer


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

    @classmethod
    def block(cls, key: str, etag: str, index: int, length: int, block_size: int | None = None,
              size: int | None = None, through: bool = True) -> "BlockAsk":
        """The whole block `index` (`length` bytes; blocks of `block_size`, `length` by default)."""
        start = index * (block_size or length)
        return cls(key, etag, index, start, start + length, size if size is not None else start + length, through)

    @property
    def length(self) -> int:
        return self.stop - self.start

    def query(self) -> str:
        """The ask as a query (what urllib's urlencode makes of these fields, built for a few µs): what is sealed."""
        return (f"key={_quote(self.key)}&etag={_quote(self.etag)}&index={self.index}"
                f"&start={self.start}&stop={self.stop}&size={self.size}{'' if self.through else '&held=1'}")

    @classmethod
    def parse(cls, query: str) -> "BlockAsk":
        """From an ask's query; ValueError when a field is missing or the bytes are not inside the object."""
        fields: dict[str, str] = {}
        for part in query.split("&"):
            name, sep, value = part.partition("=")
            if not sep:
                raise ValueError("a field without a value")
            fields.setdefault(name, value)
        try:
            index, start, stop, size = (int(fields[name]) for name in ("index", "start", "stop", "size"))
            ask = cls(_unquote(fields["key"]), _unquote(fields["etag"]), index, start, stop, size,
                      through=fields.get("held", "0") != "1")
        except KeyError as exc:
            raise ValueError(f"missing {exc}") from None
        if ask.index < 0 or not 0 <= ask.start < ask.stop <= ask.size:
            raise ValueError("the bytes asked are not inside the object")
        if not ask.etag.isprintable():
            raise ValueError("an ETag with control characters")
        return ask


HAND_OVER_WAIT = 1.0  # seconds a disk read for an owner may take (its asker's read waits): then MISS


class HandOver(Future):
    """The bytes of a block a node holds on its disk, read for an owner's ask (a replica's, or the new owner's of a
    block this node owned before the members changed): answered as held (HELD), or MISS where the read finds nothing
    in time; never counted as read through."""


# A node's answer to an ask: the bytes it holds, a Future of the bytes it reads through for the asker
# (its block, owned here) or reads from its disk (a HandOver), or None (neither). ValueError: the ask does not fit
# this node's dataset or blocks. Called on the server's event loop (the mount's own): it must answer at once, never
# block.
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


def cache_prefix(cache_id: str) -> str:
    """The path prefix of one distributed cache's requests on a node's shared peer port."""
    return f"/c/{cache_id}"


def hello_target(prefix: str, mine: bytes) -> str:
    return f"{prefix}{HELLO}?r={mine.hex()}"


def ask_target(prefix: str, sealed: bytes) -> str:
    return prefix + ASK + base64.urlsafe_b64encode(sealed).rstrip(b"=").decode()


def _unbase64(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise Malformed("an ask that is not base64") from None


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized"}


def _head(status: int, headers: list[tuple[str, object]], keep_alive: bool) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS[status]}", *(f"{name}: {value}" for name, value in headers)]
    if not keep_alive:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


_CLOSE_400 = _head(400, [("Content-Length", 0)], False)
_CLOSE_401 = _head(401, [("Content-Length", 0), ("X-Stoker-Protocol", "v2")], False)
_FRAMES = {True: _head(200, [("Transfer-Encoding", "chunked")], True),
           False: _head(200, [("Transfer-Encoding", "chunked")], False)}
_END = b"0\r\n\r\n"


def _chunk(kind: bytes, sealed: bytes | memoryview) -> list[bytes | memoryview]:
    """One sealed frame as a chunk: its size line and kind, the sealed payload, its CRLF."""
    return [f"{1 + len(sealed):x}\r\n".encode() + kind, sealed, b"\r\n"]


def _frame(session: Session, kind: bytes) -> list[bytes | memoryview]:
    """A frame without bytes (a beat, or MISS, BUSY, FAILED), sealed."""
    return _chunk(kind, session.seal_answer(kind))


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


@dataclass(eq=False)
class _Kept:
    """A connection the server keeps: where from, whether an ask of it opened, whether it waits for its next ask."""

    source: str
    sock: socket.socket
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    heard: bool = False  # a request of it was read
    opened: bool = False
    idle: bool = True

    def silent(self) -> bool:
        """Nothing read from it yet, and nothing waiting to be read (an asker sends its hello with its connect)."""
        if self.heard:
            return False
        try:
            return not self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:  # nothing waiting (BlockingIOError), or gone
            return True


class PeerServer:
    """Serves held blocks to the cache's other members from a trio event loop: the mount's (`start(nursery)`: a lookup
    is then a plain call on the loop that owns the cache, no hand-off between threads per request), or one of its
    own in a thread (`start()`). On `address` (host, port; port 0 picks one), or, with `address` None, on the
    connections a node's peer router hands over (`receive`, before `start`)."""

    def __init__(self, address: tuple[str, int] | None, key: bytes, lookup: Lookup, metrics=None,
                 max_clients: int = MAX_CLIENTS, prefix: str = "", idle_timeout: float = IDLE_TIMEOUT,
                 max_connections: int = MAX_CONNECTIONS, max_per_source: int = MAX_PER_SOURCE):
        if not key:
            raise ValueError("a peer key is required: nothing is served unsealed")
        self.key, self.lookup, self.metrics = key, lookup, metrics
        self.prefix = prefix
        self.served = self.refused = self.missed = self.busy = self.served_bytes = self.connections = 0
        self.through = self.through_failed = 0  # answers read through for a peer (its store GET), and failed ones
        self.shed = self.turned_away = 0  # connections closed to make room, and ones refused for want of it
        self.through_wait = THROUGH_WAIT
        self.idle_timeout = idle_timeout
        self.max_clients, self.max_connections, self.max_per_source = max_clients, max_connections, max_per_source
        self.answering = 0  # requests being answered now
        self._scratch = Scratch()
        self._kept: BySource[_Kept] = BySource()  # the connections kept, oldest first
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
        async for conn in accepted(listener, "peer server"):  # (a failure to accept: the asker reads the store)
            nursery.start_soon(self._connection, conn)

    async def _take_handed(self, handoff: socket.socket, nursery: trio.Nursery) -> None:
        async for conn in handed(handoff):
            nursery.start_soon(self._connection, conn)

    def rekey(self, key: bytes) -> None:
        """A new key for the cache: connections opened under the old one are closed (their sessions' keys come from
        it), on the serving loop, so a member cut off by a new key keeps no connection."""
        self.key = key
        token = self._token
        if token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(self._drop_all)

    def _drop_all(self) -> None:
        for kept in list(self._kept.all):
            self._kept.discard(kept)
            kept.scope.cancel()

    def _keep(self, source: str, sock: socket.socket) -> _Kept | None:
        """Room for a connection from `source` within both bounds (a connection of that source shed first when it
        is at its own); None when every connection that could make room is busy answering."""
        if self._kept.count(source) >= self.max_per_source and not self._shed(lambda: self._kept.of(source)):
            return None
        if len(self._kept) >= self.max_connections and not self._shed(lambda: iter(self._kept.all)):
            return None
        kept = _Kept(source, sock)
        self._kept.add(source, kept)
        return kept

    def _shed(self, among: Callable[[], Iterator[_Kept]]) -> bool:
        """Close the oldest connection that never said anything, else the oldest that never opened an ask, else the
        oldest idle one (its asker opens another when it next asks); False if all are answering."""
        unheard = (k for k in among() if not k.heard)
        victim = (next((k for _, k in zip(range(SHED_PEEKS), unheard) if k.silent()), None)
                  or next((k for k in among() if not k.opened), None) or next((k for k in among() if k.idle), None))
        if victim is None:
            return False
        self._kept.discard(victim)
        victim.scope.cancel()  # (its task closes the socket)
        self.shed += 1
        return True

    async def _connection(self, sock: socket.socket) -> None:
        """One asker's connection: its hello, then its asks answered in turn (keep-alive) until it closes, sends
        something that is not the protocol, stays silent for idle_timeout, or takes no answer for as long."""
        self.connections += 1
        name = _name(sock)
        kept = self._keep(source_of(name), sock)
        if kept is None:
            self.turned_away += 1
            sock.close()
            return
        try:
            with kept.scope:
                await self._converse(sock, kept)
        except (ConnectionError, TimeoutError):
            log.debug("peer %s: connection ended", name)  # idle past the bound, gone, or gone mid-answer
        except OSError as exc:
            log.debug("peer %s: connection failed: %s", name, exc)
        except Exception:  # noqa: BLE001 - one connection never ends the server
            log.warning("peer request from %s failed", name, exc_info=True)
        finally:
            self._kept.discard(kept)
            sock.close()

    async def _converse(self, sock: socket.socket, kept: _Kept) -> None:
        sock.setblocking(False)
        # A head and its body go in one sendmsg, but beats are small writes: without NODELAY, Nagle would hold
        # one back until the asker's delayed ACK (up to 40 ms).
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send = functools.partial(_send, sock, timeout=self.idle_timeout)
        wire = Wire()
        session: Session | None = None
        while True:
            kept.idle = True
            wait = self.idle_timeout if kept.opened else min(self.idle_timeout, OPENING_TIMEOUT)
            try:
                request = await run_on_loop(sock, wire.request(time.monotonic() + wait))
                if request is None:
                    return
                kept.idle, kept.heard = False, True
                path, _, query = request.target.partition("?")
                if session is None and path == self.prefix + HELLO:
                    session, mine = self._hello(query)
                    await send(_head(200, [("Content-Length", 0), ("X-Stoker-Hello", mine.hex())], request.keep_alive))
                elif session is not None and path.startswith(self.prefix + ASK):
                    plain = session.open_ask(_unbase64(path[len(self.prefix) + len(ASK):]))
                    kept.opened = True
                    if not await self.answer(sock, session, plain, request.keep_alive):
                        return
                elif path in (self.prefix + OLD, self.prefix + HELLO) or path.startswith(self.prefix + ASK):
                    raise Forged("an unsealed ask (an older member), a second hello, or an ask before the hello")
                else:
                    raise Malformed(f"no such path {path[:80]!r}")
            except Forged as exc:
                self.refused += 1
                log.debug("peer %s: refused: %s", kept.source, exc)
                return await send(_CLOSE_401)
            except Malformed as exc:
                log.debug("peer %s: malformed request: %s", kept.source, exc)
                return await send(_CLOSE_400)
            if not request.keep_alive:
                return

    def _hello(self, query: str) -> tuple[Session, bytes]:
        name, _, value = query.partition("=")
        try:
            theirs = bytes.fromhex(value) if name == "r" else b""
        except ValueError:
            theirs = b""
        if len(theirs) != RANDOM:
            raise Malformed("a hello without the asker's random")
        mine = fresh_random()
        return Session(self.key, theirs, mine, self.prefix), mine

    async def answer(self, sock: socket.socket, session: Session, plain: bytes, keep_alive: bool) -> bool:
        """Answer one opened ask; False when the connection is to be closed (the ask was refused)."""
        send = functools.partial(_send, sock, timeout=self.idle_timeout)
        head = _FRAMES[keep_alive]
        if self.answering >= self.max_clients:
            self.busy += 1
            await send(head, *_frame(session, BUSY), _END)
            return True
        self.answering += 1
        try:
            try:
                ask = BlockAsk.parse(plain.decode())
                found = self.lookup(ask)
            except (ValueError, UnicodeDecodeError) as exc:
                log.debug("peer %s: bad request: %s", _name(sock), exc)
                await send(_CLOSE_400)
                return False
            if found is None:
                self.missed += 1
                await send(head, *_frame(session, MISS), _END)
            elif isinstance(found, Future):
                await self._read_through(sock, session, ask, found, head)
            else:
                self._count(len(found))  # before the body: a client may have it all before this task goes on
                await self._send_bytes(sock, session, HELD, memoryview(found), head)
            return True
        finally:
            self.answering -= 1

    def _count(self, nbytes: int) -> None:
        self.served += 1
        self.served_bytes += nbytes
        if self.metrics is not None:
            self.metrics.peer_served_bytes.inc(nbytes)

    async def _read_through(self, sock: socket.socket, session: Session, ask: BlockAsk, pending: Future,
                            head: bytes) -> None:
        """The bytes this node reads through for the asker: sent with their head in one write when they come within
        a beat (as most do), else the head at the first beat and a FETCHING frame each beat until they come (or
        FAILED)."""
        send = functools.partial(_send, sock, timeout=self.idle_timeout)
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
        give_up = time.monotonic() + (min(self.through_wait, HAND_OVER_WAIT) if isinstance(pending, HandOver)
                                      else self.through_wait)
        while not pending.done() and time.monotonic() < give_up:
            with trio.move_on_after(HEARTBEAT):
                await done.wait()
            if not pending.done() and time.monotonic() < give_up:
                await send(head, *_frame(session, FETCHING))
                head = b""
        data = pending.result() if pending.done() and not pending.cancelled() and pending.exception() is None else None
        if isinstance(pending, HandOver):
            return await self._hand_over(sock, session, ask, data, head)
        # (a GET that failed was logged where it ran: the asker reads the store)
        if data is None or len(data) != ask.length:
            self.through_failed += 1
            if self.metrics is not None:
                self.metrics.peer_read_through.labels(outcome="failed").inc()
            return await send(head, *_frame(session, FAILED), _END)
        self.through += 1
        if self.metrics is not None:
            self.metrics.peer_read_through.labels(outcome="served").inc()
        self._count(len(data))
        await self._send_bytes(sock, session, OK, memoryview(data), head)

    async def _hand_over(self, sock: socket.socket, session: Session, ask: BlockAsk, data: "Buffer | None",
                         head: bytes) -> None:
        if data is None or len(data) != ask.length:
            self.missed += 1
            return await _send(sock, head, *_frame(session, MISS), _END, timeout=self.idle_timeout)
        self._count(len(data))
        await self._send_bytes(sock, session, HELD, memoryview(data), head)

    async def _send_bytes(self, sock: socket.socket, session: Session, kind: bytes, body: memoryview,
                          head: bytes) -> None:
        """The final frame with `body`, sealed into a reused buffer (sent, so the kernel has a copy, before it is
        reused)."""
        sealed = self._scratch.take(len(body) + TAG)
        try:
            session.seal_answer_into(kind, body, sealed)
            await _send(sock, head, *_chunk(kind, sealed), _END, timeout=self.idle_timeout)
        finally:
            self._scratch.give(sealed)


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


@dataclass(eq=False)
class _Conn:
    """A connection to a peer and its session (None until its hello was answered)."""

    sock: socket.socket
    session: Session | None = None

    def close(self) -> None:
        self.sock.close()


class PeerClient:
    """Asks a peer for bytes of one block, from the event loop; None unless the answer opens and is exactly those
    bytes. A peer that failed is avoided for `avoid` seconds, then asked again."""

    def __init__(self, key: bytes, timeouts: PeerTimeouts | None = None, avoid: float = AVOID,
                 clock: Callable[[], float] = time.monotonic, prefix: str = ""):
        self.key, self.timeouts, self.avoid, self.prefix = key, timeouts or PeerTimeouts(), avoid, prefix
        self.clock = clock
        self._avoid_until: dict[str, float] = {}
        self.failures: dict[str, int] = {}
        # idle connections by peer, with their sessions (sockets wrapped for the loop per ask; closed from anywhere)
        self._idle: IdlePool[str, _Conn] = IdlePool(POOLED, _Conn.close, max_age=POOL_IDLE, clock=clock)
        self._scratch = Scratch()  # (asks run on one event loop)

    def avoided(self, peer: str) -> bool:
        return self._avoid_until.get(peer, 0.0) > self.clock()

    async def fetch(self, peer: str, want: BlockAsk) -> bytearray | None:
        """The bytes `want` from `peer` ("host:port"); None if it cannot (a miss is no failure: the peer just
        does not hold them)."""
        return (await self.ask(peer, want))[1]

    async def ask(self, peer: str, want: BlockAsk) -> tuple[str, bytearray | None]:
        """(outcome, bytes) of one ask: "hit" (held) or "through" (the owner read them from the store for
        this asker) with the bytes; "miss" (neither held nor owned, busy, or the owner's own GET failed),
        "failed" (refused, timed out, silent, forged, a wrong answer: the peer is avoided a while) or "avoided",
        with None."""
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
        conn = self._idle.take(peer)
        if conn is not None:
            try:
                return await self._exchange(peer, conn, want)
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
        return await self._exchange(peer, _Conn(sock), want)

    async def _exchange(self, peer: str, conn: _Conn, want: BlockAsk) -> tuple[str, bytearray | None]:
        """One ask on `conn` (its hello first if it is new); the connection goes back to the pool after a complete
        answer, else is closed."""
        reusable = False
        try:
            outcome, body, reusable = await run_on_loop(conn.sock, self._answer(peer, conn, want))
            return outcome, body
        finally:
            if reusable:
                self._idle.give(peer, conn)
            else:
                conn.close()  # (no task waits on it any more: the ask ended)

    def _answer(self, peer: str, conn: _Conn, want: BlockAsk) -> Steps[tuple[str, bytearray | None, bool]]:
        """One ask and its answer, opened and checked: (outcome, bytes, whether the connection can carry the next)."""
        wire = Wire()
        if conn.session is None:
            mine = fresh_random()
            yield SendAll(f"GET {hello_target(self.prefix, mine)} HTTP/1.1\r\nHost: {peer}\r\n\r\n".encode(),
                          time.monotonic() + self.timeouts.first_byte)
            status, headers = yield from wire.answer_head(time.monotonic() + self.timeouts.first_byte)
            if status in (404, 503):  # a node's router: no mount of this cache there, or it does not take it now
                return "miss", None, False
            if status != 200:
                raise ValueError(f"answered {status}")
            if headers.get("content-length") != "0" or headers.get("connection", "").lower() == "close":
                raise Malformed("a hello answered with a body, or closed")
            try:
                theirs = bytes.fromhex(headers.get("x-stoker-hello", ""))
            except ValueError:
                raise Malformed("a hello answered without the owner's random") from None
            conn.session = Session(self.key, mine, theirs, self.prefix)
        session = conn.session
        target = ask_target(self.prefix, session.seal_ask(want.query().encode()))
        yield SendAll(f"GET {target} HTTP/1.1\r\nHost: {peer}\r\n\r\n".encode(),
                      time.monotonic() + self.timeouts.first_byte)
        status, headers = yield from wire.answer_head(time.monotonic() + self._beat())
        keep = headers.get("connection", "").lower() != "close"
        if status != 200:
            raise ValueError(f"answered {status}")
        if headers.get("transfer-encoding", "").lower() != "chunked" or "content-length" in headers:
            raise Malformed("an answer that is not sealed frames")
        outcome, body = yield from self._frames(wire, session, want)
        return outcome, body, keep and wire.drained()  # the whole answer was read: the connection carries the next

    def _beat(self) -> float:
        """The longest silence of a live owner: the first-byte bound, or three beats where that is shorter."""
        return max(self.timeouts.first_byte, 3 * HEARTBEAT)

    def _frames(self, wire: Wire, session: Session, want: BlockAsk) -> Steps[tuple[str, bytearray | None]]:
        """An answer's frames: beats while the owner reads through (each within the first-byte bound: a silent owner
        is gone), then the bytes (HELD, OK) or a frame without them (MISS, BUSY, FAILED: a miss); each opened."""
        beat = self._beat()
        give_up = self.clock() + self.timeouts.through
        while True:
            size = int((yield from wire.line(time.monotonic() + beat)).split(b";")[0], 16)
            if size < 1 + TAG:
                raise Malformed("a frame shorter than its seal")
            kind = bytes((yield from wire.exactly(1, time.monotonic() + beat)))
            length = size - 1 - TAG
            if kind in (HELD, OK):
                if length != want.length:
                    raise ValueError("answered another length")
                until = time.monotonic() + self.timeouts.body  # for the bytes and the answer's end
                sealed = self._scratch.take(size - 1)
                try:
                    yield from wire.exactly_into(sealed, until)
                    body = bytearray(length)
                    session.open_answer_into(kind, sealed, body)
                finally:
                    self._scratch.give(sealed)
                yield from _end(wire, until)
                return ("hit" if kind == HELD else "through"), body
            if length:
                raise ValueError(f"a frame {kind!r} with bytes")
            until = time.monotonic() + beat
            session.open_answer_into(kind, (yield from wire.exactly(TAG, until)), bytearray())
            if kind == FETCHING:
                yield from wire.crlf(until)
                if self.clock() > give_up:
                    raise socket.timeout("the owner's read-through took too long")
                continue
            if kind not in _FINAL_EMPTY:
                raise ValueError(f"a frame of kind {kind!r}")
            yield from _end(wire, until)
            return _FINAL_EMPTY[kind], None

    def close(self) -> None:
        """Close the idle connections."""
        self._idle.close()


def _end(wire: Wire, until: float) -> Steps[None]:
    """A final frame's CRLF and the chunked body's end."""
    yield from wire.crlf(until)
    if (yield from wire.line(until)) != b"0":
        raise Malformed("an answer that goes on past its final frame")
    yield from wire.crlf(until)
