"""What every worker of one mount must read the same (design §8): an inode number's path, and an open file's
version. The kernel hands any request to whichever worker reads first, so a worker may be asked about an inode
another worker named, or a file handle another worker opened.

Inode numbers are derived from the path (`derived_inode`), so every worker gives a path the same number; the
registry keeps the way back (number to path), written by the worker that first names an inode to the kernel,
before its reply goes out. A file handle's version (key, ETag, size, mtime) is written at OPEN and removed at
RELEASE. Both are symbolic links in the mount's shared folder on tmpfs: one system call to write, one to read,
nothing to lock (a link is created whole or not at all).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct

from ..cache.shared import filled
from ..store.objects import ObjectInfo

INODES, HANDLES, POSITIONS, VERSIONS = "ino", "fh", "positions", "versions"
_SLOT = struct.Struct("<QQ")  # a handle, and where its last read ended
SLOTS = 8192
_INODE_MASK = (1 << 63) - 1


def derived_inode(path: str, is_dir: bool) -> int:
    """A path's inode number, the same in every worker; a file and a directory at one path differ (the kernel must
    see a new inode when a name changes kind). Never 0 or 1 (the root's)."""
    digest = hashlib.blake2b(("d" if is_dir else "f").encode() + path.encode("utf-8", "surrogateescape"),
                             digest_size=8).digest()
    inode = int.from_bytes(digest, "little") & _INODE_MASK
    return inode if inode > 1 else inode + 2


def _table(path: str) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        return mmap.mmap(fd, SLOTS * _SLOT.size)
    finally:
        os.close(fd)


class Registry:
    def __init__(self, root: str):
        self._inodes = os.path.join(root, INODES)
        self._handles = os.path.join(root, HANDLES)
        self._named: set[int] = set()  # inodes this worker wrote (or found) already

        self._positions = _table(os.path.join(root, POSITIONS))
        self._versions = _table(os.path.join(root, VERSIONS))

    @staticmethod
    def prepare(root: str) -> None:
        for sub in (INODES, HANDLES):
            os.makedirs(os.path.join(root, sub), mode=0o700, exist_ok=True)
        for name in (POSITIONS, VERSIONS):
            filled(os.path.join(root, name), SLOTS * _SLOT.size)

    def note_position(self, fh: int, end: int) -> None:
        """Where a read of `fh` ended, for whichever worker gets its next read (a sequential reader's reads are
        spread over the workers: each must see the run, not a seek). A slot per handle modulo SLOTS: a handle that
        shares one may be taken for a seek once, never for wrong bytes."""
        _SLOT.pack_into(self._positions, (fh % SLOTS) * _SLOT.size, fh, end)

    def reopened(self, inode: int, etag: str) -> bool:
        """Was the last open of `inode`, by any worker, of this version? (Only then may the kernel keep the pages it
        cached: each worker's own memory of it would let a worker with an older listing keep another's newer pages.)
        A slot shared by two inodes answers no: a cache dropped, never mixed."""
        tag = int.from_bytes(hashlib.blake2b(etag.encode("utf-8", "surrogateescape"), digest_size=8).digest(), "little")
        at = (inode % SLOTS) * _SLOT.size
        same = _SLOT.unpack_from(self._versions, at) == (inode, tag)
        _SLOT.pack_into(self._versions, at, inode, tag)
        return same

    def position(self, fh: int) -> int | None:
        owner, end = _SLOT.unpack_from(self._positions, (fh % SLOTS) * _SLOT.size)
        return end if owner == fh else None

    def name_inode(self, inode: int, path: str, is_dir: bool) -> bool:
        """Name an inode for every worker; False where another path holds that number already (two paths whose
        derived numbers collide: the later one is refused, never answered as the other)."""
        if inode in self._named:
            return True
        target = (b"d" if is_dir else b"f") + (os.fsencode(path) or b"/")
        link = os.path.join(self._inodes, f"{inode:x}")
        try:
            os.symlink(target, link)
        except FileExistsError:
            if os.readlink(link.encode()) != target:
                return False
        self._named.add(inode)
        return True

    def named(self, inode: int) -> bool:
        """Did this worker name (or look up) the inode already (so a node it holds at that number is that path)?"""
        return inode in self._named

    def inode_path(self, inode: int) -> tuple[str, bool] | None:
        """(path, is_dir) of an inode some worker named, or None."""
        try:
            target = os.readlink(os.path.join(self._inodes, f"{inode:x}").encode())
        except FileNotFoundError:
            return None
        path = target[1:]
        return ("" if path == b"/" else os.fsdecode(path)), target[:1] == b"d"

    def checked(self, inode: int) -> None:
        """This worker's node at `inode` is the path the registry names (resolve looked)."""
        self._named.add(inode)

    def open_handle(self, fh: int, info: ObjectInfo) -> None:
        etag = info.etag.encode("utf-8", "surrogateescape")
        target = b"%d:%r:%d:" % (info.size, info.mtime, len(etag)) + etag + os.fsencode(info.key)
        os.symlink(target, os.path.join(self._handles, f"{fh:x}"))

    def handle(self, fh: int) -> ObjectInfo | None:
        """The version a file handle was opened on (by any worker), or None once released."""
        try:
            target = os.readlink(os.path.join(self._handles, f"{fh:x}").encode())
        except FileNotFoundError:
            return None
        size, mtime, length, rest = target.split(b":", 3)
        n = int(length)
        return ObjectInfo(key=os.fsdecode(rest[n:]), size=int(size), etag=rest[:n].decode("utf-8", "surrogateescape"),
                          mtime=float(mtime))

    def release_handle(self, fh: int) -> None:
        try:
            os.unlink(os.path.join(self._handles, f"{fh:x}"))
        except FileNotFoundError:
            pass
