"""One FUSE connection served from the event loop: INIT, the request loop, replies, interrupts, backing files for
passthrough (the mount itself: device.py).

This is what pyfuse3 (over libfuse) did for Stoker, written over the kernel's wire format (protocol.py) so that a
mount can do what libfuse 3.14 cannot: answer an OPEN with a backing file (passthrough), and later serve clones of
the connection from other processes (`clone`: a worker's Connection is told what INIT agreed, `agreed`). Worker tasks take turns reading one request at a time from a non-blocking
descriptor and answer what they read (see `serve`); FORGET and INTERRUPT are handled on the spot. A reply goes back
on the descriptor its request came from.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import struct
from typing import Awaitable, Callable, Iterable, Sequence

import trio

from ..failures import StokerError
from . import protocol as p

log = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview | mmap.mmap
Handler = Callable[[p.Request], Awaitable[Sequence[Buffer]]]
Forget = Callable[[Iterable[tuple[int, int]]], None]

_libc = ctypes.CDLL(None, use_errno=True)
YIELD_EVERY = 16  # answers a worker gives in a row before it lets the other tasks run
# A request this large (a WRITE's data) is not copied out of the read buffer: the buffer is lent to the request until
# it is answered, and the reads go on in a spare one. Copying 1 MiB WRITEs into fresh bytes cost a page fault per
# 4 KiB (a tenth of a writing mount's CPU); a few spares are kept for the next ones.
LEND_FROM = 64 * 1024
SPARES = 4
GONE = (errno.ENODEV, errno.EBADF)  # the connection ended: unmounted or aborted
RETRY = (errno.EINTR, errno.EAGAIN, errno.ENOENT)  # ENOENT: a request interrupted before it was read


def clone(fd: int) -> int:
    """Another descriptor of the connection `fd` belongs to (FUSE_DEV_IOC_CLONE), for a worker process: the kernel
    hands each request to whichever descriptor reads it first, and takes its reply on that same descriptor."""
    mine = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(mine, p.FUSE_DEV_IOC_CLONE, struct.pack("I", fd))
    except OSError:
        os.close(mine)
        raise
    return mine


class FuseError(StokerError):
    """An answer that is an errno (the adapter's one way to say "no")."""

    kind = "errno"

    def __init__(self, errno_: int):
        super().__init__(errno_)
        self.errno = errno_


class Connection:
    """One descriptor of a mounted FUSE connection, served from trio."""

    def __init__(self, fd: int, *, max_write: int = 1024 * 1024, agreed: p.Agreed | None = None):
        """`agreed`: this is a clone of a connection whose INIT another process answered (a worker)."""
        self.fd = fd
        self.max_write = max_write
        self.agreed: p.Agreed | None = agreed
        self._buffer = bytearray(max(p.PAGE * 2, max_write + p.PAGE))
        self._spares: list[bytearray] = []
        self._running: dict[int, trio.CancelScope] = {}
        self.ended = False  # the kernel ended the connection (unmounted, or aborted)
        self._handle: Handler
        self._forget: Forget
        self._nursery: trio.Nursery
        self._turn: trio.Lock
        self._max_tasks = self._workers = self._waiting = self._served = 0
        self._waits: frozenset[int] = frozenset()

    # ---- INIT ------------------------------------------------------------------------------
    def negotiate(self, *, want: int, max_background: int, max_stack_depth: int = 1) -> p.Agreed:
        """Read the kernel's INIT (blocking: it is the connection's first request) and answer it."""
        while True:
            try:
                request = p.parse(self._read())
                break
            except OSError as exc:
                if exc.errno not in RETRY:
                    raise
        if request.opcode != p.Op.INIT:
            raise p.ProtocolError(f"the first request is opcode {request.opcode}, not INIT")
        offer = p.parse_init(request.arg)
        try:
            agreed = p.agree(offer, want=want, max_write=self.max_write, max_pages=max(1, self.max_write // p.PAGE))
        except p.ProtocolError:
            self._write([p.reply_head(request.unique, 0, errno.EPROTO)])
            raise
        body = p.init_out(offer, agreed, max_background=max_background,
                          congestion_threshold=max_background * 3 // 4, max_stack_depth=max_stack_depth)
        self._write([p.reply_head(request.unique, len(body)), body])
        self.agreed = agreed
        log.debug("FUSE %d.%d, flags %#x", p.KERNEL_MAJOR, agreed.minor, agreed.flags)
        return agreed

    def _read(self) -> bytes | memoryview:
        """One request as the device gives it (b"": the end, which /dev/fuse never gives but a fake kernel may): a
        copy, or for a large one the read buffer itself, lent until the request is answered (`_give_back`)."""
        n = os.readv(self.fd, [self._buffer])
        if n < LEND_FROM:
            return bytes(memoryview(self._buffer)[:n])
        lent = self._buffer
        self._buffer = self._spares.pop() if self._spares else bytearray(len(lent))
        return memoryview(lent)[:n]

    def _give_back(self, request: p.Request) -> None:
        """An answered request's lent buffer becomes a spare (nothing keeps a view of a request past its answer)."""
        lent = request.arg.obj
        if type(lent) is bytearray and len(lent) == len(self._buffer) and len(self._spares) < SPARES:
            self._spares.append(lent)

    # ---- the loop --------------------------------------------------------------------------
    async def serve(self, handle: Handler, forget: Forget, *, waits: frozenset[int] = frozenset(),
                    max_tasks: int = 128, min_tasks: int = 4) -> None:
        """Answer requests until the connection ends (unmounted: the read fails with ENODEV).

        Worker tasks take turns reading (one at a time: one waits on the descriptor) and each answers the request it
        read in place, as pyfuse3's loop did: no task is started per request. While every worker is busy answering,
        another is started, up to `max_tasks`; past that the kernel queues. `waits`: the opcodes whose answer may
        wait (on the store, a listing): only those can be interrupted, the others are answered at once."""
        os.set_blocking(self.fd, False)
        self._handle, self._forget, self._max_tasks, self._waits = handle, forget, max_tasks, waits
        self._turn = trio.Lock()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for _ in range(min_tasks):
                self._start_worker()

    def _start_worker(self) -> None:
        self._workers += 1
        self._nursery.start_soon(self._worker)

    async def _worker(self) -> None:
        try:
            while not self.ended:
                self._waiting += 1
                try:
                    try:
                        self._turn.acquire_nowait()  # no trip through the scheduler when no one else reads
                    except trio.WouldBlock:
                        await self._turn.acquire()
                    try:
                        request = await self._next()
                    finally:
                        self._turn.release()
                finally:
                    self._waiting -= 1
                if request is None:
                    self._nursery.cancel_scope.cancel()
                    return
                if not self._waiting and self._workers < self._max_tasks:
                    self._start_worker()  # someone must be reading while this one answers
                await self._answer(request)
                self._give_back(request)
                self._served += 1
                if not self._served % YIELD_EVERY:
                    await trio.lowlevel.checkpoint()  # a stream of answers that never wait lets the rest run too
        finally:
            self._workers -= 1

    async def _next(self) -> p.Request | None:
        """The next request that needs an answer (FORGET and INTERRUPT are handled here); None: the connection
        ended."""
        while True:
            try:
                data = self._read()
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.fd)
                continue
            except OSError as exc:
                if exc.errno in RETRY:
                    continue
                if exc.errno in GONE:
                    self.ended = True
                    return None
                raise
            if not data:
                self.ended = True
                return None
            request = p.parse(data)
            op = request.opcode
            if op == p.Op.FORGET:
                self._forget([(request.nodeid, p.FORGET_IN.unpack_from(request.arg)[0])])
            elif op == p.Op.BATCH_FORGET:
                self._forget(_batch(request.arg))
            elif op == p.Op.INTERRUPT:
                target = p.INTERRUPT_IN.unpack_from(request.arg)[0]
                scope = self._running.get(target)
                log.debug("INTERRUPT of request %d (%s)", target, "cancelled" if scope else "already answered")
                if scope is not None:
                    scope.cancel()
            elif op == p.Op.DESTROY:
                self._reply(request.unique, ())
                self.ended = True
                return None
            else:
                if op in self._waits:
                    self._running[request.unique] = trio.CancelScope()  # an INTERRUPT may come before its answer
                return request

    async def _answer(self, request: p.Request) -> None:
        unique = request.unique
        scope = self._running.get(unique)
        if scope is None:
            await self._answer_in(request, unique)
            return
        try:
            with scope:
                await self._answer_in(request, unique)
                return
            self._reply(unique, (), errno.EINTR)  # interrupted: the caller got a signal
        finally:
            self._running.pop(unique, None)

    async def _answer_in(self, request: p.Request, unique: int) -> None:
        try:
            parts = await self._handle(request)
        except FuseError as exc:
            self._reply(unique, (), exc.errno)
            return
        except Exception:  # noqa: BLE001 - the last boundary: the adapter maps errors, this keeps the loop
            log.exception("opcode %d failed", request.opcode)
            self._reply(unique, (), errno.EIO)
            return
        self._reply(unique, parts)

    def _reply(self, unique: int, parts: Sequence[Buffer], error: int = 0) -> None:
        length = sum(len(part) for part in parts)
        try:
            self._write([p.reply_head(unique, 0 if error else length, error), *(() if error else parts)])
        except OSError as exc:
            if exc.errno in (errno.ENOENT, *GONE):  # ENOENT: the request was interrupted meanwhile
                return
            if error:
                log.error("an error reply (errno %d) was refused (%s)", error, os.strerror(exc.errno or errno.EIO))
                return
            # The kernel refused the reply (EINVAL: malformed or too long): the caller gets EIO, the mount goes on.
            log.error("a reply of %d bytes in %d parts was refused (%s): answered EIO", length, len(parts),
                      os.strerror(exc.errno or errno.EIO))
            self._reply(unique, (), errno.EIO)

    def _write(self, parts: list[Buffer]) -> None:
        os.writev(self.fd, parts)

    # ---- notifications ------------------------------------------------------------------------
    def forget_entry(self, parent: int, name: bytes) -> None:
        """Tell the kernel a name is gone (FUSE_NOTIFY_INVAL_ENTRY). Blocking, and it may wait for a directory lock a
        request being answered holds: call it from a thread, never from the loop."""
        try:
            os.write(self.fd, p.notify_inval_entry(parent, name))
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, *GONE):  # ENOENT: the kernel did not hold it
                log.info("FUSE_NOTIFY_INVAL_ENTRY of %r: %s", name, os.strerror(exc.errno or errno.EIO))

    # ---- backing files (passthrough) -------------------------------------------------------
    def open_backing(self, fd: int) -> int:
        """Register an open file as a backing file of this connection (needs CAP_SYS_ADMIN): its id."""
        arg = ctypes.create_string_buffer(p.BACKING_MAP.pack(fd, 0, 0), p.BACKING_MAP.size)
        backing = _libc.ioctl(self.fd, ctypes.c_ulong(p.FUSE_DEV_IOC_BACKING_OPEN), arg)
        if backing <= 0:
            raise OSError(ctypes.get_errno() or errno.EIO, "FUSE_DEV_IOC_BACKING_OPEN")
        return backing

    def close_backing(self, backing: int) -> None:
        arg = ctypes.c_uint32(backing)
        if _libc.ioctl(self.fd, ctypes.c_ulong(p.FUSE_DEV_IOC_BACKING_CLOSE), ctypes.byref(arg)) != 0:
            log.debug("FUSE_DEV_IOC_BACKING_CLOSE %d: %s", backing, os.strerror(ctypes.get_errno()))

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def _batch(arg: memoryview) -> list[tuple[int, int]]:
    count = p.BATCH_FORGET_IN.unpack_from(arg)[0]
    return [p.FORGET_ONE.unpack_from(arg, p.BATCH_FORGET_IN.size + i * p.FORGET_ONE.size) for i in range(count)]
