"""An emulated cloud object store for benchmarks (a fixture, not a product).

S3-compatible enough for Stoker, s3fs-fuse, rclone and boto3: path-style ListObjects v1 and v2
(prefix, delimiter, pagination), HEAD bucket/object, GET with Range, GET ?location; and writes: PUT, multipart
uploads (create, parts, complete, abort), a copy onto itself, DELETE, answering `Expect: 100-continue` as S3 does;
a written object's bytes are checked against the generated content (`GET /_written`; other content, such as a
checkpoint, is kept as its SHA-256 there; a multipart upload's parts are held until it completes). Every request
waits a first-byte latency, and every connection is capped to a bandwidth, like a cloud store.
Object content is generated, not stored: byte i of an object is PATTERN[(i + shift(key)) % len],
so datasets of any size cost no memory and any range can be verified (`expected_bytes`).
No authentication is checked. `GET /_stats` and `POST /_reset` expose request counters.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import hashlib
import itertools
import json
import random
import re
import select
import selectors
import signal
import time
from dataclasses import dataclass
from email.utils import formatdate
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape

PATTERN_SIZE = 4 * 1024 * 1024 + 4093  # not a power of two, so blocks never line up with it
PATTERN = random.Random(20261202).randbytes(PATTERN_SIZE)
_DOUBLE = PATTERN + PATTERN
CHUNK = 256 * 1024
LAST_MODIFIED = "2026-01-01T00:00:00.000Z"
LAST_MODIFIED_HTTP = formatdate(1767225600, usegmt=True)


def shift_of(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % PATTERN_SIZE


def etag_of(key: str, size: int) -> str:
    return '"' + hashlib.md5(f"{key}:{size}".encode()).hexdigest() + '"'


def expected_bytes(key: str, start: int, end: int) -> bytes:
    """The content of [start, end) of `key` (any size; used by clients to verify reads)."""
    out = bytearray()
    shift = shift_of(key)
    pos = start
    while pos < end:
        p = (pos + shift) % PATTERN_SIZE
        n = min(end - pos, PATTERN_SIZE - p)
        out += PATTERN[p:p + n]
        pos += n
    return bytes(out)


@dataclass
class Stats:
    requests: int = 0
    gets: int = 0
    heads: int = 0
    lists: int = 0
    bytes_sent: int = 0
    get_bytes: int = 0  # object bytes (GET bodies): bytes_sent less listings and error bodies
    connections: int = 0
    uploads: int = 0  # requests that write (PUT, multipart, DELETE)
    bytes_received: int = 0


class ObjectStoreServer:
    def __init__(self, objects: dict[str, dict[str, int]], *, latency: float = 0.020,
                 bandwidth: float = 16e6):
        self.buckets = {b: dict(sorted(objs.items())) for b, objs in objects.items()}
        self._sorted_keys = {b: list(objs) for b, objs in self.buckets.items()}
        self.latency = latency
        self.bandwidth = bandwidth  # bytes/s per connection; 0 = unlimited
        self.stats = Stats()
        self.uploads: dict[str, dict] = {}  # multipart uploads open: key, and each part's (length, SHA-256)
        self._upload_ids = itertools.count(1)
        self.written: dict[str, dict] = {}

    # ---- HTTP plumbing -------------------------------------------------------------------
    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, target, _ = line.decode("latin-1").split(" ", 2)
                headers = {}
                while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    k, _, v = h.decode("latin-1").partition(":")
                    headers[k.strip().lower()] = v.strip()
                length = int(headers.get("content-length", 0) or 0)
                body = b""
                if length:
                    if headers.get("expect", "").lower() == "100-continue":  # as S3: the body only once asked for
                        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                        await writer.drain()
                    body = await self._receive(reader, length)
                keep = await self.respond(method, target, headers, writer, body)
                if not keep or headers.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            return
        finally:
            writer.close()

    async def send(self, writer, status: int, headers: dict, body: bytes | None = None,
                   key: str | None = None, start: int = 0, end: int = 0, head_only: bool = False) -> bool:
        reason = {200: "OK", 204: "No Content", 206: "Partial Content", 404: "Not Found", 416: "Range Not Satisfiable",
                  412: "Precondition Failed", 400: "Bad Request", 501: "Not Implemented"}.get(status, "OK")
        length = len(body) if body is not None else end - start
        lines = [f"HTTP/1.1 {status} {reason}", f"Content-Length: {length}", "Server: stoker-bench-store",
                 f"Date: {formatdate(usegmt=True)}"] + [f"{k}: {v}" for k, v in headers.items()]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        if head_only:
            await writer.drain()
            return True
        if body is not None:
            writer.write(body)
            await writer.drain()
            self.stats.bytes_sent += len(body)
            return True
        assert key is not None  # no body: the object to stream
        await self._stream(writer, key, start, end)
        return True

    async def _stream(self, writer, key: str, start: int, end: int) -> None:
        """Send generated bytes, paced to the per-connection bandwidth."""
        shift = shift_of(key)
        began = time.monotonic()
        sent = 0
        pos = start
        while pos < end:
            n = min(CHUNK, end - pos)
            p = (pos + shift) % PATTERN_SIZE
            writer.write(memoryview(_DOUBLE)[p:p + n])
            pos += n
            sent += n
            self.stats.bytes_sent += n
            self.stats.get_bytes += n
            if self.bandwidth:
                ahead = began + sent / self.bandwidth - time.monotonic()
                if ahead > 0:
                    await asyncio.sleep(ahead)
            await writer.drain()

    async def _receive(self, reader, length: int) -> bytes:
        """A request's body, paced to the per-connection bandwidth (uploads cost what downloads cost)."""
        began = time.monotonic()
        parts: list[bytes] = []
        got = 0
        while got < length:
            chunk = await reader.read(min(CHUNK, length - got))
            if not chunk:
                raise asyncio.IncompleteReadError(b"".join(parts), length)
            parts.append(chunk)
            got += len(chunk)
            self.stats.bytes_received += len(chunk)
            if self.bandwidth:
                ahead = began + got / self.bandwidth - time.monotonic()
                if ahead > 0:
                    await asyncio.sleep(ahead)
        return b"".join(parts)

    # ---- uploads: objects written by clients (their bytes checked, then served as generated ones) -------------
    def _add(self, bucket: str, key: str, size: int, right: bool, content: list[bytes]) -> str:
        """A written object: listed and served from now on (its content is the generated one: what a bench writer
        writes, checked here part by part); `written` says whether each byte was the expected one, and for content
        of another kind (a checkpoint) its SHA-256, for the writer to check."""
        if key not in self.buckets[bucket]:
            bisect.insort(self._sorted_keys[bucket], key)
        self.buckets[bucket][key] = size
        self.written[f"{bucket}/{key}"] = {"size": size, "right": right}
        if not right:
            sha = hashlib.sha256()
            for piece in content:
                sha.update(piece)
            self.written[f"{bucket}/{key}"]["sha256"] = sha.hexdigest()
        return etag_of(key, size)

    async def _upload(self, method: str, bucket: str, key: str, query: dict, headers: dict, body: bytes, writer) -> bool:
        self.stats.uploads += 1
        xml = {"Content-Type": "application/xml"}
        if method == "POST" and "uploads" in query:
            new = f"u{next(self._upload_ids)}"
            self.uploads[new] = {"key": key, "parts": {}}
            return await self.send(writer, 200, xml, (
                '<?xml version="1.0" encoding="UTF-8"?><InitiateMultipartUploadResult><Bucket>'
                f'{escape(bucket)}</Bucket><Key>{escape(key)}</Key><UploadId>{new}</UploadId>'
                '</InitiateMultipartUploadResult>').encode())
        upload = query.get("uploadId")
        if upload is not None and upload not in self.uploads:
            return await self.send(writer, 404, xml, _error("NoSuchUpload", "The specified upload does not exist."))
        if method == "PUT" and upload is not None:
            number = int(query["partNumber"])
            digest = hashlib.sha256(body).hexdigest()
            self.uploads[upload]["parts"][number] = (len(body), digest, body)
            return await self.send(writer, 200, {"ETag": f'"{digest[:32]}"'}, b"")
        if method == "POST" and upload is not None:
            parts = self.uploads.pop(upload)["parts"]
            asked = [int(n) for n in re.findall(r"<PartNumber>(\d+)</PartNumber>", body.decode())]
            right, offset = asked == sorted(parts) and bool(asked), 0
            for n in asked:
                size, digest, _ = parts.get(n, (0, "", b""))
                right = right and hashlib.sha256(expected_bytes(key, offset, offset + size)).hexdigest() == digest
                offset += size
            etag = self._add(bucket, key, offset, right, [parts[n][2] for n in asked if n in parts])
            return await self.send(writer, 200, xml, (
                '<?xml version="1.0" encoding="UTF-8"?><CompleteMultipartUploadResult><Bucket>'
                f'{escape(bucket)}</Bucket><Key>{escape(key)}</Key><ETag>{escape(etag)}</ETag>'
                '</CompleteMultipartUploadResult>').encode())
        if method == "DELETE" and upload is not None:
            self.uploads.pop(upload, None)
            return await self.send(writer, 204, {}, b"")
        if method == "PUT":
            source = headers.get("x-amz-copy-source")
            if source is not None:  # a copy onto itself (s3fs sets metadata so): the same bytes
                size = self.buckets[bucket].get(key, 0)
                etag = etag_of(key, size)
                return await self.send(writer, 200, xml, (
                    f'<?xml version="1.0" encoding="UTF-8"?><CopyObjectResult><ETag>{escape(etag)}</ETag>'
                    f'<LastModified>{LAST_MODIFIED}</LastModified></CopyObjectResult>').encode())
            etag = self._add(bucket, key, len(body), body == expected_bytes(key, 0, len(body)), [body])
            return await self.send(writer, 200, {"ETag": etag}, b"")
        if method == "DELETE":
            if self.buckets[bucket].pop(key, None) is not None:
                self._sorted_keys[bucket].remove(key)
            return await self.send(writer, 204, {}, b"")
        return await self.send(writer, 501, {}, b"")

    # ---- S3 semantics ---------------------------------------------------------------------
    async def respond(self, method: str, target: str, headers: dict, writer, body: bytes = b"") -> bool:
        self.stats.requests += 1
        url = urlsplit(target)
        path = unquote(url.path)
        query = {k: v[0] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        if path == "/_stats":
            return await self.send(writer, 200, {"Content-Type": "application/json"},
                                   json.dumps(self.stats.__dict__).encode())
        if path == "/_reset":
            self.stats = Stats()
            return await self.send(writer, 200, {}, b"")
        if path == "/_written":  # objects clients wrote, and whether each byte was the expected one
            return await self.send(writer, 200, {"Content-Type": "application/json"}, json.dumps(self.written).encode())
        if self.latency:
            await asyncio.sleep(self.latency)
        bucket, _, key = path.lstrip("/").partition("/")
        if bucket not in self.buckets:
            return await self.send(writer, 404, {"Content-Type": "application/xml"},
                                   _error("NoSuchBucket", "The specified bucket does not exist"), head_only=method == "HEAD")
        if not key:
            if method == "HEAD":
                return await self.send(writer, 200, {}, b"", head_only=True)
            if "location" in query:
                return await self.send(writer, 200, {"Content-Type": "application/xml"},
                                       b'<?xml version="1.0" encoding="UTF-8"?><LocationConstraint '
                                       b'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"></LocationConstraint>')
            if method == "GET":
                self.stats.lists += 1
                return await self.send(writer, 200, {"Content-Type": "application/xml"}, self._list(bucket, query))
            return await self.send(writer, 501, {}, b"")
        if method in ("PUT", "POST", "DELETE"):
            return await self._upload(method, bucket, key, query, headers, body, writer)
        size = self.buckets[bucket].get(key)
        if size is None:
            return await self.send(writer, 404, {"Content-Type": "application/xml"},
                                   _error("NoSuchKey", "The specified key does not exist."), head_only=method == "HEAD")
        etag = etag_of(key, size)
        common = {"ETag": etag, "Last-Modified": LAST_MODIFIED_HTTP, "Accept-Ranges": "bytes",
                  "Content-Type": "application/octet-stream"}
        if headers.get("if-match") not in (None, "*", etag):
            return await self.send(writer, 412, {"Content-Type": "application/xml"},
                                   _error("PreconditionFailed", "At least one of the pre-conditions failed"))
        if method == "HEAD":
            self.stats.heads += 1
            writer.write(("HTTP/1.1 200 OK\r\n" + f"Content-Length: {size}\r\n" +
                          "".join(f"{k}: {v}\r\n" for k, v in common.items()) + "\r\n").encode())
            await writer.drain()
            return True
        if method != "GET":
            return await self.send(writer, 501, {}, b"")
        self.stats.gets += 1
        start, end, status = 0, size, 200
        if "range" in headers:
            parsed = _parse_range(headers["range"], size)
            if parsed is None:
                return await self.send(writer, 416, {"Content-Range": f"bytes */{size}"}, b"")
            start, end = parsed
            status = 206
            common["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        return await self.send(writer, status, common, key=key, start=start, end=end)

    def _list(self, bucket: str, q: dict) -> bytes:
        prefix = q.get("prefix", "")
        delimiter = q.get("delimiter", "")
        max_keys = min(int(q.get("max-keys", 1000) or 1000), 1000)
        v2 = q.get("list-type") == "2"
        if v2:
            after = q.get("continuation-token") or q.get("start-after") or ""
        else:
            after = q.get("marker", "")
        keys = self._sorted_keys[bucket]

        i = bisect.bisect_right(keys, after) if after else bisect.bisect_left(keys, prefix)
        contents: list[str] = []
        prefixes: list[str] = []
        last = None
        truncated = False
        while i < len(keys):
            key = keys[i]
            if not key.startswith(prefix):
                break
            if len(contents) + len(prefixes) >= max_keys:
                truncated = True
                break
            rest = key[len(prefix):]
            if delimiter and delimiter in rest:
                cp = prefix + rest.split(delimiter, 1)[0] + delimiter
                prefixes.append(cp)
                last = cp
                # skip every key under this common prefix
                i = bisect.bisect_left(keys, cp + "\U0010ffff")
                continue
            contents.append(key)
            last = key
            i += 1
        objs = self.buckets[bucket]
        parts = ['<?xml version="1.0" encoding="UTF-8"?>',
                 '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">',
                 f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix>",
                 f"<MaxKeys>{max_keys}</MaxKeys><IsTruncated>{'true' if truncated else 'false'}</IsTruncated>"]
        if delimiter:
            parts.append(f"<Delimiter>{escape(delimiter)}</Delimiter>")
        if v2:
            parts.append(f"<KeyCount>{len(contents) + len(prefixes)}</KeyCount>")
            if truncated and last is not None:
                parts.append(f"<NextContinuationToken>{escape(last)}</NextContinuationToken>")
        elif truncated and last is not None:
            parts.append(f"<Marker>{escape(q.get('marker', ''))}</Marker><NextMarker>{escape(last)}</NextMarker>")
        for key in contents:
            parts.append(f"<Contents><Key>{escape(key)}</Key><LastModified>{LAST_MODIFIED}</LastModified>"
                         f"<ETag>{escape(etag_of(key, objs[key]))}</ETag><Size>{objs[key]}</Size>"
                         f"<StorageClass>STANDARD</StorageClass></Contents>")
        for cp in prefixes:
            parts.append(f"<CommonPrefixes><Prefix>{escape(cp)}</Prefix></CommonPrefixes>")
        parts.append("</ListBucketResult>")
        return "".join(parts).encode()


def _parse_range(value: str, size: int) -> tuple[int, int] | None:
    if not value.startswith("bytes=") or "," in value:
        return None
    first, _, last = value[6:].partition("-")
    if first == "":
        n = int(last)
        return (max(0, size - n), size) if n > 0 else None
    start = int(first)
    end = min(size, int(last) + 1) if last else size
    if start >= size or start >= end:
        return None
    return start, end


def _error(code: str, message: str) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>{escape(message)}</Message></Error>").encode()


class PreciseSelector(selectors.EpollSelector):
    """asyncio's epoll selector waits whole milliseconds (epoll_wait's resolution, rounded up): every sleep of the
    store's (the first-byte latency, the pacing to the bandwidth) ended up to 1 ms late, ~1.0-1.3 ms a GET in all,
    measured (a GET of 1 byte 21.0 ms median against the 20 ms the store promises). Here the wait is a select() of
    the epoll descriptor itself, to the microsecond, and the events are then taken without waiting."""

    def select(self, timeout: float | None = None):
        if timeout is not None and timeout > 0:
            select.select([self.fileno()], [], [], timeout)
            timeout = 0
        return super().select(timeout)


def precise_loop() -> asyncio.AbstractEventLoop:
    return asyncio.SelectorEventLoop(PreciseSelector())


async def serve(server: ObjectStoreServer, host: str, port: int, ready=None) -> None:
    srv = await asyncio.start_server(server.handle, host, port, backlog=1024)
    if ready is not None:
        ready(srv.sockets[0].getsockname()[1])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with srv:
        await stop.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", required=True, help="JSON: {bucket: {key: size}}")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--latency", type=float, default=0.020, help="first-byte latency, seconds")
    p.add_argument("--bandwidth", type=float, default=16e6, help="bytes/s per connection (0: unlimited)")
    p.add_argument("--port-file", help="write the bound port here once listening")
    args = p.parse_args()
    with open(args.dataset) as f:
        objects = json.load(f)
    server = ObjectStoreServer(objects, latency=args.latency, bandwidth=args.bandwidth)

    def ready(port: int) -> None:
        if args.port_file:
            with open(args.port_file + ".tmp", "w") as f:
                f.write(str(port))
            import os

            os.replace(args.port_file + ".tmp", args.port_file)
        print(f"listening on {args.host}:{port}", flush=True)

    with asyncio.Runner(loop_factory=precise_loop) as runner:  # (not uvloop: its timers have a millisecond's grain too)
        runner.run(serve(server, args.host, args.port, ready))


if __name__ == "__main__":
    main()
