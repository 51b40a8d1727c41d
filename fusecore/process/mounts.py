"""What the kernel has mounted, from /proc/self/mountinfo (also right for a FUSE mount whose
process died, where every access fails with ENOTCONN), and the few mount(2) calls Stoker makes.

mount(2) is called directly (ctypes), not through mount(8): mount(8) canonicalises the target
with stat(), which fails with ENOTCONN on a dead FUSE mount, and repair mounts on top of one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass

from ..fuse.device import MountOptions, mount_device

NOT_READY_STATUS = 124  # exit status of `stoker mount` whose mount did not become ready (like timeout(1))

_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo octal."""
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


@dataclass(frozen=True)
class MountInfo:
    """One line of mountinfo (proc(5)): enough to tell stacked mounts and their devices apart."""

    mount_id: int
    parent_id: int
    device: str  # "major:minor"
    root: str  # the directory of the filesystem that is mounted here (a bind may mount a subdirectory)
    point: str
    fs_type: str
    propagation: tuple[str, ...]  # optional fields: shared:N, master:N, ...


def mount_table(mountinfo: str = "/proc/self/mountinfo") -> list[MountInfo]:
    """Every mount, in mount order (a mount stacked on a path comes after the one below it)."""
    table = []
    with open(mountinfo) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if len(fields) >= 6 and right:
                table.append(MountInfo(int(fields[0]), int(fields[1]), fields[2], _unescape(fields[3]),
                                       _unescape(fields[4]), right.split()[0], tuple(fields[6:])))
    return table


def mount_entries(mountinfo: str = "/proc/self/mountinfo") -> list[tuple[str, str]]:
    """(mount point, filesystem type) of every mount, in mount order."""
    return [(m.point, m.fs_type) for m in mount_table(mountinfo)]


def top_mount(path: str, table: list[MountInfo] | None = None) -> MountInfo | None:
    """The mount a lookup of `path` reaches (the last one stacked there), or None; `table` saves
    reading mountinfo again when several paths are looked up."""
    target = os.path.abspath(path)
    found = None
    for entry in mount_table() if table is None else table:
        if entry.point == target:
            found = entry
    return found


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
MS_SLAVE, MS_SHARED = 1 << 19, 1 << 20


def mount_fuse_fd(target: str, fsname: str, *, allow_other: bool, uid: int, gid: int, read_only: bool = True) -> int:
    """Open /dev/fuse and mount it at `target`, read-only unless asked (on top of whatever is there, a dead
    mount included); returns the descriptor, to be served by a `stoker mount --fuse-fd`."""
    return mount_device(target, MountOptions(fsname=fsname, subtype="stoker", allow_other=allow_other, uid=uid,
                                             gid=gid, read_only=read_only))


_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442  # the same on every architecture
_OPEN_TREE_CLONE, _AT_FDCWD, _AT_EMPTY_PATH, _MOVE_MOUNT_F_EMPTY_PATH = 1, -100, 0x1000, 0x4
_READ_ONLY_ATTRS = 0x1 | 0x2 | 0x4  # MOUNT_ATTR_RDONLY | NOSUID | NODEV
_READ_WRITE_ATTRS = 0x2 | 0x4  # NOSUID | NODEV


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _syscall(number: int, *args: object) -> int:
    result = _libc.syscall(ctypes.c_long(number), *args)
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def _set_attr(fd: int, attr_set: int = 0, propagation: int = 0) -> None:
    attr = _MountAttr(attr_set, 0, propagation, 0)
    _syscall(_SYS_MOUNT_SETATTR, ctypes.c_int(fd), b"", ctypes.c_uint(_AT_EMPTY_PATH), ctypes.byref(attr),
             ctypes.c_size_t(ctypes.sizeof(attr)))


def bind_follower(source: str, target: str, read_only: bool = True) -> None:
    """Bind `source` at `target` (read-only unless asked: a writable volume's target a pod may write) as a mount that receives what is mounted on `source` later
    (a slave of it) and shares the rest with its own copies (in every namespace that sees `target`).

    Mounting a new filesystem on `source` then reaches `target` and every container's view of it,
    and unmounting `target` (each layer) travels to its own copies only, never back to `source`.
    """
    try:
        fd = _syscall(_SYS_OPEN_TREE, ctypes.c_int(_AT_FDCWD), source.encode(),
                      ctypes.c_uint(_OPEN_TREE_CLONE | os.O_CLOEXEC))
    except OSError as exc:
        raise OSError(exc.errno, f"bind of {source}: {exc.strerror}") from exc
    try:
        _set_attr(fd, _READ_ONLY_ATTRS if read_only else _READ_WRITE_ATTRS, MS_SLAVE)
        _set_attr(fd, 0, MS_SHARED)
        _syscall(_SYS_MOVE_MOUNT, ctypes.c_int(fd), b"", ctypes.c_int(_AT_FDCWD), target.encode(),
                 ctypes.c_uint(_MOVE_MOUNT_F_EMPTY_PATH))
    except OSError as exc:
        raise OSError(exc.errno, f"bind at {target}: {exc.strerror}") from exc
    finally:
        os.close(fd)


def is_mounted(path: str) -> bool:
    target = os.path.abspath(path)
    return any(point == target for point, _ in mount_entries())


def fs_type(path: str) -> str | None:
    """The type of the topmost mount at `path` (e.g. 'fuse.stoker'), or None."""
    target = os.path.abspath(path)
    found = None
    for point, kind in mount_entries():
        if point == target:
            found = kind
    return found


def unmount(path: str) -> str | None:
    """Unmount `path` (a FUSE mount or a bind of one); falls back to a lazy unmount for a dead FUSE
    mount or a busy bind. Returns None once mountinfo no longer shows the path, else why it still does.
    """
    mp = os.path.abspath(path)
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    first = subprocess.run([tool, "-u", mp] if tool else ["umount", mp], capture_output=True, text=True)
    if first.returncode != 0 and is_mounted(mp):
        # A mount whose process died ("transport endpoint is not connected") needs a lazy unmount.
        subprocess.run([tool, "-uz", mp] if tool else ["umount", "-l", mp], capture_output=True, text=True)
    if is_mounted(mp):
        return first.stderr.strip() or f"{mp} is still mounted"
    return None


MNT_DETACH = 2


def detach_top(path: str, device: str) -> None:
    """Lazily unmount the topmost mount at `path` if it is still the one of `device`."""
    top = top_mount(path)
    if top is not None and top.device == device:
        _libc.umount2(os.path.abspath(path).encode(), MNT_DETACH)


def unmount_stack(path: str) -> str | None:
    """Unmount every mount stacked at `path`, top first (a dead FUSE layer lazily); returns None
    once mountinfo no longer shows the path, else why it still does."""
    target = os.path.abspath(path).encode()
    for _ in range(64):
        if not is_mounted(path):
            return None
        if _libc.umount2(target, 0) != 0 and _libc.umount2(target, MNT_DETACH) != 0:
            err = ctypes.get_errno()
            if is_mounted(path):
                return f"{path}: {os.strerror(err)}"
    return None if not is_mounted(path) else f"{path} is still mounted"


def wait_unmounted(path: str, timeout: float) -> bool:
    """True once mountinfo no longer lists `path` (a FUSE unmount completes asynchronously)."""
    deadline = time.monotonic() + timeout
    while is_mounted(path):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True
