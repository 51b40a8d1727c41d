"""The mounter runs mounts and nothing else: requests sent straight to a real `stoker csi-mounter` over its
socket, the way any process on the node could try. Each refusal is checked to have run nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile

import pytest

from csi.attributes import parse_volume_context
from csi.layout import kubelet_staging_path
from csi.mounter import MountRequest
from fusecore.process.mounts import is_mounted

from .conftest import SECRETS, Plugin, requires_fuse

pytestmark = [pytest.mark.integration, requires_fuse]


@pytest.fixture
def mounter(tmp_path, moto_server):
    plugin = Plugin(tmp_path)
    os.makedirs(os.path.join(plugin.state_dir, "run"), exist_ok=True)
    os.makedirs(os.path.join(plugin.state_dir, "logs"), exist_ok=True)
    plugin.start_mounter()
    yield plugin
    plugin.stop()


def ask(path: str, message) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(120)
        sock.connect(path)
        sock.sendall((message if isinstance(message, bytes) else json.dumps(message).encode()) + b"\n")
        return json.loads(sock.makefile("rb").readline())


def good_request(plugin: Plugin, bucket: str, endpoint: str, volume_id: str = "v1") -> dict:
    mountpoint = kubelet_staging_path(plugin.kubelet_dir, volume_id)
    os.makedirs(mountpoint, exist_ok=True)
    spec = parse_volume_context({"bucket": bucket, "endpointUrl": endpoint})
    from fusecore.config import Credentials

    cfg = spec.mount_config(mountpoint, os.path.join(plugin.state_dir, "run", f"{volume_id}.sock"),
                            credentials=Credentials(SECRETS["accessKeyId"], SECRETS["secretAccessKey"]))
    return MountRequest(cfg, os.path.join(plugin.state_dir, "logs", f"{volume_id}.log")).message(60)


def edited(message: dict, **config) -> dict:
    out = json.loads(json.dumps(message))
    out["config"].update(config)
    return out


def test_the_socket_is_private(mounter):
    mode = os.stat(mounter.mounter_socket).st_mode
    assert stat.S_ISSOCK(mode) and mode & 0o777 == 0o600


def test_requests_that_are_not_a_mount_document_run_nothing(mounter, moto_server, bucket, tmp_path):
    good = good_request(mounter, bucket, moto_server.endpoint)
    mountpoint = good["config"]["mountpoint"]
    marker = tmp_path / "ran"
    bad = {
        "an argv": {"op": "mount", "argv": ["mount", f"s3://{bucket}", mountpoint, "--log-file", str(marker)]},
        "an environment": dict(good, env={"LD_PRELOAD": str(tmp_path / "evil.so")}),
        "an unknown setting": edited(good, exec="/bin/sh"),
        "a mistyped setting": edited(good, cache_size="lots"),
        "a mount point outside kubelet's paths": edited(good, mountpoint=str(tmp_path)),
        "/etc": edited(good, mountpoint="/etc"),
        "a path with ..": edited(good, mountpoint=mountpoint + "/../../../../../../../../etc"),
        "a control socket elsewhere": edited(good, control_socket=str(tmp_path / "x.sock")),
        "a log file elsewhere": dict(good, log_file=str(marker)),
        "a metrics port": edited(good, metrics_port=9999),
        "the node's own credentials": dict(good, credentials=None),
        "a disk cache where this mounter has none": edited(good, disk_cache=str(tmp_path), disk_cache_size=1 << 30),
        "credentials with extra fields": dict(good, credentials=dict(good["credentials"], LD_PRELOAD="x")),
        "an unknown op": {"op": "exec", "cmd": ["/bin/true"]},
        "not JSON": b"mount everything please",
    }
    for what, message in bad.items():
        reply = ask(mounter.mounter_socket, message)
        assert reply.get("error") and reply.get("kind") == "refused", (what, reply)
    assert not is_mounted(mountpoint) and not marker.exists() and not is_mounted("/etc")
    assert os.listdir(os.path.join(mounter.state_dir, "logs")) == []  # no mount process ever started
    # The same document, untouched, mounts: the refusals above are about what was changed.
    assert ask(mounter.mounter_socket, good) == {"ok": True}
    assert is_mounted(mountpoint)


def test_callers_other_than_root_are_refused(mounter, tmp_path):
    # Let another user reach the socket (mode and a traversable path), to show the peer check behind it.
    os.chmod(mounter.mounter_socket, 0o666)
    public = tempfile.mkdtemp(prefix="stoker-peer-")
    os.chmod(public, 0o755)
    link = os.path.join(public, "mounter.sock")
    os.link(mounter.mounter_socket, link)
    # The mounter may refuse (write its answer and close) before the request is sent: a broken pipe on the
    # send is part of the refusal, and the answer is still there to read.
    code = ("import json, socket; s = socket.socket(socket.AF_UNIX); s.connect(%r)\n"
            "try:\n    s.sendall(b'{\"op\": \"ping\"}\\n')\nexcept BrokenPipeError:\n    pass\n"
            "print(s.makefile().readline())" % link)
    try:
        result = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                                 code], capture_output=True, text=True, timeout=60, cwd="/")
    finally:
        shutil.rmtree(public)
    assert result.returncode == 0, result.stderr
    reply = json.loads(result.stdout)
    assert reply["kind"] == "refused" and "uid 65534" in reply["error"]
    assert ask(mounter.mounter_socket, {"op": "ping"}) == {"ok": True}  # root still is


def test_a_mount_processes_error_keeps_its_kind_across_processes():
    """The serving process writes `ERR <kind> <message>`; the mounter turns it back into the same error
    type, so the CSI answer is NOT_FOUND or PERMISSION_DENIED rather than INTERNAL."""
    from csi.mounter import MountFailed, MountNotReady, _typed
    from fusecore.process.launch import LaunchFailed, NotReady, ready_line
    from fusecore.store.errors import AccessDenied, BucketNotFound

    line = ready_line(AccessDenied("bucket 'b': access denied (403)"))
    assert line == b"ERR access_denied bucket 'b': access denied (403)\n" and ready_line(None) == b"OK\n"
    kind, _, message = line.decode().strip()[4:].partition(" ")
    assert isinstance(_typed(LaunchFailed(message, kind)), AccessDenied)
    assert isinstance(_typed(LaunchFailed("bucket 'b': bucket does not exist", "no_bucket")), BucketNotFound)
    assert isinstance(_typed(NotReady("slow")), MountNotReady)
    assert type(_typed(LaunchFailed("cannot mount", "mount"))) is MountFailed
    assert ready_line(ValueError("cache-size: bad")).startswith(b"ERR config ")


def test_a_disk_cache_is_taken_only_directly_under_the_mounter_s_root(tmp_path):
    """--disk-cache-root: a mount's disk tier is a folder right under it, nothing else (unit: the rules)."""
    from csi.mounter import MountRefused, MountRules

    rules = MountRules(str(tmp_path / "kubelet"), str(tmp_path / "state"), allow_node_credentials=True,
                       disk_cache_root="/mnt/nvme/stoker")
    spec = parse_volume_context({"bucket": "data"})
    base = spec.mount_config(kubelet_staging_path(str(tmp_path / "kubelet"), "v1"),
                             str(tmp_path / "state" / "run" / "v1.sock"))
    log = str(tmp_path / "state" / "logs" / "v1.log")
    for where in ("/mnt/nvme/stoker/../../../etc", "/mnt/nvme/stoker", "/mnt/nvme/stoker/a/b", "/etc",
                  "/mnt/nvme/stokerx/a"):
        cfg = dataclasses.replace(base, disk_cache=where, disk_cache_size=1 << 30)
        with pytest.raises(MountRefused, match="disk cache"):
            rules.check(MountRequest(cfg, log))
    rules.check(MountRequest(dataclasses.replace(base, disk_cache="/mnt/nvme/stoker/0123abcd", disk_cache_size=1 << 30),
                             log))
