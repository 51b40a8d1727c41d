"""The object-store exception tree, and the one table from an S3 answer (status, error code) or a
botocore exception to it: errors are mapped here, once."""

from __future__ import annotations

import random
import re

import botocore.exceptions

from ..failures import StokerError


class StoreError(StokerError):
    """Base of every object-store failure; `kind` labels metrics and picks the errno."""

    kind = "other"


class NotFound(StoreError):
    kind = "not_found"


class BucketNotFound(StoreError):
    kind = "no_bucket"


class AccessDenied(StoreError):
    kind = "access_denied"


class PreconditionFailed(StoreError):
    """The object changed since it was listed (ETag mismatch, 412, or 416 on a shrunk object)."""

    kind = "changed"


class Unavailable(StoreError):
    """The store did not answer usefully after botocore's retries (timeouts, 5xx, refused)."""

    kind = "unavailable"


class TransientError(StoreError):
    """Worth retrying: a body broke off, the store throttled (503 SlowDown, 429) or failed (5xx), or an
    answer did not match the range asked for. `retry_after`: seconds the store asked us to wait."""

    kind = "transient"

    def __init__(self, message: str, *, throttled: bool = False, retry_after: float | None = None):
        super().__init__(message)
        self.throttled = throttled
        self.retry_after = retry_after


def error_of_kind(kind: str, message: str) -> StoreError | None:
    """The StoreError a `kind` names (errors that crossed a process boundary as kind + message)."""
    for cls in (NotFound, BucketNotFound, AccessDenied, PreconditionFailed, Unavailable, TransientError):
        if cls.kind == kind:
            return cls(message)
    return None


def retry_after_seconds(value: str | None) -> float | None:
    """A Retry-After header given in seconds (the HTTP-date form is ignored); at most 60."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return None if seconds is None or seconds < 0 else min(seconds, 60.0)


_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


def check_range(start: int, end: int, status: int, content_range: str | None, content_length: int | None,
                what: str) -> None:
    """The answer to a GET of bytes [start, end) must be exactly those bytes: a 206 whose Content-Range
    and length match, or a 200 of exactly that length for a range from byte 0 (the whole object).
    Anything else (a proxy or store that ignored, moved or cut the range) is retried, then fails:
    never wrong bytes."""
    length = end - start
    if status == 206:
        match = _CONTENT_RANGE.match(content_range or "")
        if match is None or (int(match.group(1)), int(match.group(2)) + 1) != (start, end):
            raise TransientError(f"{what}: the store answered bytes {content_range or '(no Content-Range)'} "
                                 f"for bytes {start}-{end - 1}")
    elif status == 200:
        if start != 0:
            raise TransientError(f"{what}: the store ignored the Range header (200 for bytes {start}-{end - 1})")
    if content_length is not None and content_length != length:
        raise TransientError(f"{what}: the answer holds {content_length} bytes, not the {length} asked for")


_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}


_DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "Forbidden",
           "InvalidToken", "ExpiredToken", "AllAccessDisabled",
           # STS refusing a web identity (the pod's token) or keys while credentials are fetched
           "InvalidIdentityToken", "IDPRejectedClaim", "ExpiredTokenException", "InvalidClientTokenId",
           "AccessDeniedException"}


_CHANGED = {"PreconditionFailed", "412", "InvalidRange", "416"}


_NO_BUCKET = {"NoSuchBucket"}


_RETRYABLE_STATUS = {429, 500, 502, 503, 504}


_RETRYABLE_CODES = {"SlowDown", "Throttling", "ServiceUnavailable", "InternalError"}


BACKOFF_BASE = 0.05  # seconds before the first retry (on average half of it: full jitter)
BACKOFF_CAP = 5.0  # the longest pause between two attempts


def backoff(attempt: int, retry_after: float | None = None) -> float:
    """Capped exponential backoff with full jitter; a store's Retry-After is honoured when longer
    (the retries of GETs in the fetcher and of small presigned requests)."""
    pause = random.uniform(0, min(BACKOFF_CAP, BACKOFF_BASE * 2 ** min(attempt, 20)))
    return max(pause, retry_after or 0.0)


def retryable(status: int | None, code: str) -> bool:
    """Throttling and 5xx: worth another attempt."""
    return status in _RETRYABLE_STATUS or code in _RETRYABLE_CODES


def answer_error(status: int | None, code: str, what: str, *, retried: bool,
                  retry_after: float | None = None) -> StoreError:
    """The one table from a store's error answer (HTTP status, S3 error code) to StoreError.

    Throttling and 5xx are TransientError, for the fetcher to retry, unless they were `retried`
    already (botocore's retry mode), when they are Unavailable.
    """
    if not retried and retryable(status, code):
        throttled = status in (429, 503) or code in ("SlowDown", "Throttling")
        return TransientError(f"{what}: store answered {status} {code}", throttled=throttled, retry_after=retry_after)
    if code in _NO_BUCKET:
        return BucketNotFound(f"{what}: bucket does not exist")
    if code in _NOT_FOUND or status == 404:
        return NotFound(f"{what}: not found")
    if code in _DENIED or status == 403:
        return AccessDenied(f"{what}: access denied ({code or status}); check the credentials and policy")
    if code in _CHANGED or status in (412, 416):
        return PreconditionFailed(f"{what}: object changed since it was listed")
    return Unavailable(f"{what}: store answered {status} {code}")


def translate(exc: Exception, what: str) -> StoreError:
    """Map a botocore exception to the StoreError family (never includes credentials)."""
    if isinstance(exc, botocore.exceptions.ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return answer_error(status, code, what, retried=True)  # botocore's retry mode already ran
    if isinstance(exc, botocore.exceptions.NoCredentialsError):
        return AccessDenied(f"{what}: no credentials found (environment, shared files or --profile)")
    if isinstance(exc, botocore.exceptions.ProfileNotFound):
        return AccessDenied(f"{what}: {exc}")
    if isinstance(exc, (botocore.exceptions.ResponseStreamingError, botocore.exceptions.IncompleteReadError)):
        return TransientError(f"{what}: response body broke off")
    if isinstance(exc, botocore.exceptions.ReadTimeoutError):
        return Unavailable(f"{what}: store did not answer in time")
    if isinstance(exc, botocore.exceptions.ConnectTimeoutError):
        return Unavailable(f"{what}: could not connect in time")
    if isinstance(exc, botocore.exceptions.EndpointConnectionError):
        return Unavailable(f"{what}: cannot reach the endpoint")
    if isinstance(exc, (botocore.exceptions.ConnectionClosedError, botocore.exceptions.HTTPClientError)):
        return Unavailable(f"{what}: connection failed")
    if isinstance(exc, botocore.exceptions.BotoCoreError):
        return Unavailable(f"{what}: {type(exc).__name__}")
    return StoreError(f"{what}: {type(exc).__name__}")
