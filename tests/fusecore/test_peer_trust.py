"""An owner trusts nothing an asker says (issue 43): two members' data paths on loopback, a third party holding the
cache's key asks the owner what a stale or lying member would. The owner's own reader, and an honest member's, still
get every right byte at once; the store is asked nothing on a lie's word."""

from __future__ import annotations

import os
import random
import time

import pytest
import trio

from fusecore.cluster.tier import Cluster
from fusecore.config import MountConfig, StoreConfig
from fusecore.read.datapath import DataPath
from fusecore.cache.blocks import BlockKey
from fusecore.cluster.peers import BlockAsk, PeerClient, PeerTimeouts
from stoker.s3server import free_port
from tests.support.fakestore import FakeStore

KiB = 1024
BLOCK = 64 * KiB
KEY = b"a key of the cache, 32 bytes...."


def datapath(store: FakeStore) -> DataPath:
    cfg = MountConfig(store=StoreConfig(bucket="b", prefix="data/", max_concurrency=8), cache_size=16 * 1024 * KiB,
                      block_size=BLOCK, max_prefetch=256 * KiB, read_deadline=20.0)
    return DataPath(cfg, store)


async def read(dp: DataPath, key: str) -> bytes:
    info = await dp.namespace.object_at(key)
    assert info is not None
    fh = dp.reader.open(info)
    out = bytearray()
    for off in range(0, info.size, 50_000):
        out += await dp.reader.read(fh, off, 50_000)
    dp.reader.release(fh)
    return bytes(out)


ATTACKS = {
    # an ETag the object never had (a stale member's): the owner's GET would answer 412
    "wrong etag": lambda info: BlockAsk.block(info.key, '"0123456789abcdef"', 0, BLOCK, BLOCK, info.size),
    # the object as 1 byte long: the owner would fetch 1 byte and keep it as block 0
    "size 1": lambda info: BlockAsk.block(info.key, info.etag, 0, 1, BLOCK, 1),
    # a huge object: a short answer retried until the deadline
    "huge size": lambda info: BlockAsk.block(info.key, info.etag, 3, BLOCK, BLOCK, 10**15),
    # outside the prefix for a store that normalises paths
    "dot-dot key": lambda info: BlockAsk.block("data/../secret/x.bin", info.etag, 0, BLOCK, BLOCK, info.size),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_an_ask_that_lies_changes_nothing_on_the_owner_and_every_reader_gets_the_right_bytes(attack):
    store = FakeStore()
    payload = random.Random(43).randbytes(300_000)
    info = store.put("data/x.bin", payload)
    store.put("secret/x.bin", b"not for the cache's members" * 100)
    port = free_port()
    owner_addr, member_addr = f"127.0.0.2:{port}", f"127.0.0.3:{port}"
    owner, member = datapath(store), datapath(store)
    outcomes: list[tuple[str, object]] = []
    timings: list[float] = []

    async def main():
        async with trio.open_nursery() as nursery:
            for dp, me in ((owner, owner_addr), (member, member_addr)):
                # R = 2: both own every block, so the owner reads through whatever is asked of it
                dp.cluster = dp.fetcher.cluster = Cluster(me, [owner_addr, member_addr], 2, KEY)
                dp.start(nursery)  # (serves peers on `me`)
            assert await read(owner, info.key) == payload  # the owner holds the object now
            gets = store.calls["get"]
            asks = [ATTACKS[attack](info)] * 2
            for i, ask in enumerate(asks):
                if i:
                    owner.cache.invalidate(info.key)  # held no more: the ask now could only be read through
                liar = PeerClient(KEY, PeerTimeouts(connect=5, first_byte=5, body=10, through=10))
                began = time.monotonic()
                outcomes.append((ask, *(await liar.ask(owner_addr, ask))))
                timings.append(time.monotonic() - began)
            assert store.calls["get"] == gets, "nothing fetched on an asker's word"
            began = time.monotonic()
            assert await read(owner, info.key) == payload
            assert await read(member, info.key) == payload
            timings.append(time.monotonic() - began)
            nursery.cancel_scope.cancel()
        owner.close()
        member.close()

    trio.run(main)
    for ask, outcome, data in outcomes:  # held bytes of the object may be served: only ever the right ones
        assert outcome in ("miss", "failed") and data is None or data == payload[ask.start:ask.stop], outcome
    assert outcomes[-1][1:] in (("miss", None), ("failed", None)), "not held: nothing is read through on a lie"
    assert max(timings) < 5, timings
    assert owner.cluster is not None
    if attack == "dot-dot key":
        assert [o[1:] for o in outcomes] == [("failed", None)] * 2 and owner.cluster.server.refused == 0  # 400
    else:
        assert owner.cluster.asks_disagreeing >= 1
    assert not any(key == "secret/x.bin" for key, *_ in store.ranges)


@pytest.mark.parametrize("attack", ["size 1", "huge size", "wrong etag"])
def test_an_ask_that_lies_to_one_worker_of_an_owner_changes_nothing_its_sibling_reads(attack, tmp_path):
    """Under --workers the owner's blocks are every worker's (cache/shared.py): a lie told to one worker must leave
    no block in the shared folder that a sibling would serve its readers."""
    from fusecore.cache import shared as blocks
    from fusecore.read.registry import Registry

    folder = str(tmp_path)
    blocks.prepare(folder)
    Registry.prepare(folder)
    store = FakeStore()
    payload = random.Random(44).randbytes(300_000)
    info = store.put("data/x.bin", payload)
    port = free_port()
    owner_addr, member_addr = f"127.0.0.2:{port}", f"127.0.0.3:{port}"
    cfg = datapath(store).cfg
    asked, sibling = (DataPath(cfg, store, shared=folder, worker=n, writes=False) for n in (1, 2))
    outcomes: list[tuple[str, object]] = []

    async def main():
        async with trio.open_nursery() as nursery:
            asked.cluster = asked.fetcher.cluster = Cluster(owner_addr, [owner_addr, member_addr], 2, KEY)
            asked.start(nursery)  # (serves peers on the owner's address)
            sibling.start(nursery)
            liar = PeerClient(KEY, PeerTimeouts(connect=5, first_byte=5, body=10, through=10))
            outcomes.append(await liar.ask(owner_addr, ATTACKS[attack](info)))
            lengths = {BLOCK, len(payload) % BLOCK}
            assert all(e.stat().st_size in lengths for e in os.scandir(os.path.join(folder, blocks.BLOCKS)))
            assert await read(sibling, info.key) == payload
            assert await read(asked, info.key) == payload
            nursery.cancel_scope.cancel()
        asked.close()
        sibling.close()

    trio.run(main)
    assert outcomes[0] in (("miss", None), ("failed", None)), outcomes
    published = {e.name: e.stat().st_size for e in os.scandir(os.path.join(folder, blocks.BLOCKS))}
    assert sorted(published.values()) == sorted([BLOCK] * (len(payload) // BLOCK) + [len(payload) % BLOCK])


def test_a_412_on_one_version_drops_that_versions_blocks_only():
    store = FakeStore()
    info = store.put("data/x.bin", b"x" * 100_000)
    dp = datapath(store)
    dp.cache.put(BlockKey(info.key, info.etag, 0), bytearray(BLOCK))
    dp.cache.put(BlockKey(info.key, '"old"', 0), bytearray(BLOCK))
    assert dp.cache.invalidate(info.key, '"old"') == 1
    assert BlockKey(info.key, info.etag, 0) in dp.cache and BlockKey(info.key, '"old"', 0) not in dp.cache


def test_a_block_held_at_another_length_than_its_extent_is_never_served():
    """Whatever put it there, a held block shorter (or longer) than its extent is dropped and read again."""
    store = FakeStore()
    payload = random.Random(7).randbytes(200_000)
    info = store.put("data/x.bin", payload)
    dp = datapath(store)
    dp.cache.put(BlockKey(info.key, info.etag, 0), bytearray(payload[:1]))
    out: list[bytes] = []

    async def main():
        async with trio.open_nursery() as nursery:
            dp.start(nursery)
            out.append(await read(dp, info.key))
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert out == [payload]
    assert dp.metrics.value(dp.metrics.errors, kind="wrong-length") == 1


def test_a_member_whose_owners_answers_are_altered_on_the_wire_reads_the_right_bytes_from_the_store():
    """A node on the path between two members flips a byte of every answer the owner sends: none opens, so the
    member's reads of the blocks that owner owns come from the store, every byte right; the owner is counted
    failed and avoided (nothing forged is ever served or kept)."""
    from fusecore.cluster.peers import PeerServer
    from tests.support.tamper import TamperProxy

    store = FakeStore()
    payloads = {f"data/f{i}.bin": random.Random(i).randbytes(150_000 + i) for i in range(12)}
    infos = [store.put(key, body) for key, body in payloads.items()]
    for _ in range(100):  # owners follow the members' addresses: a port where the owner owns a share to alter
        port = free_port()
        owner_addr, member_addr = f"127.0.0.2:{port}", f"127.0.0.3:{port}"
        probe = Cluster(owner_addr, [owner_addr, member_addr], 1, KEY)
        if sum(probe.owns(i.key, i.etag, 0) for i in infos) >= 2:
            break
    owner, member = datapath(store), datapath(store)
    seen: dict[str, object] = {}

    async def main():
        async with trio.open_nursery() as nursery:
            owner.start(nursery)
            owner.cluster = owner.fetcher.cluster = Cluster(owner_addr, [owner_addr, member_addr], 1, KEY)
            real = PeerServer(("127.0.0.5", 0), KEY, owner._for_peer).start(nursery)  # the owner, behind the path
            proxy = TamperProxy(real.address, "127.0.0.2", port)  # where the members reach it
            proxy.flip_all = True
            # the member was there first (the owner joined it), so it asks the owner for the owner's blocks only (a
            # member that started beside it would also ask it first for its own: the owners as they were without it,
            # and an altered answer to such an ask, from a read-ahead, could avoid the owner before it served one)
            member.cluster = member.fetcher.cluster = Cluster(member_addr, [member_addr], 1, KEY)
            member.cluster.set_members([owner_addr, member_addr])
            member.start(nursery)
            for info in infos:
                await read(owner, info.key)  # the owner holds its share
            owned = [i for i in infos if owner.cluster.owns(i.key, i.etag, 0)]
            gets = store.calls["get"]
            seen["read"] = {info.key: await read(member, info.key) for info in infos}
            seen["owned"], seen["gets"] = len(owned), store.calls["get"] - gets
            seen["flipped"], seen["served"] = proxy.flipped, real.served
            proxy.close()
            nursery.cancel_scope.cancel()
        owner.close()
        member.close()

    trio.run(main)
    assert seen["read"] == payloads
    assert seen["owned"] >= 2 and seen["flipped"] >= 1 and seen["served"] >= 1  # answers went out, altered
    assert member.stats()["bytes_fetched"] >= sum(map(len, payloads.values())), \
        "every byte from the store: of the member's own blocks and of the owner's alike"
    assert member.cluster is not None and member.cluster.per_peer()[owner_addr]["failed"] >= 1
    assert member.cluster.bytes_from_peers == 0
