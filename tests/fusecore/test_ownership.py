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
