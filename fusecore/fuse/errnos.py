"""The one table from object-store failures to errno, used at the FUSE boundary."""

from __future__ import annotations

import errno

from ..read.writer import Refused
from ..store.errors import AccessDenied, BucketNotFound, NotFound, PreconditionFailed, StoreError, TransientError, Unavailable

ERRNO_BY_ERROR: dict[type[StoreError], int] = {
    NotFound: errno.ENOENT,
    BucketNotFound: errno.ENOENT,
    AccessDenied: errno.EACCES,
    PreconditionFailed: errno.EIO,  # changed object: never mix two versions
    Unavailable: errno.EIO,  # timeouts / 5xx after bounded retries
    TransientError: errno.EIO,  # broken bodies after bounded retries
}


# A write-side operation refused (read/writes.py says why each is)
ERRNO_BY_REFUSAL: dict[str, int] = {
    "not_sequential": errno.EINVAL,
    "overwrite": errno.EPERM,
    "append": errno.EPERM,
    "read_write": errno.EPERM,
    "truncate": errno.EPERM,
    "delete": errno.EPERM,
    "busy": errno.EBUSY,
    "exists": errno.EEXIST,
    "not_empty": errno.ENOTEMPTY,
    "not_dir": errno.ENOTDIR,
    "is_dir": errno.EISDIR,
    "rename": errno.EXDEV,
    "invalid": errno.EINVAL,
    "not_open": errno.EBADF,
}


def errno_for(exc: StoreError) -> int:
    if isinstance(exc, Refused):
        return ERRNO_BY_REFUSAL.get(exc.why, errno.EPERM)
    for cls in type(exc).__mro__:
        if cls in ERRNO_BY_ERROR:
            return ERRNO_BY_ERROR[cls]
    return errno.EIO
