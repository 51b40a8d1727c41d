"""A pod's IAM role from its service account's annotation, as EKS IRSA writes it (the API is read
with the node plugin's service account: `get serviceaccounts`, nothing else)."""

from __future__ import annotations

import logging

from .auth import ROLE_ANNOTATION

log = logging.getLogger(__name__)


class ServiceAccountRoles:
    def __init__(self, api=None):
        from kubernetes import client, config

        if api is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api = client.ApiClient()
        self._core = client.CoreV1Api(api)

    def __call__(self, namespace: str, name: str) -> str | None:
        from kubernetes.client.rest import ApiException

        try:
            account = self._core.read_namespaced_service_account(name, namespace)
        except ApiException as exc:
            log.warning("service account %s/%s: %s", namespace, name, exc.reason)
            return None
        return (account.metadata.annotations or {}).get(ROLE_ANNOTATION)
