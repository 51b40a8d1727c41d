"""Block buffers that receive GET bodies.

Large buffers are anonymous mmaps populated up front (MAP_POPULATE, inside mmap(2), which CPython
calls without the GIL): receiving a body into never-touched pages costs a page fault per 4 KiB
inside the kernel's socket copy, which measured 2-3x more system time per GiB than populating the
mapping in one call; the fetcher maps a block's buffer in the thread that receives its
body, never on the event loop's thread. A dropped block's buffer is either kept for the next GET
(BlockCache.reserve hands it out, a few at most) or unmapped at once, so freed memory goes back to the system.

On transparent huge pages where the mount chose them (pages.py): the mapping is asked for 2 MiB pages
(MADV_HUGEPAGE) and populated by madvise(MADV_POPULATE_WRITE) called through ctypes, which releases
the GIL (CPython's mmap.madvise holds it while the kernel populates, stalling every receiving
thread). Populating on 2 MiB pages costs about a quarter of populating on 4 KiB pages, where the
host backs free memory; on a VM reporting free memory to its host it costs far more, hence the
choice per machine. Measured A/B in docs/operations.md ("Data-path A/B").
"""

from __future__ import annotations

import ctypes
import mmap

MMAP_MIN = 256 * 1024
HUGE_PAGE = 2 * 1024 * 1024
_ANONYMOUS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
_FLAGS = _ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0x8000)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)
_MADV_POPULATE_WRITE = 23  # Linux 5.14; mmap does not name it before Python 3.13


def _libc_madvise():
    """libc's madvise, called without the GIL (ctypes releases it around foreign calls); None where absent."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise()


def _huge(nbytes: int) -> mmap.mmap | None:
    """A mapping on 2 MiB pages, populated; None if the kernel refuses (the caller maps 4 KiB pages)."""
    if _MADV_HUGEPAGE is None or _madvise is None:
        return None
    try:
        m = mmap.mmap(-1, nbytes, flags=_ANONYMOUS)
    except OSError:
        return None
    try:
        m.madvise(_MADV_HUGEPAGE)
    except OSError:
        m.close()
        return None
    view = ctypes.c_char.from_buffer(m)
    address = ctypes.addressof(view)
    del view  # the mapping may be closed (evicted) only once nothing exports it
    # Where populating fails (a kernel before 5.14), the pages come on the first write: two faults a block.
    _madvise(address, nbytes, _MADV_POPULATE_WRITE)
    return m


def allocate(nbytes: int, huge: bool = False) -> bytearray | mmap.mmap:
    """A writable buffer of exactly `nbytes`; on 2 MiB pages if `huge` and it holds one."""
    if huge and nbytes >= HUGE_PAGE:
        m = _huge(nbytes)
        if m is not None:
            return m
    if nbytes >= MMAP_MIN:
        try:
            return mmap.mmap(-1, nbytes, flags=_FLAGS)
        except OSError:
            pass
    return bytearray(nbytes)


_from_size = ctypes.pythonapi.PyByteArray_FromStringAndSize
_from_size.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
_from_size.restype = ctypes.py_object


def populated_bytearray(nbytes: int, huge: bool = False) -> bytearray:
    """A bytearray of `nbytes` whose pages are mapped in one call, for a buffer about to be filled (a part of an
    upload: botocore sends bytes and bytearrays whole, not mmaps). `bytearray(n)` zeroes its memory in the caller's
    thread, a page fault per 4 KiB under the GIL; this one is made without zeroing and populated by one madvise
    without the GIL, on 2 MiB pages where the mount chose them (pages.py). Its bytes are whatever malloc gave (a
    fresh mapping, zero, for a buffer over the mount's M_MMAP_THRESHOLD: daemon.tune_malloc): a caller sends only
    what it wrote into it."""
    if nbytes < MMAP_MIN or _madvise is None:
        return bytearray(nbytes)
    buffer = _from_size(None, nbytes)
    view = ctypes.c_char.from_buffer(buffer)
    start = ctypes.addressof(view)
    del view
    first = (start + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE  # (malloc's header comes first)
    length = (start + nbytes - first) // mmap.PAGESIZE * mmap.PAGESIZE
    if huge and _MADV_HUGEPAGE is not None:
        _madvise(first, length, _MADV_HUGEPAGE)
    _madvise(first, length, _MADV_POPULATE_WRITE)
    return buffer
