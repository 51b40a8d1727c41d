"""Reads through the data path (reader + fetcher + cache) against the fake store."""

import random

import pytest
import trio
from hypothesis import given, settings, strategies as st

from fusecore.config import MountConfig, StoreConfig
from fusecore.read.datapath import DataPath
from fusecore.read.reader import FIRST_BLOCK_PARTS
from tests.support.fakestore import FakeStore
from tests.support.waiting import until

KiB = 1024
MiB = 1024 * KiB


def datapath(store, cache=16 * MiB, block=256 * KiB, prefetch=4 * MiB, concurrency=8):
    cfg = MountConfig(store=StoreConfig(bucket="b", max_concurrency=concurrency), cache_size=cache, block_size=block,
                      max_prefetch=prefetch)
    return DataPath(cfg, store)


def run(dp, fn):
    async def main():
        async with trio.open_nursery() as nursery:
            dp.start(nursery)
            await fn()
            nursery.cancel_scope.cancel()
    trio.run(main)


def watch_walks(dp) -> list[str]:
    """The paths of the directories whose walk ahead has ended, in the order they ended. A walk ahead lists its
    directory (Namespace.list_if_one_page) and then issues that directory's prefetches without a checkpoint
    between the two: once the listing returned, as any other task sees it, the walk ahead is over."""
    ended: list[str] = []
    listing = dp.namespace.list_if_one_page

    async def list_if_one_page(node):
        try:
            await listing(node)
        finally:
            ended.append(node.path)

    dp.namespace.list_if_one_page = list_if_one_page
    return ended


async def settled(dp, walks: list[str] | None = None) -> None:
    """Wait until nothing of the data path is under way: every walk ahead it started has ended (`walks`, from
    watch_walks; None for a test that opens no file through the walk) and no GET is in flight or queued.
    Prefetches are issued synchronously by reads, opens and walks ahead, so nothing more starts without a new
    read: what the store was asked is then all it will be asked."""
    await until(lambda: (walks is None or len(walks) == dp.walk.dirs_ahead) and not dp.fetcher.inflight)


def read_all(dp, info, chunk):
    async def go():
        fh = dp.reader.open(info)
        out = bytearray()
        for off in range(0, info.size, chunk):
            out += await dp.reader.read(fh, off, chunk)
        dp.reader.release(fh)
        return bytes(out)
    return go


@settings(max_examples=40, deadline=None)
@given(reads=st.lists(st.tuples(st.integers(0, 3 * MiB), st.integers(1, 700 * KiB)), min_size=1, max_size=12))
def test_random_reads_return_exactly_the_object_bytes(reads):
    store = FakeStore()
    data = random.Random(7).randbytes(3 * MiB + 123)
    info = store.put("obj", data)
    dp = datapath(store)

    async def go():
        fh = dp.reader.open(info)
        for off, size in reads:
            got = bytes(await dp.reader.read(fh, off, size))
            assert got == data[off:off + size]

    run(dp, go)


def test_sequential_read_prefetches_and_a_second_pass_needs_no_get():
    store = FakeStore()
    data = random.Random(1).randbytes(8 * MiB)
    info = store.put("shard", data)
    dp = datapath(store)
    out = []

    async def go():
        out.append(await read_all(dp, info, 128 * KiB)())
        gets_after_first = store.calls["get"]
        out.append(await read_all(dp, info, 128 * KiB)())
        out.append(store.calls["get"] - gets_after_first)

    run(dp, go)
    assert out[0] == data and out[1] == data
    assert out[2] == 0, "epoch 2 is served from the cache"
    assert store.calls["get"] == 8 * MiB // (256 * KiB), "each block fetched exactly once"
    assert dp.stats()["requests"]["get_prefetch"] > 0


def test_small_files_are_fetched_whole_in_one_get():
    store = FakeStore()
    infos = [store.put(f"img/{i}.jpg", random.Random(i).randbytes(110 * KiB)) for i in range(20)]
    dp = datapath(store, block=1 * MiB)

    async def go():
        for info in infos:
            await read_all(dp, info, 128 * KiB)()

    run(dp, go)
    assert store.calls["get"] == 20
    assert all(end - start == 110 * KiB for _, start, end in store.ranges)


def test_multi_epoch_dataset_larger_than_cache_keeps_hitting():
    """3 epochs over a dataset 1.5x the cache, same order: epochs 2-3 must not collapse to 0 hits."""
    store = FakeStore()
    block = 256 * KiB
    cache = 32 * block
    infos = [store.put(f"d/{i}", random.Random(i).randbytes(4 * block)) for i in range(12)]  # 48 blocks
    dp = datapath(store, cache=cache, block=block, prefetch=2 * block)
    ratios = []

    async def go():
        for _ in range(3):
            gets = store.calls["get"]
            for info in infos:
                await read_all(dp, info, 128 * KiB)()
            ratios.append(1 - (store.calls["get"] - gets) / 48)

    run(dp, go)
    assert ratios[0] == 0.0
    target = 0.5 * (32 / 48)
    assert min(ratios[1:]) >= target, ratios


def test_opening_small_files_of_a_directory_prefetches_its_other_files():
    store = FakeStore()
    for i in range(40):
        store.put(f"imgs/{i:03d}.jpg", random.Random(i).randbytes(100 * KiB))
    dp = datapath(store, block=1 * MiB, prefetch=2 * MiB)  # the walk budget: ~20 files ahead at a time
    walks = watch_walks(dp)

    async def go():
        await dp.namespace.readdir(1)
        imgs = await dp.namespace.lookup(1, "imgs")
        children = await dp.namespace.readdir(imgs.inode)
        order = [dp.namespace.node(inode) for _, inode in children]
        random.Random(0).shuffle(order)
        for node in order:
            dp.walk.on_open(node)
            await read_all(dp, node.info, 128 * KiB)()
            await settled(dp, walks)  # a reader slower than the store: its work on a file outlasts the GETs under way

    run(dp, go)
    stats = dp.stats()
    assert dp.walk.issued >= 30
    assert store.calls["get"] == 40, "every file fetched exactly once, prefetched or not"
    assert stats["cache"]["hits"] >= 25, "most files were already in memory when the reader came"


def one_object(seed: int, size: int, concurrency: int = 8):
    """A fake store holding one object of random bytes, and a data path of 4 MiB blocks over it."""
    store = FakeStore()
    data = random.Random(seed).randbytes(size)
    return store, data, store.put("big", data), datapath(store, cache=64 * MiB, block=4 * MiB, concurrency=concurrency)


@pytest.mark.parametrize("size", [4 * KiB, 256 * KiB, 1 * MiB])
def test_random_reads_at_page_aligned_offsets_cost_the_store_what_they_read(size):
    """Records at random 4 KiB-aligned offsets (HDF5, LMDB, zarr, a shard's members) are fetched to the byte:
    no aligned page or block rounds them up (256 KiB pages cost 2x for a 256 KiB read, 64x for 4 KiB)."""
    store, data, info, dp = one_object(seed=3, size=64 * MiB)
    rng = random.Random(4)

    async def go():
        fh = dp.reader.open(info)
        for _ in range(40):
            off = rng.randrange(1, (len(data) - size) // (4 * KiB)) * 4 * KiB
            assert bytes(await dp.reader.read(fh, off, size)) == data[off:off + size]

    run(dp, go)
    fetched = sum(end - start for _, start, end in store.ranges)
    assert fetched <= 1.1 * 40 * size, f"read amplification {fetched / (40 * size):.2f}"


def test_a_random_range_comes_in_parts_at_once():
    """The store's bandwidth is per connection: a 1 MiB record arrives in four GETs of 256 KiB at once, a 256 KiB
    one in four of 64 KiB, a 128 KiB one in two, a 64 KiB one in one GET."""
    store, data, info, dp = one_object(seed=9, size=16 * MiB)
    records = [(5 * MiB + 12 * KiB, MiB), (9 * MiB + 4 * KiB, 256 * KiB), (11 * MiB, 128 * KiB),
               (13 * MiB + 4 * KiB, 64 * KiB)]

    async def go():
        fh = dp.reader.open(info)
        for start, size in records:
            assert bytes(await dp.reader.read(fh, start, size)) == data[start:start + size]

    run(dp, go)
    assert sorted((s, e) for _, s, e in store.ranges) == [piece for (start, size), count in zip(records, (4, 4, 2, 1))
                                                          for piece in _parts(start, size, count)]


def _parts(start, size, count):
    return [(start + i * size // count, start + (i + 1) * size // count) for i in range(count)]


def test_a_random_range_takes_no_more_parts_than_half_the_free_connections():
    """Parts that wait for a connection gain nothing and cost requests: with two connections, a 256 KiB record
    comes in one GET."""
    store, data, info, dp = one_object(seed=9, size=16 * MiB, concurrency=2)

    async def go():
        fh = dp.reader.open(info)
        assert bytes(await dp.reader.read(fh, 9 * MiB + 4 * KiB, 256 * KiB)) == data[9 * MiB + 4 * KiB:9 * MiB + 260 * KiB]

    run(dp, go)
    assert [(s, e) for _, s, e in store.ranges] == [(9 * MiB + 4 * KiB, 9 * MiB + 260 * KiB)]


def test_a_read_inside_a_held_range_needs_no_get():
    """A random run's ranges are cached: the same record read again, or a smaller read inside one, is a hit."""
    store, data, info, dp = one_object(seed=10, size=16 * MiB)

    async def go():
        fh = dp.reader.open(info)
        await dp.reader.read(fh, 3 * MiB, 256 * KiB)
        await dp.reader.read(fh, 9 * MiB, 256 * KiB)
        gets = store.calls["get"]
        assert bytes(await dp.reader.read(fh, 3 * MiB, 256 * KiB)) == data[3 * MiB:3 * MiB + 256 * KiB]
        assert bytes(await dp.reader.read(fh, 9 * MiB + 8 * KiB, 4 * KiB)) == data[9 * MiB + 8 * KiB:9 * MiB + 12 * KiB]
        assert store.calls["get"] == gets, "served from the held ranges"
        assert bytes(await dp.reader.read(fh, 9 * MiB + 252 * KiB, 8 * KiB)) == data[9 * MiB + 252 * KiB:9 * MiB + 260 * KiB]
        assert store.calls["get"] == gets + 1, "a read past a held range's end is fetched"

    run(dp, go)


def test_a_sequential_run_after_random_reads_still_gets_whole_blocks_and_read_ahead():
    store = FakeStore()
    data = random.Random(12).randbytes(32 * MiB)
    info = store.put("big", data)
    dp = datapath(store, cache=128 * MiB, block=1 * MiB, prefetch=8 * MiB)

    async def go():
        fh = dp.reader.open(info)
        for off in (7 * MiB + 4 * KiB, 2 * MiB + 64 * KiB, 20 * MiB):
            await dp.reader.read(fh, off, 64 * KiB)
        dp.reader.release(fh)
        del store.ranges[:]
        assert await read_all(dp, info, 128 * KiB)() == data

    run(dp, go)
    whole = [(s, e) for _, s, e in store.ranges if e - s == MiB and s % MiB == 0]
    assert len(whole) >= 28, "a read from the start gets whole blocks (the first may come in parts; the three that " \
                             "hold a random read's range come around it)"
    assert sum(e - s for _, s, e in store.ranges) == len(data) - 3 * 64 * KiB, "each byte fetched once, both passes"
    around = sorted((s, e) for _, s, e in store.ranges if 2 * MiB <= s < 3 * MiB)  # (the gaps go at once)
    assert around == [(2 * MiB, 2 * MiB + 64 * KiB), (2 * MiB + 128 * KiB, 3 * MiB)], "block 2 around its held range"
    assert dp.stats()["requests"]["get_prefetch"] > 0


def test_a_seek_abandons_the_prefetches_still_queued_for_the_old_position():
    store = FakeStore()
    data = random.Random(8).randbytes(32 * MiB)
    info = store.put("big", data)
    store.faults.latency = 0.05
    cfg = MountConfig(store=StoreConfig(bucket="b", max_concurrency=1), cache_size=256 * MiB,
                      block_size=256 * KiB, max_prefetch=8 * MiB)
    dp = DataPath(cfg, store)

    async def go():
        fh = dp.reader.open(info)
        for off in range(0, 2 * MiB, 256 * KiB):  # sequential: a window of prefetches gets queued
            await dp.reader.read(fh, off, 256 * KiB)
        assert dp.fetcher.inflight > 2
        started_before_seek.append(len(store.ranges))
        await dp.reader.read(fh, 30 * MiB, 4096)  # seek far away
        await settled(dp)  # every prefetch queued before the seek went, or was dropped

    started_before_seek = []
    run(dp, go)
    after_seek = store.ranges[started_before_seek[0]:]
    old_position = [r for r in after_seek if r[1] < 30 * MiB]
    assert len(old_position) <= 1, "queued read-ahead of the abandoned position was not fetched"


def test_a_few_random_files_of_a_huge_directory_do_not_fetch_the_directory():
    """Random opens in a big directory: the walk stops after a bounded number of files the reader never
    takes (it used to fetch the whole directory ahead, starving the reader's own GETs)."""
    from fusecore.read.walk import WALK_START

    store = FakeStore()
    names = [f"huge/{i:05d}.jpg" for i in range(3000)]
    for name in names:
        store.put(name, b"x" * (2 * KiB))
    dp = datapath(store, cache=256 * MiB, block=1 * MiB, prefetch=64 * MiB)
    picks = random.Random(11).sample(range(len(names)), 60)
    walks = watch_walks(dp)

    async def go():
        await dp.namespace.readdir(1)
        huge = await dp.namespace.lookup(1, "huge")
        children = await dp.namespace.readdir(huge.inode)
        for i in picks:
            node = dp.namespace.node(children[i][1])
            dp.walk.on_open(node)
            await read_all(dp, node.info, 2 * KiB)()
        await settled(dp, walks)  # every file the walk asked for was fetched

    run(dp, go)
    assert store.calls["get"] <= len(picks) + WALK_START + 8 * 4, store.calls["get"]


@pytest.mark.parametrize("cache_mib", [256, 8])
def test_a_shuffled_pass_over_one_flat_folder_is_fetched_whole_ahead_where_the_cache_holds_it(cache_mib):
    """A flat folder read in shuffled order rarely opens a file the walk fetched, so the walk's own bound never
    grew (issue 44: the store's slots sat idle). Once the reader opened PASS_FRACTION of it, a folder the cache
    can hold is fetched whole ahead of the reader, each file once; one the cache cannot hold stays as it was."""
    from fusecore.read.walk import PASS_FRACTION, PASS_MIN, WALK_GROWTH, WALK_START

    store = FakeStore()
    names = [f"flat/{i:05d}.jpg" for i in range(800)]
    bodies = {name: random.Random(name).randbytes(8 * KiB) for name in names}
    for name in names:
        store.put(name, bodies[name])
    dp = datapath(store, cache=cache_mib * MiB, block=1 * MiB, prefetch=min(64, cache_mib // 2) * MiB)
    order = random.Random(12).sample(range(len(names)), len(names))
    walks = watch_walks(dp)
    issued_at: list[int] = []

    async def go():
        flat = await dp.namespace.lookup(1, "flat")
        children = await dp.namespace.readdir(flat.inode)
        for n, i in enumerate(order):
            node = dp.namespace.node(children[i][1])
            dp.walk.on_open(node)
            assert await read_all(dp, node.info, 8 * KiB)() == bodies[names[i]]
            if n + 1 == max(PASS_MIN, int(PASS_FRACTION * len(names))) + 20:
                await settled(dp, walks)
                issued_at.append(dp.walk.issued)
        await settled(dp, walks)

    run(dp, go)
    assert store.calls["get"] == len(names), "each file fetched once, by the walk or its reader"
    if cache_mib == 256:
        assert dp.walk.whole_dirs == 1
        assert issued_at[0] >= len(names) - max(PASS_MIN, int(PASS_FRACTION * len(names))) - 20, issued_at  # the rest
    else:  # 6.25 MiB of files, more than half of an 8 MiB cache: never fetched whole
        assert dp.walk.whole_dirs == 0
        assert issued_at[0] <= WALK_START + WALK_GROWTH * 120, issued_at



def test_a_flat_folder_of_3000_files_is_taken_whole_at_its_64th_open_not_its_188th():
    """Issue 44: while the reader had opened less than a 16th of a 3,000-file folder (188 files), it went one GET per
    file, a third of a cold epoch; a 48th is reached at PASS_MIN, 64 opens. Before then the walk keeps to its bound
    (a reader that stops early fetches little it never reads)."""
    store = FakeStore()
    names = [f"coco/{i:05d}.jpg" for i in range(3000)]
    for name in names:
        store.put(name, b"j" * 1024)
    dp = datapath(store, cache=256 * MiB, block=1 * MiB, prefetch=64 * MiB)
    order = random.Random(44).sample(range(len(names)), 70)
    whole_at: list[int] = []

    async def go():
        coco = await dp.namespace.lookup(1, "coco")
        children = await dp.namespace.readdir(coco.inode)
        for n, i in enumerate(order, 1):
            dp.walk.on_open(dp.namespace.node(children[i][1]))
            if dp.walk.whole_dirs and not whole_at:
                whole_at.append(n)
        await settled(dp)

    run(dp, go)
    assert whole_at == [64], whole_at

def test_a_loader_going_through_a_directory_keeps_the_walk_ahead():
    store = FakeStore()
    store.faults.latency = 0.01
    for i in range(400):
        store.put(f"seq/{i:04d}.jpg", random.Random(i).randbytes(8 * KiB))
    dp = datapath(store, cache=256 * MiB, block=1 * MiB, prefetch=64 * MiB)

    async def go():
        seq = await dp.namespace.lookup(1, "seq")
        for _, inode in await dp.namespace.readdir(seq.inode):
            node = dp.namespace.node(inode)
            dp.walk.on_open(node)
            await read_all(dp, node.info, 8 * KiB)()

    run(dp, go)
    stats = dp.stats()
    # Ahead: the walk had asked for every file but the first few before the reader opened it, and each file
    # cost one GET. (How many of those GETs had started before their reader came is up to the machine's load:
    # a busy CPU lets the reader catch up with queued prefetches, which then go as demand reads.)
    assert store.calls["get"] == 400 and stats["walk_prefetches"] >= 390, (stats["walk_prefetches"], stats["requests"])


def _class_folders(store, folders, files, size=8 * KiB):
    for c in range(folders):
        for i in range(files):
            store.put(f"train/{c:03d}/{i:03d}.jpg", random.Random(c * 1000 + i).randbytes(size))


async def _open_as_the_kernel(dp, path):
    """Look a file up from the root, a component at a time (listing directories as lookups do), and open it."""
    node = dp.namespace.node(1)
    for name in path.split("/"):
        node = await dp.namespace.lookup(node.inode, name)
    dp.walk.on_open(node)
    return node


def test_a_shuffled_epoch_over_class_folders_is_walked_ahead_into_folders_not_opened_yet():
    """Once the reader opened files the walks of sibling folders fetched, the walk lists and fetches folders it has
    not reached, so a folder's first sample is not a LIST and a GET in a row; every file is still fetched once."""
    store = FakeStore()
    store.faults.latency = 0.002
    _class_folders(store, 24, 8)
    order = [f"train/{c:03d}/{i:03d}.jpg" for c in range(24) for i in range(8)]
    random.Random(5).shuffle(order)
    dp = datapath(store, cache=256 * MiB, block=1 * MiB, prefetch=64 * MiB)
    first_opens_ahead = []
    walks = watch_walks(dp)

    async def go():
        seen = set()
        for path in order:
            folder = path.rsplit("/", 1)[0]
            if folder not in seen:
                seen.add(folder)
                first_opens_ahead.append(any(key == path for key, _, _ in store.ranges))
            node = await _open_as_the_kernel(dp, path)
            assert await read_all(dp, node.info, 8 * KiB)() == store.objects[path][0]
            await settled(dp, walks)  # a reader slower than the store: its work on a sample outlasts the GETs under way

    run(dp, go)
    assert dp.walk.dirs_ahead > 0
    assert any(first_opens_ahead), "no folder's first sample had been fetched before the reader came"
    assert store.calls["get"] == len(order), "every file fetched exactly once"


def test_the_walk_ahead_lists_a_folder_with_one_request_and_leaves_a_bigger_one_to_the_reader():
    store = FakeStore(page_size=50)
    _class_folders(store, 6, 8)
    for i in range(120):  # a sibling of more than a page
        store.put(f"train/002x/{i:03d}.jpg", b"y" * KiB)
    dp = datapath(store, cache=256 * MiB, block=1 * MiB, prefetch=64 * MiB)
    order = [f"train/{c:03d}/{i:03d}.jpg" for c in (0, 1) for i in range(8)]
    walks = watch_walks(dp)

    async def go():
        for path in order:
            node = await _open_as_the_kernel(dp, path)
            await read_all(dp, node.info, 8 * KiB)()
        await settled(dp, walks)  # every walk ahead listed (or left) its folder and its files were fetched
        assert "train/002x" in walks

    run(dp, go)
    assert dp.walk.dirs_ahead >= 4  # folders 002x to 005, ahead of the reader
    fetched = {key.rsplit("/", 1)[0] for key, _, _ in store.ranges}
    assert {"train/003", "train/004", "train/005"} <= fetched and "train/002x" not in fetched
    assert store.calls["list_dir"] == 0, "every listing was one page"


def test_a_reader_of_one_file_per_folder_never_pays_for_walks():
    store = FakeStore()
    _class_folders(store, 30, 10)
    dp = datapath(store, cache=256 * MiB, block=1 * MiB, prefetch=64 * MiB)
    walks = watch_walks(dp)

    async def go():
        for c in range(30):
            node = await _open_as_the_kernel(dp, f"train/{c:03d}/004.jpg")
            await read_all(dp, node.info, 8 * KiB)()
        await settled(dp, walks)

    run(dp, go)
    assert store.calls["get"] == 30 and dp.walk.issued == 0 and dp.walk.dirs_ahead == 0
    assert store.calls["list_dir"] + store.calls["probe"] <= 32  # the root, train, and each folder read


@pytest.mark.parametrize("initial, size, first_block_gets", [
    (8 * MiB, 16 * MiB, FIRST_BLOCK_PARTS),  # read from 0 with the initial window: the first block in parts
    (0, 16 * MiB, 1),  # --initial-prefetch 0: one GET, as before
    (8 * MiB, 6 * MiB, 1),  # a file smaller than the initial window
])
def test_a_file_read_from_its_start_gets_its_first_block_in_parts(initial, size, first_block_gets):
    store = FakeStore()
    payload = random.Random(5).randbytes(size)
    info = store.put("shard.tar", payload)
    cfg = MountConfig(store=StoreConfig(bucket="b", max_concurrency=16), cache_size=256 * MiB,
                      block_size=2 * MiB, max_prefetch=16 * MiB, initial_prefetch=initial)
    dp = DataPath(cfg, store)
    out = []

    async def go():
        out.append(await read_all(dp, info, 256 * KiB)())

    run(dp, go)
    assert out[0] == payload
    first = [r for r in store.ranges if r[1] < 2 * MiB]
    assert len(first) == first_block_gets and sum(end - start for _, start, end in first) == 2 * MiB, first


def test_a_reader_that_starts_past_zero_gets_no_parts():
    store = FakeStore()
    payload = random.Random(6).randbytes(8 * MiB)
    info = store.put("shard.tar", payload)
    cfg = MountConfig(store=StoreConfig(bucket="b", max_concurrency=16), cache_size=256 * MiB,
                      block_size=1 * MiB, max_prefetch=8 * MiB, initial_prefetch=4 * MiB)
    dp = DataPath(cfg, store)
    out = []

    async def go():
        fh = dp.reader.open(info)
        out.append(bytes(await dp.reader.read(fh, 3 * MiB, 64 * KiB)))

    run(dp, go)
    assert out[0] == payload[3 * MiB:3 * MiB + 64 * KiB]
    assert store.ranges == [("shard.tar", 3 * MiB, 3 * MiB + 64 * KiB)]  # exactly the read


def test_an_owner_reads_through_for_a_member_but_only_serves_what_it_holds_to_another_owner():
    """With R = 2 both members own every block. A member asks (through=True): the owner fetches the block once,
    keeps it and gives its exact bytes. Another owner asks (held=1): a block not held is answered None at
    once, never fetched, so two owners reading the same block can never wait on each other."""
    from concurrent.futures import Future

    from fusecore.cluster.tier import Cluster
    from fusecore.cluster.peers import BlockAsk

    store = FakeStore()
    payload = random.Random(9).randbytes(600 * KiB)
    info = store.put("data/x.bin", payload)
    dp = datapath(store, cache=16 * MiB, block=256 * KiB)
    me, other = "127.0.0.1:1", "127.0.0.2:1"  # nothing listens at the other: asking it fails at once
    out = []

    async def go():
        dp.cluster = dp.fetcher.cluster = Cluster(me, [me, other], 2, b"a key of sixteen bytes")
        owner_ask = BlockAsk.block(info.key, info.etag, 1, 256 * KiB, 256 * KiB, info.size, through=False)
        out.append(dp._for_peer(owner_ask))
        pending = dp._for_peer(BlockAsk.block(info.key, info.etag, 1, 256 * KiB, 256 * KiB, info.size))
        assert isinstance(pending, Future)
        await until(pending.done)
        out.append(bytes(pending.result()))
        out.append(bytes(dp._for_peer(owner_ask)))  # now held: served to an owner too

    run(dp, go)
    assert out[0] is None and out[1] == out[2] == payload[256 * KiB:512 * KiB]
    assert store.calls["get"] == 1, "fetched once, for the member, and kept"


def test_an_owner_reads_a_big_block_through_for_a_member_in_parts_while_another_file_streams():
    """The member gets none of a read-through block before the owner has all of it: the owner fetches it in
    FORWARD_PARTS GETs at once, also while its own reader streams another file (which alone would keep it to one)."""
    from concurrent.futures import Future

    from fusecore.cluster.tier import Cluster
    from fusecore.read.fetcher import FORWARD_PARTS
    from fusecore.cluster.peers import BlockAsk

    store = FakeStore()
    payload = random.Random(10).randbytes(2 * MiB)
    info, other = store.put("data/x.bin", payload), store.put("data/y.bin", payload)
    store.hold(lambda key, start: key == other.key)  # y's GET is still running when the member asks
    dp = datapath(store, cache=64 * MiB, block=1 * MiB)
    me, member = "127.0.0.1:1", "127.0.0.2:1"
    out = []

    async def go():
        try:
            dp.cluster = dp.fetcher.cluster = Cluster(me, [me, member], 2, b"a key of sixteen bytes")
            assert dp.fetcher.prefetch(other, 0)
            await until(lambda: any(key == other.key for key, _, _ in store.ranges))
            pending = dp._for_peer(BlockAsk.block(info.key, info.etag, 1, MiB, MiB, info.size))
            assert isinstance(pending, Future)
            await until(pending.done)  # while y's GET is held: the parts did not wait for it
            out.append(bytes(pending.result()))
        finally:
            store.release()

    run(dp, go)
    assert out == [payload[MiB:]]
    part = MiB // FORWARD_PARTS
    assert sorted(r for r in store.ranges if r[0] == info.key) == [
        (info.key, MiB + i * part, MiB + (i + 1) * part) for i in range(FORWARD_PARTS)]
    assert [r for r in store.ranges if r[0] == other.key] == [(other.key, 0, MiB)]


def test_a_shuffled_pass_over_a_directory_larger_than_the_cache_fetches_each_file_once():
    """The walk passes over files the reader opened before the walk got to them: with a cache that holds a fraction
    of the directory, such a file is gone by then, and fetching it again cost a GET and its bytes (2% of an
    epoch, issue 35)."""
    store = FakeStore()
    for i in range(200):
        store.put(f"imgs/{i:03d}.jpg", random.Random(i).randbytes(100 * KiB))
    dp = datapath(store, cache=4 * MiB, block=1 * MiB, prefetch=1 * MiB)

    async def go():
        imgs = await dp.namespace.lookup(1, "imgs")
        order = [dp.namespace.node(inode) for _, inode in await dp.namespace.readdir(imgs.inode)]
        random.Random(5).shuffle(order)
        for node in order:
            dp.walk.on_open(node)
            await read_all(dp, node.info, 128 * KiB)()

    run(dp, go)
    assert store.calls["get"] == 200, store.calls["get"]


def test_a_block_a_stream_is_in_the_middle_of_outlives_small_files_read_whole_meanwhile():
    """Small files read whole beside a stream go first when the window needs room: the stream's block is not pushed
    out between two of its reads, to be fetched again (issue 35: a stream beside a loader)."""
    store = FakeStore()
    big = random.Random(1).randbytes(8 * MiB)
    store.put("big", big)
    for i in range(300):
        store.put(f"small/{i:03d}", random.Random(i).randbytes(60 * KiB))
    dp = datapath(store, cache=20 * MiB, block=1 * MiB, prefetch=1 * MiB)  # a window of two blocks

    async def go():
        info = (await dp.namespace.lookup(1, "big")).info
        small = await dp.namespace.lookup(1, "small")
        smalls = [dp.namespace.node(inode).info for _, inode in await dp.namespace.readdir(small.inode)]
        fh = dp.reader.open(info)
        got = bytearray()
        for n, off in enumerate(range(0, info.size, 128 * KiB)):
            got += await dp.reader.read(fh, off, 128 * KiB)
            for s in smalls[20 * n % len(smalls):][:20]:  # more than the window holds beside the stream's block
                await read_all(dp, s, 64 * KiB)()
        dp.reader.release(fh)
        assert bytes(got) == big

    run(dp, go)
    fetched = sum(end - start for key, start, end in store.ranges if key == "big")
    assert fetched == 8 * MiB, fetched / MiB


def test_the_stores_bytes_are_told_apart_by_why_they_were_fetched():
    """stoker stats' store_bytes_by_cause: a reader's own block (demand), what the read-ahead fetched for it, a young
    random run's exact range, a block read through for a peer, and one read from the store after its owner did not
    give it (fallback). They add up to every byte the store sent."""
    from concurrent.futures import Future

    from fusecore.cluster.tier import Cluster
    from fusecore.cluster.ownership import Owners, block_id
    from fusecore.cluster.peers import BlockAsk

    store = FakeStore()
    seq = store.put("data/seq.bin", random.Random(1).randbytes(2 * MiB))
    rnd = store.put("data/rnd.bin", random.Random(2).randbytes(2 * MiB))
    me, gone = "127.0.0.1:1", "127.0.0.2:1"  # nothing listens at the other member: asking it fails
    owners = Owners([me, gone], 1)
    by_owner: dict[str, object] = {}
    for i in range(64):  # one small file each member owns
        info = store.put(f"data/o{i}.bin", random.Random(10 + i).randbytes(200 * KiB))
        by_owner.setdefault(owners.of(block_id(info.key, info.etag, 0))[0], info)
        if len(by_owner) == 2:
            break
    mine, theirs = by_owner[me], by_owner[gone]
    dp = datapath(store, cache=64 * MiB, block=256 * KiB)
    causes: dict[str, int] = {}

    async def go():
        assert await read_all(dp, seq, 256 * KiB)() == store.objects["data/seq.bin"][0]  # demand, read-ahead
        fh = dp.reader.open(rnd)
        await dp.reader.read(fh, 700 * KiB, 64 * KiB)  # a random read past the start: its exact range
        dp.reader.release(fh)
        await settled(dp)
        dp.cluster = dp.fetcher.cluster = Cluster(me, [me, gone], 1, b"a key of sixteen bytes")
        assert await read_all(dp, theirs, 256 * KiB)() == store.objects[theirs.key][0]  # its owner fails: the store
        # (and is avoided: the read-through asks no one, not even the member that owned its block before this one)
        pending = dp._for_peer(BlockAsk.block(mine.key, mine.etag, 0, mine.size, 256 * KiB, mine.size))
        assert isinstance(pending, Future)
        await until(pending.done)
        await settled(dp)
        causes.update(dp.stats()["store_bytes_by_cause"])
        causes["fetched"] = dp.stats()["bytes_fetched"]

    run(dp, go)
    assert causes["demand"] > 0 and causes["read-ahead"] > 0, causes
    assert causes["range"] == 64 * KiB, causes
    assert causes["read-through"] == 200 * KiB and causes["fallback"] == 200 * KiB, causes
    assert sum(causes[c] for c in ("demand", "read-ahead", "range", "read-through", "fallback")) == causes["fetched"]


def test_a_block_fetched_while_a_range_inside_it_is_coming_takes_the_range_in_rather_than_fetching_it_again():
    """A member asks the owner for a range of a block (a reader that started there) and, before it came, for the whole
    block (the reader read on, or another member asked): the block's GET waits for the range and fetches the rest."""
    store = FakeStore()
    data = random.Random(13).randbytes(4 * MiB)
    info = store.put("data/shard.bin", data)
    dp = datapath(store, cache=64 * MiB, block=1 * MiB)
    got: dict[str, bytes] = {}

    async def go():
        store.hold(lambda key, start: start == MiB + 256 * KiB)  # the range's GET stays in flight
        async with trio.open_nursery() as nursery:
            async def the_range():
                buf, _, base = await dp.fetcher.range(info, MiB + 256 * KiB, MiB + 512 * KiB)
                got["range"] = bytes(memoryview(buf)[MiB + 256 * KiB - base:MiB + 512 * KiB - base])

            async def the_block():
                got["block"] = bytes((await dp.fetcher.block(info, 1))[0])

            nursery.start_soon(the_range)
            await until(lambda: any(s == MiB + 256 * KiB for _, s, _ in store.ranges))  # the range's GET is out
            nursery.start_soon(the_block)
            await trio.testing.wait_all_tasks_blocked()
            store.release()

    run(dp, go)
    assert got == {"range": data[MiB + 256 * KiB:MiB + 512 * KiB], "block": data[MiB:2 * MiB]}
    spans = sorted((s, e) for _, s, e in store.ranges)
    assert spans[0][0] == MiB and spans[-1][1] == 2 * MiB and all(a[1] == b[0] for a, b in zip(spans, spans[1:])), \
        f"each byte of the block fetched once: {spans}"


def test_a_workers_file_handles_stay_below_a_writes_through_every_spawn_number():
    """A reader's handles carry its worker's spawn number in their high bits; a handle at or past WRITE_HANDLES is
    taken for a write's (and relayed to the hub). The hub's spawn numbers wrap before they could get there: with
    the number at bit 48 they did after 2^14 starts of workers, and a Reader refused them after 2^15."""
    from fusecore.process.workers import next_spawn
    from fusecore.read.reader import MAX_SPAWN, Reader
    from fusecore.read.writes import WRITE_HANDLES
    from fusecore.store.objects import ObjectInfo

    dp = datapath(FakeStore())
    spawns, spawn = [], MAX_SPAWN - 2
    for _ in range(4):
        spawn = next_spawn(spawn)
        spawns.append(spawn)
        reader = Reader(dp.fetcher, dp.metrics, block_size=256 * KiB, prefetch_limit=MiB, worker=spawn)
        handles = [reader.open(ObjectInfo("k", 10, "e", 0.0)) for _ in range(2)]
        assert all(0 < fh < WRITE_HANDLES for fh in handles) and handles[0] != handles[1]
    assert spawns == [MAX_SPAWN - 1, MAX_SPAWN, 1, 2]
    assert MAX_SPAWN > 4_000_000  # millions of restarts before a number comes back
    with pytest.raises(ValueError):
        Reader(dp.fetcher, dp.metrics, block_size=256 * KiB, prefetch_limit=MiB, worker=MAX_SPAWN + 1)


def test_a_block_handed_over_to_its_new_owner_leaves_the_former_owners_memory():
    """After a membership change the new owner asks the former one (through=False) for what it holds: the former
    owner answers the exact bytes and lets the block go, so serving it never keeps it over its own share. A block
    it still owns (an owner's ask with R = 2), or one a member reads through it, stays."""
    from fusecore.cluster.tier import Cluster
    from fusecore.cluster.ownership import Owners, block_id
    from fusecore.cluster.peers import BlockAsk
    from fusecore.cache.blocks import BlockKey

    store = FakeStore()
    me, other = "127.0.0.1:1", "127.0.0.2:1"  # nothing listens at the other member
    pair = Owners([me, other])
    infos = [store.put(f"data/f{i}.bin", random.Random(40 + i).randbytes(100 * KiB)) for i in range(40)]
    theirs = next(i for i in infos if pair.of(block_id(i.key, i.etag, 0))[0] == other)
    mine = next(i for i in infos if pair.of(block_id(i.key, i.etag, 0))[0] == me)
    dp = datapath(store, cache=16 * MiB, block=256 * KiB)
    out: dict[str, object] = {}

    async def go():
        for info in (theirs, mine):
            assert await read_all(dp, info, 256 * KiB)() == store.objects[info.key][0]  # held, before any cluster
        await settled(dp)
        dp.cluster = dp.fetcher.cluster = Cluster(me, [me, other], 1, b"a key of sixteen bytes")
        ask = BlockAsk.block(theirs.key, theirs.etag, 0, theirs.size, 256 * KiB, theirs.size, through=False)
        out["mine kept"] = bytes(dp._for_peer(BlockAsk.block(mine.key, mine.etag, 0, mine.size, 256 * KiB,
                                                             mine.size, through=False)))
        out["read through kept"] = bytes(dp._for_peer(BlockAsk.block(theirs.key, theirs.etag, 0, theirs.size,
                                                                     256 * KiB, theirs.size)))
        out["was held"] = BlockKey(theirs.key, theirs.etag, 0) in dp.cache
        part = BlockAsk(theirs.key, theirs.etag, 0, 4 * KiB, 68 * KiB, theirs.size, through=False)
        out["range"] = bytes(dp._for_peer(part))  # (a random reader's range: the block stays)
        out["held after range"] = BlockKey(theirs.key, theirs.etag, 0) in dp.cache
        out["handed"] = bytes(dp._for_peer(ask))
        out["held after"] = BlockKey(theirs.key, theirs.etag, 0) in dp.cache
        out["mine held"] = BlockKey(mine.key, mine.etag, 0) in dp.cache
        out["again"] = dp._for_peer(ask)

    run(dp, go)
    assert out["mine kept"] == store.objects[mine.key][0] and out["mine held"], "its own share stays"
    assert out["read through kept"] == out["handed"] == store.objects[theirs.key][0]
    assert out["range"] == store.objects[theirs.key][0][4 * KiB:68 * KiB] and out["held after range"], \
        "a range asked leaves the block where it is: the asker keeps only the range"
    assert out["was held"] and not out["held after"], "handed over: gone from the former owner's memory"
    assert out["again"] is None


def test_store_bytes_after_a_former_owners_miss_are_an_owners_own_not_a_fallback():
    """An owner asks the member that owned a block before (Cluster.plan's `moved`), which no longer holds it: the
    store's bytes are counted as the owner's own demand, not as a fallback (an owner that failed to give a block)."""
    from fusecore.cluster.tier import Plan

    class FormerOwnerMisses:
        asked = 0

        def plan(self, key, etag, index):
            return Plan(["127.0.0.9:1"], False, 1)

        async def fetch(self, plan, want):
            self.asked += 1
            return None

        def owns(self, key, etag, index):
            return True

    store = FakeStore()
    info = store.put("data/x.bin", random.Random(3).randbytes(200 * KiB))
    dp = datapath(store, cache=16 * MiB, block=256 * KiB)
    former = FormerOwnerMisses()
    causes: dict[str, int] = {}

    async def go():
        dp.fetcher.cluster = former  # type: ignore[assignment]
        assert await read_all(dp, info, 256 * KiB)() == store.objects[info.key][0]
        await settled(dp)
        causes.update(dp.stats()["store_bytes_by_cause"])

    run(dp, go)
    assert former.asked == 1 and causes.get("fallback", 0) == 0 and causes["demand"] == 200 * KiB, causes
