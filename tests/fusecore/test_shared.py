"""What a mount's workers share (cache/shared.py, read/registry.py), as pure file operations: published blocks, claims
to fetch, the hub's policy, inode numbers and open files. The real mounts are in test_workers.py."""

from __future__ import annotations

import os
import socket

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from fusecore.cache import shared
from fusecore.cache.blocks import BlockKey
from fusecore.metrics import Summed
from fusecore.read.prefetch import ReadAhead
from fusecore.read.registry import Registry, derived_inode
from fusecore.store.objects import ObjectInfo

KiB = 1024


def _root(tmp_path) -> str:
    root = str(tmp_path / "shared")
    shared.prepare(root)
    Registry.prepare(root)
    return root


def _publish(worker: shared.SharedBlocks, key: BlockKey, data: bytes) -> bool:
    """A fetch's end in a worker: claimed, published, let go."""
    claim = worker.try_claim(key)
    assert claim is not None
    try:
        return worker.publish(claim, data)
    finally:
        claim.release()


def test_a_published_block_is_read_by_another_worker_and_a_wrong_length_never(tmp_path):
    root = _root(tmp_path)
    hub = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    hub.bind(os.path.join(root, shared.HUB_SOCKET))
    one, two = shared.SharedBlocks(root), shared.SharedBlocks(root)
    key = BlockKey("data/a.jpg", '"etag1"', 0)
    assert two.load(key, 100) is None
    _publish(one, key, b"x" * 100)
    assert bytes(two.load(key, 100)) == b"x" * 100
    assert two.load(BlockKey("data/a.jpg", '"etag2"', 0), 100) is None  # another version: another name
    assert two.load(key, 99) is None and not two.holds(key)  # the length it must have, or removed
    one.flush()
    two.flush()
    news = hub.recv(65536).split(b"\n") + hub.recv(65536).split(b"\n")
    assert any(n.startswith(b"add ") for n in news) and any(n.startswith(b"hit ") for n in news)


def test_news_of_published_bytes_leave_at_once_past_a_block_and_small_news_wait(tmp_path):
    """The hub evicts for a block as soon as it is published (a folder that waits for the batch's timer outgrew its
    budget by ~20 MiB under a stream), while hits and small blocks still go in batches."""
    root = _root(tmp_path)
    hub = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    hub.bind(os.path.join(root, shared.HUB_SOCKET))
    hub.setblocking(False)
    worker = shared.SharedBlocks(root)
    small = BlockKey("data/small", '"e"', 0)
    _publish(worker, small, b"s" * (100 * KiB))
    assert worker.load(small, 100 * KiB) is not None
    try:
        hub.recv(65536)
        raise AssertionError("news of 100 KiB sent before its batch was due")
    except BlockingIOError:
        pass
    big = BlockKey("data/big", '"e"', 0)
    _publish(worker, big, b"b" * (shared.FLUSH_PUBLISHED - 100 * KiB))  # together: a block's worth published
    news = hub.recv(65536).split(b"\n")
    assert [n.split()[0] for n in news] == [b"add", b"hit", b"add"], news
    assert news[2].split()[2] == str(shared.FLUSH_PUBLISHED - 100 * KiB).encode()


def test_one_worker_claims_a_block_and_a_dead_claim_is_taken_over(tmp_path):
    root = _root(tmp_path)
    one, two = shared.SharedBlocks(root), shared.SharedBlocks(root)
    key = BlockKey("k", "e", 3)
    claim = one.try_claim(key)
    assert claim is not None
    assert two.try_claim(key) is None and two.coming(key)  # another worker fetches it
    claim.release()  # failed (or its worker died: the kernel drops the lock)
    again = two.try_claim(key)
    assert again is not None
    fd = os.open(os.path.join(root, shared.CLAIMS, shared.block_name(key)), os.O_RDWR)
    os.close(fd)  # (a worker that only looked, then closed, takes nobody's claim away)
    assert one.try_claim(key) is None
    again.release()


def test_a_block_is_written_into_its_claim_and_a_dead_workers_bytes_there_are_written_over(tmp_path):
    """Publishing renames the claim's file into place (the claim ends with it, nothing is left in the claims);
    a claim whose worker died mid-write is taken with its bytes, which never reach a block file."""
    root = _root(tmp_path)
    one, two = shared.SharedBlocks(root), shared.SharedBlocks(root)
    key = BlockKey("k", "e", 0)
    dead = one.try_claim(key)
    assert dead is not None
    os.write(dead.fd, b"partial bytes of a worker that died, longer than the block")
    os.close(dead.fd)  # (its lock goes with it, its file stays)
    claim = two.try_claim(key)
    assert claim is not None and os.fstat(claim.fd).st_size == 0
    assert two.publish(claim, b"block")
    claim.release()
    claims = os.path.join(root, shared.CLAIMS)
    assert os.listdir(claims) == []  # (renamed into place)
    assert bytes(one.load(key, 5)) == b"block"
    failed = one.try_claim(BlockKey("k", "e", 1))
    assert failed is not None
    failed.release()  # (its GET failed: its file goes)
    assert os.listdir(claims) == []


def test_claims_a_dead_worker_left_are_swept_and_live_ones_kept(tmp_path):
    """A worker that died leaves its claims' files, one with bytes of a block it was writing: memory no budget counts,
    removed when the hub starts it again; a live worker's claim stays, and its block is still published."""
    root = _root(tmp_path)
    dead, live = shared.SharedBlocks(root), shared.SharedBlocks(root)
    left = [dead.try_claim(BlockKey("k", "e", i)) for i in range(2)]
    os.write(left[0].fd, b"half a block")
    for claim in left:
        os.close(claim.fd)  # (died: the kernel drops its locks with its descriptors)
    held = live.try_claim(BlockKey("k", "e", 2))
    assert held is not None
    assert shared.sweep_claims(root) == 2
    assert os.listdir(os.path.join(root, shared.CLAIMS)) == [shared.block_name(BlockKey("k", "e", 2))]
    assert live.publish(held, b"block")
    held.release()
    assert bytes(dead.load(BlockKey("k", "e", 2), 5)) == b"block"


def test_the_policy_keeps_what_was_read_twice_within_its_budget():
    policy = shared.SharedPolicy(budget=10 * KiB)
    for name in ("a", "b", "c"):
        assert policy.admit(name, 3 * KiB) == []
    policy.hit("a")  # read again: it outranks what was streamed once
    assert policy.admit("d", 3 * KiB) == ["b"]
    assert policy.admit("e", 3 * KiB) == ["c"]
    assert "a" in policy and policy.bytes <= policy.budget
    assert policy.resize(3 * KiB) == ["d", "e"]
    policy.forget("a")
    assert policy.bytes == 0 and len(policy) == 0


def test_blocks_read_ahead_stay_until_read_and_within_their_share():
    """A block a worker read ahead and published for a reader that has not come yet goes last (evicted first, it is
    fetched again for that reader: a walk through two workers under a small cache fetched 1.7x its bytes), up to
    half the budget; once read it is a block read once like any other."""
    policy = shared.SharedPolicy(budget=12 * KiB)
    assert policy.admit("ahead1", 3 * KiB, ahead=True) == []
    assert policy.admit("ahead2", 3 * KiB, ahead=True) == [] and policy.ahead_bytes == 6 * KiB
    assert policy.admit("demand1", 3 * KiB) == []
    assert policy.admit("demand2", 3 * KiB) == []
    assert policy.admit("demand3", 3 * KiB) == ["demand1"], "the oldest read once, not what is still ahead"
    policy.hit("ahead1")  # its reader came: read once now
    assert policy.ahead_bytes == 3 * KiB
    assert policy.admit("demand4", 3 * KiB) == ["demand2"]
    assert policy.admit("ahead3", 3 * KiB, ahead=True) == ["demand3"]
    assert policy.admit("ahead4", 3 * KiB, ahead=True) == ["ahead2"], "past half the budget ahead: oldest ahead"
    assert policy.ahead_bytes == 6 * KiB and policy.bytes <= policy.budget
    policy.forget("ahead3")
    assert policy.ahead_bytes == 3 * KiB


def test_inode_numbers_are_derived_and_open_files_are_named_for_every_worker(tmp_path):
    root = _root(tmp_path)
    one, two = Registry(root), Registry(root)
    path = "dir:1/naïve name\nwith: colons"
    inode = derived_inode(path, False)
    assert inode == derived_inode(path, False) != derived_inode(path, True)
    assert inode > 1 and derived_inode("", True) > 1
    one.name_inode(inode, path, False)
    assert two.inode_path(inode) == (path, False)
    assert two.inode_path(inode + 1) is None
    info = ObjectInfo(key="p/" + path, size=12345, etag='"a:b"', mtime=1767225600.25)
    one.open_handle(7 << 48 | 5, info)
    assert two.handle(7 << 48 | 5) == info
    two.release_handle(7 << 48 | 5)
    assert one.handle(7 << 48 | 5) is None
    one.note_position(9, 4096)
    assert two.position(9) == 4096 and two.position(9 + 8192) is None


def test_a_run_read_through_another_worker_continues_here():
    ahead = ReadAhead(64 * 1024 * KiB, 1024 * KiB, max_window_blocks=16, initial_window=4)
    ahead.continue_at(3 * 1024 * KiB)
    assert not ahead.paged(3)
    assert list(ahead.on_read(3 * 1024 * KiB, 128 * KiB)) == [4, 5]  # sequential: its window opens
    fresh = ReadAhead(64 * 1024 * KiB, 1024 * KiB, max_window_blocks=16, initial_window=4)
    fresh.on_read(3 * 1024 * KiB, 128 * KiB)
    assert fresh.paged(3)  # without it, the same read is a young random run's


def test_the_workers_metrics_are_summed():
    texts = []
    for gets, ratio in ((3, 0.5), (4, 1.0)):
        registry = CollectorRegistry()
        Counter("stoker_get_requests", "GETs", ["kind"], registry=registry).labels(kind="demand").inc(gets)
        Gauge("stoker_cache_hit_ratio", "ratio", registry=registry).set(ratio)
        texts.append(generate_latest(registry).decode())
    registry = CollectorRegistry()
    registry.register(Summed(lambda: texts))
    assert registry.get_sample_value("stoker_get_requests_total", {"kind": "demand"}) == 7
    assert registry.get_sample_value("stoker_cache_hit_ratio") == 0.75


def test_the_hub_ignores_news_it_cannot_parse_and_never_leaves_its_folder(tmp_path):
    from fusecore.config import MountConfig, StoreConfig
    from fusecore.fuse.protocol import Agreed
    from fusecore.process.workers import Hub

    root = _root(tmp_path)
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    hub = Hub(MountConfig(StoreConfig(bucket="b"), cache_size=16 * 1024 * KiB, block_size=1024 * KiB, workers=2), -1,
              Agreed(31, 0, 1 << 20, 256), root, "INFO")
    for news in (b"add ../../outside 999999999999", b"add " + b"g" * 32 + b" 5", b"add " + b"a" * 32 + b" x",
                 b"hit", b"\xff\xfe", b"add " + b"a" * 32):
        hub._news(news)
    assert len(hub.policy) == 0 and outside.read_bytes() == b"keep"
    hub._news(b"add " + b"a" * 32 + b" 5")
    assert hub.policy.bytes == 5


def _hub_and_worker(tmp_path):
    """A hub (its news taken by the test, from `events`) and a worker's view of the shared blocks."""
    from fusecore.config import MountConfig, StoreConfig
    from fusecore.fuse.protocol import Agreed
    from fusecore.process.workers import Hub

    root = _root(tmp_path)
    events = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    events.bind(os.path.join(root, shared.HUB_SOCKET))
    hub = Hub(MountConfig(StoreConfig(bucket="b"), cache_size=16 * 1024 * KiB, block_size=1024 * KiB, workers=2), -1,
              Agreed(31, 0, 1 << 20, 256), root, "INFO")
    return root, events, hub, shared.SharedBlocks(root)


def test_a_block_a_worker_handed_over_to_another_node_is_evicted_by_the_hub_and_one_warmed_is_a_hit(tmp_path):
    """A worker that served a block to its new owner on another node (DataPath._for_peer) tells the hub to let it go:
    its file is removed and the budget no longer counts it; a name that is not a block's changes nothing. A warm of a
    held block (DataPath.warm) tells the hub's policy it was read, and copies nothing."""
    root, events, hub, worker = _hub_and_worker(tmp_path)
    handed, kept = BlockKey("data/a", '"e"', 0), BlockKey("data/b", '"e"', 0)
    for key in (handed, kept):
        assert _publish(worker, key, b"x" * 100)
    worker.let_go(handed)
    worker.flush()
    for news in events.recv(65536).split(b"\n"):
        hub._news(news)
    hub._news(b"drop ../../" + shared.block_name(kept).encode())
    assert not worker.holds(handed) and worker.holds(kept)
    assert hub.policy.bytes == 100 and list(hub.policy.names()) == [shared.block_name(kept)]
    # a warm of a held block: a hit for the policy, nothing copied; of one not held: nothing told
    hits = hub.policy.hits
    assert worker.touch(kept, 100) and not worker.touch(handed, 100) and not worker.touch(kept, 99)
    assert worker.stats.loaded == 0 and not worker.holds(kept), "touched, copied nothing; one of another length removed"
    worker.flush()
    for news in events.recv(65536).split(b"\n"):
        hub._news(news)
    assert hub.policy.hits == hits + 1


def test_a_workers_mark_is_made_by_the_hub_only_after_the_news_sent_before_it(tmp_path):
    """A warm's end waits on its mark: the blocks it gave the disk tier are in the hub's queue by then (the news were
    sent, but the hub might not have taken them, and the queue it shows would not count them yet)."""
    root, events, hub, worker = _hub_and_worker(tmp_path)
    _publish(worker, BlockKey("data/a", '"e"', 0), b"a" * 100)  # (news gathered, not sent yet)
    mark = worker.mark()
    assert mark is not None and not shared.SharedBlocks.marked(mark)
    taken = []
    while not shared.SharedBlocks.marked(mark):  # the hub's loop, one datagram at a time
        for news in events.recv(65536).split(b"\n"):
            hub._news(news)
            taken.append(news.split()[0])
    assert taken == [b"add", b"mark"] and hub.policy.bytes == 100
    for news in (b"mark ../../outside", b"mark 1-2/../x", b"mark " + b"9" * 40):  # no path of a sender's choosing
        hub._news(news)
    assert os.listdir(os.path.join(root, shared.MARKS)) == []


def test_a_published_block_for_the_disk_tier_is_kept_even_where_the_policy_evicts_it_at_once(tmp_path):
    """The hub hands the block's file to the disk tier before the policy may evict it (its mapping keeps the bytes):
    else a warm's block went missing from the disk tier, the warm done and nothing queued, written or skipped."""
    from fusecore.config import MountConfig, StoreConfig
    from fusecore.fuse.protocol import Agreed
    from fusecore.process.workers import Hub

    class Disk:
        def __init__(self):
            self.kept = {}

        def still_holds(self, name):
            return False

        def keep(self, name, data):
            self.kept[name] = bytes(data)

    root = _root(tmp_path)
    hub = Hub(MountConfig(StoreConfig(bucket="b"), cache_size=16 * 1024 * KiB, block_size=1024 * KiB, workers=2), -1,
              Agreed(31, 0, 1 << 20, 256), root, "INFO")
    hub.disk = Disk()
    worker = shared.SharedBlocks(root)
    key = BlockKey("data/big", '"e"', 0)
    body = os.urandom(hub.policy.budget + 1)  # more than the shared blocks' budget: evicted as soon as admitted
    _publish(worker, key, body)
    keep = "ab" * 32
    hub._news(b"add %s %d %s" % (shared.block_name(key).encode(), len(body), keep.encode()))
    assert not worker.holds(key), "evicted"
    assert hub.disk.kept == {keep: body}


def test_a_collision_of_derived_inode_numbers_is_refused_not_answered_as_the_other_path(tmp_path):
    root = _root(tmp_path)
    one, two = Registry(root), Registry(root)
    assert one.name_inode(42, "a/first", False)
    assert not two.name_inode(42, "b/second", False)  # another path with that number: refused
    assert two.name_inode(42, "a/first", False) and two.inode_path(42) == ("a/first", False)


def test_the_kernel_keeps_pages_only_of_the_version_last_opened_by_any_worker(tmp_path):
    root = _root(tmp_path)
    one, two = Registry(root), Registry(root)
    assert not one.reopened(7, '"v1"')  # first open: nothing cached to keep
    assert one.reopened(7, '"v1"')
    assert not two.reopened(7, '"v2"')  # another worker opened a newer version: dropped
    assert not one.reopened(7, '"v1"')  # this worker's older listing: dropped again, never kept


def test_several_workers_need_a_cache_that_holds_their_own_blocks():
    from fusecore.config import ConfigError, MountConfig, StoreConfig

    MountConfig(StoreConfig(bucket="b"), cache_size=64 * 1024 * KiB, block_size=4 * 1024 * KiB, workers=4)
    try:
        MountConfig(StoreConfig(bucket="b"), cache_size=32 * 1024 * KiB, block_size=4 * 1024 * KiB, workers=8)
    except ConfigError as exc:
        assert exc.setting == "workers"
    else:
        raise AssertionError("8 workers of 4 MiB blocks in 32 MiB were accepted")


def test_several_workers_take_a_disk_tier_and_a_distributed_cache(tmp_path):
    from fusecore.config import MountConfig, StoreConfig

    key = tmp_path / "key"
    key.write_bytes(os.urandom(32))
    cfg = MountConfig(StoreConfig(bucket="b"), workers=2, peers="127.0.0.1:7001,127.0.0.2:7001",
                      peer_listen="127.0.0.1:7001", peer_key_file=str(key), disk_cache=str(tmp_path),
                      disk_cache_size=64 * 1024 * KiB)
    assert cfg.workers == 2 and cfg.peer_members and cfg.disk_cache


def test_the_hub_hands_peer_connections_to_its_workers_in_turn_and_survives_a_bad_hand_off(tmp_path):
    """process/peerfanout.py: what the node's peer router hands the hub goes to the workers' hand-off sockets in
    turn; a descriptor that is no socket is closed and the hub goes on; with no worker taking it, the asker is told
    503."""
    import array
    import socket

    import trio

    from fusecore.process.peerfanout import PeerFanout, worker_handoff

    fanout = PeerFanout(str(tmp_path), 2)
    workers = []
    for index in (1, 2):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(worker_handoff(str(tmp_path), index))
        workers.append(sock)
    router = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "router.peer")
    pairs = [socket.socketpair() for _ in range(4)]
    reader, writer = os.pipe()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fanout.take_handed, fanout.receive(path))
            await trio.sleep(0)
            router.sendmsg([b"c"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [reader]))], 0, path)
            for ours, _ in pairs:
                router.sendmsg([b"c"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [ours.fileno()]))],
                               0, path)
            with trio.fail_after(10):
                while fanout.handed < len(pairs):
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    got = [len(socket.recv_fds(w, 16, 8)[1]) + len(socket.recv_fds(w, 16, 8)[1]) for w in workers]
    assert got == [2, 2], got  # in turn
    for w in workers:
        w.close()
    lone = PeerFanout(str(tmp_path / "none"), 1)
    ours, theirs = socket.socketpair()
    lone.hand(ours)
    assert theirs.recv(100).startswith(b"HTTP/1.1 503") and lone.refused == 1
