"""End to end on this machine: a DatasetCache for a moto bucket is planned by the real operator,
warmed by the warm agent in a real `stoker csi` node plugin into a real Stoker mount, and reaches
Ready with the right byte counts; a gated training pod is then released onto the warm node."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from csi.state import StateDir
from csi.volumes import kubelet_staging_path
from fusecore.process import control
from fusecore.process.mounts import is_mounted
from stoker_operator.handover import handover_name
from tests.conftest import requires_fuse
from tests.support.waiting import unmount_everything_under
from tests.csi.conftest import SECRETS, wait_until

from .conftest import (NAMESPACE, RELEASE_NS, add_cache, add_node, add_secret, add_stoker_pvc, cache, node_object,
                       node_report, status, wait_for_events)

pytestmark = [pytest.mark.integration, requires_fuse]


class NodePlugin:
    """A real `stoker csi` node plugin with the warm agent, for node `node` (its own directories under
    `tmp_path`; `extra` arguments, such as its peer address)."""

    def __init__(self, kube, tmp_path, node: str = "gpu-1", extra: tuple[str, ...] = ()):
        self.kube, self.tmp_path, self.node, self.extra = kube, tmp_path, node, extra
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.state = StateDir(str(tmp_path / "state"))
        self.kubelet_dir = str(tmp_path / "kubelet")
        self.proc = None

    def start(self) -> None:
        env = dict(os.environ, KUBECONFIG=self.kube.kubeconfig_path)
        with open(self.tmp_path / "csi.log", "ab") as logs:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "stoker", "csi", "--endpoint", f"unix://{self.tmp_path}/csi.sock",
                 "--node-id", self.node, "--state-dir", self.state.root, "--warm-agent", "--warm-recheck", "1",
                 "--health-interval", "1", "--kubelet-dir", self.kubelet_dir, "--secrets-dir",
                 str(self.tmp_path / "secrets"), "--disk-cache-root", str(self.tmp_path / "disk"),
                 "--node-disk-cache", "1GiB", *self.extra], stdout=logs, stderr=logs, env=env)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(15)

    def log(self) -> str:
        return (self.tmp_path / "csi.log").read_text()


@pytest.fixture
def node_plugin(kube, tmp_path, moto_server):
    plugin = NodePlugin(kube, tmp_path)
    plugin.start()
    yield plugin
    plugin.stop()
    unmount_everything_under(str(tmp_path))


def handover_reads(kube, cache_name: str) -> int:
    """How often DatasetCache `cache_name`'s handover Secret was read. A warm agent reads it at the start of each
    of its passes over the cache, one pass after another: once two more of its reads came, the pass the first
    began has ended. The operator reads it too when it refreshes the handover: on resume, and on its 60 s timer."""
    path = f"/api/v1/namespaces/{RELEASE_NS}/secrets/{handover_name(NAMESPACE, cache_name)}"
    return sum(1 for method, url in list(kube.requests) if method == "GET" and url.split("?")[0] == path)


def test_datasetcache_warms_a_real_mount_and_releases_the_gated_pod(kube, operator, node_plugin, moto_server,
                                                                     s3, bucket):
    files = {f"imagenet/train/{i:03d}.jpg": os.urandom(50_000 + 977 * i) for i in range(40)}
    files["imagenet/val/x.jpg"] = os.urandom(123_456)
    files["other/not-in-the-dataset.bin"] = os.urandom(10_000)
    for key, body in files.items():
        s3.put_object(Bucket=bucket, Key=key, Body=body)
    dataset = {k: v for k, v in files.items() if k.startswith("imagenet/")}
    add_node(kube, "gpu-1", labels={"pool": "gpu"})
    add_node(kube, "cpu-1", labels={"pool": "cpu"})
    add_secret(kube, "creds", SECRETS)
    add_stoker_pvc(kube, "imagenet", {"bucket": bucket, "prefix": "imagenet", "endpointUrl": moto_server.endpoint,
                                      "region": "us-east-1"})
    kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "trainer-0", "namespace": NAMESPACE, "annotations": {"stoker.dev/dataset-cache": "imagenet"}},
        "spec": {"schedulingGates": [{"name": "stoker.dev/dataset-warm"}, {"name": "other.io/quota"}],
                 "containers": [{"name": "train", "image": "pytorch"}]}})
    add_cache(kube, "imagenet", {"source": {"pvc": "imagenet"}, "nodeSelector": {"pool": "gpu"},
                                 "cacheSize": "auto", "policy": "KeepWarm"})

    ready = kube.wait_for(lambda: status(kube, "imagenet").get("phase") == "Ready", 120)
    st = status(kube, "imagenet")
    assert ready, (st, operator.log()[-3000:], node_plugin.log()[-3000:])
    total = sum(len(b) for b in dataset.values())
    assert st["datasetBytes"] == total and st["objectCount"] == len(dataset)
    assert st["nodeSummary"] == {"targets": 1, "ready": 1, "warming": 0, "failed": 0, "waiting": 0}
    assert node_object(kube, "imagenet", "cpu-1") is None  # not selected: no plan there
    plan = node_object(kube, "imagenet", "gpu-1")
    assert plan["spec"]["plan"] == st["plan"] and plan["spec"]["cacheBytes"] == st["cacheBytesPerNode"]
    node = plan["status"]
    assert node["phase"] == "Ready" and node["warmedBytes"] == total and node["cachedBytes"] >= total
    assert node["plan"] == st["plan"] and st["notReady"] == []
    assert st["cachedPercentage"] == 100.0 and st["warmedBytes"] == total
    assert {c["type"]: c["status"] for c in st["conditions"]} == {
        "Sized": "True", "CacheTooSmall": "False", "Warmed": "True", "Ready": "True"}
    assert {"Sized", "Ready"} <= wait_for_events(kube, {"Sized", "Ready"})
    # The warmed mount really holds the data, with the planned budget.
    sock = node_plugin.state.control_socket("pv-imagenet")
    stats = control.call(sock, {"op": "stats"})
    assert stats["cache"]["budget"] == st["cacheBytesPerNode"] and stats["cache"]["bytes"] >= total
    # The volume and its credentials reached the node through the operator's handover in the release
    # namespace (canonical keys only); a status rewritten by someone else is not acted on.
    handover = kube.get("v1", "secrets", handover_name(NAMESPACE, "imagenet"), RELEASE_NS)
    assert handover["metadata"]["annotations"]["stoker.dev/datasetcache"] == f"{NAMESPACE}/imagenet"
    assert set(handover["data"]) == {"volume", "accessKeyId", "secretAccessKey"}
    assert "secretRef" not in st["volume"]
    s3.create_bucket(Bucket=f"{bucket}-elses")
    reads = handover_reads(kube, "imagenet")
    assert reads >= 1
    kube.patch("stoker.dev/v1alpha1", "datasetcaches", "imagenet", NAMESPACE, {"status": {"volume": {
        "id": "pv-forged", "attributes": {"bucket": f"{bucket}-elses", "endpointUrl": moto_server.endpoint}}}},
               subresource="status")
    # The agents never read a DatasetCache: their plan and volume come from the release namespace. Checked once
    # an agent's pass that began after the forged status was written has ended (two more reads by the agent,
    # three with one the operator's timer may have made meanwhile).
    assert kube.wait_for(lambda: handover_reads(kube, "imagenet") >= reads + 3, 60), node_plugin.log()[-3000:]
    assert [r.volume_id for r in node_plugin.state.records()] == ["pv-imagenet"]
    # The gated pod was released onto the warm node; the other gate stays.
    pod = kube.wait_for(lambda: (p := kube.get("v1", "pods", "trainer-0", NAMESPACE))
                        and len(p["spec"]["schedulingGates"]) == 1 and p, 30)
    assert pod["spec"]["schedulingGates"] == [{"name": "other.io/quota"}]
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [{"matchExpressions": [
        {"key": "kubernetes.io/hostname", "operator": "In", "values": ["gpu-1"]}]}]
    # Restarting the operator and the node plugin re-plans and re-warms nothing.
    before_report = node_report(kube, "imagenet", "gpu-1")
    gets = control.call(sock, {"op": "stats"})["requests"]["get"]
    operator.stop()
    node_plugin.stop()
    reads = handover_reads(kube, "imagenet")
    operator.start()
    node_plugin.start()
    assert kube.wait_for(lambda: "Resuming is processed: 1 succeeded" in operator.log().split("is stopping")[-1], 30)
    # The restarted agent's first pass has ended: two reads by the agent, beside the operator's on resume and one
    # its timer may have made meanwhile.
    assert kube.wait_for(lambda: handover_reads(kube, "imagenet") >= reads + 4, 60), node_plugin.log()[-3000:]
    after = status(kube, "imagenet")
    assert after["phase"] == "Ready" and node_report(kube, "imagenet", "gpu-1")["updated"] == before_report["updated"]
    assert control.call(sock, {"op": "stats"})["requests"]["get"] == gets
    # KeepWarm: after the cache lost its contents the node warms it again and the cache is Ready again.
    gets = stats["requests"]["get"]
    control.call(sock, {"op": "drop"})
    assert kube.wait_for(lambda: control.call(sock, {"op": "stats"})["cache"]["bytes"] >= total
                         and node_report(kube, "imagenet", "gpu-1")["phase"] == "Ready"
                         and status(kube, "imagenet")["phase"] == "Ready", 60), status(kube, "imagenet")
    assert control.call(sock, {"op": "stats"})["requests"]["get"] > gets
    reports = [o.get("status", {}) for o in kube.history("stoker.dev/v1alpha1", "datasetcachenodes",
                                                         node_object(kube, "imagenet", "gpu-1")["metadata"]["name"],
                                                         RELEASE_NS)]
    rewarm = [r.get("phase") for r in reports if r.get("updated", "") > before_report["updated"]]
    assert rewarm[:1] == ["Warming"] and rewarm[-1] == "Ready", rewarm
    # Deleting the DatasetCache releases the node's memory (the mount nobody else uses stops).
    mount_path = kubelet_staging_path(node_plugin.kubelet_dir, "pv-imagenet")  # where the warm mount lives
    kube.delete("stoker.dev/v1alpha1", "datasetcaches", "imagenet", NAMESPACE)
    assert kube.wait_for(lambda: cache(kube, "imagenet") is None, 60), (status(kube, "imagenet"), operator.log()[-2000:])
    assert wait_until(lambda: not is_mounted(mount_path), 30)
    assert kube.get("v1", "secrets", handover_name(NAMESPACE, "imagenet"), RELEASE_NS) is None
    assert node_object(kube, "imagenet", "gpu-1") is None
    from stoker_operator.handlers import RELEASE_WAIT

    assert not [line for line in operator.log().splitlines() if RELEASE_WAIT in line and "ERROR" in line], \
        "waiting for the agents to release is progress, not an error"


def test_a_dataset_larger_than_the_cache_warms_what_fits(kube, operator, node_plugin, moto_server, s3, bucket):
    files = {f"shards/{i:02d}.tar": os.urandom(3 * 1024 * 1024) for i in range(30)}
    for key, body in files.items():
        s3.put_object(Bucket=bucket, Key=key, Body=body)
    add_node(kube, "gpu-1")
    add_secret(kube, "creds", SECRETS)
    add_cache(kube, "shards", {"source": {"s3": {"bucket": bucket, "prefix": "shards", "endpointUrl": moto_server.endpoint,
                                                 "secretRef": {"name": "creds"}}}, "cacheSize": "64Mi"})
    assert kube.wait_for(lambda: status(kube, "shards").get("phase") == "Ready", 120), status(kube, "shards")
    st = status(kube, "shards")
    total, budget = sum(len(b) for b in files.values()), 64 * 1024**2
    assert st["datasetBytes"] == total and st["cacheBytesPerNode"] == budget
    too_small = next(c for c in st["conditions"] if c["type"] == "CacheTooSmall")
    assert too_small["status"] == "True" and "90.0 MiB" in too_small["message"]
    node = node_report(kube, "shards", "gpu-1")
    assert 0.5 * budget < node["warmedBytes"] <= 0.9 * budget and "did not fit" in node["message"]
    assert "CacheTooSmall" in wait_for_events(kube, {"CacheTooSmall"})
    stats = control.call(node_plugin.state.control_socket(f"s3://{bucket}/shards/"), {"op": "stats"})
    assert stats["cache"]["budget"] == budget and stats["cache"]["bytes"] <= budget
    # A new plan (other paths) under policy Once: the old Ready report counts for nothing, the node warms
    # the new plan, and only its report makes the cache Ready again.
    old_plan = st["plan"]
    kube.patch("stoker.dev/v1alpha1", "datasetcaches", "shards", NAMESPACE, {"spec": {"paths": ["00.tar", "01.tar"]}})
    assert kube.wait_for(lambda: (s := status(kube, "shards")).get("plan") not in (None, old_plan)
                         and s.get("phase") == "Ready", 120), status(kube, "shards")
    node = node_report(kube, "shards", "gpu-1")
    assert node["plan"] == status(kube, "shards")["plan"] and node["warmedBytes"] == 2 * 3 * 1024 * 1024
    # Policy OnDemand: the new plan (the whole dataset again) is Ready as soon as the node serves it, with
    # nothing fetched ahead; the cache fills as training reads.
    sock = node_plugin.state.control_socket(f"s3://{bucket}/shards/")
    gets = control.call(sock, {"op": "stats"})["requests"]["get"]
    old_plan = status(kube, "shards")["plan"]
    kube.patch("stoker.dev/v1alpha1", "datasetcaches", "shards", NAMESPACE, {"spec": {"paths": [], "policy": "OnDemand"}})
    assert kube.wait_for(lambda: (s := status(kube, "shards")).get("plan") not in (None, old_plan)
                         and s.get("phase") == "Ready", 120), status(kube, "shards")
    node = node_report(kube, "shards", "gpu-1")
    assert node["plan"] == status(kube, "shards")["plan"] and "OnDemand" in node["message"]
    assert node["warmedBytes"] == 0 and control.call(sock, {"op": "stats"})["requests"]["get"] == gets
    kube.delete("stoker.dev/v1alpha1", "datasetcaches", "shards", NAMESPACE)
    assert kube.wait_for(lambda: cache(kube, "shards") is None, 60)
    # With a disk tier per node (diskCacheSize, within the node's --node-disk-cache), the same 64 MiB of memory
    # holds the whole dataset: what does not fit memory is warmed onto the node's disk and counted there.
    add_cache(kube, "on-disk", {"source": {"s3": {"bucket": bucket, "prefix": "shards", "endpointUrl": moto_server.endpoint,
                                                  "secretRef": {"name": "creds"}}}, "cacheSize": "64Mi",
                                "diskCacheSize": "256Mi"})
    assert kube.wait_for(lambda: status(kube, "on-disk").get("phase") == "Ready", 120), status(kube, "on-disk")
    st = status(kube, "on-disk")
    assert st["heldOn"] == "disk" and st["warmableBytes"] == total and st["diskBytesPerNode"] == 256 * 1024**2
    assert next(c for c in st["conditions"] if c["type"] == "CacheTooSmall")["status"] == "False"
    node = node_report(kube, "on-disk", "gpu-1")
    assert node["warmedBytes"] == total and node["cachedBytes"] >= total and node["heldOn"] == "disk", node
    disk = control.call(sock, {"op": "stats"})["disk"]
    assert disk["bytes"] >= total and os.path.dirname(disk["directory"]) == str(node_plugin.tmp_path / "disk")
