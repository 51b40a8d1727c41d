"""What the kernel has mounted, from /proc/self/mountinfo: also right for a FUSE mount whose
process died, where every access fails with ENOTCONN."""

from __future__ import annotations

import os
import re

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
