"""kopf handlers: thin adapters from DatasetCache, DatasetCacheNode and Pod events to plan.py's decisions.

The operator writes a DatasetCache's status and the spec of its DatasetCacheNodes (one per target
node, nodes.py); each node's warm agent writes the status of its own node's objects (agent.py).
Reports reach the DatasetCache through kopf indexes and a timer: one status write per cache and
AGGREGATE_EVERY at most, however many nodes report.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import kopf

from . import CACHE_ANNOTATION, GATE, GROUP, NODE_PLURAL, PLURAL, VERSION
from .handover import LABELS, OWNER_ANNOTATION, PEER_KEY, handover_name, new_peer_key, owner, secret_data
from .kube import Kube, NotFoundInCluster, load_config
from .nodes import FINALIZER as NODE_FINALIZER
from .nodes import NodePlan, NodeState, NotANodePlan, cache_selector, changes, object_name, release_patch, state_of
from .plan import (NoRoom, SpecProblem, aggregate, gate_release_patch, human, merge_conditions, name_list, node_room,
                   plan_id, replicas_of, size_cache, target_nodes)
from .source import StoreBusy, measure, read_secrets, resolve

log = logging.getLogger(__name__)
FINALIZER = "stoker.dev/release-node-caches"
RELEASE_WAIT_RETRIES = 60  # x 2 s: nodes that never answer do not block deletion forever

NO_ROOM_RETRY = 15  # seconds between plans of a DatasetCache that found no room on its nodes
AGGREGATE_EVERY = 3.0  # seconds between folds of the node reports into a DatasetCache's status
WRITERS = 16  # DatasetCacheNodes created, re-specced or deleted at once while planning
UNPLANNED = (None, "Pending", "Sizing", "Failed")  # Pending: waiting for room on nodes


@dataclass(frozen=True)
class OperatorConfig:
    """`stoker operator`'s settings, handed to kopf as its memo (cli.py)."""

    handover_namespace: str = "stoker-system"  # the release namespace: handovers and DatasetCacheNodes
    node_cache_memory: int = 0  # node.cacheMemory: DatasetCaches on a node never plan past it (0: no limit)


@dataclass(frozen=True)
class Context:
    """What every handler shares, built once at start-up and kept in kopf's memo."""

    kube: Kube
    handover_namespace: str
    node_cache_memory: int
    release: "ReleaseNamespace"


class ReleaseNamespace:
    """Whether the release namespace exists: asked at start-up, and again by each plan while it is missing
    (once it is there, it stays known)."""

    def __init__(self, kube: Kube, name: str):
        self.kube, self.name, self._present = kube, name, False

    def present(self) -> bool:
        if not self._present:
            self._present = not self.kube.namespace_missing(self.name)
        return self._present

    def problem(self) -> str:
        return (f"the release namespace {self.name!r} does not exist: create it, or start the operator with "
                f"--handover-namespace naming the namespace Stoker is installed in")


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="stoker.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="stoker.dev")
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 60
    logging.getLogger("kopf.objects").addFilter(_quiet_timer)
    logging.getLogger("kopf.objects").addFilter(_release_wait_is_progress)
    config = memo.get("config") or OperatorConfig()
    load_config()
    kube = Kube()
    release = ReleaseNamespace(kube, config.handover_namespace)
    if not release.present():
        log.error("%s; until then no DatasetCache is planned (each shows why in its status)", release.problem())
    memo["ctx"] = Context(kube, config.handover_namespace, config.node_cache_memory, release)


def _quiet_timer(record: logging.LogRecord) -> bool:
    """The aggregation timer succeeds every few seconds per cache: not worth a log line each time."""
    return "Timer 'summarize' succeeded" not in record.getMessage()


RELEASE_WAIT = "waiting for the node agents to release"


def _release_wait_is_progress(record: logging.LogRecord) -> bool:
    """Deleting a DatasetCache waits for its nodes by retrying the release handler, which kopf logs as an
    ERROR ("failed temporarily"): that wait is progress, logged at INFO."""
    if record.levelno > logging.INFO and RELEASE_WAIT in record.getMessage():
        record.levelno, record.levelname = logging.INFO, "INFO"
    return True


def _key(namespace: str, name: str) -> str:
    return f"{namespace}/{name}"


@kopf.index(GROUP, VERSION, NODE_PLURAL)
def node_states(*, namespace, body, memo, **_) -> dict | None:
    """DatasetCacheNodes by their DatasetCache (namespace/name): the plan each asks for and its report."""
    state = _state(memo.ctx, namespace, body)
    return {state.plan.cache: state} if state else None


@kopf.index(GROUP, VERSION, NODE_PLURAL)
def node_loads(*, namespace, body, memo, **_) -> dict | None:
    """Cache budgets by node: (DatasetCache, bytes) of every DatasetCacheNode there, deleting ones included
    (their memory is not back yet)."""
    state = _state(memo.ctx, namespace, body)
    return {state.node: (state.plan.cache, state.plan.cache_bytes)} if state else None


def _state(ctx: Context, namespace: str, body) -> NodeState | None:
    if namespace != ctx.handover_namespace:  # only the release namespace's objects are the operator's
        return None
    try:
        return state_of(dict(body))
    except NotANodePlan as exc:
        log.warning("%s", exc)
        return None


def _states(index, namespace: str, name: str) -> list[NodeState]:
    return list(index.get(_key(namespace, name), ()))


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def plan(*, spec, status, meta, namespace, name, body, patch, reason, memo, node_loads=None, **_) -> None:
    """Resolve the source, list the dataset, size the per-node cache and pick the nodes."""
    ctx: Context = memo.ctx
    generation = meta.get("generation")
    if (reason == "resume" and status.get("observedGeneration") == generation and status.get("phase") not in UNPLANNED
            and status.get("nodeReports")):  # (planned before DatasetCacheNodes existed: plan again, once)
        refresh_handover(ctx, dict(spec), namespace, name)
        return  # already planned for this generation: an operator restart re-warms nothing
    conditions = list(status.get("conditions") or [])
    if not ctx.release.present():
        problem = ctx.release.problem()
        patch.status.update(phase="Pending", observedGeneration=generation, conditions=merge_conditions(
            conditions, {"Ready": ("False", "ReleaseNamespaceMissing", problem)}))
        kopf.warn(body, reason="ReleaseNamespaceMissing", message=problem)
        raise kopf.TemporaryError(problem, delay=10)
    try:
        ref = resolve(dict(spec), namespace, ctx.kube)
        secrets = read_secrets(ref, ctx.kube)
        dataset_bytes, objects = measure(ref, secrets, list(spec.get("paths") or []))
        hand_over(ctx, namespace, name, ref, secrets, distributed=bool(replicas_of(dict(spec))))
        nodes = target_nodes(dict(spec.get("nodeSelector") or {}), ctx.kube.nodes())
        room = room_on(ctx, node_loads, nodes, namespace, name)
        sizing = size_cache(dict(spec), dataset_bytes, objects, nodes, room, ctx.node_cache_memory)
    except StoreBusy as exc:  # the store is slow or away: try again, the spec may be fine
        raise kopf.TemporaryError(f"listing the dataset: {exc}", delay=30) from None
    except NoRoom as exc:  # other DatasetCaches hold the nodes' cache memory: plan again when they go
        patch.status.update(phase="Pending", observedGeneration=generation, conditions=merge_conditions(
            conditions, {"Sized": ("False", "NodeCacheFull", str(exc)), "Ready": ("False", "Pending", str(exc))}))
        kopf.warn(body, reason="NodeCacheFull", message=str(exc))
        raise kopf.TemporaryError(str(exc), delay=NO_ROOM_RETRY) from None
    except SpecProblem as exc:
        patch.status.update(phase="Failed", observedGeneration=generation, conditions=merge_conditions(
            conditions, {"Sized": ("False", "InvalidSource", str(exc)), "Ready": ("False", "Failed", str(exc))}))
        kopf.warn(body, reason="Failed", message=str(exc))
        return
    volume = ref.as_status()
    plan_name = plan_id(generation, volume, list(spec.get("paths") or []))
    assign(ctx, namespace, name, dict(spec), plan_name, [n.name for n in nodes], sizing.cache_bytes_per_node,
           sizing.warmable_bytes, sizing.replicas)
    patch.status.update(
        phase="Warming", datasetBytes=dataset_bytes, datasetSize=human(dataset_bytes), objectCount=objects,
        cacheBytesPerNode=sizing.cache_bytes_per_node, warmableBytes=sizing.warmable_bytes,
        diskBytesPerNode=sizing.disk_bytes_per_node, heldOn=sizing.held_on,
        distributed=distribution(sizing, len(nodes)),
        volume=replacing(status.get("volume"), volume), observedGeneration=generation, plan=plan_name,
        nodeSummary={"targets": len(nodes), "ready": 0, "warming": 0, "failed": 0, "waiting": len(nodes)},
        notReady=[], warmedBytes=0, cachedPercentage=0, cached="0%", nodeReports=cache_selector(namespace, name),
        conditions=merge_conditions(conditions, {
            "Sized": ("True", "Sized", sizing.message),
            "CacheTooSmall": ("False", "Fits", sizing.message) if sizing.fits
            else ("True", "DatasetLargerThanCache", sizing.message),
        }))
    kopf.info(body, reason="Sized", message=f"{objects} objects, {human(dataset_bytes)}; {sizing.message}; "
                                            f"nodes: {name_list([n.name for n in nodes]) or 'none'}")
    if not sizing.fits:
        kopf.warn(body, reason="CacheTooSmall", message=sizing.message)


def replacing(old: dict | None, new: dict) -> dict:
    """A merge patch that replaces `old` by `new` (status is merge-patched: a key left out would stay)."""
    old = old or {}
    out: dict = {k: None for k in old if k not in new}
    for key, value in new.items():
        nested = isinstance(value, dict) and isinstance(old.get(key), dict)
        out[key] = replacing(old[key], value) if nested else value
    return out


def room_on(ctx: Context, loads, nodes, namespace: str, name: str):
    """What the other DatasetCaches left of the node cache memory on the tightest of `nodes` (None: no limit)."""
    if not ctx.node_cache_memory:
        return None
    names = [n.name for n in nodes]
    return node_room(ctx.node_cache_memory, names, {n: list(loads.get(n, ())) for n in names}, _key(namespace, name))


def distribution(sizing, nodes: int) -> dict | None:
    """status.distributed of a distributed cache (None: the key is removed from a cache that is no longer)."""
    if not sizing.replicas:
        return None
    return {"replicas": sizing.replicas, "nodes": nodes, "shareBytes": sizing.warmable_bytes}


def assign(ctx: Context, namespace: str, name: str, spec: dict, plan_name: str, nodes: list[str], cache_bytes: int,
           warmable_bytes: int, replicas: int = 0) -> None:
    """Make this cache's DatasetCacheNodes say the plan: one per target node, none elsewhere. In a distributed
    cache a node that joins or leaves changes every node's share: each is re-specced (cacheBytes,
    warmableBytes) and its agent warms what it now owns."""
    wanted = {node: NodePlan(_key(namespace, name), node, plan_name, cache_bytes, warmable_bytes,
                             tuple(spec.get("paths") or ()), str(spec.get("policy") or "Once"), replicas,
                             len(nodes) if replicas else 0)
              for node in nodes}
    kube, release_ns = ctx.kube, ctx.handover_namespace
    items, _ = kube.node_objects(release_ns, cache_selector(namespace, name))
    current = {}
    for obj in items:
        try:
            current[state_of(obj).node] = obj
        except NotANodePlan:
            kube.delete_node_object(release_ns, obj["metadata"]["name"])
    create, update, delete = changes(current, wanted)
    calls = [lambda p=p: kube.create_node_object(release_ns, p.body(release_ns)) for p in create]
    calls += [lambda p=p: kube.patch_node_object(release_ns, p.body(release_ns)["metadata"]["name"],
                                                 {"spec": p.spec()}) for p in update]
    calls += [lambda n=n: kube.delete_node_object(release_ns, n) for n in delete]
    with ThreadPoolExecutor(WRITERS) as pool:
        list(pool.map(lambda call: call(), calls))
    if create or update or delete:
        log.info("%s/%s: plan %s on %d nodes (%d new, %d re-planned, %d released)", namespace, name, plan_name,
                 len(nodes), len(create), len(update), len(delete))


def hand_over(ctx: Context, namespace: str, name: str, ref, secrets: dict[str, str], *, distributed: bool) -> None:
    """Give the node agents the volume and its credentials, in the release namespace (handover.py); a
    distributed cache's peer key is made once and kept (its nodes' running mounts sign with it)."""
    secret = handover_name(namespace, name)
    peer_key = None
    if distributed:
        try:
            peer_key = ctx.kube.secret(ctx.handover_namespace, secret)[0].get(PEER_KEY)
        except NotFoundInCluster:
            pass
        peer_key = peer_key or new_peer_key()
    ctx.kube.put_secret(ctx.handover_namespace, secret, secret_data(ref, secrets, peer_key),
                        {OWNER_ANNOTATION: owner(namespace, name)}, LABELS)


def refresh_handover(ctx: Context, spec: dict, namespace: str, name: str) -> None:
    """Hand over the source's current credentials (a rotated Secret reaches the nodes this way)."""
    try:
        ref = resolve(spec, namespace, ctx.kube)
        hand_over(ctx, namespace, name, ref, read_secrets(ref, ctx.kube), distributed=bool(replicas_of(spec)))
    except SpecProblem as exc:
        log.warning("%s/%s: credentials not refreshed: %s", namespace, name, exc)


@kopf.timer(GROUP, VERSION, PLURAL, interval=AGGREGATE_EVERY)
def summarize(*, status, meta, namespace, name, body, patch, memo, node_states=None, **_) -> None:
    """Fold the DatasetCacheNodes' reports into phase, counts and conditions (debounced: one write per
    interval at most, and none when nothing changed); release gated pods once Ready."""
    ctx: Context = memo.ctx
    if meta.get("deletionTimestamp") or status.get("phase") in UNPLANNED:
        return
    if status.get("observedGeneration") != meta.get("generation"):
        return  # a re-plan is pending; its numbers are not in yet
    result = aggregate(status, _states(node_states, namespace, name))
    changes = {"phase": result.phase, "cachedPercentage": result.cached_percentage,
               "cached": f"{result.cached_percentage:g}%", "nodeSummary": result.summary,
               "notReady": result.not_ready, "warmedBytes": result.warmed_bytes}
    new_conditions = merge_conditions(status.get("conditions") or [], result.conditions)
    if any(status.get(k) != v for k, v in changes.items()) or new_conditions != status.get("conditions"):
        patch.status.update(changes, conditions=new_conditions)
        if result.phase != status.get("phase"):
            (kopf.info if result.phase == "Ready" else kopf.warn)(
                body, reason=result.phase, message=f"{result.cached_percentage:g}% of the plan is cached")
    if result.phase == "Ready":
        release_pods(ctx, namespace, name, result.ready_nodes)


def release_pods(ctx: Context, namespace: str, cache: str, nodes: list[str]) -> int:
    released = 0
    for pod in ctx.kube.gated_pods(namespace, cache, GATE, CACHE_ANNOTATION):
        patch = gate_release_patch(pod, GATE, nodes)
        if patch is not None:
            ctx.kube.patch_pod(namespace, pod["metadata"]["name"], patch)
            log.info("released pod %s/%s onto %s", namespace, pod["metadata"]["name"], ", ".join(nodes))
            released += 1
    return released


def _gated(spec, **_) -> bool:
    return any(g.get("name") == GATE for g in (spec.get("schedulingGates") or []))


@kopf.on.event("", "v1", "pods", annotations={CACHE_ANNOTATION: kopf.PRESENT}, when=_gated)
def gated_pod(*, type, namespace, annotations, memo, node_states=None, **_) -> None:
    """A gated pod that arrives after its cache is Ready is released at once (an event handler,
    so kopf keeps no bookkeeping on users' pods)."""
    ctx: Context = memo.ctx
    if type == "DELETED":
        return
    cache = ctx.kube.cache(namespace, annotations[CACHE_ANNOTATION])
    if cache and (cache.get("status") or {}).get("phase") == "Ready":
        name = cache["metadata"]["name"]
        release_pods(ctx, namespace, name, aggregate(cache["status"], _states(node_states, namespace, name)).ready_nodes)


@kopf.timer(GROUP, VERSION, PLURAL, interval=60, initial_delay=60, idle=30)
def replan_on_node_changes(*, spec, status, meta, namespace, name, patch, memo, node_states=None, node_loads=None,
                           **_) -> None:
    """New or lost matching nodes: re-size and re-target without listing the dataset again; hand
    rotated credentials over (the agents pass them to the running mounts)."""
    ctx: Context = memo.ctx
    if status.get("phase") in UNPLANNED or status.get("observedGeneration") != meta.get("generation"):
        return
    refresh_handover(ctx, dict(spec), namespace, name)
    cluster = ctx.kube.nodes()
    states = _states(node_states, namespace, name)
    forget_gone_nodes(ctx, namespace, name, states, {n.name for n in cluster})
    nodes = target_nodes(dict(spec.get("nodeSelector") or {}), cluster)
    planned = sorted(s.node for s in states if not s.deleting)
    if [n.name for n in nodes] == planned:
        return
    try:
        sizing = size_cache(dict(spec), int(status.get("datasetBytes", 0)), int(status.get("objectCount", 0)), nodes,
                            room_on(ctx, node_loads, nodes, namespace, name), ctx.node_cache_memory)
    except NoRoom as exc:  # a new node is full of other caches: keep the current nodes
        log.warning("%s/%s: not re-targeted: %s", namespace, name, exc)
        return
    except SpecProblem as exc:
        patch.status.update(phase="Degraded", conditions=merge_conditions(
            status.get("conditions") or [], {"Ready": ("False", "NoNodes", str(exc))}))
        return
    assign(ctx, namespace, name, dict(spec), str(status.get("plan")), [n.name for n in nodes], sizing.cache_bytes_per_node,
           sizing.warmable_bytes, sizing.replicas)
    patch.status.update(cacheBytesPerNode=sizing.cache_bytes_per_node, warmableBytes=sizing.warmable_bytes,
                        diskBytesPerNode=sizing.disk_bytes_per_node, heldOn=sizing.held_on,
                        distributed=distribution(sizing, len(nodes)))


@kopf.on.delete(GROUP, VERSION, PLURAL)
def release(*, body, namespace, name, retry, memo, **_) -> None:
    """Delete this cache's DatasetCacheNodes and wait until every node agent gave its memory back (each
    removes its object's finalizer), then delete the handover."""
    ctx: Context = memo.ctx
    items, _version = ctx.kube.node_objects(ctx.handover_namespace, cache_selector(namespace, name))
    live = [obj["metadata"]["name"] for obj in items if not obj["metadata"].get("deletionTimestamp")]
    silent = [obj for obj in items if not obj.get("status")]  # never reported: its agent holds nothing yet
    with ThreadPoolExecutor(WRITERS) as pool:  # (one that is just starting sees the deletion and lets go)
        list(pool.map(lambda n: ctx.kube.delete_node_object(ctx.handover_namespace, n), live))
        list(pool.map(lambda obj: unblock(ctx, obj["metadata"]), silent))
    items = [obj for obj in items if obj.get("status")]
    holding = sorted((obj.get("spec") or {}).get("node", obj["metadata"]["name"]) for obj in items)
    if holding and retry < RELEASE_WAIT_RETRIES:
        raise kopf.TemporaryError(f"{RELEASE_WAIT} the caches of {len(holding)} nodes: {name_list(holding)}",
                                  delay=2)
    if holding:
        kopf.warn(body, reason="ReleaseTimeout", message=f"{len(holding)} nodes did not confirm the release: "
                                                         f"{name_list(holding)}")
        for obj in items:
            unblock(ctx, obj["metadata"])
    ctx.kube.delete_secret(ctx.handover_namespace, handover_name(namespace, name))


def unblock(ctx: Context, meta: dict) -> None:
    """Drop the node-release finalizer of a DatasetCacheNode (by its metadata) whose node never answered."""
    ctx.kube.patch_node_object(ctx.handover_namespace, meta["name"], release_patch(meta.get("finalizers")))


def forget_gone_nodes(ctx: Context, namespace: str, name: str, states: list[NodeState], cluster: set[str]) -> None:
    """DatasetCacheNodes left for deletion whose node is no longer in the cluster: nobody will release
    them, so let them go."""
    for state in states:
        if state.deleting and state.node not in cluster:
            unblock(ctx, {"name": object_name(namespace, name, state.node), "finalizers": [NODE_FINALIZER]})
