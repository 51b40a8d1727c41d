"""A node-local disk tier under the memory cache (design §7: memory -> disk -> peer -> store).

Blocks live as files under DIR/blocks, one per block, named by a digest of what names a block everywhere
(bucket, object key, ETag, index, block size): a changed object, or another block size, never finds old
bytes. A file holds the block's bytes from offset 0, and its header (magic, length, the name's digest, a checksum of
the bytes: CRC64-NVME) in an extended attribute, so that the kernel can read a file held whole itself (FUSE
passthrough, `open_whole`). Where DIR's filesystem takes no user xattrs, and in files of older versions, the header
is written before the bytes (SHA-256 in the oldest). A read checks all of it and drops the file on any mismatch
(counted, never served: the block is fetched again). A file handed to the kernel (`open_whole`) is checked at its
first open in this process's life, then trusted while it stays as it was (`_trust`).

Writes go behind the reader: the fetcher offers a block once its readers have it, a queue of bounded bytes
hands it to one writer thread, which writes a temporary file and renames it (a kill leaves at most a
temporary file, removed at the next start). The directory is the index: at start one scan learns each
block's name and size, oldest first; no file is read until a reader asks for it.

Budgets: the files never take more than `budget` bytes together (the least recently used go first, also at
start when a smaller budget is asked than DIR holds); writing pauses while the filesystem's free space is
under a floor; an error of the disk makes the tier stop writing for a while. None of it fails a read.
One mount per DIR: an exclusive lock on DIR/lock, refused with the holder's pid and mount point.

HeldFiles is the reading side (find, check, read, hand out whole); DiskTier keeps DIR (its lock, index, budget and
writes). A mount of several workers has one DiskTier, its hub's, and a DiskView (diskview.py) in each worker.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import struct
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable

from .blocks import BlockKey
from .buffers import allocate
from .memory import Buffer
from ..config import ConfigError, format_size
from .shared import TrustTable
from .sums import CHECKSUMS

log = logging.getLogger(__name__)

# magic, length of the bytes, the name's digest, the bytes' checksum: the magic names which (sums.CHECKSUMS). Blocks
# are written with CRC64-NVME (a tenth of SHA-256's cost: 0.35 against 2.7 ms a 4 MiB block, on every read back);
# blocks an older version wrote with SHA-256 are read as they are.
HEADER = struct.Struct("<8sQ32s32s")
MAGICS = {b"STKDISK2": "crc64nvme", b"STKDISK1": "sha256"}  # a header before the bytes
MAGIC = b"STKDISK2"  # what this version writes where DIR takes no xattrs
PLAIN_MAGIC = b"STKDISK3"  # the header in XATTR, the bytes alone in the file (CRC64-NVME)
XATTR = "user.stoker.block"
MAX_TRUSTED = 1 << 16  # files remembered as checked (or written) in this process's life (~250 B each); past it the oldest go
RECENCY_EVERY = 60.0  # seconds: a file used again within them keeps the mtime it has (restart order is this coarse)
WRITE_QUEUE = 32 * 1024**2  # bytes offered and not written yet (or two blocks); more are skipped (readers never wait)
STEP_ASIDE = 30.0  # seconds without writes after the disk failed one
FLOOR_MAX = 1024**3  # writing pauses while the filesystem has less free than min(this, a 20th of its size)
BLOCKS = "blocks"
TEMP = ".tmp-"


def floor_of(fs_size: int) -> int:
    return min(FLOOR_MAX, fs_size // 20)


@dataclass(frozen=True)
class DiskStats:
    directory: str
    budget: int
    bytes: int
    blocks: int
    hits: int
    misses: int
    bytes_read: int
    written: int
    skipped: int  # offered and not written: the queue was full, the disk paused, or the block is too big
    dropped: int  # failed their check when read back (corrupt, short, foreign) and were removed
    evicted: int
    errors: int
    queued_bytes: int
    paused: str  # why writing is paused now ("" while it writes)
    opened_seconds: float  # the start's scan of DIR (and any shrinking)


class HeldFiles:
    """The reading side of a disk tier: a block's file found, checked and read (or handed out whole), in any process
    of the mount. What DIR holds, and its budget, are the keeper's (DiskTier); `_holds`, `_forget` and the counters
    say how a subclass learns and tells of it."""

    def __init__(self, directory: str, *, bucket: str, block_size: int, huge_pages: bool = False):
        self.directory = directory
        self._bucket, self._block_size, self._huge = bucket, block_size, huge_pages
        self.queue_limit = max(WRITE_QUEUE, 2 * block_size)
        self._blocks = os.path.join(directory, BLOCKS)
        self._lock = threading.Lock()
        self._trusted: dict[str, int] = {}  # file name -> its stamp (hashed) when this process wrote or checked it
        # where the other processes of a mount of several workers learn what this one wrote or checked (shared.py)
        self.trust_table: TrustTable | None = None
        self.hits = self.misses = self.bytes_read = self.dropped = self.errors = 0
        self.plain = False  # files hold the bytes alone (the header in an xattr)

    budget: int

    def offer(self, key: BlockKey, data: Buffer) -> None:
        """Keep a block a reader got from the store or a peer; never waits."""
        raise NotImplementedError

    @property
    def queued_bytes(self) -> int:
        """Bytes offered and not written yet (a warm keeps this plus what it fetches under queue_limit)."""
        raise NotImplementedError

    def stats(self) -> DiskStats:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _holds(self, name: str) -> bool:
        """Is the file held (a use of it: its recency renewed)?"""
        raise NotImplementedError

    def _forget(self, name: str) -> bool:
        """(With the lock held.) The file is no longer held (gone, damaged); False where it was forgotten already."""
        raise NotImplementedError

    def _held(self, name: str) -> bool:
        """(With the lock held.) Is the file still held (not dropped since it was found)?"""
        raise NotImplementedError

    # ---- names -----------------------------------------------------------------------------
    def name(self, key: BlockKey) -> str:
        what = repr((self._bucket, key.key, key.etag, key.index, self._block_size))
        return hashlib.sha256(what.encode("utf-8", "surrogatepass")).hexdigest()

    def where(self, key: BlockKey) -> str | None:
        """The block's file name if DIR holds it (for `read`, which then need not hash it again), else None."""
        name = self.name(key)
        return name if self.known(name) else None

    def known(self, name: str) -> bool:
        """Is a file of this name held? (No use of it: a lookup.)"""
        raise NotImplementedError

    # ---- reads -----------------------------------------------------------------------------
    def read(self, key: BlockKey, length: int, into: Buffer | None = None, name: str | None = None) -> Buffer | None:
        """The block's bytes (`length` of them, in `into` if given) if DIR holds them whole and right, else None
        (a miss); `name`: the key's file name, from `where`."""
        name = name or self.name(key)
        if not self._holds(name):
            with self._lock:
                self.misses += 1
            return None
        try:
            data = self._read_file(name, length, into)
        except OSError as exc:
            with self._lock:
                self.errors += 1
            log.warning("disk cache: cannot read a block (%s); it is fetched again", exc.strerror)
            self._discard(name)
            return None
        if data is None:
            self._drop(name)
            return None
        with self._lock:
            self.hits += 1
            self.bytes_read += length
        return data

    def _read_file(self, name: str, length: int, into: Buffer | None) -> Buffer | None:
        try:
            fd = os.open(os.path.join(self._blocks, name), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            where = self._header(fd, name, length)
            return None if where is None else self._checked(fd, name, where, length, into)
        finally:
            os.close(fd)

    def _checked(self, fd: int, name: str, where: tuple[str, bytes, int], length: int,
                 into: Buffer | None) -> Buffer | None:
        """The block's bytes if their checksum is the header's (the file is dropped, counted, if not)."""
        kind, checksum, start = where
        data = into if into is not None else allocate(length, self._huge)
        if os.preadv(fd, [data], start) != length or _sum(kind, data) != checksum:
            self._corrupt(name, "checksum mismatch")
            return None
        if start == 0:
            self._used(name, fd, os.fstat(fd))
        else:
            os.utime(fd)  # its recency survives a restart (the scan orders by it)
        return data

    def _used(self, name: str, fd: int, st: os.stat_result) -> None:
        """A file that holds its block's bytes alone, checked: its recency survives a restart (the scan orders by
        mtime, set here at most every RECENCY_EVERY seconds: each utime is a metadata write, and moves the stamp),
        and it is trusted as long as it stays as it is now."""
        if time.time_ns() - st.st_mtime_ns > RECENCY_EVERY * 1e9:
            os.utime(fd)
            st = os.fstat(fd)
        self._trust(name, st)

    def _trust(self, name: str, st: os.stat_result) -> None:
        """Until the file changes (any write, truncation, xattr change or replacement moves its ctime or inode),
        `open_whole` hands it out without reading it again: the open of a held file is then an open and an fstat
        instead of a read of the whole file and its checksum on the event loop's thread (with the page cache
        dropped, a disk read per file, one after another). Only files this process wrote or checked are trusted.
        Where the kernel keeps ctime to its clock tick (no multigrain timestamps: before Linux 6.13), a change in
        the same few milliseconds as the stamp goes unseen: the files are this process's alone (0700), and damage
        that is no write (a disk's silent corruption) moves no stamp at all; a read through the mount checks it."""
        with self._lock:
            self._remember(name, _stamp(st))

    def _remember(self, name: str, stamp: int) -> None:
        """(With the lock held.) The newest trusted last, so that the oldest go first past MAX_TRUSTED."""
        if not self._held(name):
            return  # dropped meanwhile
        self._trusted.pop(name, None)
        self._trusted[name] = stamp
        if len(self._trusted) > MAX_TRUSTED:
            del self._trusted[next(iter(self._trusted))]
        if self.trust_table is not None:
            self.trust_table.note(name, stamp)

    def _trusts(self, name: str, stamp: int) -> bool:
        """Was the file, as it is now, written or checked by this process (or another of its mount's)?"""
        if self._trusted.get(name) == stamp:
            return True
        return self.trust_table is not None and self.trust_table.holds(name, stamp)

    def _header(self, fd: int, name: str, length: int) -> tuple[str, bytes, int] | None:
        """The checksum's kind, the checksum, and where the bytes start in the file; None: not this block's."""
        try:
            header = os.getxattr(fd, XATTR)
            start = 0
        except OSError as exc:
            if exc.errno not in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            header = os.pread(fd, HEADER.size, 0)
            start = HEADER.size
        if len(header) != HEADER.size:
            self._corrupt(name, "short header")
            return None
        magic, size, digest, checksum = HEADER.unpack(header)
        kind = "crc64nvme" if start == 0 and magic == PLAIN_MAGIC else MAGICS.get(magic) if start else None
        if kind is None or digest != bytes.fromhex(name) or size != length \
                or os.fstat(fd).st_size != start + length:
            self._corrupt(name, "header does not name this block")
            return None
        return kind, checksum, start

    def open_whole(self, key: BlockKey, length: int) -> int | None:
        """A descriptor of the block's file, checked, if it holds exactly the block's bytes from offset 0 (for the
        kernel to read itself), else None. Counted as a hit of `length` bytes; the caller closes it."""
        name = self.name(key)
        if not self._holds(name):
            return None
        try:
            fd = os.open(os.path.join(self._blocks, name), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("disk cache: cannot open a block (%s)", exc.strerror)
            return None
        try:
            st = os.fstat(fd)
            if st.st_size == length and self._trusts(name, _stamp(st)):
                self._used(name, fd, st)
            else:
                where = self._header(fd, name, length)
                if where is None or where[2] != 0 or self._checked(fd, name, where, length, None) is None:
                    return None  # damaged (dropped), or of an older layout: the header before the bytes
            with self._lock:
                self.hits += 1
                self.bytes_read += length
            fd, kept = -1, fd
            return kept
        except OSError as exc:
            log.warning("disk cache: cannot read a block (%s); it is fetched again", exc.strerror)
            return None
        finally:
            if fd >= 0:
                os.close(fd)

    def _corrupt(self, name: str, why: str) -> None:
        """Drop a damaged file, counted once: a reader and a passthrough open (or two readers) may find it at once."""
        with self._lock:
            self._trusted.pop(name, None)
            if not self._forget(name):
                return  # another found it first
            self.dropped += 1
        log.warning("disk cache: block %s dropped (%s); it is fetched again", name[:16], why)
        self._remove(name)
        self._gone(name)

    def _gone(self, name: str) -> None:
        """A file this process removed (damaged, unreadable), after its removal (a worker tells its hub)."""

    def _discard(self, name: str) -> None:
        """A file that could not be read: no longer held, removed (fetched and written again)."""
        self._drop(name)

    def let_go(self, key: BlockKey) -> None:
        """A block handed over to its new owner on another node: removed (not counted as damaged)."""
        self._discard(self.name(key))

    def _drop(self, name: str) -> None:
        """A file found gone or not to be read: no longer held."""
        with self._lock:
            self._trusted.pop(name, None)
            if not self._forget(name):
                return  # dropped already (found damaged): a copy written since under its name is not this one
        self._remove(name)

    def _remove(self, name: str) -> None:
        try:
            os.unlink(os.path.join(self._blocks, name))
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("disk cache: cannot remove %s: %s", name[:16], exc.strerror)


class DiskTier(HeldFiles):
    """See the module docstring. `read` and `where` may be called from any thread; `offer` from the event loop."""

    def __init__(self, directory: str, budget: int, *, bucket: str, block_size: int, mountpoint: str = "",
                 huge_pages: bool = False, clock: Callable[[], float] = time.monotonic):
        super().__init__(directory, bucket=bucket, block_size=block_size, huge_pages=huge_pages)
        self.budget = budget
        self._clock = clock
        # told the bytes queued for writing whenever they change (a mount of several workers shows them to the
        # worker that warms: process/workers.py)
        self.queue_mirror: Callable[[int], None] | None = None
        self._index: OrderedDict[str, int] = OrderedDict()  # file name -> bytes on disk, least recent first
        self._bytes = 0
        self._queue: deque[tuple[str, Buffer]] = deque()
        self._queued = 0
        self._wake = threading.Condition(self._lock)
        self._closing = False
        self._paused_until = 0.0
        self._paused = ""
        self.written = self.skipped = self.evicted = 0
        began = time.monotonic()
        self._holder = self._take_lock(mountpoint)
        try:
            self._prepare()
            self._scan()
            self._shrink()
            self._check_room()
        except BaseException:
            os.close(self._holder)
            raise
        self.opened_seconds = time.monotonic() - began
        self._writer = threading.Thread(target=self._write_loop, name="stoker-disk-writer", daemon=True)
        self._writer.start()

    # ---- what DIR holds (HeldFiles' hooks) ---------------------------------------------------
    def known(self, name: str) -> bool:
        return name in self._index

    def _holds(self, name: str) -> bool:
        with self._lock:
            if name not in self._index:
                return False
            self._index.move_to_end(name)
            return True

    def _held(self, name: str) -> bool:
        return name in self._index

    def _forget(self, name: str) -> bool:
        size = self._index.pop(name, None)
        if size is None:
            return False
        self._bytes -= size
        if self.trust_table is not None:
            self.trust_table.forget(name)
        return True

    def touch(self, name: str) -> None:
        """Another process of the mount used the file (a worker's read: diskview.py)."""
        self._holds(name)

    def forgotten(self, name: str) -> None:
        """Another process of the mount found the file damaged and removed it (diskview.py): forgotten, unless a
        copy was written since (its news and the worker's that fetched the block again may come in either order)."""
        if not os.path.exists(os.path.join(self._blocks, name)):
            self._forget_now(name)

    def still_holds(self, name: str) -> bool:
        """Does DIR hold the file `name`? One its index holds but another process removed (damaged: its news may
        come after the news of the block fetched again) is forgotten now, so that the new copy is written."""
        if not self.known(name):
            return False
        if os.path.exists(os.path.join(self._blocks, name)):
            return True
        self._forget_now(name)
        return False

    def _forget_now(self, name: str) -> None:
        with self._lock:
            self._trusted.pop(name, None)
            self._forget(name)

    # ---- opening ---------------------------------------------------------------------------
    def _take_lock(self, mountpoint: str) -> int:
        """Hold DIR/lock for the life of this process (the kernel lets go if it dies)."""
        where = self.directory
        if not os.path.exists(where):
            raise ConfigError("disk-cache", f"{where} does not exist")
        if not os.path.isdir(where):
            raise ConfigError("disk-cache", f"{where} is not a directory")
        path = os.path.join(where, "lock")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ConfigError("disk-cache", f"{where} is not writable: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise ConfigError("disk-cache", f"{where} is in use by another mount ({holder}); "
                                            "each mount needs a directory of its own") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}, mounted at {mountpoint or '?'}\n".encode(), 0)
        os.fchmod(fd, 0o600)
        return fd

    def _prepare(self) -> None:
        """DIR/blocks exists, is this process's alone (0700), and takes a file."""
        try:
            os.makedirs(self._blocks, mode=0o700, exist_ok=True)
            os.chmod(self._blocks, 0o700)
            probe = os.path.join(self._blocks, f"{TEMP}probe")
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                self.plain = _takes_xattrs(fd)
            finally:
                os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise ConfigError("disk-cache", f"{self.directory} is not writable: {exc.strerror}") from None

    def _scan(self) -> None:
        """Learn what DIR holds from the directory alone (names and sizes), least recently used first."""
        found = []
        with os.scandir(self._blocks) as entries:
            for entry in entries:
                if entry.name.startswith(TEMP) or len(entry.name) != 64 or not entry.is_file(follow_symlinks=False):
                    self._remove(entry.name)  # a write a kill cut short, or nothing of ours
                    continue
                st = entry.stat(follow_symlinks=False)
                found.append((st.st_mtime_ns, entry.name, st.st_size))
        found.sort()
        for _, name, size in found:
            self._index[name] = size
            self._bytes += size

    def _shrink(self) -> None:
        with self._lock:
            self._evict_to(self.budget)

    def _check_room(self) -> None:
        """Refuse a budget the filesystem cannot hold (what DIR holds already counts as room)."""
        free, _ = self._space()
        room = free + self._bytes
        if room < self.budget:
            raise ConfigError("disk-cache-size", f"{format_size(self.budget)} asked, but {self.directory} has "
                                                 f"{format_size(free)} free (and holds {format_size(self._bytes)})")

    def _space(self) -> tuple[int, int]:
        """Free bytes for this process, and the filesystem's size."""
        st = os.statvfs(self._blocks)
        return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize

    # ---- writes ----------------------------------------------------------------------------
    def offer(self, key: BlockKey, data: Buffer) -> None:
        """Keep a block a reader got from the store or a peer; never waits (the writer thread writes it)."""
        self.keep(self.name(key), data)

    def keep(self, name: str, data: Buffer) -> None:
        """Keep bytes as the file `name` (a block a worker of the mount published: workers.py); never waits."""
        with self._lock:
            if name in self._index:
                return
            if self._closing or self._queued + len(data) > self.queue_limit or self._clock() < self._paused_until:
                self.skipped += 1
                return
            self._queue.append((name, data))
            self._queued += len(data)
            self._wake.notify()
            if self.queue_mirror is not None:
                self.queue_mirror(self._queued)

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    self._wake.wait()
                if self._closing:
                    return
                name, data = self._queue.popleft()
            try:
                self._write(name, data)
            finally:
                with self._lock:
                    self._queued -= len(data)
                    if self.queue_mirror is not None:
                        self.queue_mirror(self._queued)

    def _write(self, name: str, data: Buffer) -> None:
        need = len(data) if self.plain else HEADER.size + len(data)
        if name in self._index:  # offered twice (fetched again before its first copy was written)
            return
        if need > self.budget or self._clock() < self._paused_until:
            self._skip()
            return
        try:
            free, size = self._space()
            if free - need < floor_of(size):
                self._pause(f"free space under {format_size(floor_of(size))}", 1.0)
                self._skip()
                return
            with self._lock:
                self._evict_to(self.budget - need)
            checksum = _sum("crc64nvme", data)
            temp = os.path.join(self._blocks, f"{TEMP}{name}")
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                if self.plain:
                    _write_all(fd, memoryview(data))
                    os.setxattr(fd, XATTR, HEADER.pack(PLAIN_MAGIC, len(data), bytes.fromhex(name), checksum))
                else:
                    _write_all(fd, HEADER.pack(MAGIC, len(data), bytes.fromhex(name), checksum))
                    _write_all(fd, memoryview(data))
            finally:
                os.close(fd)
            os.rename(temp, os.path.join(self._blocks, name))
        except OSError as exc:
            self._remove(f"{TEMP}{name}")
            with self._lock:
                self.errors += 1
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            self._pause("the disk is full" if full else f"a write failed: {exc.strerror}", STEP_ASIDE)
            self._skip()
            return
        try:  # (only this thread evicts: the file is there until the lock is let go below)
            stamp = _stamp(os.stat(os.path.join(self._blocks, name))) if self.plain else None
        except OSError:
            stamp = None  # (not to be stat'ed: checked at its next open)
        with self._lock:
            self._bytes += need - self._index.pop(name, 0)
            self._index[name] = need
            self.written += 1
            if stamp is not None:
                self._remember(name, stamp)
            if self._paused:
                log.info("disk cache: writing again")
                self._paused = ""

    def _skip(self) -> None:
        with self._lock:
            self.skipped += 1

    def _pause(self, why: str, seconds: float) -> None:
        with self._lock:
            self._paused_until = self._clock() + seconds
            if self._paused != why:
                log.warning("disk cache: not writing for now: %s (reads go on)", why)
            self._paused = why

    def _evict_to(self, target: int) -> None:
        """Drop least recently used files until DIR holds at most `target` bytes (with the lock held)."""
        while self._bytes > target and self._index:
            name, size = self._index.popitem(last=False)
            self._trusted.pop(name, None)
            if self.trust_table is not None:
                self.trust_table.forget(name)
            self._bytes -= size
            self.evicted += 1
            self._remove(name)

    @property
    def queued_bytes(self) -> int:
        return self._queued

    # ---- the rest --------------------------------------------------------------------------
    def stats(self) -> DiskStats:
        with self._lock:
            paused = self._paused if self._clock() < self._paused_until else ""
            return DiskStats(self.directory, self.budget, self._bytes, len(self._index), self.hits, self.misses,
                             self.bytes_read, self.written, self.skipped, self.dropped, self.evicted, self.errors,
                             self._queued, paused, round(self.opened_seconds, 3))

    def close(self) -> None:
        """Stop writing (what is queued is dropped: unmount does not wait for the disk) and let go of DIR."""
        with self._lock:
            self._closing = True
            self._queue.clear()
            self._wake.notify()
        self._writer.join(timeout=2.0)
        os.close(self._holder)


def _takes_xattrs(fd: int) -> bool:
    """Does DIR's filesystem keep a user xattr (ext4, xfs, tmpfs from Linux 6.6 do; some overlays do not)?"""
    try:
        os.setxattr(fd, XATTR, b"probe")
        return os.getxattr(fd, XATTR) == b"probe"
    except OSError:
        return False


def _stamp(st: os.stat_result) -> int:
    """What changes when a file's bytes, length or attributes change, or another file takes its name (hashed: one
    int per trusted file)."""
    return hash((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def _sum(kind: str, data: Buffer) -> bytes:
    """The checksum field of a header: the sum named `kind`, padded to the field's 32 bytes."""
    return CHECKSUMS[kind](data).ljust(32, b"\0")
