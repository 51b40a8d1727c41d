"""End to end: the real `stoker mount` CLI, a real kernel FUSE mount, a real S3 API (moto)."""

from __future__ import annotations

import errno
import json
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from fusecore.process import control
from fusecore.process.launch import ended
from stoker.s3server import MotoServer, free_port
from tests.conftest import requires_fuse
from tests.support.faultproxy import FaultProxy
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, requires_fuse]
MiB = 1024 * 1024


def put(s3, bucket, key, data):
    s3.put_object(Bucket=bucket, Key=key, Body=data)
    return data


def read_whole(path, chunk=1 * MiB):
    out = bytearray()
    with open(path, "rb", buffering=0) as f:
        while piece := f.read(chunk):
            out += piece
    return bytes(out)


def test_sequential_random_and_concurrent_reads_match_the_objects(s3, bucket, mounts):
    big = put(s3, bucket, "shards/big.tar", random.Random(1).randbytes(40 * MiB + 12345))
    mp = mounts.mount(f"s3://{bucket}", "--cache-size", "256MiB", "--block-size", "1MiB")
    path = os.path.join(mp, "shards/big.tar")
    assert os.path.getsize(path) == len(big)
    assert hashlib.sha256(read_whole(path)).digest() == hashlib.sha256(big).digest()

    rng = random.Random(2)
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(200):
            off = rng.randrange(0, len(big))
            size = rng.choice([1, 4096, 100_000, 256 * 1024, 3 * MiB])
            assert os.pread(fd, size, off) == big[off:off + size]
    finally:
        os.close(fd)

    with ThreadPoolExecutor(6) as pool:
        digests = list(pool.map(lambda _: hashlib.sha256(read_whole(path, 128 * 1024)).digest(), range(6)))
    assert set(digests) == {hashlib.sha256(big).digest()}


def _huge_page_mappings(pid: int) -> list[int]:
    """Sizes (kB) of the process's mappings marked for huge pages (MADV_HUGEPAGE: `hg` in VmFlags)."""
    sizes, size = [], 0
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if line.startswith("Size:"):
                size = int(line.split()[1])
            elif line.startswith("VmFlags:") and "hg" in line.split()[1:]:
                sizes.append(size)
    return sizes


@pytest.mark.parametrize("setting", ["on", "off"])
def test_block_buffers_on_the_pages_chosen_serve_exact_bytes(s3, bucket, mounts, setting):
    """--huge-pages on: the mount's 4 MiB block buffers are mapped for 2 MiB pages (where the kernel has
    them) and every byte read through them is the object's; off: none is."""
    from fusecore.cache import pages

    data = put(s3, bucket, "big/x.bin", random.Random(7).randbytes(24 * MiB + 777))
    mp = mounts.mount(f"s3://{bucket}", "--huge-pages", setting, "--no-kernel-cache")
    path = os.path.join(mp, "big/x.bin")
    assert read_whole(path) == data
    fd = os.open(path, os.O_RDONLY)
    try:
        for off in random.Random(8).sample(range(len(data)), 50):
            assert os.pread(fd, 200_000, off) == data[off:off + 200_000]
    finally:
        os.close(fd)
    stats = mounts.stats(mp)
    offered = pages.thp_mode() not in ("", "never")
    huge = setting == "on" and offered
    assert stats["cache"]["pages"] == ("2 MiB" if huge else "4 KiB"), stats["cache"]
    marked = sum(_huge_page_mappings(stats["pid"]))  # adjacent buffers' mappings may show as one
    assert marked >= 24 * 1024 if huge else marked == 0, marked  # the six whole 4 MiB blocks


def test_many_small_files_read_concurrently_and_listing_sends_no_head(s3, bucket, mounts):
    files = {f"imgs/{i:04d}.jpg": random.Random(i).randbytes(random.Random(i).randint(50_000, 150_000))
             for i in range(300)}
    for key, data in files.items():
        put(s3, bucket, key, data)
    mp = mounts.mount(f"s3://{bucket}")
    names = sorted(os.listdir(os.path.join(mp, "imgs")))
    assert names == sorted(k.split("/")[1] for k in files)
    sizes = {e.name: e.stat().st_size for e in os.scandir(os.path.join(mp, "imgs"))}
    assert sizes == {k.split("/")[1]: len(v) for k, v in files.items()}
    stats = mounts.stats(mp)
    assert stats["requests"]["head"] == 0, "ls -l of the directory sends no HEAD per file"

    order = list(files)
    random.Random(3).shuffle(order)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda k: read_whole(os.path.join(mp, k)), order))
    assert all(g == files[k] for k, g in zip(order, got))
    assert mounts.stats(mp)["requests"]["get"] == len(files), "each small file is fetched whole in one GET"


def test_a_cold_path_costs_one_list_per_directory_and_no_head(s3, bucket, mounts):
    """stat of a/b/c.jpg on a fresh mount: each directory on the way is listed by its first (and only)
    page, which also answers every sibling; no HEAD, no second LIST."""
    data = {f"a/b/{i}.jpg": f"image {i}".encode() for i in range(5)}
    data["a/other.txt"] = b"other"
    for key, body in data.items():
        put(s3, bucket, key, body)
    mp = mounts.mount(f"s3://{bucket}")
    assert os.stat(os.path.join(mp, "a/b/3.jpg")).st_size == len(data["a/b/3.jpg"])
    first = mounts.stats(mp)["requests"]
    assert (first["list"], first["head"]) == (3, 0), "the root, a/ and a/b/: one LIST each"
    for key, body in data.items():
        assert read_whole(os.path.join(mp, key)) == body
    with pytest.raises(FileNotFoundError):
        os.stat(os.path.join(mp, "a/b/missing.jpg"))
    after = mounts.stats(mp)["requests"]
    assert (after["list"], after["head"]) == (3, 0), "siblings and missing names come from those listings"


@pytest.mark.skipif(os.geteuid() != 0, reason="the kernel limits are tuned only by root")
def test_the_kernel_may_queue_more_readahead_for_the_mount(s3, bucket, mounts):
    put(s3, bucket, "f", b"x")
    mp = mounts.mount(f"s3://{bucket}", "--read-ahead-kb", "8192")
    dev = os.stat(mp).st_dev
    with open(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb") as f:
        assert int(f.read()) == 8192
    if not os.path.ismount("/sys/fs/fuse/connections"):  # where the kernel shows each connection's limits
        subprocess.run(["mount", "-t", "fusectl", "fusectl", "/sys/fs/fuse/connections"], check=True)
    with open(f"/sys/fs/fuse/connections/{os.minor(dev)}/max_background") as f:
        assert int(f.read()) == 64  # asked at INIT


def test_second_epoch_is_served_without_new_gets(s3, bucket, mounts):
    data = {f"d/{i}": random.Random(i).randbytes(3 * MiB + i) for i in range(4)}
    for k, v in data.items():
        put(s3, bucket, k, v)
    # Without the kernel page cache every read reaches Stoker, so this checks Stoker's own cache.
    mp = mounts.mount(f"s3://{bucket}", "--no-kernel-cache", "--cache-size", "128MiB", "--block-size", "1MiB")
    for k, v in data.items():
        assert read_whole(os.path.join(mp, k)) == v
    first = mounts.stats(mp)
    for k, v in data.items():
        assert read_whole(os.path.join(mp, k)) == v
    second = mounts.stats(mp)
    assert second["requests"]["get"] == first["requests"]["get"]
    assert second["bytes_served"]["cache"] - first["bytes_served"]["cache"] == sum(map(len, data.values()))


def test_kernel_page_cache_serves_a_reopened_unchanged_file(s3, bucket, mounts):
    v = put(s3, bucket, "f", random.Random(9).randbytes(2 * MiB))
    mp = mounts.mount(f"s3://{bucket}")
    assert read_whole(os.path.join(mp, "f")) == v
    served = mounts.stats(mp)["bytes_served"]
    assert read_whole(os.path.join(mp, "f")) == v
    assert mounts.stats(mp)["bytes_served"] == served, "keep_cache: no FUSE read for the second open"


def test_writes_are_refused_with_erofs_and_ownership_is_configurable(s3, bucket, mounts):
    put(s3, bucket, "f", b"data")
    mp = mounts.mount(f"s3://{bucket}", "--uid", "1234", "--gid", "4321")
    st = os.stat(os.path.join(mp, "f"))
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (1234, 4321, 0o444)
    for action in (lambda: open(os.path.join(mp, "f"), "wb"), lambda: open(os.path.join(mp, "new"), "wb"),
                   lambda: os.mkdir(os.path.join(mp, "d")), lambda: os.unlink(os.path.join(mp, "f"))):
        with pytest.raises(OSError) as err:
            action()
        assert err.value.errno == errno.EROFS


def test_prefix_mount_and_odd_keys_do_not_crash(s3, bucket, mounts):
    for key in ["root/a.txt", "root//double", "root/./dot", "root/dup", "root/dup/inner", "root/dir/", "other/x",
                "root/ünïcode ✓.txt"]:
        put(s3, bucket, key, key.encode())
    mp = mounts.mount(f"s3://{bucket}/root")
    assert sorted(os.listdir(mp)) == sorted(["a.txt", "dup", "dir", "ünïcode ✓.txt"])
    assert os.path.isdir(os.path.join(mp, "dup"))
    assert read_whole(os.path.join(mp, "dup", "inner")) == b"root/dup/inner"
    assert read_whole(os.path.join(mp, "ünïcode ✓.txt")) == "root/ünïcode ✓.txt".encode()
    assert not os.path.exists(os.path.join(mp, "x"))


def test_changed_object_fails_with_eio_and_new_version_appears_after_ttl(s3, bucket, mounts):
    old = put(s3, bucket, "f", b"A" * (4 * MiB))
    mp = mounts.mount(f"s3://{bucket}", "--metadata-ttl", "1", "--block-size", "1MiB", "--no-kernel-cache")
    path = os.path.join(mp, "f")
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(fd, 1000, 0) == old[:1000]
        # The first block's prefetch (of the next block) settles: no GET of the old version is left in flight.
        assert wait_for(lambda: mounts.stats(mp)["inflight"]["requests"] == 0, 30), mounts.stats(mp)["inflight"]
        put(s3, bucket, "f", b"B" * (4 * MiB))
        with pytest.raises(OSError) as err:
            for off in range(MiB, 4 * MiB, MiB):  # a block not fetched before the change
                chunk = os.pread(fd, 1000, off)
                assert chunk == old[off:off + 1000], "never a mix of two versions"
        assert err.value.errno == errno.EIO
    finally:
        os.close(fd)
    time.sleep(1.5)  # past the metadata TTL (1 s): a lower bound, which a loaded machine only lengthens
    assert read_whole(path) == b"B" * (4 * MiB)


def test_object_deleted_after_listing_gives_enoent(s3, bucket, mounts):
    put(s3, bucket, "gone", b"x" * 1000)
    mp = mounts.mount(f"s3://{bucket}", "--metadata-ttl", "forever")
    assert os.listdir(mp) == ["gone"]
    s3.delete_object(Bucket=bucket, Key="gone")
    with pytest.raises(OSError) as err:
        read_whole(os.path.join(mp, "gone"))
    assert err.value.errno == errno.ENOENT


def test_missing_bucket_fails_before_mounting_with_one_line(mounts):
    result = mounts.run("s3://no-such-bucket-xyz")
    assert result.returncode != 0
    assert "does not exist" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not os.path.ismount(result.mountpoint)


def test_wrong_credentials_fail_before_mounting_and_the_secret_is_never_printed(mounts, tmp_path):
    with MotoServer(env={"INITIAL_NO_AUTH_ACTION_COUNT": "1"}) as server:
        import boto3
        boto3.client("s3", endpoint_url=server.endpoint).create_bucket(Bucket="guarded")
        secret = "very-secret-value-123"
        result = mounts.run("s3://guarded", "--log-level", "DEBUG", endpoint=server.endpoint,
                            env={"AWS_SECRET_ACCESS_KEY": secret})
    assert result.returncode != 0
    assert "access denied" in result.stderr.lower()
    assert not os.path.ismount(result.mountpoint)
    logs = "".join(p.read_text() for p in tmp_path.glob("*.log"))
    assert secret not in result.stderr + result.stdout + logs


def test_a_fuse_fd_that_is_not_open_fails_with_a_clear_error(s3, bucket, mounts):
    """--fuse-fd (the mounter hands over a /dev/fuse it mounted): a descriptor that is not open, or
    not /dev/fuse, is refused in one line before anything starts."""
    result = mounts.run(f"s3://{bucket}", "--fuse-fd", "987")
    assert result.returncode == 2 and result.stderr.strip() == \
        "stoker mount: fuse-fd: 987 is not an open /dev/fuse descriptor"
    with open(os.devnull) as other:
        result = subprocess.run([sys.executable, "-m", "stoker", "mount", f"s3://{bucket}", result.mountpoint,
                                 "--fuse-fd", str(other.fileno())], pass_fds=(other.fileno(),),
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "is not an open /dev/fuse descriptor" in result.stderr
    assert not os.path.ismount(result.args[5])


def test_unreachable_endpoint_fails_quickly(mounts):
    started = time.monotonic()
    result = mounts.run("s3://b", "--max-attempts", "2", endpoint="http://127.0.0.1:9")
    assert result.returncode != 0 and "endpoint" in result.stderr
    assert time.monotonic() - started < 30


def test_reads_fail_in_bounded_time_when_the_store_stops_answering(s3, bucket, mounts, moto_server):
    put(s3, bucket, "f", b"z" * (2 * MiB))
    with FaultProxy(moto_server.endpoint) as proxy:
        mp = mounts.mount(f"s3://{bucket}", "--request-timeout", "1", "--max-attempts", "2",
                          "--read-deadline", "4", endpoint=proxy.endpoint)
        os.listdir(mp)
        proxy.set("blackhole")
        started = time.monotonic()
        with pytest.raises(OSError) as err:
            read_whole(os.path.join(mp, "f"))
        assert err.value.errno == errno.EIO
        assert time.monotonic() - started < 15
        proxy.set("pass")
        assert read_whole(os.path.join(mp, "f")) == b"z" * (2 * MiB), "the mount recovers with the store"


def test_slowdown_and_broken_bodies_are_retried_transparently(s3, bucket, mounts, moto_server):
    data = put(s3, bucket, "f", random.Random(5).randbytes(3 * MiB))
    with FaultProxy(moto_server.endpoint) as proxy:
        mp = mounts.mount(f"s3://{bucket}", "--block-size", "1MiB", endpoint=proxy.endpoint)
        os.listdir(mp)
        proxy.set("slowdown", 3)
        assert read_whole(os.path.join(mp, "f")) == data
        assert proxy.faults_served == 3
    data2 = put(s3, bucket, "g", random.Random(6).randbytes(3 * MiB))
    with FaultProxy(moto_server.endpoint) as proxy:
        mp2 = mounts.mount(f"s3://{bucket}", "--block-size", "1MiB", endpoint=proxy.endpoint)
        os.listdir(mp2)
        proxy.set("reset", 2)
        assert read_whole(os.path.join(mp2, "g")) == data2
        assert mounts.stats(mp2)["requests"]["body_retries"] >= 1


def test_stats_warm_drop_and_metrics(s3, bucket, mounts):
    data = {f"w/{i}": random.Random(i).randbytes(MiB + i) for i in range(5)}
    for k, v in data.items():
        put(s3, bucket, k, v)
    port = free_port()
    mp = mounts.mount(f"s3://{bucket}", "--metrics-port", str(port), "--no-kernel-cache")
    stoker = [sys.executable, "-m", "stoker"]
    warm = subprocess.run([*stoker, "warm", mp, "w"], capture_output=True, text=True, timeout=60)
    assert warm.returncode == 0, warm.stderr
    assert "warmed 5 files" in warm.stdout
    gets = mounts.stats(mp)["requests"]["get"]
    for k, v in data.items():
        assert read_whole(os.path.join(mp, k)) == v
    assert mounts.stats(mp)["requests"]["get"] == gets, "warmed files need no GET"

    text = subprocess.run([*stoker, "stats", mp], capture_output=True, text=True).stdout
    assert "hit ratio" in text and f"on {mounts.stats(mp)['cache']['pages']} pages" in text
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for name in ("stoker_bytes_served_total", "stoker_get_latency_seconds_bucket", "stoker_cache_bytes",
                 "stoker_cache_budget_bytes", "stoker_inflight_requests", "stoker_cache_hit_ratio"):
        assert name in metrics

    drop = subprocess.run([*stoker, "drop", mp], capture_output=True, text=True)
    assert drop.returncode == 0 and mounts.stats(mp)["cache"]["bytes"] == 0


def test_foreground_mount_unmounts_cleanly_on_sigterm(s3, bucket, tmp_path, moto_server):
    put(s3, bucket, "f", b"hello")
    mp = tmp_path / "fg"
    mp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "stoker", "mount", f"s3://{bucket}", str(mp), "--foreground",
                             "--endpoint-url", moto_server.endpoint], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mp) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert read_whole(str(mp / "f")) == b"hello"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert not os.path.ismount(mp)
    finally:
        if proc.poll() is None:
            proc.kill()
            subprocess.run(["fusermount3", "-uz", str(mp)])


def test_a_mount_whose_process_was_killed_can_be_unmounted_and_mounted_again(s3, bucket, mounts):
    from fusecore.process.mounts import fs_type, is_mounted

    put(s3, bucket, "f", b"still here")
    mp = mounts.mount(f"s3://{bucket}")
    assert fs_type(mp) == "fuse.stoker"
    pid = mounts.stats(mp)["pid"]
    os.kill(pid, signal.SIGKILL)
    assert wait_for(lambda: ended(pid), 30), "the killed mount process did not end"

    def listing_fails_with() -> int | None:
        try:
            os.listdir(mp)
        except OSError as exc:
            return exc.errno
        return None

    # The kernel aborts the connection once the last of the process's threads closed /dev/fuse (its main thread
    # may show as ended before): a listing sent before that ends ECONNABORTED, every one after it ENOTCONN.
    assert wait_for(lambda: listing_fails_with() == errno.ENOTCONN, 30), listing_fails_with()
    assert is_mounted(mp), "the broken mount is still in mountinfo"
    result = subprocess.run([sys.executable, "-m", "stoker", "unmount", mp], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert not is_mounted(mp)
    mp2 = mounts.mount(f"s3://{bucket}", mountpoint=mp)
    assert read_whole(os.path.join(mp2, "f")) == b"still here"


@pytest.mark.parametrize("entry", ["fusecore", "stoker"])
def test_serve_mount_refuses_a_document_it_does_not_know(tmp_path, entry):
    """The serving process takes only a mount document on stdin: anything else is one line and status 2."""
    doc = {"config": {"store": {"bucket": "b"}, "mountpoint": str(tmp_path), "preload": "/tmp/x.so"},
           "credentials": None, "log_level": "INFO"}
    result = subprocess.run([sys.executable, "-m", entry, "serve-mount"], input=json.dumps(doc), text=True,
                            capture_output=True, timeout=60)
    assert result.returncode == 2 and "unknown setting(s) preload" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not os.path.ismount(str(tmp_path))


@pytest.mark.parametrize("flag, value, named", [
    ("--max-attempts", "0", "max-attempts: must be between 1 and 20"),
    ("--max-attempts", "-1", "max-attempts"),
    ("--read-deadline", "0", "read-deadline: must be between 1 and 86400 seconds"),
    ("--request-timeout", "0", "request-timeout"),
    ("--connect-timeout", "-2", "connect-timeout"),
    ("--max-concurrency", "0", "max-concurrency"),
    ("--read-ahead-kb", "-1", "read-ahead-kb"),
    ("--metrics-port", "70000", "metrics-port"),
    ("--uid", "-1", "uid"),
    ("--cache-size", "1MiB", "cache-size"),
    ("--max-prefetch", "lots", "max-prefetch"),
    ("--initial-prefetch", "lots", "initial-prefetch"),
    ("--peer-timeout", "0", "peer-timeout"),
    ("--huge-pages", "yes", "huge-pages"),
    ("--disk-cache-size", "1GiB", "disk-cache: --disk-cache-size needs --disk-cache DIR"),
    ("--disk-cache", "/var/tmp", "disk-cache-size: --disk-cache needs a size"),
    ("--disk-cache-size", "lots", "disk-cache-size"),
])
def test_bad_flags_are_one_line_naming_the_flag(tmp_path, capsys, flag, value, named):
    """Refused before anything mounts: status 2, one line on stderr naming the setting and its range."""
    from stoker.cli import main

    assert main(["mount", "s3://b", str(tmp_path), flag, value]) == 2
    err = capsys.readouterr().err
    assert named in err and len(err.strip().splitlines()) == 1 and not os.path.ismount(str(tmp_path))


def test_a_bad_flag_ends_the_real_command_with_status_2(tmp_path):
    result = subprocess.run([sys.executable, "-m", "stoker", "mount", "s3://b", str(tmp_path), "--max-attempts", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.strip() == \
        "stoker mount: max-attempts: must be between 1 and 20 (got 0)"


@pytest.mark.parametrize("gets", ["presigned", "botocore"])
@pytest.mark.parametrize("fault", ["shift-range", "ignore-range"])
def test_an_answer_for_other_bytes_is_never_served(s3, bucket, mounts, moto_server, gets, fault):
    """A store or proxy that moves the range or ignores it: retried, then EIO; the bytes read are the
    object's bytes or nothing, on both GET paths."""
    data = put(s3, bucket, "f", random.Random(7).randbytes(2 * MiB))
    env = {"STOKER_BOTOCORE_GETS": "1"} if gets == "botocore" else {}
    with FaultProxy(moto_server.endpoint) as proxy:
        mp = mounts.mount(f"s3://{bucket}", "--block-size", "1MiB", "--read-deadline", "1", "--no-kernel-cache",
                          endpoint=proxy.endpoint, env=env)
        os.listdir(mp)
        proxy.set(fault, 2)  # two tampered answers, then the real ones
        assert read_whole(os.path.join(mp, "f")) == data
        assert proxy.faults_served == 2
        assert mounts.stats(mp)["requests"]["body_retries"] >= 2
        subprocess.run([sys.executable, "-m", "stoker", "drop", mp], check=True, capture_output=True)
        proxy.set(fault, 10_000)  # every answer tampered: the read fails, it never returns other bytes
        with pytest.raises(OSError) as err:
            read_whole(os.path.join(mp, "f"))
        assert err.value.errno == errno.EIO
        proxy.set("pass")
        assert read_whole(os.path.join(mp, "f")) == data  # the mount serves on


def test_seconds_of_throttling_are_ridden_out(s3, bucket, mounts, moto_server):
    """Three seconds of 503 SlowDown (with Retry-After) on every GET: a sequential reader waits them out
    and reads the right bytes; the mount counts the throttled answers."""
    data = put(s3, bucket, "f", random.Random(8).randbytes(4 * MiB))
    with FaultProxy(moto_server.endpoint) as proxy:
        mp = mounts.mount(f"s3://{bucket}", "--block-size", "1MiB", "--read-deadline", "30", endpoint=proxy.endpoint)
        os.listdir(mp)
        proxy.slow_down_for(3.0, retry_after="1")
        started = time.monotonic()
        assert read_whole(os.path.join(mp, "f")) == data
        assert time.monotonic() - started >= 2.5  # it did wait the burst out
        stats = mounts.stats(mp)
        assert stats["requests"]["throttled"] >= 2 and stats["requests"]["throttled"] <= proxy.faults_served


def test_entries_the_kernel_forgets_leave_the_mount_and_come_back_right(s3, bucket, mounts):
    """Bounded metadata through a real kernel: after `ls -l` every entry is held; once the kernel drops its
    dentries (FORGET) and the listing's TTL passed, the mount lets them go; they are listed again on use,
    with the right bytes."""
    data = {f"many/{i:04d}.bin": random.Random(i).randbytes(100 + i) for i in range(300)}
    for k, v in data.items():
        put(s3, bucket, k, v)
    mp = mounts.mount(f"s3://{bucket}", "--metadata-ttl", "1", "--no-kernel-cache")
    names = sorted(os.listdir(os.path.join(mp, "many")))
    sizes = {n: os.stat(os.path.join(mp, "many", n)).st_size for n in names}
    assert sizes == {k.split("/")[1]: len(v) for k, v in data.items()}
    held = mounts.stats(mp)["namespace_entries"]
    assert held >= 300
    time.sleep(1.5)  # the listing expires
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("2\n")  # reclaim dentries and inodes: the kernel sends FORGET for each

    def let_go() -> int:
        os.listdir(mp)  # a kernel request, in case the FORGETs arrived before the TTL passed
        return mounts.stats(mp)["namespace_entries"]

    deadline = time.monotonic() + 20
    while let_go() > held // 10 and time.monotonic() < deadline:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("2\n")
        time.sleep(0.5)
    assert let_go() <= held // 10, (held, let_go())
    for k, v in list(data.items())[::37]:
        assert read_whole(os.path.join(mp, k)) == v


def test_a_mount_process_carries_the_data_path_only(s3, bucket, mounts):
    """The serving process is `python -m fusecore serve-mount`: no CSI, operator or bench front end (grpc,
    the kubernetes client, jsonschema) in its memory. Its idle RSS is in `stoker bench` (issue: <= 60 MiB)."""
    put(s3, bucket, "a", b"a" * 1000)
    mp = mounts.mount(f"s3://{bucket}")
    pid = mounts.stats(mp)["pid"]
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        assert f.read().split(b"\0")[1:5] == [b"-P", b"-m", b"fusecore", b"serve-mount"]
    with open(f"/proc/{pid}/maps") as f:
        maps = f.read()
    for library in ("cygrpc", "_upb", "rpds"):  # grpc, protobuf, jsonschema's native parts
        assert library not in maps, library
    assert read_whole(os.path.join(mp, "a")) == b"a" * 1000


def test_a_mount_started_beside_another_fusecore_serves_the_installed_one(s3, bucket, mounts, tmp_path):
    """`stoker mount` run from a folder holding another `fusecore/` (an older checkout, a user's folder of that
    name): the serving process must not import it (`python -m` would put the working directory first)."""
    decoy = tmp_path / "elsewhere"
    (decoy / "fusecore").mkdir(parents=True)
    marker = tmp_path / "decoy-imported"
    (decoy / "fusecore" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (decoy / "fusecore" / "__main__.py").write_text("raise SystemExit(3)\n")
    data = put(s3, bucket, "a", os.urandom(3 * MiB))
    console = os.path.join(os.path.dirname(sys.executable), "stoker")  # as a user runs it: the console script
    mp = mounts.mount(f"s3://{bucket}", command=[console], cwd=str(decoy))
    assert read_whole(os.path.join(mp, "a")) == data
    assert not marker.exists(), "the serving process imported the fusecore of its working directory"


def test_control_errors_carry_their_kind(s3, bucket, mounts, tmp_path):
    """The control socket answers a failure with its kind, which the client raises as ControlError.kind."""
    put(s3, bucket, "a", b"a")
    mp = mounts.mount(f"s3://{bucket}")
    sock = control.default_control_socket(mp)
    cases = [({"op": "exec", "cmd": ["/bin/true"]}, "unknown_op"), ({"op": "resize", "cache_size": "lots"}, "bad_request"),
             ({"op": "credentials"}, "bad_request")]
    for message, kind in cases:
        with pytest.raises(control.ControlError) as err:
            control.call(sock, message)
        assert err.value.kind == kind, (message, str(err.value))
    with pytest.raises(control.ControlError) as err:
        control.stats(str(tmp_path / "nobody.sock"))
    assert err.value.kind == "unreachable"
    assert control.stats(sock).cache.budget > 0  # and the mount serves on


NOBODY = 65534


@requires_fuse
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("fusermount3"),
                    reason="becomes an ordinary user with setpriv (root only) and mounts through fusermount3")
def test_an_ordinary_user_mounts_through_fusermount3_reads_and_unmounts(s3, bucket, moto_server):
    """Without root the mount goes through the setuid fusermount3, which hands the connection back on a socket;
    the kernel lets only the mounting user in (no allow_other); SIGTERM unmounts through fusermount3 again."""
    body = os.urandom(300 * 1024 + 5)
    put(s3, bucket, "d/a.bin", body)
    home = tempfile.mkdtemp(prefix="stoker-user-")
    mp = os.path.join(home, "mnt")
    proc = None
    try:
        os.chmod(home, 0o755)
        os.mkdir(mp)
        for path in (home, mp):
            os.chown(path, NOBODY, NOBODY)
        as_user = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]
        env = dict(os.environ, HOME=home, XDG_RUNTIME_DIR=home)
        proc = subprocess.Popen([*as_user, sys.executable, "-m", "stoker", "mount", f"s3://{bucket}", mp,
                                 "--foreground", "--endpoint-url", moto_server.endpoint], env=env,
                                stderr=subprocess.PIPE, text=True)
        assert wait_for(lambda: os.path.ismount(mp) or proc.poll() is not None, 60)
        if proc.poll() is not None:
            why = proc.stderr.read() if proc.stderr else ""
            if "failed to open /dev/fuse" in why:  # a sandbox whose setuid binaries run without privilege
                pytest.skip("fusermount3 runs without its setuid privilege here")
            raise AssertionError(why)
        entry = next(line for line in open("/proc/self/mountinfo") if f" {mp} " in line)
        assert " - fuse.stoker stoker:" in entry and f"user_id={NOBODY}" in entry, entry
        read = subprocess.run([*as_user, sys.executable, "-c",
                               f"import hashlib; print(hashlib.sha256(open({os.path.join(mp, 'd', 'a.bin')!r}, "
                               "'rb').read()).hexdigest())"], capture_output=True, text=True, timeout=60)
        assert read.stdout.strip() == hashlib.sha256(body).hexdigest(), read.stderr
        with pytest.raises(PermissionError):
            os.listdir(mp)  # another user (root here): the kernel refuses without allow_other
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not os.path.ismount(mp)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        if os.path.ismount(mp):
            subprocess.run(["umount", "-l", mp], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)

