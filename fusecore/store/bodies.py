"""Reading a response body into the caller's buffer, piece by piece, publishing progress (both HTTP stacks)."""

from __future__ import annotations

from .objects import Progress
from .errors import TransientError


_PIECE = 256 * 1024  # progress is published after each piece of a body


def read_body(readinto, into: memoryview, progress: Progress, release, close, what: str) -> None:
    """Fill `into` from a response body piece by piece, publishing progress; hand the connection
    back to its pool only if the body was read to the end, else close it."""
    pos, length = 0, len(into)
    try:
        while pos < length:
            n = readinto(into[pos:pos + _PIECE])
            if not n:
                break
            pos += n
            progress.advance(n)
    finally:
        (release if pos == length else close)()
    if pos != length:
        raise TransientError(f"{what}: short body ({pos} of {length} bytes)")


def socket_readinto(resp):
    """The readinto of the http.client response under a urllib3 response, or None where the layers differ.

    urllib3's readinto reads into a temporary bytes object and copies it; http.client's readinto
    fills the caller's buffer from the socket directly (measured: about a third less system time
    per GiB)."""
    fp = getattr(resp, "_fp", None)
    return fp.readinto if fp is not None and hasattr(fp, "readinto") else None


def body_reader(body) -> tuple:
    """(readinto, release) for a botocore body: straight into our buffer and its connection reused
    afterwards where botocore's urllib3 response allows, else botocore's own readinto."""
    raw = getattr(body, "_raw_stream", None)
    if raw is not None and hasattr(raw, "release_conn"):
        readinto = socket_readinto(raw)
        if readinto is not None:
            return readinto, raw.release_conn
    return body.readinto, body.close
