"""A writable mount served by several workers: what writes is relayed to the hub, which alone writes.

The kernel hands each request to whichever worker reads first, so the WRITEs of one file reach every worker, while a
file is one multipart upload, in order, within one part budget for the mount. So a worker answers no write-side
request itself: it sends the request as the kernel sent it (its header and argument) to the hub's relay socket and
answers the kernel with what the hub answered. The hub answers with the same FUSE adapter (adapter.py) over a data
path of its own that writes (read/writes.py), and tells every worker what changed before it answers
(messages.PathNews: a file being written, written, gone, a directory made; process/hubwrites.py), so that any worker
lists and opens it at once.

The socket is in the mount's private shared folder (0700, the mount's user): only that user reaches it, who can
write through the mount anyway. One connection carries one request at a time; a worker keeps a few open.

Frames: a request is its length (4 bytes, little-endian) then the request's bytes; an answer is its body's length and
an errno (0: the body is the reply), then the body.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
from typing import Awaitable, Callable, Sequence

import trio

from . import protocol as p
from .session import Buffer, FuseError

log = logging.getLogger(__name__)

FRAME = struct.Struct("<I")
ANSWER = struct.Struct("<Ii")
MAX_REQUEST = 16 * 1024 * 1024  # (a WRITE carries at most max_write bytes: 1 MiB)
IDLE_KEPT = 32  # connections a worker keeps open to the hub
CONNECT_TRIES = 5
SOCKET = "relay.sock"  # in the mount's shared folder (process/workers.py)


class Relay:
    """A worker's side: `await relay(request)` is the hub's answer (its reply parts, or FuseError)."""

    def __init__(self, path: str):
        self.path = path
        self._idle: list[trio.socket.SocketType] = []

    async def __call__(self, r: p.Request) -> Sequence[Buffer]:
        sock = self._idle.pop() if self._idle else await self._connect()
        try:
            head = p.IN_HEADER.pack(p.IN_HEADER.size + len(r.arg), r.opcode, r.unique, r.nodeid, r.uid, r.gid, r.pid,
                                    0, 0)
            await _send(sock, [FRAME.pack(len(head) + len(r.arg)), head, r.arg])
            length, error = ANSWER.unpack(await _receive(sock, ANSWER.size))
            body = await _receive(sock, length)
        except BaseException as exc:  # (cancelled too: the connection's state is unknown, it is not kept)
            sock.close()
            if isinstance(exc, (OSError, EOFError)):
                log.warning("the hub did not answer a relayed request (opcode %d): %s", r.opcode, exc)
                raise FuseError(errno.EIO) from None
            raise
        if len(self._idle) < IDLE_KEPT:
            self._idle.append(sock)
        else:
            sock.close()
        if error:
            raise FuseError(error)
        return (body,) if body else ()

    async def _connect(self) -> trio.socket.SocketType:
        """A new connection to the hub. A unix socket's connect to a full backlog fails with EAGAIN, which looks like
        a connect under way and leaves the socket unconnected: each is checked, and tried again a few times."""
        last: OSError | None = None
        for attempt in range(CONNECT_TRIES):
            sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
            try:
                await sock.connect(self.path)
                sock.getpeername()  # (ENOTCONN where the connect never happened)
                return sock
            except OSError as exc:
                sock.close()
                last = exc
                if exc.errno not in (errno.EAGAIN, errno.ENOTCONN):
                    break
                await trio.sleep(0.01 * (attempt + 1))
        log.warning("cannot reach the hub's relay at %s: %s", self.path, last)
        raise FuseError(errno.EIO)

    def close(self) -> None:
        for sock in self._idle:
            sock.close()
        self._idle.clear()


Answerer = Callable[[p.Request], Awaitable[Sequence[Buffer]]]


def listen(path: str) -> socket.socket:
    """The hub's relay socket, listening before any worker starts (a write may come at once); `serve` answers it."""
    if os.path.exists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        os.chmod(path, 0o600)
        listener.listen(socket.SOMAXCONN)
    except OSError:
        listener.close()
        raise
    return listener


async def serve(listener: socket.socket, answer: Answerer, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """The hub's side: answer relayed requests with `answer` (the hub's adapter) until cancelled."""
    sock = trio.socket.from_stdlib_socket(listener)
    task_status.started()
    with sock:
        async with trio.open_nursery() as nursery:
            while True:
                try:
                    conn, _ = await sock.accept()
                except OSError as exc:  # (out of descriptors, a connection aborted before it was taken)
                    log.warning("the relay could not take a connection: %s", exc)
                    await trio.sleep(0.1)
                    continue
                nursery.start_soon(_connection, conn, answer)


async def _connection(sock: trio.socket.SocketType, answer: Answerer) -> None:
    buffer = bytearray()  # one request at a time: answered before the next is read into the same buffer
    with sock:
        while True:
            try:
                (length,) = FRAME.unpack(await _receive(sock, FRAME.size))
                if not p.IN_HEADER.size <= length <= MAX_REQUEST:
                    log.error("a relayed request of %d bytes: the connection is closed", length)
                    return
                if len(buffer) < length:
                    buffer = bytearray(length)
                view = memoryview(buffer)[:length]
                await _receive_into(sock, view)
                request = p.parse(view)
            except (EOFError, OSError, p.ProtocolError):
                return  # the worker closed it (or ended)
            try:
                parts: Sequence[Buffer] = await answer(request)
                error = 0
            except FuseError as exc:
                parts, error = (), exc.errno
            except Exception:  # noqa: BLE001 - one request's failure never ends the hub's serving
                log.exception("a relayed request (opcode %d) failed", request.opcode)
                parts, error = (), errno.EIO
            body = b"".join(parts)
            try:
                await _send(sock, [ANSWER.pack(len(body), error), body])
            except OSError:
                return


async def _receive(sock: trio.socket.SocketType, n: int) -> bytearray:
    """Exactly n bytes (EOFError if the other side closed first)."""
    buffer = bytearray(n)
    await _receive_into(sock, memoryview(buffer))
    return buffer


async def _receive_into(sock: trio.socket.SocketType, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = await sock.recv_into(view[got:])
        if not k:
            raise EOFError
        got += k


async def _send(sock: trio.socket.SocketType, parts: list) -> None:
    for part in parts:
        view = memoryview(part).cast("B")
        while view:
            view = view[await sock.send(view):]
