"""A distributed cache of three real mounts on their own loopback addresses (127.0.0.2-4) over one moto
bucket: each warms only the blocks it owns, so the store sends the dataset once; every node then reads
everything, the blocks it does not own from their owners; a killed member costs the others store reads,
never a failed read or other bytes."""

from __future__ import annotations

import os
import signal

import pytest

from fusecore import control
from stoker.s3server import free_port
from tests.conftest import requires_fuse

pytestmark = [pytest.mark.integration, requires_fuse]
MiB = 1024 * 1024


def read_all(mp: str, files: dict[str, bytes]) -> None:
    for key, body in files.items():
        with open(os.path.join(mp, key), "rb", buffering=0) as f:
            got = bytearray()
            while piece := f.read(MiB):
                got += piece
        assert bytes(got) == body, key


def stats(mp: str) -> dict:
    return control.call(control.default_control_socket(mp), {"op": "stats"})


@pytest.fixture
def dataset(s3, bucket):
    files = {f"shards/shard-{i}.tar": os.urandom(2 * MiB + 1000 * i + 17) for i in range(8)}
    files.update({f"images/{i:03d}.jpg": os.urandom(90_000 + i) for i in range(24)})
    for key, body in files.items():
        s3.put_object(Bucket=bucket, Key=key, Body=body)
    return files


def start_cluster(mounts, bucket, tmp_path, key: bytes = b"a shared cache key, 32 bytes...."):
    port = free_port()
    members = [f"127.0.0.{i}:{port}" for i in (2, 3, 4)]
    key_file = tmp_path / "peer.key"
    key_file.write_bytes(key)
    os.chmod(key_file, 0o600)
    # A generous peer timeout: these tests count store bytes, and a loaded CI machine must not turn a slow
    # peer answer into a store read (the bound itself is tested in test_peers.py).
    mps = [mounts.mount(f"s3://{bucket}", "--block-size", "1MiB", "--metadata-ttl", "3600", "--peers",
                        ",".join(members), "--peer-listen", member, "--peer-key-file", str(key_file),
                        "--peer-timeout", "10")
           for member in members]
    return mps, members


def test_the_store_sends_the_dataset_once_and_nodes_read_the_rest_from_their_owners(mounts, bucket, dataset,
                                                                                    tmp_path):
    mps, members = start_cluster(mounts, bucket, tmp_path)
    total = sum(len(b) for b in dataset.values())
    for mp in mps:
        for _ in control.warm(control.default_control_socket(mp), []):
            pass
    fetched = [stats(mp)["bytes_fetched"] for mp in mps]
    assert sum(fetched) == total, "each block came from the store once, to its owner"
    assert all(0.1 * total < f < 0.6 * total for f in fetched), fetched  # about a third each
    shares = [stats(mp)["cluster"]["share"] for mp in mps]
    assert all(abs(s - 1 / 3) < 0.05 for s in shares), shares
    for mp in mps:
        read_all(mp, dataset)
    after = [stats(mp) for mp in mps]
    assert sum(s["bytes_fetched"] for s in after) == total, "every read after the warm was answered by the cluster"
    assert all(s["cluster"]["bytes_from_peers"] > 0 for s in after)
    assert all(s["cluster"]["served_to_peers"] > 0 and not s["cluster"]["peer_failures"] for s in after)


def test_a_killed_member_costs_store_reads_never_a_failed_read(mounts, bucket, dataset, tmp_path):
    mps, members = start_cluster(mounts, bucket, tmp_path)
    for mp in mps:
        for _ in control.warm(control.default_control_socket(mp), []):
            pass
    os.kill(stats(mps[1])["pid"], signal.SIGKILL)
    for mp in (mps[0], mps[2]):
        control.call(control.default_control_socket(mp), {"op": "drop"})
        before = stats(mp)["bytes_fetched"]
        read_all(mp, dataset)  # the dead member's blocks come from the store
        after = stats(mp)
        assert after["bytes_fetched"] > before
        assert after["cluster"]["peer_failures"].get(members[1], 0) >= 1, after["cluster"]
        assert not after["errors"], after["errors"]


def test_a_node_with_another_key_is_refused_and_reads_from_the_store(mounts, bucket, dataset, tmp_path):
    mps, members = start_cluster(mounts, bucket, tmp_path)
    for mp in mps:
        for _ in control.warm(control.default_control_socket(mp), []):
            pass
    outsider_key = tmp_path / "other.key"
    outsider_key.write_bytes(b"another tenant's key, 32 bytes.")
    port = int(members[0].rsplit(":", 1)[1])
    outsider = mounts.mount(f"s3://{bucket}", "--block-size", "1MiB", "--peers",
                            ",".join([*members, f"127.0.0.5:{port}"]), "--peer-listen", f"127.0.0.5:{port}",
                            "--peer-key-file", str(outsider_key), "--peer-timeout", "10")
    read_all(outsider, dataset)
    assert stats(outsider)["cluster"]["bytes_from_peers"] == 0
    assert sum(stats(mp)["cluster"]["refused"] for mp in mps) >= 1


def test_bad_peer_settings_fail_before_mounting(mounts, bucket, tmp_path):
    short = tmp_path / "short.key"
    short.write_bytes(b"short")
    cases = [(["--peers", "127.0.0.2:7000"], "peer-listen"),
             (["--peers", "127.0.0.2:7000", "--peer-listen", "127.0.0.3:7000", "--peer-key-file", str(short)],
              "peer-listen"),
             (["--peers", "127.0.0.2:7000", "--peer-listen", "127.0.0.2:7000", "--peer-key-file", str(short)],
              "peer-key-file"),
             (["--peers", "nohost", "--peer-listen", "nohost", "--peer-key-file", str(short)], "HOST:PORT")]
    for args, named in cases:
        result = mounts.run(f"s3://{bucket}", *args)
        assert result.returncode != 0 and named in result.stderr, (args, result.stderr)


def warm_all(mps) -> None:
    for mp in mps:
        for _ in control.warm(control.default_control_socket(mp), []):
            pass


def test_a_joining_and_a_leaving_member_re_home_their_shares(mounts, bucket, dataset, tmp_path):
    """Membership changes on running mounts (`stoker peers`): after a join the new member owns a third and
    fetches it; after a leave the others take the leaver's share; each time, once re-warmed, every read on
    every member is answered by the cluster (no store bytes), with the objects' bytes."""
    mps, members = start_cluster(mounts, bucket, tmp_path)
    total = sum(len(b) for b in dataset.values())
    a, b, c = mps
    pair = members[:2]
    for mp in (a, b):  # a and b start as a cluster of two; c joins
        control.set_peers(control.default_control_socket(mp), pair)
    assert stats(c)["cluster"]["members"] == 3
    control.set_peers(control.default_control_socket(c), pair + [members[2]])
    warm_all((a, b))
    assert [round(stats(mp)["cluster"]["share"], 1) for mp in (a, b)] == [0.5, 0.5]
    assert sum(stats(mp)["bytes_fetched"] for mp in mps) == total

    for mp in (a, b):  # the join
        reply = control.set_peers(control.default_control_socket(mp), members)
        assert reply["members"] == 3 and abs(reply["share"] - 1 / 3) < 0.05
    warm_all(mps)
    fetched = sum(stats(mp)["bytes_fetched"] for mp in mps)
    assert total < fetched < 1.6 * total, "c fetched about the third it now owns, nothing more"
    for mp in mps:
        read_all(mp, dataset)
    assert sum(stats(mp)["bytes_fetched"] for mp in mps) == fetched, "every read was answered by an owner"
    assert stats(a)["cluster"]["membership_changes"] == 2

    os.kill(stats(b)["pid"], signal.SIGKILL)  # the leave: b dies, a and c are told
    survivors = [members[0], members[2]]
    for mp in (a, c):
        control.set_peers(control.default_control_socket(mp), survivors)
    warm_all((a, c))
    before = [stats(mp)["bytes_fetched"] for mp in (a, c)]
    for mp in (a, c):
        read_all(mp, dataset)
        s = stats(mp)
        assert not s["errors"] and abs(s["cluster"]["share"] - 0.5) < 0.05
    assert [stats(mp)["bytes_fetched"] for mp in (a, c)] == before, "the leaver's share was re-homed by the warm"
    by = stats(a)["bytes_by_source"]
    assert by["peers"] > 0 and by["store"] == stats(a)["bytes_fetched"]


def test_membership_changes_are_checked(mounts, bucket, dataset, tmp_path):
    mps, members = start_cluster(mounts, bucket, tmp_path)
    sock = control.default_control_socket(mps[0])
    for bad, named in (([members[1], members[2]], "must be one of the members"), (["nohost"], "HOST:PORT"),
                       (members, "replicas")):
        with pytest.raises(control.ControlError) as info:
            control.set_peers(sock, bad, replicas=4 if bad == members else None)
        assert named in str(info.value) and info.value.kind == "bad_request"
    assert stats(mps[0])["cluster"]["members"] == 3
