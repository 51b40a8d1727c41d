"""An in-memory ObjectStore with request counters and fault injection, for data-path tests."""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from fusecore.store.objects import Listing, ObjectInfo, Progress
from fusecore.store.errors import AccessDenied, NotFound, PreconditionFailed, TransientError, Unavailable


@dataclass
class Faults:
    latency: float = 0.0  # seconds added to every GET
    transient: int = 0  # next N GETs break off mid-body (503 / connection reset after retries)
    unavailable: int = 0  # next N GETs fail as a store that timed out
    hang: float = 0.0  # GETs block this long (a store that stopped answering)
    chunk_delay: float = 0.0  # seconds between 64 KiB pieces of a body (a bandwidth cap)
    break_after: int = 0  # next transient failure happens after this many bytes of the body
    denied_keys: set[str] = field(default_factory=set)
    throttle_until: float = 0.0  # GETs answer 503 SlowDown until this time.monotonic()
    throttled: int = 0  # ... or the next N GETs do
    retry_after: float | None = None  # ... asking the client to wait this long
    explode: int = 0  # next N GETs raise something no store error covers (a bug, a malformed answer)


HOLD_LIMIT = 60.0  # seconds a held GET waits at most (a test that never lets it go fails rather than hangs)


def _nothing_held(key: str, start: int) -> bool:
    return False


class FakeStore:
    def __init__(self, page_size: int = 1000):
        self.objects: dict[str, tuple[bytes, str, float]] = {}
        self.calls: Counter[str] = Counter()
        self.faults = Faults()
        self.page_size = page_size
        self.active = 0
        self.max_active = 0
        self.ranges: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._held: Callable[[str, int], bool] = _nothing_held

    # ---- holding GETs in flight ----------------------------------------------------------------
    def hold(self, which: Callable[[str, int], bool] = lambda key, start: True) -> None:
        """GETs of (key, start) that `which` answers True for wait at their start, already counted (in `calls`,
        `ranges` and `active`), until a later hold() or release() lets them go: a test keeps GETs in flight for
        exactly as long as it needs them there, whatever the machine's speed."""
        with self._changed:
            self._held = which
            self._changed.notify_all()

    def release(self) -> None:
        """Let every held GET go on; none is held from now on."""
        self.hold(_nothing_held)

    # ---- set-up helpers ----------------------------------------------------------------------
    def put(self, key: str, data: bytes) -> ObjectInfo:
        etag = '"' + hashlib.md5(data).hexdigest() + '"'
        self.objects[key] = (data, etag, time.time())
        return self.info(key)

    def info(self, key: str) -> ObjectInfo:
        data, etag, mtime = self.objects[key]
        return ObjectInfo(key, len(data), etag, mtime)

    # ---- ObjectStore ---------------------------------------------------------------------------
    def check(self) -> None:
        self.calls["check"] += 1

    def rotate(self, identity) -> None:
        self.calls["rotate"] += 1
        self.identity = identity

    def list_dir(self, prefix: str):
        self.calls["list_dir"] += 1
        yield from self._pages(prefix)

    def probe(self, key: str) -> Listing:
        self.calls["probe"] += 1
        return next(self._pages(key))

    def _pages(self, prefix: str):
        """A delimiter ('/') listing of the keys that start with `prefix`, in pages, as S3 sorts and cuts it."""
        files, dirs = [], set()
        for key in sorted(self.objects):
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix):]
            if "/" in rest:
                dirs.add(prefix + rest.split("/", 1)[0] + "/")
            else:
                files.append(self.info(key))
        entries = [(f.key, f) for f in files] + [(d, d) for d in dirs]
        entries.sort(key=lambda e: e[0])
        for i in range(0, max(len(entries), 1), self.page_size):
            chunk = entries[i:i + self.page_size]
            yield Listing(files=[e for _, e in chunk if isinstance(e, ObjectInfo)],
                          dirs=[e for _, e in chunk if isinstance(e, str)], truncated=i + self.page_size < len(entries))

    def list_all(self, prefix: str):
        self.calls["list_all"] += 1
        for key in sorted(self.objects):
            if key.startswith(prefix):
                yield self.info(key)

    def head(self, key: str) -> ObjectInfo | None:
        self.calls["head"] += 1
        return self.info(key) if key in self.objects else None

    def has_prefix(self, prefix: str) -> bool:
        self.calls["has_prefix"] += 1
        return any(k.startswith(prefix) for k in self.objects)

    def read_range(self, key: str, start: int, end: int, etag: str, into: memoryview, progress: Progress) -> None:
        """Like S3Store.read_range: pieces arrive one after another, `progress` advancing."""
        with self._lock:
            self.calls["get"] += 1
            self.ranges.append((key, start, end))
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            faults = self.faults
            transient = faults.transient > 0
            if transient:
                faults.transient -= 1
            unavailable = faults.unavailable > 0
            if unavailable:
                faults.unavailable -= 1
            explode = faults.explode > 0
            if explode:
                faults.explode -= 1
            throttle = faults.throttled > 0 or time.monotonic() < faults.throttle_until
            if faults.throttled > 0:
                faults.throttled -= 1
        try:
            with self._changed:
                if not self._changed.wait_for(lambda: not self._held(key, start), HOLD_LIMIT):
                    raise Unavailable(f"get {key!r}: held for {HOLD_LIMIT:g}s (a test never let it go)")
            if explode:
                raise RuntimeError("malformed Content-Length: 'twelve'")
            if throttle:
                self.calls["throttled"] += 1
                raise TransientError(f"get {key!r}: store answered 503 SlowDown", throttled=True,
                                     retry_after=faults.retry_after)
            if faults.hang:
                time.sleep(faults.hang)
            if faults.latency:
                time.sleep(faults.latency)
            if key in faults.denied_keys:
                raise AccessDenied(f"get {key!r}: access denied")
            if transient and not faults.break_after:
                raise TransientError(f"get {key!r}: connection reset")
            if unavailable:
                raise Unavailable(f"get {key!r}: timed out")
            if key not in self.objects:
                raise NotFound(f"get {key!r}: not found")
            data, current, _ = self.objects[key]
            if current != etag:
                raise PreconditionFailed(f"get {key!r}: changed")
            payload = data[start:min(end, start + faults.break_after)] if transient else data[start:end]
            for pos in range(0, len(payload), 64 * 1024):
                piece = payload[pos:pos + 64 * 1024]
                into[pos:pos + len(piece)] = piece
                progress.advance(len(piece))
                if faults.chunk_delay:
                    time.sleep(faults.chunk_delay)
            if transient:  # the body broke off after `break_after` bytes
                raise TransientError(f"get {key!r}: connection reset")
        finally:
            with self._lock:
                self.active -= 1
