"""DatasetCacheNode: one node's part of a DatasetCache, as a small object of its own.

The operator writes the spec (the plan for that node) and deletes the object when the node leaves
the plan; the node's warm agent writes the status (its report) and removes the finalizer once it
gave the memory back. They live in the release namespace, beside the handovers, labelled so that an
agent lists and watches its own node's objects only: what a node receives does not grow with the
cluster, and the DatasetCache keeps aggregates only (plan.aggregate).

    kubectl get dcn -n <release namespace> -l stoker.dev/cache-name=<name>   # one cache, every node
    kubectl get dcn -n <release namespace> -l stoker.dev/node=<node>         # one node, every cache
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

from .failures import OperatorError
from . import GROUP, NODE_KIND, VERSION

FINALIZER = "stoker.dev/node-release"  # removed by the node's agent once its cache is released
CACHE_LABEL = "stoker.dev/cache"  # the DatasetCache's id (cache_id)
NODE_LABEL = "stoker.dev/node"
NAME_LABEL, NAMESPACE_LABEL = "stoker.dev/cache-name", "stoker.dev/cache-namespace"
MANAGED = {"app.kubernetes.io/managed-by": "stoker-operator"}
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def cache_id(namespace: str, name: str) -> str:
    """A DatasetCache's identity in names and labels of the release namespace."""
    return hashlib.sha256(f"{namespace}/{name}".encode()).hexdigest()[:32]


def label_value(text: str) -> str:
    """`text` where it is a valid label value, else a digest of it (node names may be 253 characters)."""
    return text if _LABEL_VALUE.match(text) else "h-" + hashlib.sha256(text.encode()).hexdigest()[:40]


def object_name(namespace: str, name: str, node: str) -> str:
    """The DatasetCacheNode of one cache and node (a DNS subdomain: node names are DNS subdomains too)."""
    short = cache_id(namespace, name)[:16]
    full = f"{short}.{node}"
    return full if len(full) <= 253 else f"{short}.{hashlib.sha256(node.encode()).hexdigest()[:40]}"


def node_selector(node: str) -> str:
    return f"{NODE_LABEL}={label_value(node)}"


def cache_selector(namespace: str, name: str) -> str:
    return f"{CACHE_LABEL}={cache_id(namespace, name)}"


@dataclass(frozen=True)
class NodePlan:
    """What one node is asked to hold: the spec of its DatasetCacheNode."""

    cache: str  # namespace/name of the DatasetCache
    node: str
    plan: str
    cache_bytes: int
    warmable_bytes: int
    paths: tuple[str, ...] = ()
    policy: str = "Once"
    replicas: int = 0  # a distributed cache: the node warms the blocks it owns among the cache's nodes (R copies)
    nodes: int = 0  # a distributed cache: how many nodes the plan has (an agent waits for them all to join)

    @property
    def cache_namespace(self) -> str:
        return self.cache.split("/", 1)[0]

    @property
    def cache_name(self) -> str:
        return self.cache.split("/", 1)[1]

    def spec(self) -> dict:
        spec = {"cache": self.cache, "node": self.node, "plan": self.plan, "cacheBytes": self.cache_bytes,
                "warmableBytes": self.warmable_bytes, "paths": list(self.paths), "policy": self.policy}
        if self.replicas:
            spec["distributed"] = {"replicas": self.replicas, "nodes": self.nodes}
        return spec

    def body(self, namespace: str) -> dict:
        """The whole object, as the operator creates it."""
        ns, name = self.cache_namespace, self.cache_name
        labels = {**MANAGED, CACHE_LABEL: cache_id(ns, name), NODE_LABEL: label_value(self.node)}
        for key, value in ((NAME_LABEL, name), (NAMESPACE_LABEL, ns)):
            if label_value(value) == value:
                labels[key] = value
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": NODE_KIND,
                "metadata": {"name": object_name(ns, name, self.node), "namespace": namespace, "labels": labels,
                             "finalizers": [FINALIZER]},
                "spec": self.spec()}


class NotANodePlan(OperatorError, ValueError):
    """A DatasetCacheNode whose spec is missing or malformed (never acted on)."""


def plan_of(obj: dict) -> NodePlan:
    spec = obj.get("spec") or {}
    try:
        cache, node, plan = str(spec["cache"]), str(spec["node"]), str(spec["plan"])
        if cache.count("/") != 1 or not all(cache.split("/")):
            raise ValueError(cache)
        distributed = spec.get("distributed") or {}
        replicas, nodes = int(distributed.get("replicas", 0)), int(distributed.get("nodes", 0))
        return NodePlan(cache, node, plan, int(spec["cacheBytes"]), int(spec.get("warmableBytes") or 0),
                        tuple(str(p) for p in spec.get("paths") or ()), str(spec.get("policy") or "Once"), replicas,
                        nodes)
    except (KeyError, TypeError, ValueError):
        raise NotANodePlan(f"DatasetCacheNode {obj.get('metadata', {}).get('name')!r} has no valid spec") from None


@dataclass(frozen=True)
class NodeState:
    """A DatasetCacheNode as the operator aggregates it: the plan it asks for and the node's report."""

    plan: NodePlan
    report: dict = field(default_factory=dict, hash=False)  # compared: kopf's index keeps a value equal to the old
    deleting: bool = False

    @property
    def node(self) -> str:
        return self.plan.node

    def current_report(self, plan: str | None) -> dict | None:
        """The node's report if it is about `plan` (an earlier plan's report counts as none)."""
        if not self.report or self.deleting or self.plan.plan != plan or self.report.get("plan") != plan:
            return None
        return self.report


def state_of(obj: dict) -> NodeState:
    return NodeState(plan_of(obj), dict(obj.get("status") or {}), bool(obj["metadata"].get("deletionTimestamp")))


def release_patch(finalizers: list[str] | None) -> dict:
    """The merge patch that takes the node-release finalizer off a DatasetCacheNode (others stay)."""
    return {"metadata": {"finalizers": [f for f in finalizers or [] if f != FINALIZER]}}


def changes(current: dict[str, dict], wanted: dict[str, NodePlan]) -> tuple[list[NodePlan], list[NodePlan], list[str]]:
    """(to create, to re-spec, object names to delete) that turn the objects `current` (by node) into `wanted`."""
    create = [p for node, p in wanted.items() if node not in current]
    update = []
    for node, plan in wanted.items():
        obj = current.get(node)
        if obj is not None and not obj["metadata"].get("deletionTimestamp") and (obj.get("spec") or {}) != plan.spec():
            update.append(plan)
    delete = [obj["metadata"]["name"] for node, obj in current.items()
              if node not in wanted and not obj["metadata"].get("deletionTimestamp")]
    return create, update, delete
