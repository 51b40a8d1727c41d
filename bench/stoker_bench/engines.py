"""Range-GET engines side by side, without FUSE: Stoker's store client (presigned URLs on urllib3,
bodies read straight into the caller's buffer) and the AWS Common Runtime's S3 client (`awscrt`, what
s3torchconnector and Mountpoint build on), if it is installed.

Both fetch the same ranges from one emulated store in one process each: 4 MiB ranges of a large object
(what a sequential reader's prefetch sends) and whole ~110 KB objects (a shuffled image dataset). Each
row gives throughput and the process's CPU-seconds per GiB and per GET; the bytes are checked.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .fixture import StoreProcess
from .objectstore import etag_of, expected_bytes

MiB = 1024 * 1024
BLOCK = 4 * MiB
ACCESS_KEY, SECRET_KEY = "bench", "bench-secret"


@dataclass
class EngineRow:
    engine: str
    shape: str  # "4 MiB ranges" or "small objects"
    concurrency: int
    requests: int
    mb_per_s: float = 0.0
    cpu_s_per_gib: float = 0.0
    cpu_ms_per_get: float = 0.0
    wrong: int = 0
    note: str = ""


def dataset(large_mib: int, small: int) -> tuple[dict[str, int], list[tuple[str, int, int]], list[tuple[str, int, int]]]:
    rng = random.Random(42)
    objects = {"large/object.bin": large_mib * MiB}
    smalls = {f"small/{i:05d}.jpg": rng.randint(90_000, 130_000) for i in range(small)}
    objects.update(smalls)
    ranges = [("large/object.bin", i * BLOCK, (i + 1) * BLOCK) for i in range(large_mib * MiB // BLOCK)]
    wholes = [(key, 0, size) for key, size in smalls.items()]
    return objects, ranges, wholes


def _child(engine: str, endpoint: str, shape: str, jobs: list, concurrency: int, sizes: dict[str, int]) -> dict:
    """Run one engine in a fresh process, so its CPU time is its own."""
    spec = json.dumps({"engine": engine, "endpoint": endpoint, "jobs": jobs, "concurrency": concurrency,
                       "sizes": sizes})
    out = subprocess.run([sys.executable, "-m", "stoker_bench.engines"], input=spec, capture_output=True, text=True,
                         timeout=900, env=dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY,
                                               AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION="us-east-1"))
    if out.returncode != 0:
        return {"note": (out.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(workdir: str, *, engines: list[str], large_mib: int = 512, small: int = 600, latency: float = 0.02,
        bandwidth: float = 16e6, log=print) -> list[EngineRow]:
    objects, ranges, wholes = dataset(large_mib, small)
    rows = []
    with StoreProcess({"bench": objects}, latency=latency, bandwidth=bandwidth, workdir=workdir) as store:
        for shape, jobs, concurrency in (("4 MiB ranges", ranges, 32), ("small objects", wholes, 8)):
            for engine in engines:
                row = EngineRow(engine, shape, concurrency, len(jobs))
                result = _child(engine, store.endpoint, shape, jobs, concurrency, objects)
                for name, value in result.items():
                    setattr(row, name, value)
                rows.append(row)
                log(f"{shape:>14} {engine:>7}: " + (row.note or f"{row.mb_per_s} MB/s, {row.cpu_s_per_gib} CPU-s/GiB, "
                                                    f"{row.cpu_ms_per_get} ms CPU per GET, wrong {row.wrong}"))
    return rows


def table(rows: list[EngineRow]) -> str:
    lines = ["| shape | engine | concurrency | GETs | MB/s | CPU-s/GiB | CPU ms/GET | wrong | note |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.shape} | {r.engine} | {r.concurrency} | {r.requests} | {r.mb_per_s} | {r.cpu_s_per_gib} | "
                     f"{r.cpu_ms_per_get} | {r.wrong} | {r.note} |")
    return "\n".join(lines)


# ---- the child process: one engine, timed ----------------------------------------------------------

def _stoker_fetch(endpoint: str, sizes: dict[str, int]):
    from fusecore.config import StoreConfig
    from fusecore.store.objects import Progress
    from fusecore.store.client import S3Store

    store = S3Store(StoreConfig(bucket="bench", endpoint_url=endpoint))

    def fetch(key: str, start: int, end: int, into: memoryview) -> None:
        store.read_range(key, start, end, etag_of(key, sizes[key]), into, Progress())

    return fetch


def _crt_fetch(endpoint: str, concurrency: int):
    from awscrt.auth import AwsCredentialsProvider
    from awscrt.http import HttpHeaders, HttpRequest
    from awscrt.io import ClientBootstrap, DefaultHostResolver, EventLoopGroup
    from awscrt.s3 import S3Client, S3RequestTlsMode, S3RequestType

    loops = EventLoopGroup(2)
    client = S3Client(bootstrap=ClientBootstrap(loops, DefaultHostResolver(loops)), region="us-east-1",
                      tls_mode=S3RequestTlsMode.DISABLED,
                      credential_provider=AwsCredentialsProvider.new_static(ACCESS_KEY, SECRET_KEY),
                      part_size=8 * MiB, max_active_connections_override=concurrency)
    host = endpoint.split("://", 1)[1]

    def fetch(key: str, start: int, end: int, into: memoryview) -> None:
        def on_body(chunk, offset, **_):
            into[offset - start:offset - start + len(chunk)] = chunk

        headers = HttpHeaders([("Host", host), ("Range", f"bytes={start}-{end - 1}")])
        request = client.make_request(type=S3RequestType.DEFAULT, operation_name="GetObject",
                                      request=HttpRequest("GET", f"/bench/{key}", headers), on_body=on_body)
        request.finished_future.result(timeout=120)

    return fetch


def child_main() -> None:
    spec = json.loads(sys.stdin.read())
    jobs, concurrency = spec["jobs"], spec["concurrency"]
    if spec["engine"] == "awscrt":
        fetch = _crt_fetch(spec["endpoint"], concurrency)
    else:
        fetch = _stoker_fetch(spec["endpoint"], spec["sizes"])
    buffers = threading.local()
    wrong = 0

    def one(job) -> int:
        nonlocal wrong
        key, start, end = job
        buf = getattr(buffers, "buf", None)
        if buf is None or len(buf) < end - start:
            buf = buffers.buf = bytearray(max(end - start, BLOCK))
        view = memoryview(buf)[:end - start]
        fetch(key, start, end, view)
        if start % (16 * BLOCK) == 0 and bytes(view) != expected_bytes(key, start, end):
            wrong += 1
        return end - start

    before, started = os.times(), time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        total = sum(pool.map(one, jobs))
    seconds, after = time.monotonic() - started, os.times()
    cpu = (after.user - before.user) + (after.system - before.system)
    print(json.dumps({"mb_per_s": round(total / seconds / 1e6, 1), "cpu_s_per_gib": round(cpu / (total / 2**30), 2),
                      "cpu_ms_per_get": round(cpu / len(jobs) * 1000, 2), "wrong": wrong}))


def available() -> list[str]:
    engines = ["stoker"]
    try:
        import awscrt.s3  # noqa: F401
        engines.append("awscrt")
    except ImportError:
        pass
    return engines


if __name__ == "__main__":
    child_main()
