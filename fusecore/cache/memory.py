"""A byte-budgeted, scan-resistant block cache shared by every file of a mount.

Policy (a small W-TinyLFU): new blocks enter a small LRU *window*; blocks leaving the window
compete for a place in the *main* LRU segment, and win only if they were used more often than
the block they would evict (ties keep the incumbent). Reading a dataset slightly larger than the
cache in the same order every epoch therefore keeps a stable subset cached (hit ratio close to
cache/dataset) instead of collapsing to zero as plain LRU does.

Main has room of its own (`_main_cap`): the budget less the window and the high-water mark of staged and
in-flight bytes over the last two periods (a period: a budget's worth of blocks put). A block admitted past that
room is *lent* the room that staging and GETs in flight leave free for now, and lent blocks are evicted first
when those need it again. Without that split, room freed for a moment went to whatever left the window next
(often a stream's block), and when the transient bytes came back they pushed out main's oldest blocks whatever
they were worth: a sequential stream beside small files emptied the cache of the small files. A block leaving
the window replaces main's oldest only if it was read more often by more than one (ADMIT_MARGIN): in a
reshuffled epoch a block main holds that this pass has not reached yet counts one read less than one just read.

A member of a distributed cache never lends (`lends`): its main holds its share, sized to fit, and no other node
has those blocks.

A block put with `keep=False` (in a distributed cache, a block another node owns, fetched for a read
here) lives in the window only: while its reader needs it, never displacing what this node owns.

Prefetched blocks that nobody has read yet are *staged*: outside the policy (a prefetch must not
be evicted by the policy before its reader arrives), counted in the budget, and dropped oldest
first if staging grows past its cap. Bytes of GETs still in flight are *reserved* in the budget,
so the cache plus in-flight data never exceed the configured size.

Exact ranges (RangeKey: what a young random run asked for) are entries like blocks, under the same policy;
a per-object index of the ranges held answers a read inside one of them (`cover`).

Buffers of evicted blocks are kept for the next GET (`reserve` hands one out), at most MAX_FREE: outside the budget
by default, within it where `spares_counted` (a worker's own cache, a small share of the mount's budget whose spare
buffers would otherwise add a quarter to it): there they are the first bytes let go when the budget needs room.

Pure logic, single-threaded: the caller (the trio thread) serialises access.
"""

from __future__ import annotations

import bisect
import mmap
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import AbstractSet, Hashable

from .blocks import CacheKey, RangeKey
from ..config import STAGED_FRACTION, WINDOW_FRACTION, kept_fraction

Buffer = bytes | bytearray | memoryview | mmap.mmap


@dataclass
class _Entry:
    data: Buffer
    size: int
    visit: Hashable | None = None
    keep: bool = True  # False: dropped when it leaves the window (never admitted to main)


@dataclass(frozen=True)
class CacheStats:
    budget: int
    bytes: int
    entries: int
    reserved: int
    staged: int
    hits: int
    misses: int
    evictions: int
    rejections: int
    prefetch_dropped: int
    lent: int = 0  # bytes admitted past main's own room, given back first (see the module docstring)

    @property
    def hit_ratio(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class FrequencySketch:
    """Small-count frequency estimate per key, halved periodically so old popularity fades."""

    MAX_COUNT = 15

    def __init__(self, min_sample: int = 10_000):
        self._counts: dict[Hashable, int] = {}
        self._additions = 0
        self._min_sample = min_sample

    def increment(self, key: Hashable, resident_entries: int) -> None:
        count = self._counts.get(key, 0)
        if count < self.MAX_COUNT:
            self._counts[key] = count + 1
        self._additions += 1
        if self._additions >= max(self._min_sample, 10 * resident_entries):
            self._age()

    def frequency(self, key: Hashable) -> int:
        return self._counts.get(key, 0)

    def _age(self) -> None:
        self._counts = {k: c // 2 for k, c in self._counts.items() if c > 1}
        self._additions //= 2

    def forget(self, keys: AbstractSet[Hashable]) -> None:
        for key in keys:
            self._counts.pop(key, None)


ADMIT_MARGIN = 1  # reads by which a block leaving the window must outnumber main's oldest to take its place


class BlockCache:
    """See the module docstring. `budget` bounds window + main + staged + reserved bytes."""

    def __init__(self, budget: int, *, window_fraction: float = WINDOW_FRACTION, staged_fraction: float = STAGED_FRACTION,
                 min_sample: int = 10_000, spares_counted: bool = False):
        self._spares_counted = spares_counted
        self._window_fraction, self._staged_fraction = window_fraction, staged_fraction
        self._peak = self._last_peak = self._period_puts = 0
        # A member of a distributed cache holds its share, sized to fit (fusecore.config.distributed_cache_size),
        # and nobody else has those blocks: they are never lent, to be given back first (see `_main_cap`).
        self.lends = True
        self._set_budget(budget)
        self._window: OrderedDict[CacheKey, _Entry] = OrderedDict()
        self._main: OrderedDict[CacheKey, _Entry] = OrderedDict()
        # Blocks admitted into room that the window, staged prefetches and GETs in flight leave free for now:
        # given back first when those need it, so that they never push out main's blocks, whatever those are worth.
        self._lent: OrderedDict[CacheKey, _Entry] = OrderedDict()
        self._staged: OrderedDict[CacheKey, _Entry] = OrderedDict()
        self._window_bytes = self._main_bytes = self._staged_bytes = self._lent_bytes = 0
        self._reserved = 0
        self._by_object: dict[str, set[CacheKey]] = {}
        self._ranges: dict[tuple[str, str], list[tuple[int, int]]] = {}  # (key, etag) -> held ranges, sorted
        self._freq = FrequencySketch(min_sample)
        self._free: list[Buffer] = []  # evicted block buffers nobody references, for reuse
        self._free_bytes = 0
        self.recycled = 0
        self.hits = self.misses = self.evictions = self.rejections = self.prefetch_dropped = 0

    def _set_budget(self, budget: int) -> None:
        if budget <= 0:
            raise ValueError("budget must be positive")
        self.budget = budget
        self._window_cap = max(1, int(budget * self._window_fraction))
        self._staged_cap = max(1, int(budget * self._staged_fraction))
        self._floor = max(1, int(budget * kept_fraction()))  # main's room when transient bytes are at their caps

    def resize(self, budget: int) -> None:
        """Change the budget of a live cache (the operator sizes node caches); evicts if it shrank."""
        self._set_budget(budget)
        self._enforce()

    # ---- queries -------------------------------------------------------------------------
    @property
    def used(self) -> int:
        used = self._window_bytes + self._main_bytes + self._lent_bytes + self._staged_bytes + self._reserved
        return used + self._free_bytes if self._spares_counted else used

    @property
    def transient_bytes(self) -> int:
        """Prefetched-but-unread plus in-flight bytes."""
        return self._staged_bytes + self._reserved

    @property
    def transient_room(self) -> int:
        """Bytes prefetches may still claim (staged plus in flight stay under the staging cap)."""
        return self._staged_cap - self.transient_bytes

    @property
    def resident_bytes(self) -> int:
        return self._window_bytes + self._main_bytes + self._lent_bytes + self._staged_bytes

    def __len__(self) -> int:
        return len(self._window) + len(self._main) + len(self._lent) + len(self._staged)

    def __contains__(self, key: CacheKey) -> bool:
        return key in self._window or key in self._main or key in self._lent or key in self._staged

    def stats(self) -> CacheStats:
        return CacheStats(self.budget, self.resident_bytes, len(self), self._reserved, self._staged_bytes,
                          self.hits, self.misses, self.evictions, self.rejections, self.prefetch_dropped,
                          self._lent_bytes)

    # ---- reads ---------------------------------------------------------------------------
    def get(self, key: CacheKey, visit: Hashable | None = None) -> Buffer | None:
        """Return the cached block or None; `visit` (e.g. a file handle) counts once per pass."""
        entry = self._window.get(key)
        if entry is not None:
            self._window.move_to_end(key)
        else:
            entry = self._main.get(key)
            if entry is not None:
                self._main.move_to_end(key)
            elif (entry := self._lent.get(key)) is not None:
                self._lent.move_to_end(key)
                if self._main_bytes + entry.size <= self._main_cap:  # main has room of its own again
                    del self._lent[key]
                    self._lent_bytes -= entry.size
                    self._main[key] = entry
                    self._main_bytes += entry.size
            else:
                entry = self._staged.pop(key, None)
                if entry is None:
                    self.misses += 1
                    return None
                self._staged_bytes -= entry.size
                self._window[key] = entry
                self._window_bytes += entry.size
                self.hits += 1
                self._count_visit(key, entry, visit)
                self._enforce()
                return entry.data
        self.hits += 1
        self._count_visit(key, entry, visit)
        return entry.data

    COVER_PROBES = 4  # held ranges starting at or before a read that are looked at (random runs rarely overlap)

    def cover(self, key: str, etag: str, start: int, stop: int,
              visit: Hashable | None = None) -> tuple[RangeKey, Buffer] | None:
        """A held range of `key`'s version `etag` that holds all of [start, stop), with its bytes (a hit), or None
        (a miss)."""
        spans = self._ranges.get((key, etag), ())
        end = bisect.bisect_right(spans, (start, sys.maxsize))  # every held range that starts at or before `start`
        for held_start, held_stop in reversed(spans[max(0, end - self.COVER_PROBES):end]):
            if held_stop >= stop:
                found = RangeKey(key, etag, held_start, held_stop)
                data = self.get(found, visit)
                if data is not None:
                    return found, data
        self.misses += 1
        return None

    def held_within(self, key: str, etag: str, start: int, stop: int) -> list[tuple[int, int, Buffer]]:
        """Held ranges of `key`'s version `etag` that lie inside [start, stop), without overlaps, in order, with their
        bytes: what a GET of the whole block need not fetch again (a reader that started mid-file, then read on)."""
        found: list[tuple[int, int, Buffer]] = []
        spans = self._ranges.get((key, etag), ())
        last = start
        for i in range(bisect.bisect_left(spans, (start, 0)), len(spans)):
            lo, hi = spans[i]
            if lo >= stop:
                break
            if lo >= last and hi <= stop:
                range_key = RangeKey(key, etag, lo, hi)
                entry = next((e for seg in (self._window, self._main, self._lent, self._staged)
                              if (e := seg.get(range_key)) is not None), None)
                if entry is not None and len(entry.data) == hi - lo:
                    found.append((lo, hi, entry.data))
                    last = hi
        return found

    def passed(self, key: CacheKey) -> None:
        """Its reader read the block to its end: in the window it goes first when room is needed, before a block a
        reader is still in the middle of (a stream's 4 MiB block, which small files read whole would push out
        first, to be fetched again for the stream's next read)."""
        if key in self._window:
            self._window.move_to_end(key, last=False)

    def transient(self, key: CacheKey) -> bool:
        """Is the block held for its readers only (put with keep=False, still in the window)?"""
        entry = self._window.get(key)
        return entry is not None and not entry.keep

    def keep(self, key: CacheKey) -> None:
        """Keep a transient block like any other (it became this node's to hold: ownership moved)."""
        entry = self._window.get(key)
        if entry is not None:
            entry.keep = True

    def _count_visit(self, key: CacheKey, entry: _Entry, visit: Hashable | None) -> None:
        if visit is None or entry.visit != visit:
            entry.visit = visit
            self._freq.increment(key, len(self))

    # ---- writes --------------------------------------------------------------------------
    def put(self, key: CacheKey, data: Buffer, *, prefetched: bool = False,
            visit: Hashable | None = None, keep: bool = True) -> None:
        """Insert a fetched block (demand read, or `prefetched` and not read yet); `keep=False`: for
        its readers only, never admitted to main."""
        if key in self:
            return
        entry = _Entry(data, len(data), visit, keep)
        if entry.size > self.budget:
            self.rejections += 1
            return
        self._by_object.setdefault(key.key, set()).add(key)
        if isinstance(key, RangeKey):
            bisect.insort(self._ranges.setdefault((key.key, key.etag), []), (key.start, key.stop))
        if prefetched:
            self._staged[key] = entry
            self._staged_bytes += entry.size
        else:
            self._freq.increment(key, len(self))
            self._window[key] = entry
            self._window_bytes += entry.size
        self._note_transient(entry.size)
        self._enforce()

    def reserve(self, nbytes: int) -> Buffer | None:
        """Account for a GET about to bring `nbytes`; evicts so the budget holds. Returns a spare buffer of exactly
        `nbytes` to receive it, if one was kept (reusing mapped memory skips zeroing fresh pages: a quarter of the
        CPU of a cold sequential read here); one the GET did not use goes back with `give_back`."""
        spare = self._take_spare(nbytes)
        self._reserved += nbytes
        self._note_transient(0)
        self._enforce()
        return spare

    def give_back(self, spare: Buffer | None) -> None:
        """A spare buffer `reserve` handed out that no GET used (the block came from nearer)."""
        if spare is not None:
            self._keep_spare(spare)
            self._enforce()

    def release(self, nbytes: int) -> None:
        self._reserved = max(0, self._reserved - nbytes)

    def invalidate(self, object_key: str, etag: str | None = None) -> int:
        """Drop every cached block of an object (of the version `etag` only, when given); returns how many."""
        keys = self._by_object.pop(object_key, set())
        if etag is not None:
            kept = {key for key in keys if key.etag != etag}
            if kept:
                self._by_object[object_key] = kept
            keys -= kept
        for key in keys:
            if isinstance(key, RangeKey):
                self._ranges.pop((key.key, key.etag), None)
            for segment in (self._window, self._main, self._lent, self._staged):
                entry = segment.pop(key, None)
                if entry is not None:
                    self._account(segment, -entry.size)
        self._freq.forget(keys)
        return len(keys)

    def discard(self, key: CacheKey) -> None:
        """Let one block go (a worker's block once it is in the mount's shared blocks: readers read it there)."""
        for segment in (self._window, self._main, self._lent, self._staged):
            entry = segment.pop(key, None)
            if entry is not None:
                self._account(segment, -entry.size)
                self._forget(key)
                self._recycle(entry)
                return

    def clear(self) -> None:
        for segment in (self._window, self._main, self._lent, self._staged):
            segment.clear()
        self._window_bytes = self._main_bytes = self._lent_bytes = self._staged_bytes = 0
        self._by_object.clear()
        self._ranges.clear()

    # ---- policy --------------------------------------------------------------------------
    @property
    def _main_cap(self) -> int:
        """Main's own room: what the window and the transient bytes of late (their high-water mark over this
        period and the last) leave. A pure stream needs little and keeps a large main; a stream beside small files
        needs more, and lends the rest."""
        if not self.lends:
            return self.budget
        return max(self._floor, self.budget - self._window_cap - max(self._peak, self._last_peak))

    def _note_transient(self, nbytes: int) -> None:
        self._peak = max(self._peak, self.transient_bytes)
        self._period_puts += nbytes
        if self._period_puts >= self.budget:  # a period: a budget's worth of blocks put
            self._last_peak, self._peak, self._period_puts = self._peak, self.transient_bytes, 0

    def _account(self, segment: OrderedDict, delta: int) -> None:
        if segment is self._window:
            self._window_bytes += delta
        elif segment is self._main:
            self._main_bytes += delta
        elif segment is self._lent:
            self._lent_bytes += delta
        else:
            self._staged_bytes += delta

    def _forget(self, key: CacheKey) -> None:
        keys = self._by_object.get(key.key)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_object[key.key]
        if isinstance(key, RangeKey):
            spans = self._ranges.get((key.key, key.etag))
            if spans is not None:
                i = bisect.bisect_left(spans, (key.start, key.stop))
                if i < len(spans) and spans[i] == (key.start, key.stop):
                    del spans[i]
                if not spans:
                    del self._ranges[(key.key, key.etag)]

    def _take_spare(self, nbytes: int) -> Buffer | None:
        for i, buf in enumerate(self._free):
            if len(buf) == nbytes:
                self.recycled += 1
                self._free_bytes -= nbytes
                return self._free.pop(i)
        return None

    def _shed_spares(self, nbytes: int = 0) -> None:
        """Let spare buffers go (oldest first) until `nbytes` more fit, where they count in the budget."""
        while self._spares_counted and self._free and self.used + nbytes > self.budget:
            self._free_bytes -= len(self._free.pop(0))

    MAX_FREE = 4  # spare buffers kept; only those nothing else referenced when their block was evicted (_recycle)

    def _recycle(self, entry: _Entry) -> None:
        data = entry.data
        entry.data = b""
        # Two references: `data` here and getrefcount's argument. Any reader still holding the
        # buffer (or a memoryview of it) would add one, and then it must not be overwritten.
        if isinstance(data, mmap.mmap) and sys.getrefcount(data) == 2:
            self._keep_spare(data)

    def _keep_spare(self, buffer: Buffer) -> None:
        if len(self._free) < self.MAX_FREE:
            self._free.append(buffer)
            self._free_bytes += len(buffer)

    def _drop(self, segment: OrderedDict, *, oldest: bool = True) -> None:
        key, entry = segment.popitem(last=not oldest)
        self._account(segment, -entry.size)
        self._forget(key)
        self._recycle(entry)
        if segment is self._staged:
            self.prefetch_dropped += 1
        else:
            self.evictions += 1

    def _enforce(self) -> None:
        self._shed_spares()
        while self._staged_bytes > self._staged_cap:
            self._drop(self._staged)
        while self._window_bytes > self._window_cap and len(self._window) > 1:
            key, entry = self._window.popitem(last=False)
            self._window_bytes -= entry.size
            self._admit(key, entry)
        while self.used > self.budget:
            if self._free and self._spares_counted:  # (a block just dropped may have left its buffer spare)
                self._shed_spares()
            elif self._lent:
                self._drop(self._lent)
            elif len(self._window) > 1:
                self._drop(self._window)
            elif self._main:
                self._drop(self._main)
            elif self._staged:
                self._drop(self._staged)
            elif self._window:
                self._drop(self._window)
            else:
                break  # only reservations left; the fetcher bounds those below the budget

    def _admit(self, key: CacheKey, entry: _Entry) -> None:
        """A block leaves the window: keep it in main only if it is worth more than main's LRU."""
        if not entry.keep:
            self._forget(key)
            self.evictions += 1
            self._recycle(entry)
            return
        candidate_freq = self._freq.frequency(key)
        while True:
            self._shed_spares(entry.size)
            own = self._main_bytes + entry.size <= self._main_cap  # main has room of its own for it
            if own and entry.size <= self.budget - self.used:
                break
            if own and self._lent:  # room main lent out comes back first
                self._drop(self._lent)
            # A margin of one: read in a reshuffled order, a block main holds that this pass has not reached yet
            # counts one read less than the block just read, which is no reason to swap them.
            elif self._main and candidate_freq > self._freq.frequency(next(iter(self._main))) + ADMIT_MARGIN:
                self._drop(self._main)
            else:
                break
        if entry.size > self.budget - self.used:
            self._forget(key)
            self.rejections += 1
            self.evictions += 1
            self._recycle(entry)
        elif own:
            self._main[key] = entry
            self._main_bytes += entry.size
        else:
            self._lent[key] = entry
            self._lent_bytes += entry.size
