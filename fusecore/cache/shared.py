"""The blocks a mount's worker processes share (`--workers N`): one file per whole block in a folder on tmpfs.

Any worker reads any block without a hop to another process (`load`); a block is fetched once per mount whichever
worker asked (`try_claim`: an flock'ed file per block being fetched, which the kernel releases if its worker dies);
the worker that fetched it publishes it whole (`publish`: written into that claim's file, then renamed into place, so
a block file is always complete); and what stays is decided in one place, the hub (`SharedPolicy`), which every worker
tells of the blocks it published and read (datagrams on the hub's socket) and which evicts by unlinking. A file
unlinked while a worker reads it stays readable to that worker: eviction never tears a read.

A block is named by bucket-relative key, ETag and index (design §7): a changed object's blocks have other names.
Pure file operations: no event loop, no store.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import logging
import os
import mmap
import socket
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator

from .blocks import BlockKey

log = logging.getLogger(__name__)

BLOCKS, CLAIMS, HUB_SOCKET = "blocks", "claims", "hub.sock"
MARKS = "marks"  # a file the hub makes for each worker's mark once it has taken the news sent before it (mark)
DISK_QUEUE = "disk-queue"  # the bytes the hub's disk tier has queued for writing (a little-endian u64)
AHEAD = "ahead"  # the bytes of blocks published as read-ahead that no worker has read since (likewise)
_QUEUED = struct.Struct("<Q")
TRUSTED = "trusted"  # the disk tier's files some process of the mount wrote or checked (TrustTable)
TRUST_SLOTS = 1 << 16
_TRUST = struct.Struct("<QQ")  # a file name's tag, its stamp
NEWS_BATCH = 8192  # bytes of news a worker gathers before it sends them to the hub (and at least every FLUSH_EVERY s)
FLUSH_EVERY = 0.05
FLUSH_PUBLISHED = 4 * 1024 * 1024  # bytes published whose news a worker sends at once: the hub evicts for them (the
# shared folder outgrew its budget by up to ~20 MiB in a stream's bursts while the news waited for FLUSH_EVERY)
PROTECTED_FRACTION = 0.8  # of the budget, for blocks read again (SharedPolicy)
AHEAD_FRACTION = 0.5  # of the budget, at most, kept for blocks read ahead and unread past older blocks (SharedPolicy)


@functools.lru_cache(maxsize=4096)
def block_name(key: BlockKey) -> str:
    """A block's file name (a block's path comes up ~6 times in its fetch and its reads: hashed once)."""
    digest = hashlib.blake2b(f"{key.key}\0{key.etag}\0{key.index}".encode("utf-8", "surrogateescape"),
                             digest_size=16)
    return digest.hexdigest()


def prepare(root: str) -> None:
    """The shared folder's layout, private to the mount's user (the hub makes it before starting workers)."""
    os.makedirs(root, mode=0o700, exist_ok=True)
    for sub in (BLOCKS, CLAIMS, MARKS):
        os.makedirs(os.path.join(root, sub), mode=0o700, exist_ok=True)
    for counter in (DISK_QUEUE, AHEAD):
        with open(os.path.join(root, counter), "wb") as f:
            f.write(_QUEUED.pack(0))
    filled(os.path.join(root, TRUSTED), TRUST_SLOTS * _TRUST.size)


def filled(path: str, size: int) -> None:
    """A file of `size` zero bytes written (not truncated to it: a page of a sparse file on tmpfs takes its memory at
    its first touch through a mapping, and on a full tmpfs that touch kills the process with SIGBUS; written now,
    while the folder is new, a full tmpfs fails the mount's start instead)."""
    with open(path, "wb") as f:
        f.write(bytes(size))


class TrustTable:
    """The disk tier's files that a process of the mount wrote or checked, and their stamps then (disk.py's
    `_trust`), seen by every worker: a file one worker checked, or the hub wrote, is handed to the kernel by any
    other without reading it again. A slot per file name's hash (1 MiB for 65,536): a name that lands on another's
    slot pushes it out (that file is checked again at its next open), and a stamp read half-written matches no file
    (checked again too). A stamp moves with any change of the file (disk.py's `_stamp`), so an entry never vouches
    for other bytes."""

    def __init__(self, root: str):
        fd = os.open(os.path.join(root, TRUSTED), os.O_RDWR | os.O_CLOEXEC)
        try:
            self._table = mmap.mmap(fd, TRUST_SLOTS * _TRUST.size)
        finally:
            os.close(fd)

    @staticmethod
    def _slot(name: str) -> tuple[int, int]:
        return (int(name[:8], 16) % TRUST_SLOTS) * _TRUST.size, int(name[8:24], 16)

    def note(self, name: str, stamp: int) -> None:
        where, tag = self._slot(name)
        _TRUST.pack_into(self._table, where, tag, stamp & 0xFFFFFFFFFFFFFFFF)

    def holds(self, name: str, stamp: int) -> bool:
        where, tag = self._slot(name)
        return _TRUST.unpack_from(self._table, where) == (tag, stamp & 0xFFFFFFFFFFFFFFFF)

    def forget(self, name: str) -> None:
        """The file is gone (evicted, damaged): its slot vouches for nothing."""
        where, tag = self._slot(name)
        if _TRUST.unpack_from(self._table, where)[0] == tag:
            _TRUST.pack_into(self._table, where, 0, 0)


def counter_mirror(root: str, counter: str) -> Callable[[int], None]:
    """What the hub calls with a count every worker reads (`SharedBlocks._count`): its disk tier's queued bytes
    (DISK_QUEUE: DiskTier's queue_mirror), or the bytes read ahead and unread (AHEAD)."""
    table = _mapped(os.path.join(root, counter))

    def mirror(queued: int) -> None:
        _QUEUED.pack_into(table, 0, queued)

    return mirror


def _mapped(path: str) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        return mmap.mmap(fd, _QUEUED.size)
    finally:
        os.close(fd)


class Claim:
    """This worker fetches a block: others wait for its file. The claim's file is where the block is written, and
    renaming it into place publishes the block and ends the claim at once (`SharedBlocks.publish`). Released
    (closed; removed unless published) once published or failed; the kernel releases the lock of a worker that
    died, and a waiter then claims it itself (writing over what the dead worker wrote)."""

    __slots__ = ("key", "fd", "path", "published")

    def __init__(self, key: BlockKey, fd: int, path: str):
        self.key, self.fd, self.path = key, fd, path
        self.published = False

    def release(self) -> None:
        if self.fd < 0:
            return
        if not self.published:
            _unlink(self.path)
        os.close(self.fd)  # (closing drops the lock)
        self.fd = -1


@dataclass
class SharedStats:
    loaded: int = 0  # blocks read from another worker's file
    loaded_bytes: int = 0
    reads: int = 0  # reads answered from a block file directly (part of a block, not copied whole)
    backing: int = 0  # block files handed to the kernel to read itself (passthrough opens)
    published: int = 0
    waits: int = 0  # a block another worker was fetching, waited for
    takeovers: int = 0  # a claim whose worker died or failed, claimed again
    dropped_events: int = 0  # news the hub's socket had no room for (its rescan finds the files)


class SharedBlocks:
    """One worker's view of the shared blocks."""

    def __init__(self, root: str):
        self.root = root
        self._blocks = os.path.join(root, BLOCKS)
        self._claims = os.path.join(root, CLAIMS)
        self._hub = os.path.join(root, HUB_SOCKET)
        self._events = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        self._news: list[bytes] = []
        self._news_bytes = 0
        self._news_lock = threading.Lock()  # news come from the loop and from threads (disk reads, publishes)
        self._kept_unsent = 0  # bytes of blocks given to the hub's disk tier in news not sent yet
        self._published_unsent = 0  # bytes of blocks published in news not sent yet
        self._counters: dict[str, mmap.mmap] = {}  # the hub's counts (counter_mirror), mapped at their first read
        self._marks = 0
        self.stats = SharedStats()

    def path(self, key: BlockKey) -> str:
        return os.path.join(self._blocks, block_name(key))

    def holds(self, key: BlockKey) -> bool:
        return os.path.exists(self.path(key))

    def coming(self, key: BlockKey) -> bool:
        """Is the block held, or being fetched by some worker (its claim is there)? A read-ahead then leaves it."""
        name = block_name(key)
        return os.path.exists(os.path.join(self._blocks, name)) or os.path.exists(os.path.join(self._claims, name))

    def _opened(self, key: BlockKey, size: int, remove: bool = True) -> int | None:
        """A descriptor of the block's file, if a worker published it at exactly `size` bytes (a file of any other
        length is never served, and is removed unless `remove` is False: a size another node asked with)."""
        path = os.path.join(self._blocks, block_name(key))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        length = os.fstat(fd).st_size
        if length != size:
            os.close(fd)
            if remove:
                log.warning("shared block %s of %s has %d bytes, not %d: removed", key.index, key.key, length, size)
                _unlink(path)
            return None
        return fd

    def load(self, key: BlockKey, size: int, into: bytearray | mmap.mmap | None = None) -> bytearray | mmap.mmap | None:
        """The whole block's bytes (into `into`, or a new buffer) if a worker published it, else None."""
        fd = self._opened(key, size)
        if fd is None:
            return None
        try:
            buffer = into if into is not None else bytearray(size)
            view = memoryview(buffer)[:size]
            got = 0
            while got < size:
                n = os.preadv(fd, [view[got:]], got)
                if n <= 0:
                    return None
                got += n
        finally:
            os.close(fd)
        self.stats.loaded += 1
        self.stats.loaded_bytes += size
        self._tell(b"hit " + block_name(key).encode())
        return buffer

    def read(self, key: BlockKey, size: int, start: int, stop: int, asked: bool = False) -> bytes | None:
        """Bytes [start, stop) of a published block of `size` bytes, read from its file (a reader's read of part of
        a block: no copy of the rest of it), or None where no worker published it. A read from the block's start
        counts as a hit for the hub's policy (once per pass over the block, not once per read of it). `asked`: for
        another node, whose `size` is its own say: a file of another length is left as it is."""
        fd = self._opened(key, size, remove=not asked)
        if fd is None:
            return None
        try:
            data = os.pread(fd, stop - start, start)
        finally:
            os.close(fd)
        if len(data) != stop - start:
            return None
        self.stats.reads += 1
        if start == 0:
            self._tell(b"hit " + block_name(key).encode())
        return data

    def open_whole(self, key: BlockKey, size: int) -> int | None:
        """A descriptor of a published block of `size` bytes for the kernel to read itself (a passthrough open's
        backing file), or None; a hit for the hub's policy. The kernel keeps the file while the open lives, so an
        eviction meanwhile tears nothing (its memory is freed at the last close)."""
        fd = self._opened(key, size)
        if fd is not None:
            self.stats.backing += 1
            self._tell(b"hit " + block_name(key).encode())
        return fd

    def touch(self, key: BlockKey, size: int) -> bool:
        """Is the block published at `size` bytes? If so it counts as read for the hub's policy (a warm's wish to
        keep it), and nothing is copied (a file of another length is removed, as a load removes it)."""
        fd = self._opened(key, size)
        if fd is None:
            return False
        os.close(fd)
        self._tell(b"hit " + block_name(key).encode())
        return True

    def let_go(self, key: BlockKey) -> None:
        """The hub evicts this block (one handed over to its new owner on another node)."""
        self._tell(b"drop " + block_name(key).encode())

    def being_fetched(self, key: BlockKey) -> bool:
        """Does a live worker hold the block's claim now (a claim whose worker died is held by no one)?"""
        try:
            fd = os.open(os.path.join(self._claims, block_name(key)), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def try_claim(self, key: BlockKey) -> Claim | None:
        """The right to fetch `key` (None: another worker is fetching it now)."""
        path = os.path.join(self._claims, block_name(key))
        for _ in range(3):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                mine = _locked_current(fd, path)
                if mine is not None:
                    if mine.st_size:  # (bytes of a worker that died writing them)
                        os.ftruncate(fd, 0)
                    return Claim(key, fd, path)
            except BlockingIOError:
                os.close(fd)
                return None
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # a claim file its worker removed between our open and our lock: open the current one
        return None

    def publish(self, claim: Claim, data: bytes | bytearray | memoryview | mmap.mmap, keep: str = "",
                ahead: bool = False) -> bool:
        """Make a fetched block readable by every worker: written into its claim's file, which is renamed into place
        (so a block file is always whole, and the claim ends with it). False where the folder had no room (the block
        stays this worker's own). `keep`: the name the hub's disk tier keeps it under (the hub writes it from this
        file: diskview.py); `ahead`: read ahead, no reader has it yet (`ahead_bytes`)."""
        name = block_name(claim.key)
        try:
            view = memoryview(data)
            done = 0
            while done < len(view):
                done += os.pwrite(claim.fd, view[done:], done)
            os.rename(claim.path, os.path.join(self._blocks, name))
        except OSError as exc:  # a full tmpfs: the block stays this worker's only (its claim's file is removed)
            if exc.errno not in (errno.ENOSPC, errno.ENOENT):
                raise
            log.debug("shared block %s not published: %s", name, exc.strerror)
            return False
        claim.published = True
        self.stats.published += 1
        verb = b"ahead" if ahead else b"add"
        if keep:
            self._tell(b"%s %s %d %s" % (verb, name.encode(), len(data), keep.encode()), len(data), kept=len(data))
        else:
            self._tell(b"%s %s %d" % (verb, name.encode(), len(data)), len(data))
        return True

    def _tell(self, message: bytes, published: int = 0, kept: int = 0) -> None:
        """News for the hub, sent in batches (`flush`): a unix datagram socket queues few datagrams. `published`:
        bytes the message adds to the shared folder; `kept`: bytes it gives the hub's disk tier to write."""
        with self._news_lock:
            self._news.append(message)
            self._news_bytes += len(message) + 1
            self._published_unsent += published
            self._kept_unsent += kept
            full = self._news_bytes >= NEWS_BATCH or self._published_unsent >= FLUSH_PUBLISHED
        if full:
            self.flush()

    def tell(self, message: bytes) -> None:
        """News for the hub from another part of this worker (its disk tier's: diskview.py)."""
        self._tell(message)

    def disk_queued(self) -> int:
        """Bytes the hub's disk tier has still to write: what it queued, and what this worker's news not yet sent
        give it."""
        return self._count(DISK_QUEUE) + self._kept_unsent

    def ahead_bytes(self) -> int:
        """Bytes of blocks any worker published as read-ahead that no worker has read since (the hub's count, as
        of the news it has): with the bytes a worker's own cache holds ahead, what bounds its walk's reading ahead
        (a published block leaves that cache)."""
        return self._count(AHEAD)

    def _count(self, counter: str) -> int:
        table = self._counters.get(counter)
        if table is None:
            try:
                table = self._counters[counter] = _mapped(os.path.join(self.root, counter))
            except OSError:
                return 0
        return _QUEUED.unpack_from(table, 0)[0]

    def flush(self) -> None:
        with self._news_lock:
            if not self._news:
                return
            batch = b"\n".join(self._news)
            count = len(self._news)
            self._news.clear()
            self._news_bytes = self._published_unsent = self._kept_unsent = 0
        try:
            self._events.sendto(batch, self._hub)
        except (BlockingIOError, ConnectionRefusedError, FileNotFoundError):
            self.stats.dropped_events += count

    def mark(self) -> str | None:
        """Send the news gathered, then a mark; the path of the file the hub makes once it has taken everything this
        worker sent before the mark (datagrams on one socket are taken in order), or None where the mark could not
        be sent. What a worker waits on where it must know the hub has its news: the disk tier's queue counts the
        last blocks a warm gave it only once the hub took their news."""
        self._marks += 1
        token = f"{os.getpid()}-{self._marks}"
        self.flush()
        try:
            self._events.sendto(b"mark " + token.encode(), self._hub)
        except (BlockingIOError, ConnectionRefusedError, FileNotFoundError):
            return None
        return os.path.join(self.root, MARKS, token)

    @staticmethod
    def marked(path: str) -> bool:
        """Has the hub taken the mark at `path` (and so every news sent before it)? The file is removed."""
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False

    def close(self) -> None:
        self.flush()
        self._events.close()


def sweep_claims(root: str) -> int:
    """Remove the claim files no live worker holds, and say how many: a worker that died leaves its claims, with the
    bytes of a block it was writing into one, in memory the budget does not count. A claim is held from moments
    after its file is opened (try_claim); one swept between the two is found gone by its taker, which opens the
    current one. A dead worker's claim that a look (being_fetched) holds for that moment stays until the next sweep
    or until its block is claimed again (which writes over it)."""
    claims = os.path.join(root, CLAIMS)
    swept = 0
    for name in os.listdir(claims):
        path = os.path.join(claims, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if _locked_current(fd, path) is not None:
                _unlink(path)
                swept += 1
        except BlockingIOError:
            pass  # (a live worker's)
        finally:
            os.close(fd)
    return swept


def _locked_current(fd: int, path: str) -> os.stat_result | None:
    """Lock `fd`'s claim file for this process (BlockingIOError: a live process holds it); its stat where it is still
    the file at `path`, else None (its worker removed it between the open and the lock)."""
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    mine = os.fstat(fd)
    try:
        current = os.stat(path).st_ino
    except FileNotFoundError:
        return None
    return mine if mine.st_ino == current else None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class SharedPolicy:
    """What the shared blocks keep within one budget (the hub's, for every worker): a segmented LRU where a block
    read again (a hit) outranks one streamed once, whatever its size; the oldest block read once goes first. A block
    published as read-ahead (`admit(ahead=True)`) that no worker has read yet goes last, as a single process's cache
    keeps its staged blocks: evicted first, it would be fetched again by the reader it was fetched for (the walks
    bound how much is ahead: `ahead_bytes`); past AHEAD_FRACTION of the budget the oldest of them go first."""

    def __init__(self, budget: int):
        self.budget = budget
        self._probation: OrderedDict[str, int] = OrderedDict()
        self._protected: OrderedDict[str, int] = OrderedDict()
        self._ahead: OrderedDict[str, int] = OrderedDict()
        self._protected_bytes = 0
        self.ahead_bytes = 0
        self.bytes = 0
        self.evictions = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected) + len(self._ahead)

    def __contains__(self, name: str) -> bool:
        return name in self._probation or name in self._protected or name in self._ahead

    def admit(self, name: str, size: int, ahead: bool = False) -> list[str]:
        """A block was published: the blocks to evict now (the oldest read once first)."""
        if name not in self:
            if ahead:
                self._ahead[name] = size
                self.ahead_bytes += size
            else:
                self._probation[name] = size
            self.bytes += size
        return self._over()

    def hit(self, name: str) -> None:
        size = self._ahead.pop(name, None)
        if size is not None:  # read at last: from now on a block read once
            self.ahead_bytes -= size
            self._probation[name] = size
            return
        if name in self._protected:
            self._protected.move_to_end(name)
            return
        size = self._probation.pop(name, None)
        if size is None:
            return
        self.hits += 1
        self._protected[name] = size
        self._protected_bytes += size
        while self._protected_bytes > self.budget * PROTECTED_FRACTION and len(self._protected) > 1:
            old, old_size = self._protected.popitem(last=False)  # back to probation, newest there
            self._protected_bytes -= old_size
            self._probation[old] = old_size

    def forget(self, name: str) -> None:
        """The file is gone (removed by a worker as damaged, or missing at a rescan)."""
        size = self._probation.pop(name, None)
        if size is None:
            size = self._ahead.pop(name, None)
            if size is not None:
                self.ahead_bytes -= size
        if size is None:
            size = self._protected.pop(name, None)
            if size is None:
                return
            self._protected_bytes -= size
        self.bytes -= size

    def resize(self, budget: int) -> list[str]:
        self.budget = budget
        return self._over()

    def _over(self) -> list[str]:
        victims = []
        while self.bytes > self.budget and len(self):
            name, size = self._victim()
            self.bytes -= size
            self.evictions += 1
            victims.append(name)
        return victims

    def _victim(self) -> tuple[str, int]:
        """The next block to evict: one read ahead past AHEAD_FRACTION of the budget, else the oldest read once,
        else the oldest read again, else the oldest read ahead."""
        if self._ahead and self.ahead_bytes > self.budget * AHEAD_FRACTION:
            segment = self._ahead
        else:
            segment = next(s for s in (self._probation, self._protected, self._ahead) if s)
        name, size = segment.popitem(last=False)
        if segment is self._protected:
            self._protected_bytes -= size
        elif segment is self._ahead:
            self.ahead_bytes -= size
        return name, size

    def names(self) -> Iterator[str]:
        yield from self._probation
        yield from self._protected
        yield from self._ahead
