"""Block ownership for a distributed cache (fusecore/cluster/ownership.py): balanced, stable, cheap at 1,000 members."""

from __future__ import annotations

from collections import Counter

import pytest

from fusecore.cluster.ownership import TABLE_SIZE, Owners, block_id


def names(n: int, start: int = 0) -> list[str]:
    return [f"gpu-node-{i:04d}" for i in range(start, start + n)]


@pytest.mark.parametrize("n", [4, 16, 100, 1000])
def test_each_member_owns_its_share_within_ten_percent(n):
    owners = Owners(names(n))
    counts = Counter(owners.entries())
    assert set(counts) == set(owners.members), "every member owns part of the table"
    mean = TABLE_SIZE / n
    assert max(abs(c - mean) for c in counts.values()) <= 0.1 * mean
    assert abs(owners.share("gpu-node-0000") - 1 / n) <= 0.1 / n


def test_real_blocks_spread_like_the_table():
    owners = Owners(names(4))
    counts = Counter(owners.of(block_id(f"train/{i:05d}.jpg", "etag", 0))[0] for i in range(20000))
    assert all(abs(c - 5000) <= 500 for c in counts.values()), counts


def test_with_replicas_each_block_has_that_many_distinct_owners_spread_evenly():
    owners = Owners(names(8), replicas=2)
    held: Counter = Counter()
    for i in range(16000):
        got = owners.of(block_id("shard.tar", "e", i))
        assert len(got) == 2 and len(set(got)) == 2
        held.update(got)
    assert all(abs(c - 4000) <= 400 for c in held.values()), held  # each holds ~R/N of the blocks
    assert abs(owners.share("gpu-node-0003") - 2 / 8) <= 0.1 * 2 / 8
    assert Owners(names(2), replicas=3).replicas == 2, "never more replicas than members"


@pytest.mark.parametrize("n, most", [(10, 2.0), (100, 2.0), (1000, 8.0)])
def test_a_join_or_a_leave_moves_a_small_multiple_of_one_nth(n, most):
    """A joiner takes about its share and a leaver's entries all find new owners; Maglev moves a few more
    than that minimum (the module's docstring has the figures)."""
    before = Owners(names(n)).entries()
    joined = Owners(names(n + 1)).entries()
    moved = sum(a != b for a, b in zip(before, joined)) / TABLE_SIZE
    assert 0.9 / (n + 1) <= moved <= most / (n + 1), moved * (n + 1)
    left = Owners(names(n - 1, start=1)).entries()  # gpu-node-0000 left
    moved = sum(a != b for a, b in zip(before, left)) / TABLE_SIZE
    assert 0.9 / n <= moved <= most / n, moved * n
    assert "gpu-node-0000" not in left


def test_every_node_computes_the_same_owners_whatever_order_it_learned_the_members_in():
    members = names(50)
    a, b = Owners(members), Owners(list(reversed(members)) + members[:5])
    assert a.entries() == b.entries()
    assert a.of(block_id("k", "e", 3)) == b.of(block_id("k", "e", 3))


def test_a_new_version_of_an_object_is_another_block():
    assert len({block_id("k", "etag-1", 0), block_id("k", "etag-2", 0), block_id("k", "etag-1", 1)}) == 3


def test_no_members_or_no_replicas_is_refused():
    with pytest.raises(ValueError):
        Owners([])
    with pytest.raises(ValueError):
        Owners(["a"], replicas=0)


def test_an_owner_asks_the_member_that_owned_a_block_before_the_membership_changed_and_only_a_member():
    """Cluster.plan after a change, one replica: a newcomer asks the member that owned each of its blocks among the
    others; a member that stays asks for the rare block Maglev dealt it from another member that stays; a block a
    leaver owned is asked of nobody (it is gone); a non-owner's plan is unchanged (its owners, who read through)."""
    from fusecore.cluster.tier import Cluster, Plan

    a, b, c = "127.0.0.2:1", "127.0.0.3:1", "127.0.0.4:1"
    pair, trio_ = Owners([a, b]), Owners([a, b, c])
    ids = [(f"train/{i:05d}.jpg", "etag", i % 3) for i in range(20000)]
    newcomer = Cluster(c, [a, b, c], 1, b"a key of sixteen bytes")
    stayer = Cluster(a, [a, b], 1, b"a key of sixteen bytes")
    stayer.set_members([a, b, c])
    assert Cluster(a, [a], 1, b"a key of sixteen bytes").before is None, "alone: nobody owned anything before"
    dealt = 0
    for key, etag, index in ids:
        block = block_id(key, etag, index)
        owner, before = trio_.of(block)[0], pair.of(block)[0]
        assert newcomer.plan(key, etag, index) == (Plan([before], False, 1) if owner == c else Plan([owner], True))
        if owner == a:
            dealt += before == b
            assert stayer.plan(key, etag, index) == (Plan([b], False, 1) if before == b else Plan([], False))
    assert dealt > 0, "the sample holds a block Maglev dealt anew between the two that stay"

    stayer.set_members([a, c])  # b leaves: what it owned is asked of nobody; what c owned and a owns now, of c
    after = Owners([a, c])
    for key, etag, index in ids[:2000]:
        block = block_id(key, etag, index)
        was = trio_.of(block)[0]
        if after.of(block)[0] == a:
            assert stayer.plan(key, etag, index) == (Plan([c], False, 1) if was == c else Plan([], False))


def test_former_owners_that_hold_nothing_are_asked_no_more_and_a_change_asks_them_again():
    """A cluster that starts cold: every member's former owners miss. After MOVED_MISSES misses in a row they are
    not asked (no round trip before each of an owner's GETs); a hit in between starts the count again."""
    import trio

    from fusecore.cluster.peers import BlockAsk
    from fusecore.cluster.tier import MOVED_MISSES, Cluster

    a, b = "127.0.0.2:1", "127.0.0.3:1"
    node = Cluster(b, [a, b], 1, b"a key of sixteen bytes")
    mine = [(f"f{i}", "e", 0) for i in range(400) if node.owners.of(block_id(f"f{i}", "e", 0))[0] == b]
    answers: list[tuple[str, bytearray | None]] = []

    async def ask(peer, want):
        return answers.pop(0)

    node.client.ask = ask  # type: ignore[method-assign]

    async def asked(n: int, outcome: str) -> int:
        count = 0
        for key, etag, index in mine[:n]:
            plan = node.plan(key, etag, index)
            if plan.moved:
                count += 1
                answers.append((outcome, bytearray(b"x") if outcome == "hit" else None))
                await node.fetch(plan, BlockAsk(key, etag, index, 0, 1, 1, plan.through))
        return count

    async def go() -> None:
        assert await asked(MOVED_MISSES - 1, "miss") == MOVED_MISSES - 1
        assert await asked(1, "hit") == 1 and node.moved_bytes == 1
        assert await asked(MOVED_MISSES, "miss") == MOVED_MISSES
        assert await asked(10, "miss") == 0, "former owners that held nothing are no longer asked"
        node.set_members([a, b, "127.0.0.4:1"], entering=True)  # (the control API's join: its owners without it)
        assert all(node.plan(*one).moved for one in mine if node.owns(*one)), "a membership change asks again"

    trio.run(go)
