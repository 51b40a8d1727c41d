"""kopf handlers: thin adapters from DatasetCache and Pod events to plan.py's decisions.

One writer per status field: the operator writes everything in status except `status.nodes`,
whose entries each node's warm agent writes for its own node only (agent.py).
"""

from __future__ import annotations

import logging
import os

import kopf

from . import CACHE_ANNOTATION, GATE, GROUP, PLURAL, VERSION
from .handover import LABELS, OWNER_ANNOTATION, handover_name, owner, secret_data
from .kube import Kube, load_config
from .plan import (NoRoom, SpecProblem, aggregate, gate_release_patch, human, merge_conditions, node_room, plan_id,
                   size_cache, target_nodes)
from .source import StoreBusy, measure, read_secrets, resolve

log = logging.getLogger(__name__)
FINALIZER = "stoker.dev/release-node-caches"
RELEASE_WAIT_RETRIES = 60  # x 2 s: nodes that never answer do not block deletion forever

_kube: Kube | None = None
HANDOVER_NAMESPACE = os.environ.get("POD_NAMESPACE", "stoker-system")  # set by `stoker operator`
NODE_CACHE_MEMORY: int | None = None  # node.cacheMemory: DatasetCaches on a node never plan past it
WATCHED_NAMESPACES: list[str] = []  # empty: the whole cluster
NO_ROOM_RETRY = 15  # seconds between plans of a DatasetCache that found no room on its nodes


def kube() -> Kube:
    global _kube
    if _kube is None:
        load_config()
        _kube = Kube()
    return _kube


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="stoker.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="stoker.dev")
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 60
    kube()


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def plan(spec, status, meta, namespace, name, body, patch, reason, **_) -> None:
    """Resolve the source, list the dataset, size the per-node cache and pick the nodes."""
    generation = meta.get("generation")
    if reason == "resume" and status.get("observedGeneration") == generation and status.get("phase") not in (
            None, "Pending", "Sizing", "Failed"):
        refresh_handover(dict(spec), namespace, name)
        return  # already planned for this generation: an operator restart re-warms nothing
    conditions = list(status.get("conditions") or [])
    try:
        ref = resolve(dict(spec), namespace, kube())
        secrets = read_secrets(ref, kube())
        dataset_bytes, objects = measure(ref, secrets, list(spec.get("paths") or []))
        hand_over(namespace, name, ref, secrets)
        nodes = target_nodes(dict(spec.get("nodeSelector") or {}), kube().nodes())
        room = room_on(nodes, namespace, name)
        sizing = size_cache(dict(spec), dataset_bytes, objects, nodes, room, NODE_CACHE_MEMORY or 0)
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
    patch.status.update(
        phase="Warming", datasetBytes=dataset_bytes, datasetSize=human(dataset_bytes), objectCount=objects,
        cacheBytesPerNode=sizing.cache_bytes_per_node, warmableBytes=sizing.warmable_bytes,
        targetNodes=[n.name for n in nodes], volume=replacing(status.get("volume"), volume),
        observedGeneration=generation, plan=plan_id(generation, volume, list(spec.get("paths") or [])),
        conditions=merge_conditions(conditions, {
            "Sized": ("True", "Sized", sizing.message),
            "CacheTooSmall": ("False", "Fits", sizing.message) if sizing.fits
            else ("True", "DatasetLargerThanCache", sizing.message),
        }))
    kopf.info(body, reason="Sized", message=f"{objects} objects, {human(dataset_bytes)}; {sizing.message}; "
                                            f"nodes: {', '.join(n.name for n in nodes) or 'none'}")
    if not sizing.fits:
        kopf.warn(body, reason="CacheTooSmall", message=sizing.message)


def replacing(old: dict | None, new: dict) -> dict:
    """A merge patch that replaces `old` by `new` (status is merge-patched: a key left out would stay)."""
    old = old or {}
    out = {k: None for k in old if k not in new}
    for key, value in new.items():
        nested = isinstance(value, dict) and isinstance(old.get(key), dict)
        out[key] = replacing(old[key], value) if nested else value
    return out


def room_on(nodes, namespace: str, name: str):
    """What the other DatasetCaches left of the node cache memory on the tightest of `nodes` (None: no limit)."""
    if not NODE_CACHE_MEMORY:
        return None
    others = [c for c in kube().all_caches(WATCHED_NAMESPACES)
              if (c["metadata"]["namespace"], c["metadata"]["name"]) != (namespace, name)
              and not c["metadata"].get("deletionTimestamp")]
    return node_room(NODE_CACHE_MEMORY, [n.name for n in nodes], others)


def hand_over(namespace: str, name: str, ref, secrets: dict[str, str]) -> None:
    """Give the node agents the volume and its credentials, in the release namespace (handover.py)."""
    kube().put_secret(HANDOVER_NAMESPACE, handover_name(namespace, name), secret_data(ref, secrets),
                      {OWNER_ANNOTATION: owner(namespace, name)}, LABELS)


def refresh_handover(spec: dict, namespace: str, name: str) -> None:
    """Hand over the source's current credentials (a rotated Secret reaches the nodes this way)."""
    try:
        ref = resolve(spec, namespace, kube())
        hand_over(namespace, name, ref, read_secrets(ref, kube()))
    except SpecProblem as exc:
        log.warning("%s/%s: credentials not refreshed: %s", namespace, name, exc)


@kopf.on.event(GROUP, VERSION, PLURAL)
def progress(type, body, patch, **_) -> None:
    """Fold the node agents' reports into phase, percentage and conditions; release gated pods."""
    status = body.get("status") or {}
    meta = body.get("metadata") or {}
    unplanned = status.get("phase") in (None, "Pending", "Failed", "Sizing")  # Pending: waiting for room on nodes
    if type == "DELETED" or meta.get("deletionTimestamp") or unplanned:
        return
    if status.get("observedGeneration") != meta.get("generation"):
        return  # a re-plan is pending; its numbers are not in yet
    result = aggregate(status)
    changes = {"phase": result.phase, "cachedPercentage": result.cached_percentage,
               "cached": f"{result.cached_percentage:g}%"}
    new_conditions = merge_conditions(status.get("conditions") or [], result.conditions)
    if any(status.get(k) != v for k, v in changes.items()) or new_conditions != status.get("conditions"):
        patch.status.update(changes, conditions=new_conditions)
        if result.phase != status.get("phase"):
            (kopf.info if result.phase == "Ready" else kopf.warn)(
                body, reason=result.phase, message=f"{result.cached_percentage:g}% of the plan is cached")
    if result.phase == "Ready":
        release_pods(meta["namespace"], meta["name"], status.get("targetNodes") or [])


def release_pods(namespace: str, cache: str, nodes: list[str]) -> int:
    released = 0
    for pod in kube().gated_pods(namespace, cache, GATE, CACHE_ANNOTATION):
        patch = gate_release_patch(pod, GATE, nodes)
        if patch is not None:
            kube().patch_pod(namespace, pod["metadata"]["name"], patch)
            log.info("released pod %s/%s onto %s", namespace, pod["metadata"]["name"], ", ".join(nodes))
            released += 1
    return released


def _gated(spec, **_) -> bool:
    return any(g.get("name") == GATE for g in (spec.get("schedulingGates") or []))


@kopf.on.event("", "v1", "pods", annotations={CACHE_ANNOTATION: kopf.PRESENT}, when=_gated)
def gated_pod(type, namespace, annotations, **_) -> None:
    """A gated pod that arrives after its cache is Ready is released at once (an event handler,
    so kopf keeps no bookkeeping on users' pods)."""
    if type == "DELETED":
        return
    cache = kube().cache(namespace, annotations[CACHE_ANNOTATION])
    if cache and (cache.get("status") or {}).get("phase") == "Ready":
        release_pods(namespace, cache["metadata"]["name"], cache["status"].get("targetNodes") or [])


@kopf.timer(GROUP, VERSION, PLURAL, interval=60, initial_delay=60, idle=30)
def replan_on_node_changes(spec, status, meta, namespace, name, patch, **_) -> None:
    """New or lost matching nodes: re-size and re-target without listing the dataset again; hand
    rotated credentials over (the agents pass them to the running mounts)."""
    if status.get("phase") in (None, "Pending", "Failed", "Sizing") or status.get("observedGeneration") != meta.get("generation"):
        return
    refresh_handover(dict(spec), namespace, name)
    nodes = target_nodes(dict(spec.get("nodeSelector") or {}), kube().nodes())
    if [n.name for n in nodes] == list(status.get("targetNodes") or []):
        return
    try:
        sizing = size_cache(dict(spec), int(status.get("datasetBytes", 0)), int(status.get("objectCount", 0)), nodes,
                            room_on(nodes, namespace, name), NODE_CACHE_MEMORY or 0)
    except NoRoom as exc:  # a new node is full of other caches: keep the current nodes
        log.warning("%s/%s: not re-targeted: %s", namespace, name, exc)
        return
    except SpecProblem as exc:
        patch.status.update(phase="Degraded", conditions=merge_conditions(
            status.get("conditions") or [], {"Ready": ("False", "NoNodes", str(exc))}))
        return
    patch.status.update(targetNodes=[n.name for n in nodes], cacheBytesPerNode=sizing.cache_bytes_per_node,
                        warmableBytes=sizing.warmable_bytes)


@kopf.on.delete(GROUP, VERSION, PLURAL)
def release(status, body, namespace, name, retry, **_) -> None:
    """Wait until every node agent has given its memory back (each removes its entry from status.nodes),
    then delete the handover."""
    holding = sorted((status.get("nodes") or {}).keys())
    if holding and retry < RELEASE_WAIT_RETRIES:
        raise kopf.TemporaryError(f"waiting for {', '.join(holding)} to release their caches", delay=2)
    if holding:
        kopf.warn(body, reason="ReleaseTimeout", message=f"nodes did not confirm the release: {', '.join(holding)}")
    kube().delete_secret(HANDOVER_NAMESPACE, handover_name(namespace, name))

