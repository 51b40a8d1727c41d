"""A node's one peer port (fusecore/cluster/router.py) over real sockets: each connection reaches the mount of the
cache its path names, with the bytes exact; one cache's key opens no other cache's blocks; an unknown cache,
a mount that is gone, a malformed or silent connection are answered (a miss for the asker) and never stall
the router; a flood of silent connections sheds its own oldest ones, never an asker that sends its request line,
and holds few descriptors."""

from __future__ import annotations

import errno
import os
import socket
import time

import pytest
import trio

from fusecore.cluster.router import PeerRouter
from fusecore.cluster.peers import BlockAsk, PeerClient, PeerServer, PeerTimeouts, cache_prefix

SLACK = PeerTimeouts(connect=10, first_byte=10, body=20)
A, B = "a" * 32, "b" * 32  # two caches' ids
KEY_A, KEY_B = b"key-of-cache-a-tenant-1", b"key-of-cache-b-tenant-2"
BLOCK_A, BLOCK_B = os.urandom(1_500_001), os.urandom(700_000)


def mount(tmp_path, cache: str, key: bytes, blocks: dict) -> tuple[PeerServer, str]:
    """A mount's peer server taking the connections the router hands to its unix socket."""
    handoff = str(tmp_path / f"{cache[:4]}.peer")
    server = PeerServer(None, key, lambda want: blocks.get((want.key, want.etag, want.index)), prefix=cache_prefix(cache)).receive(handoff).start()
    return server, handoff


@pytest.fixture
def node(tmp_path):
    router = PeerRouter(("127.0.0.1", 0)).start()
    a, a_path = mount(tmp_path, A, KEY_A, {("x", "e1", 0): BLOCK_A})
    b, b_path = mount(tmp_path, B, KEY_B, {("x", "e1", 0): BLOCK_B})
    router.route(A, a_path)
    router.route(B, b_path)
    yield router, a, b
    router.close()
    a.close()
    b.close()


def here(router) -> str:
    return f"{router.address[0]}:{router.address[1]}"


def test_each_cache_s_requests_reach_its_own_mount_with_the_bytes_exact(node):
    router, a, b = node
    for _ in range(3):  # several connections each: every one is handed over and answered
        assert trio.run(PeerClient(KEY_A, SLACK, prefix=cache_prefix(A)).ask, here(router), BlockAsk.block("x", "e1", 0, len(BLOCK_A))) \
            == ("hit", BLOCK_A)
        assert trio.run(PeerClient(KEY_B, SLACK, prefix=cache_prefix(B)).ask, here(router), BlockAsk.block("x", "e1", 0, len(BLOCK_B))) \
            == ("hit", BLOCK_B)
    assert (a.served, b.served, router.handed) == (3, 3, 6)


def test_one_cache_s_key_opens_no_other_cache_s_blocks(node):
    router, a, b = node
    intruder = PeerClient(KEY_B, SLACK, prefix=cache_prefix(A))  # tenant 2's key, asking cache A's mount
    assert trio.run(intruder.ask, here(router), BlockAsk.block("x", "e1", 0, len(BLOCK_A))) == ("failed", None)
    assert a.refused == 1 and a.served == 0
    # A request signed for cache B, with its path rewritten to A's prefix: A's mount checks A's key.
    plain = PeerClient(KEY_B, SLACK, prefix="")  # no prefix: the router cannot route it at all
    assert trio.run(plain.ask, here(router), BlockAsk.block("x", "e1", 0, len(BLOCK_B))) == ("failed", None)
    assert router.malformed == 1


def test_an_unknown_cache_or_a_gone_mount_is_a_miss_not_a_failure(node, tmp_path):
    router, a, b = node
    client = PeerClient(KEY_A, SLACK, prefix=cache_prefix("c" * 32))
    assert trio.run(client.ask, here(router), BlockAsk.block("x", "e1", 0, 10)) == ("miss", None)
    assert router.unknown == 1 and not client.avoided(here(router))
    a.close()  # the mount of cache A stopped (killed, or released): its socket is gone
    client = PeerClient(KEY_A, SLACK, prefix=cache_prefix(A))
    for _ in range(3):  # the router's answer closes the connection: the next ask opens a new one
        assert trio.run(client.ask, here(router), BlockAsk.block("x", "e1", 0, len(BLOCK_A))) == ("miss", None)
    assert router.unreachable == 3 and not client.failures
    router.unroute(B)
    assert trio.run(PeerClient(KEY_B, SLACK, prefix=cache_prefix(B)).ask, here(router), BlockAsk.block("x", "e1", 0, 5)) == ("miss", None)


def test_silent_and_slow_connections_do_not_stall_the_router(tmp_path):
    router = PeerRouter(("127.0.0.1", 0), peek_timeout=0.5, max_waiting=4).start()
    a, a_path = mount(tmp_path, A, KEY_A, {("x", "e1", 0): BLOCK_A})
    router.route(A, a_path)
    try:
        silent = [socket.create_connection(router.address) for _ in range(4)]  # the bound reached
        extra = socket.create_connection(router.address)
        silent[0].settimeout(5)
        assert silent[0].recv(100).startswith(b"HTTP/1.1 503")  # over the bound: the oldest silent one is shed
        started = time.monotonic()
        for s in [*silent[1:], extra]:
            s.settimeout(5)
            assert s.recv(100).startswith(b"HTTP/1.1 400")  # no request line in time: answered and closed
        assert time.monotonic() - started < 3
        assert (router.shed, router.expired, router.busy) == (1, 4, 0)
        # A request line sent in pieces is still routed.
        client = PeerClient(KEY_A, SLACK, prefix=cache_prefix(A))
        assert trio.run(client.ask, here(router), BlockAsk.block("x", "e1", 0, len(BLOCK_A))) == ("hit", BLOCK_A)
        slow = socket.create_connection(router.address)
        slow.sendall(b"GET /c/" + A.encode())
        time.sleep(0.2)
        slow.sendall(b"/v1/block?key=x HTTP/1.1\r\n\r\n")
        slow.settimeout(5)
        assert slow.recv(100).startswith(b"HTTP/1.1 401")  # reached the mount, which wants a signature
        for s in [*silent, extra, slow]:
            s.close()
    finally:
        router.close()
        a.close()


def test_a_kept_alive_connection_is_handed_over_once_and_carries_the_next_requests(node):
    router, a, b = node
    client = PeerClient(KEY_A, SLACK, prefix=cache_prefix(A))
    for _ in range(4):
        assert trio.run(client.ask, here(router), BlockAsk.block("x", "e1", 0, len(BLOCK_A))) == ("hit", BLOCK_A)
    assert (router.handed, a.connections, a.served) == (1, 1, 4)
    client.close()


def inbox(tmp_path) -> tuple[socket.socket, str]:
    """A mount's handoff socket, read by the test itself: what the router hands over arrives here."""
    path = str(tmp_path / "inbox.peer")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(10)
    return sock, path


def taken(sock: socket.socket) -> bytes:
    """The next connection handed to `sock`, read from its first byte (the router consumed nothing)."""
    _, fds, _, _ = socket.recv_fds(sock, 16, 1)
    with socket.socket(fileno=fds[0]) as conn:
        conn.settimeout(10)
        return conn.recv(4096)


def connect_from(source: str, router) -> socket.socket:
    return socket.create_connection(router.address, timeout=10, source_address=(source, 0))


def settles(check, within=10.0) -> bool:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def closed(sock: socket.socket) -> bool:
    """The router closed it: anything it said (a 503) then the end, or a reset."""
    sock.settimeout(10)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


def test_a_flood_of_silent_connections_refuses_no_prompt_asker_and_holds_few_descriptors(tmp_path):
    box, path = inbox(tmp_path)
    router = PeerRouter(("127.0.0.1", 0), peek_timeout=60).start()  # no silent one times out here: only bounds shed
    router.route(A, path)
    base = len(os.listdir("/proc/self/fd"))
    flood, held = [], []
    try:
        for i in range(300):  # silent connections from two sources, an asker from a third between them
            flood.append(connect_from("127.0.0.2" if i % 5 == 4 else "127.0.0.1", router))
            if i % 10 == 9:
                line = (f"GET /c/{A}/v2/hello?r={os.urandom(8).hex()} HTTP/1.1\r\n" if i % 20 == 9 else
                        f"GET /c/{A}/v1/block?key=x&etag=e&index={i} HTTP/1.1\r\n").encode()
                with connect_from("127.0.0.3", router) as asker:
                    asker.sendall(line + b"Host: x\r\n\r\n")
                    assert taken(box) == line + b"Host: x\r\n\r\n"  # handed over, not one byte consumed
                held.append(len(os.listdir("/proc/self/fd")) - base - len(flood))
        assert router.handed == 30 and (router.busy, router.unreachable, router.malformed) == (0, 0, 0)
        # The router holds at most its per-source bound of each flooding source (the flood's own sockets aside).
        assert max(held) <= 2 * router.max_per_source + 4, held
        assert settles(lambda: router.shed == 300 - 2 * router.max_per_source), router.shed
    finally:
        for s in flood:
            s.close()
        router.close()
        box.close()


def test_the_per_source_bound_sheds_that_source_s_oldest_silent_connections_only(tmp_path):
    box, path = inbox(tmp_path)
    router = PeerRouter(("127.0.0.1", 0), peek_timeout=60, max_per_source=3).start()
    router.route(A, path)
    try:
        other = connect_from("127.0.0.2", router)
        mine = [connect_from("127.0.0.1", router) for _ in range(5)]
        assert settles(lambda: router.shed == 2)
        assert closed(mine[0]) and closed(mine[1])  # the source's two oldest
        for s in [other, *mine[2:]]:  # the others are still awaited: nothing said, not closed
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
            s.settimeout(10)
        for s in (other, mine[4]):  # and still routed once they speak
            s.sendall(f"GET /c/{A}/v1/block?key=x HTTP/1.1\r\n\r\n".encode())
            assert taken(box).startswith(f"GET /c/{A}/".encode())
        assert (router.shed, router.handed) == (2, 2)
        for s in [other, *mine]:
            s.close()
    finally:
        router.close()
        box.close()


class OutOfDescriptors:
    """The router's listener, out of descriptors until `until` (monotonic): counts the tries."""

    def __init__(self, listener: socket.socket, until: float):
        self.listener, self.until, self.tries = listener, until, 0

    def __getattr__(self, name):
        return getattr(self.listener, name)

    def accept(self):
        self.tries += 1
        if time.monotonic() < self.until:
            raise OSError(errno.EMFILE, "Too many open files")
        return self.listener.accept()


def test_out_of_descriptors_the_router_backs_off_then_accepts_again(tmp_path):
    box, path = inbox(tmp_path)
    router = PeerRouter(("127.0.0.1", 0))
    router.route(A, path)
    listener = router._listener = OutOfDescriptors(router._listener, time.monotonic() + 0.5)
    router.start()
    try:
        with socket.create_connection(router.address, timeout=10) as asker:
            asker.sendall(f"GET /c/{A}/v1/block?key=x HTTP/1.1\r\n\r\n".encode())
            assert taken(box).startswith(f"GET /c/{A}/".encode())  # accepted once descriptors are back
        assert listener.tries < 20  # a few tries a second, not a busy loop
    finally:
        router.close()
        box.close()


def test_a_connection_handed_over_after_being_watched_leaves_the_router_idle(tmp_path):
    box, path = inbox(tmp_path)
    router = PeerRouter(("127.0.0.1", 0))
    router.route(A, path)
    selects = []
    select = router._selector.select
    router._selector.select = lambda timeout=None: selects.append(timeout) or select(timeout)
    router.start()
    try:
        with socket.create_connection(router.address, timeout=10) as asker:
            asker.sendall(b"GET /c/")
            assert settles(lambda: len(router._waiting) == 1)  # accepted before its line came: watched
            asker.sendall(f"{A}/v1/block?key=x HTTP/1.1\r\n\r\n".encode())
            _, fds, _, _ = socket.recv_fds(box, 16, 1)
            with socket.socket(fileno=fds[0]):  # the mount holds the connection, its request unread
                selects.clear()
                time.sleep(0.3)
                assert len(selects) < 20  # nothing left watched: the router waits, it does not spin
    finally:
        router.close()
        box.close()
