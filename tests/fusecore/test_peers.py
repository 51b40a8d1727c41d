"""The peer protocol of a distributed cache (fusecore/peers.py) over real HTTP on loopback: a peer can make a
read slower, never make it fail or return other bytes."""

from __future__ import annotations

import hashlib
import http.server
import os
import socket
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import Future

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusecore.peers import BlockAsk, PeerClient, PeerServer, PeerTimeouts, sign

KEY = b"cache-key-of-tenant-a"
BLOCK = os.urandom(1_000_003)


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
    assert trio.run(other_tenant.fetch, addr(server), BlockAsk.block("train/shard-0.tar", "etag-1", 2, len(BLOCK))) is None
    target = BlockAsk.block("train/shard-0.tar", "etag-1", 2, len(BLOCK)).target()
    for headers in ({}, {"Authorization": sign(KEY, target, time.time() - 3600)},  # unsigned; an old signature
                    {"Authorization": sign(KEY, BlockAsk.block("other", "etag-1", 2, len(BLOCK)).target(), time.time())}):  # another's
        request = urllib.request.Request(f"http://{addr(server)}{target}", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=5)
        assert info.value.code == 401
    assert server.refused == 4 and server.served == 0


def test_nothing_is_served_without_a_key():
    with pytest.raises(ValueError):
        PeerServer(("127.0.0.1", 0), b"", Held())


class Liar(http.server.BaseHTTPRequestHandler):
    """A peer answering 200 with wrong bytes, a short body, or another length."""

    protocol_version = "HTTP/1.1"
    mode = "corrupt"
    checksum = "sha256"  # what an older member sends whatever it is asked

    def log_message(self, *args):
        pass

    def do_GET(self):
        from fusecore.sums import CHECKSUMS

        body = bytearray(BLOCK)
        digest = CHECKSUMS[self.checksum](BLOCK).hex()
        if self.mode == "corrupt":
            body[12345] ^= 0xFF
        length = len(BLOCK) + (7 if self.mode == "longer" else 0)
        self.send_response(200)
        self.send_header("Content-Length", str(length))
        self.send_header("X-Stoker-ETag", "etag-1")
        self.send_header(f"X-Stoker-{self.checksum.upper()}", digest)
        self.end_headers()
        self.wfile.write(body[: len(body) // 2] if self.mode == "short" else body)
        if self.mode == "short":
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)


@pytest.mark.parametrize("mode,checksum", [("corrupt", "sha256"), ("corrupt", "crc64nvme"), ("short", "crc64nvme"),
                                           ("longer", "crc64nvme")])
def test_a_wrong_answer_is_refused_and_the_peer_avoided(mode, checksum):
    handler = type("Handler", (Liar,), {"mode": mode, "checksum": checksum})
    liar = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=liar.serve_forever, daemon=True).start()
    try:
        peer = f"127.0.0.1:{liar.server_address[1]}"
        client = PeerClient(KEY, SLACK)
        assert trio.run(client.ask, peer, BlockAsk.block("train/shard-0.tar", "etag-1", 2, len(BLOCK))) == ("failed", None)
        assert client.failures[peer] == 1 and client.avoided(peer)
        assert trio.run(client.ask, peer, BlockAsk.block("train/shard-0.tar", "etag-1", 2, len(BLOCK))) == ("avoided", None)
    finally:
        liar.shutdown()
        liar.server_close()


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
        assert time.monotonic() - started < 1.5, "bounded by the first-byte timeout"
        started = time.monotonic()
        assert trio.run(client.fetch, peer, BlockAsk.block("k", "e", 0, 10)) is None and time.monotonic() - started < 0.05, "avoided"
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
    assert time.monotonic() - started < 1 and client.avoided(f"127.0.0.1:{port}")


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
    from fusecore import peers

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
        assert writes == [b"HTTP/1.1 "], "the head, its bytes and their checksum in one write"
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


def test_an_owner_that_goes_silent_while_reading_through_is_given_up_within_the_bound():
    """It answered that it fetches and beat once, then stopped (SIGSTOP, a hung host): the asker does not
    wait for it past the first-byte bound, and avoids it."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    held = []

    def serve():
        conn, _ = silent.accept()
        held.append(conn)
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Stoker-ETag: e\r\n"
                     b"X-Stoker-Through: 1\r\n\r\n1\r\n.\r\n")

    threading.Thread(target=serve, daemon=True).start()
    peer = f"127.0.0.1:{silent.getsockname()[1]}"
    client = PeerClient(KEY, TIGHT)
    try:
        started = time.monotonic()
        assert trio.run(client.ask, peer, BlockAsk.block("k", "e", 0, 10)) == ("failed", None)
        assert time.monotonic() - started < 2, "bounded by the silence, not by the owner's wait"
        assert client.avoided(peer)
    finally:
        silent.close()
        for conn in held:
            conn.close()


def test_an_ask_round_trips_and_one_outside_the_object_or_the_dataset_is_refused():
    from fusecore.cluster import check_ask

    want = BlockAsk("train/a b&c.jpg", "e1", 3, 3 * 4096 + 10, 3 * 4096 + 20, 5 * 4096, through=False)
    target = want.target("/c/x")
    assert BlockAsk.parse(target.split("?", 1)[1]) == want and "held=1" in target
    with pytest.raises(ValueError):
        BlockAsk.parse("key=k&etag=e&index=0&start=10&stop=5&size=100")  # nothing asked
    with pytest.raises(ValueError):
        BlockAsk.parse("key=k&etag=e&index=0&start=0&stop=101&size=100")  # past the object
    check_ask(want, 4096, "train/")
    with pytest.raises(ValueError, match="not inside block"):
        check_ask(want, 8192, "train/")  # another block size: the bytes are not inside block 3
    with pytest.raises(ValueError, match="outside this cache's dataset"):
        check_ask(want, 4096, "val/")


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
    headers and a head of at most MAX_HEAD bytes, is told 400 and closed, before any signature is looked at."""
    from fusecore.wire import MAX_HEAD

    target = BlockAsk.block("train/shard-0.tar", "etag-1", 2, len(BLOCK)).target()
    signed = f"Authorization: {sign(KEY, target, time.time())}\r\n"
    for bad in (f"POST {target} HTTP/1.1\r\n{signed}\r\n", f"GET {target} HTTP/2.0\r\n{signed}\r\n",
                f"GET {target} HTTP/1.1\r\n{signed}no colon here\r\n\r\n",
                f"GET {target} HTTP/1.1\r\n{signed}Content-Length: 5\r\n\r\nhello",
                f"GET {target} HTTP/1.1\r\n{signed}X-Pad: {'a' * MAX_HEAD}\r\n\r\n"):
        assert _raw(server, bad.encode()).startswith(b"HTTP/1.1 400 "), bad[:40]
    answer = _raw(server, f"GET {target} HTTP/1.1\r\n{signed}Connection: close\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(BLOCK), "a well-formed one is answered"
    assert server.served == 1 and server.refused == 0


def test_an_etag_with_control_characters_is_refused_not_echoed(server):
    """The ETag asked goes back in the X-Stoker-ETag header: one with CR or LF (a signed ask of a member gone
    wrong) is refused, never written into an answer's head."""
    evil = BlockAsk.block("train/shard-0.tar", "etag-1\r\nX-Injected: 1", 2, len(BLOCK))
    with pytest.raises(ValueError, match="control characters"):
        BlockAsk.parse(evil.target().split("?", 1)[1])
    answer = _raw(server, f"GET {evil.target()} HTTP/1.1\r\nAuthorization: {sign(KEY, evil.target(), time.time())}"
                          f"\r\nConnection: close\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 400 ") and b"X-Injected" not in answer


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
        assert time.monotonic() - started < 1.5
    finally:
        stop.set()
        listener.close()


@settings(max_examples=200, deadline=None)
@given(key=st.text(min_size=1, max_size=40), etag=st.text(min_size=1, max_size=40).filter(str.isprintable),
       through=st.booleans())
def test_an_asks_query_is_what_urllib_reads_and_writes(key, etag, through):
    """Asks are quoted and parsed here, without urllib's loops: what urllib's parse_qs (an older member) reads from
    one is the ask, and what urlencode writes parses back to it."""
    want = BlockAsk(key, etag, 1, 4096, 8192, 9000, through=through)
    query = want.target().split("?", 1)[1]
    assert BlockAsk.parse(query) == want
    fields = {name: values[0] for name, values in urllib.parse.parse_qs(query, strict_parsing=True).items()}
    assert (fields["key"], fields["etag"], fields["stop"], "held" in fields) == (key, etag, "8192", not through)
    assert BlockAsk.parse(urllib.parse.urlencode(fields)) == want


def test_members_of_the_older_version_are_answered_and_understood(server):
    """Before CRC64-NVME, asks named no checksum and answers carried SHA-256: an older asker still gets
    X-Stoker-SHA256, and an older owner's SHA-256 answer is checked and used (a rolling upgrade loses no hits)."""
    target = BlockAsk.block("train/shard-0.tar", "etag-1", 2, len(BLOCK)).target().replace("&sum=crc64nvme", "")
    answer = _raw(server, f"GET {target} HTTP/1.1\r\nAuthorization: {sign(KEY, target, time.time())}\r\n"
                          f"Connection: close\r\n\r\n".encode())
    assert f"X-Stoker-SHA256: {hashlib.sha256(BLOCK).hexdigest()}".encode() in answer and answer.endswith(BLOCK)
    older = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (Liar,), {"mode": "right"}))
    threading.Thread(target=older.serve_forever, daemon=True).start()
    try:
        client = PeerClient(KEY, SLACK)
        want = BlockAsk.block("train/shard-0.tar", "etag-1", 2, len(BLOCK))
        assert trio.run(client.ask, f"127.0.0.1:{older.server_address[1]}", want) == ("hit", BLOCK)
    finally:
        older.shutdown()
        older.server_close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=300) | st.lists(st.sampled_from([b"GET ", b"/v1/block?", b"key=a&etag=e&index=0", b" HTTP/1.1",
                                                          b"\r\n", b":", b"Authorization: Stoker-Peer 1 ab",
                                                          b"Transfer-Encoding: chunked", b"\r\n\r\n", b"\x00", b" "]),
                                         max_size=12).map(b"".join))
def test_any_bytes_sent_to_a_peer_are_answered_or_closed_never_served(server, data):
    """Whatever an unsigned sender writes, the server answers with an error status or closes; it never sends a
    block and never waits for more than the sender wrote."""
    with socket.create_connection(server.address, timeout=5) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)  # the sender is done: the server must not wait for more
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    assert BLOCK[:64] not in got
    assert got == b"" or got.startswith((b"HTTP/1.1 400 ", b"HTTP/1.1 401 ")), got[:80]
    assert server.served == 0
