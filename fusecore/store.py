"""The object-store client: the one place that knows S3, boto3 and botocore.

Everything above this module sees `ObjectInfo`, `Listing` and the `StoreError` family; every
botocore exception is translated here, once. Calls are blocking: the fetcher runs them in worker
threads.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import http.client
import logging
import mmap
import os
import re
import threading
import time
import urllib.parse
import xml.sax.saxutils
from dataclasses import dataclass, field
from typing import Iterator, Protocol
from xml.etree import ElementTree

import boto3
import botocore.config
import botocore.exceptions
import botocore.httpsession
import botocore.session
import botocore.utils
import urllib3

from .buffers import allocate
from .config import Identity, StoreConfig
from .credentials import RotatingCredentials, use_only

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str  # full object key
    size: int
    etag: str
    mtime: float  # seconds since the epoch


@dataclass
class Listing:
    """One page of a delimiter listing: objects directly under a prefix and sub-prefixes."""

    files: list[ObjectInfo] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)  # full prefixes, ending in '/'


class StoreError(Exception):
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


class Progress:
    """Bytes of a GET received so far; written by the worker thread, read by waiting readers."""

    __slots__ = ("received",)

    def __init__(self) -> None:
        self.received = 0

    def advance(self, n: int) -> None:
        self.received += n


class ObjectStore(Protocol):
    def check(self) -> None: ...
    def list_dir(self, prefix: str) -> Iterator[Listing]: ...
    def list_all(self, prefix: str) -> Iterator[ObjectInfo]: ...
    def head(self, key: str) -> ObjectInfo | None: ...
    def has_prefix(self, prefix: str) -> bool: ...
    def read_range(self, key: str, start: int, end: int, etag: str, into: memoryview, progress: Progress) -> None: ...
    def rotate(self, identity: Identity) -> None: ...


_PIECE = 256 * 1024  # progress is published after each piece of a body
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


def _translate(exc: Exception, what: str) -> StoreError:
    """Map a botocore exception to the StoreError family (never includes credentials)."""
    if isinstance(exc, botocore.exceptions.ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return _answer_error(status, code, what, retried=True)  # botocore's retry mode already ran
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


def _session(cfg: StoreConfig) -> tuple[boto3.session.Session, RotatingCredentials | None]:
    """A session that signs with the given credentials only, or boto3's default chain when none are given."""
    rotating = RotatingCredentials(cfg.credentials) if cfg.credentials is not None else None
    core = botocore.session.Session(profile=cfg.profile if rotating is None else None)
    if rotating is not None:
        use_only(core, rotating)
    elif cfg.profile:
        try:
            core.get_scoped_config()
        except botocore.exceptions.ProfileNotFound as exc:
            raise AccessDenied(f"profile {cfg.profile!r} not found") from exc
    # botocore parses every LastModified of a listing with dateutil: two thirds of the CPU of a large
    # LIST (measured: 100,000 entries, 47 of 70 s). S3's ISO 8601 form parses ~100x faster natively.
    core.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=_parse_timestamp)
    return boto3.session.Session(botocore_session=core), rotating


def _parse_timestamp(value):
    """S3's timestamps: ISO 8601 in listings (fast path), else botocore's general parser."""
    if isinstance(value, str) and len(value) >= 20 and value[10:11] == "T":
        try:
            return datetime.datetime.fromisoformat(value)
        except ValueError:
            pass
    return botocore.utils.parse_timestamp(value)


class S3Store:
    """ObjectStore over boto3; thread-safe (one client, a connection pool sized to concurrency)."""

    def __init__(self, cfg: StoreConfig):
        self.cfg = cfg
        self.bucket = cfg.bucket
        session, self._credentials = _session(cfg)
        config = botocore.config.Config(
            max_pool_connections=cfg.max_concurrency + 8,
            connect_timeout=cfg.connect_timeout,
            read_timeout=cfg.request_timeout,
            retries={"mode": "standard", "max_attempts": cfg.max_attempts},
            s3={"addressing_style": "path" if cfg.endpoint_url else "auto"},
            tcp_keepalive=True,
        )
        self._client = session.client("s3", endpoint_url=cfg.endpoint_url, region_name=cfg.region, config=config)
        self._gets = _PresignedGets(self._client, cfg) if _direct_gets_possible() else None

    def rotate(self, identity: Identity) -> None:
        """Sign every later request with `identity` (new keys, or a web identity's fresh token)."""
        if self._credentials is None:
            raise AccessDenied("this mount uses the default credential chain; it takes no credentials")
        self._credentials.replace(identity)
        if self._gets is not None:
            self._gets.forget_urls()

    def check(self) -> None:
        """Fail early, with one clear reason, on a missing bucket, bad credentials or no store."""
        what = f"bucket {self.bucket!r}"
        try:
            self._client.list_objects_v2(Bucket=self.bucket, Prefix=self.cfg.prefix, MaxKeys=1)
        except Exception as exc:  # noqa: BLE001 - translated below
            raise _translate(exc, what) from None

    def list_dir(self, prefix: str) -> Iterator[Listing]:
        if self._gets is not None:
            yield from self._gets.list_pages(prefix, "/")
            return
        paginator = self._client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix, Delimiter="/"):
                yield Listing(
                    files=[_info(item) for item in page.get("Contents", ())],
                    dirs=[p["Prefix"] for p in page.get("CommonPrefixes", ())],
                )
        except botocore.exceptions.BotoCoreError as exc:
            raise _translate(exc, f"list {prefix!r}") from None
        except botocore.exceptions.ClientError as exc:
            raise _translate(exc, f"list {prefix!r}") from None

    def list_all(self, prefix: str) -> Iterator[ObjectInfo]:
        if self._gets is not None:
            for page in self._gets.list_pages(prefix, None):
                yield from page.files
            return
        paginator = self._client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                for item in page.get("Contents", ()):
                    yield _info(item)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise _translate(exc, f"list {prefix!r}") from None

    def head(self, key: str) -> ObjectInfo | None:
        try:
            resp = self._client.head_object(Bucket=self.bucket, Key=key)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            err = _translate(exc, f"head {key!r}")
            if isinstance(err, NotFound):
                return None
            raise err from None
        return ObjectInfo(key, resp["ContentLength"], resp["ETag"], resp["LastModified"].timestamp())

    def has_prefix(self, prefix: str) -> bool:
        try:
            resp = self._client.list_objects_v2(Bucket=self.bucket, Prefix=prefix, MaxKeys=1)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise _translate(exc, f"list {prefix!r}") from None
        return resp.get("KeyCount", 0) > 0

    def get_range(self, key: str, start: int, end: int, etag: str) -> bytearray | mmap.mmap:
        """Bytes [start, end) of the version `etag` of `key`, in a new buffer."""
        buf = allocate(end - start)
        self.read_range(key, start, end, etag, memoryview(buf), Progress())
        return buf

    def read_range(self, key: str, start: int, end: int, etag: str, into: memoryview, progress: Progress) -> None:
        """Fill `into` with bytes [start, end) of version `etag`, advancing `progress` as they arrive.

        Bytes already counted in `progress` are final even if the body later breaks off: the
        version was checked (If-Match and the response ETag) before the first byte was taken.
        """
        if end <= start:
            return
        if self._gets is not None:
            self._gets.read_range(key, start, end, etag, into, progress)
        else:
            self._read_range_botocore(key, start, end, etag, into, progress)

    def _read_range_botocore(self, key: str, start: int, end: int, etag: str, into: memoryview,
                             progress: Progress) -> None:
        what = f"get {key!r}"
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end - 1}", IfMatch=etag)
            if resp.get("ETag") not in (None, etag):
                resp["Body"].close()
                raise PreconditionFailed(f"{what}: object changed since it was listed")
            status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 206)
            try:
                check_range(start, end, status, resp.get("ContentRange"), resp.get("ContentLength"), what)
            except TransientError:
                resp["Body"].close()
                raise
            readinto, release = _body_reader(resp["Body"])
            _read_body(readinto, into, progress, release, resp["Body"].close, what)
        except StoreError:
            raise
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise _translate(exc, what) from None
        except (OSError, ValueError, http.client.HTTPException) as exc:
            raise TransientError(f"{what}: {type(exc).__name__} while reading the body") from None


def _direct_gets_possible() -> bool:
    """Presigned GETs go straight to the endpoint; with a proxy configured, stay on botocore."""
    names = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")
    return not any(os.environ.get(n) for n in names) and os.environ.get("STOKER_BOTOCORE_GETS") != "1"


_CODE_RE = re.compile(rb"<Code>([^<]+)</Code>")
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class _PresignedGets:
    """Range GETs through presigned URLs on a urllib3 connection pool.

    botocore spends ~1.2 ms of CPU per GetObject (events, endpoint rules, signing, parsing); a GET
    of a presigned URL costs ~0.35 ms (measured here, bench/README). Each object's URL is signed
    once and reused for URL_REUSE seconds. Throttling and 5xx answers become TransientError, which
    the fetcher retries with backoff up to the configured number of attempts; timeouts become
    Unavailable at once, so a silent store fails reads in bounded time.
    """

    URL_LIFETIME = 3600
    URL_REUSE = 600
    MAX_URLS = 100_000

    def __init__(self, client, cfg: StoreConfig):
        self._client = client
        self._bucket = cfg.bucket
        self._urls: dict[str, tuple[float, str]] = {}
        self._lock = threading.Lock()
        ca = os.environ.get("AWS_CA_BUNDLE") or botocore.httpsession.get_cert_path(True)
        self._pool = urllib3.PoolManager(
            num_pools=4, maxsize=cfg.max_concurrency + 8, block=False, retries=False, ca_certs=ca,
            timeout=urllib3.Timeout(connect=cfg.connect_timeout, read=cfg.request_timeout))

    def list_pages(self, prefix: str, delimiter: str | None) -> Iterator[Listing]:
        """ListObjectsV2 pages through presigned URLs, parsed with the C XML parser while the next page
        is already on its way (botocore's generic parser costs ~60 ms per 1,000-key page and waits for
        nothing: a 100,000-entry directory over a 20 ms store took 24 s, now ~4.5 s)."""
        what = f"list {prefix!r}"

        def fetch(token: str | None) -> bytes:
            params = {"Bucket": self._bucket, "Prefix": prefix, "EncodingType": "url"}
            if delimiter:
                params["Delimiter"] = delimiter
            if token:
                params["ContinuationToken"] = token
            return self._get_small(lambda: self._client.generate_presigned_url(
                "list_objects_v2", Params=params, ExpiresIn=self.URL_LIFETIME), what)

        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="list") as ahead:
            coming: concurrent.futures.Future | None = ahead.submit(fetch, None)
            while coming is not None:
                body = coming.result()
                token = _continuation(body, what)
                coming = ahead.submit(fetch, token) if token else None
                yield _parse_listing(body, what)

    def _get_small(self, sign, what: str) -> bytes:
        """The body of a small GET of a URL `sign()` makes (signed again once on an expired signature)."""
        for fresh in (False, True):
            resp = self._send(sign, what, preload_content=True)
            if resp.status == 200:
                return resp.data
            code = _code_in(resp.data, resp.status)
            if _sign_again(resp.status, code, fresh):
                continue
            raise _answer_error(resp.status, code, what, retried=True)
        raise AssertionError("unreachable")

    def _send(self, sign, what: str, **kwargs):
        """GET the URL `sign()` makes; failures to sign or to talk to the store as StoreErrors."""
        try:
            return self._pool.request("GET", sign(), redirect=False, **kwargs)
        except urllib3.exceptions.ReadTimeoutError:
            raise Unavailable(f"{what}: store did not answer in time") from None
        except urllib3.exceptions.ConnectTimeoutError:
            raise Unavailable(f"{what}: could not connect in time") from None
        except (urllib3.exceptions.NewConnectionError, urllib3.exceptions.MaxRetryError):
            raise Unavailable(f"{what}: cannot reach the endpoint") from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise TransientError(f"{what}: connection failed ({type(exc).__name__})") from None
        except botocore.exceptions.BotoCoreError as exc:  # signing: credentials vanished, say
            raise _translate(exc, what) from None

    def forget_urls(self) -> None:
        """Sign again from now on (the credentials changed)."""
        with self._lock:
            self._urls.clear()

    def _url(self, key: str, *, fresh: bool = False) -> str:
        now = time.monotonic()
        with self._lock:
            cached = self._urls.get(key)
            if cached is not None and not fresh and now - cached[0] < self.URL_REUSE:
                return cached[1]
        url = self._client.generate_presigned_url(
            "get_object", Params={"Bucket": self._bucket, "Key": key}, ExpiresIn=self.URL_LIFETIME)
        with self._lock:
            if len(self._urls) >= self.MAX_URLS:
                self._urls.clear()
            self._urls[key] = (now, url)
        return url

    def read_range(self, key: str, start: int, end: int, etag: str, into: memoryview, progress: Progress) -> None:
        what = f"get {key!r}"
        headers = {"Range": f"bytes={start}-{end - 1}", "If-Match": etag}
        for fresh in (False, True):
            resp = self._send(lambda: self._url(key, fresh=fresh), what, headers=headers, preload_content=False)
            if resp.status in (200, 206):
                break
            retry_after = retry_after_seconds(resp.headers.get("Retry-After"))
            code = _error_code(resp)
            if _sign_again(resp.status, code, fresh):
                continue
            raise _answer_error(resp.status, code, what, retried=False, retry_after=retry_after)
        if resp.headers.get("ETag") not in (None, etag):
            resp.release_conn()
            raise PreconditionFailed(f"{what}: object changed since it was listed")
        try:
            declared = resp.headers.get("Content-Length")
            length = int(declared) if declared is not None else None
        except ValueError:
            resp.close()
            raise TransientError(f"{what}: malformed Content-Length") from None
        try:
            check_range(start, end, resp.status, resp.headers.get("Content-Range"), length, what)
        except TransientError:
            resp.close()
            raise
        fp = getattr(resp, "_fp", None)
        readinto = fp.readinto if fp is not None and hasattr(fp, "readinto") else resp.readinto
        try:
            _read_body(readinto, into, progress, resp.release_conn, resp.close, what)
        except urllib3.exceptions.ReadTimeoutError:
            raise Unavailable(f"{what}: store stopped sending") from None
        except (urllib3.exceptions.HTTPError, OSError, http.client.HTTPException, ValueError) as exc:
            raise TransientError(f"{what}: {type(exc).__name__} while reading the body") from None


_S3_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
_TRUNCATED = re.compile(rb"<IsTruncated>\s*true\s*</IsTruncated>")
_TOKEN = re.compile(rb"<NextContinuationToken>([^<]*)</NextContinuationToken>")


def _continuation(body: bytes, what: str) -> str | None:
    """The token of the next page (found without parsing the page, to ask for the next one at once)."""
    if not _TRUNCATED.search(body):
        return None
    match = _TOKEN.search(body)
    if match is None or not match.group(1):
        raise Unavailable(f"{what}: a truncated listing without a continuation token")
    return xml.sax.saxutils.unescape(match.group(1).decode(), {"&quot;": '"', "&apos;": "'"})


def _parse_listing(body: bytes, what: str) -> Listing:
    """One ListObjectsV2 answer (EncodingType=url) as a Listing."""
    try:
        root = ElementTree.fromstring(body)
    except ElementTree.ParseError:
        raise TransientError(f"{what}: the listing is not valid XML") from None
    ns = _S3_NS if root.tag.startswith(_S3_NS) else ""
    files = []
    for item in root.iterfind(f"{ns}Contents"):
        modified = item.findtext(f"{ns}LastModified") or ""
        files.append(ObjectInfo(urllib.parse.unquote(item.findtext(f"{ns}Key") or ""),
                                int(item.findtext(f"{ns}Size") or 0), item.findtext(f"{ns}ETag") or "",
                                _parse_timestamp(modified).timestamp() if modified else 0.0))
    dirs = [urllib.parse.unquote(p.findtext(f"{ns}Prefix") or "") for p in root.iterfind(f"{ns}CommonPrefixes")]
    return Listing(files=files, dirs=dirs)


def _read_body(readinto, into: memoryview, progress: Progress, release, close, what: str) -> None:
    """Fill `into` from a response body piece by piece, publishing progress; hand the connection
    back to its pool only if the body was read to the end, else close it."""
    pos, length = 0, len(into)
    try:
        while pos < length:
            n = readinto(into[pos:pos + _PIECE])
            if not n:
                break
            pos += n
            progress.advance(n)
    finally:
        (release if pos == length else close)()
    if pos != length:
        raise TransientError(f"{what}: short body ({pos} of {length} bytes)")


def _error_code(resp) -> str:
    """The S3 error code of a streamed error answer (read, then its connection handed back)."""
    try:
        body = resp.read(64 * 1024)
    except Exception:  # noqa: BLE001 - the status alone still says enough
        body = b""
    finally:
        resp.release_conn()
    return _code_in(body, resp.status)


def _code_in(body: bytes | None, status: int) -> str:
    match = _CODE_RE.search(body or b"")
    return match.group(1).decode(errors="replace") if match else str(status)


def _sign_again(status: int, code: str, fresh: bool) -> bool:
    """An expired presigned URL (or rotated credentials): worth one fresh signature."""
    return status == 403 and not fresh and code in ("AccessDenied", "ExpiredToken", "RequestExpired")


def _answer_error(status: int | None, code: str, what: str, *, retried: bool,
                  retry_after: float | None = None) -> StoreError:
    """The one table from a store's error answer (HTTP status, S3 error code) to StoreError.

    Throttling and 5xx are TransientError, for the fetcher to retry, unless they were `retried`
    already (botocore's retry mode), when they are Unavailable.
    """
    if not retried and (status in _RETRYABLE_STATUS or code in _RETRYABLE_CODES):
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


def _body_reader(body) -> tuple:
    """Read a body straight into our buffer and reuse its connection afterwards.

    urllib3's readinto reads into a temporary bytes object and copies it; http.client's readinto
    fills the caller's buffer from the socket directly (measured: about a third less system time
    per GiB). Falls back to botocore's own readinto where the layers differ.
    """
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    if fp is not None and hasattr(fp, "readinto") and hasattr(raw, "release_conn"):
        return fp.readinto, raw.release_conn
    return body.readinto, body.close


def _info(item: dict) -> ObjectInfo:
    return ObjectInfo(item["Key"], item["Size"], item.get("ETag", ""), item["LastModified"].timestamp())


class S3Admin(S3Store):
    """The few writes the CSI controller makes when it provisions a volume as a prefix.

    Kept beside the read path so that every S3 error is translated by the same table; the mount
    itself never writes.
    """

    def get_small(self, key: str) -> bytes | None:
        """Body of a small object, or None if there is no such object."""
        try:
            return self._client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except Exception as exc:  # noqa: BLE001 - translated below
            err = _translate(exc, f"get {key!r}")
            if isinstance(err, NotFound):
                return None
            raise err from None

    def put_small(self, key: str, body: bytes) -> None:
        try:
            self._client.put_object(Bucket=self.bucket, Key=key, Body=body)
        except Exception as exc:  # noqa: BLE001 - translated below
            raise _translate(exc, f"put {key!r}") from None

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object whose key starts with `prefix` (which must end in '/'); returns the count."""
        if not prefix.endswith("/"):
            raise ValueError("delete_prefix needs a prefix that ends in '/'")
        deleted, batch = 0, []
        for info in self.list_all(prefix):
            batch.append(info.key)
            if len(batch) == 1000:
                deleted += self.delete_keys(batch)
                batch = []
        return deleted + (self.delete_keys(batch) if batch else 0)

    def delete_keys(self, keys: list[str]) -> int:
        """Delete up to 1000 objects in one request; returns the count."""
        try:
            answer = self._client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True})
        except Exception as exc:  # noqa: BLE001 - translated below
            raise _translate(exc, f"delete {len(keys)} objects") from None
        if answer.get("Errors"):
            first = answer["Errors"][0]
            raise _answer_error(None, first.get("Code", ""), f"delete {first.get('Key')!r}", retried=True)
        return len(keys)
