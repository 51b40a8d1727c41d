"""A small kubelet for tests: what a real kubelet (1.25 and later) does with a CSI driver, by its rules.

Written down from kubelet's sources, not from what the driver expects:
- paths (pkg/volume/csi): a persistent volume is staged ("device mounted") at
  `<root>/plugins/kubernetes.io/csi/<driver>/<sha256 of the volume handle>/globalmount`, with
  `vol_data.json` beside it; a pod's target is `<root>/pods/<pod uid>/volumes/kubernetes.io~csi/<volume
  name>/mount`, whose parent kubelet creates (with its own vol_data.json) while the driver creates the
  target itself. An inline volume's handle is `csi-<sha256(pod uid + volume name)>`.
- the root is bind-mounted onto itself and made rshared (kubelet does this at start-up).
- order: NodeGetCapabilities, then NodeStageVolume once per volume per node (STAGE_UNSTAGE), then
  NodePublishVolume per pod with the pod-info keys (podInfoOnMount); on pod deletion
  NodeUnpublishVolume and removeMountDir of the target; when no pod uses the volume any more, the
  device-mount-refs check, then NodeUnstageVolume and removeMountDir of the staging path.
- the device-mount-refs check (operation_generator GenerateUnmountDeviceFunc; mount-utils
  GetMountRefs/SearchMountPoints; volume/util HasMountRefs): the last mountinfo entry at or above the
  staging path gives (root, major:minor); every other mount of that same root and device is a
  reference, and kubelet refuses to unstage (retrying forever) while any reference does not contain
  the path from `/plugins/` on. A corrupted mount (ENOTCONN) counts as having no references.
- removeMountDir: a directory still mounted is left alone; otherwise it and vol_data.json are removed.
- tokens (csi_mounter.go podServiceAccountTokenAttrs): for a CSIDriver with tokenRequests, every
  NodePublishVolume carries `csi.storage.k8s.io/serviceAccount.tokens`, a JSON object from audience to
  {token, expirationTimestamp} of the pod's service account; with requiresRepublish the reconciler
  calls NodePublishVolume again for mounted volumes (same target), with the token manager's current
  token (a new one once 80% of the old one's life has passed). NodeStageVolume never carries tokens.
- access mode and readonly (csi_mounter.go SetUpAt, csi_attacher.go MountDevice, csi_client.go
  asCSIAccessModeV1): both NodeStageVolume and NodePublishVolume carry the PV's first access mode
  (ReadWriteOnce for an inline volume) as SINGLE_NODE_WRITER, MULTI_NODE_READER_ONLY (ReadOnlyMany),
  MULTI_NODE_MULTI_WRITER (ReadWriteMany) or SINGLE_NODE_SINGLE_WRITER (ReadWriteOncePod);
  NodePublishVolume's readonly is the pod's claim `readOnly` or the PV's `csi.readOnly` (an inline
  volume's `csi.readOnly`, false unless set). A volumeMount's own readOnly is the runtime's, not the driver's.
- a container (runc, mountPropagation HostToContainer) sees an rslave recursive bind of the target
  made in its own mount namespace when it starts (tests/support/container.py).
What it cannot show: kubelet's reconstruction after its own restart, the attach/detach controller,
SELinux relabelling, and anything a container runtime does beyond that one bind.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import grpc

from csi import csi_pb2 as pb
from csi import csi_pb2_grpc as rpc
from fusecore.process.mounts import is_mounted, mount_table

from .container import Container
from .waiting import unmount_everything_under

DRIVER = "csi.stoker.dev"
READ_ONLY_MANY = pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(),
                                     access_mode=pb.VolumeCapability.AccessMode(mode=3))
_CSI_MODE = {"ReadWriteOnce": 1, "ReadOnlyMany": 3, "ReadWriteMany": 5, "ReadWriteOncePod": 6}  # asCSIAccessModeV1


def capability(access_mode: str) -> pb.VolumeCapability:
    return pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(),
                               access_mode=pb.VolumeCapability.AccessMode(mode=_CSI_MODE[access_mode]))
_CORRUPTED = {errno.ENOTCONN, errno.ESTALE, errno.EIO, errno.EACCES, errno.EHOSTDOWN, errno.EWOULDBLOCK}


class UnstageRefused(RuntimeError):
    """Kubelet's GetDeviceMountRefs check failed: it would retry NodeUnstageVolume forever."""


@dataclass
class PodVolume:
    """A volume of a pod: a PV (handle, attributes, stage secrets) or an inline CSI volume."""

    name: str
    attributes: dict[str, str]
    handle: str = ""  # a PV's volumeHandle; empty for an inline volume
    stage_secrets: dict[str, str] = field(default_factory=dict)
    publish_secrets: dict[str, str] = field(default_factory=dict)
    access_mode: str = ""  # the PV's first access mode ("" : ReadOnlyMany for a PV, ReadWriteOnce inline)
    read_only: bool | None = None  # the claim's (or the PV's csi.readOnly); None: true for a PV, false inline

    @property
    def capability(self) -> pb.VolumeCapability:
        return capability(self.access_mode or ("ReadWriteOnce" if self.inline else "ReadOnlyMany"))

    @property
    def readonly(self) -> bool:
        return (not self.inline) if self.read_only is None else self.read_only

    @property
    def inline(self) -> bool:
        return not self.handle


@dataclass
class Pod:
    name: str
    uid: str
    volumes: list[PodVolume]
    namespace: str = "training"
    service_account: str = "default"
    targets: dict[str, str] = field(default_factory=dict)  # volume name -> target path
    handles: dict[str, str] = field(default_factory=dict)  # volume name -> volume handle
    container: Container | None = None


def device_mount_refs(path: str) -> list[str]:
    """mount-utils GetMountRefs: the other mount points of the filesystem mounted at `path`."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return []
    except OSError as exc:
        if exc.errno in _CORRUPTED:
            return []  # "GetMountRefs found corrupted mount ..., treating as unmounted path"
        raise
    real = os.path.realpath(path)
    table = mount_table()
    for entry in reversed(table):
        if entry.point == real or real.startswith(entry.point.rstrip("/") + "/"):
            root = os.path.normpath(os.path.join(entry.root, os.path.relpath(real, entry.point)))
            return [m.point for m in table
                    if m.mount_id != entry.mount_id and m.root == root and m.device == entry.device]
    raise RuntimeError(f"failed to get root path and major:minor for {path}")


def has_mount_refs(mount_path: str, refs: list[str]) -> bool:
    """volume/util HasMountRefs: a reference that is not kubelet's own view of the path counts."""
    i = mount_path.find("/plugins/")
    needle = mount_path[i:] if i >= 0 else mount_path
    return any(needle not in ref for ref in refs)


def _remove_mount_dir(path: str) -> None:
    """pkg/volume/csi removeMountDir: leave a mounted directory alone, else remove it, the
    vol_data.json beside it and their directory."""
    if is_mounted(path):
        return
    parent = os.path.dirname(path)
    for remove, victim in ((os.rmdir, path), (os.unlink, os.path.join(parent, "vol_data.json")), (os.rmdir, parent)):
        try:
            remove(victim)
        except FileNotFoundError:
            continue  # kubelet ignores "does not exist" at each step
        except OSError:
            return


class Kubelet:
    """Drives a node plugin over its real socket the way kubelet does, for one node."""

    def __init__(self, root: str, csi_socket: str, *, node: str = "node-a", unstage_attempts: int = 3,
                 retry_pause: float = 0.5, token_audiences: tuple[str, ...] = (),
                 issue_token: Callable[[str], str] | None = None):
        self.root = os.path.abspath(root)
        self.token_audiences = token_audiences  # the CSIDriver's tokenRequests
        self.issue_token = issue_token  # "namespace/serviceaccount" -> a token (the TokenRequest API)
        self.tokens: dict[str, str] = {}  # the token manager's current token per namespace/serviceaccount
        self.node = node
        self.unstage_attempts = unstage_attempts
        self.retry_pause = retry_pause
        self.staged: dict[str, str] = {}  # handle -> staging path
        self.pods: dict[str, Pod] = {}
        self.refused: list[str] = []  # what the refs check said, as kubelet logs it
        os.makedirs(self.root, exist_ok=True)
        subprocess.run(["mount", "--bind", self.root, self.root], check=True)
        subprocess.run(["mount", "--make-rshared", self.root], check=True)
        self.channel = grpc.insecure_channel(f"unix://{csi_socket}")
        self.node_rpc = rpc.NodeStub(self.channel)

    def reconnect(self, csi_socket: str) -> None:
        self.channel.close()
        self.channel = grpc.insecure_channel(f"unix://{csi_socket}")
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.node_rpc = rpc.NodeStub(self.channel)

    def staging_path(self, handle: str) -> str:
        digest = hashlib.sha256(handle.encode()).hexdigest()
        return os.path.join(self.root, "plugins", "kubernetes.io", "csi", DRIVER, digest, "globalmount")

    def target_path(self, pod: Pod, volume: PodVolume) -> str:
        return os.path.join(self.root, "pods", pod.uid, "volumes", "kubernetes.io~csi", volume.name, "mount")

    def _stage_unstage(self) -> bool:
        caps = self.node_rpc.NodeGetCapabilities(pb.NodeGetCapabilitiesRequest(), timeout=30).capabilities
        return any(c.rpc.type == pb.NodeServiceCapability.RPC.STAGE_UNSTAGE_VOLUME for c in caps)

    # ---- pods

    def run_pod(self, name: str, volumes: list[PodVolume], *, service_account: str = "default",
                namespace: str = "training") -> Pod:
        pod = Pod(name, str(uuid.uuid4()), volumes, namespace, service_account)
        for volume in volumes:
            self._set_up(pod, volume)
        pod.container = Container({v.name: pod.targets[v.name] for v in volumes})
        self.pods[pod.uid] = pod
        return pod

    def _set_up(self, pod: Pod, volume: PodVolume) -> None:
        handle = volume.handle or "csi-" + hashlib.sha256((pod.uid + volume.name).encode()).hexdigest()
        pod.handles[volume.name] = handle
        staging = ""
        if not volume.inline and self._stage_unstage():
            staging = self.staging_path(handle)
            if handle not in self.staged:
                self._mount_device(handle, staging, volume)
        target = self.target_path(pod, volume)
        os.makedirs(os.path.dirname(target), mode=0o750, exist_ok=True)
        with open(os.path.join(os.path.dirname(target), "vol_data.json"), "w") as f:
            json.dump({"driverName": DRIVER, "volumeHandle": handle}, f)
        self._publish(pod, volume, handle, staging, target)
        pod.targets[volume.name] = target

    def _publish(self, pod: Pod, volume: PodVolume, handle: str, staging: str, target: str) -> None:
        context = dict(volume.attributes)
        context.update({"csi.storage.k8s.io/pod.name": pod.name, "csi.storage.k8s.io/pod.namespace": pod.namespace,
                        "csi.storage.k8s.io/pod.uid": pod.uid,
                        "csi.storage.k8s.io/serviceAccount.name": pod.service_account,
                        "csi.storage.k8s.io/ephemeral": "true" if volume.inline else "false"})
        if self.token_audiences:
            account = f"{pod.namespace}/{pod.service_account}"
            if account not in self.tokens:
                self.tokens[account] = self.issue_token(account)
            expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 3600))
            context["csi.storage.k8s.io/serviceAccount.tokens"] = json.dumps(
                {audience: {"token": self.tokens[account], "expirationTimestamp": expires}
                 for audience in self.token_audiences})
        self.node_rpc.NodePublishVolume(pb.NodePublishVolumeRequest(
            volume_id=handle, staging_target_path=staging, target_path=target, volume_capability=volume.capability,
            readonly=volume.readonly, volume_context=context, secrets=volume.publish_secrets), timeout=120)

    def rotate_token(self, namespace: str, service_account: str) -> str:
        """The token manager fetched a new token for the account (80% of the old one's life passed)."""
        account = f"{namespace}/{service_account}"
        self.tokens[account] = self.issue_token(account)
        return self.tokens[account]

    def republish(self, pod: Pod) -> None:
        """requiresRepublish: the reconciler publishes every mounted volume of the pod again."""
        for volume in pod.volumes:
            handle = pod.handles[volume.name]
            self._publish(pod, volume, handle, self.staged.get(handle, ""), pod.targets[volume.name])

    def _mount_device(self, handle: str, staging: str, volume: PodVolume) -> None:
        os.makedirs(staging, mode=0o750, exist_ok=True)
        with open(os.path.join(os.path.dirname(staging), "vol_data.json"), "w") as f:
            json.dump({"driverName": DRIVER, "volumeHandle": handle}, f)
        self.node_rpc.NodeStageVolume(pb.NodeStageVolumeRequest(
            volume_id=handle, staging_target_path=staging, volume_capability=volume.capability,
            volume_context=volume.attributes, secrets=volume.stage_secrets), timeout=120)
        self.staged[handle] = staging

    def delete_pod(self, pod: Pod) -> None:
        """Stop the container, unpublish each volume, unstage the ones no pod uses any more."""
        if pod.container is not None:
            pod.container.stop()
        del self.pods[pod.uid]
        for volume in pod.volumes:
            handle, target = pod.handles[volume.name], pod.targets[volume.name]
            self.node_rpc.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id=handle, target_path=target),
                                              timeout=60)
            _remove_mount_dir(target)
            in_use = any(handle in other.handles.values() for other in self.pods.values())
            if handle in self.staged and not in_use:
                self._unmount_device(handle)

    def _unmount_device(self, handle: str) -> None:
        staging = self.staged[handle]
        for attempt in range(self.unstage_attempts):
            refs = device_mount_refs(staging)
            if not has_mount_refs(staging, refs):
                break
            self.refused.append(f"the device mount path {staging!r} is still mounted by other references {refs}")
            time.sleep(self.retry_pause)
        else:
            raise UnstageRefused(self.refused[-1])
        self.node_rpc.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(volume_id=handle, staging_target_path=staging),
                                        timeout=60)
        _remove_mount_dir(staging)
        del self.staged[handle]

    def volume_stats(self, pod: Pod, volume: str) -> pb.NodeGetVolumeStatsResponse:
        """What kubelet's periodic volume stats collection asks for each published volume."""
        return self.node_rpc.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(
            volume_id=pod.handles[volume], volume_path=pod.targets[volume]), timeout=30)

    def close(self) -> None:
        for pod in list(self.pods.values()):
            if pod.container is not None:
                pod.container.stop()
        self.channel.close()
        unmount_everything_under(self.root + "/")
        subprocess.run(["umount", "-l", self.root], capture_output=True)
