"""A fake Kubernetes API (real HTTP), the real `stoker operator`, and cluster objects for a moto bucket."""

from __future__ import annotations

import base64
import os
import subprocess
import sys

import pytest
from stoker_bench.fakekube import FakeKube

from fusecore.process.launch import stop_process

NAMESPACE = "ml"
RELEASE_NS = "stoker-system"  # where the operator hands over volumes and keeps the DatasetCacheNodes


@pytest.fixture
def kube(tmp_path):
    from stoker_operator import crd

    with FakeKube() as fake:
        for plural in ("datasetcaches", "datasetcachenodes"):
            fake.schemas[plural] = crd.schema(plural)
        fake.kubeconfig_path = fake.kubeconfig(str(tmp_path / "kubeconfig"))
        fake.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        yield fake
        assert fake.pruned == [], f"the API server would drop fields the operator or an agent wrote: {fake.pruned}"


def add_node(kube, name: str, memory: str = "16Gi", labels: dict | None = None, ready: bool = True) -> None:
    kube.create({"apiVersion": "v1", "kind": "Node",
                 "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
                 "spec": {},
                 "status": {"allocatable": {"memory": memory, "cpu": "8"},
                            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}})


def add_secret(kube, name: str, data: dict[str, str]) -> None:
    kube.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": NAMESPACE},
                 "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}})


def add_stoker_pvc(kube, name: str, attributes: dict, secret: str | None = "creds", driver: str = "csi.stoker.dev"):
    csi = {"driver": driver, "volumeHandle": f"pv-{name}", "volumeAttributes": attributes}
    if secret:
        csi["nodeStageSecretRef"] = {"name": secret, "namespace": NAMESPACE}
    kube.create({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"pv-{name}"},
                 "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"], "csi": csi}})
    kube.create({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                 "metadata": {"name": name, "namespace": NAMESPACE},
                 "spec": {"accessModes": ["ReadOnlyMany"], "volumeName": f"pv-{name}", "storageClassName": "",
                          "resources": {"requests": {"storage": "1Gi"}}},
                 "status": {"phase": "Bound"}})


def add_cache(kube, name: str, spec: dict) -> None:
    kube.create({"apiVersion": "stoker.dev/v1alpha1", "kind": "DatasetCache",
                 "metadata": {"name": name, "namespace": NAMESPACE}, "spec": spec})


def cache(kube, name: str) -> dict | None:
    return kube.get("stoker.dev/v1alpha1", "datasetcaches", name, NAMESPACE)


def status(kube, name: str) -> dict:
    return (cache(kube, name) or {}).get("status") or {}


def node_object(kube, name: str, node: str) -> dict | None:
    """The DatasetCacheNode of cache `name` on `node` (release namespace)."""
    from stoker_operator.nodes import object_name

    return kube.get("stoker.dev/v1alpha1", "datasetcachenodes", object_name(NAMESPACE, name, node), RELEASE_NS)


def node_report(kube, name: str, node: str) -> dict:
    return (node_object(kube, name, node) or {}).get("status") or {}


class OperatorProcess:
    """The real `stoker operator` (kopf) against the fake API."""

    def __init__(self, kube, tmp_path, *args: str):
        self.kube = kube
        self.log_path = tmp_path / "operator.log"
        self.proc = None
        self.args = list(args)

    def start(self) -> None:
        env = dict(os.environ, KUBECONFIG=self.kube.kubeconfig_path)
        with open(self.log_path, "ab") as log:
            # no --standalone: a plain cluster (no kopf peering CRDs) works with the defaults
            self.proc = subprocess.Popen([sys.executable, "-m", "stoker", "operator", "--liveness", "",
                                          "--log-level", "DEBUG", *self.args], stdout=log, stderr=log, env=env)

    def stop(self) -> None:
        stop_process(self.proc, grace=15)

    def log(self) -> str:
        return self.log_path.read_text()


@pytest.fixture
def operator(kube, tmp_path):
    proc = OperatorProcess(kube, tmp_path)
    proc.start()
    yield proc
    proc.stop()


def wait_for_events(kube, reasons: set[str], timeout: float = 30) -> set[str]:
    """kopf posts events in the background: wait until these reasons were posted; returns all seen."""
    def seen() -> set[str]:
        return {e.get("reason") for e in kube.list("v1", "events", NAMESPACE)}

    kube.wait_for(lambda: reasons <= seen(), timeout)
    return seen()
