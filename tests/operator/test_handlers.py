"""The real operator against the Kubernetes API faked at its HTTP boundary: bad sources end in Failed
with a clear condition, and nothing else in the cluster is touched."""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.csi.conftest import SECRETS

from .conftest import (NAMESPACE, RELEASE_NS, OperatorProcess, add_cache, add_node, add_secret, add_stoker_pvc,
                       node_object, status, wait_for_events)

pytestmark = pytest.mark.integration


def failed_with(kube, name: str) -> str:
    st = kube.wait_for(lambda: status(kube, name).get("phase") == "Failed" and status(kube, name), 60)
    assert st, status(kube, name)
    sized = next(c for c in st["conditions"] if c["type"] == "Sized")
    assert sized["status"] == "False" and sized["reason"] == "InvalidSource"
    return sized["message"]


def test_bad_sources_fail_with_a_clear_message(kube, operator, moto_server, bucket):
    add_node(kube, "n1")
    add_secret(kube, "creds", SECRETS)
    add_secret(kube, "bad-creds", {"username": "x"})
    add_stoker_pvc(kube, "other-driver", {"bucket": bucket}, driver="ebs.csi.aws.com")
    add_stoker_pvc(kube, "no-secret", {"bucket": bucket, "endpointUrl": moto_server.endpoint}, secret="missing")
    add_stoker_pvc(kube, "weird-secret", {"bucket": bucket, "endpointUrl": moto_server.endpoint}, secret="bad-creds")
    add_stoker_pvc(kube, "no-bucket", {"bucket": "no-such-bucket-zz", "endpointUrl": moto_server.endpoint})
    cases = {
        "unknown-pvc": ({"pvc": "nope"}, "PVC ml/nope not found"),
        "other-driver": ({"pvc": "other-driver"}, "ebs.csi.aws.com"),
        "no-secret": ({"pvc": "no-secret"}, "Secret ml/missing"),
        "weird-secret": ({"pvc": "weird-secret"}, "username"),
        "no-bucket": ({"pvc": "no-bucket"}, "bucket does not exist"),
        "no-credentials": ({"s3": {"bucket": bucket, "endpointUrl": moto_server.endpoint}}, "no credentials"),
    }
    for name, (source, _) in cases.items():
        add_cache(kube, name, {"source": source})
    before = {p: kube.list(v, p) for v, p in (("v1", "pods"), ("v1", "persistentvolumes"), ("v1", "secrets"))}
    for name, (_, expected) in cases.items():
        message = failed_with(kube, name)
        assert expected.lower() in message.lower(), (name, message)
        assert SECRETS["secretAccessKey"] not in message
    def warned() -> set[str]:
        return {e["involvedObject"]["name"] for e in kube.list("v1", "events", NAMESPACE) if e.get("type") == "Warning"}

    assert kube.wait_for(lambda: warned() >= set(cases), 30), warned()  # kopf posts events in the background
    after = {p: kube.list(v, p) for v, p in (("v1", "pods"), ("v1", "persistentvolumes"), ("v1", "secrets"))}
    assert before == after
    patched = {path for method, path in kube.requests if method in ("PATCH", "PUT", "DELETE", "POST")
               and "/datasetcaches/" not in path and "/events" not in path  # no plan: no DatasetCacheNode either
               and "dryRun=All" not in path}  # (the start-up check of the release namespace writes nothing)
    assert patched == set()


def test_fixing_the_spec_replans(kube, operator, moto_server, s3, bucket):
    s3.put_object(Bucket=bucket, Key="data/a.bin", Body=b"a" * 1000)
    s3.put_object(Bucket=bucket, Key="data/sub/b.bin", Body=b"b" * 500)
    add_node(kube, "n1", memory="8Gi")
    add_secret(kube, "creds", SECRETS)
    add_cache(kube, "c", {"source": {"s3": {"bucket": "wrong-bucket-q", "endpointUrl": moto_server.endpoint,
                                            "secretRef": {"name": "creds"}}}})
    failed_with(kube, "c")
    obj = kube.get("stoker.dev/v1alpha1", "datasetcaches", "c", NAMESPACE)
    fix = {"spec": {"source": {"s3": dict(obj["spec"]["source"]["s3"], bucket=bucket, prefix="data")},
                    "cacheSize": "1Gi"}}
    request = urllib.request.Request(f"{kube.url}/apis/stoker.dev/v1alpha1/namespaces/{NAMESPACE}/datasetcaches/c",
                                     data=json.dumps(fix).encode(), method="PATCH",
                                     headers={"Content-Type": "application/merge-patch+json"})
    urllib.request.urlopen(request).close()
    st = kube.wait_for(lambda: status(kube, "c").get("phase") == "Warming" and status(kube, "c"), 60)
    assert st, status(kube, "c")
    assert (st["datasetBytes"], st["objectCount"], st["cacheBytesPerNode"]) == (1500, 2, 1024**3)
    assert st["volume"]["id"] == f"s3://{bucket}/data/" and st["nodeSummary"]["targets"] == 1
    assert st["observedGeneration"] == 2
    plan = node_object(kube, "c", "n1")["spec"]
    assert (plan["plan"], plan["cacheBytes"], plan["node"], plan["cache"]) == (st["plan"], 1024**3, "n1", f"{NAMESPACE}/c")


def test_a_secret_reference_stays_in_the_caches_namespace():
    """A DatasetCache's s3 secretRef names a Secret of its own namespace, whatever else it says."""
    from stoker_operator.source import resolve

    ref = resolve({"source": {"s3": {"bucket": "b", "secretRef": {"name": "creds", "namespace": "kube-system"}}}},
                  NAMESPACE, kube=None)
    assert (ref.secret_namespace, ref.secret_name) == (NAMESPACE, "creds")


def test_peering_without_its_crd_is_refused_at_start_not_a_silent_pause(kube, tmp_path):
    import os
    import subprocess
    import sys

    env = dict(os.environ, KUBECONFIG=kube.kubeconfig_path)
    result = subprocess.run([sys.executable, "-m", "stoker", "operator", "--peering", "stoker", "--liveness", ""],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2 and "clusterkopfpeerings.kopf.dev" in result.stderr


def test_a_cache_that_finds_its_nodes_full_waits_and_names_who_holds_them(kube, tmp_path, moto_server, s3, bucket):
    """--node-cache-memory (node.cacheMemory): a second DatasetCache on a full node is Pending, its Sized
    condition naming the cache that holds the memory; once that one is deleted it is planned."""
    from .conftest import OperatorProcess, cache

    s3.put_object(Bucket=bucket, Key="d/a.bin", Body=b"a" * 1000)
    add_node(kube, "n1")
    add_secret(kube, "creds", SECRETS)
    source = {"s3": {"bucket": bucket, "prefix": "d", "endpointUrl": moto_server.endpoint, "secretRef": {"name": "creds"}}}
    operator = OperatorProcess(kube, tmp_path, "--node-cache-memory", "1Gi")
    operator.start()
    try:
        add_cache(kube, "first", {"source": source, "cacheSize": "768Mi"})
        assert kube.wait_for(lambda: status(kube, "first").get("cacheBytesPerNode") == 768 * 1024**2, 60)
        add_cache(kube, "second", {"source": source, "cacheSize": "512Mi"})

        def waiting() -> str | None:
            sized = [c for c in status(kube, "second").get("conditions") or [] if c["type"] == "Sized"]
            return sized and sized[0]["reason"] == "NodeCacheFull" and sized[0]["message"]

        message = kube.wait_for(waiting, 60)
        assert message and "ml/first 768.0 MiB" in message and "of 1.0 GiB" in message, status(kube, "second")
        assert status(kube, "second")["phase"] == "Pending"
        kube.delete("stoker.dev/v1alpha1", "datasetcaches", "first", NAMESPACE)
        assert kube.wait_for(lambda: cache(kube, "first") is None, 30)
        assert kube.wait_for(lambda: status(kube, "second").get("cacheBytesPerNode") == 512 * 1024**2, 60), \
            status(kube, "second")
    finally:
        operator.stop()


def test_a_missing_release_namespace_is_said_at_start_and_on_every_cache(kube, tmp_path, moto_server, s3, bucket):
    """Run outside the chart, where the release namespace does not exist: one clear start-up line, and each
    DatasetCache shows why it waits (condition and Event naming the namespace and the flag); once the namespace
    exists, the caches are planned without a restart."""
    s3.put_object(Bucket=bucket, Key="data/a.bin", Body=b"a" * 1000)
    add_node(kube, "n1")
    add_secret(kube, "creds", SECRETS)
    kube.missing_namespaces.add(RELEASE_NS)
    operator = OperatorProcess(kube, tmp_path)
    operator.start()
    try:
        add_cache(kube, "c", {"source": {"s3": {"bucket": bucket, "prefix": "data", "endpointUrl": moto_server.endpoint,
                                                "secretRef": {"name": "creds"}}}})

        def waiting():
            ready = [c for c in status(kube, "c").get("conditions", []) if c["type"] == "Ready"]
            return ready and ready[0]["reason"] == "ReleaseNamespaceMissing" and ready[0]

        condition = kube.wait_for(waiting, 30)
        assert condition, (status(kube, "c"), operator.log()[-2000:])
        assert RELEASE_NS in condition["message"] and "--handover-namespace" in condition["message"]
        assert status(kube, "c")["phase"] == "Pending"
        assert "ReleaseNamespaceMissing" in wait_for_events(kube, {"ReleaseNamespaceMissing"})
        startup = [line for line in operator.log().splitlines() if f"release namespace {RELEASE_NS!r} does not exist"
                   in line and "no DatasetCache is planned" in line]
        assert len(startup) == 1, operator.log()[-3000:]
        kube.missing_namespaces.clear()
        assert kube.wait_for(lambda: status(kube, "c").get("phase") == "Warming", 60), status(kube, "c")
    finally:
        operator.stop()


def test_the_sized_event_names_a_capped_list_of_nodes(kube, operator, moto_server, s3, bucket):
    s3.put_object(Bucket=bucket, Key="data/a.bin", Body=b"a" * 1000)
    for i in range(40):
        add_node(kube, f"gpu-node-{i:03d}")
    add_secret(kube, "creds", SECRETS)
    add_cache(kube, "big", {"source": {"s3": {"bucket": bucket, "prefix": "data", "endpointUrl": moto_server.endpoint,
                                              "secretRef": {"name": "creds"}}}})
    wait_for_events(kube, {"Sized"})
    sized = [e["message"] for e in kube.list("v1", "events", NAMESPACE) if e.get("reason") == "Sized"]
    assert sized and all("and 30 more" in m and "gpu-node-039" not in m for m in sized), sized
    assert all(len(m) < 1024 for m in sized), "kopf cuts messages at 1,024 characters"


def test_waiting_for_nodes_to_release_is_logged_as_progress():
    """kopf logs a handler's TemporaryError at ERROR; the release handler's wait for the agents is INFO."""
    import logging

    from stoker_operator.handlers import RELEASE_WAIT, _release_wait_is_progress

    wait = logging.LogRecord("kopf.objects", logging.ERROR, __file__, 1,
                             f"Handler 'release' failed temporarily: {RELEASE_WAIT} the caches of 3 nodes: a, b, c",
                             None, None)
    other = logging.LogRecord("kopf.objects", logging.ERROR, __file__, 1, "Handler 'plan' failed temporarily: boom",
                              None, None)
    assert _release_wait_is_progress(wait) and (wait.levelno, wait.levelname) == (logging.INFO, "INFO")
    assert _release_wait_is_progress(other) and other.levelno == logging.ERROR


def test_a_distributed_cache_plans_shares_and_hands_over_one_peer_key_it_keeps(kube, operator, moto_server, s3,
                                                                               bucket):
    """spec.distributed: each node's DatasetCacheNode asks for its share (dataset x R / N) and says the cache
    is distributed; the handover Secret carries a key of this cache, made once: a re-plan keeps it."""
    import base64

    from fusecore.config import distributed_cache_size, estimated_block_squares
    from stoker_operator.handover import handover_name

    from .conftest import RELEASE_NS, node_object

    s3.put_object(Bucket=bucket, Key="data/a.bin", Body=b"a" * 300_000)
    s3.put_object(Bucket=bucket, Key="data/b.bin", Body=b"b" * 100_000)
    for n in ("n1", "n2", "n3", "n4"):
        add_node(kube, n, memory="8Gi")
    add_secret(kube, "creds", SECRETS)
    add_cache(kube, "d", {"source": {"s3": {"bucket": bucket, "prefix": "data", "endpointUrl": moto_server.endpoint,
                                            "secretRef": {"name": "creds"}}},
                          "distributed": {"replicas": 2}})
    st = kube.wait_for(lambda: status(kube, "d").get("phase") == "Warming" and status(kube, "d"), 60)
    assert st, status(kube, "d")
    assert st["distributed"] == {"replicas": 2, "nodes": 4, "shareBytes": 200_000}
    assert st["warmableBytes"] == 200_000
    assert st["cacheBytesPerNode"] == max(64 * 1024**2, distributed_cache_size(
        400_000, 4, 2, 0.1, squares=estimated_block_squares(400_000, 2)))
    for n in ("n1", "n2", "n3", "n4"):
        spec = node_object(kube, "d", n)["spec"]
        assert spec["distributed"] == {"replicas": 2, "nodes": 4} and spec["warmableBytes"] == 200_000

    def peer_key() -> str:
        secret = kube.get("v1", "secrets", handover_name(NAMESPACE, "d"), RELEASE_NS)
        return base64.b64decode(secret["data"]["peerKey"]).decode()

    key = peer_key()
    assert len(key) == 64 and int(key, 16)
    assert key not in operator.log(), "the peer key is never logged"
    request = urllib.request.Request(f"{kube.url}/apis/stoker.dev/v1alpha1/namespaces/{NAMESPACE}/datasetcaches/d",
                                     data=json.dumps({"spec": {"policy": "KeepWarm"}}).encode(), method="PATCH",
                                     headers={"Content-Type": "application/merge-patch+json"})
    urllib.request.urlopen(request).close()
    assert kube.wait_for(lambda: node_object(kube, "d", "n1")["spec"]["policy"] == "KeepWarm", 60)
    assert peer_key() == key, "the nodes' running mounts sign with it: a re-plan keeps the key"
