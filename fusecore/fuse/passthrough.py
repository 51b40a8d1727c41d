"""FUSE passthrough of held files: an OPEN of an object held whole in a file (the disk tier's, or, for a mount served
by several workers, the block file in their shared memory) is answered with that file as its backing file, and the
kernel then reads it itself (no READ reaches the mount).

The kernel's rule (fs/fuse/iomode.c, Linux 6.9+): while an inode has a file open in passthrough, every other open of
it must be a passthrough open of the same backing file, and an inode with a file open in the page-cache mode takes
no passthrough open; breaking either fails the user's open(2) with EIO. So this keeps, per inode, which mode its
live opens are in and answers every open in that mode: passthrough only when no cached open is live (a RELEASE
arrives after the kernel let go, so this errs towards the cached mode), and the same backing while passthrough
opens are live. An object that changed while its old version is open in passthrough is refused (EBUSY) until the
old opens close: neither mode could serve the new version then, and the old bytes are never served for it. An open
for writing (a writable mount's) is a page-cache open: refused (EBUSY) while the inode is open in passthrough.

An inode's modes are counts (cached opens, passthrough opens, the backing id and the version they read), kept where
every process that answers the mount's requests sees them: in this process (`LocalModes`), or, for a mount served by
several workers, in a table in the shared folder, an inode's record locked while an open or a release reads and
changes it (`SharedModes`): the kernel may hand an inode's opens and releases to different workers, and a backing id
of one worker's is every worker's (it belongs to the connection). A handle open in passthrough carries BACKED, so that
its release, wherever it lands, knows which count it ends.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import mmap
import os
import struct
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

from ..store.objects import ObjectInfo
from .session import FuseError

log = logging.getLogger(__name__)

# An open descriptor of the object's bytes, checked, or None; the flag: a file the workers' shared memory holds may
# be the one (DataPath.held_file)
HeldFile = Callable[[ObjectInfo, bool], "int | None"]
BACKED = 1 << 39  # set in a handle open in passthrough (a reader's handles stay below it: 2^39 opens a worker's start)


def shared_memory_backs(kernel_cache: bool, writable: bool) -> bool:
    """May a block file the workers share in memory back an open? Not where the mount keeps the page cache (it serves
    a file's later opens for less, and stays empty for a file opened in passthrough: the small cell's warm pass with
    two workers lost 12-17% files/s at +29-42% CPU), nor on a writable mount (decided while its opens for writing,
    the hub's, were counted in no worker's modes; they are since Passthrough.open_for_writing, so that reason is gone,
    and the rule stays until a writable mount's reads are measured without it)."""
    return not kernel_cache and not writable


def backed_handle(fh: int) -> int:
    return fh | BACKED


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
    def idle(self, inode: int) -> bool:
        """Has the inode no live open now (as far as a look without the lock can tell)?"""
        ...

    def locked(self, inode: int) -> AbstractContextManager[InodeModes]: ...


class LocalModes:
    """The modes of one process's inodes (a mount served by this process alone)."""

    def __init__(self) -> None:
        self._inodes: dict[int, InodeModes] = {}

    def idle(self, inode: int) -> bool:
        return inode not in self._inodes

    @contextmanager
    def locked(self, inode: int) -> Iterator[InodeModes]:
        state = self._inodes.setdefault(inode, InodeModes())
        try:
            yield state
        finally:
            if not state.cached and not state.backed:
                del self._inodes[inode]


_RECORD = struct.Struct("<QIIIIQ")  # inode (0: a free slot), cached, backed, backing, (pad), version
MODES = "modes"
MODE_SLOTS = 1 << 16  # 2 MiB of records, written at start
WINDOW = 32  # slots an inode's record may take, from its home slot on
_WINDOW_INODES = struct.Struct("<" + f"Q{_RECORD.size - 8}x" * WINDOW)  # the inode of each record of a window


class SharedModes:
    """The modes of a mount's inodes as every worker sees them: a table of records in the shared folder (written
    whole at start: its memory never runs short later), an inode's in one of the WINDOW slots from its home slot.
    An open or a release locks its inode's window (a POSIX record lock on that range of the table: windows that
    overlap exclude each other), finds or takes the record, changes it and lets go; no record is held across a
    check of a held file (Passthrough.open registers its backing first). An open whose window is full (WINDOW inodes
    with live opens among its neighbours) is refused EBUSY: it cannot be counted, and an uncounted open could break
    the kernel's rule. A worker killed between its change and its reply leaves a count that is never released: that
    inode then stays in the mode it was in (both serve right bytes)."""

    def __init__(self, root: str):
        fd = os.open(os.path.join(root, MODES), os.O_RDWR | os.O_CLOEXEC)
        self._fd = fd  # (kept open: closing any descriptor of the table would let go of this process's locks)
        self._table = mmap.mmap(fd, MODE_SLOTS * _RECORD.size)

    @staticmethod
    def prepare(root: str) -> None:
        with open(os.path.join(root, MODES), "wb") as f:
            f.write(bytes(MODE_SLOTS * _RECORD.size))

    @staticmethod
    def _home(inode: int) -> int:
        return (inode * 0x9E3779B97F4A7C15 >> 17) % (MODE_SLOTS - WINDOW)

    def _find(self, inode: int, home: int) -> tuple[int | None, int | None]:
        """The slot holding the inode's record, and the first free slot, in its window."""
        held = _WINDOW_INODES.unpack_from(self._table, home * _RECORD.size)
        if inode in held:
            return home + held.index(inode), None
        return None, (home + held.index(0) if 0 in held else None)

    def idle(self, inode: int) -> bool:
        return self._find(inode, self._home(inode))[0] is None

    @contextmanager
    def locked(self, inode: int) -> Iterator[InodeModes]:
        home = self._home(inode)
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX, WINDOW, home)
        except OSError as exc:
            log.warning("passthrough: cannot lock the modes of inode %d: %s", inode, exc)
            raise FuseError(errno.EIO) from None
        try:
            mine, free = self._find(inode, home)
            slot = mine if mine is not None else free
            if slot is None:
                log.warning("passthrough: no room to count the opens of inode %d (its window is full): refused",
                            inode)
                raise FuseError(errno.EBUSY)
            where = slot * _RECORD.size
            _, cached, backed, backing, _, version = _RECORD.unpack_from(self._table, where) if mine is not None \
                else (0, 0, 0, 0, 0, 0)
            state = InodeModes(cached, backed, backing, version)
            yield state
            if state.cached or state.backed:
                _RECORD.pack_into(self._table, where, inode, state.cached, state.backed, state.backing, 0,
                                  state.version)
            elif mine is not None:
                _RECORD.pack_into(self._table, where, 0, 0, 0, 0, 0, 0)
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, WINDOW, home)


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

    def open(self, fh: int, inode: int, info: ObjectInfo, memory: bool = True) -> int:
        """The backing id to answer this open with (its handle then `backed_handle(fh)`), or 0 for the page-cache
        mode (reads reach the mount). A held file is checked and registered before the inode's record is locked (a
        check may read the whole file); a registration another open made unneeded meanwhile is let go. `memory`: a
        file the workers' shared memory holds may back it (not where the kernel may hold the file's pages itself)."""
        version = _version(info.etag)
        prepared = self._register(info, memory) if self.enabled and self._modes.idle(inode) else 0
        try:
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
                if state.cached or not prepared:
                    state.cached += 1
                    return 0
                state.backed, state.backing, state.version = 1, prepared, version
                self.opened += 1
                prepared = 0  # (the inode's now)
                return state.backing
        finally:
            if prepared:
                self._backings.close_backing(prepared)

    def open_for_writing(self, inode: int) -> bool:
        """An open for writing (never in passthrough), counted as a page-cache open until its release; False (not
        counted) while the inode is open in passthrough: the kernel would fail it (EIO) only after the mount had
        begun the write, and that open's release then made the file an empty object."""
        with self._modes.locked(inode) as state:
            if state.backed:
                return False
            state.cached += 1
            return True

    def _register(self, info: ObjectInfo, memory: bool) -> int:
        fd = self._held(info, memory)
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
