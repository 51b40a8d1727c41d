"""The writer alone (read/writer.py) over a fake store of uploads: parts in flight bounded per file and by the mount's
budget, a failure aborts and leaves nothing, writes only in order. Real mounts: test_writes.py."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from fusecore.read.writer import Refused, Writer
from fusecore.store.errors import Unavailable
from fusecore.store.objects import ObjectInfo


class FakeUploads:
    """Records what a store was asked; a part can be slow or fail."""

    def __init__(self, part_seconds: float = 0.0, fail_part: int | None = None):
        self.part_seconds, self.fail_part = part_seconds, fail_part
        self.parts: dict[int, bytes] = {}
        self.in_flight = self.most_in_flight = 0
        self.created = self.completed = self.aborted = 0
        self.puts: list[bytes] = []
        self._lock = threading.Lock()

    def create(self, key: str) -> str:
        self.created += 1
        return "upload-1"

    def part(self, key: str, upload: str, number: int, data: bytes) -> str:
        with self._lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            time.sleep(self.part_seconds)
            if number == self.fail_part:
                raise Unavailable(f"part {number}: 500 after retries")
            self.parts[number] = bytes(data)
            return f'"etag{number}"'
        finally:
            with self._lock:
                self.in_flight -= 1

    def complete(self, key: str, upload: str, etags: list[str], size: int) -> ObjectInfo:
        assert etags == [f'"etag{n}"' for n in range(1, len(etags) + 1)]
        self.completed += 1
        return ObjectInfo(key, size, '"done-3"', 0.0)

    def put(self, key: str, data: bytes) -> ObjectInfo:
        self.puts.append(bytes(data))
        return ObjectInfo(key, len(data), '"put"', 0.0)

    def abort(self, key: str, upload: str) -> None:
        self.aborted += 1

    def delete(self, key: str) -> None:
        pass


def _run(uploads: FakeUploads, body, **kw):
    async def main():
        writer = Writer(uploads, **{"part_size": 1000, "concurrency": 2, "budget": 3000, "deadline": 30.0, **kw})
        async with trio.open_nursery() as nursery:
            writer.start(nursery)
            result = await body(writer)
            nursery.cancel_scope.cancel()
        return result

    return trio.run(main)


def test_parts_stream_while_writing_within_the_file_s_and_the_mount_s_bounds():
    uploads = FakeUploads(part_seconds=0.02)
    data = bytes(range(256)) * 40  # 10,240 bytes: 10 whole parts and a short one

    async def body(writer: Writer):
        w = writer.begin("k")
        for i in range(0, len(data), 700):
            await writer.write(w, i, data[i:i + 700])
        return await writer.finish(w)

    info = _run(uploads, body)
    assert b"".join(uploads.parts[n] for n in sorted(uploads.parts)) == data
    assert info.size == len(data) and uploads.completed == 1 and uploads.aborted == 0
    assert uploads.most_in_flight == 2  # the file's concurrency (the budget allows 3)


def test_a_small_file_is_one_put():
    uploads = FakeUploads()

    async def body(writer: Writer):
        w = writer.begin("k")
        await writer.write(w, 0, b"abc")
        return await writer.finish(w)

    assert _run(uploads, body).size == 3 and uploads.puts == [b"abc"] and uploads.created == 0


def test_a_failed_part_fails_the_close_and_aborts_the_upload():
    uploads = FakeUploads(fail_part=2)

    async def body(writer: Writer):
        w = writer.begin("k")
        with pytest.raises(Unavailable):
            for i in range(0, 5000, 500):
                await writer.write(w, i, b"x" * 500)
        await trio.sleep(0.1)  # aborted without waiting for the close
        assert uploads.aborted == 1
        with pytest.raises(Unavailable):
            await writer.finish(w)
        return writer.stats

    stats = _run(uploads, body)
    assert uploads.completed == 0 and uploads.aborted == 1 and stats.uploads_aborted == 1


def test_writes_only_in_order():
    async def body(writer: Writer):
        w = writer.begin("k")
        await writer.write(w, 0, b"12345")
        with pytest.raises(Refused) as caught:
            await writer.write(w, 9, b"x")
        return caught.value.why

    assert _run(FakeUploads(), body) == "not_sequential"


def test_a_store_that_takes_no_parts_fails_the_write_within_the_deadline():
    uploads = FakeUploads(part_seconds=0.5)

    async def body(writer: Writer):
        w = writer.begin("k")
        with pytest.raises(Unavailable):
            for i in range(0, 10_000, 1000):  # the budget (1 part) stays taken
                await writer.write(w, i, b"y" * 1000)
        return True

    assert _run(uploads, body, budget=1000, deadline=0.2)
