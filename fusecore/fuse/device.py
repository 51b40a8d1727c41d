"""Getting a FUSE connection mounted, and letting it go: mount(2) of a `/dev/fuse` descriptor as root (the one call
for a mount's own process and for the CSI mounter, which hands the descriptor to `stoker mount --fuse-fd`), the setuid
fusermount3 for an ordinary user (which passes the descriptor back on a socket, as libfuse does), and the unmount.
No event loop here: the CSI plugin imports it."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import socket
import subprocess
from dataclasses import dataclass

from ..failures import StokerError

log = logging.getLogger(__name__)
_libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4
MNT_DETACH = 2


class MountFailed(StokerError):
    """The kernel or fusermount3 refused the mount (the message says why)."""

    kind = "mount"


@dataclass(frozen=True)
class MountOptions:
    fsname: str
    subtype: str
    allow_other: bool
    uid: int
    gid: int
    read_only: bool = True


def mount(mountpoint: str, options: MountOptions) -> int:
    """A new FUSE connection mounted at `mountpoint`: its first descriptor (INIT still to answer)."""
    if os.geteuid() == 0:
        return mount_device(mountpoint, options)
    return _mount_with_fusermount(mountpoint, options)


def mount_device(mountpoint: str, o: MountOptions) -> int:
    """Open /dev/fuse and mount it at `mountpoint` with mount(2) (root; on top of whatever is there, a dead mount
    included); OSError naming the mount point where the kernel refuses."""
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    data = f"fd={fd},rootmode=40000,user_id={o.uid},group_id={o.gid},default_permissions"
    data += ",allow_other" if o.allow_other else ""
    flags = MS_NOSUID | MS_NODEV | (MS_RDONLY if o.read_only else 0)
    if _libc.mount(o.fsname.encode(), mountpoint.encode(), f"fuse.{o.subtype}".encode(), flags, data.encode()) != 0:
        err = ctypes.get_errno()
        os.close(fd)
        raise OSError(err, f"mount at {mountpoint}: {os.strerror(err)}")
    return fd


def _mount_with_fusermount(mountpoint: str, o: MountOptions) -> int:
    """An ordinary user's mount: the setuid fusermount3 mounts and hands back the descriptor on a socket."""
    tool = shutil.which("fusermount3")
    if tool is None:
        raise MountFailed("mounting as an ordinary user needs fusermount3 (Debian: apt-get install fuse3)")
    opts = ["nosuid", "nodev", "default_permissions", f"fsname={o.fsname}", f"subtype={o.subtype}"]
    opts += ["ro"] if o.read_only else []
    opts += ["allow_other"] if o.allow_other else []
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        env = dict(os.environ, _FUSE_COMMFD=str(theirs.fileno()))
        done = subprocess.run([tool, "-o", ",".join(opts), "--", mountpoint], env=env, pass_fds=(theirs.fileno(),),
                              capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise MountFailed(f"fusermount3 at {mountpoint}: {done.stderr.strip() or f'exit {done.returncode}'}")
        theirs.close()
        _, fds, _, _ = socket.recv_fds(ours, 1, 1)
    if not fds:
        raise MountFailed(f"fusermount3 mounted {mountpoint} but sent no descriptor")
    os.set_inheritable(fds[0], False)
    return fds[0]


def unmount(mountpoint: str) -> None:
    """Detach the mount (what libfuse did on exit): the kernel ends the connection once it is no longer busy."""
    if os.geteuid() == 0:
        if _libc.umount2(mountpoint.encode(), MNT_DETACH) != 0:
            log.debug("umount2 %s: %s", mountpoint, os.strerror(ctypes.get_errno()))
        return
    tool = shutil.which("fusermount3")
    if tool:
        subprocess.run([tool, "-u", "-z", "-q", "--", mountpoint], capture_output=True, timeout=60)
