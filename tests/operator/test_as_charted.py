"""The operator run the way the chart runs it: the image's entrypoint (`stoker`) with the rendered args
and environment, as the rendered uid with no passwd entry, no home and no groups, against the fake
API; a DatasetCache reaches Ready with a real node plugin warming a moto bucket."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request

import pytest

from tests.conftest import requires_fuse
from tests.deploy.test_chart import render

from .conftest import NAMESPACE, add_cache, add_node, add_secret, status
from .test_e2e import SECRETS, node_plugin  # noqa: F401 - fixture

pytestmark = [pytest.mark.integration, requires_fuse,
              pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is missing")]


def rendered_operator() -> tuple[dict, dict]:
    deployment = next(d for d in render({}) if d["kind"] == "Deployment" and d["metadata"]["name"] == "stoker-operator")
    pod = deployment["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def test_the_charted_operator_runs_as_its_uid_and_reaches_ready(kube, node_plugin, moto_server, s3, bucket):  # noqa: F811
    pod, container = rendered_operator()
    uid = pod["securityContext"]["runAsUser"]
    assert pod["securityContext"]["runAsNonRoot"] and uid != 0
    import pwd

    with pytest.raises(KeyError):
        pwd.getpwuid(uid)  # as in the image: no passwd entry for it
    env = {"PATH": os.path.dirname(sys.executable) + ":/usr/bin:/bin", "HOME": "/nonexistent"}
    for var in container.get("env", []):
        if var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[var["name"]] = "stoker-operator-7d9f-abcde"  # what the downward API gives
        elif "value" in var:
            env[var["name"]] = var["value"]
    shared = tempfile.mkdtemp(prefix="charted-")  # readable by the unprivileged uid
    os.chmod(shared, 0o755)
    env["KUBECONFIG"] = kube.kubeconfig(os.path.join(shared, "kubeconfig"))  # stands in for the service account
    os.chmod(env["KUBECONFIG"], 0o644)
    for key, body in {"val/a.jpg": os.urandom(50_000), "val/b.jpg": os.urandom(70_000)}.items():
        s3.put_object(Bucket=bucket, Key=key, Body=body)
    add_node(kube, "gpu-1")
    add_secret(kube, "creds", SECRETS)
    log = open(os.path.join(shared, "operator.log"), "wb")
    for without_pod_id in (False, True):
        run_env = {k: v for k, v in env.items() if not (without_pod_id and k == "POD_ID")}
        proc = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                                 os.path.join(os.path.dirname(sys.executable), "stoker"), *container["args"]],
                                env=run_env, stdout=log, stderr=log, cwd="/")
        name = f"coco-{int(without_pod_id)}"
        try:
            add_cache(kube, name, {"source": {"s3": {"bucket": bucket, "prefix": "val",
                                                      "endpointUrl": moto_server.endpoint,
                                                      "secretRef": {"name": "creds"}}}, "cacheSize": "64Mi"})
            assert kube.wait_for(lambda: status(kube, name).get("phase") == "Ready", 90), \
                (status(kube, name), open(log.name).read()[-3000:])
            probe = container["livenessProbe"]["httpGet"]
            port = next(p["containerPort"] for p in container["ports"] if p["name"] == probe["port"])
            assert urllib.request.urlopen(f"http://127.0.0.1:{port}{probe['path']}", timeout=10).status == 200
            assert proc.poll() is None
        finally:
            proc.terminate()
            proc.wait(20)
            kube.delete("stoker.dev/v1alpha1", "datasetcaches", name, NAMESPACE)
    assert "getpwuid" not in open(log.name).read()
