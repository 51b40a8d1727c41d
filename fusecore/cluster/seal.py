"""The seal of a distributed cache's peer traffic: every ask and every answer encrypted and authenticated.

Why not TLS with a per-cache CA: a node's one peer port (router.py) reads a connection's first request line to
know which cache's mount gets the connection, and holds no key; under TLS it would have to terminate TLS (and hold
every cache's key) or route by SNI in a ClientHello it parses itself. The seal keeps the router keyless and the
routing line plain (it names only the cache id, which is no secret), costs one exchange of 16-byte randoms when a
connection opens (connections are kept alive and pooled), and uses AES-256-GCM from `cryptography` (OpenSSL):
~0.4 ms per 4 MiB block at each end here, about what the CRC64 it replaces cost.

A connection's keys: HKDF-SHA256 of the cache's key with the asker's and the owner's 16-byte randoms as salt, one
key per direction (asks, answers) and per cache (its id is in the info). Each direction's nonce is the count of
messages it sealed on the connection, so a nonce never repeats under one key, and a message replayed, reordered or
moved to another connection does not open: a replayed ask is refused (the owner closes the connection), a replayed
or altered answer is a failed ask (the asker reads the store). An answer's kind travels in the clear beside its
sealed payload and is authenticated with it (associated data).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..failures import StokerError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

RANDOM = 16  # bytes of each end's random at a connection's opening
TAG = 16  # bytes a sealed message is longer than its plaintext (GCM's tag)
VERSION = b"stoker-peer-v2"


class Forged(StokerError, ValueError):
    """A sealed message that does not open: another key, altered, replayed, reordered or truncated."""


def fresh_random() -> bytes:
    return os.urandom(RANDOM)


def _key(secret: bytes, salt: bytes, info: bytes) -> "AESGCM":
    # (imported here: OpenSSL's bindings cost a mount ~8 MiB of memory, and only members of a cluster use them)
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return AESGCM(HKDF(hashes.SHA256(), 32, salt, VERSION + b"\0" + info).derive(secret))


def _nonce(count: int) -> bytes:
    return count.to_bytes(12, "big")


class Session:
    """One connection's keys and counts, the same at both ends: the asker seals asks and opens answers, the owner
    opens asks and seals answers, each message under the next nonce of its direction."""

    def __init__(self, secret: bytes, asker: bytes, owner: bytes, cache: str = ""):
        if len(asker) != RANDOM or len(owner) != RANDOM:
            raise Forged("a connection's randoms must be 16 bytes each")
        from cryptography.exceptions import InvalidTag

        self._invalid = InvalidTag
        salt = asker + owner
        self._asks = _key(secret, salt, b"ask " + cache.encode())
        self._answers = _key(secret, salt, b"answer " + cache.encode())
        self._asks_sent = self._asks_opened = self._answers_sent = self._answers_opened = 0

    def seal_ask(self, plain: bytes) -> bytes:
        sealed = self._asks.encrypt(_nonce(self._asks_sent), plain, None)
        self._asks_sent += 1
        return sealed

    def open_ask(self, sealed: bytes) -> bytes:
        try:
            plain = self._asks.decrypt(_nonce(self._asks_opened), sealed, None)
        except self._invalid:
            raise Forged("an ask that does not open with this connection's key") from None
        self._asks_opened += 1
        return plain

    def seal_answer(self, kind: bytes) -> bytes:
        """An answer without a payload (its tag alone), `kind` (one byte, sent in the clear) authenticated."""
        sealed = self._answers.encrypt(_nonce(self._answers_sent), b"", kind)
        self._answers_sent += 1
        return sealed

    def seal_answer_into(self, kind: bytes, payload: bytes | memoryview, into: bytearray | memoryview) -> None:
        """`payload` sealed into `into` (exactly TAG bytes longer), `kind` authenticated with it."""
        self._answers.encrypt_into(_nonce(self._answers_sent), payload, kind, into)
        self._answers_sent += 1

    def open_answer_into(self, kind: bytes, sealed: bytearray | memoryview, into: bytearray | memoryview) -> None:
        """The payload of a sealed answer into `into` (exactly its length, the sealed length less TAG)."""
        try:
            self._answers.decrypt_into(_nonce(self._answers_opened), sealed, kind, into)
        except self._invalid:
            raise Forged("an answer that does not open with this connection's key") from None
        self._answers_opened += 1


class Scratch:
    """Buffers reused for sealed blocks: a fresh 4 MiB buffer for each costs its page faults every time (~1 ms here,
    more than the cipher). Small ones come from the heap, as they would anyway. For one event loop's use."""

    def __init__(self, keep: int = 2, least: int = 256 * 1024):
        self._free: list[bytearray] = []
        self._keep, self._least = keep, least

    def take(self, nbytes: int) -> memoryview:
        if nbytes >= self._least:
            fits = [i for i, buf in enumerate(self._free) if len(buf) >= nbytes]
            if fits:  # the smallest that fits (a 4 MiB one kept for the next block)
                return memoryview(self._free.pop(min(fits, key=lambda i: len(self._free[i]))))[:nbytes]
        return memoryview(bytearray(nbytes))

    def give(self, view: memoryview) -> None:
        buf = view.obj
        assert isinstance(buf, bytearray)
        view.release()
        if len(buf) >= self._least and len(self._free) < self._keep:
            self._free.append(buf)
