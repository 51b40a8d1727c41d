"""Block planning: which aligned blocks a byte range touches, each block's extent, and the keys the cache
holds: whole blocks, and the exact ranges young random runs ask for."""

from __future__ import annotations

from typing import NamedTuple, Union


class BlockKey(NamedTuple):
    """Identifies one whole block of one version of one object (the unit of read-ahead, warming and peers)."""

    key: str
    etag: str
    index: int  # type: ignore[assignment]  # (tuple.index: a NamedTuple field named as the block's role)


class RangeKey(NamedTuple):
    """Exactly bytes [start, stop) of one version of one object: what a young random run asked for, fetched
    to the byte so that a reader of records at random offsets costs the store what it reads."""

    key: str
    etag: str
    start: int
    stop: int


CacheKey = Union[BlockKey, RangeKey]


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


def extent(key: CacheKey, file_size: int, block_size: int) -> tuple[int, int]:
    """[start, end) byte range a cache key stands for."""
    if isinstance(key, RangeKey):
        return key.start, key.stop
    return block_extent(key.index, file_size, block_size)


def block_count(file_size: int, block_size: int) -> int:
    return (file_size + block_size - 1) // block_size
