"""Block buffers that receive GET bodies.

Large buffers are anonymous mmaps populated up front (MAP_POPULATE, inside mmap(2), which CPython
calls without the GIL): receiving a body into never-touched pages costs a page fault per 4 KiB
inside the kernel's socket copy, which measured 2-3x more system time per GiB than populating the
mapping in one call; the fetcher maps a block's buffer in the thread that receives its
body, never on the event loop's thread. A dropped block's buffer is either kept for the next GET
(BlockCache.take_buffer, a few at most) or unmapped at once, so freed memory goes back to the system.

Not on transparent huge pages: asking for them (madvise MADV_HUGEPAGE, then MADV_POPULATE_WRITE)
saved 10-15% of CPU per GiB on a machine whose free memory is backed, but cost a third of a cold
sequential read's throughput on VMs that hand free memory back to the host (virtio-balloon free
page reporting, as on our Firecracker machines): a huge page is always carved from a free 2 MiB
block, which is exactly what such a VM has returned to the host, so each fault waits for the host
to back 2 MiB again; and CPython's mmap.madvise holds the GIL while it populates, stalling every
receiving thread. Measured A/B in docs/operations.md ("Data-path A/B").
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
