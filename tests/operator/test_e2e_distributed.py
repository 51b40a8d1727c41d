"""End to end, a distributed DatasetCache: the real operator plans three nodes' shares, three real `stoker csi`
node plugins (each its own node, state and loopback address 127.0.0.2-4, one peer port per node) warm
only what their node owns into real mounts, find each other through the DatasetCacheNodes' status, and
serve each other through their peer routers: reading the whole dataset on one node costs the store
nothing, bytes exact. A node leaving the plan re-homes its share; a member's mount killed costs reads
nothing but speed."""

from __future__ import annotations

import hashlib
import json
import os
import signal

import pytest

from csi.volumes import kubelet_staging_path
from fusecore.process import control
from stoker.s3server import free_port
from tests.conftest import requires_fuse
from tests.csi.conftest import SECRETS
from tests.support.waiting import unmount_everything_under

from .conftest import NAMESPACE, add_cache, add_node, add_secret, node_object, node_report, status
from .test_e2e import NodePlugin

pytestmark = [pytest.mark.integration, requires_fuse]

NODES = {"gpu-1": "127.0.0.2", "gpu-2": "127.0.0.3", "gpu-3": "127.0.0.4"}


@pytest.fixture
def plugins(kube, tmp_path, moto_server):
    port = free_port()
    started = {}
    for node, address in NODES.items():
        plugin = NodePlugin(kube, tmp_path / node, node, ("--peer-address", address, "--peer-port", str(port),
                                                          "--join-wait", "30"))
        plugin.start()
        started[node] = plugin
    yield started, port
    for plugin in started.values():
        plugin.stop()
    unmount_everything_under(str(tmp_path))


def read_all(root: str, files: dict[str, bytes], prefix: str) -> None:
    """Read every file through the mount at `root`, past the kernel's page cache, and compare the bytes."""
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1")
    for key, body in files.items():
        with open(os.path.join(root, key[len(prefix):]), "rb") as f:
            got = f.read()
        assert len(got) == len(body) and hashlib.sha256(got).digest() == hashlib.sha256(body).digest(), key


def test_three_nodes_hold_one_copy_and_serve_each_other(kube, operator, plugins, moto_server, s3, bucket):
    started, port = plugins
    files = {f"data/img/{i:03d}.jpg": os.urandom(30_000 + 911 * i) for i in range(90)}
    files.update({f"data/shards/{i}.tar": os.urandom(5 * 1024 * 1024 + 17 * i) for i in range(3)})
    for key, body in files.items():
        s3.put_object(Bucket=bucket, Key=key, Body=body)
    total = sum(len(b) for b in files.values())
    for node in NODES:
        add_node(kube, node, labels={"pool": "gpu", "rack": "a" if node != "gpu-3" else "b"})
    add_secret(kube, "creds", SECRETS)
    add_cache(kube, "ds", {"source": {"s3": {"bucket": bucket, "prefix": "data", "endpointUrl": moto_server.endpoint,
                                             "secretRef": {"name": "creds"}}},
                           "nodeSelector": {"pool": "gpu"}, "policy": "KeepWarm", "distributed": {"replicas": 1}})
    logs = lambda: {n: p.log()[-1500:] for n, p in started.items()}  # noqa: E731
    assert kube.wait_for(lambda: status(kube, "ds").get("phase") == "Ready", 120), (status(kube, "ds"), logs())
    st = status(kube, "ds")
    assert st["datasetBytes"] == total and st["distributed"]["nodes"] == 3

    # Each node published its peer address, owns about a third, and together they hold the dataset once.
    reports = {n: node_report(kube, "ds", n) for n in NODES}
    assert {n: r["peer"] for n, r in reports.items()} == {n: f"{a}:{port}" for n, a in NODES.items()}
    assert sum(r["shareBytes"] for r in reports.values()) == total
    assert all(r["phase"] == "Ready" and r["share"].endswith("%") for r in reports.values()), reports
    volume = f"s3://{bucket}/data/"
    socks = {n: p.state.control_socket(volume) for n, p in started.items()}
    stats = {n: control.stats(s) for n, s in socks.items()}
    assert sum(s.bytes_fetched for s in stats.values()) == total  # the store sent the dataset once
    assert all(s.cluster is not None and s.cluster.members == 3 for s in stats.values())
    # no node warmed more than its share (shares are uneven in bytes: a 4 MiB block weighs as a 30 kB file)
    assert {n: s.bytes_fetched for n, s in stats.items()} == {n: r["shareBytes"] for n, r in reports.items()}

    # Every file read on gpu-1 is exact, and costs the store nothing: the rest comes from the others.
    root = kubelet_staging_path(started["gpu-1"].kubelet_dir, volume)
    read_all(root, files, "data/")
    after = control.call(socks["gpu-1"], {"op": "stats"})
    assert after["bytes_fetched"] == stats["gpu-1"].bytes_fetched, after["bytes_by_source"]
    assert after["bytes_by_source"]["peers"] >= total - stats["gpu-1"].bytes_fetched - 4 * 1024 * 1024

    # gpu-3 leaves the plan (the selector no longer matches it): its share is re-homed on the two others,
    # which fetch it once; gpu-3 lets its memory go.
    old_plan = st["plan"]
    kube.patch("stoker.dev/v1alpha1", "datasetcaches", "ds", NAMESPACE, {"spec": {"nodeSelector": {"rack": "a"}}})


    def rehomed() -> bool:
        """The new plan is Ready, gpu-3 is gone, and the two shares were warmed for two members (a node may
        first warm the new plan for three, then again when it sees gpu-3 leave)."""
        reports = [node_report(kube, "ds", n) for n in ("gpu-1", "gpu-2")]
        return (status(kube, "ds").get("plan") not in (None, old_plan) and status(kube, "ds").get("phase") == "Ready"
                and node_object(kube, "ds", "gpu-3") is None and all(r.get("phase") == "Ready" for r in reports)
                and sum(r.get("shareBytes", 0) for r in reports) == total)

    assert kube.wait_for(rehomed, 120), (status(kube, "ds"), logs())
    two = {n: node_report(kube, "ds", n) for n in ("gpu-1", "gpu-2")}
    assert {r["share"] for r in two.values()} <= {"50.0%", "49.9%", "50.1%"}, two
    fetched = {n: control.stats(socks[n]).bytes_fetched for n in two}
    assert sum(fetched.values()) - sum(stats[n].bytes_fetched for n in two) <= total - sum(
        stats[n].bytes_fetched for n in two) + 8 * 1024 * 1024  # about gpu-3's share again, not the dataset
    assert control.stats(socks["gpu-1"]).cluster.members == 2
    read_all(root, files, "data/")
    assert control.stats(socks["gpu-1"]).bytes_fetched == fetched["gpu-1"], json.dumps((
        control.call(socks["gpu-1"], {"op": "stats"})["cluster"], control.call(socks["gpu-2"], {"op": "stats"})["cluster"]))

    # gpu-1 lets go of what it read for gpu-2 (its window holds a share smaller than itself whole) and its
    # agent warms gpu-1's own share again, from the store.
    control.call(socks["gpu-1"], {"op": "drop"})
    share = two["gpu-1"]["shareBytes"]
    assert kube.wait_for(lambda: control.stats(socks["gpu-1"]).cache.bytes >= share, 60), (
        control.call(socks["gpu-1"], {"op": "stats"})["cache"], logs())
    held = control.stats(socks["gpu-1"])
    assert held.cache.bytes == share and held.bytes_fetched == fetched["gpu-1"] + share

    # gpu-2's mount is killed: reads on gpu-1 still return every byte, gpu-2's blocks from the store (or from
    # gpu-2 again once its node plugin has remounted it and it rejoined).
    os.kill(control.stats(socks["gpu-2"]).pid, signal.SIGKILL)
    read_all(root, files, "data/")
    after = control.stats(socks["gpu-1"])
    from_store = after.bytes_fetched - held.bytes_fetched
    from_peers = after.cluster.bytes_from_peers - held.cluster.bytes_from_peers
    assert from_store > 0 and from_store + from_peers >= total - share, (from_store, from_peers, total - share)
