"""The CSI conformance suite's node scenarios, run the way csi-sanity (kubernetes-csi/csi-test, pkg/sanity, v5)
runs them, written down from its sources:

- Before each test (`TestContext.Setup`) it makes its own two directories with a plain mkdir (parents must
  exist, and it is an error if they do): the mount dir (`--csi.mountdir`, default `$TMPDIR/csi-mount`) and the
  staging dir (`--csi.stagingdir`, default `$TMPDIR/csi-staging`). After each test (`Teardown`) it removes
  both with rmdir, which fails if anything is left mounted or inside.
- The staging path is the staging dir itself; the target path is `<mount dir>/target`, which does not exist:
  the driver creates it on NodePublishVolume and must delete it on NodeUnpublishVolume ("should remove
  target path" checks it is gone).
- "should work" / "should be idempotent" (`runControllerTest`): NodeGetInfo; CreateVolume (one
  SINGLE_NODE_WRITER mount capability, 10 GiB, the StorageClass parameters and CreateVolumeSecret);
  NodeStageVolume `count` times; NodePublishVolume `count` times; NodeGetVolumeStats on the target (must
  succeed with a usage); then the resources' cleanup: NodeUnpublishVolume, NodeUnstageVolume, DeleteVolume.
- "NodeGetVolumeStats should fail when volume does not exist on the specified path": stage and publish, then
  stats of the volume at the relative path "some/path": NOT_FOUND.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import grpc

from csi import csi_pb2 as pb

SINGLE_NODE_WRITER = pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(),
                                         access_mode=pb.VolumeCapability.AccessMode(mode=1))
VOLUME_SIZE = 10 * 1024**3


@dataclass
class Sanity:
    node: object  # a NodeStub
    controller: object  # a ControllerStub
    root: str  # where the mount and staging dirs are made (their parent must exist)
    parameters: dict[str, str]
    secrets: dict[str, str]  # used as CreateVolume, NodeStage, NodePublish and DeleteVolume secret
    on_published: Callable[[pb.Volume, str], None] | None = None  # checks while the volume is published
    created: list[pb.Volume] = field(default_factory=list)
    teardown_errors: list[str] = field(default_factory=list)

    @property
    def mount_dir(self) -> str:
        return os.path.join(self.root, "csi-mount")

    @property
    def staging(self) -> str:
        return os.path.join(self.root, "csi-staging")

    @property
    def target(self) -> str:
        return self.mount_dir + "/target"

    # ---- a test's frame: Setup, the test, the resources' cleanup, Teardown

    def run(self, test: Callable[[], None]) -> None:
        os.mkdir(self.mount_dir, 0o755)
        os.mkdir(self.staging, 0o755)
        try:
            test()
        finally:
            self._cleanup()
            for path in (self.mount_dir, self.staging):
                try:
                    os.rmdir(path)
                except OSError as exc:
                    self.teardown_errors.append(f"{path}: {exc.strerror}")

    def _cleanup(self) -> None:
        """Resources.Cleanup: unpublish, unstage and delete every volume the test created."""
        for volume in self.created:
            self.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(
                volume_id=volume.volume_id, target_path=self.target), timeout=60)
            self.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
                volume_id=volume.volume_id, staging_target_path=self.staging), timeout=60)
            self.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=volume.volume_id, secrets=self.secrets),
                                         timeout=60)
        self.created.clear()

    # ---- the calls, as sanity makes them

    def create_volume(self, name: str) -> pb.Volume:
        volume = self.controller.CreateVolume(pb.CreateVolumeRequest(
            name=name, volume_capabilities=[SINGLE_NODE_WRITER], capacity_range=pb.CapacityRange(
                required_bytes=VOLUME_SIZE), secrets=self.secrets, parameters=self.parameters), timeout=60).volume
        self.created.append(volume)
        return volume

    def stage(self, volume: pb.Volume) -> None:
        self.node.NodeStageVolume(pb.NodeStageVolumeRequest(
            volume_id=volume.volume_id, volume_capability=SINGLE_NODE_WRITER, staging_target_path=self.staging,
            volume_context=volume.volume_context, secrets=self.secrets), timeout=120)

    def publish(self, volume: pb.Volume) -> None:
        self.node.NodePublishVolume(pb.NodePublishVolumeRequest(
            volume_id=volume.volume_id, target_path=self.target, staging_target_path=self.staging,
            volume_capability=SINGLE_NODE_WRITER, volume_context=volume.volume_context, secrets=self.secrets),
            timeout=120)

    def stats(self, volume: pb.Volume, path: str) -> pb.NodeGetVolumeStatsResponse:
        return self.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(volume_id=volume.volume_id,
                                                                        volume_path=path), timeout=60)

    # ---- the scenarios

    def should_work(self, name: str, count: int = 1) -> None:
        """runControllerTest: stage and publish `count` times each, stats on the target."""
        assert self.node.NodeGetInfo(pb.NodeGetInfoRequest()).node_id
        volume = self.create_volume(name)
        for _ in range(count):
            self.stage(volume)
        for _ in range(count):
            self.publish(volume)
        if self.on_published is not None:
            self.on_published(volume, self.target)
        assert list(self.stats(volume, self.target).usage), "NodeGetVolumeStats must report a usage"

    def unpublish_removes_target(self, name: str) -> None:
        volume = self.create_volume(name)
        self.stage(volume)
        self.publish(volume)
        assert os.path.exists(self.target), "the driver creates the target path"
        self.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id=volume.volume_id,
                                                                    target_path=self.target), timeout=60)
        assert not os.path.lexists(self.target), "the driver must delete the target path it created"

    def stats_elsewhere_is_not_found(self, name: str) -> None:
        volume = self.create_volume(name)
        self.stage(volume)
        self.publish(volume)
        try:
            self.stats(volume, "some/path")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.NOT_FOUND, (exc.code(), exc.details())
        else:
            raise AssertionError("NodeGetVolumeStats at a path where the volume is not succeeded")
