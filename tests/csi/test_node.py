"""The node plugin through a real gRPC client on its unix socket, with real FUSE mounts of a moto bucket."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from csi import csi_pb2 as pb
from fusecore.process import control
from fusecore.process.mounts import fs_type, is_mounted, unmount

from tests.support.waiting import unmount_everything_under

from .conftest import READ_ONLY_MANY, SECRETS, make_volumes, requires_fuse, volume_context, wait_until

pytestmark = [pytest.mark.integration, requires_fuse]


def fill(s3, bucket: str, files: dict[str, bytes]) -> None:
    for key, body in files.items():
        s3.put_object(Bucket=bucket, Key=key, Body=body)


def stage(plugin, volume_id, staging, context, secrets=SECRETS, capability=READ_ONLY_MANY):
    return plugin.node.NodeStageVolume(pb.NodeStageVolumeRequest(
        volume_id=volume_id, staging_target_path=staging, volume_capability=capability,
        volume_context=context, secrets=secrets), timeout=120)


def publish(plugin, volume_id, staging, target, context, *, readonly=True, capability=READ_ONLY_MANY, secrets=None):
    return plugin.node.NodePublishVolume(pb.NodePublishVolumeRequest(
        volume_id=volume_id, staging_target_path=staging, target_path=target, volume_capability=capability,
        readonly=readonly, volume_context=context, secrets=secrets or {}), timeout=120)


def unpublish(plugin, volume_id, target):
    return plugin.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=target),
                                           timeout=60)


def unstage(plugin, volume_id, staging):
    return plugin.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(volume_id=volume_id,
                                                                    staging_target_path=staging), timeout=60)


def stage_and_publish(plugin, volume_id: str, ctx: dict, tmp_path) -> tuple[str, str]:
    """Stage at kubelet's staging path and publish at tmp_path/target, as kubelet would; returns both paths."""
    staging, target = plugin.staging(volume_id), plugin.target("pod-a")
    stage(plugin, volume_id, staging, ctx)
    publish(plugin, volume_id, staging, target, ctx)
    return staging, target


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def control_stats(plugin, volume_id: str) -> dict:
    from csi.state import StateDir

    return control.call(StateDir(plugin.state_dir).control_socket(volume_id), {"op": "stats"})


@pytest.fixture
def dataset(s3, bucket):
    files = {f"train/part-{i}.bin": os.urandom(300_000 + i) for i in range(3)}
    files["train/big.bin"] = os.urandom(24 * 1024 * 1024)
    fill(s3, bucket, files)
    return files


def test_identity_and_capabilities(plugin):
    info = plugin.identity.GetPluginInfo(pb.GetPluginInfoRequest())
    assert info.name == "csi.stoker.dev" and info.vendor_version
    caps = plugin.identity.GetPluginCapabilities(pb.GetPluginCapabilitiesRequest())
    assert not [c for c in caps.capabilities if c.service.type == pb.PluginCapability.Service.CONTROLLER_SERVICE]
    assert plugin.identity.Probe(pb.ProbeRequest()).ready.value is True
    node_caps = {c.rpc.type for c in plugin.node.NodeGetCapabilities(pb.NodeGetCapabilitiesRequest()).capabilities}
    assert node_caps == {pb.NodeServiceCapability.RPC.STAGE_UNSTAGE_VOLUME,
                         pb.NodeServiceCapability.RPC.GET_VOLUME_STATS, pb.NodeServiceCapability.RPC.VOLUME_CONDITION}
    assert plugin.node.NodeGetInfo(pb.NodeGetInfoRequest()).node_id == "node-a"


def test_probe_fails_while_the_mounter_is_down(plugin):
    plugin.mounter.kill()
    plugin.mounter.wait()
    code, details = code_of(lambda: plugin.identity.Probe(pb.ProbeRequest()))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "mounter" in details


def test_healthz_fails_while_the_driver_cannot_serve(plugin):
    """What the chart's liveness probe asks: 200 while Probe answers on the driver's own socket."""
    url = f"http://127.0.0.1:{plugin.health_port}/healthz"
    assert urllib.request.urlopen(url, timeout=10).status == 200
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(url.replace("/healthz", "/metrics"), timeout=10)
    assert info.value.code == 404  # it serves /healthz and nothing else
    plugin.mounter.kill()
    plugin.mounter.wait()
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(url, timeout=10)
    assert info.value.code == 503 and "mounter" in info.value.read().decode()
    plugin.start_mounter()

    def healthy() -> bool:
        try:
            return urllib.request.urlopen(url, timeout=10).status == 200
        except urllib.error.HTTPError:
            return False

    assert wait_until(healthy, 30, 0.2)


def test_stage_publish_read_unpublish_unstage(plugin, moto_server, bucket, dataset, tmp_path):
    ctx = volume_context(bucket, moto_server.endpoint, prefix="train", cacheSize="256MiB")
    staging, target = plugin.staging("vol-1"), plugin.target("pod")
    stage(plugin, "vol-1", staging, ctx)
    assert fs_type(staging) == "fuse.stoker"
    publish(plugin, "vol-1", staging, target, ctx)
    assert is_mounted(target)
    for key, body in dataset.items():
        assert read(os.path.join(target, key.removeprefix("train/"))) == body
    with pytest.raises(OSError):
        open(os.path.join(target, "new-file"), "wb")  # read-only
    stats = plugin.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(volume_id="vol-1", volume_path=target))
    assert not stats.volume_condition.abnormal
    usage = stats.usage[0]
    assert usage.unit == pb.VolumeUsage.BYTES and usage.total == 256 * 1024**2 and usage.used > 0
    scrape = urllib.request.urlopen(f"http://127.0.0.1:{plugin.metrics_port}/metrics").read().decode()
    samples = {(s.name, s.labels.get("volume")): s.value
               for family in text_string_to_metric_families(scrape) for s in family.samples}
    assert samples[("stoker_volume_cache_budget_bytes", "vol-1")] == 256 * 1024**2
    assert samples[("stoker_volume_up", "vol-1")] == 1
    assert samples[("stoker_volume_fetched_bytes_total", "vol-1")] >= sum(len(b) for b in dataset.values())
    unpublish(plugin, "vol-1", target)
    assert not is_mounted(target) and not os.path.exists(target)
    unstage(plugin, "vol-1", staging)
    assert not is_mounted(staging)  # confirmed in mountinfo before the call returned


def test_repeated_calls_are_idempotent(plugin, moto_server, bucket, dataset, tmp_path):
    ctx = volume_context(bucket, moto_server.endpoint)
    staging, target = plugin.staging("vol-2"), plugin.target("pod-a")
    for _ in range(2):
        stage(plugin, "vol-2", staging, ctx)
    pid = control_stats(plugin, "vol-2")["pid"]
    for _ in range(2):
        publish(plugin, "vol-2", staging, target, ctx)
    assert control_stats(plugin, "vol-2")["pid"] == pid  # one mount process, not two
    assert read(os.path.join(target, "train/part-0.bin")) == dataset["train/part-0.bin"]
    for _ in range(2):
        unpublish(plugin, "vol-2", target)
    for _ in range(2):
        unstage(plugin, "vol-2", staging)
    assert not is_mounted(staging) and not is_mounted(target)


def test_error_codes(plugin, moto_server, bucket, dataset, tmp_path):
    ctx = volume_context(bucket, moto_server.endpoint)
    staging, target = plugin.staging("v"), plugin.target("pod-a")
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: stage(plugin, "", staging, ctx))[0] == invalid
    assert code_of(lambda: stage(plugin, "v", "", ctx))[0] == invalid
    assert code_of(lambda: plugin.node.NodeStageVolume(pb.NodeStageVolumeRequest(
        volume_id="v", staging_target_path=staging, volume_context=ctx)))[0] == invalid
    block = pb.VolumeCapability(block=pb.VolumeCapability.BlockVolume(),
                                access_mode=pb.VolumeCapability.AccessMode(mode=3))
    assert code_of(lambda: stage(plugin, "v", staging, ctx, capability=block))[0] == grpc.StatusCode.UNIMPLEMENTED
    code, details = code_of(lambda: stage(plugin, "v", staging, dict(ctx, cacheSize="lots")))
    assert code == invalid and "cacheSize" in details
    code, details = code_of(lambda: stage(plugin, "v", staging, dict(ctx, colour="blue")))
    assert code == invalid and "colour" in details
    code, details = code_of(lambda: stage(plugin, "v", staging, dict(ctx, secretAccessKey="misplaced-key-42")))
    assert code == invalid and "secret" in details and "misplaced-key-42" not in details
    code, details = code_of(lambda: stage(plugin, "v", staging, ctx, secrets={"password": "x"}))
    assert code == invalid and "password" in details and "x'" not in details
    code, details = code_of(lambda: stage(plugin, "v", staging, dict(ctx, bucket="no-such-bucket-here")))
    assert code == grpc.StatusCode.NOT_FOUND and "no-such-bucket-here" in details
    assert not is_mounted(staging)
    # publish before stage
    assert code_of(lambda: publish(plugin, "v", staging, target, ctx))[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert code_of(lambda: publish(plugin, "v", "", target, ctx))[0] == invalid
    assert code_of(lambda: publish(plugin, "v", staging, "", ctx))[0] == invalid
    # conflicting re-publish and re-stage
    stage(plugin, "v", staging, ctx)
    publish(plugin, "v", staging, target, ctx)
    writer = pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(),
                                 access_mode=pb.VolumeCapability.AccessMode(mode=1))
    assert code_of(lambda: publish(plugin, "v", staging, target, ctx, capability=writer))[0] == \
        grpc.StatusCode.ALREADY_EXISTS
    assert code_of(lambda: stage(plugin, "v", staging, dict(ctx, prefix="other")))[0] == grpc.StatusCode.ALREADY_EXISTS
    # unstage while published, stats of unknown volumes, what is not offered
    assert code_of(lambda: unstage(plugin, "v", staging))[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert code_of(lambda: plugin.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(
        volume_id="nope", volume_path=target)))[0] == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: plugin.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(
        volume_id="v", volume_path="")))[0] == invalid
    expand = plugin.channel.unary_unary("/csi.v1.Node/NodeExpandVolume")
    assert code_of(lambda: expand(b""))[0] == grpc.StatusCode.UNIMPLEMENTED
    unpublish(plugin, "v", target)
    unstage(plugin, "v", staging)
    assert SECRETS["secretAccessKey"] not in plugin.log()
    assert "misplaced-key-42" not in plugin.log() and "<redacted>" in plugin.log()


def test_two_targets_share_one_mount_and_one_cache(plugin, moto_server, bucket, dataset, tmp_path):
    ctx = volume_context(bucket, moto_server.endpoint)
    staging = plugin.staging("shared")
    targets = [plugin.target(f"pod{i}") for i in range(2)]
    stage(plugin, "shared", staging, ctx)
    for target in targets:
        publish(plugin, "shared", staging, target, ctx)
    body = dataset["train/big.bin"]
    assert read(os.path.join(targets[0], "train/big.bin")) == body
    gets_after_first = control_stats(plugin, "shared")["requests"]["get"]
    assert read(os.path.join(targets[1], "train/big.bin")) == body
    assert control_stats(plugin, "shared")["requests"]["get"] == gets_after_first  # no new GET: one shared cache
    assert os.stat(targets[0]).st_dev == os.stat(targets[1]).st_dev == os.stat(staging).st_dev  # one mount
    for target in targets:
        unpublish(plugin, "shared", target)
    unstage(plugin, "shared", staging)


def test_ephemeral_inline_volume(plugin, moto_server, bucket, dataset, tmp_path):
    ctx = volume_context(bucket, moto_server.endpoint, prefix="train", **{"csi.storage.k8s.io/ephemeral": "true",
                                                                        "csi.storage.k8s.io/pod.name": "trainer-0"})
    target = plugin.target("pod-inline")
    cap = pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(),
                              access_mode=pb.VolumeCapability.AccessMode(mode=1))
    for _ in range(2):
        publish(plugin, "csi-inline-1", "", target, ctx, capability=cap, readonly=False, secrets=SECRETS)
    assert fs_type(target) == "fuse.stoker"
    assert read(os.path.join(target, "part-1.bin")) == dataset["train/part-1.bin"]
    unpublish(plugin, "csi-inline-1", target)
    assert not is_mounted(target) and not os.path.exists(target)


def test_server_killed_while_reading_leaves_the_mount_serving(plugin, moto_server, bucket, dataset, tmp_path):
    ctx = volume_context(bucket, moto_server.endpoint, blockSize="1MiB")
    staging, target = stage_and_publish(plugin, "survivor", ctx, tmp_path)
    result, started = {}, threading.Event()

    def reader():
        digest = hashlib.sha256()
        with open(os.path.join(target, "train/big.bin"), "rb", buffering=0) as f:
            while chunk := f.read(256 * 1024):
                digest.update(chunk)
                started.set()
        result["sha"] = digest.hexdigest()

    thread = threading.Thread(target=reader)
    thread.start()
    assert started.wait(60)
    plugin.kill_server()
    thread.join(120)
    assert result["sha"] == hashlib.sha256(dataset["train/big.bin"]).hexdigest()
    assert read(os.path.join(target, "train/part-2.bin")) == dataset["train/part-2.bin"]
    # A new server finds the volume in its state directory and serves it.
    plugin.start()
    stats = plugin.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(volume_id="survivor", volume_path=target))
    assert not stats.volume_condition.abnormal
    unpublish(plugin, "survivor", target)
    unstage(plugin, "survivor", staging)
    assert not is_mounted(staging)


def test_killed_mount_process_is_replaced_and_targets_rebound(plugin, moto_server, bucket, dataset, tmp_path):
    ctx = volume_context(bucket, moto_server.endpoint)
    staging, target = stage_and_publish(plugin, "phoenix", ctx, tmp_path)
    path = os.path.join(target, "train/part-0.bin")
    assert read(path) == dataset["train/part-0.bin"]
    old_pid = control_stats(plugin, "phoenix")["pid"]
    os.kill(old_pid, signal.SIGKILL)

    def serves_again() -> bool:
        try:
            return read(path) == dataset["train/part-0.bin"]
        except OSError:
            return False

    assert wait_until(serves_again, 60, 0.2), plugin.log()
    assert control_stats(plugin, "phoenix")["pid"] != old_pid
    assert "recovered" in plugin.log()
    stats = plugin.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(volume_id="phoenix", volume_path=target))
    assert not stats.volume_condition.abnormal
    unpublish(plugin, "phoenix", target)
    unstage(plugin, "phoenix", staging)


def test_start_up_repairs_a_mount_that_died_while_the_plugin_was_down(plugin, moto_server, bucket, dataset,
                                                                       tmp_path):
    ctx = volume_context(bucket, moto_server.endpoint)
    staging, target = stage_and_publish(plugin, "lazarus", ctx, tmp_path)
    plugin.kill_server()
    os.kill(control_stats(plugin, "lazarus")["pid"], signal.SIGKILL)
    with pytest.raises(OSError):
        read(os.path.join(target, "train/part-0.bin"))  # transport endpoint is not connected
    plugin.start()  # repairs before it serves
    assert read(os.path.join(target, "train/part-0.bin")) == dataset["train/part-0.bin"]
    unpublish(plugin, "lazarus", target)
    unstage(plugin, "lazarus", staging)


def test_without_a_separate_mounter_mounts_outlive_the_server(local_plugin, moto_server, bucket, dataset, tmp_path):
    ctx = volume_context(bucket, moto_server.endpoint)
    staging, target = stage_and_publish(local_plugin, "local", ctx, tmp_path)
    local_plugin.kill_server()
    assert read(os.path.join(target, "train/part-1.bin")) == dataset["train/part-1.bin"]
    local_plugin.start()
    unpublish(local_plugin, "local", target)
    unstage(local_plugin, "local", staging)
    assert not is_mounted(staging)


def test_a_held_volume_is_warmed_before_stage_and_kept_after_unstage(moto_server, bucket, dataset, tmp_path):
    from csi.volumes import kubelet_staging_path

    kubelet_dir = str(tmp_path / "kubelet")
    volumes = make_volumes(tmp_path, kubelet_dir=kubelet_dir)
    ctx = volume_context(bucket, moto_server.endpoint, prefix="train")
    staging = kubelet_staging_path(kubelet_dir, "held")  # where kubelet will stage it
    sock = volumes.hold("held", ctx, SECRETS, "ml/imagenet", 96 * 1024**2)
    try:
        assert fs_type(staging) == "fuse.stoker"  # the held mount waits where kubelet stages, and nowhere else
        final = list(control.request(sock, {"op": "warm", "paths": []}, timeout=120))[-1]
        assert final["bytes_done"] == sum(len(b) for b in dataset.values()) and final["errors"] == 0
        stats = control.call(sock, {"op": "stats"})
        assert stats["cache"]["budget"] == 96 * 1024**2
        gets = stats["requests"]["get"]
        volumes.stage("held", staging, ctx, SECRETS)
        for key, body in dataset.items():
            assert read(os.path.join(staging, key.removeprefix("train/"))) == body
        assert control.call(sock, {"op": "stats"})["requests"]["get"] == gets  # served by the warmed cache
        # A second DatasetCache with a larger plan grows the live cache; letting go shrinks it back.
        volumes.hold("held", ctx, SECRETS, "ml/bigger", 128 * 1024**2)
        assert control.call(sock, {"op": "stats"})["cache"]["budget"] == 128 * 1024**2
        volumes.release("held", "ml/bigger")
        assert control.call(sock, {"op": "stats"})["cache"]["budget"] == 96 * 1024**2
        volumes.unstage("held", staging)
        assert is_mounted(staging) and control.call(sock, {"op": "stats"})["pid"] == stats["pid"]  # still held
        volumes.release("held", "ml/imagenet")
        assert not is_mounted(staging) and volumes.state.records() == []
        assert not os.path.exists(staging)
    finally:
        unmount_everything_under(kubelet_dir)


def test_a_broken_volume_is_reported_abnormal_until_repaired(slow_repair_plugin, moto_server, bucket, dataset,
                                                              tmp_path):
    plugin = slow_repair_plugin
    ctx = volume_context(bucket, moto_server.endpoint)
    staging, target = stage_and_publish(plugin, "sick", ctx, tmp_path)
    os.kill(control_stats(plugin, "sick")["pid"], signal.SIGKILL)
    request = pb.NodeGetVolumeStatsRequest(volume_id="sick", volume_path=target)
    assert wait_until(lambda: plugin.node.NodeGetVolumeStats(request).volume_condition.abnormal, 10)
    condition = plugin.node.NodeGetVolumeStats(request).volume_condition
    assert "mount process" in condition.message or "gone" in condition.message
    stage(plugin, "sick", staging, ctx)  # kubelet's periodic re-stage repairs it too
    assert read(os.path.join(target, "train/part-2.bin")) == dataset["train/part-2.bin"]
    assert not plugin.node.NodeGetVolumeStats(request).volume_condition.abnormal
    unpublish(plugin, "sick", target)
    unstage(plugin, "sick", staging)


def test_start_up_drops_volumes_whose_paths_kubelet_removed(plugin, moto_server, bucket, dataset, tmp_path):
    from csi.state import StateDir

    ctx = volume_context(bucket, moto_server.endpoint)
    staging, target = stage_and_publish(plugin, "gone", ctx, tmp_path)
    plugin.kill_server()
    # What a node reboot leaves: no mounts, and kubelet removed the directories of pods that went away.
    os.kill(control_stats(plugin, "gone")["pid"], signal.SIGKILL)
    for path in (target, staging):
        assert unmount(path) is None
    os.rmdir(target)
    os.rmdir(staging)
    plugin.start()
    assert StateDir(plugin.state_dir).records() == []
    assert "dropped paths kubelet removed" in plugin.log()


def test_wrong_credentials_are_permission_denied_and_never_logged(plugin, tmp_path):
    from stoker.s3server import MotoServer

    staging = plugin.staging("denied")
    with MotoServer(env={"INITIAL_NO_AUTH_ACTION_COUNT": "1"}) as guarded:
        import boto3

        boto3.client("s3", endpoint_url=guarded.endpoint).create_bucket(Bucket="guarded")
        secrets = {"accessKeyId": "AKIAWRONG", "secretAccessKey": "wrong-secret-value-77"}
        code, details = code_of(lambda: stage(plugin, "denied", staging, volume_context("guarded", guarded.endpoint),
                                              secrets=secrets))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "access denied" in details.lower()
    assert "wrong-secret-value-77" not in details + plugin.log()
    assert not is_mounted(staging)


def test_start_up_unmounts_mounts_no_record_names(plugin, moto_server, bucket, dataset, tmp_path):
    import subprocess
    import sys

    from csi.volumes import kubelet_staging_path

    plugin.kill_server()
    orphan = kubelet_staging_path(plugin.kubelet_dir, "orphan")
    os.makedirs(orphan)
    subprocess.run([sys.executable, "-m", "stoker", "mount", f"s3://{bucket}", orphan, "--endpoint-url",
                    moto_server.endpoint, "--log-file", str(tmp_path / "orphan.log")], check=True, timeout=120)
    assert fs_type(orphan) == "fuse.stoker"
    plugin.start()
    assert not is_mounted(orphan)
    assert "no volume record names it" in plugin.log()


def test_caches_never_add_up_to_more_than_the_nodes_cache_memory(tmp_path, moto_server, bucket, dataset):
    """--node-cache-memory (the chart's node.cacheMemory, the mounter's memory limit): a volume whose cache
    does not fit what the others left is refused with RESOURCE_EXHAUSTED and the numbers; freeing one fits it."""
    from .conftest import Plugin

    plugin = Plugin(tmp_path, args=("--node-cache-memory", "200MiB"))
    plugin.start()
    try:
        stage(plugin, "first", plugin.staging("first"), volume_context(bucket, moto_server.endpoint, cacheSize="128MiB"))
        code, details = code_of(lambda: stage(plugin, "second", plugin.staging("second"), volume_context(
            bucket, moto_server.endpoint, cacheSize="128MiB")))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "128.0 MiB" in details and "of 200.0 MiB" in details and "first" in details
        assert not is_mounted(plugin.staging("second"))
        code, details = code_of(lambda: stage(plugin, "huge", plugin.staging("huge"), volume_context(
            bucket, moto_server.endpoint, cacheSize="100Ti")))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "100.0 TiB cache" in details  # no 100Ti cache anywhere
        stage(plugin, "small", plugin.staging("small"), volume_context(bucket, moto_server.endpoint, cacheSize="64MiB"))
        unstage(plugin, "first", plugin.staging("first"))
        stage(plugin, "second", plugin.staging("second"), volume_context(bucket, moto_server.endpoint,
                                                                       cacheSize="128MiB"))
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{plugin.metrics_port}/metrics", timeout=10).read().decode()
        values = {s.name: s.value for family in text_string_to_metric_families(metrics) for s in family.samples}
        assert values["stoker_node_cache_budget_bytes"] == 192 * 1024**2
        assert values["stoker_node_cache_memory_bytes"] == 200 * 1024**2
    finally:
        plugin.stop()



READ_WRITE_MANY = pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(),
                                      access_mode=pb.VolumeCapability.AccessMode(
                                          mode=pb.VolumeCapability.AccessMode.MULTI_NODE_MULTI_WRITER))


def test_a_writable_volume_is_written_through_read_write_targets_only(plugin, moto_server, s3, bucket, tmp_path):
    """A PV with `writable: "true"` (ReadWriteMany): kubelet publishes readonly=false for a pod that writes, true for
    one that mounts it readOnly; both share the volume's one mount."""
    import errno

    ctx = volume_context(bucket, moto_server.endpoint, prefix="out", writable="true")
    staging, writer, reader = plugin.staging("vol-w"), plugin.target("pod-w"), plugin.target("pod-r")
    stage(plugin, "vol-w", staging, ctx, capability=READ_WRITE_MANY)
    publish(plugin, "vol-w", staging, writer, ctx, readonly=False, capability=READ_WRITE_MANY)
    publish(plugin, "vol-w", staging, reader, ctx, readonly=True, capability=READ_WRITE_MANY)
    data = os.urandom(3 * 1024 * 1024 + 7)
    os.makedirs(os.path.join(writer, "ckpt"), exist_ok=True)
    with open(os.path.join(writer, "ckpt", "step-1.pt"), "wb") as f:
        f.write(data)
    assert s3.get_object(Bucket=bucket, Key="out/ckpt/step-1.pt")["Body"].read() == data
    assert read(os.path.join(reader, "ckpt", "step-1.pt")) == data  # the reader's view: the same mount
    with pytest.raises(OSError) as caught:
        open(os.path.join(reader, "ckpt", "other.pt"), "wb")
    assert caught.value.errno == errno.EROFS
    assert control_stats(plugin, "vol-w")["writes"]["uploads_completed"] == 1
    for target in (writer, reader):
        unpublish(plugin, "vol-w", target)
    unstage(plugin, "vol-w", staging)


def test_a_pod_never_makes_a_volume_writable(plugin, moto_server, s3, bucket, tmp_path):
    import errno

    s3.put_object(Bucket=bucket, Key="data/x", Body=b"x")
    ctx = volume_context(bucket, moto_server.endpoint)  # a PV that does not say writable
    staging, target = plugin.staging("vol-ro"), plugin.target("pod-a")
    stage(plugin, "vol-ro", staging, ctx, capability=READ_WRITE_MANY)
    publish(plugin, "vol-ro", staging, target, ctx, readonly=False, capability=READ_WRITE_MANY)
    assert read(os.path.join(target, "data", "x")) == b"x"
    with pytest.raises(OSError) as caught:
        open(os.path.join(target, "data", "y"), "wb")
    assert caught.value.errno == errno.EROFS
    # an inline volume's attributes are the pod's: asking writable there is refused
    inline = volume_context(bucket, moto_server.endpoint, writable="true", **{"csi.storage.k8s.io/ephemeral": "true"})
    code, details = code_of(lambda: publish(plugin, "csi-inline-w", "", plugin.target("pod-i"), inline,
                                            readonly=False, capability=READ_WRITE_MANY, secrets=SECRETS))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "writable" in details
    # nor the node's processes (workers: a PV's or a StorageClass's choice)
    inline = volume_context(bucket, moto_server.endpoint, workers="8", **{"csi.storage.k8s.io/ephemeral": "true"})
    code, details = code_of(lambda: publish(plugin, "csi-inline-n", "", plugin.target("pod-n"), inline,
                                            readonly=True, capability=READ_WRITE_MANY, secrets=SECRETS))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "workers" in details
    unpublish(plugin, "vol-ro", target)
    unstage(plugin, "vol-ro", staging)
