"""What the kernel has mounted, from /proc/self/mountinfo: also right for a FUSE mount whose
process died, where every access fails with ENOTCONN."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time

NOT_READY_STATUS = 124  # exit status of `stoker mount` whose mount did not become ready (like timeout(1))

_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo octal."""
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def mount_entries(mountinfo: str = "/proc/self/mountinfo") -> list[tuple[str, str]]:
    """(mount point, filesystem type) of every mount, in mount order."""
    entries = []
    with open(mountinfo) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if len(fields) >= 5 and right:
                entries.append((_unescape(fields[4]), right.split()[0]))
    return entries


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


def wait_unmounted(path: str, timeout: float) -> bool:
    """True once mountinfo no longer lists `path` (a FUSE unmount completes asynchronously)."""
    deadline = time.monotonic() + timeout
    while is_mounted(path):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True
