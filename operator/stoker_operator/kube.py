"""The operator's and agent's few Kubernetes reads and writes, over the `kubernetes` client."""

from __future__ import annotations

import base64
import json
import logging

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from .failures import OperatorError
from . import GROUP, NODE_PLURAL, PLURAL, VERSION
from .plan import NodeInfo, quantity_bytes

log = logging.getLogger(__name__)
MERGE_PATCH = "application/merge-patch+json"
POOL_SIZE = 32  # connections kept to the API server: planning writes DatasetCacheNodes 16 at a time


class NotFoundInCluster(OperatorError, LookupError):
    pass


def load_config() -> None:
    """In-cluster service account, else KUBECONFIG / ~/.kube/config."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


class Kube:
    def __init__(self, api: client.ApiClient | None = None):
        if api is None:
            config = client.Configuration.get_default_copy()
            config.connection_pool_maxsize = POOL_SIZE
            api = client.ApiClient(config)
        self.api = api
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)

    def _get(self, call, what: str, *args):
        try:
            return call(*args)
        except ApiException as exc:
            if exc.status == 404:
                raise NotFoundInCluster(f"{what} not found") from None
            if exc.status == 403:
                raise NotFoundInCluster(f"{what}: the operator may not read it (RBAC)") from None
            raise

    def pvc(self, namespace: str, name: str):
        return self._get(self.core.read_namespaced_persistent_volume_claim, f"PVC {namespace}/{name}", name, namespace)

    def pv(self, name: str):
        return self._get(self.core.read_persistent_volume, f"PV {name}", name)

    def secret_data(self, namespace: str, name: str) -> dict[str, str]:
        return self.secret(namespace, name)[0]

    def secret(self, namespace: str, name: str) -> tuple[dict[str, str], dict[str, str]]:
        """(data, annotations) of a Secret."""
        secret = self._get(self.core.read_namespaced_secret, f"Secret {namespace}/{name}", name, namespace)
        data = {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}
        return data, dict(secret.metadata.annotations or {})

    def put_secret(self, namespace: str, name: str, data: dict[str, str], annotations: dict[str, str],
                   labels: dict[str, str]) -> None:
        """Create the Secret, or replace its data (the operator's handovers only)."""
        encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
        body = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "data": encoded,
                "metadata": {"name": name, "namespace": namespace, "annotations": annotations, "labels": labels}}
        try:
            self.core.create_namespaced_secret(namespace, body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            current = self.core.read_namespaced_secret(name, namespace)
            if (current.data or {}) != encoded or (current.metadata.annotations or {}) != annotations:
                patch = {"data": {**{k: None for k in (current.data or {}) if k not in encoded}, **encoded},
                         "metadata": {"annotations": annotations, "labels": labels}}
                self.core.patch_namespaced_secret(name, namespace, patch, _content_type=MERGE_PATCH)

    def namespace_missing(self, namespace: str) -> bool:
        """Does the API refuse writes into `namespace` because it does not exist? Asked with a dry-run create
        of a Secret there (the operator writes its handovers there anyway: no read of Namespaces needed)."""
        body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "stoker-namespace-probe"}}
        try:
            self.core.create_namespaced_secret(namespace, body, dry_run="All")
        except ApiException as exc:
            if exc.status != 404:
                return False  # 409 (a Secret of that name), 403, ...: the namespace is there, or cannot be told
            try:
                details = json.loads(exc.body or "{}").get("details") or {}
            except ValueError:
                details = {}
            return details.get("kind") == "namespaces"
        return False

    def delete_secret(self, namespace: str, name: str) -> None:
        try:
            self.core.delete_namespaced_secret(name, namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def nodes(self) -> list[NodeInfo]:
        out = []
        for node in self.core.list_node().items:
            ready = any(c.type == "Ready" and c.status == "True" for c in (node.status.conditions or []))
            memory = (node.status.allocatable or {}).get("memory", "0")
            out.append(NodeInfo(node.metadata.name, dict(node.metadata.labels or {}), quantity_bytes(memory, what="memory"),
                                ready=ready, schedulable=not (node.spec and node.spec.unschedulable)))
        return out

    def gated_pods(self, namespace: str, cache: str, gate: str, annotation: str) -> list[dict]:
        pods = self.core.list_namespaced_pod(namespace).items
        out = []
        for pod in pods:
            gates = [g.name for g in (pod.spec.scheduling_gates or [])]
            if gate in gates and (pod.metadata.annotations or {}).get(annotation) == cache:
                out.append(self.api.sanitize_for_serialization(pod))
        return out

    def patch_pod(self, namespace: str, name: str, patch: dict) -> None:
        self.core.patch_namespaced_pod(name, namespace, patch, _content_type=MERGE_PATCH)

    def cache(self, namespace: str, name: str) -> dict | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    # ---- DatasetCacheNodes (nodes.py), in the release namespace

    def node_objects(self, namespace: str, selector: str) -> tuple[list[dict], str]:
        """(items, resourceVersion) of the DatasetCacheNodes matching a label selector."""
        answer = self.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, NODE_PLURAL,
                                                           label_selector=selector)
        return answer.get("items", []), answer.get("metadata", {}).get("resourceVersion", "")

    def watch_node_objects(self, namespace: str, selector: str, resource_version: str, timeout: int = 60):
        return watch.Watch().stream(self.custom.list_namespaced_custom_object, GROUP, VERSION, namespace,
                                    NODE_PLURAL, label_selector=selector, resource_version=resource_version,
                                    timeout_seconds=timeout)

    def create_node_object(self, namespace: str, body: dict) -> None:
        try:
            self.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, NODE_PLURAL, body)
        except ApiException as exc:
            if exc.status != 409:  # created by an earlier attempt: the next plan re-specs it
                raise

    def patch_node_object(self, namespace: str, name: str, patch: dict) -> None:
        try:
            self.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, NODE_PLURAL, name, patch,
                                                       _content_type=MERGE_PATCH)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def patch_node_status(self, namespace: str, name: str, status: dict) -> None:
        try:
            self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, NODE_PLURAL, name,
                                                              {"status": status}, _content_type=MERGE_PATCH)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def delete_node_object(self, namespace: str, name: str) -> None:
        try:
            self.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, NODE_PLURAL, name)
        except ApiException as exc:
            if exc.status != 404:
                raise
