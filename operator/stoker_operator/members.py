"""A distributed DatasetCache seen from one node: its peer port, and who the other members are.

Each node's agent publishes where it serves blocks (its DatasetCacheNode's `status.peer`: the node plugin's
pod IP and peer port) and learns the others' from their DatasetCacheNodes, listed and watched by the
cache's label: what an agent receives grows with its cache's members, never with the cluster.
"""

from __future__ import annotations

import logging
import threading

from fusecore.cluster.router import PeerRouter

from .kube import Kube

log = logging.getLogger(__name__)

SPREAD_FROM = 100  # members from which a cache's progress reports are spread out (spread)


class Membership:
    """Who serves one distributed cache: its DatasetCacheNodes' `status.peer`, listed and watched by the
    cache's label (an agent's traffic grows with the cache's members, not with the cluster). `on_change`
    is called when the peers or the number of planned nodes change (progress reports do not)."""

    def __init__(self, kube: Kube, namespace: str, selector: str, on_change):
        self.kube, self.namespace, self.selector, self.on_change = kube, namespace, selector, on_change
        self._objects: dict[str, str] = {}  # DatasetCacheNode name -> its peer ("" before the node published it)
        self._lock = threading.Lock()
        self.listed = threading.Event()
        self.stopped = threading.Event()

    def current(self) -> tuple[list[str], int]:
        """(the peers published, the nodes planned)."""
        with self._lock:
            return sorted({p for p in self._objects.values() if p}), len(self._objects)

    def _apply(self, update) -> None:
        before = self.current()
        with self._lock:
            update(self._objects)
        if self.current() != before:
            self.on_change()

    def _observe(self, event_type: str, obj: dict) -> None:
        name = obj["metadata"]["name"]
        gone = event_type == "DELETED" or bool(obj["metadata"].get("deletionTimestamp"))
        peer = str((obj.get("status") or {}).get("peer") or "")
        self._apply(lambda objects: objects.pop(name, None) if gone else objects.__setitem__(name, peer))

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                items, version = self.kube.node_objects(self.namespace, self.selector)
                live = {o["metadata"]["name"]: str((o.get("status") or {}).get("peer") or "") for o in items
                        if not o["metadata"].get("deletionTimestamp")}
                self._apply(lambda objects: (objects.clear(), objects.update(live)))
                self.listed.set()
                for event in self.kube.watch_node_objects(self.namespace, self.selector, version, timeout=60):
                    if self.stopped.is_set():
                        return
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self._observe(event["type"], event["object"])
            except Exception as exc:  # noqa: BLE001 - the API may be briefly away; list and watch again
                log.warning("watching the members of %s: %s", self.selector, exc)
                self.stopped.wait(2)

    def spread(self) -> float:
        """How much less often a member reports warming progress: every member watches every other's reports,
        so a cache of N > SPREAD_FROM nodes reports N/SPREAD_FROM times less often (the API server's fan-out
        stays that of SPREAD_FROM nodes; phase changes are reported at once whatever N)."""
        return max(1.0, self.current()[1] / SPREAD_FROM)


class PeerPort:
    """This node's one peer address (HOST:PORT, the node plugin pod's), and the router behind it that hands
    each distributed cache's connections to the mount serving it."""

    def __init__(self, address: str, router: PeerRouter):
        self.address, self.router = address, router

    def route(self, cache: str, handoff: str) -> None:
        self.router.route(cache, handoff)

    def unroute(self, cache: str) -> None:
        self.router.unroute(cache)
