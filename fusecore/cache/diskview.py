"""A worker's view of its mount's disk tier (`--workers N --disk-cache DIR`).

What DIR holds, and within which budget, is decided in one place: the hub's DiskTier (disk.py), which holds DIR's
lock, learns what DIR holds at start, evicts, and writes every file. A worker writes nothing there: a block it fetched
is published to the shared blocks (shared.py) with the name the disk keeps it under, and the hub writes it from that
file. A worker finds a block by its file (the directory is the index), reads and checks it as a single process does
(HeldFiles), and tells the hub of each use (its recency) and of each damaged file it removed. A file the hub evicts
while a worker reads it stays readable to that worker.
"""

from __future__ import annotations

import os

from .disk import WRITE_QUEUE, DiskStats, HeldFiles
from .memory import Buffer
from .blocks import BlockKey
from .shared import SharedBlocks, TrustTable


class DiskView(HeldFiles):
    def __init__(self, directory: str, budget: int, *, bucket: str, block_size: int, shared: SharedBlocks,
                 huge_pages: bool = False):
        super().__init__(directory, bucket=bucket, block_size=block_size, huge_pages=huge_pages)
        self.budget = budget  # the hub's (a warm sizes itself by it)
        # a warm paces itself by the hub's queue, seen a little late (news are sent in batches): it keeps two blocks
        # under the hub's limit, so that what it fetched meanwhile is not skipped
        self.queue_limit = max(block_size, max(WRITE_QUEUE, 2 * block_size) - 2 * block_size)
        self._shared = shared
        self.trust_table = TrustTable(shared.root)
        self.opened_seconds = 0.0

    def known(self, name: str) -> bool:
        return os.path.exists(os.path.join(self._blocks, name))

    def _holds(self, name: str) -> bool:
        self._shared.tell(b"dhit " + name.encode())
        return True  # (the open says whether it is there)

    def _held(self, name: str) -> bool:
        return True

    def _forget(self, name: str) -> bool:
        return True

    def _gone(self, name: str) -> None:
        self._shared.tell(b"ddrop " + name.encode())  # (after its removal: the hub then forgets it for good)

    def _drop(self, name: str) -> None:
        """Gone (the hub evicted it): nothing to tell, nothing to remove."""
        with self._lock:
            self._trusted.pop(name, None)

    def _discard(self, name: str) -> None:
        with self._lock:
            self._trusted.pop(name, None)
        self._remove(name)
        self._gone(name)

    def offer(self, key: BlockKey, data: Buffer) -> None:
        """Nothing: a worker's blocks reach the disk through the hub, as they are published (shared.publish)."""

    @property
    def queued_bytes(self) -> int:
        return self._shared.disk_queued()

    def stats(self) -> DiskStats:
        """This worker's reads of the tier; what DIR holds, its budget and its writes are the hub's."""
        with self._lock:
            return DiskStats(self.directory, 0, 0, 0, self.hits, self.misses, self.bytes_read, 0, 0, self.dropped, 0,
                             self.errors, 0, "", 0.0)

    def close(self) -> None:
        pass
