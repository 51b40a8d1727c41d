"""Per-open-file sequential detection and a prefetch window that grows on sequential reads.

Pure logic: it answers "which blocks should be fetched ahead now", and whether a read is fetched in
whole blocks or exactly as asked (`paged`), nothing more.
"""

from __future__ import annotations

from ..cache.blocks import block_count, block_span

LONG_RUN_BLOCKS = 4  # a run that began past offset 0 is fetched exactly as asked until it is this many blocks long
AHEAD_SHARE = 4  # ... and then read ahead by at most 1/AHEAD_SHARE of what it has read


class ReadAhead:
    """Sequential detector for one open file.

    A read is sequential when it starts between the block before the furthest block read so far
    and the end of the current window (the kernel issues readahead requests concurrently, so they
    may arrive slightly out of order, and a reader may skip ahead inside what was prefetched).
    After a seek, only a read that continues exactly where the previous one ended starts a new
    sequential run, so random readers landing near each other do not trigger prefetch. On every
    read that continues the previous one or enters a new block the window doubles, up to
    `max_window_blocks`; any other read is a seek and resets the window to zero, so random access
    fetches only what it asks for.

    A read at offset 0 always begins a run from the start, also after other reads: the kernel's first
    readahead requests of a file may reach the mount in any order (the loop starts a batch of request
    tasks forwards or backwards at random), and a file read from its start must not be taken for a
    reader of a split because its second request was handled first.

    A file read from offset 0 that holds at least `initial_window` blocks starts with that window
    (the first GETs of a shard go out together, without waiting for the first block's bytes);
    smaller files start with one block. A run that began anywhere else (a reader of a split of a
    file, or after a seek) is a reader that may stop soon: it is fetched exactly as asked (`paged`) for its
    first LONG_RUN_BLOCKS blocks, and after that read ahead by at most 1/AHEAD_SHARE of the bytes
    it has read, so what it costs the store stays close to what it reads.
    """

    def __init__(self, file_size: int, block_size: int, max_window_blocks: int, initial_window: int = 1):
        self.file_size = file_size
        self.block_size = block_size
        self.max_window = max(0, max_window_blocks)
        self._last_block = block_count(file_size, block_size) - 1
        wide = initial_window if self._last_block + 1 >= initial_window else 1
        self.initial_window = min(max(1, wide), self.max_window)
        self.window = 0
        self.random = False  # the last read was a seek (or a first read past offset 0)
        self.seeks = 0  # reads that broke the sequence; prefetches of an older run are not wanted
        self._last_end = -1
        self._frontier: int | None = None  # highest block index read so far in this run
        self._issued_until = -1  # highest block index already handed out for prefetch
        self._run_start = 0  # offset where the current run began
        self._run_end = 0  # furthest byte read in the current run
        self._from_zero = True  # the current run began at offset 0 (the file's first read)

    @property
    def last_end(self) -> int:
        return self._last_end

    def continue_at(self, end: int) -> None:
        """This file's reader read up to `end` through another worker of the mount: carry on as if that read had
        been seen here, as a run (its window at least one block: a random reader costs one block more, once)."""
        self._frontier = max(0, (end - 1) // self.block_size)
        self._issued_until = max(self._issued_until, self._frontier)
        self._last_end = end
        self._from_zero, self.random, self._run_start, self._run_end = True, False, 0, end
        self.window = max(self.window, 1)

    def unissue(self, index: int) -> None:
        """Blocks from `index` on were not fetched after all; offer them again on the next read."""
        self._issued_until = min(self._issued_until, index - 1)

    def paged(self, index: int) -> bool:
        """Fetch a read in block `index` exactly as asked rather than whole blocks: a random reader, or inside the first
        LONG_RUN_BLOCKS blocks of a run that did not begin at offset 0."""
        if self.random:
            return True
        return not self._from_zero and index * self.block_size < self._run_start + LONG_RUN_BLOCKS * self.block_size

    def opens_wide(self, offset: int) -> bool:
        """Is a read at `offset` the start of a file that gets the initial window (the reader then also
        gets its first block in parts: reader.FIRST_BLOCK_PARTS)?"""
        return offset == 0 and self.initial_window > 1

    def _new_run(self, offset: int) -> None:
        self._run_start = offset
        self._run_end = offset
        self._from_zero = False

    def _ahead_cap(self) -> int:
        """Blocks a run may be read ahead: the window, and for a run that began past 0 a share of its length."""
        if self._from_zero:
            return self.window
        run = self._run_end - self._run_start
        if run < LONG_RUN_BLOCKS * self.block_size:
            return 0
        return min(self.window, run // AHEAD_SHARE // self.block_size)

    def on_read(self, offset: int, size: int) -> range:
        """Record a read and return the block indexes to prefetch now (possibly empty)."""
        span = block_span(offset, size, self.file_size, self.block_size)
        if not span:
            return range(0)
        first, last = span[0], span[-1]
        end, last_end = offset + size, self._last_end
        self._last_end = end
        if self._frontier is None or (offset == 0 and not self._from_zero):
            self.window = self.initial_window if offset == 0 else 0
            self.random = offset != 0
            self._frontier = last if self._frontier is None else max(self._frontier, last)
            if offset != 0:
                self._new_run(offset)
            else:
                self._from_zero, self._run_start = True, 0
        elif self.random and offset != last_end:
            self.seeks += 1  # still random: only an exact continuation starts a sequential run
            self._frontier = last
            self._issued_until = last
            self._new_run(offset)
        elif self._frontier - 1 <= first <= self._frontier + max(1, self.window):
            self.random = False
            if last > self._frontier or offset == last_end:
                self.window = min(self.max_window, max(1, self.window * 2))
            self._frontier = max(self._frontier, last)
        else:
            self.window = 0
            self.random = True
            self.seeks += 1
            self._frontier = last
            self._issued_until = last
            self._new_run(offset)
        self._run_end = max(self._run_end, min(end, self.file_size))
        start = max(last + 1, self._issued_until + 1)
        stop = min(last + self._ahead_cap(), self._last_block) + 1
        if start >= stop:
            return range(0)
        self._issued_until = stop - 1
        return range(start, stop)
