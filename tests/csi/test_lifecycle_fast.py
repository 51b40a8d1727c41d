"""The volume lifecycle (stage, publish, repair, hold, unpublish, unstage) through VolumeManager with the
kernel and the mount processes faked by their rules (tests/support/fakekernel.py): fast, no root, no
FUSE. The same lifecycles run with real mounts in test_node.py and through kubelet's rules in
test_kubelet.py."""

from __future__ import annotations

import os

import pytest

from csi.errors import Conflict, NodeFull, NotStaged
from csi.layout import kubelet_staging_path
from tests.support.fakekernel import STOKER_FS, FakeKernel

from .conftest import SECRETS, make_volumes

MiB = 1024**2
CONTEXT = {"bucket": "data", "endpointUrl": "http://127.0.0.1:9", "region": "us-east-1", "cacheSize": "256MiB"}


@pytest.fixture
def kernel():
    return FakeKernel()


@pytest.fixture
def volumes(tmp_path, kernel):
    return make_volumes(tmp_path, kernel, mounts=kernel, check_store=False, node_cache_memory=1024 * MiB)


def paths(tmp_path):
    staging = kubelet_staging_path(str(tmp_path / "kubelet"), "pv-1")
    pods = [str(tmp_path / "kubelet" / "pods" / uid / "volumes" / "kubernetes.io~csi" / "pv-1" / "mount")
            for uid in ("a", "b")]
    return staging, pods


def test_stage_publish_unpublish_unstage(tmp_path, volumes, kernel):
    staging, (one, two) = paths(tmp_path)
    volumes.stage("pv-1", staging, CONTEXT, SECRETS)
    assert kernel.top(staging).fs_type == STOKER_FS and len(kernel.started) == 1
    assert kernel.started[0].config.cache_size == 256 * MiB
    volumes.publish("pv-1", staging, one, "ro", CONTEXT, {})
    volumes.publish("pv-1", staging, two, "ro", CONTEXT, {})
    volumes.publish("pv-1", staging, two, "ro", CONTEXT, {})  # kubelet's republish: idempotent
    assert kernel.top(one).device == kernel.top(two).device == kernel.top(staging).device
    assert len(kernel.started) == 1  # one mount process per volume per node
    with pytest.raises(Conflict):
        volumes.publish("pv-1", staging, two, "rw", CONTEXT, {})  # another capability at the same target
    with pytest.raises(NotStaged):
        volumes.unstage("pv-1", staging)  # still published
    volumes.unpublish("pv-1", one)
    assert kernel.top(one) is None and kernel.top(staging) is not None
    volumes.unpublish("pv-1", two)
    volumes.unstage("pv-1", staging)
    assert kernel.entries == [] and kernel.processes == {} and volumes.state.load("pv-1") is None


def test_a_dead_mount_is_repaired_on_top_and_reaches_every_target(tmp_path, volumes, kernel):
    staging, (one, two) = paths(tmp_path)
    volumes.stage("pv-1", staging, CONTEXT, SECRETS)
    volumes.publish("pv-1", staging, one, "ro", CONTEXT, {})
    volumes.publish("pv-1", staging, two, "ro", CONTEXT, {})
    dead = kernel.top(staging).device
    kernel.kill(staging)
    assert volumes.health(volumes.state.load("pv-1")).abnormal
    assert volumes.check_all() == ["pv-1"]
    new = kernel.top(staging).device
    assert new != dead and kernel.top(one).device == kernel.top(two).device == new  # propagated, not re-bound
    assert len(kernel.started) == 2 and not volumes.health(volumes.state.load("pv-1")).abnormal
    assert volumes.check_all() == []  # healthy: nothing to do


def test_a_hold_keeps_the_mount_after_the_last_pod_and_release_stops_it(tmp_path, volumes, kernel):
    staging, (one, _) = paths(tmp_path)
    sock = volumes.hold("pv-1", CONTEXT, SECRETS, "ml/imagenet", 512 * MiB)
    assert kernel.top(staging) is not None  # mounted where kubelet will stage it
    assert kernel.processes[kernel.top(staging).device].path == sock
    volumes.stage("pv-1", staging, CONTEXT, SECRETS)  # the first pod finds it mounted, warm
    volumes.publish("pv-1", staging, one, "ro", CONTEXT, {})
    assert len(kernel.started) == 1
    volumes.unpublish("pv-1", one)
    volumes.unstage("pv-1", staging)
    assert kernel.top(staging) is not None  # still held
    volumes.release("pv-1", "ml/imagenet")
    assert kernel.entries == [] and volumes.state.load("pv-1") is None


def test_the_node_budget_refuses_what_does_not_fit(tmp_path, volumes, kernel):
    staging, _ = paths(tmp_path)
    volumes.hold("pv-1", CONTEXT, SECRETS, "ml/a", 768 * MiB)
    other = kubelet_staging_path(str(tmp_path / "kubelet"), "pv-2")
    with pytest.raises(NodeFull, match="pv-1"):
        volumes.stage("pv-2", other, dict(CONTEXT, bucket="other", cacheSize="300MiB"), SECRETS)  # 768 + 300 > 1024
    assert kernel.top(other) is None and len(kernel.started) == 1  # nothing mounted for the refused volume


def test_a_path_someone_else_mounted_is_not_taken(tmp_path, volumes, kernel):
    staging, (one, _) = paths(tmp_path)
    kernel._add(staging, "8:1", "ext4")  # not ours
    with pytest.raises(Conflict, match="already a mount point"):
        volumes.stage("pv-1", staging, CONTEXT, SECRETS)
    assert kernel.started == [] and os.path.abspath(staging) in {e.point for e in kernel.entries}
