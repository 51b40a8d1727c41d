"""Directory-walk prefetch: when a reader opens several small files of one directory (a data
loader going through an image folder, in any order), fetch the directory's other small files
whole, many at once, ahead of it.

Bounded by `budget` bytes of prefetched-but-unread plus in-flight data, so a huge directory
never floods the cache; it resumes issuing as the reader consumes what was fetched. And bounded by
what the reader takes: at most WALK_START files the reader has not opened yet, plus WALK_GROWTH per
file it opened that the walk had fetched. A loader going through the directory keeps the walk far
ahead; one opening a few random files of a huge directory costs at most WALK_START extra GETs
instead of fetching the directory (demand reads keep the connections).

A reader that has opened PASS_FRACTION of a directory's small files (PASS_MIN at least), in any order, is taken
to be going through all of it (a shuffled epoch over one flat folder, as COCO's train2017): where the cache can
hold the whole directory (PASS_CACHE_SHARE of its budget), the walk then fetches every file of it ahead of the
reader, as fast as the prefetch slots and the byte budget allow. Before that, a flat folder read in shuffled order
rarely opens a file the walk already fetched, so its bound never grew: the store's slots sat idle while readers
waited. A reader that stops after a few files of a huge folder never reaches the fraction, and a folder the cache
cannot hold is never fetched whole. The fraction trades the two: until it is reached the readers go one GET each
(~300 files/s with 8 of them, against the ~2,400 the store's slots allow), and a reader that stops just past it has
made the walk fetch up to 1/PASS_FRACTION times what it read (issue 44: 1/16 spent a third of a 3,000-file epoch
before the walk took over; 1/48 makes it 64 opens).

A directory's walk starts at its second open (one open says nothing of the next), or at its first once the
reader opened TRUST_HITS files the walks of its sibling directories had fetched: a shuffled epoch over class
folders shows that within its first few dozen samples. The walk then also goes ahead of the reader into sibling
directories it has not opened yet (listing each with one LIST: one of more than a page is left to the reader),
so a folder's first sample is not a LIST and a GET in a row:
TREE_START directories ahead, plus TREE_GROWTH for each of them the reader then reached (the per-directory
rule, one level up; each directory's walk keeps its own bound, and all of it the byte budget). A reader of one
file per directory (a label file per sample folder) never earns the trust, so it never pays for either.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import trio

from ..cache.memory import BlockCache
from .fetcher import Fetcher
from .namespace import Namespace, Node
from ..store.objects import ObjectInfo

log = logging.getLogger(__name__)

MAX_TRACKED_DIRS = 4096
WALK_START = 32  # files fetched ahead before the reader showed it reads what the walk fetches
WALK_GROWTH = 8  # more files ahead for each opened file the walk had fetched
TRUST_HITS = 4  # opened files the walks of one directory's subdirectories fetched before those walk at a first open
TREE_START = 16  # sibling directories walked ahead of the reader once they are trusted
TREE_GROWTH = 2  # more for each directory walked ahead that the reader then opened
PASS_FRACTION = 1 / 48  # of a directory's small files, opened in any order: the reader goes through all of it
PASS_MIN = 64  # files opened at least before a directory is taken to be read whole
PASS_CACHE_SHARE = 0.5  # of the cache budget, at most, that a directory fetched whole ahead of its reader may take
PASSED_OVER_AT_ONCE = 256  # files the kernel reads itself passed over in one go (each is a name hashed on the loop)


@dataclass
class _DirState:
    listed_at: float
    files: list[ObjectInfo]
    opened: int = 0
    next: int = 0  # files[:next] were issued
    hits: int = 0  # opened files the walk had issued
    index: dict[str, int] | None = None  # key -> position in files
    opened_ahead: set[int] = field(default_factory=set)  # positions at or past `next` the reader opened first
    total: int = 0  # bytes of its files
    seen: set[int] = field(default_factory=set)  # positions the reader opened (each once)
    whole: bool = False  # the reader goes through all of it: fetch it all (see PASS_FRACTION)

    def position(self, key: str) -> int | None:
        if self.index is None:
            self.index = {info.key: i for i, info in enumerate(self.files)}
        return self.index.get(key)

    def room(self) -> int:
        """How many more files may be issued now: the walk stays within what the reader takes (or, for a directory
        read whole, all of it)."""
        if self.whole:
            return len(self.files) - self.next
        return WALK_START + WALK_GROWTH * self.hits - (self.next - self.hits)

    def note_open(self, position: int, cache_budget: int) -> None:
        """The reader opened the file at `position`: is it going through the whole directory now?"""
        self.seen.add(position)
        if not self.whole and len(self.seen) >= max(PASS_MIN, PASS_FRACTION * len(self.files)) \
                and self.total <= PASS_CACHE_SHARE * cache_budget:
            self.whole = True


@dataclass
class _Family:
    """The subdirectories of one directory (class folders of a split), as the walk sees them."""

    parent: Node
    hits: int = 0  # opened files that the walks of its subdirectories had fetched
    ahead: set[int] = field(default_factory=set)  # subdirectories walked before the reader opened a file of them
    reached: int = 0  # of those, how many the reader then opened
    next: int = 0  # its subdirectories (in name order) up to here were considered for a walk ahead

    @property
    def trusted(self) -> bool:
        return self.hits >= TRUST_HITS

    def room(self) -> int:
        return TREE_START + TREE_GROWTH * self.reached - len(self.ahead)


T = TypeVar("T")


def _remember(table: OrderedDict[int, T], inode: int, value: T) -> T:
    """Keep `value` for the directory `inode`, forgetting the least recently used directory past MAX_TRACKED_DIRS."""
    table[inode] = value
    while len(table) > MAX_TRACKED_DIRS:
        table.popitem(last=False)
    return value


class DirectoryPrefetcher:
    def __init__(self, namespace: Namespace, fetcher: Fetcher, cache: BlockCache, *, small_file_max: int,
                 budget: int, trigger: int = 2, read_by_kernel: Callable[[ObjectInfo], bool] = lambda info: False,
                 ahead_elsewhere: Callable[[], int] = lambda: 0):
        """`read_by_kernel`: a file its reader's kernel will read itself (FUSE passthrough): passed over;
        `ahead_elsewhere`: bytes read ahead and unread that the cache no longer counts (a worker's published blocks:
        shared.py), counted against `budget` too."""
        self.ns = namespace
        self.fetcher = fetcher
        self.cache = cache
        self.small_file_max = small_file_max
        self.budget = budget
        self.trigger = trigger
        self.read_by_kernel = read_by_kernel
        self.ahead_elsewhere = ahead_elsewhere
        self._dirs: OrderedDict[int, _DirState] = OrderedDict()
        self._families: OrderedDict[int, _Family] = OrderedDict()  # by the inode of the subdirectories' parent
        self._nursery: trio.Nursery | None = None
        self.issued = 0
        self.dirs_ahead = 0  # directories listed and walked before the reader opened a file of them

    @property
    def whole_dirs(self) -> int:
        """Directories being fetched whole ahead of their reader (PASS_FRACTION)."""
        return sum(state.whole for state in self._dirs.values())

    def start(self, nursery: trio.Nursery) -> None:
        """Where walks ahead into sibling directories list them (without it, the walk never goes ahead)."""
        self._nursery = nursery

    def on_open(self, node: Node) -> None:
        if node.info is None or node.info.size > self.small_file_max:
            return
        parent = self.ns.parent_of(node)
        if parent is None:
            return
        state = self._state_of(parent)
        if state is None:
            return
        self._dirs.move_to_end(parent.inode)
        state.opened += 1
        position = state.position(node.info.key)
        if position is not None:
            state.note_open(position, self.cache.budget)
        grandparent = self.ns.parent_of(parent)
        family = self._family(grandparent) if grandparent is not None else None
        if family is not None and parent.inode in family.ahead:
            family.ahead.discard(parent.inode)
            family.reached += 1
        if position is not None and position < state.next:
            state.hits += 1
            if family is not None:
                family.hits += 1
        elif position is not None:
            state.opened_ahead.add(position)  # read before the walk got there: it is not fetched again
        if state.opened >= self.trigger or (family is not None and family.trusted):
            self._issue(state)
        if family is not None and family.trusted:
            self._go_ahead(family)

    def _state_of(self, node: Node) -> _DirState | None:
        """The walk of a directory as of its current listing (None while it has no fresh listing)."""
        state = self._dirs.get(node.inode)
        if state is None or state.listed_at != node.listed_at:
            files = self.ns.listed_files(node)
            if files is None:
                return None
            small = [f for f in files if 0 < f.size <= self.small_file_max]
            state = _remember(self._dirs, node.inode, _DirState(node.listed_at, small, total=sum(f.size for f in small)))
        return state

    def _family(self, node: Node) -> _Family:
        family = self._families.get(node.inode)
        if family is None:
            family = _remember(self._families, node.inode, _Family(node))
        self._families.move_to_end(node.inode)
        return family

    def _go_ahead(self, family: _Family) -> None:
        """Walk sibling directories the reader has not opened yet, within the family's room."""
        if self._nursery is None or family.room() <= 0:
            return
        entries = self.ns.listed_entries(family.parent)
        if entries is None:
            return
        while family.next < len(entries) and family.room() > 0 and not self._full():
            subdir = self.ns.find(entries[family.next][1])
            family.next += 1
            if subdir is not None and subdir.is_dir and subdir.inode not in self._dirs:  # (one the reader opened has a walk of its own)
                family.ahead.add(subdir.inode)
                self.dirs_ahead += 1
                self._nursery.start_soon(self._walk_ahead, subdir)

    async def _walk_ahead(self, node: Node) -> None:
        try:
            await self.ns.list_if_one_page(node)  # (a bigger one is walked when the reader opens a file of it)
        except Exception as exc:  # noqa: BLE001 - a guess that failed costs nothing: the reader lists it if it comes
            log.debug("walk ahead: listing %s failed: %s", node.path, exc)
            return
        state = self._state_of(node)
        if state is not None:
            self._issue(state)

    def _full(self) -> bool:
        """Is as much read ahead, unread, as the walk may hold?"""
        return self.cache.transient_bytes + self.ahead_elsewhere() >= self.budget

    def _issue(self, state: _DirState) -> None:
        passed_over = 0
        while state.next < len(state.files) and state.room() > 0:
            if self._full():
                return
            if state.next in state.opened_ahead:  # passed over as if issued (the room the walk takes is unchanged)
                state.opened_ahead.discard(state.next)
                state.next += 1
                continue
            info = state.files[state.next]
            if self.read_by_kernel(info):  # passed over as if issued: nothing of it reaches this process
                state.next += 1
                passed_over += 1
                if passed_over >= PASSED_OVER_AT_ONCE:
                    return  # (the next open goes on: a folder held whole never stalls the loop at once)
                continue
            if not self.fetcher.prefetch(info, 0):
                return
            state.next += 1
            self.issued += 1
