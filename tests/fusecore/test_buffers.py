"""Block buffers: exactly the size asked, zeroed, and resident before the first byte is received (read
back from /proc/self/smaps)."""

from __future__ import annotations

import ctypes

import pytest

from fusecore import buffers


def _mapping(buf) -> dict[str, int]:
    """The smaps fields (kB) of the mapping that holds `buf`."""
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
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
    return fields


@pytest.mark.parametrize("nbytes", [1000, 300 * 1024, 3 * 1024 * 1024 + 5, 8 * 1024 * 1024])
def test_a_buffer_is_the_size_asked_zeroed_and_writable(nbytes):
    buf = buffers.allocate(nbytes)
    assert len(buf) == nbytes and buf[:64] == bytes(64) and buf[-64:] == bytes(64)
    memoryview(buf)[nbytes - 3:] = b"xyz"
    assert buf[-3:] == b"xyz"


def test_a_large_buffer_is_resident_before_any_byte_arrives():
    """Populated up front: the socket copy never faults page by page."""
    buf = buffers.allocate(8 * 1024 * 1024)
    assert _mapping(buf)["Rss"] >= 8 * 1024
