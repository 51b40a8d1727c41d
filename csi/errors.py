"""The one table from failures to gRPC status codes, applied at the gRPC boundary."""

from __future__ import annotations

import grpc

from fusecore.store_errors import AccessDenied, BucketNotFound, NotFound, StoreError, TransientError, Unavailable

from .attributes import AttributeProblem
from .failures import DriverError
from .mounter import MountFailed, MountNotReady


class VolumeError(DriverError):
    """Base of the CSI contract's failures raised by the volume logic."""


class BadRequest(VolumeError):
    """A required field is missing or malformed."""


class Unsupported(VolumeError):
    """Something this driver does not offer (block volumes, ...)."""


class UnknownVolume(VolumeError):
    pass


class NotStaged(VolumeError):
    """Publish before stage, or unstage while still published."""


class Conflict(VolumeError):
    """The path is already used differently (a conflicting re-stage or re-publish)."""


class PermissionDenied(VolumeError):
    """The caller's identity may not use the volume's running mount (another principal's mount)."""


class NodeFull(VolumeError):
    """The volume's cache does not fit in what is left of the node's cache memory."""


class VolumeBusy(VolumeError):
    """Another operation on the same volume is in flight."""


class NotReady(VolumeError):
    """The plugin cannot serve yet (its mounter does not answer)."""


class StillMounted(VolumeError):
    """An unmount did not show in mountinfo in time."""


STATUS_BY_ERROR: dict[type[Exception], grpc.StatusCode] = {
    BadRequest: grpc.StatusCode.INVALID_ARGUMENT,
    AttributeProblem: grpc.StatusCode.INVALID_ARGUMENT,
    Unsupported: grpc.StatusCode.UNIMPLEMENTED,
    UnknownVolume: grpc.StatusCode.NOT_FOUND,
    NotStaged: grpc.StatusCode.FAILED_PRECONDITION,
    Conflict: grpc.StatusCode.ALREADY_EXISTS,
    VolumeBusy: grpc.StatusCode.ABORTED,
    NodeFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    NotReady: grpc.StatusCode.FAILED_PRECONDITION,
    StillMounted: grpc.StatusCode.INTERNAL,
    BucketNotFound: grpc.StatusCode.NOT_FOUND,
    NotFound: grpc.StatusCode.NOT_FOUND,
    AccessDenied: grpc.StatusCode.PERMISSION_DENIED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    TransientError: grpc.StatusCode.UNAVAILABLE,
    StoreError: grpc.StatusCode.INTERNAL,
    MountNotReady: grpc.StatusCode.DEADLINE_EXCEEDED,
    MountFailed: grpc.StatusCode.INTERNAL,
}


def status_for(exc: Exception) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS_BY_ERROR:
            return STATUS_BY_ERROR[cls]
    return grpc.StatusCode.INTERNAL
