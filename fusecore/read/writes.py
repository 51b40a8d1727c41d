"""What each write-side operation of a writable mount means (`--writable`), on the namespace and the writer: create,
open for writing, write, close, remove, make or remove a directory. The FUSE adapter maps requests to these.

Decided here (docs/operations.md "Writes"), as Mountpoint for S3 does where S3 cannot do otherwise:
- a file is written from its start, in order; a write elsewhere is refused (`not_sequential`, EINVAL), a write ahead
  only after it waited a moment for those before it (one file's concurrent WRITEs may arrive out of order);
- an existing object is replaced only when opened with O_TRUNC and `--allow-overwrite` (else EPERM); appending to
  one, or opening one for reading and writing, is refused (EPERM);
- the object exists once the writer closes the file or fsyncs it: the first close (FLUSH) by the process that opened
  it after it wrote something completes the upload (a close by another process, such as a child that inherited the
  descriptor, or a close before any write, such as a shell's `>` redirection moving the descriptor, completes nothing,
  as in Mountpoint for S3), and so does the last release; a later write to the same open file is refused; a file being
  written cannot be opened for reading or again for writing (EBUSY);
- deleting needs `--allow-delete` (EPERM); a directory is a prefix: mkdir makes one here, which the bucket holds once
  a file is written in it, and rmdir removes only an empty one (ENOTEMPTY);
- rename is refused with EXDEV (S3 has no rename: `mv` then copies and deletes, as between two filesystems); links,
  symbolic links and device files are refused by the kernel's ENOSYS.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from typing import Callable

import trio

from ..store.errors import NotFound, Unavailable
from ..store.objects import ObjectInfo
from .namespace import Namespace, Node, valid_name
from .writer import Refused, Writer, Writing

log = logging.getLogger(__name__)

WRITE_HANDLES = 1 << 62  # a write's file handles, apart from the reader's
REORDER_WAIT = 1.0  # seconds a write past the end waits for the writes before it


@dataclasses.dataclass(eq=False)
class _Open:
    writing: Writing
    node: Node
    before: ObjectInfo | None  # the object it replaces (kept if the write fails), or None for a new one
    parent: Node
    opener: int  # the process (thread group) that opened it: its close completes the object
    turn: trio.Lock = dataclasses.field(default_factory=trio.Lock)  # a write and the completion never interleave
    advanced: trio.Event = dataclasses.field(default_factory=trio.Event)  # set (and renewed) after each write


def process_of(pid: int) -> int:
    """The thread group of a thread id (FUSE names the calling thread): a close from another thread of the opener is
    the opener's. 0 where it cannot be read (the process ended)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


class Writes:
    def __init__(self, ns: Namespace, writer: Writer, *, allow_overwrite: bool, allow_delete: bool,
                 forget_blocks: Callable[[str], object] = lambda key: None):
        self.ns = ns
        self.writer = writer
        self.allow_overwrite = allow_overwrite
        self.allow_delete = allow_delete
        self._forget_blocks = forget_blocks  # the blocks of a replaced or deleted object leave the cache
        self._open: dict[int, _Open] = {}
        self._handles = itertools.count(WRITE_HANDLES)
        # The kernel must forget a name that no longer exists (a new file whose upload failed): set by the process
        # serving the connection (daemon.py)
        self.on_gone: Callable[[int, str], None] = lambda parent_inode, name: None

    def fail_all(self, why: str) -> int:
        """Fail every file being written (EIO at its close; no object): how many."""
        count = 0
        for o in self._open.values():
            if o.writing.done is None and o.writing.failed is None:
                self.writer.fail(o.writing, Unavailable(f"{o.writing.key}: {why}"))
                self._failed(o)  # (shown as before now: its handle may never be closed, if its opener never got it)
                count += 1
        return count

    def owns(self, fh: int) -> bool:
        return fh >= WRITE_HANDLES

    async def create(self, parent_inode: int, name: str, flags: int, pid: int) -> tuple[Node, int]:
        """A new file (O_CREAT of a name the kernel found no entry for), open for writing."""
        parent = await self.ns.resolve(parent_inode)
        if not valid_name(name):
            raise Refused(f"{name!r} is not a name a file can have", "invalid")
        try:
            existing: Node | None = await self.ns.lookup(parent.inode, name)
        except NotFound:
            existing = None
        if existing is not None:  # (made meanwhile by another writer, or the kernel's negative entry was old)
            if flags & os.O_EXCL:
                raise Refused(f"{existing.path} exists", "exists")
            if existing.is_dir:
                raise Refused(f"{existing.path} is a directory", "is_dir")
            return existing, await self.open(existing, flags | os.O_TRUNC, pid)
        node = self.ns.add_file(parent, name, ObjectInfo(self.ns.prefix + _join(parent.path, name), 0, "",
                                                          time.time()))
        if node.writing:
            raise Refused(f"{node.path} is being written already", "busy")
        return node, self._begin(node, parent, None, pid)

    async def open(self, node: Node, flags: int, pid: int) -> int:
        """An existing file opened for writing: only to replace it whole (O_TRUNC), with --allow-overwrite."""
        if node.writing:
            raise Refused(f"{node.path} is being written already", "busy")
        if flags & os.O_APPEND or not flags & os.O_TRUNC:
            raise Refused(f"{node.path}: an object is replaced whole (O_TRUNC), never appended to or changed in "
                          "place", "append")
        if flags & os.O_ACCMODE == os.O_RDWR:
            raise Refused(f"{node.path}: opened for reading and writing at once", "read_write")
        if not self.allow_overwrite:
            raise Refused(f"{node.path} exists; replacing it needs --allow-overwrite", "overwrite")
        parent = self.ns.parent_of(node)
        assert parent is not None and node.info is not None
        before = node.info
        node.info = dataclasses.replace(before, size=0)
        return self._begin(node, parent, before, pid)

    def _begin(self, node: Node, parent: Node, before: ObjectInfo | None, pid: int) -> int:
        assert node.info is not None
        fh = next(self._handles)
        node.writing = True
        self._open[fh] = _Open(self.writer.begin(node.info.key), node, before, parent, process_of(pid))
        return fh

    async def write(self, fh: int, offset: int, data: memoryview) -> int:
        o = self._of(fh)
        if offset > o.writing.written:  # (`data` is a view of the request's own bytes: it outlives these waits)
            await self._wait_for(o, offset)
        async with o.turn:
            await self.writer.write(o.writing, offset, data)
        o.advanced.set()
        o.advanced = trio.Event()
        info = o.node.info
        assert info is not None
        if info.size != o.writing.written:
            o.node.info = dataclasses.replace(info, size=o.writing.written)
        return len(data)

    @staticmethod
    async def _wait_for(o: _Open, offset: int) -> None:
        """A write past the end written so far waits a moment for the writes before it: concurrent WRITEs of one file
        (O_DIRECT or AIO writers) may arrive out of order, the more so through several workers (fuse/relay.py). Past
        REORDER_WAIT it is out of order, and refused."""
        with trio.move_on_after(REORDER_WAIT):
            while offset > o.writing.written and o.writing.failed is None and o.writing.done is None:
                await o.advanced.wait()

    async def flush(self, fh: int, pid: int) -> None:
        """A close: the object is complete where it is the opener's close after a write (else nothing happens now),
        or the close fails and nothing was made (the store's error)."""
        o = self._open.get(fh)
        if o is None or o.writing.done is not None or not o.writing.written:
            return
        if o.opener and process_of(pid) != o.opener:
            return  # another process's close of an inherited descriptor: the opener goes on writing
        await self.complete(fh)

    async def complete(self, fh: int) -> None:
        """fsync, the opener's close, the last release: the object is complete, or this fails and nothing was made."""
        o = self._open.get(fh)
        if o is None or o.writing.done is not None:
            return
        try:
            async with o.turn:
                info = await self.writer.finish(o.writing)
        except Exception:
            self._failed(o)
            raise
        o.node.info, o.node.writing = info, False
        o.node.cached_etag = None
        if o.before is not None:
            self._forget_blocks(info.key)
        log.debug("wrote %s (%d bytes, %s)", info.key, info.size, info.etag)

    async def release(self, fh: int) -> None:
        """The last close: a file no FLUSH completed (the kernel sends one at every close; this is the rest) is
        completed now, and its failure logged (no caller is left to tell)."""
        o = self._open.get(fh)
        if o is None:
            return
        try:
            await self.complete(fh)
        except Exception as exc:  # noqa: BLE001 - logged by the writer; the upload is aborted
            log.debug("release of %s: %s", o.node.path, exc)
        finally:
            self._open.pop(fh, None)

    async def abandon(self, fh: int) -> None:
        """A file opened here whose open never reached its opener (the FUSE layer failed it after all): no object is
        made, it shows as before."""
        o = self._open.pop(fh, None)
        if o is None:
            return
        self._failed(o)
        await self.writer.abandon(o.writing)

    def _failed(self, o: _Open) -> None:
        """No object was made: the file shows as before (the old object, or no file)."""
        o.node.writing = False
        if o.before is not None:
            o.node.info = o.before
        elif o.parent.children.get(o.node.name) == o.node.inode:
            self.ns.remove(o.parent, o.node.name)
            self.on_gone(o.parent.inode, o.node.name)

    def _of(self, fh: int) -> _Open:
        o = self._open.get(fh)
        if o is None:
            raise Refused(f"file handle {fh} is not open for writing", "not_open")
        return o

    def truncate(self, node: Node, size: int) -> None:
        """Only what changes nothing: a file being written cut to where it is (O_TRUNC of a new file)."""
        if size == (node.info.size if node.info is not None else 0) and (node.writing or size == 0):
            return
        raise Refused(f"{node.path}: cut to {size} bytes (an object is replaced whole, never cut)", "truncate")

    async def unlink(self, parent_inode: int, name: str) -> None:
        parent = await self.ns.resolve(parent_inode)
        node = await self.ns.lookup(parent.inode, name)
        if node.writing:
            raise Refused(f"{node.path} is being written", "busy")
        if not self.allow_delete:
            raise Refused(f"deleting {node.path} needs --allow-delete", "delete")
        assert node.info is not None
        await self.writer.delete(node.info.key)
        self._forget_blocks(node.info.key)
        self.ns.remove(parent, name)

    async def mkdir(self, parent_inode: int, name: str) -> Node:
        parent = await self.ns.resolve(parent_inode)
        if not valid_name(name):
            raise Refused(f"{name!r} is not a name a directory can have", "invalid")
        try:
            await self.ns.lookup(parent.inode, name)
        except NotFound:
            return self.ns.add_dir(parent, name)
        raise Refused(f"{_join(parent.path, name)} exists", "exists")

    async def rmdir(self, parent_inode: int, name: str) -> None:
        parent = await self.ns.resolve(parent_inode)
        node = await self.ns.lookup(parent.inode, name)
        if not node.is_dir:
            raise Refused(f"{node.path} is not a directory", "not_dir")
        if await self.ns.readdir(node.inode):
            raise Refused(f"{node.path} is not empty", "not_empty")
        self.ns.remove(parent, name)

    def rename(self) -> None:
        raise Refused("S3 has no rename (copy and delete instead: mv does so when told EXDEV)", "rename")


def _join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name
