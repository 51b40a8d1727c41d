"""The operator at cluster scale: one DatasetCache over N simulated nodes, against the Kubernetes API
faked at its HTTP boundary (fakekube.py), with the real `stoker operator` process.

A few nodes run the real warm agent (agent.WarmAgent: list + watch of its own node's objects, status
reports), with the mount faked at its control socket; the others act as agents do towards the API
(the same Kube calls: one list, reports while warming, the finalizer on release) from a thread pool,
and what a watch would deliver to each of them is counted from the API's event log with the agent's
own label selector. Reported: planning time, object sizes, requests, status writes, events per agent.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from stoker_operator.kube import Kube
from stoker_operator.nodes import FINALIZER, NODE_LABEL, cache_selector, node_selector, object_name, release_patch

from fusecore.process.launch import stop_process

from .fakekube import FakeKube, _selector_matches
from .fakemount import FakeMountControl
from .fixture import StoreProcess

NAMESPACE, RELEASE_NS, CACHE = "ml", "stoker-system", "imagenet"
API = "stoker.dev/v1alpha1"
REAL_AGENTS = 8  # nodes that run the real warm agent (threads and watches of their own)
DATASET = {f"train/{i:04d}.jpg": 100_000 + i for i in range(200)}


@dataclass
class ScaleResult:
    nodes: int
    plan_seconds: float  # DatasetCache created -> every DatasetCacheNode exists and status.plan is set
    ready_seconds: float  # last node report sent -> the DatasetCache says Ready
    release_seconds: float  # DatasetCache deleted -> it and its DatasetCacheNodes are gone
    cache_object_bytes: int  # the DatasetCache as stored, once Ready
    node_object_bytes: int  # the largest DatasetCacheNode
    requests: int  # API requests during the run (planning to Ready)
    requests_per_second: float
    cache_status_writes: int  # PATCHes of the DatasetCache's status while the nodes reported
    reports: int  # status PATCHes the nodes sent
    events_per_agent_watched: int  # most events a real agent's watch received
    events_per_agent_max: int  # most events any node's selector matched (what its watch would deliver)
    operator_cpu_seconds: float
    operator_rss_mib: float

    def row(self) -> dict:
        return asdict(self)


class FakeVolumes:
    """VolumeManager's hold/release seam for the real agents."""

    def __init__(self, sock: str):
        self.sock = sock
        self.held: dict[str, str] = {}

    def hold(self, volume_id, attributes, secrets, holder, cache_size) -> str:
        self.held[holder] = volume_id
        return self.sock

    def release(self, volume_id, holder) -> None:
        self.held.pop(holder, None)

    def release_holder(self, holder) -> None:
        self.held.pop(holder, None)

    def holders(self) -> set[str]:
        return set(self.held)


def _proc_stats(pid: int) -> tuple[float, float]:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return cpu, rss / 1024


def _setup(kube: FakeKube, nodes: int) -> None:
    """Namespaces, the source's Secret and `nodes` Ready GPU nodes."""
    from stoker_operator import crd

    for plural in ("datasetcaches", "datasetcachenodes"):
        kube.schemas[plural] = crd.schema(plural)
    for ns in (NAMESPACE, RELEASE_NS):
        kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    creds = {"accessKeyId": "AKIASIMULATED", "secretAccessKey": "simulated-secret"}
    kube.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "creds", "namespace": NAMESPACE},
                 "data": {k: base64.b64encode(v.encode()).decode() for k, v in creds.items()}})
    for i in range(nodes):
        name = f"gpu-{i:05d}"
        kube.create({"apiVersion": "v1", "kind": "Node",
                     "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "pool": "gpu"}},
                     "spec": {}, "status": {"allocatable": {"memory": "512Gi", "cpu": "96"},
                                            "conditions": [{"type": "Ready", "status": "True"}]}})


def _cache(endpoint: str) -> dict:
    return {"apiVersion": API, "kind": "DatasetCache", "metadata": {"name": CACHE, "namespace": NAMESPACE},
            "spec": {"source": {"s3": {"bucket": "data", "prefix": "train", "endpointUrl": endpoint,
                                       "region": "us-east-1", "secretRef": {"name": "creds"}}},
                     "nodeSelector": {"pool": "gpu"}, "cacheSize": "1Gi", "policy": "Once"}}


def _simulated_agent(client: Kube, node: str, plan: str, total: int) -> int:
    """What an agent sends the API for one plan: its list, then Warming, progress and Ready reports."""
    items, _ = client.node_objects(RELEASE_NS, node_selector(node))
    for obj in items:
        name = obj["metadata"]["name"]
        for phase, done in (("Warming", 0), ("Warming", total // 2), ("Ready", total)):
            client.patch_node_status(RELEASE_NS, name, {"phase": phase, "warmedBytes": done, "cachedBytes": done,
                                                        "filesWarmed": 0, "message": "simulated", "plan": plan,
                                                        "updated": "2026-12-02T00:00:00Z"})
    return 3 * len(items)


def run(nodes: int, *, workdir: str | None = None, log=lambda line: None, timeout: float = 600) -> ScaleResult:
    """One DatasetCache over `nodes` simulated nodes: plan, warm, report, Ready, delete."""
    from kubernetes import config as kube_config
    from stoker_operator.agent import WarmAgent

    workdir = workdir or tempfile.mkdtemp(prefix="stoker-operator-scale-")
    store = StoreProcess({"data": DATASET}, latency=0.0, bandwidth=1e12, workdir=workdir).start()
    total = sum(DATASET.values())
    operator = None
    stop = threading.Event()
    try:
        with FakeKube() as kube:
            kubeconfig = kube.kubeconfig(os.path.join(workdir, "kubeconfig"))
            _setup(kube, nodes)
            env = dict(os.environ, KUBECONFIG=kubeconfig, POD_NAMESPACE=RELEASE_NS)
            oplog = open(os.path.join(workdir, "operator.log"), "wb")
            operator = subprocess.Popen([sys.executable, "-m", "stoker", "operator", "--liveness", ""],
                                        stdout=oplog, stderr=oplog, env=env)
            kube_config.load_kube_config(kubeconfig)
            client = Kube()
            real = [f"gpu-{i:05d}" for i in range(min(REAL_AGENTS, nodes))]
            mount = FakeMountControl(os.path.join(workdir, "mount.sock"), 1 << 30, warm_bytes=total,
                                     warm_files=len(DATASET))
            for node in real:
                agent = WarmAgent(FakeVolumes(mount.path), node, client, recheck=5, handover_namespace=RELEASE_NS)
                threading.Thread(target=agent.run, args=(stop,), daemon=True).start()
            time.sleep(1)  # let kopf list before the cache appears (as an operator that has been running)
            requests_before = len(kube.requests)
            started = time.monotonic()
            kube.create(_cache(store.endpoint))

            def status() -> dict:
                return (kube.get(API, "datasetcaches", CACHE, NAMESPACE) or {}).get("status") or {}

            def planned() -> bool:
                return bool(status().get("plan")) and len(kube.list(API, "datasetcachenodes", RELEASE_NS)) == nodes

            if not kube.wait_for(planned, timeout, interval=0.2):
                raise RuntimeError(f"not planned: {status()}; see {oplog.name}")
            plan_seconds = time.monotonic() - started
            log(f"{nodes} nodes: planned in {plan_seconds:.1f}s")
            plan = status()["plan"]
            simulated = [f"gpu-{i:05d}" for i in range(len(real), nodes)]
            writes_before = _status_writes(kube)
            with ThreadPoolExecutor(32) as pool:
                reports = sum(pool.map(lambda n: _simulated_agent(client, n, plan, total), simulated))
            reported = time.monotonic()
            if not kube.wait_for(lambda: status().get("phase") == "Ready", timeout, interval=0.2):
                raise RuntimeError(f"not Ready: {status().get('nodeSummary')}; see {oplog.name}")
            ready_seconds = time.monotonic() - reported
            log(f"{nodes} nodes: Ready {ready_seconds:.1f}s after the last report")
            elapsed = time.monotonic() - started
            requests = len(kube.requests) - requests_before
            cache_bytes = len(json.dumps(kube.get(API, "datasetcaches", CACHE, NAMESPACE)))
            node_bytes = max(len(json.dumps(o)) for o in kube.list(API, "datasetcachenodes", RELEASE_NS))
            writes = _status_writes(kube) - writes_before
            reports += sum(1 for method, path in kube.requests
                           if method == "PATCH" and "/datasetcachenodes/" in path and path.endswith("/status")
                           and any(f".{n}/" in path for n in real))
            watched = max((w["events"] for w in kube.watches if "/datasetcachenodes" in w["path"]
                           and w["labelSelector"]), default=0)
            deliverable = _max_events_per_selector(kube, nodes)
            cpu, rss = _proc_stats(operator.pid)
            released = time.monotonic()
            kube.delete(API, "datasetcaches", CACHE, NAMESPACE)
            _release_simulated(kube, client, simulated, timeout)
            if not kube.wait_for(lambda: kube.get(API, "datasetcaches", CACHE, NAMESPACE) is None
                                 and not kube.list(API, "datasetcachenodes", RELEASE_NS), timeout, interval=0.2):
                raise RuntimeError(f"not released; see {oplog.name}")
            release_seconds = time.monotonic() - released
            log(f"{nodes} nodes: released in {release_seconds:.1f}s")
            stop.set()
            return ScaleResult(nodes, round(plan_seconds, 2), round(ready_seconds, 2), round(release_seconds, 2),
                               cache_bytes, node_bytes, requests, round(requests / elapsed, 1), writes, reports,
                               watched, deliverable, round(cpu, 2), round(rss, 1))
    finally:
        stop.set()
        stop_process(operator, grace=20)
        store.stop()


def _status_writes(kube: FakeKube) -> int:
    return sum(1 for method, path in kube.requests
               if method == "PATCH" and path.split("?")[0].endswith(f"/datasetcaches/{CACHE}/status"))


def _max_events_per_selector(kube: FakeKube, nodes: int) -> int:
    """The most DatasetCacheNode events any one node's label selector matches: what its watch delivers."""
    events = kube._events.get((f"/apis/{API}", "datasetcachenodes"), [])
    counts = dict.fromkeys((f"gpu-{i:05d}" for i in range(nodes)), 0)
    for _, _, _, obj in events:
        labels = obj["metadata"].get("labels") or {}
        node = labels.get(NODE_LABEL)  # the simulated nodes' names are their label values
        if isinstance(node, str) and node in counts and _selector_matches(node_selector(node), labels):
            counts[node] += 1
    return max(counts.values(), default=0)


def _release_simulated(kube: FakeKube, client: Kube, simulated: list[str], timeout: float) -> None:
    """What each simulated agent does once its object is being deleted: give the memory back (nothing to do
    here) and remove the finalizer."""
    selector = cache_selector(NAMESPACE, CACHE)
    names = {object_name(NAMESPACE, CACHE, n) for n in simulated}
    deadline = time.monotonic() + timeout
    while names and time.monotonic() < deadline:
        items, _ = client.node_objects(RELEASE_NS, selector)
        deleting = [o["metadata"]["name"] for o in items
                    if o["metadata"]["name"] in names and o["metadata"].get("deletionTimestamp")]
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda name: client.patch_node_object(
                RELEASE_NS, name, release_patch([FINALIZER])),  # as an agent does
                deleting))
        names -= set(deleting)
        names &= {o["metadata"]["name"] for o in items}
        time.sleep(0.5)
