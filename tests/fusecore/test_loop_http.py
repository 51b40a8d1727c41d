"""LoopHttp (small GETs on the event loop's own sockets) against a real HTTP server on a real socket: exact
bodies on one kept-alive connection, error answers (with a length or in chunks), refused and longer answers,
a store that goes silent mid-body and a cancelled GET (both also for NativeHttp's GET awaited on the loop), a
kept-alive connection the store closed, TLS verified against the CA bundle given, and an endpoint that refuses
connections."""

from __future__ import annotations

import shutil
import socket
import ssl
import time

import pytest
import trio

from fusecore.store.loop_http import LoopHttp
from fusecore.store.objects import Progress
from fusecore.store.errors import PreconditionFailed, TransientError, Unavailable
from tests.fusecore.test_native_http import BODY, Server, _certificates, accept_all
from tests.fusecore.test_native_http import client as native_client


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


def client(**kw) -> LoopHttp:
    return LoopHttp(**{"connect_timeout": 2.0, "request_timeout": 1.0, "ca_file": None, "max_idle": 4, **kw})


def get(http: LoopHttp, url: str, buf: bytearray | memoryview, progress: Progress | None = None, accept=accept_all,
        headers: dict | None = None, limit: float = 10):
    async def main():
        with trio.fail_after(limit):
            return await http.get_into(url, headers or {}, memoryview(buf), progress or Progress(), accept, "get 'x'")
    return trio.run(main)


def test_bodies_arrive_exactly_on_one_kept_alive_connection(server):
    http = client()
    for _ in range(3):
        buf, progress = bytearray(len(BODY)), Progress()
        answer = get(http, f"{server.url}/ok?X-Amz-Signature=abc", buf, progress, headers={"Range": "bytes=0-102399"})
        assert answer.status == 200 and answer.headers["etag"] == '"v1"'
        assert bytes(buf) == BODY and progress.received == len(BODY)
    assert server.connections == 1 and len(server.requests) == 3
    assert server.requests[0]["Range"] == "bytes=0-102399"
    assert server.requests[0]["Host"] == server.url.removeprefix("http://")


def test_error_answers_come_back_with_their_bodies_and_nothing_is_written(server):
    http = client()
    buf = bytearray(len(BODY))
    answer = get(http, f"{server.url}/error", buf)
    assert answer.status == 503 and b"<Code>SlowDown</Code>" in answer.body and answer.headers["retry-after"] == "2"
    answer = get(http, f"{server.url}/chunked", buf)
    assert answer.status == 403 and answer.body == b"<Error><Code>AccessDenied</Code></Error>"
    assert buf == bytearray(len(BODY))
    assert get(http, f"{server.url}/ok", buf).status == 200 and bytes(buf) == BODY
    assert server.connections == 1  # an error answer read whole leaves its connection usable


def test_an_answer_the_caller_refuses_is_not_taken_and_its_connection_not_reused(server):
    def refuse(status, headers):
        raise PreconditionFailed("get 'ok': object changed since it was listed")

    http = client()
    buf, progress = bytearray(len(BODY)), Progress()
    with pytest.raises(PreconditionFailed):
        get(http, f"{server.url}/ok", buf, progress, accept=refuse)
    assert progress.received == 0 and buf == bytearray(len(BODY))
    assert get(http, f"{server.url}/ok", buf).status == 200 and bytes(buf) == BODY
    assert server.connections == 2


def test_a_longer_body_than_asked_for_is_refused_without_writing_past_the_buffer(server):
    buf = bytearray(len(BODY) + 64)
    with pytest.raises(TransientError, match="longer than"):
        get(client(), f"{server.url}/long", memoryview(buf)[:len(BODY)])
    assert buf == bytearray(len(BODY) + 64)
    with pytest.raises(TransientError, match="longer than"):
        get(client(), f"{server.url}/chunked-long", memoryview(buf)[:len(BODY)])
    assert buf[len(BODY):] == bytearray(64)


def test_a_body_in_chunks_fills_its_buffer_exactly(server):
    http = client()
    for _ in range(2):
        buf, progress = bytearray(len(BODY)), Progress()
        assert get(http, f"{server.url}/chunked-ok", buf, progress).status == 200
        assert bytes(buf) == BODY and progress.received == len(BODY)
    assert server.connections == 1


# The two ways a GET is awaited on the event loop, held to one contract: LoopHttp's own sockets, and awscrt's
# connections woken once (NativeHttp.get_into_async). (`bytes_before_cancel`: awscrt hands over every piece it got;
# a loop socket may leave what is under its wake-up mark unread.)
ON_THE_LOOP = {
    "loop_http": (lambda **kw: client(**kw).get_into, False),
    "native_http": (lambda **kw: native_client(**kw).get_into_async, True),
}


def _awaited(get_into, url: str, buf: bytearray, progress: Progress):
    async def main():
        with trio.fail_after(10):
            return await get_into(url, {}, memoryview(buf), progress, accept_all, "get 'x'")
    return trio.run(main)


def _nothing_written_after(server, buf: bytearray, progress: Progress, received: int) -> None:
    """Once the store sends the rest, the abandoned GET takes none of it."""
    server.release.set()
    time.sleep(0.3)
    assert progress.received == received and buf[received:] == bytearray(len(BODY) - received)


@pytest.mark.parametrize("kind", ON_THE_LOOP)
def test_a_store_silent_mid_body_fails_in_bounded_time_and_writes_nothing_after(server, kind):
    buf, progress = bytearray(len(BODY)), Progress()
    get_into = ON_THE_LOOP[kind][0](request_timeout=0.5)
    started = time.monotonic()
    with pytest.raises(Unavailable, match="stopped sending"):
        _awaited(get_into, f"{server.url}/stall", buf, progress)
    assert time.monotonic() - started < 5
    received = progress.received
    assert 0 < received < len(BODY) and bytes(buf[:received]) == BODY[:received]
    _nothing_written_after(server, buf, progress, received)


@pytest.mark.parametrize("kind", ON_THE_LOOP)
def test_a_cancelled_get_writes_nothing_after_and_the_loop_goes_on(server, kind):
    buf, progress = bytearray(len(BODY)), Progress()
    make, bytes_before_cancel = ON_THE_LOOP[kind]
    get_into = make(request_timeout=30)

    async def main():
        with trio.move_on_after(0.5):
            await get_into(f"{server.url}/stall", {}, memoryview(buf), progress, accept_all, "get 's'")
        return progress.received

    received = trio.run(main)
    assert received < len(BODY) and (received > 0 or not bytes_before_cancel)  # (half the body came)
    _nothing_written_after(server, buf, progress, received)
    buf2 = bytearray(len(BODY))
    assert _awaited(get_into, f"{server.url}/ok", buf2, Progress()).status == 200 and bytes(buf2) == BODY


def test_a_kept_alive_connection_the_store_closed_is_replaced_without_a_failure(server):
    http = client()
    for _ in range(3):
        buf = bytearray(len(BODY))
        assert get(http, f"{server.url}/once", buf).status == 200 and bytes(buf) == BODY
    assert server.connections == 3 and len(server.requests) == 3


def test_an_endpoint_that_refuses_connections_is_unavailable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        with pytest.raises(Unavailable, match="cannot reach the endpoint"):
            get(client(), f"http://127.0.0.1:{port}/ok", bytearray(10))


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is needed to make test certificates")
def test_https_verifies_the_store_against_the_ca_bundle_given(server, tmp_path):
    """Over TLS the store's certificate is checked against the CA bundle and the name in the URL: a store the bundle
    does not vouch for is refused; bodies come exactly through the TLS socket on the loop."""
    ca, cert, key = _certificates(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.httpd.socket = context.wrap_socket(server.httpd.socket, server_side=True, do_handshake_on_connect=False)
    url = server.url.replace("http://127.0.0.1", "https://localhost") + "/ok"
    http = client(ca_file=ca)
    for _ in range(2):
        buf = bytearray(len(BODY))
        assert get(http, url, buf).status == 200 and bytes(buf) == BODY
    assert server.connections == 1
    other = tmp_path / "other"
    other.mkdir()
    other_ca, _, _ = _certificates(other)
    started = time.monotonic()
    with pytest.raises(Unavailable, match="TLS with the endpoint failed"):
        get(client(ca_file=other_ca, connect_timeout=1.0), url, bytearray(len(BODY)))
    assert time.monotonic() - started < 10
