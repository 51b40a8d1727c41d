"""The node's mount table as the volume lifecycle sees it: what is mounted where, read-only binds
that follow a mount, and unmounting everything stacked on a path.

`HostMounts` is the kernel (fusecore.process.mounts: mountinfo, mount(2), umount2); a fake with the same
rules stands beside it for fast tests (tests/support/fakekernel.py). Mount *processes* are started
through the Mounter (mounter.py); this is everything else VolumeManager does to mounts.
"""

from __future__ import annotations

from typing import Protocol

from fusecore.process.mounts import MountInfo, bind_follower, mount_table, unmount_stack


class MountTable(Protocol):
    def table(self) -> list[MountInfo]: ...

    def bind(self, source: str, target: str, read_only: bool = True) -> None:
        """A bind of `source` at `target` (read-only unless asked) that follows later mounts stacked on `source`;
        OSError."""

    def unmount(self, path: str) -> str | None:
        """Unmount every layer at `path`; None once nothing is mounted there, else why something still is."""


class HostMounts:
    """The kernel's mount table."""

    def table(self) -> list[MountInfo]:
        return mount_table()

    def bind(self, source: str, target: str, read_only: bool = True) -> None:
        bind_follower(source, target, read_only)

    def unmount(self, path: str) -> str | None:
        return unmount_stack(path)

