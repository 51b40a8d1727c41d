"""DatasetCacheNode names, labels and the operator's create / re-spec / delete decisions."""

from __future__ import annotations

import re

import pytest

from stoker_operator.crd import schema
from stoker_operator.nodes import (FINALIZER, NODE_LABEL, NodePlan, NotANodePlan, changes, label_value,
                                   node_selector, object_name, plan_of, state_of)

DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


def plan(node: str, plan_name: str = "1-abc", cache_bytes: int = 100) -> NodePlan:
    return NodePlan("ml/imagenet", node, plan_name, cache_bytes, 90, ("train",), "KeepWarm")


def test_names_and_labels_are_valid_for_any_node_name():
    long_node = ".".join(["segment" + "x" * 50] * 4)  # 231 characters: a valid node name, too long for a label
    for node in ("gpu-1", "ip-10-0-1-23.ec2.internal", long_node):
        name = object_name("ml", "imagenet", node)
        assert len(name) <= 253 and DNS_SUBDOMAIN.match(name), name
        value = label_value(node)
        assert len(value) <= 63 and re.match(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$", value)
        assert plan(node).body("stoker-system")["metadata"]["labels"][NODE_LABEL] == value
        assert node_selector(node) == f"{NODE_LABEL}={value}"
    assert label_value("gpu-1") == "gpu-1" and label_value(long_node) != label_value(long_node + "y")
    assert object_name("ml", "imagenet", "n1") != object_name("ml", "imagenet2", "n1")
    assert object_name("ml", "a", "n1") != object_name("ml2", "a", "n1")


def test_a_node_plan_round_trips_through_its_object_and_the_schema_allows_it():
    import jsonschema

    body = plan("gpu-1").body("stoker-system")
    assert body["metadata"]["finalizers"] == [FINALIZER]
    assert body["metadata"]["labels"]["stoker.dev/cache-name"] == "imagenet"
    jsonschema.validate(body, schema("datasetcachenodes"))
    assert plan_of(body) == plan("gpu-1")
    state = state_of(dict(body, status={"phase": "Ready", "plan": "1-abc"}))
    assert state.current_report("1-abc") == {"phase": "Ready", "plan": "1-abc"}
    assert state.current_report("2-def") is None


@pytest.mark.parametrize("spec", [None, {}, {"cache": "no-slash", "node": "n", "plan": "p", "cacheBytes": 1},
                                  {"cache": "a/b/c", "node": "n", "plan": "p", "cacheBytes": 1},
                                  {"cache": "a/b", "node": "n", "plan": "p", "cacheBytes": "lots"},
                                  {"cache": "/b", "node": "n", "plan": "p", "cacheBytes": 1}])
def test_a_malformed_node_object_is_refused(spec):
    with pytest.raises(NotANodePlan):
        plan_of({"metadata": {"name": "x"}, "spec": spec})


def test_changes_create_respec_and_delete_only_what_differs():
    current = {n: plan(n).body("s") for n in ("keep", "resize", "leave", "going")}
    current["resize"]["spec"]["cacheBytes"] = 50
    current["going"]["metadata"]["deletionTimestamp"] = "2026-12-02T00:00:00Z"  # already on its way out
    wanted = {n: plan(n) for n in ("keep", "resize", "new")}
    create, update, delete = changes(current, wanted)
    assert [p.node for p in create] == ["new"]
    assert [p.node for p in update] == ["resize"]
    assert delete == [current["leave"]["metadata"]["name"]]
    assert changes({n: plan(n).body("s") for n in ("a", "b")}, {n: plan(n) for n in ("a", "b")}) == ([], [], [])


def test_an_agent_leaves_alone_what_is_not_its_own(caplog):
    """A DatasetCacheNode labelled for this node but planned for another, or malformed: the agent neither
    holds a volume for it nor patches it (no finalizer taken off an object that is not its own)."""
    from stoker_bench.operator_scale import FakeVolumes
    from stoker_operator.agent import WarmAgent

    class NoWrites:
        def __getattr__(self, name):
            raise AssertionError(f"the agent called the API ({name}) for an object that is not its own")

    volumes = FakeVolumes("/nonexistent.sock")
    agent = WarmAgent(volumes, "gpu-1", NoWrites())
    forged = plan("gpu-2").body("stoker-system")
    forged["metadata"]["labels"][NODE_LABEL] = "gpu-1"
    malformed = {"metadata": {"name": "x", "finalizers": [FINALIZER]}, "spec": {"node": "gpu-1"}}
    for obj in (forged, malformed):
        agent.observe("ADDED", obj)
        agent.observe("MODIFIED", dict(obj, metadata=dict(obj["metadata"], deletionTimestamp="2026-12-03T00:00:00Z")))
    assert agent.workers == {} and volumes.held == {}
    assert "is for node gpu-2, not gpu-1" in caplog.text


@pytest.mark.parametrize("flag, value", [("--warm-report-interval", "0"), ("--warm-report-interval", "soon"),
                                         ("--warm-recheck", "-1")])
def test_the_agents_intervals_are_refused_unless_positive(capsys, flag, value):
    from stoker.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["csi", "--warm-agent", flag, value])
    assert exit_.value.code == 2 and flag in capsys.readouterr().err
    assert build_parser().parse_args(["csi", flag, "2.5"]).__dict__[flag[2:].replace("-", "_")] == 2.5


def test_an_agent_without_a_peer_port_says_it_cannot_serve_a_distributed_plan_and_holds_nothing():
    """A node plugin started with --peer-port 0 (or without its pod's address) cannot serve a share to the
    other nodes: it says so in its report (phase Failed, a message naming the chart value) instead of
    warming a share as if it were the dataset."""
    import threading

    from stoker_bench.operator_scale import FakeVolumes
    from stoker_operator.agent import NO_PEER_PORT, WarmAgent

    reports = []
    reported = threading.Event()

    class Kube:
        def patch_node_status(self, namespace, name, status):
            reports.append(status)
            reported.set()

        def __getattr__(self, name):
            raise AssertionError(f"the agent called the API ({name}) for a plan it does not serve")

    volumes = FakeVolumes("/nonexistent.sock")
    agent = WarmAgent(volumes, "gpu-1", Kube(), recheck=60)
    distributed = NodePlan("ml/c", "gpu-1", "1-abc", 2**30, 2**29, replicas=1)
    agent.observe("ADDED", distributed.body("stoker-system"))
    assert reported.wait(10)
    assert reports[0]["phase"] == "Failed" and reports[0]["message"] == NO_PEER_PORT
    assert volumes.held == {}
    for worker in agent.workers.values():
        worker.stop()


def test_membership_follows_peers_and_planned_nodes_not_progress_reports():
    """A distributed cache's members as one agent sees them (members.Membership): a node that publishes or
    changes its address, or leaves the plan, is a change; a progress report is not (it would re-join and
    re-warm every member at every report of every other)."""
    import threading

    from stoker_operator.members import Membership

    def dcn(name, peer=None, deleting=False, cached=0):
        meta = {"name": name, **({"deletionTimestamp": "2026-12-03T00:00:00Z"} if deleting else {})}
        return {"metadata": meta, "status": {"cachedBytes": cached, **({"peer": peer} if peer else {})}}

    events = [("MODIFIED", dcn("b", cached=5)),  # b is planned, has not published an address yet
              ("MODIFIED", dcn("a", "10.0.0.1:7470", cached=10)),  # progress only: no change
              ("MODIFIED", dcn("b", "10.0.0.2:7470")),  # b published: a change
              ("MODIFIED", dcn("a", "10.0.0.9:7470")),  # a's node plugin restarted with another pod IP: a change
              ("MODIFIED", dcn("b", "10.0.0.2:7470", deleting=True))]  # b leaves the plan: a change
    seen, done = [], threading.Event()

    class Kube:
        def node_objects(self, namespace, selector):
            assert selector == "stoker.dev/cache=c1"  # this cache's objects only
            return [dcn("a", "10.0.0.1:7470"), dcn("b")], "7"

        def watch_node_objects(self, namespace, selector, version, timeout=60):
            assert version == "7"
            for kind, obj in events:
                yield {"type": kind, "object": obj}
                seen.append(membership.current())
            membership.stopped.set()
            done.set()
            yield {"type": "BOOKMARK", "object": {}}

    changes = []
    membership = Membership(Kube(), "stoker-system", "stoker.dev/cache=c1", lambda: changes.append(1))
    threading.Thread(target=membership.run, daemon=True).start()
    assert done.wait(10)
    assert seen == [(["10.0.0.1:7470"], 2), (["10.0.0.1:7470"], 2), (["10.0.0.1:7470", "10.0.0.2:7470"], 2),
                    (["10.0.0.2:7470", "10.0.0.9:7470"], 2), (["10.0.0.9:7470"], 1)]
    assert len(changes) == 1 + 3  # the first list, then three changes
    assert membership.spread() == 1.0


def test_the_node_plugin_refuses_a_bad_peer_port_or_wait_before_it_starts():
    import pytest

    from stoker.cli import build_parser

    parser = build_parser()
    base = ["csi", "--mode=node", "--node-id", "n1", "--warm-agent"]
    assert parser.parse_args([*base, "--peer-port", "7470", "--join-wait", "5"]).peer_port == 7470
    for bad in (["--peer-port", "70000"], ["--peer-port", "http"], ["--peer-port", "-1"], ["--join-wait", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args([*base, *bad])


def test_a_large_distributed_cache_spreads_its_progress_reports():
    from stoker_operator.members import SPREAD_FROM, Membership

    membership = Membership(None, "stoker-system", "stoker.dev/cache=c1", lambda: None)
    membership._apply(lambda objects: objects.update({f"n{i}": "" for i in range(SPREAD_FROM // 2)}))
    assert membership.spread() == 1.0
    membership._apply(lambda objects: objects.update({f"n{i}": "" for i in range(SPREAD_FROM * 5 // 2)}))
    assert membership.spread() == 2.5
