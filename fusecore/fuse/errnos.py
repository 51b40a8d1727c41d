"""The one table from object-store failures to errno, used at the FUSE boundary."""

from __future__ import annotations

import errno

from ..store.errors import AccessDenied, BucketNotFound, NotFound, PreconditionFailed, StoreError, TransientError, Unavailable

ERRNO_BY_ERROR: dict[type[StoreError], int] = {
    NotFound: errno.ENOENT,
    BucketNotFound: errno.ENOENT,
    AccessDenied: errno.EACCES,
    PreconditionFailed: errno.EIO,  # changed object: never mix two versions
    Unavailable: errno.EIO,  # timeouts / 5xx after bounded retries
    TransientError: errno.EIO,  # broken bodies after bounded retries
}


def errno_for(exc: StoreError) -> int:
    for cls in type(exc).__mro__:
        if cls in ERRNO_BY_ERROR:
            return ERRNO_BY_ERROR[cls]
    return errno.EIO
