import json
import math

import pytest

from fusecore.config import (WORKERS_AUTO, ConfigError, MountConfig, StoreConfig, auto_workers, parse_s3_url,
                             parse_size, parse_ttl, parse_workers)
from fusecore.process.daemon import usable_cores


@pytest.mark.parametrize("text,expected", [
    ("4GiB", 4 * 1024**3), ("512MiB", 512 * 1024**2), ("64M", 64_000_000), ("1000", 1000),
    ("1.5GiB", int(1.5 * 1024**3)), ("8mib", 8 * 1024**2), (123, 123),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "4 parsecs", "-1", "1e3"])
def test_parse_size_rejects_with_the_setting_named(text):
    with pytest.raises(ConfigError, match="cache-size"):
        parse_size(text, name="cache-size")


def test_parse_ttl():
    assert parse_ttl("forever") == math.inf
    assert parse_ttl("2.5") == 2.5
    with pytest.raises(ConfigError):
        parse_ttl("soon")
    with pytest.raises(ConfigError):
        parse_ttl("-1")


def test_parse_s3_url():
    assert parse_s3_url("s3://b") == ("b", "")
    assert parse_s3_url("s3://b/p/q/") == ("b", "p/q/")
    with pytest.raises(ConfigError):
        parse_s3_url("http://b")
    with pytest.raises(ConfigError):
        parse_s3_url("s3:///p")


def test_mount_config_validates_knobs():
    store = StoreConfig(bucket="b")
    with pytest.raises(ConfigError, match="block-size"):
        MountConfig(store=store, block_size=1024)
    with pytest.raises(ConfigError, match="cache-size"):
        MountConfig(store=store, cache_size=1024**2, block_size=1024**2)
    with pytest.raises(ConfigError, match="max-concurrency"):
        MountConfig(store=StoreConfig(bucket="b", max_concurrency=0))
    cfg = MountConfig(store=store, cache_size=64 * 1024**2, block_size=1024**2)
    assert cfg.inflight_limit <= cfg.cache_size // 8
    assert cfg.prefetch_limit <= cfg.cache_size // 8


def test_format_size_is_for_people():
    from fusecore.config import format_size

    assert format_size(512) == "512 B"
    assert format_size(3.5 * 1024**3) == "3.5 GiB"
    assert format_size(2 * 1024**5) == "2.0 PiB"
    assert parse_size(format_size(64 * 1024**2).replace(" ", "")) == 64 * 1024**2


def test_a_mount_document_round_trips_and_refuses_what_it_does_not_know():
    from fusecore.config import (ConfigError, Credentials, MountConfig, StoreConfig, WebIdentity, config_from_document,
                                 identity_document, identity_from_document, mount_document)

    cfg = MountConfig(store=StoreConfig(bucket="b", prefix="p/", endpoint_url="http://s3", max_concurrency=8),
                      mountpoint="/m", cache_size=1 << 30, metadata_ttl=float("inf"), uid=1000)
    doc = json.loads(json.dumps(mount_document(cfg)))
    assert config_from_document(doc) == cfg and "credentials" not in doc["store"]
    for bad, named in [(dict(doc, exec="/bin/sh"), "exec"), (dict(doc, cache_size="big"), "cache_size"),
                       (dict(doc, store=dict(doc["store"], profile=7)), "profile"),
                       (dict(doc, mountpoint="relative"), "absolute"), (dict(doc, block_size=1), "block-size"),
                       ({k: v for k, v in doc.items() if k != "store"}, "store"), (dict(doc, uid=True), "uid")]:
        with pytest.raises(ConfigError, match=named):
            config_from_document(bad)
    for identity in (Credentials("id", "s3cr3t", "tok"), WebIdentity("arn:aws:iam::1:role/r", "jwt", "s", "http://sts")):
        assert identity_from_document(json.loads(json.dumps(identity_document(identity)))) == identity
        assert "s3cr3t" not in repr(identity) and "jwt" not in repr(identity)
    with pytest.raises(ConfigError, match="unknown field"):
        identity_from_document({"kind": "keys", "access_key_id": "a", "secret_access_key": "b", "LD_PRELOAD": "x"})
    with pytest.raises(ConfigError, match="empty"):
        identity_from_document({"kind": "keys", "access_key_id": "", "secret_access_key": "b"})
    with pytest.raises(ConfigError, match="kind"):
        identity_from_document({"kind": "shell"})


def test_cache_size_auto_holds_this_mounts_part_of_the_dataset_within_half_the_memory():
    from fusecore.config import auto_cache_size, block_squares, distributed_cache_size

    store = StoreConfig(bucket="b")
    alone = MountConfig(store=store, block_size=1024**2)
    ten = [1024**3] * 10
    squares = block_squares(ten, 1024**2)
    size, why = auto_cache_size(alone, 10 * 1024**3, 64 * 1024**3, squares)
    assert size == distributed_cache_size(10 * 1024**3, 1, 1) and "dataset of 10737418240 bytes" in why
    member = MountConfig(store=store, block_size=1024**2, peers="10.0.0.1:7070,10.0.0.2:7070,10.0.0.3:7070,"
                         "10.0.0.4:7070", peer_listen="10.0.0.1:7070", peer_key_file="/k", peer_replicas=2)
    size, why = auto_cache_size(member, 10 * 1024**3, 64 * 1024**3, squares)
    assert size == distributed_cache_size(10 * 1024**3, 4, 2, squares=10 * 1024**3 * 1024**2) and "a 2/4 share" in why
    assert squares == 10 * 1024**3 * 1024**2
    size, why = auto_cache_size(alone, 100 * 1024**3, 64 * 1024**3)
    assert size == 32 * 1024**3 and "capped at 50%" in why
    assert auto_cache_size(alone, 1000, 64 * 1024**3)[0] == 2 * 1024**2, "at least two blocks"


def test_a_member_is_sized_for_what_it_may_own_not_only_for_its_average_share():
    """Blocks land on owners by hash: 2 members of 32 blocks of 4 MiB own 64 MiB on average, give or take 11 MiB,
    more than the 10% headroom. The budget (less its transient part) holds the larger owner's bytes in nearly every
    split, where the average share with headroom alone fails about a third of them."""
    import random

    from fusecore.config import block_squares, distributed_cache_size, kept_fraction

    MiB = 1024**2
    sizes = [4 * MiB] * 32
    budget = distributed_cache_size(sum(sizes), 2, 1, squares=block_squares(sizes, 4 * MiB)) * kept_fraction()
    average = distributed_cache_size(sum(sizes), 2, 1) * kept_fraction()
    rng = random.Random(7)
    largest = [max(owned, 128 * MiB - owned) for owned in
               (sum(4 * MiB for _ in sizes if rng.random() < 0.5) for _ in range(2000))]
    assert sum(owned > budget for owned in largest) <= 2000 * 0.01
    assert sum(owned > average for owned in largest) >= 2000 * 0.2


def test_workers_auto_is_half_the_usable_cores_within_the_cache():
    assert parse_workers("auto") == parse_workers("AUTO") == WORKERS_AUTO and parse_workers("3") == 3
    with pytest.raises(ConfigError, match="workers: must be auto or a number"):
        parse_workers("all")
    with pytest.raises(ConfigError, match="workers"):
        MountConfig(store=StoreConfig(bucket="b"), mountpoint="/m", workers=-1)
    cfg = MountConfig(store=StoreConfig(bucket="b"), mountpoint="/m", workers=WORKERS_AUTO,
                      cache_size=1024**3, block_size=8 * 1024**2)
    assert [auto_workers(cfg, cores)[0] for cores in (1, 1.5, 2, 3, 4, 16, 96)] == [1, 1, 1, 1, 2, 8, 8]
    small = MountConfig(store=StoreConfig(bucket="b"), mountpoint="/m", cache_size=64 * 1024**2,
                        block_size=8 * 1024**2)
    assert auto_workers(small, 16)[0] == 2  # four blocks a worker


def test_usable_cores_follow_the_affinity_and_every_quota_above(tmp_path):
    import os

    affinity = len(os.sched_getaffinity(0))
    (tmp_path / "kubepods" / "pod1" / "ctr").mkdir(parents=True)
    own = tmp_path / "cgroup"
    own.write_text("0::/kubepods/pod1/ctr\n")
    assert usable_cores(str(tmp_path), str(own)) == affinity  # no quota anywhere
    (tmp_path / "kubepods" / "pod1" / "ctr" / "cpu.max").write_text("max 100000\n")
    (tmp_path / "kubepods" / "pod1" / "cpu.max").write_text("50000 100000\n")  # the pod's limit: half a core
    assert usable_cores(str(tmp_path), str(own)) == 1.0  # (never below one)
    (tmp_path / "kubepods" / "pod1" / "cpu.max").write_text(f"{affinity * 300000} 100000\n")
    assert usable_cores(str(tmp_path), str(own)) == affinity  # a quota above the affinity: the affinity
    if affinity > 1:
        (tmp_path / "kubepods" / "cpu.max").write_text("150000 100000\n")
        assert usable_cores(str(tmp_path), str(own)) == 1.5
