"""Per-open-file sequential detection and a prefetch window that grows on sequential reads.

Pure logic: it answers "which blocks should be fetched ahead now", nothing more.
"""

from __future__ import annotations

from .blocks import block_count, block_span


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
    """

    def __init__(self, file_size: int, block_size: int, max_window_blocks: int, initial_window: int = 1):
        self.file_size = file_size
        self.block_size = block_size
        self.max_window = max(0, max_window_blocks)
        self.initial_window = min(initial_window, self.max_window)
        self.window = 0
        self.random = False  # the last read was a seek (or a first read past offset 0)
        self.seeks = 0  # reads that broke the sequence; prefetches of an older run are not wanted
        self._last_end = -1
        self._frontier: int | None = None  # highest block index read so far in this run
        self._issued_until = -1  # highest block index already handed out for prefetch
        self._last_block = block_count(file_size, block_size) - 1

    def unissue(self, index: int) -> None:
        """Blocks from `index` on were not fetched after all; offer them again on the next read."""
        self._issued_until = min(self._issued_until, index - 1)

    def on_read(self, offset: int, size: int) -> range:
        """Record a read and return the block indexes to prefetch now (possibly empty)."""
        span = block_span(offset, size, self.file_size, self.block_size)
        if not span:
            return range(0)
        first, last = span[0], span[-1]
        end, last_end = offset + size, self._last_end
        self._last_end = end
        if self._frontier is None:
            self.window = self.initial_window if offset == 0 else 0
            self.random = offset != 0
            self._frontier = last
        elif self.random and offset != last_end:
            self.seeks += 1  # still random: only an exact continuation starts a sequential run
            self._frontier = last
            self._issued_until = last
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
        start = max(last + 1, self._issued_until + 1)
        stop = min(last + self.window, self._last_block) + 1
        if start >= stop:
            return range(0)
        self._issued_until = stop - 1
        return range(start, stop)
