"""Ranged GETs and listings over presigned URLs with urllib3: botocore signs, urllib3 moves the bytes
(a fraction of botocore's per-request CPU), and listing pages are parsed with the C XML parser.

Errors here are raised `from None` on purpose: urllib3's exceptions quote the request URL, and a
presigned URL carries the credential and any session token, which a chained traceback would log."""

from __future__ import annotations

import concurrent.futures
import datetime
import email.utils
import http.client
import logging
import os
import re
import threading
import time
import urllib.parse
import xml.sax.saxutils
from typing import Callable, Iterator, Mapping
from xml.etree import ElementTree

import botocore.exceptions
import botocore.httpsession
import botocore.utils
import urllib3

from .bodies import read_body, socket_readinto
from ..config import StoreConfig
from .loop_http import LoopHttp, loop_gets_possible
from .native_http import MAX_BODY as MAX_NATIVE_BODY, Accept, Answer, NativeHttp, native_gets_possible
from .objects import Listing, ObjectInfo, Progress
from .signing import ObjectUrls
from .errors import (PreconditionFailed, StoreError, TransientError, Unavailable, answer_error, backoff,
                     check_range, retry_after_seconds, retryable, translate)

log = logging.getLogger(__name__)


def parse_timestamp(value):
    """S3's timestamps: ISO 8601 in listings (fast path), else botocore's general parser."""
    if isinstance(value, str) and len(value) >= 20 and value[10:11] == "T":
        try:
            return datetime.datetime.fromisoformat(value)
        except ValueError:
            pass
    return botocore.utils.parse_timestamp(value)


def direct_gets_possible() -> bool:
    """Presigned GETs go straight to the endpoint; with a proxy configured, stay on botocore."""
    names = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")
    return not any(os.environ.get(n) for n in names) and os.environ.get("STOKER_BOTOCORE_GETS") != "1"


_CODE_RE = re.compile(rb"<Code>([^<]+)</Code>")
MAX_LISTING_PAGE = 16 * 1024 * 1024  # a ListObjectsV2 page of 1,000 keys of up to 1,024 bytes, URL-encoded


class PresignedGets:
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
        self._attempts = cfg.max_attempts  # for small requests (listings, HEAD), as botocore's retry mode
        self._urls: dict[str, tuple[float, str]] = {}
        self._signer = ObjectUrls(client, cfg.bucket, self.URL_LIFETIME)
        self._lock = threading.Lock()
        ca = os.environ.get("AWS_CA_BUNDLE") or botocore.httpsession.get_cert_path(True)
        self._pool = urllib3.PoolManager(
            num_pools=4, maxsize=cfg.max_concurrency + 8, block=False, retries=False, ca_certs=ca,
            timeout=urllib3.Timeout(connect=cfg.connect_timeout, read=cfg.request_timeout))
        self._native = NativeHttp(connect_timeout=cfg.connect_timeout, request_timeout=cfg.request_timeout,
                                  ca_file=ca, max_idle=cfg.max_concurrency + 8) if native_gets_possible() else None
        self._loop = LoopHttp(connect_timeout=cfg.connect_timeout, request_timeout=cfg.request_timeout,
                              ca_file=ca, max_idle=cfg.max_concurrency + 8) \
            if self._native is not None and loop_gets_possible() else None

    def list_pages(self, prefix: str, delimiter: str | None) -> Iterator[Listing]:
        """ListObjectsV2 pages through presigned URLs, parsed with the C XML parser while the next page
        is already on its way (botocore's generic parser costs ~60 ms per 1,000-key page and waits for
        nothing: a 100,000-entry directory over a 20 ms store took 24 s, now ~4.5 s)."""
        what = f"list {prefix!r}"

        def fetch(token: str | None) -> bytes:
            params: dict[str, object] = {"Prefix": prefix}
            if delimiter:
                params["Delimiter"] = delimiter
            if token:
                params["ContinuationToken"] = token
            return self._list_body(params, what)

        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="list") as ahead:
            coming: concurrent.futures.Future | None = ahead.submit(fetch, None)
            while coming is not None:
                body = coming.result()
                token = _continuation(body, what)
                coming = ahead.submit(fetch, token) if token else None
                yield parse_listing(body, what)

    def head(self, key: str) -> ObjectInfo | None:
        """HEAD of an object through a presigned URL (botocore's pipeline costs ~4x the CPU), or None."""
        what = f"head {key!r}"
        params = {"Bucket": self._bucket, "Key": key}
        answer = self._small(lambda: self._client.generate_presigned_url(
            "head_object", Params=params, ExpiresIn=self.URL_LIFETIME), what, method="HEAD")
        if answer.status == 404:
            return None
        try:
            modified = email.utils.parsedate_to_datetime(answer.headers["last-modified"]).timestamp()
            return ObjectInfo(key, int(answer.headers["content-length"]), answer.headers["etag"], modified)
        except (KeyError, TypeError, ValueError):
            raise TransientError(f"{what}: the answer lacks a size, ETag or date") from None

    def has_prefix(self, prefix: str) -> bool:
        """Is there any object under `prefix` (one ListObjectsV2 of one key through a presigned URL)?"""
        what = f"list {prefix!r}"
        listing = parse_listing(self._list_body({"Prefix": prefix, "MaxKeys": 1}, what), what)
        return bool(listing.files or listing.dirs)

    def probe(self, key: str) -> Listing:
        """The first page of a delimiter listing of the names that start with `key`: the object `key` (if
        any) and the prefix `key/` (if any) in one request, instead of a HEAD and a one-key LIST."""
        what = f"list {key!r}"
        return parse_listing(self._get_small(lambda: self._signer.listing(key), what), what)

    def _list_body(self, params: dict[str, object], what: str) -> bytes:
        """One ListObjectsV2 answer (keys URL-encoded) of this bucket, signed afresh for each attempt."""
        params = {"Bucket": self._bucket, "EncodingType": "url", **params}
        return self._get_small(lambda: self._client.generate_presigned_url(
            "list_objects_v2", Params=params, ExpiresIn=self.URL_LIFETIME), what)

    def _get_small(self, sign, what: str) -> bytes:
        """The body of a small GET of a URL `sign()` makes."""
        return self._small(sign, what).body

    def _small(self, sign, what: str, method: str = "GET") -> Answer:
        """A small request (a listing page, a HEAD) to a URL `sign()` signs afresh each time: throttling,
        5xx and broken connections are retried with capped exponential backoff and jitter (Retry-After
        honoured) up to max-attempts, like botocore's retry mode; an answer of 200 (or 404 to a HEAD) is
        returned, anything else raised as its StoreError."""
        for attempt in range(1, self._attempts + 1):
            last = attempt == self._attempts
            try:
                answer = self._whole(sign, what, method)
            except TransientError:
                if last:
                    raise
                time.sleep(backoff(attempt))
                continue
            if answer.status == 200 or (method == "HEAD" and answer.status == 404):
                return answer
            code = _code_in(answer.body, answer.status)  # (a HEAD answer has no body to name the error)
            if retryable(answer.status, code) and not last:
                time.sleep(backoff(attempt, retry_after_seconds(answer.headers.get("retry-after"))))
                continue
            raise answer_error(answer.status, code, what, retried=True)
        raise AssertionError("unreachable")

    def _whole(self, sign, what: str, method: str) -> Answer:
        """One small request and its whole answer: a GET on an awscrt connection where those are on, else urllib3
        (whose headers match names in any case)."""
        if self._native is not None and method == "GET":
            return self._native.get(self._signed(sign, what), what, limit=MAX_LISTING_PAGE)
        resp = self._send(sign, what, method=method, preload_content=True)
        return Answer(resp.status, resp.headers, resp.data or b"")

    def _send(self, sign, what: str, method: str = "GET", **kwargs):
        """Send `method` to the URL `sign()` makes; failures to sign or to talk to the store as StoreErrors."""
        url = self._signed(sign, what)
        try:
            return self._pool.request(method, url, redirect=False, **kwargs)
        except urllib3.exceptions.ReadTimeoutError:
            raise Unavailable(f"{what}: store did not answer in time") from None
        except urllib3.exceptions.ConnectTimeoutError:
            raise Unavailable(f"{what}: could not connect in time") from None
        except (urllib3.exceptions.NewConnectionError, urllib3.exceptions.MaxRetryError):
            raise Unavailable(f"{what}: cannot reach the endpoint") from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise TransientError(f"{what}: connection failed ({type(exc).__name__})") from None

    @staticmethod
    def _signed(sign: Callable[[], str], what: str) -> str:
        """The URL `sign()` makes; a failure to sign (credentials vanished, say) as its StoreError."""
        try:
            return sign()
        except botocore.exceptions.BotoCoreError as exc:
            raise translate(exc, what) from None

    def forget_urls(self) -> None:
        """Sign again from now on (the credentials changed)."""
        with self._lock:
            self._urls.clear()
        self._signer.forget()

    def _url(self, key: str, *, fresh: bool = False) -> str:
        now = time.monotonic()
        with self._lock:
            cached = self._urls.get(key)
            if cached is not None and not fresh and now - cached[0] < self.URL_REUSE:
                return cached[1]
        url = self._signer.url(key, fresh=fresh)
        with self._lock:
            if len(self._urls) >= self.MAX_URLS:
                self._urls.clear()
            self._urls[key] = (now, url)
        return url

    def read_range(self, key: str, start: int, end: int, etag: str, into: memoryview, progress: Progress) -> None:
        if self._native is not None and end - start <= MAX_NATIVE_BODY:
            self._read_native(key, start, end, etag, into, progress)
            return
        what, headers = f"get {key!r}", _range_headers(start, end, etag)
        for fresh in (False, True):
            resp = self._send(lambda: self._url(key, fresh=fresh), what, headers=headers, preload_content=False)
            if resp.status in (200, 206):
                break
            _refused(resp.status, _error_code(resp), resp.headers, fresh, what)
        try:
            _check_answer(start, end, etag, resp.status, resp.headers, what)
        except StoreError:
            resp.close()
            raise
        readinto = socket_readinto(resp) or resp.readinto
        try:
            read_body(readinto, into, progress, resp.release_conn, resp.close, what)
        except urllib3.exceptions.ReadTimeoutError:
            raise Unavailable(f"{what}: store stopped sending") from None
        except (urllib3.exceptions.HTTPError, OSError, http.client.HTTPException, ValueError) as exc:
            raise TransientError(f"{what}: {type(exc).__name__} while reading the body") from None

    @property
    def loop_range_limit(self) -> int:
        """The largest range `read_range_on_loop` takes (0: none, every GET goes through a worker thread)."""
        return MAX_NATIVE_BODY if self._native is not None else 0

    async def read_range_on_loop(self, key: str, start: int, end: int, etag: str, into: memoryview,
                                 progress: Progress) -> None:
        """`read_range` of a small range (up to `loop_range_limit`) from a trio event loop: signed there (~15 us,
        reused for URL_REUSE), sent and received on the loop's own kept-alive sockets (loop_http; on awscrt's
        thread where STOKER_LOOP_HTTP=0); the same checks and errors."""
        assert self._native is not None and end - start <= MAX_NATIVE_BODY
        what, headers, accept = _native_range(key, start, end, etag)
        for fresh in (False, True):
            url = self._signed(lambda: self._url(key, fresh=fresh), what)
            if self._loop is not None:
                answer = await self._loop.get_into(url, headers, into, progress, accept, what)
            else:
                answer = await self._native.get_into_async(url, headers, into, progress, accept, what)
            if _taken(answer, fresh, what):
                return

    def _read_native(self, key: str, start: int, end: int, etag: str, into: memoryview, progress: Progress) -> None:
        """A small range on an awscrt connection (native_http): the same checks, one fresh signature on
        an expired URL, the answer's error code mapped the same way."""
        assert self._native is not None
        what, headers, accept = _native_range(key, start, end, etag)
        for fresh in (False, True):
            url = self._signed(lambda: self._url(key, fresh=fresh), what)
            if _taken(self._native.get_into(url, headers, into, progress, accept, what), fresh, what):
                return


def _range_headers(start: int, end: int, etag: str) -> dict[str, str]:
    return {"Range": f"bytes={start}-{end - 1}", "If-Match": etag}


def _native_range(key: str, start: int, end: int, etag: str) -> tuple[str, dict[str, str], Accept]:
    """What a ranged GET on an awscrt connection is called in errors, its headers, and the check of its answer."""
    what = f"get {key!r}"

    def accept(status: int, answer: Mapping[str, str]) -> None:
        _check_answer(start, end, etag, status, answer, what)

    return what, _range_headers(start, end, etag), accept


def _taken(answer: Answer, fresh: bool, what: str) -> bool:
    """A ranged GET's answer on an awscrt connection: True once its body was taken (200, 206), False to sign the URL
    afresh once, else its StoreError."""
    if answer.status in (200, 206):
        return True
    _refused(answer.status, _code_in(answer.body, answer.status), answer.headers, fresh, what)
    return False


def _check_answer(start: int, end: int, etag: str, status: int, headers: Mapping[str, str], what: str) -> None:
    """A 200 or 206 to a ranged GET must be of the version asked for and hold exactly the bytes asked for
    (header names in lower case: urllib3's headers match any case, native_http's are lower case)."""
    if headers.get("etag") not in (None, etag):
        raise PreconditionFailed(f"{what}: object changed since it was listed")
    declared = headers.get("content-length")
    try:
        length = int(declared) if declared is not None else None
    except ValueError:
        raise TransientError(f"{what}: malformed Content-Length") from None
    check_range(start, end, status, headers.get("content-range"), length, what)


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


def parse_listing(body: bytes, what: str) -> Listing:
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
                                parse_timestamp(modified).timestamp() if modified else 0.0))
    dirs = [urllib.parse.unquote(p.findtext(f"{ns}Prefix") or "") for p in root.iterfind(f"{ns}CommonPrefixes")]
    truncated = (root.findtext(f"{ns}IsTruncated") or "").strip().lower() == "true"
    return Listing(files=files, dirs=dirs, truncated=truncated)


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


def _refused(status: int, code: str, headers: Mapping[str, str], fresh: bool, what: str) -> None:
    """A ranged GET answered other than 200 or 206, on either connection kind: return to sign the URL
    afresh once (it expired, or the credentials rotated), else raise the answer's StoreError."""
    if not _sign_again(status, code, fresh):
        raise answer_error(status, code, what, retried=False, retry_after=retry_after_seconds(headers.get("retry-after")))


def _sign_again(status: int, code: str, fresh: bool) -> bool:
    """An expired presigned URL (or rotated credentials): worth one fresh signature."""
    return status == 403 and not fresh and code in ("AccessDenied", "ExpiredToken", "RequestExpired")
