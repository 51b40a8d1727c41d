"""A node's one peer port (fusecore/peer_router.py) over real sockets: each connection reaches the mount of the
cache its path names, with the bytes exact; one cache's key opens no other cache's blocks; an unknown cache,
a mount that is gone, a malformed or silent connection are answered (a miss for the asker) and never stall
the router."""

from __future__ import annotations

import os
import socket
import time

import pytest
import trio

from fusecore.peer_router import PeerRouter
from fusecore.peers import BlockAsk, PeerClient, PeerServer, PeerTimeouts, cache_prefix

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
        silent = [socket.create_connection(router.address) for _ in range(4)]  # every slot taken
        time.sleep(0.1)
        extra = socket.create_connection(router.address)
        extra.settimeout(5)
        assert extra.recv(100).startswith(b"HTTP/1.1 503")  # over the bound: told at once
        started = time.monotonic()
        for s in silent:
            s.settimeout(5)
            assert s.recv(100).startswith(b"HTTP/1.1 400")  # no request line in time: answered and closed
        assert time.monotonic() - started < 3
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
