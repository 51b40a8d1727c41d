"""Block buffers that receive GET bodies.

Large buffers are anonymous mmaps populated up front (MAP_POPULATE): receiving a body into
never-touched pages costs a page fault per 4 KiB inside the kernel's socket copy, which measured
2-3x more system time per GiB than populating the mapping in one call. A dropped block's buffer
is either kept for the next GET (BlockCache.take_buffer, a few at most) or unmapped at once, so
freed memory goes back to the system.
"""

from __future__ import annotations

import mmap

MMAP_MIN = 256 * 1024
_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0x8000)


def allocate(nbytes: int) -> bytearray | mmap.mmap:
    """A writable buffer of exactly `nbytes`."""
    if nbytes >= MMAP_MIN:
        try:
            return mmap.mmap(-1, nbytes, flags=_FLAGS)
        except OSError:
            pass
    return bytearray(nbytes)
