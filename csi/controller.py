"""Thin gRPC adapter: the Controller service (dynamic provisioning) over provision.py."""

from __future__ import annotations

from . import csi_pb2 as pb
from . import csi_pb2_grpc as rpc
from .errors import BadRequest, Unsupported, UnknownVolume
from .node import capability_key, grpc_errors, require
from .provision import create_volume, delete_volume, split_volume_id


def _capacity(request: pb.CreateVolumeRequest) -> int:
    """Recorded, not enforced: an object-store prefix has no size limit."""
    rng = request.capacity_range
    if rng.limit_bytes and rng.required_bytes > rng.limit_bytes:
        raise BadRequest("capacity_range: required_bytes exceeds limit_bytes")
    return rng.required_bytes or rng.limit_bytes


class ControllerService(rpc.ControllerServicer):
    @grpc_errors
    def ControllerGetCapabilities(self, request, context):
        kind = pb.ControllerServiceCapability.RPC.CREATE_DELETE_VOLUME
        return pb.ControllerGetCapabilitiesResponse(
            capabilities=[pb.ControllerServiceCapability(rpc=pb.ControllerServiceCapability.RPC(type=kind))])

    @grpc_errors
    def CreateVolume(self, request, context):
        name = require(request.name, "name")
        if not request.volume_capabilities:
            raise BadRequest("volume_capabilities is required")
        for capability in request.volume_capabilities:
            try:
                capability_key(capability)
            except Unsupported as exc:
                raise BadRequest(str(exc)) from None
        if request.HasField("volume_content_source"):
            raise Unsupported("volumes from snapshots or clones are not offered")
        volume = create_volume(name, _capacity(request), dict(request.parameters), dict(request.secrets))
        return pb.CreateVolumeResponse(volume=pb.Volume(
            volume_id=volume.volume_id, capacity_bytes=volume.capacity_bytes, volume_context=volume.context))

    @grpc_errors
    def DeleteVolume(self, request, context):
        delete_volume(require(request.volume_id, "volume_id"), dict(request.secrets))
        return pb.DeleteVolumeResponse()

    @grpc_errors
    def ValidateVolumeCapabilities(self, request, context):
        volume_id = require(request.volume_id, "volume_id")
        if not request.volume_capabilities:
            raise BadRequest("volume_capabilities is required")
        if split_volume_id(volume_id) is None and "bucket" not in request.volume_context:
            raise UnknownVolume(f"volume {volume_id!r} is not a Stoker volume")
        for capability in request.volume_capabilities:
            try:
                capability_key(capability)
            except Unsupported as exc:
                return pb.ValidateVolumeCapabilitiesResponse(message=str(exc))
        return pb.ValidateVolumeCapabilitiesResponse(confirmed=pb.ValidateVolumeCapabilitiesResponse.Confirmed(
            volume_context=request.volume_context, volume_capabilities=request.volume_capabilities,
            parameters=request.parameters))
