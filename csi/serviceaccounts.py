"""A pod's IAM role from its service account's annotation, as EKS IRSA writes it (the API is read
with the node plugin's service account: `get serviceaccounts`, nothing else)."""

from __future__ import annotations

import logging
import threading

from .auth import ROLE_ANNOTATION

log = logging.getLogger(__name__)


class ServiceAccountRoles:
    """`(namespace, name) -> role ARN or None`; connects to the API on first use (in-cluster, else
    KUBECONFIG), so that a plugin that never sees a pod-identity volume never needs the API."""

    def __init__(self, api=None):
        self._api = api
        self._core = None
        self._lock = threading.Lock()

    def _client(self):
        from kubernetes import client, config

        with self._lock:
            if self._core is None:
                api = self._api
                if api is None:
                    try:
                        config.load_incluster_config()
                    except config.ConfigException:
                        config.load_kube_config()
                    api = client.ApiClient()
                self._core = client.CoreV1Api(api)
            return self._core

    def __call__(self, namespace: str, name: str) -> str | None:
        from kubernetes.client.rest import ApiException
        from kubernetes.config import ConfigException

        try:
            account = self._client().read_namespaced_service_account(name, namespace)
        except (ApiException, ConfigException, OSError) as exc:
            log.warning("service account %s/%s: %s", namespace, name, getattr(exc, "reason", None) or exc)
            return None
        return (account.metadata.annotations or {}).get(ROLE_ANNOTATION)
