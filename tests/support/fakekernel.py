"""A fake of the node's kernel mounts and mount processes, for fast tests of the volume lifecycle
(csi.kernel.MountTable and csi.mounter.Mounter in one object), by the rules the real ones follow:

- mounts stack: the last mount at a path is what a lookup reaches; unmounting a path removes its whole
  stack, and a FUSE mount's process ends when its last mount is gone;
- a bind of a path follows it: a mount stacked later on the source shows at every follower too
  (mount propagation, fusecore.process.mounts.bind_follower); unmounting a follower never touches the source;
- a mount process answers its control socket (stats, resize, credentials) until it is killed; a killed
  process leaves its mount in the table (a dead FUSE mount: ENOTCONN), as the kernel does.

The real ones are tested with real FUSE mounts and binds (tests/csi/test_node.py, test_kubelet.py).
"""

from __future__ import annotations

import os

from csi.mounter import MountRequest
from fusecore.process.mounts import MountInfo, top_mount
from stoker_bench.fakemount import FakeMountControl

STOKER_FS = "fuse.stoker"


class FakeKernel:
    def __init__(self) -> None:
        self.entries: list[MountInfo] = []
        self.followers: dict[str, str] = {}  # bind target -> its source
        self.processes: dict[str, FakeMountControl] = {}  # device -> the process serving it
        self.started: list[MountRequest] = []
        self._next = 1

    # ---- Mounter

    def start(self, request: MountRequest, timeout: float) -> None:
        cfg = request.config
        device = f"0:{1000 + self._next}"
        self.processes[device] = FakeMountControl(cfg.control_socket, cfg.cache_size)
        self.started.append(request)
        self._stack(cfg.mountpoint, device, STOKER_FS)

    # ---- MountTable

    def table(self) -> list[MountInfo]:
        return list(self.entries)

    def bind(self, source: str, target: str, read_only: bool = True) -> None:
        top = self.top(source)
        if top is None:
            raise FileNotFoundError(2, "nothing mounted at the source", source)
        self.followers[os.path.abspath(target)] = os.path.abspath(source)
        self._add(target, top.device, top.fs_type)

    def unmount(self, path: str) -> str | None:
        path = os.path.abspath(path)
        gone = {e.device for e in self.entries if e.point == path}
        self.entries = [e for e in self.entries if e.point != path]
        self.followers.pop(path, None)
        for device in gone - {e.device for e in self.entries}:  # its last mount went: the process ends
            process = self.processes.pop(device, None)
            if process is not None:
                process.kill()
        return None

    # ---- for tests

    def top(self, path: str) -> MountInfo | None:
        return top_mount(path, self.entries)

    def kill(self, path: str) -> None:
        """The mount process at `path` dies; its mount stays (a dead FUSE mount)."""
        self.processes[self.top(path).device].kill()

    def _stack(self, path: str, device: str, fs_type: str) -> None:
        """A new mount at `path`, propagated to every bind that follows it."""
        self._add(path, device, fs_type)
        for follower, source in list(self.followers.items()):
            if source == os.path.abspath(path):
                self._stack(follower, device, fs_type)

    def _add(self, path: str, device: str, fs_type: str) -> None:
        self._next += 1
        self.entries.append(MountInfo(self._next, 1, device, "/", os.path.abspath(path), fs_type, ()))
