"""Shared fixtures: a real moto S3 server, buckets, and real `stoker mount` processes."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import time
import uuid

import boto3
import pytest

from fusecore.process import control
from fusecore.process.launch import ended
from stoker.s3server import MotoServer

CREDS = {"AWS_ACCESS_KEY_ID": "testing-key", "AWS_SECRET_ACCESS_KEY": "testing-secret",
         "AWS_DEFAULT_REGION": "us-east-1"}
_counter = itertools.count()


@pytest.fixture(scope="session", autouse=True)
def aws_env():
    saved = {k: os.environ.get(k) for k in CREDS}
    os.environ.update(CREDS)
    for var in ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        os.environ.pop(var, None)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def moto_server():
    with MotoServer() as server:
        yield server


@pytest.fixture
def s3(moto_server):
    return boto3.client("s3", endpoint_url=moto_server.endpoint)


@pytest.fixture
def bucket(s3):
    name = f"test-{next(_counter)}-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=name)
    return name


def fuse_ready() -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    if not (shutil.which("fusermount3") or os.geteuid() == 0):
        return "fusermount3 is missing"
    return None


requires_fuse = pytest.mark.skipif(fuse_ready() is not None, reason=f"no FUSE: {fuse_ready()}")


class Mounts:
    """Starts `stoker mount` processes (the real CLI) and tears them down."""

    def __init__(self, tmp_path, endpoint):
        self.tmp_path = tmp_path
        self.endpoint = endpoint
        self.mounted: list[str] = []

    def run(self, source: str, *extra: str, endpoint: str | None = None, env: dict | None = None,
            mountpoint: str | None = None, command: list[str] | None = None,
            cwd: str | None = None) -> subprocess.CompletedProcess:
        mp = mountpoint or str(self.tmp_path / f"mnt{len(self.mounted)}")
        os.makedirs(mp, exist_ok=True)
        cmd = [*(command or [sys.executable, "-m", "stoker"]), "mount", source, mp, "--endpoint-url", endpoint or self.endpoint,
               "--log-file", str(self.tmp_path / f"mount{len(self.mounted)}.log"), *extra]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=cwd,
                                env=dict(os.environ, **(env or {})))
        result.mountpoint = mp
        if result.returncode == 0:
            self.mounted.append(mp)
        return result

    def mount(self, source: str, *extra: str, **kw) -> str:
        result = self.run(source, *extra, **kw)
        assert result.returncode == 0, result.stderr
        assert os.path.ismount(result.mountpoint)
        return result.mountpoint

    def stats(self, mp: str) -> dict:
        return control.call(control.default_control_socket(mp), {"op": "stats"})

    def unmount(self, mp: str) -> None:
        pid = None
        try:
            pid = self.stats(mp)["pid"]
        except Exception:  # noqa: BLE001
            pass
        subprocess.run([sys.executable, "-m", "stoker", "unmount", mp], capture_output=True)
        if os.path.ismount(mp):
            subprocess.run(["fusermount3", "-uz", mp], capture_output=True)
        if pid:
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and not ended(pid):
                time.sleep(0.02)
            if not ended(pid):
                os.kill(pid, 9)
        if mp in self.mounted:
            self.mounted.remove(mp)

    def cleanup(self) -> None:
        """Unmount every mount of the test at once (each waits for its process to end: ~3 s)."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max(1, len(self.mounted))) as pool:
            list(pool.map(self.unmount, list(self.mounted)))


@pytest.fixture
def mounts(tmp_path, moto_server):
    m = Mounts(tmp_path, moto_server.endpoint)
    yield m
    m.cleanup()


@pytest.fixture(scope="session")
def guarded():
    """A moto server that enforces IAM, with users, a pod role and web-identity STS (tests/support/guarded.py)."""
    from tests.support.guarded import start_guarded

    server, store = start_guarded()
    yield store
    store.sts.__exit__()
    server.stop()
