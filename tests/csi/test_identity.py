"""Whom a volume's mount authenticates as, through a real node plugin, its mounter and kubelet's rules,
against a store that enforces IAM (moto) and STS for web identities (tests/support/guarded.py)."""

from __future__ import annotations

import hashlib
import os
import time

import grpc
import pytest

from csi import csi_pb2 as pb
from csi.state import volume_key
from fusecore.process import control
from fusecore.process.mounts import fs_type, is_mounted
from tests.support.kubelet import Kubelet, PodVolume

from .conftest import READ_ONLY_MANY, Plugin, requires_fuse

pytestmark = [pytest.mark.integration, requires_fuse]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def attributes(guarded, **extra) -> dict[str, str]:
    return {"bucket": guarded.bucket, "prefix": "train", "endpointUrl": guarded.endpoint, "region": "us-east-1",
            **extra}


def admin_env(guarded) -> dict[str, str]:
    """The node's own identity, which would be allowed everything. (GETs go through botocore here:
    moto's IAM enforcement cannot check presigned URLs.)"""
    return {"AWS_ACCESS_KEY_ID": guarded.admin["aws_access_key_id"],
            "AWS_SECRET_ACCESS_KEY": guarded.admin["aws_secret_access_key"], "STOKER_BOTOCORE_GETS": "1"}


def stage(plugin: Plugin, volume_id: str, context: dict, secrets: dict | None = None) -> str:
    path = plugin.staging(volume_id)
    plugin.node.NodeStageVolume(pb.NodeStageVolumeRequest(
        volume_id=volume_id, staging_target_path=path, volume_capability=READ_ONLY_MANY, volume_context=context,
        secrets=secrets or {}), timeout=120)
    return path


def refused(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def expected_reads(guarded) -> dict[str, str]:
    return {name.removeprefix("train/"): sha(body) for name, body in guarded.dataset.items()}


def control_socket(plugin: Plugin, volume_id: str) -> str:
    return os.path.join(plugin.state_dir, "run", volume_key(volume_id) + ".sock")


def container_reads(pod) -> dict[str, str]:
    """What the pod's container reads (sha256 of each file, through its rslave view of the target)."""
    return {name: pod.container.read("data", name) for name in sorted(os.listdir(pod.targets["data"]))}


def read_all(root: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(root)):
        with open(os.path.join(root, name), "rb") as f:
            out[name] = sha(f.read())
    return out


@pytest.fixture
def plugin(tmp_path, guarded):
    p = Plugin(tmp_path, env=admin_env(guarded))
    p.start()
    yield p
    p.stop()


def test_a_volume_without_credentials_never_uses_the_nodes(plugin, guarded):
    """Keys that could read everything sit in the plugin's and mounter's environment: a volume without a
    secret is still refused, naming what it lacks, and so is one asking for the node's identity."""
    code, details = refused(lambda: stage(plugin, "bare", attributes(guarded)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "no credentials" in details and "authenticationSource" in details
    code, details = refused(lambda: stage(plugin, "asks-node", attributes(guarded, authenticationSource="node")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "node.allowNodeCredentials" in details
    target = plugin.target("pod-x")
    code, details = refused(lambda: plugin.node.NodePublishVolume(pb.NodePublishVolumeRequest(
        volume_id="inline-bare", target_path=target, volume_capability=READ_ONLY_MANY, readonly=True,
        volume_context=dict(attributes(guarded), **{"csi.storage.k8s.io/ephemeral": "true"})), timeout=60))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "no credentials" in details
    assert not is_mounted(plugin.staging("bare")) and not is_mounted(target)
    assert os.stat(plugin.socket).st_mode & 0o777 == 0o600  # only root (kubelet) reaches the node service


def test_node_credentials_where_the_admin_allowed_them(tmp_path, guarded):
    plugin = Plugin(tmp_path, env=admin_env(guarded), args=("--allow-node-credentials",),
                    mounter_args=("--allow-node-credentials",))
    plugin.start()
    try:
        code, _ = refused(lambda: stage(plugin, "bare", attributes(guarded)))  # still: only when the volume asks
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        path = stage(plugin, "node-identity", attributes(guarded, authenticationSource="node"))
        assert read_all(path) == expected_reads(guarded)
    finally:
        plugin.stop()


def test_other_keys_are_checked_before_they_share_a_mount_then_rotate_it(plugin, guarded):
    path = stage(plugin, "keys", attributes(guarded), guarded.reader)
    sock = control_socket(plugin, "keys")
    code, details = refused(lambda: stage(plugin, "keys", attributes(guarded), guarded.stranger))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "access denied" in details.lower()
    assert control.call(sock, {"op": "stats"})["credential_rotations"] == 0  # the mount kept its keys
    second = guarded.user(f"reader-{os.getpid()}-{id(plugin)}", {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"], "Resource": "*"}]})
    stage(plugin, "keys", attributes(guarded), second)  # rotated keys: checked, then handed to the mount
    stats = control.call(sock, {"op": "stats"})
    assert stats["credential_rotations"] == 1
    control.call(sock, {"op": "drop"})
    assert read_all(path) == expected_reads(guarded)  # fetched again, signed with the new keys
    # Nothing secret reached the state directory or the log.
    for root, _, files in os.walk(plugin.state_dir):
        for name in files:
            if name.endswith((".json", ".log")):
                with open(os.path.join(root, name), "rb") as f:
                    text = f.read()
                for secret in (guarded.reader["secretAccessKey"], second["secretAccessKey"]):
                    assert secret.encode() not in text, name
    secrets_dir = plugin.secrets_dir
    assert os.stat(secrets_dir).st_mode & 0o777 == 0o700
    assert all(os.stat(os.path.join(secrets_dir, n)).st_mode & 0o777 == 0o600 for n in os.listdir(secrets_dir))
    assert "is not on tmpfs" in plugin.log()  # tmp_path is on disk: the plugin says so
    assert second["secretAccessKey"] not in plugin.log()


def test_pod_identity_through_kubelet(tmp_path, guarded):
    """authenticationSource: pod. Kubelet hands the pod's token to NodePublishVolume (never to NodeStage);
    the mount exchanges it with STS for the role's keys; a pod of another service account does not get
    the mount; a republish with a fresh token reaches the running mount, which refreshes with it."""
    root = str(tmp_path / "kubelet")
    plugin = Plugin(tmp_path, kubelet_dir=root, own_namespaces=True, env=admin_env(guarded))
    kubelet = Kubelet(root, plugin.socket, token_audiences=("sts.amazonaws.com",), issue_token=guarded.sts.issue)
    plugin.start()  # after kubelet made its root rshared: the plugin's namespaces are peers of it
    guarded.sts.lifetime = 2  # the role's keys expire at once: every use fetches new ones with the current token
    try:
        volume = PodVolume("data", attributes(guarded, authenticationSource="pod", roleArn=guarded.role_arn,
                                              stsEndpointUrl=guarded.sts.endpoint, kernelCache="false"),
                             handle="pv-pod-identity")
        pod = kubelet.run_pod("trainer-0", [volume], namespace="ml", service_account="trainer")
        assert container_reads(pod) == expected_reads(guarded)
        first = kubelet.tokens["ml/trainer"]
        assert (first, guarded.role_arn, "stoker-ml-trainer") in guarded.sts.exchanges
        staging = kubelet.staging_path("pv-pod-identity")
        assert fs_type(staging) == "fuse.stoker"
        # Another service account's pod on this node: refused, the running mount untouched.
        with pytest.raises(grpc.RpcError) as info:
            kubelet.run_pod("intruder", [volume], namespace="ml", service_account="other")
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and "ml/trainer" in info.value.details()
        # A fresh token arrives with a republish; the old one stops working.
        sock = control_socket(plugin, "pv-pod-identity")
        second = kubelet.rotate_token("ml", "trainer")
        kubelet.republish(pod)
        assert control.call(sock, {"op": "stats"})["credential_rotations"] == 1
        kubelet.republish(pod)  # the same token again: nothing to hand over
        assert control.call(sock, {"op": "stats"})["credential_rotations"] == 1
        guarded.sts.revoke(first)
        time.sleep(2.5)
        control.call(sock, {"op": "drop"})
        assert container_reads(pod) == expected_reads(guarded)  # refreshed with the new token
        assert any(token == second for token, _, _ in guarded.sts.exchanges)
        # The token is a secret: not in the plugin's log, not in the state directory.
        for token in (first, second):
            assert token not in plugin.log()
        for dirpath, _, files in os.walk(plugin.state_dir):
            for name in files:
                if name.endswith(".json"):
                    with open(os.path.join(dirpath, name)) as f:
                        assert second not in f.read()
        kubelet.delete_pod(pod)
        assert not os.path.exists(staging)
    finally:
        guarded.sts.lifetime = None
        kubelet.close()
        plugin.stop()
