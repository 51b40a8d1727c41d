"""Connections kept by where they come from, oldest first: what the peer port (peers.py) and the node's peer router
(router.py) bound per source and in all, and pick the oldest of to shed."""

from __future__ import annotations

import ipaddress
from typing import Generic, Hashable, Iterator, TypeVar

T = TypeVar("T", bound=Hashable)


def source_of(host: str) -> str:
    """What a per-source bound counts a connection by: its address, or an IPv6 one's /64 (one host may have it all)."""
    if ":" not in host:
        return host
    ip = ipaddress.IPv6Address(host.split("%", 1)[0])
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))


class BySource(Generic[T]):
    """Items (connections) by source, each source's and all of them in the order they were added."""

    def __init__(self) -> None:
        self.all: dict[T, str] = {}  # item -> its source, oldest first
        self._by: dict[str, dict[T, None]] = {}

    def __len__(self) -> int:
        return len(self.all)

    def __contains__(self, item: T) -> bool:
        return item in self.all

    def add(self, source: str, item: T) -> None:
        self.all[item] = source
        self._by.setdefault(source, {})[item] = None

    def discard(self, item: T) -> None:
        source = self.all.pop(item, None)
        if source is None:
            return
        mine = self._by[source]
        del mine[item]
        if not mine:
            del self._by[source]

    def count(self, source: str) -> int:
        return len(self._by.get(source, ()))

    def of(self, source: str) -> Iterator[T]:
        """The items of `source`, oldest first."""
        return iter(self._by.get(source, ()))

    def clear(self) -> None:
        self.all.clear()
        self._by.clear()
