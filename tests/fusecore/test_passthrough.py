"""FUSE passthrough of files held whole on the disk tier, on real mounts: the kernel reads the held file itself (no
READ reaches the mount), every byte is the object's, and a changed object is never answered with its old bytes.
Memory is read first: a file memory holds is answered by the mount as before."""

from __future__ import annotations

import errno
import os
import time

import pytest

from fusecore.process import control
from tests.conftest import requires_fuse
from tests.support.waiting import wait_for

KiB, MiB = 1024, 1024 * 1024

pytestmark = [pytest.mark.integration, requires_fuse,
              pytest.mark.skipif(os.geteuid() != 0, reason="backing files need CAP_SYS_ADMIN")]


def _read(path: str) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return b"".join(iter(lambda: f.read(64 * KiB), b""))


def _mount_held(s3, bucket, mounts, tmp_path, dataset, *extra, drop: bool = True, disk: bool = True):
    """A mount that holds every file of `dataset`: on its disk tier (memory dropped where `drop`), or, without a
    disk tier (`disk=False`, a mount of several workers), in the workers' shared memory."""
    for name, body in dataset.items():
        s3.put_object(Bucket=bucket, Key=name, Body=body)
    tier = ()
    if disk:
        (tmp_path / "disk").mkdir()
        tier = ("--disk-cache", str(tmp_path / "disk"), "--disk-cache-size", "64MiB")
    mp = mounts.mount(f"s3://{bucket}", "--block-size", "1MiB", "--cache-size", "8MiB" if disk else "32MiB",
                      "--no-kernel-cache", *tier, *extra)
    stats = mounts.stats(mp)
    if "passthrough" not in stats:
        pytest.skip("this kernel offers no FUSE passthrough (Linux 6.9+)")
    if not disk:  # a warm: a file a worker read into its own memory would be read from there first
        for _ in control.warm(control.default_control_socket(mp), list(dataset)):
            pass
        blocks = sum(-(-len(body) // MiB) for body in dataset.values())
        assert wait_for(lambda: mounts.stats(mp)["shared"]["blocks"] >= blocks, 30), mounts.stats(mp)["shared"]
        return mp
    for name, body in dataset.items():  # the first pass reads through the mount and fills the tier
        assert _read(os.path.join(mp, name)) == body
    assert wait_for(lambda: mounts.stats(mp)["disk"]["written"] >= len(dataset), 30), mounts.stats(mp)["disk"]
    if drop:  # memory is read first: held on disk only from now on
        socket = control.default_control_socket(mp)

        def dropped() -> bool:
            """Memory empty, and nothing on its way into it: a GET of the first pass's walk that lands after a drop
            leaves its block in some worker's memory, which an open then reads from (a READ, in a CI run)."""
            control.call(socket, {"op": "drop"})
            stats = mounts.stats(mp)
            return stats["cache"]["entries"] == 0 and stats["inflight"]["requests"] == 0

        assert wait_for(dropped, 30), mounts.stats(mp)["cache"]
    return mp


def test_a_held_file_is_read_by_the_kernel_and_no_read_reaches_the_mount(s3, bucket, mounts, tmp_path):
    dataset = {f"d/f{i:02d}.jpg": os.urandom(90 * KiB + 3001 * i) for i in range(12)}
    dataset["d/big"] = os.urandom(3 * MiB + 17)  # several blocks: read through the mount as ever
    mp = _mount_held(s3, bucket, mounts, tmp_path, dataset)
    before = mounts.stats(mp)
    for name, body in dataset.items():
        if name != "d/big":
            assert _read(os.path.join(mp, name)) == body
    after = mounts.stats(mp)
    assert after["fuse_reads"]["count"] == before["fuse_reads"]["count"], "a held file's reads reach the mount"
    assert after["passthrough"]["opens"] - before["passthrough"]["opens"] == 12, after["passthrough"]
    assert after["requests"]["get"] == before["requests"]["get"]
    assert after["bytes_by_source"]["disk"] - before["bytes_by_source"]["disk"] == \
        sum(len(b) for n, b in dataset.items() if n != "d/big")
    assert _read(os.path.join(mp, "d/big")) == dataset["d/big"]
    assert mounts.stats(mp)["fuse_reads"]["count"] > after["fuse_reads"]["count"]
    assert wait_for(lambda: mounts.stats(mp)["passthrough"]["live"] == 0, 30), "every backing file let go"


def test_no_passthrough_flag_answers_every_read_here(s3, bucket, mounts, tmp_path):
    dataset = {f"f{i}": os.urandom(50 * KiB + i) for i in range(3)}
    for name, body in dataset.items():
        s3.put_object(Bucket=bucket, Key=name, Body=body)
    disk = tmp_path / "disk"
    disk.mkdir()
    mp = mounts.mount(f"s3://{bucket}", "--no-kernel-cache", "--disk-cache", str(disk), "--disk-cache-size",
                      "64MiB", "--no-passthrough")
    for name, body in dataset.items():
        assert _read(os.path.join(mp, name)) == body
    assert wait_for(lambda: mounts.stats(mp)["disk"]["written"] >= len(dataset), 30)
    reads = mounts.stats(mp)["fuse_reads"]["count"]
    for name, body in dataset.items():
        assert _read(os.path.join(mp, name)) == body
    stats = mounts.stats(mp)
    assert "passthrough" not in stats and stats["fuse_reads"]["count"] > reads


@pytest.mark.parametrize("workers, disk", [("1", True), ("2", True), ("2", False)])
def test_a_changed_object_is_never_answered_with_its_held_old_bytes(s3, bucket, mounts, tmp_path, workers, disk):
    """The held file is the old version's; after the listing shows the new ETag an open gets the new bytes. While
    the old version is open in passthrough the kernel takes no other mode for the file: a new open is refused
    (EBUSY) until the old one closes, never answered with old bytes. With two workers, whichever answers the open,
    and whether the disk tier or the workers' shared memory holds the old version."""
    old, new = os.urandom(100 * KiB), os.urandom(120 * KiB)
    mp = _mount_held(s3, bucket, mounts, tmp_path, {"x": old}, "--metadata-ttl", "1", "--workers", workers,
                     disk=disk)
    path = os.path.join(mp, "x")
    held_open = os.open(path, os.O_RDONLY)
    try:
        assert mounts.stats(mp)["passthrough"]["live"] == 1
        assert os.pread(held_open, len(old) + 1, 0) == old
        s3.put_object(Bucket=bucket, Key="x", Body=new)
        time.sleep(1.5)  # past the metadata TTL (1 s): a lower bound, which a loaded machine only lengthens

        def refused() -> bool:
            try:
                os.close(os.open(path, os.O_RDONLY))
            except OSError as exc:
                return exc.errno == errno.EBUSY
            return False

        assert wait_for(refused, 30), "an open of the new version beside the old one in passthrough"
        assert os.pread(held_open, len(old) + 1, 0) == old, "an open reads the version it opened"
    finally:
        os.close(held_open)
    assert wait_for(lambda: mounts.stats(mp)["passthrough"]["live"] == 0, 30)
    assert _read(path) == new
    assert mounts.stats(mp)["passthrough"]["refused"] >= 1


def test_a_file_memory_holds_is_read_from_memory_first(s3, bucket, mounts, tmp_path):
    dataset = {f"m{i}": os.urandom(70 * KiB + i) for i in range(4)}
    mp = _mount_held(s3, bucket, mounts, tmp_path, dataset, drop=False)  # memory and disk hold them
    before = mounts.stats(mp)
    for name, body in dataset.items():
        assert _read(os.path.join(mp, name)) == body
    after = mounts.stats(mp)
    assert after["passthrough"]["opens"] == before["passthrough"]["opens"]
    assert after["fuse_reads"]["count"] > before["fuse_reads"]["count"]


def test_a_folder_held_on_disk_is_read_by_the_kernel_not_walked_back_into_memory(s3, bucket, mounts, tmp_path):
    """The directory walk fetches a folder's small files ahead of its reader. Where the disk tier holds them and the
    kernel takes backing files it passes them over: memory is read first at open, so a copy fetched there from
    the disk would turn the kernel's own reads back into READs the mount answers (issue 45, page cache dropped)."""
    dataset = {f"w/f{i:02d}.jpg": os.urandom(60 * KiB + i) for i in range(24)}
    for name, body in dataset.items():
        s3.put_object(Bucket=bucket, Key=name, Body=body)
    disk = tmp_path / "disk"
    disk.mkdir()
    mp = mounts.mount(f"s3://{bucket}", "--cache-size", "32MiB", "--no-kernel-cache", "--disk-cache", str(disk),
                      "--disk-cache-size", "64MiB")
    if "passthrough" not in mounts.stats(mp):
        pytest.skip("this kernel offers no FUSE passthrough (Linux 6.9+)")
    socket = control.default_control_socket(mp)
    for _ in control.warm(socket, ["w"]):  # held on disk, and the walk has not been through the folder yet
        pass
    assert wait_for(lambda: mounts.stats(mp)["disk"]["written"] >= len(dataset), 30), mounts.stats(mp)["disk"]
    control.call(socket, {"op": "drop"})
    before = mounts.stats(mp)
    for name, body in dataset.items():  # a loader going through the folder: the walk's very case
        assert _read(os.path.join(mp, name)) == body
    after = mounts.stats(mp)
    assert after["passthrough"]["opens"] - before["passthrough"]["opens"] == len(dataset), after["passthrough"]
    assert after["fuse_reads"]["count"] == before["fuse_reads"]["count"], "held files were read through the mount"
    assert after["requests"]["get"] == before["requests"]["get"]


def test_held_files_opened_at_once_through_two_workers_share_one_backing_each(s3, bucket, mounts, tmp_path):
    """With two workers the kernel hands an inode's opens and releases to either, and its rule is per inode: one
    backing file while passthrough opens live (another would fail the user's open with EIO). Four threads hold every
    file open at once, twice over: every open passes through, every byte is right, no READ reaches the mount."""
    import threading

    dataset = {f"w/f{i:02d}.jpg": os.urandom(70 * KiB + 911 * i) for i in range(12)}
    mp = _mount_held(s3, bucket, mounts, tmp_path, dataset, "--workers", "2")
    before = mounts.stats(mp)
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def reader() -> None:
        try:
            start.wait(30)
            for _ in range(2):
                files = {name: open(os.path.join(mp, name), "rb", buffering=0) for name in dataset}
                try:
                    for name, f in files.items():
                        assert f.read() == dataset[name], name
                finally:
                    for f in files.values():
                        f.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    after = mounts.stats(mp)
    assert after["fuse_reads"]["count"] == before["fuse_reads"]["count"], "a held file's reads reach the mount"
    assert after["passthrough"]["opens"] - before["passthrough"]["opens"] == 4 * 2 * len(dataset)
    assert wait_for(lambda: mounts.stats(mp)["passthrough"]["live"] == 0, 30), "every backing file let go"
    from fusecore.fuse.passthrough import SharedModes

    modes = SharedModes(f"/dev/shm/stoker-{os.geteuid()}-{after['pid']}")
    assert all(modes.idle(os.stat(os.path.join(mp, name)).st_ino) for name in dataset), "every count back to 0"


def test_with_workers_a_file_held_in_their_shared_memory_is_read_by_the_kernel(s3, bucket, mounts, tmp_path):
    """Several workers share blocks as files on tmpfs (cache/shared.py): a file held whole there is a backing file
    too, so the kernel reads it itself, without the disk tier (issue 45: bytes the mount holds, read by the kernel).
    The hub's policy still hears of each such read; a file the policy evicts while open in passthrough is still read
    right through its open (the kernel holds the file), and a later open reads it through the mount again."""
    dataset = {f"s/f{i:02d}.jpg": os.urandom(80 * KiB + 1013 * i) for i in range(12)}
    dataset["s/big"] = os.urandom(2 * MiB + 5)  # two blocks: read through the workers as ever
    mp = _mount_held(s3, bucket, mounts, tmp_path, dataset, "--workers", "2", disk=False)
    small = {name: body for name, body in dataset.items() if name != "s/big"}
    before = mounts.stats(mp)
    for _ in range(2):  # (the hub's policy keeps a block read twice: the second pass's opens promote them)
        for name, body in small.items():
            assert _read(os.path.join(mp, name)) == body
    after = mounts.stats(mp)
    assert after["fuse_reads"]["count"] == before["fuse_reads"]["count"], "a held file's reads reach the mount"
    assert after["passthrough"]["opens"] - before["passthrough"]["opens"] == 2 * len(small), after["passthrough"]
    assert after["shared"]["backing"] - before["shared"]["backing"] >= len(small), after["shared"]
    assert after["requests"]["get"] == before["requests"]["get"]
    assert wait_for(lambda: mounts.stats(mp)["shared"]["hits"] - before["shared"]["hits"] >= len(small), 30), \
        "the hub's policy heard of the reads"
    assert _read(os.path.join(mp, "s/big")) == dataset["s/big"]
    assert mounts.stats(mp)["fuse_reads"]["count"] > after["fuse_reads"]["count"]

    path = os.path.join(mp, "s/f03.jpg")
    held_open = os.open(path, os.O_RDONLY)
    try:
        assert mounts.stats(mp)["passthrough"]["live"] == 1
        control.call(control.default_control_socket(mp), {"op": "drop"})
        assert mounts.stats(mp)["shared"]["blocks"] == 0, "every shared block evicted"
        assert os.pread(held_open, len(small["s/f03.jpg"]) + 1, 0) == small["s/f03.jpg"]
    finally:
        os.close(held_open)
    assert wait_for(lambda: mounts.stats(mp)["passthrough"]["live"] == 0, 30), "every backing file let go"
    reads, gets = mounts.stats(mp)["fuse_reads"]["count"], mounts.stats(mp)["requests"]["get"]
    assert _read(path) == small["s/f03.jpg"]
    assert mounts.stats(mp)["fuse_reads"]["count"] > reads and mounts.stats(mp)["requests"]["get"] > gets


def test_with_the_page_cache_the_workers_shared_memory_is_not_passed_through(s3, bucket, mounts):
    """A mount that keeps the kernel's page cache answers a file the workers hold in memory through READs, and the
    page cache then serves its next opens: a passthrough open would leave that cache empty, and an open in
    passthrough costs the workers more than one the page cache serves."""
    dataset = {f"k/f{i}": os.urandom(60 * KiB + 7 * i) for i in range(4)}
    for name, body in dataset.items():
        s3.put_object(Bucket=bucket, Key=name, Body=body)
    mp = mounts.mount(f"s3://{bucket}", "--workers", "2", "--block-size", "1MiB", "--cache-size", "32MiB")
    for _ in control.warm(control.default_control_socket(mp), list(dataset)):
        pass
    assert wait_for(lambda: mounts.stats(mp)["shared"]["blocks"] >= len(dataset), 30), mounts.stats(mp)["shared"]
    reads = []
    for _ in range(2):
        for name, body in dataset.items():
            assert _read(os.path.join(mp, name)) == body
        reads.append(mounts.stats(mp)["fuse_reads"]["count"])
    stats = mounts.stats(mp)
    assert stats.get("passthrough", {}).get("opens", 0) == 0, stats.get("passthrough")
    assert reads[0] > 0 and reads[1] == reads[0], "the second pass was not served by the page cache"


def test_a_writable_mount_never_hands_the_workers_shared_memory_to_the_kernel(s3, bucket, mounts, tmp_path):
    """A writable mount hands no shared block to the kernel (passthrough.shared_memory_backs: decided while its opens
    for writing went uncounted in the workers' modes, and kept until measured without it). Its disk tier's files
    still pass."""
    dataset = {f"v/f{i}": os.urandom(50 * KiB + 13 * i) for i in range(4)}
    mp = _mount_held(s3, bucket, mounts, tmp_path, dataset, "--workers", "2", "--writable", drop=False)
    for _ in control.warm(control.default_control_socket(mp), list(dataset)):  # (held in shared memory again)
        pass
    before = mounts.stats(mp)
    for name, body in dataset.items():
        assert _read(os.path.join(mp, name)) == body
    after = mounts.stats(mp)
    assert after["shared"]["backing"] == before["shared"]["backing"], after["shared"]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_file_open_in_passthrough_is_not_written_meanwhile_and_keeps_its_bytes(s3, bucket, mounts, tmp_path,
                                                                                 workers):
    """A writable mount: an overwrite, or a new file at a name unlinked meanwhile (it comes back at the same inode),
    while a reader holds the file open in passthrough is refused (EBUSY) and changes nothing. Before, the kernel failed
    that open (EIO) after the mount had begun the write, and its release made the object empty. Once the reader
    closed, both work."""
    dataset = {f"v/f{i}": os.urandom(50 * KiB + 13 * i) for i in range(2)}
    mp = _mount_held(s3, bucket, mounts, tmp_path, dataset, "--workers", workers, "--writable", "--allow-overwrite",
                     "--allow-delete")
    first, second = os.path.join(mp, "v/f0"), os.path.join(mp, "v/f1")

    def stored(key: str) -> bytes | None:
        try:
            return s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        except s3.exceptions.NoSuchKey:
            return None

    with open(first, "rb", buffering=0) as reader:
        assert mounts.stats(mp)["passthrough"]["live"] == 1
        with pytest.raises(OSError) as refused:
            open(first, "wb")
        assert refused.value.errno == errno.EBUSY
        assert reader.read() == dataset["v/f0"] and stored("v/f0") == dataset["v/f0"]
    with open(second, "rb", buffering=0) as reader:
        os.unlink(second)
        with pytest.raises(OSError) as refused:
            os.open(second, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        assert refused.value.errno == errno.EBUSY
        assert reader.read() == dataset["v/f1"] and stored("v/f1") is None, "no empty object made"
    with open(first, "wb") as writer:
        writer.write(b"new bytes")
    with open(second, "wb") as writer:  # (its reader closed just now: the open waits for that RELEASE, up to 2 s)
        writer.write(b"a new file")
    assert stored("v/f0") == b"new bytes" and _read(first) == b"new bytes"
    assert stored("v/f1") == b"a new file" and _read(second) == b"a new file"
