"""The CSI conformance suite's node scenarios (csi-sanity's call order, paths and expectations:
tests/support/sanity.py) against a real `stoker csi --mode all` with its separate mounter, real FUSE mounts of
moto buckets made by CreateVolume: they pass with `--mount-root` at csi-sanity's directory, and without it the
paths are refused as the caller's mistake (INVALID_ARGUMENT naming the rule), with nothing mounted."""

from __future__ import annotations

import os

import grpc
import pytest

from tests.support.sanity import Sanity

from .conftest import SECRETS, Plugin, requires_fuse

pytestmark = [pytest.mark.integration, requires_fuse]


@pytest.fixture
def root(tmp_path):
    path = tmp_path / "orchestrator"  # csi-sanity's $TMPDIR (or Nomad's client data dir)
    path.mkdir()
    return str(path)


def start(tmp_path, *extra: str) -> Plugin:
    plugin = Plugin(tmp_path, mode="all", args=extra, mounter_args=extra)
    plugin.start()
    return plugin


def sanity_for(plugin: Plugin, root: str, s3, bucket: str, endpoint: str) -> Sanity:
    content = os.urandom(300_000)

    def read_back(volume, target):
        prefix = volume.volume_context["prefix"]
        s3.put_object(Bucket=bucket, Key=prefix + "data.bin", Body=content)
        with open(os.path.join(target, "data.bin"), "rb") as f:
            assert f.read() == content, "bytes read through the published target are the object's"

    parameters = {"bucket": bucket, "prefix": "sanity", "endpointUrl": endpoint, "region": "us-east-1",
                  "cacheSize": "256MiB"}
    return Sanity(plugin.node, plugin.controller, root, parameters, dict(SECRETS), on_published=read_back)


def test_the_conformance_node_scenarios_pass_at_a_mount_root(tmp_path, root, s3, bucket, moto_server):
    plugin = start(tmp_path, "--mount-root", root)
    try:
        sanity = sanity_for(plugin, root, s3, bucket, moto_server.endpoint)
        sanity.run(lambda: sanity.should_work("sanity-node-full-1"))
        sanity.run(lambda: sanity.should_work("sanity-node-full-2", count=2))  # "should be idempotent"
        sanity.run(lambda: sanity.unpublish_removes_target("sanity-node-unpublish-volume"))
        sanity.run(lambda: sanity.stats_elsewhere_is_not_found("sanity-node-get-volume-stats"))
        assert sanity.teardown_errors == [], "each test leaves its directories empty and unmounted"
        with open("/proc/self/mountinfo") as f:
            assert root not in f.read(), "nothing stays mounted below the orchestrator's directory"
    finally:
        plugin.stop()


def test_without_a_mount_root_those_paths_are_the_callers_mistake(tmp_path, root, s3, bucket, moto_server):
    plugin = start(tmp_path)
    try:
        sanity = sanity_for(plugin, root, s3, bucket, moto_server.endpoint)
        refusals = []

        def stage_and_publish():
            volume = sanity.create_volume("sanity-refused")
            for call in (lambda: sanity.stage(volume), lambda: sanity.publish(volume)):
                with pytest.raises(grpc.RpcError) as info:
                    call()
                refusals.append((info.value.code(), info.value.details()))

        sanity.run(stage_and_publish)
        for code, details in refusals:
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
            assert "outside this driver's paths" in details and "--mount-root" in details, details
        assert not os.path.exists(sanity.target)
        assert sanity.teardown_errors == []
    finally:
        plugin.stop()


def test_a_mount_root_must_be_a_plain_absolute_directory(tmp_path):
    import subprocess
    import sys

    for bad in ("relative/dir", "/", "/a/../b"):
        result = subprocess.run([sys.executable, "-m", "stoker", "csi-mounter", "--mount-root", bad],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and "--mount-root" in result.stderr, (bad, result.stderr)
