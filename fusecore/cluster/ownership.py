"""Which members of a distributed cache own a block: a Maglev lookup table over the members.

Every node builds the same table alone from the member list (sorted, so the order it learned the
members in does not matter): members take turns claiming the next free entry of their own
permutation of the table, so each holds M/N entries give or take one. A lookup is one hash and one
index at any number of members (~2-3 µs here; building the table takes ~0.15 s). M is fixed
(65,537, a prime) so that a membership change does not re-deal the table: shares stay within 1.5% of
1/N at 1,000 members and within 8% at 5,000.

What a join or a leave moves, measured (tests/fusecore/test_ownership.py): ~1.5/N of the entries at
100 members, 6-7.5/N at 1,000 (Maglev trades extra moves for its balance; rendezvous hashing moves the
minimum 1/N but costs a hash per member per lookup, ~2 ms at 1,000 members in Python, and a ring
needs ~1,500 points per member for 10% balance at 1,000 members). The blocks that move are re-warmed
by their new owners, from a replica where there is one, else from the member that owned them before
(cluster/tier.py: Cluster.plan).

With R replicas, a block's owners are R distinct members drawn by R independent probes of the table
(a probe that lands on a member already drawn probes again), so each replica is spread like the
primary.

Pure logic, no I/O (the cluster-cache issue): the peer layer asks it whom to ask for a block, and the
operator's sizing how much of the dataset each node holds.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

TABLE_SIZE = 65537  # a prime: every member's permutation visits each entry once


def _hash64(data: bytes, salt: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, salt=salt).digest(), "little")


def block_id(key: str, etag: str, index: int) -> bytes:
    """What ownership is computed from: one version's block (a new ETag may land on other owners)."""
    return f"{key}\0{etag}\0{index}".encode()


class Owners:
    """The owners of any block among `members` (node names or addresses), `replicas` of them each."""

    def __init__(self, members: Iterable[str], replicas: int = 1):
        self.members = tuple(sorted(set(members)))
        if not self.members:
            raise ValueError("a distributed cache needs at least one member")
        if replicas < 1:
            raise ValueError("replicas must be at least 1")
        self.replicas = min(replicas, len(self.members))
        self._table = self._populate()

    def _populate(self) -> list[int]:
        """Maglev's population: members take turns claiming the next free entry of their own permutation."""
        m, n = TABLE_SIZE, len(self.members)
        offsets = [_hash64(name.encode(), b"offset") % m for name in self.members]
        skips = [_hash64(name.encode(), b"skip") % (m - 1) + 1 for name in self.members]
        nexts = [0] * n
        table = [-1] * m
        filled = 0
        while True:
            for i in range(n):
                c = (offsets[i] + nexts[i] * skips[i]) % m
                while table[c] >= 0:
                    nexts[i] += 1
                    c = (offsets[i] + nexts[i] * skips[i]) % m
                table[c] = i
                nexts[i] += 1
                filled += 1
                if filled == m:
                    return table

    def of(self, block: bytes) -> tuple[str, ...]:
        """The block's owners, the primary first."""
        found: list[int] = []
        probe = 0
        while len(found) < self.replicas:
            member = self._table[_hash64(block, probe.to_bytes(2, "little")) % TABLE_SIZE]
            if member not in found:
                found.append(member)
            probe += 1
        return tuple(self.members[i] for i in found)

    def owns(self, member: str, block: bytes) -> bool:
        return member in self.of(block)

    def share(self, member: str) -> float:
        """The part of the blocks `member` holds (about R/N): what the operator sizes its cache for."""
        if member not in self.members:
            return 0.0
        index = self.members.index(member)
        primary = self._table.count(index) / TABLE_SIZE
        return min(1.0, primary * self.replicas)

    def entries(self) -> list[str]:
        """The primary owner of every table entry (what a membership change moves is measured on it)."""
        return [self.members[i] for i in self._table]
