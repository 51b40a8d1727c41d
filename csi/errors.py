"""The one table from failures to gRPC status codes, applied at the gRPC boundary."""

from __future__ import annotations

import grpc

from fusecore.config import format_size
from fusecore.store.errors import AccessDenied, BucketNotFound, NotFound, StoreError, TransientError, Unavailable

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
    """The volume's cache (memory or disk) does not fit in what is left of the node's."""


def refuse_past(volume_id: str, need: int, others: dict[str, int], limit: int | None, *, kind: str, setting: str,
                advice: str) -> None:
    """NodeFull if the volume's `need` and what the node's other volumes take (`others`) pass `limit` (None: no
    limit), naming the largest of them."""
    if limit is None:
        return
    used = sum(others.values())
    if used + need <= limit:
        return
    holders = ", ".join(f"{v} {format_size(b)}" for v, b in sorted(others.items(), key=lambda i: -i[1])[:5])
    raise NodeFull(f"volume {volume_id!r} needs a {format_size(need)} {kind}; this node's Stoker {kind}s already "
                   f"take {format_size(used)} of {format_size(limit)} ({setting}){': ' + holders if holders else ''}. "
                   f"{advice}")


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
