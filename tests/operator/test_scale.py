"""The operator at cluster scale (stoker_bench.operator_scale): the real `stoker operator`, real warm agents
on a few nodes and the others' API traffic, against the API faked at its HTTP boundary. What grows with
the cluster must be the operator's own work, never an object's size or what one node receives."""

from __future__ import annotations

import pytest

from stoker_bench import operator_scale
from stoker_operator.handlers import AGGREGATE_EVERY

pytestmark = pytest.mark.integration


def test_a_thousand_nodes_plan_warm_and_report_with_small_objects_and_per_node_traffic(tmp_path):
    small_dir, large_dir = tmp_path / "small", tmp_path / "large"
    small_dir.mkdir()
    large_dir.mkdir()
    small = operator_scale.run(100, workdir=str(small_dir), timeout=120)
    large = operator_scale.run(1000, workdir=str(large_dir), timeout=300)
    for result in (small, large):
        real = operator_scale.REAL_AGENTS
        assert result.reports == 3 * (result.nodes - real) + 2 * real  # every node reported (real: Warming, Ready)
        # objects stay far below etcd's 1.5 MiB, whatever the node count
        assert result.cache_object_bytes < 8 * 1024 and result.node_object_bytes < 2 * 1024, result
        # an agent receives its own object's changes only: created, and its own reports echoed
        assert 1 <= result.events_per_agent_watched <= 4 and result.events_per_agent_max <= 4, result
        # reports are folded into the DatasetCache by a timer, not one status write per report
        assert result.cache_status_writes <= 2 + result.reports / 50, result
    assert large.events_per_agent_max == small.events_per_agent_max
    assert large.events_per_agent_watched == small.events_per_agent_watched
    assert abs(large.cache_object_bytes - small.cache_object_bytes) < 64  # digits of the counts only
    assert AGGREGATE_EVERY <= 5
