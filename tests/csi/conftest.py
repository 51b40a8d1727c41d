"""A real `stoker csi` node plugin (and its separate mounter) on a unix socket, and a gRPC client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import grpc
import pytest

from csi import csi_pb2 as pb
from csi import csi_pb2_grpc as rpc
from fusecore.process.launch import stop_process
from stoker.s3server import free_port
from tests.conftest import requires_fuse
from tests.support.waiting import unmount_everything_under
from tests.support.waiting import wait_for as wait_until

SECRETS = {"accessKeyId": "testing-key", "secretAccessKey": "testing-secret-DO-NOT-LOG"}
READ_ONLY_MANY = pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(),
                                     access_mode=pb.VolumeCapability.AccessMode(mode=3))


class Plugin:
    """`stoker csi-mounter` + `stoker csi --mounter-socket`, as the DaemonSet runs them."""

    def __init__(self, tmp_path, *, mode: str = "node", separate_mounter: bool = True, health_interval: float = 0.5,
                 kubelet_dir: str | None = None, own_namespaces: bool = False, args: tuple[str, ...] = (),
                 mounter_args: tuple[str, ...] = (), env: dict[str, str] | None = None):
        self.tmp_path = tmp_path
        self.kubelet_dir = kubelet_dir or str(tmp_path / "kubelet")
        # Each process in its own mount namespace whose kubelet dir is a peer of ours: what the
        # DaemonSet's containers get with mountPropagation: Bidirectional (containerd makes their
        # root rshared then).
        self.prefix = ["unshare", "--mount", "--propagation", "unchanged"] if own_namespaces else []
        self.health_interval = health_interval
        self.mode = mode
        self.separate_mounter = separate_mounter
        self.state_dir = str(tmp_path / "state")
        self.secrets_dir = str(tmp_path / "secrets")
        self.args = list(args)
        self.env = dict(os.environ, **(env or {}))
        self.mounter_args = list(mounter_args)
        self.socket = str(tmp_path / "csi.sock")
        self.mounter_socket = str(tmp_path / "mounter.sock")
        self.log_path = tmp_path / "csi.log"
        self.metrics_port = free_port()
        self.health_port = free_port()
        self.mounter = None
        self.server = None
        self.channel = None

    def start_mounter(self) -> None:
        log = open(self.tmp_path / "mounter.log", "ab")
        self.mounter = subprocess.Popen([*self.prefix, sys.executable, "-m", "stoker", "csi-mounter", "--socket",
                                         self.mounter_socket, "--state-dir", self.state_dir, "--kubelet-dir",
                                         self.kubelet_dir, *self.mounter_args], stdout=log, stderr=log, env=self.env)
        assert wait_until(lambda: os.path.exists(self.mounter_socket), 30), "mounter did not start"

    def start(self) -> None:
        if self.mode != "controller" and self.separate_mounter and self.mounter is None:
            self.start_mounter()
        if os.path.exists(self.socket):
            os.unlink(self.socket)
        log = open(self.log_path, "ab")
        argv = [*self.prefix, sys.executable, "-m", "stoker", "csi", "--endpoint", f"unix://{self.socket}", "--node-id",
                "node-a", "--mode", self.mode, "--state-dir", self.state_dir, "--health-interval", str(self.health_interval),
                "--kubelet-dir", self.kubelet_dir, "--health-port", str(self.health_port), "--health-addr", "127.0.0.1",
                "--mount-timeout", "60", "--metrics-port", str(self.metrics_port), "--metrics-addr", "127.0.0.1",
                "--secrets-dir", self.secrets_dir, *self.args]
        if self.mode != "controller" and self.separate_mounter:
            argv += ["--mounter-socket", self.mounter_socket]
        self.server = subprocess.Popen(argv, stdout=log, stderr=log, env=self.env)
        assert wait_until(lambda: os.path.exists(self.socket), 30), self.log()
        self.channel = grpc.insecure_channel(f"unix://{self.socket}")
        grpc.channel_ready_future(self.channel).result(timeout=30)

    def staging(self, volume_id: str) -> str:
        """Where kubelet stages `volume_id` (the directory exists, as kubelet makes it)."""
        from csi.layout import kubelet_staging_path

        path = kubelet_staging_path(self.kubelet_dir, volume_id)
        os.makedirs(path, exist_ok=True)
        return path

    def target(self, pod: str, volume: str = "data") -> str:
        """A pod's target path for a CSI volume (its parent exists, as kubelet makes it)."""
        path = os.path.join(self.kubelet_dir, "pods", pod, "volumes", "kubernetes.io~csi", volume, "mount")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path

    def kill_server(self) -> None:
        self.server.send_signal(signal.SIGKILL)
        self.server.wait()
        self.channel.close()

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    @property
    def identity(self):
        return rpc.IdentityStub(self.channel)

    @property
    def node(self):
        return rpc.NodeStub(self.channel)

    @property
    def controller(self):
        return rpc.ControllerStub(self.channel)

    def stop(self) -> None:
        for proc in (self.server, self.mounter):
            stop_process(proc)
        if self.channel is not None:
            self.channel.close()
        unmount_everything_under(str(self.tmp_path))


@pytest.fixture
def plugin(tmp_path, moto_server):
    p = Plugin(tmp_path)
    p.start()
    yield p
    p.stop()


@pytest.fixture
def local_plugin(tmp_path, moto_server):
    """The plain-host arrangement: `stoker csi` starts the (detached) mount processes itself."""
    p = Plugin(tmp_path, separate_mounter=False)
    p.start()
    yield p
    p.stop()


@pytest.fixture
def slow_repair_plugin(tmp_path, moto_server):
    """A plugin whose repair loop practically never runs, to observe a broken volume."""
    p = Plugin(tmp_path, health_interval=3600)
    p.start()
    yield p
    p.stop()


@pytest.fixture
def controller_plugin(tmp_path, moto_server):
    p = Plugin(tmp_path, mode="controller")
    p.start()
    yield p
    p.stop()


def volume_context(bucket: str, endpoint: str, **extra: str) -> dict[str, str]:
    return {"bucket": bucket, "endpointUrl": endpoint, "region": "us-east-1", **extra}


__all__ = ["Plugin", "READ_ONLY_MANY", "SECRETS", "requires_fuse", "volume_context", "wait_until"]


def make_volumes(tmp_path, mounter=None, *, kubelet_dir: str | None = None, policy=None, **kw):
    """A VolumeManager in this process, with its state, secrets and mount rules under `tmp_path`."""
    from csi.auth import AuthPolicy
    from csi.mounter import MountRules, ProcessMounter
    from csi.state import SecretStore, StateDir
    from csi.volumes import VolumeManager

    kubelet_dir = kubelet_dir or str(tmp_path / "kubelet")
    state = StateDir(str(tmp_path / "state"))
    mounter = mounter or ProcessMounter(MountRules(kubelet_dir, state.root))
    return VolumeManager(state, mounter, secrets=SecretStore(str(tmp_path / "secrets")), policy=policy or AuthPolicy(),
                         kubelet_dir=kubelet_dir, **kw)
