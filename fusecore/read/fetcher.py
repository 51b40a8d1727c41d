"""Fetch scheduler: one in-flight GET per block shared by all waiters, bounded concurrency and
in-flight bytes, demand reads ahead of prefetches, body-level retries, and a read deadline.
"""

from __future__ import annotations

import logging
from collections import deque
import time
from typing import Awaitable, Callable, Hashable, cast

import trio

from .admission import ByteBudget
from ..cache.blocks import BlockKey, CacheKey, RangeKey, block_extent, extent
from ..cache.memory import BlockCache, Buffer
from ..cluster.tier import Cluster
from ..cache.disk import HeldFiles
from ..failures import StokerError
from ..cache.shared import Claim, SharedBlocks
from ..metrics import MountMetrics
from ..cache.buffers import MMAP_MIN, allocate
from ..store.objects import LoopRangeReads, ObjectInfo, ObjectStore, Parts, Progress
from ..cluster.peers import BlockAsk
from ..store.errors import PreconditionFailed, StoreError, TransientError, Unavailable, backoff

log = logging.getLogger(__name__)

DEMAND_RESERVE = 16  # demand reads keep 1/16 of the connections and in-flight bytes that prefetches cannot take
MIN_PART = 256 * 1024  # a block fetched in parts (`block(parts=)`) is cut into pieces of at least this
RANGE_PART = 64 * 1024  # an exact range (a random read) of 128 KiB or more comes in parts of at least this ...
RANGE_PARTS = 4  # ... and at most this many: a 256 KiB read in four GETs at once (20 ms + 64 KiB at one connection's
# rate, not 128 KiB: 24.1 ms, not 28.2), a 1 MiB read in four, each part only on a connection free now (_range_parts)
FORWARD_PARTS = 4  # a block read through for a peer comes in this many GETs at once, whatever else streams (forward)
DISK_READERS = 16  # blocks read from the disk tier at once (worker threads of their own, not the store's)
CLAIM_POLL, CLAIM_POLL_MAX = 0.0005, 0.004  # seconds between looks for a block another worker is fetching


class _Poll:
    """The waits between looks at a block another worker is fetching: doubling from CLAIM_POLL to CLAIM_POLL_MAX,
    none past the read's deadline (`wait` is then False)."""

    def __init__(self, clock: Callable[[], float], sleep: Callable[[float], Awaitable[None]], give_up: float):
        self._clock, self._sleep, self._give_up = clock, sleep, give_up
        self._delay = CLAIM_POLL

    async def wait(self) -> bool:
        if self._clock() > self._give_up:
            return False
        await self._sleep(self._delay)
        self._delay = min(self._delay * 2, CLAIM_POLL_MAX)
        return True


class _Elsewhere(StokerError):
    """A read-ahead found the block being fetched by another worker of the mount (shared blocks): not an error, the
    read-ahead ends (never raised past the fetcher)."""


class _Pending:
    """The shared future of one block GET; readers may take bytes as soon as they arrive."""

    __slots__ = ("done", "data", "error", "demanded", "visit", "buffer", "progress", "queued", "attempts", "logged",
                 "arrived", "started", "prefetch_bytes", "parts", "split", "source", "cause", "peer_missed",
                 "fetching", "claim")

    def __init__(self, demanded: bool, visit: Hashable | None, queued: int = 0):
        self.started = False  # its task runs (a prefetch may wait in the fetcher's queue until then)
        self.prefetch_bytes = 0  # the in-flight room it was admitted with as a prefetch (else a demand read's)
        self.parts = 1  # GETs asked to fetch the block in at once (fewer where a part would be under MIN_PART)
        self.split = False  # in those parts even while other files are in flight (a block forwarded to a peer)
        self.attempts = 0
        self.logged = False  # its failure was logged (once, however many readers waited for it)
        self.done = trio.Event()
        self.data: Buffer | None = None
        self.error: StoreError | None = None
        self.demanded = demanded
        self.visit = visit
        self.buffer: Buffer | None = None  # being filled; valid up to progress.received
        self.progress = Progress()
        self.queued = queued  # bytes a prefetch promised, until its GET reserves them in the cache
        self.arrived: trio.Event | None = None  # set when the bytes some reader waits for are there
        self.source = "store"  # the tier the bytes came from (_nearer): "disk", "peer" or "store"
        self.cause = "demand"  # why its bytes came from the store (CAUSES), for the store's bytes by cause
        self.peer_missed = False  # an owner was asked for the bytes and did not give them
        self.fetching = False  # past the byte budget: its bytes are on their way (a block may wait for it)
        self.claim: Claim | None = None  # this worker fetches the block for every worker of the mount (shared)

    async def wait_for(self, need: int) -> None:
        """Return once the first `need` bytes arrived or the GET ended (one wake-up from the worker thread)."""
        arrived = self.arrived
        if arrived is None or arrived.is_set():
            arrived = self.arrived = trio.Event()
            self.progress.wake_at(need, _waker(arrived))
        else:
            self.progress.wake_at(need)  # shares the wake-up that is coming; a nearer mark wins
        if self.progress.received >= need or self.done.is_set():
            return
        await arrived.wait()

    def finish(self) -> None:
        self.done.set()
        if self.arrived is not None:
            self.arrived.set()


def _waker(event: trio.Event) -> Callable[[], None]:
    """A callable any thread may call to set `event` in this trio run (a no-op once the run ended)."""
    token = trio.lowlevel.current_trio_token()

    def wake() -> None:
        try:
            token.run_sync_soon(event.set)
        except trio.RunFinishedError:
            pass

    return wake


# Why a GET's bytes came from the store (stoker_store_bytes{cause}, `stoker stats` store_bytes_by_cause): a reader
# waited for them ("demand"), they were fetched ahead of it ("read-ahead": a stream's window, the directory walk, a
# warm), a young random run's exact range ("range"), an owner read them through for a peer ("read-through"), or an
# owner was asked first and did not give them ("fallback": it missed, failed, was busy, or its answer was refused).
CAUSES = ("demand", "read-ahead", "range", "read-through", "fallback")


def _cause(key: CacheKey, pending: _Pending, demand: bool) -> str:
    if pending.visit == "peer":
        return "read-through"
    if pending.peer_missed:
        return "fallback"
    if isinstance(key, RangeKey):
        return "range"
    return "demand" if demand else "read-ahead"


class Fetcher:
    def __init__(self, store: ObjectStore, cache: BlockCache, metrics: MountMetrics, *, block_size: int,
                 max_concurrency: int, inflight_limit: int, read_deadline: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], Awaitable[None]] = trio.sleep,
                 cluster: Cluster | None = None, huge_pages: bool = False, disk: HeldFiles | None = None):
        self.store = store
        # ranges up to this many bytes are read from the event loop, where the store can (LoopRangeReads)
        self._loop_limit: int = getattr(store, "loop_range_limit", 0)
        self._loop_reads = cast(LoopRangeReads, store)
        self.huge_pages = huge_pages  # block buffers on 2 MiB pages (pages.py chose for this machine)
        self.cluster = cluster  # a distributed cache: bytes of blocks this node does not own are asked of an owner first
        self.disk = disk  # a disk tier: read before peers and the store, and given what they sent
        self.shared: SharedBlocks | None = None  # the blocks this mount's worker processes share (--workers)
        self.disk_readers = trio.CapacityLimiter(DISK_READERS)
        self._clock, self._sleep = clock, sleep  # the retry schedule's time (a fake one in tests)
        self.cache = cache
        self.metrics = metrics
        self.block_size = block_size
        self.read_deadline = read_deadline
        self._threads = trio.CapacityLimiter(max_concurrency)
        # Prefetches leave demand reads a sixteenth of the connections (at least one), so a demand read
        # always finds one, and a sequential reader's whole window (64 blocks) can be in flight at once.
        self._prefetch_slots = max(1, max_concurrency - max(1, max_concurrency // DEMAND_RESERVE))
        self._prefetching = 0  # prefetch tasks running
        self.publishing = 0  # blocks being published to the mount's other workers (_publish), behind their readers
        # Prefetches not started yet, in the order they were asked for: they start in that order (trio runs
        # a batch of new tasks forwards or backwards at random, so tasks racing for room would not).
        self._queue: deque[tuple[BlockKey, ObjectInfo, _Pending, Callable[[], bool]]] = deque()
        self._bytes = ByteBudget(inflight_limit, self._prefetch_share(inflight_limit))
        self._pending: dict[CacheKey, _Pending] = {}
        self._ranges_in_flight = 0  # of those, exact ranges (a block's fetch waits for those inside it: _ranges_inside)
        self._queued = 0  # bytes of prefetches launched but not yet reserved in the cache
        self._nursery: trio.Nursery | None = None

    def set_inflight_limit(self, nbytes: int) -> None:
        """Bound in-flight GET bytes anew (after a cache resize); GETs already running finish."""
        self._bytes.limit = nbytes
        self._bytes.prefetch_share = self._prefetch_share(nbytes)
        self._admit()

    def _prefetch_share(self, limit: int) -> float:
        """Prefetches leave demand reads a sixteenth of the in-flight bytes, and at least a block where the
        limit holds two or more."""
        if limit < 2 * self.block_size:
            return 1.0
        return 1 - max(limit // DEMAND_RESERVE, self.block_size) / limit

    def start(self, nursery: trio.Nursery) -> None:
        """Background GETs run in `nursery`, so a cancelled reader never cancels a shared GET."""
        self._nursery = nursery

    @property
    def inflight(self) -> int:
        return len(self._pending)

    async def block(self, obj: ObjectInfo, index: int, visit: Hashable | None = None,
                    need: int | None = None, parts: int = 1, split: bool = False) -> tuple[Buffer, bool]:
        """The bytes of one whole block and whether the cache had them.

        With `need`, return as soon as the block's first `need` bytes have arrived (the buffer is
        then only valid up to there): a reader does not wait for the rest of a block it does not
        read yet, which is what makes the first byte of a cold file quick. With `parts`, a block not
        cached or coming yet is fetched in that many GETs at once (pieces of at least MIN_PART) if no
        other file is in flight when its GET starts: its reader gets all of it sooner, at the cost of
        more requests; with `split`, whatever else is in flight.
        """
        key = BlockKey(obj.key, obj.etag, index)
        data = self.cache.get(key, visit)
        lo, hi = block_extent(index, obj.size, self.block_size)
        if data is not None and len(data) != hi - lo:
            # never served: a block is kept only at its extent's length, and this one is not (design §7)
            log.warning("%s block %d held with %d bytes, not its length: dropped", obj.key, index, len(data))
            self.metrics.errors.labels(kind="wrong-length").inc()
            self.cache.invalidate(obj.key, obj.etag)
            data = None
        if data is not None:
            if self.cluster is not None and self.cache.transient(key) and self._keeps(key, obj):
                self.cache.keep(key)  # read for another owner, and this node's own since the members changed
            return data, True
        return await self._obtain(key, obj, visit, need, parts, split), False

    async def forward(self, obj: ObjectInfo, index: int) -> Buffer:
        """The whole block `index` for a peer that reads it through this node (its owner): the peer gets none of
        its bytes before all of them are here (a local reader takes each byte as it arrives), so a block not held
        is fetched in FORWARD_PARTS GETs at once even while other files stream. A 4 MiB block then waits ~1/4 of
        its time at one connection's rate, not all of it: a shard read through the owners in its first epoch kept
        pace with one read from the store only so."""
        return (await self.block(obj, index, visit="peer", parts=FORWARD_PARTS, split=True))[0]

    async def range(self, obj: ObjectInfo, start: int, stop: int, visit: Hashable | None = None) -> tuple[Buffer, bool, int]:
        """Exactly bytes [start, stop) (a young random run's read), whether the cache had them, and the offset in the
        object where the returned buffer begins (a held range may hold more than was asked). Not cached, they come
        in one GET, or in up to RANGE_PARTS GETs of at least RANGE_PART at once (the store's bandwidth is per
        connection: a 256 KiB read in four GETs waits 20 ms + 64 KiB at one connection's rate, not 256 KiB)."""
        found = self.cache.cover(obj.key, obj.etag, start, stop, visit)
        if found is not None:
            return found[1], True, found[0].start
        # _fetch cuts it into at most RANGE_PARTS parts of at least RANGE_PART
        return await self._obtain(RangeKey(obj.key, obj.etag, start, stop), obj, visit, None, RANGE_PARTS), False, start

    async def _obtain(self, key: CacheKey, obj: ObjectInfo, visit: Hashable | None, need: int | None,
                      parts: int, split: bool = False) -> Buffer:
        """Bytes of `key` not in the cache: join its GET, or start one; wait within the read's deadline."""
        pending = self._pending.get(key)
        if pending is None:
            pending = self._launch(key, obj, demanded=True, visit=visit, parts=parts, split=split)
        else:
            pending.demanded = True
            pending.visit = visit
            if not pending.started:  # a prefetch still queued: it goes now, as a demand read
                self._start(key, obj, pending)
        with trio.move_on_after(self.read_deadline):
            start, end = extent(key, obj.size, self.block_size)
            if need is None or need >= end - start:  # the whole block: its end is the one wake-up
                await pending.done.wait()
            else:
                while not pending.done.is_set():
                    if pending.buffer is not None and pending.progress.received >= need:
                        return pending.buffer
                    await pending.wait_for(need)
        if not pending.done.is_set():
            self.metrics.errors.labels(kind="deadline").inc()
            if not pending.logged:
                pending.logged = True
                log.warning("read of %s bytes %d-%d failed: no answer within %gs (%d attempts so far)", obj.key,
                            start, end - 1, self.read_deadline, pending.attempts)
            raise Unavailable(f"get {obj.key!r}: no answer within {self.read_deadline:g}s")
        if pending.error is not None:
            raise pending.error
        if pending.data is None:
            raise Unavailable(f"get {obj.key!r}: fetch abandoned")
        return pending.data

    def prefetch(self, obj: ObjectInfo, index: int, wanted: Callable[[], bool] = lambda: True) -> bool:
        """Start fetching a block ahead of the reader unless it is cached or already coming.

        Returns False, starting nothing, while prefetched-but-unread and in-flight bytes fill the
        cache's staging room: read-ahead waits rather than fetching blocks it would have to drop.
        """
        key = BlockKey(obj.key, obj.etag, index)
        if key in self._pending or key in self.cache or (self.shared is not None and self.shared.coming(key)):
            return True  # (a block another worker holds or fetches is read from its file when asked: no copy ahead)
        nbytes = min(obj.size - index * self.block_size, self.block_size)
        if self.cache.transient_room - self._queued < nbytes:
            return False
        self._queued += nbytes  # promised until its GET reserves the bytes in the cache
        pending = self._pending[key] = _Pending(False, None, nbytes)
        self._queue.append((key, obj, pending, wanted))
        self._admit()
        return True

    def _launch(self, key: CacheKey, obj: ObjectInfo, *, demanded: bool, visit: Hashable | None,
                parts: int = 1, split: bool = False) -> _Pending:
        pending = self._pending[key] = _Pending(demanded, visit)
        if isinstance(key, RangeKey):
            self._ranges_in_flight += 1
        pending.parts, pending.split = parts, split
        self._start(key, obj, pending)
        return pending

    def _start(self, key: CacheKey, obj: ObjectInfo, pending: _Pending) -> None:
        if self._nursery is None:
            raise RuntimeError("Fetcher.start() was not called")
        pending.started = True
        self._nursery.start_soon(self._run, key, obj, pending)

    def _admit(self) -> None:
        """Start queued prefetches, first asked first, while a prefetch slot is free and their bytes fit."""
        while self._queue and self._prefetching < self._prefetch_slots:
            key, obj, pending, wanted = self._queue[0]
            if pending.started:  # a reader came for it: it went as a demand read
                self._queue.popleft()
                continue
            if not wanted():  # its reader seeked or closed the file meanwhile
                self._queue.popleft()
                self._end(key, pending)
                continue
            taken = self._bytes.try_prefetch(pending.queued)  # its size, promised until its GET starts
            if not taken:
                return
            self._queue.popleft()
            pending.prefetch_bytes = taken
            self._prefetching += 1
            self._start(key, obj, pending)

    def _end(self, key: CacheKey, pending: _Pending) -> None:
        """The GET is over (or will never run): wake its readers, forget it."""
        self._settle(pending)
        del self._pending[key]
        if isinstance(key, RangeKey):
            self._ranges_in_flight -= 1
        pending.finish()

    def _settle(self, pending: _Pending) -> None:
        """A prefetch's promised bytes are now reserved in the cache (or never will be)."""
        self._queued -= pending.queued
        pending.queued = 0

    async def _run(self, key: CacheKey, obj: ObjectInfo, pending: _Pending) -> None:
        prefetch = pending.prefetch_bytes > 0
        try:
            try:
                pending.data = await self._fetch(key, obj, pending)
            except _Elsewhere:
                return  # (no reader waits for it: a reader that comes reads the other worker's file)
            keep = self._keeps(key, obj)
            self.cache.put(key, pending.data, prefetched=not pending.demanded, visit=pending.visit, keep=keep)
            to_disk = self.disk is not None and keep and pending.source != "disk" and isinstance(key, BlockKey)
            if pending.claim is not None and isinstance(key, BlockKey):
                assert self._nursery is not None
                keep_as = self.disk.name(key) if to_disk and self.disk is not None else ""  # (the hub writes it)
                # read ahead, for a reader not here yet: kept for it, and counted against the walks, where memory alone
                # holds it (with a disk tier a block evicted first is read back from the disk, and the walks going
                # further ahead made the disk cell's cold epoch 40% faster)
                ahead = not pending.demanded and self.disk is None
                self.publishing += 1
                self._nursery.start_soon(self._publish, key, pending.data, pending.claim, keep_as,
                                         ahead)  # behind the reader
                pending.claim = None
            elif to_disk and self.disk is not None and isinstance(key, BlockKey):
                self.disk.offer(key, pending.data)  # behind the reader: it has the bytes already
        except Exception as exc:  # noqa: BLE001 - one request never ends the mount: its readers get EIO
            if not isinstance(exc, StoreError):
                log.exception("unexpected error fetching %s block %d", obj.key, key.index)
                exc = Unavailable(f"get {obj.key!r}: unexpected {type(exc).__name__}")
            pending.error = exc
            self.metrics.errors.labels(kind=exc.kind).inc()
            if isinstance(exc, PreconditionFailed):  # that version is gone; blocks of others are named by theirs
                dropped = self.cache.invalidate(obj.key, obj.etag)
                log.warning("%s changed during reads; dropped %d cached blocks", obj.key, dropped)
            elif not pending.logged:
                pending.logged = True
                start, end = extent(key, obj.size, self.block_size)
                (log.warning if pending.demanded else log.info)(
                    "%s of %s bytes %d-%d failed after %d attempt(s): %s", "read" if pending.demanded else "prefetch",
                    obj.key, start, end - 1, pending.attempts, exc)
        finally:
            if pending.claim is not None:  # failed: another worker may claim it now
                pending.claim.release()
                pending.claim = None
            self._end(key, pending)
            if prefetch:
                self._prefetching -= 1
            self._admit()

    async def _publish(self, key: BlockKey, data: Buffer, claim: Claim, keep_as: str, ahead: bool) -> None:
        """Make a block this worker fetched readable by every worker (its file), then let go of its claim: the
        workers that waited for it read it. A small block is written here, a large one in a thread (the cache
        recycles no buffer that this task still references). `keep_as`: its name on the disk tier, where the hub
        writes it from that file (cache/diskview.py); `ahead`: read ahead, no reader has it yet."""
        shared = self.shared
        assert shared is not None
        try:
            if len(data) < MMAP_MIN:
                published = shared.publish(claim, data, keep_as, ahead)
            else:
                published = await trio.to_thread.run_sync(shared.publish, claim, data, keep_as, ahead,
                                                          limiter=self.disk_readers)
        except OSError as exc:
            log.warning("block %d of %s not shared with the other workers: %s", key.index, key.key, exc)
        else:
            if published:  # its readers here read its file, and this worker's room is free
                del data
                self.cache.discard(key)
        finally:
            claim.release()
            self.publishing -= 1

    def _keeps(self, key: CacheKey, obj: ObjectInfo) -> bool:
        """Does the cache keep this block past its readers? In a distributed cache only what this node owns: its
        blocks, and ranges inside them (an owner reads a range through and keeps it, so an asker that kept it too
        would crowd its own share out); a range across two blocks has no owner and stays where it was read."""
        if self.cluster is None:
            return True
        index = self._block_of(key.start, key.stop) if isinstance(key, RangeKey) else key.index
        return index is None or self.cluster.owns(obj.key, obj.etag, index)

    def _block_of(self, start: int, stop: int) -> int | None:
        """The one block that holds bytes [start, stop), or None for a range across two blocks."""
        index = start // self.block_size
        return index if (stop - 1) // self.block_size == index else None

    async def _nearer(self, obj: ObjectInfo, start: int, stop: int, pending: _Pending) -> tuple[Buffer, str] | None:
        """Bytes [start, stop) from the tiers between memory and the store, in the one read order (design §7):
        this node's disk, then an owner of their block on another node; None: the store."""
        index = self._block_of(start, stop)
        if index is None:  # a range across two blocks: no tier holds it whole
            return None
        if self.shared is not None:
            data = await self._from_shared(obj, index, start, stop, pending)
            if data is not None:
                return data, "shared"
        data = await self._from_disk(obj, index, start, stop)
        if data is not None:
            return data, "disk"
        if self.cluster is not None:
            data = await self._from_peer(obj, index, start, stop, pending)
            if data is not None:
                return data, "peer"
        return None

    async def _from_shared(self, obj: ObjectInfo, index: int, start: int, stop: int, pending: _Pending) \
            -> Buffer | None:
        """Bytes [start, stop) of block `index` from the file another worker of this mount published; for a whole
        block not published, the claim to fetch it for every worker (pending.claim), or, while another worker holds
        that claim, its bytes once it published them (a claim whose worker died or failed is taken over)."""
        shared = self.shared
        assert shared is not None
        block = BlockKey(obj.key, obj.etag, index)
        lo, hi = block_extent(index, obj.size, self.block_size)
        if (start, stop) != (lo, hi):  # a random reader's range inside the block: no claim, the store if not held
            part = shared.read(block, hi - lo, start - lo, stop - lo)
            if part is None and pending.demanded and shared.being_fetched(block):
                # another worker fetches the whole block now (a small file's first READ went there, this one its
                # second): its bytes come sooner than a GET of this range would, and the store sends them once
                poll = self._poll()
                while shared.being_fetched(block) and await poll.wait():
                    pass
                part = shared.read(block, hi - lo, start - lo, stop - lo)
            return part
        data = await self._load_shared(block, hi - lo)
        if data is not None:
            return data
        poll, waited = self._poll(), False
        while True:
            claim = shared.try_claim(block)
            data = await self._load_shared(block, hi - lo)  # (published just before the claim was free)
            if claim is not None:
                if data is not None:
                    claim.release()
                    return data
                if waited:
                    shared.stats.takeovers += 1  # its worker died, or its GET failed: this one fetches
                pending.claim = claim
                return None
            if data is not None:
                return data
            if not pending.demanded:
                raise _Elsewhere  # a read-ahead of a block another worker fetches: its room goes to the next one
            if not waited:
                waited = True
                shared.stats.waits += 1
            if not await poll.wait():
                return None  # a worker that holds its claim this long is stuck: fetch without one

    def _poll(self) -> _Poll:
        return _Poll(self._clock, self._sleep, self._clock() + self.read_deadline)

    async def _load_shared(self, block: BlockKey, size: int) -> Buffer | None:
        shared = self.shared
        assert shared is not None
        if size < MMAP_MIN:
            return shared.load(block, size)
        if not shared.holds(block):
            return None
        huge = self.huge_pages
        return await trio.to_thread.run_sync(lambda: shared.load(block, size, allocate(size, huge)),
                                             limiter=self.disk_readers, abandon_on_cancel=True)

    async def _from_disk(self, obj: ObjectInfo, index: int, start: int, stop: int) -> Buffer | None:
        """Bytes [start, stop) (block `index`, or a range inside it) from the block on this node's disk, checked."""
        lo, hi = block_extent(index, obj.size, self.block_size)
        data = await self.from_disk(BlockKey(obj.key, obj.etag, index), hi - lo)
        if data is None or (start, stop) == (lo, hi):
            return data
        return bytes(memoryview(data)[start - lo:stop - lo])  # a random reader's range: only its bytes stay

    async def from_disk(self, block: BlockKey, length: int) -> Buffer | None:
        """The block of `length` bytes if this node's disk holds it (checked: its header names the block and its
        length, its checksum its bytes), else None."""
        disk = self.disk
        name = disk.where(block) if disk is not None else None
        if disk is None or name is None:  # a miss costs no thread hop
            return None
        # A small buffer comes from this thread's heap, as the store's do (malloc'ed in a worker thread, it would
        # spread the mount's small blocks over more arenas); a mapped one is made by the thread that fills it.
        into = allocate(length) if length < MMAP_MIN else None
        return await trio.to_thread.run_sync(disk.read, block, length, into, name, limiter=self.disk_readers,
                                             abandon_on_cancel=True)

    async def _from_peer(self, obj: ObjectInfo, index: int, start: int, stop: int, pending: _Pending) -> Buffer | None:
        """Bytes [start, stop) (block `index`, or a range inside it) from an owner of the block that answers with
        exactly them, reading them through if it does not hold them (else the store)."""
        assert self.cluster is not None
        plan = self.cluster.plan(obj.key, obj.etag, index)
        if not plan.peers:  # this node is the only owner (or the others are avoided): nobody to ask
            return None
        want = BlockAsk(obj.key, obj.etag, index, start, stop, obj.size, plan.through)
        async with self._threads:  # the same bound on what is in flight as the store's GETs
            data = await self.cluster.fetch(plan, want)
        pending.peer_missed = data is None and len(plan.peers) > plan.moved  # (an owner's miss; a former owner's is not)
        return data

    def _receive(self, obj: ObjectInfo, start: int, lo: int, hi: int, pending: _Pending, progress: Progress) -> None:
        """In a worker thread: the rest of bytes [lo, hi) of the block (which begins at `start`) into its
        buffer, mapped here first if it has none (populating 4 MiB held the event loop's thread ~2 ms per
        GET, while readers waited). Only a block received whole comes without a buffer (lo is 0, hi its
        size): a block in parts is mapped before its parts start (_get_parts)."""
        if pending.buffer is None:
            pending.buffer = allocate(hi, self.huge_pages)  # before any progress: readers look at it once bytes arrived
        done = progress.received  # a retry resumes where the broken body stopped
        self.store.read_range(obj.key, start + lo + done, start + hi, obj.etag,
                              memoryview(pending.buffer)[lo + done:hi], progress)

    async def _receive_on_loop(self, obj: ObjectInfo, start: int, lo: int, hi: int, pending: _Pending,
                               progress: Progress) -> None:
        """`_receive` for a small range the store reads from the event loop (S3Store.read_range_on_loop: the body
        arrives on awscrt's thread and the loop is woken once; no worker thread waits for it)."""
        if pending.buffer is None:
            pending.buffer = allocate(hi, self.huge_pages)
        done = progress.received
        async with self._threads:  # the same bound on concurrent GETs as the receiving threads
            await self._loop_reads.read_range_on_loop(obj.key, start + lo + done, start + hi, obj.etag,
                                                      memoryview(pending.buffer)[lo + done:hi], progress)

    async def _get(self, obj: ObjectInfo, start: int, lo: int, hi: int, pending: _Pending, progress: Progress,
                   deadline: float) -> None:
        """Bytes [lo, hi) of the block, retried from the last byte received until the read's deadline."""
        attempts = 0
        while True:
            began = time.monotonic()
            attempts += 1
            pending.attempts += 1
            self.metrics.get_requests.labels(kind="demand" if pending.demanded else "prefetch").inc()
            done = progress.received  # counted in get_bytes when this attempt ends
            try:
                if hi - lo <= self._loop_limit:
                    await self._receive_on_loop(obj, start, lo, hi, pending, progress)
                else:
                    await trio.to_thread.run_sync(self._receive, obj, start, lo, hi, pending, progress,
                                                  limiter=self._threads)
            except TransientError as exc:
                if exc.throttled:
                    self.metrics.throttled.inc()
                pause = backoff(attempts, exc.retry_after)
                if self._clock() + pause >= deadline:
                    raise  # retried until the read's deadline: now it fails
                self.metrics.retries.inc()
                await self._sleep(pause)
                continue
            finally:
                self.metrics.get_bytes.inc(progress.received - done)
                self.metrics.store_bytes.labels(cause=pending.cause).inc(progress.received - done)
            self.metrics.get_latency.observe(time.monotonic() - began)
            return

    async def _get_parts(self, obj: ObjectInfo, start: int, nbytes: int, count: int, pending: _Pending,
                         deadline: float) -> None:
        """The block in `count` GETs at once; its progress counts the bytes before the first gap."""
        if pending.buffer is None:
            pending.buffer = await trio.to_thread.run_sync(allocate, nbytes, self.huge_pages, limiter=self._threads)
        parts = Parts(pending.progress, nbytes, count)
        await self._get_all(obj, start, pending, deadline, [(*extent, progress) for extent, progress
                                                              in zip(parts.extents, parts.progress)])

    async def _get_all(self, obj: ObjectInfo, start: int, pending: _Pending, deadline: float,
                       pieces: list[tuple[int, int, Progress]]) -> None:
        """Bytes [lo, hi) of the block for each piece, all at once; the first failure once all have ended."""
        errors: list[StoreError] = []

        async def one(lo: int, hi: int, progress: Progress) -> None:
            try:
                await self._get(obj, start, lo, hi, pending, progress, deadline)
            except StoreError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for lo, hi, progress in pieces:
                nursery.start_soon(one, lo, hi, progress)
        if errors:
            raise errors[0]

    async def _ranges_inside(self, obj: ObjectInfo, start: int, end: int) -> None:
        """Wait for the exact ranges of this block still coming (a reader that started inside it, or a peer's), so that
        the block's fetch takes them in rather than fetching their bytes a second time alongside."""
        coming = [p for k, p in self._pending.items()  # (only those past the byte budget: this block holds some)
                  if isinstance(k, RangeKey) and p.fetching and (k.key, k.etag) == (obj.key, obj.etag)
                  and start <= k.start and k.stop <= end]
        with trio.move_on_after(self.read_deadline):  # (each is bounded by its own deadline too)
            for pending in coming:
                await pending.done.wait()

    async def _get_around(self, obj: ObjectInfo, start: int, nbytes: int, held: list[tuple[int, int, Buffer]],
                          pending: _Pending, deadline: float) -> None:
        """The block (at `start`) with the ranges of it already held copied in and only the rest fetched, the gaps
        at once: a reader that started inside the block (its young random run fetched that exact range) and then
        read on would otherwise fetch those bytes a second time, and in a distributed cache every node that started
        there would (issue 44: 1.06x the dataset in an epoch of shard quarters)."""
        if pending.buffer is None:
            pending.buffer = await trio.to_thread.run_sync(allocate, nbytes, self.huge_pages, limiter=self._threads)
        view = memoryview(pending.buffer)
        extents: list[tuple[int, int]] = []
        gaps: list[int] = []
        at = 0
        for lo, hi, data in held:
            lo, hi = lo - start, hi - start
            if lo > at:
                gaps.append(len(extents))
                extents.append((at, lo))
            view[lo:hi] = memoryview(data).cast("B")[:hi - lo]
            extents.append((lo, hi))
            at = hi
        if at < nbytes:
            gaps.append(len(extents))
            extents.append((at, nbytes))
        parts = Parts(pending.progress, nbytes, len(extents), extents)
        for i, (lo, hi) in enumerate(extents):
            if i not in gaps:
                parts.progress[i].advance(hi - lo)  # held: there already
        await self._get_all(obj, start, pending, deadline, [(*extents[i], parts.progress[i]) for i in gaps])

    def _range_parts(self, parts: int, nbytes: int) -> int:
        """GETs for an exact range: up to `parts` of at least RANGE_PART, and no more than half the connections free
        now (a reader waits one first byte plus its largest part; where the connections are busy, more parts only
        queue behind other readers' GETs and cost requests)."""
        free = int(self._threads.total_tokens - self._threads.borrowed_tokens)
        return max(1, min(parts, nbytes // RANGE_PART, free // 2))

    def _alone(self, key: CacheKey) -> bool:
        """Is `key`'s file the only one with blocks in flight? Parts fill an idle pipe sooner; while other
        files stream, the pipe is full and more GETs only cost CPU (shards read by four readers)."""
        return all(other.key == key.key for other in self._pending)

    async def _fetch(self, key: CacheKey, obj: ObjectInfo, pending: _Pending) -> Buffer:
        start, end = extent(key, obj.size, self.block_size)
        nbytes = end - start
        demand = not pending.prefetch_bytes  # a prefetch a reader joined later still holds prefetch room
        if demand:
            held = await self._bytes.acquire(nbytes)
            self._admit()  # prefetches held back while this demand read waited may fit now
        else:
            held = pending.prefetch_bytes
        spare = self.cache.reserve(nbytes)
        self._settle(pending)  # promised until here: waiting for the byte budget must not free room
        pending.fetching = True
        self.metrics.inflight_requests.inc()
        self.metrics.inflight_bytes.inc(nbytes)
        try:
            nearer = await self._nearer(obj, start, end, pending)
            if nearer is not None:
                self.cache.give_back(spare)
                pending.buffer, pending.source = nearer
                pending.progress.advance(nbytes)
                return pending.buffer
            pending.cause = _cause(key, pending, demand)
            if isinstance(key, BlockKey) and self._ranges_in_flight:
                await self._ranges_inside(obj, start, end)
            pending.buffer = spare  # else mapped by a receiving thread
            deadline = self._clock() + self.read_deadline
            had = self.cache.held_within(obj.key, obj.etag, start, end) if isinstance(key, BlockKey) else []
            if had:
                await self._get_around(obj, start, nbytes, had, pending, deadline)
                assert pending.buffer is not None
                return pending.buffer
            parts = self._range_parts(pending.parts, nbytes) if isinstance(key, RangeKey) \
                else min(pending.parts, nbytes // MIN_PART)
            if parts > 1 and (isinstance(key, RangeKey) or pending.split or self._alone(key)):
                await self._get_parts(obj, start, nbytes, parts, pending, deadline)
            else:
                await self._get(obj, start, 0, nbytes, pending, pending.progress, deadline)
            assert pending.buffer is not None
            return pending.buffer
        finally:
            self.metrics.inflight_requests.dec()
            self.metrics.inflight_bytes.dec(nbytes)
            self._bytes.release(held, demand=demand)
            # Last, with no await after it: the caller puts the block in the cache before any other
            # task runs, so the bytes never look free in between (a prefetch could claim them twice).
            self.cache.release(nbytes)

