"""Whole pod lifecycles through tests/support/kubelet.py: kubelet's real rules (paths, call order, the
unstage refs check) and containers with an rslave view of their targets, against the real node plugin
and mounter, each in its own mount namespace as in the DaemonSet (kubelet dir Bidirectional)."""

from __future__ import annotations

import hashlib
import os
import signal
import stat
import subprocess
import threading
import time

import grpc
import pytest

from fusecore.process import control
from fusecore.process.launch import ended
from fusecore.process.mounts import mount_table
from tests.support.kubelet import Kubelet, PodVolume, UnstageRefused, device_mount_refs, has_mount_refs

from .conftest import SECRETS, Plugin, make_volumes, requires_fuse, volume_context, wait_until

pytestmark = [pytest.mark.integration, requires_fuse]


def sha(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


@pytest.fixture
def dataset(s3, bucket):
    files = {f"train/part-{i}.bin": os.urandom(200_000 + i) for i in range(3)}
    files["train/big.bin"] = os.urandom(16 * 1024 * 1024)
    for key, body in files.items():
        s3.put_object(Bucket=bucket, Key=key, Body=body)
    return files


@pytest.fixture
def node(tmp_path, moto_server):
    """A node: kubelet's root, the plugin and mounter in their own namespaces, and the kubelet emulation."""
    root = str(tmp_path / "kubelet")
    os.makedirs(root)
    plugin = Plugin(tmp_path, kubelet_dir=root, own_namespaces=True)
    kubelet = Kubelet(root, plugin.socket)
    plugin.start()
    kubelet.reconnect(plugin.socket)
    yield plugin, kubelet
    kubelet.close()
    plugin.stop()


def pv(bucket, endpoint, handle="pv-imagenet", **extra) -> PodVolume:
    return PodVolume("data", volume_context(bucket, endpoint, prefix="train", **extra), handle=handle,
                     stage_secrets=SECRETS)


def stoker_mounts(under: str) -> list[str]:
    """Stoker mounts left below `under` (other mounts of the machine are not this test's)."""
    return [m.point for m in mount_table() if m.fs_type == "fuse.stoker" and m.point.startswith(under)]


def mount_pid(plugin, volume_id: str) -> int:
    from csi.state import StateDir

    return control.call(StateDir(plugin.state_dir).control_socket(volume_id), {"op": "stats"})["pid"]


def test_the_emulated_refs_check_refuses_a_private_mount_elsewhere(tmp_path):
    """The rule the emulation applies can fail: a second mount of the staging filesystem outside
    kubelet's path (what the old private mount was) is a reference, kubelet's own binds are not."""
    root = tmp_path / "root"
    staging = root / "plugins/kubernetes.io/csi/csi.stoker.dev/abc/globalmount"
    private, source = tmp_path / "state/mounts/abc", tmp_path / "fs"
    for path in (staging, private, source):
        path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(source)], check=True)
    try:
        subprocess.run(["mount", "--bind", str(source), str(staging)], check=True)
        assert device_mount_refs(str(staging)) == [str(source)]
        assert has_mount_refs(str(staging), device_mount_refs(str(staging)))
        subprocess.run(["umount", str(source)], check=True)
        assert not has_mount_refs(str(staging), device_mount_refs(str(staging)))
        subprocess.run(["mount", "--bind", str(staging), str(private)], check=True)
        assert has_mount_refs(str(staging), device_mount_refs(str(staging)))
    finally:
        for path in (private, staging, source):
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_two_pods_share_one_cache_and_the_volume_is_unstaged_after_both(node, moto_server, bucket, dataset):
    plugin, kubelet = node
    volume = pv(bucket, moto_server.endpoint)
    a = kubelet.run_pod("trainer-a", [volume])
    assert a.container.read("data", "big.bin") == sha(dataset["train/big.bin"])
    from csi.state import StateDir

    sock = StateDir(plugin.state_dir).control_socket("pv-imagenet")
    pid, gets = mount_pid(plugin, "pv-imagenet"), control.call(sock, {"op": "stats"})["requests"]["get"]
    b = kubelet.run_pod("trainer-b", [volume])
    assert b.container.read("data", "big.bin") == sha(dataset["train/big.bin"])
    assert mount_pid(plugin, "pv-imagenet") == pid  # one mount process for both pods
    assert control.call(sock, {"op": "stats"})["requests"]["get"] == gets  # the second pod read from the cache
    staging = kubelet.staging_path("pv-imagenet")
    assert stoker_mounts(str(plugin.tmp_path)).count(staging) == 1 and not [p for p in stoker_mounts(str(plugin.tmp_path)) if p.startswith(plugin.state_dir)]
    kubelet.delete_pod(a)
    assert b.container.read("data", "part-1.bin") == sha(dataset["train/part-1.bin"])
    kubelet.delete_pod(b)  # the refs check passes and NodeUnstageVolume runs
    assert kubelet.refused == [] and kubelet.staged == {}
    assert wait_until(lambda: ended(pid), 10), "the mount process (and its cache) outlived the volume"
    assert stoker_mounts(str(plugin.tmp_path)) == []
    assert not os.path.exists(os.path.dirname(staging))  # kubelet's removeMountDir cleaned up


def test_a_container_reads_again_after_its_mount_process_is_killed_mid_read(node, moto_server, bucket, dataset):
    plugin, kubelet = node
    volume = pv(bucket, moto_server.endpoint, blockSize="1MiB", maxPrefetch="2MiB")
    pod = kubelet.run_pod("trainer", [volume])
    other = kubelet.run_pod("evaluator", [volume])
    assert pod.container.read("data", "part-0.bin") == sha(dataset["train/part-0.bin"])
    pid = mount_pid(plugin, "pv-imagenet")
    results: list[str] = []
    reader = threading.Thread(target=lambda: results.append(pod.container.read("data", "big.bin", timeout=60)))
    reader.start()
    time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    reader.join(90)
    assert results and results[0] in (sha(dataset["train/big.bin"]), "errno 107", "errno 103", "errno 5"), results
    killed_at = time.monotonic()

    def reads_right() -> bool:
        return pod.container.read("data", "big.bin") == sha(dataset["train/big.bin"])

    assert wait_until(reads_right, 30, 0.2), plugin.log()
    recovered_in = time.monotonic() - killed_at
    assert other.container.read("data", "part-2.bin") == sha(dataset["train/part-2.bin"])
    assert mount_pid(plugin, "pv-imagenet") != pid
    assert not kubelet.volume_stats(pod, "data").volume_condition.abnormal
    print(f"container read the right bytes again {recovered_in:.1f}s after kill -9")
    kubelet.delete_pod(other)  # unmounting its stacked layers must not travel back to the staging mount
    assert pod.container.read("data", "part-1.bin") == sha(dataset["train/part-1.bin"])
    assert not kubelet.volume_stats(pod, "data").volume_condition.abnormal
    kubelet.delete_pod(pod)  # every stacked layer goes; the refs check still passes
    assert kubelet.refused == [] and stoker_mounts(str(plugin.tmp_path)) == []


def test_a_volume_served_by_two_workers_outlives_a_worker_and_its_hub_is_repaired(node, moto_server, bucket,
                                                                                   dataset):
    """`workers: "2"` in the PV: the volume's mount is a hub and two workers (fusecore/process/workers.py). A worker
    killed is started again by its hub, the same mount; the hub killed takes its workers, and the plugin's repair
    reaches the running container as for a mount of one process."""
    from csi.state import StateDir

    plugin, kubelet = node
    pod = kubelet.run_pod("trainer", [pv(bucket, moto_server.endpoint, workers="2", blockSize="1MiB",
                                         cacheSize="64MiB")])
    assert pod.container.read("data", "part-0.bin") == sha(dataset["train/part-0.bin"])
    sock = StateDir(plugin.state_dir).control_socket("pv-imagenet")
    stats = control.call(sock, {"op": "stats"})
    hub, workers = stats["pid"], stats["workers"]["pids"]
    assert len(workers) == 2 and hub not in workers
    os.kill(workers[0], signal.SIGKILL)
    assert wait_until(lambda: control.call(sock, {"op": "stats"})["workers"]["restarts"] >= 1, 15)
    assert pod.container.read("data", "big.bin") == sha(dataset["train/big.bin"])
    assert mount_pid(plugin, "pv-imagenet") == hub  # the same mount: no repair was needed
    workers = control.call(sock, {"op": "stats"})["workers"]["pids"]
    os.kill(hub, signal.SIGKILL)

    def repaired() -> bool:  # (until its workers are gone too, the dead hub's connection may still answer reads)
        try:
            return mount_pid(plugin, "pv-imagenet") != hub
        except (OSError, control.ControlError):  # (the dead hub's socket: refused, or reset mid-answer)
            return False

    assert wait_until(repaired, 30, 0.2), plugin.log()
    assert wait_until(lambda: pod.container.read("data", "part-1.bin") == sha(dataset["train/part-1.bin"]), 30,
                      0.2), plugin.log()
    assert wait_until(lambda: all(ended(pid) for pid in workers), 15), "a dead hub's workers outlived it"
    kubelet.delete_pod(pod)
    assert kubelet.refused == [] and stoker_mounts(str(plugin.tmp_path)) == []


def test_a_mount_that_died_while_the_plugin_was_down_is_repaired_for_the_container(node, moto_server, bucket,
                                                                                    dataset):
    plugin, kubelet = node
    pod = kubelet.run_pod("trainer", [pv(bucket, moto_server.endpoint)])
    plugin.kill_server()
    os.kill(mount_pid(plugin, "pv-imagenet"), signal.SIGKILL)
    assert pod.container.read("data", "part-0.bin", timeout=10).startswith("errno")
    plugin.start()  # repairs before it serves
    kubelet.reconnect(plugin.socket)
    assert pod.container.read("data", "part-0.bin") == sha(dataset["train/part-0.bin"])
    kubelet.delete_pod(pod)
    assert kubelet.refused == [] and stoker_mounts(str(plugin.tmp_path)) == []


def test_repair_with_a_short_metadata_ttl_keeps_the_volume(node, moto_server, bucket, dataset):
    """A dead mount answers ENOTCONN; that must never be taken for a directory kubelet removed."""
    plugin, kubelet = node
    pod = kubelet.run_pod("trainer", [pv(bucket, moto_server.endpoint, metadataTTL="1")])
    assert pod.container.read("data", "part-1.bin") == sha(dataset["train/part-1.bin"])
    time.sleep(1.2)
    os.kill(mount_pid(plugin, "pv-imagenet"), signal.SIGKILL)
    assert wait_until(lambda: pod.container.read("data", "part-1.bin") == sha(dataset["train/part-1.bin"]),
                      30, 0.2), plugin.log()
    assert not kubelet.volume_stats(pod, "data").volume_condition.abnormal
    assert "dropped paths kubelet removed" not in plugin.log()
    kubelet.delete_pod(pod)
    assert stoker_mounts(str(plugin.tmp_path)) == []


def test_an_inline_volume_is_repaired_inside_the_container_and_cleaned_up(node, moto_server, bucket, dataset):
    plugin, kubelet = node
    inline = PodVolume("scratch", volume_context(bucket, moto_server.endpoint, prefix="train"),
                       publish_secrets=SECRETS)
    pod = kubelet.run_pod("notebook", [inline])
    assert pod.container.read("scratch", "part-0.bin") == sha(dataset["train/part-0.bin"])
    handle = pod.handles["scratch"]
    os.kill(mount_pid(plugin, handle), signal.SIGKILL)
    assert wait_until(lambda: pod.container.read("scratch", "part-0.bin") == sha(dataset["train/part-0.bin"]),
                      30, 0.2), plugin.log()
    pid = mount_pid(plugin, handle)
    kubelet.delete_pod(pod)
    assert wait_until(lambda: ended(pid), 10) and stoker_mounts(str(plugin.tmp_path)) == []


def test_a_dataset_cache_holds_the_volume_across_pods(tmp_path, moto_server, bucket, dataset):
    """The warm agent's hold (in-process here, as inside `stoker csi`) mounts where kubelet will stage;
    pods come and go, the cache stays warm, and letting go gives the memory back."""
    import argparse

    from csi.mounter import RemoteMounter
    from csi.server import build_server

    root = str(tmp_path / "kubelet")
    os.makedirs(root)
    plugin = Plugin(tmp_path, kubelet_dir=root, own_namespaces=True)
    kubelet = Kubelet(root, plugin.socket)
    plugin.start_mounter()
    volumes = make_volumes(tmp_path, RemoteMounter(plugin.mounter_socket), kubelet_dir=root)
    server = build_server(argparse.Namespace(mode="node", node_id="node-a"), volumes.mounter, volumes)
    server.add_insecure_port(f"unix://{plugin.socket}")
    server.start()
    try:
        kubelet.reconnect(plugin.socket)
        volume = pv(bucket, moto_server.endpoint)
        sock = volumes.hold("pv-imagenet", volume.attributes, SECRETS, "training/imagenet", 64 * 1024**2)
        final = list(control.request(sock, {"op": "warm", "paths": []}, timeout=120))[-1]
        assert final["errors"] == 0
        gets = control.call(sock, {"op": "stats"})["requests"]["get"]
        pid = control.call(sock, {"op": "stats"})["pid"]
        for name in ("epoch-1", "epoch-2"):
            pod = kubelet.run_pod(name, [volume])
            assert pod.container.read("data", "big.bin") == sha(dataset["train/big.bin"])
            kubelet.delete_pod(pod)  # unstaged: the refs check passes, the held mount stays
            assert kubelet.refused == [] and kubelet.staged == {}
            assert control.call(sock, {"op": "stats"})["pid"] == pid
        assert control.call(sock, {"op": "stats"})["requests"]["get"] == gets  # both pods read the warm cache
        volumes.release("pv-imagenet", "training/imagenet")
        assert wait_until(lambda: ended(pid), 10) and stoker_mounts(str(plugin.tmp_path)) == []
    finally:
        server.stop(0)
        kubelet.close()
        plugin.stop()


def test_the_old_private_mount_layout_would_be_refused(tmp_path, node, moto_server, bucket, dataset):
    """The emulation catches the bug it was built for: a second mount outside kubelet's path."""
    plugin, kubelet = node
    pod = kubelet.run_pod("trainer", [pv(bucket, moto_server.endpoint)])
    private = tmp_path / "private"
    private.mkdir()
    subprocess.run(["mount", "--bind", kubelet.staging_path("pv-imagenet"), str(private)], check=True)
    kubelet.unstage_attempts, kubelet.retry_pause = 2, 0.1
    with pytest.raises(UnstageRefused, match="still mounted by other references"):
        kubelet.delete_pod(pod)
    subprocess.run(["umount", str(private)], check=True)
    assert "pv-imagenet" in kubelet.staged  # still staged: kubelet would retry
    kubelet._unmount_device("pv-imagenet")  # its retry, once the reference is gone
    assert stoker_mounts(str(plugin.tmp_path)) == []


def test_a_provisioned_volume_mounts_in_a_pod_and_deletes_with_one_credentials_secret(tmp_path, moto_server, s3,
                                                                                      bucket):
    """The example StorageClass's flow: the external-provisioner calls CreateVolume with the provisioner
    secret, kubelet stages with the node-stage secret (the same Secret: credentials only), DeleteVolume
    finds the store from the volume id alone."""
    import yaml

    from csi import csi_pb2 as pb
    from tests.support.kubelet import READ_ONLY_MANY

    with open(os.path.join(os.path.dirname(__file__), "../../deploy/examples/storageclass.yaml")) as f:
        storage_class = next(d for d in yaml.safe_load_all(f) if d and d["kind"] == "StorageClass")
    params = {k: v for k, v in storage_class["parameters"].items() if not k.startswith("csi.storage.k8s.io/")}
    params.update(bucket=bucket, endpointUrl=moto_server.endpoint, region="us-east-1")
    root = str(tmp_path / "kubelet")
    os.makedirs(root)
    plugin = Plugin(tmp_path, mode="all", kubelet_dir=root, own_namespaces=True)
    kubelet = Kubelet(root, plugin.socket)
    plugin.start()
    try:
        kubelet.reconnect(plugin.socket)
        for policy in ("Retain", "Delete"):
            made = plugin.controller.CreateVolume(pb.CreateVolumeRequest(
                name=f"pvc-{policy.lower()}", capacity_range=pb.CapacityRange(required_bytes=1024**3),
                volume_capabilities=[READ_ONLY_MANY], parameters=dict(params, onDelete=policy),
                secrets=SECRETS), timeout=60).volume
            body = os.urandom(300_000)
            s3.put_object(Bucket=bucket, Key=made.volume_context["prefix"] + "shard-0", Body=body)
            volume = PodVolume("data", dict(made.volume_context), handle=made.volume_id, stage_secrets=SECRETS)
            pod = kubelet.run_pod("writer", [volume])
            assert pod.container.read("data", "shard-0") == sha(body)
            kubelet.delete_pod(pod)
            assert kubelet.refused == []
            plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=made.volume_id, secrets=SECRETS),
                                           timeout=60)
            left = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])}
            prefix = made.volume_context["prefix"]
            expected = {prefix + "shard-0"} if policy == "Retain" else set()
            assert {k for k in left if k.startswith(prefix)} == expected
        assert SECRETS["secretAccessKey"] not in plugin.log()
    finally:
        kubelet.close()
        plugin.stop()



def test_a_volume_s_disk_cache_survives_its_mount_and_leaves_with_the_volume(tmp_path, moto_server, bucket, dataset):
    """diskCacheSize as kubelet drives it: a 0700 folder of --disk-cache-root for the volume, within
    --node-disk-cache (a second volume that does not fit is refused); after kill -9 of the mount, the container
    reads through the repaired mount from that folder, not the store; after the pod, unstage removes it."""
    from csi.state import StateDir

    root, disk = str(tmp_path / "kubelet"), tmp_path / "nvme"
    os.makedirs(root)
    disk.mkdir()
    plugin = Plugin(tmp_path, kubelet_dir=root, own_namespaces=True,
                    args=("--disk-cache-root", str(disk), "--node-disk-cache", "96MiB"),
                    mounter_args=("--disk-cache-root", str(disk)))
    kubelet = Kubelet(root, plugin.socket)
    plugin.start()
    kubelet.reconnect(plugin.socket)
    try:
        volume = pv(bucket, moto_server.endpoint, diskCacheSize="64MiB", cacheSize="8MiB", kernelCache="false")
        pod = kubelet.run_pod("trainer", [volume])
        expected = {name.removeprefix("train/"): sha(body) for name, body in dataset.items()}
        assert {name: pod.container.read("data", name) for name in expected} == expected
        sock = StateDir(plugin.state_dir).control_socket("pv-imagenet")
        folder = control.call(sock, {"op": "stats"})["disk"]["directory"]
        assert os.path.dirname(folder) == str(disk) and stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        assert wait_until(lambda: control.call(sock, {"op": "stats"})["disk"]["written"] >= 7, 15)

        with pytest.raises(grpc.RpcError) as refused:
            kubelet.run_pod("other", [pv(bucket, moto_server.endpoint, handle="pv-other", diskCacheSize="64MiB")])
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "64.0 MiB of 96.0 MiB" in refused.value.details() and os.listdir(disk) == [os.path.basename(folder)]

        pid = mount_pid(plugin, "pv-imagenet")
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: pod.container.read("data", "big.bin") == expected["big.bin"], 30, 0.2), plugin.log()
        assert {name: pod.container.read("data", name) for name in expected} == expected
        stats = control.call(sock, {"op": "stats"})
        assert stats["pid"] != pid and stats["requests"]["get"] == 0 and stats["disk"]["directory"] == folder, stats

        kubelet.delete_pod(pod)  # the refs check passes and NodeUnstageVolume runs
        assert kubelet.refused == [] and not os.path.exists(folder) and os.listdir(disk) == []
    finally:
        kubelet.close()
        plugin.stop()


def test_a_writable_volume_is_written_by_the_pod_whose_claim_may_write_and_read_by_the_others(node, s3, bucket,
                                                                                             moto_server):
    """A PV with `writable: "true"` and accessModes [ReadWriteMany]: kubelet stages and publishes it as
    MULTI_NODE_MULTI_WRITER, readonly from each pod's claim. The trainer writes a checkpoint through its container's
    view; an evaluator whose claim is readOnly reads it and cannot write; nothing is left open at the store."""
    plugin, kubelet = node
    attributes = volume_context(bucket, moto_server.endpoint, prefix="results", writable="true")
    writer = kubelet.run_pod("trainer", [PodVolume("out", attributes, handle="pv-results", stage_secrets=SECRETS,
                                                   access_mode="ReadWriteMany", read_only=False)])
    reader = kubelet.run_pod("evaluator", [PodVolume("out", attributes, handle="pv-results", stage_secrets=SECRETS,
                                                     access_mode="ReadWriteMany", read_only=True)])
    checkpoint = os.urandom(2 * 1024 * 1024 + 11)
    assert writer.container.write("out", "step-100.pt", checkpoint) == "ok"
    assert s3.get_object(Bucket=bucket, Key="results/step-100.pt")["Body"].read() == checkpoint
    assert reader.container.read("out", "step-100.pt") == sha(checkpoint)
    assert reader.container.write("out", "forged.pt", b"x") == "errno 30"  # EROFS: its claim is readOnly
    assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    kubelet.delete_pod(writer)
    kubelet.delete_pod(reader)
    assert stoker_mounts(kubelet.root) == []


def test_a_pod_that_may_write_gets_a_read_only_target_of_a_volume_its_pv_does_not_make_writable(node, bucket,
                                                                                               moto_server):
    plugin, kubelet = node
    pod = kubelet.run_pod("trainer", [PodVolume("data", volume_context(bucket, moto_server.endpoint), handle="pv-ro",
                                                stage_secrets=SECRETS, access_mode="ReadWriteMany", read_only=False)])
    assert pod.container.write("data", "x.pt", b"x") == "errno 30"
    kubelet.delete_pod(pod)
