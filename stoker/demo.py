"""`stoker demo`: the embedded default. A local S3 server, a generated image-like dataset, a real
mount, three epochs read by concurrent readers the way a data loader would, and a report."""

from __future__ import annotations

import argparse
import importlib.util
import hashlib
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import boto3

from fusecore.process import control
from fusecore.process.mounts import wait_unmounted

from .s3server import MotoServer

BUCKET = "stoker-demo"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "demo", "AWS_SECRET_ACCESS_KEY": "demo-secret", "AWS_DEFAULT_REGION": "us-east-1"}


def add_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the embedded demo: local S3 server, generated dataset, 3 epochs")
    p.add_argument("--files", type=int, default=2000, help="small image-like files (default 2000)")
    p.add_argument("--shards", type=int, default=4, help="large shard files (default 4)")
    p.add_argument("--shard-size", default=32, type=int, help="MiB per shard (default 32)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--readers", type=int, default=8, help="concurrent readers (default 8)")
    p.add_argument("--cache-size", default="1GiB")
    p.set_defaults(func=run)


def make_dataset(client, files: int, shards: int, shard_mib: int) -> dict[str, str]:
    """Upload the generated dataset; returns key -> sha256 so reads can be verified."""
    rng = random.Random(1234)
    plan = [(f"train/class_{i % 10:02d}/img_{i:05d}.jpg", rng.randint(80_000, 120_000), rng.getrandbits(32))
            for i in range(files)]
    plan += [(f"shards/shard-{i:04d}.tar", shard_mib * 1024 * 1024, rng.getrandbits(32)) for i in range(shards)]

    def upload(item: tuple[str, int, int]) -> tuple[str, str]:
        key, size, seed = item
        body = random.Random(seed).randbytes(size)
        client.put_object(Bucket=BUCKET, Key=key, Body=body)
        return key, hashlib.sha256(body).hexdigest()

    with ThreadPoolExecutor(16) as pool:
        return dict(pool.map(upload, plan))


def read_file(path: str) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(1024 * 1024):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("moto") is None:
        print("stoker demo: the embedded S3 server needs moto: pip install 'stoker[demo]' (make demo does)",
              file=sys.stderr)
        return 2
    os.environ.update(CREDENTIALS)
    workdir = tempfile.mkdtemp(prefix="stoker-demo-")
    mountpoint = os.path.join(workdir, "mnt")
    os.mkdir(mountpoint)
    print("stoker demo: starting a local S3 server (moto) ...", flush=True)
    with MotoServer() as server:
        client = boto3.client("s3", endpoint_url=server.endpoint)
        client.create_bucket(Bucket=BUCKET)
        started = time.monotonic()
        expected = make_dataset(client, args.files, args.shards, args.shard_size)
        print(f"generated {len(expected)} objects in {time.monotonic() - started:.1f}s: {args.files} images "
              f"(~100 KB) and {args.shards} shards ({args.shard_size} MiB)", flush=True)
        mount = [sys.executable, "-P", "-m", "stoker", "mount", f"s3://{BUCKET}", mountpoint,
                 "--endpoint-url", server.endpoint, "--cache-size", args.cache_size]
        result = subprocess.run(mount, capture_output=True, text=True)
        if result.returncode != 0:
            print(f"stoker demo: mount failed: {result.stderr.strip()}", file=sys.stderr)
            return 1
        print(f"mounted s3://{BUCKET} at {mountpoint}\n", flush=True)
        try:
            return _epochs(args, mountpoint, expected)
        finally:
            subprocess.run([sys.executable, "-P", "-m", "stoker", "unmount", mountpoint])
            wait_unmounted(mountpoint, 10)
            shutil.rmtree(workdir, ignore_errors=True)


def _epochs(args: argparse.Namespace, mountpoint: str, expected: dict[str, str]) -> int:
    socket = control.default_control_socket(mountpoint)
    keys = sorted(expected)
    header = f"{'epoch':>5} {'seconds':>8} {'MB/s':>8} {'files/s':>8} {'GETs':>6} {'from network':>12} " \
             f"{'stoker cache hits':>17} {'kernel page cache':>17}"
    print(header)
    bad = 0
    before = control.stats(socket)
    for epoch in range(1, args.epochs + 1):
        order = keys[:]
        random.Random(epoch).shuffle(order)  # a shuffled epoch, like a DataLoader with shuffle=True
        started = time.monotonic()
        with ThreadPoolExecutor(args.readers) as pool:
            results = list(pool.map(lambda k: read_file(os.path.join(mountpoint, k)), order))
        seconds = time.monotonic() - started
        after = control.stats(socket)
        read_bytes = sum(size for size, _ in results)
        bad += sum(1 for key, (_, digest) in zip(order, results) if digest != expected[key])
        served_cache = after.served_from_cache - before.served_from_cache
        served_net = after.served_from_network - before.served_from_network
        hits = after.cache.hits - before.cache.hits
        misses = after.cache.misses - before.cache.misses
        gets = after.get_requests - before.get_requests
        kernel = max(0, read_bytes - served_cache - served_net)
        hit_ratio = f"{hits / (hits + misses):.1%}" if hits + misses else "-"
        print(f"{epoch:>5} {seconds:>8.2f} {read_bytes / seconds / 1e6:>8.1f} {len(order) / seconds:>8.0f} "
              f"{gets:>6} {served_net / 1e6:>10.1f}MB {hit_ratio:>17} {kernel / max(read_bytes, 1):>17.1%}",
              flush=True)
        before = after
    print()
    if bad:
        print(f"stoker demo: {bad} files read back with WRONG bytes", file=sys.stderr)
        return 1
    print(f"all {len(keys) * args.epochs} reads matched the objects' sha256. Epochs 2+ are served from memory "
          f"(Stoker's block cache and the kernel page cache, kept while ETags are unchanged).")
    return 0

