"""Directory-walk prefetch: when a reader opens several small files of one directory (a data
loader going through an image folder, in any order), fetch the directory's other small files
whole, many at once, ahead of it.

Bounded by `budget` bytes of prefetched-but-unread plus in-flight data, so a huge directory
never floods the cache; it resumes issuing as the reader consumes what was fetched. And bounded by
what the reader takes: at most WALK_START files the reader has not opened yet, plus WALK_GROWTH per
file it opened that the walk had fetched. A loader going through the directory keeps the walk far
ahead; one opening a few random files of a huge directory costs at most WALK_START extra GETs
instead of fetching the directory (demand reads keep the connections).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from .cache import BlockCache
from .fetcher import Fetcher
from .namespace import Namespace, Node
from .objects import ObjectInfo

MAX_TRACKED_DIRS = 4096
WALK_START = 32  # files fetched ahead before the reader showed it reads what the walk fetches
WALK_GROWTH = 8  # more files ahead for each opened file the walk had fetched


@dataclass
class _DirState:
    listed_at: float
    files: list[ObjectInfo]
    opened: int = 0
    next: int = 0  # files[:next] were issued
    hits: int = 0  # opened files the walk had issued
    index: dict[str, int] | None = None  # key -> position in files
    opened_ahead: set[int] = field(default_factory=set)  # positions at or past `next` the reader opened first

    def position(self, key: str) -> int | None:
        if self.index is None:
            self.index = {info.key: i for i, info in enumerate(self.files)}
        return self.index.get(key)

    def room(self) -> int:
        """How many more files may be issued now: the walk stays within what the reader takes."""
        return WALK_START + WALK_GROWTH * self.hits - (self.next - self.hits)


class DirectoryPrefetcher:
    def __init__(self, namespace: Namespace, fetcher: Fetcher, cache: BlockCache, *, small_file_max: int,
                 budget: int, trigger: int = 2):
        self.ns = namespace
        self.fetcher = fetcher
        self.cache = cache
        self.small_file_max = small_file_max
        self.budget = budget
        self.trigger = trigger
        self._dirs: OrderedDict[int, _DirState] = OrderedDict()
        self.issued = 0

    def on_open(self, node: Node) -> None:
        if node.info is None or node.info.size > self.small_file_max:
            return
        parent = self.ns.parent_of(node)
        if parent is None:
            return
        state = self._dirs.get(parent.inode)
        if state is None or state.listed_at != parent.listed_at:
            files = self.ns.listed_files(parent)
            if files is None:
                return
            state = _DirState(parent.listed_at, [f for f in files if 0 < f.size <= self.small_file_max])
            self._dirs[parent.inode] = state
            while len(self._dirs) > MAX_TRACKED_DIRS:
                self._dirs.popitem(last=False)
        self._dirs.move_to_end(parent.inode)
        state.opened += 1
        position = state.position(node.info.key)
        if position is not None and position < state.next:
            state.hits += 1
        elif position is not None:
            state.opened_ahead.add(position)  # read before the walk got there: it is not fetched again
        if state.opened >= self.trigger:
            self._issue(state)

    def _issue(self, state: _DirState) -> None:
        while state.next < len(state.files) and state.room() > 0:
            if self.cache.transient_bytes >= self.budget:
                return
            if state.next in state.opened_ahead:  # passed over as if issued (the room the walk takes is unchanged)
                state.opened_ahead.discard(state.next)
                state.next += 1
                continue
            info = state.files[state.next]
            if not self.fetcher.prefetch(info, 0):
                return
            state.next += 1
            self.issued += 1
