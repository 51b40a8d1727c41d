"""Thin gRPC adapters: the Identity and Node services over VolumeManager."""

from __future__ import annotations

import functools
import logging

import grpc
from google.protobuf import wrappers_pb2

from fusecore import __version__

from . import csi_pb2 as pb
from . import csi_pb2_grpc as rpc
from .attributes import EPHEMERAL_KEY
from .errors import BadRequest, NotReady, Unsupported, VolumeError, status_for
from .mounter import Mounter
from .volumes import VolumeManager

log = logging.getLogger(__name__)

DRIVER_NAME = "csi.stoker.dev"
ACCESS_MODE = pb.VolumeCapability.AccessMode


def grpc_errors(method):
    """Turn an exception into the gRPC status of errors.py (the one mapping)."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - every failure leaves as a status
            code = status_for(exc)
            if code == grpc.StatusCode.INTERNAL and not isinstance(exc, VolumeError):
                log.exception("%s failed", method.__name__)
            context.abort(code, str(exc) or type(exc).__name__)

    return wrapper


def require(value: str, name: str) -> str:
    if not value:
        raise BadRequest(f"{name} is required")
    return value


def capability_key(capability: pb.VolumeCapability, readonly: bool = True) -> str:
    """Validate a capability (mount access only) and describe it, to compare re-publishes."""
    if not capability.HasField("access_mode"):
        raise BadRequest("volume_capability.access_mode is required")
    kind = capability.WhichOneof("access_type")
    if kind is None:
        raise BadRequest("volume_capability needs an access type (mount)")
    if kind == "block":
        raise Unsupported("block volumes are not offered: Stoker volumes are filesystems")
    if capability.mount.fs_type not in ("", "fuse", "fuse.stoker"):
        raise BadRequest(f"volume_capability.mount.fs_type {capability.mount.fs_type!r} is not supported")
    return f"{ACCESS_MODE.Mode.Name(capability.access_mode.mode)}:{'ro' if readonly else 'rw'}"


class IdentityService(rpc.IdentityServicer):
    def __init__(self, mounter: Mounter | None, controller: bool):
        self.mounter = mounter
        self.controller = controller

    @grpc_errors
    def GetPluginInfo(self, request, context):
        return pb.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=__version__)

    @grpc_errors
    def GetPluginCapabilities(self, request, context):
        caps = []
        if self.controller:
            caps.append(pb.PluginCapability(service=pb.PluginCapability.Service(
                type=pb.PluginCapability.Service.CONTROLLER_SERVICE)))
        return pb.GetPluginCapabilitiesResponse(capabilities=caps)

    @grpc_errors
    def Probe(self, request, context):
        problem = self.mounter.healthy() if self.mounter is not None else None
        if problem:
            raise NotReady(f"not ready: {problem}")
        return pb.ProbeResponse(ready=wrappers_pb2.BoolValue(value=True))


class NodeService(rpc.NodeServicer):
    def __init__(self, volumes: VolumeManager, node_id: str):
        self.volumes = volumes
        self.node_id = node_id

    @grpc_errors
    def NodeGetCapabilities(self, request, context):
        kinds = (pb.NodeServiceCapability.RPC.STAGE_UNSTAGE_VOLUME, pb.NodeServiceCapability.RPC.GET_VOLUME_STATS,
                 pb.NodeServiceCapability.RPC.VOLUME_CONDITION)
        return pb.NodeGetCapabilitiesResponse(
            capabilities=[pb.NodeServiceCapability(rpc=pb.NodeServiceCapability.RPC(type=k)) for k in kinds])

    @grpc_errors
    def NodeGetInfo(self, request, context):
        return pb.NodeGetInfoResponse(node_id=self.node_id)

    @grpc_errors
    def NodeStageVolume(self, request, context):
        volume_id = require(request.volume_id, "volume_id")
        path = require(request.staging_target_path, "staging_target_path")
        if not request.HasField("volume_capability"):
            raise BadRequest("volume_capability is required")
        capability_key(request.volume_capability)
        self.volumes.stage(volume_id, path, dict(request.volume_context), dict(request.secrets))
        return pb.NodeStageVolumeResponse()

    @grpc_errors
    def NodeUnstageVolume(self, request, context):
        volume_id = require(request.volume_id, "volume_id")
        path = require(request.staging_target_path, "staging_target_path")
        self.volumes.unstage(volume_id, path)
        return pb.NodeUnstageVolumeResponse()

    @grpc_errors
    def NodePublishVolume(self, request, context):
        volume_id = require(request.volume_id, "volume_id")
        target = require(request.target_path, "target_path")
        if not request.HasField("volume_capability"):
            raise BadRequest("volume_capability is required")
        how = capability_key(request.volume_capability, request.readonly)
        context_map = dict(request.volume_context)
        if context_map.get(EPHEMERAL_KEY, "").lower() != "true":
            require(request.staging_target_path, "staging_target_path")
        self.volumes.publish(volume_id, request.staging_target_path, target, how, context_map, dict(request.secrets))
        return pb.NodePublishVolumeResponse()

    @grpc_errors
    def NodeUnpublishVolume(self, request, context):
        volume_id = require(request.volume_id, "volume_id")
        target = require(request.target_path, "target_path")
        self.volumes.unpublish(volume_id, target)
        return pb.NodeUnpublishVolumeResponse()

    @grpc_errors
    def NodeGetVolumeStats(self, request, context):
        volume_id = require(request.volume_id, "volume_id")
        path = require(request.volume_path, "volume_path")
        record = self.volumes.find(volume_id, path)
        health = self.volumes.condition(record)
        usage = []
        if not health.abnormal and health.cache_budget:
            # The volume's capacity here is its node cache: how much of the budget holds data.
            usage.append(pb.VolumeUsage(unit=pb.VolumeUsage.BYTES, total=health.cache_budget,
                                        used=health.cache_bytes,
                                        available=max(0, health.cache_budget - health.cache_bytes)))
        return pb.NodeGetVolumeStatsResponse(
            usage=usage, volume_condition=pb.VolumeCondition(abnormal=health.abnormal, message=health.message))
