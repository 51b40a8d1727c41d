"""Open files and reads: cache lookups, demand GETs for missing blocks, prefetch ahead."""

from __future__ import annotations

import itertools
from collections import OrderedDict

import trio

from ..cache.blocks import BlockKey, block_extent, block_span
from ..cache.memory import Buffer
from .fetcher import Fetcher
from ..metrics import MountMetrics
from .prefetch import ReadAhead
from ..store.objects import ObjectInfo
from ..store.errors import NotFound, StoreError
from .registry import Registry
from .writes import WRITE_HANDLES

FIRST_BLOCK_PARTS = 8  # a file read from offset 0 with the initial window gets its first block in this many GETs
# (512 KiB each for 4 MiB blocks: the first 1 MiB read returns after 512 KiB at one connection's rate), while
# no other file is in flight (Fetcher._alone)


class OpenFile:
    """One open() of one object version; reads of it always use the version seen at open."""

    __slots__ = ("fh", "info", "readahead", "closed")

    def __init__(self, fh: int, info: ObjectInfo, readahead: ReadAhead):
        self.fh = fh
        self.info = info
        self.readahead = readahead
        self.closed = False

    def wants(self, seeks: int) -> bool:
        """Is a prefetch issued after `seeks` seeks still useful? Not once the file seeks or closes."""
        return not self.closed and self.readahead.seeks == seeks


FOREIGN_FILES = 4096  # with several workers: open files this worker keeps read-ahead state for (registry.py)
SPAWN_SHIFT = 40  # a worker's file handles: its spawn number above this bit, its opens below (2^40 each)
MAX_SPAWN = (WRITE_HANDLES >> SPAWN_SHIFT) - 1  # the largest spawn number whose handles stay under a write's


class Reader:
    def __init__(self, fetcher: Fetcher, metrics: MountMetrics, *, block_size: int, prefetch_limit: int,
                 initial_prefetch: int = 0, registry: Registry | None = None, worker: int = 0):
        """With several workers (`registry`), a handle is unique to the mount (the worker's number in its high bits)
        and its version is in the registry, so that any worker reads it; each keeps its own read-ahead state."""
        self.fetcher = fetcher
        self.registry = registry
        self.block_size = block_size
        self.max_window_blocks = max(1, prefetch_limit // block_size)
        self.initial_window_blocks = max(1, initial_prefetch // block_size)
        self._files: OrderedDict[int, OpenFile] = OrderedDict()
        self.read_calls = 0
        self.read_bytes = 0
        if not 0 <= worker <= MAX_SPAWN:
            raise ValueError(f"worker {worker} out of range")
        self._handles = itertools.count((worker << SPAWN_SHIFT) + 1)
        self._served_cache = metrics.bytes_served.labels(source="cache")
        self._served_network = metrics.bytes_served.labels(source="network")

    def new_handle(self) -> int:
        """A handle number no open of this mount has (an open the kernel reads itself takes one too)."""
        return next(self._handles)

    def open(self, info: ObjectInfo, fh: int | None = None) -> int:
        """Reads of `info` under handle `fh` (a new one where None), for whichever worker gets them."""
        fh = self.new_handle() if fh is None else fh
        if self.registry is not None:
            self.registry.open_handle(fh, info)
        self._add(fh, info)
        return fh

    def _add(self, fh: int, info: ObjectInfo) -> OpenFile:
        f = self._files[fh] = OpenFile(fh, info, ReadAhead(info.size, self.block_size, self.max_window_blocks,
                                                           self.initial_window_blocks))
        if self.registry is not None and len(self._files) > FOREIGN_FILES:
            self._files.popitem(last=False)[1].closed = True  # (released elsewhere, or idle: the registry has it)
        return f

    def _file(self, fh: int) -> OpenFile:
        f = self._files.get(fh)
        if f is not None:
            return f
        info = self.registry.handle(fh) if self.registry is not None else None
        if info is None:
            raise NotFound(f"file handle {fh} is not open")
        return self._add(fh, info)  # opened by another worker

    def _follow(self, f: OpenFile, offset: int, size: int) -> None:
        """Several workers: a read that continues where another worker's read of this file ended continues its run
        here (registry.note_position)."""
        assert self.registry is not None
        end = self.registry.position(f.fh)
        last = f.readahead.last_end
        if last < 0 < offset:
            # this worker's first read of the file: the run began in another worker (whose reads, the kernel's
            # readahead among them, may land here out of order by more than a block or two)
            f.readahead.continue_at(offset)
        elif end is not None and end != last and abs(offset - end) <= 2 * self.block_size:
            f.readahead.continue_at(end)
        self.registry.note_position(f.fh, offset + size)

    def release(self, fh: int) -> None:
        if self.registry is not None:
            self.registry.release_handle(fh)
        f = self._files.pop(fh, None)
        if f is not None:
            f.closed = True

    @property
    def open_files(self) -> int:
        return len(self._files)

    async def read(self, fh: int, offset: int, size: int) -> Buffer:
        f = self._file(fh)
        if self.registry is not None:
            self._follow(f, offset, size)
        info = f.info
        self.read_calls += 1
        self.read_bytes += size
        span = block_span(offset, size, info.size, self.block_size)
        if not span:
            return b""
        ahead = f.readahead.on_read(offset, size)
        seeks = f.readahead.seeks
        for index in ahead:
            if not self.fetcher.prefetch(info, index, lambda: f.wants(seeks)):
                f.readahead.unissue(index)
                break
        if f.readahead.paged(span[0]) and not self._blocks_cached(info, span):
            return await self._read_range(f, offset, size)
        if len(span) == 1:
            block_start, block_end = block_extent(span[0], info.size, self.block_size)
            start = offset - block_start
            need = min(start + size, block_end - block_start)
            shared = self.fetcher.shared
            block = BlockKey(info.key, info.etag, span[0])
            if shared is not None and block not in self.fetcher.cache:
                # another worker's block: the bytes asked for, from its file (not the whole block, copied here)
                held = shared.read(block, block_end - block_start, start, need)
                if held is not None:
                    self._served_cache.inc(len(held))
                    return held
            parts = FIRST_BLOCK_PARTS if f.readahead.opens_wide(offset) else 1
            data, hit = await self.fetcher.block(info, span[0], visit=fh, need=need, parts=parts)
            if need == block_end - block_start:
                self.fetcher.cache.passed(BlockKey(info.key, info.etag, span[0]))
            view = memoryview(data)[start:need]
            (self._served_cache if hit else self._served_network).inc(len(view))
            return view
        return await self._read_many(f, span, offset, size)

    async def _read_range(self, f: OpenFile, offset: int, size: int) -> Buffer:
        """A young random run's read: exactly the bytes asked for (or a held range that holds them)."""
        stop = min(offset + size, f.info.size)
        data, hit, base = await self.fetcher.range(f.info, offset, stop, visit=f.fh)
        view = memoryview(data)[offset - base:stop - base]
        (self._served_cache if hit else self._served_network).inc(len(view))
        return view

    def _blocks_cached(self, info: ObjectInfo, span: range) -> bool:
        cache = self.fetcher.cache
        return all(BlockKey(info.key, info.etag, i) in cache for i in span)

    async def _read_many(self, f: OpenFile, span: range, offset: int, size: int) -> bytes:
        """A read across blocks waits for all of them concurrently, then joins the slices."""
        blocks: dict[int, tuple[Buffer, bool]] = {}
        errors: list[StoreError] = []

        end = min(offset + size, f.info.size)

        async def one(index: int) -> None:
            start, stop = block_extent(index, f.info.size, self.block_size)
            try:
                blocks[index] = await self.fetcher.block(f.info, index, visit=f.fh, need=min(end, stop) - start)
            except StoreError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for index in span:
                nursery.start_soon(one, index)
        if errors:
            raise errors[0]
        parts = []
        for index in span:
            data, hit = blocks[index]
            start, stop = block_extent(index, f.info.size, self.block_size)
            part = memoryview(data)[max(offset, start) - start:min(end, stop) - start]
            (self._served_cache if hit else self._served_network).inc(len(part))
            parts.append(part)
        return b"".join(parts)
