"""HTTP/1.1 as steps: a connection's heads, lines and exact lengths read by a generator that yields what it needs
(receive, receive into, send) to a driver that does the I/O from the event loop on a non-blocking socket
(`run_on_loop`: each step tried at once, the socket waited for only when it cannot go on).

Both ends of the peer protocol and the store's small GETs use it: http.client's and http.server's parsing, through the
email package, was most of a peer request's CPU (~0.4 of 0.75 ms for a 110 KB block, both ends), and awscrt's
callbacks, one per 16 KiB of a body on its own thread, cost a small GET ~0.2 ms of CPU where these steps cost ~0.12.
"""

from __future__ import annotations

import math
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, TypeVar

import trio

from ..failures import StokerError

T = TypeVar("T")
MAX_HEAD = 16 * 1024  # bytes of a request's or an answer's head (its first line and headers) at most


class Malformed(StokerError, ValueError):
    """A request or an answer that is not the protocol's HTTP/1.1."""


@dataclass
class Request:
    target: str
    authorization: str | None
    keep_alive: bool


@dataclass
class Recv:
    """A step: the next bytes the connection has (b"" at its end), by the monotonic time `until` (None: the
    socket's own timeout)."""

    until: float | None


@dataclass
class RecvInto:
    """A step: bytes into `view`; their count (0 at the connection's end)."""

    view: memoryview
    until: float | None


@dataclass
class SendAll:
    data: bytes
    until: float | None


Step = Recv | RecvInto | SendAll
Steps = Generator[Step, Any, T]  # what a connection's protocol does, step by step; a driver does the I/O


class Wire:
    """The bytes of one connection, read as heads, lines and exact lengths, as steps that `run_on_loop` carries out
    from the event loop (both ends of the peer protocol, the store's small GETs)."""

    def __init__(self) -> None:
        self._buf = bytearray()  # received, not yet taken

    def head(self, until: float | None = None) -> Steps[list[str] | None]:
        """The lines of the next head (a request or status line and headers), None at a clean end of the
        connection (nothing of a head received); ConnectionError at an end inside one, Malformed past MAX_HEAD."""
        while True:
            end = self._buf.find(b"\r\n\r\n")
            if end > MAX_HEAD or (end < 0 and len(self._buf) > MAX_HEAD):
                raise Malformed("a head longer than allowed")
            if end >= 0:
                head = bytes(self._buf[:end])
                del self._buf[:end + 4]
                return head.decode("latin-1").split("\r\n")
            data = yield Recv(until)
            if not data:
                if self._buf:
                    raise ConnectionError("the connection ended inside a head")
                return None
            self._buf += data

    def line(self, until: float | None) -> Steps[bytes]:
        """One CRLF-ended line (a chunk's size), without its CRLF."""
        while (end := self._buf.find(b"\r\n")) < 0:
            if len(self._buf) > 1024:
                raise Malformed("a line longer than allowed")
            data = yield Recv(until)
            if not data:
                raise Malformed("the connection ended inside an answer")
            self._buf += data
        line = bytes(self._buf[:end])
        del self._buf[:end + 2]
        return line

    def exactly(self, n: int, until: float | None) -> Steps[bytearray]:
        """The next `n` bytes."""
        out = bytearray(n)
        yield from self.exactly_into(memoryview(out), until)
        return out

    def exactly_into(self, view: memoryview, until: float | None) -> Steps[None]:
        """The next len(view) bytes into `view`, all of them by `until`."""
        have = min(len(view), len(self._buf))
        view[:have] = self._buf[:have]
        del self._buf[:have]
        while have < len(view):
            got = yield RecvInto(view[have:], until)
            if not got:
                raise Malformed(f"a short body ({have} of {len(view)} bytes)")
            have += got

    def into(self, view: memoryview, timeout: float, advance: Callable[[int], None],
             awaiting: Callable[[int], None] | None = None) -> Steps[int]:
        """Bytes into all of `view` (those received past the head first), waiting at most `timeout` seconds of
        silence each time, `advance` told of each arrival and `awaiting` of the bytes still due before each
        receive; how many came (fewer at the connection's end)."""
        have = min(len(view), len(self._buf))
        if have:
            view[:have] = self._buf[:have]
            del self._buf[:have]
            advance(have)
        while have < len(view):
            if awaiting is not None:
                awaiting(len(view) - have)
            got = yield RecvInto(view[have:], time.monotonic() + timeout)
            if not got:
                break
            have += got
            advance(got)
        return have

    def chunked_into(self, view: memoryview, timeout: float, advance: Callable[[int], None]) -> Steps[int]:
        """A chunked body into `view` (as `into`); Malformed if it is longer than `view` or ends inside a chunk."""
        have = 0
        while True:
            size = yield from self._chunk_size(timeout)
            if size == 0:
                yield from self._trailer(timeout)
                return have
            if have + size > len(view):
                raise Malformed(f"a body longer than the {len(view)} bytes asked for")
            if (yield from self.into(view[have:have + size], timeout, advance)) < size:
                raise Malformed("the connection ended inside a chunk")
            have += size
            yield from self.crlf(time.monotonic() + timeout)

    def _chunk_size(self, timeout: float) -> Steps[int]:
        line = yield from self.line(time.monotonic() + timeout)
        try:
            return int(line.split(b";")[0], 16)
        except ValueError:
            raise Malformed("a malformed chunk size") from None

    def _trailer(self, timeout: float) -> Steps[None]:
        while (yield from self.line(time.monotonic() + timeout)):
            pass  # trailer fields, up to the empty line

    def crlf(self, until: float | None) -> Steps[None]:
        if (yield from self.line(until)):
            raise Malformed("a chunk not ended by CRLF")

    def drained(self) -> bool:
        """Nothing received past what was taken (a connection with more is not reused)."""
        return not self._buf

    def request(self, until: float | None = None) -> Steps[Request | None]:
        """The next request (a GET without a body), None at a clean end."""
        lines = yield from self.head(until)
        if lines is None:
            return None
        parts = lines[0].split(" ")
        if len(parts) != 3 or parts[0] != "GET" or parts[2] not in ("HTTP/1.1", "HTTP/1.0"):
            raise Malformed(f"not a GET request line: {lines[0][:80]!r}")
        headers = parse_headers(lines[1:])
        if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
            raise Malformed("a request with a body")
        connection = headers.get("connection", "").lower()
        keep = connection != "close" if parts[2] == "HTTP/1.1" else connection == "keep-alive"
        return Request(parts[1], headers.get("authorization"), keep)

    def answer_head(self, until: float) -> Steps[tuple[int, dict[str, str]]]:
        """The status and headers (names in lower case) of the next answer; ConnectionError if the connection
        ended before any byte of it (a kept-alive connection the peer closed)."""
        lines = yield from self.head(until)
        if lines is None:
            raise ConnectionError("the peer closed the connection")
        return parse_answer(lines)


def left(until: float) -> float:
    left = until - time.monotonic()
    if left <= 0:
        raise socket.timeout("the other end took too long")
    return left


async def run_on_loop(sock: socket.socket, steps: Steps[T]) -> T:
    """Carry out `steps` on a non-blocking socket from the event loop: each step is tried at once and waits for the
    socket only when it cannot go on (no thread per ask: a hand-off to a worker thread cost an asker ~0.12 ms of
    CPU, as much as the ask itself; nor a trio socket per step, whose cancel scopes and checkpoints cost as much).
    A step past its time is a socket.timeout, as on a blocking socket. A TLS socket (ssl.SSLSocket, non-blocking)
    works the same way: what it has decrypted already is taken before any wait."""
    await trio.lowlevel.checkpoint_if_cancelled()
    expired = False  # the socket was waited for until the step's time: one more try at once, then a timeout
    try:
        step = next(steps)
        while True:
            try:
                if isinstance(step, Recv):
                    result: Any = sock.recv(65536)
                elif isinstance(step, RecvInto):
                    result = sock.recv_into(step.view)
                else:
                    sent = sock.send(step.data)
                    if sent < len(step.data):
                        step = SendAll(step.data[sent:], step.until)
                        raise BlockingIOError
                    result = None
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError) as blocked:
                # (TLS may need to write to go on reading, or read to go on writing)
                writable = isinstance(blocked, ssl.SSLWantWriteError) or (
                    isinstance(step, SendAll) and not isinstance(blocked, ssl.SSLWantReadError))
                wait = trio.lowlevel.wait_writable if writable else trio.lowlevel.wait_readable
                if expired:
                    raise socket.timeout("the other end took too long") from None
                with trio.move_on_after(left(step.until) if step.until is not None else math.inf) as bound:
                    await wait(sock)
                # (bytes below a socket's low-water mark wake nobody, and still show the other end is alive)
                expired = bound.cancelled_caught
                continue
            expired = False
            step = steps.send(result)
    except StopIteration as done:
        return done.value
    finally:
        steps.close()


def parse_answer(lines: list[str]) -> tuple[int, dict[str, str]]:
    """The status and headers (names in lower case) of an answer's head."""
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise Malformed(f"not a status line: {lines[0][:80]!r}")
    return int(parts[1]), parse_headers(lines[1:])


def parse_headers(lines: list[str]) -> dict[str, str]:
    headers = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise Malformed(f"a malformed header: {line[:80]!r}")
        headers[name.lower()] = value.strip()
    return headers
