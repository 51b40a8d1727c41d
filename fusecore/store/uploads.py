"""Objects written through a writable mount (`--writable`), as the store sees them: one PUT for an object smaller than
a part, else a multipart upload (create, parts, complete), aborted on any failure, so that no object and no partial
object is left. Blocking calls over the store's botocore client (its retries: botocore's `standard` mode); the read
layer runs them in threads (read/writer.py).

A journal (a small file beside the mount's control socket) names every multipart upload this mount has open: one a
crash left open is aborted when the mount starts again (`sweep`), and only those (another writer's uploads under the
same prefix are never touched). The bucket's lifecycle rule AbortIncompleteMultipartUpload is the backstop
(docs/operations.md "Writes").
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

from typing import Any, Protocol

from .errors import StoreError, Unavailable, translate
from .objects import ObjectInfo

log = logging.getLogger(__name__)


class WithClient(Protocol):
    """A store whose botocore client writes (client.S3Store)."""

    bucket: str

    @property
    def writes_client(self) -> Any: ...


class Uploads:
    def __init__(self, store: WithClient, journal: str | None):
        self.store = store
        self.bucket = store.bucket
        self._client = store.writes_client
        self._journal = journal
        self._open: dict[str, str] = {}  # upload id -> key, as in the journal
        self._lock = threading.Lock()
        self.retried = 0  # requests botocore sent again (its retries: throttling, 5xx, a dropped connection)

    def _request(self, what: str, call: str, **params: Any) -> dict:
        """One botocore call on the bucket: its answer, its retries counted (botocore's RetryAttempts, of its answer
        or of its error), its error translated once."""
        try:
            answer = getattr(self._client, call)(Bucket=self.bucket, **params)
        except Exception as exc:  # noqa: BLE001 - translated, once
            self._count_retries(getattr(exc, "response", None))
            raise translate(exc, what) from exc
        self._count_retries(answer)
        return answer

    def _count_retries(self, answer: Any) -> None:
        meta = answer.get("ResponseMetadata", {}) if isinstance(answer, dict) else {}
        n = meta.get("RetryAttempts", 0) if isinstance(meta, dict) else 0
        if n:
            with self._lock:
                self.retried += int(n)

    def put(self, key: str, data: bytes | bytearray) -> ObjectInfo:
        """A whole object in one PUT (smaller than a part)."""
        answer = self._request(f"put {key!r}", "put_object", Key=key, Body=data)
        return ObjectInfo(key=key, size=len(data), etag=answer["ETag"], mtime=time.time())

    def create(self, key: str) -> str:
        upload = self._request(f"upload {key!r}", "create_multipart_upload", Key=key)["UploadId"]
        try:
            with self._lock:
                self._open[upload] = key
                self._write_journal()
        except OSError as exc:  # an upload no journal names could outlive a crash: none is left open
            self.abort(key, upload)
            raise Unavailable(f"upload {key!r}: the upload journal {self._journal}: {exc.strerror or exc}") from None
        return upload

    def part(self, key: str, upload: str, number: int, data: bytes | bytearray) -> str:
        """Send part `number` (from 1); its ETag."""
        return self._request(f"upload {key!r} part {number}", "upload_part", Key=key, UploadId=upload,
                             PartNumber=number, Body=data)["ETag"]

    def complete(self, key: str, upload: str, etags: list[str], size: int) -> ObjectInfo:
        """Only now does the object exist."""
        parts = [{"PartNumber": n, "ETag": etag} for n, etag in enumerate(etags, 1)]
        answer = self._request(f"complete {key!r}", "complete_multipart_upload", Key=key, UploadId=upload,
                               MultipartUpload={"Parts": parts})
        self._closed(upload)
        return ObjectInfo(key=key, size=size, etag=answer["ETag"], mtime=time.time())

    def abort(self, key: str, upload: str) -> None:
        """Drop an upload and its parts (never raises: a failure is logged, the journal keeps it for the next
        start)."""
        try:
            self._request(f"abort {key!r}", "abort_multipart_upload", Key=key, UploadId=upload)
        except StoreError as error:
            if error.kind != "not_found":  # (already gone: completed or aborted before)
                log.warning("could not abort the upload of %s: %s (aborted at the next start)", key, error)
                return
        self._closed(upload)

    def delete(self, key: str) -> None:
        self._request(f"delete {key!r}", "delete_object", Key=key)

    def sweep(self) -> int:
        """Abort the uploads a crash of this mount left open (named in its journal); how many."""
        if self._journal is None:
            return 0
        try:
            with open(self._journal) as f:
                left = json.load(f)
        except FileNotFoundError:
            return 0
        except (OSError, ValueError) as exc:
            log.warning("the upload journal %s is unreadable (%s): nothing aborted from it", self._journal, exc)
            return 0
        count = 0
        for upload, key in dict(left).items() if isinstance(left, dict) else ():
            with self._lock:
                self._open[str(upload)] = str(key)
            self.abort(str(key), str(upload))
            count += 1
        with self._lock:
            self._write_journal()
        return count

    @property
    def open_uploads(self) -> int:
        return len(self._open)

    def _closed(self, upload: str) -> None:
        with self._lock:
            if self._open.pop(upload, None) is not None:
                try:
                    self._write_journal()
                except OSError as exc:  # (the upload is gone: a stale line only costs an abort at the next start)
                    log.warning("the upload journal %s: %s", self._journal, exc.strerror or exc)

    def _write_journal(self) -> None:
        if self._journal is None:
            return
        aside = self._journal + ".new"
        fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self._open, f)
        os.replace(aside, self._journal)


__all__ = ["Uploads", "StoreError"]
