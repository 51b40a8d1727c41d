"""FUSE passthrough of held files: an OPEN of an object the disk tier holds whole is answered with a backing file,
and the kernel then reads that file itself (no READ reaches the mount).

The kernel's rule (fs/fuse/iomode.c, Linux 6.9+): while an inode has a file open in passthrough, every other open of
it must be a passthrough open of the same backing file, and an inode with a file open in the page-cache mode takes
no passthrough open; breaking either fails the user's open(2) with EIO. So this keeps, per inode, which mode its
live opens are in and answers every open in that mode: passthrough only when no cached open is live (a RELEASE
arrives after the kernel let go, so this errs towards the cached mode), and the same backing while passthrough
opens are live. An object that changed while its old version is open in passthrough is refused (EBUSY) until the
old opens close: neither mode could serve the new version then, and the old bytes are never served for it.

An inode's modes are counts (cached opens, passthrough opens, the backing id and the version they read), kept where
every process that answers the mount's requests sees them: in this process (`LocalModes`), or, for a mount served by
several workers, in the shared folder, one small file per inode open now, locked while an open or a release reads and
changes it (`SharedModes`): the kernel may hand an inode's opens and releases to different workers, and a backing id
of one worker's is every worker's (it belongs to the connection). A handle open in passthrough carries BACKED, so that
its release, wherever it lands, knows which count it ends.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import struct
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

from ..store.objects import ObjectInfo
from .session import FuseError

log = logging.getLogger(__name__)

HeldFile = Callable[[ObjectInfo], "int | None"]  # an open descriptor of the object's bytes, checked, or None
BACKED = 1 << 39  # set in a handle open in passthrough (a reader's handles stay below it: 2^39 opens a worker's start)


def backed_handle(fh: int) -> int:
    return fh | BACKED


def plain_handle(fh: int) -> int:
    """The reader's handle, as it made it."""
    return fh & ~BACKED


class Backings(Protocol):
    def open_backing(self, fd: int) -> int: ...

    def close_backing(self, backing: int) -> None: ...


@dataclass
class InodeModes:
    cached: int = 0  # opens in the page-cache mode
    backed: int = 0  # opens in passthrough
    backing: int = 0
    version: int = 0  # a digest of the ETag the passthrough opens read


class Modes(Protocol):
    def locked(self, inode: int) -> AbstractContextManager[InodeModes]: ...


class LocalModes:
    """The modes of one process's inodes (a mount served by this process alone)."""

    def __init__(self) -> None:
        self._inodes: dict[int, InodeModes] = {}

    @contextmanager
    def locked(self, inode: int) -> Iterator[InodeModes]:
        state = self._inodes.setdefault(inode, InodeModes())
        try:
            yield state
        finally:
            if not state.cached and not state.backed:
                del self._inodes[inode]


_RECORD = struct.Struct("<QQQQ")
MODES = "modes"


class SharedModes:
    """The modes of a mount's inodes as every worker sees them: a file per inode with live opens, under the shared
    folder, flock'ed while read and changed (held for an open's decision, at most one check of a held file), removed
    once no open is left. A worker killed between its change and its reply leaves a count that is never released:
    that inode then stays in the mode it was in (both serve right bytes)."""

    def __init__(self, root: str):
        self._root = os.path.join(root, MODES)

    @staticmethod
    def prepare(root: str) -> None:
        os.makedirs(os.path.join(root, MODES), mode=0o700, exist_ok=True)

    @contextmanager
    def locked(self, inode: int) -> Iterator[InodeModes]:
        path = os.path.join(self._root, f"{inode:016x}")
        fd = self._lock(path)
        try:
            raw = os.pread(fd, _RECORD.size, 0)
            state = InodeModes(*_RECORD.unpack(raw)) if len(raw) == _RECORD.size else InodeModes()
            yield state
            if state.cached or state.backed:
                os.pwrite(fd, _RECORD.pack(state.cached, state.backed, state.backing, state.version), 0)
            else:
                os.unlink(path)  # (with the lock held: a process that opened it before finds it gone, and retries)
        finally:
            os.close(fd)

    @staticmethod
    def _lock(path: str) -> int:
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if os.fstat(fd).st_ino == os.stat(path).st_ino:
                    return fd
            except FileNotFoundError:
                pass  # removed by its last release between our open and our lock
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)


def _version(etag: str) -> int:
    return int.from_bytes(hashlib.blake2b(etag.encode(), digest_size=8).digest(), "little")


class Passthrough:
    def __init__(self, backings: Backings, held: HeldFile, modes: Modes | None = None):
        self._backings = backings
        self._held = held
        self._modes: Modes = modes if modes is not None else LocalModes()
        self.enabled = True
        self.opened = 0  # opens answered with a backing file
        self.closed = 0  # releases of opens in passthrough (answered here: with workers, opened anywhere)
        self.refused = 0  # opens refused: the object changed under a live passthrough open

    def open(self, fh: int, inode: int, info: ObjectInfo) -> int:
        """The backing id to answer this open with (its handle then `backed_handle(fh)`), or 0 for the page-cache
        mode (reads reach the mount)."""
        version = _version(info.etag)
        with self._modes.locked(inode) as state:
            if state.backed:
                if state.version != version:
                    self.refused += 1
                    log.info("an object changed while its old version is open in passthrough: opens of it are "
                             "refused (EBUSY) until those close")
                    raise FuseError(errno.EBUSY)
                state.backed += 1
                self.opened += 1
                return state.backing
            backing = self._register(info) if not state.cached and self.enabled else 0
            if not backing:
                state.cached += 1
                return 0
            state.backed, state.backing, state.version = 1, backing, version
            self.opened += 1
            return backing

    def _register(self, info: ObjectInfo) -> int:
        fd = self._held(info)
        if fd is None:
            return 0
        try:
            return self._backings.open_backing(fd)
        except OSError as exc:
            self.enabled = False
            log.warning("FUSE passthrough is off for this mount: the kernel refused a backing file (%s)",
                        os.strerror(exc.errno or errno.EIO))
            return 0
        finally:
            os.close(fd)

    def release(self, fh: int, inode: int) -> None:
        """The kernel let go of handle `fh` (as it was answered: BACKED where in passthrough) of `inode`."""
        with self._modes.locked(inode) as state:
            if not fh & BACKED:
                state.cached = max(0, state.cached - 1)
                return
            if not state.backed:
                return  # (not an open this mount counted)
            state.backed -= 1
            self.closed += 1
            if not state.backed:
                self._backings.close_backing(state.backing)
                state.backing = state.version = 0

    def stats(self) -> dict:
        return {"enabled": self.enabled, "opens": self.opened, "live": self.live, "refused": self.refused}

    @property
    def live(self) -> int:
        """Handles open in passthrough now (summed over a mount's workers: each counts the opens and releases it
        answered)."""
        return self.opened - self.closed
