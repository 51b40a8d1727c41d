"""The FUSE connection's request loop (fuse/session.py) against a fake kernel: a SOCK_SEQPACKET pair keeps each
request and each reply one message, as /dev/fuse does. The real kernel's side is tested through real mounts
(test_mount.py, test_passthrough.py); this one shows what a real mount cannot show on demand: an INTERRUPT of a
request that waits, a kernel that refuses a reply, FORGET batches, DESTROY."""

from __future__ import annotations

import errno
import socket
import struct

import pytest
import trio

from fusecore.fuse import protocol as p
from fusecore.fuse.session import Connection, FuseError

HEAD = struct.Struct("<IIQQIIIHH")
OUT = struct.Struct("<IiQ")


def request(opcode: int, unique: int, nodeid: int = 1, arg: bytes = b"") -> bytes:
    return HEAD.pack(HEAD.size + len(arg), opcode, unique, nodeid, 0, 0, 4242, 0, 0) + arg


def init_request(minor: int = 40, flags: int = int(p.Init.ASYNC_READ | p.Init.INIT_EXT), flags2: int = 1 << 5) -> bytes:
    return request(p.Op.INIT, 1, 0, struct.pack("<IIIII", 7, minor, 131072, flags, flags2) + bytes(44))


def reply(kernel: socket.socket) -> tuple[int, int, bytes]:
    data = kernel.recv(1 << 21)
    length, error, unique = OUT.unpack_from(data)
    assert length == len(data)
    return unique, error, data[OUT.size:]


@pytest.fixture
def pair():
    kernel, server = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    kernel.settimeout(30)  # a reply that never comes fails the test instead of hanging it
    yield kernel, server
    kernel.close()
    server.close()


def test_init_is_answered_with_what_both_sides_have(pair):
    kernel, server = pair
    kernel.send(init_request())
    conn = Connection(server.fileno(), max_write=1 << 20)
    agreed = conn.negotiate(want=int(p.Init.ASYNC_READ | p.Init.PARALLEL_DIROPS | p.Init.PASSTHROUGH),
                            max_background=64)
    unique, error, body = reply(kernel)
    assert (unique, error, len(body)) == (1, 0, 64)
    major, minor, _ra, flags, bg, _c, max_write, _g, pages, _a, flags2, depth = struct.unpack("<IIIIHHIIHHII24x", body)
    assert (major, minor, bg, max_write, pages, flags2, depth) == (7, 40, 64, 1 << 20, 256, 1 << 5, 1)
    assert flags & p.Init.ASYNC_READ and not flags & p.Init.PARALLEL_DIROPS  # not offered, not taken
    assert agreed.passthrough


def test_an_old_kernel_is_answered_eproto_and_refused(pair):
    kernel, server = pair
    kernel.send(init_request(minor=26, flags=0))
    with pytest.raises(p.ProtocolError, match="7.31"):
        Connection(server.fileno()).negotiate(want=0, max_background=64)
    assert reply(kernel)[:2] == (1, -errno.EPROTO)


async def _serve(server: socket.socket, handle, forgets: list) -> Connection:
    conn = Connection(server.fileno())
    await conn.serve(handle, forgets.extend, waits=frozenset({p.Op.GETATTR}), max_tasks=8)
    return conn


def test_requests_are_answered_by_unique_an_interrupt_cancels_a_waiting_one_and_destroy_ends(pair):
    kernel, server = pair
    forgets: list = []
    trio.run(_interrupt_and_destroy, kernel, server, forgets)
    assert forgets == [(33, 2), (5, 1), (6, 3)]


async def _interrupt_and_destroy(kernel: socket.socket, server: socket.socket, forgets: list) -> None:
    started = trio.Event()

    async def handle(r: p.Request):
        if r.opcode == p.Op.GETATTR:
            started.set()
            await trio.sleep_forever()  # a request waiting on the store
        if r.opcode == p.Op.STATFS:
            raise FuseError(errno.ENOSYS)
        return (b"x" * 10, memoryview(b"yz"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(_serve, server, handle, forgets)
        kernel.send(request(p.Op.GETATTR, 7))
        await started.wait()
        kernel.send(request(p.Op.LOOKUP, 8, arg=b"name\0"))
        assert await trio.to_thread.run_sync(reply, kernel) == (8, 0, b"x" * 10 + b"yz")
        kernel.send(request(p.Op.STATFS, 9))
        assert await trio.to_thread.run_sync(reply, kernel) == (9, -errno.ENOSYS, b"")
        kernel.send(request(p.Op.FORGET, 0, 33, struct.pack("<Q", 2)))
        kernel.send(request(p.Op.BATCH_FORGET, 0, 0, struct.pack("<II", 2, 0) + struct.pack("<QQQQ", 5, 1, 6, 3)))
        kernel.send(request(p.Op.INTERRUPT, 10, 0, struct.pack("<Q", 7)))
        assert await trio.to_thread.run_sync(reply, kernel) == (7, -errno.EINTR, b"")
        kernel.send(request(p.Op.DESTROY, 11))
        assert await trio.to_thread.run_sync(reply, kernel) == (11, 0, b"")


def test_a_reply_the_kernel_refuses_is_answered_eio_and_the_loop_goes_on(pair, monkeypatch):
    kernel, server = pair
    conn = Connection(server.fileno())
    trio.run(_refused_reply, kernel, conn, monkeypatch)
    assert conn.ended


async def _refused_reply(kernel: socket.socket, conn: Connection, monkeypatch) -> None:
    real_write = conn._write

    def write(parts):
        if len(parts) > 2:  # a kernel that takes no reply in more than two parts (as /dev/fuse past IOV_MAX)
            raise OSError(errno.EINVAL, "Invalid argument")
        real_write(parts)

    monkeypatch.setattr(conn, "_write", write)

    async def handle(r: p.Request):
        return (b"a", b"b") if r.opcode == p.Op.READDIRPLUS else (b"ok",)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(conn.serve, handle, lambda pairs: None)
        kernel.send(request(p.Op.READDIRPLUS, 3))
        assert await trio.to_thread.run_sync(reply, kernel) == (3, -errno.EIO, b"")
        kernel.send(request(p.Op.GETATTR, 4))
        assert await trio.to_thread.run_sync(reply, kernel) == (4, 0, b"ok")
        kernel.shutdown(socket.SHUT_WR)  # the connection ends: the loop returns


def test_the_loop_ends_when_the_kernel_ends_the_connection(pair):
    kernel, server = pair

    async def handle(r: p.Request):
        return ()

    conn = Connection(server.fileno())

    async def main() -> None:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(conn.serve, handle, lambda pairs: None)
                kernel.close()

    trio.run(main)
    assert conn.ended
