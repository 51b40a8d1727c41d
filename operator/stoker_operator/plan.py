"""Pure decisions of the operator: spec + observations → sizing, target nodes, phase, conditions.

No Kubernetes client, no I/O: every function here is tested on its own (tests/operator/).
"""

from __future__ import annotations

import hashlib
import json

import math
from dataclasses import dataclass, field
from typing import Iterable
from datetime import datetime, timezone

from kubernetes.utils.quantity import parse_quantity

from fusecore.config import WARM_FRACTION, distributed_cache_size, estimated_block_squares, kept_fraction
from fusecore.config import format_size as human

from .failures import OperatorError
from .nodes import NodeState

MIN_CACHE_BYTES = 64 * 1024**2  # smallest budget a plan gives a mount (room for blocks and in-flight GETs)
READY_AT = 0.98  # a node whose cache holds this share of what it was asked to warm is Ready


class SpecProblem(OperatorError, ValueError):
    """A spec the schema let through but that cannot be acted on; the message is user-facing."""


@dataclass(frozen=True)
class NodeInfo:
    name: str
    labels: dict[str, str]
    allocatable_memory: int
    ready: bool = True
    schedulable: bool = True


@dataclass(frozen=True)
class Sizing:
    dataset_bytes: int
    object_count: int
    cache_bytes_per_node: int
    warmable_bytes: int  # what each node will hold once warm
    fits: bool
    message: str
    replicas: int = 0  # a distributed cache: copies of each block among the nodes (0: every node holds it all)
    disk_bytes_per_node: int = 0  # spec.diskCacheSize: the mounts' disk tier on each node (0: memory only)
    held_on: str = "memory"  # where what is warmed stays: memory, or disk where it does not fit memory


def replicas_of(spec: dict) -> int:
    """spec.distributed.replicas, or 0 when the cache is not distributed (every node holds the dataset)."""
    distributed = spec.get("distributed")
    if distributed is None:
        return 0
    replicas = int((distributed or {}).get("replicas", 1))
    if not 1 <= replicas <= 3:
        raise SpecProblem("distributed.replicas: must be 1, 2 or 3")
    return replicas


def quantity_bytes(text: str, *, what: str = "cacheSize") -> int:
    try:
        value = parse_quantity(text)
    except ValueError:
        raise SpecProblem(f"{what}: {text!r} is not a quantity (examples: 64Gi, 500M)") from None
    if value <= 0:
        raise SpecProblem(f"{what}: must be positive")
    return int(math.ceil(value))


def timestamp() -> str:
    """Now, as Kubernetes writes times in status (RFC 3339, UTC, seconds)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def node_matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in (selector or {}).items())


def target_nodes(selector: dict[str, str], nodes: list[NodeInfo]) -> list[NodeInfo]:
    """Nodes that should hold the cache: matching the selector, Ready and schedulable."""
    return sorted((n for n in nodes if n.ready and n.schedulable and node_matches(selector, n.labels)),
                  key=lambda n: n.name)


class NoRoom(SpecProblem):
    """The target nodes' Stoker cache memory is taken by other DatasetCaches (worth retrying later)."""


@dataclass(frozen=True)
class NodeRoom:
    """What other DatasetCaches left of the node cache memory on the tightest target node."""

    free: int
    node: str = ""
    taken_by: tuple[tuple[str, int], ...] = ()  # (namespace/name, bytes per node) on that node

    def describe(self, memory: int) -> str:
        others = ", ".join(f"{name} {human(size)}" for name, size in self.taken_by) or "nothing"
        return f"on node {self.node} {others} leave {human(max(0, self.free))} of {human(memory)} (node.cacheMemory)"


def node_room(memory: int, nodes: list[str], loads: dict[str, list[tuple[str, int]]], me: str) -> NodeRoom | None:
    """The tightest of `nodes` after the cache budgets other DatasetCaches planned there (None: no nodes).

    `loads`: node -> [(namespace/name, bytes per node)] of every DatasetCacheNode there, `me` left out."""
    tightest = None
    for node in nodes:
        taken = tuple(sorted(((cache, size) for cache, size in loads.get(node, ()) if cache != me),
                             key=lambda t: (-t[1], t[0])))
        room = NodeRoom(memory - sum(size for _, size in taken), node, taken)
        if tightest is None or room.free < tightest.free:
            tightest = room
    return tightest


def size_cache(spec: dict, dataset_bytes: int, object_count: int, nodes: list[NodeInfo],
               room: NodeRoom | None = None, memory: int = 0) -> Sizing:
    """Per-node cache budget: the explicit cacheSize, or auto (what a node must hold plus headroom, capped
    by maxNodeMemoryFraction of the smallest target node's allocatable memory and by what other
    DatasetCaches left of the node cache memory, `room`). What a node must hold is the dataset, or in a
    distributed cache its share: dataset x R / N, and what it may own past that (fusecore.config.distributed_cache_size:
    blocks split unevenly, estimated from the object count)."""
    requested = str(spec.get("cacheSize", "auto"))
    fraction = float(spec.get("maxNodeMemoryFraction", 0.5))
    headroom = int(spec.get("headroomPercent", 10))
    replicas = min(replicas_of(spec), len(nodes))  # 0: not distributed (or no nodes to spread it on)
    if replicas:  # a share per node: kept through transient use, since an owner's eviction costs every node
        goal = math.ceil(dataset_bytes * replicas / len(nodes))
        need = distributed_cache_size(dataset_bytes, len(nodes), replicas, headroom / 100,
                                      squares=estimated_block_squares(dataset_bytes, object_count))
        holds = kept_fraction()
        what = f"a share of {human(goal)} (dataset {human(dataset_bytes)} x {replicas} / {len(nodes)} nodes)"
    else:
        goal = dataset_bytes
        need = math.ceil(math.ceil(dataset_bytes / WARM_FRACTION) * (1 + headroom / 100))
        holds = WARM_FRACTION
        what = f"dataset {human(dataset_bytes)}"
    if requested == "auto":
        if not nodes:
            raise SpecProblem("no Ready node matches the nodeSelector, so the cache cannot be sized")
        cap = int(min(n.allocatable_memory for n in nodes) * fraction)
        if room is not None:
            cap = min(cap, room.free)
        per_node = max(MIN_CACHE_BYTES, min(need, cap))  # a mount needs a floor
        how = f"auto: {what} + {headroom}% headroom, capped at {fraction:g} of " \
              f"{human(min(n.allocatable_memory for n in nodes))} allocatable"
    else:
        per_node = max(MIN_CACHE_BYTES, quantity_bytes(requested))
        how = f"cacheSize {requested}"
        if memory and per_node > memory:  # waiting for room would never help
            raise SpecProblem(f"cacheSize {requested} is more than a node's Stoker cache memory "
                              f"({human(memory)}, node.cacheMemory)")
        smallest = min(nodes, key=lambda n: n.allocatable_memory, default=None)
        if smallest is not None and per_node > smallest.allocatable_memory:
            raise SpecProblem(f"cacheSize {requested} is more than node {smallest.name} has "
                              f"({human(smallest.allocatable_memory)} allocatable)")
    if room is not None and per_node > room.free:
        raise NoRoom(f"{human(per_node)} per node does not fit: {room.describe(memory)}")
    disk = disk_bytes(spec)
    in_memory = min(goal, int(per_node * holds))
    warmable = max(in_memory, min(goal, int(disk * WARM_FRACTION)))  # the disk tier holds every warmed block
    held_on = "disk" if warmable > in_memory else "memory"
    if held_on == "disk":
        how += f", on disk {human(disk)} (diskCacheSize)"
    fits = warmable >= goal
    whole = f"its share of the dataset ({human(goal)}; {len(nodes)} nodes hold it {replicas}x)" if replicas \
        else f"the whole dataset of {human(dataset_bytes)}"
    if fits:
        message = f"{human(per_node)} per node ({how}) holds {whole}"
    else:
        message = (f"{'a share' if replicas else 'the dataset'} is {human(goal)} but {human(per_node)} per node "
                   f"({how}) holds only {human(warmable)} ({100 * warmable / max(1, goal):.0f}%); warming what fits")
    return Sizing(dataset_bytes, object_count, per_node, warmable, fits, message, replicas, disk, held_on)


def disk_bytes(spec: dict) -> int:
    """spec.diskCacheSize per node (0: none): the volume's disk tier on each node (the chart's node.diskCache)."""
    size = spec.get("diskCacheSize")
    return quantity_bytes(str(size), what="diskCacheSize") if size else 0


NOT_READY_SHOWN = 10  # nodes named in status.notReady (all of them: the DatasetCacheNodes)


@dataclass
class Aggregate:
    phase: str
    cached_percentage: float
    conditions: dict[str, tuple[str, str, str]] = field(default_factory=dict)  # type -> (status, reason, msg)
    summary: dict[str, int] = field(default_factory=dict)
    not_ready: list[dict] = field(default_factory=list)
    ready_nodes: list[str] = field(default_factory=list)
    warmed_bytes: int = 0


def plan_id(generation: int | None, volume: dict, paths: list[str]) -> str:
    """Names one plan: the spec's generation and what it resolved to (volume and paths), so that reports
    made for an earlier plan never count for this one."""
    digest = hashlib.sha256(json.dumps([volume, sorted(paths)], sort_keys=True).encode()).hexdigest()[:12]
    return f"{generation}-{digest}"


def aggregate(status: dict, states: Iterable[NodeState]) -> Aggregate:
    """Overall phase, counts and conditions from the DatasetCacheNodes' reports about the current plan."""
    plan = status.get("plan")
    targets = sorted((s for s in states if not s.deleting), key=lambda s: s.node)
    warmable = int(status.get("warmableBytes", 0) or 0) or int(status.get("datasetBytes", 0) or 0)
    per_node_goal = max(1, min(warmable, int(status.get("cacheBytesPerNode", 0) or 0) or warmable))
    reports = {s.node: s.current_report(plan) or {} for s in targets}
    phases = {node: report.get("phase") for node, report in reports.items()}
    cached_each = {node: min(per_node_goal, int(r.get("cachedBytes", 0) or 0)) for node, r in reports.items()}
    cached = sum(cached_each.values())
    percentage = round(100.0 * cached / (per_node_goal * len(targets)), 1) if targets else 0.0
    ready = [n for n, p in phases.items() if p == "Ready"]
    failed = [n for n, p in phases.items() if p in ("Failed", "Evicted")]
    warming = [n for n, p in phases.items() if p == "Warming"]
    was_ready = status.get("phase") in ("Ready", "Degraded")
    if targets and len(ready) == len(targets):
        phase = "Ready"
    elif was_ready or failed:
        phase = "Degraded"
    else:
        phase = "Warming"
    summary = {"targets": len(targets), "ready": len(ready), "warming": len(warming), "failed": len(failed),
               "waiting": len(targets) - len(ready) - len(warming) - len(failed)}
    not_ready = [{"node": n, "phase": phases[n] or "Waiting",
                  "message": (reports[n].get("message") or "")[:200] if reports[n] else "no report about this plan yet"}
                 for n in sorted(phases, key=lambda n: (phases[n] not in ("Failed", "Evicted"), n))
                 if phases[n] != "Ready"][:NOT_READY_SHOWN]
    conditions = {
        "Warmed": ("True", "AllNodesWarm", f"{len(ready)} of {len(targets)} nodes warm")
        if phase == "Ready" else ("False", "Warming", f"{len(ready)} of {len(targets)} nodes warm"
                                  + (f"; not warm: {name_list(failed)}" if failed else "")),
        "Ready": ("True", "CacheReady", "training can start on the warm nodes") if phase == "Ready"
        else ("False", phase, "waiting for the nodes to warm"),
    }
    return Aggregate(phase, percentage, conditions, summary, not_ready, ready, cached)


def name_list(nodes: list[str], shown: int = NOT_READY_SHOWN) -> str:
    """The first `shown` names, and how many more (messages stay short at any cluster size)."""
    more = f" and {len(nodes) - shown} more" if len(nodes) > shown else ""
    return ", ".join(nodes[:shown]) + more


def merge_conditions(existing: list[dict], updates: dict[str, tuple[str, str, str]], now: str | None = None) -> list[dict]:
    """Conditions with updates applied; lastTransitionTime changes only when the status changes."""
    now = now or timestamp()
    by_type = {c["type"]: dict(c) for c in existing or []}
    for kind, (status, reason, message) in updates.items():
        old = by_type.get(kind)
        changed = old is None or old.get("status") != status
        since = now if old is None or changed else old.get("lastTransitionTime", now)
        by_type[kind] = {"type": kind, "status": status, "reason": reason, "message": message,
                         "lastTransitionTime": since}
    order = ["Sized", "CacheTooSmall", "Warmed", "Ready"]
    return sorted(by_type.values(), key=lambda c: order.index(c["type"]) if c["type"] in order else 99)


def gate_release_patch(pod: dict, gate: str, nodes: list[str]) -> dict | None:
    """Patch that removes our scheduling gate and pins the pod to the warm nodes (None: nothing to do).

    Kubernetes lets a gated pod's node affinity be added or narrowed: with no required node affinity we
    set one term; otherwise our expression is added to every existing term (an AND within each term).
    """
    spec = pod.get("spec", {})
    gates = spec.get("schedulingGates") or []
    if not any(g.get("name") == gate for g in gates):
        return None
    expression = {"key": "kubernetes.io/hostname", "operator": "In", "values": sorted(nodes)}
    required = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = required.get("nodeSelectorTerms") or []
    if terms:
        terms = [dict(t, matchExpressions=[*(t.get("matchExpressions") or []), expression]) for t in terms]
    else:
        terms = [{"matchExpressions": [expression]}]
    node_affinity = dict((spec.get("affinity") or {}).get("nodeAffinity") or {})
    node_affinity["requiredDuringSchedulingIgnoredDuringExecution"] = dict(required, nodeSelectorTerms=terms)
    return {"spec": {"schedulingGates": [g for g in gates if g.get("name") != gate],
                     "affinity": dict(spec.get("affinity") or {}, nodeAffinity=node_affinity)}}


def node_should_warm(policy: str, node_status: dict | None, cached_bytes: int, goal_bytes: int) -> bool:
    """Does a node agent (re)start warming? First time always; after that only KeepWarm re-warms,
    when the cache lost a noticeable part of what it held (eviction, restart of the mount)."""
    if not node_status or node_status.get("phase") in (None, "Pending", "Warming", "Failed"):
        return True
    if node_status.get("phase") == "Evicted":
        return policy == "KeepWarm"
    if policy == "KeepWarm" and node_status.get("phase") == "Ready":
        return cached_bytes < READY_AT * goal_bytes
    return False
