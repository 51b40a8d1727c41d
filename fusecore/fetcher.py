"""Fetch scheduler: one in-flight GET per block shared by all waiters, bounded concurrency and
in-flight bytes, demand reads ahead of prefetches, body-level retries, and a read deadline.
"""

from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable, Hashable

import trio

from .blocks import BlockKey, block_extent
from .cache import BlockCache, Buffer
from .cluster import Cluster
from .metrics import MountMetrics
from .buffers import allocate
from .objects import ObjectInfo, ObjectStore, Progress
from .store_errors import PreconditionFailed, StoreError, TransientError, Unavailable, backoff

log = logging.getLogger(__name__)


class ByteBudget:
    """An async semaphore over bytes, demand first: a prefetch waits while a demand read waits, and
    prefetches together hold at most `prefetch_share` of the limit, so a demand read always finds room
    at once or after the GET that frees it. A request larger than the limit waits for an empty budget.

    Taking room that is free costs no scheduling round (a trio Condition cost four per GET); waiters
    park and are all woken at each release, to look again."""

    def __init__(self, limit: int, prefetch_share: float = 0.75):
        self.limit = limit
        self.prefetch_share = prefetch_share
        self.used = 0
        self.prefetch_used = 0
        self._demand_waiting = 0
        self._waiters = trio.lowlevel.ParkingLot()

    def _prefetch_fits(self, nbytes: int) -> bool:
        cap = max(nbytes, int(self.limit * self.prefetch_share))
        return self._demand_waiting == 0 and self.prefetch_used + nbytes <= cap

    async def acquire(self, nbytes: int, *, demand: bool = True) -> int:
        """Take `nbytes` (at most the whole limit); returns what was taken, for `release`."""
        nbytes = min(nbytes, self.limit)
        if demand:
            if self.used + nbytes > self.limit:
                self._demand_waiting += 1
                try:
                    while self.used + nbytes > self.limit:
                        await self._waiters.park()
                finally:
                    self._demand_waiting -= 1
                    self._waiters.unpark_all()  # prefetches held back by this demand may go on
        else:
            while self.used + nbytes > self.limit or not self._prefetch_fits(nbytes):
                await self._waiters.park()
            self.prefetch_used += nbytes
        self.used += nbytes
        return nbytes

    def release(self, nbytes: int, *, demand: bool = True) -> None:
        self.used -= nbytes
        if not demand:
            self.prefetch_used -= nbytes
        self._waiters.unpark_all()


class _Pending:
    """The shared future of one block GET; readers may take bytes as soon as they arrive."""

    __slots__ = ("done", "data", "error", "demanded", "visit", "buffer", "progress", "queued", "attempts", "logged",
                 "arrived")

    def __init__(self, demanded: bool, visit: Hashable | None, queued: int = 0):
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


class Fetcher:
    def __init__(self, store: ObjectStore, cache: BlockCache, metrics: MountMetrics, *, block_size: int,
                 max_concurrency: int, inflight_limit: int, read_deadline: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], Awaitable[None]] = trio.sleep,
                 cluster: Cluster | None = None):
        self.store = store
        self.cluster = cluster  # a distributed cache: blocks this node does not own are asked of their owner first
        self._clock, self._sleep = clock, sleep  # the retry schedule's time (a fake one in tests)
        self.cache = cache
        self.metrics = metrics
        self.block_size = block_size
        self.read_deadline = read_deadline
        self._threads = trio.CapacityLimiter(max_concurrency)
        # Prefetches may use at most 3/4 of the connections, so demand reads always find one.
        self._prefetch_slots = trio.CapacityLimiter(max(1, (max_concurrency * 3) // 4))
        self._bytes = ByteBudget(inflight_limit, self._prefetch_share(inflight_limit))
        self._pending: dict[BlockKey, _Pending] = {}
        self._queued = 0  # bytes of prefetches launched but not yet reserved in the cache
        self._nursery: trio.Nursery | None = None

    def set_inflight_limit(self, nbytes: int) -> None:
        """Bound in-flight GET bytes anew (after a cache resize); GETs already running finish."""
        self._bytes.limit = nbytes
        self._bytes.prefetch_share = self._prefetch_share(nbytes)

    def _prefetch_share(self, limit: int) -> float:
        """Prefetches leave a quarter of the in-flight bytes to demand reads, where that is a block or more."""
        return 0.75 if limit >= 4 * self.block_size else 1.0

    def start(self, nursery: trio.Nursery) -> None:
        """Background GETs run in `nursery`, so a cancelled reader never cancels a shared GET."""
        self._nursery = nursery

    @property
    def inflight(self) -> int:
        return len(self._pending)

    async def block(self, obj: ObjectInfo, index: int, visit: Hashable | None = None,
                    unit: int = 0, need: int | None = None) -> tuple[Buffer, bool]:
        """The bytes of one block (or page of size `unit`) and whether the cache had them.

        With `need`, return as soon as the block's first `need` bytes have arrived (the buffer is
        then only valid up to there): a reader does not wait for the rest of a block it does not
        read yet, which is what makes the first byte of a cold file quick.
        """
        key = BlockKey(obj.key, obj.etag, index, unit)
        data = self.cache.get(key, visit)
        if data is not None:
            if self.cluster is not None and self.cache.transient(key) and self._keeps(key, obj):
                self.cache.keep(key)  # read for another owner, and this node's own since the members changed
            return data, True
        pending = self._pending.get(key)
        if pending is None:
            pending = self._launch(key, obj, demanded=True, visit=visit)
        else:
            pending.demanded = True
            pending.visit = visit
        with trio.move_on_after(self.read_deadline):
            start, end = block_extent(index, obj.size, unit or self.block_size)
            if need is None or need >= end - start:  # the whole block: its end is the one wake-up
                await pending.done.wait()
            else:
                while not pending.done.is_set():
                    if pending.buffer is not None and pending.progress.received >= need:
                        return pending.buffer, False
                    await pending.wait_for(need)
        if not pending.done.is_set():
            self.metrics.errors.labels(kind="deadline").inc()
            if not pending.logged:
                pending.logged = True
                log.warning("read of %s block %d failed: no answer within %gs (%d attempts so far)", obj.key,
                            index, self.read_deadline, pending.attempts)
            raise Unavailable(f"get {obj.key!r}: no answer within {self.read_deadline:g}s")
        if pending.error is not None:
            raise pending.error
        if pending.data is None:
            raise Unavailable(f"get {obj.key!r}: fetch abandoned")
        return pending.data, False

    def prefetch(self, obj: ObjectInfo, index: int, wanted: Callable[[], bool] = lambda: True) -> bool:
        """Start fetching a block ahead of the reader unless it is cached or already coming.

        Returns False, starting nothing, while prefetched-but-unread and in-flight bytes fill the
        cache's staging room: read-ahead waits rather than fetching blocks it would have to drop.
        """
        key = BlockKey(obj.key, obj.etag, index)
        if key in self._pending or key in self.cache:
            return True
        nbytes = min(obj.size - index * self.block_size, self.block_size)
        if self.cache.transient_room - self._queued < nbytes:
            return False
        self._queued += nbytes  # promised until its GET reserves the bytes in the cache
        self._launch(key, obj, demanded=False, visit=None, wanted=wanted, queued=nbytes)
        return True

    def _launch(self, key: BlockKey, obj: ObjectInfo, *, demanded: bool, visit: Hashable | None,
                wanted: Callable[[], bool] = lambda: True, queued: int = 0) -> _Pending:
        if self._nursery is None:
            raise RuntimeError("Fetcher.start() was not called")
        pending = _Pending(demanded, visit, queued)
        self._pending[key] = pending
        self._nursery.start_soon(self._run, key, obj, pending, wanted)
        return pending

    def _settle(self, pending: _Pending) -> None:
        """A prefetch's promised bytes are now reserved in the cache (or never will be)."""
        self._queued -= pending.queued
        pending.queued = 0

    async def _run(self, key: BlockKey, obj: ObjectInfo, pending: _Pending, wanted: Callable[[], bool]) -> None:
        try:
            if pending.demanded:
                pending.data = await self._fetch(key, obj, pending)
            else:
                async with self._prefetch_slots:
                    if pending.demanded or wanted():
                        pending.data = await self._fetch(key, obj, pending)
            if pending.data is not None:
                self.cache.put(key, pending.data, prefetched=not pending.demanded, visit=pending.visit,
                               keep=self._keeps(key, obj))
            elif pending.demanded:  # a reader joined a prefetch that was abandoned
                pending.data = await self._fetch(key, obj, pending)
                self.cache.put(key, pending.data, visit=pending.visit, keep=self._keeps(key, obj))
        except Exception as exc:  # noqa: BLE001 - one request never ends the mount: its readers get EIO
            if not isinstance(exc, StoreError):
                log.exception("unexpected error fetching %s block %d", obj.key, key.index)
                exc = Unavailable(f"get {obj.key!r}: unexpected {type(exc).__name__}")
            pending.error = exc
            self.metrics.errors.labels(kind=exc.kind).inc()
            if isinstance(exc, PreconditionFailed):
                dropped = self.cache.invalidate(obj.key)
                log.warning("%s changed during reads; dropped %d cached blocks", obj.key, dropped)
            elif not pending.logged:
                pending.logged = True
                start, end = block_extent(key.index, obj.size, key.unit or self.block_size)
                (log.warning if pending.demanded else log.info)(
                    "%s of %s bytes %d-%d failed after %d attempt(s): %s", "read" if pending.demanded else "prefetch",
                    obj.key, start, end - 1, pending.attempts, exc)
        finally:
            self._settle(pending)
            del self._pending[key]
            pending.finish()

    def _keeps(self, key: BlockKey, obj: ObjectInfo) -> bool:
        """Does the cache keep this block past its readers? In a distributed cache only the blocks this node
        owns (and pages, which are never shared): the others belong to other nodes' shares."""
        return self.cluster is None or bool(key.unit) or self.cluster.owns(obj.key, obj.etag, key.index)

    async def _from_peer(self, key: BlockKey, obj: ObjectInfo, nbytes: int) -> Buffer | None:
        """The block from another of its owners that answers with exactly it (else the store)."""
        assert self.cluster is not None
        peers = self.cluster.sources(obj.key, obj.etag, key.index)
        if not peers:  # this node is the only owner (or the others are avoided): no thread hop
            return None
        return await trio.to_thread.run_sync(self.cluster.fetch, peers, obj.key, obj.etag, key.index, nbytes,
                                             limiter=self._threads)

    async def _fetch(self, key: BlockKey, obj: ObjectInfo, pending: _Pending) -> Buffer:
        start, end = block_extent(key.index, obj.size, key.unit or self.block_size)
        nbytes = end - start
        demand = pending.demanded  # a prefetch a reader joined while it waited still holds prefetch room
        held = await self._bytes.acquire(nbytes, demand=demand)
        self.cache.reserve(nbytes)
        self._settle(pending)  # promised until here: waiting for the byte budget must not free room
        self.metrics.inflight_requests.inc()
        self.metrics.inflight_bytes.inc(nbytes)
        try:
            progress = pending.progress
            if self.cluster is not None and not key.unit:
                peer_copy = await self._from_peer(key, obj, nbytes)
                if peer_copy is not None:
                    pending.buffer = peer_copy
                    progress.advance(nbytes)
                    return peer_copy
            buffer = self.cache.take_buffer(nbytes) or allocate(nbytes)
            view = memoryview(buffer)
            pending.buffer = buffer
            deadline = self._clock() + self.read_deadline
            while True:
                began = time.monotonic()
                pending.attempts += 1
                self.metrics.get_requests.labels(kind="demand" if pending.demanded else "prefetch").inc()
                done = progress.received  # a retry resumes where the broken body stopped
                try:
                    await trio.to_thread.run_sync(self.store.read_range, obj.key, start + done, end, obj.etag,
                                                  view[done:], progress, limiter=self._threads)
                except TransientError as exc:
                    if exc.throttled:
                        self.metrics.throttled.inc()
                    pause = backoff(pending.attempts, exc.retry_after)
                    if self._clock() + pause >= deadline:
                        raise  # retried until the read's deadline: now it fails
                    self.metrics.retries.inc()
                    await self._sleep(pause)
                    continue
                finally:
                    self.metrics.get_bytes.inc(progress.received - done)
                self.metrics.get_latency.observe(time.monotonic() - began)
                return buffer
        finally:
            self.metrics.inflight_requests.dec()
            self.metrics.inflight_bytes.dec(nbytes)
            self._bytes.release(held, demand=demand)
            # Last, with no await after it: the caller puts the block in the cache before any other
            # task runs, so the bytes never look free in between (a prefetch could claim them twice).
            self.cache.release(nbytes)

