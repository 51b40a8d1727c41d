"""What the kernel has mounted, from /proc/self/mountinfo (works for broken FUSE mounts too,
where stat() fails with ENOTCONN and os.path.ismount() says False)."""

from __future__ import annotations

import os


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo octal."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit() and len(field[i + 1:i + 4]) == 3:
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


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
