"""Block planning: which aligned blocks a byte range touches, and each block's extent."""

from __future__ import annotations

from typing import NamedTuple


class BlockKey(NamedTuple):
    """Identifies one block of one version of one object.

    `unit` is the extent size when it differs from the mount's block size (0): random readers
    fetch smaller pages so that a 256 KiB read does not pull a whole 4 MiB block.
    """

    key: str
    etag: str
    index: int  # type: ignore[assignment]  # (tuple.index: a NamedTuple field named as the block's role)
    unit: int = 0


def block_span(offset: int, size: int, file_size: int, block_size: int) -> range:
    """Indexes of the blocks that [offset, offset+size) touches, clipped to the file."""
    end = min(offset + size, file_size)
    if size <= 0 or offset >= end:
        return range(0)
    return range(offset // block_size, (end - 1) // block_size + 1)


def block_extent(index: int, file_size: int, block_size: int) -> tuple[int, int]:
    """[start, end) byte range of block `index` (the last block may be short)."""
    start = index * block_size
    return start, min(start + block_size, file_size)


def block_count(file_size: int, block_size: int) -> int:
    return (file_size + block_size - 1) // block_size
