"""A virtual machine that hands freed memory back to its host skews every cold figure: pause that for a run.

Firecracker-style VMs (virtio-balloon free page reporting) report each free 2 MiB block to the host, which
drops it; the next process to use that memory takes a host fault per 4 KiB page (measured on the CI VM:
~10 µs each, 2.7 s per GiB, where zeroing a page the host still backs costs 0.4 s per GiB). A cold read
through a caching mount touches two fresh pages per 4 KiB delivered (its block buffer and the kernel's page
cache), a client reusing buffers none, so a 256 MiB cold read fell from ~410 to ~200 MB/s and its CPU per
GiB rose from 1.7 to 4.6-6.5 with nothing changed but how long the VM had been idle. Nodes that train models
do not return memory that way. So for a run the bench stops the reporting (root only, restored afterwards)
and touches memory once, so that pages come backed, as on a node."""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass
from typing import Iterator

from fusecore.cache import pages
from fusecore.cache.buffers import allocate

REPORTING_ORDER = os.path.join(pages.SYS, pages.REPORTING_ORDER)
NEVER = str(pages.largest_order() + 1)  # above the largest buddy order: no free block qualifies for reporting
PRIME_LIMIT = 8 << 30
_CHUNK = 256 << 20


@dataclass
class HostMemory:
    """What the run found and did, for the report."""

    reporting: str  # "absent" (or not active), "paused" (from `order`), "kept" (--keep-page-reporting), "cannot pause: why"
    order: str = ""
    primed_bytes: int = 0

    def describe(self) -> str:
        if self.reporting == "absent":
            return ""
        if self.reporting == "paused":
            primed = f" and {self.primed_bytes / 2**30:.1f} GiB touched first" if self.primed_bytes else ""
            return (f"This VM returns freed memory to its host (free page reporting): paused for the run{primed}, "
                    "so fresh pages cost what they cost on a node, and Stoker's mounts put block buffers on 2 MiB "
                    "pages as they do on one (`--keep-page-reporting` measures with it, and 4 KiB pages).")
        return (f"This VM returns freed memory to its host (free page reporting, order {self.order}), "
                f"{self.reporting}: every fresh page costs a host fault, which weighs on systems that allocate "
                "while they read (cold figures about halved on the CI VM).")


def available_bytes(meminfo: str = "/proc/meminfo") -> int:
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def prime(nbytes: int) -> int:
    """Touch `nbytes` of anonymous memory at once, then free it: the pages stay backed by the host.
    Returns what was touched (the mount's populated buffers; a chunk the kernel refused to map is not)."""
    held: list[bytearray | mmap.mmap] = []
    try:
        while len(held) * _CHUNK < nbytes:
            held.append(allocate(min(_CHUNK, nbytes - len(held) * _CHUNK)))
        return sum(len(m) for m in held if isinstance(m, mmap.mmap))
    finally:
        for m in held:
            if isinstance(m, mmap.mmap):
                m.close()


@contextlib.contextmanager
def reporting_paused(keep: bool = False, path: str = REPORTING_ORDER,
                     prime_limit: int = PRIME_LIMIT) -> Iterator[HostMemory]:
    """Free page reporting off for the block (and memory primed), put back as it was after."""
    try:
        with open(path) as f:
            order = f.read().strip()
    except OSError:
        yield HostMemory("absent")
        return
    if order == NEVER:  # an enclosing run (the A/B's parent) paused it and primed
        yield HostMemory("paused")
        return
    if pages.active_order(order) is None:  # built in, but no balloon driver registered: nothing is reported
        yield HostMemory("absent")
        return
    if keep:
        yield HostMemory("kept", order)
        return
    try:
        with open(path, "w") as f:
            f.write(NEVER)
    except OSError as exc:
        yield HostMemory(f"cannot pause ({exc.strerror or type(exc).__name__})", order)
        return
    try:
        yield HostMemory("paused", order, prime(min(prime_limit, available_bytes() // 2)))
    finally:
        with open(path, "w") as f:
            f.write(order)
