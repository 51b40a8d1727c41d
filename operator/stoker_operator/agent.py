"""The node side of DatasetCaches (pull): runs inside the CSI node plugin (`stoker csi --warm-agent`).

It lists and watches the DatasetCacheNodes of its own node only (label selector, release namespace),
and for each it holds the volume's mount with the planned cache budget (VolumeManager.hold), warms it
through the mount's control socket, and writes that object's status. What an agent receives does not
grow with the cluster or with other nodes' progress; it reports at most every `report_every` seconds
while warming, and at each change of phase. A DatasetCacheNode being deleted is released (memory
back), then its finalizer removed. A restarted agent re-warms over a cache that is already warm,
which costs no GETs, and releases what it held for objects that are gone.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time

from fusecore.process import control
from fusecore.messages import JoinRequest
from fusecore.cluster.router import PeerRouter

from .handover import handover_name, read_handover
from .kube import Kube, NotFoundInCluster, load_config
from .members import Membership, PeerPort
from .nodes import FINALIZER, NodePlan, NotANodePlan, cache_id, cache_selector, node_selector, plan_of, release_patch
from .plan import READY_AT, node_should_warm, timestamp

log = logging.getLogger(__name__)
REPORT_EVERY = 10.0  # seconds between progress reports while warming (phase changes are reported at once)
RECHECK_EVERY = 30.0  # seconds between KeepWarm checks of a warm cache
PEER_PORT = 7470  # the node plugin's peer port (chart value node.peerPort)
JOIN_WAIT = 60.0  # seconds a node waits for every planned node to publish its peer address before it warms
NO_PEER_PORT = ("this node serves no peer port (the node plugin runs with --peer-port 0, or without its pod's "
                "address): a distributed DatasetCache needs node.peerPort")


class CacheWorker:
    """Keeps one DatasetCacheNode's plan warm on this node, in its own thread."""

    def __init__(self, agent: "WarmAgent", obj: dict, plan: NodePlan):
        self.agent = agent
        self.name = obj["metadata"]["name"]
        self.plan = plan
        self.key = plan.cache  # the holder's name in the volume records
        self.report = dict(obj.get("status") or {})
        self.changed = threading.Event()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"warm {self.key}", daemon=True)
        self._last_report = 0.0
        self.held: str | None = None  # the volume this worker holds (released by id)
        self.membership: Membership | None = None  # a distributed cache's members, watched while it is planned
        self.joined: tuple | None = None  # (members, replicas) the mount was last told
        self.warmed_for: tuple | None = None  # the membership the last complete warm was for
        self.owned_bytes = 0  # what this node owns of the dataset, as its last warm counted it
        self._waiting_since: float | None = None
        self.share = 0.0  # the part of the dataset's blocks this node owns (the mount's answer to join)
        self.retry_in: float | None = None  # seconds to the next pass when sooner than the recheck

    def update(self, obj: dict, plan: NodePlan) -> None:
        self.report = dict(obj.get("status") or {})
        if plan != self.plan:
            self.plan = plan
            self.changed.set()

    def stop(self) -> None:
        self.stopped.set()
        self.changed.set()
        if self.membership is not None:
            self.membership.stopped.set()

    def _run(self) -> None:
        while not self.stopped.is_set():
            self.changed.clear()
            self.retry_in = None
            try:
                self._keep_warm()
            except Exception as exc:  # noqa: BLE001 - report, then retry after a pause
                log.warning("%s: %s", self.key, exc)
                self._report({"phase": "Failed", "message": str(exc)}, force=True)
            self.changed.wait(self.retry_in or self.agent.recheck)

    def _current(self) -> dict | None:
        """This node's last report, if it is about the plan now asked for."""
        return self.report if self.report and self.report.get("plan") == self.plan.plan else None

    def _keep_warm(self) -> None:
        plan = self.plan
        if plan.replicas and self.agent.peers is None:
            raise RuntimeError(NO_PEER_PORT)
        try:
            data, annotations = self.agent.kube.secret(self.agent.handover_namespace,
                                                       handover_name(plan.cache_namespace, plan.cache_name))
        except NotFoundInCluster:
            raise RuntimeError("the operator has not handed over this DatasetCache's volume yet") from None
        handover = read_handover(plan.cache_namespace, plan.cache_name, data, annotations)
        goal = plan.warmable_bytes
        if self.held is not None and self.held != handover.volume_id:
            self.agent.volumes.release(self.held, self.key)
        if not plan.replicas and self.membership is not None:  # no longer distributed: stop watching its members
            self.membership.stopped.set()
            self.membership = None
        if plan.replicas and not handover.peer_key:
            raise RuntimeError("the operator has not handed over this DatasetCache's peer key yet")
        sock = self.agent.volumes.hold(handover.volume_id, handover.attributes, handover.secrets, self.key,
                                       plan.cache_bytes)
        self.held = handover.volume_id
        membership_changed = False
        if plan.replicas:
            joined = self._join(sock, handover.volume_id, bytes.fromhex(handover.peer_key or ""))
            if joined is None:
                return  # waiting for the other nodes to publish their addresses
            membership_changed = joined != self.warmed_for
            goal = self.owned_bytes or goal
        now = control.stats(sock)
        cached = now.held_bytes  # memory, or the disk tier where it holds more
        if plan.policy == "OnDemand":
            return self._on_demand(cached, goal, membership_changed)
        mine = self._current()  # a report about an earlier plan counts as none
        if not membership_changed and not node_should_warm(plan.policy, mine, cached, goal):
            evicted = cached < READY_AT * goal  # policy Once: say so, do not fetch again
            if mine and (evicted or abs(int(mine.get("cachedBytes", 0)) - cached) > 0.02 * max(goal, 1)):
                self._report(dict(mine, cachedBytes=cached, heldOn=now.held_on,
                                  phase="Evicted" if evicted else mine["phase"],
                                  message="evicted from the cache; policy Once does not re-warm" if evicted
                                  else mine.get("message", "")), force=True)
            return
        self._report({"phase": "Warming", "warmedBytes": 0, "cachedBytes": cached, "message": "warming"}, force=True)
        final = None
        for progress in control.warm(sock, list(plan.paths)):
            final = progress
            if self.stopped.is_set() or self.changed.is_set():
                return  # released, or re-planned: start over with the new plan
            self._report({"phase": "Warming", "warmedBytes": progress.bytes_done, "cachedBytes": cached,
                          "filesWarmed": progress.files_done,
                          "message": f"{progress.files_done} of {progress.files_total} files"})
        after = control.stats(sock)
        cached = after.held_bytes
        if final is None or not final.done:
            raise RuntimeError("the mount ended the warm without a result")
        skipped = f"; {final.skipped_files} files did not fit the cache" if final.skipped_files else ""
        ok = final.errors == 0 and final.bytes_done >= READY_AT * final.bytes_total
        if plan.replicas:
            self.owned_bytes = final.bytes_total
            self.warmed_for = self.joined
        self._report({"phase": "Ready" if ok else "Failed", "warmedBytes": final.bytes_done, "cachedBytes": cached,
                      "filesWarmed": final.files_done, "heldOn": after.held_on,
                      "message": (f"warm in {final.seconds}s{skipped}" if ok
                                  else f"{final.errors} files could not be read{skipped}")}, force=True)
        log.info("%s: warmed %d bytes on %s", self.key, final.bytes_done, self.agent.node)

    def _on_demand(self, cached: int, goal: int, membership_changed: bool) -> None:
        """Policy OnDemand: nothing is warmed. The node is Ready once its mount serves the volume (a distributed
        cache's member once it joined: its owners read through for the others), and the cache fills as training
        reads; later reports follow what it holds."""
        if self.plan.replicas:
            self.warmed_for = self.joined
        mine = self._current()
        if mine and mine.get("phase") == "Ready" and not membership_changed \
                and abs(int(mine.get("cachedBytes", 0)) - cached) <= 0.02 * max(goal, 1):
            return
        self._report({"phase": "Ready", "cachedBytes": cached,
                      "message": "serving; the cache fills as training reads (policy OnDemand)"}, force=True)

    def _join(self, sock: str, volume_id: str, key: bytes) -> tuple | None:
        """Publish this node's peer address, and once every planned node published its own (or JOIN_WAIT
        passed), tell the mount its members; None while waiting. Returns the membership the mount has."""
        peers = self.agent.peers
        assert peers is not None
        if self.membership is None:
            self.membership = Membership(self.agent.kube, self.agent.handover_namespace,
                                         cache_selector(self.plan.cache_namespace, self.plan.cache_name),
                                         self.changed.set)
            threading.Thread(target=self.membership.run, name=f"members {self.key}", daemon=True).start()
        if self.report.get("peer") != peers.address:
            self._report({"phase": "Pending", "message": "joining the distributed cache"}, force=True)
        self.membership.listed.wait(10)
        members, objects = self.membership.current()
        members = sorted(set(members) | {peers.address})
        planned = max(objects, self.plan.nodes)  # the operator may not have made every node's object yet
        now = time.monotonic()
        if len(members) < planned:
            self._waiting_since = self._waiting_since or now
            if now - self._waiting_since < self.agent.join_wait:
                if self.joined is None:  # a member already serves with the members it has while a newcomer joins
                    message = (f"{len(members)} of {planned} nodes joined; waiting for the others before warming "
                               f"this node's share")
                    self._report({"phase": "Pending", "message": message},
                                 force=message != self.report.get("message"))
                self.retry_in = min(5.0, self.agent.join_wait)  # a member's arrival ends the wait earlier
                return None
        self._waiting_since = None
        replicas = min(self.plan.replicas, len(members))
        name = cache_id(self.plan.cache_namespace, self.plan.cache_name)
        handoff = self.agent.volumes.peer_socket(volume_id)
        answer = control.join(sock, JoinRequest(name, peers.address, tuple(members), replicas, key, handoff))
        if (tuple(members), replicas) != self.joined:
            log.info("%s: joined with %d member(s) %s, %d replica(s), of %d planned; this node's share %s",
                     self.key, len(members), ", ".join(members), replicas, planned, answer.get("share"))
        peers.route(name, handoff)
        self.joined = (tuple(members), replicas)
        self.share = float(answer.get("share", 0.0))
        return self.joined

    def _report(self, entry: dict, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_report < self.agent.report_every * (
                self.membership.spread() if self.membership else 1.0):
            return
        self._last_report = now
        report = {"warmedBytes": 0, "cachedBytes": 0, "filesWarmed": 0, **entry, "updated": timestamp(),
                  "plan": self.plan.plan}
        if self.plan.replicas and self.agent.peers is not None:
            report["peer"] = self.agent.peers.address
            if self.joined is not None:
                report["share"] = f"{self.share:.1%}"
            if self.owned_bytes:
                report["shareBytes"] = self.owned_bytes
        self.agent.kube.patch_node_status(self.agent.handover_namespace, self.name, report)
        self.report = report

    def release(self) -> None:
        """Give the memory back, whatever this holder holds (even from before a restart)."""
        if self.plan.replicas and self.agent.peers is not None:
            self.agent.peers.unroute(cache_id(self.plan.cache_namespace, self.plan.cache_name))
        self.agent.volumes.release_holder(self.key)
        self.held = None


class WarmAgent:
    def __init__(self, volumes, node: str, kube: Kube, recheck: float = RECHECK_EVERY,
                 handover_namespace: str = "stoker-system", report_every: float = REPORT_EVERY,
                 peers: PeerPort | None = None, join_wait: float = JOIN_WAIT):
        self.peers = peers  # None: distributed caches are refused on this node
        self.join_wait = join_wait
        self.volumes = volumes
        self.handover_namespace = handover_namespace
        self.recheck = recheck
        self.report_every = report_every
        self.node = node
        self.kube = kube
        self.workers: dict[str, CacheWorker] = {}  # by DatasetCacheNode name

    def _plan(self, obj: dict) -> NodePlan | None:
        try:
            plan = plan_of(obj)
        except NotANodePlan as exc:
            log.warning("%s", exc)
            return None
        if plan.node != self.node:  # labelled for this node but planned for another: not ours to act on
            log.warning("DatasetCacheNode %s is for node %s, not %s", obj["metadata"]["name"], plan.node, self.node)
            return None
        return plan

    def observe(self, event_type: str, obj: dict) -> None:
        name = obj["metadata"]["name"]
        worker = self.workers.get(name)
        plan = self._plan(obj)
        if plan is None and worker is None:
            return  # malformed, or another node's: nothing of it is ours to hold, release or patch
        if event_type != "DELETED" and not obj["metadata"].get("deletionTimestamp") and plan is not None:
            if worker is None:
                worker = self.workers[name] = CacheWorker(self, obj, plan)
                worker.thread.start()
            else:
                worker.update(obj, plan)
            return
        if worker is not None:
            self._retire(name)
        elif plan is not None:
            self.volumes.release_holder(plan.cache)
        if event_type != "DELETED" and FINALIZER in (obj["metadata"].get("finalizers") or []):
            self.kube.patch_node_object(self.handover_namespace, name, release_patch(obj["metadata"]["finalizers"]))

    def _retire(self, name: str) -> None:
        """Stop the worker of DatasetCacheNode `name` and give its memory back."""
        worker = self.workers.pop(name)
        worker.stop()
        worker.thread.join(30)
        worker.release()

    def reconcile(self, items: list[dict]) -> None:
        """After a (re-)list: objects that are gone were deleted while this agent was away."""
        present = {obj["metadata"]["name"] for obj in items}
        for name in [n for n in self.workers if n not in present]:
            self._retire(name)
        planned = {p.cache for obj in items if (p := self._plan(obj)) is not None}
        for holder in self.volumes.holders() - planned:
            log.info("releasing %s: its DatasetCacheNode is gone", holder)
            self.volumes.release_holder(holder)
        for obj in items:
            self.observe("ADDED", obj)

    def run(self, stop: threading.Event) -> None:
        selector = node_selector(self.node)
        while not stop.is_set():
            try:
                items, version = self.kube.node_objects(self.handover_namespace, selector)
                self.reconcile(items)
                for event in self.kube.watch_node_objects(self.handover_namespace, selector, version, timeout=60):
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self.observe(event["type"], event["object"])
                    if stop.is_set():
                        break
            except Exception as exc:  # noqa: BLE001 - the API may be briefly away; list and watch again
                log.warning("watching DatasetCacheNodes: %s", exc)
                stop.wait(2)
        for worker in self.workers.values():
            worker.stop()


class WarmAgentExtension:
    """`stoker csi --warm-agent`: the agent runs beside the node service, sharing its volumes
    (a csi.server.NodeExtension, composed in by stoker/cli.py)."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--warm-agent", action="store_true",
                            help="warm DatasetCaches planned onto this node (needs Kubernetes API access)")
        parser.add_argument("--handover-namespace", default=os.environ.get("POD_NAMESPACE", "stoker-system"),
                            help="where the operator hands over DatasetCache volumes (the release namespace)")
        parser.add_argument("--warm-recheck", type=_seconds, default=RECHECK_EVERY,
                            help=f"seconds between checks that a warm cache is still warm (default {RECHECK_EVERY:g})")
        parser.add_argument("--warm-report-interval", type=_seconds, default=REPORT_EVERY,
                            help=f"seconds between progress reports while warming (default {REPORT_EVERY:g})")
        parser.add_argument("--peer-port", type=_port, default=PEER_PORT,
                            help=f"the port this node serves distributed DatasetCaches' blocks to the other nodes "
                                 f"on, for every cache of the node (default {PEER_PORT}; 0: none)")
        parser.add_argument("--peer-address", default=os.environ.get("POD_IP", ""),
                            help="the address the other nodes reach this node plugin on (default: $POD_IP)")
        parser.add_argument("--join-wait", type=_seconds, default=JOIN_WAIT,
                            help=f"seconds a node waits for every planned node of a distributed cache to join "
                                 f"before it warms its share (default {JOIN_WAIT:g})")

    def start(self, args: argparse.Namespace, volumes, stop: threading.Event) -> None:
        if not args.warm_agent:
            return
        load_config()
        peers = None
        if args.peer_port and args.peer_address:
            address = _member(args.peer_address, args.peer_port)
            try:
                peers = PeerPort(address, PeerRouter((args.peer_address, args.peer_port)).start())
                log.info("serving distributed caches' blocks on %s", address)
            except OSError as exc:  # the node plugin still serves volumes; distributed caches say why they cannot
                log.error("cannot serve distributed caches' blocks on %s (%s): they fail on this node", address,
                          exc.strerror or exc)
        agent = WarmAgent(volumes, args.node_id, Kube(), recheck=args.warm_recheck,
                          handover_namespace=args.handover_namespace, report_every=args.warm_report_interval,
                          peers=peers, join_wait=args.join_wait)
        threading.Thread(target=agent.run, args=(stop,), name="warm-agent", daemon=True).start()
        log.info("warm agent watching the DatasetCacheNodes of node %s", args.node_id)


def _member(address: str, port: int) -> str:
    """HOST:PORT as the members name each other (an IPv6 address in brackets)."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be between 0 and 65535 (got {text})")
    return value


def _seconds(text: str) -> float:
    """A positive number of seconds (0 would re-check or report in a busy loop)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < value <= 86400:
        raise argparse.ArgumentTypeError(f"must be between 0 and 86400 seconds (got {text})")
    return value
