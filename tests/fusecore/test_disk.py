"""The disk tier (fusecore/cache/disk.py): blocks kept on local disk, checked when read back, within their budget,
one mount per directory; and real mounts that survive kill -9 and corrupted files on it."""

from __future__ import annotations

import hashlib
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from fusecore.cache.blocks import BlockKey
from fusecore.config import ConfigError
from fusecore.cache import disk as disk_module
from fusecore.cache.disk import HEADER, DiskTier
from tests.conftest import requires_fuse
from tests.support.waiting import wait_for

KiB, MiB = 1024, 1024 * 1024
BLOCK = 256 * KiB


def tier(path, budget=4 * MiB, **kw) -> DiskTier:
    return DiskTier(str(path), budget, bucket="b", block_size=BLOCK, mountpoint="/mnt/test", **kw)


def written(disk: DiskTier, count: int) -> bool:
    return bool(wait_for(lambda: disk.stats().written >= count and disk.stats().queued_bytes == 0, 10, 0.01))


def _handed_out(tier_, key: BlockKey, length: int) -> bytes | None:
    """What the file `open_whole` hands to the kernel holds (up to twice the length: a longer file shows), or None."""
    fd = tier_.open_whole(key, length)
    if fd is None:
        return None
    try:
        return os.pread(fd, 2 * length, 0)
    finally:
        os.close(fd)


def blocks_of(disk_dir) -> list[str]:
    return sorted(os.path.join(disk_dir, "blocks", n) for n in os.listdir(os.path.join(disk_dir, "blocks")))


@pytest.fixture
def tmpfs(tmp_path):
    """A small filesystem of its own (root only), so that free space can run out."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where = tmp_path / "small"
    where.mkdir()
    mounted = []

    def make(size: str, *options: str) -> str:
        subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *options]), "tmpfs", str(where)],
                       check=True)
        mounted.append(where)
        return str(where)

    yield make
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


@pytest.mark.parametrize("plain", [True, False], ids=["header-in-xattr", "header-in-file"])
def test_blocks_come_back_exact_and_a_damaged_file_is_dropped_never_served(tmp_path, monkeypatch, plain):
    if not plain:  # a filesystem that keeps no user xattrs
        monkeypatch.setattr(disk_module, "_takes_xattrs", lambda fd: False)
    disk = tier(tmp_path)
    assert disk.plain == plain
    bodies = {BlockKey("obj", "etag-1", i): os.urandom(BLOCK - i) for i in range(4)}
    for key, body in bodies.items():
        disk.offer(key, body)
        disk.offer(key, body)  # fetched again before its first copy was written: one file, counted once
    assert written(disk, 4)
    start = 0 if disk.plain else HEADER.size  # the bytes alone (the header in an xattr), or after the header
    assert disk.stats().bytes == sum(start + len(b) for b in bodies.values()) == \
        sum(os.path.getsize(p) for p in blocks_of(tmp_path))
    files = {disk.name(key): key for key in bodies}
    damaged = [os.path.join(tmp_path, "blocks", name) for name in sorted(files)[:2]]
    with open(damaged[0], "r+b") as f:  # one flipped byte in the middle of the bytes
        f.seek(start + 1000)
        byte = f.read(1)
        f.seek(start + 1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.truncate(damaged[1], start + 10)  # a write cut short
    for key, body in bodies.items():
        got = disk.read(key, len(body))
        if os.path.join(tmp_path, "blocks", disk.name(key)) in damaged:
            assert got is None
        else:
            assert bytes(got) == body
    assert disk.read(BlockKey("obj", "etag-2", 0), BLOCK) is None, "another version of the object is another block"
    stats = disk.stats()
    assert (stats.dropped, stats.hits, stats.blocks) == (2, 2, 2)
    assert not any(os.path.exists(p) for p in damaged)
    disk.close()


def test_the_budget_holds_and_a_smaller_budget_shrinks_what_a_restart_finds(tmp_path):
    disk = tier(tmp_path, budget=4 * MiB)
    for i in range(24):
        disk.offer(BlockKey("obj", "e", i), os.urandom(BLOCK))
        assert written(disk, i + 1)
        assert sum(os.path.getsize(p) for p in blocks_of(tmp_path)) <= 4 * MiB
    assert disk.read(BlockKey("obj", "e", 0), BLOCK) is None, "the least recently used went first"
    assert disk.read(BlockKey("obj", "e", 23), BLOCK) is not None
    kept = disk.stats().blocks
    disk.close()
    again = tier(tmp_path, budget=1 * MiB)
    assert again.stats().blocks == MiB // (BLOCK + (0 if again.plain else HEADER.size)) < kept
    assert sum(os.path.getsize(p) for p in blocks_of(tmp_path)) <= 1 * MiB
    assert again.read(BlockKey("obj", "e", 23), BLOCK) is not None, "the most recently read one stays"
    again.close()


def test_nothing_under_the_directory_is_readable_by_group_or_others(tmp_path):
    os.umask(0o022)
    disk = tier(tmp_path)
    disk.offer(BlockKey("obj", "e", 0), b"x" * BLOCK)
    assert written(disk, 1)
    for root, dirs, names in os.walk(tmp_path):
        for name in dirs + names:
            mode = stat.S_IMODE(os.stat(os.path.join(root, name)).st_mode)
            assert mode & 0o077 == 0, (name, oct(mode))
    disk.close()


def test_a_directory_that_cannot_hold_the_tier_is_refused_with_a_reason(tmp_path, tmpfs):
    with pytest.raises(ConfigError, match="does not exist"):
        tier(tmp_path / "missing")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is not a directory"):
        tier(tmp_path / "file")
    disk = tier(tmp_path)
    with pytest.raises(ConfigError, match=rf"in use by another mount \(pid {os.getpid()}, mounted at /mnt/test\)"):
        tier(tmp_path)
    disk.close()
    tier(tmp_path).close()  # free again once the holder let go
    small = tmpfs("2m")
    with pytest.raises(ConfigError, match="disk-cache-size: 4.0 MiB asked, but .* has 2.0 MiB free"):
        tier(small)
    subprocess.run(["mount", "-o", "remount,ro", small], check=True)
    with pytest.raises(ConfigError, match="not writable: Read-only file system"):
        tier(small, budget=1 * MiB)


def test_writing_pauses_while_free_space_is_under_the_floor_and_reads_go_on(tmp_path, tmpfs):
    small = tmpfs("8m")  # its floor: 8 MiB / 20
    disk = tier(small, budget=6 * MiB)
    filler = os.path.join(small, "filler")
    with open(filler, "wb") as f:
        f.write(b"\0" * (6 * MiB + 512 * KiB))  # someone else fills the filesystem
    bodies = [os.urandom(BLOCK) for _ in range(8)]
    for i, body in enumerate(bodies):
        disk.offer(BlockKey("obj", "e", i), body)
    assert wait_for(lambda: disk.stats().queued_bytes == 0, 10)
    stats = disk.stats()
    assert 0 < stats.written < 8 and stats.skipped == 8 - stats.written and stats.errors == 0
    assert "free space" in stats.paused
    held = [i for i, body in enumerate(bodies) if disk.read(BlockKey("obj", "e", i), BLOCK) is not None]
    assert len(held) == stats.written
    os.unlink(filler)
    assert wait_for(lambda: not disk.stats().paused, 5)
    disk.offer(BlockKey("obj", "e", 100), bodies[0])
    assert written(disk, stats.written + 1)
    disk.close()


# ---- real mounts ---------------------------------------------------------------------------------------


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_tree(mp: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(mp)):
        with open(os.path.join(mp, name), "rb", buffering=0) as f:
            out[name] = sha(f.read())
    return out


@pytest.mark.integration
@requires_fuse
def test_a_mount_killed_and_started_again_on_its_disk_reads_nothing_from_the_store(s3, bucket, mounts, tmp_path):
    dataset = {f"f{i:02d}": os.urandom(90 * KiB + 977 * i) for i in range(24)}
    dataset["big"] = os.urandom(2 * MiB + 12345)  # several blocks, the last short
    for name, body in dataset.items():
        s3.put_object(Bucket=bucket, Key=name, Body=body)
    expected = {name: sha(body) for name, body in dataset.items()}
    blocks = 24 + 3
    disk_dir = tmp_path / "disk"
    disk_dir.mkdir()
    flags = ("--block-size", "1MiB", "--cache-size", "3MiB", "--no-kernel-cache", "--disk-cache", str(disk_dir),
             "--disk-cache-size", "64MiB")
    mp = mounts.mount(f"s3://{bucket}", *flags)
    assert read_tree(mp) == expected
    assert wait_for(lambda: mounts.stats(mp)["disk"]["written"] >= blocks, 15), mounts.stats(mp)["disk"]
    refused = mounts.run(f"s3://{bucket}", *flags)
    assert refused.returncode != 0 and f"pid {mounts.stats(mp)['pid']}" in refused.stderr, refused.stderr

    os.kill(mounts.stats(mp)["pid"], signal.SIGKILL)
    subprocess.run([sys.executable, "-m", "stoker", "unmount", mp], check=True, capture_output=True)
    mounts.mounted.remove(mp)
    mp = mounts.mount(f"s3://{bucket}", *flags, mountpoint=mp)
    assert read_tree(mp) == expected
    stats = mounts.stats(mp)
    assert stats["requests"]["get"] == 0, stats
    assert stats["disk"]["hits"] >= blocks and stats["bytes_by_source"]["disk"] >= sum(map(len, dataset.values()))
    mounts.unmount(mp)

    files = blocks_of(disk_dir)
    for path in files[:3]:  # random bytes written into three files while nothing is mounted
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            f.write(os.urandom(64))
    mp = mounts.mount(f"s3://{bucket}", *flags, mountpoint=mp)
    assert read_tree(mp) == expected
    stats = mounts.stats(mp)
    assert stats["disk"]["dropped"] == 3 and stats["requests"]["get"] == 3, stats


@pytest.mark.integration
@requires_fuse
@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_warm_fills_the_disk_tier_past_memory_and_reads_then_skip_the_store(s3, bucket, mounts, tmp_path, workers):
    """`stoker warm` plans up to the disk tier's budget where it is larger than memory (here 16 MiB of memory, a
    dataset three times that), fetching no faster than the disk writes; the next pass reads only the disk. With two
    workers, one warms and the hub writes: the warm paces itself by the hub's queue."""
    from fusecore.process import control

    dataset = {f"d/f{i:02d}": os.urandom(3 * MiB + 4099 * i) for i in range(16)}
    for name, body in dataset.items():
        s3.put_object(Bucket=bucket, Key=name, Body=body)
    disk_dir = tmp_path / "disk"
    disk_dir.mkdir()
    mp = mounts.mount(f"s3://{bucket}", "--block-size", "1MiB", "--cache-size", "16MiB", "--no-kernel-cache",
                      "--disk-cache", str(disk_dir), "--disk-cache-size", "128MiB", "--workers", workers)
    last = None
    for last in control.warm(control.default_control_socket(mp), []):
        pass
    assert last is not None and last.files_done == len(dataset) and not last.skipped_files, last
    blocks = sum(-(-len(b) // MiB) for b in dataset.values())
    disk = mounts.stats(mp)["disk"]  # a warm is done once what it fetched is on disk: the mount says where it is
    assert disk["written"] == blocks and disk["queued_bytes"] == 0 and disk["skipped"] == 0, disk
    before = mounts.stats(mp)["requests"]["get"]
    for name, body in dataset.items():
        with open(os.path.join(mp, name), "rb", buffering=0) as f:
            assert f.read() == body
    assert mounts.stats(mp)["requests"]["get"] == before, "every block came from the disk"


def test_a_warm_waits_for_a_slow_disk_instead_of_skipping_blocks(tmp_path, monkeypatch):
    """Readers never wait for the disk (a full write queue skips); a warm does: every block it fetched is written."""
    import time

    import trio

    from fusecore.config import MountConfig, StoreConfig
    from fusecore.read.datapath import DataPath
    from tests.support.fakestore import FakeStore

    slow_write = DiskTier._write

    def write(self, name, data):  # 1 MiB per 5 ms: slower than the fake store sends
        time.sleep(0.005)
        slow_write(self, name, data)

    monkeypatch.setattr(DiskTier, "_write", write)
    store = FakeStore()
    for i in range(12):
        store.put(f"d/f{i}", os.urandom(6 * MiB))  # 72 MiB: over twice the write queue
    cfg = MountConfig(store=StoreConfig(bucket="b", max_concurrency=16), cache_size=8 * MiB, block_size=MiB,
                      disk_cache=str(tmp_path), disk_cache_size=128 * MiB)
    dp = DataPath(cfg, store)

    async def report(_):
        pass

    async def main():
        async with trio.open_nursery() as nursery:
            dp.start(nursery)
            done = await dp.warm([], report)
            assert done["files_done"] == 12 and not done["skipped_files"], done
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert written(dp.disk, 72)
    assert dp.disk.stats().skipped == 0
    dp.close()


def test_blocks_larger_than_the_write_queue_are_written_too(tmp_path):
    disk = DiskTier(str(tmp_path), 128 * MiB, bucket="b", block_size=48 * MiB)
    body = os.urandom(48 * MiB)
    disk.offer(BlockKey("big", "e", 0), body)
    assert written(disk, 1) and bytes(disk.read(BlockKey("big", "e", 0), len(body))) == body
    disk.close()


def test_a_block_an_older_version_wrote_with_sha256_is_still_served_and_checked(tmp_path):
    """Files are written with CRC64-NVME now (STKDISK2); a DIR filled by an older version (STKDISK1, SHA-256) is
    read as it is after an upgrade, and a damaged one of those is still dropped, never served."""
    from fusecore.cache.disk import HEADER, PLAIN_MAGIC, XATTR

    disk = tier(tmp_path)
    keys = [BlockKey("obj", "etag-1", i) for i in range(2)]
    bodies = [os.urandom(BLOCK) for _ in keys]
    for key, body in zip(keys, bodies):
        disk.offer(key, body)
    assert written(disk, 2)
    disk.close()
    for n, (key, body) in enumerate(zip(keys, bodies)):  # rewrite both as the older version did
        path = os.path.join(tmp_path, "blocks", disk.name(key))
        magic, size, digest, _ = HEADER.unpack(os.getxattr(path, XATTR))
        assert magic == PLAIN_MAGIC == b"STKDISK3" and os.path.getsize(path) == size == BLOCK
        os.removexattr(path, XATTR)
        stored = bytearray(body)
        if n == 1:
            stored[7] ^= 0xFF  # damaged after its checksum was taken
        with open(path, "wb") as f:
            f.write(HEADER.pack(b"STKDISK1", size, digest, hashlib.sha256(body).digest()) + stored)
    again = tier(tmp_path)
    assert again.open_whole(keys[0], BLOCK) is None, "an older file has its header before the bytes: no passthrough"
    assert bytes(again.read(keys[0], BLOCK)) == bodies[0]
    assert again.read(keys[1], BLOCK) is None and again.stats().dropped == 1
    again.close()


def test_a_block_held_whole_opens_for_the_kernel_only_when_it_checks_out(tmp_path):
    """`open_whole` (FUSE passthrough's backing file): a descriptor of exactly the block's bytes from offset 0, its
    checksum checked at each open; a damaged file is dropped, never handed out; another version of the object is
    another block."""
    disk = tier(tmp_path)
    keys = [BlockKey("obj", "etag-1", 0), BlockKey("other", "etag-1", 0)]
    bodies = [os.urandom(100 * KiB + 7), os.urandom(BLOCK)]
    for key, body in zip(keys, bodies):
        disk.offer(key, body)
    assert written(disk, 2)
    fd = disk.open_whole(keys[0], len(bodies[0]))
    assert fd is not None
    try:
        assert os.pread(fd, 2 * BLOCK, 0) == bodies[0] and os.fstat(fd).st_size == len(bodies[0])
    finally:
        os.close(fd)
    assert disk.open_whole(BlockKey("obj", "etag-2", 0), len(bodies[0])) is None
    assert disk.stats().hits == 1 and disk.stats().bytes_read == len(bodies[0])
    path = os.path.join(tmp_path, "blocks", disk.name(keys[1]))
    with open(path, "r+b") as f:
        f.seek(BLOCK // 2)
        f.write(b"\0" * 8 if bodies[1][BLOCK // 2:BLOCK // 2 + 8] != b"\0" * 8 else b"\1" * 8)
    assert disk.open_whole(keys[1], BLOCK) is None
    assert disk.stats().dropped == 1 and not os.path.exists(path)
    disk.close()


def test_a_file_written_or_checked_in_this_life_opens_for_the_kernel_unread_until_it_changes(tmp_path, monkeypatch):
    """With the page cache dropped, reading each held file and its checksum at open was a disk read per file on the
    event loop's thread (issue 45): a file this process wrote, or checked once, is handed out as it is until
    anything about it changes (bytes, length, xattrs, the file itself); then it is checked again, and dropped if
    damaged. A new process checks each file once."""
    disk = tier(tmp_path)
    if not disk.plain:
        pytest.skip("the tier's filesystem takes no xattrs: no file holds its bytes alone")
    key, body = BlockKey("obj", "etag-1", 0), os.urandom(100 * KiB + 3)
    disk.offer(key, body)
    assert written(disk, 1)
    checks: list[str] = []

    def counted(tier_: DiskTier) -> None:
        real = tier_._checked
        monkeypatch.setattr(tier_, "_checked", lambda fd, name, *rest: checks.append(name) or real(fd, name, *rest))

    def handed_out() -> bytes | None:
        return _handed_out(disk, key, len(body))

    counted(disk)
    assert handed_out() == body and handed_out() == body
    assert checks == [], "written by this process: trusted"
    path = os.path.join(tmp_path, "blocks", disk.name(key))
    time.sleep(0.05)  # (past the clock tick of the stamp: a kernel without fine-grained ctime sees no change within it)
    with open(path, "r+b") as f:
        f.write(body[:8])  # the same bytes: still a change to anyone looking
    assert handed_out() == body and len(checks) == 1
    assert handed_out() == body and len(checks) == 1, "checked again, then trusted again"
    disk.close()

    disk = tier(tmp_path)  # another life: each file checked once
    counted(disk)
    assert handed_out() == body and handed_out() == body and len(checks) == 2
    time.sleep(0.05)
    with open(path, "r+b") as f:
        f.seek(50 * KiB)
        f.write(bytes([body[50 * KiB] ^ 1]))
    assert handed_out() is None and len(checks) == 3
    assert disk.stats().dropped == 1 and not os.path.exists(path)
    disk.close()


def test_a_workers_view_hands_out_what_its_hub_wrote_or_a_sibling_checked_unread(tmp_path, monkeypatch):
    """A mount of several workers (cache/diskview.py): the hub writes the tier's files and each worker reads them.
    What the hub wrote, or one worker checked, another worker hands to the kernel without reading it again (the
    mount's trust table in its shared folder); a change to the file makes every worker check it again."""
    from fusecore.cache import shared
    from fusecore.cache.diskview import DiskView

    root = str(tmp_path / "shared")
    shared.prepare(root)
    (tmp_path / "disk").mkdir()
    hub = tier(tmp_path / "disk")
    if not hub.plain:
        pytest.skip("the tier's filesystem takes no xattrs: no file holds its bytes alone")
    hub.trust_table = shared.TrustTable(root)
    key, body = BlockKey("obj", "etag-1", 0), os.urandom(90 * KiB + 5)
    hub.offer(key, body)
    assert written(hub, 1)
    views = [DiskView(str(tmp_path / "disk"), 4 * MiB, bucket="b", block_size=BLOCK, shared=shared.SharedBlocks(root))
             for _ in range(2)]
    checks: list[str] = []
    for view in views:
        real = view._checked
        monkeypatch.setattr(view, "_checked", lambda fd, name, *rest, real=real: checks.append(name) or real(fd, name,
                                                                                                            *rest))

    def handed_out(view: DiskView) -> bytes | None:
        return _handed_out(view, key, len(body))

    assert handed_out(views[0]) == body and handed_out(views[1]) == body and checks == [], "the hub wrote it"
    path = os.path.join(tmp_path, "disk", "blocks", hub.name(key))
    with open(path, "r+b") as f:
        f.write(body[:8])
    os.utime(path, ns=(1, 1))  # (a change the stamp sees whatever the clock's tick)
    assert handed_out(views[0]) == body and len(checks) == 1, "changed: checked again"
    assert handed_out(views[1]) == body and len(checks) == 1, "its sibling checked it"
    hub.close()


def test_a_former_owner_hands_a_block_over_from_its_disk_only_for_the_object_as_it_lists_it(tmp_path):
    """A member asks this node, which owned a block before the members changed, for it (an owner's ask, through=False):
    the disk tier's block is read, answered (a HandOver) and let go. An ask of another size for the same block (a
    stale or lying member) finds nothing, is counted, and never makes the disk drop the good block as damaged. A block
    this node still owns (a replica's ask) is answered and stays."""
    from concurrent.futures import Future

    import trio

    from fusecore.config import MountConfig, StoreConfig
    from fusecore.read.datapath import DataPath
    from tests.support.fakestore import FakeStore
    from fusecore.cluster.peers import BlockAsk, HandOver
    from fusecore.cluster.tier import Cluster
    from fusecore.cluster.ownership import Owners, block_id

    me, other = "127.0.0.1:1", "127.0.0.2:1"
    pair = Owners([me, other])
    store = FakeStore()
    infos = [store.put(f"d/f{i}", os.urandom(300_000 + i)) for i in range(30)]
    info = next(i for i in infos if pair.of(block_id(i.key, i.etag, 0))[0] == other)
    mine = next(i for i in infos if pair.of(block_id(i.key, i.etag, 0))[0] == me)
    cfg = MountConfig(store=StoreConfig(bucket="b"), cache_size=8 * MiB, block_size=MiB,
                      disk_cache=str(tmp_path), disk_cache_size=64 * MiB)
    dp = DataPath(cfg, store)
    answers: list[object] = []

    async def ask(want: BlockAsk) -> object:
        found = dp._for_peer(want)
        if isinstance(found, Future):
            assert isinstance(found, HandOver)
            while not found.done():
                await trio.sleep(0.01)
            found = found.result()
        return None if found is None else bytes(found)

    async def main():
        async with trio.open_nursery() as nursery:
            dp.start(nursery)
            for one in (info, mine):
                await dp.fetcher.block(one, 0)  # held (in memory, written behind to disk)
            assert written(dp.disk, 2)
            dp.drop()  # (memory empty: only the disk holds them)
            dp.cluster = dp.fetcher.cluster = Cluster(me, [me, other], 1, b"a key of sixteen bytes")
            for one, size in ((info, info.size + 1), (info, info.size), (mine, mine.size)):
                answers.append(await ask(BlockAsk.block(one.key, one.etag, 0, size, MiB, size, through=False)))
                answers.append(dp.disk.where(BlockKey(one.key, one.etag, 0)) is not None)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert answers == [None, True, store.objects[info.key][0], False, store.objects[mine.key][0], True], \
        "the lie: nothing, the block kept; handed over: let go; its own (a replica's ask): kept"
    assert dp.disk.stats().dropped == 0 and dp.cluster is not None and dp.cluster.asks_disagreeing == 1
    dp.close()
