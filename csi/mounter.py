"""Who starts mount processes: this process, or a separate long-lived mounter reached over a socket.

Mount processes must outlive the CSI server. On a plain host `stoker mount` already detaches them
(own session), so a restarted or killed `stoker csi` leaves them serving. In Kubernetes a container
restart kills every process of the container, so the DaemonSet runs a second, rarely-changing
container, `stoker csi-mounter`, that owns the mount processes; the node plugin asks it over a unix
socket in a shared emptyDir. Upgrading or restarting the node plugin then leaves the mounts alone.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import subprocess
import sys
from typing import Protocol

from fusecore.config import ConfigError, parse_s3_url
from fusecore.mounts import NOT_READY_STATUS, detach_top, mount_fuse_fd, top_mount

log = logging.getLogger(__name__)

_CREDENTIAL_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


class MountFailed(RuntimeError):
    """`stoker mount` did not mount; the message says why (never a credential)."""


class MountNotReady(MountFailed):
    """The mount did not become ready in time (and nothing is left mounted)."""


class Mounter(Protocol):
    def start(self, argv: list[str], env: dict[str, str], timeout: float) -> None: ...
    def healthy(self) -> str | None: ...


def _check_argv(argv: list[str]) -> None:
    if not argv or argv[0] != "mount":
        raise MountFailed("the mounter only runs `stoker mount`")


class ProcessMounter:
    """Mounts /dev/fuse at the volume's path itself, then runs `stoker mount --fuse-fd` (detached,
    own session) to serve it.

    Mounting here, with mount(2), lets a new mount go on top of a dead one (libfuse's own mount
    stat()s the mount point first, which fails with ENOTCONN there): that is how a repaired mount
    reaches every bind of the old one and every container's view of them (see csi/volumes.py).
    """

    def start(self, argv: list[str], env: dict[str, str], timeout: float) -> None:
        _check_argv(argv)
        mountpoint = argv[2] if len(argv) > 2 else ""
        try:
            bucket, _ = parse_s3_url(argv[1] if len(argv) > 1 else "")
        except ConfigError as exc:
            raise MountFailed(str(exc)) from None
        try:
            fd = mount_fuse_fd(mountpoint, f"stoker:{bucket}", allow_other="--allow-other" in argv,
                               uid=os.getuid(), gid=os.getgid())
        except OSError as exc:
            raise MountFailed(f"cannot mount at {mountpoint}: {exc.strerror}") from None
        mounted = top_mount(mountpoint)
        try:
            self._serve(argv, fd, env, timeout)
        except MountFailed:
            if mounted is not None:  # never leave the mount of a process that did not start
                detach_top(mountpoint, mounted.device)
            raise
        finally:
            os.close(fd)  # the serving process holds it now: its death aborts the connection

    @staticmethod
    def _serve(argv: list[str], fd: int, env: dict[str, str], timeout: float) -> None:
        child_env = dict(os.environ)
        if env:  # keys from the volume's secret replace whatever this process has
            for var in _CREDENTIAL_VARS:
                child_env.pop(var, None)
            child_env.update(env)
        cmd = [sys.executable, "-m", "stoker", *argv, "--fuse-fd", str(fd), "--ready-timeout", str(timeout)]
        try:
            result = subprocess.run(cmd, env=child_env, capture_output=True, text=True, timeout=timeout + 30,
                                    stdin=subprocess.DEVNULL, pass_fds=(fd,))
        except subprocess.TimeoutExpired:
            raise MountNotReady(f"the mount did not become ready within {timeout:g}s") from None
        if result.returncode == NOT_READY_STATUS:
            raise MountNotReady(_reason(result.stderr))
        if result.returncode != 0:
            raise MountFailed(_reason(result.stderr))

    def healthy(self) -> str | None:
        return None


def _reason(stderr: str) -> str:
    lines = [line.removeprefix("stoker mount: ") for line in stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "stoker mount failed without a message"


class RemoteMounter:
    """Client of `stoker csi-mounter` (JSON lines over a unix socket)."""

    def __init__(self, path: str):
        self.path = path

    def _call(self, message: dict, timeout: float) -> dict:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(self.path)
            with sock, sock.makefile("rb") as reader:
                sock.sendall(json.dumps(message).encode() + b"\n")
                line = reader.readline()
        except OSError as exc:
            raise MountFailed(f"the mounter at {self.path} did not answer ({exc.strerror or exc})") from None
        if not line:
            raise MountFailed(f"the mounter at {self.path} closed the connection")
        return json.loads(line)

    def start(self, argv: list[str], env: dict[str, str], timeout: float) -> None:
        reply = self._call({"op": "mount", "argv": argv, "env": env, "timeout": timeout}, timeout + 60)
        if reply.get("error"):
            raise (MountNotReady if reply.get("not_ready") else MountFailed)(reply["error"])

    def healthy(self) -> str | None:
        try:
            self._call({"op": "ping"}, 5)
        except MountFailed as exc:
            return str(exc)
        return None


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        try:
            request = json.loads(self.rfile.readline())
            op = request.get("op")
            if op == "ping":
                reply: dict = {"ok": True}
            elif op == "mount":
                reply = self._mount(request)
            else:
                reply = {"error": f"unknown op {op!r}"}
        except (ValueError, AttributeError, TypeError):
            reply = {"error": "malformed request"}
        self.wfile.write(json.dumps(reply).encode() + b"\n")

    def _mount(self, request: dict) -> dict:
        argv = [str(a) for a in request.get("argv", [])]
        try:
            ProcessMounter().start(argv, {str(k): str(v) for k, v in request.get("env", {}).items()},
                                   float(request.get("timeout", 60)))
        except MountNotReady as exc:
            return {"error": str(exc), "not_ready": True}
        except MountFailed as exc:
            return {"error": str(exc)}
        log.info("mounted %s at %s", argv[1] if len(argv) > 1 else "?", argv[2] if len(argv) > 2 else "?")
        return {"ok": True}


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def serve_mounter(path: str) -> None:
    """Serve mount requests on `path` (mode 0600) until killed."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if os.path.exists(path):
        os.unlink(path)
    with _Server(path, _Handler) as server:
        os.chmod(path, 0o600)
        log.info("mounter listening on %s", path)
        server.serve_forever()
