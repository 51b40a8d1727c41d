"""FUSE passthrough of held files: an OPEN of an object the disk tier holds whole is answered with a backing file,
and the kernel then reads that file itself (no READ reaches the mount).

The kernel's rule (fs/fuse/iomode.c, Linux 6.9+): while an inode has a file open in passthrough, every other open of
it must be a passthrough open of the same backing file, and an inode with a file open in the page-cache mode takes
no passthrough open; breaking either fails the user's open(2) with EIO. So this keeps, per inode, which mode its
live opens are in and answers every open in that mode: passthrough only when no cached open is live (a RELEASE
arrives after the kernel let go, so this errs towards the cached mode), and the same backing while passthrough
opens are live. An object that changed while its old version is open in passthrough is refused (EBUSY) until the
old opens close: neither mode could serve the new version then, and the old bytes are never served for it.
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Protocol

from ..store.objects import ObjectInfo
from .session import FuseError

log = logging.getLogger(__name__)

HeldFile = Callable[[ObjectInfo], "int | None"]  # an open descriptor of the object's bytes, checked, or None


class Backings(Protocol):
    def open_backing(self, fd: int) -> int: ...

    def close_backing(self, backing: int) -> None: ...


@dataclass
class _Inode:
    cached: set[int] = field(default_factory=set)  # handles open in the page-cache mode
    backed: set[int] = field(default_factory=set)  # handles open in passthrough
    backing: int = 0
    etag: str = ""


class Passthrough:
    def __init__(self, backings: Backings, held: HeldFile):
        self._backings = backings
        self._held = held
        self._inodes: dict[int, _Inode] = {}
        self._inode_of: dict[int, int] = {}  # handle -> inode
        self.enabled = True
        self.opened = 0  # opens answered with a backing file
        self.refused = 0  # opens refused: the object changed under a live passthrough open

    def open(self, fh: int, inode: int, info: ObjectInfo) -> int:
        """The backing id to answer this open with, or 0 for the page-cache mode (reads reach the mount)."""
        state = self._inodes.setdefault(inode, _Inode())
        if state.backed:
            if state.etag != info.etag:
                self.refused += 1
                self._drop_if_unused(inode, state)
                log.info("an object changed while its old version is open in passthrough: opens of it are "
                         "refused (EBUSY) until those close")
                raise FuseError(errno.EBUSY)
            return self._take(fh, inode, state.backed, state.backing)
        if state.cached or not self.enabled:
            return self._take(fh, inode, state.cached, 0)
        backing = self._register(info)
        if not backing:
            return self._take(fh, inode, state.cached, 0)
        state.backing, state.etag = backing, info.etag
        return self._take(fh, inode, state.backed, backing)

    def _take(self, fh: int, inode: int, handles: set[int], backing: int) -> int:
        handles.add(fh)
        self._inode_of[fh] = inode
        if backing:
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

    def release(self, fh: int) -> None:
        inode = self._inode_of.pop(fh, None)
        if inode is None:
            return
        state = self._inodes[inode]
        state.cached.discard(fh)
        if fh in state.backed:
            state.backed.discard(fh)
            if not state.backed:
                self._backings.close_backing(state.backing)
                state.backing, state.etag = 0, ""
        self._drop_if_unused(inode, state)

    def _drop_if_unused(self, inode: int, state: _Inode) -> None:
        if not state.cached and not state.backed:
            self._inodes.pop(inode, None)

    def stats(self) -> dict:
        return {"enabled": self.enabled, "opens": self.opened, "live": self.live, "refused": self.refused}

    @property
    def live(self) -> int:
        """Handles open in passthrough now."""
        return sum(len(s.backed) for s in self._inodes.values())
