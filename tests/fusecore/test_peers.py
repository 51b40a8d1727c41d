"""The peer protocol of a distributed cache (fusecore/cluster/peers.py) over real HTTP on loopback: a peer can make a
read slower, never make it fail or return other bytes; and what crosses the network is sealed (seal.py)."""

from __future__ import annotations

import contextlib
import http.server
import os
import socket
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import Future
from typing import Callable

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusecore.cluster.peers import FETCHING, HELD, BlockAsk, PeerClient, PeerServer, PeerTimeouts, ask_target, hello_target
from fusecore.cluster.seal import Session, fresh_random
from tests.support.tamper import TamperProxy

KEY = b"cache-key-of-tenant-a"
BLOCK = os.urandom(1_000_003)
SECRET = os.urandom(150_000)


class Held:
    """What one node holds: (key, etag, index) -> bytes."""

    def __init__(self):
        self.blocks = {("train/shard-0.tar", "etag-1", 2): BLOCK}

    def __call__(self, want):
        return self.blocks.get((want.key, want.etag, want.index))


@pytest.fixture
def server():
    s = PeerServer(("127.0.0.1", 0), KEY, Held()).start()
    yield s
    s.close()


def addr(server) -> str:
    return f"{server.address[0]}:{server.address[1]}"


SLACK = PeerTimeouts(connect=10, first_byte=10, body=20)  # correctness tests; the bounds are tested below


def test_a_held_block_is_served_exactly_to_a_member(server):
    client = PeerClient(KEY, SLACK)
    assert trio.run(client.fetch, addr(server), BlockAsk.block("train/shard-0.tar", "etag-1", 2, len(BLOCK))) == BLOCK
    assert server.served == 1


def test_another_version_or_a_block_not_held_is_not_served_and_is_no_failure(server):
    client = PeerClient(KEY, SLACK)
    assert trio.run(client.fetch, addr(server), BlockAsk.block("train/shard-0.tar", "etag-2", 2, len(BLOCK))) is None
    assert trio.run(client.ask, addr(server), BlockAsk.block("train/shard-0.tar", "etag-1", 3, len(BLOCK))) == ("miss", None)
    assert server.missed == 2 and not client.failures and not client.avoided(addr(server))
    assert trio.run(client.ask, addr(server), BlockAsk.block("train/shard-0.tar", "etag-1", 2, len(BLOCK))) == ("hit", BLOCK)


def test_a_request_without_the_caches_key_is_refused(server):
    other_tenant = PeerClient(b"cache-key-of-tenant-b", SLACK)
    assert trio.run(other_tenant.ask, addr(server), BlockAsk.block("train/shard-0.tar", "etag-1", 2, len(BLOCK))) == (
        "failed", None)
    assert other_tenant.avoided(addr(server)) and server.refused == 1 and server.served == 0
    # an ask sealed with another key, sent by hand on a connection that said hello: 401, closed
    mine = fresh_random()
    with socket.create_connection(server.address, timeout=5) as s:
        s.sendall(f"GET {hello_target('', mine)} HTTP/1.1\r\n\r\n".encode())
        hello = _head_of(s)
        theirs = bytes.fromhex(hello.split(b"X-Stoker-Hello: ")[1].split(b"\r\n")[0].decode())
        forged = Session(b"cache-key-of-tenant-b", mine, theirs).seal_ask(b"key=train/shard-0.tar&etag=etag-1")
        s.sendall(f"GET {ask_target('', forged)} HTTP/1.1\r\n\r\n".encode())
        assert _rest(s).startswith(b"HTTP/1.1 401 ")
    assert server.refused == 2 and server.served == 0


def _head_of(s: socket.socket) -> bytes:
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = s.recv(4096)
        assert chunk, got
        got += chunk
    return got


def _rest(s: socket.socket) -> bytes:
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    return got


def test_nothing_is_served_without_a_key():
    with pytest.raises(ValueError):
        PeerServer(("127.0.0.1", 0), b"", Held())


@pytest.mark.parametrize("where", ["hello", "head", "bytes", "tag"])
def test_a_byte_altered_on_the_wire_is_a_failed_ask_never_other_bytes(server, where):
    """A node on the path flips one byte of what the owner sends (its random at the hello, the answer's head, a
    byte of the block, the seal's tag): the ask fails (the caller reads the store) and the peer is avoided."""
    want = BlockAsk.block("train/shard-0.tar", "etag-1", 2, len(BLOCK))
    clean = TamperProxy(server.address)
    assert trio.run(PeerClient(KEY, SLACK).ask, clean.peer, want) == ("hit", BLOCK)
    stream = bytes(clean.answered)
    clean.close()
    answer = stream.index(b"HTTP/1.1 200", 10)  # the ask's answer, after the hello's
    offsets = {"hello": stream.index(b"X-Stoker-Hello: ") + 20, "head": answer + 3,
               "bytes": answer + len(stream[answer:]) // 2, "tag": len(stream) - 12}
    proxy = TamperProxy(server.address)
    proxy.flip = offsets[where]
    client = PeerClient(KEY, SLACK)
    assert trio.run(client.ask, proxy.peer, want) == ("failed", None)
    assert proxy.flipped == 1 and client.failures[proxy.peer] == 1 and client.avoided(proxy.peer)
    proxy.close()


def test_a_capture_of_peer_traffic_holds_no_run_of_a_blocks_bytes_nor_the_asks(server):
    """Everything both ends send, recorded on the path: no 64-byte run of a block's plaintext, and neither the
    object's key nor its ETag (the asks are sealed too; only the cache's routing line is plain)."""
    server.lookup.blocks[("train/secret-name.tar", "etag-secret", 0)] = SECRET
    proxy = TamperProxy(server.address)
    client = PeerClient(KEY, SLACK)
    for _ in range(3):
        assert trio.run(client.ask, proxy.peer, BlockAsk.block("train/secret-name.tar", "etag-secret", 0,
                                                                len(SECRET))) == ("hit", SECRET)
    proxy.close()
    seen = bytes(proxy.answered) + bytes(proxy.asked)
    assert len(seen) > 3 * len(SECRET)
    # Any 64-byte run of SECRET holds one of its 32-byte pieces at a multiple of 32: look for every piece.
    pieces = {SECRET[i:i + 32] for i in range(0, len(SECRET) - 31, 32)}
    assert not any(seen[i:i + 32] in pieces for i in range(len(seen) - 31))
    assert b"secret-name" not in seen and b"etag-secret" not in seen


def test_a_captured_ask_replayed_is_refused(server):
    """An ask recorded on the path and sent again, on a new connection (hello and all) or on the same one, does
    not open: the owner's random and the ask's count are part of its seal."""
    want = BlockAsk.block("train/shard-0.tar", "etag-1", 2, len(BLOCK))
    proxy = TamperProxy(server.address)
    assert trio.run(PeerClient(KEY, SLACK).ask, proxy.peer, want) == ("hit", BLOCK)
    proxy.close()
    captured = bytes(proxy.requests[0])
    assert captured.count(b"GET ") == 2  # the hello and the ask
    answer = _raw(server, captured)
    assert answer.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 401 " in answer and BLOCK[:64] not in answer
    assert server.refused == 1 and server.served == 1
    # the same ask twice on one connection: the second is a replay
    mine = fresh_random()
    with socket.create_connection(server.address, timeout=5) as s:
        s.sendall(f"GET {hello_target('', mine)} HTTP/1.1\r\n\r\n".encode())
        theirs = bytes.fromhex(_head_of(s).split(b"X-Stoker-Hello: ")[1].split(b"\r\n")[0].decode())
        line = f"GET {ask_target('', Session(KEY, mine, theirs).seal_ask(want.query().encode()))} HTTP/1.1\r\n\r\n"
        s.sendall(line.encode() * 2)
        rest = _rest(s)
    assert rest.count(b"HTTP/1.1 200 ") == 1 and rest.endswith(b"Content-Length: 0\r\nX-Stoker-Protocol: v2\r\n"
                                                                  b"Connection: close\r\n\r\n")
    assert server.refused == 2 and server.served == 2


def test_a_stalled_peer_costs_a_bounded_wait_then_is_avoided_and_later_tried_again():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections, never answers
    peer = f"127.0.0.1:{silent.getsockname()[1]}"
    now = [1000.0]
    client = PeerClient(KEY, PeerTimeouts(connect=0.2, first_byte=0.3, body=1.0), avoid=30, clock=lambda: now[0])
    try:
        started = time.monotonic()
        assert trio.run(client.fetch, peer, BlockAsk.block("k", "e", 0, 10)) is None
        assert time.monotonic() - started < 3, "bounded by the first-byte timeout (0.3 s), not the owner's 10 s"
        assert trio.run(client.ask, peer, BlockAsk.block("k", "e", 0, 10)) == ("avoided", None), "not asked again"
        assert client.failures[peer] == 1
        now[0] += 31
        assert not client.avoided(peer)
        assert trio.run(client.fetch, peer, BlockAsk.block("k", "e", 0, 10)) is None and client.failures[peer] == 2, "tried again"
    finally:
        silent.close()


def test_a_refused_connection_is_a_quick_failure():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    client = PeerClient(KEY)
    started = time.monotonic()
    assert trio.run(client.fetch, f"127.0.0.1:{port}", BlockAsk.block("k", "e", 0, 10)) is None
    assert time.monotonic() - started < 2 and client.avoided(f"127.0.0.1:{port}")


def test_a_busy_peer_answers_503_at_once_and_is_not_avoided():
    gate = threading.Event()

    def slow(want):  # read through: the answer comes once the gate opens (a lookup itself never blocks)
        pending = Future()
        threading.Thread(target=lambda: gate.wait(10) and pending.set_result(BLOCK), daemon=True).start()
        return pending

    s = PeerServer(("127.0.0.1", 0), KEY, slow, max_clients=1).start()
    try:
        first = threading.Thread(target=trio.run, args=(PeerClient(KEY, SLACK).fetch, addr(s),
                                                        BlockAsk.block("train/shard-0.tar", "etag-1", 2, len(BLOCK))))
        first.start()
        deadline = time.monotonic() + 5
        while not s.answering and time.monotonic() < deadline:  # the first request holds the only slot
            time.sleep(0.01)
        client = PeerClient(KEY, SLACK)
        assert trio.run(client.fetch, addr(s), BlockAsk.block("train/shard-0.tar", "etag-1", 2, len(BLOCK))) is None
        assert s.busy == 1 and not client.avoided(addr(s)) and not client.failures
        gate.set()
        first.join(10)
        assert s.served == 1
    finally:
        gate.set()
        s.close()


def test_a_block_handed_over_from_disk_is_answered_as_held_and_one_the_disk_lacks_as_a_miss():
    """A HandOver (a former owner's disk read for the block's new owner) answers HELD, or MISS where the read found
    nothing or other bytes: never counted as read through, never a failure that would make the asker avoid it."""
    from fusecore.cluster.peers import HAND_OVER_WAIT, HandOver

    def from_disk(want):
        handing = HandOver()
        if want.index == 5:
            return handing  # a disk read that never ends: MISS after HAND_OVER_WAIT
        body = BLOCK if want.index == 2 else (BLOCK[:10] if want.index == 3 else None)
        threading.Thread(target=lambda: (time.sleep(0.05), handing.set_result(body)), daemon=True).start()
        return handing

    s = PeerServer(("127.0.0.1", 0), KEY, from_disk).start()
    try:
        client = PeerClient(KEY, SLACK)
        asks = [BlockAsk.block("train/shard-0.tar", "etag-1", i, len(BLOCK), through=False) for i in (2, 3, 4)]
        assert [trio.run(client.ask, addr(s), ask) for ask in asks] == [("hit", BLOCK), ("miss", None), ("miss", None)]
        started = time.monotonic()
        stuck = BlockAsk.block("train/shard-0.tar", "etag-1", 5, len(BLOCK), through=False)
        assert trio.run(client.ask, addr(s), stuck) == ("miss", None)
        assert time.monotonic() - started < HAND_OVER_WAIT + 2, "a stuck disk read holds its asker 1 s, not 3"
        assert (s.served, s.missed, s.through, s.through_failed) == (1, 3, 0, 0)
        assert not client.failures and not client.avoided(addr(s))
    finally:
        s.close()


def test_an_asker_keeps_its_connection_and_a_closed_idle_one_costs_no_failure():
    """Keep-alive: several blocks ride one connection (a connection and a server thread per block cost about as
    much CPU as a 100 KB block). A peer that closed the idle connection meanwhile is asked again on a new one,
    which is neither a failure nor a miss."""
    s = PeerServer(("127.0.0.1", 0), KEY, Held(), idle_timeout=0.3).start()
    try:
        client = PeerClient(KEY, SLACK)
        for _ in range(3):
            assert trio.run(client.ask, addr(s), BlockAsk.block("train/shard-0.tar", "etag-1", 2, len(BLOCK))) == ("hit", BLOCK)
        assert trio.run(client.ask, addr(s), BlockAsk.block("train/shard-0.tar", "etag-1", 3, len(BLOCK))) == ("miss", None)  # a 404 keeps it
        assert (s.served, s.connections) == (3, 1)
        time.sleep(0.8)  # the server closes the idle connection
        assert trio.run(client.ask, addr(s), BlockAsk.block("train/shard-0.tar", "etag-1", 2, len(BLOCK))) == ("hit", BLOCK)
        assert s.connections == 2 and not client.failures and not client.avoided(addr(s))
        # A wrong answer closes the connection (it is never reused after a failure).
        other = PeerClient(KEY, SLACK)
        assert trio.run(other.ask, addr(s), BlockAsk.block("train/shard-0.tar", "etag-1", 2, len(BLOCK) + 1)) == ("failed", None)
        assert other._idle.take(addr(s)) is None
        client.close()
    finally:
        s.close()


def test_anything_unexpected_while_asking_a_peer_is_a_failure_never_an_error_for_the_read(server, monkeypatch):
    """Whatever goes wrong inside the asking (a bug of ours included), the caller gets a failure and reads the
    store: an exception escaping here would reach the reader as EIO."""
    client = PeerClient(KEY, SLACK)

    async def broken(*args):
        raise RuntimeError("a bug in the asking")

    monkeypatch.setattr(client, "_get", broken)
    assert trio.run(client.ask, addr(server), BlockAsk.block("train/shard-0.tar", "etag-1", 2, len(BLOCK))) == ("failed", None)
    assert client.avoided(addr(server))


class Owner:
    """An owner that does not hold the bytes but reads them through: a Future its 'GET' completes later."""

    def __init__(self, delay: float, fail: bool = False):
        self.delay, self.fail, self.asks = delay, fail, []

    def __call__(self, want):
        self.asks.append(want)
        pending = Future()

        def finish():
            if self.fail:
                pending.set_exception(RuntimeError("the owner's store said no"))
            else:
                pending.set_result(BLOCK[:want.length])

        threading.Timer(self.delay, finish).start()
        return pending


TIGHT = PeerTimeouts(connect=1, first_byte=0.3, body=5)  # a silence of 0.3 s is an owner gone


def test_an_owner_reads_through_beating_meanwhile_and_the_connection_carries_the_next_ask():
    from fusecore.metrics import MountMetrics

    owner = Owner(delay=0.8)  # longer than the first-byte bound: only the beats keep the asker waiting
    metrics = MountMetrics()
    s = PeerServer(("127.0.0.1", 0), KEY, owner, metrics=metrics).start()
    try:
        client = PeerClient(KEY, TIGHT)
        want = BlockAsk.block("train/shard-0.tar", "etag-1", 2, len(BLOCK))
        assert trio.run(client.ask, addr(s), want) == ("through", BLOCK)
        assert owner.asks[-1] == want and owner.asks[-1].through
        assert trio.run(client.ask, addr(s), BlockAsk.block("train/shard-0.tar", "etag-1", 2, 1000)) == ("through", BLOCK[:1000])
        assert (s.through, s.served, s.connections) == (2, 2, 1) and not client.failures
        assert metrics.value(metrics.peer_read_through, outcome="served") == 2
    finally:
        s.close()


def test_a_read_through_whose_bytes_come_within_a_beat_is_answered_in_one_write(monkeypatch):
    """Most read-throughs end before the first beat: the head then goes with the bytes, one write and one wake of
    the asker, not a head and then the bytes. (The beat is made long here, so a loaded machine cannot make the
    owner's 'GET' of 0.05 s outlast it; the beats themselves are tested above.)"""
    from fusecore.cluster import peers

    writes: list[bytes] = []
    send = peers._send

    async def counted(sock, *parts, **kwargs):
        writes.append(bytes(parts[0][:9]))
        await send(sock, *parts, **kwargs)

    monkeypatch.setattr(peers, "_send", counted)
    monkeypatch.setattr(peers, "HEARTBEAT", 5.0)
    s = PeerServer(("127.0.0.1", 0), KEY, Owner(delay=0.05)).start()
    try:
        client = PeerClient(KEY, SLACK)
        assert trio.run(client.ask, addr(s), BlockAsk.block("train/shard-0.tar", "etag-1", 2, len(BLOCK))) == (
            "through", BLOCK)
        assert writes == [b"HTTP/1.1 ", b"HTTP/1.1 "], "the hello; then the head and the sealed bytes in one write"
    finally:
        s.close()


def test_an_owner_whose_own_get_fails_is_a_miss_not_a_failure():
    s = PeerServer(("127.0.0.1", 0), KEY, Owner(delay=0.2, fail=True)).start()
    try:
        client = PeerClient(KEY, TIGHT)
        assert trio.run(client.ask, addr(s), BlockAsk.block("k", "e", 0, 10)) == ("miss", None)
        assert s.through_failed == 1 and not client.failures and not client.avoided(addr(s))
        assert client._idle.take(addr(s)) is not None, "the answer ended cleanly: the connection is kept"
    finally:
        s.close()


def _keyed_owner(answer) -> tuple[str, Callable[[], None]]:
    """An owner with the key on a socket of its own: it says hello, reads one ask and sends `answer(session, conn)`;
    its address and what closes it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    held = []

    def serve():
        conn, _ = listener.accept()
        held.append(conn)
        hello = conn.recv(65536)
        asker = bytes.fromhex(hello.split(b"?r=")[1].split(b" ")[0].decode())
        mine = fresh_random()
        conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nX-Stoker-Hello: {mine.hex()}\r\n\r\n".encode())
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        with contextlib.suppress(OSError):
            answer(Session(KEY, asker, mine), conn)

    def close():
        listener.close()
        for conn in held:
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{listener.getsockname()[1]}", close


def test_an_owner_that_goes_silent_while_reading_through_is_given_up_within_the_bound():
    """It answered that it fetches and beat once, then stopped (SIGSTOP, a hung host): the asker does not
    wait for it past the first-byte bound, and avoids it."""
    def one_beat(session, conn):
        beat = session.seal_answer(FETCHING)
        conn.sendall(f"{1 + len(beat):x}\r\n".encode() + FETCHING + beat + b"\r\n")

    peer, close = _keyed_owner(one_beat)
    client = PeerClient(KEY, TIGHT)
    try:
        started = time.monotonic()
        assert trio.run(client.ask, peer, BlockAsk.block("k", "e", 0, 10)) == ("failed", None)
        assert time.monotonic() - started < 2.5, "bounded by the silence (0.3 s), not by the owner's wait (3 s and more)"
        assert client.avoided(peer)
    finally:
        close()


def test_a_sealed_block_trickled_byte_by_byte_is_given_up_within_the_body_bound():
    """An owner (or a node on the path) that sends a block's frame a byte at a time, each within the first-byte
    bound, is given up once the body bound is past in all, not at its first silence: the reader goes to the
    store within its time instead of waiting out its read deadline."""
    stop = threading.Event()

    def trickle(session, conn):
        conn.sendall(f"{1 + 100_000 + 16:x}\r\n".encode() + HELD)
        while not stop.wait(0.05):
            conn.sendall(b"x")

    peer, close = _keyed_owner(trickle)
    client = PeerClient(KEY, PeerTimeouts(connect=1, first_byte=0.3, body=1.0))
    try:
        started = time.monotonic()
        assert trio.run(client.ask, peer, BlockAsk.block("k", "e", 0, 100_000)) == ("failed", None)
        assert time.monotonic() - started < 4, "bounded by the body bound (1 s), not by each silence (0.3 s)"
    finally:
        stop.set()
        close()


def test_an_ask_round_trips_and_one_outside_the_object_or_the_dataset_is_refused():
    from fusecore.cluster.tier import check_ask

    want = BlockAsk("train/a b&c.jpg", "e1", 3, 3 * 4096 + 10, 3 * 4096 + 20, 5 * 4096, through=False)
    query = want.query()
    assert BlockAsk.parse(query) == want and "held=1" in query
    with pytest.raises(ValueError):
        BlockAsk.parse("key=k&etag=e&index=0&start=10&stop=5&size=100")  # nothing asked
    with pytest.raises(ValueError):
        BlockAsk.parse("key=k&etag=e&index=0&start=0&stop=101&size=100")  # past the object
    check_ask(want, 4096, "train/")
    with pytest.raises(ValueError, match="not inside block"):
        check_ask(want, 8192, "train/")  # another block size: the bytes are not inside block 3
    with pytest.raises(ValueError, match="outside this cache's dataset"):
        check_ask(want, 4096, "val/")
    for sneaky in ("train/../secret/x.jpg", "train/./x.jpg", "train/a/.."):  # a store that normalises paths
        with pytest.raises(ValueError, match="segment"):
            check_ask(BlockAsk.block(sneaky, "e1", 0, 10), 4096, "train/")


def test_a_refused_ask_is_answered_400_and_fetches_nothing():
    def refuse(want):
        raise ValueError("an object outside this cache's dataset")

    s = PeerServer(("127.0.0.1", 0), KEY, refuse).start()
    try:
        assert trio.run(PeerClient(KEY, SLACK).ask, addr(s), BlockAsk.block("secret/other", "e", 0, 10)) == ("failed", None)
        assert s.served == s.through == 0
    finally:
        s.close()


def _raw(server, data: bytes) -> bytes:
    """What the server answers to `data` sent on a fresh connection, up to its close."""
    with socket.create_connection(server.address, timeout=5) as s:
        s.sendall(data)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    return got


def test_what_is_not_the_protocols_http_is_answered_400_and_the_connection_closed(server):
    """The server parses requests itself (wire.Wire): anything but a bodiless GET of HTTP/1.x, with well-formed
    headers and a head of at most MAX_HEAD bytes, is told 400 and closed, before any key is used."""
    from fusecore.store.wire import MAX_HEAD

    target = hello_target("", fresh_random())
    for bad in (f"POST {target} HTTP/1.1\r\n\r\n", f"GET {target} HTTP/2.0\r\n\r\n",
                f"GET {target} HTTP/1.1\r\nno colon here\r\n\r\n",
                f"GET {target} HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello",
                f"GET {target} HTTP/1.1\r\nX-Pad: {'a' * MAX_HEAD}\r\n\r\n",
                f"GET {target[:-2]} HTTP/1.1\r\n\r\n", "GET /v2/elsewhere HTTP/1.1\r\n\r\n"):
        assert _raw(server, bad.encode()).startswith(b"HTTP/1.1 400 "), bad[:40]
    answer = _raw(server, f"GET {target} HTTP/1.1\r\nConnection: close\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 200 ") and b"X-Stoker-Hello: " in answer, "a well-formed hello is answered"
    assert server.served == 0 and server.refused == 0


def test_an_etag_with_control_characters_is_refused():
    evil = BlockAsk.block("train/shard-0.tar", "etag-1\r\nX-Injected: 1", 2, len(BLOCK))
    with pytest.raises(ValueError, match="control characters"):
        BlockAsk.parse(evil.query())


def test_an_answer_head_trickled_byte_by_byte_is_given_up_within_the_first_byte_bound():
    """A peer that keeps each recv busy but never finishes its head is bounded as a silent one is."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    stop = threading.Event()

    def trickle():
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\n")
            while not stop.wait(0.05):
                try:
                    conn.sendall(b"X")
                except OSError:
                    return

    threading.Thread(target=trickle, daemon=True).start()
    client = PeerClient(KEY, TIGHT)
    try:
        started = time.monotonic()
        assert trio.run(client.ask, f"127.0.0.1:{listener.getsockname()[1]}", BlockAsk.block("k", "e", 0, 10)) == ("failed", None)
        assert time.monotonic() - started < 3, "bounded by the first-byte bound (0.3 s), not the trickle"
    finally:
        stop.set()
        listener.close()


@settings(max_examples=200, deadline=None)
@given(key=st.text(min_size=1, max_size=40), etag=st.text(min_size=1, max_size=40).filter(str.isprintable),
       through=st.booleans())
def test_an_asks_query_is_what_urllib_reads_and_writes(key, etag, through):
    """Asks are quoted and parsed here, without urllib's loops: what urllib's parse_qs reads from one is the ask,
    and what urlencode writes parses back to it."""
    want = BlockAsk(key, etag, 1, 4096, 8192, 9000, through=through)
    query = want.query()
    assert BlockAsk.parse(query) == want
    fields = {name: values[0] for name, values in urllib.parse.parse_qs(query, strict_parsing=True).items()}
    assert (fields["key"], fields["etag"], fields["stop"], "held" in fields) == (key, etag, "8192", not through)
    assert BlockAsk.parse(urllib.parse.urlencode(fields)) == want


class Older(http.server.BaseHTTPRequestHandler):
    """A member of the version before the seal: it refuses every request without its HMAC header (401)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(401)
        self.send_header("Content-Length", "0")
        self.end_headers()


def test_members_of_the_older_unsealed_version_are_refused_cleanly_both_ways(server):
    """During a rolling upgrade an older member's plain, HMAC-signed ask is refused (401, closed: never a block
    in the clear), and an older owner refuses this version's hello: either way the asker reads the store and
    avoids that member a while, and nothing is served unsealed."""
    import hmac

    target = "/v1/block?" + BlockAsk.block("train/shard-0.tar", "etag-1", 2, len(BLOCK)).query() + "&sum=crc64nvme"
    seconds = str(int(time.time()))
    mac = hmac.digest(KEY, f"{seconds}\n{target}".encode(), "sha256").hex()
    answer = _raw(server, f"GET {target} HTTP/1.1\r\nAuthorization: Stoker-Peer {seconds} {mac}\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 401 ") and b"X-Stoker-Protocol: v2" in answer and BLOCK[:64] not in answer
    assert server.served == 0 and server.refused == 1
    older = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Older)
    threading.Thread(target=older.serve_forever, daemon=True).start()
    try:
        client = PeerClient(KEY, SLACK)
        peer = f"127.0.0.1:{older.server_address[1]}"
        assert trio.run(client.ask, peer, BlockAsk.block("train/shard-0.tar", "etag-1", 2, len(BLOCK))) == (
            "failed", None)
        assert client.avoided(peer)
    finally:
        older.shutdown()
        older.server_close()


def test_a_flood_of_silent_connections_is_shed_and_asks_are_still_answered():
    """Connections that never open an ask are shed first, per source and in all, so a flood from any number of
    addresses without the key neither starves the members' asks nor holds the node's descriptors."""
    s = PeerServer(("127.0.0.1", 0), KEY, Held(), max_connections=48, max_per_source=16).start()
    flood: list[socket.socket] = []
    try:
        before = len(os.listdir("/proc/self/fd"))
        client = PeerClient(KEY, SLACK)
        want = BlockAsk.block("train/shard-0.tar", "etag-1", 2, len(BLOCK))
        for round_ in range(6):
            for source in ("127.0.0.5", "127.0.0.6", "127.0.0.7", "127.0.0.8"):
                for _ in range(25):
                    c = socket.socket()
                    c.bind((source, 0))
                    c.connect(s.address)
                    flood.append(c)
            assert trio.run(client.ask, addr(s), want) == ("hit", BLOCK), round_
        deadline = time.monotonic() + 30
        while s.connections < len(flood) + 1 and time.monotonic() < deadline:  # every one accepted
            time.sleep(0.05)
        assert s.served == 6 and s.shed + s.turned_away >= len(flood) + 1 - 48

        def server_descriptors() -> int:  # (the flood's client ends are this process's too)
            return len(os.listdir("/proc/self/fd")) - before - len(flood)

        while server_descriptors() > 48 + 8 and time.monotonic() < deadline:  # the shed ones' tasks close them
            time.sleep(0.05)
        assert server_descriptors() <= 48 + 8
        assert not client.failures
    finally:
        for c in flood:
            c.close()
        s.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=300) | st.lists(st.sampled_from([b"GET ", b"/v1/block?", b"/v2/ask/", b"/v2/hello?r=",
                                                          b"key=a&etag=e&index=0", b" HTTP/1.1", b"00" * 16,
                                                          b"\r\n", b":", b"Authorization: Stoker-Peer 1 ab",
                                                          b"Transfer-Encoding: chunked", b"\r\n\r\n", b"\x00", b" "]),
                                         max_size=12).map(b"".join))
def test_any_bytes_sent_to_a_peer_are_answered_or_closed_never_served(server, data):
    """Whatever a sender without the key writes, the server answers a hello or an error status, or closes; it never
    sends a block and never waits for more than the sender wrote."""
    with socket.create_connection(server.address, timeout=5) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)  # the sender is done: the server must not wait for more
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    assert BLOCK[:64] not in got
    assert got == b"" or got.startswith((b"HTTP/1.1 400 ", b"HTTP/1.1 401 ", b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n"
                                         b"X-Stoker-Hello: ")), got[:80]
    assert server.served == 0


def test_a_new_key_closes_the_connections_opened_under_the_old_one():
    """A member cut off by a new cache key (the handover made again) keeps no connection it opened before: the
    server drops them all, and the old key opens nothing on a new one."""
    s = PeerServer(("127.0.0.1", 0), KEY, Held()).start()
    try:
        client = PeerClient(KEY, SLACK)
        want = BlockAsk.block("train/shard-0.tar", "etag-1", 2, len(BLOCK))
        assert trio.run(client.ask, addr(s), want) == ("hit", BLOCK)  # its connection is pooled, kept by the server
        assert len(s._kept) == 1
        s.rekey(b"the cache's new key, 32 bytes...")
        deadline = time.monotonic() + 30
        while len(s._kept) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(s._kept) == 0
        assert trio.run(client.ask, addr(s), want) == ("failed", None) and s.served == 1
        renewed = PeerClient(b"the cache's new key, 32 bytes...", SLACK)
        assert trio.run(renewed.ask, addr(s), want) == ("hit", BLOCK)
    finally:
        s.close()
