"""A fake of the node's kernel mounts and mount processes, for fast tests of the volume lifecycle
(csi.kernel.MountTable and csi.mounter.Mounter in one object), by the rules the real ones follow:

- mounts stack: the last mount at a path is what a lookup reaches; unmounting a path removes its whole
  stack, and a FUSE mount's process ends when its last mount is gone;
- a bind of a path follows it: a mount stacked later on the source shows at every follower too
  (mount propagation, fusecore.mounts.bind_follower); unmounting a follower never touches the source;
- a mount process answers its control socket (stats, resize, credentials) until it is killed; a killed
  process leaves its mount in the table (a dead FUSE mount: ENOTCONN), as the kernel does.

The real ones are tested with real FUSE mounts and binds (tests/csi/test_node.py, test_kubelet.py).
"""

from __future__ import annotations

import json
import os
import socket
import threading

from csi.mounter import MountRequest
from fusecore.mounts import MountInfo

STOKER_FS = "fuse.stoker"


def stats_reply(budget: int, cached: int = 0) -> dict:
    """A `stats` reply of the shape fusecore.messages.MountStats reads (what a real mount sends, trimmed)."""
    return {"pid": os.getpid(), "cache": {"bytes": cached, "budget": budget, "entries": 0, "hits": 0, "misses": 0,
                                          "hit_ratio": 0.0},
            "requests": {"get": 0}, "bytes_fetched": 0, "bytes_served": {"cache": 0, "network": 0},
            "inflight": {"requests": 0, "bytes": 0}}


class FakeMountProcess:
    """A mount process's control socket: stats, resize and credentials, as `stoker serve-mount` answers."""

    def __init__(self, path: str, cache_size: int):
        self.path, self.budget, self.rotations = path, cache_size, 0
        if os.path.exists(path):
            os.unlink(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(16)
        self.alive = True
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn, conn.makefile("rwb") as f:
                request = json.loads(f.readline())
                if request["op"] == "resize":
                    self.budget = int(request["cache_size"])
                elif request["op"] == "credentials":
                    self.rotations += 1
                f.write(json.dumps(stats_reply(self.budget)).encode() + b"\n")

    def kill(self) -> None:
        self.alive = False
        self.sock.close()
        if os.path.exists(self.path):
            os.unlink(self.path)


class FakeKernel:
    def __init__(self) -> None:
        self.entries: list[MountInfo] = []
        self.followers: dict[str, str] = {}  # bind target -> its source
        self.processes: dict[str, FakeMountProcess] = {}  # device -> the process serving it
        self.started: list[MountRequest] = []
        self._next = 1

    # ---- Mounter

    def start(self, request: MountRequest, timeout: float) -> None:
        cfg = request.config
        device = f"0:{1000 + self._next}"
        self.processes[device] = FakeMountProcess(cfg.control_socket, cfg.cache_size)
        self.started.append(request)
        self._stack(cfg.mountpoint, device, STOKER_FS)

    # ---- MountTable

    def table(self) -> list[MountInfo]:
        return list(self.entries)

    def bind(self, source: str, target: str) -> None:
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
        found = None
        for entry in self.entries:
            if entry.point == os.path.abspath(path):
                found = entry
        return found

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
