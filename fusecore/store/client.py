"""The object-store client (`S3Store`): the botocore client, its session and credentials; GETs,
listings and lookups go through presigned URLs (presigned.py) unless a proxy is configured.

A range GET takes one of four routes, each kept for one job (A/B in docs/operations.md, "The GET routes"):
- the event loop's own sockets (loop_http.py): every range up to 512 KiB (small files, random reads, first-block
  parts), the cheapest per request;
- urllib3 in a worker thread (presigned.py): larger ranges (blocks), read straight into the block's buffer;
- awscrt's connections (native_http.py): listing pages, and the small ranges where STOKER_LOOP_HTTP=0 (the way back
  should a store and the loop's own HTTP/1.1 not get on);
- botocore's own get_object: only through a proxy (HTTP(S)_PROXY, or STOKER_BOTOCORE_GETS=1), which the others
  do not speak.

Everything above the store modules sees `ObjectInfo`, `Listing` (objects.py) and the `StoreError`
family (errors.py, where every botocore exception is translated, once). Calls are blocking:
the fetcher runs them in worker threads.
"""

from __future__ import annotations

import http.client
import logging
import mmap
from typing import Iterator

import botocore.auth
import botocore.config
import botocore.exceptions
import botocore.loaders
import botocore.session

from .bodies import body_reader, read_body
from ..cache.buffers import allocate
from ..config import Identity, StoreConfig
from .credentials import RotatingCredentials, use_only
from .objects import Listing, ObjectInfo, Progress
from .presigned import PresignedGets, direct_gets_possible, parse_timestamp
from .errors import (AccessDenied, NotFound, PreconditionFailed, StoreError, TransientError,
                     check_range, translate)

log = logging.getLogger(__name__)


_LOADER: botocore.loaders.Loader | None = None


def shared_loader() -> botocore.loaders.Loader:
    """One loader of botocore's data for every session of this process: the S3 model and the endpoint rules parsed
    once (~9 MiB a client, measured) for the mount's client and the writes' client, and any other this process
    makes."""
    global _LOADER
    if _LOADER is None:
        _LOADER = botocore.loaders.create_loader()
    return _LOADER


def _session(cfg: StoreConfig) -> tuple[botocore.session.Session, RotatingCredentials | None]:
    """A session that signs with the given credentials only, or botocore's default chain when none are given.

    A botocore session, not boto3's: a boto3 client also loads s3transfer and its process pool for
    upload and download helpers this read-only client never calls (~2 MiB of a mount's resident memory)."""
    rotating = RotatingCredentials(cfg.credentials) if cfg.credentials is not None else None
    core = botocore.session.Session(profile=cfg.profile if rotating is None else None)
    core.register_component("data_loader", shared_loader())
    if rotating is not None:
        use_only(core, rotating)
    elif cfg.profile:
        try:
            core.get_scoped_config()
        except botocore.exceptions.ProfileNotFound as exc:
            raise AccessDenied(f"profile {cfg.profile!r} not found") from exc
    # botocore parses every LastModified of a listing with dateutil: two thirds of the CPU of a large
    # LIST (measured: 100,000 entries, 47 of 70 s). S3's ISO 8601 form parses ~100x faster natively.
    core.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=parse_timestamp)
    return core, rotating


# The signer of a writable mount's uploads: botocore's own S3 SigV4 class, under a name of ours (botocore looks signers
# up by name in AUTH_TYPE_MAPS). With awscrt installed botocore signs S3 requests through awscrt, which copies each
# part into a BytesIO and hashes it through Python call-backs; this class hashes the part in place with hashlib (the
# GIL released). The same signature either way. Measured with --writable, 256 MiB in 1 MiB writes: the mount's CPU
# 4.3-4.5 -> 2.8-2.9 CPU-s/GiB together with WRITE_CHECKSUMS.
PART_SIGNER = "stoker-s3v4-parts"
botocore.auth.AUTH_TYPE_MAPS.setdefault(PART_SIGNER, botocore.auth.S3SigV4Auth)
# Uploads carry no CRC32 of their own (botocore >= 1.36 adds one to every part by default, in software: ~1 CPU-s/GiB):
# without one botocore signs the payload's SHA-256 over HTTPS too (hashlib, in hardware where the CPU has it), so S3
# checks every part's bytes against a digest stronger than a CRC.
WRITE_CHECKSUMS = {"request_checksum_calculation": "when_required"} \
    if "request_checksum_calculation" in botocore.config.Config.OPTION_DEFAULTS else {}


class S3Store:
    """ObjectStore over botocore; thread-safe (one client, a connection pool sized to concurrency)."""

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
        self._client = session.create_client("s3", endpoint_url=cfg.endpoint_url, region_name=cfg.region,
                                             config=config)
        self._gets = PresignedGets(self._client, cfg) if direct_gets_possible() else None
        self._session, self._config = session, config
        self._writes_client = None

    @property
    def writes_client(self):
        """The botocore client a writable mount uploads with (store/uploads.py): the same session, credentials and
        retries as `client`, signed by PART_SIGNER, without botocore's default CRC32 (made once, where a mount writes)."""
        if self._writes_client is None:
            self._writes_client = self._session.create_client(
                "s3", endpoint_url=self.cfg.endpoint_url, region_name=self.cfg.region,
                config=self._config.merge(botocore.config.Config(signature_version=PART_SIGNER, **WRITE_CHECKSUMS)))
        return self._writes_client

    @property
    def client(self):
        """The botocore client (the CSI controller's writes use it: csi/admin.py)."""
        return self._client

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
            raise translate(exc, what) from exc

    def list_dir(self, prefix: str) -> Iterator[Listing]:
        if self._gets is not None:
            yield from self._gets.list_pages(prefix, "/")
            return
        paginator = self._client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix, Delimiter="/"):
                yield _listing(page)
        except botocore.exceptions.BotoCoreError as exc:
            raise translate(exc, f"list {prefix!r}") from exc
        except botocore.exceptions.ClientError as exc:
            raise translate(exc, f"list {prefix!r}") from exc

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
            raise translate(exc, f"list {prefix!r}") from exc

    def head(self, key: str) -> ObjectInfo | None:
        if self._gets is not None:
            return self._gets.head(key)
        try:
            resp = self._client.head_object(Bucket=self.bucket, Key=key)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            err = translate(exc, f"head {key!r}")
            if isinstance(err, NotFound):
                return None
            raise err from exc
        return ObjectInfo(key, resp["ContentLength"], resp["ETag"], resp["LastModified"].timestamp())

    def has_prefix(self, prefix: str) -> bool:
        if self._gets is not None:
            return self._gets.has_prefix(prefix)
        try:
            resp = self._client.list_objects_v2(Bucket=self.bucket, Prefix=prefix, MaxKeys=1)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise translate(exc, f"list {prefix!r}") from exc
        return resp.get("KeyCount", 0) > 0

    def probe(self, key: str) -> Listing:
        """The first page of a delimiter listing of the names starting with `key` (see PresignedGets.probe)."""
        if self._gets is not None:
            return self._gets.probe(key)
        try:
            page = self._client.list_objects_v2(Bucket=self.bucket, Prefix=key, Delimiter="/")
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise translate(exc, f"list {key!r}") from exc
        return _listing(page)

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

    @property
    def loop_range_limit(self) -> int:
        """The largest range `read_range_on_loop` takes; 0 where GETs go through botocore or urllib3 only."""
        return self._gets.loop_range_limit if self._gets is not None else 0

    async def read_range_on_loop(self, key: str, start: int, end: int, etag: str, into: memoryview,
                                 progress: Progress) -> None:
        """`read_range` of a range up to `loop_range_limit` bytes, awaited on the event loop (no worker thread)."""
        assert self._gets is not None
        if end > start:
            await self._gets.read_range_on_loop(key, start, end, etag, into, progress)

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
            readinto, release = body_reader(resp["Body"])
            read_body(readinto, into, progress, release, resp["Body"].close, what)
        except StoreError:
            raise
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise translate(exc, what) from exc
        except (OSError, ValueError, http.client.HTTPException) as exc:
            raise TransientError(f"{what}: {type(exc).__name__} while reading the body") from exc


def _listing(page: dict) -> Listing:
    """One ListObjectsV2 answer of botocore as a Listing."""
    return Listing(files=[_info(item) for item in page.get("Contents", ())],
                   dirs=[p["Prefix"] for p in page.get("CommonPrefixes", ())], truncated=bool(page.get("IsTruncated")))


def _info(item: dict) -> ObjectInfo:
    return ObjectInfo(item["Key"], item["Size"], item.get("ETag", ""), item["LastModified"].timestamp())
