"""Which pages block buffers are carved from: 2 MiB (transparent huge pages) or 4 KiB, decided once per mount.

A cold read fills a fresh block buffer per block. Populating it page by page is a fifth of a cold read's
CPU (measured: 0.33-0.39 CPU-s per GiB on 4 KiB pages, 0.10 on 2 MiB pages, memory backed), so buffers
go on huge pages where that is cheap. It is not on a VM that reports free memory to its host (virtio-balloon
or Hyper-V free page reporting, as on Firecracker): each free 2 MiB block is handed back as soon as it forms,
and a huge page is always carved from one, so every fault would wait for the host (2.4 CPU-s per GiB
measured, and a third of a cold read's throughput). "auto" therefore takes huge pages only where the kernel
offers them (transparent_hugepage not "never") and no free page reporting is active; "on" and "off" decide
regardless of the reporting; blocks smaller than a huge page stay on 4 KiB pages whatever the setting.
Reads /sys and /proc only, and changes nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .buffers import HUGE_PAGE

SYS = "/sys"
THP_ENABLED = "kernel/mm/transparent_hugepage/enabled"
REPORTING_ORDER = "module/page_reporting/parameters/page_reporting_order"
BUDDY_INFO = "/proc/buddyinfo"
DEFAULT_MAX_ORDER = 10  # the largest buddy order on x86-64 and most arm64 kernels


@dataclass(frozen=True)
class Pages:
    huge: bool
    why: str  # for the mount's log and stats

    @property
    def size(self) -> str:
        return "2 MiB" if self.huge else "4 KiB"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def thp_mode(sys_root: str = SYS) -> str:
    """The bracketed word of transparent_hugepage/enabled ("always", "madvise", "never"), "" if absent."""
    text = _read(os.path.join(sys_root, THP_ENABLED)) or ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


def largest_order(buddyinfo: str = BUDDY_INFO) -> int:
    """The largest buddy order of this kernel: /proc/buddyinfo has one count per order."""
    text = _read(buddyinfo)
    if not text:
        return DEFAULT_MAX_ORDER
    words = text.splitlines()[0].split()
    return len(words) - 5 if len(words) > 5 else DEFAULT_MAX_ORDER  # "Node 0, zone DMA" then the counts


def reporting_order(sys_root: str = SYS, buddyinfo: str = BUDDY_INFO) -> int | None:
    """The order of the free blocks this kernel reports to its host, or None if it reports none.

    The parameter reads 4294967295 until a balloon driver registers; a value above the largest order means
    no free block qualifies (how `stoker bench` pauses the reporting for a run)."""
    return active_order(_read(os.path.join(sys_root, REPORTING_ORDER)), buddyinfo)


def active_order(text: str | None, buddyinfo: str = BUDDY_INFO) -> int | None:
    """page_reporting_order's text as the order reported, or None where no free block qualifies."""
    if text is None or not text.strip().isdigit():
        return None
    order = int(text)
    return order if order <= largest_order(buddyinfo) else None


def choose(setting: str, block_size: int, sys_root: str = SYS, buddyinfo: str = BUDDY_INFO) -> Pages:
    """The pages of this mount's block buffers for `setting` (auto, on, off: MountConfig checked it)."""
    if setting == "off":
        return Pages(False, "--huge-pages off")
    if block_size < HUGE_PAGE:
        return Pages(False, f"blocks of {block_size // 1024} KiB are smaller than a 2 MiB page")
    mode = thp_mode(sys_root)
    if mode in ("", "never"):
        return Pages(False, "the kernel offers no transparent huge pages"
                     + (" (transparent_hugepage is never)" if mode else ""))
    if setting == "on":
        return Pages(True, "--huge-pages on")
    order = reporting_order(sys_root, buddyinfo)
    if order is not None:
        return Pages(False, f"this VM reports free memory to its host (free page reporting, order {order}): "
                            "a huge page would wait for the host on every fault")
    return Pages(True, f"transparent huge pages ({mode}), no free page reporting")
