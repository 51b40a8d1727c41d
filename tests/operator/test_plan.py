"""The operator's pure decisions, against hand-computed expectations."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, strategies as st

from stoker_operator.nodes import NodePlan, NodeState
from stoker_operator.plan import (MIN_CACHE_BYTES, WARM_FRACTION, NodeInfo, SpecProblem, aggregate,
                                  gate_release_patch, merge_conditions, node_should_warm, quantity_bytes,
                                  size_cache, target_nodes)

GiB = 1024**3


def nodes(*memories: int, labels=None) -> list[NodeInfo]:
    return [NodeInfo(f"n{i}", dict(labels or {}), m) for i, m in enumerate(memories)]


def test_quantities():
    assert quantity_bytes("64Gi") == 64 * GiB
    assert quantity_bytes("500M") == 500_000_000
    with pytest.raises(SpecProblem, match="cacheSize"):
        quantity_bytes("lots")
    with pytest.raises(SpecProblem):
        quantity_bytes("0")


def test_target_nodes_match_the_selector_and_skip_unready_or_cordoned():
    all_nodes = [NodeInfo("a", {"pool": "gpu"}, GiB), NodeInfo("b", {"pool": "cpu"}, GiB),
                 NodeInfo("c", {"pool": "gpu"}, GiB, ready=False), NodeInfo("d", {"pool": "gpu"}, GiB, schedulable=False),
                 NodeInfo("e", {"pool": "gpu", "x": "y"}, GiB)]
    assert [n.name for n in target_nodes({"pool": "gpu"}, all_nodes)] == ["a", "e"]
    assert len(target_nodes({}, all_nodes)) == 3


def test_auto_size_is_dataset_plus_headroom_when_it_fits():
    sizing = size_cache({"cacheSize": "auto", "headroomPercent": 10}, 9 * GiB, 1000, nodes(64 * GiB, 128 * GiB))
    assert sizing.cache_bytes_per_node == math.ceil(math.ceil(9 * GiB / WARM_FRACTION) * 1.1)
    assert sizing.fits and sizing.warmable_bytes == 9 * GiB


def test_auto_size_is_capped_by_the_smallest_nodes_fraction_and_says_so():
    sizing = size_cache({"cacheSize": "auto", "maxNodeMemoryFraction": 0.25}, 100 * GiB, 10, nodes(64 * GiB, 32 * GiB))
    assert sizing.cache_bytes_per_node == 8 * GiB
    assert not sizing.fits and sizing.warmable_bytes == int(8 * GiB * WARM_FRACTION)
    assert "100.0 GiB" in sizing.message and "8.0 GiB" in sizing.message


def test_explicit_size_and_floor():
    assert size_cache({"cacheSize": "2Gi"}, GiB, 1, []).cache_bytes_per_node == 2 * GiB
    assert size_cache({"cacheSize": "1Mi"}, 10, 1, []).cache_bytes_per_node == MIN_CACHE_BYTES
    assert size_cache({"cacheSize": "auto"}, 10, 1, nodes(GiB)).cache_bytes_per_node == MIN_CACHE_BYTES
    with pytest.raises(SpecProblem, match="no Ready node"):
        size_cache({"cacheSize": "auto"}, GiB, 1, [])


@given(dataset=st.integers(0, 10**13), memory=st.integers(GiB, 2**40), fraction=st.floats(0.01, 0.9),
       headroom=st.integers(0, 100))
def test_auto_sizing_never_exceeds_the_cap_and_fits_means_fits(dataset, memory, fraction, headroom):
    spec = {"cacheSize": "auto", "maxNodeMemoryFraction": fraction, "headroomPercent": headroom}
    sizing = size_cache(spec, dataset, 1, nodes(memory))
    assert sizing.cache_bytes_per_node <= max(MIN_CACHE_BYTES, int(memory * fraction))
    assert sizing.warmable_bytes <= sizing.cache_bytes_per_node * WARM_FRACTION + 1
    assert sizing.fits == (sizing.warmable_bytes >= dataset)


def test_a_disk_tier_holds_what_memory_cannot_and_says_where():
    memory_only = size_cache({"cacheSize": "8Gi"}, 100 * GiB, 10, nodes(64 * GiB))
    assert not memory_only.fits and memory_only.held_on == "memory"
    sizing = size_cache({"cacheSize": "8Gi", "diskCacheSize": "200Gi"}, 100 * GiB, 10, nodes(64 * GiB))
    assert sizing.fits and sizing.held_on == "disk" and sizing.warmable_bytes == 100 * GiB
    assert sizing.disk_bytes_per_node == 200 * GiB and "on disk 200.0 GiB (diskCacheSize)" in sizing.message
    small_disk = size_cache({"cacheSize": "8Gi", "diskCacheSize": "50Gi"}, 100 * GiB, 10, nodes(64 * GiB))
    assert not small_disk.fits and small_disk.warmable_bytes == int(50 * GiB * WARM_FRACTION)
    fits_memory = size_cache({"cacheSize": "8Gi", "diskCacheSize": "50Gi"}, GiB, 10, nodes(64 * GiB))
    assert fits_memory.fits and fits_memory.held_on == "memory"
    with pytest.raises(SpecProblem, match="diskCacheSize"):
        size_cache({"cacheSize": "8Gi", "diskCacheSize": "lots"}, GiB, 10, nodes(64 * GiB))


PLAN = "1-abc"


def status(phase="Warming", plan=PLAN):
    return {"phase": phase, "datasetBytes": 1000, "warmableBytes": 1000, "cacheBytesPerNode": 2000, "plan": plan}


def states(plan=PLAN, reported=PLAN, deleting=(), **reports) -> list[NodeState]:
    """DatasetCacheNodes asking for `plan`, with reports about `reported`."""
    return [NodeState(NodePlan("ml/c", node, plan, 2000, 1000), dict(r, plan=reported) if r else {}, node in deleting)
            for node, r in reports.items()]


def test_aggregate_phases():
    assert aggregate(status(), states(a={"phase": "Warming", "cachedBytes": 500}, b={})).phase == "Warming"
    ready = aggregate(status(), states(a={"phase": "Ready", "cachedBytes": 1000}, b={"phase": "Ready", "cachedBytes": 1500}))
    assert ready.phase == "Ready" and ready.cached_percentage == 100.0 and ready.ready_nodes == ["a", "b"]
    assert ready.conditions["Ready"][0] == "True" and ready.summary == {
        "targets": 2, "ready": 2, "warming": 0, "failed": 0, "waiting": 0}
    half = aggregate(status("Ready"), states(a={"phase": "Ready", "cachedBytes": 1000}, b={"phase": "Evicted", "cachedBytes": 0}))
    assert half.phase == "Degraded" and half.cached_percentage == 50.0 and "b" in half.conditions["Warmed"][2]
    assert half.not_ready == [{"node": "b", "phase": "Evicted", "message": ""}]
    assert aggregate(status(), []).phase == "Warming"
    # a node leaving the plan (its object being deleted) no longer counts
    leaving = aggregate(status(), states(deleting=("b",), a={"phase": "Ready", "cachedBytes": 1000}, b={}))
    assert leaving.phase == "Ready" and leaving.summary["targets"] == 1


def test_a_huge_plan_keeps_a_small_status():
    """5,000 nodes: the DatasetCache's status names at most NOT_READY_SHOWN of them, failed ones first."""
    import json

    from stoker_operator.plan import NOT_READY_SHOWN

    reports = {f"node-{i:05d}": ({"phase": "Ready", "cachedBytes": 1000} if i % 3 else
                                 {"phase": "Failed", "message": "x" * 500} if i % 2 else {}) for i in range(5000)}
    result = aggregate(status(), states(**reports))
    assert result.summary == {"targets": 5000, "ready": 3333, "warming": 0, "failed": 833, "waiting": 834}
    assert len(result.not_ready) == NOT_READY_SHOWN and all(n["phase"] == "Failed" for n in result.not_ready)
    assert "and 823 more" in result.conditions["Warmed"][2]
    written = {"nodeSummary": result.summary, "notReady": result.not_ready, "conditions": result.conditions}
    assert len(json.dumps(written)) < 6000


def test_conditions_keep_their_transition_time_until_the_status_flips():
    first = merge_conditions([], {"Ready": ("False", "Warming", "x")}, now="t1")
    same = merge_conditions(first, {"Ready": ("False", "Warming", "y")}, now="t2")
    flipped = merge_conditions(same, {"Ready": ("True", "CacheReady", "z")}, now="t3")
    assert same[0]["lastTransitionTime"] == "t1" and same[0]["message"] == "y"
    assert flipped[0]["lastTransitionTime"] == "t3"


def test_gate_release_sets_or_narrows_node_affinity():
    gate = "stoker.dev/dataset-warm"
    plain = {"spec": {"schedulingGates": [{"name": gate}]}}
    patch = gate_release_patch(plain, gate, ["n2", "n1"])
    assert patch["spec"]["schedulingGates"] == []
    terms = patch["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms == {"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "kubernetes.io/hostname", "operator": "In", "values": ["n1", "n2"]}]}]}
    existing = {"key": "gpu", "operator": "Exists"}
    narrowed = gate_release_patch({"spec": {"schedulingGates": [{"name": gate}, {"name": "q"}], "affinity": {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [existing]}, {"matchFields": [{"key": "metadata.name", "operator": "In",
                                                                 "values": ["n1"]}]}]}},
        "podAffinity": {"x": 1}}}}, gate, ["n1"])
    new_terms = narrowed["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert new_terms[0]["matchExpressions"][0] == existing and len(new_terms[0]["matchExpressions"]) == 2
    assert new_terms[1]["matchFields"] and len(new_terms[1]["matchExpressions"]) == 1
    assert narrowed["spec"]["affinity"]["podAffinity"] == {"x": 1}
    assert narrowed["spec"]["schedulingGates"] == [{"name": "q"}]
    assert gate_release_patch({"spec": {"schedulingGates": [{"name": "q"}]}}, gate, ["n1"]) is None


def test_node_should_warm():
    assert node_should_warm("Once", None, 0, 100)
    assert node_should_warm("Once", {"phase": "Failed"}, 0, 100)
    assert not node_should_warm("Once", {"phase": "Ready"}, 0, 100)
    assert node_should_warm("KeepWarm", {"phase": "Ready"}, 50, 100)
    assert not node_should_warm("KeepWarm", {"phase": "Ready"}, 99, 100)


def test_evicted_nodes_rewarm_only_with_keepwarm():
    assert node_should_warm("KeepWarm", {"phase": "Evicted"}, 0, 100)
    assert not node_should_warm("Once", {"phase": "Evicted"}, 0, 100)


def test_reports_of_an_earlier_plan_never_make_the_cache_ready():
    """After a spec change (new paths or source) the nodes' old Ready reports count for nothing: gated pods
    wait for the new plan, and under policy Once the agents warm it."""
    from stoker_operator.plan import plan_id

    old = plan_id(1, {"id": "pv", "attributes": {"bucket": "b"}}, ["train"])
    new = plan_id(2, {"id": "pv", "attributes": {"bucket": "b"}}, ["train", "val"])
    assert old != new and plan_id(2, {"id": "pv", "attributes": {"bucket": "b"}}, ["val", "train"]) == new
    ready = {"phase": "Ready", "cachedBytes": 1000, "warmedBytes": 1000}
    # the objects still ask for the old plan (the operator has not re-specced them yet), or already ask
    # for the new one but the node's report is about the old one: neither counts
    for stale in (states(plan=old, reported=old, a=ready, b=ready), states(plan=new, reported=old, a=ready, b=ready)):
        result = aggregate(status(plan=new), stale)
        assert result.phase == "Warming" and result.cached_percentage == 0.0 and result.ready_nodes == []
        assert stale[0].current_report(new) is None and node_should_warm("Once", stale[0].current_report(new), 1000, 1000)
    fresh = states(plan=new, reported=new, a=ready, b=ready)
    assert aggregate(status(plan=new), fresh).phase == "Ready"
    assert not node_should_warm("Once", fresh[0].current_report(new), 1000, 1000)


def test_datasetcaches_sharing_a_node_never_plan_past_its_cache_memory():
    from stoker_operator.plan import NoRoom, node_room

    GiB = 1024**3
    others = {"n1": [("ml/a", 5 * GiB), ("ml/me", 3 * GiB)], "n2": [("ml/a", 5 * GiB), ("ml/b", 2 * GiB)]}
    room = node_room(8 * GiB, ["n1", "n2"], others, "ml/me")
    assert (room.free, room.node) == (1 * GiB, "n2") and [n for n, _ in room.taken_by] == ["ml/a", "ml/b"]
    nodes = [NodeInfo("n1", {}, 64 * GiB), NodeInfo("n2", {}, 64 * GiB)]
    with pytest.raises(NoRoom, match="on node n2 ml/a 5.0 GiB, ml/b 2.0 GiB leave 1.0 GiB of 8.0 GiB"):
        size_cache({"cacheSize": "2Gi"}, 10 * GiB, 100, nodes, room, 8 * GiB)
    auto = size_cache({"cacheSize": "auto"}, 10 * GiB, 100, nodes, room, 8 * GiB)
    assert auto.cache_bytes_per_node == 1 * GiB and not auto.fits  # auto takes what is left, and says so
    assert size_cache({"cacheSize": "auto"}, 10 * GiB, 100, nodes).cache_bytes_per_node > 8 * GiB  # no limit given
    with pytest.raises(NoRoom):
        size_cache({"cacheSize": "auto"}, 10 * GiB, 100, nodes, node_room(8 * GiB, ["n2"], {"n2": others["n2"] * 2}, "ml/me"), 8 * GiB)


def test_a_replaced_status_section_drops_what_the_new_plan_lacks():
    """status is merge-patched: a region removed from the spec must not stay in status.volume."""
    from stoker_operator.handlers import replacing

    old = {"id": "v", "attributes": {"bucket": "b", "region": "eu", "prefix": "p/"}}
    new = {"id": "v", "attributes": {"bucket": "b", "prefix": "q/"}}
    assert replacing(old, new) == {"id": "v", "attributes": {"bucket": "b", "prefix": "q/", "region": None}}
    assert replacing(None, new) == new


def test_a_handover_of_another_cache_or_malformed_is_refused():
    """Node agents take the volume and credentials only from their DatasetCache's own handover."""
    from stoker_operator.handover import HandoverProblem, read_handover

    good = {"volume": '{"id": "pv-a", "attributes": {"bucket": "b"}}', "accessKeyId": "AKIA1",
            "secretAccessKey": "s3cr3t", "unrelated": "x"}
    handover = read_handover("ml", "a", good, {"stoker.dev/datasetcache": "ml/a"})
    assert (handover.volume_id, handover.secrets) == ("pv-a", {"accessKeyId": "AKIA1", "secretAccessKey": "s3cr3t"})
    with pytest.raises(HandoverProblem, match="not the one of ml/a"):
        read_handover("ml", "a", good, {"stoker.dev/datasetcache": "other/b"})
    with pytest.raises(HandoverProblem, match="no valid volume"):
        read_handover("ml", "a", dict(good, volume="{"), {"stoker.dev/datasetcache": "ml/a"})
    with pytest.raises(HandoverProblem, match="contradictory") as info:
        read_handover("ml", "a", dict(good, AWS_ACCESS_KEY_ID="AKIA2"), {"stoker.dev/datasetcache": "ml/a"})
    assert "s3cr3t" not in str(info.value)
    keyed = dict(good, peerKey="ab" * 32)
    assert read_handover("ml", "a", keyed, {"stoker.dev/datasetcache": "ml/a"}).peer_key == "ab" * 32
    assert handover.peer_key is None
    with pytest.raises(HandoverProblem, match="peer key is too short") as info:
        read_handover("ml", "a", dict(good, peerKey="short"), {"stoker.dev/datasetcache": "ml/a"})
    for bad in ("zz" * 32, "ab" * 32 + "c"):  # the agent decodes it as hex: refused here with a clear reason
        with pytest.raises(HandoverProblem, match="not hexadecimal"):
            read_handover("ml", "a", dict(good, peerKey=bad), {"stoker.dev/datasetcache": "ml/a"})


def test_a_cache_size_no_node_can_hold_is_refused_not_left_pending():
    from stoker_operator.plan import NoRoom

    nodes = [NodeInfo("small", {}, 32 * GiB), NodeInfo("big", {}, 512 * GiB)]
    with pytest.raises(SpecProblem, match="more than a node's Stoker cache memory") as info:
        size_cache({"cacheSize": "100Ti"}, GiB, 10, nodes, None, 64 * GiB)
    assert not isinstance(info.value, NoRoom)  # Failed with the reason, not Pending forever
    with pytest.raises(SpecProblem, match="more than node small has"):
        size_cache({"cacheSize": "40Gi"}, GiB, 10, nodes)
    assert size_cache({"cacheSize": "30Gi"}, GiB, 10, nodes, None, 64 * GiB).cache_bytes_per_node == 30 * GiB


def test_a_distributed_cache_sizes_each_node_for_its_share():
    from fusecore.config import distributed_cache_size, estimated_block_squares, kept_fraction

    nodes = [NodeInfo(f"n{i}", {}, 64 * GiB) for i in range(4)]
    one = size_cache({"distributed": {"replicas": 1}}, 10 * GiB, 100, nodes)
    assert one.replicas == 1 and one.fits
    assert one.warmable_bytes == math.ceil(10 * GiB / 4)
    assert one.cache_bytes_per_node == distributed_cache_size(10 * GiB, 4, 1, 0.1,
                                                              squares=estimated_block_squares(10 * GiB, 100))
    # 2,560 blocks of 4 MiB: a member may own 3 standard deviations (~10%) past its share, beyond the headroom
    assert one.cache_bytes_per_node > distributed_cache_size(10 * GiB, 4, 1, 0.1) * 1.08
    assert one.cache_bytes_per_node * kept_fraction() >= one.warmable_bytes * 1.1
    assert "its share of the dataset" in one.message
    two = size_cache({"distributed": {"replicas": 2}}, 10 * GiB, 100, nodes)
    assert two.warmable_bytes == 2 * one.warmable_bytes and two.cache_bytes_per_node > one.cache_bytes_per_node
    alone = size_cache({"distributed": {}}, 10 * GiB, 100, nodes[:1])  # replicas default 1; one node holds it all
    assert alone.warmable_bytes == 10 * GiB
    capped = size_cache({"distributed": {"replicas": 3}}, 10 * GiB, 100, nodes[:2])  # 3 copies on 2 nodes: 2
    assert capped.replicas == 2
    small = size_cache({"distributed": {}, "maxNodeMemoryFraction": 0.01}, 100 * GiB, 100, nodes)
    assert not small.fits and "warming what fits" in small.message
    whole = size_cache({}, 10 * GiB, 100, nodes)
    assert whole.replicas == 0 and whole.cache_bytes_per_node > 2.5 * one.cache_bytes_per_node


def test_a_node_leaving_a_distributed_cache_re_homes_its_share_on_the_others():
    """Four nodes become three: the leaver's object is deleted and the other three are re-specced with a
    larger share (their agents warm what they now own)."""
    from stoker_operator.nodes import NodePlan, changes

    four = [NodeInfo(f"n{i}", {}, 64 * GiB) for i in range(4)]
    before, after = (size_cache({"distributed": {"replicas": 1}}, 12 * GiB, 10, nodes) for nodes in (four, four[:3]))
    assert after.warmable_bytes == 4 * GiB and before.warmable_bytes == 3 * GiB
    assert after.cache_bytes_per_node > before.cache_bytes_per_node

    def objects(sizing, nodes):
        return {n.name: NodePlan("ml/c", n.name, "1-abc", sizing.cache_bytes_per_node, sizing.warmable_bytes,
                                 replicas=sizing.replicas, nodes=len(nodes)) for n in nodes}

    current = {node: dict(plan.body("stoker-system"), status={}) for node, plan in objects(before, four).items()}
    create, update, delete = changes(current, objects(after, four[:3]))
    assert not create and sorted(p.node for p in update) == ["n0", "n1", "n2"]
    assert all(p.spec()["distributed"] == {"replicas": 1, "nodes": 3} and p.warmable_bytes == 4 * GiB for p in update)
    assert delete == [current["n3"]["metadata"]["name"]]


def test_distributed_replicas_are_checked():
    with pytest.raises(SpecProblem):
        size_cache({"distributed": {"replicas": 4}}, GiB, 1, [NodeInfo("n", {}, 64 * GiB)])
