"""Room for GETs in flight: the byte budget that demand reads wait for and prefetches are admitted to."""

from __future__ import annotations

import trio


class ByteBudget:
    """An async semaphore over bytes, demand first: a prefetch is admitted only while no demand read
    waits, and prefetches together hold at most `prefetch_share` of the limit, so a demand read always
    finds room at once or after the GET that frees it. A request larger than the limit waits for an
    empty budget.

    Demand reads wait here (`acquire`); prefetches never wait here: the fetcher offers them in the
    order they were asked for (`try_prefetch`) and keeps the ones that do not fit queued in that order.
    Taking room that is free costs no scheduling round (a trio Condition cost four per GET)."""

    def __init__(self, limit: int, prefetch_share: float = 0.75):
        self.limit = limit
        self.prefetch_share = prefetch_share
        self.used = 0
        self.prefetch_used = 0
        self._demand_waiting = 0
        self._waiters = trio.lowlevel.ParkingLot()

    async def acquire(self, nbytes: int) -> int:
        """Take `nbytes` (at most the whole limit) for a demand read; returns what was taken, for `release`."""
        nbytes = min(nbytes, self.limit)
        if self.used + nbytes > self.limit:
            self._demand_waiting += 1
            try:
                while self.used + nbytes > self.limit:
                    await self._waiters.park()
            finally:
                self._demand_waiting -= 1
        self.used += nbytes
        return nbytes

    def try_prefetch(self, nbytes: int) -> int:
        """Take `nbytes` for a prefetch if it fits now (0 if not); returns what was taken, for `release`."""
        nbytes = min(nbytes, self.limit)
        cap = max(nbytes, int(self.limit * self.prefetch_share))
        if self._demand_waiting or self.used + nbytes > self.limit or self.prefetch_used + nbytes > cap:
            return 0
        self.used += nbytes
        self.prefetch_used += nbytes
        return nbytes

    def release(self, nbytes: int, *, demand: bool = True) -> None:
        self.used -= nbytes
        if not demand:
            self.prefetch_used -= nbytes
        self._waiters.unpark_all()
