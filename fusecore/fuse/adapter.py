"""The FUSE adapter: each opcode's meaning, written once, as a thin translation between a kernel request and the
namespace, the reader and the held files (passthrough). Errors are mapped here, once (errnos.errno_for)."""

from __future__ import annotations

import errno
import logging
import math
import os
import stat
from typing import Awaitable, Callable, Sequence

import trio

from ..read.namespace import InodeCollision, Namespace, Node
from ..read.reader import Reader
from ..read.writer import Refused
from ..read.writes import WRITE_HANDLES, Writes
from ..store.errors import StoreError
from . import protocol as p
from .errnos import errno_for
from .passthrough import BACKED, Passthrough, backed_handle, shared_memory_backs
from .relay import Relay
from .session import Buffer, FuseError

log = logging.getLogger(__name__)

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_MAX_TIMEOUT = 365 * 24 * 3600.0
NOTHING: Sequence[Buffer] = ()
WRITABLE_ROOM = 1 << 50  # the free space a writable mount reports (a bucket has no size)
RELEASE_LAG = 2.0  # seconds an open for writing waits for the RELEASEs of passthrough opens (sent after their close)

Op = Callable[[p.Request], Awaitable[Sequence[Buffer]]]


class StokerFS:
    """Answers one request (`__call__`) and takes the kernel's forgets (`forget`); see the module docstring."""

    # The opcodes whose answer may wait (a listing, the store): the loop lets the kernel interrupt only these.
    # (GETATTR, OPEN and OPENDIR wait only where another worker named the inode: its path is looked up here.)
    waits = frozenset({p.Op.LOOKUP, p.Op.READ, p.Op.READDIR, p.Op.READDIRPLUS})

    def __init__(self, namespace: Namespace, reader: Reader, *, block_size: int, kernel_cache: bool,
                 uid: int, gid: int, on_open: Callable[[Node], None] = lambda node: None,
                 passthrough: Passthrough | None = None, writes: Writes | None = None, relay: Relay | None = None):
        self.on_open = on_open
        self.writes = writes  # a writable mount's (read/writes.py says what each write-side operation means)
        # A worker of a writable mount served by several: what writes goes to the hub, which answers it with this
        # adapter over its own writes (fuse/relay.py)
        self.relay = relay
        self.writable = writes is not None or relay is not None
        self.ns = namespace
        self.reader = reader
        self.block_size = block_size
        self.kernel_cache = kernel_cache
        self.uid, self.gid = uid, gid
        self.passthrough = passthrough
        self.timeout = min(namespace.ttl, _MAX_TIMEOUT) if not math.isinf(namespace.ttl) else _MAX_TIMEOUT
        self._ops: dict[int, Op] = {
            p.Op.LOOKUP: self.lookup, p.Op.GETATTR: self.getattr, p.Op.OPEN: self.open, p.Op.READ: self.read,
            p.Op.RELEASE: self.release, p.Op.OPENDIR: self.opendir, p.Op.READDIRPLUS: self.readdirplus,
            p.Op.READDIR: self.readdir, p.Op.RELEASEDIR: self.nothing,
            p.Op.STATFS: self.statfs, p.Op.ACCESS: self.access,
        }
        write_ops: dict[int, Op] = {
            p.Op.CREATE: self.create, p.Op.WRITE: self.write, p.Op.FLUSH: self.flush, p.Op.FSYNC: self.fsync,
            p.Op.SETATTR: self.setattr, p.Op.MKDIR: self.mkdir, p.Op.UNLINK: self.unlink, p.Op.RMDIR: self.rmdir,
            p.Op.RENAME: self.rename, p.Op.RENAME2: self.rename,
        }
        if writes is not None:
            self._ops.update(write_ops)
        if relay is not None:  # the same opcodes, answered by the hub (FLUSH and FSYNC only of a file being written)
            self._ops.update({op: relay for op in write_ops})
            self._ops.update({p.Op.FLUSH: self._relay_written, p.Op.FSYNC: self._relay_written})
        self._file_mode, self._dir_mode = (0o644, 0o755) if self.writable else (0o444, 0o555)

    async def __call__(self, request: p.Request) -> Sequence[Buffer]:
        op = self._ops.get(request.opcode)
        if op is None:
            # The kernel stops asking (FLUSH at each close, xattrs), or the VFS refused first (writes on a read-only
            # mount): ENOSYS, as libfuse answers an operation a filesystem does not implement.
            raise FuseError(errno.ENOSYS)
        try:
            return await op(request)
        except FuseError:
            raise
        except StoreError as exc:
            (log.info if isinstance(exc, Refused) else log.debug)("opcode %d: %s", request.opcode, exc)
            raise FuseError(errno_for(exc)) from None
        except Exception:  # noqa: BLE001 - the boundary: log and report EIO
            log.exception("unexpected error answering opcode %d", request.opcode)
            raise FuseError(errno.EIO) from None

    def forget(self, pairs: object) -> None:
        """The kernel dropped references: entries it no longer holds may be swept (namespace.sweep)."""
        for inode, count in pairs:  # type: ignore[attr-defined]
            self.ns.forget(inode, count)
        self.ns.sweep()

    def _attr(self, node: Node) -> p.Attr:
        if node.is_dir:
            return p.Attr(node.inode, 0, stat.S_IFDIR | self._dir_mode, 2, self.uid, self.gid,
                          int(self.ns.mount_time * 1e9), self.block_size)
        assert node.info is not None
        return p.Attr(node.inode, node.info.size, stat.S_IFREG | self._file_mode, 1, self.uid, self.gid,
                      int(node.info.mtime * 1e9), self.block_size)

    async def lookup(self, r: p.Request) -> Sequence[Buffer]:
        try:
            node = await self.ns.lookup(r.nodeid, os.fsdecode(p.name_of(r.arg)))
        except StoreError as exc:
            if errno_for(exc) != errno.ENOENT:
                raise
            return (p.entry_out(None, self.timeout),)  # the kernel caches "no such name" for entry_timeout
        self.ns.remember(node)  # the kernel now holds a reference to this inode
        return (p.entry_out(self._attr(node), self.timeout),)

    async def getattr(self, r: p.Request) -> Sequence[Buffer]:
        node = await self.ns.resolve(r.nodeid)
        if node.writing and self.relay is not None:
            return await self.relay(r)  # (its size grows at the hub)
        return (p.attr_out(self._attr(node), self.timeout),)

    async def opendir(self, r: p.Request) -> Sequence[Buffer]:
        if not (await self.ns.resolve(r.nodeid)).is_dir:
            raise FuseError(errno.ENOTDIR)
        return (p.open_out(r.nodeid),)

    async def readdirplus(self, r: p.Request) -> Sequence[Buffer]:
        return await self._listing(r, plus=True)

    async def readdir(self, r: p.Request) -> Sequence[Buffer]:
        return await self._listing(r, plus=False)

    async def _listing(self, r: p.Request, *, plus: bool) -> Sequence[Buffer]:
        """Entries from the offset asked, as many as fit the size asked, in one buffer (a writev takes at most
        1,024 parts). With READDIRPLUS each entry sent counts as a lookup of its inode."""
        fh, offset, size = p.READ_IN.unpack_from(r.arg)[:3]
        entries = await self.ns.readdir(fh)
        out: list[bytes] = []
        used = 0
        for index in range(offset, len(entries)):
            name, inode = entries[index]
            node = self.ns.node(inode)
            attr = self._attr(node)
            entry = p.direntplus(attr, os.fsencode(name), index + 1, self.timeout) if plus \
                else p.dirent(attr, os.fsencode(name), index + 1)
            if used + len(entry) > size:
                break
            if plus:
                try:
                    self.ns.remember(node)
                except InodeCollision as exc:  # left out: its LOOKUP says EIO
                    log.error("%s", exc)
                    continue
            out.append(entry)
            used += len(entry)
        return (b"".join(out),)

    async def open(self, r: p.Request) -> Sequence[Buffer]:
        flags = p.OPEN_IN.unpack_from(r.arg)[0]
        if flags & _WRITE_FLAGS and not self.writable:
            raise FuseError(errno.EROFS)
        if flags & _WRITE_FLAGS and self.relay is not None:
            return await self.relay(r)
        node = await self.ns.resolve(r.nodeid)
        if node.is_dir:
            raise FuseError(errno.EISDIR)
        if self.writable:
            if flags & _WRITE_FLAGS:
                assert self.writes is not None
                await self._count_writer(node.inode)
                try:
                    fh = await self.writes.open(node, flags, r.pid)
                except BaseException:
                    self._uncount_writer(node.inode)
                    raise
                return (p.open_out(fh),)
            if node.writing:
                raise Refused(f"{node.path} is being written: it can be read once closed", "busy")
        info = node.info
        assert info is not None
        fh = self.reader.new_handle()
        self.on_open(node)
        same_version = self.ns.same_version(node)
        memory = shared_memory_backs(self.kernel_cache, self.writable)
        backing = self.passthrough.open(fh, node.inode, info, memory=memory) if self.passthrough is not None else 0
        if backing:  # (the kernel reads it: no READ of this handle comes, the reader never learns of it)
            return (p.open_out(backed_handle(fh), p.OpenFlag.PASSTHROUGH, backing),)
        self.reader.open(info, fh)
        return (p.open_out(fh, p.OpenFlag.KEEP_CACHE if self.kernel_cache and same_version else 0),)

    async def read(self, r: p.Request) -> Sequence[Buffer]:
        fh, offset, size = p.READ_IN.unpack_from(r.arg)[:3]
        return (await self.reader.read(fh, offset, size),)

    async def release(self, r: p.Request) -> Sequence[Buffer]:
        fh = p.RELEASE_IN.unpack_from(r.arg)[0]
        if self.relay is not None and fh >= WRITE_HANDLES:
            return await self.relay(r)
        if self.writes is not None and self.writes.owns(fh):
            try:
                await self.writes.release(fh)
            finally:
                self._uncount_writer(r.nodeid)
            return NOTHING
        if not fh & BACKED:
            self.reader.release(fh)
        if self.passthrough is not None:
            self.passthrough.release(fh, r.nodeid)
        return NOTHING

    async def statfs(self, r: p.Request) -> Sequence[Buffer]:
        return (p.statfs_out(self.block_size, free=WRITABLE_ROOM if self.writable else 0),)

    async def access(self, r: p.Request) -> Sequence[Buffer]:
        if p.ACCESS_IN.unpack_from(r.arg)[0] & os.W_OK and not self.writable:
            raise FuseError(errno.EACCES)
        return NOTHING

    # ---- a writable mount's (read/writes.py) ------------------------------------------------------------------
    async def create(self, r: p.Request) -> Sequence[Buffer]:
        assert self.writes is not None
        flags = p.CREATE_IN.unpack_from(r.arg)[0]
        name = os.fsdecode(p.name_of(r.arg[p.CREATE_IN.size:]))
        # counted before anything is made (a name unlinked while a reader holds its file in passthrough comes back at
        # the same inode): a refusal leaves no trace, not even one the workers could hear of (hubwrites.py's views)
        parent = await self.ns.resolve(r.nodeid)
        known = self.ns.file_inode(parent, name) if parent.is_dir else None
        if known is not None:
            await self._count_writer(known)
        try:
            node, fh = await self.writes.create(r.nodeid, name, flags, r.pid)
        except BaseException:
            if known is not None:
                self._uncount_writer(known)
            raise
        counted = known
        try:
            if node.inode != known:  # (a number new to the kernel: nothing of it is open in passthrough)
                if known is not None:
                    self._uncount_writer(known)
                counted = None
                if self.passthrough is not None and not self.passthrough.open_for_writing(node.inode):
                    raise Refused(f"{node.path}: inode {node.inode} is open in passthrough", "busy")
                counted = node.inode
            self.ns.remember(node)
        except BaseException:  # (no handle reaches the kernel, so no RELEASE comes: nothing is made, nothing stays)
            if counted is not None:
                self._uncount_writer(counted)
            await self.writes.abandon(fh)
            raise
        return (p.entry_out(self._attr(node), self.timeout), p.open_out(fh))

    async def _count_writer(self, inode: int) -> None:
        """An open for writing, counted in the inode's modes (Passthrough.open_for_writing); refused (EBUSY) while the
        file is open in passthrough, once the RELEASEs of opens just closed had time to come."""
        if self.passthrough is None:
            return
        deadline = trio.current_time() + RELEASE_LAG
        while not self.passthrough.open_for_writing(inode):
            if trio.current_time() >= deadline:  # (logged at the boundary, as every refusal of a write-side request)
                raise Refused("a file being read by the kernel itself (passthrough) is written once those opens close",
                              "busy")
            await trio.sleep(0.02)

    def _uncount_writer(self, inode: int) -> None:
        if self.passthrough is not None:
            self.passthrough.release(0, inode)  # (a handle without BACKED: a page-cache open ends)

    async def write(self, r: p.Request) -> Sequence[Buffer]:
        assert self.writes is not None
        fh, offset, size = p.WRITE_IN.unpack_from(r.arg)[:3]
        data = r.arg[p.WRITE_IN.size:p.WRITE_IN.size + size]
        return (p.write_out(await self.writes.write(fh, offset, data)),)

    async def flush(self, r: p.Request) -> Sequence[Buffer]:
        """FLUSH (each close): the opener's close of a file it wrote is complete once this answers."""
        assert self.writes is not None
        fh = p.FLUSH_IN.unpack_from(r.arg)[0]
        if self.writes.owns(fh):
            await self.writes.flush(fh, r.pid)
        return NOTHING

    async def fsync(self, r: p.Request) -> Sequence[Buffer]:
        """FSYNC: a file written through this handle is complete (an object) once this answers."""
        assert self.writes is not None
        fh = p.FSYNC_IN.unpack_from(r.arg)[0]
        if self.writes.owns(fh):
            await self.writes.complete(fh)
        return NOTHING

    async def setattr(self, r: p.Request) -> Sequence[Buffer]:
        assert self.writes is not None
        valid, _, _, size = p.SETATTR_IN.unpack_from(r.arg)[:4]
        node = await self.ns.resolve(r.nodeid)
        if valid & (p.Setattr.MODE | p.Setattr.UID | p.Setattr.GID):
            raise Refused(f"{node.path}: modes and owners are the mount's (--uid, --gid), not each file's",
                          "read_write")
        if valid & p.Setattr.SIZE:
            self.writes.truncate(node, size)
        return (p.attr_out(self._attr(node), self.timeout),)  # times: accepted, not kept (S3 keeps its own)

    async def mkdir(self, r: p.Request) -> Sequence[Buffer]:
        assert self.writes is not None
        node = await self.writes.mkdir(r.nodeid, os.fsdecode(p.name_of(r.arg[p.MKDIR_IN.size:])))
        self.ns.remember(node)
        return (p.entry_out(self._attr(node), self.timeout),)

    async def unlink(self, r: p.Request) -> Sequence[Buffer]:
        assert self.writes is not None
        await self.writes.unlink(r.nodeid, os.fsdecode(p.name_of(r.arg)))
        return NOTHING

    async def rmdir(self, r: p.Request) -> Sequence[Buffer]:
        assert self.writes is not None
        await self.writes.rmdir(r.nodeid, os.fsdecode(p.name_of(r.arg)))
        return NOTHING

    async def rename(self, r: p.Request) -> Sequence[Buffer]:
        assert self.writes is not None
        self.writes.rename()
        return NOTHING

    async def _relay_written(self, r: p.Request) -> Sequence[Buffer]:
        """FLUSH or FSYNC in a worker: of a file being written (its handle is the hub's), the hub's answer."""
        assert self.relay is not None
        if p.HANDLE.unpack_from(r.arg)[0] >= WRITE_HANDLES:  # (FLUSH_IN and FSYNC_IN both start with the handle)
            return await self.relay(r)
        return NOTHING

    async def nothing(self, r: p.Request) -> Sequence[Buffer]:
        return NOTHING
