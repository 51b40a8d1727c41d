"""The systems under test: Stoker, s3fs-fuse, rclone mount (FUSE mounts), plain boto3, and s3torchconnector."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from typing import Any

from fusecore.process.launch import ended, stop_process
from fusecore.process.mounts import is_mounted, unmount, wait_unmounted

ACCESS_KEY, SECRET_KEY = "bench", "bench-secret"


class Unavailable(RuntimeError):
    """The system cannot run here; the table says why."""


def _wait_mounted(path: str, proc: subprocess.Popen | None, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.ismount(path):
        if proc is not None and proc.poll() is not None:
            raise Unavailable(f"exited with status {proc.returncode} before mounting")
        if time.monotonic() > deadline:
            raise Unavailable("did not mount in time")
        time.sleep(0.05)


def _unmount(path: str) -> None:
    """Unmount (lazily if busy) and wait until mountinfo no longer lists it."""
    if is_mounted(path):
        unmount(path)
    wait_unmounted(path, 20)


class MountedSystem:
    name = "?"
    is_mount = True

    def __init__(self, endpoint: str, bucket: str, workdir: str, cache_bytes: int, *, kernel_cache: bool = True):
        self.kernel_cache = kernel_cache
        self.endpoint = endpoint
        self.bucket = bucket
        self.workdir = workdir
        self.cache_bytes = cache_bytes
        self.mountpoint = os.path.join(workdir, f"mnt-{self.name}")
        self.pid: int | None = None
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(workdir, f"{self.name}.log")
        self.cache_dir: str | None = None  # a disk cache's folder (cache_folder), removed at stop
        self.writable = False  # started for the write cells (the runner sets it): mounted read-write

    def cache_folder(self) -> str:
        """A fresh folder in the workdir for this system's disk cache; `stop` removes it."""
        self.cache_dir = os.path.join(self.workdir, f"{self.name}-cache")
        os.makedirs(self.cache_dir, exist_ok=True)
        return self.cache_dir

    def env(self) -> dict:
        return dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
                    AWS_DEFAULT_REGION="us-east-1")

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        _unmount(self.mountpoint)
        stop_process(self.proc)
        if self.pid and not ended(self.pid):
            deadline = time.monotonic() + 10
            while not ended(self.pid) and time.monotonic() < deadline:
                time.sleep(0.02)
        if self.cache_dir is not None:
            shutil.rmtree(self.cache_dir, ignore_errors=True)


class Stoker(MountedSystem):
    name = "stoker"

    def __init__(self, *args, label: str = "", extra_args: tuple[str, ...] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.extra_args = extra_args  # e.g. a distributed cache's --peers (stoker bench --cluster)
        if label:  # several mounts of one run (cluster nodes), each its own mountpoint and log
            self.mountpoint = os.path.join(self.workdir, f"mnt-{self.name}-{label}")
            self.log_path = os.path.join(self.workdir, f"{self.name}-{label}.log")

    def start(self) -> None:
        os.makedirs(self.mountpoint, exist_ok=True)
        cmd = [sys.executable, "-P", "-m", "stoker", "mount", f"s3://{self.bucket}", self.mountpoint,
               "--endpoint-url", self.endpoint, "--cache-size", str(self.cache_bytes), "--log-file", self.log_path,
               "--metadata-ttl", "3600", *self.extra_args] + ([] if self.kernel_cache else ["--no-kernel-cache"]) \
            + (["--writable"] if self.writable else [])
        result = subprocess.run(cmd, env=self.env(), capture_output=True, text=True)
        if result.returncode != 0:
            raise Unavailable(result.stderr.strip())
        from fusecore.process import control

        self.pid = control.stats(control.default_control_socket(self.mountpoint)).pid


class StokerDisk(Stoker):
    """Stoker with its disk tier (--disk-cache) in the workdir, 16x the memory cache."""

    name = "stoker-disk"

    def start(self) -> None:
        _add_disk(self)
        super().start()


def _add_disk(system: Stoker) -> None:
    system.extra_args = (*system.extra_args, "--disk-cache", system.cache_folder(),
                         "--disk-cache-size", str(16 * system.cache_bytes))


class S3fs(MountedSystem):
    name = "s3fs"
    options: tuple[str, ...] = ()

    def start(self) -> None:
        if not shutil.which("s3fs"):
            raise Unavailable("s3fs is not installed (Debian package s3fs)")
        os.makedirs(self.mountpoint, exist_ok=True)
        passwd = os.path.join(self.workdir, "s3fs.passwd")
        with open(passwd, "w") as f:
            f.write(f"{ACCESS_KEY}:{SECRET_KEY}\n")
        os.chmod(passwd, 0o600)
        # Parallel ranged downloads as s3fs documents them: parallel_count x multipart_size.
        opts = ",".join([f"url={self.endpoint}", "use_path_request_style", f"passwd_file={passwd}",
                         *(() if self.writable else ("ro",)),
                         "parallel_count=32", "multipart_size=8", "max_stat_cache_size=200000",
                         "stat_cache_expire=3600", f"logfile={self.log_path}", "dbglevel=warn", *self.options])
        cmd = ["s3fs", self.bucket, self.mountpoint, "-f", "-o", opts]
        self.proc = subprocess.Popen(cmd, env=self.env(), stdout=subprocess.DEVNULL,
                                     stderr=open(self.log_path + ".err", "w"))
        _wait_mounted(self.mountpoint, self.proc)
        self.pid = self.proc.pid


class S3fsDisk(S3fs):
    """s3fs with its disk cache (use_cache) in the workdir."""

    name = "s3fs-disk"

    def start(self) -> None:
        self.options = (f"use_cache={self.cache_folder()}",)
        super().start()


class Rclone(MountedSystem):
    name = "rclone"

    def start(self) -> None:
        if not shutil.which("rclone"):
            raise Unavailable("rclone is not installed (Debian package rclone)")
        os.makedirs(self.mountpoint, exist_ok=True)
        cache_dir = self.cache_folder()
        env = self.env()
        env.pop("AWS_CA_BUNDLE", None)  # rclone fails at start-up on it
        cmd = ["rclone", "mount", f":s3:{self.bucket}", self.mountpoint, *(() if self.writable else ("--read-only",)),
               "--s3-provider", "Other", "--s3-endpoint", self.endpoint, "--s3-access-key-id", ACCESS_KEY,
               "--s3-secret-access-key", SECRET_KEY, "--s3-force-path-style",
               "--vfs-cache-mode", "full", "--cache-dir", cache_dir, "--vfs-read-chunk-size", "8M",
               "--vfs-read-chunk-size-limit", "256M", "--buffer-size", "64M", "--dir-cache-time", "1h",
               "--vfs-cache-max-size", str(self.cache_bytes), "--log-file", self.log_path, "--log-level", "NOTICE"]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_mounted(self.mountpoint, self.proc)
        self.pid = self.proc.pid


class Boto3Baseline:
    """The naive baseline: one GET stream per file, read in 1 MiB pieces, no cache."""

    name = "boto3"
    is_mount = False

    def __init__(self, endpoint: str, bucket: str, workdir: str, cache_bytes: int, **_: object):
        import boto3
        import botocore.config

        self.bucket = bucket
        self.pid = os.getpid()
        self.client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY,
                                   aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                                   config=botocore.config.Config(max_pool_connections=64,
                                                                 s3={"addressing_style": "path"}))

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def open_read(self, key: str, offset: int = 0, size: int | None = None):
        kw = {}
        if size is not None:
            kw["Range"] = f"bytes={offset}-{offset + size - 1}"
        return self.client.get_object(Bucket=self.bucket, Key=key, **kw)["Body"]

    def write_object(self, key: str, fileobj, *, part: int, concurrency: int) -> None:
        """A bare multipart-upload client (boto3's upload_fileobj) with the part size and concurrency given."""
        from boto3.s3.transfer import TransferConfig

        self.client.upload_fileobj(fileobj, self.bucket, key, Config=TransferConfig(
            multipart_threshold=part, multipart_chunksize=part, max_concurrency=concurrency, use_threads=True))

    def list_stat(self, prefix: str) -> int:
        paginator = self.client.get_paginator("list_objects_v2")
        n = 0
        for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix, Delimiter="/"):
            n += len(page.get("Contents", ()))
        return n


def _key_and_bytes(reader) -> tuple[str, bytes]:
    return reader.key, reader.read()


class S3TorchConnector:
    """AWS's s3torchconnector (the CRT-based S3 client PyTorch users read datasets with): its S3MapDataset under a
    DataLoader, and its S3Checkpoint writer under torch.save. It runs the cells of a dataset reader and of a checkpoint
    writer (`workloads`), and only where it is installed."""

    name = "s3torch"
    is_mount = False
    workloads = ("dataloader", "ckpt")

    def __init__(self, endpoint: str, bucket: str, workdir: str, cache_bytes: int, **_: object):
        self.endpoint, self.bucket = endpoint, bucket
        self.pid = os.getpid()
        self._checkpoint: Any = None  # S3Checkpoint, made at the first checkpoint

    def start(self) -> None:
        try:
            import s3torchconnector  # noqa: F401
        except ImportError:
            raise Unavailable("s3torchconnector is not installed (pip install torch s3torchconnector)") from None
        os.environ.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)  # (its client reads them)

    def stop(self) -> None:
        return None

    def dataset(self, items: list[tuple[str, int]]):
        from s3torchconnector import S3ClientConfig, S3MapDataset

        return S3MapDataset.from_objects([f"s3://{self.bucket}/{key}" for key, _ in items], region="us-east-1",
                                         endpoint=self.endpoint, transform=_key_and_bytes,
                                         s3client_config=S3ClientConfig(force_path_style=True))

    def save_checkpoint(self, key: str, state) -> None:
        """torch.save into S3Checkpoint's writer (a multipart upload on the CRT, complete at the writer's close)."""
        import torch
        from s3torchconnector import S3Checkpoint, S3ClientConfig

        if self._checkpoint is None:  # (one per run of the bench, as a training job keeps one)
            self._checkpoint = S3Checkpoint(region="us-east-1", endpoint=self.endpoint,
                                            s3client_config=S3ClientConfig(force_path_style=True))
        with self._checkpoint.writer(f"s3://{self.bucket}/{key}") as writer:
            torch.save(state, writer)


SYSTEMS: dict[str, type] = {"stoker": Stoker, "s3fs": S3fs, "rclone": Rclone, "boto3": Boto3Baseline,
                            "s3torch": S3TorchConnector}
# The `disk` workload runs each system asked for as these (rclone's full VFS cache is on disk already)
DISK_VARIANTS: dict[str, tuple[type, ...]] = {"stoker": (Stoker, StokerDisk), "s3fs": (S3fsDisk,), "rclone": (Rclone,),
                                             "boto3": (), "s3torch": ()}
WORKERS_SYSTEM = re.compile(r"stoker-w([1-9][0-9]?)")  # Stoker served by N worker processes (--workers N)


def kind_of(name: str) -> type | None:
    """The system a name stands for: one of SYSTEMS, or `stoker-wN` (a mount with --workers N, so that one run shows
    the scaling side by side: --systems stoker-w1,stoker-w8); None if it is none."""
    if name in SYSTEMS:
        return SYSTEMS[name]
    match = WORKERS_SYSTEM.fullmatch(name)
    if match is None:
        return None
    workers = match.group(1)

    def start(self) -> None:
        self.extra_args = (*self.extra_args, "--workers", workers)
        Stoker.start(self)

    return type(f"StokerWorkers{workers}", (Stoker,), {"name": name, "start": start})


def disk_variants(name: str) -> tuple[type, ...]:
    """The systems the `disk` workload runs for one asked for: Stoker (with workers or not) without and with its disk
    tier (`stoker-wN-disk`)."""
    if name in DISK_VARIANTS:
        return DISK_VARIANTS[name]
    kind = kind_of(name)
    if kind is None or not issubclass(kind, Stoker):
        return (kind,) if kind is not None else ()
    stoker = kind

    def start(self) -> None:
        _add_disk(self)
        stoker.start(self)

    return kind, type(f"{kind.__name__}Disk", (kind,), {"name": f"{name}-disk", "start": start})
