"""The node side of DatasetCaches (pull): runs inside the CSI node plugin (`stoker csi --warm-agent`).

It watches DatasetCaches, and for each one planned onto its node it holds the volume's mount with
the planned cache budget (VolumeManager.hold), warms it through the mount's control socket, and
writes its own entry `status.nodes.<node>` only. Pull scales with the cluster (one watch per node,
no operator fan-out) and survives operator restarts; a restarted agent re-warms over a cache that
is already warm, which costs no GETs.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time

from fusecore import control

from .handover import handover_name, read_handover
from .kube import Kube, NotFoundInCluster, load_config
from .plan import READY_AT, current_report, node_should_warm, timestamp

log = logging.getLogger(__name__)
REPORT_EVERY = 2.0  # seconds between progress patches while warming
RECHECK_EVERY = 30.0  # seconds between KeepWarm checks of a warm cache


def _plan_of(obj: dict) -> tuple:
    """What, if it changes, makes a worker start over at once."""
    status, spec = obj.get("status") or {}, obj.get("spec") or {}
    return (status.get("plan"), status.get("volume"), status.get("cacheBytesPerNode"), spec.get("paths"),
            spec.get("policy"))


def _key(obj: dict) -> str:
    return f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"


class CacheWorker:
    """Keeps one DatasetCache warm on this node, in its own thread."""

    def __init__(self, agent: "WarmAgent", obj: dict):
        self.agent = agent
        self.key = _key(obj)
        self.obj = obj
        self.changed = threading.Event()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"warm {self.key}", daemon=True)
        self._last_report = 0.0
        self.held: str | None = None  # the volume this worker holds (released by id, not by what status says)

    def update(self, obj: dict) -> None:
        replanned = _plan_of(obj) != _plan_of(self.obj)
        self.obj = obj
        if replanned:
            self.changed.set()

    def stop(self) -> None:
        self.stopped.set()
        self.changed.set()

    def _run(self) -> None:
        while not self.stopped.is_set():
            self.changed.clear()
            try:
                self._keep_warm()
            except Exception as exc:  # noqa: BLE001 - report, then retry after a pause
                log.warning("%s: %s", self.key, exc)
                self._report({"phase": "Failed", "message": str(exc)}, force=True)
            self.changed.wait(self.agent.recheck)

    def _keep_warm(self) -> None:
        status = self.obj.get("status") or {}
        spec = self.obj.get("spec") or {}
        meta = self.obj["metadata"]
        try:
            data, annotations = self.agent.kube.secret(self.agent.handover_namespace,
                                                       handover_name(meta["namespace"], meta["name"]))
        except NotFoundInCluster:
            raise RuntimeError("the operator has not handed over this DatasetCache's volume yet") from None
        handover = read_handover(meta["namespace"], meta["name"], data, annotations)
        goal = int(status.get("warmableBytes") or status.get("datasetBytes") or 0)
        if self.held is not None and self.held != handover.volume_id:
            self.agent.volumes.release(self.held, self.key)
        sock = self.agent.volumes.hold(handover.volume_id, handover.attributes, handover.secrets, self.key,
                                       int(status["cacheBytesPerNode"]))
        self.held = handover.volume_id
        cached = control.call(sock, {"op": "stats"})["cache"]["bytes"]
        mine = current_report(status, self.agent.node)  # a report about an earlier plan counts as none
        if not node_should_warm(spec.get("policy", "Once"), mine, cached, goal):
            evicted = cached < READY_AT * goal  # policy Once: say so, do not fetch again
            if mine and (evicted or abs(int(mine.get("cachedBytes", 0)) - cached) > 0.02 * max(goal, 1)):
                self._report(dict(mine, cachedBytes=cached, phase="Evicted" if evicted else mine["phase"],
                                  message="evicted from the cache; policy Once does not re-warm" if evicted
                                  else mine.get("message", "")), force=True)
            return
        self._report({"phase": "Warming", "warmedBytes": 0, "cachedBytes": cached, "message": "warming"}, force=True)
        final = None
        for progress in control.request(sock, {"op": "warm", "paths": list(spec.get("paths") or [])}, timeout=None):
            final = progress
            if self.stopped.is_set():
                return
            self._report({"phase": "Warming", "warmedBytes": progress["bytes_done"], "cachedBytes": cached,
                          "filesWarmed": progress["files_done"],
                          "message": f"{progress['files_done']} of {progress['files_total']} files"})
        stats = control.call(sock, {"op": "stats"})["cache"]
        errors = int(final["errors"]) if final else 1
        skipped = f"; {final['skipped_files']} files did not fit the cache" if final and final["skipped_files"] else ""
        ok = errors == 0 and final is not None and final["bytes_done"] >= READY_AT * final["bytes_total"]
        self._report({"phase": "Ready" if ok else "Failed", "warmedBytes": final["bytes_done"] if final else 0,
                      "cachedBytes": stats["bytes"], "filesWarmed": final["files_done"] if final else 0,
                      "message": (f"warm in {final.get('seconds', 0)}s{skipped}" if ok
                                  else f"{errors} files could not be read{skipped}")}, force=True)
        log.info("%s: warmed %d bytes on %s", self.key, final["bytes_done"] if final else 0, self.agent.node)

    def _report(self, entry: dict, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_report < REPORT_EVERY:
            return
        self._last_report = now
        meta = self.obj["metadata"]
        plan = (self.obj.get("status") or {}).get("plan")
        report = dict(entry, updated=timestamp(), **({"plan": plan} if plan else {}))
        self.agent.kube.patch_cache_status(meta["namespace"], meta["name"], {"nodes": {self.agent.node: report}})

    def release(self, *, report: bool) -> None:
        """Give the memory back; remove this node's entry (that is what the operator's finalizer waits for)."""
        self.agent.volumes.release_holder(self.key)  # whatever it holds, even from before a restart
        self.held = None
        if report:
            meta = self.obj["metadata"]
            self.agent.kube.patch_cache_status(meta["namespace"], meta["name"], {"nodes": {self.agent.node: None}})


class WarmAgent:
    def __init__(self, volumes, node: str, kube: Kube, recheck: float = RECHECK_EVERY,
                 handover_namespace: str = "stoker-system"):
        self.volumes = volumes
        self.handover_namespace = handover_namespace
        self.recheck = recheck
        self.node = node
        self.kube = kube
        self.workers: dict[str, CacheWorker] = {}

    def wanted_here(self, obj: dict) -> bool:
        status = obj.get("status") or {}
        return (not obj["metadata"].get("deletionTimestamp") and self.node in (status.get("targetNodes") or [])
                and bool(status.get("volume")) and bool(status.get("cacheBytesPerNode"))
                and status.get("observedGeneration") == obj["metadata"].get("generation"))

    def observe(self, event_type: str, obj: dict) -> None:
        key = _key(obj)
        worker = self.workers.get(key)
        if event_type != "DELETED" and self.wanted_here(obj):
            if worker is None:
                worker = self.workers[key] = CacheWorker(self, obj)
                worker.thread.start()
            else:
                worker.update(obj)
            return
        if obj["metadata"].get("deletionTimestamp") is None and event_type != "DELETED" and \
                self.node in (obj.get("status") or {}).get("targetNodes", []):
            return  # planned here but being re-planned: keep what is warm until the plan lands
        mine = self.node in ((obj.get("status") or {}).get("nodes") or {})
        if worker is not None:
            worker.stop()
            worker.thread.join(30)
            del self.workers[key]
            worker.obj = obj
            worker.release(report=mine and event_type != "DELETED")
        elif mine and event_type != "DELETED":
            CacheWorker(self, obj).release(report=True)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                items, version = self.kube.caches()
                for obj in items:
                    self.observe("ADDED", obj)
                for event in self.kube.watch_caches(version, timeout=60):
                    self.observe(event["type"], event["object"])
                    if stop.is_set():
                        break
            except Exception as exc:  # noqa: BLE001 - the API may be briefly away; list and watch again
                log.warning("watching DatasetCaches: %s", exc)
                stop.wait(2)
        for worker in self.workers.values():
            worker.stop()


def extend_csi(parser: argparse.ArgumentParser) -> None:
    """Add `--warm-agent` to `stoker csi`: the agent runs beside the node service, sharing its volumes."""
    parser.add_argument("--warm-agent", action="store_true",
                        help="warm DatasetCaches planned onto this node (needs Kubernetes API access)")
    parser.add_argument("--handover-namespace", default=os.environ.get("POD_NAMESPACE", "stoker-system"),
                        help="where the operator hands over DatasetCache volumes (the release namespace)")
    parser.add_argument("--warm-recheck", type=float, default=RECHECK_EVERY,
                        help=f"seconds between checks that a warm cache is still warm (default {RECHECK_EVERY:g})")
    previous = parser.get_default("node_extensions") or []

    def start(args: argparse.Namespace, volumes, stop: threading.Event) -> None:
        if not getattr(args, "warm_agent", False):
            return
        load_config()
        agent = WarmAgent(volumes, args.node_id, Kube(), recheck=args.warm_recheck,
                          handover_namespace=args.handover_namespace)
        threading.Thread(target=agent.run, args=(stop,), name="warm-agent", daemon=True).start()
        log.info("warm agent watching DatasetCaches for node %s", args.node_id)

    parser.set_defaults(node_extensions=[*previous, start])

