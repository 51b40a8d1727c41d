"""What the data path knows of an object store: value types and the protocol a store client implements."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

from ..config import Identity


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str  # full object key
    size: int
    etag: str
    mtime: float  # seconds since the epoch


@dataclass
class Listing:
    """One page of a delimiter listing: objects directly under a prefix and sub-prefixes."""

    files: list[ObjectInfo] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)  # full prefixes, ending in '/'
    truncated: bool = False  # more pages follow


_NEVER = 1 << 62


class Progress:
    """Bytes of a GET received so far; written by the worker thread, read by waiting readers.

    A reader that needs the first `n` bytes asks to be woken when they are there (`wake_at`): the
    worker thread calls `wake` once, when it crosses the mark, instead of the reader polling."""

    __slots__ = ("received", "_mark", "_wake")

    def __init__(self) -> None:
        self.received = 0
        self._mark = _NEVER
        self._wake: Callable[[], None] | None = None

    def advance(self, n: int) -> None:
        self.received += n
        if self.received >= self._mark:
            self._mark = _NEVER
            wake = self._wake
            if wake is not None:
                wake()

    def wake_at(self, nbytes: int, wake: Callable[[], None] | None = None) -> None:
        """Call `wake` (or the one given before) from the receiving thread once `nbytes` have arrived;
        a lower mark than one already set replaces it. The caller checks `received` after this call."""
        if wake is not None:
            self._wake = wake
        self._mark = min(self._mark, nbytes)


class Parts:
    """A block received in several GETs at once: each part has its own Progress, and the block's
    Progress counts the bytes before the first part still missing some (readers read a prefix)."""

    def __init__(self, whole: Progress, nbytes: int, count: int, extents: list[tuple[int, int]] | None = None):
        size = nbytes // count
        self.extents = extents or [(i * size, nbytes if i == count - 1 else (i + 1) * size) for i in range(count)]
        self.progress = [_Part(self) for _ in self.extents]
        self._whole = whole
        self._lock = threading.Lock()  # parts advance from their own worker threads

    def advanced(self) -> None:
        with self._lock:
            prefix = 0
            for (lo, hi), part in zip(self.extents, self.progress):
                prefix += part.received
                if part.received < hi - lo:
                    break
            if prefix > self._whole.received:
                self._whole.advance(prefix - self._whole.received)


class _Part(Progress):
    __slots__ = ("_parts",)

    def __init__(self, parts: Parts):
        super().__init__()
        self._parts = parts

    def advance(self, n: int) -> None:
        super().advance(n)
        self._parts.advanced()


class ObjectStore(Protocol):
    def check(self) -> None: ...
    def list_dir(self, prefix: str) -> Iterator[Listing]: ...
    def list_all(self, prefix: str) -> Iterator[ObjectInfo]: ...
    def head(self, key: str) -> ObjectInfo | None: ...
    def has_prefix(self, prefix: str) -> bool: ...
    def probe(self, key: str) -> Listing: ...
    def read_range(self, key: str, start: int, end: int, etag: str, into: memoryview, progress: Progress) -> None: ...
    def rotate(self, identity: Identity) -> None: ...


class LoopRangeReads(Protocol):
    """A store that reads small ranges from the trio event loop itself, with no worker thread (S3Store on awscrt
    connections: the body arrives on awscrt's own thread); `loop_range_limit` 0 means it cannot."""

    loop_range_limit: int

    async def read_range_on_loop(self, key: str, start: int, end: int, etag: str, into: memoryview,
                                 progress: Progress) -> None: ...
