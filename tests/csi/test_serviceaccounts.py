"""The IAM role of a pod's service account, read from its annotation through the API (faked at HTTP)."""

from __future__ import annotations

from csi.serviceaccounts import ServiceAccountRoles
from stoker_bench.fakekube import FakeKube


def test_role_from_the_service_account_annotation(tmp_path):
    from kubernetes import client, config

    with FakeKube() as kube:
        kube.create({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {
            "name": "trainer", "namespace": "ml",
            "annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/reader"}}})
        kube.create({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "plain", "namespace": "ml"}})
        configuration = client.Configuration()
        config.load_kube_config(config_file=kube.kubeconfig(str(tmp_path / "kubeconfig")),
                                client_configuration=configuration)
        roles = ServiceAccountRoles(client.ApiClient(configuration))
        assert roles("ml", "trainer") == "arn:aws:iam::1:role/reader"
        assert roles("ml", "plain") is None
        assert roles("ml", "missing") is None  # 404: no role, the volume is refused naming the annotation
        assert ("GET", "/api/v1/namespaces/ml/serviceaccounts/trainer") in kube.requests
