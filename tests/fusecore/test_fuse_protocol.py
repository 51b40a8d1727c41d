"""The FUSE wire format against the sizes and layouts of include/uapi/linux/fuse.h (written out here, not derived
from protocol.py), and the INIT agreement."""

from __future__ import annotations

import struct

import pytest

from fusecore.fuse import protocol as p


def _attr(ino: int = 5, size: int = 1000, mode: int = 0o100444) -> p.Attr:
    return p.Attr(ino, size, mode, 1, 1000, 1001, 1_700_000_000_250_000_000, 4096)


def test_reply_sizes_are_the_kernels():
    # struct fuse_attr 88, fuse_entry_out 40 + 88, fuse_attr_out 16 + 88, fuse_open_out 16, fuse_init_out 64,
    # fuse_kstatfs 80, fuse_out_header 16, fuse_in_header 40
    assert len(_attr().pack()) == 88
    assert len(p.entry_out(_attr(), 1.5)) == 128
    assert len(p.entry_out(None, 1.5)) == 128
    assert len(p.attr_out(_attr(), 1.0)) == 104
    assert len(p.open_out(7)) == 16
    assert len(p.statfs_out(4096)) == 80
    assert len(p.reply_head(1, 0)) == 16
    assert p.IN_HEADER.size == 40


def test_entry_carries_inode_timeouts_and_attributes():
    raw = p.entry_out(_attr(ino=42, size=123_456), 2.25)
    nodeid, generation, entry_valid, attr_valid, entry_nsec, attr_nsec = struct.unpack_from("<QQQQII", raw)
    assert (nodeid, generation, entry_valid, attr_valid, entry_nsec, attr_nsec) == (42, 0, 2, 2, 250_000_000,
                                                                                   250_000_000)
    ino, size, blocks, atime, mtime, ctime, _an, mnsec, _cn, mode, nlink, uid, gid, rdev, blksize, flags = \
        struct.unpack_from("<QQQQQQIIIIIIIIII", raw, 40)
    assert (ino, size, blocks, mtime, mnsec, mode, nlink, uid, gid, blksize) == (
        42, 123_456, 242, 1_700_000_000, 250_000_000, 0o100444, 1, 1000, 1001, 4096)


def test_negative_entry_has_no_inode_and_is_cached_for_the_timeout():
    nodeid, _gen, entry_valid, attr_valid = struct.unpack_from("<QQQQ", p.entry_out(None, 30.0))
    assert (nodeid, entry_valid, attr_valid) == (0, 30, 0)


def test_direntplus_is_padded_to_eight_bytes_and_names_its_offset():
    for name in (b"a", b"abcdefg", b"abcdefgh", b"x" * 255):
        raw = p.direntplus(_attr(ino=9), name, 17, 1.0)
        assert len(raw) % 8 == 0
        ino, off, namelen, kind = struct.unpack_from("<QQII", raw, 128)
        assert (ino, off, namelen, kind) == (9, 17, len(name), 8)
        assert raw[128 + 24:128 + 24 + len(name)] == name
        assert len(raw) - (128 + 24 + len(name)) < 8


def test_request_parse_and_length_check():
    arg = struct.pack("<QQIIQII", 3, 4096, 131072, 0, 0, 0, 0)
    head = struct.pack("<IIQQIIIHH", 40 + len(arg), 15, 77, 5, 0, 0, 1234, 0, 0)
    r = p.parse(head + arg)
    assert (r.opcode, r.unique, r.nodeid, r.pid) == (p.Op.READ, 77, 5, 1234)
    assert p.READ_IN.unpack_from(r.arg)[:3] == (3, 4096, 131072)
    with pytest.raises(p.ProtocolError):
        p.parse(head + arg[:-1])
    with pytest.raises(p.ProtocolError):
        p.parse(head[:20])


def _offer(minor: int, flags: int) -> p.Offer:
    return p.Offer(7, minor, 131072, flags)


def test_agreement_takes_only_what_is_offered_and_wanted():
    want = int(p.Init.ASYNC_READ | p.Init.PARALLEL_DIROPS | p.Init.PASSTHROUGH)
    offered = int(p.Init.ASYNC_READ | p.Init.MAX_PAGES | p.Init.INIT_EXT | p.Init.PASSTHROUGH)
    agreed = p.agree(_offer(41, offered), want=want, max_write=1 << 20, max_pages=256)
    assert agreed.minor == 40
    assert agreed.flags == int(p.Init.ASYNC_READ | p.Init.PASSTHROUGH | p.Init.INIT_EXT)
    assert agreed.passthrough
    out = p.init_out(_offer(41, offered), agreed, max_background=64, congestion_threshold=48, max_stack_depth=1)
    major, minor, readahead, flags, bg, cong, max_write, gran, pages, _align, flags2, depth = \
        struct.unpack("<IIIIHHIIHHII24x", out)
    assert (major, minor, bg, cong, max_write, pages, depth) == (7, 40, 64, 48, 1 << 20, 256, 1)
    assert flags == int(p.Init.ASYNC_READ | p.Init.INIT_EXT) and flags2 == 1 << 5


def test_no_passthrough_before_protocol_40_and_no_kernel_before_31():
    offered = int(p.Init.ASYNC_READ | p.Init.INIT_EXT | p.Init.PASSTHROUGH)
    agreed = p.agree(_offer(38, offered), want=int(p.Init.PASSTHROUGH | p.Init.ASYNC_READ), max_write=4096,
                     max_pages=1)
    assert not agreed.passthrough and agreed.minor == 38
    with pytest.raises(p.ProtocolError, match="7.31"):
        p.agree(_offer(26, 0), want=0, max_write=4096, max_pages=1)


def test_init_offer_reads_flags2_only_with_init_ext():
    arg = struct.pack("<IIIII", 7, 40, 1 << 17, int(p.Init.INIT_EXT), 1 << 5) + bytes(44)
    assert p.parse_init(memoryview(arg)).flags & p.Init.PASSTHROUGH
    arg = struct.pack("<IIIII", 7, 40, 1 << 17, 0, 1 << 5) + bytes(44)
    assert not p.parse_init(memoryview(arg)).flags & p.Init.PASSTHROUGH
