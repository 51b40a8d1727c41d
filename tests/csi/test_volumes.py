"""Per-volume locking through a real gRPC server (in this process) with a mounter that can be held."""

from __future__ import annotations

import argparse
import os
import threading

import grpc
import pytest

from csi.layout import kubelet_staging_path
from csi import csi_pb2 as pb
from csi import csi_pb2_grpc as rpc
from csi.errors import VolumeBusy
from csi.mounter import MountFailed
from csi.server import build_server
from csi.volumes import VolumeLocks

from .conftest import READ_ONLY_MANY, make_volumes


KEYS = {"accessKeyId": "a", "secretAccessKey": "b"}


class HeldMounter:
    """Blocks in start() until released, then fails: enough to observe overlapping calls."""

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()

    def start(self, request, timeout):
        self.entered.set()
        self.release.wait(30)
        raise MountFailed("held mounter does not mount")

    def healthy(self):
        return None


def test_locks_refuse_a_second_holder_and_free_on_exit():
    locks = VolumeLocks()
    with locks.hold("a"):
        with pytest.raises(VolumeBusy):
            with locks.hold("a"):
                pass
        with locks.hold("b"):
            pass
    with locks.hold("a"):
        pass


def test_a_second_caller_waits_its_turn_for_a_short_while():
    """RPCs wait briefly for a health check or repair holding the volume, instead of ABORTED at once."""
    import threading
    import time

    locks = VolumeLocks()
    entered = threading.Event()

    def busy() -> None:
        with locks.hold("a"):
            entered.set()
            time.sleep(0.5)

    worker = threading.Thread(target=busy)
    worker.start()
    assert entered.wait(5)
    with pytest.raises(VolumeBusy):
        with locks.hold("a", wait=0.05):
            pass
    with locks.hold("a", wait=5):  # granted once the first holder is done
        assert not worker.is_alive()
    worker.join()


def test_overlapping_calls_on_one_volume_get_aborted(tmp_path):
    mounter = HeldMounter()
    volumes = make_volumes(tmp_path, mounter, check_store=False)
    args = argparse.Namespace(mode="node", node_id="n1")
    server = build_server(args, mounter, volumes)
    sock = tmp_path / "csi.sock"
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    try:
        stub = rpc.NodeStub(grpc.insecure_channel(f"unix://{sock}"))
        staging = kubelet_staging_path(str(tmp_path / "kubelet"), "v")
        os.makedirs(staging)
        request = pb.NodeStageVolumeRequest(volume_id="v", staging_target_path=str(staging),
                                            volume_capability=READ_ONLY_MANY, volume_context={"bucket": "b"},
                                            secrets=KEYS)
        first = stub.NodeStageVolume.future(request)
        assert mounter.entered.wait(10)
        with pytest.raises(grpc.RpcError) as info:
            stub.NodeStageVolume(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.ABORTED
        other = pb.NodeStageVolumeRequest(volume_id="w", staging_target_path=str(staging),
                                          volume_capability=READ_ONLY_MANY, volume_context={"bucket": "b"},
                                          secrets=KEYS)
        mounter.release.set()
        with pytest.raises(grpc.RpcError) as info:
            first.result(timeout=10)
        assert info.value.code() == grpc.StatusCode.INTERNAL and "held mounter" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.NodeStageVolume(other, timeout=10)  # another volume is not blocked by the first
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert volumes.state.records() == []  # a failed stage leaves no record behind
    finally:
        server.stop(0)


@pytest.mark.integration
def test_a_mount_that_never_becomes_ready_is_an_error_and_leaves_nothing_mounted(tmp_path, moto_server, bucket):
    """A silent store: `stoker mount` gives up after the ready timeout; the call fails, nothing is mounted."""
    from csi.errors import status_for
    from csi.mounter import MountNotReady
    from fusecore.process.mounts import is_mounted
    from tests.support.faultproxy import FaultProxy

    from .conftest import SECRETS

    from csi.layout import kubelet_staging_path

    volumes = make_volumes(tmp_path, ready_timeout=3, check_store=False)
    staging = kubelet_staging_path(str(tmp_path / "kubelet"), "slow")
    os.makedirs(staging)
    with FaultProxy(moto_server.endpoint) as proxy:
        proxy.set("blackhole")
        with pytest.raises(MountNotReady) as info:
            volumes.stage("slow", str(staging), {"bucket": bucket, "endpointUrl": proxy.endpoint}, SECRETS)
    assert status_for(info.value) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert not is_mounted(str(staging))
    assert volumes.state.records() == []


def test_a_volume_held_by_several_caches_keeps_the_largest_budget():
    from csi.state import VolumeRecord

    record = VolumeRecord("v", "/m", {"bucket": "b"})
    assert record.cache_size is None and not record.in_use()
    record.holders.update({"ml/a": 2 << 30, "ml/b": 8 << 30})
    assert record.cache_size == 8 << 30 and record.in_use()
    del record.holders["ml/b"]
    assert record.cache_size == 2 << 30


def test_a_volume_s_disk_folder_is_refused_without_a_root_or_past_the_node_s_size_and_strays_are_swept(tmp_path):
    """csi/diskcache.py, the rules the node plugin applies before any mount (the real plugin: test_node.py)."""
    import stat

    from csi.diskcache import DiskCaches
    from csi.errors import BadRequest, NodeFull, status_for

    with pytest.raises(BadRequest, match="has none") as refused:
        DiskCaches().prepare("v1", 1 << 30, {})
    assert status_for(refused.value) == grpc.StatusCode.INVALID_ARGUMENT
    root = tmp_path / "nvme"
    root.mkdir()
    disks = DiskCaches(str(root), 3 << 30)
    first = disks.prepare("ns/v1", 2 << 30, {})
    assert os.path.dirname(first) == str(root) and stat.S_IMODE(os.stat(first).st_mode) == 0o700
    assert "/" not in os.path.basename(first) and disks.prepare("ns/v1", 2 << 30, {}) == first
    with pytest.raises(NodeFull, match=r"2.0 GiB of 3.0 GiB .*ns/v1 2.0 GiB"):
        disks.prepare("v2", 2 << 30, {"ns/v1": 2 << 30})
    assert sorted(os.listdir(root)) == [os.path.basename(first)]
    stray = disks.prepare("gone", 1 << 30, {"ns/v1": 2 << 30})
    (tmp_path / "nvme" / os.path.basename(stray) / "blocks").mkdir()
    disks.sweep({"ns/v1"})
    assert os.listdir(root) == [os.path.basename(first)]
    disks.remove("ns/v1")
    assert os.listdir(root) == []
