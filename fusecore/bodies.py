"""Reading a response body into the caller's buffer, piece by piece, publishing progress (both HTTP stacks)."""

from __future__ import annotations

from .objects import Progress
from .store_errors import TransientError


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


def body_reader(body) -> tuple:
    """Read a body straight into our buffer and reuse its connection afterwards.

    urllib3's readinto reads into a temporary bytes object and copies it; http.client's readinto
    fills the caller's buffer from the socket directly (measured: about a third less system time
    per GiB). Falls back to botocore's own readinto where the layers differ.
    """
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    if raw is not None and fp is not None and hasattr(fp, "readinto") and hasattr(raw, "release_conn"):
        return fp.readinto, raw.release_conn
    return body.readinto, body.close
