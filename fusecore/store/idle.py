"""Kept-alive connections between requests, by where they go: the pool the store's HTTP clients (loop_http,
native_http) and the peer client (peers) keep theirs in."""

from __future__ import annotations

import math
import threading
import time
from typing import Callable, Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
C = TypeVar("C")


class IdlePool(Generic[K, C]):
    """At most `most` idle connections for each place (one given back past that is closed); the one given back last
    is taken first. One idle for `max_age` seconds or more, or no longer `usable`, is closed rather than taken. Any
    thread may take and give."""

    def __init__(self, most: int, close: Callable[[C], None], *, usable: Callable[[C], bool] | None = None,
                 max_age: float = math.inf, clock: Callable[[], float] = time.monotonic):
        self._most, self._close, self._usable, self._max_age, self._clock = most, close, usable, max_age, clock
        self._idle: dict[K, list[tuple[float, C]]] = {}
        self._lock = threading.Lock()

    def take(self, where: K) -> C | None:
        stale: list[C] = []
        found: C | None = None
        with self._lock:
            idle = self._idle.get(where)
            now = self._clock()
            while idle:
                since, conn = idle.pop()
                if now - since < self._max_age and (self._usable is None or self._usable(conn)):
                    found = conn
                    break
                stale.append(conn)
        for conn in stale:
            self._close(conn)
        return found

    def give(self, where: K, conn: C) -> None:
        with self._lock:
            idle = self._idle.setdefault(where, [])
            if len(idle) < self._most:
                idle.append((self._clock(), conn))
                return
        self._close(conn)

    def close(self) -> None:
        """Close every idle connection."""
        with self._lock:
            pools, self._idle = self._idle, {}
        for idle in pools.values():
            for _, conn in idle:
                self._close(conn)
