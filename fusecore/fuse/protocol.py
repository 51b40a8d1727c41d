"""The FUSE wire format, as the kernel's include/uapi/linux/fuse.h defines it (protocol 7.31 to 7.40): the request
head, the arguments Stoker reads, and the replies it writes. Pure: bytes in, bytes out, no I/O."""

from __future__ import annotations

import enum
import stat
import struct
from dataclasses import dataclass

from ..failures import StokerError

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid total_extlen padding
OUT_HEADER = struct.Struct("<IiQ")  # len error unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # ino size blocks atime mtime ctime atimensec mtimensec ctimensec
# mode nlink uid gid rdev blksize flags
ENTRY_OUT = struct.Struct("<QQQQII")  # nodeid generation entry_valid attr_valid entry_valid_nsec attr_valid_nsec
ATTR_OUT = struct.Struct("<QII")  # attr_valid attr_valid_nsec dummy
OPEN_IN = struct.Struct("<II")  # flags open_flags
OPEN_OUT = struct.Struct("<QIi")  # fh open_flags backing_id (7.40; padding before)
READ_IN = struct.Struct("<QQIIQII")  # fh offset size read_flags lock_owner flags padding
RELEASE_IN = struct.Struct("<QIIQ")  # fh flags release_flags lock_owner
FORGET_IN = struct.Struct("<Q")  # nlookup
BATCH_FORGET_IN = struct.Struct("<II")  # count dummy
FORGET_ONE = struct.Struct("<QQ")  # nodeid nlookup
INTERRUPT_IN = struct.Struct("<Q")  # unique
ACCESS_IN = struct.Struct("<II")  # mask padding
CREATE_IN = struct.Struct("<IIII")  # flags mode umask open_flags (then the name)
MKDIR_IN = struct.Struct("<II")  # mode umask (then the name)
WRITE_IN = struct.Struct("<QQIIQII")  # fh offset size write_flags lock_owner flags padding (then the bytes)
WRITE_OUT = struct.Struct("<II")  # size padding
NOTIFY_INVAL_ENTRY_OUT = struct.Struct("<QII")  # parent namelen flags (then the name and a NUL)
NOTIFY_INVAL_ENTRY = 3  # a notification's code, sent in the reply head's error field with unique 0
FLUSH_IN = struct.Struct("<QIIQ")  # fh unused padding lock_owner
FSYNC_IN = struct.Struct("<QII")  # fh fsync_flags padding
HANDLE = struct.Struct("<Q")  # the file handle a FLUSH_IN, FSYNC_IN or RELEASE_IN starts with
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")  # valid padding fh size lock_owner atime mtime ctime atimensec
# mtimensec ctimensec mode unused uid gid unused
INIT_IN = struct.Struct("<IIII")  # major minor max_readahead flags
INIT_IN_FLAGS2 = struct.Struct("<I")  # flags2, from 7.36 (present when FUSE_INIT_EXT is offered)
INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")  # major minor max_readahead flags max_background congestion_threshold
# max_write time_gran max_pages map_alignment flags2 max_stack_depth (unused[6])
STATFS_OUT = struct.Struct("<QQQQQIIII24x")  # blocks bfree bavail files ffree bsize namelen frsize padding spare[6]
DIRENT = struct.Struct("<QQII")  # ino off namelen type
BACKING_MAP = struct.Struct("<iIQ")  # fd flags padding (struct fuse_backing_map)

FUSE_DEV_IOC_CLONE = 0x8004E500  # _IOR(229, 0, uint32_t): this descriptor joins the connection of the one given
FUSE_DEV_IOC_BACKING_OPEN = 0x4010E501  # _IOW(229, 1, struct fuse_backing_map)
FUSE_DEV_IOC_BACKING_CLOSE = 0x4004E502  # _IOW(229, 2, uint32_t)

KERNEL_MAJOR = 7
OLDEST_MINOR = 31  # Linux 5.4
PASSTHROUGH_MINOR = 40  # Linux 6.9: backing files


class Op(enum.IntEnum):
    LOOKUP = 1
    FORGET = 2
    GETATTR = 3
    SETATTR = 4
    SYMLINK = 6
    MKNOD = 8
    MKDIR = 9
    UNLINK = 10
    RMDIR = 11
    RENAME = 12
    LINK = 13
    OPEN = 14
    READ = 15
    WRITE = 16
    STATFS = 17
    RELEASE = 18
    FSYNC = 20
    GETXATTR = 22
    LISTXATTR = 23
    FLUSH = 25
    INIT = 26
    OPENDIR = 27
    READDIR = 28
    RELEASEDIR = 29
    ACCESS = 34
    CREATE = 35
    INTERRUPT = 36
    DESTROY = 38
    BATCH_FORGET = 42
    READDIRPLUS = 44
    RENAME2 = 45


class Init(enum.IntFlag):
    """FUSE_INIT capability bits (flags | flags2 << 32)."""

    ASYNC_READ = 1 << 0
    ATOMIC_O_TRUNC = 1 << 3
    BIG_WRITES = 1 << 5
    AUTO_INVAL_DATA = 1 << 12
    DO_READDIRPLUS = 1 << 13
    ASYNC_DIO = 1 << 15
    PARALLEL_DIROPS = 1 << 18
    MAX_PAGES = 1 << 22
    INIT_EXT = 1 << 30
    PASSTHROUGH = 1 << 37


class Setattr(enum.IntFlag):
    """What a SETATTR changes (its `valid` bits)."""

    MODE = 1 << 0
    UID = 1 << 1
    GID = 1 << 2
    SIZE = 1 << 3
    ATIME = 1 << 4
    MTIME = 1 << 5
    FH = 1 << 6
    ATIME_NOW = 1 << 7
    MTIME_NOW = 1 << 8
    LOCKOWNER = 1 << 9
    CTIME = 1 << 10
    KILL_SUIDGID = 1 << 11


TIMES = Setattr.ATIME | Setattr.MTIME | Setattr.ATIME_NOW | Setattr.MTIME_NOW | Setattr.CTIME | Setattr.FH \
    | Setattr.LOCKOWNER | Setattr.KILL_SUIDGID  # (what a SETATTR may hold that changes nothing Stoker stores)


class OpenFlag(enum.IntFlag):
    DIRECT_IO = 1 << 0
    KEEP_CACHE = 1 << 1
    CACHE_DIR = 1 << 3
    PASSTHROUGH = 1 << 7


DT_DIR, DT_REG = 4, 8
PAGE = 4096


class ProtocolError(StokerError):
    """The kernel spoke a protocol this loop cannot serve (too old, or a malformed request)."""

    kind = "fuse-protocol"


@dataclass(frozen=True, slots=True)
class Request:
    opcode: int
    unique: int
    nodeid: int
    uid: int
    gid: int
    pid: int
    arg: memoryview  # the opcode's argument, after the head


def parse(data: bytes | bytearray | memoryview) -> Request:
    """One request as read from the device (one read(2) returns exactly one request)."""
    if len(data) < IN_HEADER.size:
        raise ProtocolError(f"a request of {len(data)} bytes")
    length, opcode, unique, nodeid, uid, gid, pid, _ext, _pad = IN_HEADER.unpack_from(data)
    if length != len(data):
        raise ProtocolError(f"a request says {length} bytes and has {len(data)}")
    return Request(opcode, unique, nodeid, uid, gid, pid, memoryview(data)[IN_HEADER.size:length])


def name_of(arg: memoryview) -> bytes:
    """A name argument (LOOKUP): NUL-terminated bytes."""
    raw = bytes(arg)
    end = raw.find(b"\0")
    return raw if end < 0 else raw[:end]


@dataclass(frozen=True, slots=True)
class Attr:
    """What a reply says of an inode (struct fuse_attr)."""

    ino: int
    size: int
    mode: int
    nlink: int
    uid: int
    gid: int
    mtime_ns: int
    blksize: int

    def pack(self) -> bytes:
        sec, nsec = divmod(self.mtime_ns, 1_000_000_000)
        return ATTR.pack(self.ino, self.size, (self.size + 511) // 512, sec, sec, sec, nsec, nsec, nsec, self.mode,
                         self.nlink, self.uid, self.gid, 0, self.blksize, 0)

    @property
    def dirent_type(self) -> int:
        return DT_DIR if stat.S_ISDIR(self.mode) else DT_REG


def split_seconds(seconds: float) -> tuple[int, int]:
    whole = int(seconds)
    return whole, int((seconds - whole) * 1e9)


def entry_out(attr: Attr | None, timeout: float) -> bytes:
    """LOOKUP's reply; `None`: the name does not exist, and the kernel may remember that for `timeout`."""
    sec, nsec = split_seconds(timeout)
    if attr is None:
        return ENTRY_OUT.pack(0, 0, sec, 0, nsec, 0) + bytes(ATTR.size)
    return ENTRY_OUT.pack(attr.ino, 0, sec, sec, nsec, nsec) + attr.pack()


def attr_out(attr: Attr, timeout: float) -> bytes:
    sec, nsec = split_seconds(timeout)
    return ATTR_OUT.pack(sec, nsec, 0) + attr.pack()


def open_out(fh: int, flags: int = 0, backing_id: int = 0) -> bytes:
    return OPEN_OUT.pack(fh, flags, backing_id)


def statfs_out(block_size: int, namemax: int = 255, free: int = 0) -> bytes:
    """`free`: bytes a writer may count on (a writable mount says a bucket's room is large: tools that check the
    free space before writing must not see 0)."""
    blocks = free // block_size
    return STATFS_OUT.pack(blocks, blocks, blocks, 0, 0, block_size, namemax, block_size, 0)


def notify_inval_entry(parent: int, name: bytes) -> bytes:
    """A notification that the kernel must forget the entry `name` of directory `parent` (it no longer exists)."""
    body = NOTIFY_INVAL_ENTRY_OUT.pack(parent, len(name), 0) + name + b"\0"
    return OUT_HEADER.pack(OUT_HEADER.size + len(body), NOTIFY_INVAL_ENTRY, 0) + body


def write_out(size: int) -> bytes:
    return WRITE_OUT.pack(size, 0)


def two_names(arg: memoryview) -> tuple[bytes, bytes]:
    """RENAME's old and new names, each NUL-terminated."""
    raw = bytes(arg)
    first, _, rest = raw.partition(b"\0")
    return first, rest.partition(b"\0")[0]


def _aligned(n: int) -> int:
    return (n + 7) & ~7


def direntplus(attr: Attr, name: bytes, offset: int, timeout: float) -> bytes:
    """One READDIRPLUS entry: the entry (as LOOKUP's reply) and the dirent, padded to 8 bytes."""
    head = entry_out(attr, timeout) + DIRENT.pack(attr.ino, offset, len(name), attr.dirent_type) + name
    return head + bytes(_aligned(len(head)) - len(head))


def dirent(attr: Attr, name: bytes, offset: int) -> bytes:
    """One READDIR entry, padded to 8 bytes."""
    head = DIRENT.pack(attr.ino, offset, len(name), attr.dirent_type) + name
    return head + bytes(_aligned(len(head)) - len(head))


def reply_head(unique: int, body_length: int, error: int = 0) -> bytes:
    """The head of a reply; `error` a positive errno (sent negated), then no body."""
    return OUT_HEADER.pack(OUT_HEADER.size + body_length, -error, unique)


@dataclass(frozen=True, slots=True)
class Offer:
    """What the kernel's INIT offers."""

    major: int
    minor: int
    max_readahead: int
    flags: int  # flags | flags2 << 32


def parse_init(arg: memoryview) -> Offer:
    major, minor, max_readahead, flags = INIT_IN.unpack_from(arg)
    if flags & Init.INIT_EXT and len(arg) >= INIT_IN.size + INIT_IN_FLAGS2.size:
        flags |= INIT_IN_FLAGS2.unpack_from(arg, INIT_IN.size)[0] << 32
    return Offer(major, minor, max_readahead, flags)


@dataclass(frozen=True, slots=True)
class Agreed:
    """What this server answered to INIT: the protocol both speak and the capabilities taken."""

    minor: int
    flags: int
    max_write: int
    max_pages: int

    @property
    def passthrough(self) -> bool:
        return bool(self.flags & Init.PASSTHROUGH)


def agree(offer: Offer, *, want: int, max_write: int, max_pages: int) -> Agreed:
    """The capabilities taken: those wanted that the kernel offers; refuses a kernel older than 7.31."""
    if offer.major != KERNEL_MAJOR or offer.minor < OLDEST_MINOR:
        raise ProtocolError(f"kernel FUSE protocol {offer.major}.{offer.minor}: {KERNEL_MAJOR}.{OLDEST_MINOR} "
                            "(Linux 5.4) or later is needed")
    taken = offer.flags & want
    if taken >> 32:
        taken |= Init.INIT_EXT  # flags2 is read only with INIT_EXT set
    minor = min(offer.minor, PASSTHROUGH_MINOR)
    if minor < PASSTHROUGH_MINOR:
        taken &= ~int(Init.PASSTHROUGH)
    return Agreed(minor, taken, max_write, max_pages)


def init_out(offer: Offer, agreed: Agreed, *, max_background: int, congestion_threshold: int,
             max_stack_depth: int) -> bytes:
    return INIT_OUT.pack(KERNEL_MAJOR, agreed.minor, offer.max_readahead, agreed.flags & 0xFFFFFFFF,
                         max_background, congestion_threshold, agreed.max_write, 1, agreed.max_pages, 0,
                         agreed.flags >> 32, max_stack_depth if agreed.passthrough else 0)
