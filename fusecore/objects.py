"""What the data path knows of an object store: value types and the protocol a store client implements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Protocol

from .config import Identity


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


class Progress:
    """Bytes of a GET received so far; written by the worker thread, read by waiting readers."""

    __slots__ = ("received",)

    def __init__(self) -> None:
        self.received = 0

    def advance(self, n: int) -> None:
        self.received += n


class ObjectStore(Protocol):
    def check(self) -> None: ...
    def list_dir(self, prefix: str) -> Iterator[Listing]: ...
    def list_all(self, prefix: str) -> Iterator[ObjectInfo]: ...
    def head(self, key: str) -> ObjectInfo | None: ...
    def has_prefix(self, prefix: str) -> bool: ...
    def read_range(self, key: str, start: int, end: int, etag: str, into: memoryview, progress: Progress) -> None: ...
    def rotate(self, identity: Identity) -> None: ...
