"""The fetch scheduler against the fake store: dedup, bounds, retries, changed objects, deadlines."""

import threading
import time

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from fusecore.cache.blocks import BlockKey
from fusecore.cache.memory import BlockCache
from fusecore.read.fetcher import FORWARD_PARTS, Fetcher
from fusecore.metrics import MountMetrics
from fusecore.store.objects import Parts, Progress
from fusecore.store.errors import AccessDenied, PreconditionFailed, Unavailable
from tests.support.fakestore import FakeStore
from tests.support.waiting import until

KiB = 1024
BLOCK = 64 * KiB


class FakeTime:
    """The retry schedule's clock: a sleep moves it forward at once (the store calls still run for real)."""

    def __init__(self):
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        await trio.sleep(0)


def make(store, *, budget=8 * 1024 * KiB, concurrency=4, inflight=1024 * KiB, deadline=10.0, fake_time=None,
         block=BLOCK):
    cache = BlockCache(budget)
    timing = {"clock": fake_time, "sleep": fake_time.sleep} if fake_time is not None else {}
    fetcher = Fetcher(store, cache, MountMetrics(), block_size=block, max_concurrency=concurrency,
                      inflight_limit=inflight, read_deadline=deadline, **timing)
    return fetcher, cache


def run(fn):
    async def main():
        async with trio.open_nursery() as nursery:
            await fn(nursery)
            nursery.cancel_scope.cancel()
    trio.run(main)


async def prefetch_gets_out(fetcher, store) -> int:
    """Wait until every prefetch the fetcher admitted has its GET at the store (held there by the test), and
    return how many it admitted. Admission is synchronous (prefetch() starts the tasks); once every task is
    blocked, each admitted one counted its GET and waits for its receiving thread, which then reaches the
    store: the count is final, however slowly the machine ran them."""
    await wait_all_tasks_blocked()
    admitted = int(fetcher.metrics.value(fetcher.metrics.get_requests, kind="prefetch"))
    await until(lambda: len(store.ranges) >= admitted)
    return admitted


def test_concurrent_readers_of_one_block_share_one_get():
    store = FakeStore()
    info = store.put("k", bytes(range(256)) * 1024)
    store.faults.latency = 0.05
    fetcher, _ = make(store)
    results = []

    async def body(nursery):
        fetcher.start(nursery)

        async def reader():
            data, _ = await fetcher.block(info, 1)
            results.append(bytes(data))

        async with trio.open_nursery() as inner:
            for _ in range(20):
                inner.start_soon(reader)

    run(body)
    assert store.calls["get"] == 1
    assert all(r == (bytes(range(256)) * 1024)[BLOCK:2 * BLOCK] for r in results)
    assert len(results) == 20


def test_concurrency_and_inflight_bytes_are_bounded():
    store = FakeStore()
    info = store.put("big", b"x" * (64 * BLOCK))
    store.faults.latency = 0.02
    fetcher, cache = make(store, concurrency=3, inflight=5 * BLOCK)
    peak_reserved = []

    async def body(nursery):
        fetcher.start(nursery)

        async def watch():
            while True:
                peak_reserved.append(cache.stats().reserved)
                await trio.sleep(0.005)

        nursery.start_soon(watch)
        async with trio.open_nursery() as inner:
            for i in range(64):
                inner.start_soon(fetcher.block, info, i)

    run(body)
    assert store.max_active <= 3
    assert max(peak_reserved) <= 5 * BLOCK
    assert store.calls["get"] == 64


def test_transient_failures_are_retried_then_succeed():
    store = FakeStore()
    info = store.put("k", b"abc" * 50_000)
    store.faults.transient = 2  # e.g. 503 SlowDown / reset that survived botocore's own retries
    fetcher, _ = make(store)
    out = []

    async def body(nursery):
        fetcher.start(nursery)
        out.append(await fetcher.block(info, 0))

    run(body)
    assert bytes(out[0][0]) == (b"abc" * 50_000)[:BLOCK]
    assert store.calls["get"] == 3


class LoopStore(FakeStore):
    """A store that reads ranges up to 32 KiB from the event loop (as S3Store does on awscrt connections)."""

    loop_range_limit = 32 * KiB

    async def read_range_on_loop(self, key, start, end, etag, into, progress):
        self.calls["on_loop"] += 1
        assert end - start <= self.loop_range_limit
        await trio.to_thread.run_sync(self.read_range, key, start, end, etag, into, progress)


@pytest.mark.parametrize("kind", [FakeStore, LoopStore], ids=["thread", "event-loop"])
def test_persistent_failures_give_up_at_the_deadline_with_an_error_not_a_hang(caplog, kind):
    store = kind()
    info = store.put("k", b"abc" * 5_000 if kind is LoopStore else b"abc" * 50_000)  # on the loop: up to 32 KiB
    store.faults.transient = 10_000
    time_ = FakeTime()
    fetcher, _ = make(store, deadline=1.0, fake_time=time_)

    async def body(nursery):
        fetcher.start(nursery)
        with pytest.raises(Exception) as err:
            await fetcher.block(info, 0)
        assert err.value.kind in ("transient", "unavailable")

    run(body)
    assert store.calls["get"] > 3  # retried for as long as the read may wait, not a fixed count
    assert store.calls["get"] == len(time_.sleeps) + 1  # every retry waited its backoff first
    assert time_.now - 1000.0 < 1.0  # it gave up before the deadline: the next pause would have passed it
    assert store.calls["on_loop"] == (store.calls["get"] if kind is LoopStore else 0)
    last = min(info.size, BLOCK) - 1
    failures = [r for r in caplog.records if r.levelname == "WARNING" and f"k bytes 0-{last}" in r.getMessage()]
    assert len(failures) == 1 and "attempt" in failures[0].getMessage()  # logged once, with range and attempts


def test_a_burst_of_throttling_is_ridden_out_with_backoff():
    """Several seconds of 503 SlowDown: the read waits them out (within its deadline) and gets the right bytes."""
    store = FakeStore()
    data = bytes(range(256)) * 512
    info = store.put("k", data)
    store.faults.throttle_until = time.monotonic() + 2.0
    fetcher, _ = make(store, deadline=30.0)
    out = []

    async def body(nursery):
        fetcher.start(nursery)
        out.append(bytes((await fetcher.block(info, 1))[0]))

    run(body)
    assert out == [data[BLOCK:2 * BLOCK]]
    throttled = store.calls["throttled"]
    assert throttled >= 3 and fetcher.metrics.value(fetcher.metrics.throttled) == throttled
    assert throttled < 40  # backoff, not a busy loop


def test_retry_after_is_honoured():
    store = FakeStore()
    info = store.put("k", b"z" * BLOCK)
    store.faults.throttled = 1
    store.faults.retry_after = 0.6
    time_ = FakeTime()
    fetcher, _ = make(store, fake_time=time_)

    async def body(nursery):
        fetcher.start(nursery)
        await fetcher.block(info, 0)

    run(body)
    assert store.calls["get"] == 2 and time_.sleeps == [0.6]  # waited what the store asked, then retried


def test_an_unexpected_error_fails_that_read_and_the_fetcher_serves_on(caplog):
    store = FakeStore()
    data = b"q" * (3 * BLOCK)
    info = store.put("k", data)
    store.faults.explode = 1
    fetcher, _ = make(store)
    out = []

    async def body(nursery):
        fetcher.start(nursery)
        with pytest.raises(Unavailable, match="unexpected RuntimeError"):
            await fetcher.block(info, 0)
        out.append(bytes((await fetcher.block(info, 0))[0]))  # the same block, asked again, arrives
        out.append(bytes((await fetcher.block(info, 2))[0]))

    run(body)
    assert out == [data[:BLOCK], data[2 * BLOCK:]]
    assert any("unexpected error fetching k block 0" in r.getMessage() and r.exc_info for r in caplog.records)


def test_a_store_that_stops_answering_fails_the_read_within_the_deadline():
    store = FakeStore()
    info = store.put("k", b"abc" * 50_000)
    store.hold()  # no GET is ever answered (until the test is over)
    fetcher, _ = make(store, deadline=0.5)

    async def body(nursery):
        fetcher.start(nursery)
        try:
            started = time.monotonic()
            with pytest.raises(Unavailable):
                await fetcher.block(info, 0)
            # The bound is the behaviour: the read's deadline (0.5 s), with a margin a loaded machine keeps;
            # without it the read would wait for the store (here: until the test lets the GET go).
            assert time.monotonic() - started < 5.0
        finally:
            store.release()

    run(body)


def test_a_changed_object_fails_and_drops_its_cached_blocks():
    store = FakeStore()
    old = store.put("k", b"1" * (3 * BLOCK))
    fetcher, cache = make(store)

    async def body(nursery):
        fetcher.start(nursery)
        await fetcher.block(old, 0)
        assert BlockKey("k", old.etag, 0) in cache
        store.put("k", b"2" * (3 * BLOCK))  # overwritten behind our back
        with pytest.raises(PreconditionFailed):
            await fetcher.block(old, 1)
        assert BlockKey("k", old.etag, 0) not in cache, "never mix bytes of two versions"
        new = store.info("k")
        data, _ = await fetcher.block(new, 1)
        assert bytes(data) == b"2" * BLOCK

    run(body)


def test_access_denied_is_reported_as_such():
    store = FakeStore()
    info = store.put("secret", b"s" * 10)
    store.faults.denied_keys.add("secret")
    fetcher, _ = make(store)

    async def body(nursery):
        fetcher.start(nursery)
        with pytest.raises(AccessDenied):
            await fetcher.block(info, 0)

    run(body)


def test_unwanted_prefetches_are_skipped_and_wanted_ones_land_in_the_cache():
    store = FakeStore()
    info = store.put("k", b"z" * (20 * BLOCK))
    store.faults.latency = 0.01
    fetcher, cache = make(store, concurrency=1)

    async def body(nursery):
        fetcher.start(nursery)
        for i in range(10):
            fetcher.prefetch(info, i, wanted=lambda: False)
        fetcher.prefetch(info, 15)
        await until(lambda: BlockKey("k", info.etag, 15) in cache)  # after the ten: the queue goes in order
        await until(lambda: not fetcher.inflight)

    run(body)
    assert store.calls["get"] == 1


def test_a_reader_gets_the_first_bytes_before_the_whole_block_arrived():
    store = FakeStore()
    info = store.put("k", bytes(range(256)) * 4096)  # 1 MiB: 16 pieces of 64 KiB
    store.faults.chunk_delay = 0.05  # the whole block takes ~0.8 s
    fetcher, cache = make(store)

    async def body(nursery):
        fetcher.start(nursery)
        data, hit = await fetcher.block(info, 0, need=1000)
        assert bytes(memoryview(data)[:1000]) == (bytes(range(256)) * 4)[:1000] and not hit
        assert BlockKey("k", info.etag, 0) not in cache  # the rest of the block is still on its way
        data, _ = await fetcher.block(info, 0)
        assert bytes(data) == bytes(range(256)) * 256
        assert BlockKey("k", info.etag, 0) in cache

    run(body)
    assert store.calls["get"] == 1


def test_readers_of_one_block_are_each_woken_when_their_bytes_are_there():
    """No polling: each waiting reader is woken by the receiving thread at its own mark, the nearer
    mark first, all of them before the block is whole."""
    store = FakeStore()
    payload = bytes(range(256)) * 4096
    info = store.put("k", payload)  # 1 MiB: 16 pieces of 64 KiB
    store.faults.chunk_delay = 0.05
    fetcher, cache = make(store, block=1024 * KiB)
    woken: list[tuple[int, int]] = []

    async def reader(need: int) -> None:
        data, _ = await fetcher.block(info, 0, need=need)
        assert bytes(memoryview(data)[:need]) == payload[:need]
        woken.append((need, BlockKey("k", info.etag, 0) in cache))

    async def body(nursery):
        fetcher.start(nursery)
        async with trio.open_nursery() as readers:
            readers.start_soon(reader, 600_000)
            await wait_all_tasks_blocked()  # it waits for its mark (the farther one) before the others come
            readers.start_soon(reader, 100_000)
            readers.start_soon(reader, 300_000)

    run(body)
    assert woken == [(100_000, False), (300_000, False), (600_000, False)]
    assert store.calls["get"] == 1


def test_progress_wakes_once_at_the_nearest_mark_from_the_receiving_thread():
    progress = Progress()
    calls: list[int] = []
    progress.wake_at(500, lambda: calls.append(progress.received))
    progress.wake_at(200)  # a nearer mark replaces the farther one
    thread = threading.Thread(target=lambda: [progress.advance(100) for _ in range(10)])
    thread.start()
    thread.join()
    assert calls == [200]  # once, at the mark; not again for later pieces


def test_a_body_that_breaks_off_is_resumed_not_restarted():
    store = FakeStore()
    payload = bytes(range(256)) * 1024
    info = store.put("k", payload)
    store.faults.transient = 1
    store.faults.break_after = 40_000
    fetcher, _ = make(store)
    out = []

    async def body(nursery):
        fetcher.start(nursery)
        out.append(bytes((await fetcher.block(info, 0))[0]))

    run(body)
    assert out[0] == payload[:BLOCK]
    assert store.ranges == [("k", 0, BLOCK), ("k", 40_000, BLOCK)]


def test_prefetches_never_claim_more_room_than_the_staging_cap():
    """Bytes a prefetch promised stay promised while it waits for the byte budget and until its block
    is staged: otherwise later prefetches overcommit the room, and staged blocks are dropped unread
    (and fetched a second time when the reader comes)."""
    store = FakeStore()
    info = store.put("shards", b"y" * (64 * BLOCK))
    store.faults.latency = 0.02
    fetcher, cache = make(store, budget=2 * 1024 * KiB, inflight=2 * BLOCK)  # room: 4 blocks, 2 in flight
    issued = set()

    async def body(nursery):
        fetcher.start(nursery)
        with trio.move_on_after(3):
            while len(issued) < 64:  # a read-ahead that takes every bit of room it is given
                for index in range(64):
                    if index not in issued:
                        if not fetcher.prefetch(info, index):
                            break
                        issued.add(index)
                await trio.sleep(0)
        await until(lambda: not fetcher.inflight)

    run(body)
    assert cache.transient_room >= 0 and len(issued) >= 4
    assert cache.stats().prefetch_dropped == 0, "staged prefetches were dropped before anyone read them"
    assert store.calls["get"] == len(issued)


def test_a_demand_read_goes_before_queued_prefetches():
    """Fifty prefetches wait for the in-flight byte budget; a demand read that arrives then starts before
    any of them (prefetches hold at most 3/4 of the budget and yield to a waiting demand)."""
    store = FakeStore()
    a = store.put("a", b"a" * (50 * BLOCK))
    b = store.put("b", b"b" * BLOCK)
    store.hold(lambda key, start: key == "a")  # the prefetches' GETs stay in flight until the demand's is out
    fetcher, _ = make(store, concurrency=16, inflight=4 * BLOCK, budget=64 * 1024 * KiB)
    order = []

    async def body(nursery):
        fetcher.start(nursery)
        try:
            for index in range(50):
                assert fetcher.prefetch(a, index)
            admitted = await prefetch_gets_out(fetcher, store)  # the first prefetches are in flight, the rest wait
            started_before = len(store.ranges)
            assert started_before == admitted
            with trio.fail_after(30):  # a hang, not a speed: the demand must not wait for the held prefetches
                data, _ = await fetcher.block(b, 0)
            order.append((started_before, [k for k, _, _ in store.ranges].index("b")))
            assert bytes(data) == b"b" * BLOCK
        finally:
            store.release()

    run(body)
    started_before, demand_position = order[0]
    assert started_before == 3  # prefetches took 3 of the 4 blocks of budget, and no more
    assert demand_position == started_before  # no prefetch started between the demand's arrival and its GET


def test_prefetches_start_in_the_order_they_were_asked_for():
    """Twenty prefetches and three slots: the GETs go out block by block. trio runs a batch of new tasks
    forwards or backwards at random, so prefetch tasks racing for slots started the last blocks first
    about every other time (a reader then waited a whole GET for the block it needed next)."""
    for attempt in range(8):
        store = FakeStore()
        info = store.put("k", b"z" * (20 * BLOCK))
        store.faults.latency = 0.01
        fetcher, _ = make(store, concurrency=4, inflight=64 * BLOCK, budget=64 * 1024 * KiB)  # 3 prefetch slots

        async def body(nursery):
            fetcher.start(nursery)
            for index in range(20):
                assert fetcher.prefetch(info, index)
            await until(lambda: not fetcher.inflight)

        run(body)
        blocks = [start // BLOCK for _, start, _ in store.ranges]
        assert sorted(blocks) == list(range(20))
        # Three at a time, first asked first: when the n-th GET goes out, at most n finished, so it is
        # one of blocks 0..n+2 (the three in flight start in any order among themselves).
        assert all(block <= n + 2 for n, block in enumerate(blocks)), (attempt, blocks)
        assert store.max_active <= 3


def test_a_queued_prefetch_a_reader_waits_for_goes_at_once():
    """A reader that needs a block whose prefetch still queues behind others does not wait for their GETs."""
    store = FakeStore()
    info = store.put("k", b"q" * (12 * BLOCK))
    store.hold()  # the prefetches' GETs stay in flight: their slots stay taken
    fetcher, _ = make(store, concurrency=4, inflight=64 * BLOCK, budget=64 * 1024 * KiB)  # 3 prefetch slots
    asked: list[int] = []

    async def body(nursery):
        fetcher.start(nursery)
        try:
            for index in range(9):
                assert fetcher.prefetch(info, index)
            assert await prefetch_gets_out(fetcher, store) == 3  # three are in flight, six queue
            in_flight = {start for _, start, _ in store.ranges}
            waiting = max(set(range(9)) - {start // BLOCK for start in in_flight})
            store.hold(lambda key, start: start in in_flight)  # the three stay in flight; any other GET goes
            with trio.fail_after(30):  # a hang, not a speed: it must not wait for a prefetch slot
                data, hit = await fetcher.block(info, waiting)
            assert bytes(data) == b"q" * BLOCK and not hit
            # Its own GET, while all three prefetches were still in flight: it did not wait for a round of them.
            assert store.active == 3 and len(store.ranges) == 4
            asked.append(waiting)
        finally:
            store.release()

    run(body)
    assert [start for _, start, _ in store.ranges].count(asked[0] * BLOCK) == 1  # and it was fetched once


def test_a_block_in_parts_is_fetched_in_parallel_gets_and_read_as_a_prefix():
    """`parts`: four GETs of a quarter each at once; a reader of the first bytes is woken when the first
    part is in, however the others progress; the block in the cache is byte-exact."""
    store = FakeStore()
    payload = bytes(range(256)) * 4096  # 1 MiB block
    info = store.put("k", payload * 2)
    store.hold()
    fetcher, cache = make(store, block=1024 * KiB)
    first = trio.Event()

    async def reader():
        data, _ = await fetcher.block(info, 0, need=200_000, parts=4)
        assert bytes(memoryview(data)[:200_000]) == payload[:200_000]
        first.set()

    async def body(nursery):
        fetcher.start(nursery)
        try:
            async with trio.open_nursery() as readers:
                readers.start_soon(reader)
                await until(lambda: store.active == 4)  # the four quarters' GETs at once (one of the block: one)
                store.hold(lambda key, start: start != 0)  # the first quarter comes; the other three do not
                with trio.fail_after(30):  # a hang, not a speed
                    await first.wait()
            assert store.active >= 3  # woken while the other three quarters were held at the store
            store.release()
            data, _ = await fetcher.block(info, 0, parts=4)
            assert bytes(data) == payload
        finally:
            store.release()

    run(body)
    quarter = 256 * KiB
    assert sorted(store.ranges) == [("k", i * quarter, (i + 1) * quarter) for i in range(4)]
    assert store.max_active == 4
    assert BlockKey("k", info.etag, 0) in cache


def test_a_block_is_cut_in_parts_only_while_no_other_file_is_in_flight_unless_a_peer_waits_for_all_of_it():
    """Parts fill an idle pipe sooner; while another file streams, the block goes in one GET (four shard
    readers: more GETs only cost CPU). Blocks of the same file in flight do not count. A block forwarded to a
    peer is cut whatever streams: the peer gets none of it before all of it is here."""
    store = FakeStore()
    payload = bytes(range(256)) * 4096  # 1 MiB block
    a, b, c, d = (store.put(name, payload * (3 if name == "a" else 1)) for name in "abcd")
    fetcher, _ = make(store, block=1024 * KiB, concurrency=8, inflight=8 * 1024 * KiB, budget=64 * 1024 * KiB)

    async def streaming(key: str, start: int) -> None:
        """Hold that one GET in flight, and wait until it is at the store."""
        store.hold(lambda k, s: (k, s) == (key, start))
        await until(lambda: (key, start) in {(k, s) for k, s, _ in store.ranges})

    async def body(nursery):
        fetcher.start(nursery)
        try:
            assert fetcher.prefetch(a, 0)
            await streaming("a", 0)  # a's GET is running
            assert bytes((await fetcher.block(b, 0, parts=4))[0]) == payload
            store.release()
            await until(lambda: not fetcher.inflight)
            assert fetcher.prefetch(a, 2)
            await streaming("a", 2 * 1024 * KiB)  # a block of the same file is running
            assert bytes((await fetcher.block(a, 1, parts=4))[0]) == payload
            assert fetcher.prefetch(d, 0)
            await streaming("d", 0)  # d's GET is running
            assert bytes(await fetcher.forward(c, 0)) == payload
        finally:
            store.release()

    run(body)
    quarter = 256 * KiB
    assert [r for r in store.ranges if r[0] == "b"] == [("b", 0, 1024 * KiB)]
    part = 1024 * KiB // FORWARD_PARTS
    assert sorted(r for r in store.ranges if r[0] == "c") == [("c", i * part, (i + 1) * part)
                                                               for i in range(FORWARD_PARTS)]
    assert sorted(r for r in store.ranges if r[0] == "a" and 1024 * KiB <= r[1] < 2048 * KiB) == [
        ("a", 1024 * KiB + i * quarter, 1024 * KiB + (i + 1) * quarter) for i in range(4)]


def test_a_part_that_breaks_off_is_resumed_and_the_block_is_exact():
    store = FakeStore()
    payload = bytes(range(251)) * 4200  # four parts of ~257 KiB
    info = store.put("k", payload)
    store.faults.transient = 1
    store.faults.break_after = 10_000
    fetcher, _ = make(store, block=len(payload))
    out = []

    async def body(nursery):
        fetcher.start(nursery)
        out.append(bytes((await fetcher.block(info, 0, parts=4))[0]))

    run(body)
    assert out[0] == payload
    assert store.calls["get"] == 5  # four parts and one resumption, from where the broken one stopped
    broken = [r for r in store.ranges if r[1] % (len(payload) // 4) != 0]
    assert len(broken) == 1 and broken[0][1] % (len(payload) // 4) == 10_000


def test_parts_smaller_than_the_minimum_are_not_made():
    store = FakeStore()
    info = store.put("k", b"s" * BLOCK)  # 64 KiB: below MIN_PART, one GET
    fetcher, _ = make(store)

    async def body(nursery):
        fetcher.start(nursery)
        data, _ = await fetcher.block(info, 0, parts=4)
        assert bytes(data) == b"s" * BLOCK

    run(body)
    assert store.ranges == [("k", 0, BLOCK)]


def test_parts_count_the_bytes_before_the_first_gap():
    whole = Progress()
    parts = Parts(whole, 1000, 4)
    assert parts.extents == [(0, 250), (250, 500), (500, 750), (750, 1000)]
    parts.progress[1].advance(250)  # the second quarter whole, the first not begun: nothing readable
    parts.progress[3].advance(100)
    assert whole.received == 0
    parts.progress[0].advance(200)
    assert whole.received == 200
    parts.progress[0].advance(50)  # the first quarter whole: the second follows at once
    assert whole.received == 500
    parts.progress[2].advance(250)
    assert whole.received == 850
    parts.progress[3].advance(150)
    assert whole.received == 1000


def test_prefetches_leave_demand_reads_a_sixteenth_of_the_connections_and_bytes():
    """64 connections and 64 blocks of in-flight room: 60 prefetches fly at once (a sequential reader's whole
    window), and a demand read that comes then still starts at once on the four kept for it."""
    store = FakeStore()
    info = store.put("k", b"w" * (80 * BLOCK))
    other = store.put("o", b"o" * BLOCK)
    store.hold(lambda key, start: key == "k")  # the prefetches' GETs stay in flight, holding their connections
    fetcher, _ = make(store, concurrency=64, inflight=64 * BLOCK, budget=1024 * 1024 * KiB)
    took = []

    async def body(nursery):
        fetcher.start(nursery)
        try:
            for index in range(80):
                assert fetcher.prefetch(info, index)
            took.append(await prefetch_gets_out(fetcher, store))  # every admitted one is at the store: no 61st
            took.append(store.active)
            with trio.fail_after(30):  # a hang, not a speed: it must not wait for a prefetch to end
                data, _ = await fetcher.block(other, 0)
            assert bytes(data) == b"o" * BLOCK
            took.append(store.active)  # its own GET went while all 60 prefetches were still in flight
        finally:
            store.release()

    run(body)
    assert took == [60, 60, 60], took


def test_small_ranges_a_store_reads_on_the_loop_go_there_with_the_same_retries():
    store = LoopStore()
    small = store.put("small", b"s" * 20 * KiB)
    large = store.put("large", bytes(range(256)) * 1024)
    store.faults.transient = 2
    fetcher, _ = make(store)
    out = []

    async def body(nursery):
        fetcher.start(nursery)
        out.append(await fetcher.block(small, 0))
        out.append(await fetcher.block(large, 1))

    run(body)
    assert bytes(out[0][0]) == b"s" * 20 * KiB and bytes(out[1][0]) == (bytes(range(256)) * 1024)[BLOCK:2 * BLOCK]
    assert store.calls["on_loop"] == 3, "the small file on the loop, twice refused and retried"
    assert store.calls["get"] == 4, "the 64 KiB block through a worker thread"



def _two_workers(tmp_path, store, **kwargs):
    """This worker's fetcher on a mount's shared blocks, and the shared blocks as another worker sees them."""
    from fusecore.cache import shared

    root = str(tmp_path / "shared")
    shared.prepare(root)
    fetcher, _ = make(store, **kwargs)
    fetcher.shared = shared.SharedBlocks(root)
    return fetcher, shared.SharedBlocks(root)


def test_a_block_another_worker_fetches_is_waited_for_and_read_from_its_file(tmp_path):
    store = FakeStore()
    data = bytes(range(256)) * 1024
    info = store.put("k", data)
    fetcher, other = _two_workers(tmp_path, store, deadline=120.0)  # (a bound no loaded machine reaches)
    block = BlockKey("k", info.etag, 1)
    claim = other.try_claim(block)  # the other worker's GET of block 1 is under way
    got = []

    async def body(nursery):
        fetcher.start(nursery)

        async def reader():
            got.append(await fetcher.block(info, 1))

        nursery.start_soon(reader)
        await until(lambda: fetcher.shared.stats.waits == 1)
        other.publish(claim, data[BLOCK:2 * BLOCK])
        claim.release()
        await until(lambda: got)

    run(body)
    assert bytes(got[0][0]) == data[BLOCK:2 * BLOCK]
    assert store.ranges == [] and fetcher.shared.stats.loaded == 1  # the store sent it once, to the other
    assert fetcher.shared.stats.takeovers == 0


def test_a_claim_its_worker_gave_up_is_taken_over_and_one_held_past_the_deadline_is_fetched_without(tmp_path):
    store = FakeStore()
    data = bytes(range(256)) * 1024
    info = store.put("k", data)
    clock = FakeTime()
    fetcher, other = _two_workers(tmp_path, store, deadline=1.0, fake_time=clock)
    failed = other.try_claim(BlockKey("k", info.etag, 1))
    stuck = other.try_claim(BlockKey("k", info.etag, 2))  # never released: its worker hangs
    got = {}

    async def body(nursery):
        fetcher.start(nursery)

        async def reader(index):
            got[index] = await fetcher.block(info, index)

        nursery.start_soon(reader, 1)
        await until(lambda: fetcher.shared.stats.waits == 1)
        failed.release()  # its GET failed: nothing published
        await until(lambda: 1 in got)
        nursery.start_soon(reader, 2)
        await until(lambda: 2 in got)

    run(body)
    for index in (1, 2):
        assert bytes(got[index][0]) == data[index * BLOCK:(index + 1) * BLOCK]
    assert fetcher.shared.stats.takeovers == 1 and len(store.ranges) == 2  # each from the store, by this worker
    waits = clock.sleeps[clock.sleeps.index(0.0005):]
    assert waits[:5] == [0.0005, 0.001, 0.002, 0.004, 0.004], waits[:5]  # doubling, then at most 4 ms apart
    assert stuck is not None
