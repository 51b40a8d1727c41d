"""Files being written through a writable mount: their bytes streamed into the store while the writer writes.

A file is written from its start, in order (a write anywhere else is refused: `not_sequential`). Bytes gather into a
part; each full part is sent at once in a thread while the writer goes on (at most `concurrency` parts of one file in
flight, and `budget` bytes of parts for the whole mount: a writer that outruns the store waits, its memory bounded).
`finish` (the writer's close or fsync) sends the rest and completes the upload: only then does the object exist. A
failure anywhere (the store past its retries, expired credentials, a budget that did not drain within the deadline)
aborts the upload and fails the write or the close with the store's error; no object and no partial object is left.
An object smaller than a part is one PUT at `finish`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import trio

from ..cache.buffers import populated_bytearray
from ..store.errors import StoreError, Unavailable
from ..store.objects import ObjectInfo
from ..store.uploads import Uploads

log = logging.getLogger(__name__)


class Refused(StoreError):
    """A write-side operation S3 cannot do (or this mount may not): `why` names which, for the errno (fuse/errnos.py)
    and the one log line."""

    kind = "refused"

    def __init__(self, message: str, why: str):
        super().__init__(message)
        self.why = why


def not_sequential(key: str, offset: int, written: int) -> Refused:
    return Refused(f"{key}: a write at {offset} where {written} bytes were written (objects are written from their "
                   "start, in order)", "not_sequential")


@dataclass
class WriteStats:
    bytes_written: int = 0
    uploads_completed: int = 0
    uploads_aborted: int = 0
    parts_sent: int = 0


@dataclass(eq=False)
class Writing:
    """One file being written (until `finish` or `abandon`)."""

    key: str
    written: int = 0
    part: bytearray | None = None  # the part being filled (a whole part's buffer), up to `filled`
    filled: int = 0
    upload: str | None = None
    etags: list[str] = field(default_factory=list)
    sending: int = 0  # parts in flight
    failed: StoreError | None = None
    done: ObjectInfo | None = None
    drained: trio.Event = field(default_factory=trio.Event)
    slots: trio.Semaphore | None = None


class Writer:
    def __init__(self, uploads: Uploads, *, part_size: int, concurrency: int, budget: int, deadline: float,
                 huge_pages: bool = False):
        self.uploads = uploads
        self.huge = huge_pages  # part buffers on 2 MiB pages (where the mount chose them: cache/pages.py)
        self.part_size = part_size
        self.concurrency = concurrency
        self.deadline = deadline
        self._budget = trio.Semaphore(max(1, budget // part_size))  # parts of the whole mount in memory
        self._nursery: trio.Nursery | None = None
        self._writing: set[Writing] = set()
        # Part buffers sent and taken back, kept while files are being written (a fresh one must be populated); those
        # in flight and those kept stay within the budget (beside each file's part being filled), and the kept ones go
        # when no file is written.
        self._free: list[bytearray] = []
        self.stats = WriteStats()

    def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    @property
    def in_flight(self) -> int:
        return len(self._writing)

    def begin(self, key: str) -> Writing:
        w = Writing(key, slots=trio.Semaphore(self.concurrency))
        self._writing.add(w)
        return w

    async def write(self, w: Writing, offset: int, data: bytes | memoryview) -> None:
        if w.failed is not None:
            raise w.failed
        if w.done is not None or offset != w.written:
            raise not_sequential(w.key, offset, w.written)
        view = memoryview(data)
        w.written += len(view)
        self.stats.bytes_written += len(view)
        while view:
            if w.part is None:
                w.part, w.filled = self._free.pop() if self._free else populated_bytearray(self.part_size,
                                                                                           self.huge), 0
            n = min(len(view), self.part_size - w.filled)
            w.part[w.filled:w.filled + n] = view[:n]  # the one copy of the bytes in this process
            w.filled += n
            view = view[n:]
            if w.filled == self.part_size:
                part, w.part = w.part, None
                await self._send(w, part)

    async def _send(self, w: Writing, part: bytearray) -> None:
        """Start sending the next part (waiting for room in the mount's budget and the file's slots)."""
        assert self._nursery is not None and w.slots is not None
        with trio.move_on_after(self.deadline) as waited:
            await self._budget.acquire()
        if waited.cancelled_caught:
            self.fail(w, Unavailable(f"{w.key}: no room to send a part within {self.deadline:g}s (the store does "
                                      "not take the parts as fast as they are written)"))
            raise w.failed  # type: ignore[misc]
        try:
            await w.slots.acquire()
            if w.upload is None:
                w.upload = await trio.to_thread.run_sync(self.uploads.create, w.key)
        except BaseException as exc:
            self._budget.release()
            if isinstance(exc, StoreError):
                self.fail(w, exc)
            elif isinstance(exc, Exception):  # any failure ends the file: never a later close of what is left
                log.exception("starting a part of %s failed", w.key)
                self.fail(w, Unavailable(f"{w.key}: {type(exc).__name__}"))
                raise w.failed from exc  # type: ignore[misc]
            raise
        number = len(w.etags) + 1
        w.etags.append("")
        w.sending += 1
        self._nursery.start_soon(self._part, w, number, part)

    async def _part(self, w: Writing, number: int, part: bytearray) -> None:
        assert w.slots is not None
        try:
            if w.failed is None:
                upload = w.upload
                assert upload is not None
                w.etags[number - 1] = await trio.to_thread.run_sync(self.uploads.part, w.key, upload, number, part)
                self.stats.parts_sent += 1
        except StoreError as exc:
            self.fail(w, exc)
        except Exception as exc:  # noqa: BLE001 - any failure aborts, never a half object
            log.exception("sending part %d of %s failed", number, w.key)
            self.fail(w, Unavailable(f"{w.key}: part {number}: {type(exc).__name__}"))
        finally:
            w.sending -= 1
            w.slots.release()
            self._budget.release()
            if len(part) == self.part_size and len(self._free) < self._budget.value and self._writing:
                self._free.append(part)
            if not w.sending:
                w.drained.set()
                w.drained = trio.Event()

    def fail(self, w: Writing, exc: StoreError) -> None:
        """The first failure of a file: every later write and its close fail with it, and its upload is aborted now
        (not at the close, which a writer that stopped may never send)."""
        if w.failed is None:
            w.failed = exc
            log.warning("writing %s failed: %s (its upload is aborted; no object is left)", w.key, exc)
            if self._nursery is not None:
                self._nursery.start_soon(self.abandon, w)

    async def finish(self, w: Writing) -> ObjectInfo:
        """The object, complete (once; later calls return it again), or the failure (the upload aborted)."""
        if w.done is not None:
            return w.done
        try:
            if w.failed is None and w.upload is None:
                info = await trio.to_thread.run_sync(self.uploads.put, w.key, self._rest(w))
            else:
                if w.failed is None and w.filled:
                    await self._send(w, self._rest(w))
                while w.sending:
                    await w.drained.wait()
                if w.failed is not None:
                    raise w.failed
                assert w.upload is not None
                info = await trio.to_thread.run_sync(self.uploads.complete, w.key, w.upload, w.etags, w.written)
        except StoreError as exc:
            self.fail(w, exc)
            await self.abandon(w)
            raise
        w.done = info
        self._ended(w)
        self.stats.uploads_completed += 1
        return info

    @staticmethod
    def _rest(w: Writing) -> bytearray:
        """The last part (shorter than a part): what the buffer holds."""
        rest = w.part[:w.filled] if w.part is not None else bytearray()
        w.part, w.filled = None, 0
        return rest

    def _ended(self, w: Writing) -> None:
        self._writing.discard(w)
        if not self._writing:
            self._free.clear()  # (nothing is being written: the kept buffers go back)

    async def delete(self, key: str) -> None:
        await trio.to_thread.run_sync(self.uploads.delete, key)

    async def abandon(self, w: Writing) -> None:
        """No object: the upload (if one began) is aborted once its parts in flight ended."""
        if w.done is not None or w not in self._writing:
            return
        self._ended(w)
        w.part = None
        if w.failed is None:
            w.failed = Unavailable(f"{w.key}: abandoned")
        while w.sending:
            await w.drained.wait()
        if w.upload is not None:
            await trio.to_thread.run_sync(self.uploads.abort, w.key, w.upload)
        self.stats.uploads_aborted += 1
