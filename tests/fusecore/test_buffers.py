"""Block buffers: exactly the size asked, zeroed, and resident before the first byte is received, on 2 MiB
pages when asked (read back from /proc/self/smaps)."""

from __future__ import annotations

import ctypes

import pytest

from fusecore.cache import buffers, pages


def _mapping(buf) -> dict[str, int]:
    """The smaps fields (kB) of the mapping that holds `buf` (VmFlags: 1 per flag set)."""
    view = ctypes.c_char.from_buffer(buf)
    address = ctypes.addressof(view)
    del view
    fields: dict[str, int] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head.endswith(":") and line.split()[-1] == "kB":
                fields[head[:-1]] = int(line.split()[1])
            elif inside and head == "VmFlags:":
                fields.update((flag, 1) for flag in line.split()[1:])
    return fields


@pytest.mark.parametrize("huge", [False, True])
@pytest.mark.parametrize("nbytes", [1000, 300 * 1024, 3 * 1024 * 1024 + 5, 8 * 1024 * 1024])
def test_a_buffer_is_the_size_asked_zeroed_and_writable(nbytes, huge):
    buf = buffers.allocate(nbytes, huge)
    assert len(buf) == nbytes and buf[:64] == bytes(64) and buf[-64:] == bytes(64)
    memoryview(buf)[nbytes - 3:] = b"xyz"
    assert buf[-3:] == b"xyz"


def test_a_large_buffer_is_resident_before_any_byte_arrives():
    """Populated up front: the socket copy never faults page by page."""
    buf = buffers.allocate(8 * 1024 * 1024)
    assert _mapping(buf)["Rss"] >= 8 * 1024


@pytest.mark.skipif(pages.thp_mode() in ("", "never"), reason="this kernel offers no transparent huge pages")
def test_a_buffer_asked_on_huge_pages_is_marked_for_them_and_resident():
    """MADV_HUGEPAGE shows as `hg`; populated without the GIL (ctypes), so resident before any byte."""
    buf = buffers.allocate(8 * 1024 * 1024, huge=True)
    mapping = _mapping(buf)
    assert mapping.get("hg") == 1 and mapping["Rss"] >= 8 * 1024
    buf.close()  # nothing exports it any more: it can be unmapped (evicted)


def test_buffers_not_asked_on_huge_pages_or_too_small_for_one_are_not_marked():
    for buf in (buffers.allocate(8 * 1024 * 1024), buffers.allocate(buffers.HUGE_PAGE - 4096, huge=True)):
        assert "hg" not in _mapping(buf)


@pytest.mark.parametrize("huge", [False, True])
def test_a_part_buffer_is_a_bytearray_of_the_size_asked_resident_before_it_is_filled(huge):
    """An upload's part (populated_bytearray): a bytearray (what botocore sends whole), its pages mapped in one call
    before the writer's bytes are copied in (not a fault per 4 KiB under the GIL)."""
    buf = buffers.populated_bytearray(8 * 1024 * 1024, huge)
    assert type(buf) is bytearray and len(buf) == 8 * 1024 * 1024
    assert _mapping(buf)["Rss"] >= 8 * 1024 - 4
    buf[-3:] = b"xyz"
    buf[:3] = b"abc"
    assert bytes(buf[:3]) + bytes(buf[-3:]) == b"abcxyz"
    small = buffers.populated_bytearray(1000)  # (below a mapping of its own: a plain, zeroed bytearray)
    assert small == bytearray(1000)
