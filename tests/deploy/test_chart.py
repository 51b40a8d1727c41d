"""The Helm chart, rendered by a real Helm engine (helm-python-sdk), linted, and every rendered object
validated against the Kubernetes OpenAPI schemas (kubernetes-validate)."""

from __future__ import annotations

import os
import re

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHART = os.path.join(ROOT, "charts", "stoker")
KUBE_VERSION = "1.30.0"
CUSTOM_KINDS = {"ServiceMonitor", "ClusterKopfPeering", "KopfPeering"}  # not in the Kubernetes schemas

VALUE_SETS = {
    "defaults": {},
    "provisioning": {"controller": {"enabled": True, "replicas": 2},
                     "storageClass": {"create": True, "parameters": {"bucket": "data", "onDelete": "Delete"},
                                      "provisionerSecret": {"name": "prov", "namespace": "stoker-system"}}},
    "operator-ha-namespaced": {"operator": {"replicas": 2, "namespaces": ["ml", "research"]}},
    "big-gpu-nodes": {"node": {"cacheMemory": "512Gi", "memoryOverhead": "2Gi", "warmAgent": False,
                               "nodeSelector": {"nvidia.com/gpu.present": "true"},
                               "diskCache": {"path": "/mnt/nvme/stoker", "size": "6Ti"}},
                      "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}},
    "minimal": {"operator": {"enabled": False}, "metrics": {"enabled": False}},
}


def render(values: dict) -> list[dict]:
    chart = helm.Chart.load(CHART)
    chart.validate_schema(values)
    manifests = chart.render(values, name="stoker", namespace="stoker-system", is_install=True)
    docs = []
    for path, text in sorted(manifests.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    docs += [d for c in chart.crds for d in yaml.safe_load_all(c["data"]) if d] if isinstance(chart.crds, list) else []
    return docs


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def validate(doc: dict, crds: list[dict]) -> None:
    if doc["kind"] in CUSTOM_KINDS:
        definition = next((c for c in crds if c["spec"]["names"]["kind"] == doc["kind"]), None)
        if definition is not None:
            jsonschema.validate(doc, definition["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
        else:  # ServiceMonitor: its CRD comes with the Prometheus operator
            assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["spec"]["endpoints"]
        return
    kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_rendered_objects_are_valid_kubernetes(name):
    docs = render(VALUE_SETS[name])
    crds = by_kind(docs, "CustomResourceDefinition")
    for doc in docs:
        validate(doc, crds)
    assert len({(d["kind"], d["metadata"]["name"], d["metadata"].get("namespace")) for d in docs}) == len(docs)


def test_lint_finds_no_errors_or_warnings():
    for values in VALUE_SETS.values():
        report = helm.lint(CHART, values, strict=True)
        serious = [m for m in report["messages"] if m["severity"] >= 2]
        assert not serious and not report["errors"], report


def test_the_node_pod_and_the_mounter_are_arranged_for_restarts_and_accounting():
    docs = render(VALUE_SETS["big-gpu-nodes"])
    daemonsets = {d["metadata"]["name"]: d for d in by_kind(docs, "DaemonSet")}
    node, mounter = daemonsets["stoker-node"], daemonsets["stoker-mounter"]
    assert mounter["spec"]["updateStrategy"]["type"] == "OnDelete"  # upgrades of the plugin never kill mounts
    containers = {c["name"]: c for c in node["spec"]["template"]["spec"]["containers"]}
    assert set(containers) == {"stoker-node", "node-driver-registrar"}
    plugin = containers["stoker-node"]
    assert {"mountPath": "/var/lib/kubelet", "name": "kubelet-dir", "mountPropagation": "Bidirectional"} in \
        plugin["volumeMounts"]
    assert "--warm-agent" not in plugin["args"]
    mounter_container = mounter["spec"]["template"]["spec"]["containers"][0]
    assert mounter_container["resources"]["requests"]["memory"] == f"{512 * 1024 + 2 * 1024}Mi"
    assert mounter_container["resources"]["limits"]["memory"] == f"{512 * 1024 + 2 * 1024}Mi"
    assert any(v.get("hostPath", {}).get("path") == "/dev/fuse" for v in mounter["spec"]["template"]["spec"]["volumes"])
    # the blocks a volume's workers share: a memory-backed /dev/shm as large as the cache memory (not 64 MiB)
    assert {"name": "shm", "mountPath": "/dev/shm"} in mounter_container["volumeMounts"]
    assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "512Gi"}} in \
        mounter["spec"]["template"]["spec"]["volumes"]
    # the disk tier: the node plugin makes and removes volumes' folders, the mounts (in the mounter) use them
    assert {"--disk-cache-root=/mnt/nvme/stoker", "--node-disk-cache=6Ti"} <= set(plugin["args"])
    assert "--disk-cache-root=/mnt/nvme/stoker" in mounter_container["args"]
    for pod, container in ((node, plugin), (mounter, mounter_container)):
        assert {"name": "disk-cache", "mountPath": "/mnt/nvme/stoker"} in container["volumeMounts"]
        assert {"name": "disk-cache", "hostPath": {"path": "/mnt/nvme/stoker", "type": "DirectoryOrCreate"}} in \
            pod["spec"]["template"]["spec"]["volumes"]
    assert not any("disk-cache" in a for d in by_kind(render({}), "DaemonSet")
                   for c in d["spec"]["template"]["spec"]["containers"] for a in c.get("args", [])), "off by default"
    socket_arg = next(a for a in plugin["args"] if a.startswith("--mounter-socket="))
    assert socket_arg.split("=", 1)[1] == next(a for a in mounter_container["args"] if a.startswith("--socket=")).split("=", 1)[1]
    driver = by_kind(docs, "CSIDriver")[0]
    assert driver["metadata"]["name"] == "csi.stoker.dev"
    assert driver["spec"]["attachRequired"] is False and driver["spec"]["podInfoOnMount"] is True
    assert driver["spec"]["volumeLifecycleModes"] == ["Persistent", "Ephemeral"]


def _probes(container: dict):
    for kind in ("livenessProbe", "readinessProbe", "startupProbe"):
        probe = container.get(kind)
        if probe:
            yield kind, probe


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_probe_port_resolves_in_its_own_container(name):
    """kubelet (pkg/kubelet/prober, util.ResolvePort) looks a named port up among the ports of the probed
    container only; a number is used as it is."""
    checked = 0
    for doc in render(VALUE_SETS[name]):
        pod = doc.get("spec", {}).get("template", {}).get("spec")
        for container in (pod or {}).get("containers", []):
            names = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
            for kind, probe in _probes(container):
                action = probe.get("httpGet") or probe.get("tcpSocket") or probe.get("grpc")
                port = action["port"]
                assert isinstance(port, int) or port in names, \
                    f"{doc['metadata']['name']}/{container['name']} {kind}: port {port!r} is not one of {sorted(names)}"
                checked += 1
    assert checked >= 1


def test_optional_parts_follow_the_values():
    default_kinds = {(d["kind"], d["metadata"]["name"]) for d in render({})}
    assert ("Deployment", "stoker-operator") in default_kinds and ("Deployment", "stoker-controller") not in default_kinds
    provisioning = render(VALUE_SETS["provisioning"])
    controller = next(d for d in by_kind(provisioning, "Deployment") if d["metadata"]["name"] == "stoker-controller")
    assert {c["name"] for c in controller["spec"]["template"]["spec"]["containers"]} == {"stoker-controller",
                                                                                          "csi-provisioner"}
    storage_class = by_kind(provisioning, "StorageClass")[0]
    assert storage_class["provisioner"] == "csi.stoker.dev"
    assert storage_class["parameters"]["csi.storage.k8s.io/provisioner-secret-name"] == "prov"
    ha = render(VALUE_SETS["operator-ha-namespaced"])
    operator = by_kind(ha, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    assert "--namespace=ml" in operator["args"] and "--standalone" not in operator["args"]
    assert {d["metadata"]["namespace"] for d in by_kind(ha, "KopfPeering")} == {"ml", "research"}
    minimal = {d["kind"] for d in render(VALUE_SETS["minimal"])}
    assert "Service" not in minimal and "Deployment" not in minimal


HARDENED = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_deployment_container_runs_hardened_and_probed(name):
    """The operator and the controller (its csi-provisioner sidecar too): non-root pods with the runtime's
    seccomp profile, containers without privilege escalation, with a read-only root and no capabilities;
    each of our own containers has a liveness probe. (The node DaemonSets are privileged by necessity.)"""
    checked = 0
    for doc in by_kind(render(VALUE_SETS[name]), "Deployment"):
        pod = doc["spec"]["template"]["spec"]
        where = doc["metadata"]["name"]
        assert pod.get("securityContext", {}).get("runAsNonRoot") is True, where
        assert pod["securityContext"].get("runAsUser", 0) != 0, where
        assert pod["securityContext"].get("seccompProfile") == {"type": "RuntimeDefault"}, where
        for container in pod["containers"]:
            context = container.get("securityContext") or {}
            assert {k: context.get(k) for k in HARDENED} == HARDENED, (where, container["name"], context)
            assert not context.get("privileged"), (where, container["name"])
            if container["image"].startswith("ghcr.io/stoker-dev/stoker"):
                assert container.get("livenessProbe"), (where, container["name"])
            checked += 1
    if name == "provisioning":
        assert checked >= 3  # the operator, the controller and its provisioner


@pytest.mark.parametrize("bad", [
    {"node": {"cacheMemory": "lots"}},
    {"node": {"cacheMemory": "8GB"}},
    {"operator": {"replicas": 0}},
    {"metrics": {"port": 80}},
    {"storageClass": {"reclaimPolicy": "Shred"}},
    {"image": {"pullPolicy": "Sometimes"}},
    {"node": {"mounterResources": {"requests": {"memory": "1Gi"}}}},
    {"node": {"peerPort": 70000}},
    {"node": {"peerPort": "7470"}},
    {"node": {"diskCache": {"path": "nvme/stoker", "size": "1Ti"}}},
    {"node": {"diskCache": {"path": "/mnt/nvme"}}},
    {"node": {"diskCache": {"path": "/mnt/nvme", "size": "1TB"}}},
    {"networkPolicy": {"enabled": True, "allowFrom": "anywhere"}},
    {"unknownTopLevel": True},
])
def test_values_schema_rejects_bad_values(bad):
    with pytest.raises(helm.HelmError):
        helm.Chart.load(CHART).validate_schema(bad)


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_stoker_container_command_is_one_the_cli_accepts(name):
    """Each container of our image runs the entrypoint `stoker` with the rendered args: every flag the
    chart passes must exist (a renamed flag would crash-loop the pod), with $(VAR) from its env."""
    from stoker.cli import build_parser

    parser, seen = build_parser(), 0
    for doc in render(VALUE_SETS[name]):
        pod = doc.get("spec", {}).get("template", {}).get("spec") or {}
        for container in pod.get("containers", []):
            if not container["image"].startswith("ghcr.io/stoker-dev/stoker"):
                continue
            env = {v["name"]: "from-env" for v in container.get("env", [])}
            args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]
            parsed = parser.parse_args(args)
            assert callable(parsed.func), container["name"]
            seen += 1
    assert seen >= 2  # the node plugin and the mounter, in every value set


def test_the_peer_port_is_open_to_this_release_s_mounters_only():
    """Distributed DatasetCaches: the node plugin listens on node.peerPort at its pod IP, and the NetworkPolicy
    admits that port from this release's mounter pods (where the asking mounts run) and from nobody else;
    its health and metrics ports stay open. Without the warm agent or with peerPort 0 there is neither."""
    docs = render({})
    node = next(d for d in by_kind(docs, "DaemonSet") if d["metadata"]["name"] == "stoker-node")
    container = node["spec"]["template"]["spec"]["containers"][0]
    assert "--peer-port=7470" in container["args"]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]
    assert {"name": "peer", "containerPort": 7470, "protocol": "TCP"} in container["ports"]
    mounter = next(d for d in by_kind(docs, "DaemonSet") if d["metadata"]["name"] == "stoker-mounter")
    (policy,) = by_kind(docs, "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"] == node["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    peer_rule, open_rule = policy["spec"]["ingress"]
    assert peer_rule["ports"] == [{"port": 7470, "protocol": "TCP"}]
    assert [f["podSelector"]["matchLabels"] for f in peer_rule["from"]] == [
        mounter["spec"]["selector"]["matchLabels"]]
    assert "from" not in open_rule and {p["port"] for p in open_rule["ports"]} == {9808, 9810}
    for values in ({"node": {"peerPort": 0}}, {"node": {"warmAgent": False}}, {"networkPolicy": {"enabled": False}}):
        assert not by_kind(render(values), "NetworkPolicy"), values
    assert "--peer-port=0" in next(d for d in by_kind(render({"node": {"peerPort": 0}}), "DaemonSet")
                                   if d["metadata"]["name"] == "stoker-node")["spec"]["template"]["spec"][
        "containers"][0]["args"]
