"""A writable mount (`--writable`), on real mounts against moto: files written in order stream into the bucket and
exist once closed; what S3 cannot do is refused with its errno; overwrite and delete only with their flags; a failed
upload fails the close and leaves no object; uploads a crash left open are aborted at the next start."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal

import pytest

from fusecore.process import control
from tests.conftest import requires_fuse
from tests.support.waiting import wait_for

KiB, MiB = 1024, 1024 * 1024

pytestmark = [pytest.mark.integration, requires_fuse]


def _write(path: str, data: bytes, chunk: int = 1 * MiB) -> None:
    with open(path, "wb", buffering=0) as f:
        for i in range(0, len(data), chunk):
            f.write(data[i:i + chunk])


def _object(s3, bucket: str, key: str) -> bytes | None:
    try:
        return s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    except s3.exceptions.NoSuchKey:
        return None


def _metrics(port: int) -> dict[str, float]:
    """The mount's metrics by name (samples without labels)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples if not s.labels}


def _open_uploads(s3, bucket: str) -> list[str]:
    return [u["Key"] for u in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


def test_files_written_in_order_are_objects_once_closed_and_read_back_at_once(s3, bucket, mounts):
    s3.put_object(Bucket=bucket, Key="data/existing.bin", Body=b"old")
    mp = mounts.mount(f"s3://{bucket}", "--writable", "--part-size", "5MiB", "--no-kernel-cache")
    os.makedirs(os.path.join(mp, "ckpt/step-100"), exist_ok=True)  # a directory is a prefix: made here
    big = os.urandom(23 * MiB + 4321)  # five parts (the last short), several in flight
    small = os.urandom(300 * KiB + 7)  # one PUT
    _write(os.path.join(mp, "ckpt/step-100/model.pt"), big)
    _write(os.path.join(mp, "ckpt/step-100/meta.json"), small, chunk=64 * KiB)
    _write(os.path.join(mp, "ckpt/empty"), b"")
    assert _object(s3, bucket, "ckpt/step-100/model.pt") == big
    assert _object(s3, bucket, "ckpt/step-100/meta.json") == small
    assert _object(s3, bucket, "ckpt/empty") == b""
    # read back through the mount at once, listed with its size
    with open(os.path.join(mp, "ckpt/step-100/model.pt"), "rb") as f:
        assert hashlib.sha256(f.read()).digest() == hashlib.sha256(big).digest()
    assert sorted(os.listdir(os.path.join(mp, "ckpt/step-100"))) == ["meta.json", "model.pt"]
    assert os.stat(os.path.join(mp, "ckpt/step-100/model.pt")).st_size == len(big)
    assert _open_uploads(s3, bucket) == []
    stats = mounts.stats(mp)["writes"]
    assert stats["bytes_written"] == len(big) + len(small) and stats["uploads_completed"] == 3
    assert stats["files_open"] == 0 and stats["uploads_open"] == 0
    import subprocess
    import sys

    shown = subprocess.run([sys.executable, "-m", "stoker", "stats", mp], capture_output=True, text=True).stdout
    assert "written" in shown and "3 objects, 0 aborted" in shown, shown


def test_writers_at_once_each_get_their_own_bytes(s3, bucket, mounts):
    """Four writers at once, 1 MiB writes: each WRITE's data is read into a buffer lent to it until it is answered
    (fuse/session.py), so several are in flight at once; every object must hold its own writer's bytes."""
    from concurrent.futures import ThreadPoolExecutor

    mp = mounts.mount(f"s3://{bucket}", "--writable", "--part-size", "5MiB", "--no-kernel-cache")
    files = {f"ranks/rank{i}.pt": os.urandom(7 * MiB + i * 4099) for i in range(4)}
    os.makedirs(os.path.join(mp, "ranks"))
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda item: _write(os.path.join(mp, item[0]), item[1]), files.items()))
    for key, data in files.items():
        assert _object(s3, bucket, key) == data, key


def test_parts_are_signed_with_their_sha256_and_carry_no_crc(s3, bucket, moto_server):
    """The uploads' own client (store/client.py writes_client): each part's SHA-256 is signed (S3 checks the bytes
    against it), with no software CRC32 beside it; the read client keeps botocore's signer."""
    from fusecore.config import StoreConfig
    from fusecore.store.client import PART_SIGNER, S3Store
    from fusecore.store.uploads import Uploads

    store = S3Store(StoreConfig(bucket=bucket, endpoint_url=moto_server.endpoint, region="us-east-1"))
    uploads = Uploads(store, None)
    sent: list[dict] = []
    store.writes_client.meta.events.register("before-send.s3.UploadPart",
                                             lambda request, **_: sent.append(dict(request.headers)))
    first, rest = os.urandom(5 * MiB), os.urandom(1000)
    upload = uploads.create("signed/model.pt")
    etags = [uploads.part("signed/model.pt", upload, 1, bytearray(first)),
             uploads.part("signed/model.pt", upload, 2, bytearray(rest))]
    uploads.complete("signed/model.pt", upload, etags, len(first) + len(rest))
    assert _object(s3, bucket, "signed/model.pt") == first + rest
    assert [h["X-Amz-Content-SHA256"] for h in sent] == [hashlib.sha256(first).hexdigest().encode(),
                                                         hashlib.sha256(rest).hexdigest().encode()]
    assert not [k for h in sent for k in h if k.lower().startswith("x-amz-checksum") or k.lower() == "content-md5"]
    assert store.client.meta.config.signature_version != PART_SIGNER


def test_what_s3_cannot_do_is_refused_with_its_errno(s3, bucket, mounts):
    s3.put_object(Bucket=bucket, Key="d/old.txt", Body=b"old bytes")
    s3.put_object(Bucket=bucket, Key="d/sub/x", Body=b"x")
    mp = mounts.mount(f"s3://{bucket}", "--writable", "--no-kernel-cache")
    old = os.path.join(mp, "d/old.txt")

    def refused(call, code):
        with pytest.raises(OSError) as caught:
            call()
        assert caught.value.errno == code, caught.value

    refused(lambda: open(old, "wb"), errno.EPERM)  # an existing object: no --allow-overwrite
    refused(lambda: open(old, "ab"), errno.EPERM)  # appended to
    refused(lambda: open(old, "r+b"), errno.EPERM)  # changed in place
    refused(lambda: os.unlink(old), errno.EPERM)  # no --allow-delete
    refused(lambda: os.rename(old, os.path.join(mp, "d/new.txt")), errno.EXDEV)
    refused(lambda: os.rmdir(os.path.join(mp, "d/sub")), errno.ENOTEMPTY)
    refused(lambda: os.link(old, os.path.join(mp, "d/hard")), errno.EPERM)  # (the kernel says EPERM for ENOSYS)
    with open(os.path.join(mp, "d/new.bin"), "wb", buffering=0) as f:
        f.write(b"a" * 1000)
        f.seek(5000)
        refused(lambda: f.write(b"b"), errno.EINVAL)  # a write past where the last one ended
        refused(lambda: open(os.path.join(mp, "d/new.bin"), "rb"), errno.EBUSY)  # being written
    assert _object(s3, bucket, "d/new.bin") == b"a" * 1000
    assert _object(s3, bucket, "d/old.txt") == b"old bytes"


def test_overwrite_and_delete_only_with_their_flags(s3, bucket, mounts):
    s3.put_object(Bucket=bucket, Key="m/model.pt", Body=b"version 1")
    mp = mounts.mount(f"s3://{bucket}", "--writable", "--allow-overwrite", "--allow-delete", "--no-kernel-cache")
    path = os.path.join(mp, "m/model.pt")
    assert open(path, "rb").read() == b"version 1"
    _write(path, b"version 2, longer")
    assert _object(s3, bucket, "m/model.pt") == b"version 2, longer"
    assert open(path, "rb").read() == b"version 2, longer"  # never the old version's bytes
    os.unlink(path)
    assert _object(s3, bucket, "m/model.pt") is None and not os.path.exists(path)
    os.mkdir(os.path.join(mp, "m/empty"))
    os.rmdir(os.path.join(mp, "m/empty"))


def test_a_failed_upload_fails_the_close_and_leaves_no_object(s3, bucket, mounts, moto_server):
    mp = mounts.mount(f"s3://{bucket}", "--writable", "--part-size", "5MiB", "--max-attempts", "1")
    path = os.path.join(mp, "out.bin")
    f = open(path, "wb", buffering=0)
    f.write(os.urandom(6 * MiB))  # the first part is sent: the upload exists
    assert wait_for(lambda: _open_uploads(s3, bucket) == ["out.bin"], 10)
    for upload in s3.list_multipart_uploads(Bucket=bucket)["Uploads"]:  # the store loses it (as an expiry would)
        s3.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    f.write(os.urandom(1 * MiB))
    with pytest.raises(OSError) as caught:
        f.close()
    assert caught.value.errno in (errno.EIO, errno.ENOENT), caught.value
    assert _object(s3, bucket, "out.bin") is None
    assert not os.path.exists(path)
    assert _open_uploads(s3, bucket) == []


def test_uploads_a_killed_mount_left_open_are_aborted_when_it_starts_again(s3, bucket, mounts):
    mp = mounts.mount(f"s3://{bucket}", "--writable", "--part-size", "5MiB")
    pid = mounts.stats(mp)["pid"]
    f = open(os.path.join(mp, "half.bin"), "wb", buffering=0)
    f.write(os.urandom(11 * MiB))
    assert wait_for(lambda: _open_uploads(s3, bucket) == ["half.bin"], 10)
    journal = control.default_control_socket(mp) + ".uploads"
    assert list(json.load(open(journal)).values()) == ["half.bin"]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(OSError):
        f.close()
    mounts.unmount(mp)
    assert _object(s3, bucket, "half.bin") is None
    again = mounts.mount(f"s3://{bucket}", "--writable", mountpoint=mp)
    assert _open_uploads(s3, bucket) == [] and json.load(open(journal)) == {}
    assert not os.path.exists(os.path.join(again, "half.bin"))


def test_writes_need_the_flag_and_the_flags_need_writes(s3, bucket, mounts):
    mp = mounts.mount(f"s3://{bucket}")
    with pytest.raises(OSError) as caught:
        open(os.path.join(mp, "x"), "wb")
    assert caught.value.errno == errno.EROFS
    result = mounts.run(f"s3://{bucket}", "--allow-delete")
    assert result.returncode == 2 and "--writable" in result.stderr


def test_two_workers_write_through_their_hub_and_a_worker_killed_mid_write_fails_that_file(s3, bucket, mounts):
    """--workers 2 --writable: whichever worker gets a file's requests, its writes reach the hub's one upload; a file
    closed through one worker is listed, stat'ed and read through any at once; a name being written is busy in every
    worker; a worker killed mid-write fails the file (no object, no upload left) and the next file is whole."""
    from concurrent.futures import ThreadPoolExecutor

    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp = mounts.mount(f"s3://{bucket}", "--writable", "--allow-delete", "--workers", "2", "--part-size", "5MiB",
                      "--no-kernel-cache", "--metrics-port", str(port))
    os.makedirs(os.path.join(mp, "run/step-1"))
    files = {f"run/step-1/rank{i}.pt": os.urandom(6 * MiB + i * 4099) for i in range(4)}
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda item: _write(os.path.join(mp, item[0]), item[1]), files.items()))
    for key, data in files.items():
        assert _object(s3, bucket, key) == data, key
    for _ in range(3):  # (each listing and open goes to whichever worker reads it first)
        assert sorted(os.listdir(os.path.join(mp, "run/step-1"))) == sorted(k.rsplit("/", 1)[1] for k in files)
        for key, data in files.items():
            assert os.stat(os.path.join(mp, key)).st_size == len(data)
            with open(os.path.join(mp, key), "rb") as f:
                assert f.read() == data
    synced = os.urandom(MiB)
    with open(os.path.join(mp, "run/step-1/open.pt"), "wb", buffering=0) as f:
        f.write(synced)
        for _ in range(4):
            with pytest.raises(OSError) as caught:
                open(os.path.join(mp, "run/step-1/open.pt"), "rb")
            assert caught.value.errno == errno.EBUSY
        os.fsync(f.fileno())  # (relayed: the object exists once it answers)
        assert _object(s3, bucket, "run/step-1/open.pt") == synced
    with open(os.path.join(mp, "run/step-1/rank1.pt"), "rb") as f:
        os.fsync(f.fileno())  # a reader's fsync: nothing to do, through whichever worker
    with pytest.raises(control.ControlError):  # the hub's news is for its workers: the mount's socket refuses it
        control.call(control.default_control_socket(mp), {"op": "news", "news": [{"path": "x", "kind": "gone"}]})
    os.unlink(os.path.join(mp, "run/step-1/rank0.pt"))
    for _ in range(3):
        assert "rank0.pt" not in os.listdir(os.path.join(mp, "run/step-1"))
    assert _object(s3, bucket, "run/step-1/rank0.pt") is None
    stats = mounts.stats(mp)
    assert stats["writes"]["uploads_completed"] == 5 and stats["writes"]["files_open"] == 0
    metrics = _metrics(port)
    assert metrics["stoker_uploads_completed"] == 5 and metrics["stoker_workers"] == 2  # (the hub's writes)

    victim = stats["workers"]["pids"][0]
    with pytest.raises(OSError):
        with open(os.path.join(mp, "run/killed.pt"), "wb", buffering=0) as f:
            f.write(os.urandom(6 * MiB))
            os.kill(victim, signal.SIGKILL)
            assert wait_for(lambda: mounts.stats(mp)["workers"]["restarts"] >= 1, 15)
            for _ in range(4):
                f.write(os.urandom(MiB))
    assert _object(s3, bucket, "run/killed.pt") is None
    assert wait_for(lambda: _open_uploads(s3, bucket) == [], 10), _open_uploads(s3, bucket)
    again = os.urandom(7 * MiB)
    _write(os.path.join(mp, "run/after.pt"), again)
    assert _object(s3, bucket, "run/after.pt") == again


def test_four_seconds_of_503s_during_an_upload_and_the_file_completes_exactly(s3, bucket, mounts, moto_server):
    import time

    from tests.support.faultproxy import FaultProxy

    import socket

    data = os.urandom(17 * MiB + 99)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with FaultProxy(moto_server.endpoint) as proxy:
        mp = mounts.mount(f"s3://{bucket}", "--writable", "--part-size", "5MiB", "--max-attempts", "12",
                          "--metrics-port", str(port), endpoint=proxy.endpoint)
        path = os.path.join(mp, "ckpt.bin")
        started = time.monotonic()
        with open(path, "wb", buffering=0) as f:
            f.write(data[:6 * MiB])
            proxy.slow_down_for(4.0, methods=("PUT", "POST"))
            for i in range(6 * MiB, len(data), MiB):
                f.write(data[i:i + MiB])
        assert time.monotonic() - started >= 4.0 and proxy.faults_served > 0
        writes = mounts.stats(mp)["writes"]
        assert writes["requests_retried"] > 0 and writes["uploads_aborted"] == 0, writes
        metrics = _metrics(port)
        assert metrics["stoker_bytes_written"] == len(data), metrics
        assert metrics["stoker_upload_requests_retried"] == writes["requests_retried"]
    assert _object(s3, bucket, "ckpt.bin") == data
    assert _open_uploads(s3, bucket) == []


def test_a_close_by_another_process_or_before_any_write_completes_nothing(s3, bucket, mounts):
    """A shell's `>` opens the file, moves the descriptor and closes the first one; a child inherits a descriptor
    and closes it at exec: neither is the writer's close (each sends a FLUSH)."""
    import subprocess

    mp = mounts.mount(f"s3://{bucket}", "--writable", "--no-kernel-cache")
    result = subprocess.run(["sh", "-c", f"echo hello > {os.path.join(mp, 'shell.txt')}"], capture_output=True)
    assert result.returncode == 0, result.stderr
    assert _object(s3, bucket, "shell.txt") == b"hello\n"
    with open(os.path.join(mp, "parent.bin"), "wb", buffering=0) as f:
        f.write(b"a" * 1000)
        subprocess.run(["true"], pass_fds=(f.fileno(),), check=True)  # the child's close at its end
        f.write(b"b" * 1000)
    assert _object(s3, bucket, "parent.bin") == b"a" * 1000 + b"b" * 1000


def test_what_is_being_written_or_was_made_outlives_the_listing(s3, bucket, mounts):
    import time

    mp = mounts.mount(f"s3://{bucket}", "--writable", "--metadata-ttl", "1", "--no-kernel-cache")
    os.mkdir(os.path.join(mp, "ckpt"))
    f = open(os.path.join(mp, "ckpt", "a.pt"), "wb", buffering=0)
    f.write(b"x" * 100)
    time.sleep(1.5)  # the listings this mount holds expire
    assert "a.pt" in os.listdir(os.path.join(mp, "ckpt"))
    with pytest.raises(OSError) as caught:
        open(os.path.join(mp, "ckpt", "a.pt"), "wb")  # a second writer of the same name
    assert caught.value.errno == errno.EBUSY
    f.close()
    os.mkdir(os.path.join(mp, "later"))
    time.sleep(1.5)
    with open(os.path.join(mp, "later", "b.pt"), "wb") as g:  # a directory made at start, written much later
        g.write(b"y")
    assert _object(s3, bucket, "ckpt/a.pt") == b"x" * 100 and _object(s3, bucket, "later/b.pt") == b"y"
    with pytest.raises(OSError) as caught:
        os.open(os.path.join(mp, "later", "b.pt"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    assert caught.value.errno == errno.EEXIST
