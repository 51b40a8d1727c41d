"""The namespace: directories and files of a bucket/prefix, from LIST with a delimiter.

Directories come from common prefixes, file sizes and ETags from the listing, so listing a
directory sends no HEAD per file. Results are cached for `ttl` seconds. A name looked up in a
directory that was never listed costs one LIST: of the directory's first page, which is the whole
directory when it holds up to a page of names (1,000 on S3); else of the names starting with the one
looked up (the object and the prefix `name/` in one answer). At the next lookup in the same
directory it is listed whole.

Keys that are not valid POSIX names are skipped, deterministically (see `valid_name`), and a key
that is both an object and a prefix ("a" and "a/b") shows as the directory; the object is hidden.

Entries are bounded: the kernel's lookup count is kept per inode (`remember`, `forget`), and an entry
the kernel no longer references is dropped once its directory's listing is older than the TTL or no
longer holds it (`sweep`); looking it up again lists or resolves it afresh, under a new inode number.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable, Iterator

import trio

from ..messages import PathNews
from ..metrics import MountMetrics
from .registry import Registry, derived_inode
from ..store.objects import Listing, ObjectInfo, ObjectStore
from ..store.errors import NotFound, StoreError

log = logging.getLogger(__name__)


class InodeCollision(StoreError):
    """Two paths of a mount served by several workers derive one inode number: the later is refused (EIO, logged),
    never answered as the other (64 bits: about once in 10**7 mounts of a million names; registry.derived_inode)."""

    kind = "inode_collision"

ROOT_INODE = 1
MAX_NAME_BYTES = 255
LIST_AFTER_LOOKUPS = 1  # targeted lookups in one directory before it is listed whole


def valid_name(name: str) -> bool:
    """A path segment the kernel accepts: not empty, '.', '..'; no NUL or '/'; at most 255 bytes."""
    return (
        name not in ("", ".", "..")
        and "\0" not in name
        and "/" not in name
        and len(name.encode("utf-8", "surrogateescape")) <= MAX_NAME_BYTES
    )


@dataclass(slots=True)
class Node:
    inode: int
    path: str  # relative to the mount root; '' for the root
    is_dir: bool
    info: ObjectInfo | None = None  # files only
    children: dict[str, int] = field(default_factory=dict)  # dirs: name -> inode
    listed_at: float = -math.inf  # dirs: when the whole directory was last listed
    checked_at: float = -math.inf  # when this node was last confirmed by the store
    lookups_since_list: int = 0
    entries: list[tuple[str, int]] | None = None  # dirs: children sorted by name, kept until they change
    refs: int = 0  # the kernel's lookup count: while above 0 the inode number must stay valid
    cached_etag: str | None = None  # files: the version the kernel's page cache may hold (keep_cache)
    writing: bool = False  # files: being written by this mount (not in the bucket until closed)
    made: bool = False  # dirs: made here (mkdir): kept while the bucket has no object under it

    def sorted_children(self) -> list[tuple[str, int]]:
        """The children in name order, sorted once per change (readdir pages index into it)."""
        if self.entries is None:
            self.entries = sorted(self.children.items())
        return self.entries

    def set_child(self, name: str, inode: int | None) -> None:
        if inode is None:
            if self.children.pop(name, None) is not None:
                self.entries = None
        elif self.children.get(name) != inode:
            self.children[name] = inode
            self.entries = None

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


class Namespace:
    def __init__(self, store: ObjectStore, prefix: str, ttl: float, metrics: MountMetrics, *,
                 run_sync: Callable[..., Awaitable] | None = None, clock: Callable[[], float] = time.monotonic,
                 registry: Registry | None = None):
        self.store = store
        # Several workers (registry.py): inode numbers derived from paths, and named in the registry for the others
        self.registry = registry
        self.prefix = prefix
        self.ttl = ttl
        self.metrics = metrics
        self._clock = clock
        self._limiter = trio.CapacityLimiter(16)
        self._run_sync = run_sync or (lambda fn, *a: trio.to_thread.run_sync(fn, *a, limiter=self._limiter))
        self._nodes: dict[int, Node] = {ROOT_INODE: Node(ROOT_INODE, "", True)}
        self._by_path: dict[str, int] = {"": ROOT_INODE}
        self._next_inode = ROOT_INODE + 1
        self._listing: dict[int, trio.Event] = {}
        self._unreferenced: set[int] = set()  # every inode with refs == 0 (the root aside): sweep candidates
        self._learned_writing: set[int] = set()  # a worker's: files the hub's news said are being written
        self._swept_at = clock()
        self.skipped_names = 0
        self.mount_time = time.time()

    # ---- queries -------------------------------------------------------------------------
    def node(self, inode: int) -> Node:
        try:
            return self._nodes[inode]
        except KeyError:
            raise NotFound(f"inode {inode} is unknown") from None

    def find(self, inode: int) -> Node | None:
        return self._nodes.get(inode)

    def parent_of(self, node: Node) -> Node | None:
        if not node.path:
            return None
        parent_path = node.path.rsplit("/", 1)[0] if "/" in node.path else ""
        inode = self._by_path.get(parent_path)
        return self._nodes.get(inode) if inode is not None else None

    def listed_files(self, node: Node) -> list[ObjectInfo] | None:
        """Files of a directory in listing order, or None unless a fresh listing is at hand."""
        if not node.is_dir or not self._fresh(node.listed_at):
            return None
        nodes = (self._nodes[inode] for _, inode in node.sorted_children())
        return [n.info for n in nodes if not n.is_dir and n.info is not None]

    def listed_entries(self, node: Node) -> list[tuple[str, int]] | None:
        """A directory's (name, inode) pairs in name order (the list readdir pages from: not copied), or None unless
        a fresh listing is at hand."""
        if not node.is_dir or not self._fresh(node.listed_at):
            return None
        return node.sorted_children()

    @property
    def entries(self) -> int:
        """Nodes held in memory (the root included)."""
        return len(self._nodes)

    # ---- the kernel's references ---------------------------------------------------------
    def remember(self, node: Node) -> None:
        """The kernel got this inode in a reply (lookup, readdirplus entry): one more reference. With several workers
        its path is in the registry before the reply goes (the next request may reach another worker), and the
        kernel's references are not counted (a FORGET may reach another worker than the LOOKUP did; any worker can
        look a swept inode up again by its path)."""
        if self.registry is not None:
            if not self.registry.name_inode(node.inode, node.path, node.is_dir):
                raise InodeCollision(f"{node.path}: its inode number {node.inode} names another path in this mount")
            return
        node.refs += 1
        self._unreferenced.discard(node.inode)

    def forget(self, inode: int, count: int) -> None:
        """The kernel dropped `count` references (the entry may go at the next sweep)."""
        node = self._nodes.get(inode)
        if node is not None and inode != ROOT_INODE:
            node.refs = max(0, node.refs - count)
            if node.refs == 0:
                self._unreferenced.add(inode)

    def sweep(self, *, force: bool = False) -> list[int]:
        """Drop unreferenced entries whose directory listing expired or no longer holds them (at most once
        per TTL unless forced: entries of a fresh listing are what spares the store a LIST)."""
        now = self._clock()
        if not force and now - self._swept_at < min(self.ttl, 60.0):
            return []
        self._swept_at = now
        dropped = []
        for inode in list(self._unreferenced):
            node = self._nodes.get(inode)
            if node is None or node.refs > 0 or inode == ROOT_INODE:
                self._unreferenced.discard(inode)
            elif self._droppable(node):
                self._drop(node)
                dropped.append(inode)
        return dropped

    def _droppable(self, node: Node) -> bool:
        if node.is_dir and node.children:
            return False  # its children go first; the directory follows at a later sweep
        if node.writing or (node.made and self.registry is not None):
            return False  # (not in the bucket yet; with several workers the kernel's references are not counted)
        parent = self.parent_of(node)
        return parent is None or parent.children.get(node.name) != node.inode or not self._fresh(parent.listed_at)

    def _drop(self, node: Node) -> None:
        parent = self.parent_of(node)
        if parent is not None and parent.children.get(node.name) == node.inode:
            parent.set_child(node.name, None)  # (its listing has expired: the next access lists it again)
        del self._nodes[node.inode]
        if self._by_path.get(node.path) == node.inode:
            del self._by_path[node.path]
        self._unreferenced.discard(node.inode)

    def key_of(self, node: Node) -> str:
        return self.prefix + node.path

    def _fresh(self, stamp: float) -> bool:
        return self._clock() - stamp < self.ttl

    async def resolve(self, inode: int) -> Node:
        """The node of an inode number the kernel holds: this worker's, or (with several workers) one another
        worker named, looked up here by its path; NotFound if it names nothing now."""
        node = self._nodes.get(inode)
        if self.registry is None:
            return node if node is not None else self.node(inode)
        if node is not None and (inode == ROOT_INODE or self.registry.named(inode)):
            return await self._current(node)
        named = self.registry.inode_path(inode)
        if named is None:
            raise NotFound(f"inode {inode} is unknown")
        path, is_dir = named
        if node is not None:
            if (node.path, node.is_dir) != named:
                raise InodeCollision(f"inode {inode} names {path!r} here and {node.path!r} in this worker")
            self.registry.checked(inode)
            return node
        node = self._nodes[ROOT_INODE]
        for name in path.split("/") if path else ():
            node = await self.lookup(node.inode, name)
        if node.inode != inode:  # the path is now the other kind (a file became a directory)
            raise NotFound(f"inode {inode} ({path}) is gone")
        self.registry.checked(inode)
        return node

    async def _current(self, node: Node) -> Node:
        """(Several workers.) A file as the store has it now: the kernel's LOOKUP that saw it change may have gone to
        another worker, and an OPEN by inode number comes here with no lookup at all. So a file this worker has not
        confirmed within the TTL (nor listed its directory) is looked up again, as that LOOKUP was: never a changed
        object's old version past the TTL (with a disk tier, its old bytes are still held)."""
        if node.is_dir or node.writing or self._fresh(node.checked_at):
            return node
        parent = self.parent_of(node)
        if parent is None or self._fresh(parent.listed_at):
            return node
        return await self.lookup(parent.inode, node.path.rsplit("/", 1)[-1])

    async def lookup(self, parent_inode: int, name: str) -> Node:
        """The child `name` of a directory, or NotFound."""
        self.sweep()
        parent = await self.resolve(parent_inode)
        if not parent.is_dir or not valid_name(name):
            raise NotFound(name)
        if self._fresh(parent.listed_at):
            return self._child(parent, name)
        inode = parent.children.get(name)
        if inode is not None and self._fresh(self._nodes[inode].checked_at):
            return self._nodes[inode]
        if parent.listed_at > -math.inf or parent.lookups_since_list >= LIST_AFTER_LOOKUPS:
            await self.ensure_listed(parent)
            return self._child(parent, name)
        parent.lookups_since_list += 1
        page = await self._first_page(parent)
        if page is None:  # it was the whole directory, now listed
            return self._child(parent, name)
        return await self._resolve(parent, name, page)

    async def readdir(self, inode: int) -> list[tuple[str, int]]:
        """The directory's (name, inode) pairs in name order; the same list until the directory changes,
        so that each readdir page costs its own entries only (no re-sort, no copy)."""
        self.sweep()
        node = await self.resolve(inode)
        if not node.is_dir:
            raise NotFound(node.path)
        await self.ensure_listed(node)
        return node.sorted_children()

    def _child(self, parent: Node, name: str) -> Node:
        inode = parent.children.get(name)
        if inode is None:
            raise NotFound(name)
        return self._nodes[inode]

    # ---- store access --------------------------------------------------------------------
    async def ensure_listed(self, node: Node) -> None:
        """List a directory if its listing is missing or older than the TTL (one LIST at a time)."""
        while not self._fresh(node.listed_at):
            if await self._wait_for_listing(node):
                continue
            with self._listing_of(node):
                self._apply_listing(node, await self._run_sync(self._list_pages, self._dir_prefix(node)))
            return  # (listed once, even where a TTL of 0 never counts a listing as fresh)

    async def list_if_one_page(self, node: Node) -> None:
        """List a directory if it fits in one LIST page: one request whatever its size (a guess, such as the walk's
        ahead of a reader, must not list a huge directory page by page). It may be left unlisted."""
        if not self._fresh(node.listed_at):
            await self._first_page(node)

    async def _first_page(self, node: Node) -> Listing | None:
        """One LIST of a directory never listed: None once it was the whole directory (now listed), else
        that first page (the directory's first names in order; empty if another lookup asked meanwhile)."""
        if await self._wait_for_listing(node):
            return None if self._fresh(node.listed_at) else Listing(truncated=True)
        with self._listing_of(node):
            self.metrics.list_requests.inc()
            page = await self._run_sync(self.store.probe, self._dir_prefix(node))
            if page.truncated:
                return page
            self._apply_listing(node, [page])
        return None

    async def _wait_for_listing(self, node: Node) -> bool:
        """Wait for a listing of `node` already under way, if there is one (True)."""
        event = self._listing.get(node.inode)
        if event is None:
            return False
        await event.wait()
        return True

    @contextlib.contextmanager
    def _listing_of(self, node: Node) -> Iterator[None]:
        """Other lookups of `node` wait for this listing instead of sending their own."""
        event = self._listing[node.inode] = trio.Event()
        try:
            yield
        finally:
            del self._listing[node.inode]
            event.set()

    def _dir_prefix(self, node: Node) -> str:
        return self.prefix + (node.path + "/" if node.path else "")

    def _list_pages(self, prefix: str) -> list[Listing]:
        pages = []
        for page in self.store.list_dir(prefix):
            self.metrics.list_requests.inc()
            pages.append(page)
        if not pages:
            self.metrics.list_requests.inc()
        return pages

    def _apply_listing(self, node: Node, pages: Iterable[Listing]) -> None:
        base = self.prefix + (node.path + "/" if node.path else "")
        now = self._clock()
        files: dict[str, ObjectInfo] = {}
        dirs: set[str] = set()
        for page in pages:
            for info in page.files:
                name = info.key[len(base):]
                if valid_name(name):
                    files[name] = info
                elif name:  # '' is the directory's own marker object
                    self.skipped_names += 1
            for prefix in page.dirs:
                name = prefix[len(base):-1]
                if valid_name(name):
                    dirs.add(name)
                else:
                    self.skipped_names += 1
        children: dict[str, int] = {}
        for name in dirs:
            child = self._upsert(_join(node.path, name), True, None, now)
            child.made = False  # (if it was made here: the bucket has it now, so it is neither kept nor told of)
            children[name] = child.inode
        for name, info in files.items():
            if name not in dirs:
                children[name] = self._upsert(_join(node.path, name), False, info, now).inode
        for name, inode in node.children.items():  # what this mount writes or made is not in the bucket yet
            kept = self._nodes.get(inode)
            if name not in children and kept is not None and (kept.writing or kept.made):
                children[name] = inode
        node.children = children
        node.entries = None
        node.listed_at = node.checked_at = now
        node.lookups_since_list = 0

    async def _resolve(self, parent: Node, name: str, first: Listing | None = None) -> Node:
        """Is `name` an object, a prefix, or neither? The directory's first page answers when the name
        sorts inside it; else one LIST of the keys that start with it answers both (a second, one-key
        LIST only when that page ended before `name/` would sort)."""
        path = _join(parent.path, name)
        key = self.prefix + path
        if first is not None and _reaches(first, key + "/"):
            page = first  # it holds every name of the directory up to past `name/`
        else:
            self.metrics.list_requests.inc()
            page = await self._run_sync(self.store.probe, key)
        is_dir = key + "/" in page.dirs
        if not is_dir and page.truncated and not _reaches(page, key + "/"):
            self.metrics.list_requests.inc()
            is_dir = await self._run_sync(self.store.has_prefix, key + "/")
        info = next((f for f in page.files if f.key == key), None)  # (the first key of its page, if there)
        now = self._clock()
        if is_dir:
            node = self._upsert(path, True, None, now)
        elif info is not None:
            node = self._upsert(path, False, info, now)
        else:
            parent.set_child(name, None)
            raise NotFound(path)
        parent.set_child(name, node.inode)
        return node

    def _known(self, path: str, is_dir: bool) -> Node | None:
        """The node this namespace holds at `path` (unlinked since, maybe), where it is of that kind."""
        inode = self._by_path.get(path)
        node = self._nodes.get(inode) if inode is not None else None
        return node if node is not None and node.is_dir == is_dir else None

    def _upsert(self, path: str, is_dir: bool, info: ObjectInfo | None, now: float) -> Node:
        node = self._known(path, is_dir)
        if node is None:
            inode = self._new_inode(path, is_dir)
            node = Node(inode, path, is_dir)
            self._nodes[inode] = node
            self._by_path[path] = inode
            self._unreferenced.add(inode)  # until the kernel is told about it
        if not is_dir:
            node.info = info
        node.checked_at = now
        return node

    def same_version(self, node: Node) -> bool:
        """Is this open of a file of the version the kernel may hold pages of (the last open's)? Then it may keep
        them (keep_cache)."""
        assert node.info is not None
        etag = node.info.etag
        if self.registry is not None:
            return self.registry.reopened(node.inode, etag)
        same, node.cached_etag = node.cached_etag == etag, etag
        return same

    def _new_inode(self, path: str, is_dir: bool) -> int:
        if self.registry is None:
            inode = self._next_inode
            self._next_inode += 1
            return inode
        inode = derived_inode(path, is_dir)
        other = self._nodes.get(inode)
        if other is not None and other.path != path:  # (InodeCollision: the registry refuses the later one)
            log.error("inode %d is derived from both %r and %r: %r now shows as the latter", inode, other.path, path,
                      other.path)
        return inode

    # ---- what this mount writes (read/writer.py): seen here at once, by others after their TTL --------------------
    def add_file(self, parent: Node, name: str, info: ObjectInfo) -> Node:
        """A file being written (or just written) in `parent`: listed here from now on."""
        node = self._upsert(_join(parent.path, name), False, info, self._clock())
        parent.set_child(name, node.inode)
        return node

    def file_inode(self, parent: Node, name: str) -> int | None:
        """The inode number a file at `name` in `parent` would have if added now (add_file), where the kernel may hold
        it already: a file known here before (unlinked since, maybe), or a number derived from the path; None: a new
        number."""
        path = _join(parent.path, name)
        node = self._known(path, False)
        if node is not None:
            return node.inode
        return derived_inode(path, False) if self.registry is not None else None

    def add_dir(self, parent: Node, name: str) -> Node:
        """A directory made here (mkdir): it exists in the bucket once a file is written in it (S3 has prefixes, not
        directories), and until then for as long as this mount's listing of its parent is fresh."""
        node = self._upsert(_join(parent.path, name), True, None, self._clock())
        node.listed_at = self._clock()  # (empty, and known to be)
        node.made = True
        parent.set_child(name, node.inode)
        return node

    def remove(self, parent: Node, name: str) -> None:
        parent.set_child(name, None)

    # ---- a writable mount with several workers: the hub writes, and tells every worker (fuse/relay.py) ----------
    def news_of(self, path: str) -> PathNews:
        """The state of `path` here (the hub's), for the workers."""
        inode = self._by_path.get(path)
        node = self._nodes.get(inode) if inode is not None else None
        parent = self.parent_of(node) if node is not None else None
        if node is None or parent is None or parent.children.get(node.name) != node.inode:
            return PathNews(path, "gone")
        if node.is_dir:
            return PathNews(path, "dir")
        assert node.info is not None
        return PathNews(path, "file", node.info.key, node.info.size, node.info.etag, node.info.mtime, node.writing)

    def written_here(self) -> list[PathNews]:
        """The hub's whole view for its workers: every file being written and every directory made here."""
        return [self.news_of(node.path) for node in list(self._nodes.values())
                if node.path and (node.writing or node.made)]

    def learn_whole(self, news: list[PathNews]) -> None:
        """The hub's whole view: learned, and a file this worker still takes for being written that the view does not
        name is not (its news was missed): it is looked up again at its next use."""
        named = {n.path for n in news}
        for one in news:
            self.learn(one)
        for inode in list(self._learned_writing):
            node = self._nodes.get(inode)
            self._learned_writing.discard(inode)
            if node is None or not node.writing:
                continue
            if node.path in named:
                self._learned_writing.add(inode)
            else:
                node.writing = False
                node.checked_at = -math.inf
                parent = self.parent_of(node)
                if parent is not None:
                    parent.listed_at = -math.inf

    def learn(self, news: PathNews) -> None:
        """What the hub wrote, seen here at once: a file being written (opened here it is busy) or written, one gone, a
        directory made. The directories on its way are known from then on (they exist: the hub has them)."""
        names = news.path.split("/")
        if not news.path or not all(map(valid_name, names)) or (news.kind == "file" and news.key != self.prefix
                                                                     + news.path):
            log.warning("news of %r (%s, key %r) ignored: not a path of this mount", news.path, news.kind, news.key)
            return
        parent = self._nodes[ROOT_INODE]
        for depth, name in enumerate(names[:-1], 1):
            inode = parent.children.get(name)
            child = self._nodes.get(inode) if inode is not None else None
            if child is None or not child.is_dir:
                if news.kind == "gone":
                    return  # (nothing known here to remove)
                child = self._upsert("/".join(names[:depth]), True, None, self._clock())
                child.made = True  # (kept as a directory made here is, until the bucket has it)
                parent.set_child(name, child.inode)
            parent = child
        name = names[-1]
        if news.kind == "gone":
            gone = parent.children.get(name)
            self.remove(parent, name)
            if gone is not None and gone in self._nodes:
                self._nodes[gone].writing = False
        elif news.kind == "dir":
            if parent.children.get(name) is None:
                self.add_dir(parent, name)
        else:
            node = self.add_file(parent, name, ObjectInfo(news.key, news.size, news.etag, news.mtime))
            node.writing = news.writing
            if node.writing:
                self._learned_writing.add(node.inode)  # (what a whole view may have to take back)

    async def object_at(self, key: str) -> ObjectInfo | None:
        """The object `key` as this mount lists it (each directory on its way looked up as a reader's open would),
        or None where it lists no such object: what a member's ask is checked against (its size, its ETag)."""
        if not key.startswith(self.prefix):
            return None
        node = self._nodes[ROOT_INODE]
        for name in key[len(self.prefix):].split("/"):
            try:
                node = await self.lookup(node.inode, name)
            except NotFound:
                return None
        return None if node.is_dir else node.info

    async def walk_files(self, path: str) -> list[ObjectInfo]:
        """Every object under a relative path (a file or a directory), for warming."""
        path = path.strip("/")
        key = self.prefix + path
        if path:
            info = await self._run_sync(self.store.head, key)
            if info is not None:
                return [info]
        listed = await self._run_sync(lambda: list(self.store.list_all(key + "/" if path else self.prefix)))
        self.metrics.list_requests.inc()
        return [i for i in listed if all(valid_name(seg) for seg in i.key[len(self.prefix):].split("/"))]


def _reaches(page: Listing, mark: str) -> bool:
    """Does the page hold a name that sorts at or after `mark`? (S3 sorts by UTF-8 bytes, which is code point
    order: Python's string order.)"""
    return any(d >= mark for d in page.dirs) or any(f.key >= mark for f in page.files)


def _join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name
