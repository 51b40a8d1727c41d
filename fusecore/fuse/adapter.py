"""The pyfuse3 adapter: thin translation between kernel requests and the namespace/reader."""

from __future__ import annotations

import errno
import functools
import logging
import math
import os
import stat
from typing import Any, Callable

import pyfuse3

from .errnos import errno_for
from ..read.namespace import Namespace, Node
from ..read.reader import Reader
from ..store.errors import StoreError

log = logging.getLogger(__name__)

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_MAX_TIMEOUT = 365 * 24 * 3600.0


def _boundary(handler: Callable) -> Callable:
    """Map StoreError to its errno, and anything unexpected to EIO (never crash the mount)."""

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await handler(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except StoreError as exc:
            log.debug("%s: %s", handler.__name__, exc)
            raise pyfuse3.FUSEError(errno_for(exc)) from None
        except Exception:  # noqa: BLE001 - the boundary: log and report EIO
            log.exception("unexpected error in %s", handler.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


class StokerFS(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, namespace: Namespace, reader: Reader, *, block_size: int, kernel_cache: bool,
                 uid: int, gid: int, on_open: Callable[[Node], None] = lambda node: None):
        super().__init__()
        self.on_open = on_open
        self.ns = namespace
        self.reader = reader
        self.block_size = block_size
        self.kernel_cache = kernel_cache
        self.uid, self.gid = uid, gid
        self.timeout = min(namespace.ttl, _MAX_TIMEOUT) if not math.isinf(namespace.ttl) else _MAX_TIMEOUT

    def _attrs(self, node: Node) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.inode
        a.generation = 0
        a.entry_timeout = a.attr_timeout = self.timeout
        a.st_uid, a.st_gid = self.uid, self.gid
        a.st_blksize = self.block_size
        if node.is_dir:
            a.st_mode = stat.S_IFDIR | 0o555
            a.st_nlink = 2
            a.st_size = 0
            mtime = self.ns.mount_time
        else:
            assert node.info is not None
            a.st_mode = stat.S_IFREG | 0o444
            a.st_nlink = 1
            a.st_size = node.info.size
            mtime = node.info.mtime
        a.st_blocks = (a.st_size + 511) // 512
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = int(mtime * 1e9)
        return a

    @_boundary
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        try:
            node = await self.ns.lookup(parent_inode, os.fsdecode(name))
        except StoreError as exc:
            if errno_for(exc) != errno.ENOENT:
                raise
            negative = pyfuse3.EntryAttributes()
            negative.st_ino = 0  # the kernel caches "no such name" for entry_timeout
            negative.entry_timeout = self.timeout
            return negative
        attrs = self._attrs(node)
        self.ns.remember(node)  # the kernel now holds a reference to this inode
        return attrs

    @_boundary
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attrs(self.ns.node(inode))

    @_boundary
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        node = self.ns.node(inode)
        if not node.is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    @_boundary
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        entries = await self.ns.readdir(fh)
        for index in range(start_id, len(entries)):
            name, inode = entries[index]
            node = self.ns.node(inode)
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self._attrs(node), index + 1):
                break
            self.ns.remember(node)  # readdirplus: each entry sent counts as a lookup

    async def releasedir(self, fh: int) -> None:
        return None

    @_boundary
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if flags & _WRITE_FLAGS:
            raise pyfuse3.FUSEError(errno.EROFS)
        node = self.ns.node(inode)
        if node.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        assert node.info is not None
        fh = self.reader.open(node.info)
        self.on_open(node)
        same_version = node.cached_etag == node.info.etag
        node.cached_etag = node.info.etag
        return pyfuse3.FileInfo(fh=fh, keep_cache=self.kernel_cache and same_version)

    @_boundary
    async def read(self, fh: int, off: int, size: int) -> Any:
        return await self.reader.read(fh, off, size)

    async def release(self, fh: int) -> None:
        self.reader.release(fh)

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = self.block_size
        s.f_namemax = 255
        return s

    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        return not (mode & os.W_OK)

    async def forget(self, inode_list: Any) -> None:
        """The kernel dropped references: entries it no longer holds may be swept (namespace.sweep)."""
        for inode, count in inode_list:
            self.ns.forget(inode, count)
        self.ns.sweep()
